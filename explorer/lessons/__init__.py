"""The lessons wing: lesson files for the classroom (``lesson``), recording and timing them on a real pair
(``record``), a step told in phases (``phases``), the race against plain decoding and the speedup curve (``race``),
teach mode's plain-language account of a step (``teach``), and a lesson or any run as one HTML page that plays in
any browser (``player``, with its page ``player.html``). Everything but ``record`` reads traces only, no torch."""

"""The command line (top floor): ``python -m explorer`` and its subcommands (``main``), the options they share
(``args``), and the subcommands of the decision tools (``decision``) and the instruments (``instruments``)."""

"""The project's own methods added since plugins exist, registered through ``explorer.plugins`` like anyone's
(``loading.load_bundled`` loads them in every tool, ``--no-plugins`` included): SpecTr's K-SEQ verifier
(``spectr``), RSD-S's stochastic beam tree (``rsd-s``) and PEARL's parallel drafting (``pearl``)."""

BUNDLED = ("explorer.plugins.bundled.spectr", "explorer.plugins.bundled.rsd", "explorer.plugins.bundled.pearl")
"""The modules ``loading.load_bundled`` imports, in order."""

"""The project's own methods added since plugins exist, registered through ``explorer.plugins`` like anyone's
(``loading.load_bundled`` loads them in every tool, ``--no-plugins`` included): SpecTr's K-SEQ verifier
(``spectr``) and RSD-S's stochastic beam tree (``rsd-s``)."""

BUNDLED = ("explorer.plugins.bundled.spectr", "explorer.plugins.bundled.rsd")
"""The modules ``loading.load_bundled`` imports, in order."""

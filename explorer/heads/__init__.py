"""Draft heads trained here: the target's features computed once and cached (``data``), an EAGLE-3 head trained
on them with training-time test (``train``), saved in the checkpoint format vLLM and SGLang load
(``models/eagle3.py``). ``python -m explorer heads train`` runs both (``cli/heads.py``)."""

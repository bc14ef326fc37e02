"""Learning a head online on a stream of prompts (``engine/online_distill.py``): the runs one after the other, the
head learning between them (``learn_stream``); the head's first-position acceptance is
``trace.metrics.first_acceptance``. The stream experiment, its prompts and the held-out prompts of every kind, is
``heads/online.py``; lesson 10 learns its head with ``learn_stream``.
"""

from __future__ import annotations

from ..engine.config import MethodConfig
from ..engine.factory import build_engine
from ..engine.sampling import SamplingConfig
from .prompts import encode_prompt


def learn_stream(pair, texts: list[str], config: MethodConfig, sampling: SamplingConfig, max_new_tokens: int,
                 distiller=None, progress=lambda n, engine, trace: None):
    """Run ``texts`` one after the other with ``config`` (``online_distill`` on), the head learning between them;
    ``progress(n, engine, trace)`` after each. Returns the ``HeadDistiller`` (``distiller``, or a new one)."""
    for n, text in enumerate(texts, 1):
        engine = build_engine(pair, config, sampling, distiller=distiller)
        engine.start(encode_prompt(pair.tokenizer, text, chat_template=True), max_new_tokens, prompt_text=text)
        trace = engine.run()
        distiller = engine.parts.distiller
        progress(n, engine, trace)
    return distiller

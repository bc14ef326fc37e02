"""Every method on every numeric path the ``auto`` settings can pick on some CPU: float32 with packed weights and an
int8 draft (a CPU without native bf16), bf16 with an int8 draft (AVX-512-BF16), and stock float32 (the tiny pair's
own defaults). Each method in ``DEFAULTS`` runs greedy on the tiny pair under each and gives ``ar``'s tokens on the
same models; the EAGLE head (a random one, saved and loaded as ``--head DIR``) and the head commands read a packed
target's output embedding."""

import pytest
import torch

from explorer.engine.config import DEFAULTS
from explorer.engine.factory import build_engine
from explorer.engine.sampling import SamplingConfig
from explorer.models.eagle3 import HeadConfig, random_head, save_head
from explorer.models.loading import pack_weights, quantize_draft
from explorer.models.tiny import tiny_pair

# (dtype, draft quantization, packed weights): what load_named_pair's auto settings give a real pair on a CPU
PATHS = {
    "fp32-int8-packed": (torch.float32, "int8", "on"),
    "bf16-int8": (torch.bfloat16, "int8", "off"),
    "fp32-stock": (torch.float32, "none", "off"),
}
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
NEW_TOKENS = 20


def _pair(path: str):
    dtype, quant, packed = PATHS[path]
    if packed == "on" and not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch has no oneDNN: nothing is packed here")
    pair = pack_weights(quantize_draft(tiny_pair(seed=0, dtype=dtype), quant, consume=True), packed)
    assert pair.packed_weights == (packed == "on") and pair.draft_quant == quant
    return pair


def _head(pair, folder):
    t = pair.target.config
    config = HeadConfig(hidden_size=t.hidden_size, intermediate_size=96, num_attention_heads=t.num_attention_heads,
                        num_key_value_heads=t.num_key_value_heads, head_dim=t.hidden_size // t.num_attention_heads,
                        vocab_size=t.vocab_size, draft_vocab_size=64, rope_theta=10000.0, aux_layer_ids=(0, 1, 2))
    return save_head(random_head(config, seed=1, draft_ids=list(range(32, 96))), folder)


@pytest.mark.parametrize("path", list(PATHS))
def test_every_method_keeps_ars_greedy_tokens_on_every_numeric_path(path, tmp_path):
    pair = _pair(path)
    head = str(_head(pair, tmp_path / "head"))
    ids = pair.tokenizer.encode(PROMPT)
    greedy = SamplingConfig(temperature=0.0)
    runs = {}
    for method, config in DEFAULTS.items():
        changes = {"fallback": "off"}  # timing-driven plain steps are not what this checks
        if config.spec.uses_head:
            changes["head"] = head
        engine = build_engine(pair, config.with_(**changes), greedy)
        engine.start(ids, NEW_TOKENS)
        trace = engine.run()
        runs[method] = trace.generated_ids
        assert trace.model["packed_weights"] is pair.packed_weights, method
    assert len(runs["ar"]) == NEW_TOKENS
    differ = {m: ids for m, ids in runs.items() if ids != runs["ar"]}
    assert not differ, f"{path}: greedy tokens differ from ar's {runs['ar']}: {differ}"


def test_the_head_commands_read_a_packed_targets_output_rows(tmp_path):
    """The head's fit check and its start from the target (``heads train --init``'s ``init_from_target``, the
    vocabulary swap) read the target's output embedding; packing keeps it readable, the same rows as stock."""
    from explorer.heads.train import init_from_target, set_draft_vocabulary
    from explorer.models.eagle3 import check_fit, load_head

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch has no oneDNN: nothing is packed here")
    stock, packed = tiny_pair(seed=0), pack_weights(tiny_pair(seed=0), "on")
    out = packed.target.get_output_embeddings()
    assert type(out).__name__ == "PackedLinear" and torch.equal(out.weight, stock.target.lm_head.weight)
    folder = _head(packed, tmp_path / "head")
    head = load_head(folder)
    check_fit(head.config, packed.target)
    ids = list(range(40, 104))
    init_from_target(head, packed.target, ids)
    assert torch.equal(head.lm_head.weight, stock.target.lm_head.weight[ids])
    set_draft_vocabulary(head, packed.target, list(range(50, 114)))
    assert torch.equal(head.lm_head.weight[-10:], stock.target.lm_head.weight[104:114])

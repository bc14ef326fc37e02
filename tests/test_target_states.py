"""The seam a drafter that reads the target's hidden states plugs into (as EAGLE-style draft heads do): the
verification forward returns the named layers' states at the committed rows it read, and the prefill those of the
prompt, with no second target forward; checked against a plain forward of the same tokens."""

import pytest
import torch

from explorer.engine.config import DEFAULTS
from explorer.engine.drafters.base import Drafter, FreeNode
from explorer.engine.factory import build_parts
from explorer.engine.machine import Engine
from explorer.engine.sampling import SamplingConfig

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):"
GREEDY = SamplingConfig(temperature=0.0)


class StateReader(Drafter):
    """A test drafter: proposes the next tokens of a known continuation as a chain with a wrong first sibling (so
    the accepted path skips a row), and keeps every target state it is handed, by position."""

    name = "state-reader"

    def __init__(self, layers: tuple[int, ...], continuation: list[int], n_prompt: int):
        self.target_layers = layers
        self.continuation, self.n_prompt = continuation, n_prompt
        self.states: dict[int, torch.Tensor] = {}  # position -> (len(layers), hidden_size)

    def start(self, view) -> None:
        if view.target_states is not None:
            self._keep(0, view.target_states)

    def free_nodes(self, view) -> list[FreeNode]:
        at = len(view.committed) - self.n_prompt  # the next token is continuation[at]
        if at >= len(self.continuation):
            return []
        wrong = FreeNode(parent=-1, token=(self.continuation[at] + 1) % 250, source="lookup", provenance={})
        chain = [FreeNode(parent=j, token=tok, source="lookup", provenance={})
                 for j, tok in enumerate(self.continuation[at: at + 4], start=0)]
        for j, node in enumerate(chain):  # parents index the list below: the wrong root is first
            node.parent = -1 if j == 0 else j
        return [wrong] + chain

    def observe(self, step) -> None:
        v = step.verified
        assert v.calls == 1  # one target forward a step: the states came with the verification
        if v.target_states is not None:
            rows = v.target_states
            assert rows.shape[:2] == (len(step.context) - v.states_start + len(v.result.path), len(self.target_layers))
            self._keep(v.states_start, rows)

    def _keep(self, start: int, rows: torch.Tensor) -> None:
        for j, row in enumerate(rows):
            self.states[start + j] = row.float().clone()


@pytest.mark.parametrize("kv_cache,graphs,joint", [("dynamic", False, False), ("static", False, False),
                                                   ("static", True, False), ("dynamic", False, True)])
def test_a_drafter_reads_the_target_layers_it_names_from_the_verification_forward(tiny, kv_cache, graphs, joint):
    _check_states(tiny, kv_cache, graphs, joint)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_states_come_out_of_the_target_graphs_on_cuda(tiny_cuda):
    tiny_cuda.graph_runners.clear()  # fresh runners: the target's buckets are captured with the named layers
    _check_states(tiny_cuda, "static", True, False, capture=True)


def _check_states(pair, kv_cache: str, graphs: bool, joint: bool, capture: bool = False) -> None:
    """Run the state reader on ``pair`` and compare every committed row's states with a plain forward."""
    ids = pair.tokenizer.encode(PROMPT)
    layers = (0, 1, pair.target.config.num_hidden_layers)  # the embeddings, the input of layer 1, the final norm's
    plain = Engine(pair, DEFAULTS["ar"], GREEDY, build_parts(pair, DEFAULTS["ar"], GREEDY))
    plain.start(ids, 24)
    continuation = plain.run().generated_ids
    parts = build_parts(pair, DEFAULTS["prompt-lookup"], GREEDY)
    reader = parts.drafter = StateReader(layers, continuation, len(ids))
    eng = Engine(pair, DEFAULTS["prompt-lookup"], GREEDY, parts, kv_cache=kv_cache, graphs=graphs,
                 joint_prefill=joint)
    eng.start(ids, 24)
    if capture:
        assert eng.capture_graphs() > 0
    trace = eng.run()
    eng.release()
    assert trace.generated_ids == continuation  # lossless, and the wrong siblings were rejected
    assert sum(s.target_calls for s in trace.steps) == len(trace.steps)
    assert all(sum(1 for seg in s.timeline if seg["phase"] == "target forward") == 1 for s in trace.steps)
    assert any(len(s.committed_ids) > 1 for s in trace.steps)  # paths were accepted past the skipped sibling
    committed = eng.state.committed
    fed = len(committed) - 1  # every committed token but the last bonus token was read by the target
    assert set(range(fed)) <= set(reader.states)
    with torch.inference_mode():
        ref = pair.target(input_ids=torch.tensor([committed[:fed]], device=pair.device),
                          output_hidden_states=True).hidden_states
    for pos in range(fed):
        want = torch.stack([ref[i][0, pos] for i in layers]).float()
        assert torch.allclose(reader.states[pos], want, atol=2e-4, rtol=1e-3), \
            (pos, float((reader.states[pos] - want).abs().max()))


def test_no_layer_named_no_states(tiny):
    """A drafter that names no layer gets none (and its forwards are the plain ones)."""
    eng = Engine(tiny, DEFAULTS["sd"], GREEDY, build_parts(tiny, DEFAULTS["sd"], GREEDY))
    eng.start(tiny.tokenizer.encode(PROMPT), 6)
    eng.step()
    assert eng.last_step[1].target_states is None

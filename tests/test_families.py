"""Any model pair, by default: tiny random pairs of nine transformers families (built from configs, no download)
load as custom pairs and run every method at its default settings token for token like transformers' greedy
``generate``; a tree method passes the audit at T = 1 on two of them; a pair without a decision model of its own
borrows the embedded pair's (transferred, adapting online) or gets one calibrated for it."""

import json

import pytest
import torch

from method_grid import AUDIT_SAMPLES
from explorer.analysis.audit import audit
from explorer.cli.main import main
from explorer.engine.config import DEFAULTS, MethodConfig
from explorer.engine.factory import TRANSFER_ADAPT, build_engine
from explorer.engine.sampling import SamplingConfig
from explorer.heads.train import head_config
from explorer.models.eagle3 import default_aux_layers, random_head, save_head
from explorer.models.loading import load_named_pair
from explorer.models.tiny import FAMILIES, save_pair, tiny_family_pair

# 70 bytes: longer than the 16-position windows of the Mistral and Gemma pairs, so their sliding layers matter
PROMPT = "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * "
NEW_TOKENS = 24


def head_for_target(pair, folder) -> str:
    """A random EAGLE-3 head shaped for ``pair``'s target, saved in ``folder`` (what ``--head`` takes)."""
    layers = default_aux_layers(pair.target.config.num_hidden_layers)
    head = random_head(head_config(pair.target, layers, draft_vocab=64), seed=3)
    return str(save_head(head, folder))


def reference(pair, ids: list[int]) -> list[int]:
    """transformers' greedy ``generate`` on the target alone."""
    out = pair.target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """Each family's tiny pair saved as two Hugging Face folders (what a user points --draft / --target at)."""
    root = tmp_path_factory.mktemp("families")
    return {family: save_pair(tiny_family_pair(family), root / family) for family in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_method_at_its_defaults_equals_generate_on_each_family(family, family_dirs, tmp_path, capsys):
    draft, target = family_dirs[family]
    trace_dir = tmp_path / "traces"
    rc = main(["generate", "--draft", draft, "--target", target, "--prompt", PROMPT, "--no-chat-template",
               "--max-new-tokens", str(NEW_TOKENS), "--save-trace", str(trace_dir)])
    assert rc == 0, capsys.readouterr().err
    pair = load_named_pair("custom", draft=draft, target=target)  # as the CLI loaded it (int8 draft, packed)
    ids = pair.tokenizer.encode(PROMPT)
    expected = reference(pair, ids)
    [saved] = [json.loads(p.read_text()) for p in trace_dir.glob("*.json")]
    assert saved["settings"]["method"]["method"] == "mcsd-improved"  # the default method, no stop option given
    assert saved["settings"]["decision_model"]["how"] == "transferred"
    generated = [t for step in saved["steps"] for t in step["committed_ids"]]
    assert generated == expected, "the CLI's default run differs from generate"
    for name, config in DEFAULTS.items():
        if config.spec.uses_head:  # no head is shipped for a random target: one shaped for it
            config = config.with_(head=head_for_target(pair, tmp_path / "head"))
        engine = build_engine(pair, config, SamplingConfig(temperature=0.0))
        engine.start(ids, NEW_TOKENS)
        engine.run()
        assert engine.state.committed[len(ids):] == expected, f"{name} differs from generate on {family}"


def test_a_sliding_window_model_loads_with_eager_attention_where_sdpa_is_missing(family_dirs):
    """transformers has no SDPA attention for Gemma 2 (its logit soft-capping): the loader falls back to eager."""
    pair = load_named_pair("custom", draft=family_dirs["gemma2"][0], target=family_dirs["gemma2"][1])
    assert pair.target.config._attn_implementation == "eager"
    assert pair.target.config.attn_logit_softcapping  # the capping the eager path applies


def test_the_window_is_what_makes_long_prompts_exact(monkeypatch):
    """Without the window in the tree mask, the sliding layers see keys generate never shows them: the check above
    would fail. (Guards the test itself: the window must matter on this prompt.)"""
    import explorer.engine.attention as attention

    pair = tiny_family_pair("mistral")
    ids = pair.tokenizer.encode(PROMPT)
    expected = reference(pair, ids)
    monkeypatch.setattr(attention, "sliding_window", lambda model: None)
    engine = build_engine(pair, DEFAULTS["mcsd"], SamplingConfig(temperature=0.0))
    engine.start(ids, NEW_TOKENS)
    engine.run()
    assert engine.state.committed[len(ids):] != expected


def test_greedy_check_covers_every_lossless_method_on_a_custom_pair(family_dirs, capsys):
    draft, target = family_dirs["qwen3"]
    rc = main(["greedy-check", "--draft", draft, "--target", target, "--prompt", PROMPT, "--no-chat-template",
               "--max-new-tokens", "16"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    summary = lines[-1]["summary"]
    assert rc == 0 and "mcsd-improved" in summary and "hybrid" in summary
    assert all(t["other"] == 0 for t in summary.values()), summary


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_the_default_tree_method_passes_the_audit_on_a_windowed_family(family):
    pair = tiny_family_pair(family)
    ids = pair.tokenizer.encode(PROMPT[:40])  # past the window of 16
    config = DEFAULTS["mcsd-improved"].with_(fallback="off")  # every sample drafts a tree
    r = audit(pair, config, SamplingConfig(temperature=1.0, seed=31_000), ids, AUDIT_SAMPLES)
    assert r.first.p_value > 0.001 and r.pairs.p_value > 0.001, (r.first.p_value, r.pairs.p_value)
    assert len(r.first.exact) >= 4  # enough tested categories for the test to have power


@pytest.mark.parametrize("family, config", [
    ("gemma2", MethodConfig(method="mcsd", k_config=(3, 1), verifier="spectr", fallback="off")),
    ("mistral", MethodConfig(method="rsd-s", k_config=(3, 1, 1), fallback="off")),
    ("gemma2", MethodConfig(method="pearl", gamma=3)),
], ids=["spectr-gemma2", "rsd-s-mistral", "pearl-gemma2"])
def test_the_bundled_multi_draft_rules_pass_the_audit_on_a_windowed_family(family, config):
    """SpecTr's K-SEQ, RSD-S's beam tree and PEARL's carried drafts (explorer/plugins/bundled/) on another family's
    pair, past its window."""
    pair = tiny_family_pair(family)
    ids = pair.tokenizer.encode(PROMPT[:40])
    r = audit(pair, config, SamplingConfig(temperature=1.0, seed=32_000), ids, AUDIT_SAMPLES)
    assert r.first.p_value > 0.001 and r.pairs.p_value > 0.001, (r.first.p_value, r.pairs.p_value)
    assert len(r.first.exact) >= 4


def test_a_pair_without_its_own_decision_model_borrows_the_embedded_one_and_adapts():
    pair = tiny_family_pair("llama")
    engine = build_engine(pair, DEFAULTS["mcsd-improved"], SamplingConfig(temperature=0.0))
    assert engine.parts.decision_model.source["how"] == "transferred"
    assert "embedded" in engine.parts.decision_model.source["trained_on"]
    assert engine.config.adapt == TRANSFER_ADAPT and engine.parts.adapter is not None
    trace = engine.start(pair.tokenizer.encode(PROMPT), 8)
    assert trace.settings["decision_model"] == {"kind": "context", **engine.parts.decision_model.source}
    assert trace.settings["method"]["adapt"] == TRANSFER_ADAPT  # a replay rebuilds the same run
    # the hidden-state model reads the draft's width: it cannot transfer, and the error says what to do
    rc = main(["generate", "--models", "tiny", "--prompt", "x", "--stop", "decision", "--decision-model", "hidden",
               "--max-new-tokens", "4"])
    assert rc == 0  # the tiny pair ships its own
    from explorer.engine.machine import EngineError

    with pytest.raises(EngineError, match="decision calibrate"):
        build_engine(pair, DEFAULTS["mcsd-improved"].with_(decision_model="hidden"), SamplingConfig())


def test_calibration_trains_models_for_the_pair_that_are_found_next_time(tmp_path, monkeypatch):
    from explorer.decision.calibrate import calibrate, find_calibrated

    monkeypatch.setenv("SPEC_EXPLORER_CACHE", str(tmp_path))
    pair = tiny_family_pair("gpt2")
    assert find_calibrated(pair.draft_id, pair.target_id) is None
    seen = []
    card = calibrate(pair, prompts=6, max_new_tokens=8, on_progress=lambda m, f: seen.append(f))
    assert seen[0] == 0.0 and seen[-1] == 1.0 and seen == sorted(seen)
    assert card["pair"]["draft_id"] == pair.draft_id and card["data"]["records"] > 0
    assert find_calibrated(pair.draft_id, pair.target_id) is not None
    engine = build_engine(pair, DEFAULTS["mcsd-improved"], SamplingConfig(temperature=0.0))
    assert engine.parts.decision_model.source["how"] == "calibrated"
    assert engine.config.adapt == "off"  # a model of this pair's own needs no adaptation switched on
    with pytest.raises(ValueError, match="at least 4"):
        calibrate(pair, prompts=2)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_head_reading_the_targets_output_rows_keeps_generates_tokens_on_each_family(family, tmp_path):
    """A tied head (``lm_head_from_verifier``: no ``lm_head`` stored, the target's output rows read at load) on each
    family's output layer (tied or not to its embedding)."""
    from dataclasses import replace

    from explorer.models.eagle3 import load_head

    pair = tiny_family_pair(family)
    layers = default_aux_layers(pair.target.config.num_hidden_layers)
    config = replace(head_config(pair.target, layers, draft_vocab=64), lm_head_from_verifier=True)
    folder = save_head(random_head(config, seed=3, draft_ids=list(range(40, 104))), tmp_path / "tied")
    head = load_head(folder, target=pair.target, dtype=torch.float32)
    rows = pair.target.get_output_embeddings().weight[40:104].float()
    assert torch.equal(head.lm_head.weight, rows)
    ids = pair.tokenizer.encode(PROMPT)
    engine = build_engine(pair, DEFAULTS["eagle"].with_(head=str(folder), fallback="off"),
                          SamplingConfig(temperature=0.0))
    engine.start(ids, NEW_TOKENS)
    engine.run()
    assert engine.state.committed[len(ids):] == reference(pair, ids)


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_a_tied_head_passes_the_audit_on_a_windowed_family(family, tmp_path):
    from dataclasses import replace

    pair = tiny_family_pair(family)
    layers = default_aux_layers(pair.target.config.num_hidden_layers)
    config = replace(head_config(pair.target, layers, draft_vocab=64), lm_head_from_verifier=True)
    folder = save_head(random_head(config, seed=4), tmp_path / "tied")
    ids = pair.tokenizer.encode(PROMPT[:40])
    r = audit(pair, DEFAULTS["eagle"].with_(head=str(folder), fallback="off"),
              SamplingConfig(temperature=1.0, seed=33_000), ids, AUDIT_SAMPLES)
    assert r.first.p_value > 0.001 and r.pairs.p_value > 0.001, (r.first.p_value, r.pairs.p_value)
    assert len(r.first.exact) >= 4

"""A head whose output layer is the target's (``--tie-lm-head``): rows read from the target at load, frozen in
training and online distillation, never stored unless exported; a trained head grown (a larger draft vocabulary, a
wider MLP) drafts as before until it learns; training for epochs with early stopping keeps the best save."""

import json

import pytest
import torch
from safetensors import safe_open

from explorer.cli.main import main
from explorer.heads.data import build, chunk, coverage, grown_vocabulary, load
from explorer.heads.train import held_out_score, reshape, train_head, ttt_levels
from explorer.models.eagle3 import LM_HEAD_KEY, HeadError, load_head

TEXT = "the cat sat on the mat. the dog sat on the log. " * 12
OTHER = "a bird flew over the hill and sang to the sun. " * 10


def _data(tiny, tmp_path, text=TEXT, name="data"):
    return build(tiny, chunk([tiny.tokenizer.encode(text)], 96), (0, 1, 2), tmp_path / name, progress=False)


def _keys(folder):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_a_tied_head_trains_with_the_targets_rows_frozen_and_stores_none(tiny, tmp_path):
    data = _data(tiny, tmp_path)
    card = train_head(tiny, data, tmp_path / "tied", draft_vocab=48, intermediate=32, steps=30, lr=3e-3, ttt=2,
                      save_every=30, progress=False, tie_lm_head=True)
    folder = tmp_path / "tied"
    assert card["tie_lm_head"] and json.loads((folder / "config.json").read_text())[LM_HEAD_KEY] is True
    assert "lm_head.weight" not in _keys(folder) and "fc.weight" in _keys(folder)
    head = load_head(folder, target=tiny.target, dtype=torch.float32)
    rows = tiny.target.get_output_embeddings().weight[head.target_ids()].float()
    assert torch.equal(head.lm_head.weight, rows)  # after 30 steps at 3e-3: still the target's rows
    untrained = train_head(tiny, data, tmp_path / "fresh", draft_vocab=48, intermediate=32, steps=1, lr=1e-9,
                           ttt=2, save_every=1, progress=False, tie_lm_head=True)
    assert card["loss"] < untrained["loss"] and card["parameters"] < untrained["parameters"] + 1
    with pytest.raises(HeadError, match=LM_HEAD_KEY):
        load_head(folder)  # its output layer lives in the target
    resumed = train_head(tiny, data, folder, steps=40, lr=3e-3, ttt=2, save_every=10, progress=False)
    assert resumed["steps"] == 40 and resumed["tie_lm_head"]
    assert torch.equal(load_head(folder, target=tiny.target, dtype=torch.float32).lm_head.weight, rows)


def test_heads_export_writes_a_tied_heads_rows_out_in_either_layout(tiny, tmp_path, capsys):
    data = _data(tiny, tmp_path)
    train_head(tiny, data, tmp_path / "tied", draft_vocab=48, intermediate=32, steps=5, lr=3e-3, ttt=2,
               save_every=5, progress=False, tie_lm_head=True)
    tied = load_head(tmp_path / "tied", target=tiny.target, dtype=torch.float32)
    seq = load(data)[0]
    for layout in ("specforge", "speculators"):
        out = tmp_path / layout
        assert main(["heads", "export", "--head", str(tmp_path / "tied"), "--out", str(out), "--format", layout,
                     "--models", "tiny"]) == 0
        assert "written out" in capsys.readouterr().out
        config = json.loads((out / "config.json").read_text())
        assert LM_HEAD_KEY not in config and "lm_head.weight" in _keys(out)
        alone = load_head(out, dtype=torch.float32)  # self-contained: no target needed
        alone.set_embeddings(tiny.target.get_input_embeddings())
        with torch.no_grad():
            for a, b in zip(ttt_levels(tied, seq, 2), ttt_levels(alone, seq, 2)):
                assert torch.allclose(a, b, atol=1e-5)
    kept = tmp_path / "kept"
    assert main(["heads", "export", "--head", str(tmp_path / "tied"), "--out", str(kept), "--keep-tied",
                 "--format", "speculators", "--models", "tiny"]) == 0
    assert "lm_head.weight" not in _keys(kept)
    assert json.loads((kept / "config.json").read_text())[LM_HEAD_KEY] is True
    assert torch.equal(load_head(kept, target=tiny.target, dtype=torch.float32).lm_head.weight, tied.lm_head.weight)


def test_a_grown_head_drafts_as_before_until_it_learns(tiny, tmp_path):
    data = _data(tiny, tmp_path)
    train_head(tiny, data, tmp_path / "base", draft_vocab=48, intermediate=32, steps=40, lr=3e-3, ttt=2,
               save_every=40, progress=False)
    base = load_head(tmp_path / "base", target=tiny.target, dtype=torch.float32)
    cached = load(data)
    ids = grown_vocabulary(cached, base.target_ids().tolist(), 80, tiny.target.config.vocab_size)
    assert len(ids) == 80 and set(base.target_ids().tolist()) <= set(ids) and ids == sorted(ids)
    grown = reshape(base, tiny.target, ids, intermediate=64)
    assert grown.config.intermediate_size == 64 and grown.config.draft_vocab_size == 80
    seq = cached[0]
    col = {t: i for i, t in enumerate(ids)}
    kept = torch.tensor([col[t] for t in base.target_ids().tolist()])
    with torch.no_grad():
        for a, b in zip(ttt_levels(base, seq, 2), ttt_levels(grown, seq, 2)):
            assert torch.allclose(a, b[:, kept], atol=1e-5)  # the old tokens' logits: unchanged
    with pytest.raises(HeadError, match="only grow"):
        reshape(base, tiny.target, intermediate=16)
    with pytest.raises(ValueError, match="cannot grow"):
        grown_vocabulary(cached, ids, 10, tiny.target.config.vocab_size)
    card = train_head(tiny, _data(tiny, tmp_path, OTHER, "other"), tmp_path / "tuned", steps=20, lr=3e-3, ttt=2,
                      save_every=20, progress=False, init=tmp_path / "base", grow_vocab=80, grow_mlp=64,
                      tie_lm_head=True)
    assert card["reshaped"] == {"draft_vocab": 80, "intermediate": 64, "tie_lm_head": True}
    tuned = load_head(tmp_path / "tuned", target=tiny.target, dtype=torch.float32)
    assert tuned.config.lm_head_from_verifier and tuned.config.intermediate_size == 64
    with pytest.raises(ValueError, match="--grow-vocab"):
        train_head(tiny, data, tmp_path / "x", steps=1, ttt=2, progress=False, grow_mlp=64)


def test_training_for_epochs_stops_early_and_keeps_the_best_save(tiny, tmp_path):
    data, held = _data(tiny, tmp_path), _data(tiny, tmp_path, OTHER, "held")
    n = len(load(data))
    card = train_head(tiny, data, tmp_path / "run", draft_vocab=48, intermediate=32, epochs=40, lr=5e-2, ttt=2,
                      save_every=2, progress=False, eval_folders=[held], patience=2)
    state = json.loads((tmp_path / "run" / "train_state.json").read_text())
    best = state["best"]
    assert card["stopped_early"] and card["steps"] < 40 * n  # a learning rate this high overfits the cat text
    later = [h for h in state["history"] if h["step"] > best["step"]]
    assert len(later) == 2 and all(held_out_score(h["held_out"], 0.8) <= best["score"] for h in later)
    assert (tmp_path / "run" / "best" / "config.json").is_file()
    again = train_head(tiny, data, tmp_path / "run", draft_vocab=48, intermediate=32, epochs=40, lr=5e-2, ttt=2,
                       save_every=2, progress=False, eval_folders=[held], patience=2)
    assert again["steps"] == card["steps"]  # resumed: still stale, nothing more trained


def test_the_coverage_curve_rises_to_every_favourite(tiny, tmp_path):
    cached, vocab = load(_data(tiny, tmp_path)), tiny.target.config.vocab_size
    curve = coverage(cached, [1, 4, 16, vocab], vocab)
    covered = [c["covered"] for c in curve]
    assert covered == sorted(covered) and covered[-1] == 1.0 and covered[0] < 1.0
    held = load(_data(tiny, tmp_path, OTHER, "held"))
    apart = [c["covered"] for c in coverage(cached, [1, 4, 16, vocab], vocab, held)]
    assert apart == sorted(apart) and apart[-1] == 1.0 and apart[1] < covered[1]  # other text: less covered


def test_a_tied_head_learns_online_with_its_output_layer_frozen(tiny, tmp_path):
    from explorer.engine.online_distill import HeadDistiller

    train_head(tiny, _data(tiny, tmp_path), tmp_path / "tied", draft_vocab=48, intermediate=32, steps=2, lr=3e-3,
               ttt=2, save_every=2, progress=False, tie_lm_head=True)
    head = load_head(tmp_path / "tied", target=tiny.target, dtype=torch.float32)
    distiller = HeadDistiller.for_head(head)
    learned = {id(p) for group in distiller.optimizer.param_groups for p in group["params"]}
    assert not distiller.head.lm_head.weight.requires_grad and distiller.head.fc.weight.requires_grad
    assert id(distiller.head.lm_head.weight) not in learned and id(distiller.head.fc.weight) in learned


def test_a_malformed_tied_checkpoint_is_refused(tiny, tmp_path):
    train_head(tiny, _data(tiny, tmp_path), tmp_path / "tied", draft_vocab=48, intermediate=32, steps=2, lr=3e-3,
               ttt=2, save_every=2, progress=False, tie_lm_head=True)
    assert main(["heads", "export", "--head", str(tmp_path / "tied"), "--out", str(tmp_path / "full"),
                 "--models", "tiny"]) == 0
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    (tmp_path / "full" / "config.json").write_text(json.dumps({**config, LM_HEAD_KEY: True}))
    with pytest.raises(HeadError, match="drop one"):
        load_head(tmp_path / "full", target=tiny.target)
    with pytest.raises(ValueError, match="held-out"):
        train_head(tiny, _data(tiny, tmp_path), tmp_path / "x", steps=2, ttt=2, progress=False, patience=2)

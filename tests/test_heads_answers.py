"""The loss on answers only (``heads train --loss-on answers``, SpecForge's and speculators' loss mask): the chat
template's generation prompt finds each answer's tokens, chunk cuts anywhere (inside the marker too) keep them, the
loss and the held-out agreement skip the rest, and a resumed run cannot change the setting."""

import json

import pytest
import torch

from explorer.cli.main import main
from explorer.heads.data import HeadDataError, Sequence, answer_masks, build, chunk, generation_prompt, load
from explorer.heads import train as train_module
from explorer.heads.train import head_config, next_in_answer, train_head, ttt_levels, ttt_loss
from explorer.models.eagle3 import random_head
from explorer.models.tiny import tiny_tokenizer


def _chat(tok, prompt: str, answer: str) -> str:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt},
                {"role": "assistant", "content": answer}]
    return tok.apply_chat_template(messages, tokenize=False)


def _tokens_only(ids: list[int]) -> Sequence:
    """A sequence whose tokens alone are real (``answer_masks`` reads nothing else)."""
    n = len(ids)
    return Sequence(torch.tensor(ids), torch.zeros(n, 3, 1), torch.zeros(n, 1, dtype=torch.long), torch.zeros(n, 1))


def test_answer_masks_mark_each_answers_tokens_wherever_the_chunks_are_cut(tiny):
    tok = tiny.tokenizer
    marker = generation_prompt(tok)
    assert tok.decode(marker) == "<|im_start|>assistant\n"
    text = "plain words " + _chat(tok, "Name a cat.", "Tom the cat.") + _chat(tok, "Name a dog.", "Rex.")
    ids = tok.encode(text)
    at = [i for i in range(len(ids)) if ids[i:i + len(marker)] == marker]  # where each answer's marker starts
    assert len(at) == 2
    for cuts in ([len(ids)], [7, 40], [at[0] + 1, at[0] + 2, at[1] + 5], list(range(3, len(ids), 3))):
        bounds = [0, *cuts, len(ids)]
        seqs = [_tokens_only(ids[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]
        masks = answer_masks(seqs, marker)
        assert [m.shape[0] for m in masks] == [s.tokens.shape[0] for s in seqs]
        chosen = [t for s, m in zip(seqs, masks) for t, keep in zip(s.tokens.tolist(), m.tolist()) if keep]
        # text before any turn counts; each answer from its first token to its end of turn; no prompt, no marker
        assert tok.decode(chosen) == "plain words Tom the cat.<|im_end|>\nRex.<|im_end|>\n"
    counted = next_in_answer(answer_masks([_tokens_only(ids)], marker))[0]
    # the position before an answer's first token counts (its label is that token); the marker's first does not
    assert bool(counted[at[0] + len(marker) - 1]) and not bool(counted[at[0]])


def test_a_tokenizer_without_a_chat_template_is_refused():
    tok = tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(HeadDataError, match="chat template"):
        generation_prompt(tok)
    with pytest.raises(HeadDataError, match="empty"):
        answer_masks([_tokens_only([1, 2, 3])], [])


def test_the_loss_takes_only_the_counted_positions(tiny, tmp_path):
    config = head_config(tiny.target, (0, 1, 2), 64, intermediate=64)
    head = random_head(config, seed=1)
    head.set_embeddings(tiny.target.get_input_embeddings())
    ids = tiny.tokenizer.encode(_chat(tiny.tokenizer, "Say hello.", "Hello there, and a good day to you."))
    seq = load(build(tiny, [ids], (0, 1, 2), tmp_path / "data", progress=False))[0]
    to_draft = torch.full((tiny.target.config.vocab_size,), -1, dtype=torch.long)
    to_draft[head.target_ids()] = torch.arange(64)
    n = len(ids)
    full, _ = ttt_loss(head, seq, 2, 0.8, to_draft)
    every, _ = ttt_loss(head, seq, 2, 0.8, to_draft, torch.ones(n, dtype=torch.bool))
    none, agree = ttt_loss(head, seq, 2, 0.8, to_draft, torch.zeros(n, dtype=torch.bool))
    answers = next_in_answer(answer_masks([seq], generation_prompt(tiny.tokenizer)))[0]
    part, _ = ttt_loss(head, seq, 2, 0.8, to_draft, answers)
    assert torch.equal(full, every) and float(none.detach()) == 0.0 and agree == [0.0, 0.0]
    assert 0 < int(answers.sum()) < n and float(part.detach()) != float(full.detach())
    # the output layer runs on the counted rows alone: the same loss and gradients as every row's logits masked
    head.zero_grad()
    part.backward()
    grads = {k: p.grad.clone() for k, p in head.named_parameters() if p.grad is not None}
    head.zero_grad()
    reference = _masked_loss(head, seq, 2, 0.8, to_draft, answers)
    reference.backward()
    assert torch.allclose(part, reference, atol=1e-6) and grads
    for k, p in head.named_parameters():
        if k in grads:
            assert torch.allclose(grads[k], p.grad, atol=1e-6), k


def _masked_loss(head, seq, ttt, decay, to_draft, counted):
    """``ttt_loss`` as written first: every row's logits, the rows that do not count masked out afterwards."""
    total = torch.zeros(())
    for j, logits in enumerate(ttt_levels(head, seq, ttt), start=1):
        rows = logits.shape[0]
        draft = to_draft[seq.label_ids[j:j + rows]]
        label = torch.zeros_like(logits).scatter_add_(1, draft.clamp(min=0), seq.label_probs[j:j + rows] * (draft >= 0))
        valid = (draft[:, 0] >= 0) & (label.sum(-1) > 0) & counted[j:j + rows]
        label = label[valid] / label[valid].sum(-1, keepdim=True)
        total = total + decay ** (j - 1) * -(label * logits[valid].log_softmax(-1)).sum(-1).mean()
    return total


def test_training_on_answers_skips_prompt_only_chunks_and_keeps_its_setting(tiny, tmp_path):
    tok = tiny.tokenizer
    texts = [_chat(tok, "Please answer this question about animals in a few words: " + q, a)
             for q, a in (("what does a cat say?", "A cat says meow."), ("what does a dog say?", "A dog says woof."),
                          ("what does a cow say?", "A cow says moo, loudly and often, in the field."))]
    sequences = chunk([tok.encode(t) for t in texts], 48)  # each text's first chunk holds its prompt alone
    data = build(tiny, sequences, (0, 1, 2), tmp_path / "data", progress=False)
    held = build(tiny, sequences[-2:], (0, 1, 2), tmp_path / "held", progress=False)
    card = train_head(tiny, data, tmp_path / "head", draft_vocab=64, intermediate=32, steps=6, lr=3e-3, ttt=2,
                      save_every=3, progress=False, eval_folders=[held], loss_on="answers")
    assert card["loss_on"] == "answers" and 0 < card["sequences"] < len(sequences)
    assert len(card["held_out_agreement_by_level"]) == 2
    assert json.loads((tmp_path / "head" / "train_state.json").read_text())["loss_on"] == "answers"
    with pytest.raises(ValueError, match="answers, not all"):
        train_head(tiny, data, tmp_path / "head", steps=8, ttt=2, progress=False, loss_on="all")
    with pytest.raises(ValueError, match="choose"):
        train_head(tiny, data, tmp_path / "other", steps=2, ttt=2, progress=False, loss_on="prompts")
    assert main(["heads", "train", "--models", "tiny", "--data", str(data), "--out", str(tmp_path / "cli"),
                 "--draft-vocab", "64", "--intermediate", "32", "--steps", "2", "--ttt", "2", "--save-every", "2",
                 "--loss-on", "answers", "--quiet"]) == 0
    assert json.loads((tmp_path / "cli" / "card.json").read_text())["loss_on"] == "answers"


def test_a_sequence_whose_answer_lies_outside_the_draft_vocabulary_is_passed_over(tiny, tmp_path, monkeypatch):
    """Its loss has no position to take (``ttt_loss`` returns a constant): the step updates nothing instead of
    failing, as a 16,384-token head's run never met but a small draft vocabulary on short answers does, and records
    nothing: the saved training loss is the mean of the steps that took a position."""
    losses = []

    def spy(*args, **kwargs):
        loss, agree = ttt_loss(*args, **kwargs)
        losses.append(float(loss.detach()) if loss.requires_grad else None)
        return loss, agree

    monkeypatch.setattr(train_module, "ttt_loss", spy)
    tok = tiny.tokenizer
    common = _chat(tok, "Say it.", "the cat sat on the mat. " * 20)
    rare = _chat(tok, "Say it.", "Zyx qwv!")
    data = build(tiny, chunk([tok.encode(common), tok.encode(rare)], 256), (0, 1, 2), tmp_path / "data",
                 progress=False)
    card = train_head(tiny, data, tmp_path / "head", draft_vocab=12, intermediate=32, steps=4, lr=3e-3, ttt=2,
                      save_every=4, progress=False, loss_on="answers", vocab_data_share=1.0)
    assert card["steps"] == 4 and card["sequences"] >= 2
    taken = [x for x in losses if x is not None]
    assert len(losses) == 4 and None in losses and taken  # both kinds of step ran
    state = json.loads((tmp_path / "head" / "train_state.json").read_text())
    assert state["history"][-1]["loss"] == pytest.approx(sum(taken) / len(taken), abs=1e-4)

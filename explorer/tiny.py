"""A tiny, randomly initialised, seeded model pair for fast tests and for trying the UI without the 1.6 GB download.

The tokenizer is a real byte-level BPE with no merges (one token per byte, plus special tokens), built in memory.
The target is a 2-layer Qwen2; the draft is the same network cut to its first layer (embeddings and head shared as
copies), so the two distributions are correlated the way a real draft's are, and acceptance is neither 0 nor 1.
"""

from __future__ import annotations

import copy

import torch

from .pair import ModelPair, make_pair

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """Byte-level tokenizer: 256 byte tokens + 3 specials (ids 256..258). Any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = _CHAT_TEMPLATE
    return tok


def tiny_config(vocab_size: int, n_layers: int = 2):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=False, initializer_range=0.3, attn_implementation="sdpa")


def tiny_pair(seed: int = 0, device=None, dtype=torch.float32) -> ModelPair:
    """Build the tiny pair deterministically from ``seed`` (fp32 by default, so greedy tests have no bf16 ties)."""
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    vocab = len(tok)
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's global RNG
        torch.manual_seed(seed)
        target = AutoModelForCausalLM.from_config(tiny_config(vocab, 2), dtype=dtype)
        draft = AutoModelForCausalLM.from_config(tiny_config(vocab, 1), dtype=dtype)
    # The draft is the target's first layer: same embeddings, head and final norm; one block instead of two.
    draft.model.embed_tokens = copy.deepcopy(target.model.embed_tokens)
    draft.model.layers[0] = copy.deepcopy(target.model.layers[0])
    draft.model.norm = copy.deepcopy(target.model.norm)
    draft.lm_head = copy.deepcopy(target.lm_head)
    for lm in (draft, target):
        lm.generation_config.eos_token_id = tok.eos_token_id
        lm.generation_config.pad_token_id = tok.pad_token_id
        lm.to(device or "cpu").eval()
    return make_pair(draft, target, tok, name=f"tiny random pair (seed {seed})", draft_id=f"tiny-draft-{seed}",
                     target_id=f"tiny-target-{seed}")

"""A tiny, randomly initialised, seeded model pair for fast tests and for trying the UI without the 1.6 GB download.

The tokenizer is a real byte-level BPE with no merges (one token per byte, plus special tokens), built in memory.
The target is a 2-layer Qwen2; the draft is the same network cut to its first layer (embeddings and head shared as
copies), so the two distributions are correlated the way a real draft's are, and acceptance is neither 0 nor 1.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from .pair import ModelPair, make_pair

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """Byte-level tokenizer: 256 byte tokens + 3 specials (ids 256..258). Any text round-trips."""
    # here, not at the top: transformers and its tokenizers take about 0.8 s to import; models.loading imports this
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
    # here, not at the top: transformers takes about 0.8 s to import; models.loading imports this module
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=False, initializer_range=0.3, attn_implementation="sdpa")


# Tiny configs of the model families the engine is tested on (``tests/test_families.py``): every family keeps its
# own attention, position and norm code; windows are 16 positions so that a test prompt runs past them.
_SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=False)
FAMILIES = {
    "llama": ("LlamaConfig", _SMALL),
    "mistral": ("MistralConfig", {**_SMALL, "sliding_window": 16}),
    "qwen3": ("Qwen3Config", {**_SMALL, "head_dim": 16}),
    "phi3": ("Phi3Config", _SMALL),
    "gemma2": ("Gemma2Config", {**_SMALL, "head_dim": 16, "sliding_window": 16}),
    "gemma3": ("Gemma3TextConfig", {**_SMALL, "head_dim": 16, "sliding_window": 16}),
    "gpt-neox": ("GPTNeoXConfig", {k: v for k, v in _SMALL.items() if k != "num_key_value_heads"}),
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_head": 4, "n_positions": 512, "initializer_range": 0.3}),
    "opt": ("OPTConfig", {"hidden_size": 64, "ffn_dim": 128, "num_attention_heads": 4, "word_embed_proj_dim": 64,
                          "max_position_embeddings": 512, "init_std": 0.3}),
}


def tiny_family_pair(family: str, seed: int = 0, dtype=torch.float32, target_layers: int = 2) -> ModelPair:
    """A tiny random pair of one transformers family (``FAMILIES``), built from its config: a 2-layer (or
    ``target_layers``) target and
    a 1-layer draft holding copies of the target's embeddings, first layer, final norm and head (so the two
    distributions agree often but not always, as ``tiny_pair``'s do), on the byte tokenizer. fp32, CPU.

    Raises ValueError for an unknown family."""
    # here, not at the top: transformers takes about 0.8 s to import; models.loading imports this module
    import transformers
    from transformers import AutoModelForCausalLM

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; use one of {', '.join(FAMILIES)}")
    config_name, kwargs = FAMILIES[family]
    tok = tiny_tokenizer()
    ids = dict(vocab_size=len(tok), bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    layers = "n_layer" if family == "gpt2" else "num_hidden_layers"
    config_class = getattr(transformers, config_name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        target = AutoModelForCausalLM.from_config(config_class(**kwargs, **ids, **{layers: target_layers}),
                                                  dtype=dtype)
        draft = AutoModelForCausalLM.from_config(config_class(**kwargs, **ids, **{layers: 1}), dtype=dtype)
    shapes = {k: v.shape for k, v in draft.state_dict().items()}
    draft.load_state_dict({k: v.clone() for k, v in target.state_dict().items()
                           if k in shapes and v.shape == shapes[k]}, strict=False)
    for lm in (draft, target):
        lm.generation_config.eos_token_id = tok.eos_token_id
        lm.generation_config.pad_token_id = tok.pad_token_id
        lm.eval()
    return make_pair(draft, target, tok, name=f"tiny {family} pair (seed {seed})",
                     draft_id=f"tiny-{family}-draft-{seed}", target_id=f"tiny-{family}-target-{seed}")


def save_pair(pair: ModelPair, directory) -> tuple[str, str]:
    """Write the pair's two models and the tokenizer as Hugging Face folders ``<directory>/draft`` and
    ``<directory>/target`` (what ``--draft`` / ``--target`` and the app's custom pair load); returns their paths."""
    out = []
    for role, model in (("draft", pair.draft), ("target", pair.target)):
        folder = Path(directory) / role
        model.save_pretrained(folder)
        pair.tokenizer.save_pretrained(folder)
        out.append(str(folder))
    return out[0], out[1]


def tiny_pair(seed: int = 0, device=None, dtype=torch.float32) -> ModelPair:
    """Build the tiny pair deterministically from ``seed`` (fp32 by default, so greedy tests have no bf16 ties)."""
    # here, not at the top: transformers takes about 0.8 s to import; models.loading imports this module
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

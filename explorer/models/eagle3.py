"""EAGLE-3 draft heads: one decoder layer that drafts from the target's own hidden states.

An EAGLE-3 head (Li et al. 2025, arXiv 2503.01840) reads the hidden states of three target layers at a committed
token, fuses them (``fc``: 3H -> H) into a feature g, and predicts the next token from g and the embedding of the
token that follows it. Deeper draft levels feed the head's own pre-norm output back as g. Its logits cover a reduced
draft vocabulary, mapped to target ids by ``d2t`` (target id = draft id + d2t[draft id]); a target token outside it
gets probability 0 in q.

The checkpoint format is the one SpecForge writes and vLLM (``llama_eagle3.py``) and SGLang load: a folder with
``config.json`` (``architectures: ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``, ``hidden_size``, head
counts, ``intermediate_size``, ``vocab_size`` (the target's), ``draft_vocab_size``, ``rope_theta``,
``rms_norm_eps``, optional ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``) and
safetensors weights: ``fc.weight [H, 3H]``, ``midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}``,
``midlayer.self_attn.{q,k,v}_proj`` (input width 2H) and ``o_proj``, ``midlayer.mlp.{gate,up,down}_proj``,
``norm.weight``, ``lm_head.weight [draft_vocab, H]``, ``d2t`` and ``t2d``; ``embed_tokens.weight`` optional (the
target's when absent). A head whose ``config.json`` says ``lm_head_from_verifier`` stores no ``lm_head``: its output
layer is the target's output rows at its draft ids, read when it loads (EAGLE-1 used the target's LM head; vLLM's
speculators starts its heads' lm_head from those rows). The ``speculators`` package's ``layers.0.`` names and its
own ``config.json`` layout (``Eagle3Speculator``: ``from_speculators``) load too, and ``save_head`` writes either
layout. Pickled weights are refused.

The layer, as vLLM runs it: the attention reads ``concat(input_layernorm(embed(token)), hidden_norm(g))`` and adds
its output to g (the residual); then ``post_attention_layernorm``, the MLP and its residual; the logits are
``lm_head(norm(out))`` and the next level's g is ``out`` before ``norm``. Which target layers feed it: by default
the inputs of layers 2, L/2 and L-3 (vLLM's reading of ``eagle_aux_hidden_state_layer_ids``: the id is the layer
whose input is read; transformers' ``hidden_states[id]``).
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"  # vLLM speculators' eagle3 class, as its config.json names it
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
PICKLED = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
MAX_CONFIG_BYTES = 1 << 20
# config.json's mark of a head whose output layer is the target's rows at d2t, not stored. speculators has no such key
# (its Eagle3 model builds lm_head from the verifier's rows at t2d when it is made, then trains and saves it; only the
# embedding has a flag, embed_requires_grad), and its loader would report lm_head.weight missing: heads export writes
# the rows out for it. Named after the verifier as speculators names the target.
LM_HEAD_KEY = "lm_head_from_verifier"


class HeadError(ValueError):
    """A head that cannot be loaded or does not fit its target: the message says which file, field or size."""


@dataclass(frozen=True)
class HeadConfig:
    """An EAGLE-3 head's shape (``config.json``).

    Attributes:
        hidden_size: H, the head's width; ``target_hidden_size`` the target's (the features' width; H when
            absent).
        intermediate_size: the MLP's width.
        num_attention_heads, num_key_value_heads, head_dim: the attention's shape (``head_dim`` H / heads when
            absent).
        vocab_size: the target's vocabulary; ``draft_vocab_size`` the head's (its logits' width).
        rms_norm_eps, rope_theta, max_position_embeddings: as in a Llama config (no RoPE scaling).
        aux_layer_ids: the target layers whose inputs feed ``fc``, or None for the default (``aux_layers``).
        norm_before_residual: the attention's residual is the normed feature ``hidden_norm(g)`` instead of g
            (speculators' option; vLLM's ``_norm_before_residual``).
        lm_head_from_verifier: the output layer is the target's output rows at the draft ids (``d2t``), frozen and
            never stored (``config.json``: ``LM_HEAD_KEY``); ``load_head`` reads them from the target.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    target_hidden_size: int | None = None
    aux_layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False
    lm_head_from_verifier: bool = False

    @property
    def feature_size(self) -> int:
        """The width of one target layer's hidden state."""
        return self.target_hidden_size or self.hidden_size

    def aux_layers(self, n_target_layers: int) -> tuple[int, ...]:
        """The target layers whose inputs feed the head: the config's, else ``default_aux_layers``."""
        return self.aux_layer_ids if self.aux_layer_ids is not None else default_aux_layers(n_target_layers)

    @classmethod
    def from_dict(cls, raw: dict) -> HeadConfig:
        """Parse a ``config.json``: SpecForge's layout, or vLLM speculators' (``speculators_model_type: eagle3``,
        ``from_speculators``). Raises HeadError for another architecture, more than one layer, a missing or
        malformed field, or RoPE scaling or a speculators option that is not supported."""
        if not isinstance(raw, dict):
            raise HeadError("config.json is not a JSON object")
        if raw.get("speculators_model_type") is not None or SPECULATORS_ARCHITECTURE in (raw.get("architectures")
                                                                                         or []):
            raw = from_speculators(raw)
        arch = raw.get("architectures") or []
        if ARCHITECTURE not in arch:
            raise HeadError(f"config.json names architectures {arch}: not an EAGLE-3 head ({ARCHITECTURE})")
        if int(raw.get("num_hidden_layers", 1)) != 1:
            raise HeadError(f"an EAGLE-3 head has one decoder layer; config.json says {raw['num_hidden_layers']}")
        if raw.get("rope_scaling") not in (None, {}) and (raw["rope_scaling"] or {}).get("rope_type", "default") \
                not in ("default",):
            raise HeadError(f"RoPE scaling {raw['rope_scaling']} is not supported for heads")
        eagle = raw.get("eagle_config") or {}
        try:
            hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
            aux = eagle.get("eagle_aux_hidden_state_layer_ids")
            config = cls(hidden_size=hidden, intermediate_size=int(raw["intermediate_size"]),
                         num_attention_heads=heads,
                         num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                         head_dim=int(raw.get("head_dim") or hidden // heads), vocab_size=int(raw["vocab_size"]),
                         draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
                         rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                         rope_theta=rope_theta_of(raw),
                         max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
                         target_hidden_size=int(raw["target_hidden_size"]) if raw.get("target_hidden_size") else None,
                         aux_layer_ids=tuple(int(i) for i in aux) if aux else None,
                         norm_before_residual=bool(raw.get("norm_before_residual", False)),
                         lm_head_from_verifier=bool(raw.get(LM_HEAD_KEY, False)))
        except KeyError as exc:
            raise HeadError(f"config.json lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise HeadError(f"config.json has a malformed field: {exc}") from None
        if min(config.hidden_size, config.intermediate_size, config.num_attention_heads, config.num_key_value_heads,
               config.head_dim, config.vocab_size, config.draft_vocab_size) < 1:
            raise HeadError("config.json has a size below 1")
        if config.num_attention_heads % config.num_key_value_heads:
            raise HeadError(f"{config.num_attention_heads} attention heads do not share "
                            f"{config.num_key_value_heads} key/value heads evenly")
        if config.draft_vocab_size > config.vocab_size:
            raise HeadError(f"the draft vocabulary ({config.draft_vocab_size}) is larger than the target's "
                            f"({config.vocab_size})")
        return config

    def to_dict(self) -> dict:
        """``config.json`` as SpecForge writes it (vLLM and SGLang read it)."""
        out = {"architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
               "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
               "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
               "head_dim": self.head_dim, "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
               "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
               "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
               "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
        if self.target_hidden_size:
            out["target_hidden_size"] = self.target_hidden_size
        if self.aux_layer_ids is not None:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                                   "use_aux_hidden_state": True}
        if self.norm_before_residual:
            out["norm_before_residual"] = True
        if self.lm_head_from_verifier:
            out[LM_HEAD_KEY] = True
        return out

    def to_speculators(self, verifier: str = "") -> dict:
        """``config.json`` in vLLM speculators' layout (``Eagle3Speculator``): the layer's Llama config under
        ``transformer_layer_config``, the EAGLE-3 fields at the top, ``verifier`` the target's name or path."""
        layer = {k: v for k, v in self.to_dict().items()
                 if k not in ("architectures", "draft_vocab_size", "target_hidden_size", "eagle_config",
                              "norm_before_residual", "torch_dtype", LM_HEAD_KEY)}
        return {"architectures": [SPECULATORS_ARCHITECTURE], "speculators_model_type": "eagle3",
                "transformer_layer_config": layer | {"attention_bias": False, "mlp_bias": False},
                "draft_vocab_size": self.draft_vocab_size, "norm_before_residual": self.norm_before_residual,
                "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
                "target_hidden_size": self.target_hidden_size,
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids) if self.aux_layer_ids else None,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                **({LM_HEAD_KEY: True} if self.lm_head_from_verifier else {}),
                "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                       "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5,
                                                             "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                       "verifier": {"name_or_path": verifier, "architectures": []}}}


def from_speculators(raw: dict) -> dict:
    """A speculators ``config.json`` (``speculators_model_type: eagle3``) in SpecForge's flat layout: the layer's
    config from ``transformer_layer_config``, the EAGLE-3 fields from the top. Raises HeadError for another
    speculator type, a missing layer config, or an option the head does not implement (``norm_before_fc``,
    ``fc_norm``, ``norm_output``, attention or MLP biases, a Qwen3 layer's query/key norms)."""
    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        raise HeadError(f"config.json is a speculators {kind!r} model: only eagle3 heads load")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise HeadError("the speculators config.json has no transformer_layer_config")
    unsupported = [k for k in ("norm_before_fc", "fc_norm", "norm_output") if raw.get(k)]
    unsupported += [k for k in ("attention_bias", "mlp_bias") if layer.get(k)]
    if layer.get("model_type", "qwen3") not in ("llama",):
        unsupported.append(f"a {layer.get('model_type', 'qwen3 (no model_type)')} layer")
    if unsupported:
        raise HeadError(f"the speculators head uses {', '.join(unsupported)}, which this project's EAGLE-3 layer "
                        "does not implement")
    flat = dict(layer)
    flat["architectures"] = [ARCHITECTURE]
    for key in ("draft_vocab_size", "target_hidden_size", "norm_before_residual", LM_HEAD_KEY):
        if raw.get(key) is not None:
            flat[key] = raw[key]
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        flat["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": raw["eagle_aux_hidden_state_layer_ids"]}
    return flat


def rope_theta_of(raw: dict) -> float:
    """A config's RoPE theta (a ``config.json`` or a transformers config's ``to_dict()``): ``rope_theta``, else the
    one in ``rope_parameters`` (where transformers 5 keeps it), else 10000."""
    params = raw.get("rope_parameters")
    return float(raw.get("rope_theta") or (params.get("rope_theta") if isinstance(params, dict) else None) or 10000.0)


def default_aux_layers(n_target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs feed a head by default: 2, L // 2 and L - 3 (EAGLE-3's choice), kept within
    0 .. L for a target of fewer than five layers."""
    return (min(2, n_target_layers), n_target_layers // 2, max(n_target_layers - 3, 0))


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 (as Llama's)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class HeadCache:
    """The head's own KV cache for one run (batch size 1): keys and values ``(kv_heads, length, head_dim)``,
    appended by each forward; ``keep`` holds a prefix and chosen rows (the accepted path), ``rewind`` cuts back."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else int(self.k.shape[1])

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``(kv_heads, rows, head_dim)`` keys and values; returns the whole cache."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=1)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=1)
        return self.k, self.v

    def keep(self, prefix: int, rows: list[int]) -> None:
        """Keep positions ``[0, prefix)`` then ``rows`` (ascending, >= ``prefix``); drop the rest."""
        if self.k is None:
            return
        index = torch.tensor(list(range(prefix)) + list(rows), dtype=torch.long, device=self.k.device)
        self.k, self.v = self.k[:, index], self.v[:, index]

    def rewind(self, length: int) -> None:
        self.keep(length, [])


class HeadLayer(nn.Module):
    """The head's decoder layer: attention whose queries, keys and values read 2H (the token's embedding and the
    feature, each normed), RoPE positions, grouped key/value heads; the MLP; residuals on the feature."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        h, heads, kv, d = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.c = c
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * h, heads * d, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * h, kv * d, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * h, kv * d, bias=False)
        self.self_attn.o_proj = nn.Linear(heads * d, h, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(c.intermediate_size, h, bias=False)

    def forward(self, embeds: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, cache: HeadCache,
                mask: torch.Tensor | None) -> torch.Tensor:
        """``embeds``, ``g``: ``(rows, H)``; ``positions``: int64 ``(rows,)``; ``mask``: bool ``(rows,
        cache.length + rows)`` (True = attend) or None for causal rows after the cache. Returns ``(rows, H)``, the
        layer's output before the final norm; appends the rows' keys and values to ``cache``."""
        c, rows = self.c, g.shape[0]
        normed = self.hidden_norm(g)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        attn = self.self_attn
        q = attn.q_proj(x).view(rows, c.num_attention_heads, c.head_dim).transpose(0, 1)
        k = attn.k_proj(x).view(rows, c.num_key_value_heads, c.head_dim).transpose(0, 1)
        v = attn.v_proj(x).view(rows, c.num_key_value_heads, c.head_dim).transpose(0, 1)
        cos, sin = _rope(positions, c.head_dim, c.rope_theta, x.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        past = cache.length
        keys, values = cache.append(k, v)
        if mask is None:  # causal rows after the cached ones
            mask = torch.ones(rows, past + rows, dtype=torch.bool, device=g.device).tril(past)
        group = c.num_attention_heads // c.num_key_value_heads
        # each key/value head serves ``group`` query heads (repeat_interleave with an int would sync on a GPU)
        keys, values = (t[:, None].expand(-1, group, -1, -1).reshape(-1, *t.shape[1:]) for t in (keys, values))
        with _attention_kernels(q.device):
            out = torch.nn.functional.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask,
                                                                   scale=1.0 / math.sqrt(c.head_dim))[0]
        h = (normed if c.norm_before_residual else g) + attn.o_proj(out.transpose(0, 1).reshape(rows, -1))
        m = self.mlp
        y = self.post_attention_layernorm(h)
        return h + m.down_proj(torch.nn.functional.silu(m.gate_proj(y)) * m.up_proj(y))


class Eagle3Head(nn.Module):
    """An EAGLE-3 draft head (module docstring: the layer, the features, the vocabulary map).

    Attributes:
        config: its ``HeadConfig``.
        fc: 3 target features -> g (``features``).
        midlayer: the decoder layer (``HeadLayer``); norm, lm_head: to draft-vocabulary logits.
        d2t: int64 ``(draft_vocab,)``, target id = draft id + d2t; t2d: bool ``(vocab,)``, the target ids in the
            draft vocabulary.
        embed_tokens: the head's own token embedding, or None to use the target's (``set_embeddings``).
    """

    def __init__(self, config: HeadConfig, own_embeddings: bool = False):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(3 * c.feature_size, c.hidden_size, bias=False)
        self.midlayer = HeadLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if own_embeddings else None
        self._target_embed: tuple = ()  # the target's embedding, held outside the module's own parameters

    def set_embeddings(self, embedding: nn.Module) -> None:
        """Embed tokens with ``embedding`` (the target's input embeddings) where the head has none of its own. It
        stays the target's: not among the head's parameters, never saved, moved or trained with it."""
        self._target_embed = (embedding,)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``(rows,)`` int64 target token ids -> ``(rows, H)``. Raises HeadError with no embedding to use."""
        if self.embed_tokens is not None:
            return self.embed_tokens(tokens).to(self.fc.weight.dtype)
        if not self._target_embed:
            raise HeadError("the head has no token embedding of its own: set the target's (set_embeddings)")
        table = self._target_embed[0]
        return table(tokens.to(table.weight.device)).detach().to(self.fc.weight.dtype)  # read, never trained

    def features(self, states: torch.Tensor) -> torch.Tensor:
        """``(rows, 3, feature_size)`` target hidden states (``Forwards`` layers) -> g ``(rows, H)``."""
        return self.fc(states.reshape(states.shape[0], -1).to(self.fc.weight.dtype))

    def forward(self, tokens: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, cache: HeadCache,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One head step over ``rows``: ``tokens`` int64 ``(rows,)`` (the token after each feature's position),
        ``g`` ``(rows, H)``, ``positions`` int64 ``(rows,)``, ``mask`` as ``HeadLayer.forward``. Returns the
        draft-vocabulary logits ``(rows, draft_vocab)`` float32 and the next g ``(rows, H)`` (before the norm)."""
        out = self.step(tokens, g, positions, cache, mask)
        return self.logits(out), out

    def step(self, tokens: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, cache: HeadCache,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """``forward`` without the output layer: the next g ``(rows, H)`` (before the norm), for training, which
        needs the logits of only some rows (``heads.train.ttt_levels``)."""
        return self.midlayer(self.embed(tokens), g, positions, cache, mask)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """``(rows, H)`` layer outputs (``step``) -> draft-vocabulary logits ``(rows, draft_vocab)`` float32."""
        return self.lm_head(self.norm(out)).float()

    def set_target_ids(self, ids: torch.Tensor) -> None:
        """Map draft id i to target id ``ids[i]`` (int64 ``(draft_vocab,)``): ``d2t`` and ``t2d`` follow. Raises
        HeadError for another number of ids."""
        if ids.numel() != self.config.draft_vocab_size:
            raise HeadError(f"{ids.numel()} draft ids for a draft vocabulary of {self.config.draft_vocab_size}")
        ids = ids.to(self.d2t.device)
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
            self.t2d.zero_()
            self.t2d[ids] = True

    def target_ids(self) -> torch.Tensor:
        """int64 ``(draft_vocab,)``: the target id of each draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target_logits(self, logits: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
        """Draft-vocabulary logits ``(rows, draft_vocab)`` -> target-vocabulary logits ``(rows, vocab)`` float32,
        -inf where the target id is outside the draft vocabulary (q = 0 there)."""
        vocab = vocab or self.config.vocab_size
        out = torch.full((logits.shape[0], vocab + 1), float("-inf"), dtype=torch.float32, device=logits.device)
        out.index_copy_(1, target_columns(self.target_ids(), vocab), logits.float())
        return out[:, :vocab]


def target_columns(target_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """int64 ``(draft_vocab,)``: the column of each draft id in a ``(..., vocab + 1)`` tensor, its target id, or the
    spare last column ``vocab`` for an id past the target's logits (cut off afterwards). ``index_copy_`` into those
    columns spreads draft-vocabulary values over the target's vocabulary without boolean indexing, which on a GPU
    is a host synchronisation."""
    return torch.where(target_ids < vocab, target_ids, vocab)


# On a GPU, SDPA may pick cuDNN's kernel, which builds an execution plan for each new shape (pytorch/pytorch#155958).
# The head's shapes change every step (its cache grows, its levels' row counts vary): on an H200 the first eagle run
# spent 170-290 ms drafting a step, a second run over the same prompts (the same shapes) 15-18 ms. So the head keeps
# to the kernels that need no plan.
_NO_PLAN_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _attention_kernels(device: torch.device):
    """The SDPA kernels the head may use on ``device``: on CUDA, those without per-shape plans; elsewhere any."""
    return sdpa_kernel(_NO_PLAN_KERNELS) if device.type == "cuda" else contextlib.nullcontext()


def _rope(positions: torch.Tensor, dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's rotary tables at ``positions``: cos and sin ``(rows, dim)``."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    freqs = positions.float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to ``(heads, rows, dim)``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[None] + rotated * sin[None]


_RENAMES = (("layers.0.", "midlayer."), ("model.", ""))
LAYOUTS = ("specforge", "speculators")


def load_head(path: str | Path, target=None, device=None, dtype=None) -> Eagle3Head:
    """Load an EAGLE-3 head from a checkpoint folder (module docstring: the format), on ``device`` in ``dtype``
    (default: the target's), checked against ``target`` (a transformers causal LM) when given.

    Raises:
        HeadError: no such folder, no or malformed ``config.json``, another architecture, pickled weights only, a
            missing, unexpected or misshapen weight, or a head that does not fit the target (hidden size,
            vocabulary, layer count), each named in the message.
    """
    from safetensors import safe_open
    from safetensors import SafetensorError

    folder = Path(path)
    config_path = folder / CONFIG_FILE
    config = read_config(folder)
    files = weight_files(folder)
    if not files:
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLED)
        raise HeadError(f"{folder} has no .safetensors weights" + (
            f" (pickled files {pickled} are never loaded: convert them to safetensors)" if pickled else ""))
    tensors: dict[str, torch.Tensor] = {}
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    name = key
                    for old, new in _RENAMES:
                        if name.startswith(old):
                            name = new + name[len(old):]
                    tensors[name] = f.get_tensor(key)
    except (SafetensorError, OSError, ValueError) as exc:
        raise HeadError(f"cannot read the weights in {folder}: {exc}") from None
    if target is not None:
        check_fit(config, target)
    if config.draft_vocab_size == config.vocab_size and "d2t" not in tensors and "t2d" not in tensors:
        tensors["d2t"] = torch.zeros(config.vocab_size, dtype=torch.long)  # speculators: no maps, the whole vocab
        tensors["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    if config.lm_head_from_verifier and "lm_head.weight" in tensors:
        raise HeadError(f"{config_path} says {LM_HEAD_KEY} (the output layer is the target's) but the weights hold "
                        "lm_head.weight: drop one of them")
    if config.lm_head_from_verifier:
        if target is None:
            raise HeadError(f"the head in {folder} reads its output layer from the target ({LM_HEAD_KEY}): load it "
                            "with its target")
        tensors["lm_head.weight"] = verifier_rows(target, tensors.get("d2t"), config.draft_vocab_size)
    head = Eagle3Head(config, own_embeddings="embed_tokens.weight" in tensors)
    expected = head.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise HeadError(f"the head's weights do not match its config.json: missing {missing[:6]}"
                        f"{' ...' if len(missing) > 6 else ''}, unexpected {unexpected[:6]}"
                        f"{' ...' if len(unexpected) > 6 else ''}")
    for name, want in expected.items():
        if tuple(tensors[name].shape) != tuple(want.shape):
            raise HeadError(f"weight {name} has shape {tuple(tensors[name].shape)}, config.json implies "
                            f"{tuple(want.shape)}")
    tensors["d2t"] = tensors["d2t"].long()
    tensors["t2d"] = tensors["t2d"].bool()
    ids = torch.arange(config.draft_vocab_size) + tensors["d2t"]
    if bool(((ids < 0) | (ids >= config.vocab_size)).any()):
        raise HeadError("d2t maps a draft id outside the target vocabulary")
    head.load_state_dict(tensors)
    if target is not None:
        dtype = dtype or next(target.parameters()).dtype
        device = device or next(target.parameters()).device
        head.set_embeddings(target.get_input_embeddings())
    if device is not None or dtype is not None:
        head = head.to(device=device, dtype=dtype)  # floating weights only: d2t and t2d keep their dtypes
    return head.eval()


def verifier_rows(target, d2t: torch.Tensor | None, draft_vocab: int) -> torch.Tensor:
    """The target's output rows of the draft vocabulary (``d2t``: int ``(draft_vocab,)``, target id = draft id +
    d2t): ``(draft_vocab, H)`` in the target's dtype, on the CPU, a copy. Raises HeadError without ``d2t`` or for
    an id past the target's output layer."""
    if d2t is None or d2t.numel() != draft_vocab:
        raise HeadError(f"the head has no d2t of {draft_vocab} draft ids to read the target's output rows with")
    out = target.get_output_embeddings().weight
    ids = torch.arange(draft_vocab) + d2t.long().cpu()
    if bool(((ids < 0) | (ids >= out.shape[0])).any()):
        raise HeadError("d2t maps a draft id outside the target's output layer")
    return out.detach()[ids.to(out.device)].cpu().clone()


def read_config(path: str | Path) -> HeadConfig:
    """The ``HeadConfig`` of the checkpoint folder ``path`` (its ``config.json``), weights unread. Raises HeadError:
    no such folder, no, oversized or malformed ``config.json``, another architecture (``HeadConfig.from_dict``)."""
    folder = Path(path)
    if not folder.is_dir():
        raise HeadError(f"no head folder at {folder}")
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise HeadError(f"{folder} has no {CONFIG_FILE}: not an EAGLE-3 head checkpoint")
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise HeadError(f"{config_path} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        return HeadConfig.from_dict(json.loads(config_path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HeadError(f"{config_path} is not valid JSON: {exc}") from None


def weight_files(folder: Path) -> list[Path]:
    """The head's safetensors files: ``model.safetensors``, else the shards a ``model.safetensors.index.json``
    names, else every ``.safetensors`` file of the folder."""
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise HeadError(f"{index} is malformed: {exc!r}") from None
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


def check_fit(config: HeadConfig, target) -> None:
    """Raises HeadError where the head does not fit ``target``: the features' width against the target's hidden
    size, the vocabulary against the target's, the feature layers against its layer count."""
    tc = target.config
    if config.feature_size != tc.hidden_size:
        raise HeadError(f"the head reads features {config.feature_size} wide; the target's hidden size is "
                        f"{tc.hidden_size}")
    vocab = target.get_output_embeddings().weight.shape[0]
    if config.vocab_size != vocab and config.vocab_size != tc.vocab_size:
        raise HeadError(f"the head's vocabulary has {config.vocab_size} tokens; the target's {vocab}")
    layers = config.aux_layers(tc.num_hidden_layers)
    if len(layers) != 3 or any(not 0 <= i <= tc.num_hidden_layers for i in layers):
        raise HeadError(f"the head reads target layers {list(layers)}; the target has {tc.num_hidden_layers} "
                        "(three ids from 0 to that count)")


def save_head(head: Eagle3Head, path: str | Path, layout: str = "specforge", verifier: str = "",
              materialise: bool = False) -> Path:
    """Write ``head`` as an EAGLE-3 checkpoint folder (``config.json``, ``model.safetensors``; the target's
    embedding is not saved unless the head has its own) in ``layout``: ``specforge`` (``midlayer.*``, the flat
    config SpecForge writes and SGLang and vLLM load) or ``speculators`` (``layers.0.*`` and vLLM speculators'
    config, ``verifier`` naming the target). A head whose output layer is the target's
    (``lm_head_from_verifier``) is saved without it, unless ``materialise``: then its rows are written and the
    config no longer says so, a self-contained checkpoint for engines that expect ``lm_head.weight``. Returns the
    folder. Raises HeadError for another layout."""
    from dataclasses import replace

    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise HeadError(f"unknown checkpoint layout {layout!r}; use {' or '.join(LAYOUTS)}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tied = head.config.lm_head_from_verifier and not materialise
    c = replace(head.config, lm_head_from_verifier=tied)
    config = c.to_dict() if layout == "specforge" else c.to_speculators(verifier)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    if layout == "speculators":
        state = {("layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k: v
                 for k, v in state.items()}
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    return folder


def random_head(config: HeadConfig, seed: int = 0, draft_ids: list[int] | None = None) -> Eagle3Head:
    """A head with seeded random weights (tests, and the start of training), its draft vocabulary the target ids
    ``draft_ids`` (default: the first ``draft_vocab_size``)."""
    gen = torch.Generator().manual_seed(seed)
    head = Eagle3Head(config)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / math.sqrt(p.shape[1])))
    head.set_target_ids(torch.tensor(draft_ids if draft_ids is not None else range(config.draft_vocab_size),
                                     dtype=torch.long))
    return head.eval()

"""Shared decoder math for every family: norms, RoPE, attention, dense and MoE FFN.

Model code is pure math. It never holds weights: each block asks the `WeightStore` for a tensor by its HF
checkpoint name just before use, and lets it go when the block returns. Shapes use T = tokens in this pass,
D = hidden size, H / Hkv = query / key-value heads, Dh = head dim, S = cached positions.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
import torch.nn.functional as F

from colibri import kernels
from colibri.core.errors import UnsupportedModelError
from colibri.kernels import ops
from colibri.kernels.ops import linear

if TYPE_CHECKING:
    from colibri.weights.store import WeightStore

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass
class ModelArgs:
    """Everything the math needs, normalized from a checkpoint's own config (HF config.json or GGUF)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False  # bias on q/k/v projections (qwen2)
    o_bias: bool = False  # bias on the output projection (llama with attention_bias)
    qk_norm: str | None = None  # None | "head" (RMSNorm per head: qwen3, gemma3) | "full" (over all heads: olmoe)
    clip_qkv: float | None = None
    gemma_norm: bool = False  # RMSNorm scales by (1 + w), computed in f32
    sandwich_norm: bool = False  # gemma3: extra norms after attention and around the FFN
    embed_scale: float | None = None  # gemma: embeddings multiplied by sqrt(D)
    attn_scale: float | None = None  # default Dh ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # per layer FULL / SLIDING
    rope: dict[str, dict[str, Any]] = field(default_factory=dict)  # layer type -> rope parameters
    # Mixture of experts
    num_experts: int = 0
    top_k: int = 0
    norm_topk_prob: bool = False
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: list[bool] = field(default_factory=list)
    moe_prefix: str = "mlp"  # "block_sparse_moe" for mixtral
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_layers
        if not self.moe_layers:
            self.moe_layers = [self.num_experts > 0] * self.num_layers


# ---------------------------------------------------------------------------------------------- config helpers


def get(cfg: dict, *keys: str, default: Any = None) -> Any:
    """First present, non-None value among `keys` in a config dict."""
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def as_id_list(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]


def rope_params(cfg: dict, theta_default: float = 10000.0) -> dict[str, Any]:
    """One rope-parameter dict from either transformers-5 `rope_parameters` or legacy `rope_theta`/`rope_scaling`."""
    rp = dict(cfg.get("rope_parameters") or {})
    if FULL in rp or SLIDING in rp:  # per-layer-type form; caller picks
        return rp
    legacy = dict(cfg.get("rope_scaling") or {})
    out = {**legacy, **rp}
    if "type" in out and "rope_type" not in out:
        out["rope_type"] = out.pop("type")
    out.setdefault("rope_type", "default")
    out.setdefault("rope_theta", float(get(cfg, "rope_theta", default=theta_default)))
    return out


def base_args(cfg: dict, **overrides: Any) -> ModelArgs:
    """Fields shared by llama-like configs; families pass what differs as overrides."""
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kw: dict[str, Any] = dict(
        model_type=cfg["model_type"],
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(get(cfg, "intermediate_size", default=0)),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(get(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(get(cfg, "head_dim", default=hidden // heads)),
        rms_norm_eps=float(get(cfg, "rms_norm_eps", default=1e-6)),
        max_position_embeddings=int(get(cfg, "max_position_embeddings", default=4096)),
        tie_word_embeddings=bool(get(cfg, "tie_word_embeddings", default=False)),
        hidden_act=get(cfg, "hidden_act", "hidden_activation", default="silu"),
        bos_token_id=get(cfg, "bos_token_id"),
        eos_token_id=as_id_list(cfg.get("eos_token_id")),
    )
    kw.update(overrides)
    if "rope" not in kw:
        rp = rope_params(cfg)
        kw["rope"] = {FULL: rp, SLIDING: rp}
    return ModelArgs(**kw)


# ---------------------------------------------------------------------------------------------- building blocks

def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# through ops.pointwise: an element's activation must not depend on the size of the pass (batch invariance)
_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": lambda x: ops.pointwise(F.silu, x),
    "swish": lambda x: ops.pointwise(F.silu, x),
    "gelu": lambda x: ops.pointwise(F.gelu, x),
    "gelu_pytorch_tanh": lambda x: ops.pointwise(_gelu_tanh, x),
    "gelu_new": lambda x: ops.pointwise(_gelu_tanh, x),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTS:
        raise UnsupportedModelError(f"activation {name!r} is not supported (supported: {', '.join(_ACTS)})")
    return _ACTS[name]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """RMSNorm in f32. Llama casts back before scaling by w; gemma scales by (1 + w) in f32, then casts."""
    return ops.rms_norm(x, w, eps, gemma)


def inv_frequencies(p: dict[str, Any], head_dim: int) -> torch.Tensor:
    """RoPE inverse frequencies [Dh/2] for one rope-parameter dict (default, linear, llama3)."""
    dim = int(head_dim * p.get("partial_rotary_factor", 1.0))
    base = float(p.get("rope_theta", 10000.0))
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = p.get("rope_type", "default")
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(p["factor"])
    if kind == "llama3":
        factor, lo, hi = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old_ctx = float(p["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / hi) * ~(wavelen > old_ctx / lo)
        return torch.where(medium, smoothed, scaled)
    raise UnsupportedModelError(f"RoPE type {kind!r} is not supported (supported: default, linear, llama3)")


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin: [T, Dh] for absolute positions [T], computed in f32 then cast (as HF does)."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [H, T, Dh]; rotate-half convention (HF layout)."""
    return ops.rope(x, cos, sin)


def attend(q: torch.Tensor, k: torch.Tensor | ops.Paged, v: torch.Tensor | ops.Paged, positions: torch.Tensor,
           window: int | None, scale: float, softcap: float | None) -> torch.Tensor:
    """Attention, q: [H, T, Dh] at `positions` [T], k/v: [Hkv, S, Dh] or `ops.Paged` (key j at position j) ->
    [H, T, Dh] in q's dtype; a query at p sees keys p - window < j <= p. Batch-invariant: see
    `colibri.kernels.ops.attend`."""
    return ops.attend(q, k, v, positions, window, scale, softcap)


# ---------------------------------------------------------------------------------------------- a pass's input


class SequenceKV(Protocol):
    """What attention needs from one sequence's KV: room for this pass's positions, reserved by the caller."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor | ops.Paged,
                                                                             torch.Tensor | ops.Paged]:
        """Write k, v [Hkv, T, Dh] after the sequence's committed positions; return K and V of every position so
        far, these included ([Hkv, S, Dh] in the compute dtype: tensors, or `ops.Paged` blocks read in place)."""

    def room(self, layer: int, tokens: int) -> tuple[ops.Paged, ops.Paged] | None:
        """K and V of every position so far and this pass's `tokens` more, as `ops.Paged` blocks whose rows of the
        new positions the caller writes (`ops.rope_attend`); None where the rows go through `update` instead."""

    def rooms(self, tokens: int) -> list[tuple[ops.Paged, ops.Paged]] | None:
        """`room` of every layer at once (for a pass that runs all layers in one call); None where the layers'
        rooms cannot all be held at once, or `room` gives None."""


@dataclass
class Batch:
    """One forward pass: the packed tokens of several sequences.

    tokens / positions: [T] long, each token's id and its position in its own sequence; spans: per sequence, its
    rows [start, end) of the packed tokens (consecutive positions, after its committed ones); kv: per sequence,
    its KV; logit_rows: [R] long, the packed rows whose logits the pass returns."""

    tokens: torch.Tensor
    positions: torch.Tensor
    spans: list[tuple[int, int]]
    kv: list[SequenceKV]
    logit_rows: torch.Tensor

    @classmethod
    def pack(cls, parts: list[tuple[list[int], int, SequenceKV, int]]) -> "Batch":
        """From (token ids, first position, KV, logits_from) per sequence: rows logits_from.. of the sequence's
        tokens get logits (0: every row; len(ids) - 1: its last only)."""
        tokens, positions, spans, kvs, rows = [], [], [], [], []
        for ids, start, kv, logits_from in parts:
            s = len(tokens)
            tokens.extend(ids)
            positions.extend(range(start, start + len(ids)))
            spans.append((s, len(tokens)))
            kvs.append(kv)
            rows.extend(range(s + logits_from, len(tokens)))
        as_long = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
        return cls(as_long(tokens), as_long(positions), spans, kvs, as_long(rows))


# ---------------------------------------------------------------------------------------------- the FFN's hook


class FFNHook(Protocol):
    """What a dense FFN layer's hidden product goes through when a hook is set (`DecoderModel.ffn_hook`): the
    LOSSY sparse FFN (runtime/sparsity.py) masks it, its calibration records it."""

    def hidden(self, layer: int, a: torch.Tensor, u: torch.Tensor, down) -> torch.Tensor:
        """a = act(gate x), u = up x: [T, I] -> the hidden product [T, I] that `down` [D, I] is applied to. Row t
        of the result must depend on row t of a and u alone (batch invariance)."""


# ---------------------------------------------------------------------------------------------- the decoder


class DecoderModel:
    """A pre-norm decoder-only transformer covering every supported family through ModelArgs flags."""

    ffn_hook: FFNHook | None = None  # the dense FFN layers' hidden product goes through it when set
    # LOSSY int8 activations in this model's passes (kernels.int8_mode; None: the process's setting)
    lossy_int8: bool | None = None

    def __init__(self, args: ModelArgs):
        self.args = args
        self.act = activation(args.hidden_act)
        # the block is norm, attention, norm, gated silu FFN with nothing between (llama, qwen2, mistral): its dense
        # layers may run as one native call (_block_call)
        self.one_call_blocks = not (args.sandwich_norm or args.gemma_norm or args.qk_norm or args.o_bias) and \
            args.clip_qkv is None and args.hidden_act in ("silu", "swish")
        # per layer: its two norms' names, the q / k / v biases' (or None), the seven linears' (q, k, v, o, gate, up,
        # down): what _block_call asks the store for
        self.block_names = [self._block_names(i) for i in range(args.num_layers)]
        # ... and all of them, layer after layer: what _blocks_call checks its kept blocks against
        self.layers_names = [n for norms, bias, names in self.block_names for n in norms + names + (bias or [])]
        self.inv_freq = {t: inv_frequencies(args.rope[t], args.head_dim) for t in set(args.layer_types)}
        self.scale = args.attn_scale if args.attn_scale is not None else args.head_dim ** -0.5

    # -- names: HF checkpoint names, the store's keys -------------------------------------------------

    @staticmethod
    def layer_prefix(i: int) -> str:
        return f"model.layers.{i}."

    def lm_head_name(self) -> str:
        return "model.embed_tokens.weight" if self.args.tie_word_embeddings else "lm_head.weight"

    def expert_names(self, i: int, e: int) -> list[str]:
        a = self.args
        base = f"{self.layer_prefix(i)}{a.moe_prefix}.experts.{e}."
        return [f"{base}{p}.weight" for p in a.expert_proj]

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the forward pass reads, with its HF shape: used to validate a checkpoint up front."""
        a = self.args
        d, hd = a.hidden_size, a.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (a.vocab_size, d), "model.norm.weight": (d,)}
        if not a.tie_word_embeddings:
            shapes["lm_head.weight"] = (a.vocab_size, d)
        for i in range(a.num_layers):
            p = self.layer_prefix(i)
            att = p + "self_attn."
            shapes[att + "q_proj.weight"] = (a.num_heads * hd, d)
            shapes[att + "k_proj.weight"] = (a.num_kv_heads * hd, d)
            shapes[att + "v_proj.weight"] = (a.num_kv_heads * hd, d)
            shapes[att + "o_proj.weight"] = (d, a.num_heads * hd)
            if a.attention_bias:
                shapes[att + "q_proj.bias"] = (a.num_heads * hd,)
                shapes[att + "k_proj.bias"] = (a.num_kv_heads * hd,)
                shapes[att + "v_proj.bias"] = (a.num_kv_heads * hd,)
            if a.o_bias:
                shapes[att + "o_proj.bias"] = (d,)
            if a.qk_norm == "head":
                shapes[att + "q_norm.weight"] = (hd,)
                shapes[att + "k_norm.weight"] = (hd,)
            elif a.qk_norm == "full":
                shapes[att + "q_norm.weight"] = (a.num_heads * hd,)
                shapes[att + "k_norm.weight"] = (a.num_kv_heads * hd,)
            shapes[p + "input_layernorm.weight"] = (d,)
            shapes[p + "post_attention_layernorm.weight"] = (d,)
            if a.sandwich_norm:
                shapes[p + "pre_feedforward_layernorm.weight"] = (d,)
                shapes[p + "post_feedforward_layernorm.weight"] = (d,)
            if a.moe_layers[i]:
                m = f"{p}{a.moe_prefix}."
                shapes[m + "gate.weight"] = (a.num_experts, d)
                for e in range(a.num_experts):
                    g, u, dn = self.expert_names(i, e)
                    shapes[g] = shapes[u] = (a.moe_intermediate_size, d)
                    shapes[dn] = (d, a.moe_intermediate_size)
                if a.shared_expert_intermediate_size:
                    s = m + "shared_expert."
                    shapes[s + "gate_proj.weight"] = shapes[s + "up_proj.weight"] = (a.shared_expert_intermediate_size, d)
                    shapes[s + "down_proj.weight"] = (d, a.shared_expert_intermediate_size)
                    shapes[m + "shared_expert_gate.weight"] = (1, d)
            else:
                shapes[p + "mlp.gate_proj.weight"] = shapes[p + "mlp.up_proj.weight"] = (a.intermediate_size, d)
                shapes[p + "mlp.down_proj.weight"] = (d, a.intermediate_size)
        return shapes

    # -- forward --------------------------------------------------------------------------------------

    def norm(self, x: torch.Tensor, store: "WeightStore", name: str) -> torch.Tensor:
        return rms_norm(x, store.get(name), self.args.rms_norm_eps, self.args.gemma_norm)

    def forward(self, store: "WeightStore", batch: "Batch", hidden: bool = False) -> torch.Tensor:
        """One pass over the packed tokens of several sequences -> logits [R, V] of `batch.logit_rows` (hidden:
        the final norm's output [R, D] there instead, the hidden states the head would read: embeddings).

        Embedding, norms, projections, the FFN and MoE routing run over all T packed tokens at once, so each
        weight is fetched once per pass whatever the number of sequences (for MoE, the union of the experts the
        tokens route to); attention runs per sequence over its own keys. Each sequence's KV must have room for
        its span reserved by the caller, who also commits the positions afterwards: the math keeps no state."""
        with kernels.int8_mode(self.lossy_int8):
            return self._forward(store, batch, hidden)

    def _forward(self, store: "WeightStore", batch: "Batch", hidden: bool) -> torch.Tensor:
        a = self.args
        tokens, positions = batch.tokens, batch.positions
        store.begin_pass(tokens.shape[0], longest=max(b - s for s, b in batch.spans))
        x = store.rows("model.embed_tokens.weight", tokens)  # [T, D]
        if a.embed_scale is not None:
            x = x * torch.tensor(a.embed_scale, dtype=x.dtype)
        rope = {t: rope_cos_sin(f, positions, x.dtype) for t, f in self.inv_freq.items()}  # [T, Dh] each
        y = self._blocks_call(store, x, batch, rope)
        if y is not None:
            x = y
        else:
            for i in range(a.num_layers):
                with store.layer(i):
                    x = self.block(store, i, x, batch, rope[a.layer_types[i]])
        x = x[batch.logit_rows]  # [R, D]
        with store.layer(a.num_layers):  # the head's scope
            x = self.norm(x, store, "model.norm.weight")
            if hidden:
                return x
            parts = [linear(x, w) for w in store.row_blocks(self.lm_head_name())]  # vocab blocks when streamed
            logits = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        if a.final_softcap is not None:
            logits = torch.tanh(logits / a.final_softcap) * a.final_softcap
        return logits

    def block(self, store, i, x, batch: "Batch", rope) -> torch.Tensor:
        a, p = self.args, self.layer_prefix(i)
        if self.one_call_blocks and len(batch.kv) == 1 and not a.moe_layers[i] and self.ffn_hook is None:
            y = self._block_call(store, i, x, batch, rope)
            if y is not None:
                return y
        h = self.attention(store, i, self.norm(x, store, p + "input_layernorm.weight"), batch, rope)
        if a.sandwich_norm:
            h = self.norm(h, store, p + "post_attention_layernorm.weight")
            x = x + h
            h = self.norm(x, store, p + "pre_feedforward_layernorm.weight")
            h = self.moe(store, i, h, x) if a.moe_layers[i] else self.mlp(store, p + "mlp.", h, i)
            return x + self.norm(h, store, p + "post_feedforward_layernorm.weight")
        x = x + h
        h = self.norm(x, store, p + "post_attention_layernorm.weight")
        h = self.moe(store, i, h, x) if a.moe_layers[i] else self.mlp(store, p + "mlp.", h, i)
        return x + h

    def _block_names(self, i: int) -> tuple[list[str], list[str] | None, list[str]]:
        p = self.layer_prefix(i)
        att, mlp = p + "self_attn.", p + "mlp."
        return ([p + "input_layernorm.weight", p + "post_attention_layernorm.weight"],
                [att + n + "_proj.bias" for n in "qkv"] if self.args.attention_bias else None,
                [att + n + "_proj.weight" for n in "qkvo"] + [mlp + n + "_proj.weight" for n in ("gate", "up", "down")])

    def _block_call(self, store, i, x, batch: "Batch", rope) -> torch.Tensor | None:
        """`block` for one sequence as one native call (ops.DenseBlock: the same bits as the calls `block` makes,
        which a decode step paid for with cold caches) where each of them has its native form; None otherwise."""
        block = self._layer_block(store, i, x, rope)
        if block is None:
            return None
        room = batch.kv[0].room(i, x.shape[0])
        if room is None or room[0].blocks[0].dtype != x.dtype:  # (q8 blocks: `update` quantizes the rows)
            return None
        window = self.args.sliding_window if self.args.layer_types[i] == SLIDING else None
        return block(x, *rope, *room, batch.positions, window, self.scale, self.args.attn_softcap)

    def _blocks_call(self, store, x, batch: "Batch", rope: dict) -> torch.Tensor | None:
        """Every layer for one sequence as one native call (ops.DenseLayers: the same bits as `block`'s calls, layer
        after layer) where each layer has its one-call block, the store keeps every weight resident (no layer's
        scope has work to do) and the KV has every layer's room at once; None otherwise. A layer's Python between
        two native calls ran after the weights' stream had evicted it; here all of it runs first, at once."""
        a = self.args
        if (not self.one_call_blocks or store.placement is not None or len(batch.kv) != 1 or any(a.moe_layers)
                or self.ffn_hook is not None or not self._one_call_input(x, rope.values())):
            return None
        ropes = [rope[t] for t in a.layer_types]
        used = [store.get(n) for n in self.layers_names]
        # kept with the weights it was made of, as each layer's block (a tensor the store's were replaced by makes
        # new blocks); one check of every weight, not a layer's block looked up at a time
        _, layers = store.derived(("dense_layers", x.dtype, kernels.tier(), kernels.int8_activations()),
                                  lambda: (used, self._dense_layers(store, x, ropes)),
                                  lambda kept: all(map(operator.is_, kept[0], used)))
        rooms = batch.kv[0].rooms(x.shape[0]) if layers is not None else None
        if rooms is None or rooms[0][0].blocks[0].dtype != x.dtype:
            return None
        windows = [a.sliding_window if t == SLIDING else None for t in a.layer_types]
        return layers(x, ropes, rooms, batch.positions, windows, self.scale, a.attn_softcap)

    def _dense_layers(self, store, x: torch.Tensor, ropes: list) -> ops.DenseLayers | None:
        """Every layer's block laid end to end for one call; None where a layer has no one-call form."""
        blocks = [self._layer_block(store, i, x, ropes[i]) for i in range(self.args.num_layers)]
        return None if any(b is None for b in blocks) else ops.DenseLayers.of(blocks)

    @staticmethod
    def _one_call_input(x: torch.Tensor, ropes) -> bool:
        """Whether activations x ([T, D], T > 0) and the (cos, sin) pairs `ropes` are what the one-call blocks take."""
        dt = x.dtype
        return (x.dim() == 2 and x.is_contiguous() and dt in (torch.float32, torch.bfloat16) and x.shape[0] > 0
                and all(c.dtype == dt and s.dtype == dt for c, s in ropes))

    def _layer_block(self, store, i: int, x: torch.Tensor, rope) -> ops.DenseBlock | None:
        """Layer i's DenseBlock for activations like x, made once where the store keeps its weights; None where the
        layer has no one-call form for them."""
        dt = x.dtype
        if not self._one_call_input(x, [rope]):
            return None
        norm_names, bias_names, names = self.block_names[i]
        used = [store.get(n) for n in norm_names + names + (bias_names or [])]
        # kept with the weights it was made of: a tensor the store's were replaced by (tests) makes a new block
        _, block = store.derived(("dense_block", i, dt, kernels.tier(), kernels.int8_activations()),
                                 lambda: (used, self._dense_block(used, bias_names is not None, x)),
                                 lambda kept: all(a is b for a, b in zip(kept[0], used)))
        return block

    def _dense_block(self, used: list, bias: bool, x: torch.Tensor) -> ops.DenseBlock | None:
        """A layer's weights (`used`: its two norms, q, k, v, o, gate, up, down, then the q, k, v biases where
        `bias`) as one native call takes them for activations like x; None where one lacks its native form."""
        norms, weights = used[:2], used[2:9]
        if norms[0].dtype != x.dtype or norms[1].dtype != x.dtype:
            return None
        linears = [ops.native_linear(x, w) for w in weights]
        if any(call is None for call in linears):
            return None
        return ops.DenseBlock.of(norms, self.args.rms_norm_eps, linears, used[9:] if bias else None, x.dtype)

    def attention(self, store, i, x, batch: "Batch", rope) -> torch.Tensor:
        a = self.args
        att = self.layer_prefix(i) + "self_attn."
        bias = [store.get(att + n + "_proj.bias") for n in "qkv"] if a.attention_bias else None
        # with nothing between the projections and RoPE, attention's own call adds their biases (attend_sequence)
        late = a.qk_norm is None and a.clip_qkv is None
        q, k, v = (linear(x, store.get(f"{att}{n}_proj.weight"), None if late or bias is None else bias[j])
                   for j, n in enumerate("qkv"))  # [T, H*Dh], [T, Hkv*Dh], [T, Hkv*Dh]
        bias = bias if late else None
        if a.qk_norm == "full":
            q = self.norm(q, store, att + "q_norm.weight")
            k = self.norm(k, store, att + "k_norm.weight")
        if a.clip_qkv is not None:
            q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        T = x.shape[0]
        if a.qk_norm == "head":  # over each head's Dh values: [T, H, Dh] views
            q = self.norm(q.view(T, a.num_heads, a.head_dim), store, att + "q_norm.weight")
            k = self.norm(k.view(T, a.num_kv_heads, a.head_dim), store, att + "k_norm.weight")
        window = a.sliding_window if a.layer_types[i] == SLIDING else None
        if len(batch.kv) == 1:  # one sequence (a decode step, a prefill chunk): no slices, no copy into o
            o = self.attend_sequence(batch.kv[0], i, q, k, v, bias, rope, batch.positions, window)
        else:
            o, (cos, sin) = q.new_empty(T, a.num_heads * a.head_dim), rope
            for (s, e), kv in zip(batch.spans, batch.kv):  # each sequence attends to its own keys only
                o[s:e] = self.attend_sequence(kv, i, q[s:e], k[s:e], v[s:e], bias, (cos[s:e], sin[s:e]),
                                              batch.positions[s:e], window)
        return linear(o, store.get(att + "o_proj.weight"), store.get(att + "o_proj.bias") if a.o_bias else None)

    def attend_sequence(self, kv: SequenceKV, i: int, q, k, v, bias, rope, positions, window) -> torch.Tensor:
        """One sequence's rows of a pass: q [T, H * Dh], k, v [T, Hkv * Dh] before RoPE (or [T, heads, Dh]), their
        biases still to add (q, k, v) or None, cos / sin [T, Dh] -> attention's output [T, H * Dh], its keys and
        values stored in kv along the way."""
        a = self.args
        cos, sin = rope
        room = kv.room(i, q.shape[0])
        if room is not None:  # blocks the pass's rows go into as they are: one call (ops.rope_attend)
            return ops.rope_attend(q, k, v, cos, sin, *room, positions, window, self.scale, a.attn_softcap, bias)
        for t, b in zip((q, k, v), bias or ()):  # (the projections' own outputs: added in place)
            ops.add_bias(t, b)
        T = q.shape[0]
        q = q.view(T, a.num_heads, a.head_dim).transpose(0, 1)  # [H, T, Dh]
        k = k.view(T, a.num_kv_heads, a.head_dim).transpose(0, 1)
        v = v.view(T, a.num_kv_heads, a.head_dim).transpose(0, 1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = kv.update(i, k, v)  # [Hkv, S, Dh]: the sequence's positions so far and these
        o = attend(q, keys, values, positions, window, self.scale, a.attn_softcap)
        return o.transpose(0, 1).reshape(T, a.num_heads * a.head_dim)

    def mlp(self, store, prefix: str, x: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """The gated FFN; `layer`: a dense model's FFN layer (not a shared expert), which the hook sees."""
        g = linear(x, store.get(prefix + "gate_proj.weight"))
        u = linear(x, store.get(prefix + "up_proj.weight"))
        down = store.get(prefix + "down_proj.weight")
        if layer is not None and self.ffn_hook is not None:
            return linear(self.ffn_hook.hidden(layer, self.act(g), u, down), down)
        return linear(self.act(g) * u, down)

    def expert(self, store, names: list[str], x: torch.Tensor) -> torch.Tensor:
        g, u, d = names
        return linear(self.act(linear(x, store.get(g))) * linear(x, store.get(u)), store.get(d))

    def moe(self, store, i: int, x: torch.Tensor, resid: torch.Tensor | None = None) -> torch.Tensor:
        """Routed experts (softmax, top-k, optional renormalization) plus an optional gated shared expert.
        resid: the residual stream x is normed from, for the next layer's router lookahead."""
        a = self.args
        m = f"{self.layer_prefix(i)}{a.moe_prefix}."
        router_logits = linear(x, store.get(m + "gate.weight"))  # [T, E]
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, a.top_k, dim=-1)  # [T, k]
        if a.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(x.dtype)
        uses = Counter(top_i.flatten().tolist())
        names = {e: self.expert_names(i, e) for e in sorted(uses)}
        routed = store.route(i, dict(uses), names)  # the order to compute them in: resident ones first
        if resid is not None:
            self.lookahead(store, i + 1, resid)  # layer i's demand reads are queued first: they keep priority
        ys = {}
        for e in routed:
            tok, slot = torch.where(top_i == e)
            with store.expert(i, e):
                ys[e] = (tok, self.expert(store, names[e], x[tok]) * top_w[tok, slot, None])
        out = torch.zeros_like(x)
        for e in sorted(ys):  # summed in expert order whatever the compute order: placement never changes results
            out.index_add_(0, *ys[e])
        if a.shared_expert_intermediate_size:
            s = self.mlp(store, m + "shared_expert.", x)
            out = out + ops.pointwise(torch.sigmoid, linear(x, store.get(m + "shared_expert_gate.weight"))) * s
        return out

    def lookahead(self, store, j: int, resid: torch.Tensor) -> None:
        """Guess layer j's experts before layer j - 1's are computed: layer j's FFN norm and router applied to
        the residual stream as it stands now (it changes little from one layer to the next), so the store can
        read the guessed experts while layer j - 1 computes. Only a hint: the routing itself is computed from
        the real input, so a wrong guess costs a read, never a different token. Skipped when the router's
        weights are not resident yet (never waited for)."""
        a = self.args
        if j >= a.num_layers or not a.moe_layers[j] or not store.wants_lookahead(j):
            return
        p = self.layer_prefix(j)
        norm = store.peek(p + ("pre_feedforward_layernorm.weight" if a.sandwich_norm
                               else "post_attention_layernorm.weight"))
        gate = store.peek(f"{p}{a.moe_prefix}.gate.weight")
        if norm is None or gate is None:
            return
        h = rms_norm(resid, norm, a.rms_norm_eps, a.gemma_norm)
        top_i = torch.topk(linear(h, gate), a.top_k, dim=-1).indices  # [T, k]: softmax keeps the order
        uses = Counter(top_i.flatten().tolist())
        store.predict(j, dict(uses), {e: self.expert_names(j, e) for e in sorted(uses)})

"""What a memory budget holds besides the weights: the KV cache for the context and one forward pass's activations.

`--memory-limit` bounds what the engine allocates for a model: resident and staged weights, the KV cache, and
the activations of a forward pass of up to `--batch-size` tokens (for generation; the [T, vocab] logits that
`Model.logits()` returns are the caller's, outside it). The runtime baseline (the Python interpreter,
torch, the tokenizer and the manifest, all present before the first weight is read) is outside it; `Model`
measures and reports it. The planner first sets aside `reserve_bytes` from the limit and places weights in the
rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from colibri.core.config import EngineConfig
from colibri.core.errors import InputError

LIMITED_CTX = 4096  # default context under a memory limit: its KV cache is reserved up front...
KV_SHARE = 0.25  # ...and halved (down to MIN_CTX) while that KV cache would take more of the limit than this
MIN_CTX = 256
# Allocator slack on top of the activation estimate: temporaries of the quantized kernels and glibc's own...
SLACK = 1.25
PASS_FIXED = 4 << 20  # ...and what any pass touches besides its tensors (kernel threads' scratch, heap growth)


def kv_layout(args, dtype: torch.dtype, quant: str | None = None, block: int | None = None):
    """The model's KV layout; `block` None: the model's default block size (kv.block_for)."""
    from colibri.kv.cache import KVLayout, block_for
    shape = (args.num_layers, args.num_kv_heads, args.head_dim, dtype)
    return KVLayout(*shape, block or block_for(*shape, quant), quant)


def kv_bytes(args, ctx: int, dtype: torch.dtype, quant: str | None = None) -> int:
    """K and V (and their scales when quantized) for `ctx` positions in every layer."""
    return kv_layout(args, dtype, quant).token_bytes * ctx


def activation_bytes(args, batch: int, ctx: int, dtype: torch.dtype, rows: int = 1) -> int:
    """Peak of one forward pass over `batch` tokens attending to `ctx` positions, `rows` of them getting logits
    (the largest moment: one layer's attention and FFN, or the head, with the residual stream alive), with
    allocator slack. The terms are the tensors the pass allocates (models.base, ops, the kernels); the KV cache
    and its assembly scratch are the KV plan's."""
    b = dtype.itemsize
    T, S, d = batch, ctx, args.hidden_size
    H, Hkv, Dh = args.num_heads, args.num_kv_heads, args.head_dim
    residual = 5 * T * d * b  # the embedded rows, x, the normed input, the branch output, the sum
    qkv = T * (H + 2 * Hkv) * Dh * b
    rope = 3 * T * (H + Hkv) * Dh * b  # apply_rope's rotated copy and two products beside q and k
    # ops.attend: the output [H, T, Dh] (empty_like q), the kernel's f32 result and its cast, the transposed copy
    # for o_proj; the torch fallback adds an f32 query and one query's f32 copies of its visible keys and values
    attn = T * H * Dh * (3 * b + 4) + T * H * Dh * 4 + 2 * Hkv * S * Dh * 4
    inter = max(args.intermediate_size if not all(args.moe_layers) else 0,
                (args.moe_intermediate_size or 0) + (args.shared_expert_intermediate_size or 0))
    # gate, up, act(gate) and the product; routed experts' outputs are kept until summed in expert order
    ffn = 4 * T * inter * b + (T * args.num_experts * 4 * 3 + T * args.top_k * d * b if args.num_experts else 0)
    # the head's rows: its output blocks, their concatenation and the f32 logits the sampler reads
    head = rows * args.vocab_size * (2 * b + 4) + rows * d * b
    # attention's and the FFN's temporaries are counted together: the small ones freed after attention stay in
    # the heap while the FFN allocates, so a layer's peak is above either alone
    return int(SLACK * (residual + max(qkv + rope + attn + ffn, head))) + PASS_FIXED


def context_length(args, ctx_length: int | None, limit: int | None, dtype: torch.dtype,
                   quant: str | None = None) -> int:
    """The maximum context. Set: checked against the model's. Unset: the model's own without a memory limit (the
    KV cache grows as used); under a limit, where its KV cache is reserved up front, at most LIMITED_CTX and
    halved while that cache would exceed KV_SHARE of the limit."""
    top = args.max_position_embeddings
    if ctx_length is not None:
        ctx = int(ctx_length)
        if not 1 <= ctx <= top:
            raise InputError(f"--ctx-length {ctx_length} is outside 1..{top}, the context this model supports")
        return ctx
    if limit is None:
        return top
    ctx = min(top, LIMITED_CTX)
    while ctx > MIN_CTX and kv_bytes(args, ctx, dtype, quant) > KV_SHARE * limit:
        ctx //= 2
    return ctx


@dataclass
class KVPlan:
    """How the KV cache uses its share: `window` positions of the live sequence in RAM (None: the whole
    context), `prefix_ram` bytes of cached prefixes, and `working` bytes of read buffers for the blocks on disk."""
    layout: object
    ctx: int
    window: int | None
    prefix_ram: int
    working: int

    @property
    def offload(self) -> bool:
        return self.window is not None

    @property
    def ram_bytes(self) -> int:
        lay = self.layout
        held = self.window if self.window is not None else -(-self.ctx // lay.block) * lay.block
        return held * lay.token_bytes + self.prefix_ram + self.working

    def as_dict(self) -> dict:
        return {"kv_window_tokens": self.window if self.window is not None else self.ctx,
                "kv_offload": self.offload, "kv_prefix_ram_bytes": self.prefix_ram,
                "kv_working_bytes": self.working, "kv_quant": self.layout.quant, "kv_block_tokens": self.layout.block}


def kv_working_bytes(lay, full: int) -> int:
    """RAM an offloaded context needs besides its window: two read buffers of its blocks (attention reads every
    block where it is, q8 ones too: no dequantized copy of the context)."""
    return 2 * (full // lay.block) * lay.seg_bytes


def kv_plan(args, ctx: int, dtype: torch.dtype, limit: int | None, kv_ram: int | None = None,
            quant: str | None = None, block: int | None = None, explicit_ctx: bool = True,
            spare: int | None = None) -> KVPlan:
    """Split the KV share. `kv_ram` (bytes) set: the live window and the prefix cache share it. Unset: without a
    memory limit the whole context stays in RAM and as much again may cache prefixes; under a limit the
    context's KV stays in RAM (the default context was chosen to fit), unless a context asked for explicitly
    does not fit KV_SHARE of the limit or the `spare` bytes (the limit less the activations and the weights'
    minimum working set): then the largest window that fits both is kept in RAM and older blocks go to disk.
    Bounding the window by `spare` makes acceptance upward-closed: a larger limit never gets a window that no
    longer fits beside the rest."""
    lay = kv_layout(args, dtype, quant, block)
    full = -(-ctx // lay.block) * lay.block
    ctx_bytes = full * lay.token_bytes
    if kv_ram is None:
        if limit is None:
            return KVPlan(lay, ctx, None, ctx_bytes, 0)
        share = int(KV_SHARE * limit)
        room = share if spare is None else min(share, spare - kv_working_bytes(lay, full))
        fits_whole = ctx_bytes <= share and (spare is None or ctx_bytes <= spare)
        if fits_whole or not explicit_ctx or room // lay.token_bytes < 2 * lay.block:
            # (a limit too small for it is refused with the minimum)
            return KVPlan(lay, ctx, None, 0, 0)
        kv_ram = room
    window = kv_ram // lay.token_bytes // lay.block * lay.block
    if window >= full:
        return KVPlan(lay, ctx, None, kv_ram - ctx_bytes, 0)
    if window < 2 * lay.block:
        raise InputError(f"a KV RAM share of {kv_ram} bytes holds {kv_ram // lay.token_bytes} tokens; it must hold "
                         f"at least {2 * lay.block} ({2 * lay.block * lay.token_bytes} bytes): raise --kv-ram")
    return KVPlan(lay, ctx, window, 0, kv_working_bytes(lay, full))


@dataclass
class Reserve:
    """The non-weight part of a budget."""
    ctx: int
    batch: int
    kv_bytes: int
    activation_bytes: int

    @property
    def total(self) -> int:
        return self.kv_bytes + self.activation_bytes

    def as_dict(self) -> dict:
        return {"ctx_length": self.ctx, "batch_size": self.batch, "kv_reserve_bytes": self.kv_bytes,
                "activation_reserve_bytes": self.activation_bytes}


def reserve(args, ctx: int, batch: int, dtype: torch.dtype, kv: KVPlan | None = None,
            limited: bool = True, quantized: bool = False, sequences: int = 1) -> Reserve:
    """The KV plan's RAM (without a limit, the prefix cache's default share is not a reservation) and the
    activations of one pass of `batch` tokens with logits for one row per sequence, plus the dequantize scratch
    quantized weights keep (quant.SCRATCH_BYTES)."""
    if int(batch) < 1:
        raise InputError(f"--batch-size must be at least 1 (got {batch})")
    kv = kv or kv_plan(args, ctx, dtype, None)
    held = kv.ram_bytes - (0 if limited else kv.prefix_ram)
    T = min(batch, ctx)
    return Reserve(ctx, batch, held, pass_bytes(args, dtype, quantized, T, ctx, min(T, sequences)))


def pass_bytes(args, dtype: torch.dtype, quantized: bool, tokens: int, ctx: int, rows: int) -> int:
    """What one pass needs besides the weights and the KV cache: its activations, and the dequantize scratch
    quantized weights keep (quant.SCRATCH_BYTES). The reserve holds it for the largest pass; the elastic budget
    asks it of each pass run."""
    from colibri.quant.kinds import SCRATCH_BYTES
    return activation_bytes(args, tokens, ctx, dtype, rows) + (SCRATCH_BYTES if quantized else 0)


@dataclass
class Settings:
    """What a load's options resolve to: the memory limit (bytes or None), context, KV plan, reserve."""
    memory_limit: int | None
    ctx: int
    kv: KVPlan
    reserve: Reserve


class BelowMinimum(InputError):
    """A memory limit under the working set of these settings (`settings(state_minimum=False)`: the message does
    not search for the smallest limit that would do)."""


def settings(args, dtype: torch.dtype, config: EngineConfig, quantized: bool = False,
             floor: int | None = None, state_minimum: bool = True) -> Settings:
    """Resolve a config's memory settings for a model: limit, context, KV plan and reserve. `floor`: the weights'
    minimum working set under a limit (placement.minimum_staging); given, a limit is accepted iff reserve + floor
    fits it, the automatic context is the largest that fits, and a refusal (BelowMinimum) states the smallest
    accepted limit, found with the same test, unless `state_minimum` is false (a caller that retries with other
    settings: the search is most of a refusal's cost)."""
    limit = config.memory_limit_bytes
    o = Options(args, dtype, config.ctx_length, config.batch_size, config.kv_ram_bytes, config.kv_quant,
                config.kv_block, quantized, config.max_sequences, floor)
    conf = _resolve(limit, o)
    if limit is not None and floor is not None and not _accepted(conf, floor):
        if not state_minimum:
            raise BelowMinimum(f"memory limit {_fmt(limit)} is below this model's minimum working set")
        least = minimum_limit(o, limit)
        raise BelowMinimum(f"memory limit {_fmt(limit)} is below this model's minimum working set of {_fmt(least)} "
                           f"(with the KV cache and activations for a {_resolve(least, o).ctx}-token context);"
                           " raise --memory-limit or lower --ctx-length / --batch-size")
    return conf


@dataclass(frozen=True)
class Options:
    """Everything but the limit that decides a load's memory settings: the model's args, the compute dtype, the
    context asked for (None: automatic), tokens per pass, the KV RAM asked for, KV quantization and block, whether
    the weights are quantized, sequences decoded together, and the weights' minimum working set (None: no limit
    test)."""
    args: object
    dtype: torch.dtype
    ctx_length: int | None
    batch: int
    kv_ram: int | None
    kv_quant: str | None
    kv_block: int | None
    quantized: bool
    sequences: int
    floor: int | None


def _fmt(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _accepted(conf: Settings, floor: int) -> bool:
    return conf.memory_limit >= conf.reserve.total + floor


def _resolve(limit: int | None, o: Options) -> Settings:
    """The settings a limit gets. The automatic context (none asked for, under a limit) is the largest of
    LIMITED_CTX, halved down to MIN_CTX, whose KV cache is at most KV_SHARE of the limit and whose reserve fits
    beside `o.floor`; the smallest when none does (then refused)."""
    args, dtype = o.args, o.dtype
    if o.ctx_length is not None or limit is None:
        ladder = [context_length(args, o.ctx_length, limit, dtype, o.kv_quant)]
    else:
        ladder = [min(args.max_position_embeddings, LIMITED_CTX)]
        while ladder[-1] > MIN_CTX:
            ladder.append(ladder[-1] // 2)
    limited = limit is not None
    for i, ctx in enumerate(ladder):
        act = reserve(args, ctx, o.batch, dtype, None, limited, o.quantized, o.sequences).activation_bytes
        spare = None if limit is None or o.floor is None else limit - o.floor - act
        kv = kv_plan(args, ctx, dtype, limit, o.kv_ram, o.kv_quant, o.kv_block, explicit_ctx=o.ctx_length is not None,
                     spare=spare)
        conf = Settings(limit, ctx, kv, reserve(args, ctx, o.batch, dtype, kv, limited, o.quantized, o.sequences))
        last = i == len(ladder) - 1
        if last or (kv_bytes(args, ctx, dtype, o.kv_quant) <= KV_SHARE * limit
                    and (o.floor is None or _accepted(conf, o.floor))):
            return conf
    raise AssertionError("unreachable: the ladder's last context is returned")


def minimum_limit(o: Options, upper: int) -> int:
    """The smallest limit `_resolve` accepts (bisection: acceptance is upward-closed by construction; the
    property test sweeps it). `upper` need not be accepted: the search doubles it until it is."""

    def ok(limit: int) -> bool:
        try:
            return _accepted(_resolve(limit, o), o.floor)
        except InputError:  # e.g. a KV window of under two blocks: not accepted at this limit
            return False

    hi = max(int(upper), 1)
    while not ok(hi):
        if hi > 1 << 50:
            raise InputError("no memory limit fits these settings; lower --ctx-length / --batch-size / --kv-ram")
        hi *= 2
    lo = 0  # not accepted
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi

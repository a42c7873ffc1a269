"""Kernels the model math calls. Weights may be plain tensors or quantized objects with their own matmul.

Both are batch-invariant (colibri.kernels): a row's result does not depend on the other rows in the pass, and a
query's attention output does not depend on the other queries nor on keys it cannot see.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from colibri import kernels


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w.T + b. x: [..., in], w: [out, in] (a tensor, or any object with `.linear(x, b)`) -> [..., out]."""
    if not isinstance(w, torch.Tensor):
        return w.linear(x, b)
    n, k = w.shape
    x2 = x.reshape(-1, k)
    if kernels.native() and x.dtype == w.dtype and x.dtype in (torch.float32, torch.bfloat16):
        y = kernels.library().dense_linear(x2.contiguous(), w.contiguous())
    else:
        y = kernels.blocked(lambda blk: kernels.padded_linear(blk, w), x2, n)
    if b is not None:
        add_bias(y, b)
    return y.reshape(*x.shape[:-1], n)


def native_linear(x: torch.Tensor, w) -> tuple[str, tuple, int] | None:
    """What `linear(x, w)` runs natively for a pass x [T, K] (f32 or bf16, contiguous): the op of the tier's
    library(), its arguments after x and the output's columns N; None where it runs torch's (w: as `linear` takes
    it, objects answering for themselves through `.native_op()`)."""
    if isinstance(w, torch.Tensor):
        if kernels.native() and x.dtype == w.dtype and x.dtype in (torch.float32, torch.bfloat16):
            return "dense_linear", (w.contiguous(),), w.shape[0]
        return None
    call = w.native_op()
    return None if call is None else (*call, w.shape[0])


_OP_INDEX = {name: i for i, name in enumerate(kernels.OPS)}  # the library's ops by their position (DenseBlock)


@dataclass(frozen=True)
class DenseBlock:
    """A dense decoder block's weights as one native call takes them (kernels/block.cpp), made once per layer where
    the store keeps its weights (WeightStore.derived): a decode step's call then does no work per weight in Python.

    Calling it runs the block: rms_norm(x, norms[0]); the q, k, v linears; `rope_attend` (its bias, cos ... softcap);
    the o linear and the residual; rms_norm(., norms[1]); gate, up; silu (through `pointwise`) times up; down and
    the residual. The same bits as those calls one by one, which a decode step made from Python with cold caches."""

    norms: list[torch.Tensor]
    eps: float
    ops: list[int]  # per linear (q, k, v, o, gate, up, down): its op's index in the library
    weights: list[torch.Tensor]  # the linears' tensors, in order
    counts: list[int]  # how many of them each linear takes
    groups: list[int]  # each linear's group size argument (0: none)
    cols: list[int]  # each linear's output columns
    bias: list[torch.Tensor]  # q, k, v biases in the activations' dtype (empty: none)

    @classmethod
    def of(cls, norms: list[torch.Tensor], eps: float, linears: list[tuple[str, tuple, int]],
           bias: list[torch.Tensor] | None, dtype: torch.dtype) -> "DenseBlock":
        """linears: `native_linear`'s answer for q, k, v, o, gate, up, down. The caller checks that each has its
        native form: the norms, bias and the activations (`dtype`) of one dtype, f32 or bf16, the blocks not q8."""
        ops, weights, counts, groups, cols = [], [], [], [], []
        for op, args, n in linears:
            tensors = [t for t in args if isinstance(t, torch.Tensor)]
            ops.append(_OP_INDEX[op])
            weights += tensors
            counts.append(len(tensors))
            groups.append(args[-1] if len(tensors) < len(args) else 0)
            cols.append(n)
        return cls(norms, float(eps), ops, weights, counts, groups, cols,
                   [] if bias is None else _as_dtype(bias, dtype))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: Paged, values: Paged,
                 positions: torch.Tensor, window: int | None, scale: float, softcap: float | None) -> torch.Tensor:
        return kernels.library().dense_block(x, self.norms, self.ops, self.weights, self.counts, self.groups,
                                             self.cols, self.bias, cos, sin, keys.blocks, values.blocks, keys.length,
                                             _int64(positions), window or 0, float(scale), float(softcap or 0),
                                             self.eps, _GRAIN)


@dataclass(frozen=True)
class DenseLayers:
    """Every layer's DenseBlock as one native call takes them (kernels/block.cpp's dense_blocks): their lists laid
    end to end, made once where the store keeps its weights. Calling it runs layer after layer, each as its block
    would, the output of one the input of the next: the same bits as the blocks' calls. Between two of those calls
    from Python the weights' stream had evicted the interpreter's code and data, so each layer's Python ran cold."""

    norms: list[torch.Tensor]
    eps: float
    ops: list[int]
    weights: list[torch.Tensor]
    counts: list[int]
    groups: list[int]
    cols: list[int]
    bias: list[torch.Tensor]

    @classmethod
    def of(cls, blocks: list[DenseBlock]) -> "DenseLayers | None":
        """None where the blocks differ in what the call takes once for all: the norms' eps, having biases."""
        if len({b.eps for b in blocks}) != 1 or len({bool(b.bias) for b in blocks}) != 1:
            return None
        def flat(field: str) -> list:
            return [v for b in blocks for v in getattr(b, field)]

        return cls(flat("norms"), blocks[0].eps, flat("ops"), flat("weights"), flat("counts"), flat("groups"),
                   flat("cols"), flat("bias"))

    def __call__(self, x: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]],
                 rooms: list[tuple[Paged, Paged]], positions: torch.Tensor, windows: list[int | None], scale: float,
                 softcap: float | None) -> torch.Tensor:
        """ropes, rooms, windows: per layer, its (cos, sin), (keys, values) and window, as a block takes them."""
        kb = [b for keys, _ in rooms for b in keys.blocks]
        vb = [b for _, values in rooms for b in values.blocks]
        return kernels.library().dense_blocks(x, self.norms, self.ops, self.weights, self.counts, self.groups,
                                              self.cols, self.bias, [c for c, _ in ropes], [s for _, s in ropes], kb,
                                              vb, [len(k.blocks) for k, _ in rooms], [k.length for k, _ in rooms],
                                              _int64(positions), [w or 0 for w in windows], float(scale),
                                              float(softcap or 0), self.eps, _GRAIN)


def _int64(positions: torch.Tensor) -> torch.Tensor:
    """Positions as the native ops take them (int64)."""
    return positions if positions.dtype == torch.int64 else positions.to(torch.int64)


def _as_dtype(bias: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Biases in the activations' dtype, converted only where it differs (as add_bias converts them)."""
    return [b if b.dtype == dtype else b.to(dtype) for b in bias]


def add_bias(y: torch.Tensor, b: torch.Tensor) -> None:
    """y += b in y's dtype, in place (y: a linear's fresh output [T, N], b: [N]). b is converted only where its
    dtype differs: a no-op .to is still a dispatcher call, and in a decode step each call runs with cold caches."""
    y += b if b.dtype == y.dtype else b.to(y.dtype)


# ATen's CPU loops compute an elementwise op in a vectorized body (two vectors per step: 64 elements for bf16 on
# AVX-512) and a scalar tail, and split loops of GRAIN or more elements across threads; for silu, sigmoid, gelu
# and rsqrt the two paths round differently, so one element's result depended on the tensor's size.
_VEC = 64
_GRAIN = 16384  # a multiple of _VEC, below at::internal::GRAIN_SIZE (32768): one thread runs each call


# the functions the native kernels run over the same pieces (kernels/pointwise.cpp: the same ATen kernel per piece,
# the pieces in parallel, no Python step per piece)
_NATIVE = {F.silu: "silu", torch.sigmoid: "sigmoid", torch.rsqrt: "rsqrt", F.gelu: "gelu"}


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, every element through the vectorized body (zero-padded to whole steps, in
    single-threaded pieces), so the result of an element never depends on the tensor around it."""
    n = x.numel()
    if n <= _GRAIN:  # one piece (a norm's T scale factors, a decode step's activations): no loop, no threads
        if n % _VEC == 0 and x.is_contiguous():
            return fn(x)
        return fn(F.pad(x.reshape(-1), (0, -n % _VEC)))[:n].view(x.shape)
    if fn in _NATIVE and kernels.native():  # (any size: the native op pads it as _pointwise_pieces does)
        return kernels.library().pointwise(x.contiguous().view(-1), _NATIVE[fn], _GRAIN).view(x.shape)
    return _pointwise_pieces(fn, x)


def write_rows(dst: list[torch.Tensor], src: list[torch.Tensor], offset: int) -> None:
    """dst[i][:, offset : offset + n] = src[i] for each i (dst [H, B, X], src [H, n, X]: a pass's K and V rows
    into a KV block, rows contiguous); one native call (kernels/rows.cpp)."""
    if kernels.native():  # (it checks the shapes, dtypes and strides)
        kernels.library().write_rows(dst, src, offset)
        return
    for d, s in zip(dst, src):
        d[:, offset:offset + s.shape[1]] = s


def write_positions(dst: Callable[[int], list[torch.Tensor]], src: list[torch.Tensor], start: int,
                    block: int) -> None:
    """src[i] [H, T, X] as positions start .. start + T - 1 of a KV cache's blocks of `block` rows each; dst(j):
    block j's tensors, in src's order. One `write_rows` per block the positions span."""
    T, pos = src[0].shape[1], start
    while pos < start + T:
        j, o = divmod(pos, block)
        n, s = min(block - o, start + T - pos), pos - start
        write_rows(dst(j), src if n == T else [t[:, s:s + n] for t in src], o)
        pos += n


def _pointwise_pieces(fn, x: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    flat = x.reshape(-1)
    if n % _VEC:
        flat = torch.cat([flat, flat.new_zeros(_VEC - n % _VEC)])
    out = torch.empty_like(flat)
    for a in range(0, flat.numel(), _GRAIN):
        out[a:a + _GRAIN] = fn(flat[a:a + _GRAIN])
    return out[:n].view(x.shape)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim in f32 (x [..., D], w [D]). Llama casts back before scaling by w; gemma scales by
    (1 + w) in f32, then casts. Native (kernels/norm.cpp: one call, its sum of squares in a fixed order) where x and
    w are both f32 or both bf16; torch's ops otherwise."""
    if kernels.native() and x.dtype == w.dtype and x.dtype in (torch.float32, torch.bfloat16):
        return kernels.library().rms_norm(x, w, float(eps), bool(gemma))
    return _rms_norm_torch(x, w, eps, gemma)


def _rms_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """The fallback: torch's ops, each rounded as HF's RMSNorm rounds it."""
    dtype = x.dtype
    h = x.float()
    h = h * pointwise(torch.rsqrt, h.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (h * (1.0 + w.float())).to(dtype)
    return w * h.to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF layout): x [H, T, Dh], cos / sin [T, Dh] in x's dtype -> x * cos + rotate_half(x) *
    sin, each op rounded to x's dtype. Native (kernels/norm.cpp, the same bits) for f32 and bf16."""
    if kernels.native() and x.dtype == cos.dtype == sin.dtype and x.dtype in (torch.float32, torch.bfloat16):
        return kernels.library().rope(x, cos, sin)
    return _rope_torch(x, cos, sin)


def _rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The fallback: torch's three elementwise ops (HF's form)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def dequantize_q8(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q8 KV rows: int8 codes [..., Dh] times their f32 scales [..., Dh / group] (one per group of a head vector),
    in f32, then converted to `dtype` (the values attention sees, however the rows are read)."""
    g = q.unflatten(-1, (s.shape[-1], q.shape[-1] // s.shape[-1])).float() * s[..., None]
    return g.flatten(-2).to(dtype)


@dataclass(frozen=True)
class Paged:
    """Keys or values [Hkv, length, Dh] where a paged KV cache stores them: `blocks`, [Hkv, B, Dh] each (the same
    shape, dtype and strides), block i holding rows [i * B, (i + 1) * B); the first `length` rows count. Attention
    reads them in place (the same rows in the same order as their concatenation: the same bits), so a decode step
    does not copy the whole context per layer. q8 blocks (`--kv-quant q8`): `blocks` hold int8 codes and `scales`
    their f32 scales [Hkv, B, Dh / group] (the same shape and strides each); their rows are
    dequantize_q8(codes, scales, dtype), dequantized where they are read."""

    blocks: list[torch.Tensor]
    length: int
    scales: list[torch.Tensor] | None = None
    dtype: torch.dtype | None = None

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) as one [Hkv, hi - lo, Dh] tensor (a copy; q8: dequantized)."""
        B = self.blocks[0].shape[1]
        first, last = lo // B, -(-hi // B)

        def cat(blocks: list[torch.Tensor]) -> torch.Tensor:
            if hi <= lo:
                return blocks[0][:, :0].clone()
            return torch.cat([b[:, max(0, lo - j * B):min(B, hi - j * B)]
                              for j, b in enumerate(blocks[first:last], start=first)], dim=1)
        if self.scales is None:
            return cat(self.blocks)
        return dequantize_q8(cat(self.blocks), cat(self.scales), self.dtype)

    def dense(self) -> torch.Tensor:
        """The rows as one [Hkv, length, Dh] tensor (a copy)."""
        return self.rows(0, self.length)


def attend(q: torch.Tensor, k: torch.Tensor | Paged, v: torch.Tensor | Paged, positions: torch.Tensor,
           window: int | None, scale: float, softcap: float | None) -> torch.Tensor:
    """Causal attention. q: [H, T, Dh] at absolute `positions` [T]; k, v: [Hkv, S, Dh] (last dim contiguous) or
    both `Paged`, key j at position j -> [H, T, Dh] in q's dtype. Query p sees keys max(0, p - window + 1) .. p.

    f32 math: scores scaled, soft-capped (Gemma-2), softmaxed over exactly the visible keys, the weighted sum
    in key order. Query head h uses KV head h // (H / Hkv), without repeated copies."""
    pos = _int64(positions)
    paged = isinstance(k, Paged)
    q8 = paged and k.scales is not None
    if kernels.native() and (not q8 or _native_q8(k)):
        lib, w, sc, cap = kernels.library(), window or 0, float(scale), float(softcap or 0)
        if q8:
            out = lib.attend_paged_q8(q, k.blocks, k.scales, v.blocks, v.scales, k.length, pos, w, sc, cap,
                                      k.dtype == torch.bfloat16)
        elif paged:
            out = lib.attend_paged(q, k.blocks, v.blocks, k.length, pos, w, sc, cap)
        else:
            out = lib.attend(q, k, v, pos, w, sc, cap)
        return out if out.dtype == q.dtype else out.to(q.dtype)  # (the kernels return q's dtype)
    return _attend_torch(q, k, v, positions, window, scale, softcap)


def rope_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                keys: Paged, values: Paged, positions: torch.Tensor, window: int | None, scale: float,
                softcap: float | None, bias: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of a pass that first writes its own keys and values into the KV cache's blocks. q [T, H * Dh] and
    k, v [T, Hkv * Dh] as the projections give them (before RoPE; any shape with T contiguous rows); bias: None, or
    the projections' biases (q, k, v), added first as `linear` adds them; cos, sin [T, Dh]; keys, values: the
    blocks (`Paged`, not q8) whose rows keys.length - T .. keys.length - 1 are the pass's positions. Writes k after
    RoPE and v there, then attends -> o [T, H * Dh] in q's dtype.

    The same bits as `add_bias`, `rope` on q and k, `write_rows` and `attend`, in one native call
    (kernels/attend_pass.cpp) where there were a dozen a layer (views and transposes included), each paid with cold
    caches in a decode step."""
    T, Dh = cos.shape
    dt = q.dtype
    if T == 0:  # (a sequence with no rows in this pass)
        return q.new_empty(0, q.shape[1:].numel())
    if bias is not None:
        bias = _as_dtype(bias, dt)
    if kernels.native() and dt in (torch.float32, torch.bfloat16) and k.dtype == v.dtype == cos.dtype == \
            sin.dtype == keys.blocks[0].dtype == dt:
        pos = _int64(positions)
        return kernels.library().rope_attend_paged(q, k, v, bias or [], cos, sin, keys.blocks, values.blocks,
                                                   keys.length, pos, window or 0, float(scale), float(softcap or 0))
    if bias is not None:
        q, k, v = (t + b for t, b in zip((q, k, v), bias))
    qh = rope(q.reshape(T, -1, Dh).transpose(0, 1), cos, sin)  # [H, T, Dh]
    kh = rope(k.reshape(T, -1, Dh).transpose(0, 1), cos, sin)
    vh = v.reshape(T, -1, Dh).transpose(0, 1)
    write_positions(lambda j: [keys.blocks[j], values.blocks[j]], [kh, vh], keys.length - T, keys.blocks[0].shape[1])
    return attend(qh, keys, values, positions, window, scale, softcap).transpose(0, 1).reshape(T, -1)


def _native_q8(k: Paged) -> bool:
    """Whether the native kernel reads these q8 blocks: groups of 32, values dequantized to f32 or bf16, head dim
    up to 512 (generic/attention.cpp); others go through the fallback, which dequantizes the rows it reads."""
    dh = k.blocks[0].shape[-1]
    return k.dtype in (torch.float32, torch.bfloat16) and dh <= 512 and dh == 32 * k.scales[0].shape[-1]


def _attend_torch(q, k, v, positions, window, scale, softcap) -> torch.Tensor:
    """The fallback: one query at a time over fresh f32 copies of its visible keys, so every matmul and softmax
    has shapes set by that query's position alone (hence batch-invariant, though slower than the native kernel)."""
    H, T, Dh = q.shape
    paged = isinstance(k, Paged)
    Hkv, S = (k.blocks[0].shape[0], k.length) if paged else (k.shape[0], k.shape[1])

    def rows(t, lo: int, hi: int) -> torch.Tensor:  # rows [lo, hi) as a fresh f32 [Hkv, hi - lo, Dh]
        return t.rows(lo, hi).float() if paged else torch.empty(Hkv, max(0, hi - lo), Dh).copy_(t[:, lo:hi])

    qg = q.float().view(Hkv, H // Hkv, T, Dh)
    out = torch.empty(Hkv, H // Hkv, T, Dh)
    for t, p in enumerate(positions.tolist()):
        hi, lo = min(p, S - 1), max(0, p - window + 1) if window else 0
        keys, vals = rows(k, lo, hi + 1), rows(v, lo, hi + 1)
        s = torch.matmul(qg[:, :, t].contiguous(), keys.transpose(1, 2)).mul_(scale)  # [Hkv, G, n]
        if softcap is not None:
            s = s.div_(softcap).tanh_().mul_(softcap)
        out[:, :, t] = torch.matmul(torch.softmax(s, dim=-1), vals)
    return out.view(H, T, Dh).to(q.dtype)

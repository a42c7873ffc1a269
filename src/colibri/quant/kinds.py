"""Quantized linear weights stored as plain bytes: q4 (4-bit, group-wise scale + zero) and q8 (int8, symmetric).

A weight is a few contiguous tensors (`buffers()`) that a container writes as raw bytes and hands back through
`from_buffers`, which keeps them as they are (no copy on the common path). `colibri.kernels.ops.linear` calls
`w.linear(x, b)` for these objects.

Longer than the package's other files on purpose: it is the one writer and reader of every stored weight layout
(q4, q8, and the GGUF K-quants at the end), so each layout and all the code that touches its bytes read together.

q4 on-disk layout (N out, K in, g = group_size in {32, 64, 128, 256}, K % g == 0, Np = N rounded up to 16):
  qweight       uint8 [Np, K/2]   nibbles in the AVX-512 layout of torch's CPU int4 kernel: rows in tiles of 64;
                                  tile t holds bytes [K, 32], byte (k, j) = q[64t + j, k] | q[64t + 32 + j, k] << 4.
                                  A last partial tile of r = Np % 64 rows holds [K, r/2],
                                  byte (k, i) = q[base + 2i, k] | q[base + 2i + 1, k] << 4.
  scales_zeros  [K/g, Np, 2]      (scale, zero) per group and row, bf16/f16/f32 (the kind's scale_dtype).
  weight = (q - 8) * scale + zero, q in [0, 15]; rows N..Np-1 are padding (q = 8, scale = zero = 0).
  torch packs differently per CPU ISA (64-row tiles for AVX-512, 32-row tiles for AVX2, row pairs otherwise), so
  the stored bytes are one fixed layout: the kernel's own on AVX-512 machines (zero-copy), repacked once at load
  elsewhere (`from_buffers` keeps both then).
q8 on-disk layout:
  qweight  int8 [N, K];  scales [N] (group_size 0: per output channel) or [N, K/g] (per group), weight = q * scale.
q4k / q6k: GGUF Q4_K / Q6_K kept exactly, two-level scales (section "GGUF K-quants" below; q4k uses the q4 tile layout,
q6k the file's own blocks; q8k, Q6_K with its codes in bytes, is what older containers hold). q3k, iq4_xs (Q3_K,
IQ4_XS: q8k's form), q5k, q2k (Q5_K, Q2_K: q8k's form with an offset per 32 / per 16), q5_0, iq4_nl (Q5_0, IQ4_NL:
q8 g32's form), q5_1 (Q5_1: q8 g32's form with an offset per 32) and q4_1 (Q4_1: q4 with f16 (d, m)) likewise keep
the file's bytes; docs/format.md describes each.

Compute (benchmarks/quant_kernels.py, docs/performance.md): batch-invariant at every row count, so a row's result
never depends on the other rows in the pass.
  native (colibri.kernels: the avx512, avx2 and portable tiers, bit-identical to each other): q4 with bf16 x: per group, x . (q - 8) by bf16 dot products of the exact
    codes, then scale * that + zero * sum(x) in f32, output rounded once to bf16; q8 with bf16 x: weights
    q * scale rounded to bf16, f32 accumulation. f32 x: the `dequantize()` weights exactly, f32 accumulation.
  torch fallback (COLIBRI_KERNELS=torch, or no C++ compiler): bf16 x: torch's int4 / int8 weight-only kernels at
    every row count (their rows do not interact); grouped q8 and f32 x: a few MiB of rows at a time are
    dequantized in f32 (exactly the `dequantize()` values), rounded to x's dtype and multiplied with a GEMM run
    on fixed 16-row blocks (`kernels.blocked`).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch

from colibri import kernels
from colibri.kernels import ops

Q4_GROUP_SIZES = (32, 64, 128, 256)
# two-level GGUF kinds in super-blocks of 256 values (section "GGUF K-quants")
K_KINDS = ("q4k", "q8k", "q6k", "q3k", "iq4_xs", "q5k", "q2k")
QUANT_KINDS_ALL = ("q4", "q8") + K_KINDS + ("q5_0", "q5_1", "iq4_nl", "q4_1", "q4_0")
GGUF_KEPT_KINDS = K_KINDS + ("q5_0", "q5_1", "iq4_nl")  # kinds only an exact GGUF import makes (see GGUF_K_EXACT)
TILED_KINDS = ("q4", "q4k", "q4_1", "q4_0")  # kinds stored in 64-row q4 code tiles (rows are read a tile at a time)
_TILE = 64  # rows per q4 tile (the AVX-512 kernel's BLOCK_N)
Q4_TILE = _TILE  # public: readers of q4 rows (streaming lookups and head blocks) read whole tiles
_CHUNK_BYTES = 1 << 23  # f32 scratch per dequantize step, small enough to stay in the L3 (docs/performance.md)
SCRATCH_BYTES = _CHUNK_BYTES * 3 // 2  # what _scratch keeps: the f32 step and its bf16 copy (budget.reserve)
_local = threading.local()


def _scratch(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    """A reused buffer per thread and dtype: a fresh multi-MiB allocation per call costs page faults. Made at its
    full size (a step's _CHUNK_BYTES of f32 elements) on first use: grown step by step, the smaller buffers it
    dropped stayed in the heap, above what the budget reserves for it (SCRATCH_BYTES)."""
    n = 1
    for s in shape:
        n *= s
    bufs = _local.__dict__.setdefault("bufs", {})
    if dtype not in bufs or bufs[dtype].numel() < n:
        with torch.inference_mode(False):  # a normal tensor: writable both inside and outside inference mode
            bufs[dtype] = torch.empty(max(n, _CHUNK_BYTES // 4), dtype=dtype)
    return bufs[dtype][:n].view(shape)


@dataclass(frozen=True)
class QuantKind:
    """What a quantized weight is: `name` "q4" / "q8", `group_size` along K (q8: 0 = one scale per output
    channel), and the dtype its scales (and q4 zeros) are stored in."""

    name: str
    group_size: int
    scale_dtype: torch.dtype

    @property
    def bits(self) -> int:
        """Bits per stored code."""
        return 4 if self.name in TILED_KINDS else 8


def _kind(kind: QuantKind | str, group_size: int | None) -> QuantKind:
    if isinstance(kind, QuantKind):
        return kind
    if kind == "q4":
        return QuantKind("q4", 64 if group_size is None else group_size, torch.bfloat16)
    if kind == "q8":
        return QuantKind("q8", 0 if group_size is None else group_size, torch.bfloat16)
    if kind in _K_KIND:
        return _K_KIND[kind]
    raise ValueError(f"unknown quant kind {kind!r} (expected 'q4', 'q8', 'q4k' or 'q8k')")


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


def _check_shape(kind: QuantKind, shape: tuple[int, int]) -> tuple[int, int]:
    n, k = (int(s) for s in shape)
    g = kind.group_size
    if kind.name in K_KINDS:  # GGUF K-quants: fixed groups inside SUPER-value super-blocks
        if n <= 0 or k <= 0 or k % SUPER:
            raise ValueError(f"{kind.name}: shape {(n, k)} needs K divisible by {SUPER}")
        return n, k
    if kind.name == "q4" and g not in Q4_GROUP_SIZES:
        raise ValueError(f"q4 group size must be one of {Q4_GROUP_SIZES}, got {g}")
    if kind.name == "q8" and g < 0:
        raise ValueError(f"q8 group size must be 0 (per channel) or positive, got {g}")
    if n <= 0 or k <= 0 or (g and k % g):
        raise ValueError(f"{kind.name}: shape {(n, k)} needs K divisible by the group size {g}")
    return n, k


def buffer_layout(kind: QuantKind | str, shape: tuple[int, int],
                  group_size: int | None = None) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The on-disk pieces of a weight of logical `shape` [N, K]: name -> (dtype, shape), in storage order."""
    kind = _kind(kind, group_size)
    n, k = _check_shape(kind, shape)
    if kind.name in K_KINDS:
        return _k_buffer_layout(kind, n, k)
    if kind.name in G32_BLOCK:
        return {"qweight": (torch.uint8, (n, k // 32 * G32_BLOCK[kind.name]))}
    if kind.name == "q4_0":
        np_ = _round16(n)
        return {"qweight": (torch.uint8, (np_, k // 2)), "scales": (torch.float16, (k // 32, np_))}
    if kind.name == "q4_1":
        np_ = _round16(n)
        return {"qweight": (torch.uint8, (np_, k // 2)), "scales_mins": (torch.float16, (k // 32, np_, 2))}
    if kind.name == "q4":
        np_ = _round16(n)
        return {"qweight": (torch.uint8, (np_, k // 2)),
                "scales_zeros": (kind.scale_dtype, (k // kind.group_size, np_, 2))}
    scales = (n,) if kind.group_size == 0 else (n, k // kind.group_size)
    return {"qweight": (torch.int8, (n, k)), "scales": (kind.scale_dtype, scales)}


def _check_buffers(kind: QuantKind, shape, buffers: dict[str, torch.Tensor]) -> None:
    if kind.scale_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{kind.name} scales must be bf16, f16 or f32, got {kind.scale_dtype}")
    sides = tuple(tuple(getattr(buffers.get(n), "shape", ())) for n in ("scales", "supers"))
    legacy = kind.name == "q4k" and sides in q4k_legacy_layouts(shape)
    for name, (dtype, want) in buffer_layout(kind, shape).items():
        t = buffers.get(name)
        if t is None:
            raise ValueError(f"{kind.name} weight {tuple(shape)}: buffer {name!r} is missing")
        exact_dtype = name == "qweight" or kind.name in K_KINDS
        if name != "qweight" and legacy:
            want = tuple(t.shape)  # read from a container made before version 5 (q4k_legacy_layouts)
        if tuple(t.shape) != want or (exact_dtype and t.dtype != dtype) or not t.is_contiguous():
            raise ValueError(f"{kind.name} weight {tuple(shape)}: buffer {name!r} is {t.dtype} {tuple(t.shape)}, "
                             f"expected contiguous {dtype} {want}")


# ---- q4 nibble layout -----------------------------------------------------------------------------------------

def _pack_q4(q: torch.Tensor) -> torch.Tensor:
    """q: uint8 [Np, K] in [0, 15], Np % 16 == 0 -> uint8 [Np, K/2] in the layout described at the top."""
    np_, k = q.shape
    out = torch.empty(np_, k // 2, dtype=torch.uint8)
    nf = np_ // _TILE * _TILE
    if nf:
        t = q[:nf].view(nf // _TILE, 2, 32, k)  # [tiles, low/high nibble, j, K]
        out[:nf].view(nf // _TILE, k, 32).copy_((t[:, 0] | (t[:, 1] << 4)).transpose(1, 2))
    if nf < np_:
        t = q[nf:].view((np_ - nf) // 2, 2, k)  # [row pairs, even/odd, K]
        out[nf:].view(k, (np_ - nf) // 2).copy_((t[:, 0] | (t[:, 1] << 4)).T)
    return out


def _signed_nibbles(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 bytes -> (low, high) nibbles as int8 q - 8. Flipping bit 3 of a nibble turns q into the 4-bit
    two's complement of q - 8, which an arithmetic shift sign-extends."""
    s = (p ^ 0x88).view(torch.int8)
    return (s << 4) >> 4, s >> 4


def _unpack_q4(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of `_pack_q4`: uint8 [Np, K/2] -> int8 [Np, K] holding q - 8."""
    np_, k = qweight.shape[0], qweight.shape[1] * 2
    out = torch.empty(np_, k, dtype=torch.int8)
    nf = np_ // _TILE * _TILE
    if nf:
        lo, hi = _signed_nibbles(qweight[:nf].view(nf // _TILE, k, 32))
        o = out[:nf].view(nf // _TILE, 2, 32, k)
        o[:, 0].copy_(lo.transpose(1, 2))
        o[:, 1].copy_(hi.transpose(1, 2))
    if nf < np_:
        lo, hi = _signed_nibbles(qweight[nf:].view(k, (np_ - nf) // 2))
        o = out[nf:].view((np_ - nf) // 2, 2, k)
        o[:, 0].copy_(lo.T)
        o[:, 1].copy_(hi.T)
    return out


@functools.cache
def kernel_layout_is_stored_layout() -> bool:
    """True when this process's torch packs int4 weights exactly as we store them (AVX-512 dispatch)."""
    g = torch.Generator().manual_seed(0)
    for n in (64 + 16, 64 + 32, 64 + 48):
        q = torch.randint(0, 16, (n, 64), generator=g, dtype=torch.uint8)
        if not torch.equal(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1), _pack_q4(q)):
            return False
    return True


def torch_tier_repacks_q4() -> bool:
    """Whether q4 weights hold a second copy of their codes: only on the torch tier (the native tiers read the
    stored tiles), and only where torch's int4 kernel packs them otherwise (its AVX2 and portable dispatch)."""
    return not kernels.native() and not kernel_layout_is_stored_layout()


def repack_for_kernel(qweight: torch.Tensor) -> torch.Tensor:
    """Stored q4 bytes -> the bytes torch's int4 kernel reads (the same tensor where they agree)."""
    if kernel_layout_is_stored_layout():
        return qweight
    q = _unpack_q4(qweight).to(torch.int32) + 8
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)


# ---- weights --------------------------------------------------------------------------------------------------

def _as_2d(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"linear: input has {x.shape[-1]} features, the weight expects {k}")
    return x.reshape(-1, k).contiguous()


class _QuantWeight:
    kind: QuantKind
    shape: tuple[int, int]
    # The native ops of the kind (exact, and the LOSSY int8 one or None), the buffers they take after x, whether the
    # group size follows them, and the group the int8 kernels are asked about (int8_supports; None: group_size).
    OP: str
    OP_I8: str | None = None
    OP_ARGS: tuple[str, ...] = ("qweight", "scales")
    OP_GROUPED = False
    I8_GROUP: int | None = None

    def __init__(self, kind: QuantKind, shape, buffers: dict[str, torch.Tensor]):
        self.shape = _check_shape(kind, shape)
        _check_buffers(kind, self.shape, buffers)
        self.kind = kind
        self._buffers = {name: buffers[name] for name in buffer_layout(kind, self.shape)}
        self._cache: dict = {}  # derived small tensors (scales in another dtype or order), built on first use
        self._native: dict[bool, tuple[str, tuple]] = {}  # native_op's answer by LOSSY mode, made on first use

    @property
    def group_size(self) -> int:
        return self.kind.group_size

    @property
    def nbytes(self) -> int:
        """Bytes of the stored buffers (what reading this weight from disk costs)."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def buffers(self) -> dict[str, torch.Tensor]:
        """The on-disk pieces, each a contiguous tensor; see `buffer_layout`."""
        return dict(self._buffers)

    @classmethod
    def from_buffers(cls, shape, group_size: int, buffers: dict[str, torch.Tensor]):
        """Wrap stored pieces without copying them; the scale dtype is the stored one."""
        scales = buffers.get("scales_zeros" if cls is Q4Weight else "scales")
        if scales is None:
            raise ValueError(f"{cls.__name__}.from_buffers: scale buffer missing (got {sorted(buffers)})")
        return cls(QuantKind("q4" if cls is Q4Weight else "q8", group_size, scales.dtype), shape, buffers)

    def _buffer_as(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A stored small buffer converted to `dtype` once and kept (the decode kernels want scales in the
        activation dtype every token; placement.resident_extra charges the copy to a pinned weight's page). The
        f32 paths convert what they need per call instead: keeping f32 copies of every resident weight's scales
        cost a third of the q4 bytes again, outside the budget."""
        t = self._buffers[name]
        if t.dtype == dtype:
            return t
        key = (name, dtype)
        if key not in self._cache:
            self._cache[key] = t.to(dtype)
        return self._cache[key]

    def native_op(self) -> tuple[str, tuple] | None:
        """The op of the native tier's library() that `linear` runs for this weight in this process's kernel mode
        (exact, or LOSSY int8 where it is on and takes the weight), with its arguments after x; None where the torch
        fallback runs it."""
        if not kernels.native():
            return None
        lossy = kernels.int8_activations()  # (every native tier has the same ops)
        if lossy not in self._native:  # (asked for every linear of every pass: each answer made once)
            op = self.OP
            group = self.group_size if self.I8_GROUP is None else self.I8_GROUP
            if lossy and self.OP_I8 and kernels.int8_supports(self.shape[1], group):
                op = self.OP_I8
            args = tuple(self._buffers[name] for name in self.OP_ARGS)
            self._native[lossy] = op, (args + (self.group_size,) if self.OP_GROUPED else args)
        return self._native[lossy]

    def _linear_2d(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] f32 / bf16 (contiguous) -> [T, N or more] in x's dtype."""
        call = self.native_op()
        if call is not None:
            return getattr(kernels.library(), call[0])(x, *call[1])
        return self._torch_linear(x)

    def _torch_linear(self, x: torch.Tensor) -> torch.Tensor:
        """_linear_2d on the torch tier: the weight dequantized in row blocks (kinds with a torch kernel: that)."""
        return kernels.blocked(self._dequant_matmul, x, self.shape[0])

    def linear(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T + b. x: [..., K] float32 / bfloat16 (float16 computes in f32) -> [..., N] in x's dtype."""
        n, k = self.shape
        flat = x.dim() == 2 and x.shape[1] == k and x.is_contiguous()  # a pass's activations: as they are
        x2 = x if flat else _as_2d(x, k)
        if x2.dtype == torch.bfloat16 or x2.dtype == torch.float32:
            y = self._linear_2d(x2)
        else:
            y = self._linear_2d(x2.float()).to(x.dtype)
        if y.shape[1] != n:  # rows padded to 16
            y = y[:, :n].contiguous()
        if b is not None:
            ops.add_bias(y, b)
        return y if flat else y.reshape(*x.shape[:-1], n)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind.name}, shape={self.shape}, group_size={self.group_size})"


class Q4Weight(_QuantWeight):
    """4-bit weight, asymmetric per group of `group_size` inputs: w = (q - 8) * scale + zero."""

    codes_offset = -8  # w = (q + codes_offset) * scale + zero (Q4KWeight: 0)
    OP, OP_I8, OP_ARGS, OP_GROUPED = "q4_linear", "q4_linear_i8", ("qweight", "scales_zeros"), True

    def __init__(self, kind: QuantKind, shape, buffers: dict[str, torch.Tensor]):
        super().__init__(kind, shape, buffers)
        self._packed: torch.Tensor | None = None  # torch's int4 layout, made at the torch tier's first bf16 call

    def _torch_linear(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16:
            sz = self._buffer_as("scales_zeros", torch.bfloat16)
            if self._packed is None:
                self._packed = repack_for_kernel(self._buffers["qweight"])
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self._packed, self.group_size, sz)
        return kernels.blocked(self._dequant_matmul, x, self._buffers["qweight"].shape[0])

    def _scales_zeros_f32(self, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
        sz = self._buffers["scales_zeros"][:, r0:r1].float()
        return sz[..., 0], sz[..., 1]  # [G, r1 - r0] each

    def _tile_params_f32(self, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero) of tiles t0..t1 as contiguous f32 [tiles, G, 1, 64], built per dequantize step: strided
        broadcasts in the loop cost several times more than contiguous ones (docs/performance.md, "Figures moved
        from source comments"), and a kept f32 copy for the whole weight would double the RAM of 16-bit stored
        scales, for every resident weight."""
        (_, k), g = self.shape, self.group_size
        sz = self._buffers["scales_zeros"][:, t0 * _TILE:t1 * _TILE].float().view(k // g, t1 - t0, _TILE, 2)
        p = sz.permute(3, 1, 0, 2).unsqueeze(3).contiguous()  # [2, tiles, G, 1, 64]
        return p[0], p[1]

    def _dequant_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """y = x @ W.T in x's dtype, dequantizing a few 64-row tiles at a time (W.T tiles are [K, 64]); the
        weights are exactly `dequantize()`'s in f32, rounded once to bf16 for bf16 x."""
        (_, k), g = self.shape, self.group_size
        qw = self._buffers["qweight"]
        np_, nt, t = qw.shape[0], qw.shape[0] // _TILE, x.shape[0]
        y = torch.empty(t, np_, dtype=x.dtype)
        if nt:
            tiles = qw[:nt * _TILE].view(nt, k, 32)
            step = max(1, _CHUNK_BYTES // (k * _TILE * 4))
            yt = y[:, :nt * _TILE].view(t, nt, _TILE)
            for i in range(0, nt, step):
                c = min(step, nt - i)
                s, z = self._tile_params_f32(i, i + c)
                w = _scratch(torch.float32, c, k, _TILE)
                lo, hi = _signed_nibbles(tiles[i:i + c])
                w[..., :32].copy_(lo)
                w[..., 32:].copy_(hi)
                if self.codes_offset != -8:
                    w.add_(self.codes_offset + 8)
                w4 = w.view(c, k // g, g, _TILE)
                torch.addcmul(z, w4, s, out=w4)  # (q - 8) * scale + zero, one rounding
                if x.dtype != torch.float32:
                    w = _scratch(x.dtype, c, k, _TILE).copy_(w)
                yt[:, i:i + c].copy_(torch.matmul(x, w).transpose(0, 1))
        if nt * _TILE < np_:
            y[:, nt * _TILE:] = kernels.padded_linear(x, self._dequant_rows(nt * _TILE, np_).to(x.dtype))
        return y

    def _dequant_rows(self, r0: int, r1: int) -> torch.Tensor:
        """f32 [r1 - r0, K] for a row range aligned to the layout (whole tiles, or the tail)."""
        (_, k), g = self.shape, self.group_size
        qw = self._buffers["qweight"]
        q = _unpack_q4(qw[r0:r1]) if r0 % _TILE == 0 and (r1 - r0) % _TILE == 0 else _unpack_q4(qw)[r0:r1]
        scale, zero = self._scales_zeros_f32(r0, r1)
        w = q.float().view(r1 - r0, k // g, g)
        if self.codes_offset != -8:
            w.add_(self.codes_offset + 8)
        torch.addcmul(zero.T.unsqueeze(-1), w, scale.T.unsqueeze(-1), out=w)
        return w.view(r1 - r0, k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a dense [N, K] tensor (computed in f32: bit-exact to what the f32 path multiplies by)."""
        n = self.shape[0]
        return self._dequant_rows(0, self._buffers["qweight"].shape[0])[:n].to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """f32 [len(ids), K]: rows of a lookup table (token embedding), dequantizing only the tiles they sit in."""
        out = torch.empty(len(ids), self.shape[1])
        np_ = self._buffers["qweight"].shape[0]
        full = np_ // _TILE * _TILE
        for i, r in enumerate(ids.tolist()):
            r0, r1 = (r // _TILE * _TILE, r // _TILE * _TILE + _TILE) if r < full else (full, np_)
            out[i] = self._dequant_rows(r0, r1)[r - r0]
        return out


class _DerivedQ4Weight(Q4Weight):
    """A q4-tiled kind whose (scale, zero) per group are derived from what it stores (`_scales_zeros_f32`, f32
    [G, rows] each) rather than stored as q4's pairs: q4_1, q4_0, q4k."""

    def _torch_linear(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantized in row blocks: q4's int4 path reads stored pairs (q4_0 builds its own: Q40Weight)."""
        return kernels.blocked(self._dequant_matmul, x, self._buffers["qweight"].shape[0])

    def _tile_params_f32(self, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As Q4Weight's, [tiles, K/g, 1, 64] each, built per dequantize step from the derived pairs."""
        (_, k), g = self.shape, self.group_size
        s, z = self._scales_zeros_f32(t0 * _TILE, t1 * _TILE)  # [G, rows]
        p = torch.stack([s, z]).view(2, k // g, t1 - t0, _TILE).permute(0, 2, 1, 3).unsqueeze(3).contiguous()
        return p[0], p[1]


class Q41Weight(_DerivedQ4Weight):
    """GGUF Q4_1 kept exactly: the q4 tiles with f16 (d, m) per group of 32 as the file stores them, w = d q + m,
    computed as q4 with scale d and zero m + 8 d (exact in f32: from_gguf checks it)."""

    OP, OP_I8, OP_ARGS, OP_GROUPED, I8_GROUP = "q4_1_linear", "q4_1_linear_i8", ("qweight", "scales_mins"), False, 32

    @classmethod
    def from_buffers(cls, shape, group_size: int, buffers: dict[str, torch.Tensor]):
        return cls(GGUF_EXACT["Q4_1"], shape, buffers)

    def _scales_zeros_f32(self, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
        sm = self._buffers["scales_mins"][:, r0:r1].float()
        return sm[..., 0], sm[..., 1] + 8 * sm[..., 0]


class Q40Weight(_DerivedQ4Weight):
    """GGUF Q4_0 kept exactly at its own size (4.5 bits a weight): the q4 tiles with the file's f16 d per group of
    32, w = d (q - 8) (exact in f32); the kernels take it as q4 with (d, +0) (q4_0_linear), bit for bit."""

    OP, OP_I8, OP_ARGS, OP_GROUPED, I8_GROUP = "q4_0_linear", "q4_0_linear_i8", ("qweight", "scales"), False, 32

    @classmethod
    def from_buffers(cls, shape, group_size: int, buffers: dict[str, torch.Tensor]):
        return cls(GGUF_EXACT["Q4_0"], shape, buffers)

    def _scales_zeros_f32(self, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
        d = self._buffers["scales"][:, r0:r1].float()
        return d, torch.zeros_like(d)

    def _torch_linear(self, x: torch.Tensor) -> torch.Tensor:
        b = self._buffers
        if x.dtype == torch.bfloat16:  # torch's int4 kernel, as q4 with (d, 0) in bf16
            if self._packed is None:
                self._packed = repack_for_kernel(b["qweight"])
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self._packed, 32, self._scales_zeros_bf16())
        return kernels.blocked(self._dequant_matmul, x, b["qweight"].shape[0])

    def _scales_zeros_bf16(self) -> torch.Tensor:
        """(d, 0) [K/32, Np, 2] in bf16 for torch's int4 kernel, made once and kept as q4's converted scales are."""
        if "scales_zeros_bf16" not in self._cache:
            d = self._buffers["scales"].to(torch.bfloat16)
            self._cache["scales_zeros_bf16"] = torch.stack([d, torch.zeros_like(d)], dim=-1).contiguous()
        return self._cache["scales_zeros_bf16"]


class Q8Weight(_QuantWeight):
    """int8 weight, symmetric: w = q * scale, one scale per output channel (group_size 0) or per group."""

    OP, OP_I8, OP_GROUPED = "q8_linear", "q8_linear_i8", True

    def _torch_linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.group_size == 0 and x.dtype == torch.bfloat16:
            s = self._buffer_as("scales", torch.bfloat16)
            return torch.ops.aten._weight_int8pack_mm(x, self._buffers["qweight"], s)
        return super()._torch_linear(x)

    def _dequant_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """y = x @ W.T in x's dtype, dequantizing a few MiB of rows at a time (in f32, then rounded for bf16)."""
        n, k = self.shape
        y = torch.empty(x.shape[0], n, dtype=x.dtype)
        step = max(1, _CHUNK_BYTES // (k * 4))
        for r in range(0, n, step):
            c = min(step, n - r)
            w = _scratch(torch.float32, c, k).copy_(self._codes(slice(r, r + c)))
            s = self._scales_f32(slice(r, r + c))
            w.view(c, s.shape[1], -1).mul_(s.unsqueeze(-1))
            if x.dtype != torch.float32:
                w = _scratch(x.dtype, c, k).copy_(w)
            y[:, r:r + c] = kernels.padded_linear(x, w)
        return y

    def _codes(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """The int8 codes of `rows` (a slice, or row ids), [rows, K]."""
        return self._buffers["qweight"][rows]

    def _scales_f32(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """Scales of `rows` (a slice, or row ids) as f32 [rows, groups] (one group per channel: [rows, 1])."""
        s = self._buffers["scales"][rows].float()
        return s.view(s.shape[0], -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        s = self._scales_f32(slice(0, n))
        return (self._codes(slice(0, n)).float().view(n, s.shape[1], -1) * s.unsqueeze(-1)).view(n, k).to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """f32 [len(ids), K]: rows of a lookup table (token embedding)."""
        k = self.shape[1]
        s = self._scales_f32(ids)
        return (self._codes(ids).float().view(len(ids), s.shape[1], -1) * s.unsqueeze(-1)).view(len(ids), k)


# ---- quantize -------------------------------------------------------------------------------------------------

def _bf16_round_up(t: torch.Tensor) -> torch.Tensor:
    """Smallest bf16 >= t, for t >= 0 (f32 in, bf16 out): scales rounded up keep every value in range."""
    bits = t.float().contiguous().view(torch.int32)
    up = torch.where((bits & 0xFFFF) != 0, (bits + 0x10000) & ~0xFFFF, bits)
    return up.view(torch.float32).to(torch.bfloat16)


Q4_FIT_ITERS = 6
# elements per quantization step (1 MiB of f32): bounds converter memory, and keeps the fit's elementwise passes
# in L2 (for the plain and the importance-weighted fit alike). Each pass is too small to split across threads:
# the fit runs on one, since on a loaded host a parallel region waits for a descheduled thread (both timed:
# docs/performance.md, "Conversion").
QUANTIZE_CHUNK = 1 << 18


def _q4_fit(wf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (scale, zero) for q4, in bf16. wf: f32 [N, G, g].

    Starts from the min/max fit (error <= scale/2 everywhere) and refines by alternating least squares: with the
    codes fixed, the scale and zero minimizing the squared error are a linear regression of w on (q - 8); with
    those fixed, codes are re-rounded. The best fit seen per group is kept (clipping an outlier may pay), so the
    squared error is never above min/max's at the same bits (how much lower: docs/quality.md, "Reading the
    table").
    """
    lo, hi = wf.amin(-1, keepdim=True), wf.amax(-1, keepdim=True)
    scale = (hi - lo) / 15
    zero = lo + 8 * scale
    best_err = torch.full_like(lo, float("inf"))
    best_s, best_z = scale.clone(), zero.clone()
    flat = scale == 0  # constant groups: zero = the value, scale 0
    for _ in range(Q4_FIT_ITERS):
        s16, z16 = scale.to(torch.bfloat16).float(), zero.to(torch.bfloat16).float()  # what will be stored
        q = torch.where(s16 > 0, torch.round((wf - z16) / s16.clamp_min(1e-30)) + 8, 8).clamp_(0, 15)
        err = ((q - 8) * s16 + z16 - wf).pow(2).sum(-1, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s, best_z = torch.where(better, s16, best_s), torch.where(better, z16, best_z)
        x = q - 8
        xm, wm = x.mean(-1, keepdim=True), wf.mean(-1, keepdim=True)
        var = (x - xm).pow(2).mean(-1, keepdim=True)
        fit = ((x - xm) * (wf - wm)).mean(-1, keepdim=True) / var.clamp_min(1e-30)
        scale = torch.where((var > 0) & (fit > 0) & ~flat, fit, scale)
        zero = torch.where(flat, lo, wm - scale * xm)
    return best_s.squeeze(-1).to(torch.bfloat16), best_z.squeeze(-1).to(torch.bfloat16)


def quantize(w: torch.Tensor, kind: str, group_size: int,
             importance: torch.Tensor | None = None) -> Q4Weight | Q8Weight:
    """Round-to-nearest quantization of a float [N, K] weight, scales (and zeros) stored in bf16.

    q4: per group, (scale, zero) fitted by `_q4_fit` (min/max start, least-squares refinement), codes q in [0, 15]
    rounded against the stored bf16 values. With `importance` (f32 [K], mean x^2 per input channel from
    calibration) the fit minimizes the importance-weighted error instead (`quantfit.fit_q4_weighted`).
    q8: per output channel (group_size 0) or per group, scale = absmax / 127 rounded up to bf16, q in [-127, 127].
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see QUANTIZE_CHUNK
    try:
        return _quantize(w, kind, group_size, importance)
    finally:
        torch.set_num_threads(threads)


def _quantize(w: torch.Tensor, kind: str, group_size: int, importance: torch.Tensor | None) -> Q4Weight | Q8Weight:
    kind_ = _kind(kind, group_size)
    n, k = _check_shape(kind_, tuple(w.shape))
    g = kind_.group_size or k
    w = w.detach()
    rows = max(1, QUANTIZE_CHUNK // k)  # f32 temporaries stay at a few chunks whatever the tensor's size
    if kind_.name == "q8":
        q = torch.empty(n, k, dtype=torch.int8)
        scale = torch.empty(n, k // g, dtype=torch.bfloat16)
        for r in range(0, n, rows):
            wf = w[r:r + rows].float().reshape(-1, k // g, g)
            scale[r:r + rows] = _bf16_round_up(wf.abs().amax(-1) / 127)
            sf = scale[r:r + rows].float().unsqueeze(-1)
            q[r:r + rows] = torch.where(sf > 0, torch.round(wf / sf.clamp_min(1e-30)), 0).clamp_(-127, 127).view(-1, k)
        scales = scale.reshape(n) if kind_.group_size == 0 else scale
        return Q8Weight(kind_, (n, k), {"qweight": q, "scales": scales.contiguous()})
    np_ = _round16(n)
    qp = torch.full((np_, k), 8, dtype=torch.uint8)
    sz = torch.zeros(k // g, np_, 2, dtype=torch.bfloat16)
    for r in range(0, n, rows):
        wf = w[r:r + rows].float().reshape(-1, k // g, g)
        scale, zero = _q4_fit(wf)
        if importance is not None:
            from colibri.quant.fit import fit_q4_weighted
            scale, zero = fit_q4_weighted(wf, importance.view(k // g, g), (scale, zero))
        sf, zf = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
        q = torch.where(sf > 0, torch.round((wf - zf) / sf.clamp_min(1e-30)) + 8, 8).clamp_(0, 15)
        end = r + wf.shape[0]  # qp and sz have padding rows beyond n
        qp[r:end] = q.view(-1, k).to(torch.uint8)
        sz[:, r:end, 0] = scale.T
        sz[:, r:end, 1] = zero.T
    return Q4Weight(kind_, (n, k), {"qweight": _pack_q4(qp), "scales_zeros": sz})


# ---- GGUF blocks ----------------------------------------------------------------------------------------------

def _gguf_type_name(gguf_type) -> str:
    if isinstance(gguf_type, str):
        return gguf_type.upper()
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(int(gguf_type)).name


GGUF_CHUNK_BYTES = 4 << 20  # stored bytes converted per step by from_gguf (its temporaries are a few times it)


def from_gguf(raw: np.ndarray, gguf_type, shape: tuple[int, int]) -> Q4Weight | Q8Weight:
    """Re-express GGUF Q4_0 / Q4_1 (-> q4, group 32) or Q8_0 (-> q8, group 32) blocks without loss; Q4_K and
    Q6_K become the two-level kinds q4k / q8k (section "GGUF K-quants" below).

    raw: uint8 [N, K / 32 * block_bytes] (rows in HF order), shape: [N, K]. `dequantize()` of the result equals
    `gguf.quants.dequantize` bit for bit in f32. Scales stay f16 where that is exact (Q4_0, Q8_0); Q4_1's zero
    m + 8 d is stored in f32 and checked to be exact (raises ValueError otherwise).
    """
    name = _gguf_type_name(gguf_type)
    n, k = (int(s) for s in shape)
    rows = max(_TILE, GGUF_CHUNK_BYTES // max(1, raw[0].nbytes) // _TILE * _TILE)
    if n <= rows:
        return _from_gguf(raw, name, n, k)
    # Row blocks of whole tiles, each converted on its own and copied into the full buffers along their row axis
    # (the one whose length is the rows'): the temporaries stay at a block's, whatever the tensor's size.
    out: dict[str, torch.Tensor] = {}
    first = None
    for r0 in range(0, n, rows):
        part = _from_gguf(raw[r0:r0 + rows], name, min(rows, n - r0), k)
        if first is None:
            first = part
            layout = buffer_layout(part.kind, (n, k))
            out = {b: torch.empty(layout[b][1], dtype=t.dtype) for b, t in part.buffers().items()}
            axes = {b: next(i for i, (c, f) in enumerate(zip(t.shape, out[b].shape)) if c != f)
                    for b, t in part.buffers().items()}
            per_row = {b: t.shape[axes[b]] / rows for b, t in part.buffers().items()}  # q4k's packed scale codes: 1/2
        for b, t in part.buffers().items():
            out[b].narrow(axes[b], int(r0 * per_row[b]), t.shape[axes[b]]).copy_(t)
    return type(first)(first.kind, (n, k), out)


def _from_gguf(raw: np.ndarray, name: str, n: int, k: int) -> Q4Weight | Q8Weight:
    if name in ("Q4_K", "Q6_K", "Q3_K", "IQ4_XS", "Q5_K", "Q2_K"):
        return _k_from_gguf(raw, name, n, k)
    if name in ("Q5_0", "IQ4_NL", "Q5_1"):  # the blocks as they are
        if k % 32:
            raise ValueError(f"from_gguf: K = {k} is not a multiple of the 32-value block")
        cls = {"Q5_0": Q50Weight, "IQ4_NL": IQ4NLWeight, "Q5_1": Q51Weight}[name]
        return cls(cls.KIND, (n, k), {"qweight": torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(n, -1))})
    bytes_per_block = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}.get(name)
    if bytes_per_block is None:
        raise ValueError(f"from_gguf: {name} blocks are not supported (only Q4_0, Q4_1, Q8_0)")
    if k % 32:
        raise ValueError(f"from_gguf: K = {k} is not a multiple of the 32-value block")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // 32, bytes_per_block)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # [N, G]
    if name == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(n, k))
        return Q8Weight(QuantKind("q8", 32, torch.float16), (n, k),
                        {"qweight": q, "scales": torch.from_numpy(d.copy())})
    nib = blocks[..., bytes_per_block - 16:]  # [N, G, 16]: byte j = value j (low nibble) | value j + 16 (high)
    np_ = _round16(n)
    q = torch.full((np_, k), 8, dtype=torch.uint8)
    q[:n] = torch.from_numpy(np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(n, k))
    if name == "Q4_0":  # d as stored (containers before q4_0 hold it as q4 with f16 (d, +0): still read)
        sc = torch.zeros(k // 32, np_, dtype=torch.float16)
        sc[:, :n] = torch.from_numpy(d.T.copy())
        return Q40Weight(GGUF_EXACT["Q4_0"], (n, k), {"qweight": _pack_q4(q), "scales": sc})
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    zero64 = m.astype(np.float64) + 8 * d.astype(np.float64)
    if not np.array_equal(zero64.astype(np.float32).astype(np.float64), zero64):  # the kernels' zero, m + 8 d in f32
        raise ValueError("from_gguf: a Q4_1 block's m + 8 d is not exact in float32; keep this tensor as float")
    sm = torch.zeros(k // 32, np_, 2, dtype=torch.float16)
    sm[:, :n, 0] = torch.from_numpy(d.T.copy())
    sm[:, :n, 1] = torch.from_numpy(m.T.copy())
    return Q41Weight(GGUF_EXACT["Q4_1"], (n, k), {"qweight": _pack_q4(q), "scales_mins": sm})


# ---- container helpers ----------------------------------------------------------------------------------------

# GGUF block types re-expressed without loss, and the kind (group 32, scale dtype) each becomes.
GGUF_EXACT = {
    "Q4_0": QuantKind("q4_0", 32, torch.float16),
    "Q4_1": QuantKind("q4_1", 32, torch.float16),
    "Q8_0": QuantKind("q8", 32, torch.float16),
}
# ... and the K-quants, kept exactly unless a conversion asks to re-quantize them by the q4 policy (--requantize)
GGUF_K_EXACT = {"Q4_K": QuantKind("q4k", 32, torch.float16), "Q6_K": QuantKind("q6k", 16, torch.float16),
                "Q3_K": QuantKind("q3k", 16, torch.float16), "IQ4_XS": QuantKind("iq4_xs", 16, torch.float16),
                "Q5_0": QuantKind("q5_0", 32, torch.float16), "IQ4_NL": QuantKind("iq4_nl", 32, torch.float16),
                "Q5_K": QuantKind("q5k", 32, torch.float16), "Q2_K": QuantKind("q2k", 16, torch.float16),
                "Q5_1": QuantKind("q5_1", 32, torch.float16)}


def supports(kind: QuantKind | str, shape: tuple[int, ...], group_size: int | None = None) -> bool:
    """Whether a weight of `shape` can be stored as `kind` (2-D, K divisible by the group size)."""
    if len(shape) != 2:
        return False
    try:
        _check_shape(_kind(kind, group_size), tuple(shape))
    except ValueError:
        return False
    return True


def from_buffers(kind: str, shape, group_size: int, buffers: dict[str, torch.Tensor]) -> Q4Weight | Q8Weight:
    cls = {"q4": Q4Weight, "q8": Q8Weight, "q4k": Q4KWeight, "q8k": Q8KWeight, "q6k": Q6KWeight, "q3k": Q3KWeight,
           "iq4_xs": IQ4XSWeight, "iq4_nl": IQ4NLWeight, "q5_0": Q50Weight, "q4_1": Q41Weight, "q4_0": Q40Weight,
           "q5k": Q5KWeight, "q2k": Q2KWeight, "q5_1": Q51Weight}[kind]
    return cls.from_buffers(tuple(shape), group_size, buffers)


# ---- GGUF K-quants kept exactly -------------------------------------------------------------------------------
#
# GGUF K-quants kept exactly: Q4_K as the two-level q4 kind `q4k`, Q6_K as the two-level int8 kind `q8k`.
#
# A K-quant GGUF (llama.cpp's Q4_K_M) stores most matrices as Q4_K and the rest as Q6_K. Re-quantizing them into
# q4 (one bf16 scale + zero per 64) and q8 (one scale per channel) is lossy twice and costs more bytes; these
# kinds store the GGUF's own codes and scales, so a container's weights are the source's, bit for bit
# (`dequantize()` equals `gguf.quants.dequantize` in f32), at about the source's bytes.
#
# q4k (N out, K in, K % 256 == 0, Np = N rounded up to 16): 4.5 bits per weight, Q4_K's
#   qweight  uint8 [Np, K/2]        codes q in [0, 15] in the q4 tile layout (colibri.quant.kinds, top of the file)
#   scales   uint8 [Np/16, K/32 * 24]  the 6-bit (sc, m) per group of 32 and row as 12 bits v = sc | m << 6: per 16
#                                   rows their v & 255, then 8 bytes of v >> 8 (rows 0-7 low nibbles, 8-15 high),
#                                   so 8 or 16 rows decode with two zero-extending loads
#   supers   f16    [Np/16, K/256 * 32]  (d, dmin) per 256 values and row
#   Both side parts are written a tile of the codes after the other (64 rows; the last tile 16, 32 or 48): per
#   group of 32 (scales) or 256 (supers) the tile's rows, so a tile's pass reads them as one run of bytes
#   (containers of format version 5). Version 4 held them group-major, scales [K/32, Np/16, 24] and supers
#   [K/256, Np, 2]; those made before, scales [K/32, Np, 2] ((sc, m) a byte each, 4.625 bits per weight). Both
#   are read still (q4k_legacy_layouts).
#   w = (d * sc) * q - dmin * m, in f32: d * sc and dmin * m are exact (11 + 6 bits), so is their product by q;
#   one rounding, in the subtraction, as gguf's dequantize.
# q6k: 6.5625 bits per weight, Q6_K's own blocks as the file stores them
#   qweight  uint8 [N, K/256 * 210]  per 256 values: ql[128] (low 4 bits), qh[64] (high 2 bits), sc[16] (int8 per 16
#                                    values), d (f16); the order of the codes: kernels/generic/gguf_blocks.h
#   w = (d * sc) * (q - 32), exact in f32: the values of q8k.
# q8k: 8.5625 bits per weight, Q6_K with its codes widened to bytes (what containers made before q6k hold; read,
# no longer written)
#   qweight  int8 [N, K]       q - 32, q in [0, 63]
#   scales   int8 [N, K/16]    sc per 16 values
#   supers   f16  [N, K/256]   d per 256 values
#   w = (d * sc) * q, exact in f32.
# q5k: 5.5 bits per weight, Q5_K's own blocks as the file stores them
#   qweight  uint8 [N, K/256 * 176]  per 256 values: d, dmin (f16), scales[12] (8 + 8 6-bit (sc, m): Q4_K's
#                                    packing), qh[32] (fifth bits), qs[128] (low 4 bits); order: gguf_blocks.h
#   w = (d * sc) * q - dmin * m per 32 values, q in [0, 31]: q4k's formula with a fifth bit, the same f32 steps.
# q2k: 2.625 bits per weight, Q2_K's own blocks as the file stores them
#   qweight  uint8 [N, K/256 * 84]  per 256 values: scales[16] (per 16 values: sc the low nibble, m the high),
#                                   qs[64] (2-bit codes), d, dmin (f16); order: gguf_blocks.h
#   w = (d * sc) * q - dmin * m per 16 values, q in [0, 3]: q5k's steps with an offset per 16.
# q5_1 (one-level, beside q5_0): 6 bits per weight, Q5_1's own 24-byte blocks, per 32 values d, m (f16), qh (the
#   fifth bits), qs[16] (the low nibbles); w = d * q + m, q in [0, 31] (d * q exact, one rounding in the addition).
# Compute: colibri.kernels (kquant.cpp) decodes the scales per group on the fly; the torch fallback dequantizes a
# few MiB at a time (exactly `dequantize()`), as q4 / q8 do.

SUPER = 256  # values per K-quant super-block
Q6K_BLOCK = 210  # bytes per 256 values of a Q6_K block
Q3K_BLOCK = 110  # ... of a Q3_K block
IQ4XS_BLOCK = 136  # ... of an IQ4_XS block
Q5K_BLOCK = 176  # ... of a Q5_K block
Q2K_BLOCK = 84  # ... of a Q2_K block
IQ4NL_BLOCK = 18  # bytes per 32 values of an IQ4_NL block
Q4K, Q6K = GGUF_K_EXACT["Q4_K"], GGUF_K_EXACT["Q6_K"]
Q8K = QuantKind("q8k", 16, torch.float16)
Q50 = GGUF_K_EXACT["Q5_0"]
Q50_BLOCK = 22  # bytes per 32 values of a Q5_0 block
Q51_BLOCK = 24  # ... of a Q5_1 block
G32_BLOCK = {"q5_0": Q50_BLOCK, "q5_1": Q51_BLOCK, "iq4_nl": IQ4NL_BLOCK}  # the 32-value block kinds' block bytes
_K_KIND = {"q4k": Q4K, "q8k": Q8K, "q6k": Q6K, "q5_0": Q50, "q4_1": GGUF_EXACT["Q4_1"], "q4_0": GGUF_EXACT["Q4_0"],
           **{k.name: k for k in GGUF_K_EXACT.values()}}


def q4k_legacy_layouts(shape: tuple[int, int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The shapes of a q4k weight's (scales, supers) that older containers hold: version 4's group-major ones and
    those of the versions before ((sc, m) a byte each)."""
    n, k = shape
    np_ = _round16(n)
    return [((k // 32, np_ // 16, 24), (k // SUPER, np_, 2)), ((k // 32, np_, 2), (k // SUPER, np_, 2))]


def q4k_pack_codes(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """6-bit (sc, m) codes, uint8 [G, Np] each (Np % 16 == 0) -> the packed q4k codes group-major, uint8
    [G, Np/16, 24]: per 16 rows the low bytes of v = sc | m << 6, then 8 bytes whose low / high nibbles hold rows
    0-7's / 8-15's v >> 8."""
    v = (sc.to(torch.int32) | (m.to(torch.int32) << 6)).view(sc.shape[0], -1, 16)
    hi = v >> 8
    return torch.cat([v & 0xFF, hi[..., :8] | (hi[..., 8:] << 4)], dim=-1).to(torch.uint8)


def _tile_spans(units: int) -> list[tuple[int, int]]:
    """The q4 tiles of a weight of `units` 16-row units as (first unit, units): 4 each, the last 1 to 4."""
    return [(u, min(_TILE // 16, units - u)) for u in range(0, units, _TILE // 16)]


def q4k_tiled(scales: torch.Tensor, supers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-major packed scales [G, Np/16, 24] and supers [K/256, Np, 2] -> the tile-major parts containers hold
    (version 5): scales [Np/16, G * 24], supers [Np/16, K/256 * 32] (the top of this section)."""
    g, units, _ = scales.shape
    nb = supers.shape[0]
    sc = [scales[:, u:u + n].reshape(-1) for u, n in _tile_spans(units)]
    sup = [supers[:, 16 * u:16 * (u + n)].reshape(-1) for u, n in _tile_spans(units)]
    return torch.cat(sc).view(units, g * 24), torch.cat(sup).view(units, nb * 32)


def _untile(part: torch.Tensor, r0: int, r1: int, shape) -> tuple[torch.Tensor, int]:
    """A tile-major q4k part [Np/16, ...] over the whole tiles holding rows [r0, r1), group-major, and the first row
    it holds. shape(n): a tile's of n units as group-major (scales: (G, n, 24); supers: (K/256, 16 n, 2))."""
    spans = [(u, n) for u, n in _tile_spans(part.shape[0]) if 16 * u < r1 and 16 * (u + n) > r0]
    if not spans:
        return part[:0].reshape(shape(0)), r0
    return torch.cat([part[u:u + n].reshape(shape(n)) for u, n in spans], dim=1), 16 * spans[0][0]


def q4k_group_major(scales: torch.Tensor, supers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A q4k weight's tile-major scales and supers in version 4's group-major layout: [G, Np/16, 24] and
    [K/256, Np, 2]."""
    r1 = 16 * scales.shape[0]
    g, nb = scales.shape[1] // 24, supers.shape[1] // 32
    return (_untile(scales, 0, r1, lambda n: (g, n, 24))[0], _untile(supers, 0, r1, lambda n: (nb, 16 * n, 2))[0])


def q4k_codes(scales: torch.Tensor, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sc, m) uint8 [G, r1 - r0] each of rows [r0, r1) from a q4k weight's scales, of any layout."""
    if scales.dim() == 2:  # tile-major: the tiles holding the rows, group-major
        g = scales.shape[1] // 24
        scales, first = _untile(scales, r0, r1, lambda n: (g, n, 24))
        r0, r1 = r0 - first, r1 - first
    if scales.shape[-1] == 2:  # a byte each (containers before version 4)
        return scales[:, r0:r1, 0], scales[:, r0:r1, 1]
    u = scales[:, r0 // 16:(r1 + 15) // 16].to(torch.int32)  # the 16-row units holding the rows
    hi = torch.cat([u[..., 16:] & 15, u[..., 16:] >> 4], dim=-1)
    v = (u[..., :16] | (hi << 8)).flatten(1)[:, r0 % 16:r0 % 16 + r1 - r0]
    return (v & 63).to(torch.uint8), (v >> 6).to(torch.uint8)


def q4k_supers(supers: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """(d, dmin) f16 [K/256, r1 - r0, 2] of rows [r0, r1) from a q4k weight's supers, of any layout."""
    if supers.dim() == 2:
        nb = supers.shape[1] // 32
        supers, first = _untile(supers, r0, r1, lambda n: (nb, 16 * n, 2))
        r0, r1 = r0 - first, r1 - first
    return supers[:, r0:r1]


def tile_side_rows(kind: str, part: str, v: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) (whole tiles) of a tiled kind's side part ([G, Np, ...], q4k's packed scales [G, Np/16, 24] or
    its tile-major parts [Np/16, ...]), contiguous."""
    if kind == "q4k" and v.dim() == 2:  # tile-major: a run of whole units
        return v[r0 // 16:(r1 + 15) // 16]
    if kind == "q4k" and part == "scales" and v.shape[-1] == 24:
        return v[:, r0 // 16:(r1 + 15) // 16].contiguous()
    return v[:, r0:r1].contiguous()


def _k_buffer_layout(kind: QuantKind, n: int, k: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    if kind.name == "q4k":
        np_ = _round16(n)
        return {"qweight": (torch.uint8, (np_, k // 2)), "scales": (torch.uint8, (np_ // 16, k // 32 * 24)),
                "supers": (torch.float16, (np_ // 16, k // SUPER * 32))}
    if kind.name in ("q6k", "q3k", "iq4_xs", "q5k", "q2k"):
        per_block = {"q6k": Q6K_BLOCK, "q3k": Q3K_BLOCK, "iq4_xs": IQ4XS_BLOCK, "q5k": Q5K_BLOCK,
                     "q2k": Q2K_BLOCK}[kind.name]
        return {"qweight": (torch.uint8, (n, k // SUPER * per_block))}
    return {"qweight": (torch.int8, (n, k)), "scales": (torch.int8, (n, k // 16)),
            "supers": (torch.float16, (n, k // SUPER))}


class Q4KWeight(_DerivedQ4Weight):
    """Q4_K kept exactly: w = (d * sc) * q - dmin * m per group of 32 (see the top of the file)."""

    codes_offset = 0  # the dequantizing helpers of Q4Weight see the codes q, not q - 8
    OP, OP_I8, OP_ARGS, OP_GROUPED = "q4k_linear", "q4k_linear_i8", ("qweight", "scales", "supers"), False
    I8_GROUP = 32

    def __init__(self, kind: QuantKind, shape, buffers: dict[str, torch.Tensor]):
        # skips Q4Weight's int4 repack: torch's int4 kernel cannot take two-level scales (the fallback dequantizes)
        super(Q4Weight, self).__init__(kind, shape, buffers)

    @classmethod
    def from_buffers(cls, shape, group_size: int, buffers: dict[str, torch.Tensor]):
        return cls(Q4K, shape, buffers)

    def _scales_zeros_f32(self, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(d * sc, -dmin * m), f32 [K/32, r1 - r0] each: w = q * scale + zero."""
        sc, mn = q4k_codes(self._buffers["scales"], r0, r1)
        sup = q4k_supers(self._buffers["supers"], r0, r1).float().repeat_interleave(SUPER // 32, dim=0)
        return sup[..., 0] * sc.float(), -(sup[..., 1] * mn.float())


class Q8KWeight(Q8Weight):
    """Q6_K kept exactly: w = (d * sc) * (q - 32) per 16 values (see the top of the file)."""

    # (the LOSSY int8 op quantizes x per 16 values)
    OP, OP_I8, OP_ARGS, OP_GROUPED = "q8k_linear", "q8k_linear_i8", ("qweight", "scales", "supers"), False
    I8_GROUP = 16

    @classmethod
    def from_buffers(cls, shape, group_size: int, buffers: dict[str, torch.Tensor]):
        return cls(Q8K, shape, buffers)

    def _scales_f32(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """d * sc of `rows` (a slice, or row ids), f32 [rows, K/16] (exact)."""
        sup = self._buffers["supers"][rows].float().repeat_interleave(SUPER // 16, dim=1)
        return sup * self._buffers["scales"][rows].float()


class _BlocksWeight(Q8Weight):
    """A GGUF kind kept as the file's blocks whose values are those of a kind with int8 codes (q8k or q8 g32): the
    native kernels read the blocks in place (`OP`), and the torch fallback dequantizes as q8 does (`_codes`,
    `_scales_f32`). The LOSSY int8 mode reads the kinds with q8k's values (q6k, q3k, iq4_xs) with q8k's int8
    kernels over codes decoded natively from the blocks (`OP_I8`: q8k_linear_i8's bits); it leaves the others
    exact (decoding them to int8 codes on every call in torch cost 10-40x their exact kernel at every pass size up
    to 256: docs/performance.md, "LOSSY int8 activations")."""

    KIND: QuantKind
    BLOCK: int  # bytes per block
    VALUES: int  # values per block
    # the ops over the blocks; the LOSSY int8 one, if any, quantizes x per 16 values, as q8k's
    OP_I8, OP_ARGS, OP_GROUPED, I8_GROUP = None, ("qweight",), False, 16

    @classmethod
    def from_buffers(cls, shape, group_size: int, buffers: dict[str, torch.Tensor]):
        return cls(cls.KIND, shape, buffers)

    NATIVE_ROWS = False  # rows of its table decoded by the native `kquant_rows` (the kinds of 256-value blocks)

    def _blocks(self, rows: slice | torch.Tensor) -> torch.Tensor:
        b = self._buffers["qweight"][rows]
        return b.view(b.shape[0], self.shape[1] // self.VALUES, self.BLOCK)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """f32 [len(ids), K]: rows of a lookup table (token embedding), the same values natively or in torch (a
        decode step's one row took about twenty torch ops, run cold)."""
        if self.NATIVE_ROWS and kernels.native():
            return kernels.library().kquant_rows(self._buffers["qweight"], ids.to(torch.int64), self.OP)
        return self._torch_rows(ids)

    def _torch_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return super().rows(ids)


class _KBlocksWeight(_BlocksWeight):
    """Blocks of 256 values with q8k's values (codes times d * sc per 16 values)."""

    VALUES, NATIVE_ROWS = SUPER, True

    def _scale_codes(self, b: torch.Tensor) -> torch.Tensor:
        """int8 [rows, K/16] scale codes of blocks b [rows, K/256, BLOCK]."""
        raise NotImplementedError

    def _supers(self, b: torch.Tensor) -> torch.Tensor:
        """f16 [rows, K/256]: each block's d (its last two bytes)."""
        return b[..., self.BLOCK - 2:].contiguous().view(torch.float16).reshape(b.shape[0], -1)

    def _scales_f32(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """d * sc of `rows`, f32 [rows, K/16] (exact)."""
        b = self._blocks(rows)
        return self._supers(b).float().repeat_interleave(SUPER // 16, dim=1) * self._scale_codes(b).float()

    def _widened(self, rows: slice) -> dict[str, torch.Tensor]:
        b = self._blocks(rows)
        return {"qweight": self._codes(rows).contiguous(), "scales": self._scale_codes(b), "supers": self._supers(b)}


    def as_q8k(self) -> Q8KWeight:
        """The same weight in the q8k kind (its codes and scales widened to bytes)."""
        return Q8KWeight(Q8K, self.shape, self._widened(slice(0, self.shape[0])))


class Q6KWeight(_KBlocksWeight):
    """Q6_K kept exactly at its own size (see the top of the file): codes q - 32, int8 scales per 16."""

    KIND, BLOCK, OP, OP_I8 = Q6K, Q6K_BLOCK, "q6k_linear", "q6k_linear_i8"

    def _codes(self, rows: slice | torch.Tensor) -> torch.Tensor:
        b = self._blocks(rows)
        r, nb = b.shape[:2]
        shift = torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 1, 2, 1)
        lo = (b[..., :128].reshape(r, nb, 2, 1, 64) >> shift) & 0x0F  # [half, nibble, byte]: value 32 j + l
        hshift = (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 1, 4, 1)
        hi = (b[..., 128:192].reshape(r, nb, 2, 1, 32) >> hshift) & 3
        return ((lo.reshape(r, nb, 2, 4, 32) | (hi << 4)).view(torch.int8) - 32).reshape(r, -1)

    def _scale_codes(self, b: torch.Tensor) -> torch.Tensor:
        return b[..., 192:208].contiguous().view(torch.int8).reshape(b.shape[0], -1)


class Q3KWeight(_KBlocksWeight):
    """Q3_K kept exactly at its own size (3.4375 bits a weight): per 256 values hmask[32] (the third bit), qs[64]
    (the low two), 12 bytes of 6-bit scales, d (f16); w = (d * (sc - 32)) * (q - 4): q8k's form (order of the codes
    and scales: kernels/generic/gguf_blocks.h)."""

    KIND, BLOCK, OP, OP_I8 = GGUF_K_EXACT["Q3_K"], Q3K_BLOCK, "q3k_linear", "q3k_linear_i8"

    def _codes(self, rows: slice | torch.Tensor) -> torch.Tensor:
        b = self._blocks(rows)
        r, nb = b.shape[:2]
        shift = (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 1, 4, 1)
        lo = (b[..., 32:96].reshape(r, nb, 2, 1, 32) >> shift) & 3
        hi = (b[..., 0:32].reshape(r, nb, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)) & 1
        return ((lo | (hi.reshape(r, nb, 2, 4, 32) << 2)).view(torch.int8) - 4).reshape(r, -1)

    def _scale_codes(self, b: torch.Tensor) -> torch.Tensor:
        r, nb = b.shape[:2]
        p = b[..., 96:108]
        lo = torch.cat([p[..., 0:8] & 15, p[..., 0:8] >> 4], dim=-1)  # [rows, nb, 16]
        hi = ((p[..., 8:12].reshape(r, nb, 1, 4) >> (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 4, 1)) & 3)
        return ((lo | (hi.reshape(r, nb, 16) << 4)).view(torch.int8) - 32).reshape(r, -1)


class _G32BlocksWeight(_BlocksWeight):
    """Blocks of 32 values with an f16 d first and q8 g32's values (codes times d)."""

    VALUES = 32

    def _d(self, b: torch.Tensor) -> torch.Tensor:
        return b[..., 0:2].contiguous().view(torch.float16).reshape(b.shape[0], -1)

    def _scales_f32(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """d per 32 values of `rows`, f32 [rows, K/32]."""
        return self._d(self._blocks(rows)).float()

    def _widened(self, rows: slice) -> dict[str, torch.Tensor]:
        return {"qweight": self._codes(rows).contiguous(), "scales": self._d(self._blocks(rows))}


    def as_q8(self) -> Q8Weight:
        """The same weight as q8 with group 32 and f16 scales (its codes widened to bytes)."""
        return Q8Weight(QuantKind("q8", 32, torch.float16), self.shape, self._widened(slice(0, self.shape[0])))


class Q50Weight(_G32BlocksWeight):
    """GGUF Q5_0 kept exactly at its own size (5.5 bits a weight): w = d * (q - 16) per 32 values."""

    KIND, BLOCK, OP = Q50, Q50_BLOCK, "q5_0_linear"

    def _codes(self, rows: slice | torch.Tensor) -> torch.Tensor:
        b = self._blocks(rows)
        return (_five_bit_codes(b[..., 2:6], b[..., 6:22]).view(torch.int8) - 16).reshape(b.shape[0], -1)


def _five_bit_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0's / Q5_1's codes q in [0, 31], uint8 [..., 32], from qh uint8 [..., 4] (bit j, little-endian: value j's
    fifth bit) and qs uint8 [..., 16] (value j < 16 the low nibble of byte j, value j + 16 its high nibble)."""
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    bits = qh.contiguous().view(torch.int32)  # [..., 1]
    return q | (((bits >> torch.arange(32, dtype=torch.int32)) & 1) << 4).to(torch.uint8)


IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # llama.cpp's kvalues_iq4nl


def _iq4_values(qs: torch.Tensor) -> torch.Tensor:
    """int8 [..., 32] table values of the 16 index bytes of each group [..., 16] (low nibbles, then high)."""
    idx = torch.cat([qs & 0x0F, qs >> 4], dim=-1).long()
    return torch.tensor(IQ4_VALUES, dtype=torch.int8)[idx]


class IQ4NLWeight(_G32BlocksWeight):
    """GGUF IQ4_NL kept exactly (4.5 bits a weight): w = d * IQ4_VALUES[q] per 32 values."""

    KIND, BLOCK, OP = GGUF_K_EXACT["IQ4_NL"], IQ4NL_BLOCK, "iq4_nl_linear"

    def _codes(self, rows: slice | torch.Tensor) -> torch.Tensor:
        b = self._blocks(rows)
        return _iq4_values(b[..., 2:18]).reshape(b.shape[0], -1)


class IQ4XSWeight(_KBlocksWeight):
    """GGUF IQ4_XS kept exactly (4.25 bits a weight): per 256 values d (f16), 8 6-bit scales (ls - 32, one per 32),
    IQ4_VALUES indices; w = (d * (ls - 32)) * IQ4_VALUES[q]: q8k's form, each scale given to both of its 16s."""

    KIND, BLOCK, OP, OP_I8 = GGUF_K_EXACT["IQ4_XS"], IQ4XS_BLOCK, "iq4_xs_linear", "iq4_xs_linear_i8"

    def _codes(self, rows: slice | torch.Tensor) -> torch.Tensor:
        b = self._blocks(rows)
        r, nb = b.shape[:2]
        return _iq4_values(b[..., 8:136].reshape(r, nb, 8, 16)).reshape(r, -1)

    def _scale_codes(self, b: torch.Tensor) -> torch.Tensor:
        r, nb = b.shape[:2]
        lo = torch.stack([b[..., 4:8] & 15, b[..., 4:8] >> 4], dim=-1).reshape(r, nb, 8)  # group ib: byte ib/2
        hi16 = b[..., 2:4].contiguous().view(torch.int16).to(torch.int32)  # [rows, nb, 1]
        hi = ((hi16 >> (2 * torch.arange(8, dtype=torch.int32))) & 3).to(torch.uint8)
        sc = (lo | (hi << 4)).view(torch.int8) - 32  # [rows, nb, 8]
        return sc.repeat_interleave(2, dim=-1).reshape(r, -1)

    def _supers(self, b: torch.Tensor) -> torch.Tensor:
        return b[..., 0:2].contiguous().view(torch.float16).reshape(b.shape[0], -1)


def _k_scale_codes(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's / Q5_K's 12-byte packing of 8 + 8 6-bit codes, uint8 [..., 12] -> (sc, m), uint8 [..., 8] each."""
    a, b, c = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    sc = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], dim=-1)
    mn = torch.cat([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], dim=-1)
    return sc, mn


class _MinBlocksWeight(_BlocksWeight):
    """Blocks whose weights are codes times a scale minus an offset per group (q5k, q2k, q5_1): w = q * s - z with
    q * s exact in f32 and one rounding in the subtraction, gguf's dequantize steps (Q5_1's w = d q + m: z = -m, the
    same bits). The torch fallback forms those f32 values a few MiB of rows at a time."""

    def _terms(self, rows: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes q uint8 [rows, K], s f32 [rows, K/G], z f32 [rows, K/G]) for `rows`, groups of G values."""
        raise NotImplementedError

    def _values(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """f32 [rows, K]: q * s - z per group (the product exact, one rounding)."""
        q, s, z = self._terms(rows)
        r = q.shape[0]
        return (q.float().view(r, s.shape[1], -1) * s.unsqueeze(-1) - z.unsqueeze(-1)).view(r, -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._values(slice(0, self.shape[0])).to(dtype)

    def _torch_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self._values(ids)

    def _dequant_matmul(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        y = torch.empty(x.shape[0], n, dtype=x.dtype)
        step = max(1, _CHUNK_BYTES // (k * 4))
        for r in range(0, n, step):
            w = self._values(slice(r, r + step))
            y[:, r:r + w.shape[0]] = kernels.padded_linear(x, w.to(x.dtype))
        return y


class Q5KWeight(_MinBlocksWeight):
    """GGUF Q5_K kept exactly at its own size (5.5 bits a weight): per 256 values d, dmin (f16), 8 (sc, m) 6-bit
    pairs, codes q in [0, 31]; w = (d * sc) * q - dmin * m per 32 (see the top of the section). The native kernels
    read the blocks in place (q5k_linear: q6k's dot form with the offset); the LOSSY int8 mode leaves it exact
    (see _BlocksWeight)."""

    KIND, BLOCK, VALUES, OP = GGUF_K_EXACT["Q5_K"], Q5K_BLOCK, SUPER, "q5k_linear"
    NATIVE_ROWS = True

    def _terms(self, rows: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b = self._blocks(rows)
        r, nb = b.shape[:2]
        lo = (b[..., 48:].reshape(r, nb, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 1, 2, 1)) & 15
        hi = (b[..., 16:48].reshape(r, nb, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)) & 1
        sc, mn = _k_scale_codes(b[..., 4:16])  # [rows, nb, 8]
        dd = b[..., 0:4].contiguous().view(torch.float16).float()  # [rows, nb, 2]: d, dmin
        return ((lo.reshape(r, nb, 8, 32) | (hi << 4)).reshape(r, -1), (dd[..., 0:1] * sc.float()).reshape(r, -1),
                (dd[..., 1:2] * mn.float()).reshape(r, -1))


class Q2KWeight(_MinBlocksWeight):
    """GGUF Q2_K kept exactly at its own size (2.625 bits a weight): per 256 values 16 bytes of 4-bit (sc, m) (one
    pair per 16 values), 2-bit codes, d, dmin (f16); w = (d * sc) * q - dmin * m per 16 (see the top of the
    section): q5k's form with its offsets per 16 (q2k_linear); the LOSSY int8 mode leaves it exact."""

    KIND, BLOCK, VALUES, OP = GGUF_K_EXACT["Q2_K"], Q2K_BLOCK, SUPER, "q2k_linear"
    NATIVE_ROWS = True

    def _terms(self, rows: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b = self._blocks(rows)
        r, nb = b.shape[:2]
        # value 128 h + 32 j + l: bits 2 j of qs[32 h + l]
        q = (b[..., 16:80].reshape(r, nb, 2, 1, 32) >> (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 1, 4, 1)) & 3
        sm = b[..., 0:16]  # [rows, nb, 16]
        dd = b[..., 80:84].contiguous().view(torch.float16).float()  # [rows, nb, 2]: d, dmin
        return (q.reshape(r, -1), (dd[..., 0:1] * (sm & 15).float()).reshape(r, -1),
                (dd[..., 1:2] * (sm >> 4).float()).reshape(r, -1))


class Q51Weight(_MinBlocksWeight):
    """GGUF Q5_1 kept exactly at its own size (6 bits a weight): per 32 values d, m (f16), the fifth bits, the low
    nibbles; w = d * q + m, q in [0, 31], formed as d * q - (-m) (the same bits): q5_0's form with an offset per
    block (q5_1_linear); the LOSSY int8 mode leaves it exact. llama.cpp's Q5_K_M takes it for rows whose length is
    not a multiple of 256."""

    KIND, BLOCK, VALUES, OP = GGUF_K_EXACT["Q5_1"], Q51_BLOCK, 32, "q5_1_linear"

    def _terms(self, rows: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b = self._blocks(rows)
        dm = b[..., 0:4].contiguous().view(torch.float16).float()  # [rows, K/32, 2]: d, m
        return _five_bit_codes(b[..., 4:8], b[..., 8:24]).reshape(b.shape[0], -1), dm[..., 0], -dm[..., 1]


def _k_from_gguf(raw: np.ndarray, name: str, n: int, k: int) -> Q4KWeight | Q8KWeight:
    """GGUF Q4_K / Q6_K blocks (uint8 [N, K / 256 * block bytes], rows in HF order) re-expressed without loss."""
    if k % SUPER:
        raise ValueError(f"from_gguf: K = {k} is not a multiple of the {SUPER}-value K-quant block")
    nb = k // SUPER
    if name == "Q4_K":
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, nb, 144)
        dd = blocks[..., 0:4].copy().view(np.float16)  # [N, nb, 2]: d, dmin
        s = blocks[..., 4:16].reshape(n, nb, 3, 4)
        a, b, c = s[..., 0, :], s[..., 1, :], s[..., 2, :]  # llama.cpp's 12-byte packing of 8 + 8 6-bit codes
        sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)  # [N, nb, 8]
        mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
        qs = blocks[..., 16:].reshape(n, nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        q = (qs & 0x0F).reshape(n, k)  # value 64 j + i: low nibble of byte 32 j + i (i < 32), else its high nibble
        np_ = _round16(n)
        qp = torch.zeros(np_, k, dtype=torch.uint8)
        qp[:n] = torch.from_numpy(q)
        codes = torch.zeros(2, k // 32, np_, dtype=torch.uint8)  # (sc, m) [G, Np]
        codes[:, :, :n] = torch.from_numpy(np.stack([sc, mn]).reshape(2, n, k // 32).transpose(0, 2, 1).copy())
        supers = torch.zeros(nb, np_, 2, dtype=torch.float16)
        supers[:, :n] = torch.from_numpy(dd.transpose(1, 0, 2).copy())
        scales, supers = q4k_tiled(q4k_pack_codes(codes[0], codes[1]), supers)
        return Q4KWeight(Q4K, (n, k), {"qweight": _pack_q4(qp), "scales": scales, "supers": supers})
    if name in ("Q6_K", "Q3_K", "IQ4_XS", "Q5_K", "Q2_K"):  # the blocks as they are
        cls = {"Q6_K": Q6KWeight, "Q3_K": Q3KWeight, "IQ4_XS": IQ4XSWeight, "Q5_K": Q5KWeight, "Q2_K": Q2KWeight}[name]
        return cls(cls.KIND, (n, k), {"qweight": torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(n, -1))})
    raise ValueError(f"from_gguf: {name} is not a K-quant kept exactly (Q4_K, Q6_K, Q3_K, IQ4_XS, Q5_K, Q2_K)")


# ---- back to GGUF blocks --------------------------------------------------------------------------------------
#
# The inverse of from_gguf: each kind kept from a GGUF gives back the file's blocks, byte for byte (rows in HF
# order, [N, K / block values * block bytes]); `colibri convert --output model.gguf` writes them.

def stored_kind(name: str, group_size: int | None, scale_dtype: torch.dtype | None) -> QuantKind:
    """The QuantKind of a stored weight from what a manifest records: its kind, group size and (q4, q8) the dtype of
    its scales part."""
    if name in ("q4", "q8"):
        return QuantKind(name, group_size or 0, scale_dtype)
    return _kind(name, group_size)


def gguf_type(kind: QuantKind) -> str | None:
    """The GGUF type `to_gguf` writes a weight of `kind` as: the type it was imported from, Q6_K for q8k (Q6_K with
    its codes widened), Q8_0 for q8 per channel or in groups of a multiple of 32 (exact where its scales fit f16);
    None where no GGUF type holds it (Colibri's own q4: a bf16 scale and zero per group)."""
    t = next((t for t, k in {**GGUF_EXACT, **GGUF_K_EXACT}.items() if k == kind), None)
    if t is not None:
        return t
    if kind.name == "q8k":
        return "Q6_K"
    if kind == QuantKind("q4", 32, torch.float16):  # Q4_0 as containers before the q4_0 kind hold it: (d, +0)
        return "Q4_0"
    if kind.name == "q8" and (kind.group_size == 0 or kind.group_size % 32 == 0):
        return "Q8_0"
    return None


def to_gguf(w: _QuantWeight) -> np.ndarray:
    """The GGUF blocks (uint8 [N, row bytes], rows in HF order) of type `gguf_type(w.kind)` holding exactly `w`'s
    values. Kinds imported from a GGUF give back the imported bytes: to_gguf(from_gguf(raw, t, shape)) == raw.
    ValueError where that type cannot hold them exactly (q8 scales below f16's range)."""
    n, k = w.shape
    t = gguf_type(w.kind)
    b = w.buffers()
    if isinstance(w, _BlocksWeight):  # the file's blocks as they are
        return b["qweight"].numpy()
    if t == "Q4_K":
        return _q4k_blocks(b, n, k)
    if t == "Q6_K":
        return _q6k_blocks(b, n, k)
    if w.kind.name == "q4_0":
        return _g32_nibble_blocks(b["qweight"], b["scales"].unsqueeze(-1), n, k)
    if t == "Q4_0" and not b["scales_zeros"][..., 1].view(torch.int16).any():  # Q4_0: d, and a zero of +0.0
        return _g32_nibble_blocks(b["qweight"], b["scales_zeros"][..., :1], n, k)
    if t == "Q4_1":
        return _g32_nibble_blocks(b["qweight"], b["scales_mins"], n, k)
    if t == "Q8_0":
        s = b["scales"].view(n, -1)
        d = s.to(torch.float16)
        if not torch.equal(d.to(s.dtype), s):
            raise ValueError("to_gguf: a q8 scale is outside f16's range (Q8_0 stores d in f16)")
        d = d.repeat_interleave(k // 32 // d.shape[1], dim=1)  # [N, K/32]: one d per 32-value block
        codes = b["qweight"].view(n, k // 32, 32).view(torch.uint8)
        return torch.cat([d.unsqueeze(-1).view(torch.uint8), codes], dim=-1).reshape(n, -1).numpy()
    raise ValueError(f"to_gguf: no GGUF type holds a {w.kind.name} weight (group {w.group_size}, "
                     f"{w.kind.scale_dtype} scales) exactly")


def _g32_nibble_blocks(qweight: torch.Tensor, params: torch.Tensor, n: int, k: int) -> np.ndarray:
    """Q4_0 / Q4_1 blocks from q4 tiles and f16 params [K/32, Np, 1 or 2] ((d) or (d, m)): per 32 values the
    params, then byte j = q[j] | q[j + 16] << 4."""
    q = (_unpack_q4(qweight)[:n] + 8).view(torch.uint8).view(n, k // 32, 2, 16)
    nib = q[:, :, 0] | (q[:, :, 1] << 4)  # [N, K/32, 16]
    p = params[:, :n].transpose(0, 1).contiguous().view(torch.uint8)  # [N, K/32, 2 or 4] bytes
    return torch.cat([p, nib], dim=-1).reshape(n, -1).numpy()


def _q4k_blocks(b: dict[str, torch.Tensor], n: int, k: int) -> np.ndarray:
    """Q4_K blocks from q4k's buffers: d, dmin; the 12-byte packing of the 8 + 8 6-bit (sc, m) codes; the codes,
    value 64 j + i in byte 32 j + i's low nibble (i < 32) or byte 32 j + i - 32's high nibble."""
    nb = k // SUPER
    out = np.empty((n, nb, 144), dtype=np.uint8)
    out[..., 0:4] = q4k_supers(b["supers"], 0, n).transpose(0, 1).contiguous().view(torch.uint8).numpy()  # [N, nb, 4]
    sc, mn = (c.transpose(0, 1).reshape(n, nb, 8).numpy() for c in q4k_codes(b["scales"], 0, n))  # [N, nb, 8]
    out[..., 4:8] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    out[..., 8:12] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    out[..., 12:16] = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    q = (_unpack_q4(b["qweight"])[:n] + 8).view(torch.uint8).numpy().reshape(n, nb, 4, 2, 32)
    out[..., 16:] = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(n, nb, 128)
    return out.reshape(n, -1)


def _q6k_blocks(b: dict[str, torch.Tensor], n: int, k: int) -> np.ndarray:
    """Q6_K blocks from q8k's widened codes (the inverse of Q6KWeight._codes: value 128 h + 32 j + l has its low 4
    bits in ql byte 64 h + 32 (j % 2) + l, nibble j // 2, and its high 2 in qh byte 32 h + l, bits 2 j)."""
    nb = k // SUPER
    q = (b["qweight"].view(n, nb, 2, 4, 32) + 32).view(torch.uint8).numpy()  # [N, nb, half, j, l]
    lo, hi = q & 0x0F, q >> 4
    out = np.empty((n, nb, Q6K_BLOCK), dtype=np.uint8)
    out[..., 0:128] = (lo[:, :, :, 0:2] | (lo[:, :, :, 2:4] << 4)).reshape(n, nb, 128)
    out[..., 128:192] = (hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4)
                         | (hi[:, :, :, 3] << 6)).reshape(n, nb, 64)
    out[..., 192:208] = b["scales"].view(n, nb, 16).view(torch.uint8).numpy()
    out[..., 208:210] = b["supers"].view(n, nb, 1).view(torch.uint8).numpy()
    return out.reshape(n, -1)

"""GGUF K-quants kept exactly: Q4_K as the two-level q4 kind `q4k`, Q6_K as the two-level int8 kind `q8k`.

A K-quant GGUF (llama.cpp's Q4_K_M) stores most matrices as Q4_K and the rest as Q6_K. Re-quantizing them into
q4 (one bf16 scale + zero per 64) and q8 (one scale per channel) is lossy twice and costs more bytes; these
kinds store the GGUF's own codes and scales, so a container's weights are the source's, bit for bit
(`dequantize()` equals `gguf.quants.dequantize` in f32), at about the source's bytes.

q4k (N out, K in, K % 256 == 0, Np = N rounded up to 16): 4.625 bits per weight (Q4_K: 4.5, its 6-bit scale
codes packed; here one byte each)
  qweight  uint8 [Np, K/2]       codes q in [0, 15] in the q4 tile layout (colibri.quant, top of the file)
  scales   uint8 [K/32, Np, 2]   (sc, m) per group of 32 and row, 6-bit codes
  supers   f16   [K/256, Np, 2]  (d, dmin) per 256 values and row
  w = (d * sc) * q - dmin * m, in f32: d * sc and dmin * m are exact (11 + 6 bits), so is their product by q;
  one rounding, in the subtraction, as gguf's dequantize.
q8k: 8.5625 bits per weight (Q6_K: 6.5625)
  qweight  int8 [N, K]       q - 32, q in [0, 63]
  scales   int8 [N, K/16]    sc per 16 values
  supers   f16  [N, K/256]   d per 256 values
  w = (d * sc) * q, exact in f32.
Compute: colibri.kernels (kquant.cpp) decodes the scales per group on the fly; the torch fallback dequantizes a
few MiB at a time (exactly `dequantize()`), as q4 / q8 do.
"""

from __future__ import annotations

import numpy as np
import torch

from colibri import kernels
from colibri.quant import _TILE, GGUF_K_EXACT, Q4Weight, Q8Weight, QuantKind, _pack_q4, _round16

SUPER = 256  # values per K-quant super-block
Q4K, Q8K = GGUF_K_EXACT["Q4_K"], GGUF_K_EXACT["Q6_K"]
KINDS = {"q4k": Q4K, "q8k": Q8K}


def buffer_layout(kind: QuantKind, n: int, k: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    if kind.name == "q4k":
        np_ = _round16(n)
        return {"qweight": (torch.uint8, (np_, k // 2)), "scales": (torch.uint8, (k // 32, np_, 2)),
                "supers": (torch.float16, (k // SUPER, np_, 2))}
    return {"qweight": (torch.int8, (n, k)), "scales": (torch.int8, (n, k // 16)),
            "supers": (torch.float16, (n, k // SUPER))}


class Q4KWeight(Q4Weight):
    """Q4_K kept exactly: w = (d * sc) * q - dmin * m per group of 32 (see the top of the file)."""

    codes_offset = 0  # the dequantizing helpers of Q4Weight see the codes q, not q - 8

    def __init__(self, kind: QuantKind, shape, buffers: dict[str, torch.Tensor]):
        # skips Q4Weight's int4 repack: torch's int4 kernel cannot take two-level scales (the fallback dequantizes)
        super(Q4Weight, self).__init__(kind, shape, buffers)

    @classmethod
    def from_buffers(cls, shape, group_size: int, buffers: dict[str, torch.Tensor]):
        return cls(Q4K, shape, buffers)

    def _linear_2d(self, x: torch.Tensor) -> torch.Tensor:
        b = self._buffers
        if kernels.native():
            return kernels.ops().q4k_linear(x, b["qweight"], b["scales"], b["supers"])
        return kernels.blocked(self._dequant_matmul, x, b["qweight"].shape[0])

    def _scales_zeros_f32(self, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(d * sc, -dmin * m), f32 [K/32, r1 - r0] each: w = q * scale + zero."""
        sc = self._buffers["scales"][:, r0:r1].float()
        sup = self._buffers["supers"][:, r0:r1].float().repeat_interleave(SUPER // 32, dim=0)
        return sup[..., 0] * sc[..., 0], -(sup[..., 1] * sc[..., 1])

    def _tile_params_f32(self, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As Q4Weight's, [tiles, K/32, 1, 64] each, built per dequantize step from the two-level codes."""
        k = self.shape[1]
        s, z = self._scales_zeros_f32(t0 * _TILE, t1 * _TILE)  # [G, rows]
        p = torch.stack([s, z]).view(2, k // 32, t1 - t0, _TILE).permute(0, 2, 1, 3).unsqueeze(3).contiguous()
        return p[0], p[1]


class Q8KWeight(Q8Weight):
    """Q6_K kept exactly: w = (d * sc) * (q - 32) per 16 values (see the top of the file)."""

    @classmethod
    def from_buffers(cls, shape, group_size: int, buffers: dict[str, torch.Tensor]):
        return cls(Q8K, shape, buffers)

    def _linear_2d(self, x: torch.Tensor) -> torch.Tensor:
        b = self._buffers
        if kernels.native():
            return kernels.ops().q8k_linear(x, b["qweight"], b["scales"], b["supers"])
        return kernels.blocked(self._dequant_matmul, x, self.shape[0])

    def _scales_f32(self, r0: int, r1: int) -> torch.Tensor:
        """d * sc, f32 [r1 - r0, K/16] (exact)."""
        sup = self._buffers["supers"][r0:r1].float().repeat_interleave(SUPER // 16, dim=1)
        return sup * self._buffers["scales"][r0:r1].float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        s = (self._buffers["supers"][ids].float().repeat_interleave(SUPER // 16, dim=1)
             * self._buffers["scales"][ids].float())
        return (self._buffers["qweight"][ids].float().view(len(ids), k // 16, 16) * s.unsqueeze(-1)).view(len(ids), k)


def from_gguf(raw: np.ndarray, name: str, n: int, k: int) -> Q4KWeight | Q8KWeight:
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
        scales = torch.zeros(k // 32, np_, 2, dtype=torch.uint8)
        scales[:, :n] = torch.from_numpy(np.stack([sc, mn], axis=-1).reshape(n, k // 32, 2).transpose(1, 0, 2).copy())
        supers = torch.zeros(nb, np_, 2, dtype=torch.float16)
        supers[:, :n] = torch.from_numpy(dd.transpose(1, 0, 2).copy())
        return Q4KWeight(Q4K, (n, k), {"qweight": _pack_q4(qp), "scales": scales, "supers": supers})
    if name == "Q6_K":
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, nb, 210)
        ql = blocks[..., :128].reshape(n, nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        qh = blocks[..., 128:192].reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
        lo = (ql & 0x0F).reshape(n, nb, 2, 4, 32)  # [half, quarter, i]: 128 h + 32 j + i
        hi = (qh & 0x03).reshape(n, nb, 2, 4, 32)
        q = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, k)
        sc = blocks[..., 192:208].copy().view(np.int8).reshape(n, k // 16)
        d = blocks[..., 208:210].copy().view(np.float16).reshape(n, nb)
        return Q8KWeight(Q8K, (n, k), {"qweight": torch.from_numpy(q), "scales": torch.from_numpy(sc),
                                       "supers": torch.from_numpy(d)})
    raise ValueError(f"from_gguf: {name} is not a K-quant kept exactly (Q4_K, Q6_K)")

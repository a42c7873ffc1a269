"""GGUF Q4_K / Q5_K / Q6_K / Q8_0 / Q5_0 / Q5_1 blocks from float weights, the way llama.cpp's quantizer makes them.

`quantize_blocks(w, "Q4_K", importance)` returns the GGUF block bytes of a [N, K] weight, which `kinds.from_gguf`
turns into the exact kinds (q4k, q5k, q6k, q8 g32, q5_0, q5_1): a container made from HF weights then streams
through the same kernels as an imported GGUF. Vectorized over every sub-block of a few thousand rows at a time
(torch, f32).

The searches follow llama.cpp's ggml-quants (the algorithms, re-derived here from their description):
* Q4_K: per 32-value sub-block an asymmetric 4-bit fit w ~ scale * L - min (make_qkx2_quants: candidate grids of
  15 + rmin + i * rdelta steps, each across [best offset so far, max(w)] and followed by a weighted least-squares
  fit of (scale, min) to its codes, the best by weighted squared error). Weights without an importance matrix:
  rms(sub-block) + |w|; with one: importance * sqrt(sigma^2 + w^2), sigma^2 = 2 * mean(w^2) over the super-block,
  and the wider grid of make_qkx3_quants. The 8 scales and 8 mins of a super-block are then quantized to 6 bits
  against their maximum (without importance) or, weighted by each sub-block's total weight, by make_qp_quants'
  grid search and per-code refinement (with importance); the codes are re-rounded against the stored scales.
* Q5_K: Q4_K's fit with codes in [0, 31] (make_qkx2_quants over 16 grids from 31 - 0.5 without importance, the same
  37 as Q4_K's with it), its fifth bits in qh.
* Q6_K: per 16-value sub-block a symmetric 6-bit fit (`_sym_fit`, make_qx_quants) weighted by w^2, or by the
  importance itself; the 16 scales become int8 against the largest, codes re-rounded.
* Q5_0 with importance: `_sym_fit` over 32 values weighted by importance * sqrt(sigma^2 + w^2), sigma^2 the row's
  mean square. Q5_1 with importance: `_asym_fit` over 32 values with codes in [0, 31] and make_qkx3_quants' 37
  grids, the same weights; its codes are the search's own. Q8_0, and Q5_0 / Q5_1 without importance: gguf.quants'
  own quantizers (llama.cpp's reference rounding, byte for byte; its Q8_0 ignores importance).
Measured against llama.cpp's own quantizer (ggml_quantize_chunk, docs/quality.md): the same weighted error to
1e-4 and 95-100 % of the dequantized values identical (the rest: float summation order deciding near-ties).
Rounding is half to even everywhere, as llama.cpp's nearest_int.
"""

from __future__ import annotations

import numpy as np
import torch

SUPER = 256
ROWS_VALUES = 1 << 18  # values per step: 1 MiB f32 temporaries stay in cache (8 MiB ones ran 3x slower)
_EPS = 1e-15


def _f16(t: torch.Tensor) -> torch.Tensor:
    """The value as the block stores it (f16), back in f32."""
    return t.to(torch.float16).float()


def _asym_fit(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
              direct: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sub-block (last axis) the (scale, min) of x ~ scale * L - min, L in [0, nmax], minimizing the weighted
    squared error over candidate grids (make_qkx2_quants), and the codes L of the best grid. x, w: [..., n];
    returns [...], [...] (min >= 0) and [..., n]. `direct`: each grid's error summed over its values as llama.cpp
    does, not expanded from the sums (one pass fewer, but the expansion cancels, so near-ties go the other way more
    often: Q5_1's blocks with importance 98.9 % equal to ggml's that way, 99.9 % directly; Q4_K and Q5_K, whose
    figures in docs/quality.md were measured with the expansion, keep it)."""
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True)
    rng = hi - lo
    flat = rng <= 0
    rng = torch.where(flat, 1, rng)
    sw, sx, sxx = w.sum(-1, keepdim=True), (w * x).sum(-1, keepdim=True), (w * x * x).sum(-1, keepdim=True)

    def sums(q):
        wq = w * q
        return wq.sum(-1, keepdim=True), (wq * q).sum(-1, keepdim=True), (wq * x).sum(-1, keepdim=True)

    def err(s, m, q, sl, sl2, sxl):  # sum w (s q + m - x)^2 (from the sums: one pass over the values per grid)
        if direct:
            return (w * (s * q + m - x).square()).sum(-1, keepdim=True)
        return s * s * sl2 + 2 * s * m * sl + m * m * sw - 2 * s * sxl - 2 * m * sx + sxx

    scale, mn = rng / nmax, lo
    codes = torch.round((x - lo) * (nmax / rng)).clamp_(0, nmax)
    best = err(scale, mn, codes, *sums(codes))
    for i in range(nstep + 1):
        # each grid spans [best offset so far, max], as llama.cpp's loop does (the offset may come near the max:
        # codes of non-positive or non-finite steps are 0)
        v = (x - mn) * ((rmin + rdelta * i + nmax) / (hi - mn))
        q = torch.where(v > 0, torch.round(v.clamp(max=nmax)), 0)
        sl, sl2, sxl = sums(q)
        d = sw * sl2 - sl * sl
        ok = d > 0
        d = torch.where(ok, d, 1)
        s = (sw * sxl - sx * sl) / d
        m = (sl2 * sx - sl * sxl) / d
        pos = m > 0  # a positive offset is not representable (min >= 0): refit the scale alone
        s = torch.where(pos, sxl / sl2.clamp_min(1e-30), s)
        m = torch.where(pos, 0, m)
        e = err(s, m, q, sl, sl2, sxl)
        better = ok & (e < best)
        best = torch.where(better, e, best)
        scale, mn = torch.where(better, s, scale), torch.where(better, m, mn)
        codes = torch.where(better, q, codes)
    scale, mn = torch.where(flat, 0, scale), torch.where(flat, lo, mn)
    return scale.squeeze(-1), (-mn).squeeze(-1), torch.where(flat, 0, codes)


def _scales_6bit(v: torch.Tensor, sw: torch.Tensor | None, nmax: int = 63) -> tuple[torch.Tensor, torch.Tensor]:
    """(step d [...], codes L [..., 8] in [0, nmax]) storing the non-negative values v [..., 8] as d * L.
    Without weights: d = max / nmax, L rounded. With sub-block weights sw (make_qp_quants): the best of 9 steps
    around that by weighted squared error, then 5 rounds of moving each code to its least-squares value while
    that improves the weighted fit, and d = the least-squares step of the final codes."""
    mx = v.amax(-1, keepdim=True)
    zero = mx < _EPS
    mx = torch.where(zero, 1, mx)
    iscale = nmax / mx
    if sw is None:
        return torch.where(zero, 0, 1 / iscale).squeeze(-1), torch.round(v * iscale).clamp_(0, nmax)

    def err(i):
        return (sw * (v - torch.round(v * i).clamp_(max=nmax) / i).square()).sum(-1, keepdim=True)
    best = err(iscale)
    for k in (-4, -3, -2, -1, 1, 2, 3, 4):
        cand = (nmax + 0.1 * k) / mx
        e = err(cand)
        iscale = torch.where(e < best, cand, iscale)
        best = torch.minimum(e, best)
    q = torch.round(v * iscale).clamp_(max=nmax)
    slx, sl2 = (sw * v * q).sum(-1), (sw * q * q).sum(-1)
    for _ in range(5):
        for j in range(v.shape[-1]):
            w, x, l = sw[..., j], v[..., j], q[..., j]
            a, b = slx - w * x * l, sl2 - w * l * l
            ok = (a > 0) & (b > 0)
            nl = torch.round(x * b / torch.where(ok, a, 1)).clamp_(max=nmax)
            a2, b2 = a + w * x * nl, b + w * nl * nl
            take = ok & (nl != l) & (a2 * a2 * sl2 > slx * slx * b2)
            q[..., j] = torch.where(take, nl, l)
            slx, sl2 = torch.where(take, a2, slx), torch.where(take, b2, sl2)
    d = torch.where(zero.squeeze(-1) | (sl2 <= 0), 0, slx / sl2.clamp_min(1e-30))
    return d, torch.where(zero, 0, q)


def _kq_asym(rows: torch.Tensor, imp: torch.Tensor | None, nmax: int) -> np.ndarray:
    """rows: f32 [M, K], imp: [K] or None -> uint8 [M, K / 256 * (144 | 176)] Q4_K (nmax 15) / Q5_K (nmax 31)
    blocks. The two share the fit (codes in [0, nmax] per 32 values, 6-bit (sc, m) per super-block, f16 d and dmin);
    without importance Q5_K's grids are narrower (llama.cpp's quantize_row_q5_K_ref: 16 grids from nmax - 0.5,
    Q4_K's 21 from nmax - 1), with importance both take make_qkx3_quants' 37."""
    m = rows.shape[0]
    x = rows.reshape(-1, SUPER)
    b = x.shape[0]
    imp = None if imp is None else imp.expand(m, -1).reshape(b, SUPER)
    xs = x.view(b, 8, 32)
    if imp is None:
        w = xs.square().mean(-1, keepdim=True).sqrt() + xs.abs()
        scale, mn, _ = _asym_fit(xs, w, nmax, *((-1.0, 0.1, 20) if nmax == 15 else (-0.5, 0.1, 15)))
        (d, ls), (dmin, lm) = _scales_6bit(scale, None), _scales_6bit(mn, None)
    else:
        sigma2 = 2 * x.square().mean(-1, keepdim=True).unsqueeze(-1)
        w = imp.view(b, 8, 32) * (sigma2 + xs.square()).sqrt()
        scale, mn, _ = _asym_fit(xs, w, nmax, -0.9, 0.05, 36)
        sw = w.sum(-1)
        (d, ls), (dmin, lm) = _scales_6bit(scale, sw), _scales_6bit(mn, sw)
    d16, dmin16 = _f16(d), _f16(dmin)
    dj = (d16.unsqueeze(-1) * ls).unsqueeze(-1)
    mj = (dmin16.unsqueeze(-1) * lm).unsqueeze(-1)
    q = torch.where(dj > 0, torch.round((xs + mj) / dj.clamp_min(1e-30)), 0).clamp_(0, nmax).to(torch.uint8)
    ls, lm = ls.to(torch.uint8), lm.to(torch.uint8)
    # 12 scale bytes: sub-blocks 0-3 hold 6-bit scale / min in bytes 0-3 / 4-7; 4-7 keep their low nibbles in
    # bytes 8-11 and their top 2 bits in the top bits of bytes 0-7
    sc = torch.empty(b, 12, dtype=torch.uint8)
    sc[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    sc[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    sc[:, 8:12] = (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)
    head = torch.stack([d16, dmin16], -1).to(torch.float16).view(torch.uint8)
    if nmax == 31:  # Q5_K: the fifth bit of value 32 i + l at bit i of qh[l], then the low nibbles as Q4_K's
        qh = ((q >> 4) << torch.arange(8, dtype=torch.uint8).view(1, 8, 1)).sum(1, dtype=torch.uint8)  # [b, 32]
        q = q & 15
    q = q.view(b, 4, 2, 32)  # 64-value chunks: the first 32 in low nibbles, the next 32 in high
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(b, 128)
    parts = [head, sc, qh, qs] if nmax == 31 else [head, sc, qs]
    return torch.cat(parts, 1).reshape(m, -1).numpy()


def _q4k(rows: torch.Tensor, imp: torch.Tensor | None) -> np.ndarray:
    return _kq_asym(rows, imp, 15)


def _q5k(rows: torch.Tensor, imp: torch.Tensor | None) -> np.ndarray:
    return _kq_asym(rows, imp, 31)


def _sym_fit(x: torch.Tensor, w: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sub-block (last axis) (scale [...], codes l [..., n]) of x ~ scale * l, l in [-nmax, nmax - 1], by
    make_qx_quants' search: 19 grids of nmax +- 0.9 steps across the signed largest value, each with its weighted
    least-squares scale, the best by the weighted error it leaves."""
    amax_i = x.abs().argmax(-1, keepdim=True)
    mx = x.gather(-1, amax_i)
    zero = mx.abs() < _EPS
    mx = torch.where(zero, 1, mx)
    wx = w * x

    def fit(i: int):
        l = torch.round(x * (-(nmax + 0.1 * i) / mx)).clamp_(-nmax, nmax - 1)
        slx, sl2 = (wx * l).sum(-1, keepdim=True), (w * l * l).sum(-1, keepdim=True)
        return slx / sl2.clamp_min(1e-30), slx, sl2, l

    scale, slx, _, codes = fit(0)
    best = scale * slx
    for i in (*range(-9, 0), *range(1, 10)):
        s, slx, sl2, l = fit(i)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        scale, best = torch.where(better, s, scale), torch.where(better, s * slx, best)
        codes = torch.where(better, l, codes)
    return torch.where(zero, 0, scale).squeeze(-1), torch.where(zero, 0, codes)


def _q6k(rows: torch.Tensor, imp: torch.Tensor | None) -> np.ndarray:
    """rows: f32 [M, K], imp: [K] or None -> uint8 [M, K / 256 * 210] Q6_K blocks."""
    m = rows.shape[0]
    x = rows.reshape(-1, SUPER)
    b = x.shape[0]
    xs = x.view(b, 16, 16)
    # the importance itself weighs the fit (llama.cpp's Q6_K, unlike its other kinds, leaves out sqrt(sigma^2 + w^2))
    w = xs.square() if imp is None else imp.expand(m, -1).reshape(b, 16, 16)
    scale, _ = _sym_fit(xs, w, 32)
    big = scale.abs().argmax(-1, keepdim=True)
    top = scale.gather(-1, big)
    zero = top.abs() < _EPS
    iscale = torch.where(zero, 0, -128 / torch.where(zero, 1, top))
    d16 = _f16(torch.where(zero, 0, 1 / torch.where(zero, 1, iscale)))
    sc = torch.round(iscale * scale).clamp_(-128, 127)
    dj = (d16 * sc).unsqueeze(-1)
    q = torch.where(dj != 0, torch.round(xs / torch.where(dj != 0, dj, 1)), 0).clamp_(-32, 31) + 32
    q = q.to(torch.uint8).view(b, 2, 4, 32)  # two 128-value halves of four 32-value quarters
    ql = torch.cat([q[:, :, 0] & 15 | (q[:, :, 2] & 15) << 4, q[:, :, 1] & 15 | (q[:, :, 3] & 15) << 4], 2)
    qh = q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    return torch.cat([ql.reshape(b, 128), qh.reshape(b, 64), sc.to(torch.int8).view(torch.uint8),
                      d16.to(torch.float16).view(torch.uint8)], 1).reshape(m, -1).numpy()


def _row_weights(rows: torch.Tensor, imp: torch.Tensor) -> torch.Tensor:
    """Q5_0's / Q5_1's fit weights, [M, K / 32, 32]: importance * sqrt(sigma^2 + w^2), sigma^2 the row's mean square
    (llama.cpp's quantize_row_q5_0_impl / _q5_1_impl)."""
    m, k = rows.shape
    sigma2 = rows.square().mean(-1, keepdim=True)
    return (imp.view(1, k) * (sigma2 + rows.square()).sqrt()).view(m, -1, 32)


def _five_bit_blocks(head: list[torch.Tensor], q: torch.Tensor) -> np.ndarray:
    """Q5_0 / Q5_1 blocks, uint8 [M, K / 32 * (22 | 24)], from their f16 head (d, or d and m) [M, K / 32] each and the
    codes q in [0, 31], [M, K / 32, 32]: the head, qh (bit j: value j's fifth bit, little-endian), qs (value j < 16
    in the low nibble of byte j, value j + 16 in its high nibble)."""
    m = q.shape[0]
    q = q.to(torch.int64)
    qh = ((q >> 4) << torch.arange(32)).sum(-1).to(torch.int32).view(torch.uint8).view(m, -1, 4)
    q = q.to(torch.uint8)
    qs = (q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)
    h = [t.to(torch.float16).view(torch.uint8).view(m, -1, 2) for t in head]
    return torch.cat([*h, qh, qs], -1).reshape(m, -1).numpy()


def _q5_0(rows: torch.Tensor, imp: torch.Tensor) -> np.ndarray:
    """rows: f32 [M, K], imp: [K] -> uint8 [M, K / 32 * 22] Q5_0 blocks fitted with importance (llama.cpp's
    quantize_row_q5_0_impl: make_qx_quants over 32 values weighted by `_row_weights`; the codes are the search's
    own)."""
    m = rows.shape[0]
    scale, l = _sym_fit(rows.view(m, -1, 32), _row_weights(rows, imp), 16)
    return _five_bit_blocks([scale], l + 16)


def _q5_1(rows: torch.Tensor, imp: torch.Tensor) -> np.ndarray:
    """rows: f32 [M, K], imp: [K] -> uint8 [M, K / 32 * 24] Q5_1 blocks fitted with importance (llama.cpp's
    quantize_row_q5_1_impl: make_qkx3_quants' 37 grids over 32 values, codes in [0, 31], weighted by `_row_weights`;
    d the search's scale, m its offset, the codes its own, not re-rounded against the f16 d and m)."""
    m = rows.shape[0]
    scale, mn, l = _asym_fit(rows.view(m, -1, 32), _row_weights(rows, imp), 31, -0.9, 0.05, 36, direct=True)
    return _five_bit_blocks([scale, -mn], l)


_K = {"Q4_K": _q4k, "Q5_K": _q5k, "Q6_K": _q6k}
_G32 = {"Q5_0": _q5_0, "Q5_1": _q5_1}  # with importance; without it gguf.quants' own (llama.cpp's reference)
TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1")


def quantize_blocks(w: torch.Tensor, gguf_type: str, importance: torch.Tensor | None = None) -> np.ndarray:
    """GGUF blocks of `w` [N, K] (any float dtype) as uint8 [N, K / block * block bytes]. `importance`: f32 [K]
    per input channel (mean x^2 over calibration activations, llama.cpp's imatrix), used by Q4_K, Q5_K, Q6_K, Q5_0 and
    Q5_1 (llama.cpp's Q8_0 has no use for it)."""
    n, k = w.shape
    if gguf_type in _G32 and importance is not None:
        fn = _G32[gguf_type]
    elif gguf_type in _K:
        fn = _K[gguf_type]
        if k % SUPER:
            raise ValueError(f"{gguf_type}: K = {k} is not a multiple of {SUPER}")
    else:
        from gguf import GGMLQuantizationType, quants

        return quants.quantize(w.float().numpy(), GGMLQuantizationType[gguf_type])
    imp = None if importance is None else importance.float().clamp_min(0).view(1, k)
    rows, out = max(1, ROWS_VALUES // k), None
    for r in range(0, n, rows):
        part = fn(w[r:r + rows].float(), imp)
        if out is None:  # filled in place: the blocks are held once, whatever the tensor's size
            out = np.empty((n, part.shape[1]), dtype=np.uint8)
        out[r:r + len(part)] = part
    return out

"""The LOSSY int8-activation ops on GGUF kinds as stored (q4k_linear_i8, q8k_linear_i8; q4_1_linear_i8,
q4_0_linear_i8), which decode each group's scale on the fly from the 8-bit codes and the f16 super-scales (or from
the f16 (d, m) / d), give the bits of the q4 / q8 int8 ops on the same codes with those scales materialized in f32
(q4k: s = d * sc, z = 8 * s - dmin * m, group 32; q8k: d * sc, group 16; q4_1: (d, m + 8 d); q4_0: (d, 0)), in every
kernel tier whose int8 ops this CPU runs: f32 and bf16 x, pass sizes 1 to 100, a 16-column q4 tail tile, 8-row q8
tails, K past a 1024-k chunk, one or two threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize as gguf_quantize

from colibri.quant.kinds import from_gguf, q4k_codes, q4k_supers

from test_kquant import k_blocks
from test_tier_int8 import _int8_tiers

ROWS = (1, 3, 5, 16, 64, 100)
# 200 rows: q4k pads to 208 (a 16-column tail tile), q8k ends in an 8-row block; K = 2304: past a 1024-k chunk;
# 256 x 1536 (Qwen2.5-1.5B's k / v): whole tiles only, whose decode passes decode q4k's scales group by group
SHAPES = [(200, 1536), (37, 2304), (64, 256), (256, 1536)]


@pytest.fixture(scope="module")
def tier_ops(tier_ops):
    return {name: ops for name, ops in tier_ops.items() if name in _int8_tiers()}


def _weights(n: int, k: int) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for qt, kind in ((QT.Q4_K, "q4k"), (QT.Q6_K, "q8k")):
        w = from_gguf(k_blocks(qt, n, k, seed=n + k), qt, (n, k))
        out[kind] = (w.as_q8k() if qt == QT.Q6_K else w)._buffers
    return out


def _q4_scales_zeros(b: dict[str, torch.Tensor]) -> torch.Tensor:
    """(s, z) f32 [K/32, Np, 2] as the kernel computes them, each f32 step rounded."""
    sc, mn = q4k_codes(b["scales"], 0, b["qweight"].shape[0])
    sup = q4k_supers(b["supers"], 0, b["qweight"].shape[0]).float().repeat_interleave(8, dim=0)
    s = sup[..., 0] * sc.float()
    z = s * 8 - sup[..., 1] * mn.float()
    return torch.stack([s, z], dim=-1).contiguous()


def _q8_scales(b: dict[str, torch.Tensor]) -> torch.Tensor:
    """d * sc, f32 [N, K/16] (exact)."""
    return (b["supers"].float().repeat_interleave(16, dim=1) * b["scales"].float()).contiguous()


def _x(t: int, k: int, dtype, seed: int) -> torch.Tensor:
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0  # a zero group (d = 0)
    if t > 1:
        x[1, 5] *= 40  # an outlier
    return x.to(dtype)


def _check(ops, n: int, k: int, rows, dtypes, where: str = "") -> None:
    w = _weights(n, k)
    b4, b8 = w["q4k"], w["q8k"]
    sz, s8 = _q4_scales_zeros(b4), _q8_scales(b8)
    for tier, o in ops.items():
        for dtype in dtypes:
            for t in rows:
                x = _x(t, k, dtype, seed=t)
                y = o.q4k_linear_i8(x, b4["qweight"], b4["scales"], b4["supers"])
                ref = o.q4_linear_i8(x, b4["qweight"], sz, 32)
                assert y.dtype == dtype and torch.equal(y, ref), f"q4k {n}x{k} {dtype} T={t}{where}: {tier} differs"
                y = o.q8k_linear_i8(x, b8["qweight"], b8["scales"], b8["supers"])
                ref = o.q8_linear_i8(x, b8["qweight"], s8, 16)
                assert y.dtype == dtype and torch.equal(y, ref), f"q8k {n}x{k} {dtype} T={t}{where}: {tier} differs"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kquants_equal_the_materialized_scales(tier_ops, shape, dtype):
    _check(tier_ops, *shape, ROWS, [dtype])


def test_int8_kquants_do_not_depend_on_the_thread_count(tier_ops):
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):  # 3 on a 2-core machine: threads run out unevenly and take each other's tiles
            torch.set_num_threads(n)
            _check(tier_ops, 200, 1536, (1, 6, 37), [torch.bfloat16], f" threads={n}")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qt", [QT.Q4_1, QT.Q4_0])
def test_int8_q4_1_and_q4_0_equal_their_derived_pairs(tier_ops, qt):
    """Q4_1 / Q4_0 as stored: their int8 ops give q4_linear_i8's bits over the f32 pairs the weight derives, on every
    tier, at every pass size (200 rows: a 16-column tail tile; K past a chunk), and the weight's linear() takes them
    in the LOSSY mode (the pairs were made in torch on every call before: 4-5x the kernel's time on a decode step)."""
    from colibri import kernels

    n, k = 200, 2304
    raw = gguf_quantize((np.random.default_rng(5).standard_normal((n, k)) * 0.02).astype(np.float32), qt)
    w = from_gguf(raw, qt, (n, k))
    b = w._buffers
    s, z = w._scales_zeros_f32(0, b["qweight"].shape[0])
    pairs = torch.stack([s, z], dim=-1).contiguous()

    def op(o, x):
        if qt == QT.Q4_1:
            return o.q4_1_linear_i8(x, b["qweight"], b["scales_mins"])
        return o.q4_0_linear_i8(x, b["qweight"], b["scales"])

    for tier, o in tier_ops.items():
        for dtype in (torch.float32, torch.bfloat16):
            for t in ROWS:
                x = _x(t, k, dtype, seed=t)
                y = op(o, x)
                assert y.dtype == dtype and torch.equal(y, o.q4_linear_i8(x, b["qweight"], pairs, 32)), (qt, tier, t)
    x = _x(3, k, torch.bfloat16, seed=9)
    try:
        for tier in tier_ops:
            kernels.use(tier)
            kernels.set_int8_activations(True)
            assert torch.equal(w.linear(x), op(tier_ops[tier], x)[:, :n]), (qt, tier)
            kernels.set_int8_activations(None)
    finally:
        kernels.set_int8_activations(None)
        kernels.use(None)


def test_k_quant_weights_use_them_in_the_lossy_mode_only():
    """Q4KWeight / Q6KWeight.linear: the int8 ops when the LOSSY mode is on (rows independent of the pass, error
    against the exact weights bounded; q6k's blocks through q8k's int8 kernel, q6k_linear_i8), the exact kernels
    when it is off."""
    from colibri import kernels
    from test_kquant import reference

    n, k = 200, 1536
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(7)).bfloat16()
    try:
        kernels.use("auto")
        for qt in (QT.Q4_K, QT.Q6_K):
            raw = k_blocks(qt, n, k, seed=11)
            w = from_gguf(raw, qt, (n, k))
            want = x.double() @ reference(raw, qt, n, k).double().T
            exact = w.linear(x)
            kernels.set_int8_activations(True)
            lossy = w.linear(x)
            b = w._buffers
            if qt == QT.Q6_K:
                assert torch.equal(lossy, kernels.library().q6k_linear_i8(x, b["qweight"]))
            else:
                assert torch.equal(lossy, kernels.library().q4k_linear_i8(x, b["qweight"], b["scales"],
                                                                          b["supers"])[:, :n])
            assert torch.equal(w.linear(x[3:5]), lossy[3:5])
            assert not torch.equal(lossy, exact)
            assert ((lossy.double() - want).abs().max() / want.abs().max()).item() < 2e-2
            kernels.set_int8_activations(None)
    finally:
        kernels.set_int8_activations(None)
        kernels.use(None)

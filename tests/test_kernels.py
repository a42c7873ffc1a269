"""Batch invariance: a row's result is bit-identical whatever else shares its pass, for every linear kind, for
attention and the head, in the native kernels and in the torch fallback (COLIBRI_KERNELS=torch)."""

from __future__ import annotations

import pytest
import torch

from colibri import kernels
from colibri.kernels import ops
from colibri.quant.kinds import quantize

ROWS = (1, 3, 16, 64)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["native", "torch"])
def mode(request):
    """native: the best tier this machine builds (auto); torch: the fallback. The process's own setting after."""
    kernels.use("auto" if request.param == "native" else "torch")
    if request.param == "native" and not kernels.native():
        kernels.use(None)
        pytest.skip("native kernels unavailable on this machine")
    yield request.param
    kernels.use(None)


def _weight(kind: str, n: int, k: int):
    w = _randn(n, k, seed=1) * 0.1
    if kind == "f32":
        return w
    if kind == "bf16":
        return w.bfloat16()
    name, g = kind.split("g")
    return quantize(w, name, int(g))


def _x_dtypes(kind: str):
    return {"f32": (torch.float32,), "bf16": (torch.bfloat16,)}.get(kind, (torch.float32, torch.bfloat16))


@pytest.mark.parametrize("kind", ["q4g32", "q4g64", "q8g0", "q8g32", "bf16", "f32"])
@pytest.mark.parametrize("shape", [(200, 256), (64, 96)])  # 200 rows: q4 pads to 208 (a 16-row tail tile)
def test_linear_rows_do_not_depend_on_the_pass(mode, kind, shape):
    if kind.startswith("q4") and shape[1] % int(kind[3:]):
        pytest.skip("K not a multiple of the group")
    w = _weight(kind, *shape)
    for dtype in _x_dtypes(kind):
        x = _randn(max(ROWS), shape[1], seed=2).to(dtype)
        solo = torch.cat([ops.linear(x[i:i + 1], w) for i in range(x.shape[0])])
        for t in ROWS:
            y = ops.linear(x[:t], w)
            assert y.dtype == dtype and y.shape == (t, shape[0])
            assert torch.equal(y, solo[:t]), f"{kind} {dtype} T={t}: rows differ from their solo runs"
        b = _randn(shape[0], seed=3).to(dtype)
        assert torch.equal(ops.linear(x[:16], w, b)[5], ops.linear(x[5:6], w, b)[0])


@pytest.mark.parametrize("kind", ["q4g32", "q4g64", "q8g0", "q8g32", "f32"])
def test_f32_activations_stay_exact(mode, kind):
    """f32 x against the dequantized weights in float64, at every pass size."""
    w = _weight(kind, 200, 256)
    wd = w if isinstance(w, torch.Tensor) else w.dequantize()
    x = _randn(64, 256, seed=4)
    for t in ROWS:
        torch.testing.assert_close(ops.linear(x[:t], w).double(), x[:t].double() @ wd.double().T, rtol=1e-5, atol=1e-5)


def test_head_row_blocks_match_the_whole_table(mode):
    """A streamed head computes its vocabulary in row blocks (q4: multiples of 64 rows; the kinds stored by rows:
    any count, a block of a handful of rows included); the logits are the same."""
    for kind in ("q4g64", "q8g0", "bf16", "f32"):
        w = _weight(kind, 384, 128)
        x = _randn(5, 128, seed=5).to(torch.float32 if kind == "f32" else torch.bfloat16)
        whole = ops.linear(x, w)
        cuts = (0, 128, 256, 384) if kind.startswith("q4") else (0, 250, 379, 381, 384)
        blocks = list(zip(cuts, cuts[1:]))
        if isinstance(w, torch.Tensor):
            parts = [ops.linear(x, w[r0:r1]) for r0, r1 in blocks]
        else:
            parts = [ops.linear(x, type(w).from_buffers((r1 - r0, 128), w.group_size, _row_slice(w, r0, r1)))
                     for r0, r1 in blocks]
        assert torch.equal(torch.cat(parts, dim=-1), whole), kind


def _row_slice(w, r0: int, r1: int) -> dict[str, torch.Tensor]:
    b = w.buffers()
    if "scales_zeros" in b:  # q4: whole 64-row tiles are contiguous byte ranges; scales are [G, Np, 2]
        return {"qweight": b["qweight"][r0:r1].contiguous(), "scales_zeros": b["scales_zeros"][:, r0:r1].contiguous()}
    return {"qweight": b["qweight"][r0:r1].contiguous(), "scales": b["scales"][r0:r1].contiguous()}


@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (None, 20.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_rows_do_not_depend_on_the_pass_or_later_keys(mode, window, softcap, dtype):
    """A query at position p gives the same result in a prefill chunk (later keys present, masked) as in a
    decode step over exactly p + 1 keys, whatever the number of queries beside it."""
    H, Hkv, Dh, S = 6, 2, 32, 70
    q = _randn(H, S, Dh, seed=6).to(dtype)
    k, v = _randn(Hkv, S, Dh, seed=7).to(dtype), _randn(Hkv, S, Dh, seed=8).to(dtype)
    solo = torch.stack([ops.attend(q[:, p:p + 1], k[:, :p + 1], v[:, :p + 1], torch.tensor([p]), window, 0.2,
                                   softcap)[:, 0] for p in range(S)], dim=1)
    for t in ROWS:
        start = S - t - 3  # a chunk that ends before the cache does: 3 later keys it must not see
        pos = torch.arange(start, start + t)
        got = ops.attend(q[:, start:start + t], k, v, pos, window, 0.2, softcap)
        assert torch.equal(got, solo[:, start:start + t]), f"T={t}"


def test_pointwise_elements_do_not_depend_on_the_tensor_size():
    """silu, sigmoid, gelu and rsqrt round differently in ATen's scalar tail and vector body; ops.pointwise
    computes every element the same way."""
    import torch.nn.functional as F
    for dtype in (torch.float32, torch.bfloat16):
        x = (_randn(40000, seed=9) * 3).abs().to(dtype) + 0.1
        for fn in (F.silu, torch.sigmoid, F.gelu, torch.rsqrt):
            whole = ops.pointwise(fn, x)
            assert all(torch.equal(ops.pointwise(fn, x[i:i + n]), whole[i:i + n])
                       for i, n in ((0, 1), (5, 3), (100, 77), (16383, 2), (20000, 20000)))
            assert torch.equal(whole, ops._pointwise_pieces(fn, x))  # the native pieces (40,000 = 625 x 64)
            for n in (1, 3, 77, 20001):  # sizes off the 64-element step: the native op pads as the Python loop does
                assert torch.equal(ops.pointwise(fn, x[:n]), ops._pointwise_pieces(fn, x[:n]))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the native pieces on two threads, inside inference mode (as the engine runs them)
    try:
        with torch.inference_mode():
            x = _randn(64 * 1000, seed=10).bfloat16()
            assert torch.equal(ops.pointwise(F.silu, x), ops._pointwise_pieces(F.silu, x))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fam", ["llama", "gemma3", "qwen2_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_logits_equal_token_by_token_decode(mode, tiny_model_dir, fam, dtype):
    """A whole model: the logits of every prompt position from one prefill pass equal those of feeding the
    prompt one token at a time (T = 1 passes), and those of a prefill cut into 5-token chunks."""
    from colibri.runtime.model import load

    ids = [(7 * i + 3) % 384 for i in range(40)]  # past 32 rows: ATen's vectorized loops take over
    with load(tiny_model_dir(fam), dtype=dtype) as m:
        whole = m.logits(ids)
        steps = torch.cat(list(m.engine.score(ids, chunk=1)))
        chunked = torch.cat(list(m.engine.score(ids, chunk=5)))
    assert torch.equal(whole, steps)
    assert torch.equal(whole, chunked)

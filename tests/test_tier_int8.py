"""The LOSSY int8-activation ops (q4_linear_i8, q8_linear_i8) give the same bits in every kernel tier this CPU can
run them in (avx512: its VNNI code needs avx512_vnni; avx2 and portable: generic/int8.cpp, any CPU the tier runs
on): q4 at x groups of 32, 64 and 128, q8 per channel and grouped, f32 and bf16 x, pass sizes 1 to 64 (each tier's
rows also equal the reference's rows of a 64-row pass: batch-invariant across tiers), tail tiles, K past a chunk,
f16 / f32 scales and one or two threads; and the GGUF blocks with q8k's values (q6k, q3k, iq4_xs) through q8k's int8
kernels. Where the CPU has AVX-VNNI, the avx2 tier runs its passes with it and without it (int8_vnni)."""

from __future__ import annotations

import pytest
import torch

from gguf import GGMLQuantizationType as QT

from colibri import kernels
from colibri.quant.kinds import from_gguf, quantize
from test_kquant import k_blocks

ROWS = (1, 2, 3, 4, 5, 16, 17, 64)  # 4: the longest decode pass (kDirectRows)


def _int8_tiers() -> list[str]:
    """The runnable tiers whose int8 ops this CPU runs (the avx512 tier's need avx512_vnni)."""
    have = kernels._cpu_flags()
    return [n for n in kernels.runnable_tiers() if all(f in have for f in kernels.TIERS[n].int8.cpu_flags)]


class _WithoutVnni:
    """A tier's ops, each call run with AVX-VNNI turned off (int8_vnni(0)), then back on: its vpmaddubsw form on a
    CPU that has AVX-VNNI, which would otherwise run only the vpdpbusd one."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        op = getattr(self._ops, name)

        def call(*args):
            self._ops.int8_vnni(0)
            try:
                return op(*args)
            finally:
                self._ops.int8_vnni(1)
        return call


@pytest.fixture(scope="module")
def tier_ops(tier_ops):
    """The int8 tiers, and where the avx2 tier runs AVX-VNNI here, that tier without it too."""
    ops = {name: o for name, o in tier_ops.items() if name in _int8_tiers()}
    if "avx2" in ops and bool(ops["avx2"].int8_vnni(-1)):
        ops["avx2 without avx_vnni"] = _WithoutVnni(ops["avx2"])
    return ops


def test_the_avx2_tier_uses_avx_vnni_where_the_cpu_has_it(tier_ops):
    """int8_vnni says whether the avx2 tier's passes use AVX-VNNI: exactly where the CPU has it (turning it on
    elsewhere is refused); the other tiers never do (avx512 has its own VNNI, portable none)."""
    has = "avx_vnni" in kernels._cpu_flags()
    for name, o in tier_ops.items():
        if name in ("avx512", "portable"):
            assert not bool(o.int8_vnni(-1)) and not bool(o.int8_vnni(1)), name
        elif name == "avx2":
            assert bool(o.int8_vnni(-1)) == has
            try:
                assert not bool(o.int8_vnni(0))
                assert bool(o.int8_vnni(1)) == has
            finally:
                o.int8_vnni(1)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _cases(n: int, k: int):
    """(name, fn(ops, x)) for the q4 and q8 kinds of an [n, k] weight."""
    w = _randn(n, k, seed=1) * 0.1
    cases = []
    for g in (32, 64, 128):
        b = quantize(w, "q4", g)._buffers
        cases.append((f"q4g{g}", lambda o, x, b=b, g=g: o.q4_linear_i8(x, b["qweight"], b["scales_zeros"], g)))
    for g in (0, 32, 128):
        b = quantize(w, "q8", g)._buffers
        cases.append((f"q8g{g}", lambda o, x, b=b, g=g: o.q8_linear_i8(x, b["qweight"], b["scales"], g)))
    return cases


def _check(tier_ops, name, fn, x):
    ref = fn(tier_ops["portable"], x)
    for tier, o in tier_ops.items():
        for t in ROWS:
            y = fn(o, x[:t])
            assert y.dtype == x.dtype and torch.equal(y, ref[:t]), f"{name} {x.dtype} T={t}: {tier} differs"


# 200 rows: q4 pads to 208 (a 16-column tail tile), q8 ends in an 8-column block; K = 2304: past a 1024-k chunk
@pytest.mark.parametrize("shape", [(200, 256), (64, 2304)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_tiers_agree_at_every_pass_size(tier_ops, shape, dtype):
    x = _randn(max(ROWS), shape[1], seed=2).to(dtype)
    x[0, :64] = 0  # a zero group (d = 0)
    x[1, 5] *= 40  # an outlier: its group's step grows
    for name, fn in _cases(*shape):
        _check(tier_ops, name, fn, x)


def test_int8_tiers_agree_on_other_scale_dtypes_and_tails(tier_ops):
    """f16 and f32 scales, x groups of 16 and 256, q4 tail tiles of 32 and 48 columns, q8 codes of -128."""
    g = torch.Generator().manual_seed(3)
    x = _randn(max(ROWS), 512, seed=4).bfloat16()
    for np_, grp in ((96, 16), (112, 256)):
        qw = torch.randint(0, 256, (np_, 256), generator=g, dtype=torch.uint8)
        sz = _randn(512 // grp, np_, 2, seed=5) * 0.05
        for dt in (torch.float16, torch.float32):
            _check(tier_ops, f"q4 Np={np_} g{grp} {dt}",
                   lambda o, xx, s=sz.to(dt), q=qw, gg=grp: o.q4_linear_i8(xx, q, s, gg), x)
    qw = torch.randint(-128, 128, (45, 512), generator=g, dtype=torch.int8)
    for grp in (0, 16, 256):
        sc = (_randn(45, 512 // grp, seed=6) if grp else _randn(45, seed=6)).abs() * 0.01
        for dt in (torch.float16, torch.float32):
            _check(tier_ops, f"q8 g{grp} {dt}", lambda o, xx, s=sc.to(dt), gg=grp: o.q8_linear_i8(xx, qw, s, gg), x)


def test_int8_tiers_do_not_depend_on_the_thread_count(tier_ops):
    """The same rows on 1, 2 and 3 threads, whichever thread runs which tiles (parallel.h: a thread that runs out
    takes half of another's; 3 threads on a 2-core machine make them run out unevenly), q4 tiles and q6k blocks."""
    w = quantize(_randn(320, 1024, seed=7) * 0.1, "q4", 64)._buffers
    q6 = from_gguf(k_blocks(QT.Q6_K, 1000, 512, seed=9), QT.Q6_K, (1000, 512))._buffers["qweight"]
    x, x6 = _randn(37, 1024, seed=8).bfloat16(), _randn(37, 512, seed=10).bfloat16()
    fns = {"q4": lambda o, t: o.q4_linear_i8(x[:t], w["qweight"], w["scales_zeros"], 64),
           "q6k": lambda o, t: o.q6k_linear_i8(x6[:t], q6)}
    refs = {name: fn(tier_ops["portable"], 37) for name, fn in fns.items()}
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for tier, o in tier_ops.items():
                for name, fn in fns.items():
                    for t in (1, 1, 1, 6, 37):
                        assert torch.equal(fn(o, t), refs[name][:t]), f"{name} {tier} T={t} threads={n}"
    finally:
        torch.set_num_threads(threads)


def test_gguf_block_kinds_without_an_int8_kernel_stay_exact():
    """The GGUF kinds kept as blocks whose values are not q8k's (q5k, q2k, q5_0, q5_1, iq4_nl) have no int8 kernel of
    their own: in the LOSSY int8 mode each gives its exact kernel's bits, on every tier (decoding them to int8 codes
    per call cost 10-40x the exact kernel)."""
    n, k = 64, 512
    x = _randn(8, k, seed=4)
    for qt in (QT.Q5_K, QT.Q2_K, QT.Q5_1, QT.IQ4_NL):
        w = from_gguf(k_blocks(qt, n, k, seed=3), qt, (n, k))
        for tier in _int8_tiers():
            kernels.use(tier)
            try:
                exact = w.linear(x)
                kernels.set_int8_activations(True)
                assert torch.equal(w.linear(x), exact), (qt, tier)
            finally:
                kernels.set_int8_activations(None)
                kernels.use(None)


# 200 rows: a tail of 8 columns; 1100 x 2304: K past a chunk, and longer passes decode the rows in several chunks
@pytest.mark.parametrize("shape", [(200, 512), (1100, 2304)])
@pytest.mark.parametrize("qt", [QT.Q6_K, QT.Q3_K, QT.IQ4_XS])
def test_gguf_blocks_with_q8k_values_read_by_q8ks_int8_kernels(tier_ops, qt, shape):
    """q6k, q3k and iq4_xs in the LOSSY int8 mode: their ops over the blocks as stored give q8k_linear_i8's bits for
    the codes widened to bytes, on every tier and at every pass size (decode passes decode 8 rows at a time, longer
    ones chunks of rows), bf16 and f32 x; the weight's linear() takes them when the mode is on."""
    n, k = shape
    w = from_gguf(k_blocks(qt, n, k, seed=n), qt, (n, k))
    q8k = w.as_q8k()._buffers
    op = f"{w.KIND.name}_linear_i8"
    for dtype in (torch.float32, torch.bfloat16):
        x = _randn(max(ROWS), k, seed=k).to(dtype)
        x[2, 16:32] = 0  # a zero group of 16 (d = 0)
        ref = tier_ops["portable"].q8k_linear_i8(x, q8k["qweight"], q8k["scales"], q8k["supers"])
        _check(tier_ops, f"{op} {list(shape)}", lambda o, xx: getattr(o, op)(xx, w._buffers["qweight"]), x)
        assert torch.equal(getattr(tier_ops["portable"], op)(x, w._buffers["qweight"]), ref), (op, dtype)
    x = _randn(3, k, seed=1).bfloat16()
    for tier in _int8_tiers():
        kernels.use(tier)
        try:
            kernels.set_int8_activations(True)
            assert torch.equal(w.linear(x), getattr(tier_ops[tier], op)(x, w._buffers["qweight"])), (op, tier)
        finally:
            kernels.set_int8_activations(None)
            kernels.use(None)

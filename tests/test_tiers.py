"""Every kernel tier this CPU can run (avx512, avx2, portable: the portable tier always) gives the same bits: each
linear kind in bf16 and f32 at pass sizes 1, 3, 16, 64, pointwise, and whole models' logits and greedy tokens
(the tiny families; the README demo's default container). Attention and the LOSSY int8 ops are crossed in
test_tier_attention.py and test_tier_int8.py."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize as gguf_quantize

from colibri import kernels
from colibri.quant.kinds import from_gguf, q4k_codes, q4k_group_major, quantize
from test_kquant import k_blocks
from test_tier_int8 import _int8_tiers

ROWS = (1, 3, 16, 64)
TIERS = kernels.runnable_tiers()


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _linear_cases(n: int, k: int):
    """(name, x dtypes, fn(ops, x)) for every stored kind of an [n, k] weight."""
    w = _randn(n, k, seed=1) * 0.1
    cases = [("f32", (torch.float32,), lambda o, x: o.dense_linear(x, w)),
             ("bf16", (torch.bfloat16,), lambda o, x: o.dense_linear(x, w.bfloat16()))]
    both = (torch.float32, torch.bfloat16)
    for g in (32, 64, 128):
        if k % g == 0:
            b = quantize(w, "q4", g)._buffers
            cases.append((f"q4g{g}", both, lambda o, x, b=b, g=g: o.q4_linear(x, b["qweight"], b["scales_zeros"], g)))
    for g in (0, 16, 32, 64):  # per channel, a group within a 32-element step, one step, two steps
        if g and k % g:
            continue
        b = quantize(w, "q8", g)._buffers
        cases.append((f"q8g{g}", both, lambda o, x, b=b, g=g: o.q8_linear(x, b["qweight"], b["scales"], g)))
    h = quantize(w, "q8", 32)._buffers  # f16 scales, as GGUF Q8_0 imports keep them (the short bf16 rounding)
    cases.append(("q8g32h", both, lambda o, x: o.q8_linear(x, h["qweight"], h["scales"].half(), 32)))
    if k % 256 == 0:
        b = from_gguf(k_blocks(QT.Q4_K, n, k, seed=n), QT.Q4_K, (n, k))._buffers
        cases.append(("q4k", both, lambda o, x: o.q4k_linear(x, b["qweight"], b["scales"], b["supers"])))
        old = q4k_legacy_buffers(b)  # as containers before format version 4 hold them
        cases.append(("q4k-bytes", both, lambda o, x: o.q4k_linear(x, old["qweight"], old["scales"], old["supers"])))
        q6 = from_gguf(k_blocks(QT.Q6_K, n, k, seed=n), QT.Q6_K, (n, k))
        q8 = q6.as_q8k()._buffers
        cases.append(("q8k", both, lambda o, x: o.q8k_linear(x, q8["qweight"], q8["scales"], q8["supers"])))
        cases.append(("q6k", both, lambda o, x: o.q6k_linear(x, q6._buffers["qweight"])))
        q5k = from_gguf(k_blocks(QT.Q5_K, n, k, seed=n), QT.Q5_K, (n, k))._buffers["qweight"]
        cases.append(("q5k", both, lambda o, x: o.q5k_linear(x, q5k)))
        q2k = from_gguf(k_blocks(QT.Q2_K, n, k, seed=n), QT.Q2_K, (n, k))._buffers["qweight"]
        cases.append(("q2k", both, lambda o, x: o.q2k_linear(x, q2k)))
    if k % 32 == 0:
        q5 = from_gguf(gguf_quantize(w.numpy(), QT.Q5_0), QT.Q5_0, (n, k))
        cases.append(("q5_0", both, lambda o, x: o.q5_0_linear(x, q5._buffers["qweight"])))
        q51 = from_gguf(gguf_quantize(w.numpy(), QT.Q5_1), QT.Q5_1, (n, k))._buffers["qweight"]
        cases.append(("q5_1", both, lambda o, x: o.q5_1_linear(x, q51)))
    return cases


def q4k_group_major_buffers(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """q4k buffers with the packed codes and the supers group-major: the layout of format version 4."""
    scales, supers = q4k_group_major(b["scales"], b["supers"])
    return {**b, "scales": scales.contiguous(), "supers": supers.contiguous()}


def q4k_legacy_buffers(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """q4k buffers with the (sc, m) codes a byte each, [K/32, Np, 2], the supers group-major: the layout before
    format version 4."""
    sc, mn = q4k_codes(b["scales"], 0, b["qweight"].shape[0])
    return {**q4k_group_major_buffers(b), "scales": torch.stack([sc, mn], dim=-1).contiguous()}


def test_q4k_layouts_give_the_same_bits(tier_ops):
    """q4k's tile-major codes and supers (format version 5), the group-major packed ones of version 4 and the
    byte-each codes before it: the same rows on every tier, in both modes (exact and LOSSY int8), at every pass
    size, for full and tail tiles."""
    n, k = 200, 512
    b = from_gguf(k_blocks(QT.Q4_K, n, k, seed=3), QT.Q4_K, (n, k))._buffers
    v4, old = q4k_group_major_buffers(b), q4k_legacy_buffers(b)
    assert b["scales"].shape == (13, k // 32 * 24) and b["supers"].shape == (13, k // 256 * 32)
    assert v4["scales"].shape == (k // 32, 13, 24) and v4["supers"].shape == (k // 256, 208, 2)
    assert old["scales"].shape == (k // 32, 208, 2)
    int8 = set(_int8_tiers())
    for tier, o in tier_ops.items():
        ops = [o.q4k_linear] + ([o.q4k_linear_i8] if tier in int8 else [])
        for op in ops:
            for dtype in (torch.float32, torch.bfloat16):
                x = _randn(64, k, seed=4).to(dtype)
                for t in ROWS:
                    new = op(x[:t], b["qweight"], b["scales"], b["supers"])
                    for prev in (v4, old):
                        assert torch.equal(new, op(x[:t], prev["qweight"], prev["scales"], prev["supers"])), \
                            (tier, op, t)


# 200 rows: q4 pads to 208 (a 16-column tail tile); K = 96: a dot-form tail; K = 2304: past a 1024-column chunk
@pytest.mark.parametrize("shape", [(200, 256), (64, 96), (37, 2304)])
def test_linear_tiers_agree_at_every_pass_size(tier_ops, shape):
    for name, dtypes, fn in _linear_cases(*shape):
        for dtype in dtypes:
            x = _randn(max(ROWS), shape[1], seed=2).to(dtype)
            ref = fn(tier_ops["portable"], x)
            for tier, o in tier_ops.items():
                for t in ROWS:
                    y = fn(o, x[:t])
                    assert torch.equal(y, ref[:t]), f"{name} {dtype} T={t}: {tier} differs from portable"


def test_linear_tiers_do_not_depend_on_the_thread_count(tier_ops):
    """Every stored kind's exact op gives the same rows on 1, 2 and 3 threads, whichever thread runs which tiles or
    row blocks (parallel.h: a thread that runs out takes half of another's; 3 threads on a 2-core machine run out
    unevenly). 1000 rows: many tiles and blocks to deal."""
    shape = (1000, 256)
    x = _randn(37, shape[1], seed=2)
    threads = torch.get_num_threads()
    try:
        for name, dtypes, fn in _linear_cases(*shape):
            for dtype in dtypes:
                ref = fn(tier_ops["portable"], x.to(dtype))
                for n in (1, 2, 3):
                    torch.set_num_threads(n)
                    for tier, o in tier_ops.items():
                        for t in (1, 1, 6, 37):
                            assert torch.equal(fn(o, x[:t].to(dtype)), ref[:t]), f"{name} {dtype} {tier} T={t} n={n}"
                torch.set_num_threads(threads)
    finally:
        torch.set_num_threads(threads)


# The avx2 tier's passes of 32 rows or more take the lane form (generic/tiles.h), shorter ones the dot form: the same
# rows on every tier on both sides of that line, with K off the 32-element steps (its tail laid out element by
# element) and on them, for the register blocks of 6 and 5 rows (T = 33, 70) and a group of 16 weight rows cut short
# (N = 37).
@pytest.mark.parametrize("k", [100, 1056])
def test_dot_forms_agree_across_the_lane_threshold(tier_ops, k):
    w = _randn(37, k, seed=11) * 0.1
    q8 = quantize(w, "q8", 0)._buffers
    cases = [("f32", torch.float32, lambda o, x: o.dense_linear(x, w)),
             ("bf16", torch.bfloat16, lambda o, x: o.dense_linear(x, w.bfloat16())),
             ("q8 per channel", torch.bfloat16, lambda o, x: o.q8_linear(x, q8["qweight"], q8["scales"], 0)),
             ("q8 per channel f32 x", torch.float32, lambda o, x: o.q8_linear(x, q8["qweight"], q8["scales"], 0))]
    for name, dtype, fn in cases:
        x = _randn(70, k, seed=12).to(dtype)
        ref = fn(tier_ops["portable"], x)
        for tier, o in tier_ops.items():
            for t in (1, 16, 31, 32, 33, 70):
                assert torch.equal(fn(o, x[:t]), ref[:t]), f"{name} K={k} T={t}: {tier} differs from portable"


def _blocks_and_widened(kind: str, n: int, k: int):
    """(the op on the GGUF blocks as stored, the op on its codes widened to bytes) for q6k, q3k and iq4_xs (-> q8k),
    q5_0 and iq4_nl (-> q8 with group 32 and f16 scales), q4_1 (-> q4 with f32 (d, m + 8 d)) and q4_0 (-> q4 with
    f16 (d, +0))."""
    if kind in ("q6k", "q3k", "iq4_xs"):
        qtype = {"q6k": QT.Q6_K, "q3k": QT.Q3_K, "iq4_xs": QT.IQ4_XS}[kind]
        w = from_gguf(k_blocks(qtype, n, k, seed=7), qtype, (n, k))
        q8 = w.as_q8k()._buffers
        return (lambda o, x: getattr(o, f"{kind}_linear")(x, w._buffers["qweight"]),
                lambda o, x: o.q8k_linear(x, q8["qweight"], q8["scales"], q8["supers"]))
    if kind == "q4_1":  # f16 (d, m) as stored against q4 with f32 (d, m + 8 d)
        w = from_gguf(gguf_quantize(_randn(n, k, seed=9).numpy(), QT.Q4_1), QT.Q4_1, (n, k))
        b = w._buffers
        s, z = w._scales_zeros_f32(0, b["qweight"].shape[0])
        sz = torch.stack([s, z], dim=-1).contiguous()
        return (lambda o, x: o.q4_1_linear(x, b["qweight"], b["scales_mins"]),
                lambda o, x: o.q4_linear(x, b["qweight"], sz, 32))
    if kind == "q4_0":  # f16 d as stored against q4 with f16 (d, +0)
        w = from_gguf(gguf_quantize(_randn(n, k, seed=9).numpy(), QT.Q4_0), QT.Q4_0, (n, k))
        b = w._buffers
        sz = torch.stack([b["scales"], torch.zeros_like(b["scales"])], dim=-1).contiguous()
        return (lambda o, x: o.q4_0_linear(x, b["qweight"], b["scales"]),
                lambda o, x: o.q4_linear(x, b["qweight"], sz, 32))
    if kind == "iq4_nl":
        w = from_gguf(k_blocks(QT.IQ4_NL, n, k, seed=9), QT.IQ4_NL, (n, k))
    else:
        w = from_gguf(gguf_quantize(_randn(n, k, seed=9).numpy(), QT.Q5_0), QT.Q5_0, (n, k))
    q8 = w.as_q8()._buffers
    return (lambda o, x: getattr(o, f"{kind}_linear")(x, w._buffers["qweight"]),
            lambda o, x: o.q8_linear(x, q8["qweight"], q8["scales"], 32))


@pytest.mark.parametrize("kind,shape", [("q6k", (200, 256)), ("q6k", (37, 2304)), ("q5_0", (200, 896)),
                                        ("q5_0", (37, 2304)), ("q4_1", (200, 576)), ("q4_1", (37, 2304)),
                                        ("q3k", (200, 256)), ("q3k", (37, 2304)), ("iq4_xs", (200, 256)),
                                        ("iq4_xs", (37, 2304)), ("iq4_nl", (200, 896)), ("iq4_nl", (37, 2304)),
                                        ("q4_0", (200, 896)), ("q4_0", (37, 2304))])
def test_blocks_as_stored_give_the_widened_codes_bits_on_every_tier(tier_ops, kind, shape):
    """GGUF blocks read as stored (q6k, q5_0; q4_1's f16 (d, m), q4_0's f16 d) give the bits of their codes widened
    to bytes (of q4 with f32 (d, m + 8 d), with f16 (d, +0)), every pass size."""
    blocks, widened = _blocks_and_widened(kind, *shape)
    for dtype in (torch.float32, torch.bfloat16):
        x = _randn(max(ROWS), shape[1], seed=8).to(dtype)
        for tier, o in tier_ops.items():
            for t in ROWS:
                assert torch.equal(blocks(o, x[:t]), widened(o, x[:t])), (kind, tier, dtype, t)


@pytest.mark.parametrize("kind,shape", [("q5k", (200, 256)), ("q5k", (37, 2304)), ("q2k", (200, 256)),
                                        ("q2k", (37, 2304)), ("q5_1", (200, 896)), ("q5_1", (37, 2304)),
                                        ("q5_1", (64, 96))])
def test_offset_kinds_are_the_dot_form_of_their_dequantized_values_on_every_tier(tier_ops, kind, shape):
    """Q5_K, Q2_K and Q5_1 blocks as stored (q5k_linear, q2k_linear, q5_1_linear) give, on every tier and pass
    size, the bits of the dense dot form over gguf's dequantized f32 values (bf16 x: those values rounded once to
    bf16): the weights (d sc) q - dmin m (Q5_1: d q + m) are formed exactly, then q6k's (q5_0's) accumulation."""
    n, k = shape
    qtype = {"q5k": QT.Q5_K, "q2k": QT.Q2_K, "q5_1": QT.Q5_1}[kind]
    w = from_gguf(k_blocks(qtype, n, k, seed=5), qtype, (n, k))
    dense = w.dequantize()
    for dtype in (torch.float32, torch.bfloat16):
        x = _randn(max(ROWS), k, seed=6).to(dtype)
        for tier, o in tier_ops.items():
            for t in ROWS:
                assert torch.equal(getattr(o, f"{kind}_linear")(x[:t], w._buffers["qweight"]),
                                   o.dense_linear(x[:t], dense.to(dtype))), (tier, dtype, t)


def test_veltkamp_split_is_bf16_round_to_nearest_even():
    """generic/simd.h's round_bf16_normal: c = v (2^16 + 1), c - (c - v) (each step rounded, as torch's f32
    elementwise ops are) equals vcvtneps2bf16's RNE for every f32 significand, both signs, ties included, at
    exponents from tiny normals to 2^100."""
    m = torch.arange(1 << 23, dtype=torch.int32)
    for e in (1, 100, 127, 227):  # biased exponents: 2^-126, 2^-27, 2^0, 2^100
        bits = torch.cat([m | (e << 23), m | (e << 23) | torch.tensor(-(1 << 31), dtype=torch.int32)])
        v = bits.view(torch.float32)
        c = v * 65537.0
        split = c - (c - v)
        rne = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).view(torch.float32)
        assert torch.equal(split, rne), f"exponent {e - 127}"


def test_pointwise_tiers_agree(tier_ops):
    for dtype in (torch.float32, torch.bfloat16):
        x = (_randn(64 * 300, seed=3) * 4).to(dtype)
        for fn in ("silu", "sigmoid", "gelu", "rsqrt"):
            xi = x.abs() + 0.1 if fn == "rsqrt" else x
            ref = tier_ops["portable"].pointwise(xi, fn, 1024)
            for tier, o in tier_ops.items():
                assert torch.equal(o.pointwise(xi, fn, 1024), ref), f"{fn} {dtype}: {tier}"


def test_norm_and_rope_tiers_agree_with_each_other_and_with_torch(tier_ops):
    """kernels/norm.cpp: RoPE gives the Python form's bits (torch's three rounded ops) on every tier, from a
    transposed view as attention passes it; RMSNorm gives the same bits on every tier and in every pass size (its sum
    of squares in a fixed order), and torch's form within the last bit of that sum (most elements equal)."""
    from colibri.kernels import ops

    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(7, 9, 64, generator=gen) * 3).to(dtype).transpose(0, 1)  # [H, T, Dh], not contiguous
        cos, sin = (torch.randn(7, 64, generator=gen).to(dtype) for _ in range(2))
        ref = ops._rope_torch(x, cos, sin)
        for tier, o in tier_ops.items():
            assert torch.equal(o.rope(x, cos, sin), ref), f"rope {dtype}: {tier}"
        for gemma in (False, True):
            for d in (64, 100, 576):
                xs = (torch.randn(64, d, generator=gen) * 2).to(dtype)
                w = torch.randn(d, generator=gen).to(dtype)
                want = ops._rms_norm_torch(xs, w, 1e-5, gemma)
                base = tier_ops["portable"].rms_norm(xs, w, 1e-5, gemma)
                ulp = 2.0 ** -21 if dtype == torch.float32 else 2.0 ** -7  # a few f32 ulp, 1 of bf16
                torch.testing.assert_close(base.float(), want.float(), rtol=ulp, atol=0)
                assert (base == want).float().mean() > 0.5  # rows whose sum of squares rounds alike
                for tier, o in tier_ops.items():
                    for t in ROWS:  # a row's result never depends on the rows beside it
                        assert torch.equal(o.rms_norm(xs[:t], w, 1e-5, gemma), base[:t]), f"rms {dtype} {d}: {tier}"


@pytest.fixture
def each_tier():
    """Runs a function under every runnable tier (the process tier switched with kernels.use) -> {tier: result}."""
    def run(fn):
        out = {}
        try:
            for tier in TIERS:
                kernels.use(tier)
                assert kernels.tier() == tier
                out[tier] = fn()
        finally:
            kernels.use(None)
        return out
    return run


@pytest.mark.parametrize("fam", ["llama", "mistral", "qwen2", "qwen3", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_tiny_family_logits_and_tokens_equal_on_every_tier(tiny_model_dir, each_tier, tmp_path, fam):
    """bf16 dense weights (the dot form) and a q4 container (the outer form) of each tiny family."""
    import colibri
    from colibri.convert.pipeline import cached_container

    src = tiny_model_dir(fam)
    q4 = cached_container(src, tmp_path, "q4")
    ids = [(7 * i + 3) % 384 for i in range(20)]

    def run():
        got = []
        for path, dtype in ((src, "bfloat16"), (q4, None)):
            with colibri.load(path, dtype=dtype) as m:
                got.append((m.logits(ids), m.generate(ids, max_tokens=8, temperature=0).token_ids))
        return got

    results = each_tier(run)
    ref = results["portable"]
    for tier, got in results.items():
        for (logits, tokens), (rl, rt) in zip(got, ref):
            assert torch.equal(logits, rl), f"{fam}: {tier} logits differ from portable"
            assert tokens == rt


def test_readme_demo_tokens_equal_on_every_tier(each_tier):
    """The README demo's model (SmolLM2-135M's GGUF, converted to its default container) decodes the same
    greedy tokens on every tier."""
    import colibri
    from colibri.convert.pipeline import default_container
    from colibri.core.errors import ModelLoadError

    try:
        path = default_container()
    except ModelLoadError as e:
        pytest.skip(str(e))

    def run():
        with colibri.load(path) as m:
            return m.generate("Name three uses of a hash map.", max_tokens=24, temperature=0).token_ids

    results = each_tier(run)
    assert len(set(map(tuple, results.values()))) == 1, results


def test_portable_tier_compiles_for_aarch64(aarch64_portable):
    """The portable tier is the one ARM machines (Apple Silicon, Graviton, Ampere) run: cross-compiled (its one
    translation unit, as the build makes it, with Debian's aarch64 g++, which .ci/run installs; built once a session
    by tests/aarch64_machine.py, linked where the emulated machine is set up, else to an object file), it builds
    for aarch64 with NEON fma for the exact steps (fmla) and no call to a software fmaf. (With an emulated aarch64
    machine set up, tests/test_tier_aarch64.py also runs it.)"""
    import shutil
    import subprocess

    assert aarch64_portable.binary.stat().st_size > 0
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump:
        dis = subprocess.run([objdump, "-d", str(aarch64_portable.binary)], capture_output=True, text=True,
                             check=True).stdout
        assert "fmla" in dis and "fmaf" not in dis

"""attend gives the same bits in every kernel tier this CPU can run (one source, generic/attention.cpp, over the
vector traits of generic/lanes.h: 16 AVX-512 lanes in avx512, 8 lanes in avx2 and portable): f32, bf16 and mixed
q/k/v, head dims that are multiples of 16, of 8 only, and of neither, GQA groups of 1 to 8 (head groups of up to 8
in avx512, 4 in the others, and their remainders), sliding windows, softcap,
scores far enough apart that exp lands below 2^-126, queries that see no key, views with strided rows as the
engine passes them, and one or two threads; and attend_paged (the KV cache's blocks read in place) gives attend's
bits for the blocks' concatenation, on every tier, and attend_paged_q8 (q8 blocks: int8 codes and f32 scales)
attend's bits for the blocks dequantized as the KV cache defines it; rope_attend_paged (RoPE, the pass's rows
written into the blocks and attention in one call) gives the bits of those steps one op at a time."""

from __future__ import annotations

import pytest
import torch




def _randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _qkv(H, Hkv, D, T, S, dtypes, seed):
    """q as the engine's [T, H, D] projection transposed to [H, T, D]; k and v as the first S rows of a longer
    cache (strided rows, contiguous last dim)."""
    dq, dk, dv = dtypes
    q = _randn(T, H, D, seed=seed).to(dq).transpose(0, 1)
    k = _randn(Hkv, S + 7, D, seed=seed + 1).to(dk)[:, :S]
    v = _randn(Hkv, S + 7, D, seed=seed + 2).to(dv)[:, :S]
    return q, k, v


F32, BF16 = torch.float32, torch.bfloat16
CASES = [  # H, Hkv, D, T, S, (q, k, v dtypes), positions, window, scale, softcap
    (8, 2, 64, 1, 300, (BF16,) * 3, "decode", 0, 0.125, 0.0),
    (8, 2, 64, 37, 37, (BF16,) * 3, "prefill", 0, 0.125, 0.0),
    (9, 3, 80, 20, 90, (F32,) * 3, "prefill", 7, 80 ** -0.5, 30.0),
    (6, 1, 40, 5, 70, (BF16, BF16, F32), "prefill", 16, 40 ** -0.5, 0.0),
    (4, 4, 20, 6, 33, (F32, BF16, BF16), "scattered", 0, 1.0, 0.0),
    (5, 1, 256, 3, 50, (F32,) * 3, "prefill", 0, 0.0625, 50.0),
    (2, 1, 9, 17, 17, (F32,) * 3, "prefill", 3, 20.0, 0.0),  # scores far apart: exp below 2^-126 and to 0
    (12, 2, 128, 2, 600, (BF16,) * 3, "decode", 0, 128 ** -0.5, 0.0),
    (16, 2, 64, 20, 60, (BF16,) * 3, "prefill", 0, 0.125, 0.0),  # groups of 8 (avx512) and 4 + 4
    (14, 2, 48, 9, 40, (F32, BF16, BF16), "prefill", 12, 48 ** -0.5, 20.0),  # 7: 7 and 4 + 3
]


def _positions(kind, T, S):
    if kind == "scattered":  # some past the cache, some negative (no visible key: zeros)
        return torch.tensor([S + 3, -1, 0, S // 2, -4, 1][:T])
    return torch.arange(S - T, S)  # decode / prefill: the last T positions


@pytest.mark.parametrize("case", range(len(CASES)))
def test_attend_tiers_agree(tier_ops, case):
    H, Hkv, D, T, S, dtypes, kind, window, scale, cap = CASES[case]
    q, k, v = _qkv(H, Hkv, D, T, S, dtypes, seed=10 * case)
    pos = _positions(kind, T, S)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            ref = tier_ops["portable"].attend(q, k, v, pos, window, scale, cap)
            assert ref.isfinite().all()
            for tier, o in tier_ops.items():
                got = o.attend(q, k, v, pos, window, scale, cap)
                assert torch.equal(got, ref), f"case {case} ({n} threads): {tier} differs from portable"
    finally:
        torch.set_num_threads(threads)
    if kind == "scattered":
        assert not ref[:, 1].any() and not ref[:, 4].any()  # the queries that see no key


PAGED = [  # H, Hkv, D, B (rows a block), T, S, (q, k, v dtypes), positions, window, softcap
    (12, 2, 128, 64, 1, 300, (BF16,) * 3, "decode", 0, 0.0),  # Qwen2.5-1.5B's heads, 64-row blocks, a part-full last
    (8, 2, 64, 16, 37, 100, (BF16,) * 3, "prefill", 0, 0.0),
    (9, 3, 80, 6, 20, 90, (F32,) * 3, "prefill", 7, 30.0),  # a block size that is no power of two; a window
    (6, 1, 40, 32, 5, 70, (BF16, BF16, F32), "scattered", 16, 0.0),
    (4, 4, 20, 8, 1, 8, (F32, BF16, BF16), "decode", 0, 0.0),  # one full block
]


@pytest.mark.parametrize("case", range(len(PAGED)))
def test_attend_paged_is_attend_of_the_blocks(tier_ops, case):
    """The blocks as the cache stores them ([Hkv, B, Dh] views of separate tensors: K and V of one layer of a block
    segment), the last one part-full: every tier gives attend's result on their concatenation, bit for bit, and
    so the same as the portable tier."""
    H, Hkv, D, B, T, S, (dq, dk, dv), kind, window, cap = PAGED[case]
    n = -(-S // B)
    q = _randn(T, H, D, seed=case).to(dq).transpose(0, 1)
    segs = [_randn(2, Hkv, B + 3, D, seed=100 * case + j) for j in range(n)]  # strided rows, like a segment's views
    kb = [s[0, :, :B].to(dk) for s in segs]
    vb = [s[1, :, :B].to(dv) for s in segs]
    k, v = torch.cat(kb, 1)[:, :S], torch.cat(vb, 1)[:, :S]
    pos = _positions(kind, T, S)
    scale = D ** -0.5
    ref = tier_ops["portable"].attend(q, k, v, pos, window, scale, cap)
    assert ref.isfinite().all()
    for tier, o in tier_ops.items():
        assert torch.equal(o.attend_paged(q, kb, vb, S, pos, window, scale, cap), ref), f"{tier}: paged differs"
        assert torch.equal(o.attend(q, k, v, pos, window, scale, cap), ref), f"{tier} differs from portable"


Q8 = [  # H, Hkv, D, B, T, S, q dtype, cache dtype, positions, window, softcap
    (12, 2, 128, 64, 1, 300, BF16, BF16, "decode", 0, 0.0),  # Qwen2.5-1.5B's heads, a part-full last block
    (9, 3, 64, 16, 20, 90, F32, F32, "prefill", 7, 30.0),  # f32 values (not rounded); a window; softcap
    (6, 1, 96, 6, 5, 70, BF16, BF16, "scattered", 16, 0.0),  # Dh a multiple of 32 but not of 64
    (4, 4, 32, 8, 3, 8, F32, BF16, "decode", 0, 0.0),  # one full block; f32 q over bf16 values
]


@pytest.mark.parametrize("case", range(len(Q8)))
def test_attend_paged_q8_is_attend_of_the_dequantized_blocks(tier_ops, case):
    """q8 blocks as the cache stores them (int8 codes, f32 scales per 32 values, views of a segment): every tier
    gives attend's result over the rows dequantized (ops.dequantize_q8) and concatenated, bit for bit, including
    values that round to bf16 ties and subnormal products."""
    from colibri.kernels.ops import dequantize_q8
    from colibri.kv.cache import quantize

    H, Hkv, D, B, T, S, dq, dt, kind, window, cap = Q8[case]
    n = -(-S // B)
    q = _randn(T, H, D, seed=case).to(dq).transpose(0, 1)
    blocks = []
    for j in range(n):
        kv = _randn(2, Hkv, B, D, seed=200 * case + j)
        kv[0, :, 0] *= 1e-40  # a row whose scale is subnormal: its products too
        codes, scales = quantize(kv, 32)
        seg = torch.zeros(2, Hkv, B + 3, D, dtype=torch.int8)  # strided rows, like a segment's views
        sseg = torch.zeros(2, Hkv, B + 3, D // 32)
        seg[:, :, :B], sseg[:, :, :B] = codes, scales
        blocks.append((seg[:, :, :B], sseg[:, :, :B]))
    kb, vb = [b[0][0] for b in blocks], [b[0][1] for b in blocks]
    ks, vs = [b[1][0] for b in blocks], [b[1][1] for b in blocks]
    k = dequantize_q8(torch.cat(kb, 1), torch.cat(ks, 1), dt)[:, :S]
    v = dequantize_q8(torch.cat(vb, 1), torch.cat(vs, 1), dt)[:, :S]
    pos = _positions(kind, T, S)
    scale = D ** -0.5
    ref = tier_ops["portable"].attend(q, k, v, pos, window, scale, cap)
    assert ref.isfinite().all()
    for tier, o in tier_ops.items():
        got = o.attend_paged_q8(q, kb, ks, vb, vs, S, pos, window, scale, cap, dt == BF16)
        assert torch.equal(got, ref), f"{tier}: q8 paged differs"


ROPE_PAGED = [  # H, Hkv, D, B, length before the pass, T, dtype, window, softcap
    (12, 2, 128, 64, 215, 1, BF16, 0, 0.0),  # a Qwen2.5-1.5B decode step
    (12, 2, 128, 64, 62, 3, BF16, 0, 0.0),  # the pass's rows across two blocks
    (8, 2, 64, 16, 0, 16, F32, 0, 0.0),  # a first chunk filling one block
    (9, 3, 80, 6, 40, 64, F32, 7, 30.0),  # eleven blocks of a size no power of two; a window; softcap
    (6, 1, 40, 32, 5, 64, BF16, 16, 0.0),
]


@pytest.mark.parametrize("case", range(len(ROPE_PAGED)))
def test_rope_attend_paged_is_rope_write_attend(tier_ops, case):
    """rope_attend_paged (the projections' biases added, RoPE on the pass's q and k, k and v written into the
    blocks, attention over them, the output as [T, H * Dh]) gives the bits of those steps one op at a time, on
    every tier, the same as portable's; the rows it writes are rope(k + bk) and v + bv."""
    H, Hkv, D, B, start, T, dt, window, cap = ROPE_PAGED[case]
    S = start + T
    n = -(-S // B)
    q = _randn(T, H * D, seed=case).to(dt)
    k = _randn(T, Hkv * D, seed=case + 1).to(dt)
    v = _randn(T, Hkv * D, seed=case + 2).to(dt)
    ang = torch.arange(start, S)[:, None].float() * _randn(1, D // 2, seed=case + 3).abs()
    cos, sin = torch.cat([ang, ang], 1).cos().to(dt), torch.cat([ang, ang], 1).sin().to(dt)
    pos, scale = torch.arange(start, S), D ** -0.5
    bias = [_randn(n * D, seed=case + 4 + n).to(dt) for n in (H, Hkv, Hkv)] if case % 2 == 0 else []
    qb, kb_, vb_ = ((t + b for t, b in zip((q, k, v), bias)) if bias else (q, k, v))  # a linear's `y += b`

    def blocks(seed):  # K and V views of segments (strided rows), positions < start filled, the rest junk
        segs = [_randn(2, Hkv, B + 3, D, seed=seed + j).to(dt) for j in range(n)]
        return [s[0, :, :B] for s in segs], [s[1, :, :B] for s in segs]

    want = None
    for tier, o in tier_ops.items():
        kb, vb = blocks(300 * case)
        qh = o.rope(qb.view(T, H, D).transpose(0, 1), cos, sin)
        kh = o.rope(kb_.view(T, Hkv, D).transpose(0, 1), cos, sin)
        rk, rv = torch.cat(kb, 1), torch.cat(vb, 1)
        rk[:, start:S], rv[:, start:S] = kh, vb_.view(T, Hkv, D).transpose(0, 1)
        ref = o.attend(qh, rk[:, :S], rv[:, :S], pos, window, scale, cap).transpose(0, 1).reshape(T, H * D)
        kb, vb = blocks(300 * case)
        got = o.rope_attend_paged(q.view(T, H, D) if case % 2 else q, k, v, bias, cos, sin, kb, vb, S, pos, window,
                                  scale, cap)
        assert torch.equal(got, ref), f"{tier}: rope_attend_paged differs from its steps"
        assert torch.equal(torch.cat(kb, 1)[:, :S], rk[:, :S]) and torch.equal(torch.cat(vb, 1)[:, :S], rv[:, :S])
        want = ref if want is None else want
        assert torch.equal(got, want), f"{tier} differs from {next(iter(tier_ops))}"


def test_rope_attend_paged_refuses_bad_arguments(tier_ops):
    o = tier_ops["portable"]
    q, k, cs = torch.zeros(1, 32), torch.zeros(1, 16), torch.zeros(1, 16)
    kb, pos = [torch.zeros(1, 8, 16)], torch.tensor([4])
    assert o.rope_attend_paged(q, k, k, [], cs, cs, kb, kb, 5, pos, 0, 1.0, 0.0).shape == (1, 32)
    with pytest.raises(RuntimeError, match="one dtype"):
        o.rope_attend_paged(q, k.bfloat16(), k, [], cs, cs, kb, kb, 5, pos, 0, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="must match the blocks"):
        o.rope_attend_paged(q, torch.zeros(1, 32), k, [], cs, cs, kb, kb, 5, pos, 0, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="hold `length` keys"):
        o.rope_attend_paged(q, k, k, [], cs, cs, kb, kb, 9, pos, 0, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="empty or"):
        o.rope_attend_paged(q, k, k, [cs[0]], cs, cs, kb, kb, 5, pos, 0, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="each bias"):
        o.rope_attend_paged(q, k, k, [cs[0]] * 3, cs, cs, kb, kb, 5, pos, 0, 1.0, 0.0)


def test_attend_paged_refuses_mismatched_blocks(tier_ops):
    o = tier_ops["portable"]
    q = torch.zeros(2, 1, 16)
    k = [torch.zeros(1, 8, 16), torch.zeros(1, 4, 16)]
    pos = torch.tensor([5])
    with pytest.raises(RuntimeError, match="same shape"):
        o.attend_paged(q, k, k, 10, pos, 0, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="hold `length` keys"):
        o.attend_paged(q, k[:1], k[:1], 9, pos, 0, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="same number of blocks"):
        o.attend_paged(q, k[:1], k, 8, pos, 0, 1.0, 0.0)


def test_attend_paged_q8_refuses_bad_blocks(tier_ops):
    o = tier_ops["portable"]
    q, pos = torch.zeros(2, 1, 32), torch.tensor([5])
    k, s = [torch.zeros(1, 8, 32, dtype=torch.int8)], [torch.ones(1, 8, 1)]
    assert o.attend_paged_q8(q, k, s, k, s, 8, pos, 0, 1.0, 0.0, True).shape == (2, 1, 32)
    with pytest.raises(RuntimeError, match="int8 .* codes or f32"):
        o.attend_paged_q8(q, [k[0].float()], s, k, s, 8, pos, 0, 1.0, 0.0, True)
    with pytest.raises(RuntimeError, match="same number of blocks"):
        o.attend_paged_q8(q, k, s + s, k, s, 8, pos, 0, 1.0, 0.0, True)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        o.attend_paged_q8(torch.zeros(2, 1, 16), [k[0][..., :16]], s, [k[0][..., :16]], s, 8, pos, 0, 1.0, 0.0, True)

"""The portable tier on aarch64, the CPU it is for above all (Apple Silicon, Graviton, Ampere), run under emulation:
qemu-user in the environment tools/aarch64_env.py sets up (.ci/run makes it in .ci/aarch64; COLIBRI_AARCH64_ENV
names another; the tests skip without one). The tier's one translation unit is cross-compiled here against that
environment's aarch64 torch, with the Python module, into the kernel cache its colibri reads, and loaded there as
any machine loads a tier (tests/aarch64_machine.py: one build and one emulated interpreter a session). There it
gives the bits this CPU's tiers give (tests/test_tiers.py and its siblings show those equal): the calls of the
cross-tier tests (every linear kind at pass sizes 1, 3, 16 and 64 in f32 and bf16, the GGUF blocks as stored, the
LOSSY int8 ops, attention over rows and over paged and q8 blocks, pointwise, RMSNorm, RoPE) replayed, the tiny
families' logits and greedy tokens (bf16 weights and q4 containers: torch's own ops around the kernels too, MoE
routing included), and the README demo's greedy tokens. qemu computes each aarch64 instruction's IEEE result as the
architecture defines it (FPCR at Linux's defaults: no flush to zero), so this checks the tier's arithmetic on that
ISA; it says nothing of its speed."""

from __future__ import annotations

import json

import pytest
import torch

# run there: the recorded calls (op name, arguments, result) against the tier's ops, results compared bit for bit
CHECK = """
import json, sys, torch
from colibri import kernels
assert kernels.runnable_tiers() == ["portable"] and kernels.tier() == "portable", kernels.runnable_tiers()
bad, calls = [], torch.load(sys.argv[1], weights_only=True)
for name, args, want in calls:
    got = getattr(kernels.library(), name)(*args)
    if not (got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)):
        bad.append([name] + [list(a.shape) if isinstance(a, torch.Tensor) else repr(a) for a in args])
print(json.dumps({"calls": len(calls), "differ": bad}))
"""


class _Recorder:
    """A tier's ops that keep every call made through them: (op name, arguments, result)."""

    def __init__(self, ops):
        self._ops, self.calls = ops, []

    def __getattr__(self, name):
        fn = getattr(self._ops, name)

        def call(*args):
            out = fn(*args)
            self.calls.append((name, args, out))
            return out
        return call


@pytest.fixture(scope="module")
def aarch64(aarch64_portable):
    """fn(code, *args, timeout) -> stdout: Python code run on the emulated aarch64 machine with the portable tier,
    its library cross-compiled from this checkout into a kernel cache of its own (tests/aarch64_machine.py)."""
    if aarch64_portable.why_no_machine:
        pytest.skip(aarch64_portable.why_no_machine)
    return aarch64_portable.run


def _record(ops) -> list:
    """The calls of the cross-tier tests' cases, made through ops (this CPU's portable tier)."""
    import test_tier_attention as ta
    import test_tier_int8 as ti
    import test_tiers as tt
    from gguf import GGMLQuantizationType as QT

    from colibri.kernels.ops import _rope_torch
    from colibri.quant.kinds import from_gguf
    from test_kquant import k_blocks

    r = _Recorder(ops)
    for shape in ((200, 256), (64, 96), (37, 2304)):
        for _, dtypes, fn in tt._linear_cases(*shape):
            for dtype in dtypes:
                x = tt._randn(64, shape[1], seed=2).to(dtype)
                for t in tt.ROWS:
                    fn(r, x[:t])
    for kind, shape in (("q6k", (37, 2304)), ("q5_0", (200, 896)), ("q4_1", (200, 576)), ("q3k", (200, 256)),
                        ("iq4_xs", (37, 2304)), ("iq4_nl", (200, 896)), ("q4_0", (37, 2304))):
        blocks, _ = tt._blocks_and_widened(kind, *shape)
        for dtype in (torch.float32, torch.bfloat16):
            x = tt._randn(64, shape[1], seed=8).to(dtype)
            for t in tt.ROWS:
                blocks(r, x[:t])
    for qt, shape in ((QT.Q5_K, (37, 2304)), (QT.Q2_K, (200, 256)), (QT.Q5_1, (200, 896))):
        w = from_gguf(k_blocks(qt, *shape, seed=5), qt, shape)
        for dtype in (torch.float32, torch.bfloat16):
            x = tt._randn(64, shape[1], seed=6).to(dtype)
            for t in tt.ROWS:
                getattr(r, f"{w.KIND.name}_linear")(x[:t], w._buffers["qweight"])
    for shape in ((200, 256), (64, 2304)):  # LOSSY int8
        for dtype in (torch.float32, torch.bfloat16):
            x = ti._randn(64, shape[1], seed=2).to(dtype)
            x[0, :64] = 0
            for _, fn in ti._cases(*shape):
                for t in (1, 3, 16, 64):
                    fn(r, x[:t])
    for qt in (QT.Q6_K, QT.Q3_K, QT.IQ4_XS):
        w = from_gguf(k_blocks(qt, 200, 512, seed=200), qt, (200, 512))
        x = ti._randn(16, 512, seed=512).bfloat16()
        for t in (1, 3, 16):
            getattr(r, f"{w.KIND.name}_linear_i8")(x[:t], w._buffers["qweight"])
    for case, (H, Hkv, D, T, S, dtypes, kind, window, scale, cap) in enumerate(ta.CASES):
        q, k, v = ta._qkv(H, Hkv, D, T, S, dtypes, seed=10 * case)
        r.attend(q, k, v, ta._positions(kind, T, S), window, scale, cap)
    for case, (H, Hkv, D, B, T, S, (dq, dk, dv), kind, window, cap) in enumerate(ta.PAGED):
        q = ta._randn(T, H, D, seed=case).to(dq).transpose(0, 1)
        segs = [ta._randn(2, Hkv, B + 3, D, seed=100 * case + j) for j in range(-(-S // B))]
        r.attend_paged(q, [s[0, :, :B].to(dk) for s in segs], [s[1, :, :B].to(dv) for s in segs], S,
                       ta._positions(kind, T, S), window, D ** -0.5, cap)
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        x = (tt._randn(64 * 300, seed=3) * 4).to(dtype)
        # (not rsqrt: ATen's rsqrt gave 27 % of these elements other bits on aarch64; only the torch fallback's
        # RMSNorm takes it, the tiers' rms_norm computes 1 / sqrt itself)
        for fn in ("silu", "sigmoid", "gelu"):
            r.pointwise(x, fn, 1024)
        xr = (torch.randn(7, 9, 64, generator=gen) * 3).to(dtype).transpose(0, 1)
        cos, sin = (torch.randn(7, 64, generator=gen).to(dtype) for _ in range(2))
        assert torch.equal(r.rope(xr, cos, sin), _rope_torch(xr, cos, sin))
        for gemma in (False, True):
            for d in (64, 100, 576):
                xs = (torch.randn(64, d, generator=gen) * 2).to(dtype)
                w = torch.randn(d, generator=gen).to(dtype)
                for t in (1, 3, 64):
                    r.rms_norm(xs[:t], w, 1e-5, gemma)
    return r.calls


def test_portable_tier_on_aarch64_gives_this_cpus_bits(aarch64, tier_ops, tmp_path):
    calls = _record(tier_ops["portable"])
    assert len(calls) > 500
    torch.save(calls, tmp_path / "calls.pt")
    out = json.loads(aarch64(CHECK, str(tmp_path / "calls.pt")).splitlines()[-1])
    assert out["calls"] == len(calls)
    assert not out["differ"], f"{len(out['differ'])} of {len(calls)} calls differ on aarch64, the first: " \
                              f"{out['differ'][:5]}"


def test_readme_demo_tokens_on_aarch64(aarch64, tmp_path):
    """The README demo's container gives the same logits over its prompt, bit for bit, and decodes the same greedy
    tokens on the emulated aarch64 machine (its whole forward: the portable tier's kernels, its prefill and decode
    forms, torch's own ops around them) as on this one."""
    import colibri
    from colibri.convert.pipeline import default_container
    from colibri.core.errors import ModelLoadError

    try:
        path = default_container()
    except ModelLoadError as e:
        pytest.skip(str(e))
    prompt, n = "Name three uses of a hash map.", 8
    with colibri.load(path) as m:
        logits, tokens = m.logits(prompt), list(m.generate(prompt, max_tokens=n, temperature=0).token_ids)
    code = ("import json, sys, torch, colibri\nwith colibri.load(sys.argv[1]) as m:\n"
            f"    torch.save(m.logits({prompt!r}), sys.argv[2])\n"
            f"    print(json.dumps(list(m.generate({prompt!r}, max_tokens={n}, temperature=0).token_ids)))")
    there = json.loads(aarch64(code, str(path), str(tmp_path / "logits.pt")).splitlines()[-1])
    assert len(tokens) == n and there == tokens
    got = torch.load(tmp_path / "logits.pt", weights_only=True)
    assert got.shape == logits.shape and torch.equal(got, logits), int((got != logits).sum())


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe")
# run there: each model's logits and greedy tokens against this machine's, bit for bit
FAMILY_CHECK = """
import json, sys, torch, colibri
bad, want = [], torch.load(sys.argv[1], weights_only=True)
for name, (path, dtype, ids, logits, tokens) in want.items():
    with colibri.load(path, dtype=dtype or None) as m:
        got = m.logits(ids), m.generate(ids, max_tokens=len(tokens), temperature=0).token_ids
    if not torch.equal(got[0], logits) or list(got[1]) != tokens:
        bad.append([name, int((got[0] != logits).sum()), list(got[1]), tokens])
print(json.dumps({"models": len(want), "differ": bad}))
"""


def test_tiny_family_logits_and_tokens_on_aarch64(aarch64, tiny_model_dir, tmp_path):
    """Every tiny family, as bf16 weights (the dot form) and as a q4 container (the outer form): the whole forward's
    logits and 8 greedy tokens on the emulated aarch64 machine equal this machine's."""
    import colibri
    from colibri.convert.pipeline import cached_container

    ids = [(7 * i + 3) % 384 for i in range(20)]
    want = {}
    for fam in FAMILIES:
        src = tiny_model_dir(fam)
        for path, dtype in ((src, "bfloat16"), (cached_container(src, tmp_path, "q4"), "")):
            with colibri.load(path, dtype=dtype or None) as m:
                want[f"{fam} {dtype or 'q4'}"] = (str(path), dtype, ids, m.logits(ids),
                                                  list(m.generate(ids, max_tokens=8, temperature=0).token_ids))
    torch.save(want, tmp_path / "want.pt")
    out = json.loads(aarch64(FAMILY_CHECK, str(tmp_path / "want.pt")).splitlines()[-1])
    assert out["models"] == 2 * len(FAMILIES) and not out["differ"], out["differ"]

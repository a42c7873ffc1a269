"""Two builds of one kernel tier side by side: the same ops on the same inputs through each library, per-call time,
and whether their outputs are bit-identical (an A/B across commits of a kernel change).

    python benchmarks/tier_ab.py --tier avx2 OLD.so NEW.so [--rounds 3] [--threads 1] [--ops attend q8k q4k dense]

OLD.so / NEW.so: a tier's library from the kernel cache (`colibri kernels` prints where; a worktree of the old
commit with PYTHONPATH=<worktree>/src builds its own). Both register the same op namespace, so each runs in a
process of its own; the processes alternate --rounds times and the best time per case is kept (a shared host's
rates move between runs). Shapes are Qwen2.5-1.5B's: attention (12 heads, 2 KV heads, Dh 128) at decode and
prefill lengths, the dot-form kinds (dense bf16, q8k) and q4k at 1536 x 8960 and 8960 x 1536, T = 1 to 256, bf16 x;
--ops also takes the other q4-tiled kinds and more LOSSY int8 ops (MORE: q4k with f32 x and in the int8 mode, q4 with
bf16 / f16 / f32 scales, q4_1, q4_0, q8 per channel, grouped q8 (f16 per 32, bf16 per 128), q8k and Q6_K blocks in the
int8 mode), the exact q8 with f16 scales per 32 (Q8_0's values; also at SmolLM2-135M's tied 49152 x 576 head, the
README demo's) and the exact Q6_K and Q5_K blocks as stored (q6k, q5k).
Output: one line per case, ms old / new and their ratio, then whether every output matched bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

OPS = ("attend", "dense", "q8k", "q4k")
# the other kinds of q4 code tiles (their group parameters: generic/linear_steps.h) and more of the LOSSY int8 ops
# (their activations: generic/int8_decode.h), not run unless asked
MORE = ("q4k_f32", "q4k_i8", "q4", "q4_1", "q4_0", "q8_i8", "q8g_i8", "q6k_i8", "q8", "q6k", "q5k")


def cases(ops):
    """(name, rows T, inputs builder, call) for every case; inputs from fixed seeds, so both processes see the
    same."""
    import torch

    def gen(seed):
        return torch.Generator().manual_seed(seed)

    out = []
    if "attend" in ops:
        for t, s in ((1, 512), (1, 4096), (4, 4096), (256, 512)):
            def make(t=t, s=s):
                g = gen(t * 7 + s)
                q = torch.randn(12, t, 128, generator=g).bfloat16()
                k = torch.randn(2, s, 128, generator=g).bfloat16()
                v = torch.randn(2, s, 128, generator=g).bfloat16()
                return q, k, v, torch.arange(s - t, s)
            out.append((f"attend T={t} S={s}", t, make, lambda o, a: o.attend(*a, 0, 128 ** -0.5, 0.0)))
    for n, k in ((1536, 8960), (8960, 1536)):
        for t in (1, 4, 16, 64, 256):
            if "dense" in ops:
                def make(n=n, k=k, t=t):
                    g = gen(n + k + t)
                    return torch.randn(t, k, generator=g).bfloat16(), (torch.randn(n, k, generator=g) * 0.02).bfloat16()
                out.append((f"dense {n}x{k} T={t}", t, make, lambda o, a: o.dense_linear(*a)))
            if "q8k" in ops:
                def make(n=n, k=k, t=t):
                    g = gen(n + k + t + 1)
                    return (torch.randn(t, k, generator=g).bfloat16(),
                            torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8),
                            torch.randint(-60, 60, (n, k // 16), generator=g, dtype=torch.int8),
                            (torch.rand(n, k // 256, generator=g) * 1e-3).half())
                out.append((f"q8k {n}x{k} T={t}", t, make, lambda o, a: o.q8k_linear(*a)))
            if "q4k" in ops:
                def make(n=n, k=k, t=t):
                    g = gen(n + k + t + 2)
                    return (torch.randn(t, k, generator=g).bfloat16(),
                            torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8),
                            torch.randint(0, 256, (k // 32, n // 16, 24), generator=g, dtype=torch.uint8),
                            (torch.rand(k // 256, n, 2, generator=g) * 1e-3).half())
                out.append((f"q4k {n}x{k} T={t}", t, make, lambda o, a: o.q4k_linear(*a)))
            out += _q4_tiles(ops, n, k, t, gen)
    if "q8" in ops:  # exact q8, f16 scales per 32 (Q8_0's values); the README demo's head among the shapes
        for n, k in ((1536, 8960), (8960, 1536), (49152, 576)):
            for t in (1, 4, 16):
                def make(n=n, k=k, t=t):
                    g = gen(n + k + t + 10)
                    return (torch.randn(t, k, generator=g).bfloat16(),
                            torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
                            (torch.rand(n, k // 32, generator=g) * 1e-2).half())
                out.append((f"q8 g32 {n}x{k} T={t}", t, make, lambda o, a: o.q8_linear(*a, 32)))
    return out


def _q4_tiles(ops, n, k, t, gen):
    """The cases of the other q4-tiled kinds (MORE) at one shape and pass size; x bf16 unless named f32."""
    import torch

    def q4k(seed, dtype):
        g = gen(seed)
        return (torch.randn(t, k, generator=g).to(dtype),
                torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8),
                torch.randint(0, 256, (k // 32, n // 16, 24), generator=g, dtype=torch.uint8),
                (torch.rand(k // 256, n, 2, generator=g) * 1e-3).half())

    def tiles(seed, scales):  # x bf16, q4 tiles, and the scales tensor scales(g) makes
        g = gen(seed)
        return (torch.randn(t, k, generator=g).bfloat16(),
                torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8), scales(g))

    out = []
    if "q4k_f32" in ops:
        out.append((f"q4k f32 {n}x{k} T={t}", t, lambda: q4k(n + k + t + 3, torch.float32),
                    lambda o, a: o.q4k_linear(*a)))
    if "q4k_i8" in ops:
        out.append((f"q4k i8 {n}x{k} T={t}", t, lambda: q4k(n + k + t + 4, torch.bfloat16),
                    lambda o, a: o.q4k_linear_i8(*a)))
    if "q4" in ops:
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            out.append((f"q4 {str(dt)[6:]} {n}x{k} T={t}", t,
                        lambda dt=dt: tiles(n + k + t + 5,
                                            lambda g: (torch.randn(k // 64, n, 2, generator=g) * 1e-2).to(dt)),
                        lambda o, a: o.q4_linear(*a, 64)))
    if "q4_1" in ops:
        out.append((f"q4_1 {n}x{k} T={t}", t,
                    lambda: tiles(n + k + t + 6, lambda g: (torch.randn(k // 32, n, 2, generator=g) * 1e-2).half()),
                    lambda o, a: o.q4_1_linear(*a)))
    if "q8_i8" in ops:  # q8 with one scale per channel (x groups of 64)
        def q8(seed=n + k + t + 8):
            g = gen(seed)
            return (torch.randn(t, k, generator=g).bfloat16(),
                    torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
                    (torch.rand(n, generator=g) * 1e-2).bfloat16())
        out.append((f"q8 i8 {n}x{k} T={t}", t, q8, lambda o, a: o.q8_linear_i8(*a, 0)))
    if "q8g_i8" in ops:  # grouped q8 in the int8 mode: f16 scales per 32, bf16 per 128 (avx512: the dot form), q8k
        for gs, dt in ((32, torch.float16), (128, torch.bfloat16)):
            def q8g(seed=n + k + t + 11 + gs, gs=gs, dt=dt):
                g = gen(seed)
                return (torch.randn(t, k, generator=g).bfloat16(),
                        torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
                        (torch.rand(n, k // gs, generator=g) * 1e-2).to(dt))
            out.append((f"q8 g{gs} i8 {n}x{k} T={t}", t, q8g, lambda o, a, gs=gs: o.q8_linear_i8(*a, gs)))

        def q8k(seed=n + k + t + 12):
            g = gen(seed)
            return (torch.randn(t, k, generator=g).bfloat16(),
                    torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8),
                    torch.randint(-60, 60, (n, k // 16), generator=g, dtype=torch.int8),
                    (torch.rand(n, k // 256, generator=g) * 1e-3).half())
        out.append((f"q8k i8 {n}x{k} T={t}", t, q8k, lambda o, a: o.q8k_linear_i8(*a)))
    def q6k(seed=n + k + t + 9):
        g = gen(seed)
        b = torch.randint(0, 256, (n, k // 256, 210), generator=g, dtype=torch.uint8)
        b[:, :, 208] = 0
        b[:, :, 209] = 0x1c  # d: a small f16
        return torch.randn(t, k, generator=g).bfloat16(), b.view(n, -1).contiguous()
    if "q6k_i8" in ops:  # Q6_K blocks as stored (x groups of 16)
        out.append((f"q6k i8 {n}x{k} T={t}", t, q6k, lambda o, a: o.q6k_linear_i8(*a)))
    if "q6k" in ops:  # the same, exact
        out.append((f"q6k {n}x{k} T={t}", t, q6k, lambda o, a: o.q6k_linear(*a)))
    if "q5k" in ops:  # Q5_K blocks as stored, exact (the kinds with mins: w = d sc q - dmin m)
        def q5k(seed=n + k + t + 13):
            g = gen(seed)
            b = torch.randint(0, 256, (n, k // 256, 176), generator=g, dtype=torch.uint8)
            b[:, :, 0] = b[:, :, 2] = 0
            b[:, :, 1] = b[:, :, 3] = 0x1c  # d, dmin: small f16
            return torch.randn(t, k, generator=g).bfloat16(), b.view(n, -1).contiguous()
        out.append((f"q5k {n}x{k} T={t}", t, q5k, lambda o, a: o.q5k_linear(*a)))
    if "q4_0" in ops:
        out.append((f"q4_0 {n}x{k} T={t}", t,
                    lambda: tiles(n + k + t + 7, lambda g: (torch.randn(k // 32, n, generator=g) * 1e-2).half()),
                    lambda o, a: o.q4_0_linear(*a)))
    return out


def one(lib: str, tier: str, threads: int, ops) -> None:
    """Child: every case through one library; a JSON line per case (best ms of 5, sha256 of the output)."""
    import torch
    torch.ops.load_library(lib)
    torch.set_num_threads(threads)
    o = getattr(torch.ops, f"colibri_{tier}")
    for name, rows, make, call in cases(ops):
        a = make()
        y = call(o, a)
        reps = 64 if rows == 1 else 8  # a decode call is short: more of them per timing
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                call(o, a)
            best = min(best, (time.perf_counter() - t0) / reps)
        digest = hashlib.sha256(y.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
        print(json.dumps({"case": name, "ms": best * 1e3, "sha": digest}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--tier", required=True, choices=["avx512", "avx2", "portable"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=[*OPS, *MORE])
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        return one(a.one, a.tier, a.threads, a.ops)
    for lib in (a.old, a.new):
        if not os.path.isfile(lib):
            sys.exit(f"tier_ab: {lib} is not a file: give two libraries of one tier ('colibri kernels' lists them)")
    best: dict[str, dict[str, float]] = {"old": {}, "new": {}}
    sha: dict[str, dict[str, str]] = {"old": {}, "new": {}}
    for _ in range(a.rounds):
        for side, lib in (("old", a.old), ("new", a.new)):
            cmd = [sys.executable, __file__, a.old, a.new, "--tier", a.tier, "--threads", str(a.threads),
                   "--ops", *a.ops, "--one", lib]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode:
                last = (run.stderr.strip().splitlines() or ["no output"])[-1]
                sys.exit(f"tier_ab: {lib} failed: {last[:300]}")
            for line in run.stdout.splitlines():
                r = json.loads(line)
                best[side][r["case"]] = min(best[side].get(r["case"], float("inf")), r["ms"])
                sha[side][r["case"]] = r["sha"]
    for case, old in best["old"].items():
        new = best["new"][case]
        print(f"{case:28s} {old:9.3f} ms {new:9.3f} ms  new/old {new / old:5.2f}")
    same = [c for c in sha["old"] if sha["old"][c] == sha["new"][c]]
    print(f"bit-identical outputs: {len(same)} of {len(sha['old'])} cases")


if __name__ == "__main__":
    main()

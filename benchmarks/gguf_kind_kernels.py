"""Per-call time of the exact GGUF kinds' linear kernels on random valid blocks (no model file needed).

    COLIBRI_KERNELS=avx2 python benchmarks/gguf_kind_kernels.py [--kinds q4k q5k q6k q2k q5_0 q5_1 ...]
        [--shapes 1536x8960 8960x1536] [--rows 1 16] [--threads 1] [--reps 9] [--int8]

For each shape N x K (N outputs, K inputs) and pass size T: the best of --reps calls of `w.linear(x)` with bf16 x,
kinds interleaved so that a load spike on a shared machine hits them all; --int8 times the LOSSY int8 mode.
Prints a markdown table of ms per call with the tier that ran.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as QT

from colibri import kernels
from colibri.quant.kinds import from_gguf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_kquant import k_blocks  # noqa: E402  (the tests' random valid blocks)

QTYPES = {"q4k": QT.Q4_K, "q5k": QT.Q5_K, "q6k": QT.Q6_K, "q3k": QT.Q3_K, "iq4_xs": QT.IQ4_XS, "q2k": QT.Q2_K,
          "q5_0": QT.Q5_0, "q5_1": QT.Q5_1, "iq4_nl": QT.IQ4_NL}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="*", default=["q4k", "q5k", "q6k"], choices=sorted(QTYPES))
    ap.add_argument("--shapes", nargs="*", default=["1536x8960", "8960x1536"])
    ap.add_argument("--rows", nargs="*", type=int, default=[1, 16])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--int8", action="store_true", help="the LOSSY int8-activation mode")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kernels.set_int8_activations(a.int8)
    print(f"tier {kernels.tier()}, {a.threads} thread(s), bf16 x{', LOSSY int8' if a.int8 else ''}; ms per call")
    print("| N x K | T | " + " | ".join(a.kinds) + " |")
    print("|---|---|" + "---|" * len(a.kinds))
    for shape in a.shapes:
        n, k = (int(s) for s in shape.split("x"))
        ws = {kind: from_gguf(k_blocks(QTYPES[kind], n, k, seed=1), QTYPES[kind], (n, k)) for kind in a.kinds}
        for t in a.rows:
            x = torch.randn(t, k, generator=torch.Generator().manual_seed(2)).bfloat16()
            best = dict.fromkeys(ws, float("inf"))
            for w in ws.values():
                w.linear(x)  # warm-up
            for _ in range(a.reps):
                for kind, w in ws.items():
                    t0 = time.perf_counter()
                    w.linear(x)
                    best[kind] = min(best[kind], time.perf_counter() - t0)
            print(f"| {n} x {k} | {t} | " + " | ".join(f"{best[kind] * 1e3:.2f}" for kind in a.kinds) + " |",
                  flush=True)


if __name__ == "__main__":
    main()

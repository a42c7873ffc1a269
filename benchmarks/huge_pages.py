"""The same quantized weights in 4 KiB pages (torch.empty) and in a weights.io.Arena (huge pages where the kernel
gives them), timed alternately in one process: what resident weights in huge pages change in a linear's rate.

    python benchmarks/huge_pages.py                      # Q4_K 8960 x 1536, 16 weights (from DRAM), exact kernels
    COLIBRI_LOSSY_INT8=1 Q=Q6_K S=1536x8960 python benchmarks/huge_pages.py

Env: Q (a GGUF quant type), S (N x K), C (weights, each read once a round), R (rounds), T (x rows). Prints the
best and the median G weights/s of each placement; the two placements' outputs are checked equal first.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_kquant import k_blocks  # noqa: E402

from colibri.kernels.ops import linear  # noqa: E402
from colibri.quant.kinds import from_gguf  # noqa: E402
from colibri.weights.io import Arena  # noqa: E402


def moved(w, take):
    """A copy of quantized weight w whose buffers come from take(nbytes) (a uint8 tensor)."""
    bufs = {}
    for name, t in w._buffers.items():
        b = take(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
        b.copy_(t)
        bufs[name] = b
    return type(w).from_buffers(w.shape, w.group_size, bufs)


def main() -> None:
    torch.set_num_threads(2)
    kind = getattr(QT, os.environ.get("Q", "Q4_K"))
    n, k = map(int, os.environ.get("S", "8960x1536").split("x"))
    count, rounds, rows = (int(os.environ.get(v, d)) for v, d in (("C", "16"), ("R", "12"), ("T", "1")))
    made = [from_gguf(k_blocks(kind, n, k, seed=i), kind, (n, k)) for i in range(count)]
    arena = Arena(sum(Arena.size(t.numel() * t.element_size()) for w in made for t in w._buffers.values()))
    places = {"4 KiB pages": [moved(w, lambda nb: torch.empty(nb, dtype=torch.uint8)) for w in made],
              "arena": [moved(w, arena.take) for w in made]}
    del made
    x = torch.randn(rows, k).bfloat16()
    rates: dict[str, list[float]] = {p: [] for p in places}
    with torch.inference_mode():
        a, b = places.values()
        assert all(torch.equal(linear(x, u), linear(x, v)) for u, v in zip(a, b))
        for _ in range(rounds):
            for p, ws in places.items():
                t = time.perf_counter()
                for w in ws:
                    linear(x, w)
                rates[p].append(n * k * count / (time.perf_counter() - t) / 1e9)
    for p, v in rates.items():
        print(f"{p}: best {max(v):.1f}, median {statistics.median(v):.1f} G weights/s")


if __name__ == "__main__":
    main()

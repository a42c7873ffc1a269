"""Colibri's K-quant blocks (`colibri.quant.kquant`) against llama.cpp's own (`ggml_quantize_chunk`), block by block.

    python benchmarks/kquant_blocks.py --ggml-lib .../libggml-base.so [--rows 256] [--cols 1536]

Random weights with one outlier input channel, and a random importance per channel. Per block type, with and
without importance: the share of bytes and of dequantized values that are identical, the ratio of the weighted
squared errors (ours / llama.cpp's; the weight is the importance, or 1), and single-thread CPU time per value.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from colibri.quant import kquant
from quant_quality import ggml_blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ggml-lib", type=Path, required=True, help="llama.cpp's libggml-base.so")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=1536)
    a = ap.parse_args()
    torch.set_num_threads(1)
    theirs = ggml_blocks(a.ggml_lib)
    torch.manual_seed(0)
    w = torch.randn(a.rows, a.cols) * 0.02
    w[:, 3] *= 10
    imp = torch.rand(a.cols) ** 3 * 5 + 1e-3
    print("| type | importance | bytes equal | values equal | weighted error ours / llama.cpp | ours M values/cpu-s | "
          "llama.cpp M values/cpu-s |")
    print("|---|---|---|---|---|---|---|")
    for t in ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_0"):
        for i in (None, imp):
            if i is not None and t == "Q8_0":
                continue  # llama.cpp's Q8_0 takes no importance
            got, cpu = {}, {}
            for who, fn in (("ours", kquant.quantize_blocks), ("ggml", theirs)):
                t0 = time.process_time()
                got[who] = fn(w, t, i)
                cpu[who] = w.numel() / (time.process_time() - t0) / 1e6
            deq = {k: torch.from_numpy(dequantize(v, GGMLQuantizationType[t]).reshape(w.shape)) for k, v in got.items()}
            weight = torch.ones(a.cols) if i is None else i
            err = {k: (weight * (v - w) ** 2).sum().item() for k, v in deq.items()}
            print(f"| {t} | {'yes' if i is not None else 'no'} | {(got['ours'] == got['ggml']).mean():.4f} | "
                  f"{(deq['ours'] == deq['ggml']).float().mean().item():.4f} | {err['ours'] / err['ggml']:.4f} | "
                  f"{cpu['ours']:.1f} | {cpu['ggml']:.1f} |")


if __name__ == "__main__":
    main()

"""Per-token cost of single matrices in two containers of one model (e.g. the old q4 policy vs exact K-quants).

    python benchmarks/kquant_kernels.py OLD_CONTAINER NEW_CONTAINER [--threads 1] [--reps 7] [--names N ...]

For each tensor: its kind and bytes in both containers, and the best of --reps linear calls at T = 1 with bf16
activations (all in RAM), as ms and GB/s. The embedding of a container that also stores lm_head.weight is
read as that head.
"""

from __future__ import annotations

import argparse
import time

import torch

from colibri.formats.container import ContainerCheckpoint

NAMES = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight",
         "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight")


def load(c: ContainerCheckpoint, name: str):
    """The matrix each token multiplies by: a table stored twice is read as its head."""
    if name == "model.embed_tokens.weight" and "lm_head.weight" in c.tensors:
        name = "lm_head.weight"
    return c.load(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--names", nargs="*", default=list(NAMES))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cks = {"old": ContainerCheckpoint(a.old), "new": ContainerCheckpoint(a.new)}
    print("| tensor | old kind | MB | ms | GB/s | new kind | MB | ms | GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in a.names:
        ws = {k: load(c, name) for k, c in cks.items()}
        x = torch.randn(1, ws["old"].shape[1]).bfloat16()
        best = {k: float("inf") for k in ws}
        for w in ws.values():
            w.linear(x)  # warm-up
        for _ in range(a.reps):
            for k, w in ws.items():  # interleaved, so a load spike hits both
                t0 = time.perf_counter()
                w.linear(x)
                best[k] = min(best[k], time.perf_counter() - t0)
        cells = []
        for k, w in ws.items():
            cells += [f"{w.kind.name}-g{w.group_size}", f"{w.nbytes / 1e6:.1f}", f"{best[k] * 1e3:.2f}",
                      f"{w.nbytes / best[k] / 1e9:.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

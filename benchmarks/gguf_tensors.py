"""Per-call time of a real GGUF's own tensors through `from_gguf(...).linear(x)`, by pass size: the kernels an
imported model runs, comparable across versions of Colibri (issue 22's per-kernel table at T = 1, 16, 256).

    python benchmarks/gguf_tensors.py MODEL.gguf [--rows 1 16 256] [--reps 5] [--copies 8] [--json OUT]
    PYTHONPATH=<worktree of an old commit>/src python benchmarks/gguf_tensors.py MODEL.gguf --json old.json

Takes the Q4_K ffn_up and the Q6_K ffn_down matrices of up to --copies layers and the token embedding (the tied
head, at T = 1 only), builds each with the running version's `from_gguf` (older versions import it from
colibri.quant), and times `w.linear(x)` with bf16 x on one thread in thread CPU time, cycling through the copies so
that passes of a few rows read their weights from DRAM; the best of --reps rounds per call. Prints one line per case
(ms and a hash of the first copy's output: equal hashes across versions mean bit-identical rows) and writes them as
JSON with --json. Run two versions alternately and compare their files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import numpy as np
import torch
from gguf import GGUFReader

try:
    from colibri.quant.kinds import from_gguf
except ImportError:  # versions before the quant package (the code before the kernel tiers)
    from colibri.quant import from_gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    groups: dict[str, list] = {}
    for t in GGUFReader(a.gguf).tensors:
        kind = t.tensor_type.name
        head = t.name == "token_embd.weight"
        if not (head or t.name.endswith("ffn_up.weight") and kind == "Q4_K"
                or t.name.endswith("ffn_down.weight") and kind == "Q6_K"):
            continue
        n, k = int(t.shape[1]), int(t.shape[0])  # GGUF lists a matrix's shape inner dimension first
        if head:
            groups[f"{kind} head {n}x{k}"] = [t]
        else:
            groups.setdefault(f"{kind} {t.name.split('.')[-2]} {n}x{k}", []).append(t)
    out = {}
    for name, tensors in groups.items():
        ws = []
        for t in tensors[:a.copies]:
            n, k = int(t.shape[1]), int(t.shape[0])
            ws.append(from_gguf(np.asarray(t.data).reshape(n, -1), t.tensor_type, (n, k)))
        for rows in ([1] if " head " in name else a.rows):
            x = torch.randn(rows, ws[0].shape[1], generator=torch.Generator().manual_seed(rows)).bfloat16()
            digest = hashlib.sha256(ws[0].linear(x).float().numpy().tobytes()).hexdigest()[:12]
            best = float("inf")
            for _ in range(a.reps):
                t0 = time.thread_time()
                for w in ws:
                    w.linear(x)
                best = min(best, (time.thread_time() - t0) / len(ws))
            key = f"{name} T={rows}"
            out[key] = {"ms": round(best * 1e3, 4), "output": digest, "kind": type(ws[0]).__name__}
            print(f"{key:34s} {type(ws[0]).__name__:12s} {best * 1e3:9.3f} ms  {digest}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""KV pool bytes and peak RSS for sequences that share a long common prompt (a child process per run, so its peak
RSS is its own).

    python benchmarks/kv_share.py --sequences 8 --prefix 1000 --suffix 24 --tokens 8
    PYTHONPATH=/work/main/src python benchmarks/kv_share.py ...   # the same on another tree, to compare

Each of `--sequences` prompts is the same `--prefix` tokens followed by `--suffix` tokens of its own; all are
queued at once and decoded `--tokens` greedily. Reported: the KV pool's peak RAM (`m.kv.ram_bytes()`, sampled
after every step), peak RSS above the runtime baseline, the prefix tokens each request reused, and the wall time.
Default model: SmolLM2-135M (bf16, all in RAM). State the disk regime and whether the machine was contended.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, time
import colibri
from colibri.core.metrics import peak_rss_bytes
from colibri.engine.sampling import SamplingParams
model, n, prefix, suffix, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
m = colibri.load(model) if model else colibri.load()
common = [(i * 7919) % 20000 + 100 for i in range(prefix)]
prompts = [common + [(i * 104729 + j * 31) % 20000 + 100 for j in range(suffix)] for i in range(n)]
eng, peak, t0 = m.engine, 0, time.perf_counter()
reqs = [eng.add_request(p, SamplingParams(max_tokens=tokens, ignore_eos=True)) for p in prompts]
while any(not r.finished for r in reqs):
    eng.step()
    peak = max(peak, m.kv.ram_bytes())
wall = time.perf_counter() - t0
lay = m.kv.layout
print(json.dumps({"sequences": n, "prefix": prefix, "suffix": suffix, "tokens": tokens,
                  "kv_pool_peak_bytes": peak, "token_bytes": lay.token_bytes,
                  "whole_per_sequence_bytes": (prefix + suffix + tokens) * lay.token_bytes,
                  "peak_rss_over_baseline": peak_rss_bytes() - m.baseline_rss_bytes,
                  "prefix_tokens_reused": [r.metrics.prefix_tokens for r in reqs], "wall_s": round(wall, 2),
                  "tokens_out": [r.token_ids for r in reqs]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="model path (default: SmolLM2-135M)")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--suffix", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=8)
    a = ap.parse_args()
    out = subprocess.run([sys.executable, "-c", CHILD, a.model, str(a.sequences), str(a.prefix), str(a.suffix),
                          str(a.tokens)], capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"child exited {out.returncode}")
    print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()

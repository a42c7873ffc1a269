"""Streaming runtime benchmark: `colibri plan` and `colibri bench` over a matrix of settings, one table.

    python benchmarks/streaming.py --model DIR --memory-limit 1G [--tokens 16] [--repeat 2]
        [--config DEPTH,IO_THREADS ...]    # default: auto,2  0,2  4,2  auto,1  auto,4

Each configuration runs `colibri plan --json` (the prediction: disk and kernel probes, no weights read) and then
`colibri bench --json` (a cold start: the container's pages are dropped from the page cache, weights are read with
O_DIRECT; decode I/O separated from load and prefill), each in its own process. Per run the table shows measured
decode tok/s, the I/O bound measured in the same run (achieved read GB/s / bytes read per decode token), the
compute bound (kernel probe), the ratio of measured to min(bounds), the plan's prediction and its error, and
bytes read per decode token against the plan's cyclic optimum (every non-resident byte once per token: streamed
pages, head rows, lookup rows). `--json-out FILE` keeps everything.

The virtio disk here sits behind a host cache (docs/performance.md, "Disk"): files written or read recently come
back at 2-10 GB/s whatever the guest drops, so figures state the bandwidth each run achieved.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def colibri(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "colibri.cli", *args, "--json"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"colibri {' '.join(args)} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout)


def options(a, depth: str, io_threads: str) -> list[str]:
    out = ["--model", a.model, "--io-threads", io_threads, "--threads", str(a.threads)]
    if a.memory_limit:
        out += ["--memory-limit", a.memory_limit]
    if depth != "auto":
        out += ["--prefetch-depth", depth]
    for flag, value in (("--ctx-length", a.ctx_length), ("--batch-size", a.batch_size)):
        if value:
            out += [flag, str(value)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--memory-limit")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx-length", type=int)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--config", action="append", help="DEPTH,IO_THREADS (DEPTH may be 'auto'); repeatable")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    configs = [tuple(c.split(",")) for c in (a.config or ["auto,2", "0,2", "4,2", "auto,1", "auto,4"])]
    rows = []
    print(f"{'depth':>5} {'io':>3} {'tok/s':>6} {'I/O bnd':>7} {'cmp bnd':>7} {'ratio':>5} {'pred':>6} {'err %':>6} "
          f"{'GB/tok':>7} {'optimum':>7} {'GB/s':>5}")
    for depth, io_threads in configs:
        for _ in range(a.repeat):
            opts = options(a, depth, io_threads)
            plan = colibri("plan", *opts)
            bench = colibri("bench", *opts, "--tokens", str(a.tokens))
            optimum = plan["per_token"]["total_bytes"] if plan.get("per_token") else 0
            got = bench["decode_bytes_per_token"] or 0
            row = {"depth": depth, "io_threads": int(io_threads), "plan": plan, "bench": bench,
                   "bytes_vs_optimum": got / optimum - 1 if optimum else None,
                   "plan_error_pct": round(100 * (bench["decode_tokens_per_s"] / plan["predicted_tokens_per_s"] - 1),
                                           1)}
            rows.append(row)
            io_bound = bench["io_bound_tokens_per_s"]
            print(f"{plan['placement']['prefetch_depth']:>5} {io_threads:>3} {bench['decode_tokens_per_s']:>6.3f} "
                  f"{io_bound if io_bound else float('inf'):>7.3f} {bench['compute_bound_tokens_per_s']:>7.3f} "
                  f"{bench['ratio_to_bound']:>5.2f} {plan['predicted_tokens_per_s']:>6.3f} {row['plan_error_pct']:>6.1f} "
                  f"{got / 1e9:>7.3f} {optimum / 1e9:>7.3f} {bench['decode_read_gb_per_s'] or 0:>5.2f}", flush=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

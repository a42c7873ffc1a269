"""Throughput through `colibri serve` and `colibri batch`, against the engine's own figure, in a memory cgroup.

    python benchmarks/serve.py --model DIR [--cgroup-limit 800M] [--memory-limit 500M] [--clients 1,4,8,16]
                               [--tokens 32] [--batch-lines 64] [--threads 2] [--draft-tokens 0]

1. The engine alone: `benchmarks/batch.py --batches 16` (its own cgroup), the B = 16 aggregate decode tok/s.
2. A `colibri serve` process in a fresh memory cgroup (benchmarks/limited.py: `--cgroup-limit` caps the process,
   page cache included) with `--memory-limit` and `--max-sequences` = the largest client count. For each count C,
   C clients stream a completion each at once (different prompts, greedy, `ignore_eos`, --tokens tokens). The
   aggregate decode rate counts the tokens that arrived while all C were decoding (after the last first token,
   before the first last token) over that time, as batch.py counts only the steps in which all B decode. TTFT is
   request sent to first token, p50 / p95 over the C requests. Disk bytes and read GB/s come from /metrics.
3. `colibri batch` on --batch-lines prompts (same settings, the same cgroup limit): lines/s and tok/s end to end
   (load, prefill and decode included).

The page cache is dropped before each part; streamed pages are read with O_DIRECT, but this VM's host may serve
recently read data from its own cache: the read GB/s says which regime a run was in. Needs root and the cgroup-v1
memory controller.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from batch import PROMPTS  # noqa: E402
from limited import MemCG, drop_caches, own_memcg, parse_size  # noqa: E402


def colibri() -> list[str]:
    script = Path(sys.executable).parent / "colibri"
    return [str(script)] if script.exists() else [sys.executable, "-m", "colibri.cli"]


def prompt(i: int) -> str:
    return PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))


def engine_b16(a) -> dict:
    cmd = [sys.executable, str(HERE / "batch.py"), "--model", a.model, "--cgroup-limit", a.cgroup_limit,
           "--memory-limit", a.memory_limit, "--batches", str(max(a.clients)), "--tokens", str(a.tokens),
           "--threads", str(a.threads), "--draft-tokens", str(a.draft_tokens)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    print(p.stdout.strip().splitlines()[0] if p.stdout.strip() else p.stderr[-2000:], file=sys.stderr)
    return json.loads(p.stdout.strip().splitlines()[-1])["rows"][0]


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def clients(url: str, count: int, tokens: int) -> dict:
    """`count` concurrent streamed completions; per request the send time and each token's arrival."""
    runs: list[dict] = [{} for _ in range(count)]
    start = threading.Barrier(count)

    def one(i: int) -> None:
        body = {"model": "m", "prompt": prompt(i), "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        start.wait()
        t0, arrivals = time.perf_counter(), []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["text"]:
                        arrivals.append(time.perf_counter())
        runs[i] = {"t0": t0, "arrivals": arrivals}

    before = metrics(url)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = metrics(url)
    lo = max(r["arrivals"][0] for r in runs)
    hi = min(r["arrivals"][-1] for r in runs)
    inside = sum(1 for r in runs for t in r["arrivals"] if lo < t <= hi)
    ttft = sorted(r["arrivals"][0] - r["t0"] for r in runs)
    nbytes = after.get("colibri_disk_read_bytes_total", 0) - before.get("colibri_disk_read_bytes_total", 0)
    read_s = after.get("colibri_store_read_active_s", 0) - before.get("colibri_store_read_active_s", 0)
    steps = after["colibri_engine_steps"] - before["colibri_engine_steps"]
    return {"clients": count, "aggregate_decode_tokens_per_s": round(inside / (hi - lo), 3) if hi > lo else None,
            "ttft_p50_s": round(statistics.median(ttft), 3),
            "ttft_p95_s": round(ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))], 3),
            "tokens": sum(len(r["arrivals"]) for r in runs), "steps": int(steps),
            "bytes_read_per_step": int(nbytes / steps) if steps else 0,
            "read_gb_per_s": round(nbytes / read_s / 1e9, 3) if read_s else None}


def serve_part(a) -> tuple[list[dict], dict]:
    port = 8700 + os.getpid() % 200
    url = f"http://127.0.0.1:{port}"
    cg = MemCG(own_memcg(), f"colibri-serve-{os.getpid()}", parse_size(a.cgroup_limit))
    log = tempfile.TemporaryFile(mode="w+")
    try:
        drop_caches()
        cmd = colibri() + ["serve", "--model", a.model, "--model-name", "m", "--port", str(port), "--memory-limit",
                           a.memory_limit, "--max-sequences", str(max(a.clients)), "--threads", str(a.threads),
                           "--draft-tokens", str(a.draft_tokens)]
        proc = subprocess.Popen(cmd, preexec_fn=cg.entering(), stderr=log, stdout=subprocess.DEVNULL)
        try:
            while True:
                assert proc.poll() is None, "colibri serve exited"
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            rows = []
            for count in a.clients:
                row = clients(url, count, a.tokens)
                rows.append(row)
                print(f"serve C={count:>2}: {row['aggregate_decode_tokens_per_s']} tok/s aggregate decode | TTFT p50"
                      f" {row['ttft_p50_s']} s p95 {row['ttft_p95_s']} s | {row['bytes_read_per_step'] / 1e6:.1f}"
                      f" MB/step at {row['read_gb_per_s']} GB/s", file=sys.stderr, flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
        cgroup = {"max_usage_bytes": int(cg.read("memory.max_usage_in_bytes")),
                  "failcnt": int(cg.read("memory.failcnt")), "oom_kills": cg.oom_kills()}
        return rows, cgroup
    finally:
        cg.remove()


def batch_part(a) -> dict:
    cg = MemCG(own_memcg(), f"colibri-batchjob-{os.getpid()}", parse_size(a.cgroup_limit))
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "in.jsonl", Path(d) / "out.jsonl"
        src.write_text("".join(json.dumps({"id": i, "prompt": prompt(i), "ignore_eos": True}) + "\n"
                               for i in range(a.batch_lines)))
        try:
            drop_caches()
            cmd = colibri() + ["batch", "--model", a.model, "--input", str(src), "--output", str(dst),
                               "--memory-limit", a.memory_limit, "--max-sequences", str(max(a.clients)),
                               "--threads", str(a.threads), "--max-tokens", str(a.tokens),
                               "--draft-tokens", str(a.draft_tokens)]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, preexec_fn=cg.entering(), capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if p.returncode != 0:
                print(p.stderr[-3000:], file=sys.stderr)
            out = [json.loads(line) for line in dst.read_text().splitlines()]
            tokens = sum(o["completion_tokens"] for o in out)
            return {"lines": len(out), "wall_s": round(wall, 2), "tokens": tokens,
                    "tokens_per_s": round(tokens / wall, 3), "lines_per_s": round(len(out) / wall, 3),
                    "ttft_p50_s": round(statistics.median(o["ttft_s"] for o in out), 3),
                    "max_usage_bytes": int(cg.read("memory.max_usage_in_bytes")),
                    "oom_kills": cg.oom_kills()}
        finally:
            cg.remove()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cgroup-limit", default="800M")
    ap.add_argument("--memory-limit", default="500M")
    ap.add_argument("--clients", default="1,4,8,16", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch-lines", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-tokens", type=int, default=0,
                    help="speculation in every part (default 0 = off: a streamed chunk then carries one token, so"
                         " chunk arrivals count tokens; speculation is measured by benchmarks/spec.py)")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root and the cgroup-v1 memory controller", file=sys.stderr)
        return 2
    print(f"loadavg before: {os.getloadavg()[0]:.2f} (a shared machine distorts timings)", file=sys.stderr)
    engine = engine_b16(a)
    rows, cgroup = serve_part(a)
    job = batch_part(a)
    top = rows[-1]["aggregate_decode_tokens_per_s"]
    ratio = round(top / engine["aggregate_tokens_per_s"], 3) if top else None
    print(f"engine B={max(a.clients)}: {engine['aggregate_tokens_per_s']} tok/s | server C={rows[-1]['clients']}:"
          f" {top} tok/s ({ratio}x the engine) | batch {job['lines']} lines: {job['tokens_per_s']} tok/s end to end,"
          f" {job['wall_s']} s", file=sys.stderr)
    print(json.dumps({"cgroup_limit": a.cgroup_limit, "memory_limit": a.memory_limit, "tokens": a.tokens,
                      "engine": engine, "serve": rows, "serve_cgroup": cgroup, "server_to_engine": ratio,
                      "batch": job, "loadavg_after": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

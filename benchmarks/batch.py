"""Aggregate decode throughput of B concurrent sequences in one engine (one weight sweep per step).

    python benchmarks/batch.py --model DIR [--cgroup-limit 800M] [--memory-limit 500M] [--batches 1,2,4,8,16]
                               [--tokens 16] [--threads 2]

One child process, in a fresh child memory cgroup (benchmarks/limited.py: `--cgroup-limit` caps the whole
process, page cache included), loads the container once under `--memory-limit` and, for each B, runs B requests
(different prompts, greedy, EOS ignored) through `Engine.step()`. Only steps in which all B sequences decode are
measured: per step the wall time, the store's read wait (`io_wait_s`) and the rest (compute); aggregate tok/s is
B / step time. Page cache is dropped before the child starts; streamed pages are read with O_DIRECT, but this
VM's host may serve recently read data from its own cache (~10 GB/s): the read GB/s printed says which regime a
run was in. Needs root and the cgroup-v1 memory controller (as limited.py).

Speculation is off by default: drafts (benchmarks/spec.py measures them) advance sequences unevenly, so they
finish at different steps and few steps have all B decoding; `--draft-tokens -1` turns the engine's default on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from limited import MemCG, own_memcg, parse_size, run_child  # noqa: E402

PROMPTS = ["def quicksort(arr):", "class LinkedList:", "import os\n\ndef walk(path):", "# Parse a CSV file\n",
           "def fibonacci(n):", "SELECT name FROM users WHERE", "function debounce(fn, ms) {", "fn main() {"]


def prompt_ids(m, i: int) -> list[int]:
    """Sequence i's prompt: a text of PROMPTS through the model's tokenizer, or, for a synthetic container
    (benchmarks/synth.py writes none), 24 fixed pseudo-random ids of its vocabulary."""
    if m.tokenizer is not None:
        return m.tokenizer.encode(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)))
    import torch

    g = torch.Generator().manual_seed(i)
    return torch.randint(0, m.args.vocab_size, (24,), generator=g).tolist()


def child(a: argparse.Namespace) -> None:
    from colibri.cli import quiet_openmp
    quiet_openmp(argparse.Namespace(command="run", model=a.model, memory_limit=a.memory_limit))
    import colibri
    from colibri.engine.sampling import SamplingParams

    m = colibri.load(a.model, memory_limit=parse_size(a.memory_limit), threads=a.threads,
                     max_sequences=max(a.batches), ctx_length=a.ctx_length,
                     draft_tokens=None if a.draft_tokens < 0 else a.draft_tokens)
    eng, store = m.engine, m.store
    for B in a.batches:
        prompts = [prompt_ids(m, i) for i in range(B)]
        reqs = [eng.add_request(p, SamplingParams(max_tokens=a.tokens, ignore_eos=True)) for p in prompts]
        preempted, most = eng.preemptions, 0
        while any(not r.token_ids for r in reqs):
            eng.step()  # prefill
            most = max(most, len(eng.running))
        steps, wall, wait, nbytes, read_s, made = 0, 0.0, 0.0, 0, 0.0, 0
        while all(not r.finished for r in reqs) and all(r.pending == 1 for r in reqs) and len(eng.running) == B:
            before = sum(len(r.token_ids) for r in reqs)
            c0 = store.counters() or None  # None: all in RAM
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            if c0 is not None:
                c1 = store.counters()
                wait += c1["io_wait_s"] - c0["io_wait_s"]
                nbytes += c1["bytes_read"] - c0["bytes_read"]
                read_s += c1["read_active_s"] - c0["read_active_s"]
            steps += 1
            wall += dt
            made += sum(len(r.token_ids) for r in reqs) - before  # B a step, more where drafts stood
        while any(not r.finished for r in reqs):
            eng.step()
            most = max(most, len(eng.running))
        if not steps:
            why = (f"at most {most} ran at once and {eng.preemptions - preempted} were preempted: the KV pool did "
                   f"not hold {B} sequences" if most < B else "all finished first; raise --tokens")
            raise SystemExit(f"B={B}: no step had every sequence decoding ({why})")
        print(json.dumps({"batch": B, "decode_steps": steps, "step_s": round(wall / steps, 5),
                          "read_wait_s_per_step": round(wait / steps, 5),
                          "compute_s_per_step": round((wall - wait) / steps, 5),
                          "aggregate_tokens_per_s": round(made / wall, 3), "tokens_per_step": round(made / steps, 3),
                          "bytes_read_per_step": nbytes // steps, "kv_block_tokens": m.kv.layout.block,
                          "preemptions": eng.preemptions - preempted,
                          "read_gb_per_s": round(nbytes / read_s / 1e9, 3) if read_s else None,
                          "peak_rss_bytes": int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
                          * 1024, "runtime_baseline_rss_bytes": m.baseline_rss_bytes}), flush=True)
    m.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cgroup-limit", default="800M")
    ap.add_argument("--memory-limit", default="500M")
    ap.add_argument("--batches", default="1,2,4,8,16", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx-length", type=int, default=None)
    ap.add_argument("--draft-tokens", type=int, default=0,
                    help="speculation's draft length (default 0: off, so every step is one token per sequence; "
                         "-1: the engine's adaptive drafts)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return 0
    if os.geteuid() != 0:
        print("needs root and the cgroup-v1 memory controller", file=sys.stderr)
        return 2
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", a.model, "--memory-limit",
           str(a.memory_limit), "--batches", ",".join(map(str, a.batches)), "--tokens", str(a.tokens),
           "--threads", str(a.threads)] + (["--ctx-length", str(a.ctx_length)] if a.ctx_length else []) \
        + ["--draft-tokens", str(a.draft_tokens)]
    cg = MemCG(own_memcg(), f"colibri-batch-{os.getpid()}", parse_size(a.cgroup_limit))
    try:
        rows, rc = run_child(cmd, cg)
        base = rows[0]["aggregate_tokens_per_s"] if rows else None
        for r in rows:
            base_rss = r["runtime_baseline_rss_bytes"]
            print(f"B={r['batch']:>2}: {r['aggregate_tokens_per_s']:7.2f} tok/s aggregate "
                  f"({r['aggregate_tokens_per_s'] / base:4.1f}x B=1) | step {1e3 * r['step_s']:7.1f} ms = read wait "
                  f"{1e3 * r['read_wait_s_per_step']:6.1f} + compute {1e3 * r['compute_s_per_step']:6.1f} | "
                  f"{r['bytes_read_per_step'] / 1e6:6.1f} MB/step at {r['read_gb_per_s']} GB/s | "
                  f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB = baseline {base_rss / 2**20:.0f} + "
                  f"{(r['peak_rss_bytes'] - base_rss) / 2**20:.0f}"
                  f" | {r['preemptions']} preempted, {r['kv_block_tokens']}-token KV blocks")
        print(json.dumps({"cgroup_limit": a.cgroup_limit, "memory_limit": a.memory_limit,
                          "max_usage_bytes": int(cg.read("memory.max_usage_in_bytes")),
                          "failcnt": int(cg.read("memory.failcnt")), "oom_kills": cg.oom_kills(), "rows": rows}))
        return rc
    finally:
        cg.remove()


if __name__ == "__main__":
    sys.exit(main())

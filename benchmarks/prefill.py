"""Prefill and decode speed with all weights in RAM: one long prompt in a single pass, then greedy decode steps.

    python benchmarks/prefill.py --model PATH [--prompt-tokens 500] [--decode-tokens 32] [--threads 2] [--repeat 2]
    python benchmarks/prefill.py --model PATH --threads 1 --cpu-time   # thread CPU time: robust on a shared machine
    python benchmarks/prefill.py --model PATH --lossy-int8-activations # the LOSSY int8-activation kernels
    python benchmarks/prefill.py --model PATH --cgroup-limit 800M --memory-limit 500M  # a small machine

The prompt is token ids cycled from a fixed text's encoding, so every run sees the same tokens. One request goes
through the engine: prefill time is until its first token, decode the steps after it; the KV space is cleared
between repeats so no run reuses the previous one's prefix. Prints one JSON line with the best prefill and
decode tok/s over --repeat runs, and the greedy tokens (to compare versions). Decode is plain steps unless
--draft-tokens asks for speculation.

--memory-limit is the engine's budget (colibri.load's memory_limit: weights that do not fit stream from disk).
--cgroup-limit runs the measurement in a child process inside a fresh child memory cgroup with that limit, page
cache included (benchmarks/limited.py's MemCG: needs root and the cgroup-v1 memory controller), and adds the
cgroup's peak usage and failcnt to the JSON line; the page cache is dropped first (a cold start; streamed weights
are read with O_DIRECT either way). --read-bps (with --cgroup-limit) caps the child's reads of the model's disk at
that many bytes a second (limited.py's ReadCap: the slow-disk kind of machine on a host-cached disk).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

TEXT = ("def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot = items[len(items) // 2]\n"
        "    left = [x for x in items if x < pivot]\n    return quicksort(left) + [pivot] + quicksort(right)\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cpu-time", action="store_true", help="time with the thread's CPU clock (needs --threads 1)")
    ap.add_argument("--lossy-int8-activations", action="store_true", help="LOSSY int8-activation kernels (VNNI)")
    ap.add_argument("--draft-tokens", type=int, default=0,
                    help="speculation's draft length (default 0: plain T = 1 decode steps; the repeated prompt makes "
                         "n-gram drafts hit far more often than real text does)")
    ap.add_argument("--memory-limit", help="the engine's memory budget, e.g. 500M (default: every weight in RAM)")
    ap.add_argument("--cgroup-limit", help="run inside a child memory cgroup with this limit, e.g. 800M (root)")
    ap.add_argument("--read-bps", help="with --cgroup-limit: cap reads of the model's disk, e.g. 1.4G (bytes/s)")
    args = ap.parse_args()
    if args.read_bps and not args.cgroup_limit:
        raise SystemExit("--read-bps caps a cold-start child: give --cgroup-limit too")
    if args.cgroup_limit:
        return in_cgroup(args.cgroup_limit, args.read_bps, args.model)
    if args.cpu_time and args.threads != 1:
        raise SystemExit("--cpu-time measures the calling thread only: use it with --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    import torch

    import colibri

    torch.set_num_threads(args.threads)
    m = colibri.load(args.model, threads=args.threads, lossy_int8_activations=args.lossy_int8_activations,
                     draft_tokens=args.draft_tokens, memory_limit=args.memory_limit)
    base = m.tokenizer.encode(TEXT)
    ids = (base * (args.prompt_tokens // len(base) + 1))[:args.prompt_tokens]
    from colibri.engine.sampling import SamplingParams

    eng = m.engine

    def reads() -> tuple[int, float]:  # (bytes read from disk, seconds reads were in flight) so far; 0 all in RAM
        c = m.store.counters()
        return c.get("bytes_read", 0), c.get("read_active_s", 0.0)

    best_pre, best_dec, tokens, prefill_io = 0.0, 0.0, [], {}
    for _ in range(args.repeat):
        m.kv.clear()
        req = eng.add_request(ids, SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True))
        (b0, r0), steps0 = reads(), eng.steps
        t0 = clock()
        while not req.token_ids and not req.finished:
            eng.step()
        (b1, r1), passes = reads(), eng.steps - steps0
        if req.error is not None or not req.token_ids:
            import traceback

            if req.error is not None:
                traceback.print_exception(req.error)
            raise SystemExit(f"the request failed: {req.error or req.finish_reason}")
        pre = len(ids) / (clock() - t0)
        t0 = clock()
        eng.run([req])
        dec = (len(req.token_ids) - 1) / (clock() - t0)
        tokens = list(req.token_ids)
        if pre > best_pre:  # the prefill's passes and disk reads, of the best run
            prefill_io = {"prefill_passes": passes, "prefill_read_bytes": b1 - b0,
                          "prefill_read_gb_per_s": round((b1 - b0) / (r1 - r0) / 1e9, 2) if r1 > r0 else 0.0}
        best_pre, best_dec = max(best_pre, pre), max(best_dec, dec)
    from colibri import kernels

    with kernels.int8_mode(m.decoder.lossy_int8):  # the model's mode (its passes ran in it)
        int8 = kernels.int8_activations()
    print(json.dumps({"model": args.model, "threads": args.threads, "int8_activations": int8,
                      "draft_tokens": args.draft_tokens, "memory_limit": args.memory_limit,
                      "clock": "thread CPU" if args.cpu_time else "wall",
                      "prompt_tokens": len(ids),
                      "pass_tokens": m.pass_tokens, "prefill_tok_s": round(best_pre, 2),
                      **prefill_io, "decode_tok_s": round(best_dec, 2), "tokens": tokens}))


def in_cgroup(limit: str, read_bps: str | None, model: str) -> None:
    """This script again, without --cgroup-limit and --read-bps, in a child memory cgroup of `limit` bytes after a
    page-cache drop (limited.py's run_child), its reads of the model's disk capped at read_bps; its JSON line with
    the cgroup's peak usage and failcnt (and the cap) added."""
    from limited import MemCG, ReadCap, own_memcg, parse_size, run_child

    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip or a in ("--cgroup-limit", "--read-bps") or a.startswith(("--cgroup-limit=", "--read-bps=")):
            skip = a in ("--cgroup-limit", "--read-bps")
            continue
        argv.append(a)
    cg = MemCG(own_memcg(), f"colibri-prefill-{os.getpid()}", parse_size(limit))
    cap = None
    try:
        cap = ReadCap(model, parse_size(read_bps)) if read_bps else None
        rows, rc = run_child([sys.executable, os.path.abspath(__file__), *argv], cg, cap)
        if rc != 0 or not rows:
            raise SystemExit(f"the child failed ({'OOM-killed by the cgroup limit' if cg.oom_kills() > 0 else rc})")
        res = rows[-1]
        res.update(cgroup_limit=limit, cgroup_max_usage_mib=round(int(cg.read("memory.max_usage_in_bytes")) / 2**20),
                   cgroup_failcnt=int(cg.read("memory.failcnt")))
        if cap is not None:
            res.update(read_cap_gb_s=round(cap.bps / 1e9, 3))
        print(json.dumps(res))
    finally:
        cg.remove()
        if cap is not None:
            cap.remove()


if __name__ == "__main__":
    main()

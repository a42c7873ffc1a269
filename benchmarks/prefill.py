"""Prefill and decode speed with all weights in RAM: one long prompt in a single pass, then greedy decode steps.

    python benchmarks/prefill.py --model PATH [--prompt-tokens 500] [--decode-tokens 32] [--threads 2] [--repeat 2]
    python benchmarks/prefill.py --model PATH --threads 1 --cpu-time   # thread CPU time: robust on a shared machine
    python benchmarks/prefill.py --model PATH --lossy-int8-activations # the LOSSY int8-activation kernels

The prompt is token ids cycled from a fixed text's encoding, so every run sees the same tokens. One request goes
through the engine: prefill time is until its first token, decode the steps after it; the KV space is cleared
between repeats so no run reuses the previous one's prefix. Prints one JSON line with the best prefill and
decode tok/s over --repeat runs, and the greedy tokens (to compare versions).
"""

from __future__ import annotations

import argparse
import json
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
    ap.add_argument("--draft-tokens", type=int, help="speculation's draft length (0: plain T = 1 decode steps)")
    args = ap.parse_args()
    if args.cpu_time and args.threads != 1:
        raise SystemExit("--cpu-time measures the calling thread only: use it with --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    import torch

    import colibri

    torch.set_num_threads(args.threads)
    m = colibri.load(args.model, threads=args.threads, lossy_int8_activations=args.lossy_int8_activations,
                     draft_tokens=args.draft_tokens)
    base = m.tokenizer.encode(TEXT)
    ids = (base * (args.prompt_tokens // len(base) + 1))[:args.prompt_tokens]
    from colibri.sampling import SamplingParams

    eng = m.engine
    best_pre, best_dec, tokens = 0.0, 0.0, []
    for _ in range(args.repeat):
        m.kv.clear()
        req = eng.add_request(ids, SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True))
        t0 = clock()
        while not req.token_ids:
            eng.step()
        pre = len(ids) / (clock() - t0)
        t0 = clock()
        eng.run([req])
        dec = (len(req.token_ids) - 1) / (clock() - t0)
        tokens = list(req.token_ids)
        best_pre, best_dec = max(best_pre, pre), max(best_dec, dec)
    from colibri import kernels

    print(json.dumps({"model": args.model, "threads": args.threads, "int8_activations": kernels.int8_activations(),
                      "draft_tokens": args.draft_tokens, "clock": "thread CPU" if args.cpu_time else "wall",
                      "prompt_tokens": len(ids),
                      "pass_tokens": m.pass_tokens, "prefill_tok_s": round(best_pre, 2),
                      "decode_tok_s": round(best_dec, 2), "tokens": tokens}))


if __name__ == "__main__":
    main()

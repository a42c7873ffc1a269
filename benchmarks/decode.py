"""Decode speed with all weights in RAM: tok/s per compute dtype at a fixed thread count.

    python benchmarks/decode.py --model PATH [--dtype float32 bfloat16] [--threads 2] [--tokens 64]

Without --model it uses the embedded default (SmolLM2-135M-Instruct). Each dtype runs in a fresh process so
peak RSS is per configuration. Greedy decoding with EOS ignored, so every run produces exactly --tokens tokens.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

PROMPT = "The history of the printing press begins"


def measure(model: str | None, dtype: str, threads: int, tokens: int) -> dict:
    import torch

    import colibri
    from colibri.core.defaults import default_model_path

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    m = colibri.load(model or default_model_path(), dtype=dtype)
    load_s = time.perf_counter() - t0
    m.generate(PROMPT, max_tokens=4, ignore_eos=True)  # warm-up: allocator, kernels
    r = m.generate(PROMPT, max_tokens=tokens, ignore_eos=True)
    return {"dtype": dtype, "threads": threads, "load_s": round(load_s, 2), **r.stats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.model, a.child, a.threads, a.tokens)))
        return
    print(f"model: {a.model or 'default (SmolLM2-135M-Instruct Q4_1 GGUF)'}; threads {a.threads}; {a.tokens} tokens")
    print("| dtype | decode tok/s | prefill tok/s | TTFT s | load s | peak RSS MiB |")
    print("|---|---|---|---|---|---|")
    for dtype in a.dtype:
        cmd = [sys.executable, __file__, "--child", dtype, "--threads", str(a.threads), "--tokens", str(a.tokens)]
        if a.model:
            cmd += ["--model", a.model]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        s = json.loads(out)
        print(f"| {dtype} | {s['decode_tokens_per_s']:.1f} | {s['prefill_tokens_per_s']:.1f} | {s['ttft_s']:.3f} |"
              f" {s['load_s']:.1f} | {s['peak_rss_bytes'] / 2**20:.0f} |")


if __name__ == "__main__":
    main()

"""Decode all in RAM against llama.cpp's, in paired rounds: each round runs llama-bench's tg and Colibri's decode
back to back (the order swapped every round), each in a fresh process, so both see the same moment of a shared
host's memory bandwidth.

    python benchmarks/paired_decode.py --model DIR --gguf FILE --llama-bench BIN [--rounds 8] [--tokens 32]
                                       [--repeat 3] [--threads 2] [--lossy-int8-activations]

On a shared VM the rate a process reads RAM at moves by a third from minute to minute, and from one process to the
next (docs/performance.md): two engines measured minutes apart, or in one long-lived process each, differ by as
much as the engines themselves do. So every round starts both afresh: `llama-bench -p 0 -n TOKENS -r REPEAT` (its
own warm-up pass first), and benchmarks/prefill.py with a 16-token prompt and TOKENS decode tokens, REPEAT times
(the KV cleared in between; llama-bench's tg has no prompt). Each engine's best of its REPEAT runs is taken. A plain
two-thread read of a 1 GiB buffer is timed before each round.

Prints one line per round (read GB/s, llama.cpp's tok/s, Colibri's, their ratio), then one JSON object: the
median and range of the per-round ratios, each engine's median tok/s and GB/s of weights (the bytes a token reads:
Colibri's every linear and head, the same kinds and sizes as the GGUF's), and whether Colibri's tokens were the same
in every round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def llama_tg(bench: str, gguf: str, threads: int, tokens: int, repeat: int) -> float:
    """llama-bench's best tg sample (tok/s) of `repeat`, `tokens` generated tokens each."""
    out = subprocess.run([bench, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", str(repeat),
                          "-o", "jsonl"], check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if not rows:
        raise SystemExit(f"llama-bench printed no result:\n{out}")
    return max(float(v) for v in rows[-1]["samples_ts"])


def colibri_decode(model: str, threads: int, tokens: int, repeat: int, lossy: bool) -> dict:
    """benchmarks/prefill.py's JSON line for a 16-token prompt and `tokens` decode steps, best of `repeat`."""
    cmd = [sys.executable, os.path.join(HERE, "prefill.py"), "--model", model, "--prompt-tokens", "16",
           "--decode-tokens", str(tokens), "--repeat", str(repeat), "--threads", str(threads), "--draft-tokens", "0"]
    out = subprocess.run(cmd + (["--lossy-int8-activations"] if lossy else []), check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def read_rate() -> float:
    """GB/s of a plain two-thread sum over a 1 GiB buffer (best of 3), in a process of its own."""
    code = ("import time, torch; torch.set_num_threads(2); b = torch.ones(2 ** 28); b.sum(); ts = []\n"
            "for _ in range(3):\n t = time.perf_counter(); b.sum(); ts.append(time.perf_counter() - t)\n"
            "print(2 ** 30 / min(ts) / 1e9)")
    return float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)


def weight_bytes(model: str) -> int:
    """The bytes a decode step reads of the container's weights: every layer linear and the head."""
    from colibri.formats.container import ContainerCheckpoint

    ck = ContainerCheckpoint(model)
    head = "lm_head.weight" if "lm_head.weight" in ck.tensors else "model.embed_tokens.weight"
    return sum(t.nbytes for n, t in ck.tensors.items() if t.role not in ("embedding", "norm") or n == head)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="Colibri's container")
    ap.add_argument("--gguf", required=True, help="the GGUF llama.cpp reads (the container's source)")
    ap.add_argument("--llama-bench", required=True, help="llama.cpp's llama-bench binary")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lossy-int8-activations", action="store_true")
    a = ap.parse_args()
    for what, path in (("--model", a.model), ("--gguf", a.gguf), ("--llama-bench", a.llama_bench)):
        if not os.path.exists(path):
            raise SystemExit(f"{what} {path}: no such file or directory")
    step_bytes = weight_bytes(a.model)
    rows, tokens = [], []
    for r in range(a.rounds):
        gbs = read_rate()
        runs = [lambda: llama_tg(a.llama_bench, a.gguf, a.threads, a.tokens, a.repeat),
                lambda: colibri_decode(a.model, a.threads, a.tokens, a.repeat, a.lossy_int8_activations)]
        if r % 2:
            ours, llama = runs[1](), runs[0]()
        else:
            llama, ours = runs[0](), runs[1]()
        tokens.append(ours["tokens"])
        tok_s = ours["decode_tok_s"]
        rows.append({"read_gb_s": round(gbs, 1), "llama_tok_s": round(llama, 2), "colibri_tok_s": tok_s,
                     "ratio": round(tok_s / llama, 3)})
        print(f"round {r + 1}: read {gbs:.1f} GB/s; llama.cpp {llama:.2f} tok/s ({llama * step_bytes / 1e9:.1f} GB/s),"
              f" Colibri {tok_s:.2f} tok/s ({tok_s * step_bytes / 1e9:.1f} GB/s); ratio {tok_s / llama:.3f}",
              flush=True)
    ratios = [row["ratio"] for row in rows]
    llama_med = statistics.median(row["llama_tok_s"] for row in rows)
    ours_med = statistics.median(row["colibri_tok_s"] for row in rows)
    print(json.dumps({
        "model": a.model, "gguf": a.gguf, "threads": a.threads, "lossy_int8": a.lossy_int8_activations,
        "kernels": os.environ.get("COLIBRI_KERNELS", "auto"), "tokens": a.tokens, "repeat": a.repeat,
        "rounds": rows, "ratio_median": round(statistics.median(ratios), 3), "ratio_min": min(ratios),
        "ratio_max": max(ratios), "llama_tok_s_median": round(llama_med, 2), "colibri_tok_s_median": round(ours_med, 2),
        "weight_bytes_per_token": step_bytes, "llama_gb_s_median": round(llama_med * step_bytes / 1e9, 1),
        "colibri_gb_s_median": round(ours_med * step_bytes / 1e9, 1),
        "same_tokens": all(t == tokens[0] for t in tokens), "finished": time.strftime("%Y-%m-%d %H:%M:%S")}))


if __name__ == "__main__":
    main()

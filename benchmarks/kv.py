"""KV cache benchmarks: multi-turn chat with prefix reuse, long context with KV offload, and the cost of q8 KV.

    python benchmarks/kv.py turns   [--model DIR] [--memory-limit 300M] [--turns 5]
    python benchmarks/kv.py long    [--model DIR] [--tokens 6000] [--memory-limit 256M] [--kv-ram 32M]
    python benchmarks/kv.py ttft    [--model PATH]
    python benchmarks/kv.py quality [--tokens 4096]
    python benchmarks/kv.py inplace [--model DIR] [--tokens 4000] [--rounds 4] [--kv-quant q8]

* turns: a 5-turn chat (a ~700-token first message of pydoc text, then short questions; greedy, 32 tokens per
  reply) on a container streaming under --memory-limit (default: Qwen2.5-Coder-0.5B q4 converted from its PyPI
  GGUF). Per turn: prompt tokens, tokens reused from the KV cache, tokens computed, TTFT and decode tok/s; then the
  same turns with the KV cache cleared before each (every turn a cold prefill of its whole history).
* long: one --tokens-token prompt in an 8192-token context: all in RAM, with only --kv-ram (weights in RAM, the
  rest of the KV in a swap file, read back with O_DIRECT), and with --memory-limit too (weights streamed as
  well): each in a fresh child process (peak RSS is its own),
  with TTFT, prefill and decode speed, KV bytes written and read (per decode token), the wait for those reads,
  and the slowdown against the all-in-RAM run. Default model: SmolLM2-135M q4.
* ttft: SmolLM2 turn 2 after a ~1,000-token turn 1, against a cold prefill of the same history (median of 3).
* inplace: plain decode (no drafts) over a --tokens-token context all in RAM, attention reading the KV blocks where
  they are (`ops.Paged`, the engine's path) against the same blocks copied into one tensor per layer and step
  first (what the engine did before, `Paged.dense`), alternating 16-token rounds in one process (the prompt is
  prefilled once; its KV is reused from the prefix cache), with the tokens compared; --kv-quant q8: q8 blocks read
  and dequantized in the kernel against the context dequantized into one tensor per layer and step first. Default
  model: SmolLM2-135M q4.
* quality: perplexity of the first --tokens pydoc tokens with K and V stored in q8 against the unquantized cache
  (SmolLM2, Qwen2.5-Coder-0.5B; f32 and bf16 activations).

Results print as one JSON object per configuration and a summary table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import real_models  # noqa: E402

import colibri  # noqa: E402
from colibri.convert.pipeline import ConvertOptions, convert  # noqa: E402

WORK = Path(tempfile.gettempdir()) / "colibri-bench-kv"
QUESTIONS = ["Summarize the text above in two sentences.", "Which Python statements does it mention?",
             "Give an example of the first one.", "What would change in Python 2?", "Thank you. One last summary."]


def container(name: str, source) -> Path:
    out = WORK / name
    if not (out / "manifest.json").exists():
        src = source()
        if src is None:
            sys.exit(f"the model for {name} is not installed (see DESIGN.md for the PyPI packages)")
        convert(src, out, ConvertOptions(quant="q4"), force=True)
    return out


def text(tokens: int) -> str:
    return real_models.pydoc_text()[: tokens * 4]


def turns(args) -> None:
    path = args.model or container("qwen25-q4", real_models.qwen25_gguf)
    rows = {}
    for mode in ("reuse", "cold"):
        m = colibri.load(path, memory_limit=args.memory_limit, ctx_length=4096)
        tok = m.tokenizer
        first = tok.decode(tok.encode(text(800))[:700])
        messages, out = [], []
        for t in range(args.turns):
            messages.append({"role": "user", "content": (first + "\n\n" if t == 0 else "") + QUESTIONS[t % 5]})
            if mode == "cold":
                m.kv.clear()
            r = m.chat(messages, max_tokens=32, ignore_eos=True)
            messages.append({"role": "assistant", "content": r.text})
            s = r.stats
            out.append({"turn": t + 1, "prompt": s["prompt_tokens"], "reused": s["prefix_tokens"],
                        "computed": s["prefill_tokens_computed"], "ttft_s": s["ttft_s"],
                        "decode_tok_s": s["decode_tokens_per_s"], "disk_gb": round(s["disk_bytes_read"] / 1e9, 3),
                        "tokens": r.token_ids})
            print(json.dumps({"mode": mode, **{k: v for k, v in out[-1].items() if k != "tokens"}}), flush=True)
        rows[mode] = out
        m.close()
    print(f"\n{Path(path).name} under --memory-limit {args.memory_limit}")
    print("| turn | prompt | reused | computed | TTFT (reuse) | TTFT (cold) | decode tok/s | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for a, c in zip(rows["reuse"], rows["cold"]):
        print(f"| {a['turn']} | {a['prompt']} | {a['reused']} | {a['computed']} | {a['ttft_s']:.2f} s "
              f"| {c['ttft_s']:.2f} s | {a['decode_tok_s']:.2f} | {a['tokens'] == c['tokens']} |")


CHILD = r"""
import json, sys, colibri
from colibri.core.metrics import peak_rss_bytes
path, limit, kv_ram, ids = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
kw = {} if limit == "none" else dict(memory_limit=limit)
kw.update({} if kv_ram == "none" else dict(kv_ram=kv_ram))
m = colibri.load(path, ctx_length=8192, **kw)
r = m.generate(ids, max_tokens=16, ignore_eos=True)
print(json.dumps({"tokens": r.token_ids, "stats": r.stats, "baseline": m.baseline_rss_bytes,
                  "window": m.kv_plan.window, "peak": peak_rss_bytes()}))
"""


def long(args) -> None:
    path = args.model or container("smollm2-q4", real_models.smollm2_gguf)
    ids = colibri.load(path).tokenizer.encode(text(args.tokens + 600))[: args.tokens]
    runs = {}
    configs = {"ram": ("none", "none"), "kv": ("none", args.kv_ram), "offload": (args.memory_limit, args.kv_ram)}
    for name, (limit, kv_ram) in configs.items():
        p = subprocess.run([sys.executable, "-c", CHILD, str(path), limit, kv_ram, json.dumps(ids)],
                           capture_output=True, text=True)
        if p.returncode:
            sys.exit(p.stderr)
        runs[name] = r = json.loads(p.stdout.strip().splitlines()[-1])
        s = r["stats"]
        print(json.dumps({"run": name, "window": r["window"], "peak_rss_mib": r["peak"] >> 20,
                          "baseline_mib": r["baseline"] >> 20,
                          **{k: s[k] for k in ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s",
                                               "kv_written_bytes", "kv_read_bytes", "kv_read_bytes_per_token",
                                               "kv_read_wait_s", "kv_disk_bytes", "disk_bytes_read")}}), flush=True)
    a = runs["ram"]["stats"]
    print(f"\n{args.tokens}-token prompt, ctx 8192, {Path(path).name}")
    print("| run | TTFT | prefill tok/s | decode tok/s | KV written | KV read back | per decode token | read wait | "
          "peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in configs:
        r, s = runs[name], runs[name]["stats"]
        label = {"ram": "all in RAM", "kv": f"--kv-ram {args.kv_ram} (weights in RAM)",
                 "offload": f"--memory-limit {args.memory_limit} --kv-ram {args.kv_ram}"}[name]
        print(f"| {label} | {s['ttft_s']:.1f} s | {s['prefill_tokens_per_s']:.0f} | {s['decode_tokens_per_s']:.2f} "
              f"| {s['kv_written_bytes'] / 2**20:.0f} MiB | {s['kv_read_bytes'] / 1e9:.2f} GB "
              f"| {s['kv_read_bytes_per_token'] / 2**20:.0f} MiB | {s['kv_read_wait_s']:.2f} s "
              f"| {r['peak'] >> 20} MiB (baseline {r['baseline'] >> 20}) |")
    for name in ("kv", "offload"):
        b = runs[name]["stats"]
        print(f"{name}: same tokens as all in RAM: {runs['ram']['tokens'] == runs[name]['tokens']}; slowdown: TTFT "
              f"{b['ttft_s'] / a['ttft_s']:.2f}x, decode {a['decode_tokens_per_s'] / b['decode_tokens_per_s']:.2f}x")


def ttft(args) -> None:
    m = colibri.load(args.model or real_models.smollm2_gguf())
    messages = [{"role": "user", "content": text(1100)}]
    first = m.chat(messages, max_tokens=16)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Summarize that."}]
    warm, cold = [], []
    for _ in range(3):
        m.chat(messages[:1], max_tokens=16)  # the live sequence is turn 1 again
        warm.append(m.chat(messages, max_tokens=4).stats)
        m.kv.clear()
        cold.append(m.chat(messages, max_tokens=4).stats)
    w, c = statistics.median(s["ttft_s"] for s in warm), statistics.median(s["ttft_s"] for s in cold)
    print(json.dumps({"turn1_prompt": first.prompt_tokens, "turn2_prompt": warm[0]["prompt_tokens"],
                      "turn2_reused": warm[0]["prefix_tokens"], "ttft_turn2_s": w, "ttft_cold_s": c,
                      "ratio": round(w / c, 4)}))


def quality(args) -> None:
    from colibri.runtime.evaluate import perplexity
    print("| model | activations | KV | perplexity | delta |")
    print("|---|---|---|---|---|")
    for name, src in (("SmolLM2-135M", real_models.smollm2_gguf), ("Qwen2.5-Coder-0.5B", real_models.qwen25_gguf)):
        path = src()
        if path is None:
            continue
        for dtype in ("float32", "bfloat16"):
            base = None
            for q in (None, "q8"):
                m = colibri.load(path, dtype=dtype, kv_quant=q)
                ids = m.tokenizer.encode(real_models.pydoc_text()[: args.tokens * 6])[: args.tokens]
                ppl, _ = perplexity(m, ids)
                base = ppl if base is None else base
                print(f"| {name} | {dtype} | {q or dtype} | {ppl:.4f} | {100 * (ppl / base - 1):+.2f} % |", flush=True)
                m.close()


def inplace(args) -> None:
    from colibri.engine.sampling import SamplingParams
    from colibri.kv.cache import KVCache

    m = colibri.load(args.model or container("smollm2-q4", real_models.smollm2_gguf), ctx_length=args.tokens + 128,
                     draft_tokens=0, kv_quant=args.kv_quant)  # plain T = 1 steps: each reads the context once a layer
    ids = (m.tokenizer.encode(real_models.pydoc_text()) * 4)[:args.tokens]
    in_place = KVCache._read

    def copied(cache, i, end):
        k, v = in_place(cache, i, end)
        return k.dense(), v.dense()

    rates, tokens = {"in place": [], "copied": []}, {}
    for _ in range(args.rounds):
        for mode, read in (("in place", in_place), ("copied", copied)):
            KVCache._read = read
            req = m.engine.add_request(ids, SamplingParams(max_tokens=17, ignore_eos=True))
            while not req.token_ids:
                m.engine.step()
            t0 = time.perf_counter()
            m.engine.run([req])
            rates[mode].append((len(req.token_ids) - 1) / (time.perf_counter() - t0))
            assert tokens.setdefault(mode, req.token_ids) == req.token_ids
    KVCache._read = in_place
    print(json.dumps({"model": str(args.model), "context": args.tokens, "kv_quant": args.kv_quant,
                      **{f"decode_tok_s {k}": [round(r, 2) for r in v] for k, v in rates.items()},
                      "same_tokens": tokens["in place"] == tokens["copied"]}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["turns", "long", "ttft", "quality", "inplace"])
    p.add_argument("--model")
    p.add_argument("--memory-limit", default=None)
    p.add_argument("--kv-ram", default="32M")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--kv-quant", choices=["q8"], help="inplace: q8 KV blocks")
    a = p.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    if a.what == "turns":
        a.memory_limit = a.memory_limit or "300M"
    if a.what == "long":
        a.memory_limit, a.tokens = a.memory_limit or "256M", a.tokens or 6000
    if a.what == "quality":
        a.tokens = a.tokens or 4096
    if a.what == "inplace":
        a.tokens = a.tokens or 4000
    {"turns": turns, "long": long, "ttft": ttft, "quality": quality, "inplace": inplace}[a.what](a)


if __name__ == "__main__":
    main()

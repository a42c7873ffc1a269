"""The elastic budget over a growing conversation: pinned weight bytes, KV RAM, bytes read per decode token and
peak RSS above the runtime baseline, turn by turn, under one memory limit (a child process per run, so its peak
RSS is its own).

    python benchmarks/elastic.py --model /work/models/qwen1.5b-q4-main --memory-limit 500M --turns 4 --grow 400

Each turn appends `--grow` prompt tokens and generates `--tokens` greedily, reusing the conversation's KV (only the
new tokens are prefilled). State the disk regime with the figures (host-cached/idle or contended).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, os, sys
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import colibri
from colibri.core.metrics import peak_rss_bytes
model, limit, turns, grow, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
m = colibri.load(model, memory_limit=limit)
ids, rows = [(i * 7919) % 30000 + 100 for i in range(16)], []
for turn in range(turns):
    out = m.generate(ids, max_tokens=tokens, ignore_eos=True)
    c = m.store.counters()
    before = c["bytes_read"]
    one = m.generate(ids + out.token_ids, max_tokens=2, ignore_eos=True)  # a pure decode step's reads
    rows.append({"turn": turn, "context": len(ids) + len(out.token_ids), "pinned_bytes": c["pinned_bytes"],
                 "kv_ram_bytes": m.kv.ram_bytes(), "decode_read_bytes": m.store.counters()["bytes_read"] - before,
                 "decode_tok_s": out.stats.get("decode_tok_s"), "tokens": out.token_ids,
                 "peak_over_baseline": peak_rss_bytes() - m.baseline_rss_bytes})
    ids = ids + out.token_ids + [(i * 104729) % 30000 + 100 for i in range(turn * grow, (turn + 1) * grow)]
print(json.dumps({"limit": m.store.placement.memory_limit, "floor_pinned_bytes": m.store.placement.pinned_bytes,
                  "turns": rows}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--memory-limit", default="500M")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--grow", type=int, default=400)
    ap.add_argument("--tokens", type=int, default=8)
    a = ap.parse_args()
    p = subprocess.run([sys.executable, "-c", CHILD, a.model, a.memory_limit, str(a.turns), str(a.grow),
                        str(a.tokens)], capture_output=True, text=True)
    if p.returncode:
        sys.exit(p.stderr[-2000:])
    r = json.loads(p.stdout.strip().splitlines()[-1])
    mib = 1 << 20
    print(f"limit {r['limit'] / mib:.0f} MiB, placement floor pins {r['floor_pinned_bytes'] / mib:.1f} MiB")
    print("turn  context  pinned MiB  KV MiB  decode step read MiB (2 tokens)  peak-baseline MiB")
    for t in r["turns"]:
        print(f"{t['turn']:>4}  {t['context']:>7}  {t['pinned_bytes'] / mib:>10.1f}  {t['kv_ram_bytes'] / mib:>6.1f}"
              f"  {t['decode_read_bytes'] / mib:>33.1f}  {t['peak_over_baseline'] / mib:>17.1f}")


if __name__ == "__main__":
    main()

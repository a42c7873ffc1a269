"""Speculative decoding (n-gram drafts) on and off: tokens per forward pass and decode tok/s on three tasks.

    python benchmarks/spec.py --model DIR [--cgroup-limit 800M] [--memory-limit 500M] [--tokens 96] [--threads 2]
    python benchmarks/spec.py --model smollm2 --cgroup-limit none --memory-limit none
    python benchmarks/spec.py --model DIR --tasks c_prose --repeat 2      # off, on, off, on
    python benchmarks/spec.py --model SYNTH_MOE --lookahead --memory-limit 1500M --cgroup-limit 2G --tokens 16

Tasks (chat template applied, greedy): (a) repeat a function from the prompt with a variable renamed, (b) extract
fields of a JSON document in the prompt into JSON, (c) free prose. Each runs with `draft_tokens=0` (off) and the
default adaptive drafter (on), in one child process (one load; a fresh drafter per run, so nothing is learned
from the other runs), inside a fresh memory cgroup (benchmarks/limited.py) capping the whole process when
`--cgroup-limit` is given; the page cache is dropped before the child starts. Tokens must match on/off: the
script fails otherwise. `--model smollm2` is the embedded default model. Printed per task: tokens per pass, decode
tok/s, weight bytes read per token and the read GB/s (which says whether the host served reads from its cache).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from limited import MemCG, own_memcg, parse_size, run_child  # noqa: E402

CODE = '''def summarize_orders(orders, tax_rate, currency="EUR"):
    """Total, average and largest order of a list of orders, tax included."""
    if not orders:
        return {"total": 0.0, "average": 0.0, "largest": None, "currency": currency}
    total = 0.0
    largest = None
    for order in orders:
        amount = sum(item["price"] * item["quantity"] for item in order["items"])
        if order.get("discount"):
            amount -= amount * order["discount"]
        amount *= 1 + tax_rate
        total += amount
        if largest is None or amount > largest["amount"]:
            largest = {"id": order["id"], "amount": amount}
    return {"total": round(total, 2), "average": round(total / len(orders), 2),
            "largest": largest, "currency": currency}
'''

DOC = {"id": "INV-2024-0193", "issued": "2024-03-18", "status": "paid",
       "customer": {"name": "Margarethe Okonkwo-Lindqvist", "email": "m.okonkwo@northwind-logistics.example",
                    "phone": "+46 31 770 42 19",
                    "address": {"street": "Skeppsbron 14", "city": "Gothenburg", "postcode": "411 21",
                                "country": "Sweden"}},
       "items": [{"sku": "NW-CHAIR-ERG-02", "description": "Ergonomic office chair, graphite", "quantity": 12,
                  "unit_price": 289.5},
                 {"sku": "NW-DESK-ADJ-160", "description": "Height-adjustable desk, 160 x 80 cm", "quantity": 6,
                  "unit_price": 649.0},
                 {"sku": "NW-LAMP-LED-07", "description": "LED desk lamp with dimmer", "quantity": 18,
                  "unit_price": 54.9}],
       "shipping": {"carrier": "Nordic Freight AB", "tracking": "NF-88213-SE-4471", "cost": 120.0},
       "notes": "Deliver to the loading dock at the rear of the building between 08:00 and 11:00."}

TASKS = {
    "a_code_rename": "Rewrite this Python function with the parameter `orders` renamed to `purchases` everywhere. "
                     "Output only the complete code.\n\n```python\n" + CODE + "```",
    "b_json_extract": "From this invoice, output a JSON object with the fields customer_name, customer_email, "
                      "customer_phone, street, city, postcode, country, carrier and tracking, copying the values "
                      "exactly. Output only the JSON.\n\n" + json.dumps(DOC, indent=2),
    "c_prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def lookahead_child(a: argparse.Namespace) -> None:
    """MoE router lookahead on and off (alternating loads), greedy decode from fixed token ids (a synthetic
    container has no tokenizer): decode tok/s, recall per layer, expert hit rate, bytes read per token."""
    import colibri
    ids = list(range(1000, 1000 + 16))
    runs, tokens = {}, {}
    if (Path(a.model) / "usage.json").exists():
        raise SystemExit(f"{a.model}/usage.json exists: its learned pins would make the runs warm; move it away")
    for look in [True, False] * a.repeat:
        m = colibri.load(a.model, memory_limit=parse_size(a.memory_limit), threads=a.threads, lookahead=look,
                         draft_tokens=0)
        m.store.usage.path = None  # each run starts cold, and the container is left as it was (no usage.json)
        r = m.generate(ids, max_tokens=a.tokens, ignore_eos=True)
        s, c = r.stats, m.engine.counters()
        key = "on" if look else "off"
        tokens.setdefault(key, r.token_ids)
        old = runs.setdefault(key, {"runs": 0, "decode_s": 0.0})
        old["runs"] += 1
        old["decode_s"] += s["decode_s"]
        old["decode_tokens_per_s"] = round(old["runs"] * (len(r.token_ids) - 1) / old["decode_s"], 3)
        old.update({k: s[k] for k in ("weight_bytes_per_token", "read_gb_per_s", "expert_hit_rate",
                                      "expert_resident_rate", "lookahead_recall", "io_wait_s")})
        old.update({k: c.get(k, 0) for k in ("lookahead_reads", "lookahead_useful_reads", "lookahead_wasted_bytes",
                                             "lookahead_slots")})
        old["decode_weight_gb_per_token"] = round(c["weight_bytes_per_token"] / 1e9, 3)
        old["recall_by_layer"] = m.store.counters()["lookahead_recall_by_layer"]
        old["placement"] = {k: v for k, v in m.store.placement.as_dict().items() if k in
                            ("pinned_bytes", "streamed_bytes", "expert_cache_slots", "staging_bytes")}
        m.close()
    print(json.dumps({"task": "moe_lookahead", "tokens_identical": tokens["on"] == tokens["off"], **runs}),
          flush=True)


def pins(m) -> tuple[int, int]:
    c = m.store.counters()
    return c.get("elastic_pins", 0), c.get("elastic_unpins", 0)


def child(a: argparse.Namespace) -> None:
    from colibri.cli import quiet_openmp
    quiet_openmp(argparse.Namespace(command="run", model=None if a.model == "smollm2" else a.model,
                                    memory_limit=a.memory_limit))
    import colibri
    from colibri.engine.speculate import Speculator

    model = None if a.model == "smollm2" else a.model
    if model is None:
        from colibri.convert.pipeline import default_container
        model = default_container()
    m = colibri.load(model, memory_limit=parse_size(a.memory_limit), threads=a.threads)
    for task in a.tasks.split(","):
        ids = m.chat_ids([{"role": "user", "content": TASKS[task]}])
        runs = {}
        for mode, draft in [("off", 0), ("on", None)] * a.repeat:  # alternating: a drifting machine hits both
            m.engine.spec = Speculator(draft, m.config.ngram, m.config.ngram_cache_size)
            pins0 = pins(m)
            r = m.generate(ids, max_tokens=a.tokens, ignore_eos=True)
            s = r.stats
            churn = [b - a for a, b in zip(pins0, pins(m))]  # elastic pins and unpins during the run
            if mode in runs:  # a repeat: decode tok/s over all runs of the mode (total tokens / total time)
                old = runs[mode]
                n = len(r.token_ids) - 1
                old["decode_s"] += s["decode_s"]
                old["runs"] += 1
                old["decode_tokens_per_s"] = round(old["runs"] * n / old["decode_s"], 3)
                old["elastic_pins_unpins"] = [x + y for x, y in zip(old["elastic_pins_unpins"], churn)]
                continue
            runs[mode] = {"runs": 1, "decode_tokens_per_s": s["decode_tokens_per_s"], "tokens_per_pass": s["tokens_per_pass"],
                          "draft_tokens": s["draft_tokens"], "accepted_tokens": s["accepted_tokens"],
                          "weight_bytes_per_token": s["weight_bytes_per_token"], "read_gb_per_s": s["read_gb_per_s"],
                          "decode_s": s["decode_s"], "token_ids": r.token_ids, "elastic_pins_unpins": churn,
                          "cut_for_memory": m.engine.spec.cut,
                          "gate": {k: v for k, v in m.engine.spec.counters().items() if k.startswith("decode_pass")}}
        same = runs["on"]["token_ids"] == runs["off"]["token_ids"]
        for v in runs.values():
            v.pop("token_ids")
        print(json.dumps({"task": task, "prompt_tokens": len(ids), "tokens_identical": same, **runs,
                          "text": r.text[:160]}), flush=True)
    m.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a container directory, or 'smollm2' (the default model)")
    ap.add_argument("--cgroup-limit", default="800M")
    ap.add_argument("--memory-limit", default="500M")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each mode, alternating off/on (default 1)")
    ap.add_argument("--lookahead", action="store_true",
                    help="MoE: router lookahead on/off instead of speculation (e.g. a benchmarks/synth.py container)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        (lookahead_child if a.lookahead else child)(a)
        return 0
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", a.model, "--memory-limit",
           str(a.memory_limit), "--tokens", str(a.tokens), "--threads", str(a.threads), "--tasks", a.tasks,
           "--repeat", str(a.repeat)] + (["--lookahead"] if a.lookahead else [])
    limit = parse_size(a.cgroup_limit)
    cg = None
    if limit is not None:
        if os.geteuid() != 0:
            print("--cgroup-limit needs root and the cgroup-v1 memory controller", file=sys.stderr)
            return 2
        cg = MemCG(own_memcg(), f"colibri-spec-{os.getpid()}", limit)
    try:
        rows, rc = run_child(cmd, cg)
        for r in rows:
            on, off = r["on"], r["off"]
            if r["task"] == "moe_lookahead":
                print(f"lookahead decode {off['decode_tokens_per_s']:.2f} -> {on['decode_tokens_per_s']:.2f} tok/s |"
                      f" recall {on['lookahead_recall']:.3f} by layer {on['recall_by_layer']} | expert hit rate "
                      f"{off['expert_hit_rate']:.3f} -> {on['expert_hit_rate']:.3f} | early reads {on['lookahead_reads']} "
                      f"({on['lookahead_useful_reads']} used) | GB read per token {off['decode_weight_gb_per_token']} -> "
                      f"{on['decode_weight_gb_per_token']} | identical {r['tokens_identical']}")
                print(json.dumps(r))
                continue
            speed = on["decode_tokens_per_s"] / off["decode_tokens_per_s"] if off["decode_tokens_per_s"] else 0
            print(f"{r['task']:<15} tokens/pass {off['tokens_per_pass']:.2f} -> {on['tokens_per_pass']:.2f} | "
                  f"decode {off['decode_tokens_per_s']:.2f} -> {on['decode_tokens_per_s']:.2f} tok/s ({speed:.2f}x) | "
                  f"accepted {on['accepted_tokens']}/{on['draft_tokens']} | weight MB/token "
                  f"{off['weight_bytes_per_token'] / 1e6:.0f} -> {on['weight_bytes_per_token'] / 1e6:.0f} | read GB/s "
                  f"{off['read_gb_per_s']:.2f} / {on['read_gb_per_s']:.2f} | identical {r['tokens_identical']}")
            print(json.dumps(r))
        if cg is not None:
            print(f"cgroup max usage {int(cg.read('memory.max_usage_in_bytes')) / 2**20:.0f} MiB, failcnt "
                  f"{cg.read('memory.failcnt').strip()}")
        return 0 if rc == 0 and rows and all(r["tokens_identical"] for r in rows) else 1
    finally:
        if cg is not None:
            cg.remove()


if __name__ == "__main__":
    sys.exit(main())

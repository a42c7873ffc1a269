"""Expert sharding over N nodes, simulated from one node's measured figures (docs/scale.md).

    python benchmarks/scale_sim.py [--nodes 1,2,4,8,16] [--tokens 256] [--gbit 10] [--rtt-ms 0.1]

A Mixtral-8x7B-shape model (32 layers, 8 experts top-2, q4 experts of 117 MB, hidden 4096) decodes one step at a
time on node 0, which holds the dense part (attention, norms, routers: 0.9 GB, pinned) and runs it; expert e of
layer l lives on node (e + l) mod N, on that node's disk only. Per layer, node 0 sends each token's hidden state
(bf16) to the nodes holding its routed experts and gets their outputs back; a node reads the routed experts it
does not have in RAM from its own disk, one after another, and computes them. Each node has the same RAM for
its expert cache (LRU) as the single node measured. The layer's time is the dense compute, plus the slowest
node's reads and expert compute, plus one network round trip and the bytes at the link's rate when a remote node
takes part; steps add up layer by layer (a layer's experts are known only once its router has run, so nothing
overlaps across layers). Routing is uniform at random, as in the measured synthetic model (the worst case: a
trained model's routing is skewed and caches better). One sequence (B = 1): the measured compute of a batched
step is not per token (16 tokens cost 4.4x one, not 16x), and no split of it between experts and the dense part
was measured, so the simulation does not extrapolate batches.

Measured inputs (docs/performance.md, "The Mixtral-8x7B shape at 4G", idle): B = 1 steps of 3,799 ms = 3,017 ms
read wait + 783 ms compute, 7,529 MB read per step (2.50 GB/s effective); 19 expert cache slots at
--memory-limit 4G; an expert's FFN 8 ms per token (its --verbose timeline), so the dense part is 783 - 64 x 8 =
271 ms per token. The simulation at N = 1 is checked against the measured 0.26 tok/s.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import OrderedDict

LAYERS, EXPERTS, TOP_K, HIDDEN = 32, 8, 2, 4096
EXPERT_MB, DISK_GBS, SLOTS = 117.0, 2.50, 19
EXPERT_MS, DENSE_MS = 8.0, 271.0  # per token: one expert's FFN; the dense part of all layers together


def simulate(nodes: int, tokens: int, gbit: float, rtt_ms: float, seed: int = 0) -> dict:
    rng = random.Random(seed)
    caches = [OrderedDict() for _ in range(nodes)]
    total_ms, net_bytes, read_mb = 0.0, 0, 0.0
    for _ in range(tokens):
        for layer in range(LAYERS):
            routed = [rng.sample(range(EXPERTS), TOP_K)]
            per_node: dict[int, dict[int, int]] = {}  # node -> expert -> tokens routed to it
            for experts in routed:
                for e in experts:
                    n = (e + layer) % nodes
                    per_node.setdefault(n, {}).setdefault(e, 0)
                    per_node[n][e] += 1
            slowest, remote_bytes = 0.0, 0
            for n, experts in per_node.items():
                ms = 0.0
                for e, count in experts.items():
                    key, cache = (layer, e), caches[n]
                    if key in cache:
                        cache.move_to_end(key)
                    else:
                        ms += EXPERT_MB / DISK_GBS  # MB / (GB/s) = ms
                        read_mb += EXPERT_MB
                        cache[key] = True
                        if len(cache) > SLOTS:
                            cache.popitem(last=False)
                    ms += EXPERT_MS * count
                slowest = max(slowest, ms)
                if n != 0:  # each token routed there: its hidden state out, the expert's output back (bf16)
                    remote_bytes += 2 * HIDDEN * 2 * sum(experts.values())
            net_ms = (rtt_ms + remote_bytes / (gbit * 1e9 / 8) * 1e3) if remote_bytes else 0.0
            total_ms += DENSE_MS / LAYERS + slowest + net_ms
            net_bytes += remote_bytes
    step_ms = total_ms / tokens
    return {"nodes": nodes, "ms_per_token": round(step_ms, 1), "tok_per_s": round(1e3 / step_ms, 3),
            "read_gb_per_token": round(read_mb / 1e3 / tokens, 2),
            "net_kib_per_token": round(net_bytes / 1024 / tokens, 1),
            "expert_gb_per_node": round(LAYERS * EXPERTS * EXPERT_MB / 1e3 / nodes, 1)}  # node 0: + 0.9 dense


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", default="1,2,4,8,16")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--gbit", type=float, default=10.0, help="link rate in Gbit/s")
    p.add_argument("--rtt-ms", type=float, default=0.1)
    a = p.parse_args()
    for n in map(int, a.nodes.split(",")):
        print(json.dumps(simulate(n, a.tokens, a.gbit, a.rtt_ms)))


if __name__ == "__main__":
    main()

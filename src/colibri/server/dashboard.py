"""The dashboard's data: one frame (a JSON object) built from what feeds /metrics — the engine thread's published
snapshot and the ServerMetrics histograms — pushed to each open dashboard over SSE a few times a second.

Nothing here touches the engine: a frame reads the snapshot the engine thread publishes after each step. While a
dashboard is connected (`Worker.watchers`), that snapshot also carries the store's picture (per-layer page tiers,
MoE expert heat), taken at most every `worker.PICTURE_EVERY_S`; with no dashboard open the engine pays nothing.

The pages themselves (static/dashboard.html, static/chat.html and their script and style) are plain files in the
package: no CDN, no build step.
"""

from __future__ import annotations

import asyncio
import json
import time
from importlib import resources
from pathlib import Path
from typing import AsyncIterator

from colibri.core.defaults import parse_size
from colibri.server.metrics import ServerMetrics

FRAME_HZ = 4.0  # frames per second sent to each dashboard
STATIC = Path(str(resources.files("colibri.server") / "static"))


def _histogram(h) -> tuple[float, float]:
    """(sum, count) of a prometheus-client Histogram."""
    total = count = 0.0
    for family in h.collect():
        for s in family.samples:
            if s.name.endswith("_sum"):
                total = s.value
            elif s.name.endswith("_count"):
                count = s.value
    return total, count


def _counter(c) -> float:
    return sum(s.value for f in c.collect() for s in f.samples if s.name.endswith("_total"))


class Frames:
    """Builds frames for one server; remembers the latest per-request rates so the figures stay up between
    requests."""

    def __init__(self, metrics: ServerMetrics, model_id: str):
        self.metrics, self.model_id = metrics, model_id
        self.last: dict[str, float | None] = {"decode_tok_s": None, "prefill_tok_s": None, "ttft_s": None}

    def settings(self) -> dict:
        w = self.metrics.worker
        c = w.config
        out = {"model": self.model_id, "state": w.state, "memory_limit_bytes": parse_size(c.memory_limit)
               if c.memory_limit else None, "max_sequences": c.max_sequences, "batch_size": c.batch_size,
               "threads": c.threads, "io_threads": c.io_threads, "kv_quant": c.kv_quant}
        if w.model is not None:
            out.update(context_length=w.model.context_length, dtype=str(w.model.dtype).removeprefix("torch."),
                       layers=w.model.args.num_layers, experts=w.model.args.num_experts or 0)
        return out

    def frame(self) -> dict:
        w = self.metrics.worker
        snap = w.snapshot
        out: dict = {"time": time.time(), "state": w.state, "model": self.model_id}
        if not snap:
            return out
        rows = snap["requests"]
        for key in ("decode_tok_s", "prefill_tok_s", "ttft_s"):  # the running requests' mean, else the latest's
            live = [r[key] for r in rows if r[key] is not None]
            last = snap["last"].get(key)
            if live or last is not None:
                self.last[key] = sum(live) / len(live) if live else last
        aggregate, gbs = w.rates()
        ttft_sum, ttft_n = _histogram(self.metrics.ttft)
        eng, store = snap["engine"], snap["store"]
        out["rates"] = {"aggregate_tok_s": aggregate, "decode_tok_s": self.last["decode_tok_s"],
                        "prefill_tok_s": self.last["prefill_tok_s"], "ttft_s": self.last["ttft_s"],
                        "ttft_mean_s": ttft_sum / ttft_n if ttft_n else None, "disk_gb_s": gbs}
        out["totals"] = {"generated_tokens": _counter(self.metrics.generated),
                         "requests": _counter(self.metrics.requests),
                         "disk_bytes_read": store.get("bytes_read", 0), "engine_steps": eng.get("engine_steps", 0)}
        out["running"] = eng.get("running_sequences", 0)
        out["queued"] = snap["queued"]
        out["requests"] = rows
        out["memory"] = self._memory(snap)
        if eng.get("spec_drafted_tokens"):
            out["speculation"] = {k: eng.get(k) for k in ("spec_drafted_tokens", "spec_accepted_tokens",
                                                          "spec_acceptance_rate", "tokens_per_pass")}
        if "expert_hit_rate" in eng and w.model.args.num_experts:
            out["experts"] = {"hit_rate": eng["expert_hit_rate"], "lookahead_recall": eng.get("lookahead_recall")}
        if snap.get("picture"):
            out["picture"] = snap["picture"]
        return out

    def _memory(self, snap: dict) -> dict:
        """The tier bar: the memory limit's parts now, and the KV bytes in the swap file (beside the limit)."""
        store, kv = snap["store"], snap["kv"]
        limit = parse_size(self.metrics.worker.config.memory_limit) if self.metrics.worker.config.memory_limit \
            else None
        parts = [("pinned weights", store.get("pinned_bytes", 0)), ("staging", store.get("staging_bytes", 0)),
                 ("expert cache", store.get("cached_bytes", 0)), ("KV in RAM", kv.get("kv_ram_bytes", 0)),
                 ("activations", store.get("reserve_bytes", 0))]
        used = sum(n for _, n in parts)
        if limit is not None:
            parts.append(("free", max(0, limit - used)))
        return {"limit_bytes": limit, "parts": [{"name": n, "bytes": b} for n, b in parts],
                "kv_swap_bytes": kv.get("kv_disk_bytes", 0)}


async def stream(frames: Frames, disconnected, hz: float = FRAME_HZ) -> AsyncIterator[str]:
    """SSE: a frame every 1/hz seconds until `disconnected()` (an awaitable factory) says the client left.
    Counts itself in the worker's watchers meanwhile (the engine thread then takes the store's picture)."""
    worker = frames.metrics.worker
    worker.watch(1)
    try:
        yield "retry: 2000\n\n"
        while True:
            yield f"data: {json.dumps(frames.frame(), separators=(',', ':'))}\n\n"
            await asyncio.sleep(1.0 / hz)
            if await disconnected():
                return
    finally:
        worker.watch(-1)

"""The prediction model behind `colibri plan`: what a decode token reads, and how long a pass takes.

* `layout`: the placement `colibri.load` would choose for a container under a memory limit (`model.plan`), and
  from it the bytes read from disk per decode token: each scope's whole-read streamed pages (a tied embedding
  staged whole is read twice: lookup and head), the head table's row blocks when it is read by rows, one lookup
  row, and for MoE models the expected expert misses under uniformly random routing.
* `bounds`: I/O bound = bandwidth / bytes per token, compute bound = 1 / compute seconds per token; their minimum
  is the speed if reads and compute overlapped fully.
* `pipeline` / `simulate`: one decode pass replayed the way the streaming store runs it: a scope waits for its
  pages, prefetch reads at most `prefetch_depth` pages past the current scope into free staging slots, head row
  blocks and routed experts are demand reads. That matters where one scope computes long against the layers
  (a large head, as qwen2.5-0.5B's; docs/performance.md, "Figures moved from source comments"): while it
  computes only the prefetched pages can be read, so reads and compute overlap far less than the minimum of
  the bounds assumes.

The bandwidth and compute seconds it takes come from the probes (perf.probes); perf.runner puts them together.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from colibri.core.config import DEFAULT_BATCH
from colibri.core.metrics import rss_bytes
from colibri.runtime.budget import Reserve
from colibri.formats.container import PageEntry, TensorEntry, read_manifest, records
from colibri.weights.io import ALIGN, DEFAULT_REQUEST_SIZE, DEMAND, PREFETCH
from colibri.models.base import ModelArgs
from colibri.weights.placement import (EmbeddingScope, LayerScope, Placement, Scope, WeightTable, block_rows,
                                       main_part, row_bytes, row_span_bytes, row_tensor)

KINDS = ("embedding", "attention", "ffn", "expert", "shared_expert", "head")
BASELINE_NOTE = ("the runtime baseline (Python, torch, tokenizer, manifest) is outside --memory-limit; the limit "
                 "bounds weights, staging buffers, the KV cache for the context and activations")
EXPERT_ASSUMPTION = ("experts: uniformly random routing; a routed expert is read unless pinned or held by the "
                     "expert cache, whose slots are shared across MoE layers in proportion to their streamed experts")
PIPELINE_MODEL = ("reads overlap compute only as far as the store's prefetch reaches (depth pages past each scope, "
                  "into free staging slots); routed experts and head row blocks are demand reads; the disk serves "
                  "2 MiB requests one at a time at the probed bandwidth (the rate probed under compute while compute "
                  "runs); compute runs at the probe's measured slowdown while the disk is busy, and after a wait of "
                  "10 ms or more first spends the probe's measured wake-up time")
WAKE_GAP_S = 0.01  # an idle gap this long lets the compute threads (and, on a VM, their vCPUs) fall asleep


# ---------------------------------------------------------------------------------------------- bytes per token


@dataclass
class Layout:
    """What `colibri.load` with some settings would keep resident and read per token (no weight read)."""
    model: Path
    args: ModelArgs
    placement: Placement
    reserve: Reserve
    pages: list[PageEntry]
    tensors: dict[str, TensorEntry]
    data_file: Path  # the largest data file (the disk probe reads it)
    per_token: dict  # token_bytes
    runtime_baseline_rss_bytes: int  # this process when the layout was made: Python, torch, manifest read
    elastic_pins: list[int] = field(default_factory=list)  # what the elastic budget pins as a decode starts

    @property
    def weights(self) -> WeightTable:
        return WeightTable(self.pages, self.tensors, self.args.num_layers, self.args.tie_word_embeddings)

    def with_elastic_pins(self) -> Layout:
        """The layout as a decode starts (`colibri run`, the server): the elastic pins resident beside the
        placement's own, until the context's KV takes their room back. (`colibri bench` holds the placement's
        own pins only, so that it measures what the plan places.)"""
        pins, p = set(self.elastic_pins), self.placement
        streamed = [i for i in p.streamed if i not in pins]
        placed = dataclasses.replace(p, pinned=p.pinned + self.elastic_pins, streamed=streamed,
                                     pinned_bytes=p.pinned_bytes + sum(self.pages[i].nbytes for i in pins),
                                     streamed_bytes=self.weights.pass_bytes(streamed))
        return dataclasses.replace(self, placement=placed, elastic_pins=[],
                                   per_token=token_bytes(placed, self.pages, self.tensors, self.args))

    @property
    def memory_limit_bytes(self) -> int | None:
        return self.placement.memory_limit

    @property
    def all_resident(self) -> bool:
        return not self.placement.streamed and not self.placement.by_rows

    def by_kind(self) -> dict[str, dict[str, int]]:
        """Page bytes per page kind: pinned, streamed, read by rows, total."""
        groups = {"pinned": self.placement.pinned, "streamed": self.placement.streamed,
                  "by_rows": self.placement.by_rows}
        rows = {k: {"total": 0, "pinned": 0, "streamed": 0, "by_rows": 0} for k in KINDS}
        for group, ids in groups.items():
            for i in ids:
                row = rows.setdefault(self.pages[i].kind, {"total": 0, "pinned": 0, "streamed": 0, "by_rows": 0})
                row[group] += self.pages[i].nbytes
                row["total"] += self.pages[i].nbytes
        return {k: v for k, v in rows.items() if v["total"]}

    def as_dict(self) -> dict:
        """The JSON report (`colibri plan --json` starts with it)."""
        a, p, res = self.args, self.placement, self.reserve
        tied = a.tie_word_embeddings
        return {
            "model": str(self.model),
            "architecture": a.model_type,
            "num_layers": a.num_layers,
            "experts": {"num_experts": a.num_experts, "top_k": a.top_k} if a.num_experts else None,
            "memory_limit_bytes": self.memory_limit_bytes,
            "all_resident": self.all_resident,
            "reserve": {**res.as_dict(), "total_bytes": res.total},
            "placement": {**p.as_dict(), "by_rows_bytes": sum(self.pages[i].nbytes for i in p.by_rows),
                          "slots": p.slots, "slot_bytes": p.slot_bytes},
            "head_table": "model.embed_tokens.weight (tied: the embedding serves as head)" if tied
                          else "lm_head.weight",
            "pages": {"total_bytes": sum(pg.nbytes for pg in self.pages), "by_kind": self.by_kind()},
            "per_token": self.per_token,
            "elastic_pins": {"pages": len(self.elastic_pins),
                             "bytes": sum(self.pages[i].nbytes for i in self.elastic_pins)},
            "data_file": str(self.data_file),
            "runtime_baseline_rss_bytes": self.runtime_baseline_rss_bytes,
            "runtime_baseline_note": BASELINE_NOTE,
        }


def layout(path: str | Path, memory_limit=None, dtype=None, prefetch_depth: int | None = None,
           ctx_length: int | None = None, batch_size: int = DEFAULT_BATCH) -> Layout:
    """What `colibri.load` with these settings would keep resident and read per token, without reading a weight."""
    from colibri.runtime.model import plan_decode

    path = Path(path)
    placement, res, args, pins = plan_decode(path, memory_limit, dtype=dtype, prefetch_depth=prefetch_depth,
                                             ctx_length=ctx_length, batch_size=batch_size)
    manifest = read_manifest(path)
    tensors, pages = records(manifest)
    largest = max(manifest["files"], key=lambda f: f["size"])  # one file below 1 TiB; the probe reads the largest
    return Layout(path, args, placement, res, pages, tensors, path / largest["name"],
                  token_bytes(placement, pages, tensors, args), rss_bytes(), pins)


def head_blocks(t: TensorEntry) -> list[tuple[int, int]]:
    """(bytes read, rows) of each row block of a head table streamed by rows (streaming.rows.RowTables.stream:
    each block from the 4096-aligned start of its first row to the end of its last)."""
    base = t.offset + t.parts[main_part(t)].offset
    rb, n, step = row_bytes(t), t.shape[0], block_rows(t)
    return [(base + min(n, r + step) * rb - (base + r * rb) // ALIGN * ALIGN, min(n, r + step) - r)
            for r in range(0, n, step)]


def token_bytes(placement: Placement, pages: list[PageEntry], tensors: dict[str, TensorEntry], args: ModelArgs) -> dict:
    """Bytes read from disk by one decode step (one token): each scope that uses a whole-read streamed page reads
    it (a tied embedding staged whole serves two: the lookup and the head), the head table's row blocks, one
    lookup row, and the expected expert misses."""
    head_name = "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"
    head = lookup = 0
    weights = WeightTable(pages, tensors, args.num_layers, args.tie_word_embeddings)
    streamed = weights.pass_bytes(i for i in placement.streamed if pages[i].kind != "expert")
    for i in placement.by_rows:
        table = row_tensor(pages[i], tensors)
        if table == head_name:
            head = sum(b for b, _ in head_blocks(tensors[table]))
        if pages[i].kind == "embedding":
            lookup = row_span_bytes(tensors[table])  # one token's row: at most this aligned span
    experts = expert_bytes(placement, pages, args)
    return {"streamed_bytes": streamed, "head_row_bytes": head, "lookup_row_bytes": lookup,
            "expert_bytes": experts["expected_bytes"], "experts": experts if args.num_experts else None,
            "total_bytes": streamed + head + lookup + experts["expected_bytes"]}


def expert_bytes(placement: Placement, pages: list[PageEntry], args: ModelArgs) -> dict:
    """Expected expert bytes read per token: per MoE layer, top_k x an expert's bytes x the miss probability
    (streamed experts not held by the layer's share of the expert cache, over num_experts)."""
    per_layer: dict[int, dict[int, int]] = {}  # layer -> expert -> bytes of its streamed pages
    for i in placement.streamed:
        p = pages[i]
        if p.kind == "expert":
            per_layer.setdefault(p.layer, {}).setdefault(p.expert, 0)
            per_layer[p.layer][p.expert] += p.nbytes
    streamed_total = sum(len(e) for e in per_layer.values())
    layers = []
    expected = 0.0
    for layer in sorted(per_layer):
        experts = per_layer[layer]
        n = len(experts)
        cache = placement.cache_slots * n / streamed_total
        miss = max(0.0, n - cache) / args.num_experts
        mean = sum(experts.values()) / n
        expected += args.top_k * miss * mean
        layers.append({"layer": layer, "streamed_experts": n, "pinned_experts": args.num_experts - n,
                       "cache_slots": round(cache, 3), "miss_probability": round(miss, 6),
                       "expert_bytes": round(mean), "expected_bytes": round(args.top_k * miss * mean)})
    return {"expected_bytes": round(expected), "layers": layers, "assumption": EXPERT_ASSUMPTION}


# ---------------------------------------------------------------------------------------------- one decode pass


@dataclass
class PassStep:
    """One step of a decode pass as the pipeline model sees it (see `pipeline`): a store scope (its pages) or a
    step outside any (the lookup's row, sampling)."""
    pages: list[int]  # indices into the prefetch order of the whole-read streamed pages it holds
    after: int | None  # prefetch continues from this index of the order (None: not a store scope, no prefetch)
    compute_s: float = 0.0  # compute once its pages are in (MoE: attention and router, before routed experts)
    expert_bytes: float = 0.0  # expected routed-expert bytes read on demand after `compute_s`
    rest_s: float = 0.0  # compute after the experts are in (MoE: the expert FFNs)
    blocks: list[tuple[int, float]] = field(default_factory=list)  # head row blocks: (bytes, compute s), 2 buffers
    demand_bytes: int = 0  # a demand read before anything else (the embedding lookup's row)


class _Disk:
    """The data file's queue: requests of `request` bytes served one at a time at `bandwidth` bytes/s, or at
    `busy_bandwidth` while compute runs (the windows `compute` records); when the disk is free it takes the
    first-priority request already submitted (demand before prefetch, then in order)."""

    def __init__(self, bandwidth: float, request: int, busy_bandwidth: float | None = None):
        self.bw, self.request = bandwidth, request
        # under compute the disk serves no faster than alone (docs/performance.md, "Disk"); a busy probe above the
        # idle one is the host cache's noise, and taken as it is it let the model beat its own I/O bound
        self.busy_bw = min(busy_bandwidth, bandwidth) if busy_bandwidth else bandwidth
        self.clock = 0.0
        self.queue: list[tuple[int, int, float, float, list]] = []  # priority, seq, submitted, bytes, read
        self.seq = 0
        self.windows: list[tuple[float, float]] = []  # compute intervals, in time order
        self._w = 0  # the first window that may still matter (the clock only moves forward)

    def _end(self, t: float, nbytes: float) -> float:
        """When `nbytes` started at `t` are read: at the busy rate inside compute windows, else the idle rate."""
        while True:
            while self._w < len(self.windows) and self.windows[self._w][1] <= t:
                self._w += 1
            if self._w == len(self.windows):
                return t + nbytes / self.bw
            a, b = self.windows[self._w]
            if t < a:
                if nbytes <= (a - t) * self.bw:
                    return t + nbytes / self.bw
                nbytes -= (a - t) * self.bw
                t = a
            if nbytes <= (b - t) * self.busy_bw:
                return t + nbytes / self.busy_bw
            nbytes -= (b - t) * self.busy_bw
            t = b

    def _serve_one(self) -> None:
        self.clock = max(self.clock, min(q[2] for q in self.queue))
        q = min(q for q in self.queue if q[2] <= self.clock)
        self.queue.remove(q)
        self.clock = self._end(self.clock, q[3])
        q[4][0] -= 1
        q[4][1] = max(q[4][1], self.clock)

    def _advance(self, now: float) -> None:
        while self.queue and max(self.clock, min(q[2] for q in self.queue)) < now:
            self._serve_one()  # requests the disk starts before `now` are not overtaken by later ones

    def compute(self, now: float, c: float, slowdown: float) -> float:
        """`c` seconds of compute starting at `now`, `slowdown` times slower while the disk reads what is already
        submitted (at the busy rate); returns when it ends and records the window."""
        if c <= 0:
            return now
        self._advance(now)
        busy = max(self.clock - now, 0.0) + sum(q[3] for q in self.queue) / self.busy_bw
        end = now + (c * slowdown if c * slowdown <= busy else busy + c - busy / slowdown)
        self.windows.append((now, end))
        return end

    def submit(self, nbytes: float, now: float, priority: int) -> list:
        """Queue a read at time `now`; returns its handle [requests left, completion time]."""
        self._advance(now)
        read = [0, now]
        for off in range(0, max(1, math.ceil(nbytes)), self.request):
            self.queue.append((priority, self.seq, now, min(self.request, nbytes - off), read))
            self.seq += 1
            read[0] += 1
        return read

    def wait(self, read: list) -> float:
        while read[0]:
            self._serve_one()
        return read[1]


def pipeline(scopes: list[PassStep], sizes: list[int], bandwidth: float | None, slots: int, depth: int,
             request: int = DEFAULT_REQUEST_SIZE, passes: int = 4, slowdown: float = 1.0,
             busy_bandwidth: float | None = None, wake_s: float = 0.0, wake_gap_s: float = WAKE_GAP_S) -> dict:
    """Seconds per decode pass when reads and compute overlap as the streaming store lets them: a scope waits
    for all its pages, then starts reading up to `depth` pages past its end into free staging slots, computes,
    releases its pages and reads ahead again; routed experts and head row blocks are demand reads issued when
    the math reaches them. The disk serves one request at a time at the probed bandwidth (`busy_bandwidth`
    while compute runs: reads slow down under a matmul; docs/performance.md, "Disk"), and compute runs
    `slowdown` times slower while the disk is busy (both measured by the compute probe); compute that follows a
    wait of `wake_gap_s` or more first spends `wake_s` waking up. Returns the last of `passes` cyclic passes
    (the steady state) and the time it waited for reads."""
    if not bandwidth:
        t = sum(s.compute_s + s.rest_s + sum(c for _, c in s.blocks) for s in scopes)
        return {"s_per_token": t, "io_wait_s": 0.0}
    disk = _Disk(bandwidth, request, busy_bandwidth)
    held: dict[int, list] = {}  # order index -> its read (in flight or done), one staging slot each
    now = wait = 0.0
    n = len(sizes)
    idle = 0.0  # waited since the last compute

    def ready(read) -> None:
        nonlocal now, wait, idle
        t = disk.wait(read)
        if t > now:
            wait += t - now
            idle += t - now
            now = t

    def compute(c: float) -> None:
        nonlocal now, idle
        if c > 0:
            if idle >= wake_gap_s:
                c += wake_s
            idle = 0.0
        now = disk.compute(now, c, slowdown)

    def prefetch(after: int | None) -> None:
        if after is None:
            return
        for j in range(min(depth, n)):
            k = (after + j) % n
            if k not in held:
                if len(held) >= slots:
                    return
                held[k] = disk.submit(sizes[k], now, PREFETCH)

    marks = []
    for _ in range(passes):
        marks.append((now, wait))
        for s in scopes:
            if s.demand_bytes:
                ready(disk.submit(s.demand_bytes, now, DEMAND))
            for k in s.pages:
                if k not in held:
                    held[k] = disk.submit(sizes[k], now, DEMAND)
            for k in s.pages:
                ready(held[k])
            prefetch(s.after)
            compute(s.compute_s)
            if s.expert_bytes:
                ready(disk.submit(s.expert_bytes, now, DEMAND))
            compute(s.rest_s)
            blocks = [disk.submit(b, now, DEMAND) for b, _ in s.blocks[:2]]
            for i, (_, c) in enumerate(s.blocks):
                ready(blocks[i])
                compute(c)
                if i + 2 < len(s.blocks):
                    blocks.append(disk.submit(s.blocks[i + 2][0], now, DEMAND))
            for k in s.pages:
                del held[k]
            prefetch(s.after)
    t0, w0 = marks[-1]
    return {"s_per_token": now - t0, "io_wait_s": wait - w0}


def bounds(bytes_per_token: float, bytes_per_s: float | None, compute_s: float) -> dict:
    """I/O bound, compute bound and their minimum (the speed if reads and compute overlapped fully), in tok/s;
    None: no bound (nothing read per token)."""
    io = bytes_per_s / bytes_per_token if bytes_per_token and bytes_per_s else None
    cpu = 1.0 / compute_s if compute_s > 0 else None
    both = [b for b in (io, cpu) if b is not None]
    best = min(both) if both else None
    return {"io_bound_tokens_per_s": io, "compute_bound_tokens_per_s": cpu, "bound_tokens_per_s": best,
            "bound": None if best is None else "io" if best == io else "compute"}


def pass_scopes(lay: Layout, compute: dict) -> tuple[list[PassStep], list[int]]:
    """A decode pass as the streaming store runs it: (scopes in order, sizes of the prefetch order's pages);
    `compute`: the compute probe's report."""
    placement, pages, tensors, args = lay.placement, lay.pages, lay.tensors, lay.args
    num_layers, weights = args.num_layers, lay.weights
    order = sorted(i for i in placement.streamed if pages[i].kind != "expert")
    index = {pid: k for k, pid in enumerate(order)}
    end: dict[Scope, int] = {}
    members: dict[Scope, list[int]] = {}
    for p in pages:
        for key in weights.scopes(p.id):
            end[key] = max(end.get(key, -1), p.id)
            if p.id in index:
                members.setdefault(key, []).append(index[p.id])

    def scope(key: Scope, **kw) -> PassStep:
        return PassStep(members.get(key, []), bisect.bisect_right(order, end.get(key, -1)), **kw)

    per_token, by_rows = lay.per_token, set(placement.by_rows)
    scopes = []
    embedding = next(p for p in pages if p.kind == "embedding")
    if embedding.id in index:  # staged whole for the lookup
        scopes.append(scope(EmbeddingScope()))
    elif embedding.id in by_rows:
        scopes.append(PassStep([], None, demand_bytes=per_token["lookup_row_bytes"]))
    experts = {x["layer"]: x["expected_bytes"] for x in (per_token["experts"] or {}).get("layers", [])}
    group = {i: c for c in compute["layers"].values() for i in c["indices"]}  # layer -> its group's times
    for i in range(num_layers):
        c = group[i]
        if args.moe_layers[i]:
            scopes.append(scope(LayerScope(i), compute_s=c["attention_s"], expert_bytes=experts.get(i, 0),
                                rest_s=c["s"] - c["attention_s"]))
        else:
            scopes.append(scope(LayerScope(i), compute_s=c["s"]))
    head_name = "model.embed_tokens.weight" if weights.tied else "lm_head.weight"
    head_page = tensors[head_name].page
    if head_page in by_rows:
        rows = tensors[head_name].shape[0]
        blocks = [(b, compute["head_s"] * r / rows) for b, r in head_blocks(tensors[head_name])]
        scopes.append(scope(LayerScope(num_layers), blocks=blocks))
    else:
        scopes.append(scope(LayerScope(num_layers), compute_s=compute["head_s"]))
    scopes.append(PassStep([], None, compute_s=compute["sample_s"]))  # after the head's scope closes
    return scopes, [pages[i].nbytes for i in order]


def simulate(lay: Layout, compute: dict, bandwidth: float | None, busy_bandwidth: float | None = None) -> dict:
    """The pipeline model of a layout with the compute probe's report `compute`, at `bandwidth` bytes/s
    (`busy_bandwidth` while compute runs; None: the same)."""
    scopes, sizes = pass_scopes(lay, compute)
    p = lay.placement
    c = compute
    return pipeline(scopes, sizes, bandwidth, p.slots - p.cache_slots, p.prefetch_depth, slowdown=c["slowdown"],
                    busy_bandwidth=busy_bandwidth, wake_s=c.get("wake_s", 0.0),
                    wake_gap_s=c.get("wake_gap_s", WAKE_GAP_S))


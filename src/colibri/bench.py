"""Decode speed predicted without loading (`colibri plan`) and measured from a cold start (`colibri bench`).

The prediction is built from numbers the output shows:

* bytes read from disk per decode token, from the placement `colibri.load` would choose (`model.plan`): each
  scope's whole-read streamed pages (a tied embedding staged whole is read twice: lookup and head), the head
  table's row blocks when it is read by rows, one lookup row, and for MoE models the expected expert misses
  under uniformly random routing;
* the disk's read bandwidth, from a short O_DIRECT probe of the model's own data file (io.probe_bandwidth, the
  run's io thread count), in slices whose spread the output shows;
* seconds of compute per token, from a kernel probe: one layer per layer shape, built with the container's storage
  kinds and shapes (random bytes: kernel speed does not depend on the values) in enough copies that the weights
  come from DRAM, run through the family's own block math for single-token passes at torch's current thread
  count, scaled by the number of layers, plus the head's matmul (timed on a slice of its rows) and greedy
  sampling; timed again while the disk probe reads, which gives how much slower compute runs during reads.

I/O bound = bandwidth / bytes per token and compute bound = 1 / compute seconds; their minimum is the speed if
reads and compute overlapped fully. The prediction (`pipeline`) replays one decode pass the way the streaming
store runs it: a scope waits for its pages, prefetch reads at most `prefetch_depth` pages past the current scope
into free staging slots, head row blocks and routed experts are demand reads. On qwen2.5-0.5B q4 that matters:
the head computes for ~20 ms while only the prefetched pages can be read, so reads and compute overlap far less
than the minimum of the bounds assumes. `bench` measures the same quantities in one run and reports the error.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from colibri import budget, quant
from colibri.container import DTYPES, read_manifest
from colibri.errors import InputError
from colibri.io import ALIGN, DEFAULT_REQUEST_SIZE, DEMAND, PREFETCH, probe_bandwidth, thp_mode
from colibri.kv import KVCache
from colibri.metrics import GenerationMetrics
from colibri.models.base import Batch, rms_norm, rope_cos_sin
from colibri.ops import linear
from colibri.store import RamStore
from colibri.placement import block_rows, fmt_bytes, main_part, row_bytes, row_span_bytes, row_tensor, scopes_of

KINDS = ("embedding", "attention", "ffn", "expert", "shared_expert", "head")
PROBE_PASSES = 20  # single-token passes timed per layer shape
PROBE_SECONDS = 0.6  # at most this long per layer shape (at least 5 passes)
HEAD_PROBE_BYTES = 64 << 20  # the head's matmul is timed on at most this many bytes of its rows, then scaled
COLD_BYTES = 64 << 20  # layer copies the probe cycles through: twice a large L3, so weights come from DRAM
BASELINE_NOTE = ("the runtime baseline (Python, torch, tokenizer, manifest) is outside --memory-limit; the limit "
                 "bounds weights, staging buffers, the KV cache for the context and activations")
EXPERT_ASSUMPTION = ("experts: uniformly random routing; a routed expert is read unless pinned or held by the "
                     "expert cache, whose slots are shared across MoE layers in proportion to their streamed experts")
PIPELINE_SHORT = "reads overlap compute only as far as the store's prefetch reaches"
PIPELINE_MODEL = ("reads overlap compute only as far as the store's prefetch reaches (depth pages past each scope, "
                  "into free staging slots); routed experts and head row blocks are demand reads; the disk serves "
                  "2 MiB requests one at a time at the probed bandwidth (the rate probed under compute while compute "
                  "runs); compute runs at the probe's measured slowdown while the disk is busy, and after a wait of "
                  "10 ms or more first spends the probe's measured wake-up time")


# ---------------------------------------------------------------------------------------------- placement


def is_container(path: Path) -> bool:
    return path.is_dir() and (path / "manifest.json").is_file()


def layout(path: str | Path, memory_limit=None, dtype=None, prefetch_depth: int | None = None,
           ctx_length: int | None = None, batch_size: int = budget.DEFAULT_BATCH) -> dict:
    """What `colibri.load` with these settings would keep resident and read per token, without reading a weight."""
    from colibri.model import plan

    path = Path(path)
    placement, res, args = plan(path, memory_limit, dtype=dtype, prefetch_depth=prefetch_depth,
                                ctx_length=ctx_length, batch_size=batch_size)
    manifest = read_manifest(path)
    pages, tensors = manifest["pages"], {t["name"]: t for t in manifest["tensors"]}
    tied = args.tie_word_embeddings
    groups = {"pinned": placement.pinned, "streamed": placement.streamed, "by_rows": placement.by_rows}
    by_kind = {k: {"total": 0, "pinned": 0, "streamed": 0, "by_rows": 0} for k in KINDS}
    for group, ids in groups.items():
        for i in ids:
            row = by_kind.setdefault(pages[i]["kind"], {"total": 0, "pinned": 0, "streamed": 0, "by_rows": 0})
            row[group] += pages[i]["nbytes"]
            row["total"] += pages[i]["nbytes"]
    by_kind = {k: v for k, v in by_kind.items() if v["total"]}
    files = manifest["files"]
    largest = max(files, key=lambda f: f["size"])  # one file below 1 TiB; the probe reads the largest
    return {
        "model": str(path),
        "architecture": args.model_type,
        "num_layers": args.num_layers,
        "experts": {"num_experts": args.num_experts, "top_k": args.top_k} if args.num_experts else None,
        "memory_limit_bytes": placement.budget,
        "all_resident": not placement.streamed and not placement.by_rows,
        "reserve": {**res.as_dict(), "total_bytes": res.total},
        "placement": {**placement.as_dict(), "by_rows_bytes": sum(pages[i]["nbytes"] for i in placement.by_rows),
                      "slots": placement.slots, "slot_bytes": placement.slot_bytes},
        "head_table": "model.embed_tokens.weight (tied: the embedding serves as head)" if tied else "lm_head.weight",
        "pages": {"total_bytes": sum(p["nbytes"] for p in pages), "by_kind": by_kind},
        "per_token": token_bytes(placement, pages, tensors, args),
        "data_file": str(path / largest["name"]),
        "runtime_baseline_rss_bytes": budget.rss_bytes(),  # this process: Python, torch, manifest read
        "runtime_baseline_note": BASELINE_NOTE,
        "_placement": placement, "_pages": pages, "_tensors": tensors, "_args": args,
    }


def head_blocks(t: dict) -> list[tuple[int, int]]:
    """(bytes read, rows) of each row block of a head table streamed by rows (StreamingStore._stream_blocks:
    each block from the 4096-aligned start of its first row to the end of its last)."""
    base = t["offset"] + t["parts"][main_part(t)]["offset"]
    rb, n, step = row_bytes(t), t["shape"][0], block_rows(t)
    return [(base + min(n, r + step) * rb - (base + r * rb) // ALIGN * ALIGN, min(n, r + step) - r)
            for r in range(0, n, step)]


def token_bytes(placement, pages: list[dict], tensors: dict[str, dict], args) -> dict:
    """Bytes read from disk by one decode step (one token): each scope that uses a whole-read streamed page reads
    it (a tied embedding staged whole serves two: the lookup and the head), the head table's row blocks, one
    lookup row, and the expected expert misses."""
    head_name = "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"
    streamed = head = lookup = 0
    for i in placement.streamed:
        if pages[i]["kind"] != "expert":
            streamed += pages[i]["nbytes"] * len(scopes_of(pages[i], args.num_layers, args.tie_word_embeddings))
    for i in placement.by_rows:
        table = row_tensor(pages[i], tensors)
        if table == head_name:
            head = sum(b for b, _ in head_blocks(tensors[table]))
        if pages[i]["kind"] == "embedding":
            lookup = row_span_bytes(tensors[table])  # one token's row: at most this aligned span
    experts = expert_bytes(placement, pages, args)
    return {"streamed_bytes": streamed, "head_row_bytes": head, "lookup_row_bytes": lookup,
            "expert_bytes": experts["expected_bytes"], "experts": experts if args.num_experts else None,
            "total_bytes": streamed + head + lookup + experts["expected_bytes"]}


def expert_bytes(placement, pages: list[dict], args) -> dict:
    """Expected expert bytes read per token: per MoE layer, top_k x an expert's bytes x the miss probability
    (streamed experts not held by the layer's share of the expert cache, over num_experts)."""
    per_layer: dict[int, dict[int, int]] = {}  # layer -> expert -> bytes of its streamed pages
    for i in placement.streamed:
        p = pages[i]
        if p["kind"] == "expert":
            per_layer.setdefault(p["layer"], {}).setdefault(p["expert"], 0)
            per_layer[p["layer"]][p["expert"]] += p["nbytes"]
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


# ---------------------------------------------------------------------------------------------- probes


def disk_probe(path: str | Path, io_threads: int, seconds: float, slices: int = 5,
               stop: threading.Event | None = None) -> dict:
    """O_DIRECT read bandwidth of one of the model's own data files (not a temporary file), in `slices` equal
    parts (or one part that ends when `stop` is set): their mean, and their spread."""
    rates = [probe_bandwidth(path, seconds=seconds / slices, threads=io_threads, stop=stop) for _ in range(slices)]
    return {"bytes_per_s": round(statistics.mean(rates)), "min_bytes_per_s": round(min(rates)),
            "max_bytes_per_s": round(max(rates)), "file": str(path), "io_threads": io_threads, "seconds": seconds,
            "transparent_huge_pages": thp_mode()}


def _filled(dtype: torch.dtype, shape, value: float | None = None) -> torch.Tensor:
    """A tensor whose every byte is written (never the shared zero page): float parts small and finite, integer
    parts random bytes tiled from one 1 MiB draw (kernel speed does not depend on the values)."""
    n = 1
    for s in shape:
        n *= s
    if dtype.is_floating_point:
        if value is not None:
            return torch.full(shape, value, dtype=dtype)
        base = (torch.randn(min(n, 1 << 18)) * 0.02).to(dtype)
        return base.repeat(-(-n // base.numel()))[:n].view(shape)
    info = torch.iinfo(dtype)
    base = torch.randint(info.min, info.max + 1, (min(n, 1 << 20),), dtype=dtype)
    return base.repeat(-(-n // base.numel()))[:n].view(shape)


def random_weight(entry: dict | None, shape, dtype: torch.dtype):
    """A weight of `shape` as the store would hand it to the math: a quantized object of the manifest entry's
    kind, group size and scale dtypes, or a float tensor in the compute dtype (norms: ones)."""
    kind = entry["kind"] if entry else "float"
    if kind not in ("q4", "q8"):
        return _filled(dtype, shape, 1.0 if len(shape) == 1 else None)
    scales = {n: DTYPES[p["dtype"]] for n, p in entry["parts"].items()}
    buffers = {}
    for name, (dt, pshape) in quant.buffer_layout(kind, tuple(shape), entry["group_size"]).items():
        dt = scales.get(name, dt)
        if name == "scales_zeros":
            sz = torch.zeros(pshape, dtype=dt)
            sz[..., 0] = 0.01
            buffers[name] = sz
        else:
            buffers[name] = _filled(dt, pshape, 0.002 if name == "scales" else None)
    return quant.from_buffers(kind, tuple(shape), entry["group_size"], buffers)


class _ProbeStore(RamStore):
    """One layer's weights; the experts a pass routes to are served by `top_k` built experts."""

    def __init__(self, tensors, dtype, arch, experts: list[list]):
        super().__init__(tensors, dtype)
        self.arch, self.experts, self.alias = arch, experts, {}

    def get(self, name: str):
        return self.tensors.get(name) if name in self.tensors else self.alias[name]

    def route(self, i, uses, names):
        self.alias = {n: w for j, e in enumerate(sorted(uses))
                      for n, w in zip(self.arch.expert_names(i, e), self.experts[j % len(self.experts)])}
        return super().route(i, uses, names)


def _timed(fn, passes: int = PROBE_PASSES, seconds: float = PROBE_SECONDS) -> float:
    """Median seconds of `fn()` over up to `passes` calls (at least 5, at most about `seconds`), after 2 warm-ups."""
    for _ in range(2):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < passes and (len(times) < 5 or time.perf_counter() - start < seconds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


WAKE_GAP_S = 0.01  # an idle gap this long lets the compute threads (and, on a VM, their vCPUs) fall asleep


def _woken(fn, gap: float = 2 * WAKE_GAP_S, passes: int = 5) -> float:
    """Median seconds of `fn()` right after `gap` seconds of idling."""
    times = []
    for _ in range(passes):
        time.sleep(gap)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compute_probe(path: str | Path, dtype=None, ctx_length: int | None = None, position: int = 32,
                  background: threading.Thread | None = None, stop: threading.Event | None = None) -> dict:
    """Seconds of compute per decode token (see the module docstring), at torch's current thread count.

    Each layer shape is built in enough copies to exceed the CPU caches (COLD_BYTES) and the passes cycle through
    them: in a run every layer's weights come from DRAM. With `background` (a thread reading the model's data
    file until `stop` is set), everything is timed again while it runs: `slowdown` is how much slower compute is
    while the disk streams (the reads' CPU time and memory traffic); `stop` is set when that timing ends, so the
    reads' own rate is their rate under compute."""
    from colibri.model import checkpoint_dtype, open_model, resolve_dtype
    from colibri.sampling import Sampler, SamplingParams

    ckpt, args, arch = open_model(Path(path))
    try:
        dt = resolve_dtype(dtype) or checkpoint_dtype(ckpt)
        entries = ckpt.tensors if hasattr(ckpt, "manifest") else {}
        shapes = arch.weight_shapes()
    finally:
        ckpt.close()
    weight = (lambda n, shape=None: random_weight(entries.get(n), shape or shapes[n], dt))
    stored = (lambda n: entries[n]["nbytes"] if n in entries else math.prod(shapes[n]) * dt.itemsize)
    gen = torch.Generator().manual_seed(0)
    ctx = max(position + PROBE_PASSES + 8, min(ctx_length or args.max_position_embeddings, 1 << 16))
    shapes_of: dict[bool, list[int]] = {}
    for i in range(args.num_layers):
        shapes_of.setdefault(bool(args.moe_layers[i]), []).append(i)
    timers: dict[str, tuple] = {}  # component -> (function, count per token)
    for moe, idx in shapes_of.items():
        i = idx[0]
        prefix = arch.layer_prefix(i)
        expert_names = {n for e in range(args.num_experts) for n in arch.expert_names(i, e)} if moe else set()
        names = [n for n in shapes if n.startswith(prefix) and n not in expert_names]
        nbytes = sum(map(stored, names)) + (args.top_k * sum(map(stored, arch.expert_names(i, 0))) if moe else 0)
        stores = []
        for _ in range(max(1, min(64, math.ceil(COLD_BYTES / max(1, nbytes))))):
            experts = [[weight(n) for n in arch.expert_names(i, e)] for e in range(args.top_k)] if moe else []
            stores.append(_ProbeStore({n: weight(n) for n in names}, dt, arch, experts))
        cache = KVCache(budget.kv_layout(args, dt), ctx)
        cache.update(i, *(torch.zeros(args.num_kv_heads, position, args.head_dim, dtype=dt),) * 2)
        cache.advance(position)  # decode attends to a short prompt's worth of positions
        x = (torch.randn(1, args.hidden_size, generator=gen) * 0.5).to(dt)
        turn = iter(itertools.cycle(stores))

        def step(attention_only: bool = False, i=i, prefix=prefix, cache=cache, x=x, turn=turn) -> None:
            store = next(turn)
            if cache.length + 1 >= ctx:
                cache.truncate(position)
            pos = torch.arange(cache.length, cache.length + 1)
            rope = rope_cos_sin(arch.inv_freq[args.layer_types[i]], pos, dt)
            one = Batch(torch.zeros(1, dtype=torch.long), pos, [(0, 1)], [cache], torch.zeros(1, dtype=torch.long))
            if attention_only:  # the part before a MoE layer's router (its experts are read after it)
                arch.attention(store, i, arch.norm(x, store, prefix + "input_layernorm.weight"), one, rope)
            else:
                arch.block(store, i, x, one, rope)
                cache.advance(1)

        kind = "moe" if moe else "dense"
        timers[kind] = (step, len(idx))
        timers[kind + "_attention"] = (functools.partial(step, True), 0)
    head_name = arch.lm_head_name()
    vocab, hidden = shapes[head_name]
    entry = entries.get(head_name)
    per_row = row_bytes(entry) if entry else hidden * torch.empty((), dtype=dt).element_size()
    rows = min(vocab, max(64, HEAD_PROBE_BYTES // per_row // 64 * 64))
    head, norm = weight(head_name, (rows, hidden)), weight("model.norm.weight")
    xh = (torch.randn(1, hidden, generator=gen) * 0.5).to(dt)
    timers["head"] = (lambda: linear(rms_norm(xh, norm, args.rms_norm_eps, args.gemma_norm), head).float(),
                      vocab / rows)
    logits = torch.randn(args.vocab_size, generator=gen)
    sampler = Sampler(SamplingParams(temperature=0.0))
    timers["sample"] = (lambda: sampler(logits, [1, 2, 3]), 1)

    def run() -> dict[str, float]:
        with torch.inference_mode():
            return {k: _timed(fn) for k, (fn, _) in timers.items()}

    def per_token(t: dict[str, float]) -> float:
        return sum(t[k] * n for k, (_, n) in timers.items())

    idle = run()
    # the first layer after a long wait for reads runs slower: measured 1.8 ms more for a 7B-shape layer after
    # 10 ms idle with OMP_WAIT_POLICY=PASSIVE (not after 5 ms; ~0.4 ms with the default spin after 30 ms)
    kind = "dense" if "dense" in timers else "moe"
    with torch.inference_mode():
        wake = max(0.0, _woken(timers[kind][0]) - idle[kind])
    busy = None
    if background is not None:
        background.start()
        try:
            time.sleep(0.05)  # the reader is streaming
            busy = run()
        finally:  # also when timing fails: the reader must not outlive it
            if stop is not None:
                stop.set()
            background.join()
    layers = {k: {"s": idle[k], "attention_s": min(idle[k], idle[k + "_attention"]), "layers": timers[k][1]}
              for k in ("dense", "moe") if k in timers}
    out = {"s_per_token": per_token(idle), "layers": layers, "head_s": idle["head"] * vocab / rows,
           "sample_s": idle["sample"], "threads": torch.get_num_threads(), "dtype": str(dt).removeprefix("torch."),
           "position": position, "slowdown": 1.0, "wake_s": wake, "wake_gap_s": WAKE_GAP_S}
    if busy:
        out["s_per_token_while_reading"] = per_token(busy)
        out["slowdown"] = max(1.0, per_token(busy) / per_token(idle))
    return out


# ---------------------------------------------------------------------------------------------- prediction


@dataclass
class Scope:
    """One scope of a decode pass as the pipeline model sees it (see `pipeline`)."""
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
        self.busy_bw = busy_bandwidth or bandwidth
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


def pipeline(scopes: list[Scope], sizes: list[int], bandwidth: float | None, slots: int, depth: int,
             request: int = DEFAULT_REQUEST_SIZE, passes: int = 4, slowdown: float = 1.0,
             busy_bandwidth: float | None = None, wake_s: float = 0.0, wake_gap_s: float = WAKE_GAP_S) -> dict:
    """Seconds per decode pass when reads and compute overlap as the streaming store lets them: a scope waits
    for all its pages, then starts reading up to `depth` pages past its end into free staging slots, computes,
    releases its pages and reads ahead again; routed experts and head row blocks are demand reads issued when
    the math reaches them. The disk serves one request at a time at the probed bandwidth (`busy_bandwidth`
    while compute runs: on this VM reads slow from ~10 to ~7 GB/s under a 2-thread matmul), and compute runs
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


def pass_scopes(plan: dict, compute: dict) -> tuple[list[Scope], list[int]]:
    """A decode pass as the streaming store runs it: (scopes in order, sizes of the prefetch order's pages)."""
    placement, pages, tensors, args = plan["_placement"], plan["_pages"], plan["_tensors"], plan["_args"]
    num_layers, tied = args.num_layers, args.tie_word_embeddings
    order = sorted(i for i in placement.streamed if pages[i]["kind"] != "expert")
    index = {pid: k for k, pid in enumerate(order)}
    end: dict[tuple, int] = {}
    members: dict[tuple, list[int]] = {}
    for p in pages:
        for key in scopes_of(p, num_layers, tied):
            end[key] = max(end.get(key, -1), p["id"])
            if p["id"] in index:
                members.setdefault(key, []).append(index[p["id"]])

    def scope(key: tuple, **kw) -> Scope:
        return Scope(members.get(key, []), bisect.bisect_right(order, end.get(key, -1)), **kw)

    per_token, by_rows = plan["per_token"], set(placement.by_rows)
    scopes = []
    embedding = next(p for p in pages if p["kind"] == "embedding")
    if embedding["id"] in index:  # staged whole for the lookup
        scopes.append(scope(("embedding",)))
    elif embedding["id"] in by_rows:
        scopes.append(Scope([], None, demand_bytes=per_token["lookup_row_bytes"]))
    experts = {x["layer"]: x["expected_bytes"] for x in (per_token["experts"] or {}).get("layers", [])}
    for i in range(num_layers):
        c = compute["layers"]["moe" if args.moe_layers[i] else "dense"]
        if args.moe_layers[i]:
            scopes.append(scope(("layer", i), compute_s=c["attention_s"], expert_bytes=experts.get(i, 0),
                                rest_s=c["s"] - c["attention_s"]))
        else:
            scopes.append(scope(("layer", i), compute_s=c["s"]))
    head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    head_page = tensors[head_name]["page"]
    if head_page in by_rows:
        rows = tensors[head_name]["shape"][0]
        blocks = [(b, compute["head_s"] * r / rows) for b, r in head_blocks(tensors[head_name])]
        scopes.append(scope(("layer", num_layers), blocks=blocks))
    else:
        scopes.append(scope(("layer", num_layers), compute_s=compute["head_s"]))
    scopes.append(Scope([], None, compute_s=compute["sample_s"]))  # after the head's scope closes
    return scopes, [pages[i]["nbytes"] for i in order]


def simulate(plan: dict, bandwidth: float | None, busy_bandwidth: float | None = None) -> dict:
    """The pipeline model of a plan (with its compute probe) at `bandwidth` bytes/s (`busy_bandwidth` while
    compute runs; None: the same)."""
    scopes, sizes = pass_scopes(plan, plan["compute"])
    p = plan["_placement"]
    c = plan["compute"]
    return pipeline(scopes, sizes, bandwidth, p.slots - p.cache_slots, p.prefetch_depth, slowdown=c["slowdown"],
                    busy_bandwidth=busy_bandwidth, wake_s=c.get("wake_s", 0.0),
                    wake_gap_s=c.get("wake_gap_s", WAKE_GAP_S))


def error_pct(measured: float, predicted: float | None) -> float | None:
    return round(100 * (measured / predicted - 1), 2) if predicted else None


def predict(path: str | Path, memory_limit=None, dtype=None, prefetch_depth: int | None = None, io_threads: int = 2,
            ctx_length: int | None = None, batch_size: int = budget.DEFAULT_BATCH, probe_seconds: float = 1.0,
            plan: dict | None = None) -> dict:
    """`colibri plan`: the layout (or `plan`, computed earlier), the disk and compute probes, the prediction."""
    out = dict(plan) if plan is not None else layout(path, memory_limit, dtype, prefetch_depth, ctx_length,
                                                       batch_size)
    per_token = out["per_token"]["total_bytes"]
    disk: dict = {}
    busy: dict = {}
    reads = None
    stop = threading.Event()  # ends the second probe when the timing under reads is done
    if per_token:
        # The disk alone (its rate while compute is idle), then a second probe that runs exactly while compute is
        # timed again: the slowdown of compute under reads, and the disk's rate under compute (5.7-7.9 GB/s
        # against ~10 GB/s alone on the host-cached disk); the pipeline model uses both rates.
        disk.update(disk_probe(out["data_file"], io_threads, probe_seconds))
        reads = threading.Thread(target=lambda: busy.update(disk_probe(out["data_file"], io_threads, 60.0, 1,
                                                                       stop)), daemon=True)
    out["compute"] = compute_probe(path, dtype, out["reserve"]["ctx_length"], background=reads, stop=stop)
    if busy:
        disk["while_computing_bytes_per_s"] = busy["bytes_per_s"]
    out["disk"] = disk or None
    bandwidth = disk.get("bytes_per_s")
    out.update(bounds(per_token, bandwidth, out["compute"]["s_per_token"]))
    busy_bw = disk.get("while_computing_bytes_per_s")
    sim = simulate(out, bandwidth, busy_bw)
    out["pipeline"] = {"s_per_token": sim["s_per_token"], "io_wait_s_per_token": sim["io_wait_s"],
                       "tokens_per_s": 1 / sim["s_per_token"], "model": PIPELINE_MODEL}
    if disk:  # the same model at the slowest and fastest slice of the disk probe
        out["pipeline"]["tokens_per_s_range"] = [
            1 / simulate(out, disk[k], busy_bw and busy_bw * disk[k] / bandwidth)["s_per_token"]
            for k in ("min_bytes_per_s", "max_bytes_per_s")]
    out["predicted_tokens_per_s"] = out["pipeline"]["tokens_per_s"]
    return out


def public(d: dict) -> dict:
    """The JSON-able part of a report (drops the Placement object kept for internal use)."""
    return {k: v for k, v in d.items() if not k.startswith("_")}


def _mib(n) -> str:
    return "-" if not n else fmt_bytes(int(n))


def _rate(x) -> str:
    return "unbounded" if x is None else f"{x:.2f} tok/s"


def format_plan(r: dict) -> str:
    lines = []
    p, res = r["placement"], r["reserve"]
    exp = r["experts"]
    lines.append(f"model: {r['model']} ({r['architecture']}, {r['num_layers']} layers"
                 + (f", {exp['num_experts']} experts top {exp['top_k']}" if exp else "")
                 + f", {_mib(r['pages']['total_bytes'])} of pages)")
    limit = r["memory_limit_bytes"]
    lines.append(f"memory limit: {_mib(limit) if limit else 'none (every page resident)'}; runtime baseline "
                 f"{_mib(r['runtime_baseline_rss_bytes'])} now: {BASELINE_NOTE}")
    lines.append(f"reserve: {_mib(res['kv_reserve_bytes'])} KV cache ({res['ctx_length']} tokens) + "
                 f"{_mib(res['activation_reserve_bytes'])} activations (batch {res['batch_size']}) = "
                 f"{_mib(res['total_bytes'])}")
    lines.append(f"{'pages':>16} {'pinned':>11} {'streamed':>11} {'by rows':>11} {'total':>11}")
    rows = dict(r["pages"]["by_kind"])
    rows["total"] = {c: sum(v[c] for v in r["pages"]["by_kind"].values())
                     for c in ("pinned", "streamed", "by_rows", "total")}
    for kind, v in rows.items():
        lines.append(f"{kind:>16} " + " ".join(f"{_mib(v[c]):>11}" for c in ("pinned", "streamed", "by_rows",
                                                                             "total")))
    if r["all_resident"]:
        lines.append("placement: every page resident; nothing is read from disk per token")
    else:
        cache = (f"; expert cache: {p['expert_cache_slots']} slots ({_mib(p['expert_cache_bytes'])})" if exp else "")
        lines.append(f"staging: {_mib(p['staging_bytes'])} ({p['slots']} slots of {_mib(p['slot_bytes'])}, prefetch "
                     f"depth {p['prefetch_depth']}){cache}; head table: {r['head_table']}")
    t = r["per_token"]
    lines.append(f"read per token: {_mib(t['total_bytes'])} = {_mib(t['streamed_bytes'])} streamed pages + "
                 f"{_mib(t['head_row_bytes'])} head rows + {_mib(t['lookup_row_bytes'])} lookup row"
                 + (f" + {_mib(t['expert_bytes'])} expected experts ({EXPERT_ASSUMPTION})" if exp else ""))
    d = r["disk"]
    if d:
        lines.append(f"disk: {d['bytes_per_s'] / 1e9:.2f} GB/s (O_DIRECT probe of {Path(d['file']).name}, "
                     f"{d['io_threads']} io threads, {d['seconds']:g} s; slices {d['min_bytes_per_s'] / 1e9:.2f}-"
                     f"{d['max_bytes_per_s'] / 1e9:.2f} GB/s"
                     + (f"; {d['while_computing_bytes_per_s'] / 1e9:.2f} GB/s while computing"
                        if d.get("while_computing_bytes_per_s") else "")
                     + (f"; transparent huge pages '{d['transparent_huge_pages']}': buffers in 4 KiB pages, reads may "
                        "be slower and vary" if d.get("transparent_huge_pages") == "never" else "") + ")")
    c = r["compute"]
    parts = " + ".join(f"{v['layers']} x {1e3 * v['s']:.2f} ms ({k} layer)" for k, v in c["layers"].items())
    lines.append(f"compute: {1e3 * c['s_per_token']:.1f} ms/token = {parts} + head {1e3 * c['head_s']:.2f} ms + "
                 f"sampling {1e3 * c['sample_s']:.2f} ms (torch threads {c['threads']}, {c['dtype']})"
                 + (f"; {c['slowdown']:.2f}x slower while the disk reads" if "s_per_token_while_reading" in c else ""))
    lines.append(f"bounds: I/O {_rate(r['io_bound_tokens_per_s'])}, compute {_rate(r['compute_bound_tokens_per_s'])}"
                 f": {r['bound']}-bound; full overlap would give {_rate(r['bound_tokens_per_s'])}")
    pipe = r["pipeline"]
    spread = pipe.get("tokens_per_s_range")
    lines.append(f"predicted decode: {_rate(r['predicted_tokens_per_s'])}"
                 + (f" ({spread[0]:.2f}-{spread[1]:.2f} over the disk's spread)" if spread else "")
                 + f", {1e3 * pipe['s_per_token']:.1f} ms/token with {1e3 * pipe['io_wait_s_per_token']:.1f} ms "
                 f"waiting for reads: {PIPELINE_SHORT}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- bench


def model_files(path: Path) -> list[Path]:
    """Every file of a model: a container's or HF directory's files, or the .gguf file itself."""
    return sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]


def drop_page_cache(files: list[Path]) -> int:
    """Evict these files from the page cache (flushed first: dirty pages cannot be dropped); returns how many.
    A virtio disk's host-side cache is out of reach: recently read data may still come back fast."""
    dropped = 0
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return dropped


def run_bench(path: str | Path, memory_limit=None, tokens: int = 32, prompt: str = "", dtype=None,
              threads: int | None = None, io_threads: int = 2, prefetch_depth: int | None = None,
              ctx_length: int | None = None, batch_size: int = budget.DEFAULT_BATCH,
              probe_seconds: float = 1.0) -> dict:
    """Cold-start decode benchmark: drop the model's files from the page cache, load under the limit, generate
    `tokens` tokens greedily (EOS ignored), and set the decode phase's measured speed and I/O beside the plan's
    prediction. The probes run after the model is closed, so they neither warm its pages nor count in its RSS."""
    from colibri.model import load

    path = Path(path)
    if tokens < 2:
        raise InputError(f"--tokens must be at least 2 (one prefill token, then decode steps; got {tokens})")
    if threads:
        torch.set_num_threads(int(threads))
    container = is_container(path)
    if memory_limit is not None or container:
        plan = layout(path, memory_limit, dtype, prefetch_depth, ctx_length, batch_size)  # before usage.json changes
    else:
        plan = None
    dropped = drop_page_cache(model_files(path))
    t0 = time.perf_counter()
    m = load(path, memory_limit=memory_limit, dtype=dtype, io_threads=io_threads, prefetch_depth=prefetch_depth,
             ctx_length=ctx_length, batch_size=batch_size)
    load_s = time.perf_counter() - t0
    if hasattr(m.store, "hold"):
        m.store.hold()  # measure the placement `plan` predicts (elastic pins vary with the KV cache)
    try:
        # a model without a tokenizer (test models) gets fixed token ids unless given a prompt
        ids = m.prompt_ids(prompt or (PROMPT if m.tokenizer else PROMPT_IDS))
        counters = getattr(m.store, "counters", None)
        c0 = counters() if counters else None
        c1 = metrics = None
        for chunk in m.stream(ids, max_tokens=tokens, temperature=0.0, ignore_eos=True):
            metrics = chunk.metrics
            if c1 is None and chunk.token_id is not None and counters:
                c1 = counters()  # after prefill and the first token: decode starts here
        stats = metrics.as_dict()
        c2 = counters() if counters else None
        same = plan is None or plan["_placement"].pinned == getattr(m.store, "placement", plan["_placement"]).pinned
        baseline = m.baseline_rss_bytes
    finally:
        m.close()
    steps = metrics.generated_tokens - 1
    decode = GenerationMetrics()
    if counters:
        decode.account_io(c1, c2)
    per_token = decode.disk_bytes_read / steps if steps > 0 else 0.0
    bps = decode.disk_bytes_read / decode.read_s if decode.read_s > 0 else None
    pred = predict(path, memory_limit, dtype, prefetch_depth, io_threads, ctx_length, batch_size, probe_seconds,
                   plan) if plan is not None else _ram_prediction(path, dtype, ctx_length)
    measured = bounds(per_token, bps, pred["compute"]["s_per_token"])
    tps = stats["decode_tokens_per_s"]
    best = measured["bound_tokens_per_s"]
    predicted = pred["predicted_tokens_per_s"]
    # the same pipeline model at the bandwidth this run achieved: separates the model's error from the probe's
    at_run = predicted if plan is None else 1 / simulate(pred, bps)["s_per_token"]
    return {
        "model": str(path), "memory_limit_bytes": pred.get("memory_limit_bytes"), "tokens": tokens,
        "prompt_tokens": len(ids), "threads": torch.get_num_threads(), "io_threads": io_threads,
        "prefetch_depth": prefetch_depth, "cold_start": {"files_dropped_from_page_cache": dropped,
                                                         "note": "O_DIRECT reads; a host-side disk cache may "
                                                                 "still hold recently read data"},
        "load_s": round(load_s, 3), "ttft_s": stats["ttft_s"], "decode_tokens_per_s": tps,
        "decode_steps": steps, "decode_s": stats["decode_s"],
        "decode_bytes_read": decode.disk_bytes_read, "decode_bytes_per_token": round(per_token),
        "decode_read_s": decode.read_s, "decode_read_gb_per_s": round(decode.read_gb_per_s, 3),
        "decode_io_wait_s": round(decode.io_wait_s, 6),
        "decode_hit_rate_pages": round(decode.hit_rate[0], 4), "decode_hit_rate_bytes": round(decode.hit_rate[1], 4),
        "decode_expert_hits": decode.expert_hits, "decode_expert_misses": decode.expert_misses,
        "load_bytes_read": c0["bytes_read"] if c0 else 0,
        "prefill_bytes_read": (c1["bytes_read"] - c0["bytes_read"]) if c0 and c1 else 0,
        "io_bound_tokens_per_s": measured["io_bound_tokens_per_s"],
        "compute_bound_tokens_per_s": measured["compute_bound_tokens_per_s"],
        "bound": measured["bound"],
        "ratio_to_bound": round(tps / best, 6) if best else None,
        "predicted_tokens_per_s": predicted,
        "prediction_error_pct": error_pct(tps, predicted),
        "model_at_run_bandwidth_tokens_per_s": at_run,
        "model_at_run_bandwidth_error_pct": error_pct(tps, at_run),
        "placement_as_planned": same,
        "peak_rss_bytes": stats["peak_rss_bytes"], "runtime_baseline_rss_bytes": baseline,
        "generation": stats,
        "plan": public(pred),
    }


PROMPT = "The history of the printing press begins"
PROMPT_IDS = [1, 2, 3, 4, 5, 6, 7, 8]


def _ram_prediction(path: Path, dtype, ctx_length) -> dict:
    """A model that is not a container: every weight resident, only the compute bound applies."""
    compute = compute_probe(path, dtype, ctx_length)
    return {"model": str(path), "memory_limit_bytes": None, "all_resident": True, "per_token": {"total_bytes": 0},
            "disk": None, "compute": compute, **bounds(0, None, compute["s_per_token"]),
            "predicted_tokens_per_s": 1 / compute["s_per_token"]}


def format_bench(r: dict) -> str:
    io = r["io_bound_tokens_per_s"]
    err = r["prediction_error_pct"]
    parts = [f"decode {r['decode_tokens_per_s']:.2f} tok/s ({r['decode_steps']} steps)",
             f"predicted {_rate(r['predicted_tokens_per_s'])}" + (f" ({err:+.1f} %)" if err is not None else ""),
             (f"I/O bound {io:.2f} tok/s ({r['decode_read_gb_per_s']:.2f} GB/s / "
              f"{r['decode_bytes_per_token'] / 1e6:.1f} MB per token)" if io else "I/O bound none (nothing read)"),
             f"compute bound {_rate(r['compute_bound_tokens_per_s'])}",
             f"{100 * r['ratio_to_bound']:.0f} % of min bound" if r["ratio_to_bound"] else "",
             f"TTFT {r['ttft_s']:.3f} s",
             f"read {_mib(r['load_bytes_read'] + r['prefill_bytes_read'] + r['decode_bytes_read'])}"
             + (f" (decode hit rate {100 * r['decode_hit_rate_bytes']:.0f} %)" if r["decode_bytes_read"] else ""),
             f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB (baseline {r['runtime_baseline_rss_bytes'] / 2**20:.0f})"]
    huge = r["generation"].get("staging_huge_fraction")
    if huge is not None and huge < 0.9:  # reads into 4 KiB pages can be much slower (io.AlignedBuffer)
        parts.append(f"only {100 * huge:.0f} % of the staging buffers in huge pages")
    return " | ".join(p for p in parts if p)

"""The probes behind `colibri plan`: the disk's read bandwidth and the seconds of compute per decode token.

* `disk_probe`: O_DIRECT reads of the model's own data file (io.probe_bandwidth, the run's io thread count), in
  slices whose spread the report shows.
* `compute_probe`: one layer per layer shape, built with the container's storage kinds and shapes (random bytes:
  kernel speed does not depend on the values) in enough copies that the weights come from DRAM, run through the
  family's own block math for single-token passes at torch's current thread count, scaled by the number of
  layers, plus the head's matmul (timed on a slice of its rows) and greedy sampling; timed again while the disk
  probe reads, which gives how much slower compute runs during reads, and once after an idle gap (the wake-up).
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
import threading
import time
from collections import Counter
from pathlib import Path

import torch

from colibri.runtime import budget
from colibri.quant import kinds as quant
from colibri.formats.container import DTYPES, ContainerCheckpoint, TensorEntry
from colibri.weights.io import probe_bandwidth, thp_mode
from colibri.kv.cache import KVCache
from colibri.runtime.model import resolve_dtype
from colibri.models import open_model
from colibri.models.base import Batch, rms_norm, rope_cos_sin
from colibri.kernels.ops import linear
from colibri.perf.predict import WAKE_GAP_S
from colibri.engine.sampling import Sampler, SamplingParams
from colibri.weights.store import RamStore
from colibri.weights.placement import row_bytes

PROBE_PASSES = 20  # single-token passes timed per layer shape
PROBE_SECONDS = 0.6  # at most this long per layer shape (at least 5 passes)
HEAD_PROBE_BYTES = 64 << 20  # the head's matmul is timed on at most this many bytes of its rows, then scaled
COLD_BYTES = 64 << 20  # layer copies the probe cycles through: twice a large L3, so weights come from DRAM
MAX_GROUPS = 6  # layer groups timed apart at most (layer_groups); the probe takes about two seconds a group


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


def random_weight(entry: TensorEntry | None, shape, dtype: torch.dtype):
    """A weight of `shape` as the store would hand it to the math: a quantized object of the manifest entry's
    kind, group size and scale dtypes, or a float tensor in the compute dtype (norms: ones)."""
    kind = entry.kind if entry else "float"
    if kind not in quant.QUANT_KINDS_ALL:
        return _filled(dtype, shape, 1.0 if len(shape) == 1 else None)
    scales = {n: DTYPES[p.dtype] for n, p in entry.parts.items()}
    buffers = {}
    for name, (dt, pshape) in quant.buffer_layout(kind, tuple(shape), entry.group_size).items():
        dt = scales.get(name, dt)
        if kind in quant.K_KINDS:  # random codes and scale codes, small f16 super-scales
            buffers[name] = _filled(dt, pshape, None)
        elif name == "scales_zeros":
            sz = torch.zeros(pshape, dtype=dt)
            sz[..., 0] = 0.01
            buffers[name] = sz
        else:
            buffers[name] = _filled(dt, pshape, 0.002 if name == "scales" else None)
    return quant.from_buffers(kind, tuple(shape), entry.group_size, buffers)


class _ProbeStore(RamStore):
    """One layer's weights; the experts a pass routes to are served by `top_k` built experts."""

    def __init__(self, tensors, dtype, decoder, experts: list[list]):
        super().__init__(tensors, dtype)
        self.decoder, self.experts, self.alias = decoder, experts, {}

    def get(self, name: str):
        return self.tensors.get(name) if name in self.tensors else self.alias[name]

    def route(self, i, uses, names):
        self.alias = {n: w for j, e in enumerate(sorted(uses))
                      for n, w in zip(self.decoder.expert_names(i, e), self.experts[j % len(self.experts)])}
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


def _woken(fn, gap: float = 2 * WAKE_GAP_S, passes: int = 5) -> float:
    """Median seconds of `fn()` right after `gap` seconds of idling."""
    times = []
    for _ in range(passes):
        time.sleep(gap)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def layer_groups(args, decoder, shapes: dict, entries: dict) -> dict[str, tuple[bool, list[int], dict[str, int]]]:
    """The model's layers in groups that compute alike: MoE or dense, and the same storage kind for each of their
    weights (a K-quant GGUF keeps some layers' weights in a wider kind: Q4_K_M's Q6_K ffn_down and attn_v in about
    half of them). name -> (moe, layer indices, {quantized kind: weights of it in a layer}); the largest group of each
    layer type is named "dense" or "moe", the others "dense 2", "dense 3", ...; past MAX_GROUPS groups, the rest
    count as the largest of their type."""
    found: dict[tuple, list[int]] = {}
    for i in range(args.num_layers):
        prefix = decoder.layer_prefix(i)
        kinds = tuple(sorted((n[len(prefix):], entries[n].kind if n in entries else "float") for n in shapes
                             if n.startswith(prefix)))
        found.setdefault((bool(args.moe_layers[i]), kinds), []).append(i)
    out: dict[str, tuple[bool, list[int], dict[str, int]]] = {}
    for (moe, kinds), idx in sorted(found.items(), key=lambda kv: (-len(kv[1]), kv[1][0])):
        base = "moe" if moe else "dense"
        if len(out) >= MAX_GROUPS and base in out:  # past the largest groups: timed as its type's largest
            out[base][1].extend(idx)
            continue
        name = base if base not in out else f"{base} {sum(k.split()[0] == base for k in out) + 1}"
        out[name] = (moe, idx, dict(Counter(kind for _, kind in kinds if kind in quant.QUANT_KINDS_ALL)))
    return {k: (moe, sorted(idx), counts) for k, (moe, idx, counts) in out.items()}


def compute_probe(path: str | Path, dtype=None, ctx_length: int | None = None, position: int = 32,
                  background: threading.Thread | None = None, stop: threading.Event | None = None) -> dict:
    """Seconds of compute per decode token (see the module docstring), at torch's current thread count, as a
    report: per layer shape, head, sampling, slowdown under reads, wake-up.

    Each layer shape is built in enough copies to exceed the CPU caches (COLD_BYTES) and the passes cycle through
    them: in a run every layer's weights come from DRAM. With `background` (a thread reading the model's data
    file until `stop` is set), everything is timed again while it runs: `slowdown` is how much slower compute is
    while the disk streams (the reads' CPU time and memory traffic); `stop` is set when that timing ends, so the
    reads' own rate is their rate under compute."""
    ckpt, args, decoder = open_model(Path(path))
    try:
        dt = resolve_dtype(dtype) or ckpt.default_dtype()
        entries = ckpt.tensors if isinstance(ckpt, ContainerCheckpoint) else {}
        shapes = decoder.weight_shapes()
    finally:
        ckpt.close()
    weight = (lambda n, shape=None: random_weight(entries.get(n), shape or shapes[n], dt))
    stored = (lambda n: entries[n].nbytes if n in entries else math.prod(shapes[n]) * dt.itemsize)
    gen = torch.Generator().manual_seed(0)
    ctx = max(position + PROBE_PASSES + 8, min(ctx_length or args.max_position_embeddings, 1 << 16))
    groups = layer_groups(args, decoder, shapes, entries)
    timers: dict[str, tuple] = {}  # component -> (function, count per token)
    for group, (moe, idx, _) in groups.items():
        i = idx[0]
        prefix = decoder.layer_prefix(i)
        expert_names = {n for e in range(args.num_experts) for n in decoder.expert_names(i, e)} if moe else set()
        names = [n for n in shapes if n.startswith(prefix) and n not in expert_names]
        nbytes = sum(map(stored, names)) + (args.top_k * sum(map(stored, decoder.expert_names(i, 0))) if moe else 0)
        stores = []
        for _ in range(max(1, min(64, math.ceil(COLD_BYTES / max(1, nbytes))))):
            experts = [[weight(n) for n in decoder.expert_names(i, e)] for e in range(args.top_k)] if moe else []
            stores.append(_ProbeStore({n: weight(n) for n in names}, dt, decoder, experts))
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
            rope = rope_cos_sin(decoder.inv_freq[args.layer_types[i]], pos, dt)
            one = Batch(torch.zeros(1, dtype=torch.long), pos, [(0, 1)], [cache], torch.zeros(1, dtype=torch.long))
            if attention_only:  # the part before a MoE layer's router (its experts are read after it)
                decoder.attention(store, i, decoder.norm(x, store, prefix + "input_layernorm.weight"), one, rope)
            else:
                decoder.block(store, i, x, one, rope)
                cache.advance(1)

        timers[group] = (step, len(idx))
        timers[group + "_attention"] = (functools.partial(step, True), 0)
    head_name = decoder.lm_head_name()
    vocab, hidden = shapes[head_name]
    entry = entries.get(head_name)
    per_row = row_bytes(entry) if entry else hidden * dt.itemsize
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
    # the first layer after a wait for reads of WAKE_GAP_S or more runs slower (its threads, and on a VM their
    # vCPUs, went to sleep; more so with OMP_WAIT_POLICY=PASSIVE): `wake` is that extra time, in seconds, for one
    # layer (figures: docs/performance.md, "Streaming under `--memory-limit`")
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
    layers = {k: {"s": idle[k], "attention_s": min(idle[k], idle[k + "_attention"]), "layers": len(idx),
                  "indices": idx, "kinds": kinds} for k, (_, idx, kinds) in groups.items()}
    out = {"s_per_token": per_token(idle), "layers": layers, "head_s": idle["head"] * vocab / rows,
           "sample_s": idle["sample"], "threads": torch.get_num_threads(), "dtype": str(dt).removeprefix("torch."),
           "position": position, "slowdown": 1.0, "wake_s": wake, "wake_gap_s": WAKE_GAP_S}
    if busy:
        out["s_per_token_while_reading"] = per_token(busy)
        out["slowdown"] = max(1.0, per_token(busy) / per_token(idle))
    return out

"""`colibri plan` (the layout, the probes and the predicted decode speed, without loading) and `colibri bench`
(cold-start decode measured beside that prediction), and their one-line and table renderings."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from colibri.core.config import DEFAULT_BATCH
from colibri.formats.container import MANIFEST
from colibri.core.errors import InputError
from colibri.core.metrics import GenerationMetrics
from colibri.perf.predict import (BASELINE_NOTE, EXPERT_ASSUMPTION, PIPELINE_MODEL, Layout, bounds, layout,
                                  simulate)
from colibri.perf.probes import compute_probe, disk_probe
from colibri.weights.placement import fmt_bytes

PIPELINE_SHORT = "reads overlap compute only as far as the store's prefetch reaches"
PROMPT = "The history of the printing press begins"
PROMPT_IDS = [1, 2, 3, 4, 5, 6, 7, 8]  # a model without a tokenizer (test models) runs on these


@dataclass
class Plan:
    """What `colibri plan` reports: the layout (None: not a container, every weight resident), the probes'
    reports, the bounds and the pipeline model's prediction."""
    model: Path
    compute: dict  # probes.compute_probe
    bounds: dict  # predict.bounds
    layout: Layout | None = None
    disk: dict | None = None  # probes.disk_probe, with the rate while computing
    pipeline: dict | None = None  # s_per_token, io_wait_s_per_token, tokens_per_s (and its range over the disk's)

    @property
    def memory_limit_bytes(self) -> int | None:
        return self.layout.memory_limit_bytes if self.layout else None

    @property
    def predicted_tokens_per_s(self) -> float:
        return self.pipeline["tokens_per_s"] if self.pipeline else 1 / self.compute["s_per_token"]

    def as_dict(self) -> dict:
        """The JSON report (`colibri plan --json`)."""
        if self.layout is None:
            head = {"model": str(self.model), "memory_limit_bytes": None, "all_resident": True,
                    "per_token": {"total_bytes": 0}}
        else:
            head = self.layout.as_dict()
        return {**head, "compute": self.compute, "disk": self.disk, **self.bounds,
                **({"pipeline": self.pipeline} if self.pipeline else {}),
                "predicted_tokens_per_s": self.predicted_tokens_per_s}


def is_container(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def error_pct(measured: float, predicted: float | None) -> float | None:
    return round(100 * (measured / predicted - 1), 2) if predicted else None


def predict(path: str | Path, memory_limit=None, dtype=None, prefetch_depth: int | None = None, io_threads: int = 2,
            ctx_length: int | None = None, batch_size: int = DEFAULT_BATCH, probe_seconds: float = 1.0,
            lay: Layout | None = None) -> Plan:
    """`colibri plan`: the layout (or `lay`, computed earlier), the disk and compute probes, the prediction."""
    lay = lay or layout(path, memory_limit, dtype, prefetch_depth, ctx_length, batch_size)
    per_token = lay.per_token["total_bytes"]
    disk: dict = {}
    busy: dict = {}
    reads = None
    stop = threading.Event()  # ends the second probe when the timing under reads is done
    if per_token:
        # The disk alone (its rate while compute is idle), then a second probe that runs exactly while compute is
        # timed again: the slowdown of compute under reads, and the disk's rate under compute (lower than alone:
        # docs/performance.md, "Streaming under `--memory-limit`"); the pipeline model uses both rates.
        disk.update(disk_probe(lay.data_file, io_threads, probe_seconds))
        reads = threading.Thread(target=lambda: busy.update(disk_probe(lay.data_file, io_threads, 60.0, 1, stop)),
                                 daemon=True)
    compute = compute_probe(path, dtype, lay.reserve.ctx, background=reads, stop=stop)
    if busy:
        disk["while_computing_bytes_per_s"] = busy["bytes_per_s"]
    bandwidth = disk.get("bytes_per_s")
    busy_bw = disk.get("while_computing_bytes_per_s")
    sim = simulate(lay, compute, bandwidth, busy_bw)
    pipeline = {"s_per_token": sim["s_per_token"], "io_wait_s_per_token": sim["io_wait_s"],
                "tokens_per_s": 1 / sim["s_per_token"], "model": PIPELINE_MODEL}
    if disk:  # the same model at the slowest and fastest slice of the disk probe
        pipeline["tokens_per_s_range"] = [
            1 / simulate(lay, compute, disk[k], busy_bw and busy_bw * disk[k] / bandwidth)["s_per_token"]
            for k in ("min_bytes_per_s", "max_bytes_per_s")]
    if lay.elastic_pins:  # a decode's start, with the elastic pins: what `colibri run` reads while the context is short
        start = lay.with_elastic_pins()
        pipeline["decode_start"] = {"bytes_per_token": start.per_token["total_bytes"],
                                    "tokens_per_s": 1 / simulate(start, compute, bandwidth, busy_bw)["s_per_token"]}
    return Plan(Path(path), compute, bounds(per_token, bandwidth, compute["s_per_token"]), lay, disk or None,
                pipeline)


def ram_prediction(path: Path, dtype, ctx_length) -> Plan:
    """A model that is not a container: every weight resident, only the compute bound applies."""
    compute = compute_probe(path, dtype, ctx_length)
    return Plan(path, compute, bounds(0, None, compute["s_per_token"]))


# ---------------------------------------------------------------------------------------------- bench


@dataclass
class BenchReport:
    """What `colibri bench` reports: the decode phase's measured speed and I/O beside the plan's prediction."""
    model: str
    memory_limit_bytes: int | None
    tokens: int
    prompt_tokens: int
    threads: int
    io_threads: int
    prefetch_depth: int | None
    cold_start: dict  # files dropped from the page cache, and what that cannot drop
    load_s: float
    ttft_s: float
    decode_tokens_per_s: float
    decode_steps: int
    decode_s: float
    decode_bytes_read: int
    decode_bytes_per_token: int
    decode_read_s: float  # wall time with a read in flight
    decode_read_gb_per_s: float
    decode_io_wait_s: float
    decode_hit_rate_pages: float
    decode_hit_rate_bytes: float
    decode_expert_hits: int
    decode_expert_misses: int
    load_bytes_read: int
    prefill_bytes_read: int
    io_bound_tokens_per_s: float | None  # at the bandwidth this run achieved
    compute_bound_tokens_per_s: float | None
    bound: str | None
    ratio_to_bound: float | None
    predicted_tokens_per_s: float
    prediction_error_pct: float | None
    model_at_run_bandwidth_tokens_per_s: float  # the pipeline model at this run's bandwidth: the model's own error
    model_at_run_bandwidth_error_pct: float | None
    placement_as_planned: bool
    peak_rss_bytes: int
    runtime_baseline_rss_bytes: int
    generation: dict  # the run's GenerationMetrics
    plan: Plan
    sparse_ffn: dict | None = None  # --sparse-ffn (LOSSY): FFN sparsity and bytes per token, prefill included
    timeline: list[dict] | None = None  # the store's per-scope records of the first `timeline_passes` passes

    def as_dict(self) -> dict:
        """The JSON report (`colibri bench --json`)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["plan"] = self.plan.as_dict()
        return out


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
              ctx_length: int | None = None, batch_size: int = DEFAULT_BATCH,
              probe_seconds: float = 1.0, sparse_ffn: str | None = None, timeline_passes: int = 0) -> BenchReport:
    """Cold-start decode benchmark: drop the model's files from the page cache, load under the limit, generate
    `tokens` tokens greedily (EOS ignored), and set the decode phase's measured speed and I/O beside the plan's
    prediction. The probes run after the model is closed, so they neither warm its pages nor count in its RSS.
    `timeline_passes`: keep the streaming store's per-scope timeline of that many first passes (`timeline`)."""
    from colibri.runtime.model import load

    path = Path(path)
    if tokens < 2:
        raise InputError(f"--tokens must be at least 2 (one prefill token, then decode steps; got {tokens})")
    if threads:
        torch.set_num_threads(int(threads))
    lay = None
    if memory_limit is not None or is_container(path):
        lay = layout(path, memory_limit, dtype, prefetch_depth, ctx_length, batch_size)  # before usage.json changes
    dropped = drop_page_cache(model_files(path))
    t0 = time.perf_counter()
    # plain one-token steps (no n-gram drafts), the passes the plan models: accepted drafts read a pass's weights
    # once for several tokens, so bytes and time per token would fall with how repetitive the text happens to be
    m = load(path, memory_limit=memory_limit, dtype=dtype, io_threads=io_threads, prefetch_depth=prefetch_depth,
             ctx_length=ctx_length, batch_size=batch_size, sparse_ffn=sparse_ffn, draft_tokens=0)
    load_s = time.perf_counter() - t0
    m.store.hold()  # measure the placement `plan` predicts (elastic pins vary with the KV cache)
    if m.store.timeline is not None:
        m.store.timeline_passes = timeline_passes
    try:
        ids = m.prompt_ids(prompt or (PROMPT if m.tokenizer else PROMPT_IDS))
        c0 = m.store.counters() or None  # None: all in RAM, nothing read
        c1 = metrics = None
        for chunk in m.stream(ids, max_tokens=tokens, temperature=0.0, ignore_eos=True):
            metrics = chunk.metrics
            if c1 is None and chunk.token_id is not None and c0 is not None:
                c1 = m.store.counters()  # after prefill and the first token: decode starts here
        stats = metrics.as_dict()
        c2 = m.store.counters() if c0 is not None else None
        placed = m.store.placement  # None: all in RAM, as the layout planned
        same = lay is None or placed is None or lay.placement.pinned == placed.pinned
        baseline = m.baseline_rss_bytes
        sparse = m.sparse.counters() if m.sparse is not None else None
        timeline = list(m.store.timeline) if timeline_passes and m.store.timeline is not None else None
    finally:
        m.close()
    steps = metrics.generated_tokens - 1
    decode = GenerationMetrics()
    if c0 is not None:
        decode.account_io(c1, c2)
    per_token = decode.disk_bytes_read / steps if steps > 0 else 0.0
    bps = decode.disk_bytes_read / decode.read_s if decode.read_s > 0 else None
    pred = predict(path, memory_limit, dtype, prefetch_depth, io_threads, ctx_length, batch_size, probe_seconds,
                   lay) if lay is not None else ram_prediction(path, dtype, ctx_length)
    measured = bounds(per_token, bps, pred.compute["s_per_token"])
    tps = stats["decode_tokens_per_s"]
    best = measured["bound_tokens_per_s"]
    predicted = pred.predicted_tokens_per_s
    # the same pipeline model at the bandwidth this run achieved: separates the model's error from the probe's
    at_run = predicted if lay is None else 1 / simulate(lay, pred.compute, bps)["s_per_token"]
    return BenchReport(
        model=str(path), memory_limit_bytes=pred.memory_limit_bytes, tokens=tokens, prompt_tokens=len(ids),
        threads=torch.get_num_threads(), io_threads=io_threads, prefetch_depth=prefetch_depth,
        cold_start={"files_dropped_from_page_cache": dropped,
                    "note": "O_DIRECT reads; a host-side disk cache may still hold recently read data"},
        load_s=round(load_s, 3), ttft_s=stats["ttft_s"], decode_tokens_per_s=tps, decode_steps=steps,
        decode_s=stats["decode_s"], decode_bytes_read=decode.disk_bytes_read,
        decode_bytes_per_token=round(per_token), decode_read_s=decode.read_s,
        decode_read_gb_per_s=round(decode.read_gb_per_s, 3), decode_io_wait_s=round(decode.io_wait_s, 6),
        decode_hit_rate_pages=round(decode.hit_rate[0], 4), decode_hit_rate_bytes=round(decode.hit_rate[1], 4),
        decode_expert_hits=decode.expert_hits, decode_expert_misses=decode.expert_misses,
        load_bytes_read=c0["bytes_read"] if c0 else 0,
        prefill_bytes_read=(c1["bytes_read"] - c0["bytes_read"]) if c0 and c1 else 0,
        io_bound_tokens_per_s=measured["io_bound_tokens_per_s"],
        compute_bound_tokens_per_s=measured["compute_bound_tokens_per_s"], bound=measured["bound"],
        ratio_to_bound=round(tps / best, 6) if best else None, predicted_tokens_per_s=predicted,
        prediction_error_pct=error_pct(tps, predicted), model_at_run_bandwidth_tokens_per_s=at_run,
        model_at_run_bandwidth_error_pct=error_pct(tps, at_run), placement_as_planned=same,
        peak_rss_bytes=stats["peak_rss_bytes"], runtime_baseline_rss_bytes=baseline, generation=stats, plan=pred,
        sparse_ffn=sparse, timeline=timeline)


# ---------------------------------------------------------------------------------------------- text


def _mib(n) -> str:
    return "-" if not n else fmt_bytes(int(n))


def _rate(x) -> str:
    return "unbounded" if x is None else f"{x:.2f} tok/s"


def format_plan(plan: Plan) -> str:
    """The plan as the table `colibri plan` prints (a rendering of its JSON report)."""
    r = plan.as_dict()
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

    def layers(name: str, v: dict) -> str:  # a group's kinds where there are several groups to tell apart
        kinds = f": {', '.join(f'{n} {q}' for q, n in v['kinds'].items())}" if len(c["layers"]) > 1 else ""
        return f"{v['layers']} x {1e3 * v['s']:.2f} ms ({name} layer{kinds})"

    parts = " + ".join(layers(k, v) for k, v in c["layers"].items())
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
    start, pins = pipe.get("decode_start"), r["elastic_pins"]
    if start:
        lines.append(f"at a decode's start: {_rate(start['tokens_per_s'])} reading {_mib(start['bytes_per_token'])} "
                     f"per token, with {pins['pages']} more pages ({_mib(pins['bytes'])}) pinned in the room the "
                     f"context's KV reserve leaves while the context is short (given back as it grows; `colibri "
                     f"bench` holds the placement's own pins)")
    return "\n".join(lines)


def format_bench(r: BenchReport) -> str:
    """The one line `colibri bench` prints."""
    io = r.io_bound_tokens_per_s
    err = r.prediction_error_pct
    parts = [f"decode {r.decode_tokens_per_s:.2f} tok/s ({r.decode_steps} steps)",
             f"predicted {_rate(r.predicted_tokens_per_s)}" + (f" ({err:+.1f} %)" if err is not None else ""),
             (f"I/O bound {io:.2f} tok/s ({r.decode_read_gb_per_s:.2f} GB/s / "
              f"{r.decode_bytes_per_token / 1e6:.1f} MB per token)" if io else "I/O bound none (nothing read)"),
             f"compute bound {_rate(r.compute_bound_tokens_per_s)}",
             f"{100 * r.ratio_to_bound:.0f} % of min bound" if r.ratio_to_bound else "",
             f"TTFT {r.ttft_s:.3f} s",
             f"read {_mib(r.load_bytes_read + r.prefill_bytes_read + r.decode_bytes_read)}"
             + (f" (decode hit rate {100 * r.decode_hit_rate_bytes:.0f} %)" if r.decode_bytes_read else ""),
             f"peak RSS {r.peak_rss_bytes / 2**20:.0f} MiB (baseline {r.runtime_baseline_rss_bytes / 2**20:.0f})"]
    if r.sparse_ffn:
        s = r.sparse_ffn
        parts.append(f"LOSSY sparse FFN {100 * s['ffn_sparsity']:.0f} % of neurons skipped, FFN bytes needed"
                     f" {s['ffn_bytes_needed_per_token'] / 1e6:.1f} of {s['ffn_dense_bytes_per_token'] / 1e6:.1f} MB"
                     " per token")
    huge = r.generation.get("staging_huge_fraction")
    if huge is not None and huge < 0.9:  # reads into 4 KiB pages can be much slower (io.AlignedBuffer)
        parts.append(f"only {100 * huge:.0f} % of the staging buffers in huge pages")
    return " | ".join(p for p in parts if p)

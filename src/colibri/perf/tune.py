"""`colibri tune`: measure a container's decode speed under a memory limit at candidate settings, and keep a
profile beside the container (tune.json) only when one beats the default by at least MIN_GAIN in repeated
measurements; `run`, `chat`, `serve` and `batch` then take its settings for that limit and say so.

Candidates start from what the planner would use (its prefetch depth, the default io threads, torch's threads)
and move one setting at a time (coordinate descent): io threads 1-4, the prefetch depth halved and doubled,
one thread fewer. Each candidate is measured `repeats` times (a fresh load, `tokens` greedy tokens, EOS ignored;
decode tok/s) and ranked by its median. The winner is then measured again, interleaved with the default, and the
profile is written only if that median beats the default's by MIN_GAIN: a win inside the noise writes nothing.

Not tuned here: the OpenMP wait policy (set before torch loads, `colibri` sets it for streamed models),
the batch size (a prefill setting; decode is what this measures), and sparse FFNs (not in this engine).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Callable

from colibri.core.atomic import write_json
from colibri.core.config import DEFAULT_IO_THREADS
from colibri.core.defaults import parse_size
from colibri.core.errors import InputError

PROFILE = "tune.json"
VERSION = 1
MIN_GAIN = 0.03  # a profile is kept only when it decodes at least 3 % faster than the default
KNOBS = ("io_threads", "prefetch_depth", "threads")
PROMPT = "The history of the printing press begins"


def measure(path: Path, memory_limit: int, settings: dict, tokens: int) -> float:
    """Decode tok/s of one fresh load at `settings` (io_threads, prefetch_depth, threads)."""
    from colibri.runtime.model import load
    m = load(path, memory_limit=memory_limit, **settings)
    try:
        ids = m.prompt_ids(PROMPT) if m.tokenizer else [1, 2, 3, 4, 5, 6, 7, 8]
        r = m.generate(ids, max_tokens=tokens, temperature=0.0, ignore_eos=True)
    finally:
        m.close()
    return r.stats["decode_tokens_per_s"]


def candidates(setting: str, current: dict, depth: int, cores: int) -> list:
    """Values of one setting to try besides the current one."""
    if setting == "io_threads":
        values = [1, 2, 3, 4]
    elif setting == "prefetch_depth":
        values = sorted({max(1, depth // 2), depth, depth * 2})
    else:
        values = sorted({cores, max(1, cores - 1)})
    return [v for v in values if v != current[setting]]


def tune(path: str | Path, memory_limit, tokens: int = 16, repeats: int = 3, min_gain: float = MIN_GAIN,
         bench: Callable[[dict], float] | None = None, log: Callable[[str], None] | None = None) -> dict:
    """Search the settings (module docstring); returns the report and writes PROFILE when the gain holds.
    `bench(settings) -> tok/s` replaces the real measurement (tests)."""
    import torch

    from colibri.perf.predict import layout
    path = Path(path)
    limit = parse_size(memory_limit)
    lay = layout(path, limit)
    bench = bench or (lambda s: measure(path, limit, s, tokens))
    log = log or (lambda text: print(f"colibri tune: {text}", file=sys.stderr, flush=True))
    cores = torch.get_num_threads()
    default = {"io_threads": DEFAULT_IO_THREADS, "prefetch_depth": lay.placement.prefetch_depth, "threads": cores}

    def median(settings: dict) -> float:
        rate = statistics.median(bench(dict(settings)) for _ in range(repeats))
        log(f"{_fmt(settings)}: {rate:.2f} tok/s (median of {repeats})")
        return rate

    best, best_rate = dict(default), median(default)
    tried = [{"settings": dict(default), "tok_s": best_rate}]
    for setting in KNOBS:
        for value in candidates(setting, best, default["prefetch_depth"], cores):
            trial = {**best, setting: value}
            rate = median(trial)
            tried.append({"settings": trial, "tok_s": rate})
            if rate > best_rate:
                best, best_rate = trial, rate
    report = {"version": VERSION, "memory_limit_bytes": limit, "default": default, "tried": tried,
              "tokens": tokens, "repeats": repeats, "container": _identity(path)}
    if best == default:
        log("the default is the fastest setting measured; no profile written")
        return {**report, "written": False, "settings": default, "gain_pct": 0.0}
    # confirm: the winner against the default again, interleaved, so a lucky streak is not kept
    pairs = [(bench(dict(default)), bench(dict(best))) for _ in range(repeats)]
    base, tuned = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    gain = tuned / base - 1 if base > 0 else 0.0
    report.update(settings=best, default_tok_s=base, tuned_tok_s=tuned, gain_pct=round(100 * gain, 2))
    if gain < min_gain:
        log(f"{_fmt(best)} measured {100 * gain:+.1f} % against the default on confirmation (under"
            f" {100 * min_gain:.0f} %); no profile written")
        return {**report, "written": False}
    write_json(path / PROFILE, {k: v for k, v in report.items() if k != "tried"})
    log(f"wrote {path / PROFILE}: {_fmt(best)}, {100 * gain:+.1f} % decode tok/s against the default")
    return {**report, "written": True}


def _fmt(settings: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in settings.items())


def _identity(path: Path) -> str:
    """The container the profile was measured on: its manifest's checksum."""
    return json.loads((path / "manifest.json").read_text()).get("checksum", "")


def profile_for(path: str | os.PathLike, memory_limit) -> dict | None:
    """The settings of the profile beside container `path` measured at this memory limit, or None (no profile,
    another limit, another container, or a damaged file)."""
    f = Path(path) / PROFILE
    if memory_limit is None or not f.is_file():
        return None
    try:
        p = json.loads(f.read_text())
        if p.get("version") != VERSION or p.get("memory_limit_bytes") != parse_size(memory_limit) or \
                p.get("container") != _identity(Path(path)):
            return None
        return p
    except (OSError, ValueError, InputError):
        return None

"""`colibri tune`: measure a container's speed under a memory limit at candidate settings, and keep a profile
beside the container (tune.json) only when one beats the default by at least MIN_GAIN in repeated measurements;
`run`, `chat`, `serve` and `batch` then take its settings for that limit and say so.

Two stages, each a coordinate descent from what the planner would use, one setting at a time:
1. decode tok/s over io threads (1-4), the prefetch depth (the planner's, halved and doubled), compute threads
   (torch's, one fewer) and the OpenMP wait policy (PASSIVE, ACTIVE: libgomp reads it once, when torch loads, so
   a policy other than this process's is measured in a child process);
2. prefill tok/s of a `prefill_tokens` prompt over the batch size (tokens per forward pass: the default, halved
   and doubled; a size the limit cannot hold is skipped), with stage 1's outcome.
Each candidate is measured `repeats` times (a fresh load each) and ranked by its median. A stage's winner is then
measured again, interleaved with the default, and kept only if that median beats the default's by MIN_GAIN: a
win inside the noise keeps nothing. The profile is written when either stage keeps a winner.

Not tuned: sparse FFNs (`--sparse-ffn`, LOSSY: it changes tokens, and it masks neurons without reading fewer
bytes yet, so it cannot make decode faster).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable

from colibri.core.atomic import write_json
from colibri.core.config import DEFAULT_BATCH, DEFAULT_IO_THREADS
from colibri.core.defaults import parse_size
from colibri.core.errors import ColibriError, InputError

PROFILE = "tune.json"
VERSION = 2
MIN_GAIN = 0.03  # a setting is kept only when it is at least 3 % faster than the default
KNOBS = ("io_threads", "prefetch_depth", "threads", "omp_wait_policy")  # stage 1, measured by decode tok/s
POLICIES = ("PASSIVE", "ACTIVE")
PROMPT = "The history of the printing press begins"

# bench(settings, objective) -> tok/s, objective "decode" or "prefill"; None: the limit cannot hold the settings
Bench = Callable[[dict, str], "float | None"]


def omp_policy() -> str:
    """This process's OpenMP wait policy: what OMP_WAIT_POLICY said when torch loaded ("default": libgomp's own,
    spinning a while before sleeping)."""
    return os.environ.get("OMP_WAIT_POLICY", "").upper() or "default"


def measure(path: Path, memory_limit: int, settings: dict, objective: str, tokens: int,
            prefill_tokens: int) -> float | None:
    """tok/s of one fresh load at `settings`: decode of `tokens` greedy tokens, or prefill of a `prefill_tokens`
    prompt of real text. None where the memory limit cannot hold these settings."""
    if settings["omp_wait_policy"] != omp_policy():
        return _in_child(path, memory_limit, settings, objective, tokens, prefill_tokens)
    from colibri.runtime.model import load
    engine = {k: v for k, v in settings.items() if k != "omp_wait_policy"}
    try:
        m = load(path, memory_limit=memory_limit, **engine)
    except ColibriError:  # refused by the planner: too little room for this batch
        return None
    try:
        if objective == "decode":
            ids = m.prompt_ids(PROMPT) if m.tokenizer else [1, 2, 3, 4, 5, 6, 7, 8]
            return m.generate(ids, max_tokens=tokens, temperature=0.0, ignore_eos=True).stats["decode_tokens_per_s"]
        r = m.generate(_long_prompt(m, prefill_tokens), max_tokens=1, temperature=0.0, ignore_eos=True)
        return r.stats["prefill_tokens_per_s"]
    finally:
        m.close()


def _long_prompt(m, n: int) -> list[int]:
    """`n` tokens of real English text (the built-in calibration prose: CPython's pydoc topics), or counting ids
    where there is no tokenizer."""
    if m.tokenizer is None:
        return [1 + i % 97 for i in range(n)]
    from colibri.convert.calibrate import builtin_text
    prose, _ = builtin_text()
    return m.tokenizer.encode(prose[: n * 8])[:n]


def _in_child(path: Path, memory_limit: int, settings: dict, objective: str, tokens: int,
              prefill_tokens: int) -> float | None:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if settings["omp_wait_policy"] != "default":
        env["OMP_WAIT_POLICY"] = settings["omp_wait_policy"]
    job = json.dumps([str(path), memory_limit, settings, objective, tokens, prefill_tokens])
    r = subprocess.run([sys.executable, "-c", "from colibri.perf.tune import _child; _child()", job], env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise InputError(f"colibri tune: a measurement in a child process failed ({last}); rerun with --debug")
    return json.loads(r.stdout)


def _child() -> None:
    path, memory_limit, settings, objective, tokens, prefill_tokens = json.loads(sys.argv[1])
    print(json.dumps(measure(Path(path), memory_limit, settings, objective, tokens, prefill_tokens)))


def candidates(setting: str, current: dict, default: dict, cores: int) -> list:
    """Values of one setting to try besides the current one."""
    if setting == "io_threads":
        values = [1, 2, 3, 4]
    elif setting == "prefetch_depth":
        d = default["prefetch_depth"]
        values = sorted({max(1, d // 2), d, d * 2})
    elif setting == "threads":
        values = sorted({cores, max(1, cores - 1)})
    elif setting == "omp_wait_policy":
        values = list(POLICIES)
    else:  # batch_size
        values = sorted({max(16, DEFAULT_BATCH // 2), DEFAULT_BATCH, DEFAULT_BATCH * 2})
    return [v for v in values if v != current[setting]]


def tune(path: str | Path, memory_limit, tokens: int = 16, repeats: int = 3, min_gain: float = MIN_GAIN,
         prefill_tokens: int = 2 * DEFAULT_BATCH, bench: Bench | None = None,
         log: Callable[[str], None] | None = None) -> dict:
    """Search the settings (module docstring); returns the report and writes PROFILE when a gain holds.
    `bench(settings, objective) -> tok/s` replaces the real measurement (tests). prefill_tokens 0: no stage 2."""
    import torch

    from colibri.perf.predict import layout
    path = Path(path)
    limit = parse_size(memory_limit)
    lay = layout(path, limit)
    bench = bench or (lambda s, objective: measure(path, limit, s, objective, tokens, prefill_tokens))
    log = log or (lambda text: print(f"colibri tune: {text}", file=sys.stderr, flush=True))
    cores = torch.get_num_threads()
    default = {"io_threads": DEFAULT_IO_THREADS, "prefetch_depth": lay.placement.prefetch_depth, "threads": cores,
               "omp_wait_policy": omp_policy(), "batch_size": DEFAULT_BATCH}
    tried: list[dict] = []

    def median(settings: dict, objective: str) -> float | None:
        rates = [bench(dict(settings), objective) for _ in range(repeats)]
        if any(r is None for r in rates):
            log(f"{_fmt(settings)}: refused under this memory limit")
            return None
        rate = statistics.median(rates)
        tried.append({"settings": dict(settings), "objective": objective, "tok_s": rate})
        log(f"{_fmt(settings)}: {rate:.2f} {objective} tok/s (median of {repeats})")
        return rate

    def stage(start: dict, knobs: tuple, objective: str) -> tuple[dict, dict]:
        """(settings kept, what was measured): the best of the descent if it holds MIN_GAIN on confirmation
        against `start`, else `start`."""
        best, best_rate = dict(start), median(start, objective)
        if best_rate is None:
            raise InputError(f"colibri tune: the memory limit cannot hold the default settings ({_fmt(start)})")
        for setting in knobs:
            for value in candidates(setting, best, default, cores):
                trial = {**best, setting: value}
                rate = median(trial, objective)
                if rate is not None and rate > best_rate:
                    best, best_rate = trial, rate
        if best == start:
            log(f"{objective}: the default is the fastest setting measured")
            return start, {"gain_pct": 0.0, "kept": False}
        # confirm: the winner against the default again, interleaved, so a lucky streak is not kept
        pairs = [(bench(dict(start), objective), bench(dict(best), objective)) for _ in range(repeats)]
        base, won = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        gain = won / base - 1 if base > 0 else 0.0
        result = {"candidate": {k: v for k, v in best.items() if v != start[k]}, "default_tok_s": base,
                  "tuned_tok_s": won, "gain_pct": round(100 * gain, 2), "kept": gain >= min_gain}
        if not result["kept"]:
            log(f"{objective}: {_fmt(result['candidate'])} measured {100 * gain:+.1f} % against the default on"
                f" confirmation (under {100 * min_gain:.0f} %); not kept")
            return start, result
        return best, result

    settings, decode = stage(default, KNOBS, "decode")
    prefill = {"gain_pct": 0.0, "kept": False}
    if prefill_tokens > 0:
        settings, prefill = stage(settings, ("batch_size",), "prefill")
    report = {"version": VERSION, "memory_limit_bytes": limit, "default": default, "tried": tried, "tokens": tokens,
              "prefill_tokens": prefill_tokens, "repeats": repeats, "container": _identity(path),
              "settings": settings, "decode": decode, "prefill": prefill, "gain_pct": decode["gain_pct"],
              "prefill_gain_pct": prefill["gain_pct"]}
    if settings == default:
        log("no setting beat the default by 3 %; no profile written")
        return {**report, "written": False}
    write_json(path / PROFILE, {k: v for k, v in report.items() if k != "tried"})
    changed = {k: v for k, v in settings.items() if v != default[k]}
    log(f"wrote {path / PROFILE}: {_fmt(changed)} ({decode['gain_pct']:+.1f} % decode, {prefill['gain_pct']:+.1f} %"
        " prefill tok/s against the default)")
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

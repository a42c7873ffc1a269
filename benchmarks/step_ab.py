"""Two versions of the code, alternated step by step in one decode run: the median step time of each.

    python benchmarks/step_ab.py --model PATH [--variant FILE.py | --library DIR] [--lossy-int8-activations]
                                 [--tokens 200] [--rounds 6] [--threads 2]

--variant FILE.py: Python-level code. FILE.py defines `on()` and `off()`: each puts one version in place (replacing
functions of colibri's modules, say `colibri.quant.kinds._QuantWeight.linear`); the model is loaded first.
--library DIR: the kernels of another checkout (DIR: its src/colibri/kernels), built as the tier in use under a
namespace of its own (`<ns>_ab`, cached like any tier's library) so that both libraries load in one process; `on`
makes it the library `colibri.kernels.library()` returns. Its outputs must be the same bits (tokens compared).
Without either, both sides run the same code (an A/A run: the harness's own noise). Steps alternate off, on, ...
in each request, so both versions see the same host, memory placement and context lengths: over the default 6 x 200 steps an
A/A run stays within 0.2 % (over 3 x 200, once 1.7 %), where separate processes on a shared host differ by several
per cent (figures: docs/performance.md, "What the LOSSY decode step waits on here"). tier_ab.py times single kernels
of two libraries, in processes of their own.

Prints JSON: the median step of each version (ms), their ratio (on / off), the step counts, and whether the greedy
tokens of the alternated rounds equal those of a run with `off` alone (a variant that changes bits shows there).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

import colibri
from colibri import kernels
from colibri.engine.sampling import SamplingParams

PROMPT = "def quicksort(items):\n    if len(items) <= 1:"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    which = ap.add_mutually_exclusive_group()  # neither: an A/A run
    which.add_argument("--variant", help="a Python file defining on() and off()")
    which.add_argument("--library", type=Path, help="another checkout's src/colibri/kernels, swapped in per step")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lossy-int8-activations", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m = colibri.load(a.model, threads=a.threads, draft_tokens=0, lossy_int8_activations=a.lossy_int8_activations)
    on = off = lambda: None  # noqa: E731 - the A/A run
    if a.variant:
        spec = importlib.util.spec_from_file_location("variant", a.variant)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        on, off = mod.on, mod.off
    elif a.library:
        on, off = library_swap(a.library.resolve())
    ids = m.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=a.tokens, ignore_eos=True)

    def run(alternate: bool, times: tuple[list, list]) -> list[int]:
        off()
        req = m.engine.add_request(ids, params)
        while not req.token_ids:  # the prefill, not timed
            m.engine.step()
        i = 0
        while not req.finished:
            side = alternate and i % 2 == 1
            (on if side else off)()
            t = time.perf_counter()
            m.engine.step()
            times[side].append(time.perf_counter() - t)
            i += 1
        off()
        return req.token_ids

    reference = run(False, ([], []))
    times: tuple[list, list] = ([], [])
    same = all(run(True, times) == reference for _ in range(a.rounds))
    t_off, t_on = statistics.median(times[0]), statistics.median(times[1])
    print(json.dumps(dict(model=a.model, variant=a.variant, library=a.library and str(a.library),
                          lossy_int8=a.lossy_int8_activations,
                          off_ms=round(t_off * 1e3, 3), on_ms=round(t_on * 1e3, 3), ratio=round(t_on / t_off, 4),
                          steps=[len(times[0]), len(times[1])], same_tokens=same), indent=1))


def library_swap(src_dir: Path):
    """(on, off): the tier in use's library built from src_dir under the namespace <ns>_ab, and back."""
    name = kernels.tier()
    if name not in kernels.NATIVE:
        raise SystemExit(f"--library needs a native kernel tier (this process runs {name!r})")
    mine = kernels.library()
    t = dataclasses.replace(kernels.TIERS[name], ns=kernels.TIERS[name].ns + "_ab", src_dir=src_dir)
    other = kernels.python_module(t, kernels.load(t))

    def use(mod):
        kernels._ops = mod  # what library() returns (the tier's name and everything else stay)
    return (lambda: use(other)), (lambda: use(mine))


if __name__ == "__main__":
    main()

"""What a decode step costs around its linears: the step with every linear's result cached (the first call of each
weight at each pass size computes it; later calls return it), so what is left is the norms, RoPE, the KV update,
attention, the activations, the residual adds, sampling and the Python between them. Also times those functions.

    python benchmarks/around_linears.py --model PATH [--lossy-int8-activations] [--tokens 64] [--rounds 3]

Prints JSON: ms a token of the whole step with the linears cached (the best of the rounds), and per function us a
token and a layer. Run it from two checkouts (PYTHONPATH=<checkout>/src) alternately to compare code versions: the
tokens are not meaningful (the cached linears' results are stale), only the time.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

import colibri
import colibri.models.base as base
from colibri.engine.sampling import SamplingParams

TIMED = ("rms_norm", "apply_rope", "attend")  # module functions of models/base.py, timed where they are called


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lossy-int8-activations", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    cache: dict = {}
    real_linear = base.linear

    def cached_linear(x, w, b=None):
        key = (x.shape[0], id(w))
        if key not in cache:
            cache[key] = real_linear(x, w, b)
        return cache[key]

    spent: collections.Counter = collections.Counter()

    def timed(fn, label):
        def run(*args, **kw):
            t = time.perf_counter_ns()
            out = fn(*args, **kw)
            spent[label] += time.perf_counter_ns() - t
            return out
        return run

    base.linear = cached_linear
    for name in TIMED:
        setattr(base, name, timed(getattr(base, name), name))
    for name in ("attention", "mlp", "block"):
        setattr(base.DecoderModel, name, timed(getattr(base.DecoderModel, name), f"DecoderModel.{name}"))

    m = colibri.load(a.model, threads=a.threads, draft_tokens=0, lossy_int8_activations=a.lossy_int8_activations)
    ids = m.tokenizer.encode("def quicksort(items):\n    if len(items) <= 1:\n")
    layers = m.decoder.args.num_layers
    best, per = float("inf"), {}
    for _ in range(a.rounds):
        m.kv.clear()
        req = m.engine.add_request(ids, SamplingParams(max_tokens=a.tokens, ignore_eos=True))
        while not req.token_ids:
            m.engine.step()
        spent.clear()
        n0, t = len(req.token_ids), time.perf_counter()
        while not req.finished:
            m.engine.step()
        n = len(req.token_ids) - n0
        dt = (time.perf_counter() - t) / n
        if dt < best:
            best = dt
            per = {k: dict(us_per_token=round(v / n / 1e3, 1), us_per_layer=round(v / n / layers / 1e3, 1))
                   for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
    print(json.dumps(dict(model=a.model, lossy_int8=a.lossy_int8_activations, layers=layers,
                          step_ms_linears_cached=round(best * 1e3, 3), functions=per), indent=1))


if __name__ == "__main__":
    main()

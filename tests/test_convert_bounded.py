"""`colibri convert` in bounded memory (issue 24, item 0): a GGUF three times larger than a cgroup memory limit
converts inside that limit, exact kinds (Q4_K, Q6_K, Q5_0) and re-quantized ones (F16, IQ2_XXS), with progress from
the start and a notice for the kind that has no exact form."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import synthetic_gguf
from clirun import colibri_cmd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from limited import MemCG, own_memcg  # noqa: E402

LIMIT = 512 << 20  # the whole process tree: Python, torch, the conversion and its share of the page cache
PEAK = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(rc)")


def test_gguf_three_times_the_memory_limit_converts_inside_it(tmp_path):
    src = synthetic_gguf.write(tmp_path / "big.gguf", "test", layers=48)
    assert src.stat().st_size > 3 * LIMIT
    try:
        cg = MemCG(own_memcg(), f"colibri-test-convert-{os.getpid()}", LIMIT)
    except (OSError, RuntimeError):
        cg = None  # no cgroup here (not root, no v1 memory controller): the peak RSS below is still checked
    out = tmp_path / "big"
    try:
        # Through a small launcher that reports its child's peak RSS: a child forked from this (large) pytest
        # process would report this process's RSS at the fork as its own peak.
        p = subprocess.run([sys.executable, "-c", PEAK, *colibri_cmd(), "convert", "--input", str(src), "--output",
                            str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600,
                           preexec_fn=cg.entering() if cg else None)
        oom = cg.oom_kills() if cg else 0
    finally:
        if cg:
            cg.remove()
    assert p.returncode == 0 and oom <= 0, p.stderr[-2000:]
    *lines, peak = p.stderr.splitlines()
    assert int(peak) * 1024 < LIMIT
    assert lines[0].endswith(": reading")  # before the file is parsed
    assert any("converting" in ln for ln in lines) and any("verifying" in ln for ln in lines)
    assert [ln for ln in lines if "notice" in ln] == [
        "colibri: notice: 1 IQ2_XXS tensors have no exact kind in Colibri yet: re-quantized to q4 by the fixed policy "
        "(lossy, a few % perplexity: docs/quality.md)"]

    from colibri.formats.container import ContainerCheckpoint
    from colibri.formats.gguf import GGUFCheckpoint

    c, g = ContainerCheckpoint(out), GGUFCheckpoint(src)
    kinds = {t["name"]: t["kind"] for t in json.loads((out / "manifest.json").read_text())["tensors"]}
    assert next(c.verify(), None) is None
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "q4"  # IQ2_XXS re-quantized
    assert kinds["model.layers.0.self_attn.o_proj.weight"] == "q4"  # F16 quantized by the policy
    for name in ("model.layers.0.self_attn.k_proj.weight", "lm_head.weight", "model.embed_tokens.weight",
                 "model.layers.47.mlp.down_proj.weight",
                 "model.layers.47.mlp.up_proj.weight"):
        assert kinds[name] in ("q4k", "q6k", "q5_0")
        assert torch.equal(c.load(name).dequantize(), g.load(name)), name
    c.close()
    g.close()


"""Conversion time and peak RSS of `colibri convert`, run as a child process.

    python benchmarks/convert_bench.py --input PATH [--quant q4] [--group-size 64]
    python benchmarks/convert_bench.py --synthetic-hf llama-2-7b --workdir /nvme/bench [--quant q4]
    python benchmarks/convert_bench.py --synthetic-gguf llama-2-7b --workdir /nvme/bench

--synthetic-gguf writes a Q4_K_M-like GGUF of that shape (tests/synthetic_gguf.py: Q4_K / Q6_K / Q5_0 blocks kept
exactly, one F16 and one IQ2_XXS matrix re-quantized) and converts it.

--synthetic-hf first writes a bf16 HF checkpoint of that architecture shape (random weights, 2 GB shards with
an index, as real 7B checkpoints ship) and then converts it: the test of "streams tensor by tensor, peak RSS
bounded whatever the model size". Reports wall time, input and output sizes, throughput and the child's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synth import SHAPES  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import synthetic_gguf  # noqa: E402

from colibri.models import family  # noqa: E402


def write_synthetic_hf(shape: str, out: Path, shard_bytes: int = 2 << 30) -> Path:
    cfg = dict(SHAPES[shape], torch_dtype="bfloat16")
    arch = family(cfg["model_type"]).Model(family(cfg["model_type"]).args(cfg))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(0)
    shard, size, n, weight_map = {}, 0, 0, {}

    def flush():
        nonlocal shard, size, n
        name = f"model-{n:05d}.safetensors"
        save_file(shard, out / name)
        weight_map.update({k: name for k in shard})
        shard, size, n = {}, 0, n + 1

    for name, s in arch.weight_shapes().items():
        t = torch.ones(s, dtype=torch.bfloat16) if len(s) == 1 else \
            (torch.randn(s, generator=gen) * s[-1] ** -0.5).to(torch.bfloat16)
        shard[name] = t
        size += t.numel() * 2
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


def dir_size(p: Path) -> int:
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input")
    ap.add_argument("--synthetic-hf", choices=sorted(SHAPES))
    ap.add_argument("--synthetic-gguf", choices=sorted(synthetic_gguf.SHAPES))
    ap.add_argument("--layers", type=int, default=32, help="--synthetic-gguf: its layer count")
    ap.add_argument("--workdir", default="/tmp/colibri-convert-bench")
    ap.add_argument("--quant", default="q4")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--keep", action="store_true", help="keep the converted output")
    a = ap.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    src = Path(a.input) if a.input else None
    if a.synthetic_hf:
        src = work / f"{a.synthetic_hf}-bf16-hf"
        if not (src / "model.safetensors.index.json").exists():
            t0 = time.perf_counter()
            write_synthetic_hf(a.synthetic_hf, src)
            print(f"wrote synthetic bf16 checkpoint {src} ({dir_size(src) / 2**30:.2f} GiB) in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            # Start afresh: a child's ru_maxrss includes the parent's pages at fork, and writing the checkpoint
            # left this process large. The re-run finds the checkpoint and goes straight to the conversion.
            os.execv(sys.executable, [sys.executable, *sys.argv])
    if a.synthetic_gguf:
        src = work / f"{a.synthetic_gguf}-{a.layers}-q4km.gguf"
        if not src.exists():
            synthetic_gguf.write(src, a.synthetic_gguf, a.layers)
            print(f"wrote synthetic GGUF {src} ({dir_size(src) / 2**30:.2f} GiB)", flush=True)
            os.execv(sys.executable, [sys.executable, *sys.argv])  # as above
    if src is None:
        sys.exit("error: give --input, --synthetic-hf or --synthetic-gguf")
    out = work / "converted"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "colibri.cli", "convert", "--input", str(src), "--output", str(out),
                    "--quant", a.quant, "--group-size", str(a.group_size)], check=True)
    secs = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    insize, outsize = dir_size(src), dir_size(out)
    print(f"input {src.name}: {insize / 2**30:.2f} GiB -> {a.quant} g{a.group_size}: {outsize / 2**30:.2f} GiB")
    print(f"time {secs:.1f} s ({insize / 2**20 / secs:.0f} MiB/s of input), peak RSS {peak / 2**20:.0f} MiB")
    if not a.keep:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()

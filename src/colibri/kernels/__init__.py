"""Batch-invariant compute kernels: the native AVX-512 build, how it is built and found, and the switch to torch.

Every kernel here gives each output row bit-identical results whatever the number of rows in the pass, so a
sequence decodes the same tokens alone, in a batch, after a chunked prefill or while speculating.

Native kernels (linear.cpp, attention.cpp, kquant.cpp, pointwise.cpp; shared pieces in tiles.h) are C++ compiled with torch.utils.cpp_extension at first use, into
`defaults.cache_dir()/kernels/<torch version>-<source hash>`, and registered as `torch.ops.colibri_kernels.*`;
they run on torch's own thread pool (at::parallel_for). Why a JIT build: it needs only a C++ compiler and the
`ninja` package at run time, takes 1-2 minutes once per machine and torch version (66-128 s measured on a
shared 2-core machine, 11 s of it torch's headers; reported on stderr), and the
install stays `pip install -e .` with no compile step or build isolation (a setup.py build would need torch in
the build requirements and would rebuild on every editable install). A ctypes library was ruled out: its own
OpenMP runtime beside torch's is a known trap (two pools oversubscribe the cores).

`COLIBRI_KERNELS` selects: `native` (default: the native kernels where the CPU has AVX-512 F/BW/VL/DQ/BF16/VBMI and
the build succeeds, else torch with a one-line notice) or `torch` (always the torch fallback). The fallback is
batch-invariant too, by other means (fixed-size row blocks; see `blocked`), so its own runs agree with
themselves; its tokens can differ from the native kernels' in the last bits.

LOSSY int8 activations (int8.cpp, opt-in: `EngineConfig.lossy_int8_activations`, `--lossy-int8-activations`, or
`COLIBRI_LOSSY_INT8=1`): q4 and q8 weights multiply activations quantized per row and per group to int8 with
AVX-512 VNNI dot products, about twice the arithmetic rate of the exact bf16 kernels on long passes. Still
batch-invariant; its quality cost is in docs/performance.md. Process-wide, like the kernel mode: once set, every
model in the process uses it. Where the CPU lacks avx512_vnni (or the native kernels are off) a one-line notice
says so and the exact kernels run.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import sys
import time
from pathlib import Path

import torch

MODE_ENV = "COLIBRI_KERNELS"
LOSSY_INT8_ENV = "COLIBRI_LOSSY_INT8"
_SOURCES = ("linear.cpp", "attention.cpp", "int8.cpp", "kquant.cpp", "pointwise.cpp")
_HEADERS = ("tiles.h",)  # included by the sources: part of the build's identity
# -fopenmp: at::parallel_for is a header template whose OpenMP region compiles to a serial loop without it (the
# kernels then used one core of two); the extension links the libgomp.so.1 torch has already loaded.
_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vbmi",
          "-mfma", "-mf16c"]
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512vbmi")
BLOCK_ROWS = 16  # rows per call in the torch fallback: every GEMM it runs has exactly this many rows


def mode() -> str:
    m = os.environ.get(MODE_ENV, "native").strip().lower() or "native"
    if m not in ("native", "torch"):
        raise ValueError(f"{MODE_ENV}={m!r} is not understood; use 'native' or 'torch'")
    return m


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _notice(msg: str) -> None:
    print(f"colibri: {msg}", file=sys.stderr, flush=True)


def _build_dir() -> Path:
    from colibri.defaults import cache_dir

    here = Path(__file__).parent
    h = hashlib.sha256(" ".join(_FLAGS).encode())
    for s in _SOURCES + _HEADERS:
        h.update((here / s).read_bytes())
    return cache_dir() / "kernels" / f"torch{torch.__version__}-{h.hexdigest()[:12]}"


def _build() -> bool:
    """Compile (or reuse) the native library and load it into torch.ops; False where that is impossible."""
    missing = [f for f in _CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        _notice(f"native kernels need {', '.join(missing)}; using the torch kernels")
        return False
    from torch.utils import cpp_extension

    d = _build_dir()
    d.mkdir(parents=True, exist_ok=True)
    lib = d / "colibri_kernels.so"
    t0 = time.perf_counter()
    try:
        with open(d / "build.lock", "w") as lock:  # one process builds; the others wait, then load its result
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not lib.exists():
                (d / "lock").unlink(missing_ok=True)  # torch's own baton, left behind by a killed build
                cpp_extension.load("colibri_kernels", [str(Path(__file__).parent / s) for s in _SOURCES],
                                   extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(d),
                                   is_python_module=False,
                                   verbose=False)
                _notice(f"built the native kernels in {time.perf_counter() - t0:.0f} s (cached in {d})")
                return True
        torch.ops.load_library(str(lib))
        return True
    except Exception as e:  # no compiler, no ninja, a failed build: the torch kernels still work
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        _notice(f"native kernels unavailable ({first[:200]}); using the torch kernels")
        return False


@functools.cache
def _native_loaded() -> bool:
    return _build()


def native() -> bool:
    """Whether the native kernels are in use (builds them on first call)."""
    return mode() == "native" and _native_loaded()


def ops():
    return torch.ops.colibri_kernels


def blocked(fn, x: torch.Tensor, n: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """fn over fixed BLOCK_ROWS-row blocks of x [T, K] (the last zero-padded) -> [T, n].

    torch's GEMMs pick kernels and reduction orders by the row count; calling them only with BLOCK_ROWS rows,
    from a fresh contiguous buffer, makes each row's result independent of T (measured on MKL and oneDNN, f32
    and bf16). At T = 1 the padded call costs about the same as a one-row call (both read the whole weight)."""
    t = x.shape[0]
    out = torch.empty(t, n, dtype=dtype or x.dtype)
    for r in range(0, t, BLOCK_ROWS):
        c = min(BLOCK_ROWS, t - r)
        blk = torch.zeros(BLOCK_ROWS, x.shape[1], dtype=x.dtype)
        blk[:c] = x[r:r + c]
        out[r:r + c] = fn(blk)[:c]
    return out


_int8_requested: bool | None = None  # set_int8_activations; None: COLIBRI_LOSSY_INT8 decides


def set_int8_activations(on: bool | None) -> None:
    """Turn the LOSSY int8-activation kernels on or off for this process (None: back to COLIBRI_LOSSY_INT8)."""
    global _int8_requested
    _int8_requested = None if on is None else bool(on)


def _int8_env() -> bool:
    v = os.environ.get(LOSSY_INT8_ENV, "").strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{LOSSY_INT8_ENV}={v!r} is not understood; use 1 or 0")


@functools.cache
def _int8_usable() -> bool:
    if "avx512_vnni" not in _cpu_flags():
        _notice("lossy int8 activations need AVX-512 VNNI (avx512_vnni), which this CPU lacks; using the exact kernels")
        return False
    if not native():
        _notice("lossy int8 activations need the native kernels; using the exact torch kernels")
        return False
    return True


def int8_activations() -> bool:
    """Whether q4 / q8 linears use the LOSSY int8-activation kernels now (requested, VNNI present, native on)."""
    on = _int8_env() if _int8_requested is None else _int8_requested
    return on and mode() == "native" and _int8_usable()


def int8_supports(k: int, group_size: int) -> bool:
    """Whether the int8 kernels take a weight with K inputs and this group size (0: q8 per channel); the exact
    kernels run the others."""
    return k % 64 == 0 and group_size in (0, 32, 64, 128, 256)

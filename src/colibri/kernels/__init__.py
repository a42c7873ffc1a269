"""Batch-invariant compute kernels: the native kernel tiers, how they are built and found, and the torch fallback.

Every kernel here gives each output row bit-identical results whatever the number of rows in the pass, so a
sequence decodes the same tokens alone, in a batch, after a chunked prefill or while speculating.

Tiers (TIERS), best first; a process uses one (`tier()`):
  avx512    linear.cpp int8.cpp kquant.cpp (shared pieces in tiles.h), for CPUs with AVX-512 F/BW/VL/DQ/BF16/VBMI
  avx2      generic/*.cpp compiled for AVX2 + FMA + F16C
  portable  the same sources for the compiler's baseline ISA (x86-64, or whatever it targets elsewhere: aarch64):
            any CPU
  torch     no library: torch's own kernels on fixed-size row blocks (`blocked`)
Every native tier also compiles the sources written once for all of them: generic/attention.cpp (over the vector
traits of generic/lanes.h: 16 AVX-512 lanes in avx512, 8 in the others), pointwise.cpp, norm.cpp, rows.cpp,
attend_pass.cpp and block.cpp.
Each native tier is one shared library compiled with torch.utils.cpp_extension at first use, registering the same
op names under its own namespace, `torch.ops.colibri_<tier>.*` (-DCOLIBRI_NS; library.h), so tiers load side by
side in one process (tests compare them). The library is also a Python module of the same functions (pybind11,
named as the namespace; registry.cpp), which `library()` returns: a call there skips the dispatcher's parsing of
its arguments (about 1 us of a decode step's every op). They run on torch's own thread pool (at::parallel_for).
Why a JIT build: it needs only a C++ compiler and the `ninja` package at run time, takes 1-2 minutes once per
machine and torch version (docs/performance.md has the figures; progress on stderr), and the install stays `pip
install -e .` with no compile step or build isolation (a setup.py build would need torch in the build requirements
and would rebuild on every editable install). A ctypes library was ruled
out: its own OpenMP runtime beside torch's is a known trap (two pools oversubscribe the cores).

The cache and the build: kernels/build.py.

`COLIBRI_KERNELS` (read once per process; `use` overrides it in tests): `auto` (default; `native` is an alias):
the best tier this CPU runs whose build succeeds; `avx512`, `avx2`, `portable`: that tier (an error at start
where the CPU lacks it; a failed build falls down as auto would); `torch`: always the fallback. The fallback is
batch-invariant too, by other means (fixed-size row blocks; see `blocked`), so its own runs agree with
themselves; the native tiers give each other's bits (tests/test_tiers.py), the fallback's tokens can differ from
theirs in the last bits. `colibri kernels` lists all this.

LOSSY int8 activations (int8.cpp, opt-in: `EngineConfig.lossy_int8_activations`, `--lossy-int8-activations`, or
`COLIBRI_LOSSY_INT8=1`): q4 (and q4_1, q4_0: their f16 scales as stored), q8, q4k and q8k weights (the K-quants'
two-level scales decoded per group, as stored), and q6k, q3k and iq4_xs through q8k's kernels (their blocks decoded
to q8k's codes and scales), multiply activations quantized per row and per group (q8k: per 16) to int8 with int8 dot
products (AVX-512 VNNI in the avx512 tier; in the avx2 tier vpmaddubsw, or AVX-VNNI's vpdpbusd on passes of more
than 4 rows where the CPU has it; plain integer vectors in the portable one: the same bits in all), about twice the
arithmetic rate of the exact kernels on long passes. Still batch-invariant;
its quality cost is in docs/performance.md. A model's own: its passes run in the mode it was loaded with
(`int8_mode` around each, so a LOSSY model and an exact one share a process); a model loaded without the option
follows the process's setting (`set_int8_activations`, else COLIBRI_LOSSY_INT8). Where the tier in use has no int8
ops (Tier.int8) or the CPU lacks what they need, a one-line notice says so and the exact kernels run.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import platform
import threading

import torch

from colibri.core import log

# the build's names this package's users reach through it (tests, cli, the conftest's build of every tier)
from colibri.kernels.build import (OPS, Int8, KernelsUnavailable, NoCompiler, Tier,  # noqa: F401
                                   cache_root, compiler, ensure_built, is_built, library_path, load, notice, one_line,
                                   python_module, room_short_of_a_build, unity_source)

MODE_ENV = "COLIBRI_KERNELS"
LOSSY_INT8_ENV = "COLIBRI_LOSSY_INT8"
_GENERIC_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
BLOCK_ROWS = 16  # rows per call in the torch fallback: every GEMM it runs has exactly this many rows
GEMM_COLS = 64  # and a multiple of this many weight rows (`padded_linear`)
_GENERIC_SOURCES = ("generic/linear.cpp", "generic/kquant.cpp", "generic/attention.cpp", "generic/int8.cpp",
                    "pointwise.cpp", "norm.cpp", "rows.cpp", "attend_pass.cpp", "block.cpp", "registry.cpp")
_GENERIC_HEADERS = ("generic/simd.h", "generic/lanes.h", "generic/linear_steps.h", "generic/tiles.h",
                    "generic/int8_decode.h", "generic/int8_weights.h", "generic/q4_ops.h", "generic/gguf_blocks.h",
                    "args.h", "library.h", "stream.h", "parallel.h")
TIERS: dict[str, Tier] = {t.name: t for t in (
    Tier("avx512", "colibri_avx512", ("linear.cpp", "generic/attention.cpp", "int8.cpp", "kquant.cpp",
                                     "pointwise.cpp", "norm.cpp", "rows.cpp", "attend_pass.cpp", "block.cpp",
                                     "registry.cpp"),
         ("tiles.h", "args.h", "library.h", "stream.h", "parallel.h", "generic/simd.h", "generic/lanes.h",
          "generic/linear_steps.h", "generic/int8_decode.h", "generic/int8_weights.h", "generic/q4_ops.h",
          "generic/gguf_blocks.h"),
         ("-O3", "-fopenmp", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
          "-mavx512bf16", "-mavx512vbmi", "-mfma", "-mf16c"),
         ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512vbmi"),
         Int8(True, ("avx512_vnni",)), module=True, build_memory=2240 << 20),
    Tier("avx2", "colibri_avx2", _GENERIC_SOURCES, _GENERIC_HEADERS, (*_GENERIC_FLAGS, "-mavx2", "-mfma", "-mf16c"),
         ("avx2", "fma", "f16c"), Int8(True, faster_with=("avx_vnni",)), module=True),  # vpmaddubsw: AVX2 itself
    # no -m flags: the compiler's baseline ISA, which every CPU it targets runs
    Tier("portable", "colibri_portable", _GENERIC_SOURCES, _GENERIC_HEADERS, _GENERIC_FLAGS, (), Int8(True),
         module=True, build_memory=1952 << 20),
)}
NATIVE = tuple(TIERS)  # best first: the order auto tries them in
VALUES = ("auto", *NATIVE, "torch")  # what COLIBRI_KERNELS takes ("native": an alias of auto)


def _cpu_flags() -> set[str]:
    """The x86 CPU flags /proc/cpuinfo lists; none on any other machine (whose kernels are the portable tier's), even
    where it shows an x86 host's (qemu-user emulating aarch64 passes the host's file through)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()  # not x86 Linux: the portable tier only


def missing_flags(t: Tier) -> list[str]:
    """The CPU flags tier t needs that this CPU lacks."""
    have = _cpu_flags()
    return [f for f in t.cpu_flags if f not in have]


def runnable_tiers() -> list[str]:
    """The native tiers this CPU can run, best first (portable always)."""
    return [n for n in NATIVE if not missing_flags(TIERS[n])]


_lock_state = threading.RLock()  # resolution and loading: once, whichever thread asks first
_loaded: dict[str, object] = {}  # tier name -> its ops (the library's Python module)
_failed: dict[str, KernelsUnavailable] = {}  # tier name -> why it could not be loaded (not retried)


def tier_ops(name: str):
    """Tier `name`'s ops (its library's Python module), built and loaded on first call (cached); RuntimeError
    (KernelsUnavailable) with the reason where that is impossible."""
    if name not in NATIVE:
        raise ValueError(f"{name!r} is not a native kernel tier; the tiers are {', '.join(NATIVE)}")
    t = TIERS[name]
    with _lock_state:
        if name in _loaded:
            return _loaded[name]
        if name in _failed:
            raise _failed[name]
        missing = missing_flags(t)
        if missing:  # not cached: tests change the CPU flags _cpu_flags reports
            raise KernelsUnavailable(f"the {name} kernels need {', '.join(missing)}, which this CPU lacks")
        try:
            lib = load(t)
            _loaded[name] = python_module(t, lib) if t.module else getattr(torch.ops, t.ns)
        except KernelsUnavailable as e:
            _failed[name] = e
            raise
        except Exception as e:  # an unwritable log, a library that loads badly: the tier is out, the process not
            _failed[name] = KernelsUnavailable(f"the {name} kernels cannot be loaded ({one_line(e)})")
            raise _failed[name] from e
        return _loaded[name]


_override: str | None = None  # use(); None: COLIBRI_KERNELS decides
_tier: str | None = None  # the resolved tier of this process
_ops = None  # its ops


def _setting(value: str | None = None, source: str | None = None) -> str:
    """The tier setting (one of VALUES) from `value`, else use()'s override, else COLIBRI_KERNELS; ValueError
    (one line) for a value not understood, or a tier this CPU lacks."""
    if value is None:
        value = _override if _override is not None else os.environ.get(MODE_ENV, "")
        source = source or (f"kernels.use({_override!r})" if _override is not None else f"{MODE_ENV}={value}")
    v = value.strip().lower() or "auto"
    v = "auto" if v == "native" else v
    allowed = ", ".join(("auto", *runnable_tiers(), "torch"))
    if v not in VALUES:
        raise ValueError(f"{source} is not understood; use one of: {allowed}")
    if v in NATIVE and (missing := missing_flags(TIERS[v])):
        raise ValueError(f"{source}: the {v} kernels need {', '.join(missing)}, which this CPU lacks; use one of:"
                         f" {allowed}")
    return v


def check_env() -> str:
    """Check COLIBRI_KERNELS (and COLIBRI_LOSSY_INT8) without building anything, for a caller that wants a bad
    value to fail at start rather than in the first forward pass; returns the tier setting. ValueError (one line)."""
    _int8_env()
    return _setting()


def _resolve(setting: str) -> str:
    """The tier to use for `setting`: the first of its tiers, best first, that this CPU runs and that loads;
    each one passed over is a one-line notice (printed before the next one is tried, which may build)."""
    if setting == "torch":
        return "torch"
    pending: list[str] = []  # why the tiers passed over were, said once the next one is known
    no_compiler = False
    for name in NATIVE[NATIVE.index("avx512" if setting == "auto" else setting):]:
        t = TIERS[name]
        if missing := missing_flags(t):
            # a near miss (AVX-512 without BF16) is worth a word; a CPU with none of the flags is another kind
            # of CPU, whose best tier is simply a lower one
            if len(missing) < len(t.cpu_flags):
                pending.append(f"the {name} kernels need {', '.join(missing)}, which this CPU lacks")
            continue
        if no_compiler and not is_built(t):
            continue  # it would fail as the last one did
        if pending:
            notice(f"{'; '.join(pending)}; using the {name} kernels")
            pending = []
        try:
            tier_ops(name)
            return name
        except KernelsUnavailable as e:
            no_compiler = no_compiler or isinstance(e, NoCompiler)
            pending.append(str(e))
    if pending:
        notice(f"{'; '.join(pending)}; using the torch kernels")
    return "torch"


def tier() -> str:
    """The kernel tier of this process: 'avx512' | 'avx2' | 'portable' | 'torch' (resolved, and built, on first
    call; ValueError for a bad COLIBRI_KERNELS)."""
    global _tier, _ops
    if _tier is None:
        with _lock_state:
            if _tier is None:
                name = _resolve(_setting())
                _ops = None if name == "torch" else tier_ops(name)
                _tier = name
                log.debug(f"colibri: the {name} kernels run (COLIBRI_KERNELS={_setting()})")
    return _tier


def use(name: str | None) -> None:
    """Override the process's tier setting (a COLIBRI_KERNELS value; None: back to COLIBRI_KERNELS), resolved
    again at the next call. For tests; ValueError as for COLIBRI_KERNELS."""
    global _override, _tier, _ops
    with _lock_state:
        if name is not None:
            _setting(name, f"kernels.use({name!r})")
        _override, _tier, _ops = name, None, None
        _int8_usable.cache_clear()
        _int8_env.cache_clear()


def native() -> bool:
    """Whether a native tier is in use (builds it on first call)."""
    return tier() != "torch"


def library():
    """The ops of the tier in use, its library's Python module (callers check native() first)."""
    if not native():
        raise RuntimeError("the torch kernels are in use; they have no native ops")
    return _ops


def padded_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) (x [T, K], w [N, K]) -> [T, N] with every GEMM over a multiple of GEMM_COLS rows of w (its
    last rows zero-padded to one). torch's GEMMs take other kernels, with other roundings, for a handful of columns,
    and a streamed table's row blocks or a weight's last dequantized chunk can leave that few: the same row gave other
    bits there than in the resident weight. With more, each column's bits are the same whatever N (measured:
    docs/performance.md, "What the LOSSY decode's linears are bound by; the fallback's and the cache's fixes")."""
    n = w.shape[0]
    main = n - n % GEMM_COLS
    if main == n:
        return torch.nn.functional.linear(x, w)
    tail = torch.zeros(GEMM_COLS, w.shape[1], dtype=w.dtype)
    tail[:n - main] = w[main:]
    y = torch.empty(x.shape[0], n, dtype=torch.promote_types(x.dtype, w.dtype))
    if main:
        y[:, :main] = torch.nn.functional.linear(x, w[:main])
    y[:, main:] = torch.nn.functional.linear(x, tail)[:, :n - main]
    return y


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
# the mode of the passes running in this thread (int8_mode); None: the process's
_int8_scope: contextvars.ContextVar[bool | None] = contextvars.ContextVar("colibri_int8_scope", default=None)


def set_int8_activations(on: bool | None) -> None:
    """Turn the LOSSY int8-activation kernels on or off for this process (None: back to COLIBRI_LOSSY_INT8)."""
    global _int8_requested
    _int8_requested = None if on is None else bool(on)
    _int8_env.cache_clear()


@functools.cache
def _int8_env() -> bool:
    """COLIBRI_LOSSY_INT8, read once (every linear asks; `use` and `set_int8_activations` read it again)."""
    v = os.environ.get(LOSSY_INT8_ENV, "").strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{LOSSY_INT8_ENV}={v!r} is not understood; use 1 or 0")


def int8_status(name: str) -> tuple[bool, str]:
    """Whether tier `name`'s LOSSY int8 ops can run on this CPU, and where not, why (a phrase)."""
    if name == "torch":
        return False, "the torch kernels have none"
    spec = TIERS[name].int8
    if not spec.usable:
        return False, f"the {name} kernels have none yet"
    have = _cpu_flags()
    missing = [f for f in (*TIERS[name].cpu_flags, *spec.cpu_flags) if f not in have]
    if missing:
        return False, f"this CPU lacks {', '.join(missing)}"
    return True, ""


@functools.cache
def _int8_usable() -> bool:
    ok, why = int8_status(tier())
    if not ok:
        notice(f"lossy int8 activations are unavailable ({why}); using the exact kernels")
    return ok


@contextlib.contextmanager
def int8_mode(on: bool | None):
    """The LOSSY int8-activation mode of the linears run inside, in this thread: a model's passes run in the mode
    it was loaded with (DecoderModel.forward); None: the process's (set_int8_activations, else COLIBRI_LOSSY_INT8)."""
    token = _int8_scope.set(on)
    try:
        yield
    finally:
        _int8_scope.reset(token)


def int8_activations() -> bool:
    """Whether q4 / q8 linears use the LOSSY int8-activation kernels now (requested, by the model running or the
    process, and the tier in use has them for this CPU)."""
    on = _int8_scope.get()
    if on is None:
        on = _int8_env() if _int8_requested is None else _int8_requested
    return on and _int8_usable()


def int8_supports(k: int, group_size: int) -> bool:
    """Whether the int8 kernels take a weight with K inputs and this group size (0: q8 per channel; 16: q8k's
    scale groups, its activations quantized per 16); the exact kernels run the others."""
    return k % 64 == 0 and group_size in (0, 16, 32, 64, 128, 256)


def describe() -> dict:
    """What `colibri kernels` lists, building nothing: the CPU's relevant flags, each tier (runnable, missing
    flags, built, its library, LOSSY int8), the setting and which tier it picks and why, and auto's pick (a
    prediction: a build that has not run yet may still fail)."""
    have = _cpu_flags()
    relevant = dict.fromkeys(f for t in TIERS.values() for f in (*t.cpu_flags, *t.int8.cpu_flags, *t.int8.faster_with))
    tiers = []
    for name in (*NATIVE, "torch"):
        ok8, why8 = int8_status(name)
        faster = [f for f in TIERS[name].int8.faster_with if f in have] if ok8 else []  # (torch: never ok8)
        row = dict(name=name, runnable=True, missing=[], built=None, library=None, error=None,
                   int8=dict(usable=ok8, why=why8, faster_with=faster))
        if name != "torch":
            t = TIERS[name]
            row["missing"] = missing_flags(t)
            row["runnable"] = not row["missing"]
            try:
                row["library"] = str(library_path(t))
                row["built"] = is_built(t)
            except KernelsUnavailable as e:
                row["built"], row["error"] = False, str(e)
        tiers.append(row)
    setting = _setting()
    rows = {r["name"]: r for r in tiers}
    return dict(cpu_flags={f: f in have for f in relevant}, setting=setting, compiler=compiler(), tiers=tiers,
                pick=_predict(setting, rows), auto=_predict("auto", rows))


def _predict(setting: str, rows: dict) -> dict:
    """Which tier `setting` would pick, and why, from the listing alone (_resolve's walk without building)."""
    if setting == "torch":
        return dict(tier="torch", why=f"{MODE_ENV}=torch")
    passed = []
    start = "avx512" if setting == "auto" else setting
    for name in NATIVE[NATIVE.index(start):]:
        r = rows[name]
        if not r["runnable"]:
            passed.append(f"{name} needs {', '.join(r['missing'])}")
        elif r["built"]:
            return dict(tier=name, why="; ".join([*passed, f"{name} is built"]))
        elif r["error"]:
            passed.append(r["error"])
        elif compiler() is None:
            passed.append(f"{name} is not built and there is no C++ compiler")
        elif (left := room_short_of_a_build(TIERS[name])) is not None:
            passed.append(f"{name} is not built and this memory cgroup leaves {left} MiB of the"
                          f" {TIERS[name].build_memory >> 20} its build takes (`colibri kernels --build` outside it"
                          " builds it)")
        else:
            return dict(tier=name, why="; ".join([*passed, f"{name} is not built yet: the first use builds it"
                                                            " (1-2 minutes), or falls to the next tier if that fails"]))
    return dict(tier="torch", why="; ".join(passed))

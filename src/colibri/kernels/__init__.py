"""Batch-invariant compute kernels: the native kernel tiers, how they are built and found, and the torch fallback.

Every kernel here gives each output row bit-identical results whatever the number of rows in the pass, so a
sequence decodes the same tokens alone, in a batch, after a chunked prefill or while speculating.

Tiers (TIERS), best first; a process uses one (`tier()`):
  avx512    linear.cpp attention.cpp int8.cpp kquant.cpp pointwise.cpp (shared pieces in tiles.h), for CPUs with
            AVX-512 F/BW/VL/DQ/BF16/VBMI
  avx2      generic/*.cpp and pointwise.cpp compiled for AVX2 + FMA + F16C
  portable  the same sources for the compiler's baseline ISA (x86-64, or whatever it targets elsewhere: aarch64):
            any CPU
  torch     no library: torch's own kernels on fixed-size row blocks (`blocked`)
Each native tier is one shared library compiled with torch.utils.cpp_extension at first use, registering the same
op names under its own namespace, `torch.ops.colibri_<tier>.*` (-DCOLIBRI_NS; library.h), so tiers load side by
side in one process (tests compare them). They run on torch's own thread pool (at::parallel_for). Why a JIT build:
it needs only a C++ compiler and the `ninja` package at run time, takes 1-2 minutes once per machine and torch
version (docs/performance.md has the figures; progress on stderr), and the install stays `pip install -e .` with no compile step or build isolation (a setup.py build would
need torch in the build requirements and would rebuild on every editable install). A ctypes library was ruled
out: its own OpenMP runtime beside torch's is a known trap (two pools oversubscribe the cores).

The cache: `defaults.cache_dir()/kernels/torch<version>-<tier>-<hash of flags, sources and headers>/`. A build
runs in a child process (its compiler output kept in build.log there), in a temporary directory, under a file
lock (one process builds, the others wait and load its result); the library is renamed into place with its
sha256 beside it, so a killed build never leaves a library that looks valid, and a damaged one (truncated: its
loading would crash the process) is removed and rebuilt once. An unwritable cache builds in a private temporary
directory, not kept. A tier that cannot be had (no compiler, a compile error, a library that will not load) is
one notice on stderr, and the next tier down.

`COLIBRI_KERNELS` (read once per process; `use` overrides it in tests): `auto` (default; `native` is an alias):
the best tier this CPU runs whose build succeeds; `avx512`, `avx2`, `portable`: that tier (an error at start
where the CPU lacks it; a failed build falls down as auto would); `torch`: always the fallback. The fallback is
batch-invariant too, by other means (fixed-size row blocks; see `blocked`), so its own runs agree with
themselves; the native tiers give each other's bits (tests/test_tiers.py), the fallback's tokens can differ from
theirs in the last bits. `colibri kernels` lists all this.

LOSSY int8 activations (int8.cpp, opt-in: `EngineConfig.lossy_int8_activations`, `--lossy-int8-activations`, or
`COLIBRI_LOSSY_INT8=1`): q4, q8, q4k and q8k weights (the K-quants' two-level scales decoded per group, as
stored) multiply activations quantized per row and per group (q8k: per 16) to int8 with int8 dot products
(AVX-512 VNNI in the avx512 tier, vpmaddubsw in the avx2 tier, plain integer vectors in the portable one: the
same bits in all), about twice the arithmetic rate of the exact kernels on long passes. Still
batch-invariant; its quality cost is in docs/performance.md. Process-wide, like the kernel tier: once set, every
model in the process uses it. Where the tier in use has no int8 ops (Tier.int8) or the CPU lacks what they need,
a one-line notice says so and the exact kernels run.
"""

from __future__ import annotations

import atexit
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

MODE_ENV = "COLIBRI_KERNELS"
LOSSY_INT8_ENV = "COLIBRI_LOSSY_INT8"
HERE = Path(__file__).parent
# the ops every native tier registers (same names and signatures in each); a build that lacks one failed
OPS = ("q4_linear", "q8_linear", "dense_linear", "q4k_linear", "q8k_linear", "attend", "pointwise", "q4_linear_i8",
       "q8_linear_i8", "q4k_linear_i8", "q8k_linear_i8")
# -fopenmp: at::parallel_for is a header template whose OpenMP region compiles to a serial loop without it (the
# kernels then used one core of two); the library links the libgomp.so.1 torch has already loaded.
_LDFLAGS = ("-fopenmp",)
_GENERIC_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
BLOCK_ROWS = 16  # rows per call in the torch fallback: every GEMM it runs has exactly this many rows
PROGRESS_S = 15  # seconds between the progress lines of a build
BUILD_TIMEOUT_S = 1800  # a build still running after this is stopped (a wedged compiler must not hang a process)


@dataclasses.dataclass(frozen=True)
class Int8:
    """A tier's LOSSY int8-activation ops (q4_linear_i8, q8_linear_i8): whether they may be used, and the CPU
    flags they need beyond the tier's own."""
    usable: bool
    cpu_flags: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Tier:
    """One native kernel library: its sources and headers (relative to src_dir; all part of the build's
    identity), compiler flags, the torch namespace it registers (-DCOLIBRI_NS) and the CPU flags it needs."""
    name: str
    ns: str
    sources: tuple[str, ...]
    headers: tuple[str, ...]
    flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    int8: Int8
    src_dir: Path = HERE
    ops: tuple[str, ...] = OPS


_GENERIC_SOURCES = ("generic/linear.cpp", "generic/kquant.cpp", "generic/attention.cpp", "generic/int8.cpp",
                    "pointwise.cpp")
_GENERIC_HEADERS = ("generic/simd.h", "generic/tiles.h", "generic/int8_decode.h", "args.h", "library.h", "stream.h")
TIERS: dict[str, Tier] = {t.name: t for t in (
    Tier("avx512", "colibri_avx512", ("linear.cpp", "attention.cpp", "int8.cpp", "kquant.cpp", "pointwise.cpp"),
         ("tiles.h", "args.h", "library.h", "stream.h", "generic/simd.h", "generic/int8_decode.h"),
         ("-O3", "-fopenmp", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
          "-mavx512bf16", "-mavx512vbmi", "-mfma", "-mf16c"),
         ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512vbmi"),
         Int8(True, ("avx512_vnni",))),
    Tier("avx2", "colibri_avx2", _GENERIC_SOURCES, _GENERIC_HEADERS, (*_GENERIC_FLAGS, "-mavx2", "-mfma", "-mf16c"),
         ("avx2", "fma", "f16c"), Int8(True)),  # vpmaddubsw: AVX2 itself
    # no -m flags: the compiler's baseline ISA, which every CPU it targets runs
    Tier("portable", "colibri_portable", _GENERIC_SOURCES, _GENERIC_HEADERS, _GENERIC_FLAGS, (), Int8(True)),
)}
NATIVE = tuple(TIERS)  # best first: the order auto tries them in
VALUES = ("auto", *NATIVE, "torch")  # what COLIBRI_KERNELS takes ("native": an alias of auto)


class KernelsUnavailable(RuntimeError):
    """A native tier cannot be used here; the message is one line that says why."""


class NoCompiler(KernelsUnavailable):
    """No C++ compiler: every tier that is not built yet fails the same way."""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()  # not x86 Linux: the portable tier only


def notice(msg: str) -> None:
    """One line on stderr about how the kernels run (a tier that cannot be had, a mode that does not apply)."""
    print(f"colibri: {msg}", file=sys.stderr, flush=True)


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def missing_flags(t: Tier) -> list[str]:
    """The CPU flags tier t needs that this CPU lacks."""
    have = _cpu_flags()
    return [f for f in t.cpu_flags if f not in have]


def runnable_tiers() -> list[str]:
    """The native tiers this CPU can run, best first (portable always)."""
    return [n for n in NATIVE if not missing_flags(TIERS[n])]


def cache_root() -> Path:
    from colibri.core.defaults import cache_dir
    return cache_dir() / "kernels"


def library_path(t: Tier, root: Path | None = None) -> Path:
    """Where tier t's library is cached under root (default cache_root()); KernelsUnavailable where a source
    cannot be read (its hash names the directory)."""
    h = hashlib.sha256("\0".join((t.ns, *t.flags, *_LDFLAGS)).encode())
    for name in t.sources + t.headers:
        try:
            data = (t.src_dir / name).read_bytes()
        except OSError as e:
            raise KernelsUnavailable(f"the {t.name} kernels' source {name} cannot be read ({e.strerror})") from e
        h.update(name.encode() + b"\0" + data)
    d = (root or cache_root()) / f"torch{torch.__version__}-{t.name}-{h.hexdigest()[:12]}"
    return d / f"{t.ns}.so"


def _checksum_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _damage(lib: Path) -> str | None:
    """Why the cached library cannot be loaded safely (None: intact). Checked before dlopen, which would not
    raise on a truncated library but crash the process (SIGBUS) when it touches the missing pages."""
    try:
        want = _checksum_path(lib).read_text().strip()
    except OSError:
        return "its checksum file is missing"
    try:
        if _sha256(lib) != want:
            return f"its checksum does not match ({lib.stat().st_size} bytes)"
    except OSError as e:
        return f"it cannot be read: {e.strerror}"
    return None


def is_built(t: Tier, root: Path | None = None) -> bool:
    """Whether tier t's library is in the cache, intact (loading nothing)."""
    try:
        lib = library_path(t, root)
    except KernelsUnavailable:
        return False
    return lib.is_file() and _damage(lib) is None


def compiler() -> str | None:
    """The C++ compiler a build would run (cpp_extension's choice: $CXX, else c++), as a path; None if absent."""
    return shutil.which(os.environ.get("CXX") or "c++")


# The build, in a child process: its compiler output goes to the log whole, a crash or a wedged compiler cannot
# take the caller down with it, and loading the result there (then checking its ops) tests the library before
# it is published. A fresh process also keeps cpp_extension's in-process version counter out of the way.
_CHILD = r"""
import json, sys
import torch
from torch.utils import cpp_extension
a = json.loads(sys.argv[1])
cpp_extension.load(a["name"], a["sources"], extra_cflags=a["cflags"], extra_ldflags=a["ldflags"],
                   build_directory=a["dir"], is_python_module=False, verbose=True)
ns = getattr(torch.ops, a["ns"])
for op in a["ops"]:
    getattr(ns, op)  # raises where the library does not register the op
"""


def _first_error(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    for ln in lines:  # a compiler's or linker's first complaint is the cause; the rest follows from it
        if re.search(r"\berror\b:", ln):
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def unity_source(t: Tier) -> str:
    """The one translation unit a tier is built as: its sources, each #included (compiled with -I t.src_dir).
    torch's headers, which every source includes, take most of a source's compile time: parsed once, the build
    takes about a third of the CPU time of one unit per source (the sources share one anonymous namespace, so
    no two may define the same name)."""
    return "".join(f'#include "{s}"\n' for s in t.sources)


def _compile(t: Tier, d: Path, notice) -> Path:
    """Build tier t into directory d (which the caller owns: under the lock, or private) -> the library."""
    lib = d / f"{t.ns}.so"
    log = d / "build.log"
    cxx = os.environ.get("CXX") or "c++"
    if compiler() is None:
        log.write_text(f"no C++ compiler: {cxx!r} is not found on PATH={os.environ.get('PATH', '')}\n")
        raise NoCompiler(f"the {t.name} kernels cannot be built: no C++ compiler found ({cxx!r} is not on PATH;"
                         f" install g++ or set CXX); log: {log}")
    for stale in d.glob("tmp-*"):  # a killed build's; nobody else builds here while the caller holds the lock
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix="tmp-", dir=d))
    name = t.ns + "_build"
    unity = tmp / f"{t.ns}.cpp"
    unity.write_text(unity_source(t))
    job = json.dumps(dict(name=name, sources=[str(unity)],
                          cflags=[*t.flags, f"-I{t.src_dir}", f"-DCOLIBRI_NS={t.ns}"], ldflags=list(_LDFLAGS),
                          dir=str(tmp), ns=t.ns, ops=list(t.ops)))
    # cpp_extension runs `ninja` from PATH: the environment's own bin first, where pip put it, even when the
    # environment is not activated
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    notice(f"building the {t.name} kernels (once per machine and torch version, 1-2 minutes)...")
    t0 = time.monotonic()
    with open(log, "w") as out:
        child = subprocess.Popen([sys.executable, "-c", _CHILD, job], stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, env=env)
        try:
            while True:
                try:
                    rc = child.wait(timeout=PROGRESS_S)
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() - t0 > BUILD_TIMEOUT_S:
                        raise KernelsUnavailable(f"the {t.name} kernels' build ran over {BUILD_TIMEOUT_S} s and was"
                                                 f" stopped; log: {log}") from None
                    notice(f"building the {t.name} kernels: {time.monotonic() - t0:.0f} s")
        finally:
            if child.poll() is None:  # stopped, interrupted: the compiler goes too
                child.kill()
                child.wait()
    if rc != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise KernelsUnavailable(f"the {t.name} kernels failed to build ({_first_error(log)}); full log: {log}")
    built = tmp / f"{name}.so"
    # the checksum first, then the library: a library in place always has its checksum beside it
    (tmp / "sha256").write_text(_sha256(built) + "\n")
    os.replace(tmp / "sha256", _checksum_path(lib))
    os.replace(built, lib)
    shutil.rmtree(tmp, ignore_errors=True)
    notice(f"built the {t.name} kernels in {time.monotonic() - t0:.0f} s ({lib})")
    return lib


def _lock(f, t: Tier, notice) -> None:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        notice(f"another process is building the {t.name} kernels; waiting for it")
        fcntl.flock(f, fcntl.LOCK_EX)  # released by the kernel if that process dies


def _build(t: Tier, lib: Path, notice) -> Path:
    """A fresh, intact library of tier t: built into lib's directory under its lock, or where that directory
    cannot be written, into a private temporary one."""
    d = lib.parent
    try:
        d.mkdir(parents=True, exist_ok=True)
        lock = open(d / "build.lock", "a")
    except OSError as e:
        notice(f"the kernel cache {d.parent} is not writable ({e.strerror or e}); building the {t.name} kernels in"
               f" a private temporary directory, not kept (set COLIBRI_CACHE to a writable directory to keep them)")
        private = Path(tempfile.mkdtemp(prefix=f"colibri-kernels-{t.name}-"))
        built = _compile(t, private, notice)  # on failure the directory stays: its log is named in the notice
        atexit.register(shutil.rmtree, private, True)
        return built
    with lock:
        _lock(lock, t, notice)
        if lib.is_file():
            if _damage(lib) is None:
                return lib  # another process built it while this one waited
            lib.unlink()  # damaged: gone before anything else, whatever happens to the rebuild
        _checksum_path(lib).unlink(missing_ok=True)
        return _compile(t, d, notice)


def load(t: Tier, root: Path | None = None, notice=notice) -> Path:
    """Load tier t's library into torch.ops (namespace t.ns), building it first where it is not cached intact
    under root (default cache_root()); a damaged one is removed and rebuilt once. Returns the library's path;
    KernelsUnavailable (one line) where it cannot be had. Load a namespace once per process: a second copy of
    a library registering it would abort the process."""
    lib = ensure_built(t, root, notice)
    torch.ops.load_library(str(lib))
    return lib


def ensure_built(t: Tier, root: Path | None = None, notice=notice) -> Path:
    """Tier t's library in the cache under root, intact: built, or removed and rebuilt once where damaged;
    not loaded (several tiers may build side by side, each in its own child process). KernelsUnavailable (one
    line) where it cannot be had."""
    lib = library_path(t, root)
    if lib.is_file():
        why = _damage(lib)
        if why is None:
            return lib
        notice(f"the {t.name} kernels' library {lib} is damaged ({why}); rebuilding it")
    return _build(t, lib, notice)


_lock_state = threading.RLock()  # resolution and loading: once, whichever thread asks first
_loaded: dict[str, object] = {}  # tier name -> its torch.ops namespace
_failed: dict[str, KernelsUnavailable] = {}  # tier name -> why it could not be loaded (not retried)


def tier_ops(name: str):
    """Tier `name`'s torch.ops namespace, built and loaded on first call (cached); RuntimeError
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
            load(t)
        except KernelsUnavailable as e:
            _failed[name] = e
            raise
        except Exception as e:  # an unwritable log, a library that loads badly: the tier is out, the process not
            _failed[name] = KernelsUnavailable(f"the {name} kernels cannot be loaded ({_one_line(e)})")
            raise _failed[name] from e
        _loaded[name] = getattr(torch.ops, t.ns)
        return _loaded[name]


_override: str | None = None  # use(); None: COLIBRI_KERNELS decides
_tier: str | None = None  # the resolved tier of this process
_ops = None  # its torch.ops namespace


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


def native() -> bool:
    """Whether a native tier is in use (builds it on first call)."""
    return tier() != "torch"


def library():
    """The torch.ops namespace of the tier in use (callers check native() first)."""
    if not native():
        raise RuntimeError("the torch kernels are in use; they have no native ops")
    return _ops


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


def int8_activations() -> bool:
    """Whether q4 / q8 linears use the LOSSY int8-activation kernels now (requested, and the tier in use has
    them for this CPU)."""
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
    relevant = dict.fromkeys(f for t in TIERS.values() for f in (*t.cpu_flags, *t.int8.cpu_flags))
    tiers = []
    for name in (*NATIVE, "torch"):
        ok8, why8 = int8_status(name)
        row = dict(name=name, runnable=True, missing=[], built=None, library=None, error=None,
                   int8=dict(usable=ok8, why=why8))
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
        else:
            return dict(tier=name, why="; ".join([*passed, f"{name} is not built yet: the first use builds it"
                                                            " (1-2 minutes), or falls to the next tier if that fails"]))
    return dict(tier="torch", why="; ".join(passed))

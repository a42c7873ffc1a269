"""Building and caching a native kernel tier's library (the tiers themselves and the choice among them: the
package's __init__).

The cache: `defaults.cache_dir()/kernels/torch<version>-<tier>-<hash of flags, sources and headers>/`. A build
runs in a child process (its compiler output kept in build.log there), in a temporary directory, under a file
lock (one process builds, the others wait and load its result); the library is renamed into place with its
sha256 beside it, so a killed build never leaves a library that looks valid, and a damaged one (truncated: its
loading would crash the process) is removed and rebuilt once. An unwritable cache builds in a private temporary
directory, not kept. A tier that cannot be had (no compiler, a compile error, a library that will not load) is
one notice on stderr, and the next tier down.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from colibri.core import log
from colibri.core.metrics import cgroup_memory_limit, rss_bytes

HERE = Path(__file__).parent
# the ops every native tier registers (same names and signatures in each: registry.cpp, the last source of every
# tier, lists them once); a build that lacks one failed
OPS = tuple(re.findall(r"^  X\((\w+), ", (HERE / "registry.cpp").read_text(), re.M))
# -fopenmp: at::parallel_for is a header template whose OpenMP region compiles to a serial loop without it (the
# kernels then used one core of two); the library links the libgomp.so.1 torch has already loaded.
_LDFLAGS = ("-fopenmp",)
PROGRESS_S = 15  # seconds between the progress lines of a build
BUILD_TIMEOUT_S = 1800  # a build still running after this is stopped (a wedged compiler must not hang a process)
# What a tier's build takes where its Tier does not say (Tier.build_memory): the compiler's peak on the one unity
# source (docs/performance.md, "A build where the memory cgroup has no room for it"). Under a cgroup memory limit
# that leaves less beside this process, the compiler would thrash for the whole timeout or be killed: the build is
# not started.
BUILD_MEMORY = 1792 << 20


@dataclasses.dataclass(frozen=True)
class Int8:
    """A tier's LOSSY int8-activation ops (q4_linear_i8, q8_linear_i8): whether they may be used, and the CPU
    flags they need beyond the tier's own."""
    usable: bool
    cpu_flags: tuple[str, ...] = ()
    # flags the ops use where the CPU has them (the library asks the CPU itself: no build per flag), same bits
    faster_with: tuple[str, ...] = ()


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
    module: bool = False  # the library is also a Python module of its ops (registry.cpp), which callers use
    build_memory: int = BUILD_MEMORY  # bytes its build takes at its peak, with a margin



class KernelsUnavailable(RuntimeError):
    """A native tier cannot be used here; the message is one line that says why."""


class NoCompiler(KernelsUnavailable):
    """No C++ compiler: every tier that is not built yet fails the same way."""


def notice(msg: str) -> None:
    """One line on stderr about how the kernels run (a tier that cannot be had, a mode that does not apply)."""
    log.notice(f"colibri: {msg}")


def one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


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
if a["module"]:
    from colibri.kernels.build import module_of
    mod = module_of(a["ns"], a["lib"])  # None where the build had no Python headers
    for op in a["ops"] if mod is not None else ():
        getattr(mod, op)
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


def room_short_of_a_build(t: Tier) -> int | None:
    """MiB this process's cgroup memory limit leaves beside its resident memory where that is less than tier t's
    build takes (t.build_memory); None where the build fits or there is no limit."""
    limit = cgroup_memory_limit()
    room = None if limit is None else limit - rss_bytes()
    return None if room is None or room >= t.build_memory else max(room, 0) >> 20


def _compile(t: Tier, d: Path, notice) -> Path:
    """Build tier t into directory d (which the caller owns: under the lock, or private) -> the library."""
    lib = d / f"{t.ns}.so"
    log = d / "build.log"
    cxx = os.environ.get("CXX") or "c++"
    if compiler() is None:
        log.write_text(f"no C++ compiler: {cxx!r} is not found on PATH={os.environ.get('PATH', '')}\n")
        raise NoCompiler(f"the {t.name} kernels cannot be built: no C++ compiler found ({cxx!r} is not on PATH;"
                         f" install g++ or set CXX); log: {log}")
    left = room_short_of_a_build(t)
    if left is not None:
        log.write_text(f"not built: the memory cgroup leaves {left} MiB beside this process; the build takes about"
                       f" {t.build_memory >> 20} MiB\n")
        raise KernelsUnavailable(f"the {t.name} kernels are not built inside this memory limit: building them takes"
                                 f" about {t.build_memory >> 20} MiB and the cgroup leaves {left} MiB;"
                                 f" run `colibri kernels --build` once outside it (COLIBRI_KERNELS={t.name}); log:"
                                 f" {log}")
    for stale in d.glob("tmp-*"):  # a killed build's; nobody else builds here while the caller holds the lock
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix="tmp-", dir=d))
    name = t.ns + "_build"
    unity = tmp / f"{t.ns}.cpp"
    unity.write_text(unity_source(t))
    job = json.dumps(dict(name=name, sources=[str(unity)],
                          cflags=[*t.flags, f"-I{t.src_dir}", f"-DCOLIBRI_NS={t.ns}"], ldflags=list(_LDFLAGS),
                          dir=str(tmp), ns=t.ns, ops=list(t.ops), module=t.module, lib=str(tmp / f"{name}.so")))
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


def module_of(ns: str, lib: str | Path):
    """The Python module the (loaded) library lib also is, named ns (registry.cpp); None where it is none (built
    without Python's headers: no PyInit_<ns>)."""
    try:
        ctypes.CDLL(str(lib))[f"PyInit_{ns}"]
    except AttributeError:
        return None
    loader = importlib.machinery.ExtensionFileLoader(ns, str(lib))
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(ns, loader))
    loader.exec_module(mod)  # (pybind11's modules initialize in two phases: this runs the ops' definitions)
    return mod


def python_module(t: Tier, lib: Path):
    """Tier t's ops as the Python module its library also is (t.module; registry.cpp), lib already loaded by
    `load`: the same functions as torch.ops.<t.ns>, called without the dispatcher's argument parsing. A library
    built without Python's headers (a system Python without its -dev package) is no module: its torch.ops
    namespace then (the same ops, each call about 1 us slower)."""
    mod = module_of(t.ns, lib)
    if mod is None:
        log.debug(f"colibri: the {t.name} kernels were built without Python's headers; calling them through torch.ops")
        return getattr(torch.ops, t.ns)
    return mod


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


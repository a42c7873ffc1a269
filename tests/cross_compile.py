"""The portable kernel tier cross-compiled for aarch64 (tests/test_tiers.py checks the result), started as soon as
the session knows it will run that test (conftest), so the compile, most of a minute of one core, overlaps the
tests before it instead of adding to the suite's time."""

from __future__ import annotations

import atexit
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

TEST = "test_portable_tier_compiles_for_aarch64"
_job: tuple[subprocess.Popen, Path, Path] | None = None


def compiler() -> str | None:
    return shutil.which("aarch64-linux-gnu-g++")


def start() -> None:
    """Start the compile (once; nothing without the cross compiler): the tier's one translation unit, as the build
    makes it, to an object file."""
    global _job
    cxx = compiler()
    if _job is not None or cxx is None:
        return
    from torch.utils import cpp_extension

    from colibri import kernels

    tier = kernels.TIERS["portable"]
    d = Path(tempfile.mkdtemp(prefix="colibri-aarch64-"))
    atexit.register(shutil.rmtree, d, True)
    unity, obj, log = d / "portable.cpp", d / "portable.o", d / "build.log"
    unity.write_text(kernels.unity_source(tier))
    inc = [f"-isystem{p}" for p in cpp_extension.include_paths()] + [f"-isystem{sysconfig.get_paths()['include']}"]
    cmd = [cxx, "-std=c++17", "-O2", "-fopenmp", "-ffp-contract=off", "-DCOLIBRI_NS=colibri_portable",
           f"-I{tier.src_dir}", *inc, "-c", str(unity), "-o", str(obj)]
    with open(log, "w") as out:  # a file, not a pipe: nobody reads until the test asks
        _job = (subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT), obj, log)


def result() -> tuple[int, str, Path]:
    """(exit status, compiler output, object file), waiting for the compile started by `start` (started here if
    it was not)."""
    start()
    assert _job is not None, "no aarch64 cross compiler"
    proc, obj, log = _job
    rc = proc.wait(timeout=600)
    return rc, log.read_text(errors="replace"), obj

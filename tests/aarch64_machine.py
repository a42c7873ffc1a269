"""The portable kernel tier built for aarch64 once per test session, and the emulated aarch64 machine that runs it.

Two test files use it: tests/test_tiers.py disassembles the cross-compiled tier (NEON fma for the exact steps), and
tests/test_tier_aarch64.py runs it under qemu-user in the environment tools/aarch64_env.py sets up (.ci/run makes it
in .ci/aarch64; COLIBRI_AARCH64_ENV names another). The cross compile of the tier's one translation unit takes
about a minute and a half and an emulated Python's `import torch` about fifteen seconds, so both happen once: one
compile serves both files, and one emulated interpreter runs every piece of code the tests send it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sysconfig
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENV = Path(os.environ.get("COLIBRI_AARCH64_ENV") or REPO / ".ci" / "aarch64")
CXX = "aarch64-linux-gnu-g++"

# The emulated interpreter's loop: a JSON line {"code", "args"} in, a JSON line {"out", "error"} out after MARK, its
# first argument (a line without it is something a library wrote to the file descriptor itself); the code runs as a
# script would (its own globals, sys.argv = ["-c", *args]) with what it prints captured.
MARK = "\x1eaarch64-reply "
SERVE = """
import contextlib, io, json, sys, traceback
out, MARK = sys.stdout, sys.argv[1]
for line in iter(sys.stdin.readline, ""):
    req, buf, error = json.loads(line), io.StringIO(), None
    sys.argv = ["-c", *req["args"]]
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(req["code"], "<aarch64>", "exec"), {"__name__": "__main__"})
    except BaseException:
        error = traceback.format_exc()
    out.write(MARK + json.dumps({"out": buf.getvalue(), "error": error}) + "\\n")
    out.flush()
"""


class Unavailable(Exception):
    """What the tests lack to build or run the tier on aarch64 (their skip reason)."""


class Machine:
    """The portable tier cross-compiled for aarch64 (`binary`: the loadable library where the emulated machine is
    set up, else an object file), and `run(code, *args)` on that machine (None without it)."""

    def __init__(self, root: Path):
        from colibri import kernels

        if shutil.which(CXX) is None:
            raise Unavailable(f"no aarch64 cross compiler ({CXX}; apt-get install g++-aarch64-linux-gnu)")
        self.tier = kernels.TIERS["portable"]
        self._proc = None
        self.why_no_machine = None
        if not (ENV / "ready").is_file():
            self.why_no_machine = f"no emulated aarch64 environment at {ENV} (python tools/aarch64_env.py {ENV})"
        elif shutil.which("qemu-aarch64") is None:
            self.why_no_machine = "no qemu-aarch64 (apt-get install qemu-user)"
        if self.why_no_machine:
            self.binary = self._compile_object(root)
        else:
            self._start(root)
            self.binary = self._build_library()

    # -- building --------------------------------------------------------------------------------------------

    def _cxx(self, cmd: list[str], what: str) -> None:
        p = subprocess.run([CXX, "-std=c++17", *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=900)
        assert p.returncode == 0, f"the portable tier does not {what} for aarch64:\n{p.stdout[-3000:]}"

    def _compile_object(self, root: Path) -> Path:
        """Without the emulated machine: the tier's translation unit to an object file against this machine's torch
        headers, without the Python module (registry.cpp needs the target's Python headers, which a Debian Python's
        multiarch pyconfig.h asks for and this machine lacks; its code is plain pybind11, built on every x86 run)."""
        from torch.utils import cpp_extension

        from colibri import kernels

        inc = [f"-isystem{p}" for p in cpp_extension.include_paths()]
        unity, obj = root / "portable.cpp", root / "portable.o"
        unity.write_text(kernels.unity_source(self.tier))
        self._cxx([*self.tier.flags, f"-DCOLIBRI_NS={self.tier.ns}", "-DCOLIBRI_NO_PYTHON_MODULE",
                   f"-I{self.tier.src_dir}", *inc, f"-isystem{sysconfig.get_paths()['include']}", "-c", str(unity),
                   "-o", str(obj)], "compile")
        return obj

    def _build_library(self) -> Path:
        """The tier's library, Python module included, linked against the emulated machine's aarch64 torch, in the
        kernel cache that machine's colibri reads (with the checksum the build writes beside a library)."""
        from colibri import kernels
        from colibri.kernels import build

        where = json.loads(self.run("import json, torch; from colibri.kernels import TIERS, build; print(json.dumps("
                                    "{'lib': str(build.library_path(TIERS['portable'])), 'torch': torch.__path__[0],"
                                    " 'abi': int(torch._C._GLIBCXX_USE_CXX11_ABI)}))").splitlines()[-1])
        lib, th = Path(where["lib"]), Path(where["torch"])
        lib.parent.mkdir(parents=True)
        unity = lib.parent / "unity.cpp"
        unity.write_text(kernels.unity_source(self.tier))
        py = ENV / "root" / "usr" / "include"  # Python.h, and the aarch64 pyconfig.h it includes
        self._cxx(["-fPIC", "-shared", *self.tier.flags, f"-D_GLIBCXX_USE_CXX11_ABI={where['abi']}",
                   f"-DCOLIBRI_NS={self.tier.ns}", f"-I{self.tier.src_dir}", f"-isystem{th / 'include'}",
                   f"-isystem{th / 'include' / 'torch' / 'csrc' / 'api' / 'include'}", f"-isystem{py / 'python3.11'}",
                   f"-isystem{py}", str(unity), "-o", str(lib), f"-L{th / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch",
                   "-ltorch_python"], "build")
        build._checksum_path(lib).write_text(build._sha256(lib) + "\n")
        return lib

    # -- the emulated interpreter ----------------------------------------------------------------------------

    def _start(self, root: Path) -> None:
        env = {**os.environ, "COLIBRI_CACHE": str(root / "cache"), "COLIBRI_KERNELS": "portable",
               "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "2"}
        self._proc = subprocess.Popen([str(ENV / "python"), "-c", SERVE, MARK], env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, bufsize=1)

    def run(self, code: str, *args: str, timeout: float = 600) -> str:
        """Python code run on the emulated aarch64 machine (in its one interpreter, each piece with globals of its
        own); what it printed. A failure or a timeout fails the test with the machine's traceback."""
        if self._proc is None:
            raise Unavailable(self.why_no_machine)
        timer = threading.Timer(timeout, self._proc.kill)  # a wedged emulation ends the read below
        timer.start()
        try:
            self._proc.stdin.write(json.dumps({"code": code, "args": list(args)}) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
            while line and not line.startswith(MARK):
                line = self._proc.stdout.readline()
        finally:
            timer.cancel()
        assert line, f"the emulated aarch64 interpreter ended (rc {self._proc.poll()}; timeout {timeout} s)"
        reply = json.loads(line[len(MARK):])
        assert reply["error"] is None, f"on aarch64:\n{reply['error'][-3000:]}"
        return reply["out"]

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()

"""An emulated aarch64 machine for the portable kernel tier (tests/test_tier_aarch64.py runs it there).

    python tools/aarch64_env.py DIR

DIR gets root/ (Debian 12's arm64 Python 3.11 and its headers, unpacked by mmdebstrap, with the C++ runtime of
Debian's aarch64 cross compiler), site/ (aarch64 wheels: torch and what colibri imports to load a model) and
python, a script that runs that Python under qemu-aarch64 (qemu-user) with site/ first on its path. Installs
qemu-user, mmdebstrap and g++-aarch64-linux-gnu with apt-get where they are missing (as root); reads
deb.debian.org and the package index. A finished environment has DIR/ready; running again redoes nothing then.

torch there is 2.10.0, not the 2.13.0 the project pins: PyPI's aarch64 torch wheels from 2.11 on are CUDA builds
(their NVIDIA libraries are not installable here), and PyTorch's CPU index is out of reach. The kernels build
against either (tests/test_tier_aarch64.py cross-compiles them against this one), and the checks compare the
bits of results, which do not depend on torch's version.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TORCH = "torch==2.10.0"
# what `import colibri` and loading the README demo's container import (torch's own needs are pure Python)
PACKAGES = ("numpy", "safetensors", "tokenizers", "gguf", "jinja2", "tqdm", "filelock", "typing_extensions",
            "sympy", "networkx", "fsspec")
PYTHON = "python3.11"  # Debian 12's
DEBIAN = ("bookworm", "http://deb.debian.org/debian")
CROSS_LIBS = Path("/usr/aarch64-linux-gnu/lib")  # g++-aarch64-linux-gnu's runtime: libstdc++, libgcc_s, libgomp
TOOLS = {"qemu-aarch64": "qemu-user", "mmdebstrap": "mmdebstrap", "aarch64-linux-gnu-g++": "g++-aarch64-linux-gnu"}


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def tools() -> None:
    missing = sorted({pkg for exe, pkg in TOOLS.items() if shutil.which(exe) is None})
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        sys.exit(f"aarch64_env: missing {', '.join(missing)}; install them (apt-get install -y {' '.join(missing)})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True, env=env)


def root(d: Path) -> Path:
    """Debian's arm64 Python, unpacked only (no maintainer scripts: they would need to run under emulation)."""
    r = d / "root"
    if not (r / "usr" / "bin" / PYTHON).is_file():
        tmp = d / "root.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        run(["mmdebstrap", "--arch=arm64", "--variant=extract", "--quiet",
             f"--include={PYTHON},lib{PYTHON}-stdlib,lib{PYTHON}-dev", DEBIAN[0], str(tmp), DEBIAN[1]])
        shutil.rmtree(r, ignore_errors=True)
        tmp.rename(r)
    lib = r / "usr" / "lib" / "aarch64-linux-gnu"
    for pattern in ("libstdc++.so.6*", "libgcc_s.so.1", "libgomp.so.1*"):
        for f in CROSS_LIBS.glob(pattern):
            if not (lib / f.name).exists():
                shutil.copy2(f, lib / f.name, follow_symlinks=False)
    return r


def site(d: Path) -> Path:
    s = d / "site"
    if (s / "torch").is_dir():
        return s
    tmp = d / "site.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(tmp), "--only-binary=:all:",
           "--python-version", "3.11", "--platform", "manylinux_2_28_aarch64", "--platform", "manylinux_2_17_aarch64",
           "--platform", "manylinux2014_aarch64"]
    run([*pip, "--no-deps", TORCH])  # (its metadata names no CUDA package for aarch64, but keep pip from looking)
    run([*pip, *PACKAGES])
    tmp.rename(s)
    return s


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__.split("\n\n")[1])
    d = Path(sys.argv[1]).resolve()
    if (d / "ready").is_file():
        print(f"aarch64_env: {d} is ready")
        return
    d.mkdir(parents=True, exist_ok=True)
    tools()
    r, s = root(d), site(d)
    script = d / "python"
    # qemu-user hands the guest this environment; -L makes the guest's absolute paths (its loader, libraries) root's
    script.write_text("#!/bin/sh\n"
                      f'PYTHONPATH="{s}${{PYTHONPATH:+:$PYTHONPATH}}" exec qemu-aarch64 -L "{r}" "{r}/usr/bin/{PYTHON}"'
                      ' "$@"\n')
    script.chmod(0o755)
    run([str(script), "-c", "import platform, torch; print(platform.machine(), 'torch', torch.__version__)"])
    (d / "ready").write_text("")
    print(f"aarch64_env: {d} is ready")


if __name__ == "__main__":
    main()

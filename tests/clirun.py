"""Running the `colibri` command in tests. Most tests run it in this process through cli.main (`here`): the
behaviour without a process start's seconds of imports. A few run it as a process of its own (`colibri_cmd`,
`run`): the smoke tests of the installed command, and what needs a process (a signal, a second process, a
restart, exactly what a process writes to stdout)."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path


def colibri_cmd() -> list[str]:
    """The installed `colibri` script beside this Python, else `python -m colibri.cli`."""
    script = Path(sys.executable).parent / "colibri"
    return [str(script)] if script.exists() else [sys.executable, "-m", "colibri.cli"]


def run(*args: str, stdin: str | None = None, cwd: Path | None = None, env: dict | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """`colibri ARGS` as a process of its own, output captured as text."""
    return subprocess.run(colibri_cmd() + [str(a) for a in args], input=stdin, capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def here(capsys, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    """`colibri ARGS` in this process through cli.main, stdin read from `stdin`, its output captured (capsys):
    the exit status is main's return value, or an argparse SystemExit's code."""
    from colibri import cli

    saved = sys.stdin
    sys.stdin = io.StringIO(stdin)
    capsys.readouterr()
    try:
        rc = cli.main([str(a) for a in args])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdin = saved
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), rc, out.out, out.err)

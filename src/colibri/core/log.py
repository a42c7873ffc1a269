"""Colibri's one logger: the notices (a kernel tier passed over or being built, a re-quantized tensor, a lossy
mode that does not apply) and the debug lines, on stderr, each line as it is written here (no level or time
prefix: the notices' text is what users and tests read).

Levels: `notice` is INFO, `warn` (what changes the numbers: lossy re-quantization) WARNING, `debug` DEBUG. The
CLI's `-q` shows warnings only and `-v` adds debug lines (set_level); a program using Colibri as a library sets
the "colibri" logger's level or handlers as it likes. Lines go to the sys.stderr of the moment (pytest's capsys,
a redirected stream), not the one at import.
"""

from __future__ import annotations

import logging
import sys

LOGGER = logging.getLogger("colibri")


class _Stderr(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging's contract: a failed write is reported, never raised
            self.handleError(record)


if not LOGGER.handlers:
    LOGGER.addHandler(_Stderr())
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False  # a root handler set by a host program (uvicorn, ray) would print each line twice


def notice(text: str) -> None:
    LOGGER.info(text)


def warn(text: str) -> None:
    LOGGER.warning(text)


def debug(text: str) -> None:
    LOGGER.debug(text)


def set_level(quiet: bool = False, verbose: bool = False) -> None:
    """-q: warnings only; -v: debug lines too; neither: notices (the default)."""
    LOGGER.setLevel(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO)

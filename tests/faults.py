"""Fault injection shared by tests: a conversion paused at a known point (for tests that kill a process mid-way)
and read errors from the disk under a `colibri.weights.io.Reader`."""

from __future__ import annotations

import errno
import threading

# Python source that makes `colibri.convert.pipeline` (bound as `c`) stop, asleep, right after its journal records
# `{pages}` finished pages: a test kills the process there to interrupt a conversion at a known point.
PAUSE_AFTER_PAGES = (
    "import sys, time; from colibri.convert import pipeline as c; _write = c.write_json\n"
    "def _paused(path, obj, **kw):\n"
    "    _write(path, obj, **kw)\n"
    "    if path.name == c.JOURNAL and len(obj['pages']) >= {pages}: time.sleep(3600)\n"
    "c.write_json = _paused\n")


class FailingReads:
    """Read errors under one `Reader`, as a failing disk returns them: wraps the reader's one read call
    (`Reader._pread`). `fail(file_index, offset, times)`: the next `times` reads of file `file_index` covering
    byte `offset` (any offset: None) raise EIO instead of reading."""

    def __init__(self, reader):
        self._read = reader._pread
        self._left: dict[tuple[int, int | None], int] = {}
        self._lock = threading.Lock()  # the reader's I/O threads call _pread concurrently
        reader._pread = self._pread

    def fail(self, file_index: int, offset: int | None = None, times: int = 1) -> "FailingReads":
        with self._lock:
            self._left[(file_index, offset)] = self._left.get((file_index, offset), 0) + times
        return self

    def _pread(self, file_index: int, fd: int, view: memoryview, offset: int) -> int:
        with self._lock:
            for (f, at), left in self._left.items():
                if f == file_index and left and (at is None or offset <= at < offset + len(view)):
                    self._left[(f, at)] = left - 1
                    raise OSError(errno.EIO, "Input/output error (injected by the test)")
        return self._read(file_index, fd, view, offset)

"""Integrity of what the streaming store reads: each page's crc32 against the manifest on its first read (the
check runs on the I/O thread), and the data files unchanged (inode, size, mtime) since load before each pass.
A failure raises StorageError naming the page or file; a page is verified at most once."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from colibri.formats.container import ContainerCheckpoint, checksum_str
from colibri.core.errors import StorageError
from colibri.weights.streaming.stats import StreamStats


def file_id(path: Path) -> tuple:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


class Checksums:
    def __init__(self, ckpt: ContainerCheckpoint, stats: StreamStats):
        self.ckpt = ckpt
        self.stats = stats
        self.verified: set[int] = set()
        self._file_ids = [file_id(p) for p in ckpt.files]

    def verifier(self, pid: int):
        """Checksum check for a page's first read (runs on the I/O thread); None once verified."""
        if pid in self.verified:
            return None

        def verify(data: memoryview) -> None:
            self.check_page(pid, zlib.crc32(data))

        return verify

    def check_page(self, pid: int, crc: int) -> None:
        """Compare a page's crc32 with the manifest's: a mismatch raises, a match marks the page verified."""
        page = self.ckpt.pages[pid]
        if checksum_str(crc) != page.checksum:
            raise StorageError(f"page {pid}: checksum mismatch in {self.ckpt.files[page.file]} at offset "
                               f"{page.offset} ({page.nbytes} bytes); the file is corrupt — run "
                               f"`colibri verify` and reconvert")
        self.verified.add(pid)
        self.stats.verified_pages += 1

    def check_files(self) -> None:
        """Raise if a data file was replaced, truncated or rewritten since load."""
        for path, ident in zip(self.ckpt.files, self._file_ids):
            try:
                now = file_id(path)
            except OSError:
                now = None
            if now != ident:
                raise StorageError(f"data file {path} changed on disk after the model was loaded (replaced, "
                                   "truncated or rewritten); reload the model")

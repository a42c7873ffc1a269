"""Files replaced whole: a reader, or the next run after a crash, sees the old content or the new, never a part.

Every file Colibri rewrites in place (a saved conversation, a conversion's journal and manifest, calibration
statistics, a preallocated swap file, a GGUF export) goes through `atomic_write` (`atomic_path` for a writer that
opens the file itself): the bytes go to a temporary sibling `NAME.partial-PID`, which is flushed, fsynced and
renamed over `NAME`, then the directory is fsynced so the rename itself survives a power cut. A failure at any point (an exception, Ctrl-C, a full disk) removes the
temporary file and leaves `NAME` as it was. A process killed mid-write leaves only the `.partial-PID` file,
which nothing reads as valid.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import IO, Any, Iterator


def partial_path(path: Path) -> Path:
    """The temporary sibling `atomic_write` writes `path` through."""
    return path.with_name(f"{path.name}.partial-{os.getpid()}")


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of directory `path` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """The temporary sibling to write `path`'s new content to, by any writer that takes a path (a GGUFWriter): when
    the block exits without an exception it is fsynced and renamed over `path`; otherwise it is removed and `path`
    is untouched."""
    path = Path(path)
    tmp = partial_path(path)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, text: bool = False, perms: int = 0o644) -> Iterator[IO[Any]]:
    """A file object open for writing (binary; `text`: UTF-8) whose content replaces `path` when the block exits
    without an exception; otherwise `path` is untouched and the temporary file is gone. `perms`: the new
    file's permission bits (before the umask)."""
    with atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, perms)
        with open(fd, "w" if text else "wb", **({"encoding": "utf-8"} if text else {})) as f:
            yield f


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 1) -> None:
    """`obj` as JSON in `path`, replaced atomically."""
    with atomic_write(path, text=True) as f:
        json.dump(obj, f, indent=indent)

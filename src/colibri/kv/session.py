"""Saved conversations: a sequence's KV blocks, its token ids and chat messages, tied to one model.

File layout: a magic line, then a JSON header (format version, the identity of the model and of the KV layout,
token ids, messages, one crc32 per block as 8 hex digits, and the header's own crc32) padded to 4096 bytes, then
the blocks (`KVLayout.block_bytes` each, the last one partly used). Saving writes a temporary file, fsyncs it and
renames it over the old one, so a crash leaves the previous turn's file or the new one, never a mix. Loading refuses a file saved for another model,
container, compute dtype, KV quantization, block size or format version, and one whose header or blocks fail
their crc.

A conversation has one writer at a time: `SessionLock` holds an exclusive `flock` on `NAME.lock` beside the file
for as long as a chat uses it, so a second `chat --session NAME` is refused at start instead of both running and
the last to save silently dropping the other's turns. The lock is released when its process ends, however.
"""

from __future__ import annotations

import fcntl
import json
import os
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from colibri.core.atomic import atomic_write
from colibri.formats.container import ContainerCheckpoint
from colibri.core.errors import InputError
from colibri.weights.io import align_up

if TYPE_CHECKING:
    from colibri.kv.cache import KVCache
    from colibri.kv.pool import KVLayout
    from colibri.formats.checkpoint import Checkpoint
    from colibri.kv.space import KVSpace

MAGIC = b"COLIBRI-KV-SESSION\n"
# Version 2: the header carries `header_crc32`, the crc32 of its own canonical JSON (sorted keys, without that key),
# required: a changed byte in a saved message or token id is refused, not loaded as another history. Version 1
# (no header checksum) is still read; a header that has the key is checked whatever its version says, so damage
# to the version digit cannot switch the check off.
VERSION = 2
READS = (1, 2)


class SessionLock:
    """Exclusive use of the conversation file `path` while held (a context manager; also released at exit)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        while True:
            try:
                self.lock_path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise InputError(f"cannot lock the conversation {self.path}: {e.strerror}; check the --kv-dir "
                                 "directory") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                owner = self._owner()
                raise InputError(f"the conversation {self.path} is in use by another colibri chat{owner}; wait "
                                 "for it to end or choose another --session") from None
            # the holder before us may have unlinked the lock file after we opened it: lock the file at the path
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.lock_path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd: int | None = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def _owner(self) -> str:
        try:
            return f" (pid {int(self.lock_path.read_text().strip())})"
        except (OSError, ValueError):
            return ""

    def release(self) -> None:
        if self._fd is None:
            return
        self.lock_path.unlink(missing_ok=True)  # while still locked: a waiter re-checks the path (above)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "SessionLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def model_identity(ckpt: "Checkpoint") -> str:
    """What the KV values depend on in the weights: a container's fingerprint and page checksums; for a GGUF
    file or an HF directory, the file names, sizes and a checksum of their first and last MiB."""
    if isinstance(ckpt, ContainerCheckpoint):
        from colibri.weights.usage import ExpertUsage
        return "container:" + ExpertUsage.identity_of(ckpt)
    path = ckpt.path
    files = [path] if path.is_file() else sorted(p for p in path.iterdir()
                                                if p.suffix in (".safetensors", ".json", ".gguf"))
    crc = 0
    for f in files:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            crc = zlib.crc32(f"{f.name}:{size}".encode(), crc)
            crc = zlib.crc32(fh.read(1 << 20), crc)
            fh.seek(max(0, size - (1 << 20)))
            crc = zlib.crc32(fh.read(1 << 20), crc)
    return f"{'gguf' if path.is_file() else 'hf'}:{crc:08x}"


def identity(ckpt: "Checkpoint", model_type: str, layout: "KVLayout") -> dict:
    """Everything a saved sequence's KV depends on: the weights, the architecture and the KV layout."""
    return {"model": model_identity(ckpt), "architecture": model_type, **layout.identity()}


# what load reads from a header of a version it knows, by type
_HEAD_KEYS = {"identity": dict, "length": int, "ids": list, "messages": list, "crc32": list}


def _header_crc(head: dict) -> str:
    body = {k: v for k, v in head.items() if k != "header_crc32"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()):08x}"


def _header(head: dict) -> bytes:
    head["header_crc32"] = _header_crc(head)  # fixed width: the size computed before the blocks holds
    raw = MAGIC + json.dumps(head, ensure_ascii=False).encode()
    return raw.ljust(align_up(len(raw) + 1), b"\0")


def save(path: str | os.PathLike, ident: dict, lay: "KVLayout", cache: "KVCache | None",
         messages: list[dict] | None = None) -> Path:
    """Write `cache` (None: an empty conversation) and `messages` to `path` atomically, one block at a time (the
    checksums are fixed-width hex, so the header is written last, in place); `ident`: `identity(...)`."""
    path = Path(path)
    length = cache.length if cache is not None else 0
    nblocks = -(-length // lay.block)
    head = {"version": VERSION, "identity": ident, "length": length,
            "ids": cache.ids[:length] if cache is not None else [], "messages": messages or [],
            "block_bytes": lay.block_bytes, "crc32": ["0" * 8] * nblocks}
    size = len(_header(head))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as f:
            f.seek(size)
            buf = torch.empty(lay.block_bytes, dtype=torch.uint8)
            for b in range(nblocks):
                data = cache.encode_block(b, buf).numpy()
                head["crc32"][b] = f"{zlib.crc32(data):08x}"
                f.write(memoryview(data))
            f.seek(0)
            f.write(_header(head))
    except OSError as e:  # a failed or interrupted save leaves the previous file and no temporary one
        raise InputError(f"cannot save the conversation to {path}: {e.strerror}; check the --kv-dir disk") from None
    return path


def _read_header(f, path: Path) -> tuple[dict, int]:
    """The JSON header and the offset where the blocks start."""
    if f.read(len(MAGIC)) != MAGIC:
        raise InputError(f"{path} is not a Colibri conversation file; remove it or choose another --session")
    text = b""
    while b"\0" not in text:
        chunk = f.read(1 << 16)
        if not chunk:
            break
        text += chunk
    end = text.find(b"\0")
    try:
        head = json.loads(text[:end if end >= 0 else len(text)])
        version = head["version"]
        crc = head.get("header_crc32")
    except (ValueError, KeyError, TypeError, AttributeError):
        raise InputError(f"{path}: the conversation header is damaged; remove the file to start over") from None
    if version in READS and ((crc is None and version >= 2) or (crc is not None and crc != _header_crc(head))):
        raise InputError(f"{path}: the conversation header fails its checksum (damaged file); remove it to start "
                         "over")
    if version in READS:  # version 1 has no header checksum: a damaged key is met here, not as a KeyError later
        for key, typ in _HEAD_KEYS.items():
            v = head.get(key)
            if not isinstance(v, typ) or isinstance(v, bool):
                raise InputError(f"{path}: the conversation header lacks a valid {key!r} (damaged file); remove it"
                                 " to start over")
        if not all(type(i) is int for i in head["ids"]) or not all(isinstance(c, str) for c in head["crc32"]):
            raise InputError(f"{path}: the conversation header's ids or block checksums are damaged; remove it to"
                             " start over")
    return head, align_up(len(MAGIC) + end + 1) if end >= 0 else os.fstat(f.fileno()).st_size


def load(path: str | os.PathLike, ident: dict, kv: "KVSpace") -> tuple["KVCache", list[dict]]:
    """The saved sequence as a new cache of the KV space `kv`, and the saved messages; refused unless it was
    saved with this `ident` (`identity(...)`)."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as e:  # missing, a directory, unreadable
        raise InputError(f"{path}: cannot read the saved conversation ({e.strerror}); give the file save_session"
                         " wrote") from None
    with f:
        head, start = _read_header(f, path)
        version = head["version"]
        if version not in READS:
            raise InputError(f"{path}: conversation format version {version} is not supported (this Colibri "
                             f"reads {', '.join(map(str, READS))}); remove the file to start over")
        want, got = ident, head.get("identity", {})
        diff = [k for k in want if want[k] != got.get(k)]
        if diff:
            what = ", ".join(f"{k} {got.get(k)!r} (this run: {want[k]!r})" for k in diff)
            raise InputError(f"{path} was saved for another model or setting: {what}; it cannot be used here; "
                             "choose another --session or remove the file")
        lay = kv.layout
        crcs, length, ids = head["crc32"], head["length"], head["ids"]
        if (os.fstat(f.fileno()).st_size != start + len(crcs) * lay.block_bytes or len(ids) != length
                or len(crcs) != -(-length // lay.block)):
            raise InputError(f"{path} is truncated or damaged (size does not match its header); remove it to "
                             "start over")
        cache = kv.new_cache()
        raw = bytearray(lay.block_bytes)
        block = torch.frombuffer(raw, dtype=torch.uint8)
        f.seek(start)
        try:
            for b, crc in enumerate(crcs):
                f.readinto(raw)
                if f"{zlib.crc32(raw):08x}" != crc:
                    raise InputError(f"{path}: block {b} fails its checksum (damaged file); remove it to start over")
                cache.append_block(block, ids[b * lay.block:min(length, (b + 1) * lay.block)])
        except BaseException:
            cache.release()
            raise
    return cache, head["messages"]

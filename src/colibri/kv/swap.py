"""The KV swap file: a preallocated file on the SSD where KV blocks go when they do not fit their RAM share.

Layout: a 4096-byte header (magic line, then JSON: format version and total size), then the data area. A user
opens it with a block shape (layers x per-layer segment bytes); the data area is then split into one region per
layer, each holding `slots` segments, so one layer's segments of consecutive slots are one contiguous range: the
read-back of a sequence's old blocks for one layer is a few large reads, not one per block.

Nothing in it must survive: every open starts with all slots free. Before use the header and the file size are
checked, so a file of another kind or a truncated one is refused rather than overwritten. An open file is held
with an exclusive `flock` until it is closed: a second user (another process, or another model in this one) is
refused with one line instead of silently reading and overwriting the first one's blocks. The lock goes with the
process, however it ends; `sweep` uses that to delete the temporary swap files of processes that died without
cleaning up (SIGKILL, a crash).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import heapq
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

from colibri.core.atomic import atomic_write
from colibri.core.errors import InputError, StorageError
from colibri.weights.io import ALIGN, DEMAND, AlignedBuffer, Reader, align_up

MAGIC = b"COLIBRI-KV-SWAP\n"
VERSION = 1
HEADER = 4096
DISK_RESERVE = 1 << 30  # free space `create` leaves on the filesystem


def _fmt(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def create(path: str | os.PathLike, size: int, keep_free: int = DISK_RESERVE) -> Path:
    """Preallocate a swap file of `size` bytes (fallocate), refusing when the filesystem would keep less than
    `keep_free` bytes free. Written under a temporary name and renamed, so a failure leaves nothing that looks
    like a swap file."""
    path = Path(path)
    size = align_up(int(size))
    if size < 2 * HEADER:
        raise InputError(f"swap size {size} bytes is too small; give e.g. --size 2G")
    if path.exists():
        raise InputError(f"{path} already exists; remove it first or choose another --path")
    if not path.parent.is_dir():
        raise InputError(f"{path.parent} is not a directory; create it first")
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    if size + keep_free > free:
        raise InputError(f"not enough disk space for a {_fmt(size)} swap file at {path.parent}: {_fmt(free)} free "
                         f"and {_fmt(keep_free)} kept in reserve; free space or choose a smaller --size")
    try:
        with atomic_write(path, perms=0o600) as f:
            os.posix_fallocate(f.fileno(), 0, size)
            head = MAGIC + json.dumps({"version": VERSION, "size": size, "id": uuid.uuid4().hex}).encode()
            f.write(head.ljust(HEADER, b"\0"))
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise InputError(f"the disk at {path.parent} ran out of space while allocating {_fmt(size)}; "
                             "free space or choose a smaller --size") from None
        raise InputError(f"cannot create swap file {path}: {e.strerror}") from None
    return path


def check(path: str | os.PathLike) -> int:
    """The data size of a valid swap file; InputError naming what is wrong otherwise."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"swap file {path} does not exist; create it with: colibri swap create --path {path} "
                         "--size SIZE")
    with open(path, "rb") as f:
        head = f.read(HEADER)
    if not head.startswith(MAGIC):
        raise InputError(f"{path} is not a Colibri swap file (bad header); give a file made by `colibri swap "
                         "create`")
    try:
        meta = json.loads(head[len(MAGIC):].rstrip(b"\0"))
        version, size = int(meta["version"]), int(meta["size"])
    except (ValueError, KeyError, TypeError):
        raise InputError(f"{path}: the swap header is damaged; recreate it with `colibri swap create`") from None
    if version != VERSION:
        raise InputError(f"{path}: swap format version {version} is not supported (this Colibri writes "
                         f"{VERSION}); recreate it with `colibri swap create`")
    actual = path.stat().st_size
    if actual != size:
        raise InputError(f"{path}: the swap file is {actual} bytes but its header says {size} (truncated or "
                         "resized); recreate it with `colibri swap create`")
    return size - HEADER


def _holder(path: Path) -> int | None:
    """The pid holding a flock on `path`, from /proc/locks (None where unknown)."""
    try:
        st = path.stat()
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        parts = line.split()
        if "FLOCK" in parts and want in parts:
            try:
                return int(parts[parts.index(want) - 1])
            except ValueError:
                return None
    return None


def lock(fd: int, path: Path) -> None:
    """Take the exclusive lock on an open swap file, or raise InputError naming who holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _holder(path)
        who = ("another model in this process" if pid == os.getpid() else
               f"another Colibri process (pid {pid})" if pid else "another Colibri process")
        raise InputError(f"swap file {path} is in use by {who}; give each model its own --swap file (or leave "
                         "--swap unset for a temporary one)") from None


_TEMPORARY = re.compile(r"^kv-(\d+)-[0-9a-f]+\.swap(\.partial-\d+)?$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def sweep(directory: str | os.PathLike) -> int:
    """Delete the temporary swap files in `directory` left by processes that no longer run (their owner's lock is
    gone with them); returns the bytes freed. A file whose owner lives, or that is locked, is left alone."""
    freed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        m = _TEMPORARY.match(name)
        if not m or _alive(int(m.group(1))):
            continue
        path = Path(directory) / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: a live owner after all (a reused pid)
            size = os.fstat(fd).st_blocks * 512
            path.unlink(missing_ok=True)
            freed += size
        except OSError:
            pass
        finally:
            os.close(fd)
    return freed


class SwapFile:
    """An open swap file holding KV blocks of one shape: `layers` segments of `seg_bytes` each per block.

    Slots are reference counted: a block spilled by a sequence and adopted by the prefix cache is not copied.
    """

    def __init__(self, path: str | os.PathLike, layers: int, seg_bytes: int, io_threads: int = 2,
                 temporary: bool = False):
        if seg_bytes % ALIGN:
            raise ValueError(f"segment size {seg_bytes} is not a multiple of {ALIGN}")
        self.path, self.temporary = Path(path), temporary
        data = check(self.path)
        self.layers, self.seg_bytes = layers, seg_bytes
        self.slots = data // (layers * seg_bytes)
        if self.slots < 1:
            raise InputError(f"{self.path} ({_fmt(data)}) cannot hold one KV block of {_fmt(layers * seg_bytes)}; "
                             "create a larger swap file")
        self._refs = [0] * self.slots
        self._free = list(range(self.slots))  # a min-heap: the lowest free slot first, so a sequence's blocks
        # tend to be consecutive and one layer's read-back is a few large reads
        self._lock = threading.Lock()
        try:
            self._wfd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
            self.direct = True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise StorageError(f"cannot open swap file {self.path}: {e.strerror}") from None
            self._wfd = os.open(self.path, os.O_RDWR)  # tmpfs: no O_DIRECT
            self.direct = False
        try:
            lock(self._wfd, self.path)
            self.reader = Reader([self.path], io_threads=io_threads, direct=None)
        except BaseException:
            os.close(self._wfd)
            raise
        self._bounce: AlignedBuffer | None = None
        self.bytes_written = 0
        self.closed = False
        if temporary:
            atexit.register(self.close)

    @classmethod
    def temporary_in(cls, directory: str | os.PathLike, size: int, layers: int, seg_bytes: int,
                     io_threads: int = 2) -> "SwapFile":
        """A swap file created for this process in `directory` and deleted when it closes (or at exit)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        sweep(directory)  # before the free-space check: leftovers of dead processes count as free
        path = directory / f"kv-{os.getpid()}-{uuid.uuid4().hex[:8]}.swap"
        try:  # a signal landing after create's rename, before the file has an owner, must not leave it behind
            create(path, HEADER + size, keep_free=DISK_RESERVE)
            return cls(path, layers, seg_bytes, io_threads, temporary=True)
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    # -- slots -------------------------------------------------------------------------------------------

    @property
    def used(self) -> int:
        with self._lock:
            return self.slots - len(self._free)

    def alloc(self) -> int | None:
        with self._lock:
            if not self._free:
                return None
            s = heapq.heappop(self._free)
            self._refs[s] = 1
            return s

    def ref(self, slot: int) -> None:
        with self._lock:
            self._refs[slot] += 1

    def free(self, slot: int) -> None:
        with self._lock:
            self._refs[slot] -= 1
            if self._refs[slot] == 0:
                heapq.heappush(self._free, slot)

    # -- data --------------------------------------------------------------------------------------------

    def offset(self, slot: int, layer: int) -> int:
        return HEADER + (layer * self.slots + slot) * self.seg_bytes

    def write(self, slot: int, block: torch.Tensor) -> None:
        """Write one block (uint8 [layers * seg_bytes]) to `slot`."""
        n = self.layers * self.seg_bytes
        if block.numel() != n:
            raise ValueError(f"a block is {n} bytes, got {block.numel()}")
        if block.data_ptr() % ALIGN:
            if self._bounce is None:
                self._bounce = AlignedBuffer(n)
            self._bounce.tensor(0, n).copy_(block)
            block = self._bounce.tensor(0, n)
        mv = memoryview(block.numpy())
        for layer in range(self.layers):
            seg = mv[layer * self.seg_bytes:(layer + 1) * self.seg_bytes]
            at = self.offset(slot, layer)
            try:
                done = 0
                while done < len(seg):
                    done += os.pwrite(self._wfd, seg[done:], at + done)
            except OSError as e:
                raise StorageError(f"write to KV swap file {self.path} at offset {at} failed: {e.strerror}; "
                                   "check the disk") from None
        self.bytes_written += n

    def read_layer(self, slots: list[int], layer: int, buffer: AlignedBuffer, priority: int = DEMAND) -> list[Future]:
        """Read `layer`'s segment of each slot into `buffer` (segment j at j * seg_bytes); runs of consecutive
        slots are one read each."""
        futures, j = [], 0
        while j < len(slots):
            r = j + 1
            while r < len(slots) and slots[r] == slots[r - 1] + 1:
                r += 1
            futures.append(self.reader.submit(0, self.offset(slots[j], layer), (r - j) * self.seg_bytes, buffer,
                                              priority, j * self.seg_bytes, label="KV swap"))
            j = r
        return futures

    def read_block(self, slot: int, buffer: AlignedBuffer, priority: int = DEMAND) -> list[Future]:
        """Read every layer's segment of one slot into `buffer` (layer l at l * seg_bytes)."""
        return [self.reader.submit(0, self.offset(slot, layer), self.seg_bytes, buffer, priority,
                                   layer * self.seg_bytes, label="KV swap") for layer in range(self.layers)]

    @property
    def bytes_read(self) -> int:
        return self.reader.stats().bytes_read

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.reader.close()
        os.close(self._wfd)
        if self.temporary:
            self.path.unlink(missing_ok=True)


class SwapSlots:
    """The swap file of one KV space, as its block pool and sequences use it: opened on first use (the file at
    `path`, else a temporary one of `temporary_bytes` in `directory`), slots allocated and freed, blocks written
    and read. When the file is full, `alloc` calls `make_room` (it frees a slot and returns True, or returns
    False) before giving up. `read_wait_s` sums the time sequences waited on its reads (`wait`)."""

    def __init__(self, layers: int, seg_bytes: int, block_tokens: int, path: str | os.PathLike | None = None,
                 directory: str | os.PathLike | None = None, temporary_bytes: int = 0, io_threads: int = 2,
                 make_room: Callable[[], bool] = lambda: False, fallback: str | os.PathLike | None = None):
        """`fallback`: where the temporary file goes when `directory` cannot be made or written (the default
        directory in an unwritable cache; a notice says so), None: that is an error."""
        self.layers, self.seg_bytes, self.block_tokens = layers, seg_bytes, block_tokens
        self.path = None if path is None else Path(path)
        self.directory = None if directory is None else Path(directory)
        self.fallback = None if fallback is None else Path(fallback)
        self.temporary_bytes, self.io_threads, self.make_room = temporary_bytes, io_threads, make_room
        self.opened: SwapFile | None = None
        self.read_wait_s = 0.0
        if self.directory is not None:  # at load, not at the first spill (which may never come): a dead
            sweep(self.directory)       # process's leftover of hundreds of MiB goes when the next one starts

    @property
    def file(self) -> SwapFile:
        if self.opened is None:
            if self.path is not None:
                self.opened = SwapFile(self.path, self.layers, self.seg_bytes, self.io_threads)
            else:
                if self.directory is None:
                    raise InputError("the KV cache outgrew its RAM share and no swap directory is set; give --swap")
                self.opened = SwapFile.temporary_in(self._writable_directory(), self.temporary_bytes, self.layers,
                                                    self.seg_bytes, self.io_threads)
        return self.opened

    def _writable_directory(self) -> Path:
        """`directory`, made if need be; where it cannot be made or written, the fallback (said in a notice), else
        an InputError."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if os.access(self.directory, os.W_OK):
                return self.directory
            why = "not writable"
        except OSError as e:
            why = e.strerror or str(e)
        if self.fallback is None:
            raise InputError(f"the KV cache outgrew its RAM share and the swap directory {self.directory} cannot be"
                             f" used ({why}); give a writable swap_dir, or a swap file (--swap)")
        from colibri.core import log
        log.notice(f"colibri: the KV swap directory {self.directory} cannot be used ({why}); the temporary swap file"
                   f" goes to {self.fallback} instead (set COLIBRI_CACHE to a writable directory, or give --swap)")
        return self.fallback

    @property
    def available(self) -> bool:
        """Open, or a file was given (a temporary one is created only when a block must go to disk)."""
        return self.opened is not None or self.path is not None

    def alloc(self) -> int:
        while True:
            s = self.file.alloc()
            if s is not None:
                return s
            if not self.make_room():
                raise InputError(f"the KV swap file {self.file.path} is full ({self.file.slots} blocks of "
                                 f"{self.block_tokens} tokens); give a larger one (colibri swap create --size)")

    def free(self, slot: int) -> None:
        self.file.free(slot)

    def write(self, slot: int, block: torch.Tensor) -> None:
        self.file.write(slot, block)

    def read_block(self, slot: int, buffer: AlignedBuffer) -> list[Future]:
        return self.file.read_block(slot, buffer)

    def read_layer(self, slots: list[int], layer: int, buffer: AlignedBuffer, priority: int) -> list[Future]:
        return self.file.read_layer(slots, layer, buffer, priority)

    def wait(self, futures: list[Future]) -> None:
        """Wait for reads a sequence needs now: each is moved ahead of prefetches first; the time waited adds to
        `read_wait_s`."""
        t0 = time.perf_counter()
        for f in futures:
            self.file.reader.promote(f)
        for f in futures:
            f.result()
        self.read_wait_s += time.perf_counter() - t0

    def close(self) -> None:
        if self.opened is not None:
            self.opened.close()
            self.opened = None

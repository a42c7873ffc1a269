"""Disk reads for streamed weights: reusable 4096-aligned buffers and a few threads doing O_DIRECT `preadv`.

Why this shape (benchmarks/disk.py): sequential O_DIRECT reads of a few MiB with two requests in flight reach the
disk's bandwidth, and never leave a second copy of the weights in the page cache (which would then act as the
cache and count against the memory limit). `os.preadv` releases the GIL, so two Python threads keep two requests
in flight while the model computes. No mmap: page-fault driven reads are the slowest way to stream.

* `AlignedBuffer` — an anonymous mapping (page-aligned by construction); `.tensor(offset, nbytes)` is a uint8
  view over it, no copy. A buffer may be refilled once the caller has dropped its views.
* `Reader` — opens each data file once, splits a page read into `request_size` requests, and runs them on
  `io_threads` threads, demand reads (priority 0) ahead of prefetches (priority 1). `submit` returns a Future
  that resolves to the filled buffer, or raises `StorageError` naming the file, offset and failure.
* `Arena` — one AlignedBuffer handed out in turn: the resident weights of a run without a memory limit.
* `probe_bandwidth` — measured read bandwidth of one file through a `Reader`.
"""

from __future__ import annotations

import dataclasses
import errno
import heapq
import itertools
import mmap
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from colibri.core.errors import StorageError

ALIGN = 4096  # O_DIRECT wants offset, length and memory address aligned; 4096 covers every logical block size
# Requests of a few MiB: small requests lose bandwidth on cold data, and each request costs Python time, so fewer
# larger ones keep that cost small (benchmarks/disk.py; figures in docs/performance.md, "Disk").
DEFAULT_REQUEST_SIZE = 2 << 20
DEFAULT_IO_THREADS = 2  # two requests in flight reach the cold disk's rate where one does not ("Disk")
DEMAND, PREFETCH = 0, 1  # priorities: lower runs first
HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) transparent huge page size


def align_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def huge_align(n: int) -> int:
    """`n` rounded up to whole huge pages when it is at least one (then an AlignedBuffer of it is all huge pages),
    else to 4096: the size to give long-lived buffers whose bytes the memory budget counts."""
    return align_up(n, HUGE_PAGE) if n >= HUGE_PAGE else align_up(n)


class AlignedBuffer:
    """`nbytes` (rounded up to 4096) of page-aligned anonymous memory, with zero-copy torch and memoryview views.

    Buffers of at least one huge page start on a 2 MiB boundary and ask for transparent huge pages
    (MADV_HUGEPAGE). That can decide the read speed (benchmarks/disk.py, "destination buffers"; figures in
    docs/performance.md, "Disk"): O_DIRECT into 4 KiB pages scattered in physical memory splits each request into
    many segments, so the rate depends on which buffer a read goes into; into huge pages it does not. Only whole
    huge pages inside the buffer are advised, so its resident size stays `nbytes`. Where the kernel has no huge
    page to give (THP off, memory fragmented) the buffer is ordinary 4 KiB pages.

    The mapping is never closed explicitly: torch views keep it alive and it is unmapped when the last one goes.
    """

    def __init__(self, nbytes: int):
        self.nbytes = align_up(max(int(nbytes), 1))
        huge = self.nbytes >= HUGE_PAGE
        # private, not MAP_SHARED /dev/zero (which Python's default is): shared memory is not eligible for THP
        self._mem = mmap.mmap(-1, self.nbytes + (HUGE_PAGE if huge else 0),
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(self._mem, dtype=torch.uint8)
        start = (-whole.data_ptr()) % HUGE_PAGE if huge else 0
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._mem.madvise(mmap.MADV_HUGEPAGE, start, self.nbytes // HUGE_PAGE * HUGE_PAGE)
            except OSError:  # a kernel without THP: ordinary pages
                pass
        self._u8 = whole[start:start + self.nbytes]
        self._mv = memoryview(self._mem)[start:start + self.nbytes]

    @property
    def address(self) -> int:
        return self._u8.data_ptr()

    def _check(self, offset: int, nbytes: int | None) -> int:
        n = self.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise ValueError(f"range [{offset}, {offset + n}) is outside the {self.nbytes}-byte buffer")
        return n

    def tensor(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """uint8 [nbytes] view of the buffer's bytes from `offset` (no copy; valid until the buffer is reused)."""
        n = self._check(offset, nbytes)
        return self._u8[offset:offset + n]

    def memoryview(self, offset: int = 0, nbytes: int | None = None) -> memoryview:
        n = self._check(offset, nbytes)
        return self._mv[offset:offset + n]

    def __repr__(self) -> str:
        return f"AlignedBuffer(nbytes={self.nbytes}, address={self.address:#x})"


class Arena:
    """Long-lived tensors' bytes carved in turn out of one AlignedBuffer of `nbytes` (each start 64-byte aligned):
    the resident weights of an unlimited run, so that they sit in huge pages where the kernel gives them. A decode
    step reads every resident weight once, in long runs; in 4 KiB pages that is a TLB miss every 4 KiB
    (docs/performance.md, "Resident weights in huge pages"). Nothing is freed before the last view goes."""

    ALIGN = 64

    def __init__(self, nbytes: int):
        self.buffer = AlignedBuffer(nbytes)
        self.used = 0

    @classmethod
    def size(cls, nbytes: int) -> int:
        """What a take of `nbytes` uses of the arena."""
        return align_up(nbytes, cls.ALIGN)

    def take(self, nbytes: int) -> torch.Tensor:
        """The next `nbytes` of the arena as a uint8 tensor; ValueError when it has no room left."""
        t = self.buffer.tensor(self.used, nbytes)
        self.used += self.size(nbytes)
        return t


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"; None where unknown): with "never"
    AlignedBuffer gets 4 KiB pages and reads may be slower and vary by buffer."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text and "]" in text else None


def huge_page_bytes(buffers: Sequence[AlignedBuffer]) -> int | None:
    """Bytes of `buffers` backed by transparent huge pages (AnonHugePages of the mappings holding them, from
    /proc/self/smaps), or None where smaps is unavailable. Reads smaps once: call it at load, not per token."""
    spans = sorted((b.address, b.address + b.nbytes) for b in buffers)
    if not spans:
        return 0
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return None
    total = 0
    lo = hi = None
    for line in text.splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):
            a, _, b = head.partition("-")
            try:
                lo, hi = int(a, 16), int(b, 16)
            except ValueError:
                lo = hi = None
        elif line.startswith("AnonHugePages:") and lo is not None:
            if any(s < hi and lo < e for s, e in spans):
                total += int(line.split()[1]) * 1024
    return total


@dataclass
class IOStats:
    direct: bool  # every file is read with O_DIRECT (False: buffered + fadvise(DONTNEED) fallback)
    io_threads: int
    request_size: int
    reads: int = 0  # completed page reads
    requests: int = 0  # completed preadv requests
    bytes_read: int = 0
    busy_s: float = 0.0  # summed over threads: time inside preadv
    active_s: float = 0.0  # wall time with at least one request in flight
    errors: int = 0

    @property
    def gb_per_s(self) -> float:
        """Achieved bandwidth while reading (10^9 bytes/s)."""
        return self.bytes_read / self.active_s / 1e9 if self.active_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["gb_per_s"] = round(self.gb_per_s, 3)
        return d


class _Read:
    __slots__ = ("future", "file_index", "offset", "nbytes", "buffer", "label", "todo", "inflight", "started",
                 "error", "skip", "verify", "buffer_offset")

    def __init__(self, future, file_index, offset, nbytes, buffer, label, todo, verify=None):
        self.future, self.file_index, self.offset, self.nbytes = future, file_index, offset, nbytes
        self.buffer, self.label, self.todo, self.verify = buffer, label, todo, verify
        self.buffer_offset = 0
        self.inflight = 0
        self.started = False
        self.error: StorageError | None = None
        self.skip = False  # cancelled before it started, or failed: its queued requests are dropped


def _forget_read(fut: Future) -> None:
    """A settled read needs no promotion: unlinking it breaks the Future <-> _Read cycle, so a buffer is freed as
    soon as its owner lets go of it, not at the next garbage collection (RSS, which elastic pins measure, counts
    it until then)."""
    vars(fut).pop("_colibri_read", None)


class _Request:
    __slots__ = ("read", "offset", "length", "need", "view", "taken")

    def __init__(self, read, offset, length, need, view):
        self.read, self.offset, self.length, self.need, self.view = read, offset, length, need, view
        self.taken = False


class Reader:
    """Page reads from a fixed list of data files on `io_threads` threads; see the module docstring.

    `direct`: None tries O_DIRECT per file and falls back to buffered reads (dropping the read range from the page
    cache afterwards) where the filesystem refuses it; False forces buffered reads; True refuses the fallback.
    """

    def __init__(self, paths: Sequence[str | os.PathLike], io_threads: int = DEFAULT_IO_THREADS,
                 request_size: int = DEFAULT_REQUEST_SIZE, direct: bool | None = None):
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        if request_size < ALIGN or request_size % ALIGN:
            raise ValueError(f"request_size must be a positive multiple of {ALIGN}, got {request_size}")
        self.paths = [os.fspath(p) for p in paths]
        self.io_threads, self.request_size = io_threads, request_size
        self._fds: list[int] = []
        self._direct: list[bool] = []
        self._retired_fds: list[int] = []
        try:
            for p in self.paths:
                self._open(p, direct)
        except BaseException:
            for fd in self._fds:
                os.close(fd)
            raise
        self._require_direct = direct is True
        self._cv = threading.Condition(threading.RLock())
        self._heap: list[tuple[int, int, _Request]] = []
        self._seq = itertools.count()
        self._stats = IOStats(direct=all(self._direct), io_threads=io_threads, request_size=request_size)
        self._inflight = 0
        self._active_since = 0.0
        self._closed = False
        self._threads = [threading.Thread(target=self._worker, name=f"colibri-io-{i}", daemon=True)
                         for i in range(io_threads)]
        for t in self._threads:
            t.start()

    def _open(self, path: str, direct: bool | None) -> None:
        try:
            if direct is not False:
                try:
                    self._fds.append(os.open(path, os.O_RDONLY | os.O_DIRECT))
                    self._direct.append(True)
                    return
                except OSError as e:
                    if e.errno != errno.EINVAL or direct:
                        raise
            self._fds.append(os.open(path, os.O_RDONLY))
            self._direct.append(False)
        except OSError as e:
            raise StorageError(f"cannot open data file {path}: {e.strerror}") from e

    # ---- public API -------------------------------------------------------------------------------------------

    def submit(self, file_index: int, offset: int, nbytes: int, buffer: AlignedBuffer, priority: int = PREFETCH,
               buffer_offset: int = 0, label: str = "", verify: Callable[[memoryview], None] | None = None) -> Future:
        """Read bytes [offset, offset + nbytes) of file `file_index` into `buffer` at `buffer_offset`.

        Both offsets must be multiples of 4096 and the buffer must hold `nbytes` rounded up to 4096. Returns a
        Future resolving to `buffer` once every request of the read is done; `label` (e.g. "page 12") prefixes
        the error message. A Future cancelled before its first request starts reads nothing. `verify`, if given,
        runs on the I/O thread over the bytes read (a checksum); the StorageError it raises fails the Future.
        """
        if not 0 <= file_index < len(self.paths):
            raise ValueError(f"file index {file_index} out of range (the reader has {len(self.paths)} files)")
        if offset % ALIGN or buffer_offset % ALIGN:
            raise ValueError(f"offsets must be multiples of {ALIGN}: file offset {offset}, "
                             f"buffer offset {buffer_offset}")
        span = align_up(nbytes)
        if nbytes < 0 or buffer_offset + span > buffer.nbytes:
            raise ValueError(f"a {nbytes}-byte read at buffer offset {buffer_offset} does not fit the "
                             f"{buffer.nbytes}-byte buffer")
        fut: Future = Future()
        read = _Read(fut, file_index, offset, nbytes, buffer, label, 0, verify)
        read.buffer_offset = buffer_offset
        reqs = []
        for pos in range(0, nbytes, self.request_size):
            length = min(self.request_size, span - pos)
            reqs.append(_Request(read, offset + pos, length, min(length, nbytes - pos),
                                 buffer.memoryview(buffer_offset + pos, length)))
        read.todo = len(reqs)
        fut._colibri_read = read  # lets promote() find the requests
        fut.add_done_callback(_forget_read)
        with self._cv:
            if self._closed:
                raise RuntimeError("the reader is closed")
            if not reqs:
                fut.set_result(buffer)
                return fut
            for r in reqs:
                heapq.heappush(self._heap, (priority, next(self._seq), r))
            self._cv.notify(min(len(reqs), self.io_threads))
        return fut

    def read(self, file_index: int, offset: int, nbytes: int, buffer: AlignedBuffer, buffer_offset: int = 0,
             label: str = "") -> AlignedBuffer:
        """Blocking demand read."""
        return self.submit(file_index, offset, nbytes, buffer, DEMAND, buffer_offset, label).result()

    def promote(self, future: Future, priority: int = DEMAND) -> None:
        """Move the not-yet-started requests of a submitted read to `priority` (a prefetch became a demand)."""
        read = getattr(future, "_colibri_read", None)
        if read is None:
            return
        with self._cv:
            # re-push the waiting requests; the old heap entries are skipped when popped (already taken)
            waiting = [r for _, _, r in self._heap if r.read is read and not r.taken]
            for r in waiting:
                nr = _Request(read, r.offset, r.length, r.need, r.view)
                r.taken = True
                heapq.heappush(self._heap, (priority, next(self._seq), nr))

    def stats(self) -> IOStats:
        """A snapshot of the counters."""
        with self._cv:
            s = dataclasses.replace(self._stats, direct=all(self._direct))
            if self._inflight:
                s.active_s += time.perf_counter() - self._active_since
            return s

    def close(self) -> None:
        """Stop the threads (each finishes its current request), fail reads still queued, close the files."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        pending = {id(r.read): r.read for _, _, r in self._heap if not r.taken}
        self._heap.clear()
        for read in pending.values():
            if not read.future.cancel() and not read.future.done():
                err = self._error(read, read.offset, "the reader was closed before the read finished")
                read.future.set_exception(err)
        for fd in self._fds + self._retired_fds:
            os.close(fd)
        self._fds, self._retired_fds = [], []

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- worker side ------------------------------------------------------------------------------------------

    def _error(self, read: _Read, offset: int, what: str) -> StorageError:
        head = f"{read.label}: " if read.label else ""
        return StorageError(f"{head}read of {self.paths[read.file_index]} at offset {offset} failed: {what}")

    def _next_locked(self) -> _Request | None:
        while True:
            while not self._heap and not self._closed:
                self._cv.wait()
            if self._closed:
                return None
            req = heapq.heappop(self._heap)[2]
            if req.taken:
                continue
            req.taken = True
            read = req.read
            if read.skip:
                continue
            if not read.started:
                read.started = True
                if not read.future.set_running_or_notify_cancel():
                    read.skip = True
                    continue
            read.inflight += 1
            if self._inflight == 0:
                self._active_since = time.perf_counter()
            self._inflight += 1
            return req

    def _worker(self) -> None:
        while True:
            with self._cv:
                req = self._next_locked()
            if req is None:
                return
            read = req.read
            t0 = time.perf_counter()
            err = None
            try:
                self._do(req)
            except StorageError as e:
                err = e
            except OSError as e:
                err = self._error(read, req.offset, f"{e.strerror or e} (errno {e.errno})")
            except Exception as e:  # noqa: BLE001 - whatever fails, the waiter gets it instead of waiting forever
                err = self._error(read, req.offset, f"unexpected {type(e).__name__}: {e}")
            t1 = time.perf_counter()
            result = None
            with self._cv:
                st = self._stats
                st.busy_s += t1 - t0
                self._inflight -= 1
                if self._inflight == 0:
                    st.active_s += t1 - self._active_since
                read.inflight -= 1
                if err is None:
                    st.requests += 1
                    st.bytes_read += req.need
                    read.todo -= 1
                    if read.todo == 0 and read.error is None:
                        st.reads += 1
                        result = (self._finish, read)
                else:
                    st.errors += 1
                    if read.error is None:
                        read.error, read.skip = err, True
                # a failed read resolves only when none of its requests still writes into the buffer
                if read.error is not None and read.inflight == 0 and not read.future.done():
                    result = (read.future.set_exception, read.error)
            if result is not None:
                self._resolve(read, *result)

    def _resolve(self, read: _Read, how: Callable, arg) -> None:
        """Settle a read's Future outside the lock (callbacks may submit more reads). Nothing that goes wrong
        here may end the thread or leave the Future pending: a waiter would block forever."""
        try:
            how(arg)
        except Exception as e:  # noqa: BLE001 - handed to the waiter below
            if not read.future.done():
                read.future.set_exception(self._error(read, read.offset, f"unexpected {type(e).__name__}: {e}"))

    def _finish(self, read: _Read) -> None:
        if read.verify is not None:
            try:
                read.verify(read.buffer.memoryview(read.buffer_offset, read.nbytes))
            except StorageError as e:
                read.future.set_exception(e)
                return
            except Exception as e:  # noqa: BLE001 - a broken check (a damaged manifest entry) is a failed read
                read.future.set_exception(self._error(read, read.offset, f"its check failed with "
                                                      f"{type(e).__name__}: {e}"))
                return
        read.future.set_result(read.buffer)

    def _do(self, req: _Request) -> None:
        i = req.read.file_index
        fd, direct = self._fds[i], self._direct[i]
        done = 0
        while done < req.need:
            try:
                n = self._pread(i, fd, req.view[done:], req.offset + done)
            except OSError as e:
                if e.errno == errno.EINVAL and direct and done == 0 and not self._require_direct:
                    fd, direct = self._fall_back(i), False  # the filesystem accepted O_DIRECT at open, not here
                    continue
                raise
            if n == 0 or (direct and (done + n) % ALIGN and done + n < req.need):
                raise self._error(req.read, req.offset + done + n,
                                  f"short read, got {done + n} of {req.need} bytes from offset {req.offset}; "
                                  f"the file is shorter than the container says (truncated or replaced)")
            done += n
        if not direct:
            os.posix_fadvise(fd, req.offset, req.length, os.POSIX_FADV_DONTNEED)

    def _pread(self, file_index: int, fd: int, view: memoryview, offset: int) -> int:
        """One read system call: bytes of file `file_index` (open as `fd`) at `offset` into `view`; the count read.
        The one place bytes come off the disk: an OSError raised here fails its request as the disk's would."""
        return os.preadv(fd, [view], offset)

    def _fall_back(self, i: int) -> int:
        with self._cv:
            if self._direct[i]:
                try:
                    fd = os.open(self.paths[i], os.O_RDONLY)
                except OSError as e:
                    raise StorageError(f"cannot reopen data file {self.paths[i]}: {e.strerror}") from e
                self._retired_fds.append(self._fds[i])  # another thread may still be using it
                self._fds[i], self._direct[i] = fd, False
            return self._fds[i]


def probe_bandwidth(path: str | os.PathLike, seconds: float = 1.0, request_size: int = DEFAULT_REQUEST_SIZE,
                    threads: int = DEFAULT_IO_THREADS, window: int = 64 << 20,
                    stop: threading.Event | None = None) -> float:
    """Read bandwidth of `path` in bytes/s: sequential `window`-sized reads (O_DIRECT where supported, two in
    flight) for about `seconds` or until `stop` is set, wrapping around at the end of the file."""
    size = os.path.getsize(path) // ALIGN * ALIGN
    if size == 0:
        raise ValueError(f"{path} is smaller than {ALIGN} bytes; nothing to measure")
    window = min(align_up(window), size)
    bufs = [AlignedBuffer(window) for _ in range(2)]
    for b in bufs:  # fault the pages in first: the engine reads into long-lived buffers, not fresh ones
        b.tensor().fill_(0)
    with Reader([path], io_threads=threads, request_size=request_size) as reader:
        offsets = itertools.cycle(range(0, size - window + 1, window))
        t0 = time.perf_counter()
        inflight = [reader.submit(0, next(offsets), window, b) for b in bufs]
        while True:
            done = inflight.pop(0).result()
            if time.perf_counter() - t0 >= seconds or (stop is not None and stop.is_set()):
                break
            inflight.append(reader.submit(0, next(offsets), window, done))
        for f in inflight:
            f.result()
        elapsed = time.perf_counter() - t0
        return reader.stats().bytes_read / elapsed

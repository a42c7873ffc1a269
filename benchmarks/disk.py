"""Read bandwidth of the disk under a Colibri container: picks colibri.weights.io's request size and thread count.

    python benchmarks/disk.py [--path /work/.bench] [--size-gb 3] [--read-gb 0.5] [--repeat 3]
    python benchmarks/disk.py --file EXISTING_FILE     # measure a file already there (kept)

Writes a file of random bytes next to where containers live, drops the page cache (root only; says so when it
cannot), then measures, through `colibri.weights.io.Reader`:
  * O_DIRECT sequential reads as 64 MiB pages (two in flight, as the streaming runtime does) split into
    requests of 256 KiB .. 8 MiB, on 1, 2 and 4 threads;
  * buffered sequential reads for comparison (plain `preadv` with kernel readahead, and the Reader's
    buffered fallback, which drops each range from the page cache after reading it);
  * 4 KiB random O_DIRECT reads at queue depth 1;
  * "buffers": the same 64 MiB reads into 8 different destination buffers, each read twice, once in 4 KiB pages
    (MADV_NOHUGEPAGE) and once as colibri.weights.io.AlignedBuffer allocates them (2 MiB-aligned, MADV_HUGEPAGE), idle
    and while a 2-thread bf16 matmul loop runs (as decode compute does). The figures that made AlignedBuffer use
    huge pages came from these rows (docs/performance.md, "Disk").
Each cell is the median of --repeat runs, each reading --read-gb from a different part of the file. The test
file is deleted at the end.

On a virtual disk the host may cache what the guest wrote or read recently (dropping the guest's page cache does
not reach it): a freshly written file then measures the host's cache. `--file` on a large file that nothing
touched lately shows the cold numbers; the first pass over it is the cold one.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import statistics
import threading
import time
from pathlib import Path

import torch

from colibri.weights.io import ALIGN, DEFAULT_IO_THREADS, DEFAULT_REQUEST_SIZE, AlignedBuffer, Reader, huge_page_bytes

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGE = 64 * MiB
REQUEST_SIZES = [256 * KiB, 1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB]
THREADS = [1, 2, 4]


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def write_file(path: Path, size: int) -> float:
    chunk = 64 * MiB
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(size // chunk):
            f.write(os.urandom(chunk))  # random: no storage layer can compress or dedupe it
        f.flush()
        os.fsync(f.fileno())
    return size / (time.perf_counter() - t0)


def regions(size: int, read_bytes: int):
    """Start offsets of successive measurement regions, so consecutive configurations read different bytes."""
    start = 0
    while True:
        if start + read_bytes > size:
            start = 0
        yield start
        start += read_bytes


def reader_gbps(path: Path, start: int, nbytes: int, request_size: int, threads: int, direct: bool) -> float:
    """Sequential pages of PAGE bytes from `start`, two pages in flight; returns GB/s (10^9)."""
    bufs = [AlignedBuffer(PAGE) for _ in range(2)]
    with Reader([path], io_threads=threads, request_size=request_size, direct=direct) as reader:
        if direct and not reader.stats().direct:
            raise SystemExit(f"O_DIRECT is not supported on {path}'s filesystem")
        offsets = list(range(start, start + nbytes, PAGE))
        t0 = time.perf_counter()
        inflight = [reader.submit(0, off, PAGE, b) for off, b in zip(offsets, bufs)]
        offsets = iter(offsets[len(inflight):])
        while inflight:
            buf = inflight.pop(0).result()
            off = next(offsets, None)
            if off is not None:
                inflight.append(reader.submit(0, off, PAGE, buf))
        return reader.stats().bytes_read / (time.perf_counter() - t0) / 1e9


def plain_buffered_gbps(path: Path, start: int, nbytes: int, request_size: int) -> float:
    buf = AlignedBuffer(request_size)
    view = buf.memoryview()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        done = 0
        while done < nbytes:
            done += os.preadv(fd, [view], start + done)
        return done / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def random_4k(path: Path, size: int, seconds: float) -> tuple[float, float]:
    """4 KiB O_DIRECT reads at random aligned offsets, one at a time: (MB/s, mean latency in us)."""
    buf = AlignedBuffer(ALIGN)
    view = buf.memoryview()
    rng = random.Random(0)
    blocks = size // ALIGN
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            os.preadv(fd, [view], rng.randrange(blocks) * ALIGN)
            n += 1
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return n * ALIGN / dt / 1e6, dt / n * 1e6


class SmallPageBuffer(AlignedBuffer):
    """An AlignedBuffer held in 4 KiB pages (MADV_NOHUGEPAGE), as colibri.weights.io allocated buffers before huge pages."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            self._mem.madvise(mmap.MADV_NOHUGEPAGE)
        self._u8 = torch.frombuffer(self._mem, dtype=torch.uint8)
        self._mv = memoryview(self._mem)


def per_buffer_gbps(path: Path, size: int, make, busy: bool, n: int = 8) -> tuple[list[float], int | None]:
    """One 64 MiB read into each of `n` fresh buffers from `make`, twice (the second pass is what is shown), with
    `busy`: while a 2-thread bf16 matmul loop runs. Returns (GB/s per buffer, bytes in huge pages)."""
    bufs = [make(PAGE) for _ in range(n)]
    for b in bufs:
        b.tensor().fill_(0)
    stop = threading.Event()
    w, x = torch.randn(4096, 4096).to(torch.bfloat16), torch.randn(1, 4096).to(torch.bfloat16)

    def work() -> None:
        while not stop.is_set():
            torch.nn.functional.linear(x, w)

    th = threading.Thread(target=work) if busy else None
    if th:
        th.start()
    try:
        with Reader([path], io_threads=DEFAULT_IO_THREADS) as reader:
            rates = []
            for rep in range(2):
                rates = []
                for i, b in enumerate(bufs):
                    off = (i * 7 + rep * 3) % (size // PAGE) * PAGE
                    t0 = time.perf_counter()
                    reader.submit(0, off, PAGE, b).result()
                    rates.append(PAGE / (time.perf_counter() - t0) / 1e9)
    finally:
        stop.set()
        if th:
            th.join()
    return rates, huge_page_bytes(bufs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", type=Path, default=Path("/work/.bench"), help="directory for the test file")
    ap.add_argument("--size-gb", type=float, default=3.0, help="test file size, GiB")
    ap.add_argument("--read-gb", type=float, default=0.5, help="bytes read per run, GiB")
    ap.add_argument("--repeat", type=int, default=3, help="runs per cell (median)")
    ap.add_argument("--random-seconds", type=float, default=3.0)
    ap.add_argument("--file", type=Path, help="measure this existing file instead of writing one")
    args = ap.parse_args()

    if args.file:
        path, created_dir, size = args.file, False, os.path.getsize(args.file) // PAGE * PAGE
        if size == 0:
            raise SystemExit(f"{path} is smaller than one {PAGE // MiB} MiB page")
    else:
        size = int(args.size_gb * GiB) // PAGE * PAGE
        created_dir = not args.path.exists()
        args.path.mkdir(parents=True, exist_ok=True)
        path = args.path / "colibri-disk-bench.bin"
    read_bytes = max(PAGE, min(size, int(args.read_gb * GiB) // PAGE * PAGE))
    try:
        if not args.file:
            print(f"writing {size / GiB:.2f} GiB to {path} ... ", end="", flush=True)
            print(f"{write_file(path, size) / 1e9:.2f} GB/s (buffered write + fsync)")
        dropped = drop_caches()
        print("page cache dropped" if dropped else
              "could not drop the page cache (not root?): O_DIRECT rows are unaffected, buffered rows may read RAM")
        where = regions(size, read_bytes)
        print(f"\nO_DIRECT sequential, {PAGE // MiB} MiB pages, 2 in flight, median of {args.repeat} runs of "
              f"{read_bytes / GiB:.2f} GiB, GB/s (10^9 B/s)")
        print("request   " + "".join(f"{t:>3} thr " for t in THREADS))
        table = {}
        for rs in REQUEST_SIZES:
            row = []
            for t in THREADS:
                table[rs, t] = statistics.median(reader_gbps(path, next(where), read_bytes, rs, t, direct=True)
                                                 for _ in range(args.repeat))
                row.append(f"{table[rs, t]:7.2f}")
            label = f"{rs // KiB} KiB" if rs < MiB else f"{rs // MiB} MiB"
            print(f"{label:<9}" + "".join(row))

        print("\nbuffered sequential (after dropping the file from the page cache), GB/s")
        for rs in (1 * MiB, 4 * MiB):
            drop_caches()
            print(f"  plain preadv + readahead, {rs // MiB} MiB, 1 thread: "
                  f"{plain_buffered_gbps(path, next(where), read_bytes, rs):6.2f}")
        drop_caches()
        print(f"  Reader fallback (fadvise DONTNEED), 2 MiB, 2 threads: "
              f"{reader_gbps(path, next(where), read_bytes, 2 * MiB, 2, direct=False):6.2f}")

        mbps, lat = random_4k(path, size, args.random_seconds)
        print(f"\n4 KiB random O_DIRECT reads, QD1: {mbps:.1f} MB/s, {lat:.0f} us mean latency "
              f"({1e6 / lat:.0f} IOPS)")

        print("\ndestination buffers: 64 MiB O_DIRECT reads, one per buffer, GB/s of each of 8 buffers")
        for name, make in (("4 KiB pages", SmallPageBuffer), ("AlignedBuffer", AlignedBuffer)):
            for busy in (False, True):
                rates, huge = per_buffer_gbps(path, size, make, busy)
                print(f"  {name:<14} {'under compute' if busy else 'idle':<13} "
                      + " ".join(f"{r:5.1f}" for r in rates)
                      + f"  (huge pages: {'?' if huge is None else huge // MiB} MiB of {8 * PAGE // MiB})")

        best = max(table, key=table.get)
        default = (DEFAULT_REQUEST_SIZE, DEFAULT_IO_THREADS)
        print(f"\nfastest cell: {best[0] // KiB} KiB x {best[1]} threads = {table[best]:.2f} GB/s; colibri.weights.io "
              f"default {default[0] // KiB} KiB x {default[1]} = {table.get(default, float('nan')):.2f} GB/s")
    finally:
        if not args.file:
            path.unlink(missing_ok=True)
            if created_dir:
                args.path.rmdir()


if __name__ == "__main__":
    main()

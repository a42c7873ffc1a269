"""colibri.weights.io: aligned buffers, the O_DIRECT reader thread pool, errors, fallback."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from colibri.weights import io
from colibri.core.errors import ColibriError, StorageError
from colibri.weights.io import (ALIGN, DEMAND, HUGE_PAGE, PREFETCH, AlignedBuffer, Arena, Reader, huge_page_bytes,
                        probe_bandwidth)
from faults import FailingReads

MiB = 1 << 20
FILE_SIZE = 40 * MiB + 1234  # an unaligned tail: the last read ends at EOF inside a 4096 block


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("io") / "data-00000.bin"
    data = os.urandom(FILE_SIZE)
    path.write_bytes(data)
    return path, data


def read_all(reader: Reader, size: int, page: int) -> bytes:
    """Read the file as pages of `page` bytes (prefetch priority, all queued at once)."""
    futs = []
    for off in range(0, size, page):
        n = min(page, size - off)
        futs.append((reader.submit(0, off, n, AlignedBuffer(n), PREFETCH, label=f"page {off // page}"), n))
    return b"".join(fut.result(timeout=30).tensor(0, n).numpy().tobytes() for fut, n in futs)


@pytest.mark.parametrize("request_size,threads,page", [
    (256 << 10, 1, 7 * MiB), (1 * MiB, 2, 64 * MiB), (4 * MiB, 3, 5 * MiB + 4096), (ALIGN, 2, 3 * MiB)])
def test_read_matches_file(data_file, request_size, threads, page):
    path, data = data_file
    with Reader([path], io_threads=threads, request_size=request_size) as reader:
        assert read_all(reader, len(data), page) == data
        st = reader.stats()
    assert st.bytes_read == len(data)
    assert st.reads == -(-len(data) // page)
    assert st.requests >= st.reads and st.active_s > 0 and st.busy_s > 0 and st.errors == 0


def test_buffer_offset_and_zero_copy_views(data_file):
    path, data = data_file
    buf = AlignedBuffer(3 * MiB + 5)
    assert buf.nbytes == 3 * MiB + ALIGN and buf.address % ALIGN == 0
    with Reader([path]) as reader:
        assert reader.read(0, 8192, MiB, buf, buffer_offset=2 * MiB) is buf
    view = buf.tensor(2 * MiB, MiB)
    assert view.dtype == torch.uint8 and view.data_ptr() == buf.address + 2 * MiB
    assert view.numpy().tobytes() == data[8192:8192 + MiB]
    view[0] = view[0] ^ 0xFF  # writes through: same memory
    assert buf.memoryview(2 * MiB, 1)[0] == view[0].item()
    # typed views over the same bytes stay zero-copy
    f = buf.tensor(0, 4096).view(torch.float32)
    assert f.data_ptr() == buf.address and f.numel() == 1024
    with pytest.raises(ValueError):
        buf.tensor(buf.nbytes - 10, 11)


def _queue_order(reader: Reader, n_prefetch: int, last_priority: int, promote: bool):
    order: list[str] = []
    lock = threading.Lock()

    def record(name):
        def cb(_):
            with lock:
                order.append(name)
        return cb

    futs = []
    with reader._cv:  # hold the worker off so that the whole queue exists before the first pop
        for i in range(n_prefetch + 1):
            name = "last" if i == n_prefetch else f"p{i}"
            prio = last_priority if i == n_prefetch else PREFETCH
            f = reader.submit(0, i * ALIGN * 16, ALIGN * 16, AlignedBuffer(ALIGN * 16), prio)
            f.add_done_callback(record(name))
            futs.append(f)
        if promote:
            reader.promote(futs[-1])
    for f in futs:
        f.result(timeout=30)
    return order


@pytest.mark.parametrize("promote", [False, True])
def test_demand_overtakes_queued_prefetches(data_file, promote):
    path, _ = data_file
    with Reader([path], io_threads=1, request_size=ALIGN * 16) as reader:
        order = _queue_order(reader, 40, PREFETCH if promote else DEMAND, promote)
    # one thread, queue built before the first pop: the demand goes first, prefetches keep their order
    assert order == ["last"] + [f"p{i}" for i in range(40)], order


def test_truncated_file_raises_and_the_reader_keeps_working(tmp_path):
    path = tmp_path / "data-00001.bin"
    data = os.urandom(8 * MiB)
    path.write_bytes(data)
    buf = AlignedBuffer(8 * MiB)
    with Reader([path], request_size=MiB) as reader:
        os.truncate(path, 3 * MiB + 100)
        with pytest.raises(StorageError) as ei:
            reader.read(0, 0, 8 * MiB, buf, label="page 7")
        msg = str(ei.value)
        assert "\n" not in msg and "page 7" in msg and str(path) in msg and "offset" in msg and "short read" in msg
        assert isinstance(ei.value, ColibriError)
        assert reader.read(0, 0, 2 * MiB, buf) is buf
        assert buf.tensor(0, 2 * MiB).numpy().tobytes() == data[:2 * MiB]
        assert reader.stats().errors >= 1


def test_injected_error_then_next_read_succeeds(data_file):
    path, data = data_file
    buf = AlignedBuffer(8 * MiB)
    with Reader([path], io_threads=2, request_size=MiB) as reader:
        disk = FailingReads(reader).fail(0, offset=4 * MiB + 10)
        with pytest.raises(StorageError) as ei:
            reader.read(0, 0, 8 * MiB, buf, label="page 3")
        msg = str(ei.value)
        assert "page 3" in msg and str(path) in msg and f"offset {4 * MiB}" in msg and "Input/output" in msg
        assert reader.read(0, 0, 8 * MiB, buf) is buf  # the injection fired once
        assert buf.tensor(0, 8 * MiB).numpy().tobytes() == data[:8 * MiB]
        disk.fail(0)  # any offset
        with pytest.raises(StorageError):
            reader.read(0, 16 * MiB, MiB, buf)
        assert reader.stats().errors == 2


def test_buffered_fallback_forced(data_file):
    path, data = data_file
    with Reader([path], request_size=MiB, direct=False) as reader:
        assert read_all(reader, len(data), 16 * MiB) == data
        st = reader.stats()
    assert st.direct is False and st.as_dict()["direct"] is False and st.bytes_read == len(data)


def test_buffered_fallback_when_o_direct_refused(data_file, monkeypatch):
    path, data = data_file
    real_open = os.open

    def no_direct(p, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # what tmpfs said before Linux 6.6
        return real_open(p, flags, *a)

    monkeypatch.setattr(io.os, "open", no_direct)
    buf = AlignedBuffer(2 * MiB)
    with Reader([path]) as reader:
        assert reader.stats().direct is False
        reader.read(0, MiB, 2 * MiB, buf)
    assert buf.tensor().numpy().tobytes() == data[MiB:3 * MiB]
    with pytest.raises(StorageError, match="cannot open data file"):
        Reader([path], direct=True)


def test_missing_file_and_bad_arguments(tmp_path, data_file):
    with pytest.raises(StorageError, match="nope.bin"):
        Reader([tmp_path / "nope.bin"])
    path, _ = data_file
    reader = Reader([path])
    with pytest.raises(ValueError):
        reader.submit(0, 100, 4096, AlignedBuffer(4096))  # unaligned offset
    with pytest.raises(ValueError):
        reader.submit(0, 0, 8192, AlignedBuffer(4096))  # does not fit
    with pytest.raises(ValueError):
        reader.submit(1, 0, 4096, AlignedBuffer(4096))
    reader.close()
    reader.close()
    with pytest.raises(RuntimeError):
        reader.submit(0, 0, 4096, AlignedBuffer(4096))


def test_cancelled_prefetch_reads_nothing(data_file):
    path, _ = data_file
    with Reader([path], io_threads=1, request_size=ALIGN) as reader:
        futs = [reader.submit(0, i * ALIGN, ALIGN, AlignedBuffer(ALIGN)) for i in range(200)]
        cancelled = [f for f in futs[100:] if f.cancel()]
        for f in futs:
            if not f.cancelled():
                f.result(timeout=30)
        assert reader.stats().bytes_read == (200 - len(cancelled)) * ALIGN


def test_probe_bandwidth(data_file):
    path, _ = data_file
    bw = probe_bandwidth(path, seconds=0.2, window=8 * MiB)
    assert bw > 1e6


def test_large_buffers_start_on_a_huge_page_and_small_ones_stay_small():
    """Buffers of a huge page or more are 2 MiB-aligned (transparent huge pages where the kernel gives them:
    O_DIRECT into scattered 4 KiB pages read 2-3x slower on the VM); the usable size is exactly what was asked."""
    big, small = AlignedBuffer(5 * HUGE_PAGE + 4096), AlignedBuffer(8192)
    assert big.address % HUGE_PAGE == 0 and big.nbytes == 5 * HUGE_PAGE + 4096 == big.tensor().numel()
    assert small.address % ALIGN == 0 and small.nbytes == 8192 == len(small.memoryview())
    big.tensor().fill_(7)
    small.tensor().fill_(1)
    huge = huge_page_bytes([big, small])
    assert huge is None or 0 <= huge <= 5 * HUGE_PAGE  # only whole huge pages inside the buffer are advised
    assert int(big.tensor()[-1]) == 7 and bytes(big.memoryview(big.nbytes - 2)) == b"\x07\x07"


def test_arena_hands_out_aligned_consecutive_ranges_of_one_buffer():
    """An Arena gives each take the next range of its one buffer (64-byte aligned starts, exactly the bytes asked
    for), writes through, and refuses a take past its end."""
    sizes = [3 * MiB + 5, 100, 64, 1]
    arena = Arena(sum(Arena.size(n) for n in sizes))
    views = [arena.take(n) for n in sizes]
    base = arena.buffer.address
    assert [v.numel() for v in views] == sizes
    assert [v.data_ptr() - base for v in views] == [0, 3 * MiB + 64, 3 * MiB + 192, 3 * MiB + 256]
    for i, v in enumerate(views):
        v.fill_(i + 1)
    assert [int(v[-1]) for v in views] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="outside"):
        arena.take(arena.buffer.nbytes)

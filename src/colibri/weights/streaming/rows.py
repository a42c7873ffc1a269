"""Tables the streaming store reads by rows instead of whole (placement.by_rows): the token lookup reads only
the rows of the tokens in the pass (merged aligned spans), and the head streams its rows in blocks through
place.HEAD_BUFFERS buffers, the next blocks read while one computes. A table's small companions (scales, and
tensors sharing its page) stay resident. q4 tables are read in whole tiles (padding rows included)."""

from __future__ import annotations

import bisect
import contextlib
import math
import time
import zlib
from concurrent.futures import Future
from typing import Callable, Iterator

import torch

from colibri.weights import placement as place
from colibri.quant import kinds as quant
from colibri.formats.container import DTYPES, FLOAT_KINDS, ContainerCheckpoint, tensor_from_bytes
from colibri.weights.io import ALIGN, DEMAND, AlignedBuffer, Reader, align_up
from colibri.weights.placement import block_rows, main_part, row_bytes, row_tensor, side_ranges, stored_rows, unit_of
from colibri.weights.streaming.checks import Checksums
from colibri.weights.streaming.stats import StreamStats


class RowTables:
    def __init__(self, ckpt: ContainerCheckpoint, reader: Reader, stats: StreamStats, checks: Checksums,
                 dtype: torch.dtype, as_compute: Callable):
        self.pages, self.tensors = ckpt.pages, ckpt.tensors
        self.reader, self.stats, self.checks = reader, stats, checks
        self.dtype, self.as_compute = dtype, as_compute
        self.side: dict[str, dict[str, torch.Tensor]] = {}  # by-rows table -> its resident parts
        self.blocks: list[AlignedBuffer] = []  # the head's block buffers

    def load(self, by_rows: list[int], tied: bool, block_bytes: int, pinned: dict[str, object]) -> None:
        """Verify each by-rows page once, reading it in blocks, and keep its small companions resident (whole
        tensors go into `pinned`)."""
        if not by_rows:
            return
        step = 8 << 20
        chunk = AlignedBuffer(step)
        for pid in by_rows:
            page = self.pages[pid]
            table = row_tensor(page, self.tensors)
            ranges = side_ranges(page, self.tensors, table)
            side = AlignedBuffer(sum(align_up(n) for *_, n in ranges))
            dest, at = [], 0
            for r in ranges:
                dest.append(at)
                at += align_up(r[3])
            crc = 0
            for c0 in range(0, page.nbytes, step):
                n = min(step, page.nbytes - c0)
                self.reader.read(page.file, page.offset + c0, n, chunk, label=f"page {pid}")
                crc = zlib.crc32(chunk.memoryview(0, n), crc)
                for (_, _, off, nb), d in zip(ranges, dest):
                    lo, hi = max(off, c0), min(off + nb, c0 + n)
                    if lo < hi:
                        side.tensor(d + lo - off, hi - lo).copy_(chunk.tensor(lo - c0, hi - lo))
            self.stats.bytes_read += page.nbytes
            self.checks.check_page(pid, crc)
            for (name, part, _, nb), d in zip(ranges, dest):
                t = self.tensors[name]
                if part is None:
                    pinned[name] = self.as_compute(tensor_from_bytes(t, side.tensor(d, nb)))
                else:
                    p = t.parts[part]
                    self.side.setdefault(name, {})[part] = side.tensor(d, nb).view(DTYPES[p.dtype]).view(p.shape)
        if any(self.pages[i].kind == "head" or tied for i in by_rows):
            size = block_bytes // place.HEAD_BUFFERS
            self.blocks = [AlignedBuffer(size) for _ in range(place.HEAD_BUFFERS)]

    def _table(self, name: str, r0: int, r1: int, data: torch.Tensor):
        """Rows [r0, r1) of table `name` over `data` (their bytes), with the resident companions."""
        t = self.tensors[name]
        p = t.parts[main_part(t)]
        k = t.shape[1]
        rows = data.view(DTYPES[p.dtype]).view(r1 - r0, *p.shape[1:])
        if t.kind in FLOAT_KINDS:
            return rows
        if t.kind in quant.TILED_KINDS:  # whole tiles; side parts [G, Np, 2] -> this block's [G, r1 - r0, 2]
            side = {n: quant.tile_side_rows(t.kind, n, v, r0, r1) for n, v in self.side.get(name, {}).items()}
            n = min(r1, t.shape[0]) - r0  # the last block carries the padding rows
        else:
            side = {n: v[r0:r1] for n, v in self.side.get(name, {}).items()}
            n = r1 - r0
        return quant.from_buffers(t.kind, (n, k), t.group_size, {"qweight": rows, **side})

    def read(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup of a table on disk: read only the rows of these tokens (merged aligned spans)."""
        t = self.tensors[name]
        page = self.pages[self.tensors[name].page]
        base = t.offset + t.parts[main_part(t)].offset
        rb = row_bytes(t)
        uniq, inverse = torch.unique(ids, return_inverse=True)
        units = sorted({unit_of(t, r) for r in uniq.tolist()})  # the rows themselves, or their q4 tiles
        spans: list[list[int]] = []  # [file start, file end] of merged aligned spans
        for r0, r1 in units:
            s, e = (base + r0 * rb) // ALIGN * ALIGN, align_up(base + r1 * rb)
            if spans and s <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], e)
            else:
                spans.append([s, e])
        buf = AlignedBuffer(sum(e - s for s, e in spans))
        futures, at, where = [], 0, []
        for s, e in spans:
            futures.append(self.reader.submit(page.file, s, e - s, buf, DEMAND, buffer_offset=at,
                                              label=f"page {page.id} (rows of {name})"))
            where.append((s, e, at))
            at += e - s
        t0 = time.perf_counter()
        try:
            for f in futures:
                f.result()
        finally:
            self.stats.io_wait_s += time.perf_counter() - t0
        self.stats.bytes_read += at
        self.stats.row_bytes_read += at

        def at_file(r0: int, r1: int) -> torch.Tensor:
            a = base + r0 * rb
            s, _, off = where[bisect.bisect_right(where, (a, math.inf, 0)) - 1]
            return buf.tensor(off + a - s, (r1 - r0) * rb)

        if t.kind in quant.TILED_KINDS:  # dequantize the tiles that hold the rows one at a time, picking rows
            vals = torch.empty(len(uniq), t.shape[1], dtype=self.dtype)
            by_tile: dict[tuple[int, int], list[tuple[int, int]]] = {}
            for j, r in enumerate(uniq.tolist()):
                by_tile.setdefault(unit_of(t, r), []).append((j, r))
            for u, members in by_tile.items():
                tile = self._table(name, *u, at_file(*u)).dequantize()
                for j, r in members:
                    vals[j] = tile[r - u[0]]
            return vals[inverse]
        got = [at_file(r, r + 1) for r in uniq.tolist()]
        p = t.parts[main_part(t)]
        rows = torch.stack(got).view(DTYPES[p.dtype]).view(len(got), *p.shape[1:])
        if t.kind in FLOAT_KINDS:
            vals = rows
        else:
            side = {n: v[uniq].contiguous() for n, v in self.side.get(name, {}).items()}
            vals = quant.from_buffers(t.kind, (len(got), t.shape[1]), t.group_size,
                                      {"qweight": rows, **side}).rows(torch.arange(len(got)))
        return vals[inverse].to(self.dtype)

    def stream(self, name: str) -> Iterator:
        """Rows of a head table in blocks through place.HEAD_BUFFERS buffers: the next blocks read while one computes."""
        t = self.tensors[name]
        page = self.pages[self.tensors[name].page]
        base = t.offset + t.parts[main_part(t)].offset
        rb, n, step = row_bytes(t), stored_rows(t), block_rows(t)  # q4: whole tiles, padding rows included
        blocks = [(r, min(n, r + step)) for r in range(0, n, step)]
        pending: dict[int, tuple[Future, int]] = {}

        def submit(b: int) -> None:
            r0, r1 = blocks[b]
            s = (base + r0 * rb) // ALIGN * ALIGN
            size = base + r1 * rb - s
            fut = self.reader.submit(page.file, s, size, self.blocks[b % len(self.blocks)], DEMAND,
                                     label=f"page {page.id} (rows {r0}-{r1} of {name})")
            pending[b] = (fut, base + r0 * rb - s)
            self.stats.bytes_read += size
            self.stats.row_bytes_read += size

        try:
            for b in range(min(len(self.blocks), len(blocks))):
                submit(b)
            for b, (r0, r1) in enumerate(blocks):
                fut, off = pending[b]
                t0 = time.perf_counter()
                try:
                    fut.result()
                finally:
                    self.stats.io_wait_s += time.perf_counter() - t0
                del pending[b]
                data = self.blocks[b % len(self.blocks)].tensor(off, (r1 - r0) * rb)
                yield self.as_compute(self._table(name, r0, r1, data))
                if b + len(self.blocks) < len(blocks):
                    submit(b + len(self.blocks))
        finally:
            for fut, _ in pending.values():  # an abandoned pass: no read may still write into a buffer
                if not fut.cancel():
                    with contextlib.suppress(Exception):
                        fut.result()

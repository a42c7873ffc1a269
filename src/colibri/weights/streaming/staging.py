"""The staging ring: the equal-size slots that streamed pages are read into (O_DIRECT), and the forward order
they are read in.

A streamed page is read into a free slot just before its scope (a demand read) or ahead of it (prefetch: up to
`depth` non-expert pages past the scope in forward order, wrapping to the next pass), is held while a scope over
it is open, and its slot is freed when the scope ends unless the expert cache keeps it (`Slot.cached`). Equal
slots never fragment: a demand read always finds one once pages not held are dropped (`make_room`). Elastic pins
take pages out of the streamed set (`remove`) and give them back (`add`)."""

from __future__ import annotations

import bisect
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from colibri.formats.container import TensorEntry
from colibri.weights.io import DEMAND, HUGE_PAGE, PREFETCH, AlignedBuffer, Reader, huge_page_bytes
from colibri.weights.placement import Scope, WeightTable
from colibri.weights.streaming.checks import Checksums
from colibri.weights.streaming.stats import PageState, StreamStats


@dataclass
class Slot:
    buffer: AlignedBuffer
    future: Future
    cached: bool = False  # an expert kept resident after its scope
    fresh: bool = True  # read and not yet used


class Staging:
    def __init__(self, weights: WeightTable, reader: Reader, checks: Checksums, stats: StreamStats,
                 state: dict[int, PageState], streamed: Iterable[int], slot_bytes: int, count: int, depth: int):
        """`state`: the tier of every page, shared with the store (this ring moves streamed pages between
        ON_DISK, LOADING and RESIDENT); `streamed`: the placement's streamed pages in forward order; `count`
        slots of `slot_bytes`; `depth`: pages read ahead of a scope."""
        self.weights, self.pages = weights, weights.pages
        self.reader, self.checks, self.stats, self.state, self.depth = reader, checks, stats, state, depth
        self.slots: dict[int, Slot] = {}  # page id -> the slot its read went into
        self.free: list[AlignedBuffer] = [AlignedBuffer(slot_bytes) for _ in range(count)]
        self.held: set[int] = set()  # streamed pages of the open scope(s)
        self.order = list(streamed)  # forward order: the prefetch sequence
        self.streamed = set(self.order)
        self.scope_pages: dict[Scope, list[int]] = {}  # scope -> its streamed pages, in order
        self.scope_end: dict[Scope, int] = {}  # last page id of each scope (streamed or not)
        for p in self.pages:
            for key in weights.scopes(p.id):
                if p.id in self.streamed:
                    self.scope_pages.setdefault(key, []).append(p.id)
                self.scope_end[key] = max(self.scope_end.get(key, -1), p.id)

    # -- the streamed set ---------------------------------------------------------------------------------------

    def remove(self, pid: int) -> None:
        """Page `pid` stops streaming (an elastic pin)."""
        self.streamed.discard(pid)
        self.order.remove(pid)
        for key in self.weights.scopes(pid):
            self.scope_pages[key].remove(pid)

    def add(self, pid: int) -> None:
        """Page `pid` streams again, in its place in forward order."""
        self.streamed.add(pid)
        bisect.insort(self.order, pid)
        for key in self.weights.scopes(pid):
            bisect.insort(self.scope_pages.setdefault(key, []), pid)

    def streamed_bytes(self) -> int:
        """What a dense pass reads of the streamed pages (a tied table twice: lookup and head)."""
        return self.weights.pass_bytes(self.streamed)

    def unread(self, pid: int) -> bool:
        """A streamed page with no read started (in no slot)."""
        return self.state[pid] == PageState.ON_DISK and pid in self.streamed

    # -- reads and slots ----------------------------------------------------------------------------------------

    def start(self, pid: int, priority: int) -> None:
        page = self.pages[pid]
        if not self.free:
            raise RuntimeError(f"internal: no staging slot free for page {pid}")
        buf = self.free.pop()
        fut = self.reader.submit(page.file, page.offset, page.nbytes, buf, priority, label=f"page {pid}",
                                 verify=self.checks.verifier(pid))
        self.slots[pid] = Slot(buf, fut)
        self.state[pid] = PageState.LOADING
        self.stats.bytes_read += page.nbytes
        self.stats.page_reads += 1

    def drop(self, pid: int) -> None:
        """Free page `pid`'s slot (cancelling its read, or waiting for it to end)."""
        slot = self.slots.pop(pid, None)
        if slot is None:
            return
        if not slot.future.cancel():
            try:
                slot.future.result()
            except Exception:  # noqa: BLE001 - the read's error surfaces if the page is needed again
                pass
        self.free.append(slot.buffer)
        self.state[pid] = PageState.ON_DISK

    def cancel(self, pid: int) -> bool:
        """Take back page `pid`'s read if it has not started (nothing was read: the counters go back too)."""
        if not self.slots[pid].future.cancel():
            return False
        self.stats.bytes_read -= self.pages[pid].nbytes
        self.stats.page_reads -= 1
        self.drop(pid)
        return True

    def done(self, pid: int | None) -> bool:
        """Page `pid`'s read is in a slot and ended without error."""
        slot = self.slots.get(pid)
        return slot is not None and slot.future.done() and slot.future.exception() is None

    def view(self, t: TensorEntry, pid: int) -> torch.Tensor:
        """The bytes of tensor `t` in the slot of its page `pid`."""
        return self.slots[pid].buffer.tensor(t.offset - self.pages[pid].offset, t.nbytes)

    # -- scopes -------------------------------------------------------------------------------------------------

    def take(self, pids: list[int], expert: bool, soon: set[int], evict: Callable[[set[int]], bool]) -> set[int]:
        """A scope over streamed pages `pids` opens: promote the reads in flight, start demand reads for the
        rest (`make_room` with `soon` and `evict`), and count each use. Returns the pages read or being read
        before the scope began (prefetched, routed or cached)."""
        ahead = set()
        for pid in pids:
            slot = self.slots.get(pid)
            if slot is not None:
                ahead.add(pid)
                slot.cached = False  # held now; re-admitted (or not) when the scope ends
                self.reader.promote(slot.future)
            else:  # a demand read for what prefetch did not bring
                self.make_room(set(pids), soon, evict)
                self.start(pid, DEMAND)
                slot = self.slots[pid]
            # A hit is a use served by bytes read for an earlier use (a cached expert); a page read for this use,
            # prefetched or not, is a miss.
            hit = not slot.fresh
            slot.fresh = False
            nbytes = self.pages[pid].nbytes
            if hit:
                self.stats.hits += 1
                self.stats.hit_bytes += nbytes
            else:
                self.stats.misses += 1
                self.stats.miss_bytes += nbytes
            if expert:
                if hit:
                    self.stats.expert_hits += 1
                else:
                    self.stats.expert_misses += 1
        return ahead

    def wait(self, pids: list[int]) -> float:
        """Wait for the reads of `pids` and hold them; returns the seconds waited. A failed read raises
        StorageError naming the page and file and leaves nothing behind: the next pass reads the pages again."""
        t0 = time.perf_counter()
        try:
            for pid in pids:
                self.slots[pid].future.result()
                self.state[pid] = PageState.RESIDENT
        except BaseException:
            for pid in pids:
                self.drop(pid)
            raise
        finally:
            self.stats.io_wait_s += time.perf_counter() - t0
        waited = time.perf_counter() - t0
        self.held.update(pids)
        return waited

    def make_room(self, keep: set[int], soon: set[int], evict: Callable[[set[int]], bool]) -> None:
        """Free a slot for a demand read: drop prefetched pages (farthest ahead first) other than `soon` (the
        layer's routed experts still to run, read early by a guess), then, if still needed, `evict(keep)` a
        cached expert, then the `soon` pages. Pages in `keep` (the scope's own) stay."""
        if self.free:
            return
        loose = sorted((p for p, s in self.slots.items() if not s.cached and p not in self.held and p not in keep),
                       key=self._distance, reverse=True)
        for pid in [p for p in loose if p not in soon]:
            self.drop(pid)
            if self.free:
                return
        if evict(keep):
            return
        for pid in [p for p in loose if p in soon]:
            self.drop(pid)
            if self.free:
                return

    def _distance(self, pid: int) -> int:
        return bisect.bisect_left(self.order, pid)

    def prefetch_after(self, last: int) -> None:
        """Start reads of the streamed pages that follow page `last` in forward order (cyclically: the next
        pass starts over), up to `depth` pages and as far as free slots allow."""
        if self.depth <= 0 or not self.order:
            return
        start = bisect.bisect_right(self.order, last)
        issued = 0
        for k in range(len(self.order)):
            nxt = self.order[(start + k) % len(self.order)]
            if self.pages[nxt].kind == "expert":
                continue  # routing decides which experts: they are read on demand
            if issued >= self.depth:
                return
            issued += 1
            if nxt in self.slots or nxt in self.held:
                continue
            if not self.free:
                return  # never evict something needed sooner for something needed later
            self.start(nxt, PREFETCH)


def fault_in(buffers: list[AlignedBuffer]) -> float | None:
    """Touch `buffers` now (huge pages where the kernel has them), not mid-token; returns the share of their
    bytes in transparent huge pages (None: unknown). O_DIRECT into 4 KiB pages can read much slower
    (io.AlignedBuffer; docs/performance.md, "Disk"): the share tells a slow run apart from a slow disk."""
    for buf in buffers:
        buf.tensor().fill_(0)
    big = [b for b in buffers if b.nbytes >= HUGE_PAGE]  # smaller buffers never get huge pages
    huge, total = huge_page_bytes(big), sum(b.nbytes for b in big)
    return round(huge / total, 4) if huge is not None and total else None

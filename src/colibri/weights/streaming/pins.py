"""Pinned pages. PinnedPages holds them: each read into a buffer of its own, its tensors resident in the compute
dtype. ElasticPins decides which beyond the placement's own: streamed dense pages are pinned while the memory limit
has room beside the KV cache and the activations of the pass at hand, and unpinned (the last made first; they
stream again) when those grow. The staging was sized for the placement's streamed set, which holds every set left
streaming, so pins never need more staging."""

from __future__ import annotations

from typing import Callable

import torch

from colibri.weights import placement as place
from colibri.formats.container import PageEntry, TensorEntry, tensor_from_bytes
from colibri.core import heap
from colibri.core.errors import StorageError
from colibri.core.metrics import rss_bytes
from colibri.weights.io import DEMAND, AlignedBuffer, Reader
from colibri.weights.streaming.checks import Checksums
from colibri.weights.streaming.staging import Staging
from colibri.weights.streaming.stats import PageState, StreamStats


class PinnedPages:
    def __init__(self, pages: list[PageEntry], tensors: dict[str, TensorEntry], reader: Reader, checks: Checksums,
                 stats: StreamStats, state: dict[int, PageState], staging: Staging, as_compute: Callable):
        """`state`: the tier of every page, shared with the store; `staging`: where a page pinned elastically
        streamed from, and streams again once released; `as_compute`: a tensor in the compute dtype."""
        self.pages, self.tensors, self.reader, self.checks = pages, tensors, reader, checks
        self.stats, self.state, self.staging, self.as_compute = stats, state, staging, as_compute
        self.objects: dict[str, object] = {}  # tensor name -> its value, over the page's own buffer

    def pin(self, pid: int) -> AlignedBuffer:
        """Read page `pid` into a buffer of its own and keep its tensors resident."""
        page = self.pages[pid]
        buf = AlignedBuffer(page.nbytes)
        self.reader.submit(page.file, page.offset, page.nbytes, buf, DEMAND, label=f"page {pid}",
                           verify=self.checks.verifier(pid)).result()
        self.stats.bytes_read += page.nbytes
        for name in page.tensors:
            t = self.tensors[name]
            self.objects[name] = self.as_compute(tensor_from_bytes(t, buf.tensor(t.offset - page.offset, t.nbytes)))
        self.state[pid] = PageState.PINNED
        return buf

    def pin_streamed(self, pid: int) -> AlignedBuffer:
        """An elastic pin of streamed page `pid`: it leaves the streamed set; after a failed read it streams again."""
        self.staging.drop(pid)  # prefetched for the next pass: the pinned copy replaces it
        self.staging.remove(pid)
        try:
            return self.pin(pid)
        except BaseException:
            self.state[pid] = PageState.ON_DISK
            self.staging.add(pid)
            raise

    def release(self, pid: int) -> None:
        """An elastic pin given up: its tensors go (with them, its buffer); the page streams again."""
        for name in self.pages[pid].tensors:
            self.objects.pop(name, None)
        self.state[pid] = PageState.ON_DISK
        self.staging.add(pid)


# Bytes of RSS held beyond what the budget accounts for, and beyond what the last heap trim left there, that are
# worth a trim: a long pass's freed activations stay scattered over glibc's heaps, which its trim threshold does
# not return, and the elastic budget would count them as held for the rest of the run (docs/performance.md,
# "Elastic pins after a long pass").
TRIM_SLACK = 16 << 20


class ElasticPins:
    def __init__(self, pages: list[PageEntry], tensors: dict[str, TensorEntry], pl: place.Placement,
                 memory_limit: int | None, dtype: torch.dtype, pin: Callable[[int], AlignedBuffer],
                 release: Callable[[int], None], baseline: int | None = None,
                 rss: Callable[[], int] = rss_bytes, trim: Callable[[], None] = heap.trim_heap):
        """`pin(pid)`: read a streamed page into a buffer of its own and keep its tensors resident (on failure
        the page streams again and the error propagates); `release(pid)`: the page streams again; `baseline`:
        the runtime baseline RSS (None: not measured); `rss`: the process's RSS now; `trim`: give freed heap
        memory back to the OS."""
        self.pages, self.placement, self.memory_limit = pages, pl, memory_limit
        self._pin, self._release = pin, release
        self.baseline = baseline
        self._rss, self._trim = rss, trim
        self._kept = 0  # RSS the last trim could not give back, beyond what was accounted for then
        self.trims = 0
        self._cost = {pid: p.nbytes + place.resident_extra(p, tensors, dtype) for pid, p in enumerate(pages)}
        self._fixed = sum(self._cost[pid] for pid in pl.pinned) + pl.staging_bytes
        self._candidates = place.pin_order(pages, (pid for pid in pl.streamed if pages[pid].kind != "expert"))
        self._extra: dict[int, AlignedBuffer] = {}  # elastic pins in the order they were made
        self._extra_bytes = 0  # their cost (pages and what their weights derive)
        self.pins = self.unpins = 0

    @property
    def pinned_bytes(self) -> int:
        """Pinned page bytes now: the placement's and the elastic pins'."""
        return self.placement.pinned_bytes + sum(self.pages[pid].nbytes for pid in self._extra)

    def weight_bytes(self) -> int:
        """What the weights hold now against the budget: pinned pages with what they derive, and the staging."""
        return self._fixed + self._extra_bytes

    def fit(self, held: int, extra: int, pin: bool = True) -> None:
        """Share the budget with the KV cache and the next pass: `held` bytes held now besides the weights (the KV
        cache) and `extra` more the pass takes. Unpin elastic pins (the last made first; their pages stream
        again) until the weights fit beside them, then (pin=True) pin streamed dense pages in placement order
        while they fit. What is held is also measured (RSS above `baseline`, when set, less the weights): memory
        the allocator kept from earlier passes counts as held. Called between passes; the placement's own pins,
        sized for the whole context and a full pass, always fit."""
        if self.memory_limit is None:
            return
        room = self._room(held) - extra
        while self._extra and self._extra_bytes > room:
            self._unpin(next(reversed(self._extra)))
        if not pin:
            return
        for pid in self._candidates:
            if pid not in self._extra and self._extra_bytes + self._cost[pid] <= room:
                try:
                    self._extra[pid] = self._pin(pid)
                except StorageError:  # a pin only saves reads: the page streams, and a pass needing it reports
                    return
                self._extra_bytes += self._cost[pid]
                self.pins += 1

    def _room(self, held: int) -> int:
        """The budget less the placement's weights and what is held (measured as `fit` says)."""
        if self.baseline is not None:
            held = max(held, self._measured(held))
        return self.memory_limit - self._fixed - held

    def _measured(self, held: int) -> int:
        """RSS above the baseline, less the weights. Where that exceeds `held` by TRIM_SLACK more than the last
        trim left, the heap is trimmed first and measured again."""
        over = self._rss() - self.baseline - self.weight_bytes()
        if over - held > self._kept + TRIM_SLACK:
            self._trim()
            self.trims += 1
            over = self._rss() - self.baseline - self.weight_bytes()
            self._kept = max(0, over - held)
        else:  # what was kept may have been freed since
            self._kept = min(self._kept, max(0, over - held))
        return over

    def kv_room(self, extra: int) -> int | None:
        """Bytes the KV cache may hold beside a pass taking `extra` once every elastic pin has given way: the
        limit less the placement's own weights (None: no budget)."""
        return None if self.memory_limit is None else self.memory_limit - self._fixed - extra

    def spare(self, held: int) -> int | None:
        """Bytes a pass may take beside `held` without unpinning anything (None: no budget). Optional work, such
        as speculative drafts, is cut to this rather than make pages stream again."""
        return None if self.memory_limit is None else self._room(held) - self._extra_bytes

    def hold(self) -> None:
        """Back to the placement's own pins, and no elastic pins from here on: for measuring a placement."""
        while self._extra:
            self._unpin(next(reversed(self._extra)))
        self._candidates = []

    def _unpin(self, pid: int) -> None:
        del self._extra[pid]  # with the tensors built over it, the buffer is unmapped
        self._release(pid)
        self._extra_bytes -= self._cost[pid]
        self.unpins += 1


def first_pins(pages: list[PageEntry], tensors: dict[str, TensorEntry], pl: place.Placement,
               memory_limit: int | None, dtype: torch.dtype, held: int, extra: int) -> list[int]:
    """The pages ElasticPins.fit(held, extra) pins first, with no pin made yet and nothing held but `held` (the
    process's memory not measured): what `colibri plan` counts as resident at the start of a decode."""
    made: list[int] = []
    ElasticPins(pages, tensors, pl, memory_limit, dtype, pin=made.append, release=lambda pid: None).fit(held, extra)
    return made

"""Streaming weight store: a container larger than the memory budget, read from disk as the forward pass goes.

The store carries out a placement (colibri.placement): pinned pages are read at load and stay resident;
streamed pages are read with O_DIRECT into equal-size staging slots just before their scope and ahead of it
(prefetch), and released when the scope ends. Three refinements:
* Lookup and head tables read by rows: the lookup reads only the rows of the tokens in the pass, and the head
  streams its rows in blocks through two small buffers; their small companions stay resident.
* MoE experts: slots left after pinning are an expert cache that keeps experts resident after their scope,
  evicting by decayed use count, then recency (colibri.usage). A multi-token pass (prefill) only fills free
  cache slots: it never evicts the decode working set.
* Every page's checksum is verified on its first read, on the I/O thread; a mismatch, a failed or short read, or
  a data file changed after load raises StorageError naming the page and file, and leaves the engine usable.

Pins are elastic (`fit`): beyond the placement's own, streamed pages are pinned while the budget has room
beside the KV cache and the activations of the pass at hand, and unpinned (they stream again) when those grow.

Tiers: a page is ON_DISK, LOADING (a read in flight), RESIDENT (in a staging or cache slot, evictable) or PINNED.
A GPU tier would be one more pinned destination with its own budget (pages copied there at load, `get`
returning device tensors), with the same scopes and the same disk path.

Scopes (the model math opens them; see models/base.py): `layer(i)` for layer i's attention and dense FFN pages,
`layer(num_layers)` for the head, `expert(i, e)` for one routed expert. A streamed page is held only inside
its scope: model code keeps no tensor across scopes, so the buffer can be reused afterwards.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import math
import os
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from colibri import placement as place
from colibri import quant
from colibri.container import DTYPES, FLOAT_KINDS, ContainerCheckpoint, checksum_str, tensor_from_bytes
from colibri.errors import StorageError
from colibri.io import ALIGN, DEMAND, HUGE_PAGE, PREFETCH, AlignedBuffer, Reader, align_up, huge_page_bytes
from colibri.placement import (block_rows, main_part, plan, row_bytes, row_tensor, scopes_of, side_ranges,
                               stored_rows, unit_of)
from colibri.usage import USAGE_FILE, USAGE_SAVE_EVERY, ExpertUsage


class PageState(enum.Enum):
    ON_DISK = "on_disk"
    LOADING = "loading"
    RESIDENT = "resident"
    PINNED = "pinned"


# -------------------------------------------------------------------------------------------------- the store


@dataclass
class _Slot:
    buffer: AlignedBuffer
    future: Future
    cached: bool = False  # an expert kept resident after its scope
    fresh: bool = True  # read and not yet used


@dataclass
class StreamStats:
    bytes_read: int = 0  # everything read from the data files, pinned pages included
    page_reads: int = 0
    hits: int = 0  # uses of streamed pages served by bytes read for an earlier use (cached experts)
    misses: int = 0  # uses that needed a read (prefetched or on demand)
    hit_bytes: int = 0
    miss_bytes: int = 0
    expert_hits: int = 0
    expert_misses: int = 0
    expert_pinned_uses: int = 0  # routed experts that were pinned (neither hit nor miss: never streamed)
    row_bytes_read: int = 0  # lookup rows and head blocks
    verified_pages: int = 0
    io_wait_s: float = 0.0
    lookahead_predicted: int = 0  # router lookahead: experts guessed for a layer before it ran
    lookahead_correct: int = 0  # routed experts that had been guessed
    lookahead_routed: int = 0  # routed experts of the layers that had a guess (recall = correct / routed)
    lookahead_reads: int = 0  # expert pages read early for a guess
    lookahead_wasted_bytes: int = 0  # of those, bytes read for experts the layer did not route to
    lookahead_useful_reads: int = 0  # of those, pages of experts the layer did route to (reads moved earlier)

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


class StreamingStore:
    """The WeightStore for a container under a memory budget (see module docstring)."""

    def __init__(self, ckpt: ContainerCheckpoint, args, memory_limit: int | None, dtype: torch.dtype,
                 io_threads: int = 2, prefetch_depth: int | None = None, direct: bool | None = None,
                 reserve: int = 0, batch: int = 1, usage: bool = True, lookahead: bool = True):
        self.ckpt = ckpt
        self.dtype = dtype
        self.args = args
        self.num_layers = num_layers = args.num_layers
        tied = args.tie_word_embeddings
        self.pages = ckpt.pages
        self.tensors = ckpt.tensors
        self.usage = ExpertUsage(ckpt.path / USAGE_FILE if usage else None, num_layers, args.num_experts,
                                 ExpertUsage.identity_of(ckpt)) if args.num_experts else None
        self.placement = plan(self.pages, self.tensors, num_layers, tied, memory_limit, prefetch_depth, reserve, batch,
                              self.usage.loaded if self.usage else None, dtype)
        self.prefetch_depth = self.placement.prefetch_depth
        self.reader = Reader(ckpt.files, io_threads=io_threads, direct=direct)
        self.stats = StreamStats()
        self.state = {pid: PageState.ON_DISK for pid in range(len(self.pages))}
        self._file_ids = [self._file_id(p) for p in ckpt.files]
        self._verified: set[int] = set()
        self._pinned: dict[str, object] = {}
        self._side: dict[str, dict[str, torch.Tensor]] = {}  # by-rows table -> its resident parts
        self._page_of = {name: t.page for name, t in self.tensors.items()}
        self._by_rows = set(self.placement.by_rows)
        self._slots: dict[int, _Slot] = {}
        self._held: set[int] = set()  # streamed pages of the open scope(s)
        self._objects: dict[str, object] = {}  # tensors built over held pages
        self._order = list(self.placement.streamed)  # forward order: the prefetch sequence
        self._scope_pages: dict[tuple, list[int]] = {}
        self._scope_end: dict[tuple, int] = {}  # last page id of each scope
        self._streamed = set(self.placement.streamed)
        for p in self.pages:
            for key in scopes_of(p, num_layers, tied):
                if p.id in self._streamed:
                    self._scope_pages.setdefault(key, []).append(p.id)
                self._scope_end[key] = max(self._scope_end.get(key, -1), p.id)
        # router lookahead: layers whose experts stream, and per layer the guess in flight (experts, pages read)
        self._lookahead = {self.pages[i].layer for i in self._streamed
                           if self.pages[i].kind == "expert"} if lookahead else set()
        self._guess: dict[int, tuple[set[int], set[int]]] = {}
        # Staging reserved for guesses, taken from the expert cache (at most half of it), so a guess finds a free
        # slot under a tight budget instead of competing with cached experts it ranks below: the pages of a
        # decode pass's top_k guessed experts, plus those of the top_k - 1 routed experts a decode layer reads
        # beyond the staging's own slot (its demand reads are issued first and take free slots first). A
        # guess's page is never cached before it is used, so a demand read can always take its slot.
        per_expert: dict[tuple[int, int], int] = {}
        for i in self._streamed:
            if self.pages[i].kind == "expert":
                key = (self.pages[i].layer, self.pages[i].expert)
                per_expert[key] = per_expert.get(key, 0) + 1
        pages = max(per_expert.values(), default=0)
        want = (2 * args.top_k - 1) * pages if self._lookahead and self.usage else 0
        self.lookahead_slots = min(want, self.placement.cache_slots // 2)
        self._cache_cap = self.placement.cache_slots - self.lookahead_slots
        self._stale: set[int] = set()  # pages of wrong guesses still being read: freed once done
        self._soon: set[int] = set()  # pages of the experts the layer in progress routed to
        self.lookahead_layers = [[0, 0] for _ in range(num_layers)]  # per layer: [correct, routed]
        self._multi = False  # the current pass prefills several tokens of a sequence: it must not evict cached experts
        self._passes = 0
        self.timeline_passes = 0  # record a per-scope timeline for this many forward passes (--verbose)
        self.timeline: list[dict] = []
        pl = self.placement
        # elastic pins: streamed dense pages pinned beyond the placement's while the budget has room (see `fit`);
        # the staging was sized for the placement's streamed set, which holds every set left streaming then
        self.memory_limit = memory_limit
        self._cost = {pid: p.nbytes + place.resident_extra(p, self.tensors, dtype) for pid, p in
                      enumerate(self.pages)}
        self._fixed = sum(self._cost[pid] for pid in pl.pinned) + pl.staging_bytes
        self._candidates = sorted((pid for pid in pl.streamed if self.pages[pid].kind != "expert"),
                                  key=lambda i: (place.PIN_ORDER.get(self.pages[i].kind, 9), self.pages[i].offset))
        self._extra: dict[int, AlignedBuffer] = {}  # elastic pins in the order they were made
        self._extra_bytes = 0  # their cost (pages and what their weights derive)
        self.pins = self.unpins = 0
        self.baseline: int | None = None  # the runtime baseline RSS, set by the owner once measured
        self._free: list[AlignedBuffer] = [AlignedBuffer(pl.slot_bytes) for _ in range(pl.slots)]
        self._blocks: list[AlignedBuffer] = []
        self._load_pinned()
        self._load_by_rows()
        staging = self._free + self._blocks
        for buf in staging:  # fault the buffers in now (huge pages where the kernel has them), not mid-token
            buf.tensor().fill_(0)
        # the share of the staging slots and head blocks in transparent huge pages: O_DIRECT into 4 KiB pages can
        # read much slower (io.AlignedBuffer; docs/performance.md, "Disk"); reported so a slow run can be
        # told apart from a slow disk
        big = [b for b in staging if b.nbytes >= HUGE_PAGE]  # smaller buffers never get huge pages
        huge, total = huge_page_bytes(big), sum(b.nbytes for b in big)
        self.staging_huge_fraction = round(huge / total, 4) if huge is not None and total else None

    # -- load time -------------------------------------------------------------------------------------------

    def _verifier(self, pid: int):
        """Checksum check for a page's first read (runs on the I/O thread)."""
        if pid in self._verified:
            return None

        def verify(data: memoryview) -> None:
            self._check_page(pid, zlib.crc32(data))

        return verify

    def _check_page(self, pid: int, crc: int) -> None:
        """Compare a page's crc32 with the manifest's: a mismatch raises, a match marks the page verified."""
        page = self.pages[pid]
        if checksum_str(crc) != page.checksum:
            raise StorageError(f"page {pid}: checksum mismatch in {self.ckpt.files[page.file]} at offset "
                               f"{page.offset} ({page.nbytes} bytes); the file is corrupt — run "
                               f"`colibri verify` and reconvert")
        self._verified.add(pid)
        self.stats.verified_pages += 1

    def _load_pinned(self) -> None:
        for pid in self.placement.pinned:
            self._pin_page(pid)

    def _pin_page(self, pid: int) -> AlignedBuffer:
        """Read page `pid` into a buffer of its own and keep its tensors resident."""
        page = self.pages[pid]
        buf = AlignedBuffer(page.nbytes)
        self.reader.submit(page.file, page.offset, page.nbytes, buf, DEMAND, label=f"page {pid}",
                           verify=self._verifier(pid)).result()
        self.stats.bytes_read += page.nbytes
        for name in page.tensors:
            t = self.tensors[name]
            self._pinned[name] = self._as_compute(tensor_from_bytes(
                t, buf.tensor(t.offset - page.offset, t.nbytes)))
        self.state[pid] = PageState.PINNED
        return buf

    # -- elastic pins ----------------------------------------------------------------------------------------

    @property
    def pinned_bytes(self) -> int:
        """Pinned page bytes now: the placement's and the elastic pins'."""
        return self.placement.pinned_bytes + sum(self.pages[pid].nbytes for pid in self._extra)

    def streamed_bytes(self) -> int:
        """What a dense pass reads of whole-read pages now (the placement's figure, less the elastic pins)."""
        tied = self.args.tie_word_embeddings
        return sum(self.pages[pid].nbytes * len(scopes_of(self.pages[pid], self.num_layers, tied))
                   for pid in self._streamed)

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
                self._drop(pid)  # prefetched for the next pass: the pinned copy replaces it
                self._unstream(pid)
                try:
                    self._extra[pid] = self._pin_page(pid)
                except StorageError:  # a pin only saves reads: the page streams, and a pass needing it reports
                    self.state[pid] = PageState.ON_DISK
                    self._restream(pid)
                    return
                except BaseException:
                    self.state[pid] = PageState.ON_DISK
                    self._restream(pid)
                    raise
                self._extra_bytes += self._cost[pid]
                self.pins += 1

    def _room(self, held: int) -> int:
        """The budget less the placement's weights and what is held (measured as `fit` says)."""
        if self.baseline is not None:
            from colibri.metrics import rss_bytes
            held = max(held, rss_bytes() - self.baseline - self.weight_bytes())
        return self.memory_limit - self._fixed - held

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
        for name in self.pages[pid].tensors:
            self._pinned.pop(name, None)
        self._extra_bytes -= self._cost[pid]
        self.state[pid] = PageState.ON_DISK
        self._restream(pid)
        self.unpins += 1

    def _unstream(self, pid: int) -> None:
        self._streamed.discard(pid)
        self._order.remove(pid)
        for key in scopes_of(self.pages[pid], self.num_layers, self.args.tie_word_embeddings):
            self._scope_pages[key].remove(pid)

    def _restream(self, pid: int) -> None:
        self._streamed.add(pid)
        bisect.insort(self._order, pid)
        for key in scopes_of(self.pages[pid], self.num_layers, self.args.tie_word_embeddings):
            bisect.insort(self._scope_pages.setdefault(key, []), pid)

    def _load_by_rows(self) -> None:
        """Verify each by-rows page once, reading it in blocks, and keep its small companions resident."""
        if not self.placement.by_rows:
            return
        step = 8 << 20
        chunk = AlignedBuffer(step)
        for pid in self.placement.by_rows:
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
            self._check_page(pid, crc)
            for (name, part, _, nb), d in zip(ranges, dest):
                t = self.tensors[name]
                if part is None:
                    self._pinned[name] = self._as_compute(tensor_from_bytes(t, side.tensor(d, nb)))
                else:
                    p = t.parts[part]
                    self._side.setdefault(name, {})[part] = side.tensor(d, nb).view(DTYPES[p.dtype]).view(p.shape)
        if any(self.pages[i].kind == "head" or self.args.tie_word_embeddings for i in self.placement.by_rows):
            size = self.placement.block_bytes // place.HEAD_BUFFERS
            self._blocks = [AlignedBuffer(size) for _ in range(place.HEAD_BUFFERS)]

    def _as_compute(self, value):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != self.dtype:
            return value.to(self.dtype)
        return value

    @staticmethod
    def _file_id(path: Path) -> tuple:
        st = os.stat(path)
        return st.st_ino, st.st_size, st.st_mtime_ns

    # -- the WeightStore surface ---------------------------------------------------------------------------

    def begin_pass(self, tokens: int, longest: int | None = None) -> None:
        """A forward pass over `tokens` tokens starts: check the data files are the ones loaded. `longest`: the
        most tokens of one sequence in it (a prefill chunk, unlike a batch of decode steps, must not evict cached
        experts)."""
        for path, ident in zip(self.ckpt.files, self._file_ids):
            try:
                now = self._file_id(path)
            except OSError:
                now = None
            if now != ident:
                raise StorageError(f"data file {path} changed on disk after the model was loaded (replaced, "
                                   "truncated or rewritten); reload the model")
        self._multi = (tokens if longest is None else longest) > 1
        self._passes += 1
        for i in list(self._guess):  # guesses of a pass that failed before their layer
            self._settle_guess(i, set())
        if self.usage:
            self.usage.tick(tokens)
            if self._passes % USAGE_SAVE_EVERY == 0:
                self.usage.save()

    def get(self, name: str):
        if name in self._pinned:
            return self._pinned[name]
        obj = self._objects.get(name)
        if obj is None:
            pid = self._page_of[name]
            if pid not in self._held:
                raise RuntimeError(f"tensor {name!r} used outside its scope (page {pid})")
            obj = self._build(name, pid)
        return obj

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        if name in self._pinned:
            w = self._pinned[name]
            return w[ids] if isinstance(w, torch.Tensor) else w.rows(ids).to(self.dtype)
        if self._page_of[name] in self._by_rows:
            return self._read_rows(name, ids)
        with self._scope(("embedding",)):
            w = self.get(name)
            return (w[ids].clone() if isinstance(w, torch.Tensor) else w.rows(ids)).to(self.dtype)

    def row_blocks(self, name: str) -> Iterator:
        """The table `name` as consecutive row blocks (inside the head's scope): the whole table when resident."""
        if name in self._pinned or self._page_of[name] not in self._by_rows:
            yield self.get(name)
            return
        yield from self._stream_blocks(name)

    def layer(self, i: int) -> contextlib.AbstractContextManager:
        return self._scope(("layer", i))

    def expert(self, i: int, e: int) -> contextlib.AbstractContextManager:
        return self._scope(("expert", i, e))

    def route(self, i: int, uses: dict[int, int], names: dict[int, list[str]]) -> list[int]:
        """Layer i's router picked experts (expert -> tokens routed to it): count the use, start reading the
        missing ones now so they load concurrently, and order them resident first (compute overlaps the reads)."""
        if self.usage:
            self.usage.record(i, uses)
        self._soon = {self._page_of[n] for e in uses for n in names[e]}  # this layer's routed experts' pages
        if self._stale:  # a wrong guess's page that is routed to after all is kept for this use
            self._stale.difference_update(self._soon)
        if i in self._guess:
            self._settle_guess(i, set(uses))
        self.stats.expert_pinned_uses += sum(
            1 for e in uses if self.state[self._page_of[names[e][0]]] == PageState.PINNED)
        self.prefetch(n for e in sorted(uses) for n in names[e])

        def ready(e: int) -> bool:
            pid = self._page_of[names[e][0]]
            slot = self._slots.get(pid)
            return self.state[pid] == PageState.PINNED or (slot is not None and slot.future.done())

        return sorted(uses, key=lambda e: (not ready(e), e))

    # -- MoE router lookahead: reads of guessed experts, below demand reads ---------------------------------

    def wants_lookahead(self, i: int) -> bool:
        return i in self._lookahead

    def peek(self, name: str):
        """A tensor before its scope when its bytes are here: pinned, held, or its page's read done (the page
        cannot be reused while the caller computes with it: slots are only freed by scopes)."""
        if name in self._pinned:
            return self._pinned[name]
        pid = self._page_of.get(name)
        if pid in self._held:
            return self.get(name)
        slot = self._slots.get(pid)
        if slot is None or not slot.future.done() or slot.future.exception() is not None:
            return None
        t, page = self.tensors[name], self.pages[pid]
        return self._as_compute(tensor_from_bytes(t, slot.buffer.tensor(t.offset - page.offset, t.nbytes)))

    def predict(self, i: int, uses: dict[int, int], names: dict[int, list[str]]) -> None:
        """Layer i's experts guessed ahead (expert -> tokens, most likely first among equal counts): read the
        guessed ones not resident, most used first, at prefetch priority (behind every demand read), into the
        slots reserved for guesses (`lookahead_slots`), then into a free slot (one is kept free for demand
        reads) or, in a decode pass, over a cached expert that ranks lower (the guess enters the cache early)."""
        if i not in self._lookahead:
            return
        self._reap()
        self.stats.lookahead_predicted += len(uses)
        started = set()
        for e in sorted(uses, key=lambda e: -uses[e]):  # stable: the router's order breaks ties
            for pid in sorted({self._page_of[n] for n in names[e]}):
                if self.state[pid] != PageState.ON_DISK or pid not in self._streamed:
                    continue
                reserved = self._free and len(started) < self.lookahead_slots
                if not reserved and len(self._free) <= 1 and not self._evict_for(pid):
                    return self._note_guess(i, uses, started)
                self._start(pid, PREFETCH)
                started.add(pid)
        self._note_guess(i, uses, started)

    def _evict_for(self, pid: int) -> bool:
        """Free a cached expert's slot for a guessed page that ranks higher (decode passes only, as `_admit`)."""
        if self._multi or self.usage is None:
            return False
        cached = [p for p in self._cached() if p not in self._held]
        return bool(cached) and self._drop_lower(cached, pid)

    def _note_guess(self, i: int, uses: dict[int, int], started: set[int]) -> None:
        self.stats.lookahead_reads += len(started)
        old = self._guess.pop(i, None)
        self._guess[i] = (set(uses), started | (old[1] if old else set()))

    def _settle_guess(self, i: int, routed: set[int]) -> None:
        """Layer i routed to `routed`: count the guess's recall; a page read for a wrong guess stays as a cache
        candidate when the expert cache has a free slot, else its read is cancelled, or its slot freed once the
        read is done (never waited for here)."""
        guessed, pids = self._guess.pop(i)
        if routed:
            hit = len(guessed & routed)
            self.stats.lookahead_correct += hit
            self.stats.lookahead_routed += len(routed)
            self.lookahead_layers[i][0] += hit
            self.lookahead_layers[i][1] += len(routed)
        cap = self._cache_cap if self.usage is not None else 0
        for pid in pids:
            slot = self._slots.get(pid)
            if slot is not None and self.pages[pid].expert in routed:
                self.stats.lookahead_useful_reads += 1
            if slot is None or self.pages[pid].expert in routed or slot.cached or pid in self._held:
                continue
            if slot.future.done() and slot.future.exception() is None and len(self._cached()) < cap:
                slot.cached = True
                continue
            if slot.future.cancel():  # never started: nothing was read
                self.stats.bytes_read -= self.pages[pid].nbytes
                self.stats.page_reads -= 1
                self._drop(pid)
                continue
            self.stats.lookahead_wasted_bytes += self.pages[pid].nbytes
            self._stale.add(pid)
        self._reap()

    def _reap(self) -> None:
        for pid in [p for p in self._stale if p not in self._slots or self._slots[p].future.done()]:
            self._stale.discard(pid)
            slot = self._slots.get(pid)
            if slot is not None and not slot.cached and pid not in self._held and slot.fresh:
                self._drop(pid)

    def prefetch(self, names: Iterable[str]) -> None:
        for pid in sorted({self._page_of[n] for n in names}):
            if self.state[pid] == PageState.ON_DISK and pid in self._streamed and self._free:
                self._start(pid, DEMAND)

    def close(self) -> None:
        if self.usage:
            self.usage.save()
        self.reader.close()
        self._pinned.clear()
        self._objects.clear()
        self._slots.clear()

    def nbytes(self) -> int:
        return self.pinned_bytes + self.placement.staging_bytes

    def counters(self) -> dict:
        """Cumulative counters (GenerationMetrics takes differences) and the placement's resident bytes."""
        io = self.reader.stats()
        cached = sum(1 for s in self._slots.values() if s.cached)
        return {**self.stats.as_dict(), "read_active_s": io.active_s, "direct_io": io.direct,
                "pinned_bytes": self.pinned_bytes, "elastic_pinned_bytes": self.pinned_bytes - self.placement.pinned_bytes,
                "elastic_pins": self.pins, "elastic_unpins": self.unpins, "cached_bytes": cached * self.placement.slot_bytes,
                "staging_bytes": self.placement.staging_bytes, "staging_huge_fraction": self.staging_huge_fraction,
                "reserve_bytes": self.placement.reserve, "lookahead_slots": self.lookahead_slots,
                "lookahead_recall_by_layer": [round(c / r, 4) if r else None for c, r in self.lookahead_layers]}

    # -- streaming -------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _scope(self, key: tuple) -> Iterator[None]:
        pids = self._scope_pages.get(key, [])
        ahead = set()  # already read or being read when the scope began (prefetched, routed or cached)
        for pid in pids:
            slot = self._slots.get(pid)
            if slot is not None:
                ahead.add(pid)
                slot.cached = False  # held now; re-admitted (or not) when the scope ends
                self.reader.promote(slot.future)
            else:  # a demand read for what prefetch did not bring
                self._make_room(keep=set(pids))
                self._start(pid, DEMAND)
                slot = self._slots[pid]
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
            if key[0] == "expert":
                if hit:
                    self.stats.expert_hits += 1
                else:
                    self.stats.expert_misses += 1
        t0 = time.perf_counter()
        try:
            for pid in pids:
                self._slots[pid].future.result()  # raises StorageError naming the page and file
                self.state[pid] = PageState.RESIDENT
        except BaseException:
            for pid in pids:  # a failed read leaves nothing behind: the next pass reads the pages again
                self._drop(pid)
            raise
        finally:
            self.stats.io_wait_s += time.perf_counter() - t0
        waited = time.perf_counter() - t0
        self._held.update(pids)
        self._prefetch_after(self._scope_end.get(key, -1))
        t1 = time.perf_counter()
        try:
            yield
        finally:
            if self._passes <= self.timeline_passes:
                self.timeline.append({"pass": self._passes, "scope": "/".join(map(str, key)), "pages": len(pids),
                                      "demand_bytes": sum(self.pages[p].nbytes for p in pids if p not in ahead),
                                      "wait_ms": round(1e3 * waited, 3),
                                      "compute_ms": round(1e3 * (time.perf_counter() - t1), 3)})
            for pid in pids:
                for name in self.pages[pid].tensors:
                    self._objects.pop(name, None)
                self._held.discard(pid)
                if key[0] == "expert" and self._admit(pid):
                    self._slots[pid].cached = True
                else:
                    self._drop(pid)
            self._prefetch_after(self._scope_end.get(key, -1))

    def _cached(self) -> list[int]:
        return [pid for pid, s in self._slots.items() if s.cached]

    def _key(self, pid: int) -> tuple[int, int]:
        return self.pages[pid].layer, self.pages[pid].expert

    def _admit(self, pid: int) -> bool:
        """Keep an expert resident after its scope? Into a free cache slot always; over a cached expert only in
        a single-token pass (decode), and only when that expert ranks lower."""
        cap = self._cache_cap
        if cap == 0 or self.usage is None:
            return False
        cached = self._cached()
        if len(cached) < cap:
            return True
        if self._multi:
            return False
        return self._drop_lower(cached, pid)

    def _drop_lower(self, cached: list[int], pid: int) -> bool:
        """Drop the lowest-ranked of the `cached` experts if it ranks below `pid`'s (its slot is then free)."""
        victim = min(cached, key=lambda i: self.usage.rank(self._key(i)))
        if self.usage.rank(self._key(victim)) >= self.usage.rank(self._key(pid)):
            return False
        self._drop(victim)
        return True

    def _build(self, name: str, pid: int):
        t = self.tensors[name]
        page, slot = self.pages[pid], self._slots[pid]
        value = self._as_compute(tensor_from_bytes(t, slot.buffer.tensor(t.offset - page.offset, t.nbytes)))
        self._objects[name] = value
        return value

    def _start(self, pid: int, priority: int) -> None:
        page = self.pages[pid]
        if not self._free:
            raise RuntimeError(f"internal: no staging slot free for page {pid}")
        buf = self._free.pop()
        fut = self.reader.submit(page.file, page.offset, page.nbytes, buf, priority, label=f"page {pid}",
                                 verify=self._verifier(pid))
        self._slots[pid] = _Slot(buf, fut)
        self.state[pid] = PageState.LOADING
        self.stats.bytes_read += page.nbytes
        self.stats.page_reads += 1

    def _make_room(self, keep: set[int]) -> None:
        """Free a slot for a demand read: drop prefetched pages (farthest ahead first) other than those of the
        layer's routed experts still to run (read early by a guess), then, if still needed, the lowest-ranked
        cached expert, then those."""
        if self._free:
            return
        loose = sorted((p for p, s in self._slots.items() if not s.cached and p not in self._held and p not in keep),
                       key=self._distance, reverse=True)
        for pid in [p for p in loose if p not in self._soon]:
            self._drop(pid)
            if self._free:
                return
        cached = [p for p in self._cached() if p not in keep]
        if cached and self.usage:
            self._drop(min(cached, key=lambda i: self.usage.rank(self._key(i))))
            return
        for pid in [p for p in loose if p in self._soon]:
            self._drop(pid)
            if self._free:
                return

    def _distance(self, pid: int) -> int:
        return bisect.bisect_left(self._order, pid)

    def _drop(self, pid: int) -> None:
        slot = self._slots.pop(pid, None)
        if slot is None:
            return
        if not slot.future.cancel():
            try:
                slot.future.result()
            except Exception:  # noqa: BLE001 - the read's error surfaces if the page is needed again
                pass
        self._free.append(slot.buffer)
        self.state[pid] = PageState.ON_DISK

    def _prefetch_after(self, last: int) -> None:
        """Start reads of the streamed pages that follow page `last` in forward order (cyclically: the next
        pass starts over), up to `prefetch_depth` pages and as far as free slots allow."""
        if self.prefetch_depth <= 0 or not self._order:
            return
        start = bisect.bisect_right(self._order, last)
        issued = 0
        for k in range(len(self._order)):
            nxt = self._order[(start + k) % len(self._order)]
            if self.pages[nxt].kind == "expert":
                continue  # routing decides which experts: they are read on demand
            if issued >= self.prefetch_depth:
                return
            issued += 1
            if nxt in self._slots or nxt in self._held:
                continue
            if not self._free:
                return  # never evict something needed sooner for something needed later
            self._start(nxt, PREFETCH)

    # -- tables read by rows -----------------------------------------------------------------------------------

    def _table(self, name: str, r0: int, r1: int, data: torch.Tensor):
        """Rows [r0, r1) of table `name` over `data` (their bytes), with the resident companions."""
        t = self.tensors[name]
        p = t.parts[main_part(t)]
        k = t.shape[1]
        rows = data.view(DTYPES[p.dtype]).view(r1 - r0, *p.shape[1:])
        if t.kind in FLOAT_KINDS:
            return rows
        if t.kind in quant.TILED_KINDS:  # whole tiles; side parts [G, Np, 2] -> this block's [G, r1 - r0, 2]
            side = {n: v[:, r0:r1].contiguous() for n, v in self._side.get(name, {}).items()}
            n = min(r1, t.shape[0]) - r0  # the last block carries the padding rows
        else:
            side = {n: v[r0:r1] for n, v in self._side.get(name, {}).items()}
            n = r1 - r0
        return quant.from_buffers(t.kind, (n, k), t.group_size, {"qweight": rows, **side})

    def _read_rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup of a table on disk: read only the rows of these tokens (merged aligned spans)."""
        t = self.tensors[name]
        page = self.pages[self._page_of[name]]
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
            side = {n: v[uniq].contiguous() for n, v in self._side.get(name, {}).items()}
            vals = quant.from_buffers(t.kind, (len(got), t.shape[1]), t.group_size,
                                      {"qweight": rows, **side}).rows(torch.arange(len(got)))
        return vals[inverse].to(self.dtype)

    def _stream_blocks(self, name: str) -> Iterator:
        """Rows of a head table in blocks through place.HEAD_BUFFERS buffers: the next blocks read while one computes."""
        t = self.tensors[name]
        page = self.pages[self._page_of[name]]
        base = t.offset + t.parts[main_part(t)].offset
        rb, n, step = row_bytes(t), stored_rows(t), block_rows(t)  # q4: whole tiles, padding rows included
        blocks = [(r, min(n, r + step)) for r in range(0, n, step)]
        pending: dict[int, tuple[Future, int]] = {}

        def submit(b: int) -> None:
            r0, r1 = blocks[b]
            s = (base + r0 * rb) // ALIGN * ALIGN
            size = base + r1 * rb - s
            fut = self.reader.submit(page.file, s, size, self._blocks[b % len(self._blocks)], DEMAND,
                                     label=f"page {page.id} (rows {r0}-{r1} of {name})")
            pending[b] = (fut, base + r0 * rb - s)
            self.stats.bytes_read += size
            self.stats.row_bytes_read += size

        try:
            for b in range(min(len(self._blocks), len(blocks))):
                submit(b)
            for b, (r0, r1) in enumerate(blocks):
                fut, off = pending[b]
                t0 = time.perf_counter()
                try:
                    fut.result()
                finally:
                    self.stats.io_wait_s += time.perf_counter() - t0
                del pending[b]
                data = self._blocks[b % len(self._blocks)].tensor(off, (r1 - r0) * rb)
                yield self._as_compute(self._table(name, r0, r1, data))
                if b + len(self._blocks) < len(blocks):
                    submit(b + len(self._blocks))
        finally:
            for fut, _ in pending.values():  # an abandoned pass: no read may still write into a buffer
                if not fut.cancel():
                    with contextlib.suppress(Exception):
                        fut.result()

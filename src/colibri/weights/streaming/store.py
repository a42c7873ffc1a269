"""Streaming weight store: a container larger than the memory budget, read from disk as the forward pass goes.

The store carries out a placement (colibri.weights.placement): pinned pages are read at load and stay resident;
streamed pages are read with O_DIRECT into equal-size staging slots just before their scope and ahead of it
(prefetch), and released when the scope ends. Three refinements:
* Lookup and head tables read by rows (rows.py): the lookup reads only the rows of the tokens in the pass,
  and the head streams its rows in blocks through two small buffers; their small companions stay resident.
* MoE experts: slots left after pinning are an expert cache that keeps experts resident after their scope,
  evicting by decayed use count, then recency (colibri.weights.usage). A multi-token pass (prefill) only fills free
  cache slots: it never evicts the decode working set.
* Every page's checksum is verified on its first read, on the I/O thread (checks.py); a mismatch, a failed or
  short read, or a data file changed after load raises StorageError naming the page and file, and leaves the
  engine usable.

Pins are elastic (`fit`, pins.py): beyond the placement's own, streamed pages are pinned while the budget has room
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
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from colibri.formats.container import ContainerCheckpoint, tensor_from_bytes
from colibri.weights.io import DEMAND, HUGE_PAGE, PREFETCH, AlignedBuffer, Reader, huge_page_bytes
from colibri.weights.placement import plan, scopes_of
from colibri.weights.streaming.checks import Checksums
from colibri.weights.streaming.pins import ElasticPins
from colibri.weights.streaming.rows import RowTables
from colibri.weights.streaming.stats import PageState, StreamStats
from colibri.weights.usage import USAGE_FILE, USAGE_SAVE_EVERY, ExpertUsage


# -------------------------------------------------------------------------------------------------- the store


@dataclass
class _Slot:
    buffer: AlignedBuffer
    future: Future
    cached: bool = False  # an expert kept resident after its scope
    fresh: bool = True  # read and not yet used


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
        self.checks = Checksums(ckpt, self.stats)
        self._pinned: dict[str, object] = {}
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
        self.elastic = ElasticPins(self.pages, self.tensors, pl, memory_limit, dtype, self._pin_streamed,
                                   self._release)
        self._free: list[AlignedBuffer] = [AlignedBuffer(pl.slot_bytes) for _ in range(pl.slots)]
        self.tables = RowTables(ckpt, self.reader, self.stats, self.checks, dtype, self._as_compute)
        self._load_pinned()
        self.tables.load(pl.by_rows, tied, pl.block_bytes, self._pinned)
        staging = self._free + self.tables.blocks
        for buf in staging:  # fault the buffers in now (huge pages where the kernel has them), not mid-token
            buf.tensor().fill_(0)
        # the share of the staging slots and head blocks in transparent huge pages: O_DIRECT into 4 KiB pages can
        # read much slower (io.AlignedBuffer; docs/performance.md, "Disk"); reported so a slow run can be
        # told apart from a slow disk
        big = [b for b in staging if b.nbytes >= HUGE_PAGE]  # smaller buffers never get huge pages
        huge, total = huge_page_bytes(big), sum(b.nbytes for b in big)
        self.staging_huge_fraction = round(huge / total, 4) if huge is not None and total else None

    # -- load time -------------------------------------------------------------------------------------------

    def _load_pinned(self) -> None:
        for pid in self.placement.pinned:
            self._pin_page(pid)

    def _pin_page(self, pid: int) -> AlignedBuffer:
        """Read page `pid` into a buffer of its own and keep its tensors resident."""
        page = self.pages[pid]
        buf = AlignedBuffer(page.nbytes)
        self.reader.submit(page.file, page.offset, page.nbytes, buf, DEMAND, label=f"page {pid}",
                           verify=self.checks.verifier(pid)).result()
        self.stats.bytes_read += page.nbytes
        for name in page.tensors:
            t = self.tensors[name]
            self._pinned[name] = self._as_compute(tensor_from_bytes(
                t, buf.tensor(t.offset - page.offset, t.nbytes)))
        self.state[pid] = PageState.PINNED
        return buf

    # -- elastic pins (pins.py decides which) ------------------------------------------------------------------

    @property
    def baseline(self) -> int | None:
        """The runtime baseline RSS, set by the owner once measured (elastic pins count RSS above it as held)."""
        return self.elastic.baseline

    @baseline.setter
    def baseline(self, value: int | None) -> None:
        self.elastic.baseline = value

    @property
    def pinned_bytes(self) -> int:
        """Pinned page bytes now: the placement's and the elastic pins'."""
        return self.elastic.pinned_bytes

    def streamed_bytes(self) -> int:
        """What a dense pass reads of whole-read pages now (the placement's figure, less the elastic pins)."""
        tied = self.args.tie_word_embeddings
        return sum(self.pages[pid].nbytes * len(scopes_of(self.pages[pid], self.num_layers, tied))
                   for pid in self._streamed)

    def fit(self, held: int, extra: int, pin: bool = True) -> None:
        self.elastic.fit(held, extra, pin)

    def kv_room(self, extra: int) -> int | None:
        return self.elastic.kv_room(extra)

    def spare(self, held: int) -> int | None:
        return self.elastic.spare(held)

    def hold(self) -> None:
        self.elastic.hold()

    def _pin_streamed(self, pid: int) -> AlignedBuffer:
        """An elastic pin of streamed page `pid`: it leaves the streamed set; after a failed read it streams again."""
        self._drop(pid)  # prefetched for the next pass: the pinned copy replaces it
        self._unstream(pid)
        try:
            return self._pin_page(pid)
        except BaseException:
            self.state[pid] = PageState.ON_DISK
            self._restream(pid)
            raise

    def _release(self, pid: int) -> None:
        """An elastic pin given up: its tensors go (with them, its buffer); the page streams again."""
        for name in self.pages[pid].tensors:
            self._pinned.pop(name, None)
        self.state[pid] = PageState.ON_DISK
        self._restream(pid)

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

    def _as_compute(self, value):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != self.dtype:
            return value.to(self.dtype)
        return value

    # -- the WeightStore surface ---------------------------------------------------------------------------

    def begin_pass(self, tokens: int, longest: int | None = None) -> None:
        """A forward pass over `tokens` tokens starts: check the data files are the ones loaded. `longest`: the
        most tokens of one sequence in it (a prefill chunk, unlike a batch of decode steps, must not evict cached
        experts)."""
        self.checks.check_files()
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
            return self.tables.read(name, ids)
        with self._scope(("embedding",)):
            w = self.get(name)
            return (w[ids].clone() if isinstance(w, torch.Tensor) else w.rows(ids)).to(self.dtype)

    def row_blocks(self, name: str) -> Iterator:
        """The table `name` as consecutive row blocks (inside the head's scope): the whole table when resident."""
        if name in self._pinned or self._page_of[name] not in self._by_rows:
            yield self.get(name)
            return
        yield from self.tables.stream(name)

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
                "elastic_pins": self.elastic.pins, "elastic_unpins": self.elastic.unpins,
                "cached_bytes": cached * self.placement.slot_bytes,
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
                                 verify=self.checks.verifier(pid))
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

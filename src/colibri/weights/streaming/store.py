"""Streaming weight store: a container larger than the memory budget, read from disk as the forward pass goes.

The store carries out a placement (colibri.weights.placement): pinned pages are read at load and stay resident;
streamed pages are read with O_DIRECT into the staging ring just before their scope and ahead of it, and
released when the scope ends. It composes parts with one job each: staging.py (slots, forward-order prefetch),
experts.py (the MoE expert cache), lookahead.py (reads of the experts the router is guessed to pick), pins.py
(elastic pins beside the KV cache), rows.py (tables read by rows), checks.py (checksums: a mismatch, a failed or
short read, or a data file changed after load raises StorageError naming the page and file, and leaves the
engine usable), stats.py (page tiers and counters).

Tiers: a page is ON_DISK, LOADING (a read in flight), RESIDENT (in a staging or cache slot, evictable) or PINNED.
A GPU tier would be one more pinned destination with its own budget (pages copied there at load, `get`
returning device tensors), with the same scopes and the same disk path.

Scopes (the model math opens them; see models/base.py): `layer(i)` for layer i's attention and dense FFN pages,
`layer(num_layers)` for the head, `expert(i, e)` for one routed expert. A streamed page is held only inside
its scope: model code keeps no tensor across scopes, so the buffer can be reused afterwards.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Hashable, Iterable, Iterator, TypeVar

import torch

from colibri.formats.container import ContainerCheckpoint, TensorEntry, tensor_from_bytes
from colibri.weights.io import DEMAND, Reader
from colibri.weights.placement import EmbeddingScope, ExpertScope, LayerScope, Scope, WeightTable, plan
from colibri.weights.streaming.checks import Checksums
from colibri.weights.streaming.experts import ExpertCache
from colibri.weights.streaming.lookahead import Lookahead, guessed_layers, reserved_slots
from colibri.weights.streaming.pins import ElasticPins, PinnedPages
from colibri.weights.streaming.rows import RowTables
from colibri.weights.streaming.staging import Staging, fault_in
from colibri.weights.streaming.stats import PageState, StreamStats
from colibri.weights.usage import USAGE_FILE, ExpertUsage

T = TypeVar("T")


class StreamingStore:
    """The WeightStore for a container under a memory budget (see module docstring)."""

    def __init__(self, ckpt: ContainerCheckpoint, args, memory_limit: int | None, dtype: torch.dtype,
                 io_threads: int = 2, prefetch_depth: int | None = None, direct: bool | None = None,
                 reserve: int = 0, batch: int = 1, usage: bool = True, lookahead: bool = True,
                 baseline: int | None = None):
        """`baseline`: the runtime baseline RSS (elastic pins count RSS above it as held; None: not measured)."""
        self.ckpt, self.dtype, self.args = ckpt, dtype, args
        self.num_layers = num_layers = args.num_layers
        weights = WeightTable.of(ckpt, args)
        self.pages, self.tensors = pages, tensors = weights.pages, weights.tensors
        counts = ExpertUsage(ckpt.path / USAGE_FILE if usage else None, num_layers, args.num_experts,
                             ExpertUsage.identity_of(ckpt)) if args.num_experts else None
        self.placement = pl = plan(weights, memory_limit, prefetch_depth, reserve, batch,
                                   counts.loaded if counts else None, dtype)
        self.reader = Reader(ckpt.files, io_threads=io_threads, direct=direct)
        self.stats = StreamStats()
        self.state = {pid: PageState.ON_DISK for pid in range(len(pages))}
        self.checks = Checksums(ckpt, self.stats)
        self._page_of = {name: t.page for name, t in tensors.items()}
        self._by_rows = set(pl.by_rows)
        self._objects: dict[str, object] = {}  # tensors built over held pages
        self._passes = 0
        self.timeline_passes = 0  # record a per-scope timeline for this many forward passes (--verbose)
        self.timeline: list[dict] = []
        self.staging = Staging(weights, self.reader, self.checks, self.stats, self.state, pl.streamed, pl.slot_bytes,
                               pl.slots, pl.prefetch_depth)
        layers = guessed_layers(pages, pl.streamed) if lookahead else set()
        reserved = reserved_slots(pages, pl.streamed, args.top_k, pl.cache_slots) if layers and counts else 0
        self.experts = ExpertCache(pages, self.staging, counts, pl.cache_slots - reserved)
        self.lookahead = Lookahead(pages, self._page_of, self.staging, self.experts, self.stats, layers, reserved,
                                   num_layers)
        self.pinned = PinnedPages(pages, tensors, self.reader, self.checks, self.stats, self.state, self.staging,
                                  self._as_compute)
        self._pinned = self.pinned.objects  # name -> tensor of a pinned page (the placement's or elastic)
        self.elastic = ElasticPins(pages, tensors, pl, memory_limit, dtype, self.pinned.pin_streamed,
                                   self.pinned.release, baseline)
        self.tables = RowTables(ckpt, self.reader, self.stats, self.checks, dtype, self._as_compute)
        for pid in pl.pinned:
            self.pinned.pin(pid)
        self.tables.load(pl.by_rows, weights.tied, pl.block_bytes, self._pinned)
        self.staging_huge_fraction = fault_in(self.staging.free + self.tables.blocks)

    # -- tensors ---------------------------------------------------------------------------------------------

    def _as_compute(self, value):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != self.dtype:
            return value.to(self.dtype)
        return value

    def _tensor(self, t: TensorEntry, data: torch.Tensor):
        """Tensor `t` over its bytes `data`, ready for compute."""
        return self._as_compute(tensor_from_bytes(t, data))

    # -- elastic pins (pins.py) ------------------------------------------------------------------------------

    @property
    def pinned_bytes(self) -> int:
        """Pinned page bytes now: the placement's and the elastic pins'."""
        return self.elastic.pinned_bytes

    def streamed_bytes(self) -> int:
        """What a dense pass reads of whole-read pages now (the placement's figure, less the elastic pins)."""
        return self.staging.streamed_bytes()

    def fit(self, held: int, extra: int, pin: bool = True) -> None:
        self.elastic.fit(held, extra, pin)

    def kv_room(self, extra: int) -> int | None:
        return self.elastic.kv_room(extra)

    def spare(self, held: int) -> int | None:
        return self.elastic.spare(held)

    def hold(self) -> None:
        self.elastic.hold()

    # -- the WeightStore surface ---------------------------------------------------------------------------

    def begin_pass(self, tokens: int, longest: int | None = None) -> None:
        """A forward pass over `tokens` tokens starts: check the data files are the ones loaded. `longest`: the
        most tokens of one sequence in it (a prefill chunk, unlike a batch of decode steps, must not evict cached
        experts)."""
        self.checks.check_files()
        self._passes += 1
        self.lookahead.begin_pass()
        self.experts.begin_pass(tokens, (tokens if longest is None else longest) > 1, self._passes)

    def get(self, name: str):
        if name in self._pinned:
            return self._pinned[name]
        obj = self._objects.get(name)
        if obj is None:
            pid = self._page_of[name]
            if pid not in self.staging.held:
                raise RuntimeError(f"tensor {name!r} used outside its scope (page {pid})")
            obj = self._objects[name] = self._tensor(self.tensors[name], self.staging.view(self.tensors[name], pid))
        return obj

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        if name in self._pinned:
            w = self._pinned[name]
            return w[ids] if isinstance(w, torch.Tensor) else w.rows(ids).to(self.dtype)
        if self._page_of[name] in self._by_rows:
            return self.tables.read(name, ids)
        with self._scope(EmbeddingScope()):
            w = self.get(name)
            return (w[ids].clone() if isinstance(w, torch.Tensor) else w.rows(ids)).to(self.dtype)

    def row_blocks(self, name: str) -> Iterator:
        """The table `name` as consecutive row blocks (inside the head's scope): the whole table when resident."""
        if name in self._pinned or self._page_of[name] not in self._by_rows:
            yield self.get(name)
            return
        yield from self.tables.stream(name)

    def layer(self, i: int) -> contextlib.AbstractContextManager:
        return self._scope(LayerScope(i))

    def expert(self, i: int, e: int) -> contextlib.AbstractContextManager:
        return self._scope(ExpertScope(i, e))

    def route(self, i: int, uses: dict[int, int], names: dict[int, list[str]]) -> list[int]:
        """Layer i's router picked experts (expert -> tokens routed to it): count the use, start reading the
        missing ones now so they load concurrently, and order them resident first (compute overlaps the reads)."""
        self.experts.record(i, uses)
        self.lookahead.route(i, set(uses), {self._page_of[n] for e in uses for n in names[e]})
        self.stats.expert_pinned_uses += sum(
            1 for e in uses if self.state[self._page_of[names[e][0]]] == PageState.PINNED)
        self.prefetch(n for e in sorted(uses) for n in names[e])

        def ready(e: int) -> bool:
            pid = self._page_of[names[e][0]]
            slot = self.staging.slots.get(pid)
            return self.state[pid] == PageState.PINNED or (slot is not None and slot.future.done())

        return sorted(uses, key=lambda e: (not ready(e), e))

    def wants_lookahead(self, i: int) -> bool:
        return self.lookahead.wants(i)

    def derived(self, key: Hashable, make: Callable[[], T], current: Callable[[T], bool]) -> T:
        """Made again on every call: a layer's weights are other objects from one scope to the next (pinned ones
        may be unpinned), and a kept value would hold their pages."""
        return make()

    def peek(self, name: str):
        """A tensor before its scope when its bytes are here: pinned, held, or its page's read done (the page
        cannot be reused while the caller computes with it: slots are only freed by scopes)."""
        if name in self._pinned:
            return self._pinned[name]
        pid = self._page_of.get(name)
        if pid in self.staging.held:
            return self.get(name)
        if not self.staging.done(pid):
            return None
        return self._tensor(self.tensors[name], self.staging.view(self.tensors[name], pid))

    def predict(self, i: int, uses: dict[int, int], names: dict[int, list[str]]) -> None:
        self.lookahead.predict(i, uses, names)

    def prefetch(self, names: Iterable[str]) -> None:
        for pid in sorted({self._page_of[n] for n in names}):
            if self.staging.unread(pid) and self.staging.free:
                self.staging.start(pid, DEMAND)

    def close(self) -> None:
        self.experts.close()
        self.reader.close()
        self._pinned.clear()
        self._objects.clear()
        self.staging.slots.clear()

    def counters(self) -> dict:
        """Cumulative counters (GenerationMetrics takes differences) and the placement's resident bytes."""
        io, pl = self.reader.stats(), self.placement
        return {**self.stats.as_dict(), "read_active_s": io.active_s, "direct_io": io.direct,
                "pinned_bytes": self.pinned_bytes, "elastic_pinned_bytes": self.pinned_bytes - pl.pinned_bytes,
                "elastic_pins": self.elastic.pins, "elastic_unpins": self.elastic.unpins,
                "heap_trims": self.elastic.trims,
                "cached_bytes": len(self.experts.cached()) * pl.slot_bytes,
                "staging_bytes": pl.staging_bytes, "staging_huge_fraction": self.staging_huge_fraction,
                "reserve_bytes": pl.reserve, "lookahead_slots": self.lookahead.slots,
                "lookahead_recall_by_layer": [round(c / r, 4) if r else None for c, r in self.lookahead.recall]}

    def picture(self) -> dict:
        """What the server's dashboard draws, read at a few Hz only while one is open: per layer, the bytes of its
        pages by tier now (`layers`: [[pinned, resident, loading, on_disk]] per layer, embedding and head pages
        counted in `other`); for a MoE model the decayed use count of each (layer, expert) (`heat`: layers x
        experts) and which experts are pinned (`pinned_experts`: [layer, expert] pairs)."""
        order = (PageState.PINNED, PageState.RESIDENT, PageState.LOADING, PageState.ON_DISK)
        layers = [[0, 0, 0, 0] for _ in range(self.num_layers)]
        other = [0, 0, 0, 0]
        pinned_experts = []
        for pid, page in enumerate(self.pages):
            state = self.state[pid]
            row = layers[page.layer] if page.layer is not None and page.layer < self.num_layers else other
            row[order.index(state)] += page.nbytes
            if page.expert is not None and state is PageState.PINNED:
                pinned_experts.append([page.layer, page.expert])
        out = {"layers": layers, "other": other, "tiers": [s.value for s in order]}
        usage = self.experts.usage
        if usage is not None:
            n_layers, n_experts = usage.shape
            out["heat"] = [[round(usage.score((i, e)), 2) for e in range(n_experts)] for i in range(n_layers)]
            out["pinned_experts"] = pinned_experts
        return out

    # -- scopes ----------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _scope(self, key: Scope) -> Iterator[None]:
        st, expert = self.staging, isinstance(key, ExpertScope)
        pids = st.scope_pages.get(key, [])
        ahead = st.take(pids, expert, self.lookahead.soon, self.experts.evict)
        waited = st.wait(pids)  # raises StorageError naming the page and file
        st.prefetch_after(st.scope_end.get(key, -1))
        t1 = time.perf_counter()
        try:
            yield
        finally:
            if self._passes <= self.timeline_passes:
                self.timeline.append({"pass": self._passes, "scope": str(key), "pages": len(pids),
                                      "demand_bytes": sum(self.pages[p].nbytes for p in pids if p not in ahead),
                                      "wait_ms": round(1e3 * waited, 3),
                                      "compute_ms": round(1e3 * (time.perf_counter() - t1), 3)})
            for pid in pids:
                for name in self.pages[pid].tensors:
                    self._objects.pop(name, None)
                st.held.discard(pid)
                if not (expert and self.experts.admit(pid)):
                    st.drop(pid)
            st.prefetch_after(st.scope_end.get(key, -1))

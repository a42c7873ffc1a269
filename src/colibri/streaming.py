"""Streaming weight store: a container larger than the memory budget, read from disk as the forward pass goes.

Placement (decided once, at load): pages are PINNED (resident for the whole run) or streamed. Streamed pages
are read with O_DIRECT into a staging pool sized by the budget, just before their scope and ahead of it
(prefetch), and released when the scope ends. The pinned set is fixed, so a dense model's cyclic layer sweep
reads exactly the streamed bytes once per forward pass: the optimum, with no LRU thrash.

Scopes (the model math opens them; see models/base.py): `layer(i)` for layer i's attention and dense FFN pages,
`layer(num_layers)` for the head, `expert(i, e)` for one routed expert. A streamed page is held only inside
its scope: model code keeps no tensor across scopes, so the buffer can be reused afterwards.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from colibri.container import ContainerCheckpoint, tensor_from_bytes
from colibri.errors import InputError
from colibri.io import DEMAND, PREFETCH, AlignedBuffer, Reader

# What is resident besides the streamed pages is small; pinning these kinds first costs little and saves a
# read of them on every token.
PIN_ORDER = {"attention": 0, "head": 1, "embedding": 2, "shared_expert": 3, "ffn": 4, "expert": 5}


class PageState(enum.Enum):
    ON_DISK = "on_disk"
    LOADING = "loading"
    RESIDENT = "resident"
    PINNED = "pinned"


@dataclass
class Placement:
    budget: int
    pinned: list[int]
    streamed: list[int]
    staging_bytes: int  # the staging pool: the largest scope's streamed pages plus prefetch room
    pinned_bytes: int
    streamed_bytes: int
    minimum: int  # the smallest budget this container can run in

    def as_dict(self) -> dict:
        return {"budget_bytes": self.budget, "pinned_bytes": self.pinned_bytes,
                "streamed_bytes": self.streamed_bytes, "staging_bytes": self.staging_bytes,
                "pinned_pages": len(self.pinned), "streamed_pages": len(self.streamed),
                "minimum_bytes": self.minimum}


def scopes_of(page: dict, num_layers: int, tied: bool) -> list[tuple]:
    """The scopes that read a page. A tied embedding serves the lookup and the head."""
    if page["kind"] == "expert":
        return [("expert", page["layer"], page["expert"])]
    if page["kind"] == "embedding":
        return [("embedding",), ("layer", num_layers)] if tied else [("embedding",)]
    return [("layer", num_layers if page["kind"] == "head" else page["layer"])]


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def staging_slots(pages: list[dict], streamed: Iterable[int], num_layers: int, tied: bool,
                  prefetch_depth: int) -> tuple[int, int]:
    """(slots, slot bytes) of the staging ring: equal slots the size of the largest streamed page, as many as
    the largest scope has streamed pages, plus `prefetch_depth` for reads ahead. Equal slots never fragment,
    so a demand read always finds room once prefetched pages are dropped."""
    count: dict[tuple, int] = {}
    size = 0
    for pid in streamed:
        p = pages[pid]
        for key in scopes_of(p, num_layers, tied):
            count[key] = count.get(key, 0) + 1
        size = max(size, p["nbytes"])
    if not count:
        return 0, 0
    # An expert's scope opens inside its layer's: both are held at once.
    nested = {key: n + (1 if any(k[0] == "expert" and k[1] == key[1] for k in count) else 0)
              for key, n in count.items() if key[0] == "layer"}
    return max([*count.values(), *nested.values()]) + prefetch_depth, size


def staging_need(pages: list[dict], streamed: Iterable[int], num_layers: int, tied: bool,
                 prefetch_depth: int) -> int:
    slots, size = staging_slots(pages, streamed, num_layers, tied, prefetch_depth)
    return slots * size


def plan(pages: list[dict], num_layers: int, tied: bool, budget: int | None, prefetch_depth: int) -> Placement:
    """Everything pinned when it fits; else pin greedily (small, every-token pages first, then in forward
    order) while the staging ring the remaining streamed pages need still fits."""
    ids = list(range(len(pages)))
    total = sum(p["nbytes"] for p in pages)
    minimum = staging_need(pages, ids, num_layers, tied, 0)
    if budget is None or budget >= total:
        return Placement(budget or total, ids, [], 0, total, 0, minimum)
    if budget < minimum:
        raise InputError(f"memory limit {fmt_bytes(budget)} is below this model's minimum working set of "
                         f"{fmt_bytes(minimum)} for weights (staging for its largest layer's pages);"
                         " raise --memory-limit")
    pinned: list[int] = []
    streamed = set(ids)
    pinned_bytes = 0
    for pid in sorted(ids, key=lambda i: (PIN_ORDER.get(pages[i]["kind"], 9), pages[i]["offset"])):
        rest = streamed - {pid}
        if pinned_bytes + pages[pid]["nbytes"] + staging_need(pages, rest, num_layers, tied,
                                                              prefetch_depth) <= budget:
            pinned.append(pid)
            streamed = rest
            pinned_bytes += pages[pid]["nbytes"]
    streamed_list = sorted(streamed, key=lambda i: (pages[i]["file"], pages[i]["offset"]))
    staging = staging_need(pages, streamed_list, num_layers, tied, prefetch_depth)
    if pinned_bytes + staging > budget:  # prefetch does not fit beside the pins: stage without it
        staging = staging_need(pages, streamed_list, num_layers, tied, 0)
    return Placement(budget, sorted(pinned), streamed_list, staging, pinned_bytes,
                     sum(pages[i]["nbytes"] for i in streamed_list), minimum)


@dataclass
class _Slot:
    buffer: AlignedBuffer
    future: Future


@dataclass
class StreamStats:
    bytes_read: int = 0
    page_reads: int = 0
    hits: int = 0  # a streamed page found already read (prefetched) when its scope began
    misses: int = 0
    io_wait_s: float = 0.0


class StreamingStore:
    """The WeightStore for a container under a memory budget (see module docstring)."""

    def __init__(self, ckpt: ContainerCheckpoint, num_layers: int, tied: bool, budget: int | None,
                 dtype: torch.dtype, io_threads: int = 2, prefetch_depth: int = 2, direct: bool | None = None):
        self.ckpt = ckpt
        self.dtype = dtype
        self.num_layers = num_layers
        self.pages = ckpt.pages
        self.placement = plan(self.pages, num_layers, tied, budget, prefetch_depth)
        self.reader = Reader(ckpt.files, io_threads=io_threads, direct=direct)
        self.stats = StreamStats()
        self.state = {pid: PageState.ON_DISK for pid in range(len(self.pages))}
        self._pinned: dict[str, object] = {}
        self._page_of = {t["name"]: t["page"] for t in ckpt.manifest["tensors"]}
        self._slots: dict[int, _Slot] = {}
        self._held: set[int] = set()  # streamed pages of the open scope(s)
        self._objects: dict[str, object] = {}  # tensors built over held pages
        self._order = sorted(self.placement.streamed)  # page ids are in forward order: the prefetch sequence
        self._scope_pages: dict[tuple, list[int]] = {}
        self._scope_end: dict[tuple, int] = {}  # last page id of each scope
        for p in self.pages:
            for key in scopes_of(p, num_layers, tied):
                if p["id"] in self.placement.streamed:
                    self._scope_pages.setdefault(key, []).append(p["id"])
                self._scope_end[key] = max(self._scope_end.get(key, -1), p["id"])
        depth = prefetch_depth if self.placement.staging_bytes == staging_need(
            self.pages, self.placement.streamed, num_layers, tied, prefetch_depth) else 0
        n_slots, slot_bytes = staging_slots(self.pages, self.placement.streamed, num_layers, tied, depth)
        self.prefetch_depth = depth
        self._free: list[AlignedBuffer] = [AlignedBuffer(slot_bytes) for _ in range(n_slots)]
        self._load_pinned()

    # -- pinned pages ------------------------------------------------------------------------------------

    def _load_pinned(self) -> None:
        for pid in self.placement.pinned:
            page = self.pages[pid]
            buf = AlignedBuffer(page["nbytes"])
            self.reader.read(page["file"], page["offset"], page["nbytes"], buf, label=f"page {pid}")
            self.stats.bytes_read += page["nbytes"]
            for name in page["tensors"]:
                t = self.ckpt.tensors[name]
                value = tensor_from_bytes(t, buf.tensor(t["offset"] - page["offset"], t["nbytes"]))
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    value = value.to(self.dtype)
                self._pinned[name] = value
            self.state[pid] = PageState.PINNED

    # -- the WeightStore surface ---------------------------------------------------------------------------

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
        with self._scope(("embedding",)):
            w = self.get(name)
            return (w[ids].clone() if isinstance(w, torch.Tensor) else w.rows(ids)).to(self.dtype)

    def layer(self, i: int) -> contextlib.AbstractContextManager:
        return self._scope(("layer", i))

    def expert(self, i: int, e: int) -> contextlib.AbstractContextManager:
        return self._scope(("expert", i, e))

    def prefetch(self, names: Iterable[str]) -> None:
        """Routed experts: start their reads now, so all of a layer's missing experts load concurrently."""
        for pid in sorted({self._page_of[n] for n in names}):
            if self.state[pid] == PageState.ON_DISK and self._free:
                self._start(pid, DEMAND)

    def close(self) -> None:
        self.reader.close()
        self._pinned.clear()
        self._objects.clear()
        self._slots.clear()

    def nbytes(self) -> int:
        return self.placement.pinned_bytes + self.placement.staging_bytes

    # -- streaming -------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _scope(self, key: tuple) -> Iterator[None]:
        pids = self._scope_pages.get(key, [])
        for pid in pids:  # demand reads for what prefetch did not bring
            if pid in self._slots:
                self.stats.hits += 1
                self.reader.promote(self._slots[pid].future)
            else:
                self.stats.misses += 1
                self._make_room(keep=set(pids))
                self._start(pid, DEMAND)
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
        self._held.update(pids)
        self._prefetch_after(self._scope_end.get(key, -1))
        try:
            yield
        finally:
            for pid in pids:
                for name in self.pages[pid]["tensors"]:
                    self._objects.pop(name, None)
                self._held.discard(pid)
                self._drop(pid)
            self._prefetch_after(self._scope_end.get(key, -1))

    def _build(self, name: str, pid: int):
        t = self.ckpt.tensors[name]
        page, slot = self.pages[pid], self._slots[pid]
        value = tensor_from_bytes(t, slot.buffer.tensor(t["offset"] - page["offset"], t["nbytes"]))
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != self.dtype:
            value = value.to(self.dtype)
        self._objects[name] = value
        return value

    def _start(self, pid: int, priority: int) -> None:
        page = self.pages[pid]
        if not self._free:
            raise RuntimeError(f"internal: no staging slot free for page {pid}")
        buf = self._free.pop()
        fut = self.reader.submit(page["file"], page["offset"], page["nbytes"], buf, priority, label=f"page {pid}")
        self._slots[pid] = _Slot(buf, fut)
        self.state[pid] = PageState.LOADING
        self.stats.bytes_read += page["nbytes"]
        self.stats.page_reads += 1

    def _make_room(self, keep: set[int]) -> None:
        """Drop prefetched pages (farthest ahead first) until a slot is free for a demand read."""
        for pid in sorted(self._slots, key=self._distance, reverse=True):
            if self._free:
                return
            if pid not in self._held and pid not in keep:
                self._drop(pid)

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
        pass starts over), up to `prefetch_depth` pages and as far as the staging pool allows."""
        if self.prefetch_depth <= 0 or not self._order:
            return
        start = bisect.bisect_right(self._order, last)
        issued = 0
        for k in range(len(self._order)):
            nxt = self._order[(start + k) % len(self._order)]
            if self.pages[nxt]["kind"] == "expert":
                continue  # routing decides which experts: they are read on demand
            if issued >= self.prefetch_depth:
                return
            issued += 1
            if nxt in self._slots or nxt in self._held:
                continue
            if not self._free:
                return  # never evict something needed sooner for something needed later
            self._start(nxt, PREFETCH)

"""Streaming weight store: a container larger than the memory budget, read from disk as the forward pass goes.

Placement (decided once, at load, by `plan`): the budget first sets aside the KV cache and activations
(budget.Reserve); then pages are PINNED (resident for the whole run) while the staging the remaining pages need
still fits. Streamed pages are read with O_DIRECT into equal-size staging slots just before their scope and
ahead of it (prefetch), and released when the scope ends. The pinned set is fixed, so a dense model's cyclic
layer sweep reads exactly the streamed bytes once per forward pass: the optimum, with no LRU thrash.

Three refinements:
* Lookup and head tables (the token embedding, an untied lm_head) are never staged whole: the lookup reads only
  the rows of the tokens in the pass, and the head streams its rows in blocks through two small buffers. Their
  small companions (scales of a q8 table, the final norm) stay resident.
* MoE experts: budget left after pinning becomes an expert cache (slots that keep experts resident after their
  scope), evicting by decayed use count, then recency. A multi-token pass (prefill) only fills free cache slots:
  it never evicts the decode working set. Routing counts persist beside the container (usage.json, written
  atomically) and the next load pins the hottest experts from the start.
* Every page's checksum is verified on its first read, on the I/O thread; a mismatch, a failed or short read, or
  a data file changed after load raises StorageError naming the page and file, and leaves the engine usable.

Tiers: a page is ON_DISK, LOADING (a read in flight), RESIDENT (in a staging or cache slot, evictable) or PINNED.
The plan assigns each page its tier once; a GPU tier would be one more pinned destination with its own budget
(pages copied there at load, `get` returning device tensors), with the same scopes and the same disk path.

Scopes (the model math opens them; see models/base.py): `layer(i)` for layer i's attention and dense FFN pages,
`layer(num_layers)` for the head, `expert(i, e)` for one routed expert. A streamed page is held only inside
its scope: model code keeps no tensor across scopes, so the buffer can be reused afterwards.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import json
import math
import os
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from colibri.container import DTYPES, FLOAT_KINDS, ContainerCheckpoint, checksum_str, tensor_from_bytes
from colibri.errors import InputError, StorageError
from colibri.io import (ALIGN, DEMAND, HUGE_PAGE, PREFETCH, AlignedBuffer, Reader, align_up, huge_align,
                        huge_page_bytes)
from colibri import quant

# Every non-expert page is read once per token whatever its kind, so for a dense model each pinned byte saves
# one byte of reading per token. The order pins the small every-token pages first (they are the largest share
# of scopes), and experts last: each is needed by only top_k / num_experts of the tokens.
PIN_ORDER = {"attention": 0, "head": 1, "embedding": 2, "shared_expert": 3, "ffn": 4, "expert": 5}
BLOCK_BYTES = 4 << 20  # rows of the head read per block...
HEAD_BUFFERS = 2  # ...through this many buffers (4 measured no faster on Qwen2.5-1.5B under 400M, noise +-15 %)
ROW_KINDS = ("f32", "bf16", "f16", "q8", "q4")  # storage kinds whose rows (q4: 64-row tiles) are contiguous bytes
LEARNED_PIN_SHARE = 0.75  # of the budget left for experts, how much usage.json's hottest experts may pin
USAGE_FILE = "usage.json"
USAGE_HALF_LIFE = 256  # tokens: the expert cache's use counts halve over this many routed tokens
USAGE_SAVE_EVERY = 128  # forward passes between usage.json writes (also written at close)


class PageState(enum.Enum):
    ON_DISK = "on_disk"
    LOADING = "loading"
    RESIDENT = "resident"
    PINNED = "pinned"


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# -------------------------------------------------------------------------------------------------- tables


def row_tensor(page: dict, tensors: dict[str, dict]) -> str | None:
    """The lookup/head table of an embedding or head page when its rows can be read on their own."""
    name = {"embedding": "model.embed_tokens.weight", "head": "lm_head.weight"}.get(page["kind"])
    t = tensors.get(name) if name else None
    if t is None or t["kind"] not in ROW_KINDS or len(t["shape"]) != 2 or name not in page["tensors"]:
        return None
    return name


def main_part(t: dict) -> str:
    return "data" if t["kind"] in FLOAT_KINDS else "qweight"


def row_bytes(t: dict) -> int:
    """Bytes per stored row of the table's main part (q4: K/2, meaningful only over whole tiles)."""
    p = t["parts"][main_part(t)]
    return p["nbytes"] // p["shape"][0]


def row_unit(t: dict) -> int:
    """Rows that are read together: 1, or for q4 a 64-row tile (its nibbles interleave the tile's rows)."""
    return quant.Q4_TILE if t["kind"] == "q4" else 1


def stored_rows(t: dict) -> int:
    """Rows of the main part on disk (q4 pads N to a multiple of 16; the last partial tile is read whole)."""
    return t["parts"][main_part(t)]["shape"][0]


def unit_of(t: dict, r: int) -> tuple[int, int]:
    """The stored row range [r0, r1) that row r is read with: itself, or its q4 tile (the tail: to the end)."""
    u = row_unit(t)
    r0 = r // u * u
    return r0, min(r0 + u, stored_rows(t))


def side_ranges(page: dict, tensors: dict[str, dict], table: str) -> list[tuple[str, str | None, int, int]]:
    """(tensor, part or None for the whole tensor, page-relative offset, nbytes) of what stays resident when a
    table page is read by rows: the table's parts other than its rows (q8 scales) and every other tensor."""
    out = []
    for name in page["tensors"]:
        t = tensors[name]
        if name == table:
            for pname, p in t["parts"].items():
                if pname != main_part(t):
                    out.append((name, pname, t["offset"] + p["offset"] - page["offset"], p["nbytes"]))
        else:
            out.append((name, None, t["offset"] - page["offset"], t["nbytes"]))
    return out


def scopes_of(page: dict, num_layers: int, tied: bool) -> list[tuple]:
    """The scopes that read a page. A tied embedding serves the lookup and the head."""
    if page["kind"] == "expert":
        return [("expert", page["layer"], page["expert"])]
    if page["kind"] == "embedding":
        return [("embedding",), ("layer", num_layers)] if tied else [("embedding",)]
    return [("layer", num_layers if page["kind"] == "head" else page["layer"])]


def staging_slots(pages: list[dict], streamed: Iterable[int], num_layers: int, tied: bool,
                  prefetch_depth: int) -> tuple[int, int]:
    """(slots, slot bytes) of the staging ring: equal slots the size of the largest streamed page (in whole huge
    pages: reads into 4 KiB pages are slower, io.AlignedBuffer), as many as the largest scope has streamed pages,
    plus `prefetch_depth` for reads ahead. Equal slots never fragment, so a demand read always finds room once
    prefetched pages are dropped."""
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
    return max([*count.values(), *nested.values()]) + prefetch_depth, huge_align(size)  # whole huge pages


# -------------------------------------------------------------------------------------------------- planning


@dataclass
class Placement:
    budget: int | None
    reserve: int  # KV cache and activations (budget.Reserve), set aside before weights
    pinned: list[int]
    streamed: list[int]  # read whole through the staging slots
    by_rows: list[int]  # tables read by rows (lookup) or row blocks (head)
    side_bytes: int  # resident companions of the by-rows tables
    slots: int  # staging slots, expert cache slots included
    slot_bytes: int
    cache_slots: int  # how many slots may keep experts resident after their scope
    block_bytes: int  # the head's row-block buffers
    lookup_bytes: int  # transient row buffers of one pass's embedding lookup
    pinned_bytes: int
    streamed_bytes: int  # what a dense pass reads of whole-read pages (a staged tied embedding twice: lookup, head)
    minimum: int  # the smallest budget this container runs in
    learned_pins: int = 0  # experts pinned because usage.json says they are the hottest
    prefetch_depth: int = 0

    @property
    def staging_bytes(self) -> int:
        return self.slots * self.slot_bytes + self.block_bytes + self.lookup_bytes + self.side_bytes

    def as_dict(self) -> dict:
        return {"budget_bytes": self.budget, "reserve_bytes": self.reserve, "pinned_bytes": self.pinned_bytes,
                "streamed_bytes": self.streamed_bytes, "staging_bytes": self.staging_bytes,
                "expert_cache_bytes": self.cache_slots * self.slot_bytes, "expert_cache_slots": self.cache_slots,
                "pinned_pages": len(self.pinned), "streamed_pages": len(self.streamed),
                "row_read_pages": len(self.by_rows), "learned_pins": self.learned_pins,
                "prefetch_depth": self.prefetch_depth, "minimum_bytes": self.minimum}


class _Costs:
    """What a set of streamed pages needs besides itself: staging slots, and for by-rows tables their resident
    companions, head block buffers and lookup row buffers."""

    def __init__(self, pages, tensors, num_layers, tied, batch):
        self.pages, self.num_layers, self.tied = pages, num_layers, tied
        self.parts: dict[int, tuple[int, int, int]] = {}  # by-rows page -> (side, block, lookup) bytes
        for p in pages:
            table = row_tensor(p, tensors)
            if table is None:
                continue
            t = tensors[table]
            side = sum(align_up(n) for *_, n in side_ranges(p, tensors, table))
            block = HEAD_BUFFERS * block_buffer_bytes(t) if p["kind"] == "head" or tied else 0
            lookup = 0
            if p["kind"] == "embedding":  # one aligned span per distinct token, never more than the table
                main = t["parts"][main_part(t)]["nbytes"]
                lookup = min(batch * row_span_bytes(t), align_up(main) + ALIGN)
            if side + block + lookup < p["nbytes"]:  # else staging the whole page is cheaper (small tables)
                self.parts[p["id"]] = (side, block, lookup)
        self.rows = {i: sum(v) for i, v in self.parts.items()}

    def need(self, streamed: Iterable[int], depth: int) -> int:
        streamed = list(streamed)
        slots, size = staging_slots(self.pages, [i for i in streamed if i not in self.rows], self.num_layers,
                                    self.tied, depth)
        return slots * size + sum(self.rows[i] for i in streamed if i in self.rows)


def minimum_staging(pages: list[dict], tensors: dict[str, dict], num_layers: int, tied: bool, batch: int) -> int:
    """What the weights need under the smallest budget (every page streamed, nothing read ahead): a memory limit
    must hold this beside the reserve (budget.settings' `floor`)."""
    return _Costs(pages, tensors, num_layers, tied, batch).need(range(len(pages)), 0)


def row_span_bytes(t: dict) -> int:
    """The most bytes an aligned read of one row (q4: its tile) covers."""
    rb = row_bytes(t) * row_unit(t)
    base = t["offset"] + t["parts"][main_part(t)]["offset"]
    straddles = not (base % ALIGN == 0 and (ALIGN % rb == 0 or rb % ALIGN == 0))
    return align_up(rb) + (ALIGN if straddles else 0)


def block_rows(t: dict) -> int:
    """Rows per head block: about BLOCK_BYTES, a whole number of 4096-byte units when the rows allow it."""
    rb = row_bytes(t)
    unit = math.lcm(ALIGN // math.gcd(rb, ALIGN), row_unit(t))
    rows = max(1, BLOCK_BYTES // rb)
    return rows - rows % unit if rows >= unit else max(rows - rows % row_unit(t), row_unit(t))


def block_buffer_bytes(t: dict) -> int:
    """One head block buffer: its rows, plus a unit of slack when blocks do not start on 4096 boundaries."""
    rows = min(block_rows(t), stored_rows(t))
    base = t["offset"] + t["parts"][main_part(t)]["offset"]
    aligned = base % ALIGN == 0 and (rows * row_bytes(t)) % ALIGN == 0
    return huge_align(align_up(rows * row_bytes(t)) + (0 if aligned else ALIGN))  # whole huge pages (io.py)


def auto_depth(pages: list[dict], streamed: Iterable[int], num_layers: int, tied: bool) -> int:
    """Pages to read ahead by default: the most streamed pages one layer has, plus one. Prefetch counts pages
    after the current scope, so with fewer than that, each layer's last page is read on demand, with compute
    waiting (measured: Llama-2-7B q4 under 1 GiB, 3 pages a layer, depth 2 ran at 0.78 of the I/O bound and
    depth 4 at 0.93)."""
    count: dict[int, int] = {}
    for pid in streamed:
        if pages[pid]["kind"] not in ("expert", "embedding", "head"):
            count[pages[pid]["layer"]] = count.get(pages[pid]["layer"], 0) + 1
    return max(count.values(), default=1) + 1


def resident_extra(page: dict, tensors: dict[str, dict], dtype: torch.dtype | None) -> int:
    """Bytes a pinned page's weights hold besides the page: the scales the bf16 kernels need converted (kept,
    since every decode token uses them) and, on CPUs whose int4 kernel wants another layout, the repacked q4."""
    extra = 0
    for name in page["tensors"]:
        t = tensors[name]
        if t["kind"] not in ("q4", "q8"):
            continue
        if dtype == torch.bfloat16:
            scales = t["parts"]["scales_zeros" if t["kind"] == "q4" else "scales"]
            if scales["dtype"] != "bfloat16" and (t["kind"] == "q4" or not t.get("group_size")):
                extra += 2 * math.prod(scales["shape"])
        if t["kind"] == "q4" and not quant.kernel_layout_is_stored_layout():
            extra += math.prod(t["parts"]["qweight"]["shape"])  # uint8
    return extra


def plan(pages: list[dict], tensors: dict[str, dict], num_layers: int, tied: bool, budget: int | None,
         prefetch_depth: int | None, reserve: int = 0, batch: int = 1,
         usage: dict[tuple[int, int], float] | None = None, dtype: torch.dtype | None = None) -> Placement:
    """Everything pinned when it fits; else pin greedily (see PIN_ORDER; experts only by learned usage) while
    the staging the remaining pages need still fits, and give what is left to the expert cache. A pinned page
    costs its bytes plus what its weights derive and keep (`resident_extra` for compute in `dtype`)."""
    ids = list(range(len(pages)))
    extra = {i: resident_extra(p, tensors, dtype) for i, p in enumerate(pages)}
    cost = {i: p["nbytes"] + extra[i] for i, p in enumerate(pages)}
    total = sum(p["nbytes"] for p in pages)
    costs = _Costs(pages, tensors, num_layers, tied, batch)
    minimum = reserve + costs.need(ids, 0)
    if budget is None or budget >= reserve + sum(cost.values()):
        return Placement(budget, reserve, ids, [], [], 0, 0, 0, 0, 0, 0, total, 0, minimum)
    if budget < minimum:
        raise InputError(f"memory limit {fmt_bytes(budget)} is below this model's minimum working set of "
                         f"{fmt_bytes(minimum)} ({fmt_bytes(reserve)} KV cache and activations, "
                         f"{fmt_bytes(minimum - reserve)} staging for its largest layer); raise --memory-limit"
                         " or lower --ctx-length / --batch-size")
    room = budget - reserve
    streamed = set(ids)
    pinned_cost = 0  # pinned pages' bytes plus what their weights derive
    if prefetch_depth is None:  # auto: a whole layer ahead, plus one page
        prefetch_depth = auto_depth(pages, [i for i in ids if i not in costs.rows], num_layers, tied)
    # a budget too small for that many prefetch slots reads ahead as far as it can, rather than not at all:
    # Qwen2.5-Coder-1.5B q4 under 250M ran at 0.62 of the I/O bound with depth 0 (only 2 slots fit depth 3's 5)
    while prefetch_depth > 0 and costs.need(streamed, prefetch_depth) > room:
        prefetch_depth -= 1

    def try_pin(pid: int, depth: int) -> bool:
        nonlocal pinned_cost
        rest = streamed - {pid}
        if pinned_cost + cost[pid] + costs.need(rest, depth) <= room:
            streamed.discard(pid)
            pinned_cost += cost[pid]
            return True
        return False

    untied_lookup = {i for i in costs.rows if pages[i]["kind"] == "embedding" and not tied}
    dense = [i for i in ids if pages[i]["kind"] != "expert" and i not in untied_lookup]  # rows are cheap to read
    for pid in sorted(dense, key=lambda i: (PIN_ORDER.get(pages[i]["kind"], 9), pages[i]["offset"])):
        try_pin(pid, prefetch_depth)
    depth = prefetch_depth if pinned_cost + costs.need(streamed, prefetch_depth) <= room else 0
    if not any(pages[i]["kind"] != "expert" and i not in costs.rows for i in streamed):
        depth = 0  # prefetch reads dense pages ahead; with none streamed its slots would sit idle
    need = costs.need(streamed, depth)
    experts = [i for i in streamed if pages[i]["kind"] == "expert"]
    learned = 0
    if experts and usage:
        share = LEARNED_PIN_SHARE * (room - pinned_cost - need)
        hot = sorted((i for i in experts if usage.get((pages[i]["layer"], pages[i]["expert"]), 0) > 0),
                     key=lambda i: -usage[(pages[i]["layer"], pages[i]["expert"])])
        spent = 0
        for pid in hot:  # pinning an expert never raises the staging need: checked by bytes alone
            if spent + cost[pid] > share:
                break
            streamed.discard(pid)
            pinned_cost += cost[pid]
            spent += cost[pid]
            learned += 1
        need = costs.need(streamed, depth)
    normal = sorted((i for i in streamed if i not in costs.rows), key=lambda i: (pages[i]["file"], pages[i]["offset"]))
    slots, slot_bytes = staging_slots(pages, normal, num_layers, tied, depth)
    cache_slots = 0
    if any(pages[i]["kind"] == "expert" for i in normal) and slot_bytes:
        cache_slots = max(0, (room - pinned_cost - need) // slot_bytes)
    by_rows = sorted(i for i in streamed if i in costs.rows)
    side, block, lookup = (sum(costs.parts[i][k] for i in by_rows) for k in range(3))
    pinned = sorted(set(ids) - streamed)
    per_pass = sum(pages[i]["nbytes"] * len(scopes_of(pages[i], num_layers, tied)) for i in normal)
    return Placement(budget, reserve, pinned, normal, by_rows, side, slots + cache_slots, slot_bytes, cache_slots,
                     block, lookup, sum(pages[i]["nbytes"] for i in pinned), per_pass, minimum, learned, depth)


# -------------------------------------------------------------------------------------------------- expert usage


class ExpertUsage:
    """Decayed routing counts (the expert cache's eviction score) and per-run totals (persisted in usage.json).

    Decay is lazy: a count is stored with the token clock at its last update and scaled by 2^(-age/half-life)
    when read. Saved totals carry the previous runs' totals at half weight, so the file follows drift."""

    def __init__(self, path: Path | None, num_layers: int, num_experts: int, identity: str):
        self.path, self.identity = path, identity
        self.shape = (num_layers, num_experts)
        self.clock = 0
        self.count: dict[tuple[int, int], float] = {}
        self.stamp: dict[tuple[int, int], int] = {}
        self.last_use: dict[tuple[int, int], int] = {}
        self.run: dict[tuple[int, int], int] = {}
        self.loaded = self._load()
        self.saved_ok: bool | None = None

    def _load(self) -> dict[tuple[int, int], float]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if data.get("version") != 1 or data.get("container") != self.identity or \
                    tuple(data.get("shape", ())) != self.shape:
                return {}  # another container's counts (or an older layout): start afresh
            return {(i, e): float(c) for i, row in enumerate(data["counts"]) for e, c in enumerate(row) if c > 0}
        except (OSError, ValueError, KeyError, TypeError):
            return {}

    @staticmethod
    def identity_of(ckpt: ContainerCheckpoint) -> str:
        """Which container the counts belong to: its source fingerprint and page checksums."""
        pages = ",".join(p["checksum"] for p in ckpt.pages)
        return ckpt.manifest.get("source", {}).get("fingerprint", "") + "/" + f"{zlib.crc32(pages.encode()):08x}"

    def tick(self, tokens: int) -> None:
        self.clock += tokens

    def record(self, layer: int, uses: dict[int, int]) -> None:
        for e, n in uses.items():
            key = (layer, e)
            self.count[key] = self.score(key) + n
            self.stamp[key] = self.last_use[key] = self.clock
            self.run[key] = self.run.get(key, 0) + n

    def score(self, key: tuple[int, int]) -> float:
        c = self.count.get(key)
        if c is None:
            return 0.0
        return c * 0.5 ** ((self.clock - self.stamp[key]) / USAGE_HALF_LIFE)

    def rank(self, key: tuple[int, int]) -> tuple[float, int]:
        """Eviction order: lowest decayed count first, then least recently used."""
        return self.score(key), self.last_use.get(key, -1)

    def save(self) -> None:
        """Write totals atomically (temp file + rename); a read-only container directory is not an error."""
        if self.path is None or not self.run:
            return
        layers, experts = self.shape
        rows = [[round(0.5 * self.loaded.get((i, e), 0.0) + self.run.get((i, e), 0), 3) for e in range(experts)]
                for i in range(layers)]
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"version": 1, "container": self.identity, "shape": list(self.shape),
                                       "counts": rows}))
            os.replace(tmp, self.path)
            self.saved_ok = True
        except OSError:
            self.saved_ok = False
            with contextlib.suppress(OSError):
                tmp.unlink()


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

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


class StreamingStore:
    """The WeightStore for a container under a memory budget (see module docstring)."""

    def __init__(self, ckpt: ContainerCheckpoint, args, budget: int | None, dtype: torch.dtype,
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
        self.placement = plan(self.pages, self.tensors, num_layers, tied, budget, prefetch_depth, reserve, batch,
                              self.usage.loaded if self.usage else None, dtype)
        self.prefetch_depth = self.placement.prefetch_depth
        self.reader = Reader(ckpt.files, io_threads=io_threads, direct=direct)
        self.stats = StreamStats()
        self.state = {pid: PageState.ON_DISK for pid in range(len(self.pages))}
        self._file_ids = [self._file_id(p) for p in ckpt.files]
        self._verified: set[int] = set()
        self._pinned: dict[str, object] = {}
        self._side: dict[str, dict[str, torch.Tensor]] = {}  # by-rows table -> its resident parts
        self._page_of = {t["name"]: t["page"] for t in ckpt.manifest["tensors"]}
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
                if p["id"] in self._streamed:
                    self._scope_pages.setdefault(key, []).append(p["id"])
                self._scope_end[key] = max(self._scope_end.get(key, -1), p["id"])
        # router lookahead: layers whose experts stream, and per layer the guess in flight (experts, pages read)
        self._lookahead = {self.pages[i]["layer"] for i in self._streamed
                           if self.pages[i]["kind"] == "expert"} if lookahead else set()
        self._guess: dict[int, tuple[set[int], set[int]]] = {}
        self._stale: set[int] = set()  # pages of wrong guesses still being read: freed once done
        self.lookahead_layers = [[0, 0] for _ in range(num_layers)]  # per layer: [correct, routed]
        self._multi = False  # the current pass prefills several tokens of a sequence: it must not evict cached experts
        self._passes = 0
        self.timeline_passes = 0  # record a per-scope timeline for this many forward passes (--verbose)
        self.timeline: list[dict] = []
        pl = self.placement
        self._free: list[AlignedBuffer] = [AlignedBuffer(pl.slot_bytes) for _ in range(pl.slots)]
        self._blocks: list[AlignedBuffer] = []
        self._load_pinned()
        self._load_by_rows()
        staging = self._free + self._blocks
        for buf in staging:  # fault the buffers in now (huge pages where the kernel has them), not mid-token
            buf.tensor().fill_(0)
        # the share of the staging slots and head blocks in transparent huge pages: on a VM, O_DIRECT into 4 KiB
        # pages read 2-3x slower (io.AlignedBuffer); reported so a slow run can be told apart from a slow disk
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
        if checksum_str(crc) != page["checksum"]:
            raise StorageError(f"page {pid}: checksum mismatch in {self.ckpt.files[page['file']]} at offset "
                               f"{page['offset']} ({page['nbytes']} bytes); the file is corrupt — run "
                               f"`colibri verify` and reconvert")
        self._verified.add(pid)
        self.stats.verified_pages += 1

    def _load_pinned(self) -> None:
        for pid in self.placement.pinned:
            page = self.pages[pid]
            buf = AlignedBuffer(page["nbytes"])
            self.reader.submit(page["file"], page["offset"], page["nbytes"], buf, DEMAND, label=f"page {pid}",
                               verify=self._verifier(pid)).result()
            self.stats.bytes_read += page["nbytes"]
            for name in page["tensors"]:
                t = self.tensors[name]
                self._pinned[name] = self._as_compute(tensor_from_bytes(
                    t, buf.tensor(t["offset"] - page["offset"], t["nbytes"])))
            self.state[pid] = PageState.PINNED

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
            for c0 in range(0, page["nbytes"], step):
                n = min(step, page["nbytes"] - c0)
                self.reader.read(page["file"], page["offset"] + c0, n, chunk, label=f"page {pid}")
                crc = zlib.crc32(chunk.memoryview(0, n), crc)
                for (_, _, off, nb), d in zip(ranges, dest):
                    lo, hi = max(off, c0), min(off + nb, c0 + n)
                    if lo < hi:
                        side.tensor(d + lo - off, hi - lo).copy_(chunk.tensor(lo - c0, hi - lo))
            self.stats.bytes_read += page["nbytes"]
            self._check_page(pid, crc)
            for (name, part, _, nb), d in zip(ranges, dest):
                t = self.tensors[name]
                if part is None:
                    self._pinned[name] = self._as_compute(tensor_from_bytes(t, side.tensor(d, nb)))
                else:
                    p = t["parts"][part]
                    self._side.setdefault(name, {})[part] = side.tensor(d, nb).view(DTYPES[p["dtype"]]).view(p["shape"])
        if any(self.pages[i]["kind"] == "head" or self.args.tie_word_embeddings for i in self.placement.by_rows):
            size = self.placement.block_bytes // HEAD_BUFFERS
            self._blocks = [AlignedBuffer(size) for _ in range(HEAD_BUFFERS)]

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
        if self._stale:  # a wrong guess's page that is routed to after all is kept for this use
            self._stale.difference_update(self._page_of[n] for e in uses for n in names[e])
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
        return self._as_compute(tensor_from_bytes(t, slot.buffer.tensor(t["offset"] - page["offset"], t["nbytes"])))

    def predict(self, i: int, uses: dict[int, int], names: dict[int, list[str]]) -> None:
        """Layer i's experts guessed ahead (expert -> tokens): read the guessed ones not resident, most used
        first, at prefetch priority (behind every demand read), into a free slot (one is kept free for demand
        reads) or, in a decode pass, over a cached expert that ranks lower (the guess enters the cache early)."""
        if i not in self._lookahead:
            return
        self._reap()
        self.stats.lookahead_predicted += len(uses)
        started = set()
        for e in sorted(uses, key=lambda e: (-uses[e], e)):
            for pid in sorted({self._page_of[n] for n in names[e]}):
                if self.state[pid] != PageState.ON_DISK or pid not in self._streamed:
                    continue
                if len(self._free) <= 1 and not self._evict_for(pid):
                    return self._note_guess(i, uses, started)
                self._start(pid, PREFETCH)
                started.add(pid)
        self._note_guess(i, uses, started)

    def _evict_for(self, pid: int) -> bool:
        """Free a cached expert's slot for a guessed page that ranks higher (decode passes only, as `_admit`)."""
        if self._multi or self.usage is None:
            return False
        cached = [p for p in self._cached() if p not in self._held]
        if not cached:
            return False
        victim = min(cached, key=lambda p: self.usage.rank(self._key(p)))
        if self.usage.rank(self._key(victim)) >= self.usage.rank(self._key(pid)):
            return False
        self._drop(victim)
        return True

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
        cap = self.placement.cache_slots if self.usage is not None else 0
        for pid in pids:
            slot = self._slots.get(pid)
            if slot is None or self.pages[pid]["expert"] in routed or slot.cached or pid in self._held:
                continue
            if slot.future.done() and slot.future.exception() is None and len(self._cached()) < cap:
                slot.cached = True
                continue
            if slot.future.cancel():  # never started: nothing was read
                self.stats.bytes_read -= self.pages[pid]["nbytes"]
                self.stats.page_reads -= 1
                self._drop(pid)
                continue
            self.stats.lookahead_wasted_bytes += self.pages[pid]["nbytes"]
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
        return self.placement.pinned_bytes + self.placement.staging_bytes

    def counters(self) -> dict:
        """Cumulative counters (GenerationMetrics takes differences) and the placement's resident bytes."""
        io = self.reader.stats()
        cached = sum(1 for s in self._slots.values() if s.cached)
        return {**self.stats.as_dict(), "read_active_s": io.active_s, "direct_io": io.direct,
                "pinned_bytes": self.placement.pinned_bytes, "cached_bytes": cached * self.placement.slot_bytes,
                "staging_bytes": self.placement.staging_bytes, "staging_huge_fraction": self.staging_huge_fraction,
                "reserve_bytes": self.placement.reserve,
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
            nbytes = self.pages[pid]["nbytes"]
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
                                      "demand_bytes": sum(self.pages[p]["nbytes"] for p in pids if p not in ahead),
                                      "wait_ms": round(1e3 * waited, 3),
                                      "compute_ms": round(1e3 * (time.perf_counter() - t1), 3)})
            for pid in pids:
                for name in self.pages[pid]["tensors"]:
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
        return self.pages[pid]["layer"], self.pages[pid]["expert"]

    def _admit(self, pid: int) -> bool:
        """Keep an expert resident after its scope? Into a free cache slot always; over a cached expert only in
        a single-token pass (decode), and only when that expert ranks lower."""
        cap = self.placement.cache_slots
        if cap == 0 or self.usage is None:
            return False
        cached = self._cached()
        if len(cached) < cap:
            return True
        if self._multi:
            return False
        victim = min(cached, key=lambda i: self.usage.rank(self._key(i)))
        if self.usage.rank(self._key(victim)) >= self.usage.rank(self._key(pid)):
            return False
        self._drop(victim)
        return True

    def _build(self, name: str, pid: int):
        t = self.tensors[name]
        page, slot = self.pages[pid], self._slots[pid]
        value = self._as_compute(tensor_from_bytes(t, slot.buffer.tensor(t["offset"] - page["offset"], t["nbytes"])))
        self._objects[name] = value
        return value

    def _start(self, pid: int, priority: int) -> None:
        page = self.pages[pid]
        if not self._free:
            raise RuntimeError(f"internal: no staging slot free for page {pid}")
        buf = self._free.pop()
        fut = self.reader.submit(page["file"], page["offset"], page["nbytes"], buf, priority, label=f"page {pid}",
                                 verify=self._verifier(pid))
        self._slots[pid] = _Slot(buf, fut)
        self.state[pid] = PageState.LOADING
        self.stats.bytes_read += page["nbytes"]
        self.stats.page_reads += 1

    def _make_room(self, keep: set[int]) -> None:
        """Free a slot for a demand read: drop prefetched pages (farthest ahead first), then, if still needed,
        the lowest-ranked cached expert."""
        if self._free:
            return
        for pid in sorted((p for p, s in self._slots.items() if not s.cached), key=self._distance, reverse=True):
            if pid not in self._held and pid not in keep:
                self._drop(pid)
                if self._free:
                    return
        cached = [p for p in self._cached() if p not in keep]
        if cached and self.usage:
            self._drop(min(cached, key=lambda i: self.usage.rank(self._key(i))))

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

    # -- tables read by rows -----------------------------------------------------------------------------------

    def _table(self, name: str, r0: int, r1: int, data: torch.Tensor):
        """Rows [r0, r1) of table `name` over `data` (their bytes), with the resident companions."""
        t = self.tensors[name]
        p = t["parts"][main_part(t)]
        k = t["shape"][1]
        rows = data.view(DTYPES[p["dtype"]]).view(r1 - r0, *p["shape"][1:])
        if t["kind"] in FLOAT_KINDS:
            return rows
        if t["kind"] == "q4":  # whole tiles; scales_zeros [G, Np, 2] -> this block's [G, r1 - r0, 2]
            side = {n: v[:, r0:r1].contiguous() for n, v in self._side.get(name, {}).items()}
            n = min(r1, t["shape"][0]) - r0  # the last block carries the padding rows
        else:
            side = {n: v[r0:r1] for n, v in self._side.get(name, {}).items()}
            n = r1 - r0
        return quant.from_buffers(t["kind"], (n, k), t["group_size"], {"qweight": rows, **side})

    def _read_rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup of a table on disk: read only the rows of these tokens (merged aligned spans)."""
        t = self.tensors[name]
        page = self.pages[self._page_of[name]]
        base = t["offset"] + t["parts"][main_part(t)]["offset"]
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
            futures.append(self.reader.submit(page["file"], s, e - s, buf, DEMAND, buffer_offset=at,
                                              label=f"page {page['id']} (rows of {name})"))
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

        if t["kind"] == "q4":  # dequantize the tiles that hold the rows, then pick the rows
            tiles = {u: self._table(name, *u, at_file(*u)).dequantize() for u in units}
            vals = torch.stack([tiles[unit_of(t, r)][r - unit_of(t, r)[0]] for r in uniq.tolist()])
            return vals[inverse].to(self.dtype)
        got = [at_file(r, r + 1) for r in uniq.tolist()]
        p = t["parts"][main_part(t)]
        rows = torch.stack(got).view(DTYPES[p["dtype"]]).view(len(got), *p["shape"][1:])
        if t["kind"] in FLOAT_KINDS:
            vals = rows
        else:
            side = {n: v[uniq].contiguous() for n, v in self._side.get(name, {}).items()}
            vals = quant.from_buffers(t["kind"], (len(got), t["shape"][1]), t["group_size"],
                                      {"qweight": rows, **side}).rows(torch.arange(len(got)))
        return vals[inverse].to(self.dtype)

    def _stream_blocks(self, name: str) -> Iterator:
        """Rows of a head table in blocks through HEAD_BUFFERS buffers: the next blocks read while one computes."""
        t = self.tensors[name]
        page = self.pages[self._page_of[name]]
        base = t["offset"] + t["parts"][main_part(t)]["offset"]
        rb, n, step = row_bytes(t), stored_rows(t), block_rows(t)  # q4: whole tiles, padding rows included
        blocks = [(r, min(n, r + step)) for r in range(0, n, step)]
        pending: dict[int, tuple[Future, int]] = {}

        def submit(b: int) -> None:
            r0, r1 = blocks[b]
            s = (base + r0 * rb) // ALIGN * ALIGN
            size = base + r1 * rb - s
            fut = self.reader.submit(page["file"], s, size, self._blocks[b % len(self._blocks)], DEMAND,
                                     label=f"page {page['id']} (rows {r0}-{r1} of {name})")
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

"""Placement: which pages of a container stay resident under a memory budget and what streaming the rest needs.

Decided at load (`plan`), without reading a weight: the budget first sets aside the KV cache and activations
(budget.Reserve); then pages are PINNED (resident for the whole run) while the staging the remaining pages need
still fits. Streamed pages go through equal-size staging slots, so a dense model's cyclic layer sweep reads
exactly the streamed bytes once per forward pass, with no LRU thrash. Lookup and head tables (the token
embedding, an untied lm_head) are never staged whole: the lookup reads only its tokens' rows and the head
streams row blocks through two small buffers; their small companions stay resident. MoE experts get the budget
left after pinning as an expert cache. The store (colibri.weights.streaming) carries a placement out, and its elastic
pins (`StreamingStore.fit`) pin and unpin streamed pages beyond it as the KV cache's need changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

from colibri.quant import kinds as quant
from colibri.formats.container import FLOAT_KINDS, PageEntry, TensorEntry
from colibri.core.errors import InputError
from colibri.weights.io import ALIGN, align_up, huge_align

# Every non-expert page is read once per token whatever its kind, so for a dense model each pinned byte saves
# one byte of reading per token. The order pins the small every-token pages first (they are the largest share
# of scopes), and experts last: each is needed by only top_k / num_experts of the tokens.
PIN_ORDER = {"attention": 0, "head": 1, "embedding": 2, "shared_expert": 3, "ffn": 4, "expert": 5}
BLOCK_BYTES = 4 << 20  # rows of the head read per block...
HEAD_BUFFERS = 2  # ...through this many buffers: one computes while the next is read (more buffers did no
# better: docs/performance.md, "Figures moved from source comments")
# kinds whose rows (q4, q4k: 64-row tiles) are contiguous bytes
ROW_KINDS = ("f32", "bf16", "f16", "q8", "q4", "q4_1", "q4_0", "q8k", "q6k", "q3k", "iq4_xs", "q5k", "q2k", "q5_0",
             "q5_1", "iq4_nl", "q4k")
LEARNED_PIN_SHARE = 0.75  # of the budget left for experts, how much usage.json's hottest experts may pin


def pin_order(pages: list[PageEntry], ids: Iterable[int]) -> list[int]:
    """Pages in the order to pin them: by kind (PIN_ORDER), and within a kind spread over the pass rather than
    from its start: the k-th of a kind's n pages (in file order) goes at the bit-reversed position of k, so any
    prefix of the order (pins grow and shrink at its end) leaves the streamed pages evenly apart. A run of
    pinned layers computes with only the prefetch depth's pages to read; spread runs are short, so the disk never
    waits on compute (docs/performance.md, "Pins spread over the pass")."""
    kinds: dict[int, list[int]] = {}
    for pid in sorted(ids, key=lambda i: pages[i].offset):
        kinds.setdefault(PIN_ORDER.get(pages[pid].kind, 9), []).append(pid)
    out = []
    for _, group in sorted(kinds.items()):
        bits = max(1, (len(group) - 1).bit_length())
        spread = (int(format(k, f"0{bits}b")[::-1], 2) for k in range(1 << bits))
        out += [group[r] for r in spread if r < len(group)]
    return out


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# -------------------------------------------------------------------------------------------------- tables


def row_tensor(page: PageEntry, tensors: dict[str, TensorEntry]) -> str | None:
    """The lookup/head table of an embedding or head page when its rows can be read on their own."""
    name = {"embedding": "model.embed_tokens.weight", "head": "lm_head.weight"}.get(page.kind)
    t = tensors.get(name) if name else None
    if t is None or t.kind not in ROW_KINDS or len(t.shape) != 2 or name not in page.tensors:
        return None
    return name


def main_part(t: TensorEntry) -> str:
    return "data" if t.kind in FLOAT_KINDS else "qweight"


def row_bytes(t: TensorEntry) -> int:
    """Bytes per stored row of the table's main part (q4: K/2, meaningful only over whole tiles)."""
    p = t.parts[main_part(t)]
    return p.nbytes // p.shape[0]


def row_unit(t: TensorEntry) -> int:
    """Rows that are read together: 1, or for q4 a 64-row tile (its nibbles interleave the tile's rows)."""
    return quant.Q4_TILE if t.kind in quant.TILED_KINDS else 1


def stored_rows(t: TensorEntry) -> int:
    """Rows of the main part on disk (q4 pads N to a multiple of 16; the last partial tile is read whole)."""
    return t.parts[main_part(t)].shape[0]


def unit_of(t: TensorEntry, r: int) -> tuple[int, int]:
    """The stored row range [r0, r1) that row r is read with: itself, or its q4 tile (the tail: to the end)."""
    u = row_unit(t)
    r0 = r // u * u
    return r0, min(r0 + u, stored_rows(t))


def side_ranges(page: PageEntry, tensors: dict[str, TensorEntry], table: str) -> list[tuple[str, str | None, int, int]]:
    """(tensor, part or None for the whole tensor, page-relative offset, nbytes) of what stays resident when a
    table page is read by rows: the table's parts other than its rows (q8 scales) and every other tensor."""
    out = []
    for name in page.tensors:
        t = tensors[name]
        if name == table:
            for pname, p in t.parts.items():
                if pname != main_part(t):
                    out.append((name, pname, t.offset + p.offset - page.offset, p.nbytes))
        else:
            out.append((name, None, t.offset - page.offset, t.nbytes))
    return out


@dataclass(frozen=True)
class LayerScope:
    """Layer `layer`'s attention and dense FFN pages; layer == num_layers: the head."""
    layer: int

    def __str__(self) -> str:
        return f"layer/{self.layer}"


@dataclass(frozen=True)
class ExpertScope:
    """One routed expert's pages, opened inside its layer's scope."""
    layer: int
    expert: int

    def __str__(self) -> str:
        return f"expert/{self.layer}/{self.expert}"


@dataclass(frozen=True)
class EmbeddingScope:
    """The embedding table staged whole for the lookup."""

    def __str__(self) -> str:
        return "embedding"


Scope = LayerScope | ExpertScope | EmbeddingScope  # where model code holds pages (the store opens one at a time)


@dataclass(frozen=True, eq=False)
class WeightTable:
    """A container's pages and tensors, with the two facts of its model that say which steps of a pass read a
    page: the number of layers (the head's scope is layer num_layers) and whether the embedding is also the
    head (tied)."""
    pages: list[PageEntry]
    tensors: dict[str, TensorEntry]
    num_layers: int
    tied: bool

    @classmethod
    def of(cls, ckpt, args) -> WeightTable:
        """The table of a container checkpoint for the model args (models.ModelArgs) read from it."""
        return cls(ckpt.pages, ckpt.tensors, args.num_layers, args.tie_word_embeddings)

    def scopes(self, pid: int) -> list[Scope]:
        """The scopes that read page pid. A tied embedding serves the lookup and the head."""
        page = self.pages[pid]
        if page.kind == "expert":
            return [ExpertScope(page.layer, page.expert)]
        if page.kind == "embedding":
            return [EmbeddingScope(), LayerScope(self.num_layers)] if self.tied else [EmbeddingScope()]
        return [LayerScope(self.num_layers if page.kind == "head" else page.layer)]

    def pass_bytes(self, pids: Iterable[int]) -> int:
        """What a dense pass reads of these pages read whole (a staged tied table twice: lookup and head)."""
        return sum(self.pages[pid].nbytes * len(self.scopes(pid)) for pid in pids)


def staging_slots(weights: WeightTable, streamed: Iterable[int], prefetch_depth: int) -> tuple[int, int]:
    """(slots, slot bytes) of the staging ring: equal slots the size of the largest streamed page (in whole huge
    pages: reads into 4 KiB pages are slower, io.AlignedBuffer), as many as the largest scope has streamed pages,
    plus `prefetch_depth` for reads ahead. Equal slots never fragment, so a demand read always finds room once
    prefetched pages are dropped."""
    count: dict[Scope, int] = {}
    size = 0
    for pid in streamed:
        for key in weights.scopes(pid):
            count[key] = count.get(key, 0) + 1
        size = max(size, weights.pages[pid].nbytes)
    if not count:
        return 0, 0
    # An expert's scope opens inside its layer's: both are held at once.
    expert_layers = {k.layer for k in count if isinstance(k, ExpertScope)}
    nested = {key: n + (key.layer in expert_layers) for key, n in count.items() if isinstance(key, LayerScope)}
    return max([*count.values(), *nested.values()]) + prefetch_depth, huge_align(size)  # whole huge pages


# -------------------------------------------------------------------------------------------------- planning


@dataclass
class Placement:
    memory_limit: int | None  # --memory-limit in bytes (None: none)
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
        return {"memory_limit_bytes": self.memory_limit, "reserve_bytes": self.reserve, "pinned_bytes": self.pinned_bytes,
                "streamed_bytes": self.streamed_bytes, "staging_bytes": self.staging_bytes,
                "expert_cache_bytes": self.cache_slots * self.slot_bytes, "expert_cache_slots": self.cache_slots,
                "pinned_pages": len(self.pinned), "streamed_pages": len(self.streamed),
                "row_read_pages": len(self.by_rows), "learned_pins": self.learned_pins,
                "prefetch_depth": self.prefetch_depth, "minimum_bytes": self.minimum}


class _Costs:
    """What a set of streamed pages needs besides itself: staging slots, and for by-rows tables their resident
    companions, head block buffers and lookup row buffers."""

    def __init__(self, weights: WeightTable, batch: int):
        self.weights = weights
        tensors = weights.tensors
        self.parts: dict[int, tuple[int, int, int]] = {}  # by-rows page -> (side, block, lookup) bytes
        for p in weights.pages:
            table = row_tensor(p, tensors)
            if table is None:
                continue
            t = tensors[table]
            side = sum(align_up(n) for *_, n in side_ranges(p, tensors, table))
            block = HEAD_BUFFERS * block_buffer_bytes(t) if p.kind == "head" or weights.tied else 0
            lookup = 0
            if p.kind == "embedding":  # one aligned span per distinct token, never more than the table
                main = t.parts[main_part(t)].nbytes
                lookup = min(batch * row_span_bytes(t), align_up(main) + ALIGN)
            if side + block + lookup < p.nbytes:  # else staging the whole page is cheaper (small tables)
                self.parts[p.id] = (side, block, lookup)
        self.rows = {i: sum(v) for i, v in self.parts.items()}

    def need(self, streamed: Iterable[int], depth: int) -> int:
        streamed = list(streamed)
        slots, size = staging_slots(self.weights, [i for i in streamed if i not in self.rows], depth)
        return slots * size + sum(self.rows[i] for i in streamed if i in self.rows)


def minimum_staging(weights: WeightTable, batch: int) -> int:
    """What the weights need under the smallest budget (every page streamed, nothing read ahead): a memory limit
    must hold this beside the reserve (budget.settings' `floor`)."""
    return _Costs(weights, batch).need(range(len(weights.pages)), 0)


def row_span_bytes(t: TensorEntry) -> int:
    """The most bytes an aligned read of one row (q4: its tile) covers."""
    rb = row_bytes(t) * row_unit(t)
    base = t.offset + t.parts[main_part(t)].offset
    straddles = not (base % ALIGN == 0 and (ALIGN % rb == 0 or rb % ALIGN == 0))
    return align_up(rb) + (ALIGN if straddles else 0)


def block_rows(t: TensorEntry) -> int:
    """Rows per head block: about BLOCK_BYTES, a whole number of 4096-byte units when the rows allow it."""
    rb = row_bytes(t)
    unit = math.lcm(ALIGN // math.gcd(rb, ALIGN), row_unit(t))
    rows = max(1, BLOCK_BYTES // rb)
    return rows - rows % unit if rows >= unit else max(rows - rows % row_unit(t), row_unit(t))


def block_buffer_bytes(t: TensorEntry) -> int:
    """One head block buffer: its rows, plus a unit of slack when blocks do not start on 4096 boundaries."""
    rows = min(block_rows(t), stored_rows(t))
    base = t.offset + t.parts[main_part(t)].offset
    aligned = base % ALIGN == 0 and (rows * row_bytes(t)) % ALIGN == 0
    return huge_align(align_up(rows * row_bytes(t)) + (0 if aligned else ALIGN))  # whole huge pages (weights/io.py)


def auto_depth(pages: list[PageEntry], streamed: Iterable[int]) -> int:
    """Pages to read ahead by default: the most streamed pages one layer has, plus one. Prefetch counts pages
    after the current scope, so with fewer than that, each layer's last page is read on demand, with compute
    waiting (figures: docs/performance.md, "Figures moved from source comments")."""
    count: dict[int, int] = {}
    for pid in streamed:
        if pages[pid].kind not in ("expert", "embedding", "head"):
            count[pages[pid].layer] = count.get(pages[pid].layer, 0) + 1
    return max(count.values(), default=1) + 1


def resident_extra(page: PageEntry, tensors: dict[str, TensorEntry], dtype: torch.dtype | None) -> int:
    """Bytes a pinned page's weights hold besides the page: the scales the bf16 kernels need converted (kept,
    since every decode token uses them) and, on CPUs whose int4 kernel wants another layout, the repacked q4."""
    extra = 0
    for name in page.tensors:
        t = tensors[name]
        if t.kind not in ("q4", "q8"):
            continue
        if dtype == torch.bfloat16:
            scales = t.parts["scales_zeros" if t.kind == "q4" else "scales"]
            if scales.dtype != "bfloat16" and (t.kind == "q4" or not t.group_size):
                extra += 2 * math.prod(scales.shape)
        if t.kind == "q4" and quant.torch_tier_repacks_q4():
            extra += math.prod(t.parts["qweight"].shape)  # uint8
    return extra


def plan(weights: WeightTable, memory_limit: int | None, prefetch_depth: int | None, reserve: int = 0, batch: int = 1,
         usage: dict[tuple[int, int], float] | None = None, dtype: torch.dtype | None = None) -> Placement:
    """Everything pinned when it fits; else pin greedily (see PIN_ORDER; experts only by learned usage) while
    the staging the remaining pages need still fits, and give what is left to the expert cache. A pinned page
    costs its bytes plus what its weights derive and keep (`resident_extra` for compute in `dtype`)."""
    pages, tensors = weights.pages, weights.tensors
    ids = list(range(len(pages)))
    extra = {i: resident_extra(p, tensors, dtype) for i, p in enumerate(pages)}
    cost = {i: p.nbytes + extra[i] for i, p in enumerate(pages)}
    total = sum(p.nbytes for p in pages)
    costs = _Costs(weights, batch)
    minimum = reserve + costs.need(ids, 0)
    if memory_limit is None or memory_limit >= reserve + sum(cost.values()):
        return Placement(memory_limit, reserve, ids, [], [], 0, 0, 0, 0, 0, 0, total, 0, minimum)
    if memory_limit < minimum:
        raise InputError(f"memory limit {fmt_bytes(memory_limit)} is below this model's minimum working set of "
                         f"{fmt_bytes(minimum)} ({fmt_bytes(reserve)} KV cache and activations, "
                         f"{fmt_bytes(minimum - reserve)} staging for its largest layer); raise --memory-limit"
                         " or lower --ctx-length / --batch-size")
    room = memory_limit - reserve
    untied_lookup = {i for i in costs.rows if pages[i].kind == "embedding" and not weights.tied}
    dense = [i for i in ids if pages[i].kind != "expert" and i not in untied_lookup]  # rows are cheap to read

    def pin_dense(depth: int) -> tuple[set[int], int, int]:
        """(streamed pages, pinned pages' cost with what their weights derive, depth) after pinning in
        pin_order while the staging of the rest at `depth` fits. A budget too small for that many prefetch slots
        reads ahead as far as it can, rather than not at all: depth 0 serializes reads and compute
        (docs/performance.md, "Figures moved from source comments")."""
        streamed, pinned_cost = set(ids), 0
        while depth > 0 and costs.need(streamed, depth) > room:
            depth -= 1
        for pid in pin_order(pages, dense):
            rest = streamed - {pid}
            if pinned_cost + cost[pid] + costs.need(rest, depth) <= room:
                streamed, pinned_cost = rest, pinned_cost + cost[pid]
        return streamed, pinned_cost, depth

    if prefetch_depth is not None:
        streamed, pinned_cost, prefetch_depth = pin_dense(prefetch_depth)
    else:  # auto: a whole layer's streamed pages ahead, plus one page; counted on the pages left streaming, as
        # pins take whole kinds (every attention page first), and each slot fewer pins one page more
        want = auto_depth(pages, [i for i in ids if i not in costs.rows])
        while True:
            streamed, pinned_cost, prefetch_depth = pin_dense(want)
            fewer = auto_depth(pages, [i for i in streamed if i not in costs.rows])
            if fewer >= want:
                break
            want = fewer
    depth = prefetch_depth if pinned_cost + costs.need(streamed, prefetch_depth) <= room else 0
    if not any(pages[i].kind != "expert" and i not in costs.rows for i in streamed):
        depth = 0  # prefetch reads dense pages ahead; with none streamed its slots would sit idle
    need = costs.need(streamed, depth)
    experts = [i for i in streamed if pages[i].kind == "expert"]
    learned = 0
    if experts and usage:
        share = LEARNED_PIN_SHARE * (room - pinned_cost - need)
        hot = sorted((i for i in experts if usage.get((pages[i].layer, pages[i].expert), 0) > 0),
                     key=lambda i: -usage[(pages[i].layer, pages[i].expert)])
        spent = 0
        for pid in hot:  # pinning an expert never raises the staging need: checked by bytes alone
            if spent + cost[pid] > share:
                break
            streamed.discard(pid)
            pinned_cost += cost[pid]
            spent += cost[pid]
            learned += 1
        need = costs.need(streamed, depth)
    normal = sorted((i for i in streamed if i not in costs.rows), key=lambda i: (pages[i].file, pages[i].offset))
    slots, slot_bytes = staging_slots(weights, normal, depth)
    cache_slots = 0
    if any(pages[i].kind == "expert" for i in normal) and slot_bytes:
        cache_slots = max(0, (room - pinned_cost - need) // slot_bytes)
    by_rows = sorted(i for i in streamed if i in costs.rows)
    side, block, lookup = (sum(costs.parts[i][k] for i in by_rows) for k in range(3))
    pinned = sorted(set(ids) - streamed)
    return Placement(memory_limit, reserve, pinned, normal, by_rows, side, slots + cache_slots, slot_bytes, cache_slots,
                     block, lookup, sum(pages[i].nbytes for i in pinned), weights.pass_bytes(normal), minimum, learned,
                     depth)

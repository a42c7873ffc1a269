"""Paged KV cache: a sequence's positions in blocks of `block` tokens, blocks of the model's shared pool.

One sequence's cache (`KVCache`) holds a table of blocks that its pool made (colibri.kv.pool): block j holds
positions [j * block, (j + 1) * block) of every layer. Blocks are reference counted and shared: a sequence that
starts with a cached prefix holds the prefix trie's blocks themselves, and a block it is about to write that others
hold too (the partly filled last block of a reused prefix) is copied first. At most `window` positions of a sequence stay
in RAM: when a pass needs more, its oldest blocks move to the swap file (for every holder), and attention reads
them back one layer at a time (into a staging buffer) with the next layer's reads in flight. Attention reads
blocks where they are, in RAM or staged (`ops.Paged`: no copy of the context per layer and step; q8 blocks are
dequantized row by row where attention reads them). The values attention sees are the same wherever a block
lives, so placement never changes tokens. Sliding-window layers read back only the blocks inside their window.

A block's bytes, the unit of the pool, the swap file and saved sessions, are per layer one 4096-aligned
segment: K [Hkv, block, Dh], V [Hkv, block, Dh] in the storage dtype, then (q8 only) their f32 scales
[Hkv, block, Dh / group].

`--kv-quant q8` (lossy, opt-in) stores K and V as int8 with one f32 scale per `group` (32) values of a head
vector; every use dequantizes, so a position's keys are the same wherever they are stored.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from colibri.core.errors import InputError
from colibri.kernels.ops import Paged, write_positions
from colibri.weights.io import DEMAND, PREFETCH, AlignedBuffer, align_up
from colibri.kv.pool import BLOCK, Block, BlockPool, BlockTable, KVLayout
from colibri.kv.swap import SwapSlots

MIN_BLOCK = 16  # the fewest: BLOCK is halved down to this while a block would take more than BLOCK_BYTES of RAM
BLOCK_BYTES = 4 << 20


@functools.lru_cache(maxsize=256)  # a pure function of its arguments, asked at every limit a plan tries
def block_for(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, quant: str | None) -> int:
    """The default block size of a model: BLOCK tokens, halved (down to MIN_BLOCK) while one block's RAM exceeds
    BLOCK_BYTES. A block is the unit a sequence's KV grows by, so a large one wastes most of itself on short
    sequences (a Llama-2-7B block of 64 bf16 tokens is 32 MiB: sixteen 28-token sequences would hold 512 MiB for
    448 positions, 16 tokens make it 8 MiB); small models keep 64-token blocks, whose per-layer segments are what
    the swap file reads and writes at once. The size never changes tokens: attention sees the same keys in the
    same order however they are split."""
    block = BLOCK
    while block > MIN_BLOCK and KVLayout(num_layers, num_kv_heads, head_dim, dtype, block, quant).ram_block_bytes \
            > BLOCK_BYTES:
        block //= 2
    return block


def quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., Dh] -> int8 values [..., Dh] and f32 scales [..., Dh / group] (symmetric, amax / 127)."""
    g = x.float().unflatten(-1, (x.shape[-1] // group, group))
    s = g.abs().amax(-1) / 127.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round(g / s[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.flatten(-2), s


class KVCache:
    """One sequence's KV; see the module docstring. `pool`: the block pool it shares with other sequences, with
    its swap slots if any (None: a pool of its own, RAM only).
    Its block table comes from `pool`; the cache keeps the positions and their token ids, its read buffers and
    the reads in flight. `on_truncate(cache, length)` is told when positions >= length are dropped (the prefix trie's
    cursor)."""

    def __init__(self, layout: KVLayout, max_length: int, window: int | None = None,
                 layer_windows: list[int | None] | None = None, pool: BlockPool | None = None,
                 on_truncate: Callable[[KVCache, int], None] | None = None):
        self.layout = layout
        B = layout.block
        self.max_length = max_length
        full = align_up(max_length, B)
        self.window = full if window is None else min(full, window // B * B)
        if self.window < full and self.window < 2 * B:  # spilling needs one block in RAM beside the oldest
            raise InputError(f"a KV window of {self.window} tokens is too small; it must hold two blocks "
                             f"({2 * B} tokens)")
        self.pool = pool if pool is not None else BlockPool(layout)
        self._on_truncate = on_truncate
        self.layer_windows = layer_windows or [None] * layout.num_layers
        self.length = 0  # positions committed (visible to the next pass)
        self.ids: list[int] = []  # the token at each committed position
        self.table: BlockTable = self.pool.table()  # entry j: positions [j * block, (j + 1) * block)
        self._staging: list[AlignedBuffer] = []  # read buffers for blocks on disk (two: one layer ahead)
        self._pending: dict[int, tuple[list[int], list, int]] = {}  # layer -> (blocks, futures, buffer)

    # -- bookkeeping ---------------------------------------------------------------------------------------

    @property
    def swap(self) -> SwapSlots | None:
        """The swap slots of its pool (None: RAM only)."""
        return self.pool.swap

    @property
    def offloads(self) -> bool:
        return self.window < align_up(self.max_length, self.layout.block)

    @property
    def max_pass(self) -> int:
        """The most tokens one forward pass may add: the window keeps one block for the oldest in-RAM one."""
        return self.window - self.layout.block if self.offloads else self.max_length

    def ram_blocks(self) -> int:
        return self.table.ram_blocks()

    def staging_bytes(self) -> int:
        return sum(b.nbytes for b in self._staging)

    def _staging_size(self) -> int:
        lay = self.layout
        return 2 * align_up(align_up(self.max_length, lay.block) // lay.block * lay.seg_bytes)

    def grow_bytes(self, tokens: int) -> int:
        """RAM the pool and this cache's buffers gain when room for `tokens` more positions is reserved (a
        swapped-out cache being read back first): blocks appended, read back or copied from shared ones, less
        those the window sends to disk, and the read buffers the pass first needs."""
        lay, B = self.layout, self.layout.block
        table = self.table
        back = table.to_read_back()
        own = table.ram_blocks() + back
        added = shared = 0  # blocks entering this sequence's RAM / copies of shared blocks kept in RAM by others
        for j in range(self.length // B, -(-(self.length + tokens) // B)):
            if j >= len(table) or not table[j].in_ram:
                added += 1
            elif table[j].shared:
                shared += 1
        spilled = max(0, own + added - self.window // B)
        extra = 0
        if not self._staging and (spilled or any(not b.in_ram for b in table)):
            extra += self._staging_size()
        return max(0, back + added + shared - spilled) * lay.ram_block_bytes + extra

    @torch.inference_mode()
    def reserve(self, tokens: int) -> None:
        """Make room for a pass of `tokens` positions: blocks appended, or made writable (read back from disk,
        copied when shared), and the oldest blocks over the window sent to the swap file."""
        if self.length + tokens > self.max_length:
            raise InputError(f"{self.length + tokens} positions exceed the context of {self.max_length} tokens")
        if tokens > self.max_pass:
            raise ValueError(f"a pass of {tokens} tokens does not fit a {self.window}-token KV window")
        self._drain()
        self.swap_in()
        B = self.layout.block
        first = self.length // B
        for j in range(first, -(-(self.length + tokens) // B)):
            if j == len(self.table):
                self.table.append_new()
            else:
                self.table.make_writable(j)
        self._fit_window()

    def _fit_window(self) -> None:
        """Send the oldest of this sequence's blocks in RAM to the swap file while more than `window` positions
        are in RAM (the pass's own blocks are the newest: `max_pass` leaves them room)."""
        if self.offloads:
            self.table.spill_oldest(self.window // self.layout.block)

    def _writable(self, end: int) -> bool:
        B = self.layout.block
        if len(self.table) * B < end:
            return False
        return all(b.in_ram and not b.shared for b in self.table[self.length // B:-(-end // B)])

    # -- writing -------------------------------------------------------------------------------------------

    def update(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor | Paged, torch.Tensor | Paged]:
        """Write this pass's k, v ([Hkv, T, Dh]) after the committed positions; return K and V of all
        S = length + T positions ([Hkv, S, Dh], compute dtype: tensors, or the blocks as `Paged`) for attention."""
        if not torch.is_inference_mode_enabled():  # (a forward pass is in it already: entering it again cost
            with torch.inference_mode():           # every layer of a decode step)
                return self.update(i, k, v)
        end = self._room_for(k.shape[1])
        lay = self.layout
        if lay.quant:
            (k, ks), (v, vs) = quantize(k, lay.group), quantize(v, lay.group)
        src = [k, v, ks, vs] if lay.quant else [k, v]
        write_positions(lambda j: list(self.table[j].layers[i][:len(src)]), src, self.length, lay.block)
        if end <= lay.block and not lay.quant:  # one block: read in place
            bk, bv = self.table[0].layers[i][:2]
            return bk[:, :end], bv[:, :end]
        return self._read(i, end)

    def room(self, i: int, T: int) -> tuple[Paged, Paged] | None:
        """Layer i's K and V as attention reads them (`Paged` over length + T positions) with this pass's T
        positions made writable in RAM, for the caller to write as rows length .. length + T - 1 of the blocks
        (`ops.rope_attend`); None for q8 blocks, whose rows `update` quantizes."""
        if self.layout.quant:
            return None
        if not torch.is_inference_mode_enabled():  # (see update)
            with torch.inference_mode():
                return self.room(i, T)
        return self._read(i, self._room_for(T))

    def rooms(self, T: int) -> list[tuple[Paged, Paged]] | None:
        """`room` of every layer at once, for a pass that runs all its layers in one call; None for q8 blocks and
        where a visible block is in the swap file (read back into a staging buffer that holds two layers' at a
        time)."""
        if self.layout.quant:
            return None
        if not torch.is_inference_mode_enabled():  # (see update)
            with torch.inference_mode():
                return self.rooms(T)
        end = self._room_for(T)
        if not all(b.in_ram for b in self.table[:-(-end // self.layout.block)]):
            return None
        return [self._read(i, end) for i in range(self.layout.num_layers)]

    def _room_for(self, T: int) -> int:
        """The end of a pass of T positions (length + T), its positions made writable (reserved here for callers
        that skip reserve(): a bare forward)."""
        end = self.length + T
        if not self._writable(end):
            self.reserve(T)
        return end

    def advance(self, n: int, ids=None) -> None:
        if ids is not None:
            self.ids.extend(int(t) for t in ids)
        self.length += n

    # -- attention input -----------------------------------------------------------------------------------

    def _first_block(self, i: int) -> int:
        """The first block layer i's queries of this pass can see."""
        w = self.layer_windows[i]
        return 0 if w is None else max(0, self.length - w + 1) // self.layout.block  # first query at `length`

    def _disk_blocks(self, i: int) -> list[int]:
        return [j for j in range(self._first_block(i), len(self.table)) if not self.table[j].in_ram]

    def _submit(self, i: int, priority: int) -> None:
        js = self._disk_blocks(i)
        if not js:
            return
        if not self._staging:
            self._staging = [AlignedBuffer(self._staging_size() // 2) for _ in range(2)]
        buf = i % 2
        futures = self.swap.read_layer([self.table[j].slot for j in js], i, self._staging[buf], priority)
        self._pending[i] = (js, futures, buf)

    def _drain(self) -> None:
        """Wait out reads still in flight (a failed pass leaves some): their buffers are about to be reused."""
        for _, futures, _ in self._pending.values():
            for f in futures:
                try:
                    f.result()
                except Exception:  # noqa: BLE001 - already reported by the pass that failed
                    pass
        self._pending.clear()

    def _read(self, i: int, end: int) -> tuple[torch.Tensor | Paged, torch.Tensor | Paged]:
        """K and V of layer i's `end` positions for attention. Its visible blocks in the swap file are read back
        first (into a staging buffer, with the next layer's reads put in flight); then the blocks go to attention
        where they are, in RAM or staged (`Paged`: no copy of the context per layer and step; q8 codes with their
        scales, dequantized where attention reads them). Blocks before a sliding window are never read: the first
        visible block stands in for them."""
        lay = self.layout
        B = lay.block
        first, nb = self._first_block(i), -(-end // B)
        staged = self._read_back(i) if any(not self.table[j].in_ram for j in range(first, nb)) else {}
        segs = [staged[j] if j in staged else self.table[j].layers[i] for j in range(first, nb)]
        segs = [segs[0]] * first + segs
        if not lay.quant:
            return Paged([s[0] for s in segs], end), Paged([s[1] for s in segs], end)
        return (Paged([s[0] for s in segs], end, [s[2] for s in segs], lay.dtype),
                Paged([s[1] for s in segs], end, [s[3] for s in segs], lay.dtype))

    def _read_back(self, i: int) -> dict[int, tuple]:
        """Layer i's visible blocks in the swap file, read into a staging buffer: {block: (k, v, k_scales,
        v_scales)} views there, valid until the reads of layer i + 2 (the buffers alternate by layer)."""
        lay = self.layout
        pend = self._pending.pop(i, None)
        if pend is None or pend[0] != self._disk_blocks(i):
            if pend is not None:
                for f in pend[1]:
                    f.result()
            self._submit(i, DEMAND)
            pend = self._pending.pop(i)
        if i + 1 < lay.num_layers and i + 1 not in self._pending:
            self._submit(i + 1, PREFETCH)
        js, futures, buf = pend
        self.swap.wait(futures)
        raw = self._staging[buf].tensor(0, len(js) * lay.seg_bytes)
        k, v, ks, vs = lay.views(raw, len(js))
        return {j: (k[n], v[n], None if ks is None else ks[n], None if vs is None else vs[n]) for n, j in enumerate(js)}

    # -- blocks in and out ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_block(self, b: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The padded bytes of block b (uint8 [block_bytes]), from RAM or the swap file."""
        out = torch.empty(self.layout.block_bytes, dtype=torch.uint8) if out is None else out
        return self.pool.read(self.table[b], out)

    @torch.inference_mode()
    def append_block(self, block: torch.Tensor, ids: list[int]) -> None:
        """Append a block's padded bytes (a saved session) at the block-aligned end; `ids` are its tokens (fewer
        than a block for a sequence's last one)."""
        B = self.layout.block
        if self.length % B:
            raise ValueError("blocks are appended at block boundaries only")
        self.reserve(B if self.length + B <= self.max_length else len(ids))
        self.layout.unpad(block, self.table[self.length // B].data)
        self.advance(len(ids), ids)

    @torch.inference_mode()
    def share(self, blocks: list[Block], ids: list[int]) -> None:
        """Append full blocks others hold (a cached prefix of `ids`' tokens) by reference: nothing is copied;
        blocks on disk come back into RAM, within the window."""
        B = self.layout.block
        if self.length % B or len(ids) != len(blocks) * B or self.length + len(ids) > self.max_length:
            raise ValueError("shared blocks are whole blocks appended at a block boundary within the context")
        self.table.append_shared(blocks)
        self.advance(len(ids), ids)
        self.table.load_last(min(len(blocks), self.window // B))
        self._fit_window()

    @torch.inference_mode()
    def truncate(self, length: int) -> None:
        """Drop positions >= length (a reused prefix, rejected speculative tokens); the blocks past it go back to
        the pool."""
        length = max(0, min(self.length, length))
        self._drain()
        self.table.truncate(-(-length // self.layout.block))
        if self._on_truncate is not None:
            self._on_truncate(self, length)
        self.length = length
        del self.ids[length:]

    def use_block(self, j: int, block: Block) -> None:
        """Hold `block` (the same positions' KV, held elsewhere) in place of block j; nothing while swapped out or
        with reads in flight (they name the blocks' slots)."""
        if not self._pending:
            self.table.replace(j, block)

    # -- preemption: the sequence out to the swap file and back, nothing recomputed -------------------------

    @property
    def swapped(self) -> bool:
        return self.table.swapped

    @torch.inference_mode()
    def swap_out(self) -> None:
        """Move the blocks only this sequence holds to the swap file and free its read buffers (blocks others
        hold stay where they are). InputError when the swap file has no room, with the cache unchanged."""
        if self.table.swapped:
            return
        self._drain()
        self.table.swap_out()
        self._staging = []

    @torch.inference_mode()
    def swap_in(self) -> None:
        """Read the blocks `swap_out` moved back into RAM and free their slots."""
        self.table.swap_in()

    def reset(self) -> None:
        self.truncate(0)

    @torch.inference_mode()
    def release(self) -> None:
        """Give this cache's blocks back to the pool and free its buffers."""
        self._drain()
        self.table.release()
        self._staging = []
        self.length, self.ids = 0, []
        if self._on_truncate is not None:
            self._on_truncate(self, 0)

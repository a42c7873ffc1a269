"""The KV block pool: fixed-size, reference-counted blocks that sequences and the prefix cache share.

A block holds `block` positions of every layer (the byte layout of `KVLayout`: per layer one segment, K then V,
then their scales; unpadded in RAM, each segment padded to 4096 bytes in the swap file) and lives in RAM or in
the swap file, the second tier, in a slot of the `SwapSlots` the pool is given. Whoever holds a block (a
sequence's block table, a node of the prefix trie) holds one reference; the last one to let go frees its RAM or
its swap slot. A block with more than one holder is never written: a sequence about to write into one (the partly
filled last block of a reused prefix) gets a copy of its own first. The pool's RAM is its blocks' bytes, each
counted once however many hold it.

Each sequence's `BlockTable` is made by the pool and changed only by this module's code, so a table's entries and
their references always agree; the sequence (colibri.kv.cache) decides what to reserve, spill or drop, its table
carries it out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from colibri.core.errors import InputError
from colibri.weights.io import AlignedBuffer, align_up
from colibri.kv.swap import SwapSlots

BLOCK = 64  # tokens per block, the most (colibri.kv.cache.block_for halves it for large blocks)
QUANTS = (None, "q8")


@dataclass(frozen=True)
class KVLayout:
    """The shape of a block's bytes (see the module docstring), the same in RAM, the swap file and saved
    sessions up to the padding."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # compute dtype: what attention reads
    block: int = BLOCK
    quant: str | None = None

    def __post_init__(self) -> None:
        if self.quant not in QUANTS:
            raise InputError(f"--kv-quant {self.quant!r} is not supported (choose q8, or leave it unset)")
        if self.block < 2 or self.block % 2:
            raise InputError(f"KV block size must be an even number of tokens >= 2 (got {self.block})")

    @property
    def group(self) -> int:
        return 32 if self.head_dim % 32 == 0 else self.head_dim

    @property
    def store_dtype(self) -> torch.dtype:
        return torch.int8 if self.quant else self.dtype

    def value_bytes(self, tokens: int) -> int:
        return self.num_kv_heads * tokens * self.head_dim * self.store_dtype.itemsize

    def scale_bytes(self, tokens: int) -> int:
        return self.num_kv_heads * tokens * (self.head_dim // self.group) * 4 if self.quant else 0

    @property
    def token_bytes(self) -> int:
        """RAM bytes of one position in every layer (K, V and their scales)."""
        return self.num_layers * 2 * (self.value_bytes(1) + self.scale_bytes(1))

    @property
    def seg_bytes(self) -> int:
        return align_up(2 * (self.value_bytes(self.block) + self.scale_bytes(self.block)))

    @property
    def block_bytes(self) -> int:
        """Bytes of a block in the swap file and in saved sessions (segments padded to 4096)."""
        return self.num_layers * self.seg_bytes

    @property
    def ram_seg_bytes(self) -> int:
        return 2 * (self.value_bytes(self.block) + self.scale_bytes(self.block))

    @property
    def ram_block_bytes(self) -> int:
        """Bytes of a block in RAM: the same segments, unpadded."""
        return self.num_layers * self.ram_seg_bytes

    def pad(self, ram: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """A block's RAM bytes -> its padded form (uint8 [block_bytes])."""
        out.view(self.num_layers, self.seg_bytes)[:, :self.ram_seg_bytes].copy_(
            ram.view(self.num_layers, self.ram_seg_bytes))
        return out

    def unpad(self, padded: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """A block's padded bytes -> its RAM form (uint8 [ram_block_bytes])."""
        out.view(self.num_layers, self.ram_seg_bytes).copy_(
            padded.view(self.num_layers, self.seg_bytes)[:, :self.ram_seg_bytes])
        return out

    def identity(self) -> dict:
        return {"layers": self.num_layers, "kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "dtype": str(self.dtype).removeprefix("torch."), "block": self.block, "kv_quant": self.quant}

    def views(self, seg: torch.Tensor, n: int = 1, stride: int | None = None):
        """(k, v, k_scales, v_scales) views of `n` consecutive segments of `stride` bytes each (uint8; default
        seg_bytes, the padded form): values [n, Hkv, block, Dh]; scales [n, Hkv, block, Dh / group] or None."""
        seg = seg.view(n, stride or self.seg_bytes)
        h, b, d = self.num_kv_heads, self.block, self.head_dim
        vb, sb = self.value_bytes(b), self.scale_bytes(b)
        k = seg[:, :vb].view(self.store_dtype).view(n, h, b, d)
        v = seg[:, vb:2 * vb].view(self.store_dtype).view(n, h, b, d)
        if not self.quant:
            return k, v, None, None
        g = d // self.group
        ks = seg[:, 2 * vb:2 * vb + sb].view(torch.float32).view(n, h, b, g)
        vs = seg[:, 2 * vb + sb:2 * vb + 2 * sb].view(torch.float32).view(n, h, b, g)
        return k, v, ks, vs


class Block:
    """One block: its bytes in RAM (`data`, uint8 [ram_block_bytes], with per-layer views) or in swap slot
    `slot`."""

    __slots__ = ("data", "layers", "slot", "refs")

    def __init__(self):
        self.data: torch.Tensor | None = None
        self.layers: list[tuple] = []  # per layer (k, v, k_scales, v_scales): [Hkv, block, Dh] views of data
        self.slot: int | None = None
        self.refs = 1

    @property
    def in_ram(self) -> bool:
        return self.data is not None

    @property
    def shared(self) -> bool:
        return self.refs > 1


class BlockTable:
    """One sequence's blocks in position order: entry j holds positions [j * block, (j + 1) * block). The table
    holds one reference to each entry. `swapped`: the sequence is preempted, and the blocks `swap_out` sent to
    the swap file (those it alone held in RAM then) are listed until `swap_in` reads them back."""

    __slots__ = ("pool", "_blocks", "_out")

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self._blocks: list[Block] = []
        self._out: list[Block] | None = None

    def __len__(self) -> int:
        return len(self._blocks)

    def __getitem__(self, j):
        return self._blocks[j]

    def __iter__(self):
        return iter(self._blocks)

    def ram_blocks(self) -> int:
        return sum(1 for b in self._blocks if b.in_ram)

    def append_new(self) -> None:
        self._blocks.append(self.pool.new())

    def append_shared(self, blocks: list[Block]) -> None:
        """Append blocks others hold, by reference."""
        for b in blocks:
            self._blocks.append(self.pool.ref(b))

    def make_writable(self, j: int) -> None:
        """Entry j in RAM and held by this table alone (`BlockPool.writable`)."""
        self._blocks[j] = self.pool.writable(self._blocks[j])

    def replace(self, j: int, block: Block) -> bool:
        """Hold `block` (the same positions' KV) in place of entry j; refused (False) while swapped out."""
        if self._out is not None:
            return False
        mine, self._blocks[j] = self._blocks[j], self.pool.ref(block)
        self.pool.unref(mine)
        return True

    def load_last(self, n: int) -> None:
        """Bring the last `n` entries into RAM."""
        for b in self._blocks[-n:] if n else ():
            self.pool.load(b)

    def spill_oldest(self, keep: int) -> None:
        """Send the oldest entries in RAM to the swap file until at most `keep` are in RAM."""
        ram = [b for b in self._blocks if b.in_ram]
        for b in ram[:max(0, len(ram) - keep)]:
            self.pool.spill(b)

    def truncate(self, keep: int) -> None:
        """Let go of the entries from `keep` on."""
        for b in self._blocks[keep:]:
            self.pool.unref(b)
        del self._blocks[keep:]
        if self._out is not None:
            self._out = [b for b in self._out if any(b is c for c in self._blocks)]

    def release(self) -> None:
        """Let go of every entry."""
        for b in self._blocks:
            self.pool.unref(b)
        self._blocks, self._out = [], None

    # -- preemption ----------------------------------------------------------------------------------------

    @property
    def swapped(self) -> bool:
        return self._out is not None

    def to_read_back(self) -> int:
        """Blocks `swap_in` would read back."""
        return 0 if self._out is None else sum(1 for b in self._out if not b.in_ram)

    def swap_out(self) -> None:
        """Send the entries only this table holds in RAM to the swap file (entries others hold stay where they
        are). On failure those already sent come back, the table unchanged, and the error propagates."""
        if self._out is not None:
            return
        out: list[Block] = []
        try:
            for b in self._blocks:
                if b.in_ram and not b.shared:
                    self.pool.spill(b)
                    out.append(b)
        except BaseException:
            for b in out:
                self.pool.load(b)
            raise
        self._out = out

    def swap_in(self) -> None:
        """Read the entries `swap_out` sent to disk back into RAM, freeing their slots."""
        if self._out is None:
            return
        for b in self._out:
            self.pool.load(b)
        self._out = None


class BlockPool:
    """The blocks of one model's KV and their swap slots. `swap` gives the slots (None: RAM only; spilling is
    refused)."""

    def __init__(self, layout: KVLayout, swap: SwapSlots | None = None):
        self.layout, self.swap = layout, swap
        self.ram_blocks = 0  # blocks whose bytes are in RAM
        self._io: AlignedBuffer | None = None  # a padded block on its way to or from the swap file

    @property
    def ram_bytes(self) -> int:
        """Its blocks in RAM and, once a block has gone to or come from the swap file, the padded block buffer
        kept for that."""
        return self.ram_blocks * self.layout.ram_block_bytes + (0 if self._io is None else self._io.nbytes)

    def _buffer(self) -> torch.Tensor:
        if self._io is None:
            self._io = AlignedBuffer(self.layout.block_bytes)
        return self._io.tensor(0, self.layout.block_bytes)

    def _attach(self, block: Block) -> None:
        """Give `block` fresh RAM (its contents undefined until written) and its per-layer views."""
        lay = self.layout
        data = torch.empty(lay.ram_block_bytes, dtype=torch.uint8)
        segs = data.view(lay.num_layers, lay.ram_seg_bytes)
        block.data = data
        block.layers = [tuple(None if t is None else t[0] for t in lay.views(segs[i], stride=lay.ram_seg_bytes))
                        for i in range(lay.num_layers)]
        self.ram_blocks += 1

    def _detach(self, block: Block) -> None:
        block.data, block.layers = None, []
        self.ram_blocks -= 1

    def table(self) -> BlockTable:
        """An empty block table for a sequence."""
        return BlockTable(self)

    @property
    def can_spill(self) -> bool:
        """Whether a spill may be tried: a swap file is open or given (a temporary one is created only when a
        block must go to disk)."""
        return self.swap is not None and self.swap.available

    def new(self) -> Block:
        block = Block()
        self._attach(block)
        return block

    @staticmethod
    def ref(block: Block) -> Block:
        block.refs += 1
        return block

    def unref(self, block: Block) -> None:
        block.refs -= 1
        if block.refs > 0:
            return
        if block.data is not None:
            self._detach(block)
        if block.slot is not None:
            self.swap.free(block.slot)
            block.slot = None

    # -- the two tiers -----------------------------------------------------------------------------------

    def _swap(self) -> SwapSlots:
        if self.swap is None:
            raise InputError("the KV cache needs more than its RAM share and has no swap file; give --swap or a "
                             "larger --kv-ram")
        return self.swap

    def spill(self, block: Block) -> None:
        """Move a block's bytes to the swap file (for every holder). The slot comes from `swap`, which may drop
        cached prefixes on disk to find one; InputError when the file is full, the block unchanged."""
        if block.data is None:
            return
        swap = self._swap()
        slot = swap.alloc()
        try:
            swap.write(slot, self.layout.pad(block.data, self._buffer()))
        except BaseException:
            swap.free(slot)  # the block stays in RAM; the slot is not leaked
            raise
        block.slot = slot
        self._detach(block)

    def read(self, block: Block, out: torch.Tensor) -> torch.Tensor:
        """A block's padded bytes, wherever they are, into `out` (uint8 [block_bytes])."""
        if block.data is not None:
            return self.layout.pad(block.data, out)
        return out.copy_(self._read_slot(block.slot))

    def _read_slot(self, slot: int) -> torch.Tensor:
        """The padded bytes of a block on disk (in the pool's I/O buffer, valid until its next use)."""
        self._buffer()
        for f in self.swap.read_block(slot, self._io):
            f.result()
        return self._io.tensor(0, self.layout.block_bytes)

    def _fill(self, dst: Block, src: Block) -> None:
        """dst's RAM <- src's bytes, wherever they are."""
        if src.data is not None:
            dst.data.copy_(src.data)
        else:
            self.layout.unpad(self._read_slot(src.slot), dst.data)

    def load(self, block: Block) -> None:
        """Bring a block on disk back into RAM (for every holder) and free its slot."""
        if block.data is not None:
            return
        slot = block.slot
        self._attach(block)
        try:
            self.layout.unpad(self._read_slot(slot), block.data)
        except BaseException:
            self._detach(block)
            raise
        block.slot = None
        self.swap.free(slot)

    def writable(self, block: Block) -> Block:
        """`block` made safe to write by one holder: brought into RAM, or copied when others hold it too (the
        caller's reference moves to the copy)."""
        if block.shared:
            copy = self.new()
            try:
                self._fill(copy, block)
            except BaseException:
                self.unref(copy)
                raise
            self.unref(block)
            return copy
        self.load(block)
        return block


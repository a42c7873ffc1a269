"""The KV block pool: fixed-size, reference-counted blocks that sequences and the prefix cache share.

A block holds `block` positions of every layer (the byte layout of `KVLayout`: per layer one segment, K then V,
then their scales; unpadded in RAM, each segment padded to 4096 bytes in the swap file) and lives in RAM or in
the swap file, the second tier. Whoever holds a block (a sequence's
block table, a node of the prefix trie) holds one reference; the last one to let go frees its RAM or its swap
slot. A block with more than one holder is never written: a sequence about to write into one (the partly filled
last block of a reused prefix) gets a copy of its own first. The pool's RAM is its blocks' bytes, each counted
once however many hold it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from colibri.errors import InputError
from colibri.io import AlignedBuffer

if TYPE_CHECKING:
    from colibri.kv import KVLayout
    from colibri.kvspace import KVSpace


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


class BlockPool:
    """The blocks of one model's KV. `space` provides the swap file (None: RAM only; spilling is refused)."""

    def __init__(self, layout: "KVLayout", space: "KVSpace | None" = None):
        self.layout, self.space = layout, space
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
            self.space.free_slot(block.slot)
            block.slot = None

    # -- the two tiers -----------------------------------------------------------------------------------

    def _swap(self):
        if self.space is None:
            raise InputError("the KV cache needs more than its RAM share and has no swap file; give --swap or a "
                             "larger --kv-ram")
        return self.space

    def spill(self, block: Block) -> None:
        """Move a block's bytes to the swap file (for every holder). The slot comes from the space, which may
        drop cached prefixes on disk to find one; InputError when the file is full, the block unchanged."""
        if block.data is None:
            return
        space = self._swap()
        slot = space.alloc_slot()
        try:
            space.swap.write(slot, self.layout.pad(block.data, self._buffer()))
        except BaseException:
            space.free_slot(slot)  # the block stays in RAM; the slot is not leaked
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
        for f in self.space.swap.read_block(slot, self._io):
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
        self.space.free_slot(slot)

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


"""A model's KV memory: one block pool shared by every sequence and the prefix cache, and the swap file.

`KVSpace` builds the parts, each given the ones it uses, and hands each sequence its cache: `SwapSlots` owns the
swap file (colibri.kv.swap); the pool owns the blocks, their swap slots and the sequences' block tables
(colibri.kv.pool); a cache owns its positions, token ids, read buffers and reads in flight (colibri.kv.cache); the
trie owns its nodes, a cursor per sequence and the prefix cache's RAM share (colibri.kv.prefix). The space itself
keeps the live sequence.

Every KV block (colibri.kv.pool) belongs to the one pool; sequences and the prefix cache hold references to them.
The prefix cache is a trie whose nodes are full blocks of `block` token ids: after each pass a sequence's newly
filled blocks are inserted (a reference, not a copy), so a request that starts with a known prefix holds those
very blocks and computes only the rest. A block only the trie still holds counts against the prefix cache's RAM
share (`prefix_ram`); beyond it the least recently used go to the swap file (when one is open) and are dropped
when that is full. The live sequence (the last request's cache, kept after it ends) serves the common case of a
chat at any token boundary: the next turn's prompt starts with everything the last one computed.
"""

from __future__ import annotations

import os
import weakref

from colibri.kv.cache import KVCache
from colibri.kv.pool import BlockPool, KVLayout
from colibri.kv.prefix import Node, PrefixTrie, common_prefix
from colibri.kv.swap import SwapFile, SwapSlots


class KVSpace:
    """KV memory of one model; see the module docstring.

    window: positions of a sequence kept in RAM (None: all of the context). prefix_ram: RAM bytes for blocks
    only the prefix cache holds. swap_path: a file made by `colibri swap create` (None: a temporary one in
    `swap_dir`, created the first time a block goes to disk and deleted on close; `swap_fallback`: where it goes
    if `swap_dir` cannot be made or written, None: that is an error).
    """

    def __init__(self, layout: KVLayout, ctx: int, window: int | None, prefix_ram: int,
                 swap_path: str | os.PathLike | None = None, swap_dir: str | os.PathLike | None = None,
                 layer_windows: list[int | None] | None = None, io_threads: int = 2, sequences: int = 1,
                 swap_fallback: str | os.PathLike | None = None):
        self.layout, self.ctx, self.window = layout, ctx, window
        self.sequences = max(1, int(sequences))  # sequences that may hold KV at once (sizes a temporary swap)
        self._caches: weakref.WeakSet[KVCache] = weakref.WeakSet()
        self.layer_windows = layer_windows
        # a temporary swap file holds each sequence's context (all of it, when preempted), and as much again for
        # the prefix cache
        temporary = (self.sequences + 1) * -(-ctx // layout.block) * layout.block_bytes
        # a full swap file takes a slot from the prefix cache's blocks on disk
        self.slots = SwapSlots(layout.num_layers, layout.seg_bytes, layout.block, swap_path, swap_dir, temporary,
                               io_threads, make_room=lambda: self.trie.evict(disk=True), fallback=swap_fallback)
        self.pool = BlockPool(layout, self.slots)
        self.trie = PrefixTrie(self.pool, layout.block, prefix_ram)
        if swap_path is not None:
            _ = self.swap  # opened and locked at load: a bad or busy file is refused before any work
        self.live: KVCache | None = None
        self.live_busy = False

    # -- the swap file -------------------------------------------------------------------------------------

    @property
    def swap(self) -> SwapFile:
        """The swap file, opened (a temporary one created) on first use."""
        return self.slots.file

    # -- sequences -----------------------------------------------------------------------------------------

    def new_cache(self) -> KVCache:
        cache = KVCache(self.layout, self.ctx, self.window, self.layer_windows, self.pool, self.trie.rewind)
        self._caches.add(cache)
        return cache

    def _reuse(self, ids: list[int]) -> tuple[list[Node], int]:
        """The trie's nodes of the longest cached prefix of `ids` (at most len(ids) - 1 tokens: the last one is
        computed for its logits), and how many tokens the idle live sequence would reuse instead (0: none)."""
        B, most = self.layout.block, len(ids) - 1
        nodes = self.trie.match(ids)[: most // B]
        live = self.live
        if self.live_busy or live is None:
            return nodes, 0
        from_live = min(common_prefix(live.ids, ids), most)
        return nodes, from_live if from_live >= len(nodes) * B and from_live > 0 else 0

    def acquire_bytes(self, ids: list[int]) -> int:
        """RAM `acquire(ids)` adds: the cached prefix's blocks it reads back from the swap file (within the
        window); blocks in RAM are shared, not copied. Nothing is allocated to find out."""
        nodes, from_live = self._reuse(ids)
        if from_live:
            return 0
        keep = (self.window or self.ctx) // self.layout.block
        return sum(self.layout.ram_block_bytes for n in nodes[-keep:] if not n.block.in_ram) if keep else 0

    def ram_bytes(self) -> int:
        """RAM of the KV pool (each block once however many hold it) and the sequences' read buffers."""
        return self.pool.ram_bytes + sum(c.staging_bytes() for c in list(self._caches))

    @property
    def prefix_ram(self) -> int:
        """RAM bytes for blocks only the prefix cache holds (the trie's share)."""
        return self.trie.ram_share

    def prefix_bytes(self) -> int:
        """RAM of the blocks only the prefix cache holds."""
        return self.trie.ram_bytes()

    def prefix_room(self) -> int:
        """RAM the prefix cache may still take (its share less what it holds)."""
        return self.trie.room()

    def drop_live(self) -> int:
        """Let go of the idle live sequence (its full blocks stay in the prefix cache, within its share); bytes
        freed."""
        live = self.live
        if live is None or self.live_busy:
            return 0
        before = self.ram_bytes()
        self.commit(live)
        live.release()
        self._caches.discard(live)
        self.live = None
        self.trie.shrink()
        return max(0, before - self.ram_bytes())

    def acquire(self, ids: list[int]) -> tuple[KVCache, int]:
        """A cache holding the longest known prefix of `ids` (at most len(ids) - 1 tokens: the last one is
        computed for its logits), and that prefix's length."""
        nodes, from_live = self._reuse(ids)
        if from_live:
            self.live_busy = True
            self.live.truncate(from_live)
            return self.live, from_live
        if self.live_busy:  # a generation still holds the live sequence: this one gets its own
            cache = self.new_cache()
        else:
            self.live_busy = True
            if self.live is None:
                self.live = self.new_cache()
            else:
                self.commit(self.live)
                self.live.reset()
            cache = self.live
        self.trie.reused(cache, nodes)
        cache.share([n.block for n in nodes], [t for n in nodes for t in n.key])
        return cache, cache.length

    def release(self, cache: KVCache) -> None:
        """A generation ended: the live sequence stays for the next one; another cache's blocks go to the prefix
        cache (the trie's references) and the pool."""
        self.commit(cache)
        if cache is self.live:
            self.live_busy = False
        else:
            cache.release()
            self._caches.discard(cache)
        self.trie.shrink()

    def adopt(self, cache: KVCache) -> None:
        """Make `cache` (a restored session) the live sequence, committing the previous one."""
        if self.live is not None and self.live is not cache:
            self.commit(self.live)
            self.live.release()
            self._caches.discard(self.live)
        self.live, self.live_busy = cache, False
        self._caches.add(cache)
        self.trie.shrink()

    # -- the prefix cache ----------------------------------------------------------------------------------

    def commit(self, cache: KVCache) -> None:
        """The cache's full blocks not in the prefix trie yet go in, by reference (`PrefixTrie.commit`)."""
        self.trie.commit(cache)

    def clear(self) -> None:
        """Forget the live sequence and every cached prefix (the next prompt is computed from scratch)."""
        if self.live is not None and not self.live_busy:
            self.live.release()
            self._caches.discard(self.live)
            self.live = None
        self.trie.clear()

    # -- stats and shutdown --------------------------------------------------------------------------------

    def counters(self) -> dict:
        sw = self.slots.opened
        return {
            "kv_ram_bytes": self.ram_bytes(),
            "kv_disk_bytes": sw.used * self.layout.block_bytes if sw else 0,
            "kv_read_bytes": sw.bytes_read if sw else 0,
            "kv_written_bytes": sw.bytes_written if sw else 0,
            "kv_read_wait_s": self.slots.read_wait_s,
            "prefix_cache_blocks": self.trie.count,
            "kv_pool_blocks": self.pool.ram_blocks,
        }

    def close(self) -> None:
        self.slots.close()

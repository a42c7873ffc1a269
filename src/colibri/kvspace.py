"""A model's KV memory: one block pool shared by every sequence and the prefix cache, and the swap file.

Every KV block (colibri.kvpool) belongs to the one pool; sequences and the prefix cache hold references to them.
The prefix cache is a trie whose nodes are full blocks of `block` token ids: after each pass a sequence's newly
filled blocks are inserted (a reference, not a copy), so a request that starts with a known prefix holds those
very blocks and computes only the rest. A block only the trie still holds counts against the prefix cache's RAM
share (`prefix_ram`); beyond it the least recently used go to the swap file (when one is open) and are dropped
when that is full. The live sequence (the last request's cache, kept after it ends) serves the common case of a
chat at any token boundary: the next turn's prompt starts with everything the last one computed.
"""

from __future__ import annotations

import itertools
import os
import weakref
from pathlib import Path

from colibri.errors import InputError, StorageError
from colibri.kv import KVCache, KVLayout, Workspace
from colibri.kvpool import BlockPool
from colibri.prefix import Node, common_prefix
from colibri.swap import SwapFile


class KVSpace:
    """KV memory of one model; see the module docstring.

    window: positions of a sequence kept in RAM (None: all of the context). prefix_ram: RAM bytes for blocks
    only the prefix cache holds. swap_path: a file made by `colibri swap create` (None: a temporary one in
    `swap_dir`, created the first time a block goes to disk and deleted on close).
    """

    def __init__(self, layout: KVLayout, ctx: int, window: int | None, prefix_ram: int,
                 swap_path: str | os.PathLike | None = None, swap_dir: str | os.PathLike | None = None,
                 layer_windows: list[int | None] | None = None, io_threads: int = 2, sequences: int = 1):
        self.layout, self.ctx, self.window = layout, ctx, window
        self.sequences = max(1, int(sequences))  # sequences that may hold KV at once (sizes a temporary swap)
        self._caches: weakref.WeakSet[KVCache] = weakref.WeakSet()
        self.prefix_ram = max(0, int(prefix_ram))
        self.swap_path = None if swap_path is None else Path(swap_path)
        self.swap_dir = Path(swap_dir) if swap_dir is not None else None
        self.layer_windows = layer_windows
        self.io_threads = io_threads
        self.pool = BlockPool(layout, self)
        self.work = Workspace(layout, ctx)
        self._swap: SwapFile | None = None
        if self.swap_path is not None:
            _ = self.swap  # opened and locked at load: a bad or busy file is refused before any work
        self.root = Node((), None)
        self.generation = 0  # bumped when the trie is cleared: caches re-walk it
        self._clock = itertools.count(1)
        self.live: KVCache | None = None
        self.live_busy = False
        self.read_wait_s = 0.0
        self._count = 0  # trie nodes
        self.prefix_hit_tokens = 0
        self.prefill_tokens = 0

    # -- the swap file -------------------------------------------------------------------------------------

    @property
    def swap(self) -> SwapFile:
        if self._swap is None:
            lay = self.layout
            if self.swap_path is not None:
                self._swap = SwapFile(self.swap_path, lay.num_layers, lay.seg_bytes, self.io_threads)
            else:
                if self.swap_dir is None:
                    raise InputError("the KV cache outgrew its RAM share and no swap directory is set; give --swap")
                # each sequence's context (all of it, when preempted), and as much again for the prefix cache
                blocks = (self.sequences + 1) * -(-self.ctx // lay.block)
                self._swap = SwapFile.temporary_in(self.swap_dir, blocks * lay.block_bytes, lay.num_layers,
                                                   lay.seg_bytes, self.io_threads)
        return self._swap

    @property
    def swap_open(self) -> bool:
        return self._swap is not None or self.swap_path is not None

    def alloc_slot(self) -> int:
        while True:
            s = self.swap.alloc()
            if s is not None:
                return s
            if not self._evict(disk=True):
                raise InputError(f"the KV swap file {self.swap.path} is full ({self.swap.slots} blocks of "
                                 f"{self.layout.block} tokens); give a larger one (colibri swap create --size)")

    def free_slot(self, slot: int) -> None:
        self.swap.free(slot)

    def promote(self, future) -> None:
        self.swap.reader.promote(future)

    # -- sequences -----------------------------------------------------------------------------------------

    def new_cache(self) -> KVCache:
        cache = KVCache(self.layout, self.ctx, self.window, self, self.layer_windows)
        self._caches.add(cache)
        return cache

    def _reuse(self, ids: list[int]) -> tuple[list[Node], int]:
        """The trie's nodes of the longest cached prefix of `ids` (at most len(ids) - 1 tokens: the last one is
        computed for its logits), and how many tokens the idle live sequence would reuse instead (0: none)."""
        B, most = self.layout.block, len(ids) - 1
        nodes = self._match(ids)[: most // B]
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
        """RAM of the KV pool (each block once however many hold it), the shared workspace and the sequences'
        read buffers."""
        return self.pool.ram_bytes + self.work.nbytes + sum(c.staging_bytes() for c in list(self._caches))

    def prefix_bytes(self) -> int:
        """RAM of the blocks only the prefix cache holds."""
        return sum(self.layout.ram_block_bytes for n in self._nodes() if n.block.in_ram and n.block.refs == 1)

    def prefix_room(self) -> int:
        """RAM the prefix cache may still take (its share less what it holds)."""
        return max(0, self.prefix_ram - self.prefix_bytes())

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
        self._shrink()
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
        for n in nodes:
            n.stamp = next(self._clock)
        cache.share([n.block for n in nodes], [t for n in nodes for t in n.key])
        if nodes:
            cache.committed, cache.node, cache.trie_gen = len(nodes), nodes[-1], self.generation
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
        self._shrink()

    def adopt(self, cache: KVCache) -> None:
        """Make `cache` (a restored session) the live sequence, committing the previous one."""
        if self.live is not None and self.live is not cache:
            self.commit(self.live)
            self.live.release()
            self._caches.discard(self.live)
        self.live, self.live_busy = cache, False
        self._caches.add(cache)
        self._shrink()

    # -- the prefix trie -----------------------------------------------------------------------------------

    def _match(self, ids: list[int]) -> list[Node]:
        B, node, out = self.layout.block, self.root, []
        for b in range(len(ids) // B):
            node = node.children.get(tuple(ids[b * B:(b + 1) * B]))
            if node is None:
                break
            out.append(node)
        return out

    def commit(self, cache: KVCache) -> None:
        """Insert the cache's full blocks not in the trie yet, by reference. A block the trie already holds for
        the same tokens (computed twice, by sequences that ran at once) replaces the cache's own copy."""
        if cache.trie_gen != self.generation or cache.node is None:
            cache.committed, cache.node, cache.trie_gen = 0, self.root, self.generation
        B, node = self.layout.block, cache.node
        for b in range(cache.committed, cache.length // B):
            key = tuple(cache.ids[b * B:(b + 1) * B])
            mine = cache.blocks[b]
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = Node(key, node, self.pool.ref(mine))
                self._count += 1
            elif child.block is not mine and not cache.swapped and not cache._pending and \
                    (child.block.in_ram or not mine.in_ram):
                cache.blocks[b] = self.pool.ref(child.block)
                self.pool.unref(mine)
            child.stamp = next(self._clock)
            node = child
        cache.committed, cache.node = max(cache.committed, cache.length // B), node

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _shrink(self) -> None:
        """Keep the blocks only the trie holds within the prefix cache's RAM share."""
        while self.prefix_bytes() > self.prefix_ram and self._evict(disk=False):
            pass

    def _drop(self, n: Node) -> None:
        del n.parent.children[n.key]
        self.pool.unref(n.block)
        self._count -= 1

    def _evict(self, disk: bool) -> bool:
        """disk=False: the least recently used block only the trie holds in RAM goes to the swap file (when one
        is open and has room), else its node is dropped (a leaf). disk=True: the least recently used leaf whose
        block only the trie holds on disk is dropped, freeing its slot. False when there is none."""
        def mine(n: Node) -> bool:
            return n.block.refs == 1 and n.block.in_ram != disk
        if not disk and self.swap_open:
            held = [n for n in self._nodes() if mine(n)]
            if held:
                try:
                    self.pool.spill(min(held, key=lambda x: x.stamp).block)
                    return True
                except (InputError, StorageError):  # caching only saves work: a full disk costs that saving
                    pass
        leaves = [n for n in self._nodes() if not n.children and mine(n)]
        if not leaves:
            return False
        self._drop(min(leaves, key=lambda x: x.stamp))
        return True

    def clear(self) -> None:
        """Forget the live sequence and every cached prefix (the next prompt is computed from scratch)."""
        if self.live is not None and not self.live_busy:
            self.live.release()
            self._caches.discard(self.live)
            self.live = None
        for n in self._nodes():
            self.pool.unref(n.block)
        self.root, self._count = Node((), None), 0
        self.generation += 1

    # -- stats and shutdown --------------------------------------------------------------------------------

    def counters(self) -> dict:
        sw = self._swap
        return {
            "kv_ram_bytes": self.ram_bytes(),
            "kv_disk_bytes": sw.used * self.layout.block_bytes if sw else 0,
            "kv_read_bytes": sw.bytes_read if sw else 0,
            "kv_written_bytes": sw.bytes_written if sw else 0,
            "kv_read_wait_s": self.read_wait_s,
            "prefix_cache_blocks": self._count,
            "kv_pool_blocks": self.pool.ram_blocks,
        }

    def close(self) -> None:
        if self._swap is not None:
            self._swap.close()
            self._swap = None

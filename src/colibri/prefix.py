"""A model's KV memory: the live sequence, the prefix cache (a radix tree of token blocks) and the swap file.

Reuse comes from two places. The live sequence (the last request's cache, kept after it ends) serves the common
case of a chat: the next turn's prompt starts with everything the last one computed, so only the new tokens are
prefilled, at any token boundary. The prefix cache serves other sequences: a trie whose nodes are full blocks of
`block` token ids maps a token prefix to the blocks' KV bytes, held in RAM (up to `prefix_ram` bytes) or in the
swap file. When the live sequence is replaced, or cut back by more than a block, its full blocks are committed to
the trie first (copy-on-write: blocks already on disk are shared by reference, not copied). Least recently used
leaves leave RAM for the swap file (when one is open) and are dropped when that is full.
"""

from __future__ import annotations

import itertools
import os
import weakref
from pathlib import Path

import torch

from colibri.errors import InputError, StorageError
from colibri.io import AlignedBuffer
from colibri.kv import KVCache, KVLayout
from colibri.swap import SwapFile

COMMIT_MIN_BLOCKS = 2  # a live sequence cut back by fewer full blocks is not copied to the trie (a re-tokenized
# tail of the last reply, not a branch worth keeping)


class Node:
    __slots__ = ("key", "parent", "children", "data", "slot", "stamp")

    def __init__(self, key: tuple[int, ...], parent: "Node | None"):
        self.key, self.parent = key, parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.data: torch.Tensor | None = None  # the block's bytes in RAM
        self.slot: int | None = None  # or its swap slot
        self.stamp = 0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class KVSpace:
    """KV memory of one model; see the module docstring.

    window: positions of the live sequence kept in RAM (None: all of the context). prefix_ram: RAM bytes for the
    prefix cache. swap_path: a file made by `colibri swap create` (None: a temporary one in `swap_dir`, created
    the first time a sequence outgrows its window and deleted on close).
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
        self._swap: SwapFile | None = None
        if self.swap_path is not None:
            _ = self.swap  # opened and locked at load: a bad or busy file is refused before any work
        self.root = Node((), None)
        self._clock = itertools.count(1)
        self.live: KVCache | None = None
        self.live_busy = False
        self.read_wait_s = 0.0
        self._ram = 0  # bytes of trie blocks held in RAM
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
        # RAM grows from one block: many short sequences share the pool
        cache = KVCache(self.layout, self.ctx, self.window, self, self.layer_windows, initial=self.layout.block)
        self._caches.add(cache)
        return cache

    def acquire_bytes(self, ids: list[int]) -> int:
        """RAM `acquire(ids)` adds: none when it reuses the live sequence, else a fresh cache holding the known
        prefix (found the same way; nothing is allocated to find out)."""
        B = self.layout.block
        most = len(ids) - 1
        from_trie = len(self._match(ids)[: most // B]) * B
        live = self.live
        if not self.live_busy and live is not None:
            from_live = min(common_prefix(live.ids, ids), most)
            if from_live >= from_trie and from_live > 0:
                return 0
        fresh = KVCache(self.layout, self.ctx, self.window, self, self.layer_windows, initial=B)
        return fresh.ram_after(from_trie)

    def ram_bytes(self) -> int:
        """RAM held by every sequence's cache and by the prefix cache's RAM blocks."""
        return sum(c.ram_bytes() for c in list(self._caches)) + self._ram

    def prefix_room(self) -> int:
        """RAM the prefix cache may still take (its share less what it holds)."""
        return max(0, self.prefix_ram - self._ram)

    def drop_live(self) -> int:
        """Free the idle live sequence's RAM (its full blocks go to the prefix cache first); bytes freed."""
        live = self.live
        if live is None or self.live_busy:
            return 0
        freed = live.ram_bytes()
        self.commit(live)
        live.release()
        self._caches.discard(live)
        self.live = None
        return freed

    def acquire(self, ids: list[int]) -> tuple[KVCache, int]:
        """A cache holding the longest known prefix of `ids` (at most len(ids) - 1 tokens: the last one is
        computed for its logits), and that prefix's length."""
        most = len(ids) - 1
        nodes = self._match(ids)[: most // self.layout.block]
        from_trie = len(nodes) * self.layout.block
        if self.live_busy:  # a generation still holds the live sequence: this one gets its own
            cache = self.new_cache()
            return cache, self._load(cache, nodes)
        live = self.live
        from_live = min(common_prefix(live.ids, ids), most) if live is not None else 0
        self.live_busy = True
        if live is not None and from_live >= from_trie and from_live > 0:
            if live.length // self.layout.block - from_live // self.layout.block >= COMMIT_MIN_BLOCKS:
                self.commit(live)
            live.truncate(from_live)
            return live, from_live
        if live is None:
            self.live = live = self.new_cache()
        else:
            self.commit(live)
            live.reset()
        return live, self._load(live, nodes)

    def release(self, cache: KVCache) -> None:
        """A generation ended: the live sequence stays for the next one; another cache is committed and freed."""
        if cache is self.live:
            self.live_busy = False
            return
        self.commit(cache)
        cache.release()
        self._caches.discard(cache)

    def adopt(self, cache: KVCache) -> None:
        """Make `cache` (a restored session) the live sequence, committing the previous one."""
        if self.live is not None and self.live is not cache:
            self.commit(self.live)
            self.live.release()
            self._caches.discard(self.live)
        self.live, self.live_busy = cache, False
        self._caches.add(cache)

    # -- the prefix trie -----------------------------------------------------------------------------------

    def _match(self, ids: list[int]) -> list[Node]:
        B, node, out = self.layout.block, self.root, []
        for b in range(len(ids) // B):
            node = node.children.get(tuple(ids[b * B:(b + 1) * B]))
            if node is None:
                break
            out.append(node)
        return out

    def _block_of(self, node: Node) -> torch.Tensor:
        if node.data is not None:
            return node.data
        buf = AlignedBuffer(self.layout.block_bytes)
        for f in self.swap.read_block(node.slot, buf):
            f.result()
        return buf.tensor(0, self.layout.block_bytes)

    def _load(self, cache: KVCache, nodes: list[Node]) -> int:
        for node in nodes:
            node.stamp = next(self._clock)
            cache.append_block(self._block_of(node), list(node.key))
        return cache.length

    def commit(self, cache: KVCache) -> None:
        """Insert the cache's full blocks into the trie (those not there yet), within the prefix cache's room."""
        B, node = self.layout.block, self.root
        for b in range(cache.length // B):
            key = tuple(cache.ids[b * B:(b + 1) * B])
            child = node.children.get(key)
            if child is None:
                child = Node(key, node)
                if b < len(cache.slots):  # on disk already: share the slot
                    self.swap.ref(cache.slots[b])
                    child.slot = cache.slots[b]
                elif not self._store(child, lambda: cache.encode_block(b)):
                    return  # no room (or the swap write failed): the rest of the prefix stays uncached
                node.children[key] = child
                self._count += 1
            child.stamp = next(self._clock)
            node = child

    def _ram_bytes(self) -> int:
        return self._ram

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _store(self, node: Node, encode) -> bool:
        """Give a new node its bytes: in RAM if the prefix cache has room (after evicting), else in the swap."""
        need = self.layout.block_bytes
        while self.prefix_ram and self._ram_bytes() + need > self.prefix_ram:
            if not self._evict(disk=False):
                break
        if self._ram_bytes() + need <= self.prefix_ram:
            node.data = encode().clone()
            self._ram += node.data.numel()
            return True
        if self.swap_open:
            s = self._write_to_swap(encode())
            if s is None:
                return False
            node.slot = s
            return True
        return False

    def _write_to_swap(self, block: torch.Tensor) -> int | None:
        """A new swap slot holding `block`, or None when the swap file is full or the write fails: caching a
        prefix only saves work, so a full disk (ENOSPC) costs that saving, never the request that triggered it."""
        s = self.swap.alloc()
        if s is None:
            return None
        try:
            self.swap.write(s, block)
        except StorageError:
            self.swap.free(s)
            return None
        return s

    def _evict(self, disk: bool) -> bool:
        """Free the least recently used leaf held in RAM (disk=False: moved to the swap file when there is
        room, else dropped) or on disk (disk=True: dropped). False when there is none."""
        leaves = [n for n in self._nodes() if not n.children and ((n.slot is not None) if disk else
                                                                   (n.data is not None))]
        if not leaves:
            return False
        n = min(leaves, key=lambda x: x.stamp)
        if not disk and self.swap_open:
            s = self._write_to_swap(n.data)
            if s is not None:
                self._ram -= n.data.numel()
                n.slot, n.data = s, None
                return True
        if n.slot is not None:
            self.swap.free(n.slot)
        if n.data is not None:
            self._ram -= n.data.numel()
        del n.parent.children[n.key]
        self._count -= 1
        return True

    def clear(self) -> None:
        """Forget the live sequence and every cached prefix (the next prompt is computed from scratch)."""
        if self.live is not None and not self.live_busy:
            self.live.release()
            self._caches.discard(self.live)
            self.live = None
        for n in self._nodes():
            if n.slot is not None:
                self.swap.free(n.slot)
        self.root, self._ram, self._count = Node((), None), 0, 0

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
        }

    def close(self) -> None:
        if self._swap is not None:
            self._swap.close()
            self._swap = None

"""The prefix trie: cached prompt prefixes as a trie of full KV blocks, so a request that starts with a known prefix
reuses those very blocks.

Each node below the root is one full block of `block` token ids and holds one reference to that block's KV
(colibri.kv.pool); a node's path from the root is the prefix the block ends. Nodes carry a use stamp for
least-recently-used eviction. The trie keeps a cursor per sequence (how many of its leading blocks are in, and
the node of the last), so each commit inserts only the blocks filled since; a sequence that drops positions tells
the trie (`rewind`), and a cleared trie starts every cursor over.

The trie keeps the blocks only it holds within its RAM share: beyond it the least recently used go to the swap
file (when one is open and has room) or are dropped, and when the swap file is full its own blocks there are
dropped first (`evict`).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator

from colibri.core.errors import InputError, StorageError
from colibri.kv.cache import KVCache
from colibri.kv.pool import Block, BlockPool


class Node:
    __slots__ = ("key", "parent", "children", "block", "stamp")

    def __init__(self, key: tuple[int, ...], parent: "Node | None", block: Block | None = None):
        self.key, self.parent = key, parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.block = block  # the trie's reference to the block's KV
        self.stamp = 0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Cursor:
    """How far the trie has taken one sequence in: its leading `committed` blocks are inserted, `node` holds the
    last of them, both of trie `generation`."""

    __slots__ = ("committed", "node", "generation")

    def __init__(self, committed: int, node: Node, generation: int):
        self.committed, self.node, self.generation = committed, node, generation


class PrefixTrie:
    """Full blocks of `block` token ids from the root down, each node holding a reference to its block in
    `pool`, and a cursor per sequence it has taken blocks from (held weakly: a sequence gone is forgotten).
    `ram_share`: RAM bytes for the blocks only the trie holds."""

    def __init__(self, pool: BlockPool, block: int, ram_share: int = 0):
        self.pool, self.block = pool, block
        self.ram_share = max(0, int(ram_share))
        self.root = Node((), None)
        self.generation = 0  # bumped when the trie is cleared: cursors of an older one start over
        self.count = 0  # nodes
        self._clock = itertools.count(1)
        self._cursors: weakref.WeakKeyDictionary[KVCache, Cursor] = weakref.WeakKeyDictionary()

    def match(self, ids: list[int]) -> list[Node]:
        """The nodes of the longest prefix of `ids` in the trie, in whole blocks."""
        B, node, out = self.block, self.root, []
        for b in range(len(ids) // B):
            node = node.children.get(tuple(ids[b * B:(b + 1) * B]))
            if node is None:
                break
            out.append(node)
        return out

    def reused(self, cache: KVCache, nodes: list[Node]) -> None:
        """`cache` starts with the blocks of `nodes` (taken from `match`): they are in use now and are its
        committed blocks."""
        for n in nodes:
            n.stamp = next(self._clock)
        if nodes:
            self._cursors[cache] = Cursor(len(nodes), nodes[-1], self.generation)

    def commit(self, cache: KVCache) -> None:
        """Insert the cache's full blocks not in the trie yet, by reference. A block the trie already holds for
        the same tokens (computed twice, by sequences that ran at once) replaces the cache's own copy."""
        cur = self._cursors.get(cache)
        if cur is None or cur.generation != self.generation:
            cur = self._cursors[cache] = Cursor(0, self.root, self.generation)
        B, node = self.block, cur.node
        for b in range(cur.committed, cache.length // B):
            key = tuple(cache.ids[b * B:(b + 1) * B])
            mine = cache.table[b]
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = Node(key, node, self.pool.ref(mine))
                self.count += 1
            elif child.block is not mine and (child.block.in_ram or not mine.in_ram):
                cache.use_block(b, child.block)
            child.stamp = next(self._clock)
            node = child
        cur.committed, cur.node = max(cur.committed, cache.length // B), node

    def rewind(self, cache: KVCache, length: int) -> None:
        """`cache` dropped its positions >= length: its cursor steps back to the blocks it still holds."""
        cur = self._cursors.get(cache)
        if cur is None:
            return
        while cur.committed > length // self.block:
            cur.committed, cur.node = cur.committed - 1, cur.node.parent

    def nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def drop(self, n: Node) -> None:
        """Remove a leaf and let go of its block."""
        del n.parent.children[n.key]
        self.pool.unref(n.block)
        self.count -= 1

    def clear(self) -> None:
        """Forget every node (their blocks let go) and every cursor's place."""
        for n in self.nodes():
            self.pool.unref(n.block)
        self.root, self.count = Node((), None), 0
        self.generation += 1

    # -- the RAM share -------------------------------------------------------------------------------------

    def ram_bytes(self) -> int:
        """RAM of the blocks only the trie holds."""
        size = self.pool.layout.ram_block_bytes
        return sum(size for n in self.nodes() if n.block.in_ram and n.block.refs == 1)

    def room(self) -> int:
        """RAM the trie may still take (its share less what it holds)."""
        return max(0, self.ram_share - self.ram_bytes())

    def shrink(self) -> None:
        """Keep the blocks only the trie holds within its RAM share."""
        while self.ram_bytes() > self.ram_share and self.evict(disk=False):
            pass

    def evict(self, disk: bool) -> bool:
        """disk=False: the least recently used block only the trie holds in RAM goes to the swap file (when one
        is open or given and has room), else its node is dropped (a leaf). disk=True: the least recently used leaf
        whose block only the trie holds on disk is dropped, freeing its slot. False when there is none."""
        def mine(n: Node) -> bool:
            return n.block.refs == 1 and n.block.in_ram != disk
        if not disk and self.pool.can_spill:
            held = [n for n in self.nodes() if mine(n)]
            if held:
                try:
                    self.pool.spill(min(held, key=lambda x: x.stamp).block)
                    return True
                except (InputError, StorageError):  # caching only saves work: a full disk costs that saving
                    pass
        leaves = [n for n in self.nodes() if not n.children and mine(n)]
        if not leaves:
            return False
        self.drop(min(leaves, key=lambda x: x.stamp))
        return True

"""The prefix trie: cached prompt prefixes as a trie of full KV blocks, so a request that starts with a known prefix
reuses those very blocks.

Each node below the root is one full block of `block` token ids and holds one reference to that block's KV
(colibri.kvpool); a node's path from the root is the prefix the block ends. Nodes carry a use stamp for
least-recently-used eviction.
"""

from __future__ import annotations

from colibri.kvpool import Block


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

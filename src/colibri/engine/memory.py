"""The memory governor: the one place that decides how the weights, the KV pool and a pass share the RAM.

Under a memory limit the weight store's pins are elastic: before a pass, the store unpins (or pins) pages so that
they, the KV pool's RAM and that pass's activations fit the limit together, and the KV pool may hold all the limit
leaves beside the placement's own weights and the pass. Without a limit the pool has a fixed reserve (or none)
and the store is left alone. The engine asks this object; it never sizes memory itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from colibri.engine.speculate import Speculator
    from colibri.kv.space import KVSpace
    from colibri.weights.store import WeightStore


@dataclass(frozen=True)
class PassShape:
    """What a forward pass needs besides weights and KV depends on these: its tokens (drafts included), the
    longest context one of its sequences attends over, and the logit rows it computes."""

    tokens: int
    ctx: int
    rows: int


class MemoryGovernor:
    """store: the weight store; space: the KV space; spec: the speculator (its n-gram indexes count in the pool);
    pool_bytes: the KV pool's budget (None: unbounded); pass_bytes: PassShape's (tokens, ctx, rows) -> bytes of
    that pass besides weights and KV, under a memory limit only (None: no limit, pins are not elastic)."""

    def __init__(self, store: WeightStore, space: KVSpace, spec: Speculator, pool_bytes: int | None,
                 pass_bytes: Callable[[int, int, int], int] | None):
        self.store, self.space, self.spec = store, space, spec
        self.pool_bytes = pool_bytes
        self.pass_bytes = pass_bytes

    @property
    def elastic(self) -> bool:
        """Under a memory limit: the store's pins give way to the KV pool and the pass."""
        return self.pass_bytes is not None

    def pass_cost(self, shape: PassShape) -> int:
        return self.pass_bytes(shape.tokens, shape.ctx, shape.rows)

    def pool_used(self) -> int:
        """What the KV pool's budget holds now: every sequence's KV in RAM, the cached prefixes, and the drafter's
        n-gram indexes (they grow with the tokens, as KV does)."""
        return self.space.ram_bytes() + self.spec.nbytes()

    def make_room(self, kv_grow: int, shape: PassShape, pin: bool = True) -> None:
        """Let the weight store share the limit with the KV pool (its RAM now plus `kv_grow`) and a pass of
        `shape`; pin=False only ever unpins."""
        if self.elastic:
            kv = self.pool_used() + self.space.prefix_room()  # the prefix cache's RAM share is kept for it
            self.store.fit(kv, kv_grow + self.pass_cost(shape), pin)

    def draft_room(self) -> int | None:
        """Bytes a pass may add beside the weights as pinned now and the KV pool (None: no limit). Drafts are
        optional work: a page unpinned for them would be read again by every later pass."""
        if not self.elastic:
            return None
        return self.store.spare(self.pool_used() + self.space.prefix_room())

    def pool_cap(self, shape: PassShape | None = None) -> int | None:
        """What the KV pool may hold beside a pass of `shape`: its reserve (`pool_bytes`, sized beside the largest
        pass), or, under a memory limit, all the limit leaves beside the placement's own weights and that pass
        (the elastic pins give way to the KV, `make_room`): a decode pass needs a fraction of the activations the
        reserve holds for a full prefill. None: unbounded."""
        if self.pool_bytes is None or shape is None or not self.elastic:
            return self.pool_bytes
        cap = self.store.kv_room(self.pass_cost(shape))
        return self.pool_bytes if cap is None else max(self.pool_bytes, cap - self.space.prefix_room())

    def fits(self, extra: int, shape: PassShape | None = None) -> bool:
        """Whether the pool holds `extra` more bytes beside a pass of `shape`; the last conversation's idle KV is
        dropped (its blocks to the prefix cache) before saying no."""
        cap = self.pool_cap(shape)
        if cap is None:
            return True
        if self.pool_used() + extra <= cap:
            return True
        self.space.drop_live()
        return self.pool_used() + extra <= cap

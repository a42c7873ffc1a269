"""A step's typed pieces: the plan the scheduler makes (slots of sequences, the pass's shape), what the pass
computed, and what the update reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from colibri.engine.memory import PassShape
from colibri.engine.request import Request


@dataclass
class Slot:
    """One sequence's share of a pass: `tokens` of it (its pending tokens or a chunk of them, then the drafts
    riding along)."""

    req: Request
    tokens: int

    @property
    def sampled(self) -> int:
        """Logit rows sampled: the last pending row and each draft once the pending tokens are all in; none for a
        chunk in the middle of a prompt."""
        return self.tokens - self.req.pending + 1 if self.tokens >= self.req.pending else 0

    @property
    def rows(self) -> int:
        """Logit rows computed: a mid-prompt chunk still computes its last row (the head's reads stay those of any
        pass)."""
        return max(self.sampled, 1)


@dataclass
class StepPlan:
    """The pass a step runs: its slots in order (decoding sequences first, then prompt chunks)."""

    slots: list[Slot]

    def shape(self) -> PassShape:
        return PassShape(sum(s.tokens for s in self.slots),
                         max(s.req.cache.length + s.tokens for s in self.slots), sum(s.rows for s in self.slots))

    @property
    def decode_only(self) -> bool:
        return all(s.req.pending == 1 for s in self.slots)


@dataclass
class Served:
    """A slot the pass computed: the token ids it fed and the logit rows to sample."""

    req: Request
    ids: list[int]
    sampled: int


@dataclass
class PassResult:
    """A computed pass: what it served, its logits [rows, V] (float32), and the store's and KV space's counters
    before and after it (None before/after: the store reads nothing)."""

    served: list[Served]
    logits: torch.Tensor
    io: tuple[dict | None, dict | None]
    kv: tuple[dict, dict]

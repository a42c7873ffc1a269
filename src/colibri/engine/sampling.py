"""Token sampling: repetition penalty, temperature, top-k, top-p, min-p; greedy at temperature 0."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from colibri.core.config import DEFAULT_MAX_TOKENS
from colibri.core.errors import InputError


@dataclass
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        ints = ("max_tokens", "top_k")
        reals = ("temperature", "top_p", "min_p", "repetition_penalty")
        for name in ints + reals:  # 2.5 tokens, True as a count or inf as a temperature set nothing meaningful
            v = getattr(self, name)
            ok = isinstance(v, int) if name in ints else isinstance(v, (int, float)) and math.isfinite(v)
            if isinstance(v, bool) or not ok:
                raise InputError(f"{name} must be {'an integer' if name in ints else 'a finite number'} (got {v!r})")
        if self.stop is not None and (not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop)):
            raise InputError(f"stop must be a string or a list of strings (got {self.stop!r})")
        if not isinstance(self.ignore_eos, bool):
            raise InputError(f"ignore_eos must be True or False (got {self.ignore_eos!r})")
        checks = [
            (self.max_tokens >= 0, f"max_tokens must be >= 0 (got {self.max_tokens})"),
            (self.temperature >= 0, f"temperature must be >= 0 (got {self.temperature})"),
            (self.top_k >= 0, f"top_k must be >= 0 (got {self.top_k})"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1] (got {self.top_p})"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1] (got {self.min_p})"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0 (got {self.repetition_penalty})"),
            (self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed < 2**64),
             f"seed must be an integer in [-2**63, 2**64) (got {self.seed!r})"),
        ]
        for ok, msg in checks:
            if not ok:
                raise InputError(msg)


class Sampler:
    def __init__(self, params: SamplingParams):
        self.p = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(int(params.seed))
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, context: list[int]) -> int:
        """logits: [V] float32 for the next position; context: prompt + generated ids so far."""
        p = self.p
        logits = logits.float()
        if p.repetition_penalty != 1.0 and context:
            ids = torch.tensor(sorted(set(context)), dtype=torch.long)
            ids = ids[ids < logits.shape[0]]
            picked = logits[ids]
            logits = logits.clone()
            logits[ids] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if p.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.shape[0]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            drop = (cum - sorted_p) >= p.top_p  # keep the smallest prefix whose mass reaches top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.generator))


def warm_up(logits: torch.Tensor, ids: list[int]) -> None:
    """Run the greedy and the filtered, penalized random paths once on `logits` [R, V], so the code they run is
    paged in before the runtime baseline is measured (colibri.runtime.warmup.warm_up makes such logits)."""
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=8, top_p=0.9, seed=0,
                                                                  repetition_penalty=1.1)):
        Sampler(params)(logits[0], ids)

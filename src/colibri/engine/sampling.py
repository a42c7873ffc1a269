"""Token sampling: penalties, a grammar's mask, log-probabilities, temperature, top-k, top-p, min-p; greedy at
temperature 0.

Every step of a sequence's sample reads only its own logits, history, seed and grammar state, so batching never
changes its tokens. The order: penalties (`penalize`: repetition over prompt and reply, presence and frequency
over the reply, OpenAI's formula), then the grammar's mask (engine/grammar.py); the log-probabilities a request
asks for are those of this distribution (`log_softmax`, before temperature and the top-k / top-p / min-p cuts,
so they do not change with temperature); then temperature and the cuts, and the draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from colibri.core.config import DEFAULT_MAX_TOKENS
from colibri.core.errors import InputError

MAX_LOGPROBS = 20  # top log-probabilities per token, as OpenAI allows


@dataclass
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token the reply holds
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the reply
    seed: int | None = None
    stop: list[str] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's log-probability and the k likeliest
    grammar: str | None = None  # an llguidance grammar (engine/grammar.py) the reply must match

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        ints = ("max_tokens", "top_k")
        reals = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
        for name in ints + reals:  # 2.5 tokens, True as a count or inf as a temperature set nothing meaningful
            v = getattr(self, name)
            ok = isinstance(v, int) if name in ints else isinstance(v, (int, float)) and math.isfinite(v)
            if isinstance(v, bool) or not ok:
                raise InputError(f"{name} must be {'an integer' if name in ints else 'a finite number'} (got {v!r})")
        if self.stop is not None and (not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop)):
            raise InputError(f"stop must be a string or a list of strings (got {self.stop!r})")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InputError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}] (got {self.logprobs!r})")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise InputError(f"grammar must be an llguidance grammar string (got {type(self.grammar).__name__})")
        if not isinstance(self.ignore_eos, bool):
            raise InputError(f"ignore_eos must be True or False (got {self.ignore_eos!r})")
        checks = [
            (self.max_tokens >= 0, f"max_tokens must be >= 0 (got {self.max_tokens})"),
            (self.temperature >= 0, f"temperature must be >= 0 (got {self.temperature})"),
            (self.top_k >= 0, f"top_k must be >= 0 (got {self.top_k})"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1] (got {self.top_p})"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1] (got {self.min_p})"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0 (got {self.repetition_penalty})"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2] (got {self.presence_penalty})"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2] (got {self.frequency_penalty})"),
            (self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed < 2**64),
             f"seed must be an integer in [-2**63, 2**64) (got {self.seed!r})"),
        ]
        for ok, msg in checks:
            if not ok:
                raise InputError(msg)


@dataclass
class TokenLogprobs:
    """A sampled token's log-probability and the `k` likeliest tokens' [(id, logprob)], best first."""

    logprob: float
    top: list[tuple[int, float]]


def penalize(logits: torch.Tensor, p: SamplingParams, context: list[int], prompt_tokens: int) -> torch.Tensor:
    """The penalized logits [V] (a copy when any penalty applies). repetition_penalty (CTRL's) divides a positive
    logit of every token seen in `context` (prompt + reply) and multiplies a negative one; presence_penalty and
    frequency_penalty (OpenAI's) subtract `presence + frequency * count` from each token the reply
    (`context[prompt_tokens:]`) holds `count` > 0 times."""
    V = logits.shape[0]
    if p.repetition_penalty != 1.0 and context:
        ids = torch.tensor(sorted(set(context)), dtype=torch.long)
        ids = ids[ids < V]
        picked = logits[ids]
        logits = logits.clone()
        logits[ids] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    reply = context[prompt_tokens:]
    if (p.presence_penalty or p.frequency_penalty) and reply:
        ids = torch.tensor(reply, dtype=torch.long)
        counts = torch.bincount(ids[ids < V], minlength=V).to(logits.dtype)  # [V]
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


class Sampler:
    """One sequence's sampler: `prompt_tokens` tells its reply from its prompt in the context it is given;
    `constraint` (engine/grammar.py) masks what its grammar forbids and follows the tokens drawn. After each
    call, `last` holds the drawn token's log-probabilities when the params ask for them (else None)."""

    def __init__(self, params: SamplingParams, prompt_tokens: int = 0, constraint=None):
        self.p = params
        self.prompt_tokens = prompt_tokens
        self.constraint = constraint
        self.last: TokenLogprobs | None = None
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(int(params.seed))
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, context: list[int]) -> int:
        """logits: [V] float32 for the next position; context: prompt + generated ids so far."""
        p = self.p
        logits = penalize(logits.float(), p, context, self.prompt_tokens)
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        token = self._draw(logits)
        if p.logprobs is not None:
            lp = torch.log_softmax(logits, dim=-1)
            top = torch.topk(lp, p.logprobs) if p.logprobs else None
            pairs = [] if top is None else zip(top.indices.tolist(), top.values.tolist())
            self.last = TokenLogprobs(float(lp[token]), [(i, v) for i, v in pairs if v > -math.inf])
        if self.constraint is not None:
            self.constraint.advance(token)
        return token

    def _draw(self, logits: torch.Tensor) -> int:
        p = self.p
        if p.temperature == 0:
            # numpy's argmax: the same first index of the largest value (a NaN counting as the largest) in one
            # vectorized pass, about a tenth of torch.argmax's time over a 151936-entry vocabulary
            return int(logits.detach().contiguous().numpy().argmax())
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
                                                                  repetition_penalty=1.1, presence_penalty=0.5,
                                                                  frequency_penalty=0.5, logprobs=2)):
        Sampler(params)(logits[0], ids)

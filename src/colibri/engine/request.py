"""One request in the engine: its tokens, sampler, text deltas (stop strings held back) and metrics."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from colibri.core.errors import InputError
from colibri.core.metrics import GenerationMetrics
from colibri.engine.sampling import Sampler, SamplingParams, TokenLogprobs
from colibri.formats.tokenizer import StreamDecoder

if TYPE_CHECKING:
    from colibri.kv.cache import KVCache
    from colibri.formats.tokenizer import Tokenizer

WAITING, RUNNING, PREEMPTED, FINISHED = "waiting", "running", "preempted", "finished"


def token_ids(value) -> list[int]:
    """A prompt given as token ids (a list, tuple or integer tensor) as a list of ints; an InputError for anything
    else, a float or a bool among them included (int(2.7) would run token 2)."""
    import numpy as np
    import torch
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise InputError(f"token ids must be integers (got a {value.dtype} tensor)")
        return [int(i) for i in value.flatten().tolist()]
    if not isinstance(value, (list, tuple)):
        raise InputError(f"the prompt must be text or a list of token ids (got {type(value).__name__})")
    for i in value:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise InputError(f"token ids must be integers (got {i!r})")
    return [int(i) for i in value]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids only (EOS excluded)
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or stop string) | "length" (max_tokens or context full) | "abort"
    stats: dict = field(default_factory=dict)


@dataclass
class StreamChunk:
    text: str  # text delta (may be empty while a multi-byte character is incomplete or a stop string may start)
    token_id: int | None  # the token that produced it; None for the final flush
    metrics: GenerationMetrics
    logprobs: TokenLogprobs | None = None  # the token's, when the request asked for them


class Request:
    """The handle `Engine.add_request` returns. Read `token_ids`, `text`, `finished`, `finish_reason`, `error`
    and `metrics` at any time; `take()` returns the stream chunks produced since the last call."""

    def __init__(self, rid: int, prompt_ids: list[int], params: SamplingParams, tokenizer: "Tokenizer | None"):
        self.id = rid
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.state = WAITING
        self.ids = list(prompt_ids)  # prompt + generated: what the KV must end up holding
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.metrics = GenerationMetrics()
        self.metrics.prompt_tokens = len(prompt_ids)
        self.cache: "KVCache | None" = None
        constraint = None
        if params.grammar is not None:
            if tokenizer is None:
                raise InputError("a grammar needs the model's tokenizer; this model has none")
            from colibri.engine.grammar import Constraint  # the optional llguidance, only when asked for
            constraint = Constraint(params.grammar, tokenizer)
        self.sampler = Sampler(params, len(prompt_ids), constraint)
        self.admitted_at = 0  # the step it was admitted (preemption picks the newest)
        # speculation: tokens a drafter proposes to follow `ids`; the next step verifies them in its pass
        self.draft: list[int] = []
        self.drafted = self.accepted = 0
        self._chunks: deque[StreamChunk] = deque()
        self._decoder = StreamDecoder(tokenizer) if tokenizer else None  # None: ids only, no text
        self._stops = [s for s in (params.stop or []) if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1  # text that may begin a stop string
        self._text, self._emitted = "", 0
        self._t_decode: float | None = None

    # -- reading ---------------------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.state == FINISHED

    @property
    def text(self) -> str:
        """Text emitted so far (what the stream chunks carried)."""
        return self._text[:self._emitted]

    def take(self) -> list[StreamChunk]:
        out = []
        while self._chunks:  # popleft: safe while another thread's step appends
            out.append(self._chunks.popleft())
        return out

    def result(self) -> GenerationResult:
        return GenerationResult(self.text, list(self.token_ids), len(self.prompt_ids), self.finish_reason or "",
                                self.metrics.as_dict())

    # -- the engine's side -----------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Tokens to run through the model before the next sample: the prompt's rest, or the last token."""
        return len(self.ids) - (self.cache.length if self.cache is not None else 0)

    def accept(self, token: int, eos_ids: set[int], context: int) -> None:
        """A sampled token: end on EOS, else keep it and emit its text; end on a stop string, max_tokens or a
        full context."""
        m, p = self.metrics, self.params
        now = time.perf_counter()
        if self._t_decode is None:
            m.mark_first_token()
            m.prefill_io_wait_s, m.prefill_kv_read_bytes = m.io_wait_s, m.kv_read_bytes
            m.prefill_disk_bytes = m.disk_bytes_read
            self._t_decode = now
        if token in eos_ids and not p.ignore_eos:
            return self.finish("stop")
        self.ids.append(token)
        self.token_ids.append(token)
        m.generated_tokens += 1
        m.decode_s = now - self._t_decode
        self._text += self._decoder.push(token) if self._decoder else ""
        cut = min((i for i in (self._text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._text = self._text[:cut]
            return self._end("stop", token, self.sampler.last)
        safe = len(self._text) - self._hold
        delta = self._text[self._emitted:safe] if safe > self._emitted else ""
        self._emitted += len(delta)
        self._chunks.append(StreamChunk(delta, token, m, self.sampler.last))
        if len(self.token_ids) >= p.max_tokens or len(self.ids) >= context:
            self.finish("length")

    def finish(self, reason: str) -> None:
        """End with the held-back text flushed as a last chunk."""
        self._text += self._decoder.flush() if self._decoder else ""
        self._end(reason, None)

    def _end(self, reason: str, token: int | None, logprobs: TokenLogprobs | None = None) -> None:
        if reason != "abort":
            self._chunks.append(StreamChunk(self._text[self._emitted:], token, self.metrics, logprobs))
            self._emitted = len(self._text)
        if self._t_decode is not None:
            self.metrics.decode_s = time.perf_counter() - self._t_decode
        self.finish_reason = self.metrics.finish_reason = reason
        self.state = FINISHED

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.finish_reason = self.metrics.finish_reason = "error"
        self.state = FINISHED

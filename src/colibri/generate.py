"""Generation, layered: a step generator of token ids, a streaming wrapper of text deltas, a one-call generate."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from colibri.errors import InputError
from colibri.metrics import GenerationMetrics
from colibri.sampling import Sampler, SamplingParams
from colibri.tokenizer import StreamDecoder

if TYPE_CHECKING:
    from colibri.model import Model


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids only (EOS excluded)
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or stop string) | "length" (max_tokens or context full)
    stats: dict = field(default_factory=dict)


@dataclass
class StreamChunk:
    text: str  # text delta (may be empty while a multi-byte character is incomplete)
    token_id: int | None
    metrics: GenerationMetrics


def step_tokens(model: "Model", prompt_ids: list[int], params: SamplingParams,
                metrics: GenerationMetrics) -> Iterator[int]:
    """Prefill the prompt (chunked), then sample and yield one token id per step until EOS or a limit."""
    if not prompt_ids:
        raise InputError("empty prompt: give at least one token of input")
    ctx = model.context_length
    if len(prompt_ids) >= ctx:
        raise InputError(f"prompt is {len(prompt_ids)} tokens but the context holds {ctx} with the reply; "
                         "shorten the prompt or raise --ctx-length")
    metrics.prompt_tokens = len(prompt_ids)
    sampler = Sampler(params)
    space = model.kv
    counters = getattr(model.store, "counters", None)  # streaming store; absent when all weights are in RAM
    io0 = counters() if counters else None
    kv0 = space.counters()

    def account_io() -> None:
        if counters:
            metrics.account_io(io0, counters())
        metrics.account_kv(kv0, space.counters())

    t0 = time.perf_counter()
    cache, reused = space.acquire(prompt_ids)
    try:
        metrics.prefix_tokens = reused
        metrics.prefill_computed = len(prompt_ids) - reused
        logits = model.prefill(prompt_ids[reused:], cache)
        metrics.prefill_s = time.perf_counter() - t0
        account_io()
        metrics.prefill_io_wait_s = metrics.io_wait_s
        metrics.prefill_kv_read_bytes = metrics.kv_read_bytes
        context = list(prompt_ids)
        t_decode = None
        metrics.finish_reason = "length"
        for n in range(params.max_tokens):
            token = sampler(logits, context)
            if n == 0:
                metrics.mark_first_token()
                t_decode = time.perf_counter()
            if token in model.eos_ids and not params.ignore_eos:
                metrics.finish_reason = "stop"
                break
            context.append(token)
            metrics.generated_tokens += 1
            metrics.decode_s = time.perf_counter() - t_decode
            account_io()
            yield token
            if n + 1 == params.max_tokens or cache.length + 1 >= ctx:
                break
            logits = model.decode_step(token, cache)
        if t_decode is not None:
            metrics.decode_s = time.perf_counter() - t_decode
        account_io()
    finally:
        space.release(cache)


def stream(model: "Model", prompt_ids: list[int], params: SamplingParams) -> Iterator[StreamChunk]:
    """Text deltas as tokens arrive. Stop strings end generation; text that might begin one is held back."""
    metrics = GenerationMetrics()
    decoder = StreamDecoder(model.tokenizer) if model.tokenizer else None  # None: ids only, no text
    stops = [s for s in (params.stop or []) if s]
    hold = max((len(s) for s in stops), default=1) - 1
    text, emitted = "", 0
    steps = step_tokens(model, prompt_ids, params, metrics)
    for token in steps:
        text += decoder.push(token) if decoder else ""
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            steps.close()
            metrics.finish_reason = "stop"
            yield StreamChunk(text[emitted:cut], token, metrics)
            return
        safe = len(text) - hold
        delta = text[emitted:safe] if safe > emitted else ""
        emitted += len(delta)
        yield StreamChunk(delta, token, metrics)
    text += decoder.flush() if decoder else ""
    yield StreamChunk(text[emitted:], None, metrics)


def generate(model: "Model", prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
    parts, ids, metrics = [], [], None
    for chunk in stream(model, prompt_ids, params):
        parts.append(chunk.text)
        metrics = chunk.metrics
        if chunk.token_id is not None:
            ids.append(chunk.token_id)
    stats = metrics.as_dict()
    return GenerationResult("".join(parts), ids, len(prompt_ids), metrics.finish_reason, stats)

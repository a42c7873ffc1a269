"""Generation for one prompt, as thin wrappers over the engine: a stream of text deltas and a one-call generate.

Both go through `Engine.stream`, so a call made while others run (another thread, a server) shares their steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from colibri.engine.request import GenerationResult, StreamChunk
from colibri.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from colibri.engine import Engine

__all__ = ["GenerationResult", "StreamChunk", "SamplingParams", "stream", "generate"]


def stream(engine: "Engine", prompt_ids: list[int], params: SamplingParams) -> Iterator[StreamChunk]:
    """Text deltas as tokens arrive. Stop strings end generation; text that might begin one is held back."""
    return engine.stream(prompt_ids, params)


def generate(engine: "Engine", prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
    parts, ids, metrics = [], [], None
    for chunk in stream(engine, prompt_ids, params):
        parts.append(chunk.text)
        metrics = chunk.metrics
        if chunk.token_id is not None:
            ids.append(chunk.token_id)
    return GenerationResult("".join(parts), ids, len(prompt_ids), metrics.finish_reason, metrics.as_dict())

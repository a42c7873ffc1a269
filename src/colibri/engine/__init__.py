"""The engine layer: continuous batching over the model math (`Engine`) and its requests."""

from colibri.engine.engine import Engine
from colibri.engine.request import GenerationResult, Request, StreamChunk

__all__ = ["Engine", "Request", "StreamChunk", "GenerationResult"]

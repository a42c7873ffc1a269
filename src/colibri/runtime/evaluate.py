"""Quality measurements: perplexity over a token sequence, computed chunk by chunk with the KV cache."""

from __future__ import annotations

import math

import torch

from colibri.core.errors import InputError


@torch.inference_mode()
def perplexity(model, ids: list[int], chunk: int = 512) -> tuple[float, float]:
    """(perplexity, mean negative log-likelihood) of ids[1:] given their prefixes, in one causal pass.

    Memory stays at one chunk of logits ([chunk, V] f32) whatever len(ids) is.
    """
    if len(ids) < 2:
        raise InputError("perplexity needs at least two tokens")
    if len(ids) > model.context_length:
        raise InputError(f"{len(ids)} tokens exceed the context of {model.context_length}")
    chunk = min(chunk, model.pass_tokens)
    total, count = 0.0, 0
    for s, logits in zip(range(0, len(ids) - 1, chunk), model.engine.score(ids[:-1], chunk)):
        target = torch.tensor(ids[s + 1:s + 1 + logits.shape[0]])
        total += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        count += len(target)
    nll = total / count
    return math.exp(nll), nll

"""`colibri calibrate`: the sparse FFN's per-layer thresholds and the neurons' co-activation order, from a
calibration text run through the container's own weights (runtime/sparsity.py has the sidecar and the runtime).

One pass over the text (at most `tokens` tokens, one forward pass) with a recording hook: per dense FFN layer, the
|act(gate)| thresholds of each sparsity step of LEVELS, the relative error ||FFN_s(x) - FFN(x)||^2 / ||FFN(x)||^2
each step costs on these tokens, and the co-activation order at the layer's median threshold. Then the allocation
(`allocate`): every layer at the target (uniform, the default) or TEAL's greedy one (the layer whose error grows
least takes the next step, until the layers' mean sparsity reaches the target; measured worse); with
--max-ppl-increase the targets of TARGETS are tried in order and the last whose perplexity on the calibration text
stays within the budget is kept. Deterministic for a fixed text.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Callable

import torch

from colibri.core.errors import InputError
from colibri.kernels.ops import linear
from colibri.runtime.evaluate import perplexity
from colibri.runtime.model import load
from colibri.runtime.sparsity import (Sidecar, SparseFFN, chunk_activity, chunk_size, ffn_bytes, require_container,
                                      sidecar_path)
from colibri.weights.usage import ExpertUsage

LEVELS = tuple(i / 20 for i in range(20))  # per-layer sparsity steps the greedy allocation moves through (0..0.95)
REFERENCE_LEVEL = 10  # LEVELS[10] = 0.5: the activity the co-activation order is computed from
DEFAULT_TOKENS = 512
DEFAULT_PPL_INCREASE = 2.0  # percent
TARGETS = tuple(i / 20 for i in range(1, 19))  # --max-ppl-increase tries these mean sparsities, in order


def coactivation_order(active: torch.Tensor, chunk: int) -> torch.Tensor:
    """active: bool [T, I] -> int64 [I], neurons that fire together next to each other: chunk by chunk, the most
    frequently active neuron not yet placed, then the chunk - 1 unplaced ones most often active with it (ties:
    the lower index). Deterministic: the co-activation counts are exact integers."""
    a = active.float()
    freq = a.sum(0)
    co = a.T @ a  # [I, I] counts, exact in f32 below 2^24 tokens
    n = a.shape[1]
    placed = torch.zeros(n, dtype=torch.bool)
    out, done = [], 0
    while done < n:
        seed = int(torch.where(placed, -1.0, freq).argmax())  # argmax: the first of equal values
        score = torch.where(placed, -1.0, co[seed])
        score[seed] = math.inf
        take = torch.sort(score, descending=True, stable=True).indices[:min(chunk, n - done)]
        placed[take] = True
        out.append(take)
        done += take.numel()
    return torch.cat(out)


class _Recorder:
    """The FFN hook of a calibration pass (dense results): per layer, the thresholds of each level of LEVELS,
    the relative error of the FFN output each level costs, the co-activation order and the chunk activity."""

    def __init__(self, chunk: int):
        self.chunk = chunk
        self.thresholds: dict[int, list[float]] = {}
        self.errors: dict[int, list[float]] = {}
        self.order: dict[int, torch.Tensor] = {}
        self.mag: dict[int, torch.Tensor] = {}  # |a| [T, I], for the chunk statistics of the chosen thresholds

    def hidden(self, layer: int, a: torch.Tensor, u: torch.Tensor, down) -> torch.Tensor:
        h = a * u
        y = linear(h, down).float()
        mag = a.abs()
        flat = mag.float().flatten().sort().values
        n = flat.numel()
        thr = [0.0] + [float(flat[max(0, int(s * n) - 1)]) for s in LEVELS[1:]]
        ref = float(y.square().sum().clamp_min(1e-30))
        err = []
        for t in thr:
            ys = linear(h.masked_fill(mag <= t, 0), down).float()
            err.append(float((ys - y).square().sum()) / ref)
        self.thresholds[layer], self.errors[layer] = thr, err
        self.order[layer] = coactivation_order(mag > thr[REFERENCE_LEVEL], self.chunk)
        self.mag[layer] = mag
        return h


ALLOCATIONS = ("uniform", "greedy")


def allocate(errors: dict[int, list[float]], target: float, how: str = "uniform") -> dict[int, int]:
    """Per layer, the step of LEVELS reaching a mean sparsity `target`. uniform (CATS; the default): every layer at
    the first step at or above it. greedy (TEAL's allocation with a layer-local cost): from 0 everywhere, raise by
    one step the layer whose relative FFN-output error grows least, until the mean reaches `target`; measured
    worse than uniform on SmolLM2 (docs/quality.md): a layer's relative FFN error does not say what it costs
    downstream."""
    top = len(LEVELS) - 1
    if how == "uniform":
        step = min(top, math.ceil(target * (len(LEVELS)) - 1e-9))
        return {i: step for i in errors}
    level = {i: 0 for i in errors}
    while level and sum(LEVELS[v] for v in level.values()) / len(level) < target - 1e-9:
        grow = [(errors[i][v + 1] - errors[i][v], i) for i, v in level.items() if v < top]
        if not grow:
            break
        level[min(grow)[1]] += 1
    return level


def _chunk_sparsity(mag: dict[int, torch.Tensor], thr: dict[int, float], order: dict[int, torch.Tensor] | None,
                    chunk: int) -> float:
    """Mean fraction of chunks no token needs, per token, in `order` (None: the stored order)."""
    skipped = total = 0
    for i, m in mag.items():
        o = order[i] if order is not None else torch.arange(m.shape[1])
        c = chunk_activity(m > thr[i], o, chunk)
        skipped += int((~c).sum())
        total += c.numel()
    return skipped / total if total else 0.0


def text_ids(model, files: list[str] | None, tokens: int) -> tuple[list[int], str]:
    """(The first `tokens` ids of the calibration text, its digest): the files joined, or CPython's own prose
    and source (as `colibri convert --calibration builtin` uses)."""
    from colibri.convert.calibrate import builtin_text, encode_text
    if files:
        parts = []
        for f in files:
            try:
                parts.append(Path(f).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError) as e:
                raise InputError(f"--text {f}: cannot read it as UTF-8 text ({e})") from None
        text = "\n\n".join(parts)
    else:
        text = "\n\n".join(builtin_text())
    ids = encode_text(model.checkpoint.tokenizer, model.args.vocab_size, text[: tokens * 16])[:tokens]
    if len(ids) < 16:
        raise InputError(f"--text: only {len(ids)} tokens; give a longer text")
    return ids, hashlib.sha256(text.encode()).hexdigest()[:16]


class Calibration:
    """One recorded pass over the calibration ids on a loaded model (`m`, no hook set): what any target's
    sidecar is chosen from, and the perplexity on these ids with a given sidecar."""

    def __init__(self, m, ids: list[int], text: str):
        require_container(m.checkpoint, m.args, "colibri calibrate")
        self.m, self.ids, self.text = m, ids, text
        self.chunk = chunk_size(m.checkpoint, m.args)
        self.rec = _Recorder(self.chunk)
        self.dense_ppl = self._ppl(self.rec)
        self.layers = sorted(self.rec.errors)

    def _ppl(self, hook) -> float:
        self.m.decoder.ffn_hook = hook
        try:
            return perplexity(self.m, self.ids, chunk=len(self.ids))[0]
        finally:
            self.m.decoder.ffn_hook = None

    def sidecar(self, level: dict[int, int], info: dict | None = None) -> Sidecar:
        """The sidecar of a level (index into LEVELS) per dense layer."""
        a, rec = self.m.args, self.rec
        thr = [rec.thresholds[i][level[i]] if i in level else 0.0 for i in range(a.num_layers)]
        order = [rec.order.get(i, torch.arange(a.intermediate_size)) for i in range(a.num_layers)]
        return Sidecar(ExpertUsage.identity_of(self.m.checkpoint), self.chunk, thr, order, info or {})

    def sparse_ppl(self, side: Sidecar) -> float:
        return self._ppl(SparseFFN(side, ffn_bytes(self.m.checkpoint, self.m.args)))

    def choose(self, target: float | None, max_ppl_increase: float | None,
               progress: Callable[[int, int], None] | None = None, allocation: str = "uniform") -> Sidecar:
        """The sidecar at a mean sparsity `target`, or the highest of TARGETS within +max_ppl_increase % of the
        dense perplexity on the calibration ids; its info filled in."""
        rec = self.rec
        if target is not None:
            level = allocate(rec.errors, target, allocation)
            ppl = self.sparse_ppl(self.sidecar(level))
        else:
            level, ppl, target = allocate(rec.errors, 0.0, allocation), self.dense_ppl, 0.0
            for k, t in enumerate(TARGETS):
                lv = allocate(rec.errors, t, allocation)
                p = self.sparse_ppl(self.sidecar(lv))
                if progress:
                    progress(1 + k, len(TARGETS))
                if p > self.dense_ppl * (1 + max_ppl_increase / 100):
                    break
                level, ppl, target = lv, p, t
        chosen = {i: rec.thresholds[i][level[i]] for i in self.layers}
        info = {"tokens": len(self.ids), "text": self.text, "target_sparsity": target, "allocation": allocation,
                "max_ppl_increase_percent": max_ppl_increase,
                "layer_sparsity": [LEVELS[level[i]] for i in self.layers],
                "perplexity_dense": round(self.dense_ppl, 4), "perplexity_sparse": round(ppl, 4),
                "chunk_sparsity_stored_order": round(_chunk_sparsity(rec.mag, chosen, None, self.chunk), 4),
                "chunk_sparsity_coactivation_order": round(_chunk_sparsity(rec.mag, chosen, rec.order, self.chunk),
                                                           4)}
        return self.sidecar(level, info)


def calibrate(path: str | Path, files: list[str] | None = None, target: float | None = None,
              max_ppl_increase: float | None = None, tokens: int = DEFAULT_TOKENS, output: str | None = None,
              progress: Callable[[str, int, int], None] | None = None,
              allocation: str = "uniform") -> tuple[Path, Sidecar]:
    """Calibrate a container's sparse FFN and write its sidecar -> (its path, the sidecar). target: the layers'
    mean sparsity; max_ppl_increase (percent, the default when neither is given): the highest mean sparsity of
    TARGETS whose perplexity on the calibration text stays within it."""
    if target is not None and max_ppl_increase is not None:
        raise InputError("give --target-sparsity or --max-ppl-increase, not both")
    if target is not None and not 0 <= target <= LEVELS[-1]:
        raise InputError(f"--target-sparsity must be between 0 and {LEVELS[-1]} (got {target})")
    if target is None and max_ppl_increase is None:
        max_ppl_increase = DEFAULT_PPL_INCREASE
    if allocation not in ALLOCATIONS:
        raise InputError(f"--allocation must be one of {', '.join(ALLOCATIONS)} (got {allocation!r})")
    tokens = max(16, tokens)
    steps = 1 + (len(TARGETS) if target is None else 1)
    with load(str(path), batch_size=tokens, max_sequences=1) as m:
        require_container(m.checkpoint, m.args, "colibri calibrate")
        ids, digest = text_ids(m, files, tokens)
        cal = Calibration(m, ids, digest if files else "builtin")
        if progress:
            progress("calibrating", 1, steps)
        side = cal.choose(target, max_ppl_increase, progress and (lambda k, n: progress("calibrating", 1 + k, steps)),
                          allocation)
        if progress:
            progress("calibrating", steps, steps)
        out = sidecar_path(m.checkpoint, output)
        side.save(out)
    return out, side

"""Calibration for `colibri convert`: what each quantizable tensor sees, and what quantizing it costs.

The source model runs over a calibration text one layer at a time: a layer's weights are read (f32), its block
runs on the hidden states of every calibration token, and the weights are dropped before the next layer, so peak
memory is one layer's weights plus the activations of the calibration tokens, whatever the model's size.

Per linear weight W [N, K] it collects
* importance: mean of x_k^2 over the calibration tokens, per input channel k (llama.cpp's imatrix), which the
  q4 fit weights its error by (quant/fit.py);
* sensitivity: the measured output error of the stage that holds it when W alone is quantized to q4 (weighted
  fit): ||block(x; W^) - block(x; W)||^2 / ||block(x; W)||^2 over the first `sens_tokens` tokens, the block's
  output being the residual stream after the layer; for the head, the same ratio over the logits (centered).
  For an untied token embedding, the relative error of the looked-up rows.

The residual stream is what every later layer reads, so a relative error there is comparable across layers;
mixed.py spends a size budget on the tensors with the most sensitivity per byte.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from colibri.quant import kinds as quant
from colibri.core.atomic import atomic_write
from colibri.models.base import Batch, rms_norm, rope_cos_sin
from colibri.weights.store import RamStore

EMBED = "model.embed_tokens.weight"
CALIBRATION = "calibration.safetensors"  # in the container: the statistics its q4 fit used
DEFAULT_TOKENS = 1024  # calibration tokens (half prose, half Python source)
SENS_TOKENS = 128  # the first tokens, on which each tensor's sensitivity is measured
# CPython's own files, so calibration works offline; none of them is a text benchmarks/quant_quality.py scores
# (it scores the start of the pydoc topics and other stdlib modules).
PROSE_TAIL_CHARS = 60_000  # the END of the pydoc topics text (keys sorted)
CODE_MODULES = ("textwrap", "heapq", "bisect", "fnmatch", "colorsys", "shlex", "string")


def builtin_text() -> tuple[str, str]:
    """(English prose: the tail of `pydoc_data.topics`, Python source: a few small stdlib modules)."""
    from pydoc_data import topics

    prose = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))[-PROSE_TAIL_CHARS:]
    code = []
    for name in CODE_MODULES:
        spec = importlib.util.find_spec(name)
        if spec and spec.origin and spec.origin.endswith(".py"):
            code.append(Path(spec.origin).read_text(encoding="utf-8"))
    return prose, "\n\n".join(code)


def encode_text(tokenizer, vocab_size: int, text: str) -> list[int]:
    """Token ids of a calibration text; a checkpoint without a tokenizer (test models) reads its bytes as ids."""
    if tokenizer is None:
        return [b % vocab_size for b in text.encode("utf-8")]
    return [i for i in tokenizer.encode(text).ids if i < vocab_size]


def calibration_ids(tokenizer, vocab_size: int, text_file: str | None, tokens: int) -> list[int]:
    """Token ids of the calibration text: `text_file`'s first `tokens`, or half prose and half code built in.
    A checkpoint without a tokenizer (test models) reads the text's bytes as ids."""
    def encode(text: str) -> list[int]:
        return encode_text(tokenizer, vocab_size, text)

    if text_file:
        try:
            text = Path(text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            from colibri.core.errors import InputError
            raise InputError(f"--calibration {text_file}: cannot read it as UTF-8 text ({e})") from None
        ids = encode(text[: tokens * 16])[:tokens]
    else:
        prose, code = builtin_text()
        half = tokens // 2
        ids = encode(prose[-half * 16:])[-half:] + encode(code[: half * 16])[:tokens - half]
    if len(ids) < 16:
        from colibri.core.errors import InputError
        raise InputError(f"--calibration {text_file}: only {len(ids)} tokens; give a longer text")
    return ids


def text_digest(text_file: str | None) -> str:
    """Identity of the calibration text for the conversion fingerprint."""
    if not text_file:
        return "builtin"
    return hashlib.sha256(Path(text_file).read_bytes()).hexdigest()[:16]


@dataclass
class Calibration:
    importance: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> f32 [K]
    sensitivity: dict[str, float] = field(default_factory=dict)  # name -> relative output error at q4
    tokens: int = 0
    # the q4 weights the sensitivity was measured with (the weighted fit the container stores), kept for the
    # writer so that no tensor is fitted twice; not saved (a resumed conversion fits them again)
    quantized: dict[str, object] = field(default_factory=dict)

    def save(self, path: Path) -> None:
        with atomic_write(path) as f:
            f.write(safetensors_bytes({n: t.contiguous() for n, t in self.importance.items()},
                         metadata={"sensitivity": json.dumps(self.sensitivity), "tokens": str(self.tokens)}))

    @classmethod
    def load(cls, path: Path) -> "Calibration | None":
        try:
            from safetensors import safe_open
            with safe_open(str(path), "pt") as f:
                meta = f.metadata()
            return cls(load_file(path), json.loads(meta["sensitivity"]), int(meta["tokens"]))
        except Exception:  # absent or damaged: calibrate again
            return None


class _Cache:
    """The KV of one pass over one sequence (a `SequenceKV`): a layer attends to the keys it just computed."""

    def update(self, i: int, k: torch.Tensor, v: torch.Tensor):
        return k, v

    def room(self, i: int, T: int) -> None:  # no blocks: update gets the rows
        return None

    def rooms(self, T: int) -> None:
        return None


def _one_sequence(ids: list[int]) -> Batch:
    """A Batch of one sequence from position 0 (no logits are computed: the caller runs blocks only)."""
    return Batch.pack([(ids, 0, _Cache(), len(ids))])


class _Recorder:
    """A linear weight that adds sum(x^2) per input channel to `stats` whenever it is applied."""

    def __init__(self, w: torch.Tensor, name: str, stats: dict, counts: dict, on: Callable[[], bool]):
        self.w, self.name, self.stats, self.counts, self.on = w, name, stats, counts, on
        self.shape = tuple(w.shape)

    def native_op(self) -> None:  # (ops.native_linear) f32 in torch, where the statistics are taken
        return None

    def linear(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()
        if self.on():
            self.stats[self.name] = self.stats.get(self.name, 0) + x2.square().sum(0)
            self.counts[self.name] = self.counts.get(self.name, 0) + x2.shape[0]
        return F.linear(x2, self.w, b).reshape(*x.shape[:-1], self.shape[0])


class _LayerStore(RamStore):
    """The WeightStore for calibration: one layer's tensors read on first use, f32, dropped by `release`;
    2-D weights wrapped in recorders; `override` replaces a tensor (its quantized version) for a re-run. The rest
    of the protocol is the RAM store's: nothing streams, no guess is read ahead."""

    def __init__(self, ckpt, linears: set[str]):
        super().__init__({}, torch.float32)
        self.ckpt, self.linears = ckpt, linears
        self.loaded: dict[str, torch.Tensor] = {}
        self.override: dict[str, torch.Tensor] = {}
        self.stats: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.recording = True

    def weight(self, name: str) -> torch.Tensor:
        if name not in self.loaded:
            self.loaded[name] = self.ckpt.load(name).float()
        return self.loaded[name]

    def get(self, name: str):
        w = self.override.get(name)
        if w is None:
            w = self.weight(name)
        if name in self.linears:
            return _Recorder(w, name, self.stats, self.counts, lambda: self.recording)
        return w

    def release(self) -> None:
        self.loaded, self.override = {}, {}

    def derived(self, key, make, current):
        return make()  # (a layer's tensors are dropped by `release`: nothing derived from them is kept)

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        return self.weight(name)[ids]

    def importance(self, name: str) -> torch.Tensor:
        return self.stats[name] / self.counts[name]


def _relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).square().sum() / ref.square().sum().clamp_min(1e-30))


def calibrate(ckpt, args, decoder, ids: list[int], plan: dict[str, tuple[str, int]], sens_tokens: int = SENS_TOKENS,
              progress: Callable[[str, int, int], None] | None = None, measure: bool = True) -> Calibration:
    """Importance of every linear weight and (`measure`) sensitivity of each weight in `plan` (name -> the q4
    kind and group size it would get). `progress(stage, done, total)` is called after each layer."""
    lm_head = decoder.lm_head_name()
    linears = {n for n, s in decoder.weight_shapes().items() if len(s) == 2 and n != EMBED} | {lm_head}
    store = _LayerStore(ckpt, linears)
    cal = Calibration(tokens=len(ids))
    tokens = torch.tensor(ids)
    s = min(sens_tokens, len(ids))

    def q4(name: str, w: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
        kind, g = plan[name]
        q = quant.quantize(w, kind, g, importance=importance)
        if importance is not None:
            cal.quantized[name] = q
        return q.dequantize()

    with torch.inference_mode():
        x = store.rows(EMBED, tokens)
        if measure and EMBED in plan and not args.tie_word_embeddings:  # the lookup table: its rows' error
            cal.sensitivity[EMBED] = _relative(q4(EMBED, store.weight(EMBED), None)[tokens[:s]], x[:s])
        store.release()
        if args.embed_scale is not None:
            x = x * torch.tensor(args.embed_scale, dtype=x.dtype)
        positions = torch.arange(len(ids))
        rope = {t: rope_cos_sin(f, positions, x.dtype) for t, f in decoder.inv_freq.items()}
        rope_s = {t: (c[:s], n[:s]) for t, (c, n) in rope.items()}
        whole, head = _one_sequence(ids), _one_sequence(ids[:s])
        for i in range(args.num_layers):
            store.recording = True
            y = decoder.block(store, i, x, whole, rope[args.layer_types[i]])
            store.recording = False
            mine = [n for n in store.loaded if n in store.linears]
            for n in mine:
                cal.importance[n] = store.importance(n)
            for n in mine:
                if not measure or n not in plan or ".experts." in n:  # experts: too many to re-run one by one
                    continue
                store.override = {n: q4(n, store.loaded[n], cal.importance[n])}
                ys = decoder.block(store, i, x[:s], head, rope_s[args.layer_types[i]])
                cal.sensitivity[n] = _relative(ys, y[:s])
            store.release()
            x = y
            if progress:
                progress("calibrating", i + 1, args.num_layers + 1)
        h = rms_norm(x, store.weight("model.norm.weight"), args.rms_norm_eps, args.gemma_norm)
        w = store.weight(lm_head)
        cal.importance[lm_head] = h.square().mean(0)
        if measure and lm_head in plan:
            ref = h[:s] @ w.T
            ref = ref - ref.mean(-1, keepdim=True)
            got = h[:s] @ q4(lm_head, w, cal.importance[lm_head]).T
            cal.sensitivity[lm_head] = _relative(got - got.mean(-1, keepdim=True), ref)
        store.release()
        if progress:
            progress("calibrating", args.num_layers + 1, args.num_layers + 1)
    return cal

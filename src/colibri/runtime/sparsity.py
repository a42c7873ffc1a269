"""LOSSY sparse FFN (`--sparse-ffn`) and its calibration (`colibri calibrate`).

CATS-style activation sparsity on the dense SwiGLU FFN: a neuron n of layer i is active for a token when
|act(gate x)_n| > t_i; an inactive neuron's hidden product is set to zero, so up's row n and down's column n do
not matter for that token. CATS rather than TEAL (which thresholds the input of every projection along the
hidden dimension): the gate is computed exactly anyway, and the mask then falls on the intermediate neurons,
which are whole rows of up and whole columns of down: the unit a neuron-bundle layout reads (docs/format.md).

Exactness and batches: a row's mask comes from its own gate row alone and the masked hidden product goes through
the same batch-invariant kernels as the dense one, so a sequence's tokens never depend on its batch mates, and
with thresholds of 0 the logits equal the dense path's bit for bit. What a pass would need to read is the union
of its rows' active chunks; the counters report both the per-row and the union figures. This version computes
up and down over every neuron (the mask, not the bytes, is what it changes): reading only the active chunks
needs the bundle layout, described in docs/format.md, section "Sparse FFN sidecar". Calibration:
runtime/sparse_calibrate.py.

The sidecar (`sparse_ffn.safetensors` in the container's directory) holds the per-layer thresholds, the
co-activation order of the neurons per layer and the statistics they came from, bound to the container's
identity: a sidecar made for another container is refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from colibri.core.atomic import atomic_write
from colibri.core.errors import InputError, UnsupportedModelError
from colibri.formats.container import ContainerCheckpoint
from colibri.quant.kinds import K_KINDS, SUPER, TILED_KINDS
from colibri.weights.usage import ExpertUsage

SIDECAR = "sparse_ffn.safetensors"
FORMAT, VERSION = "colibri-sparse-ffn", 1
PROJ = ("gate_proj", "up_proj", "down_proj")


def ffn_names(i: int) -> list[str]:
    return [f"model.layers.{i}.mlp.{p}.weight" for p in PROJ]


def chunk_size(ckpt: ContainerCheckpoint, args) -> int:
    """Neurons per chunk, the unit a bundle reads: whole 64-row tiles of the q4-tiled kinds' gate and up rows,
    whole groups (K-quants: 256-value super-blocks) of down along its input, the intermediate dimension."""
    c = 32
    for i in range(args.num_layers):
        g, u, d = (ckpt.tensors[n] for n in ffn_names(i))
        for t in (g, u):
            if t.kind in TILED_KINDS:
                c = math.lcm(c, 64)
        if d.kind in K_KINDS:
            c = math.lcm(c, SUPER)
        elif d.group_size:
            c = math.lcm(c, d.group_size)
    return c


def dense_layers(args) -> list[int]:
    return [i for i in range(args.num_layers) if not args.moe_layers[i]]


# ---------------------------------------------------------------------------------------------- the sidecar


@dataclass
class Sidecar:
    """identity: the container's (ExpertUsage.identity_of). chunk: neurons per chunk. thresholds: per layer.
    order: per layer, int64 [I], the co-activation order (position p holds neuron order[p]). info: how it was
    made (text digest, tokens, target, per-layer sparsity, perplexities), stored as JSON."""

    identity: str
    chunk: int
    thresholds: list[float]
    order: list[torch.Tensor]
    info: dict = field(default_factory=dict)

    def save(self, path: Path) -> None:
        tensors = {"thresholds": torch.tensor(self.thresholds, dtype=torch.float32)}
        tensors.update({f"order.{i}": o.to(torch.int32).contiguous() for i, o in enumerate(self.order)})
        meta = {"format": FORMAT, "version": str(VERSION), "identity": self.identity, "chunk": str(self.chunk),
                "info": json.dumps(self.info, sort_keys=True)}
        with atomic_write(path) as f:
            f.write(safetensors_bytes(tensors, metadata=meta))

    @classmethod
    def load(cls, path: Path, identity: str, layers: int) -> "Sidecar":
        """The sidecar at `path` if it belongs to the container of `identity` (InputError, one line, otherwise)."""
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except FileNotFoundError:
            raise InputError(f"--sparse-ffn: {path} does not exist; make it with `colibri calibrate --model"
                             " CONTAINER`") from None
        except Exception as e:  # noqa: BLE001 - a damaged file is one line
            raise InputError(f"--sparse-ffn: {path} is not a sparse-FFN sidecar ({e}); run colibri calibrate"
                             " again") from None
        if meta.get("format") != FORMAT or meta.get("version") != str(VERSION):
            raise InputError(f"--sparse-ffn: {path} is not a version {VERSION} sparse-FFN sidecar"
                             f" ({meta.get('format')} v{meta.get('version')}); run colibri calibrate again")
        if meta.get("identity") != identity:
            raise InputError(f"--sparse-ffn: {path} was calibrated for another container; run colibri calibrate"
                             " on this one")
        thr = tensors["thresholds"].tolist()
        if len(thr) != layers:
            raise InputError(f"--sparse-ffn: {path} has {len(thr)} layers, the model {layers}; run colibri"
                             " calibrate again")
        order = [tensors[f"order.{i}"].long() for i in range(layers)]
        return cls(identity, int(meta["chunk"]), thr, order, json.loads(meta.get("info", "{}")))


def sidecar_path(ckpt: ContainerCheckpoint, given: str | None) -> Path:
    """--sparse-ffn's file: the one given, or the container's own."""
    return Path(given) if given and given != "default" else Path(ckpt.path) / SIDECAR


def require_container(ckpt, args, what: str) -> None:
    if not isinstance(ckpt, ContainerCheckpoint):
        raise UnsupportedModelError(f"{what} needs a Colibri container (its sidecar is bound to one); convert the"
                                    " model first (colibri convert --input ... --output ...)")
    if not dense_layers(args):
        raise UnsupportedModelError(f"{what} applies to dense FFN layers; this model's are all mixture of experts")


# ---------------------------------------------------------------------------------------------- the runtime hook


def chunk_activity(keep: torch.Tensor, order: torch.Tensor, chunk: int) -> torch.Tensor:
    """keep: bool [T, I] -> bool [T, ceil(I / chunk)]: which chunks of the neurons in `order` each row needs."""
    t, n = keep.shape
    k = keep[:, order]
    pad = -n % chunk
    if pad:
        k = torch.cat([k, k.new_zeros(t, pad)], dim=1)
    return k.view(t, -1, chunk).any(-1)


class SparseFFN:
    """The FFN hook of `--sparse-ffn` (models.base.FFNHook): masks the hidden product of the neurons at or
    below their layer's threshold, row by row, and counts what it kept. ffn_bytes: per layer, the stored bytes
    of (gate, up, down)."""

    def __init__(self, sidecar: Sidecar, ffn_bytes: dict[int, tuple[int, int, int]]):
        self.side = sidecar
        self.bytes = ffn_bytes
        self.rows = 0  # rows x dense layers seen
        self.neurons = self.active = 0  # neurons seen, neurons kept
        self.chunk_bytes = 0.0  # the gate plus up and down of each row's own active chunks, summed over rows
        self.union_bytes = 0.0  # the same for each pass's union of active chunks, summed over passes
        self.dense_bytes = 0  # what the same rows' FFN would read dense

    def hidden(self, layer: int, a: torch.Tensor, u: torch.Tensor, down) -> torch.Tensor:
        keep = a.abs() > self.side.thresholds[layer]  # [T, I]: a row's own gate row alone
        h = (a * u).masked_fill_(~keep, 0)
        t, n = keep.shape
        chunks = chunk_activity(keep, self.side.order[layer], self.side.chunk)  # [T, C]
        g, up, dn = self.bytes[layer]
        c = chunks.shape[1]
        self.rows += t
        self.neurons += t * n
        self.active += int(keep.sum())
        self.chunk_bytes += t * g + (up + dn) * int(chunks.sum()) / c
        self.union_bytes += g + (up + dn) * int(chunks.any(0).sum()) / c
        self.dense_bytes += t * (g + up + dn)
        return h

    def counters(self) -> dict:
        """FFN sparsity and bytes: per token (each row's own active chunks), per pass (the union over its rows,
        per token of the pass) and dense, all dense layers together."""
        layers = max(1, len(self.bytes))
        tokens = self.rows / layers
        per = lambda v: round(v / tokens) if tokens else 0  # noqa: E731
        return {"sparse_ffn": True, "ffn_sparsity": round(1 - self.active / self.neurons, 4) if self.neurons else 0.0,
                "ffn_dense_bytes_per_token": per(self.dense_bytes),
                "ffn_bytes_needed_per_token": per(self.chunk_bytes),
                "ffn_bytes_needed_per_token_union": per(self.union_bytes),
                "ffn_chunk": self.side.chunk}


def ffn_bytes(ckpt: ContainerCheckpoint, args) -> dict[int, tuple[int, int, int]]:
    return {i: tuple(ckpt.tensors[n].nbytes for n in ffn_names(i)) for i in dense_layers(args)}


def attach(model, given: str | None) -> SparseFFN:
    """Load --sparse-ffn's sidecar for a loaded model and set its hook."""
    ckpt, args = model.checkpoint, model.args
    require_container(ckpt, args, "--sparse-ffn")
    side = Sidecar.load(sidecar_path(ckpt, given), ExpertUsage.identity_of(ckpt), args.num_layers)
    hook = SparseFFN(side, ffn_bytes(ckpt, args))
    model.decoder.ffn_hook = hook
    return hook

"""The checkpoint protocol and `open_checkpoint`, which reader a path needs.

Everything above the loaders sees a checkpoint through `Checkpoint` alone. What only one format has is reached
by its type: a `ContainerCheckpoint` (isinstance) has the manifest's pages and tensors the streaming store reads;
a checkpoint whose `format` is "gguf" has `raw_tensor` (the stored blocks, which the converter keeps exact).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from colibri.core.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

    from colibri.quant.kinds import Q4Weight, Q8Weight

Format = Literal["huggingface", "gguf", "container"]


class Checkpoint(Protocol):
    format: Format
    path: Path
    config: dict[str, Any]  # HF config.json keys (a GGUF's metadata mapped to them)
    tokenizer: Any  # tokenizers.Tokenizer, or None: the model runs on token ids only
    chat_template: str | None
    special: dict[str, Any]  # bos/eos/pad/unk token strings and eos_token_id / bos_token_id

    def tensor_names(self) -> list[str]: ...

    def tensor_shape(self, name: str) -> tuple[int, ...]: ...

    def tensor_dtype(self, name: str) -> str:
        """How the tensor is stored, as `colibri info` shows it (F32, Q4_K, q4-g64, ...)."""

    def load(self, name: str) -> torch.Tensor | Q4Weight | Q8Weight:
        """The tensor under its HF name and layout: a float tensor, or (containers) a packed q4/q8 weight."""

    def default_dtype(self) -> torch.dtype:
        """The compute dtype when none is asked for."""

    def close(self) -> None: ...


def is_gguf_file(path: Path) -> bool:
    """Whether `path` is a file named .gguf or starting with the GGUF magic."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def open_checkpoint(path: Path) -> Checkpoint:
    """The reader for `path`: a .gguf file (or any file starting with the GGUF magic), a directory with a Colibri
    manifest, else an HF directory."""
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory; check the --model path")
    if path.is_file():
        if not is_gguf_file(path):
            raise ModelLoadError(f"{path}: not a GGUF file; give a .gguf file or a model directory")
        from colibri.formats.gguf import GGUFCheckpoint
        return GGUFCheckpoint(path)
    from colibri.formats.container import MANIFEST, ContainerCheckpoint
    if (path / MANIFEST).is_file():
        return ContainerCheckpoint(path)
    from colibri.formats.hf import HFCheckpoint
    return HFCheckpoint(path)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_tensors(ckpt: Checkpoint, shapes: dict[str, tuple[int, ...]], path: Path) -> None:
    """Every tensor the math reads is present with the shape the config implies (checked before any is read). A
    container, written from exactly its config's tensors, also holds none the config leaves out: a config that
    disagrees with its tensor table (one layer fewer, untied where the weights are tied) is refused instead of
    running a different model. (HF directories and GGUF files may carry tensors the text model does not read.)"""
    have = set(ckpt.tensor_names())
    if ckpt.format == "container" and (extra := sorted(have - set(shapes))):
        layers = {int(m.group(1)) for n in shapes if (m := _LAYER.search(n))}
        beyond = sorted({int(m.group(1)) for n in extra if (m := _LAYER.search(n))} - layers)
        what = (f"weights of layer {beyond[0]}, which the config's {len(layers)} layers leave out" if beyond
                else f"tensor {extra[0]!r}, which the config does not describe")
        raise ModelLoadError(f"{path}: the container holds {what}; its config does not match the weights "
                             "(damaged or edited manifest), reconvert the model")
    for name, shape in shapes.items():
        if name not in have:
            raise ModelLoadError(f"{path}: tensor {name!r} is missing; the checkpoint is incomplete"
                                 f" or not a {ckpt.config.get('model_type')} model")
        got = tuple(ckpt.tensor_shape(name))
        if got != tuple(shape):
            raise ModelLoadError(f"{path}: tensor {name!r} has shape {list(got)}, expected {list(shape)}"
                                 " from the config; the weights do not match the config")

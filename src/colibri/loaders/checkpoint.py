"""The checkpoint protocol and `open_checkpoint`, which reader a path needs.

Everything above the loaders sees a checkpoint through `Checkpoint` alone. What only one format has is reached
by its type: a `ContainerCheckpoint` (isinstance) has the manifest's pages and tensors the streaming store reads;
a checkpoint whose `format` is "gguf" has `raw_tensor` (the stored blocks, which the converter keeps exact).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from colibri.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

    from colibri.quant import Q4Weight, Q8Weight

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


def open_checkpoint(path: Path) -> Checkpoint:
    """The reader for `path`: a .gguf file (or any file starting with the GGUF magic), a directory with a Colibri
    manifest, else an HF directory."""
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory; check the --model path")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            with open(path, "rb") as f:
                if f.read(4) != b"GGUF":
                    raise ModelLoadError(f"{path}: not a GGUF file; give a .gguf file or a model directory")
        from colibri.loaders.gguf import GGUFCheckpoint
        return GGUFCheckpoint(path)
    from colibri.container import MANIFEST, ContainerCheckpoint
    if (path / MANIFEST).is_file():
        return ContainerCheckpoint(path)
    from colibri.loaders.hf import HFCheckpoint
    return HFCheckpoint(path)


def check_tensors(ckpt: Checkpoint, shapes: dict[str, tuple[int, ...]], path: Path) -> None:
    """Every tensor the math reads is present with the shape the config implies (checked before any is read)."""
    have = set(ckpt.tensor_names())
    for name, shape in shapes.items():
        if name not in have:
            raise ModelLoadError(f"{path}: tensor {name!r} is missing; the checkpoint is incomplete"
                                 f" or not a {ckpt.config.get('model_type')} model")
        got = tuple(ckpt.tensor_shape(name))
        if got != tuple(shape):
            raise ModelLoadError(f"{path}: tensor {name!r} has shape {list(got)}, expected {list(shape)}"
                                 " from the config; the weights do not match the config")

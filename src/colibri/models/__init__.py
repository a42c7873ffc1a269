"""The one table of supported families: HF `model_type` -> module with `args(cfg) -> ModelArgs` and `Model`;
`open_model`: a checkpoint with its family's arguments and math."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from colibri.core.errors import ModelLoadError, UnsupportedModelError
from colibri.formats.checkpoint import Checkpoint, open_checkpoint

if TYPE_CHECKING:
    from colibri.models.base import DecoderModel, ModelArgs

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]

ALIASES = {
    "gemma3_text": "gemma3",
}


def family(model_type: str | None) -> ModuleType:
    name = ALIASES.get(model_type or "", model_type)
    if name not in FAMILIES:
        supported = ", ".join(FAMILIES + sorted(ALIASES))
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported (supported: {supported})")
    return importlib.import_module(f"colibri.models.{name}")


def open_model(path: Path) -> "tuple[Checkpoint, ModelArgs, DecoderModel]":
    """(checkpoint, ModelArgs, family math) without reading any weight."""
    ckpt = open_checkpoint(path)
    fam = family(ckpt.config.get("model_type"))
    try:
        args = fam.args(ckpt.config)
    except KeyError as e:
        raise ModelLoadError(f"{path}: config lacks required field {e.args[0]!r}") from None
    return ckpt, args, fam.Model(args)

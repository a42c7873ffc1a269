"""The one table of supported families: HF `model_type` -> module with `args(cfg) -> ModelArgs` and `Model`."""

from __future__ import annotations

import importlib
from types import ModuleType

from colibri.errors import UnsupportedModelError

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

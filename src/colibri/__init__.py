"""Colibri: LLM inference that streams weights from an SSD, with exact model math."""

from colibri.core import __version__
from colibri.core.errors import ColibriError, InputError, ModelLoadError, UnsupportedModelError

__all__ = ["load", "Model", "GenerationResult", "EngineConfig", "Engine", "SamplingParams", "ColibriError", "InputError", "ModelLoadError",
           "UnsupportedModelError", "__version__"]
# imported on first use, so that `import colibri` (and the CLI's start) does not load torch: the CLI chooses
# OpenMP's wait policy, which torch's OpenMP runtime reads once when it loads
_LAZY = {"load": "colibri.runtime.model", "Model": "colibri.runtime.model", "GenerationResult": "colibri.engine.generate",
         "EngineConfig": "colibri.core.config", "Engine": "colibri.engine", "SamplingParams": "colibri.engine.sampling"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'colibri' has no attribute {name!r}")

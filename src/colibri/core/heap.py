"""glibc's heap under a memory budget: give freed memory back before the baseline is measured and after a long
pass (the elastic budget, weights/streaming/pins.py), and keep large freed blocks from staying resident while the
budget holds."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _glibc(name: str):
    """The C library's function `name` (malloc_trim, mallopt: glibc's), or None where it has none (musl, macOS).
    Looked up once: find_library runs `ldconfig -p`, and the elastic budget trims between passes."""
    path = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(path), name) if path else None
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Return freed heap memory to the OS (glibc malloc_trim). Parsing a large tokenizer.json leaves much of its
    freed heap resident; the loader trims it before measuring the runtime baseline, so it does not count there
    (figure: docs/performance.md, "Figures moved from source comments")."""
    malloc_trim = _glibc("malloc_trim")
    if malloc_trim is not None:
        malloc_trim(0)


def tame_allocator() -> None:
    """Keep glibc from holding freed memory: large blocks come from (and return to) mmap, and the heap is
    trimmed eagerly. Without it, glibc's adaptive mmap threshold lets freed activation buffers of a few MB stay
    in the heap, and RSS drifts above the budget."""
    mallopt = _glibc("mallopt")
    if mallopt is not None:
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        mallopt(M_MMAP_THRESHOLD, 256 << 10)
        mallopt(M_TRIM_THRESHOLD, 1 << 20)

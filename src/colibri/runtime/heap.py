"""glibc's heap under a memory budget: give freed memory back before the baseline is measured, and keep large
freed blocks from staying resident while the budget holds."""

from __future__ import annotations

import ctypes
import ctypes.util


def _libc():
    path = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(path) if path else None
    except OSError:
        return None


def trim_heap() -> None:
    """Return freed heap memory to the OS (glibc malloc_trim). Parsing a large tokenizer.json leaves much of its
    freed heap resident; the loader trims it before measuring the runtime baseline, so it does not count there
    (figure: docs/performance.md, "Figures moved from source comments")."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def tame_allocator() -> None:
    """Keep glibc from holding freed memory: large blocks come from (and return to) mmap, and the heap is
    trimmed eagerly. Without it, glibc's adaptive mmap threshold lets freed activation buffers of a few MB stay
    in the heap, and RSS drifts above the budget."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        libc.mallopt(M_MMAP_THRESHOLD, 256 << 10)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 20)

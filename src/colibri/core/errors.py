"""User-facing errors: one line that says what is wrong and what to do."""

import errno
import re


class ColibriError(Exception):
    """Base class; the CLI prints `error: <message>` without a traceback (unless --debug)."""


class ModelLoadError(ColibriError):
    """A checkpoint path, file or tensor is missing, truncated, or malformed."""


class UnsupportedModelError(ColibriError):
    """The checkpoint's architecture, dtype or feature is not implemented."""


class InputError(ColibriError):
    """A prompt or request argument is invalid (empty, too long, bad value)."""


class OutputError(ColibriError):
    """Writing the user's output failed or cannot succeed (disk full, read-only directory); names the file."""


class StorageError(ColibriError):
    """Reading weights from disk failed (I/O error, file truncated or replaced); names the file and offset."""


class Terminated(BaseException):
    """The process got SIGTERM. Raised by the CLI's signal handler so that cleanup runs as for Ctrl-C (temporary
    swap files deleted, a half-written session discarded); a BaseException, so `except Exception` lets it pass."""


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` is the process running out of memory, not a fault of its input: Python's MemoryError, an
    OSError ENOMEM (a mapping refused), or torch's CPU allocator refusing an allocation (a RuntimeError that says
    so)."""
    return (isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno == errno.ENOMEM)
            or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e)))


def oom_text(e: BaseException) -> str:
    """What an out-of-memory exception says, on one line (torch's without its "[enforce fail at ...] err == 0."
    prefix)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return re.sub(r"^\[enforce fail[^\]]*\]\s*(err == 0\.\s*)?", "", text)

"""User-facing errors: one line that says what is wrong and what to do."""


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

"""The ground floor: errors, settings (`EngineConfig`), defaults and paths, atomic file writes, the metrics object."""

__version__ = "0.1.0"  # pyproject.toml's version

"""Expert usage: decayed routing counts that rank a MoE model's experts for the expert cache, persisted beside
the container (usage.json, written atomically) so the next load pins the hottest experts from the start."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from colibri.core.atomic import write_json
from colibri.formats.container import ContainerCheckpoint

USAGE_FILE = "usage.json"
USAGE_HALF_LIFE = 256  # tokens: the expert cache's use counts halve over this many routed tokens
USAGE_SAVE_EVERY = 128  # forward passes between usage.json writes (also written at close)


class ExpertUsage:
    """Decayed routing counts (the expert cache's eviction score) and per-run totals (persisted in usage.json).

    Decay is lazy: a count is stored with the token clock at its last update and scaled by 2^(-age/half-life)
    when read. Saved totals carry the previous runs' totals at half weight, so the file follows drift."""

    def __init__(self, path: Path | None, num_layers: int, num_experts: int, identity: str):
        self.path, self.identity = path, identity
        self.shape = (num_layers, num_experts)
        self.clock = 0
        self.count: dict[tuple[int, int], float] = {}
        self.stamp: dict[tuple[int, int], int] = {}
        self.last_use: dict[tuple[int, int], int] = {}
        self.run: dict[tuple[int, int], int] = {}
        self.loaded = self._load()
        self.saved_ok: bool | None = None

    def _load(self) -> dict[tuple[int, int], float]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if data.get("version") != 1 or data.get("container") != self.identity or \
                    tuple(data.get("shape", ())) != self.shape:
                return {}  # another container's counts (or an older layout): start afresh
            return {(i, e): float(c) for i, row in enumerate(data["counts"]) for e, c in enumerate(row) if c > 0}
        except (OSError, ValueError, KeyError, TypeError):
            return {}

    @staticmethod
    def identity_of(ckpt: ContainerCheckpoint) -> str:
        """Which container the counts belong to: its source fingerprint and page checksums."""
        pages = ",".join(p.checksum for p in ckpt.pages)
        return ckpt.manifest.get("source", {}).get("fingerprint", "") + "/" + f"{zlib.crc32(pages.encode()):08x}"

    def tick(self, tokens: int) -> None:
        self.clock += tokens

    def record(self, layer: int, uses: dict[int, int]) -> None:
        for e, n in uses.items():
            key = (layer, e)
            self.count[key] = self.score(key) + n
            self.stamp[key] = self.last_use[key] = self.clock
            self.run[key] = self.run.get(key, 0) + n

    def score(self, key: tuple[int, int]) -> float:
        c = self.count.get(key)
        if c is None:
            return 0.0
        return c * 0.5 ** ((self.clock - self.stamp[key]) / USAGE_HALF_LIFE)

    def rank(self, key: tuple[int, int]) -> tuple[float, int]:
        """Eviction order: lowest decayed count first, then least recently used."""
        return self.score(key), self.last_use.get(key, -1)

    def save(self) -> None:
        """Write totals atomically (colibri.core.atomic); a read-only container directory is not an error."""
        if self.path is None or not self.run:
            return
        layers, experts = self.shape
        rows = [[round(0.5 * self.loaded.get((i, e), 0.0) + self.run.get((i, e), 0), 3) for e in range(experts)]
                for i in range(layers)]
        try:
            write_json(self.path, {"version": 1, "container": self.identity, "shape": list(self.shape),
                                   "counts": rows}, indent=None)
            self.saved_ok = True
        except OSError:
            self.saved_ok = False

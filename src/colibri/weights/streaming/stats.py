"""The streaming store's bookkeeping: the tier of each page (PageState) and the cumulative counters (StreamStats)
that every part of the store adds to. Counters only grow (GenerationMetrics takes differences), except that a
guessed read cancelled before it started is taken back."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PageState(enum.Enum):
    ON_DISK = "on_disk"
    LOADING = "loading"
    RESIDENT = "resident"
    PINNED = "pinned"


@dataclass
class StreamStats:
    bytes_read: int = 0  # everything read from the data files, pinned pages included
    page_reads: int = 0
    hits: int = 0  # uses of streamed pages served by bytes read for an earlier use (cached experts)
    misses: int = 0  # uses that needed a read (prefetched or on demand)
    hit_bytes: int = 0
    miss_bytes: int = 0
    expert_hits: int = 0
    expert_misses: int = 0
    expert_pinned_uses: int = 0  # routed experts that were pinned (neither hit nor miss: never streamed)
    row_bytes_read: int = 0  # lookup rows and head blocks
    verified_pages: int = 0
    io_wait_s: float = 0.0
    lookahead_predicted: int = 0  # router lookahead: experts guessed for a layer before it ran
    lookahead_correct: int = 0  # routed experts that had been guessed
    lookahead_routed: int = 0  # routed experts of the layers that had a guess (recall = correct / routed)
    lookahead_reads: int = 0  # expert pages read early for a guess
    lookahead_wasted_bytes: int = 0  # of those, bytes read for experts the layer did not route to
    lookahead_useful_reads: int = 0  # of those, pages of experts the layer did route to (reads moved earlier)

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}

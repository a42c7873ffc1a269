"""The streaming weight store: StreamingStore (store.py) composes parts with one job each: stats.py (page
tiers and counters), checks.py (checksums and unchanged data files), rows.py (tables read by rows), pins.py
(elastic pins beside the KV cache)."""

from colibri.weights.streaming.stats import PageState, StreamStats
from colibri.weights.streaming.store import StreamingStore

__all__ = ["PageState", "StreamStats", "StreamingStore"]

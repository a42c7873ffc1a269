"""The streaming weight store: StreamingStore (store.py) composes parts with one job each: staging.py (the
staging ring: slots streamed pages are read into, forward-order prefetch), experts.py (the MoE expert cache),
lookahead.py (reads of the experts the router is guessed to pick), pins.py (pinned pages, elastic pins beside the
KV cache), rows.py (tables read by rows), checks.py (checksums and unchanged data files), stats.py (page tiers
and counters)."""

from colibri.weights.streaming.stats import PageState, StreamStats
from colibri.weights.streaming.store import StreamingStore

__all__ = ["PageState", "StreamStats", "StreamingStore"]

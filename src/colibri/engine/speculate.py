"""Drafting for speculative decoding: n-gram guesses, and the cost gate that decides how many to make.

A decoding sequence's next tokens are guessed by matching its last n tokens (longest n first) against its own
context (prompt lookup: code, JSON and documents repeat what the prompt holds) and against a cache of n-grams
from sequences seen before, shared by all. The engine verifies the guesses in the sequence's next pass
(`Engine._sample`), so a draft never changes a token: it only lets one pass, one sweep of the weights, yield
several.

The gate. With a per-token acceptance rate `alpha` (estimated per sequence and per match length), the k-th
draft token adds alpha**k expected tokens to a pass and costs `b` seconds more, `b` being the measured slope of
decode-pass time against tokens in the pass (a streamed dense model: about 0, every pass is one sweep; MoE: the
union of routed experts grows with the tokens; all in RAM, compute-bound: the most). A pass of T tokens yields
about N = B tokens (B sequences) in `cost(T) = a + b*T` seconds, so a draft token pays while
alpha**k > b * N / cost(T) ("lam" below): the longest such k is drafted, none when alpha <= lam. Until two pass
sizes have been measured `b` counts as 0, which makes the first drafts the measurement; a sequence's draft
length also ramps up from RAMP_START with its verified drafts, so the prior alone never buys a long draft. The
engine cuts drafts whose pass would make the elastic budget unpin weights (`Engine._drafts_within_pins`): an
unpinned page would be read by every later pass, which costs more than a rejected draft saves.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import TYPE_CHECKING

from colibri.core.config import DEFAULT_NGRAM, DEFAULT_NGRAM_CACHE as DEFAULT_CACHE_ENTRIES

if TYPE_CHECKING:
    from colibri.engine.request import Request

ADAPTIVE_MAX = 16  # the most draft tokens the gate proposes
RAMP_START = 4  # a sequence's first draft holds at most this many tokens; each verified draft sets the next
# bound to 2 * accepted + 2 (doubling while every draft stands), so a text where drafts fail never pays for long
# ones on the prior alone (a long draft's pass costs a multiple of a plain one: docs/performance.md,
# "Speculative decoding")
EXPLORE_EVERY = 8  # steps a gated-off sequence waits before it drafts one token again (acceptance may change)
PRIOR = (1.0, 2.0)  # acceptance prior (successes, trials): 0.5, worth two observations
DECAY = 0.9  # weight of the past in a sequence's acceptance estimate, per verified draft
PASS_SIZES = 256  # passes of more tokens (prompt chunks) are not measured


# RAM the drafter's Python structures take, as upper bounds of tracemalloc measurements (docs/performance.md,
# "Speculative decoding"): bytes per shared-cache entry (with its share of the retained sequences), and bytes
# of a sequence's lookup index per token and n-gram length. The engine counts them in the KV pool's budget.
CACHE_ENTRY_BYTES = 400
INDEX_BYTES_PER_TOKEN_AND_N = 120


class NgramCache:
    """n-gram -> the tokens that followed it in a sequence seen before (its most recent one); at most `entries`
    n-grams, least recently used dropped first. Shared by every sequence of an engine."""

    def __init__(self, entries: int, ngram: int):
        self.entries, self.ngram = entries, ngram
        self.min_n = min(2, ngram)  # a single token says too little about what follows it in another text
        self._map: OrderedDict[tuple[int, ...], tuple[tuple[int, ...], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def nbytes(self) -> int:
        return len(self._map) * CACHE_ENTRY_BYTES

    def add(self, ids: list[int]) -> None:
        """Record the n-grams of a finished sequence (each maps to where it ended in `ids`)."""
        if self.entries <= 0:
            return
        src = tuple(ids)
        m = self._map
        for e in range(max(self.min_n, len(src) - 4 * self.entries), len(src)):
            for n in range(self.min_n, min(self.ngram, e) + 1):
                key = src[e - n:e]
                m[key] = (src, e)
                m.move_to_end(key)
        while len(m) > self.entries:
            m.popitem(last=False)

    def lookup(self, key: tuple[int, ...]) -> tuple[tuple[int, ...], int] | None:
        hit = self._map.get(key)
        if hit is not None:
            self._map.move_to_end(key)
        return hit


class SequenceDrafts:
    """One sequence's prompt-lookup index and acceptance estimates."""

    def __init__(self, ngram: int):
        self.ngram = ngram
        self.index: list[dict[tuple[int, ...], int]] = [{} for _ in range(ngram + 1)]  # n -> n-gram -> its end
        self.indexed = 0  # n-grams ending before this position are in the index
        self.accept: dict[int, list[float]] = {}  # match length -> [successes, trials] (decayed)
        self.idle = 0  # steps since it last drafted
        self.last_n = 0  # match length of the draft in flight
        self.ramp = RAMP_START  # the most tokens its next adaptive draft may hold

    def extend_index(self, ids: list[int]) -> None:
        """Index the n-grams that end before the last token (those with a known continuation)."""
        for e in range(max(1, self.indexed), len(ids)):
            for n in range(1, min(self.ngram, e) + 1):
                self.index[n][tuple(ids[e - n:e])] = e  # the most recent occurrence wins
        self.indexed = max(self.indexed, len(ids))

    def nbytes(self) -> int:
        return self.indexed * self.ngram * INDEX_BYTES_PER_TOKEN_AND_N

    def alpha(self, n: int) -> float:
        s, t = self.accept.get(n, PRIOR)
        return s / t

    def observe(self, n: int, accepted: int, rejected: bool) -> None:
        """`accepted` draft tokens stood, then one was rejected (or not); positions after it are untested."""
        s, t = self.accept.get(n, PRIOR)
        self.accept[n] = [s * DECAY + accepted, t * DECAY + accepted + int(rejected)]
        self.ramp = min(ADAPTIVE_MAX, 2 * accepted + 2)


class PassCost:
    """Seconds per decode pass against the tokens in it: a running mean per pass size, and a line through them."""

    def __init__(self):
        self.mean: dict[int, float] = {}
        self.count: dict[int, int] = {}

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > PASS_SIZES or seconds <= 0:
            return
        c = self.count.get(tokens, 0)
        w = 1.0 / min(c + 1, 16)  # a mean of the first 16, then an exponential average (timings drift)
        self.mean[tokens] = self.mean.get(tokens, seconds) * (1 - w) + seconds * w
        self.count[tokens] = c + 1

    def line(self) -> tuple[float, float] | None:
        """(a, b): seconds = a + b * tokens, least squares over the measured sizes (each weighted by its count, at
        most 16); None until some size is measured; b = 0 while only one is."""
        if not self.mean:
            return None
        pts = [(t, m, min(self.count[t], 16)) for t, m in self.mean.items()]
        s0 = sum(w for _, _, w in pts)
        s1 = sum(w * t for t, _, w in pts)
        s2 = sum(w * t * t for t, _, w in pts)
        sy = sum(w * m for _, m, w in pts)
        sty = sum(w * t * m for t, m, w in pts)
        den = s0 * s2 - s1 * s1
        b = max(0.0, (s0 * sty - s1 * sy) / den) if len(pts) > 1 and den > 0 else 0.0
        a = max(1e-9, (sy - b * s1) / s0)
        return a, b


class Speculator:
    """Drafts for an engine's decoding sequences. draft_tokens: None adapts the length (the gate above, up to
    ADAPTIVE_MAX), N > 0 drafts N whenever a match exists, 0 is off; ngram: the longest n-gram matched;
    cache_entries: the shared n-gram cache's size (0: none)."""

    def __init__(self, draft_tokens: int | None = None, ngram: int = DEFAULT_NGRAM,
                 cache_entries: int = DEFAULT_CACHE_ENTRIES):
        self.fixed = draft_tokens
        self.ngram = ngram
        self.cache = NgramCache(cache_entries, ngram)
        self.cost = PassCost()
        self.seqs: dict[int, SequenceDrafts] = {}
        self.drafted = self.accepted = 0
        self.passes = self.tokens = 0  # passes that sampled tokens, and the tokens they yielded
        self.gated_off = 0  # decode steps where a match existed but the gate drafted nothing
        self.cut = 0  # draft tokens the engine cut because their pass would have unpinned weights

    @property
    def enabled(self) -> bool:
        return self.fixed != 0

    # -- proposing -------------------------------------------------------------------------------------------

    def propose(self, req: "Request", room: int, sequences: int) -> list[int]:
        """Draft tokens to follow `req.ids` (at most `room`); `sequences`: how many decode in this step."""
        if not self.enabled or room <= 0:
            return []
        st = self.seqs.get(req.id)
        if st is None:
            st = self.seqs[req.id] = SequenceDrafts(self.ngram)
        ids = req.ids
        st.extend_index(ids)
        match = self._match(st, ids)
        if match is None:
            return []
        n, src, end = match
        k = min(room, self.fixed if self.fixed else min(st.ramp, self._gate(st, n, sequences)))
        if k <= 0:
            self.gated_off += 1
            st.idle += 1
            if self.fixed or st.idle < EXPLORE_EVERY:
                return []
            k = 1  # now and then one token, to notice acceptance coming back
        st.idle, st.last_n = 0, n
        draft: list[int] = []
        for j in range(k):  # continue from the match; past the end of `src` the draft continues itself
            at = end + j
            if src is ids or at < len(src):
                draft.append(src[at] if at < len(src) else draft[at - len(src)])
            else:
                break
        return draft

    def _match(self, st: SequenceDrafts, ids: list[int]) -> tuple[int, tuple | list, int] | None:
        """(n, source, end) of the longest suffix n-gram found: its own context first, then the shared cache."""
        for n in range(min(self.ngram, len(ids)), 0, -1):
            key = tuple(ids[len(ids) - n:])
            end = st.index[n].get(key)
            if end is not None:
                return n, ids, end
            if n >= self.cache.min_n:
                hit = self.cache.lookup(key)
                if hit is not None:
                    return n, hit[0], hit[1]
        return None

    def _gate(self, st: SequenceDrafts, n: int, sequences: int) -> int:
        alpha = st.alpha(n)
        line = self.cost.line()
        a, b = line if line is not None else (1.0, 0.0)
        lam = b * sequences / (a + b * sequences)
        if alpha <= lam or alpha <= 0:
            return 0
        if lam <= 0 or alpha >= 1:
            return ADAPTIVE_MAX
        return min(ADAPTIVE_MAX, int(math.log(lam) / math.log(alpha)))

    # -- after the pass --------------------------------------------------------------------------------------

    def verified(self, req: "Request", drafted: int, accepted: int, tokens: int) -> None:
        """A pass verified `drafted` tokens of `req`'s draft, `accepted` of them stood, it yielded `tokens` (a
        draft cut short by the end of the request counts no rejection)."""
        self.passes += 1
        self.tokens += tokens
        if drafted:
            self.drafted += drafted
            self.accepted += accepted
            st = self.seqs.get(req.id)
            if st is not None:
                st.observe(st.last_n, accepted, accepted < drafted and not req.finished)

    def measured(self, tokens: int, seconds: float) -> None:
        """One decode pass (every sequence in it decoding) of `tokens` tokens took `seconds`."""
        self.cost.add(tokens, seconds)

    def finished(self, req: "Request") -> None:
        """A sequence left: its text joins the shared cache."""
        self.seqs.pop(req.id, None)
        if self.enabled and req.token_ids:
            self.cache.add(req.ids)

    def nbytes(self) -> int:
        """RAM the drafts' indexes and the shared cache take now (an estimate from their sizes)."""
        return self.cache.nbytes() + sum(st.nbytes() for st in self.seqs.values())

    def counters(self) -> dict:
        line = self.cost.line() or (0.0, 0.0)
        return {"spec_drafted_tokens": self.drafted, "spec_accepted_tokens": self.accepted,
                "spec_acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
                "spec_gated_off_steps": self.gated_off, "spec_cut_for_memory_tokens": self.cut,
                "sampling_passes": self.passes, "sampled_tokens": self.tokens,
                "tokens_per_pass": round(self.tokens / self.passes, 4) if self.passes else 0.0,
                "decode_pass_base_s": round(line[0], 6), "decode_pass_per_token_s": round(line[1], 6),
                "ngram_cache_entries": len(self.cache), "spec_index_bytes": self.nbytes()}

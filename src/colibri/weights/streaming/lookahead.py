"""MoE router lookahead: reads of the experts a layer is guessed to route to, started before the layer runs, at
prefetch priority (below every demand read). A guess is settled when its layer routes: its recall is counted, a
page read for a wrong guess stays as a cache candidate when the expert cache has a free slot, else its read is
cancelled, or its slot freed once the read is done (never waited for)."""

from __future__ import annotations

from typing import Iterable

from colibri.formats.container import PageEntry
from colibri.weights.io import PREFETCH
from colibri.weights.streaming.experts import ExpertCache
from colibri.weights.streaming.staging import Staging
from colibri.weights.streaming.stats import StreamStats


def guessed_layers(pages: list[PageEntry], streamed: Iterable[int]) -> set[int]:
    """The layers whose experts stream: the ones a guess can read ahead for."""
    return {pages[i].layer for i in streamed if pages[i].kind == "expert"}


def reserved_slots(pages: list[PageEntry], streamed: Iterable[int], top_k: int, cache_slots: int) -> int:
    """Staging reserved for guesses, taken from the expert cache (at most half of it), so a guess finds a free
    slot under a tight budget instead of competing with cached experts it ranks below: the pages of a decode
    pass's top_k guessed experts, plus those of the top_k - 1 routed experts a decode layer reads beyond the
    staging's own slot (its demand reads are issued first and take free slots first). A guess's page is never
    cached before it is used, so a demand read can always take its slot."""
    per_expert: dict[tuple[int, int], int] = {}
    for i in streamed:
        if pages[i].kind == "expert":
            key = (pages[i].layer, pages[i].expert)
            per_expert[key] = per_expert.get(key, 0) + 1
    return min((2 * top_k - 1) * max(per_expert.values(), default=0), cache_slots // 2)


class Lookahead:
    def __init__(self, pages: list[PageEntry], page_of: dict[str, int], staging: Staging, cache: ExpertCache,
                 stats: StreamStats, layers: set[int], slots: int, num_layers: int):
        """`page_of`: tensor name -> page id; `layers`: the layers to guess for (guessed_layers, or none);
        `slots`: staging slots reserved for guesses (reserved_slots)."""
        self.pages, self.page_of, self.staging, self.cache, self.stats = pages, page_of, staging, cache, stats
        self.layers, self.slots = layers, slots
        self.recall = [[0, 0] for _ in range(num_layers)]  # per layer: [correct, routed]
        self._guess: dict[int, tuple[set[int], set[int]]] = {}  # layer -> (guessed experts, pages read for them)
        self._stale: set[int] = set()  # pages of wrong guesses still being read: freed once done
        self.soon: set[int] = set()  # pages of the experts the layer in progress routed to

    def wants(self, i: int) -> bool:
        return i in self.layers

    def begin_pass(self) -> None:
        for i in list(self._guess):  # guesses of a pass that failed before their layer
            self._settle(i, set())

    def route(self, i: int, routed: set[int], pids: set[int]) -> None:
        """Layer i routed to experts `routed`, whose pages `pids` it reads next."""
        self.soon = pids
        if self._stale:  # a wrong guess's page that is routed to after all is kept for this use
            self._stale.difference_update(self.soon)
        if i in self._guess:
            self._settle(i, routed)

    def predict(self, i: int, uses: dict[int, int], names: dict[int, list[str]]) -> None:
        """Layer i's experts guessed ahead (expert -> tokens, most likely first among equal counts): read the
        guessed ones not resident, most used first, into the slots reserved for guesses (`slots`), then into a
        free slot (one is kept free for demand reads) or, in a decode pass, over a cached expert that ranks
        lower (the guess enters the cache early)."""
        if i not in self.layers:
            return
        st = self.staging
        self._reap()
        self.stats.lookahead_predicted += len(uses)
        started = set()
        for e in sorted(uses, key=lambda e: -uses[e]):  # stable: the router's order breaks ties
            for pid in sorted({self.page_of[n] for n in names[e]}):
                if not st.unread(pid):
                    continue
                reserved = st.free and len(started) < self.slots
                if not reserved and len(st.free) <= 1 and not self.cache.make_way(pid):
                    return self._note(i, uses, started)
                st.start(pid, PREFETCH)
                started.add(pid)
        self._note(i, uses, started)

    def _note(self, i: int, uses: dict[int, int], started: set[int]) -> None:
        self.stats.lookahead_reads += len(started)
        old = self._guess.pop(i, None)
        self._guess[i] = (set(uses), started | (old[1] if old else set()))

    def _settle(self, i: int, routed: set[int]) -> None:
        """Layer i routed to `routed` (empty: its pass ended before it): count the guess's recall and let go of
        the pages read for experts it did not route to."""
        st = self.staging
        guessed, pids = self._guess.pop(i)
        if routed:
            hit = len(guessed & routed)
            self.stats.lookahead_correct += hit
            self.stats.lookahead_routed += len(routed)
            self.recall[i][0] += hit
            self.recall[i][1] += len(routed)
        for pid in pids:
            slot = st.slots.get(pid)
            if slot is not None and self.pages[pid].expert in routed:
                self.stats.lookahead_useful_reads += 1
            if slot is None or self.pages[pid].expert in routed or slot.cached or pid in st.held:
                continue
            if st.done(pid) and self.cache.take(pid):
                continue
            if st.cancel(pid):  # never started: nothing was read
                continue
            self.stats.lookahead_wasted_bytes += self.pages[pid].nbytes
            self._stale.add(pid)
        self._reap()

    def _reap(self) -> None:
        st = self.staging
        for pid in [p for p in self._stale if p not in st.slots or st.slots[p].future.done()]:
            self._stale.discard(pid)
            slot = st.slots.get(pid)
            if slot is not None and not slot.cached and pid not in st.held and slot.fresh:
                st.drop(pid)

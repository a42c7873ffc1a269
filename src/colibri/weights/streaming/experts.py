"""The MoE expert cache: staging slots left after pinning (less those reserved for router guesses) keep experts
resident after their scope, evicting by decayed use count, then recency (colibri.weights.usage, whose counts
this cache keeps and saves). A multi-token pass (prefill) only fills free cache slots: it never evicts the
decode working set. A cached expert stays in its staging slot, marked `Slot.cached`."""

from __future__ import annotations

from colibri.formats.container import PageEntry
from colibri.weights.streaming.staging import Staging
from colibri.weights.usage import USAGE_SAVE_EVERY, ExpertUsage


class ExpertCache:
    def __init__(self, pages: list[PageEntry], staging: Staging, usage: ExpertUsage | None, cap: int):
        """`usage`: the experts' use counts (None: no experts, nothing is cached); `cap`: cache slots."""
        self.pages, self.staging, self.usage, self.cap = pages, staging, usage, cap
        self.multi = False  # the current pass prefills several tokens of a sequence: it must not evict cached experts

    def begin_pass(self, tokens: int, multi: bool, passes: int) -> None:
        """Pass number `passes` over `tokens` tokens starts (`multi`: a prefill); counts decay with tokens."""
        self.multi = multi
        if self.usage:
            self.usage.tick(tokens)
            if passes % USAGE_SAVE_EVERY == 0:
                self.usage.save()

    def record(self, i: int, uses: dict[int, int]) -> None:
        """Layer i routed tokens to experts (expert -> tokens)."""
        if self.usage:
            self.usage.record(i, uses)

    def close(self) -> None:
        if self.usage:
            self.usage.save()

    def cached(self) -> list[int]:
        return [pid for pid, s in self.staging.slots.items() if s.cached]

    def admit(self, pid: int) -> bool:
        """Keep expert page `pid` resident after its scope? Into a free cache slot always; over a cached expert
        only in a single-token pass (decode), and only when that expert ranks lower."""
        if self.cap == 0 or self.usage is None:
            return False
        cached = self.cached()
        if len(cached) >= self.cap and (self.multi or not self._drop_lower(cached, pid)):
            return False
        self.staging.slots[pid].cached = True
        return True

    def take(self, pid: int) -> bool:
        """Keep page `pid` (read, not yet used) as a cached expert if a cache slot is free."""
        if self.usage is None or len(self.cached()) >= self.cap:
            return False
        self.staging.slots[pid].cached = True
        return True

    def make_way(self, pid: int) -> bool:
        """Free a cached expert's slot for page `pid` (read early) if it ranks higher: decode passes only, as
        `admit`."""
        if self.multi or self.usage is None:
            return False
        cached = [p for p in self.cached() if p not in self.staging.held]
        return bool(cached) and self._drop_lower(cached, pid)

    def evict(self, keep: set[int]) -> bool:
        """Drop the lowest-ranked cached expert outside `keep` (its slot is then free); False: none."""
        cached = [p for p in self.cached() if p not in keep]
        if not (cached and self.usage):
            return False
        self.staging.drop(min(cached, key=self._rank))
        return True

    def _drop_lower(self, cached: list[int], pid: int) -> bool:
        """Drop the lowest-ranked of the `cached` experts if it ranks below `pid`'s (its slot is then free)."""
        victim = min(cached, key=self._rank)
        if self._rank(victim) >= self._rank(pid):
            return False
        self.staging.drop(victim)
        return True

    def _rank(self, pid: int):
        return self.usage.rank((self.pages[pid].layer, self.pages[pid].expert))

"""The elastic budget measures what is held by RSS; after a long pass, memory glibc kept from the pass's freed
activations is given back (a heap trim) before pins are chosen, so it holds weights again instead of nothing.
The store's RSS and trim are stand-ins here: only the accounting is under test (the measured effect on a real
model: docs/performance.md, "Elastic pins after a long pass")."""

from __future__ import annotations

import torch

from colibri.formats.container import PageEntry
from colibri.weights.placement import Placement
from colibri.weights.streaming.pins import TRIM_SLACK, ElasticPins

MB = 1 << 20
PAGE = 30 * MB


class Process:
    """RSS = baseline + the staging slots + the pinned buffers + `kept` (heap a trim gives back) + `stuck`
    (memory it cannot)."""

    def __init__(self):
        self.baseline, self.staging, self.pinned, self.kept, self.stuck, self.trims = 100 * MB, 2 * PAGE, 0, 0, 0, 0

    def rss(self) -> int:
        return self.baseline + self.staging + self.pinned + self.kept + self.stuck

    def trim(self) -> None:
        self.trims += 1
        self.kept = 0


def elastic(proc: Process, pages: int = 8, limit: int = 400 * MB) -> ElasticPins:
    entries = [PageEntry(id=i, kind="ffn", layer=i, expert=None, tensors=[], nbytes=PAGE) for i in range(pages)]
    pl = Placement(limit, 0, [], list(range(pages)), [], 0, 2, PAGE, 0, 0, 0, 0, pages * PAGE, 2 * PAGE)

    def pin(pid):
        proc.pinned += PAGE
        return object()

    def release(pid):
        proc.pinned -= PAGE

    return ElasticPins(entries, {}, pl, limit, torch.bfloat16, pin, release, baseline=proc.baseline,
                       rss=proc.rss, trim=proc.trim)


def test_memory_a_long_pass_left_in_the_heap_is_trimmed_and_pinned_again():
    proc = Process()
    e = elastic(proc)
    e.fit(held=0, extra=0)  # 400 MB less 60 of staging: 11 pages would fit, there are 8
    assert len(e._extra) == 8 and proc.trims == 0
    e.fit(held=0, extra=200 * MB)  # a long pass: pins give way to its activations
    assert len(e._extra) == 4
    proc.kept = 100 * MB  # its activations, freed, stay in glibc's heaps
    e.fit(held=0, extra=0)  # the next (decode) pass: trimmed, measured again, all 8 pinned
    assert proc.trims == 1 and len(e._extra) == 8, (proc.trims, len(e._extra))


def test_no_trim_below_the_slack_and_none_again_for_what_a_trim_cannot_return():
    proc = Process()
    e = elastic(proc, limit=300 * MB)
    proc.kept = TRIM_SLACK - MB  # too little to be worth a trim: counted as held
    e.fit(held=0, extra=0)
    assert proc.trims == 0 and len(e._extra) == 7  # 300 - 60 - 15 MB: 7 pages of 30
    proc.kept, proc.stuck = 0, 100 * MB  # memory the heap cannot give back (a live allocation)
    e.fit(held=0, extra=0)
    assert proc.trims == 1 and len(e._extra) == 4
    for _ in range(3):  # measured as held every time, trimmed no more
        e.fit(held=0, extra=0)
    assert proc.trims == 1 and len(e._extra) == 4
    proc.kept = 2 * TRIM_SLACK  # grown well beyond what the last trim left: trimmed again
    e.fit(held=0, extra=0)
    assert proc.trims == 2 and len(e._extra) == 4
    proc.stuck = 0  # freed: the pins come back without a trim (the heap is empty since the last one)
    e.fit(held=0, extra=0)
    assert proc.trims == 2 and len(e._extra) == 8


def test_memory_the_caller_accounts_for_is_not_trimmed_for():
    proc = Process()
    e = elastic(proc)
    proc.stuck = 100 * MB  # the KV cache, which the caller passes as held
    e.fit(held=100 * MB, extra=0)
    assert proc.trims == 0 and len(e._extra) == 8

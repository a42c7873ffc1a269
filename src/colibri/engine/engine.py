"""The engine: many sequences, one weight sweep per step (continuous batching).

Each `step()` runs one forward pass over the packed tokens of every running sequence: one token for each
decoding sequence, then chunks of the prompts still being prefilled, up to `batch_size` tokens in all. Requests
join (`add_request`) and leave (finished, `abort`) at any step. The engine owns the sequences' KV: it reserves
room for a pass, commits the positions after it, and keeps the KV pool (every sequence's RAM and the cached
prefixes) within its budget: a sequence that outgrows the pool makes the newest running one leave RAM for the
swap file whole (preempted, resumed later with nothing recomputed). The model math sees only the packed batch.

Speculation (engine/speculate.py): before each step a decoding sequence may get draft tokens guessed from
n-grams; they ride in its pass after its last token and `_sample` keeps those the model agrees with, so a pass
can yield several tokens of a sequence for one sweep of the weights, and the tokens are those of plain decoding.

One lock serializes steps, so threads may each add a request and step until theirs finishes: every step
serves all of them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch

from colibri.engine.request import FINISHED, PREEMPTED, RUNNING, WAITING, Request, StreamChunk, token_ids
from colibri.engine.memory import MemoryGovernor, PassShape
from colibri.engine.plan import PassResult, Served, Slot, StepPlan
from colibri.engine.speculate import CACHE_ENTRY_BYTES, Speculator
from colibri.core.errors import ColibriError, InputError
from colibri.models.base import Batch
from colibri.kv.prefix import common_prefix
from colibri.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from colibri.core.config import EngineConfig
    from colibri.formats.tokenizer import Tokenizer
    from colibri.kv.cache import KVCache
    from colibri.kv.space import KVSpace
    from colibri.weights.store import WeightStore


class Engine:
    """Continuous batching over one model's math (`decoder`), weight store and KV space.

    tokenizer: the model's (or None); eos_ids: tokens that end a reply; context: positions a sequence may hold;
    pass_tokens: tokens per pass; max_sequences: sequences running at once; pool_bytes: the KV pool's RAM budget
    (None: unbounded); pass_bytes: (tokens, ctx, logit rows) -> bytes a pass needs besides weights and KV, under a
    memory limit only; config: the speculation settings (None: the speculator's defaults). The engine never
    calls back into whatever built it."""

    def __init__(self, decoder, store: WeightStore, space: KVSpace, *, tokenizer: Tokenizer | None,
                 eos_ids: Iterable[int], context: int, pass_tokens: int, max_sequences: int,
                 pool_bytes: int | None = None, pass_bytes: Callable[[int, int, int], int] | None = None,
                 config: EngineConfig | None = None):
        self.decoder, self.store, self.space = decoder, store, space
        self.tokenizer, self.eos_ids = tokenizer, set(eos_ids)
        self.context = context
        self.batch_tokens = pass_tokens
        self.max_sequences = max_sequences
        self.waiting: deque[Request] = deque()  # preempted ones first, then new ones in arrival order
        self.running: list[Request] = []
        self.steps = 0
        self.preemptions = 0
        self._ids = 0
        self.spec = Speculator() if config is None else Speculator(config.draft_tokens, config.ngram,
                                                                    config.ngram_cache_size)
        if pool_bytes is not None:  # the shared n-gram cache counts in the KV pool: at most an eighth of it
            self.spec.cache.entries = min(self.spec.cache.entries, pool_bytes // (8 * CACHE_ENTRY_BYTES))
        self.memory = MemoryGovernor(store, space, self.spec, pool_bytes, pass_bytes)
        self.decode_bytes = self.decode_tokens = 0  # weight bytes read in decode steps, and the tokens they yielded
        self.lock = threading.RLock()

    # -- requests --------------------------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], sampling: SamplingParams | None = None) -> Request:
        """Queue a request (it joins the next step with room). A prompt the context cannot hold is refused here,
        with an InputError; nothing else is affected."""
        if isinstance(prompt_ids, str):
            raise InputError("add_request takes token ids, not text: encode it first (model.prompt_ids(text))")
        ids = token_ids(prompt_ids)
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise InputError(f"sampling must be a SamplingParams (got {type(sampling).__name__})")
        if not ids:
            raise InputError("empty prompt: give at least one token of input")
        if len(ids) >= self.context:
            raise InputError(f"prompt is {len(ids)} tokens but the context holds {self.context} with the reply; "
                             "shorten the prompt or raise --ctx-length")
        with self.lock:
            self._ids += 1
            req = Request(self._ids, ids, sampling or SamplingParams(), self.tokenizer)
            if req.params.max_tokens == 0:
                req.finish("length")
            else:
                self.waiting.append(req)
        return req

    def abort(self, req: Request) -> None:
        """Stop a request now; its KV is released within this call."""
        if not isinstance(req, Request):
            raise InputError(f"abort takes a request that add_request returned (got {type(req).__name__})")
        with self.lock:
            if req.finished:
                return
            if req in self.waiting:
                self.waiting.remove(req)
            if req in self.running:
                self.running.remove(req)
            self._release(req)
            req.finish("abort")

    @property
    def unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def counters(self) -> dict:
        """Levels and totals for a metrics endpoint: sequences by state, steps, preemptions, KV pool use,
        speculation (drafted, accepted, tokens per pass, the gate's pass cost), weight bytes read per decoded
        token and, for a streamed MoE, the expert hit rate and the router lookahead's recall."""
        out = {"running_sequences": len(self.running), "waiting_sequences": len(self.waiting),
               "preempted_sequences": sum(1 for r in self.waiting if r.state == PREEMPTED),
               "engine_steps": self.steps, "preemptions": self.preemptions,
               "kv_pool_used_bytes": self.space.ram_bytes(), **self.spec.counters(),
               "decode_weight_bytes_read": self.decode_bytes, "decode_tokens": self.decode_tokens,
               "weight_bytes_per_token": round(self.decode_bytes / self.decode_tokens) if self.decode_tokens else 0}
        io = self._io()
        if io is not None:
            streamed = io["expert_hits"] + io["expert_misses"]
            out["expert_hit_rate"] = round(io["expert_hits"] / streamed, 4) if streamed else 0.0
            for k in ("lookahead_predicted", "lookahead_correct", "lookahead_routed", "lookahead_reads",
                      "lookahead_useful_reads", "lookahead_wasted_bytes", "lookahead_slots"):
                if k in io:
                    out[k] = io[k]
            if io.get("lookahead_routed"):
                out["lookahead_recall"] = round(io["lookahead_correct"] / io["lookahead_routed"], 4)
        return out

    # -- the step --------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """One forward pass over every running sequence: schedule, execute, update. Returns the requests that
        produced output in it."""
        with self.lock:
            plan = self._plan()
            if plan is None:
                return []
            t0, decode_only = time.perf_counter(), plan.decode_only
            plan = self._drafts_within_pins(plan)
            self.memory.make_room(self._grow(plan), plan.shape())
            result = self._execute(plan)
            if result is None:
                return []
            return self._update(result, t0 if decode_only else None)

    def _plan(self) -> StepPlan | None:
        """Admit waiting requests, draft, and schedule the pass (None: nothing to run)."""
        self._admit()
        self._draft()
        plan = self._schedule()
        return plan if plan.slots else None

    def _execute(self, plan: StepPlan) -> PassResult | None:
        """Reserve each slot's KV (a sequence that cannot is failed and left out) and run the forward pass; a failed
        pass fails its requests (None)."""
        io0, kv0 = self._io(), self.space.counters()
        parts, served = [], []
        for slot in plan.slots:
            req, n = slot.req, slot.tokens
            cache = req.cache
            try:
                cache.reserve(n)  # older blocks may go to the swap file
            except ColibriError as e:
                self._fail(req, e)
                continue
            ids = (req.ids[cache.length:] + req.draft)[:n]
            parts.append((ids, cache.length, cache, n - slot.rows))
            served.append(Served(req, ids, slot.sampled))
            req.draft = []
        if not served:
            return None
        try:
            logits = self.decoder.forward(self.store, Batch.pack(parts)).float()  # [R, V]
        except Exception as e:  # noqa: BLE001 - a failed pass fails its requests; each caller sees it
            for s in served:
                self._fail(s.req, e)
            return None
        self.steps += 1
        return PassResult(served, logits, (io0, self._io()), (kv0, self.space.counters()))

    def _update(self, result: PassResult, decode_t0: float | None) -> list[Request]:
        """Advance each served sequence's KV, sample its rows (accepting drafts), account the pass (a decode pass,
        started at decode_t0, feeds the speculator's cost gate and the bytes per token), and retire the finished
        sequences or commit the others' new blocks to the prefix cache."""
        (io0, io1), (kv0, kv1) = result.io, result.kv
        out, row, tokens = [], 0, 0
        share = 1 / len(result.served)
        for s in result.served:
            req = s.req
            req.cache.advance(len(s.ids), s.ids)
            m = req.metrics
            if io0 is not None:
                m.add_io(io0, io1, share)
            m.add_kv(kv0, kv1, share)
            if s.sampled:
                if not m.prefill_s:
                    m.prefill_s = time.perf_counter() - m._t0
                had, accepted = len(req.token_ids), req.accepted
                drafts = s.ids[len(s.ids) - s.sampled + 1:]
                self._sample(req, result.logits[row:row + s.sampled], drafts)
                got = len(req.token_ids) - had
                m.add_pass(len(drafts), req.accepted - accepted, got)
                self.spec.verified(req, len(drafts), req.accepted - accepted, got)
                tokens += got
                out.append(req)
            row += max(s.sampled, 1)
            if req.finished:
                self.running.remove(req)
                self._release(req)
            else:  # its newly filled blocks join the prefix cache (by reference) for sequences to come
                self.space.commit(req.cache)
        if decode_t0 is not None:
            self.spec.measured(sum(len(s.ids) for s in result.served), time.perf_counter() - decode_t0)
            self.decode_tokens += tokens
            if io0 is not None:
                self.decode_bytes += io1["bytes_read"] - io0["bytes_read"]
        return out

    def _drafts_within_pins(self, plan: StepPlan) -> StepPlan:
        """Drafts are optional work: a pass carrying them must fit beside the weights as pinned now, since a page
        the elastic budget unpinned for them would be read again by every later pass, for the rest of the run
        (docs/performance.md, "Speculative decoding", "Where prose lost its 5 %"). The longest draft is halved
        until the pass fits."""
        if not any(s.req.draft for s in plan.slots):
            return plan
        room = self.memory.draft_room()
        if room is None:
            return plan
        plan = StepPlan([Slot(s.req, s.tokens) for s in plan.slots])
        while True:
            slot = max(plan.slots, key=lambda s: len(s.req.draft))
            req = slot.req
            if not req.draft or self._grow(plan) + self.memory.pass_cost(plan.shape()) <= room:
                return plan
            keep = len(req.draft) // 2
            self.spec.cut += len(req.draft) - keep
            slot.tokens -= len(req.draft) - keep
            req.draft = req.draft[:keep]

    def _draft(self) -> None:
        """Fill `draft` of each decoding sequence (the speculator decides how many), leaving the pass room for
        every decoding sequence's own token and the prompt chunks waiting."""
        if not self.spec.enabled:
            return
        decoding = [r for r in self.running if r.pending == 1]
        spare = self.batch_tokens - len(decoding) - sum(r.pending for r in self.running if r.pending > 1)
        for req in decoding:
            # the model's own token follows the drafts: a request with r tokens to go drafts at most r - 1
            room = min(spare, req.params.max_tokens - len(req.token_ids) - 1,
                       self.context - len(req.ids) - 1, req.cache.max_pass - 1)
            req.draft = self.spec.propose(req, room, len(decoding)) if room > 0 else []
            spare -= len(req.draft)

    def _sample(self, req: Request, logits: torch.Tensor, drafts: list[int]) -> None:
        """Sample from logits [1 + len(drafts), V] in order: each draft stands while the token sampled at its
        row equals it (for a deterministic draft this is exactly the standard acceptance rule, so outputs keep
        the model's distribution); the KV of rejected drafts is dropped."""
        for j in range(len(drafts) + 1):
            token = req.sampler(logits[j], req.ids)
            req.accept(token, self.eos_ids, self.context)
            if req.finished or j == len(drafts) or token != drafts[j]:
                break
            req.accepted += 1
        req.drafted += len(drafts)
        if not req.finished and req.cache.length > len(req.ids) - 1:
            req.cache.truncate(len(req.ids) - 1)

    def _io(self) -> dict | None:
        return self.store.counters() or None  # None: all in RAM, nothing read

    def _admit(self) -> None:
        """Move waiting requests into the running set while there is room: sequences and KV pool."""
        mem = self.memory
        while self.waiting and len(self.running) < self.max_sequences:
            req = self.waiting[0]
            if req.state == PREEMPTED:
                shape = self._joining(1, req.cache.length + 1)
                if self.running and not mem.fits(req.cache.grow_bytes(1), shape):
                    return
                mem.make_room(req.cache.grow_bytes(1), PassShape(1, req.cache.length + 1, 1), pin=False)
                req.cache.swap_in()
            else:
                if self._computing_shared(req):
                    return
                mem.make_room(self.space.acquire_bytes(req.prompt_ids), PassShape(1, len(req.ids), 1), pin=False)
                cache, reused = self.space.acquire(req.prompt_ids)
                chunk = min(len(req.ids) - reused, self._chunk(cache))
                if self.running and not mem.fits(cache.grow_bytes(chunk), self._joining(chunk, len(req.ids))):
                    self.space.release(cache)
                    return
                req.cache = cache
                req.metrics.prefix_tokens = reused
                req.metrics.prefill_computed = len(req.ids) - reused
            self.waiting.popleft()
            req.state = RUNNING
            req.admitted_at = self.steps
            self.running.append(req)

    def _computing_shared(self, req: Request) -> bool:
        """Whether a running sequence is still prefilling a prefix of at least one block that `req`'s prompt
        shares: `req` then waits, and once admitted holds those blocks (from the prefix cache) instead of
        computing a copy of its own (it trades a few steps of latency, none when the pass is full of the other's
        chunks anyway, for the prefill of the shared part)."""
        B = self.space.layout.block
        for r in self.running:
            if r.pending > 1 and r.cache is not None and r.cache.length < len(r.prompt_ids):
                common = common_prefix(r.prompt_ids, req.prompt_ids) // B * B
                if common and r.cache.length < common:
                    return True
        return False

    def _grow(self, plan: StepPlan) -> int:
        """RAM the pass's reservations add: each sequence's blocks and read buffers."""
        return sum(s.req.cache.grow_bytes(s.tokens) for s in plan.slots)

    def _chunk(self, cache: "KVCache") -> int:
        return min(self.batch_tokens, cache.max_pass)

    def _joining(self, tokens: int, ctx: int) -> PassShape:
        """The next pass with a sequence joining with `tokens` tokens over `ctx` positions: the running sequences'
        pending tokens beside it, within the pass size."""
        pending = sum(r.pending for r in self.running)
        longest = max([ctx] + [r.cache.length + 1 for r in self.running])
        return PassShape(min(self.batch_tokens, pending + tokens), longest, len(self.running) + 1)

    def pool_capacity(self) -> int | None:
        """What the KV pool may hold now: the governor's cap beside a decode pass of the running sequences (the
        figure /metrics reports as the pool's capacity; under a memory limit it exceeds the reserve while pins
        give way). None: unbounded."""
        n = max(1, len(self.running))
        ctx = max((req.cache.length + 1 for req in self.running if req.cache is not None), default=1)
        return self.memory.pool_cap(PassShape(n, ctx, n))

    def _schedule(self) -> StepPlan:
        """The slots of this pass: every decoding sequence, then prompt chunks, within batch_tokens; preempting the
        newest sequences while their growth would overflow the KV pool. Under a memory limit the pool's room
        depends on the pass (`MemoryGovernor.pool_cap`): prompt chunks are halved first, down to one token."""
        prefill = self.batch_tokens  # tokens of prompt chunks this pass may carry
        while True:
            budget, left, plan = self.batch_tokens, prefill, StepPlan([])
            decoding = [r for r in self.running if r.pending == 1]
            prefilling = [r for r in self.running if r.pending > 1]
            for req in decoding + prefilling:
                room = min(budget, req.cache.max_pass, budget if req.pending == 1 else left)
                n = min(req.pending, room)
                if n <= 0:
                    break
                if req.pending > 1:
                    left -= n
                if req.draft:  # drafts ride along only whole, after all pending tokens, within the context
                    if n + len(req.draft) <= room and len(req.ids) + len(req.draft) < self.context \
                            and n == req.pending:
                        n += len(req.draft)
                    else:
                        req.draft = []
                plan.slots.append(Slot(req, n))
                budget -= n
            if self.memory.pool_bytes is None or len(self.running) <= 1:
                return plan
            if self.memory.fits(self._grow(plan), plan.shape()):
                return plan
            if any(req.draft for req in self.running):  # drafts are the first to go: they never preempt
                for req in self.running:
                    req.draft = []
                prefill = self.batch_tokens
                continue
            chunks = sum(s.tokens for s in plan.slots if s.req.pending > 1)
            if self.memory.elastic and chunks > 1:
                prefill = chunks // 2  # a smaller pass leaves the pool more room
                continue
            self._preempt(max(self.running, key=lambda r: (r.admitted_at, r.id)))
            prefill = self.batch_tokens

    def _preempt(self, req: Request) -> None:
        """The whole sequence leaves RAM for the swap file; it resumes, first in line, when there is room."""
        try:
            req.cache.swap_out()
        except ColibriError as e:
            self.running.remove(req)
            self._release(req)
            req.fail(InputError(f"the KV pool ({self.memory.pool_bytes} bytes) is full and this sequence could not be "
                                f"moved to the swap file: {e}"))
            return
        self.running.remove(req)
        req.state = PREEMPTED
        self.preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        self.spec.finished(req)
        if req.cache is not None:
            cache, req.cache = req.cache, None
            if cache.swapped:  # nothing of it in RAM to keep: its slots are freed
                cache.release()
            self.space.release(cache)

    def _fail(self, req: Request, error: BaseException) -> None:
        if req in self.running:
            self.running.remove(req)
        self._release(req)
        req.fail(error)

    # -- whole sequences, outside the step loop --------------------------------------------------------------

    @torch.inference_mode()
    def score(self, ids: list[int], chunk: int | None = None, hidden: bool = False) -> Iterator[torch.Tensor]:
        """Logits of every position of `ids` (float32 [n, V] per chunk of at most `chunk` tokens; hidden: the
        final norm's output [n, D] instead), in a fresh cache of its own that is released afterwards; steps of
        other requests may run between chunks."""
        if len(ids) > self.context:
            raise InputError(f"input is {len(ids)} tokens but the context holds {self.context}")
        cache = self.space.new_cache()
        try:
            step = min(chunk or self.batch_tokens, self._chunk(cache))
            for s in range(0, len(ids), step):
                part = ids[s:s + step]
                with self.lock:
                    # logits of every row are the caller's, outside the budget: the pass is charged one
                    self.memory.make_room(cache.grow_bytes(len(part)),
                                          PassShape(len(part), cache.length + len(part), 1))
                    cache.reserve(len(part))
                    logits = self.decoder.forward(self.store, Batch.pack([(part, cache.length, cache, 0)]), hidden)
                    cache.advance(len(part), part)
                yield logits.float()
        finally:
            with self.lock:
                cache.release()

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StreamChunk]:
        """One request's chunks as they come, stepping the engine (and every other request in it) meanwhile;
        closing the iterator early aborts the request. A refused or failed request raises its error."""
        req = self.add_request(prompt_ids, params)
        try:
            while True:
                done = req.finished  # read first: a request's last chunk is queued before it is marked finished
                yield from req.take()
                if done:
                    break
                with self.lock:
                    if not req.finished and not req._chunks:
                        self.step()
            if req.error is not None:
                raise req.error
        finally:
            if not req.finished:
                self.abort(req)

    def run(self, requests: list[Request]) -> None:
        """Step until every one of `requests` has finished."""
        while any(not r.finished for r in requests):
            self.step()

    def close(self) -> None:
        with self.lock:
            for req in list(self.waiting) + list(self.running):
                self.abort(req)


__all__ = ["Engine", "Request", "StreamChunk", "WAITING", "RUNNING", "PREEMPTED", "FINISHED"]

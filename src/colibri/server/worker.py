"""The engine thread: the only thread that touches the model. HTTP handlers hand it jobs and aborts.

It loads the model (after the server's socket is up, so /health answers meanwhile), then loops: take the new
jobs and the aborts, run one `Engine.step()` while any request is unfinished, and hand each job's new text to
its asyncio queue with `loop.call_soon_threadsafe`; with nothing to do it sleeps on a condition. An abort takes
effect before the next step, so a disconnected client's sequence and its KV blocks are gone within one step.
A step that raises fails the requests in it (500 to their clients); the loop keeps serving the others.
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from colibri.core.config import EngineConfig
from colibri.core.errors import ColibriError, oom_text, out_of_memory
from colibri.engine.sampling import SamplingParams
from colibri.server.schema import APIError

LOADING, READY, DRAINING, FAILED, STOPPED = "loading", "ready", "draining", "failed", "stopped"
RATE_WINDOW_S = 10.0  # tokens/s and read GB/s are averaged over the steps of the last 10 s
PICTURE_EVERY_S = 0.25  # the store's picture (per-layer tiers, expert heat) is taken at most this often, and only
# while a dashboard watches: it walks every page, which a step without a watcher should not pay for


@dataclass
class Event:
    kind: str  # "delta" (text, tokens, logprobs) | "done" (finish_reason, error, metrics)
    text: str = ""
    tokens: int = 0
    logprobs: list = field(default_factory=list)  # [(token id, TokenLogprobs)] when the request asked for them
    finish_reason: str | None = None
    error: APIError | None = None
    metrics: object = None


@dataclass(eq=False)
class Job:
    """One engine request as a handler sees it: events arrive on `queue` as (index, Event)."""

    ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int = 0
    t0: float = field(default_factory=time.perf_counter)
    req: object = None
    aborted: bool = False
    done: bool = False
    first_token_s: float | None = None
    queued: bool = True  # waiting for a sequence slot (counted in the queue depth)
    submitted: bool = False

    def deliver(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, event))
        except RuntimeError:  # the handler's loop is closed (server shutting down)
            pass


def load_model(config: EngineConfig):
    """The model `config` names, loaded as `colibri run` loads it."""
    from colibri.runtime.model import load
    return load(config)


def engine_error(e: BaseException) -> APIError:
    """The answer to a request the engine failed on: running out of memory is 503 (the server keeps serving; a
    shorter request, or the same under less load, may pass), anything else 500."""
    if out_of_memory(e):
        return APIError(503, f"out of memory serving this request ({oom_text(e)}); retry with a shorter prompt or"
                        " fewer tokens, or start the server with --memory-limit", code="out_of_memory")
    return APIError(500, f"the engine failed on this request: {type(e).__name__}: {e}", code="engine_error")


class Worker:
    """Owns the model; `submit` and `abort` are called from the HTTP side, everything else runs in its thread.

    `load(config)` builds the model in the engine thread (default `load_model`); a caller that serves a model
    built another way, or wraps the loaded one, passes its own."""

    def __init__(self, config: EngineConfig, max_queue: int, metrics=None, load: Callable | None = None):
        self.config = config
        self.max_queue = max_queue
        self.metrics = metrics
        self._load_model = load or load_model
        self.state = LOADING
        self.error: str | None = None
        self.model = None
        self.load_s: float | None = None
        self._cond = threading.Condition()
        self._inbox: list[Job] = []
        self._aborts: list[Job] = []
        self._jobs: list[Job] = []  # submitted to the engine, not finished
        self._outstanding = 0  # jobs submitted and not done (under _cond)
        self._stop = False
        self._cutoff: float | None = None  # monotonic time the drain ends (set by drain)
        self._durations: deque[float] = deque(maxlen=32)
        self._steps: deque[tuple[float, int, int, float]] = deque()  # (time, tokens, bytes read, read seconds)
        self.snapshot: dict = {}
        self.last: dict = {}  # the dashboard's figures of the latest finished request (its _row)
        self.watchers = 0  # dashboards connected (watch(); the engine thread only reads it)
        self._picture_at = 0.0
        self._want_picture = False  # a dashboard just connected: publish a picture without waiting for a step
        self.on_failed = None  # called (from the engine thread) when the model failed to load
        self._thread = threading.Thread(target=self._main, name="colibri-engine", daemon=True)

    # -- the HTTP side -----------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def check_ready(self) -> None:
        if self.state == DRAINING:
            raise APIError(503, "the server is shutting down; send the request to another instance",
                           code="shutting_down")
        if self.state == LOADING:
            raise APIError(503, "the model is still loading; retry shortly (GET /health shows the state)",
                           code="model_loading", headers={"Retry-After": "2"})
        if self.state != READY:
            raise APIError(503, f"the model is not available: {self.error or self.state}", code="model_unavailable")

    def submit(self, jobs: list[Job]) -> None:
        """Queue jobs for the engine, all or none: 429 when they would overflow the running sequences plus the
        bounded queue."""
        self.check_ready()
        most = self.config.max_sequences + self.max_queue
        if len(jobs) > most:
            raise APIError(400, f"{len(jobs)} prompts in one request, but this server takes at most {most} at once"
                                " (--max-sequences plus --max-queue); split the list", param="prompt",
                           code="too_many_prompts")
        with self._cond:
            room = self.config.max_sequences + self.max_queue - self._outstanding
            if len(jobs) > room:
                raise APIError(429, f"the server is busy: {self._outstanding} requests in flight (at most"
                                    f" {self.config.max_sequences} running and {self.max_queue} queued); retry"
                                    " after the time in Retry-After", code="queue_full",
                               headers={"Retry-After": str(self.retry_after())})
            self._outstanding += len(jobs)
            for job in jobs:
                job.submitted = True
            self._inbox.extend(jobs)
            self._cond.notify()

    def in_flight(self) -> int:
        """Requests accepted and not yet answered: running, queued, or taken in but not yet admitted (read live,
        unlike the snapshot, which lags by up to one engine step)."""
        with self._cond:
            return self._outstanding

    def abort(self, job: Job) -> None:
        """Stop a job (its client went away); the engine thread drops it before its next step."""
        with self._cond:
            if job.submitted and not job.done and not job.aborted:
                job.aborted = True
                self._aborts.append(job)
                self._cond.notify()

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the recent mean request time, between 1 and 60."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return int(min(60, max(1, math.ceil(mean))))

    def drain(self, grace_s: float) -> None:
        """The server is going down: refuse new jobs (503) from now, and end those still unfinished after grace_s
        seconds with a 503 'shutting_down' error (their handlers answer it, so every connection closes cleanly).
        Idempotent (a second signal keeps the first deadline)."""
        with self._cond:
            if self._cutoff is not None:
                return
            if self.state in (LOADING, READY):
                self.state = DRAINING
            self._cutoff = time.monotonic() + grace_s
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def watch(self, change: int) -> None:
        """A dashboard connected (+1) or left (-1); a new one gets the store's picture at once, even when idle."""
        with self._cond:
            self.watchers += change
            if change > 0:
                self._want_picture = True
                self._cond.notify()

    def rates(self) -> tuple[float, float]:
        """(generated tokens/s, weight read GB/s) over the steps of the last RATE_WINDOW_S seconds."""
        now = time.perf_counter()
        steps = [s for s in list(self._steps) if s[0] >= now - RATE_WINDOW_S]
        tokens = sum(s[1] for s in steps)
        nbytes, read_s = sum(s[2] for s in steps), sum(s[3] for s in steps)
        return tokens / RATE_WINDOW_S, (nbytes / read_s / 1e9 if read_s > 0 else 0.0)

    # -- the engine thread -------------------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._load()
        except BaseException as e:  # noqa: BLE001 - the server stays up and reports it on /health
            self.error = (str(e) if isinstance(e, ColibriError) else
                          f"out of memory ({oom_text(e)}); start the server with --memory-limit" if out_of_memory(e)
                          else f"{type(e).__name__}: {e}")
            self.state = FAILED
            self._refuse_all(APIError(503, f"the model failed to load: {self.error}", code="model_unavailable"))
            if self.on_failed is not None:
                self.on_failed()
            return
        try:
            self._loop()
        finally:
            self._shutdown()

    def _load(self) -> None:
        t0 = time.perf_counter()
        self.model = self._load_model(self.config)
        self.load_s = time.perf_counter() - t0
        self._publish()
        with self._cond:
            if self.state == LOADING:  # a drain that began during the load keeps refusing
                self.state = READY
        print(f"colibri serve: model loaded in {self.load_s:.1f} s", file=sys.stderr, flush=True)

    def _loop(self) -> None:
        eng = self.model.engine
        while True:
            with self._cond:
                while not (self._inbox or self._aborts or self._stop or eng.unfinished or self._cut() or
                           self._want_picture):
                    self._cond.wait(None if self._cutoff is None else max(0.0, self._cutoff - time.monotonic()))
                if self._stop:
                    return
                cut = self._cut()
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
            for job in aborts:
                if job.req is not None and not job.req.finished:
                    eng.abort(job.req)
                self._finish(job, "abort")
            if cut:  # the grace after SIGTERM is over: what still runs ends with an error its client can read
                self._end_all(APIError(503, "the server is shutting down; the request was stopped before it"
                                            " finished", code="shutting_down"))
            for job in inbox:
                if job.aborted:
                    continue
                try:
                    job.req = eng.add_request(job.ids, job.params)
                except ColibriError as e:
                    self._finish(job, "error", APIError(400, str(e), code="invalid_request"))
                    continue
                self._jobs.append(job)
            if eng.unfinished:
                io0, t = self._io(), time.perf_counter()
                before = sum(len(j.req.token_ids) for j in self._jobs)
                try:
                    eng.step()
                except Exception as e:  # noqa: BLE001 - fail what was in the step, keep serving
                    self._fail_running(e)
                self._record(t, io0, sum(len(j.req.token_ids) for j in self._jobs) - before)
            self._deliver()
            self._publish()

    def _deliver(self) -> None:
        keep = []
        for job in self._jobs:
            req = job.req
            if job.queued and req.state != "waiting":
                job.queued = False
            chunks = req.take()
            if chunks:
                tokens = sum(1 for c in chunks if c.token_id is not None)
                if tokens and job.first_token_s is None:
                    job.first_token_s = time.perf_counter() - job.t0
                    if self.metrics is not None:
                        self.metrics.ttft.observe(job.first_token_s)
                lps = [(c.token_id, c.logprobs) for c in chunks if c.logprobs is not None and c.token_id is not None]
                job.deliver(Event("delta", "".join(c.text for c in chunks), tokens, lps))
            if req.finished:
                if job.aborted:
                    continue  # already answered by _finish("abort")
                err = None
                if req.error is not None:
                    err = engine_error(req.error)
                self._finish(job, req.finish_reason, err, req.metrics)
            else:
                keep.append(job)
        self._jobs = keep

    def _finish(self, job: Job, reason: str, error: APIError | None = None, metrics=None) -> None:
        if job.done:
            return
        with self._cond:
            job.done = True
            self._outstanding -= 1
        duration = time.perf_counter() - job.t0
        if reason != "abort":
            self._durations.append(duration)
        if job.req is not None and job.req.metrics.generated_tokens:
            self.last = self._row(job, time.perf_counter())
        if self.metrics is not None:
            self.metrics.finished(reason, duration, metrics)
        job.deliver(Event("done", finish_reason=reason, error=error, metrics=metrics))

    def _fail_running(self, error: BaseException) -> None:
        eng = self.model.engine
        print(f"colibri serve: engine step failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        for job in self._jobs:
            if job.req.state == "running" and not job.req.finished:
                try:
                    eng.abort(job.req)
                except Exception:  # noqa: BLE001 - its KV may be in a bad state; the request is gone either way
                    pass
                job.req.fail(error)

    def _io(self) -> dict | None:
        return self.model.store.counters() or None  # None: all in RAM, nothing read

    def _record(self, t0: float, io0: dict | None, tokens: int) -> None:
        io1 = self._io()
        nbytes = io1["bytes_read"] - io0["bytes_read"] if io0 else 0
        read_s = io1["read_active_s"] - io0["read_active_s"] if io0 else 0.0
        now = time.perf_counter()
        self._steps.append((now, tokens, nbytes, read_s))
        while self._steps and self._steps[0][0] < now - RATE_WINDOW_S:
            self._steps.popleft()
        if self.metrics is not None:
            self.metrics.step(now - t0, tokens)

    def _publish(self) -> None:
        """A consistent snapshot of the engine's, the store's and the KV space's counters for /metrics (read by
        the HTTP side without touching the engine)."""
        m = self.model
        now = time.perf_counter()
        picture = self.snapshot.get("picture") if self.watchers else None
        want, self._want_picture = self._want_picture, False
        if self.watchers and (want or now - self._picture_at >= PICTURE_EVERY_S):
            picture, self._picture_at = m.store.picture(), now
        self.snapshot = {"engine": m.engine.counters(), "store": self._io() or {}, "kv": m.kv.counters(),
                         "kv_pool_capacity_bytes": m.engine.pool_capacity(),
                         "queued": sum(1 for j in self._jobs if j.queued) + len(self._inbox),
                         "requests": [self._row(j, now) for j in self._jobs], "last": self.last, "picture": picture}

    @staticmethod
    def _row(job: Job, now: float) -> dict:
        """One line of the dashboard's request table."""
        req, m = job.req, job.req.metrics
        decode = (m.generated_tokens - 1) / m.decode_s if m.generated_tokens > 1 and m.decode_s > 0 else None
        return {"id": req.id, "state": "queued" if job.queued else req.state, "prompt_tokens": len(req.prompt_ids),
                "reused_tokens": m.prefix_tokens, "generated_tokens": m.generated_tokens,
                "max_tokens": req.params.max_tokens, "ttft_s": job.first_token_s, "age_s": now - job.t0,
                "decode_tok_s": decode, "prefill_tok_s": m.prefill_computed / m.prefill_s if m.prefill_s > 0 else None}

    def _refuse_all(self, error: APIError) -> None:
        with self._cond:
            jobs, self._inbox = self._inbox, []
        for job in jobs:
            self._finish(job, "error", error)

    def _cut(self) -> bool:
        return self._cutoff is not None and time.monotonic() >= self._cutoff and bool(self._jobs or self._inbox)

    def _end_all(self, error: APIError) -> None:
        eng = self.model.engine
        for job in self._jobs:
            if job.req is not None and not job.req.finished:
                eng.abort(job.req)
            self._finish(job, "error", error)
        self._jobs = []
        self._refuse_all(error)

    def _shutdown(self) -> None:
        self.state = STOPPED
        err = APIError(503, "the server is shutting down", code="shutting_down")
        for job in self._jobs:
            self._finish(job, "error", err)
        self._jobs = []
        self._refuse_all(err)
        if self.model is not None:
            self.model.close()

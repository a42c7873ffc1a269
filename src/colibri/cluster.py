"""`colibri batch --ray`: the same job over a Ray cluster, one engine per node (or per `--replicas`); and
`colibri stage`, which puts a container on every node's disk for it.

Ray (an optional extra) places the engines and carries lines and results; everything else is colibri.batch's:
the input's parsing, the resume from the output, the result records, the writer. Each node's engine is an actor
that loads `--model` from that node's own disk (the embedded default: the node's own converted copy), so the
weights never cross the network; only lines (a prompt) and results (a record) do.

The driver keeps at most `window` lines in flight per engine (twice its --max-sequences, as on one machine: the
engine always has the next line queued), so a slow node holds no more than its share and the input is never
all in the object store. Results are written once, by the driver, in the order they finish (as on one machine);
a rerun skips the ids already written. An engine whose actor dies (its node lost, its process killed) has its
in-flight lines re-queued to the others, which is safe because nothing of a line is written before its result
is whole: a line is written exactly once, by whichever engine finishes it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import time
from collections import deque
from pathlib import Path

from colibri import batch
from colibri.core.config import EngineConfig
from colibri.core.errors import ColibriError, InputError

INSTALL = "--ray needs Ray, an optional extra: pip install 'colibri[ray]' (from a checkout: pip install -e \".[ray]\")"


def import_ray():
    """The ray module, or an InputError saying in one line how to install it."""
    try:
        import ray
    except ImportError:
        raise InputError(INSTALL) from None
    return ray


def connect(address: str | None):
    """Ray, connected: to `address`, else to RAY_ADDRESS or the cluster started on this machine, else to a new
    local one. A process that already called ray.init (a test, a notebook) keeps its connection."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=address or None, include_dashboard=False)
    return ray


class Engine:
    """One engine on one node: each `generate` call adds a line and returns its record when it finishes. Calls
    run concurrently (a threaded actor) and share the engine: whichever call holds the lock runs one step for
    every request in it, so `window` lines in flight decode together as in one machine's `colibri batch`."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model = None
        self._lock = threading.Lock()

    def load(self) -> tuple[None, str | None]:
        """Load the model from this node's disk: (None, None), or (None, the error in one line)."""
        try:
            cfg = self.config
            if cfg.model is None:
                from colibri.convert.pipeline import default_container
                cfg = cfg.replace(model=str(default_container()))
            from colibri.runtime.model import load
            self.model = load(cfg)
        except ColibriError as e:
            return None, f"{os.uname().nodename}: {e}"
        return None, None

    def pid(self) -> int:
        return os.getpid()

    def generate(self, line: batch.Line) -> tuple[dict | None, str | None]:
        """(record, None) when the line finished, (None, error) when the engine refused or failed it."""
        eng, start = self.model.engine, time.perf_counter()
        try:
            with self._lock:
                req = eng.add_request(batch.line_ids(self.model, line), batch.SamplingParams(**line.sampling))
            while not req.finished:
                with self._lock:
                    if not req.finished:  # another call may have stepped it meanwhile
                        eng.step()
        except ColibriError as e:
            return None, str(e)
        if req.error is not None:
            return None, str(req.error)
        return batch.record(self.model, line, req, start), None


def placements(ray, replicas: int | None, threads: int | None) -> list[tuple[dict, int]]:
    """(actor options, compute threads) per engine: one per alive node with all its CPUs, or `replicas` spread
    over the nodes with an equal share of the cluster's CPUs (--threads: that many each). Ray reserves the
    threads as the actor's CPUs, so its accounting is honest, but never more than there are (a fraction of one
    where replicas outnumber CPUs), so an engine is never left waiting for CPUs that do not exist."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    nodes = [(n["NodeID"], float(n["Resources"].get("CPU", 1))) for n in ray.nodes() if n["Alive"]]
    if replicas is None:
        return [(dict(num_cpus=min(t, cpus), scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)), t)
                for node, cpus in nodes for t in [threads or max(1, int(cpus))]]
    share = sum(cpus for _, cpus in nodes) / replicas
    t = threads or max(1, int(share))
    return [(dict(num_cpus=min(t, share), scheduling_strategy="SPREAD"), t)] * replicas


class ClusterBatch:
    """The driver: lines out to the engines with back-pressure, results written as they come back."""

    def __init__(self, ray, engines: list, out: batch.Output, report, window: int):
        self.ray, self.out, self.report, self.window = ray, out, report, window
        self.engines = list(engines)
        self.skipped = 0
        self.overhead_s = 0.0  # the driver's own time (everything but waiting for results): per line, see docs

    def run(self, lines: list[batch.Line], bar) -> None:
        ray = self.ray
        from ray.exceptions import RayActorError
        todo, inflight = deque(lines), {}  # ref -> (line, engine)
        load = {e: 0 for e in self.engines}
        t0 = time.perf_counter()
        while todo or inflight:
            t = time.perf_counter()
            if not self.engines:
                raise ColibriError(f"every engine of the cluster is gone; {self.out.written} lines are written; run"
                                   " the same command again to resume")
            for e in self.engines:
                while todo and load[e] < self.window:
                    line = todo.popleft()
                    inflight[e.generate.remote(line)] = (line, e)
                    load[e] += 1
            self.overhead_s += time.perf_counter() - t
            ready, _ = ray.wait(list(inflight), num_returns=1)
            t = time.perf_counter()
            for ref in ready:
                line, e = inflight.pop(ref)
                load[e] -= 1
                try:
                    rec, error = ray.get(ref)
                except RayActorError:
                    todo.appendleft(line)  # it runs again, whole, on another engine
                    if e in self.engines:
                        self.engines.remove(e)
                        self.report(f"an engine stopped with {load[e] + 1} lines in flight ({len(self.engines)}"
                                    " left); they run on the others")
                    continue
                if error is not None:
                    self.skip(line, error, bar)
                    continue
                self.out.write(rec)
                bar.update(1)
            bar.set_postfix_str(f"{self.out.tokens / (time.perf_counter() - t0):.1f} tok/s, {len(self.engines)}"
                                " engines", refresh=False)
            self.overhead_s += time.perf_counter() - t

    skip = batch.Batch.skip

    def close(self) -> None:
        for e in self.engines:
            self.ray.kill(e)


def start_engines(ray, config: EngineConfig, replicas: int | None) -> list:
    """The engines, each loaded on its node; an InputError naming the node where one cannot load."""
    cls = ray.remote(Engine)
    window = 2 * config.max_sequences
    engines = [cls.options(max_concurrency=window + 1, **opts).remote(config.replace(threads=t))
               for opts, t in placements(ray, replicas, config.threads)]
    started(ray, engines, [e.load.remote() for e in engines])
    return engines


def started(ray, actors: list, answers: list) -> list:
    """The values of the actors' first calls, each answering (value, None) or (None, an error line); an InputError
    with the first error, every actor stopped, where one failed or died (out of memory, a node lost)."""
    from ray.exceptions import RayActorError
    try:
        errors = [error for _, error in ray.get(answers) if error is not None]
    except RayActorError as e:
        errors = [f"an engine died while loading the model ({type(e).__name__}); see its node's Ray logs"]
    if errors:
        for a in actors:
            ray.kill(a)
        raise InputError(errors[0])
    return [value for value, _ in ray.get(answers)]


def batch_job(args, config: EngineConfig):
    """`start` for batch.run on the cluster at `args.ray`."""
    def start(out: batch.Output, report) -> ClusterBatch:
        ray = connect(args.ray)
        engines = start_engines(ray, config, args.replicas)
        report(f"{len(engines)} engines on {len({n['NodeID'] for n in ray.nodes() if n['Alive']})} nodes")
        return ClusterBatch(ray, engines, out, report, window=2 * config.max_sequences)
    import_ray()  # before the input is read: without Ray, one line saying how to install it
    return start


# `colibri stage`: a container copied onto every node's disk (or this machine's), then verified there.
CHUNK = 8 << 20  # bytes of a file per message to the nodes
AHEAD = 4  # chunks in flight per node: the driver reads ahead of the slowest node by at most this many


class Stager:
    """Writes one container to `dest` on this node: into a sibling staging directory, file by file in the order
    the chunks come, then checks every file's SHA-256 against the source's and every page's checksum, and only
    then renames it to `dest`. A `dest` already holding the same container (the same manifest) is checked, not
    rewritten; one holding anything else is refused."""

    def __init__(self, dest: str, manifest: bytes):
        self.dest = Path(dest)
        self.tmp = self.dest.parent / f".{self.dest.name}.staging-{os.getpid()}"
        self.manifest = manifest
        self.present = False
        self.error: str | None = None
        self._f = None
        self._hashes: dict[str, object] = {}

    def begin(self) -> tuple[str | None, bool]:
        """(None, whether `dest` already holds the container: then nothing needs sending), or (the error in one
        line, False). Call first."""
        where = os.uname().nodename
        if self.dest.exists():
            try:
                self.present = (self.dest / "manifest.json").read_bytes() == self.manifest
            except OSError:
                self.present = False
            if not self.present:
                return f"{where}: {self.dest} exists and is not this container; remove it or give another --output", \
                    False
            return None, True
        try:
            self.tmp.mkdir(parents=True)
        except OSError as e:
            return f"{where}: cannot create {self.tmp} ({e.strerror}); give a writable --output", False
        return None, False

    def write(self, name: str, data: bytes) -> None:
        """Append `data` to file `name` (chunks of one file arrive in order, files one after another)."""
        if self.present or self.error is not None:
            return
        try:
            if self._f is None or self._f.name != str(self.tmp / name):
                if self._f is not None:
                    self._f.close()
                self._f = open(self.tmp / name, "xb")
                self._hashes[name] = hashlib.sha256()
            self._f.write(data)
        except OSError as e:  # a full disk: said by finish, with the node's name
            self.error = f"{os.uname().nodename}: cannot write {self.tmp / name} ({e.strerror}); make room, stage again"
            return
        self._hashes[name].update(data)

    def finish(self, hashes: dict[str, str]) -> str | None:
        """Check what was written (or is there) against the source's hashes and checksums, then put it in place:
        None, or the error in one line (a staging directory is then removed)."""
        where = os.uname().nodename
        if self._f is not None:
            try:
                self._f.flush()
                os.fsync(self._f.fileno())
            except OSError as e:
                self.error = self.error or f"{where}: cannot write {self._f.name} ({e.strerror}); make room, stage" \
                                           " again"
            self._f.close()
            self._f = None
        if self.error is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return self.error
        root = self.dest if self.present else self.tmp
        if self.present:
            for name in hashes:
                self._hashes[name] = file_hash(root / name)
        bad = sorted(n for n, h in hashes.items() if n not in self._hashes or self._hashes[n].hexdigest() != h)
        error = f"{where}: {root / bad[0]}: differs from the source after the copy" if bad else None
        if error is None:
            from colibri.formats.container import ContainerCheckpoint
            ckpt = ContainerCheckpoint(root)
            try:
                damaged = next(iter(ckpt.verify()), None)
            finally:
                ckpt.close()
            if damaged is not None:
                error = f"{where}: {root}: checksum mismatch at {damaged[0]}: {damaged[1]}"
        if self.present:
            return error and error + "; remove it and stage again"
        if error is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return error
        fd = os.open(self.tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(self.tmp, self.dest)
        return None


def file_hash(path: Path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h


def stage(src: str, dest: str, address: str | None, report) -> int:
    """`colibri stage`: copy the container `src` to `dest` on this machine (address None) or on every node of the
    cluster at `address` ("": connect's default), and verify it there. Returns the number of copies."""
    from colibri.formats.container import ContainerCheckpoint
    from tqdm import tqdm
    ContainerCheckpoint(src).close()  # not a container, or an incomplete one: its error, before anything is sent
    root = Path(src)
    names = sorted(p.name for p in root.iterdir() if p.is_file())
    manifest = (root / "manifest.json").read_bytes()
    ray = None if address is None else connect(address)
    if ray is None:
        stagers = [Stager(dest, manifest)]
    else:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        cls = ray.remote(Stager)
        stagers = [cls.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                   .remote(dest, manifest) for n in ray.nodes() if n["Alive"]]

    def each(method: str, *args, to=None) -> list:
        """Call `method` on every stager (or those in `to`): the results locally, the object refs on the cluster."""
        return [getattr(s, method)(*args) if ray is None else getattr(s, method).remote(*args)
                for s in (stagers if to is None else to)]

    def results(values: list) -> list:
        return values if ray is None else ray.get(values)

    try:
        began = results(each("begin"))
        errors = [e for e, _ in began if e is not None]
        if errors:
            raise InputError(errors[0])
        copying = [s for s, (_, present) in zip(stagers, began) if not present]
        hashes, pending = {}, deque()
        total = sum((root / n).stat().st_size for n in names)
        with tqdm(total=total, unit="B", unit_scale=True, desc="stage", file=sys.stderr, dynamic_ncols=True) as bar:
            for name in names:
                h = hashlib.sha256()
                with open(root / name, "rb") as f:
                    while data := f.read(CHUNK):
                        h.update(data)
                        if copying:
                            pending.append(each("write", name, data if ray is None else ray.put(data), to=copying))
                        if len(pending) > AHEAD:
                            results(pending.popleft())  # back-pressure: the slowest node is at most AHEAD behind
                        bar.update(len(data))
                hashes[name] = h.hexdigest()
            while pending:
                results(pending.popleft())
        errors = [e for e in results(each("finish", hashes)) if e is not None]
        if errors:
            raise ColibriError(errors[0])
    finally:
        if ray is not None:
            for s in stagers:
                ray.kill(s)
    report(f"{dest}: verified on {len(stagers)} {'node' if len(stagers) == 1 else 'nodes'} (copied to"
           f" {len(copying)}, already there on {len(stagers) - len(copying)})")
    return len(stagers)

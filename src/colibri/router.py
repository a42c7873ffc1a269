"""`colibri serve --ray`: replicas of `colibri serve` on a Ray cluster behind one OpenAI-compatible endpoint.

Each replica is a Ray actor running the whole single-machine server (colibri.server: validation, tools,
streaming, /metrics) in a thread, on its node's address and its node's copy of --model. This module is only the
router in front of them: it reads each request's body, picks a replica, and relays the answer byte for byte.

Routing: a conversation goes to the replica that holds its prefix. The router keys a request by a chain of
hashes over its messages (chat) or its prompt in 256-character pieces (completions): h1 = H(m1), h2 = H(h1, m2),
... and remembers, for each key it has sent, which replica got it. The next turn of a conversation ([m1, reply,
m2]) shares h1 (at least) with the turn before, so it goes where m1's KV blocks are cached; the longest shared
key wins. A request that shares nothing, or whose replica is down, goes to the least-loaded replica (fewest
requests in flight through this router).

Failure: a replica that refuses the connection or drops it before its answer has started is marked down and the
request is retried on another (nothing was sent to the client yet). A replica that dies while streaming fails
only the requests it was streaming: each gets a final SSE error event (code `replica_lost`) and [DONE]; the
others carry on. /health answers how many replicas are up (200 while one is); /metrics is every up replica's
/metrics with the samples of the same name and labels summed, plus `colibri_replicas_up`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import threading
import time
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request  # module level: FastAPI resolves the handlers' annotations here
from fastapi.responses import JSONResponse, Response

from colibri.cluster import connect, placements, started
from colibri.core.config import EngineConfig
from colibri.core.errors import ColibriError

PIECE = 256  # characters of a completion prompt per routing key
MAX_KEYS = 1 << 16  # routing keys remembered (least recently used go first): about 6 MB
BODY_CAP = 16 << 20  # bytes of a request body the router reads (a replica has its own, smaller, limits)
HEALTH_PERIOD_S = 1.0


class Replica:
    """A Ray actor: one `colibri serve` on this node, on a free port of the node's address."""

    def __init__(self, config: EngineConfig, api_key: str | None, max_queue: int, name: str):
        self.config, self.api_key, self.max_queue, self.name = config, api_key, max_queue, name
        self.error: str | None = None

    def start(self) -> tuple[str | None, str | None]:
        """(the replica's base URL, None), or (None, the error in one line)."""
        import ray

        from colibri.server import listen, serve
        cfg = self.config
        try:
            if cfg.model is None:
                from colibri.convert.pipeline import default_container
                cfg = cfg.replace(model=str(default_container()))
            from colibri.runtime.model import open_model
            ckpt, _, _ = open_model(cfg.model_path())  # a wrong path or architecture: the error, not a dead port
            ckpt.close()
            host = ray.util.get_node_ip_address()
            sock = listen(host, 0)
            port = sock.getsockname()[1]
            sock.close()  # serve binds it again (SO_REUSEADDR): the moment between is the only race
        except ColibriError as e:
            return None, f"{os.uname().nodename}: {e}"

        def run() -> None:
            try:
                serve(cfg, host=host, port=port, api_key=self.api_key, max_queue=self.max_queue, name=self.name)
            except ColibriError as e:
                self.error = str(e)

        threading.Thread(target=run, daemon=True, name="colibri-replica").start()
        return f"http://{host}:{port}", None

    def pid(self) -> int:
        return os.getpid()


@dataclass(eq=False)
class Upstream:
    index: int
    url: str
    actor: object
    up: bool = True  # answers at all (a refused or dropped connection: down)
    ready: bool = False  # its /health says ready
    inflight: int = 0


def routing_keys(body: dict) -> list[str]:
    """The request's chain of prefix keys, shortest first (none for a body the replica will refuse)."""
    if isinstance(body.get("messages"), list):
        pieces = [json.dumps(m, sort_keys=True) for m in body["messages"]]
    elif isinstance(body.get("prompt"), str):
        p = body["prompt"]
        pieces = [p[i:i + PIECE] for i in range(0, len(p), PIECE)]
    else:
        return []
    keys, h = [], hashlib.sha256()
    for piece in pieces:
        h.update(piece.encode("utf-8", "surrogatepass") + b"\0")
        keys.append(h.copy().hexdigest())
    return keys


class Router:
    """The replicas, the routing table and the counters; `app()` is the HTTP side."""

    def __init__(self, upstreams: list[Upstream], model_id: str, api_key: str | None):
        self.upstreams, self.model_id, self.api_key = upstreams, model_id, api_key
        self.owners: OrderedDict[str, Upstream] = OrderedDict()
        self.routed = {"prefix": 0, "least_loaded": 0, "retried": 0, "lost": 0}

    def live(self) -> list[Upstream]:
        return [u for u in self.upstreams if u.up and u.ready]

    def pick(self, keys: list[str], tried: set) -> Upstream | None:
        """The replica holding the longest prefix of `keys`, else the least loaded; None when none is left."""
        live = [u for u in self.live() if u not in tried]
        for key in reversed(keys):
            owner = self.owners.get(key)
            if owner in live:
                self.routed["prefix"] += 1
                return owner
        if not live:
            return None
        self.routed["least_loaded"] += 1
        return min(live, key=lambda u: (u.inflight, u.index))

    def remember(self, keys: list[str], u: Upstream) -> None:
        for key in keys:
            self.owners[key] = u
            self.owners.move_to_end(key)
        while len(self.owners) > MAX_KEYS:
            self.owners.popitem(last=False)

    def down(self, u: Upstream) -> None:
        u.up = u.ready = False

    async def watch(self, client) -> None:
        """Poll every replica's /health: up, ready or down (a replica that comes back is used again)."""
        while True:
            for u in self.upstreams:
                try:
                    r = await client.get(u.url + "/health", timeout=2.0)
                    u.up, u.ready = True, r.status_code == 200
                except Exception:  # noqa: BLE001 (any failure to answer is "down")
                    self.down(u)
            await asyncio.sleep(HEALTH_PERIOD_S)

    def app(self):
        import httpx
        from colibri.server.app import ClosingStream, read_body
        from colibri.server.schema import APIError

        client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=64))

        @asynccontextmanager
        async def lifespan(app):
            watcher = asyncio.create_task(self.watch(client))
            yield
            watcher.cancel()
            await client.aclose()

        app = FastAPI(title="colibri (Ray)", lifespan=lifespan, docs_url=None, redoc_url=None)

        @app.exception_handler(APIError)
        async def api_error(request: Request, e: APIError) -> JSONResponse:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

        def forwarded(request: Request) -> dict:
            keep = ("authorization", "content-type", "accept")
            return {k: v for k, v in request.headers.items() if k.lower() in keep}

        @app.get("/health")
        async def health() -> JSONResponse:
            live = len(self.live())
            status = "ready" if live else "loading" if any(u.up for u in self.upstreams) else "unavailable"
            body = {"status": status, "model": self.model_id, "replicas": live,
                    "replicas_total": len(self.upstreams), "routed": self.routed}
            return JSONResponse(body, status_code=200 if live else 503)

        @app.get("/metrics")
        async def metrics(request: Request) -> Response:
            texts = []
            for u in self.live():
                try:
                    r = await client.get(u.url + "/metrics", headers=forwarded(request), timeout=5.0)
                except httpx.HTTPError:
                    self.down(u)
                    continue
                if r.status_code != 200:
                    return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
                texts.append(r.text)
            return Response(aggregate(texts, len(self.live())), media_type="text/plain; version=0.0.4")

        async def relay(request: Request, path: str, body: bytes | None) -> Response:
            keys = []
            if body is not None:
                try:
                    obj = json.loads(body)
                    keys = routing_keys(obj) if isinstance(obj, dict) else []
                except ValueError:  # the replica answers the 400
                    pass
            tried: set = set()
            while True:
                u = self.pick(keys, tried)
                if u is None:
                    raise APIError(503, f"no replica is up ({len(self.upstreams)} started); retry later",
                                   code="no_replica", headers={"Retry-After": "1"})
                tried.add(u)
                u.inflight += 1
                try:
                    req = client.build_request(request.method, u.url + path, content=body,
                                               headers=forwarded(request))
                    upstream = await client.send(req, stream=True)
                except BaseException as e:  # the client gone (cancelled) as much as the replica
                    u.inflight -= 1
                    if not isinstance(e, httpx.HTTPError):
                        raise
                    self.down(u)
                    self.routed["retried"] += 1
                    continue  # nothing reached the client: another replica takes it
                headers = {"x-colibri-replica": str(u.index),
                           **{k: v for k, v in upstream.headers.items()
                              if k.lower() in ("retry-after", "cache-control", "x-accel-buffering")}}
                if upstream.status_code == 200 and keys:
                    self.remember(keys, u)
                if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
                    try:
                        content = await upstream.aread()
                    except httpx.HTTPError:
                        self.down(u)
                        self.routed["retried"] += 1
                        continue  # its answer never started: another replica takes it
                    finally:  # also when the client is gone (cancelled)
                        u.inflight -= 1
                        await upstream.aclose()
                    return Response(content, status_code=upstream.status_code, headers=headers,
                                    media_type=upstream.headers.get("content-type"))
                return ClosingStream(self.stream(u, upstream), Lease(u, upstream), status_code=upstream.status_code,
                                     headers=headers, media_type="text/event-stream")

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            return await relay(request, "/v1/models", None)

        @app.get("/v1/models/{name:path}")
        async def one_model(name: str, request: Request) -> Response:
            return await relay(request, f"/v1/models/{name}", None)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await relay(request, "/v1/chat/completions", await read_body(request, BODY_CAP))

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await relay(request, "/v1/completions", await read_body(request, BODY_CAP))

        @app.post("/v1/embeddings")  # no conversation to follow: the least loaded replica
        async def embeddings(request: Request) -> Response:
            return await relay(request, "/v1/embeddings", await read_body(request, BODY_CAP))

        return app

    async def stream(self, u: Upstream, upstream):
        """The replica's SSE bytes as they come; if it dies mid-stream, one error event and [DONE]."""
        import httpx
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError:
            self.down(u)
            self.routed["lost"] += 1
            error = {"error": {"message": f"replica {u.index} stopped while answering; the other replicas carry on:"
                                          " send the request again", "type": "server_error", "param": None,
                               "code": "replica_lost"}}
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


class Lease:
    """A relayed stream's hold on its replica, released however the response ends (ClosingStream calls aclose,
    also when the client left before the body began): one request fewer in flight, the upstream closed (so
    the replica aborts what nobody reads)."""

    def __init__(self, u: Upstream, upstream):
        self.u, self.upstream = u, upstream

    async def aclose(self) -> None:
        if self.upstream is not None:
            self.u.inflight -= 1
            upstream, self.upstream = self.upstream, None
            await upstream.aclose()


def aggregate(texts: list[str], up: int) -> bytes:
    """Prometheus texts summed sample by sample (same name and labels), plus colibri_replicas_up."""
    from prometheus_client.parser import text_string_to_metric_families
    families: dict[str, tuple[str, str, dict]] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            _, _, samples = families.setdefault(fam.name, (fam.type, fam.documentation, {}))
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                samples[key] = samples.get(key, 0.0) + s.value
    lines = ["# HELP colibri_replicas_up Replicas answering and ready", "# TYPE colibri_replicas_up gauge",
             f"colibri_replicas_up {up}"]
    for name, (kind, doc, samples) in families.items():
        lines += [f"# HELP {name} {doc} (summed over the replicas)", f"# TYPE {name} {kind}"]
        for (sample, labels), value in samples.items():
            label = ",".join(f'{k}="{v}"' for k, v in labels)
            lines.append(f"{sample}{{{label}}} {value!r}" if label else f"{sample} {value!r}")
    return ("\n".join(lines) + "\n").encode()


def start_replicas(ray, config: EngineConfig, replicas: int | None, api_key: str | None, max_queue: int,
                   name: str) -> list[Upstream]:
    """The replicas, each serving on its node; an InputError naming the node where one cannot start."""
    cls = ray.remote(Replica)
    actors = [cls.options(max_concurrency=4, **opts).remote(config.replace(threads=t), api_key, max_queue, name)
              for opts, t in placements(ray, replicas, config.threads)]
    urls = started(ray, actors, [a.start.remote() for a in actors])
    return [Upstream(i, url, a) for i, (url, a) in enumerate(zip(urls, actors))]


def serve(args, config: EngineConfig, name: str) -> None:
    """`colibri serve --ray`: start the replicas, then the router on --host/--port until SIGINT/SIGTERM."""
    import uvicorn

    from colibri.server import listen
    ray = connect(args.ray)
    upstreams = start_replicas(ray, config, args.replicas, args.api_key, args.max_queue, name)
    router = Router(upstreams, name, args.api_key)
    sock = listen(args.host, args.port)
    print(f"colibri serve: {name} on http://{args.host}:{sock.getsockname()[1]}/v1 over {len(upstreams)} replicas"
          " (loading; GET /health)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        uvicorn.Server(uvicorn.Config(router.app(), log_level="warning", access_log=False)).run(sockets=[sock])
    finally:
        sock.close()
        for u in upstreams:
            ray.kill(u.actor)
    print(f"colibri serve: stopped after {time.perf_counter() - t0:.0f} s", file=sys.stderr)

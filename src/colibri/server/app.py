"""The HTTP routes: OpenAI's /v1/models, /v1/chat/completions and /v1/completions, with /health and /metrics, and
the pages: the dashboard at / (its frames over SSE at /dashboard/events, one frame at /dashboard/state) and the
chat page at /chat (dashboard.py; the files in static/).

A handler validates the body, renders and tokenizes the prompt, hands the engine thread a job and then only
waits on the job's asyncio queue: text deltas go out as SSE chunks (or are gathered for one JSON answer), an SSE
comment keeps the connection alive while nothing comes (a long prefill), and a client that goes away has its
request aborted. Every error is OpenAI's shape with its status.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hmac
import json
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from colibri.core.errors import InputError
from colibri.engine.grammar import available as grammars_available
from colibri.engine.sampling import SamplingParams
from colibri.server import dashboard, schema, tools
from colibri.server.metrics import ServerMetrics
from colibri.server.replies import ChatReply, CompletionReply, Logprobs
from colibri.server.schema import APIError, ChatRequest, CompletionRequest, EmbeddingRequest
from colibri.server.worker import Event, Job, Worker

MAX_BODY_BYTES = 8 << 20  # a request body larger than this is refused with 413 before it is read whole
# names the body's parameters this server does not know and ignored (schema.ignored), comma-separated
IGNORED_HEADER = "X-Colibri-Ignored-Parameters"
MAX_EMBEDDING_INPUTS = 256  # inputs of one /v1/embeddings request (each is a pass of its own)
KEEPALIVE_S = 5.0  # an SSE comment goes out after this long without a token (long prefills, a full queue)


@dataclass
class Settings:
    model_id: str
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    keepalive_s: float = KEEPALIVE_S
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(settings: Settings, worker: Worker, metrics: ServerMetrics) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()  # the socket is up: the model loads in the engine thread while /health answers
        yield
        await asyncio.to_thread(worker.stop)

    # /openapi.json describes the routes and their request bodies (schema.py's models: handlers parse the raw
    # body themselves, so FastAPI learns them from `body_schema`); no interactive docs pages
    app = FastAPI(title="colibri", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    components: dict = {}
    app.add_middleware(_CountResponses, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' with the"
                                " key given to --api-key", code="invalid_api_key")

    def check_model(name: str) -> None:
        if name != settings.model_id:
            raise APIError(400, f"model {name!r} is not served here; this server serves {settings.model_id!r}"
                                " (GET /v1/models)", param="model", code="model_not_found")

    def model_card() -> dict:
        card = {"id": settings.model_id, "object": "model", "created": settings.created, "owned_by": "colibri"}
        if worker.model is not None:
            card["context_length"] = worker.model.context_length
        return card

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"status": worker.state, "model": settings.model_id}
        if worker.error:
            body["error"] = worker.error
        if worker.load_s is not None:
            body["load_s"] = round(worker.load_s, 3)
        return JSONResponse(body, status_code=200 if worker.state == "ready" else 503)

    # /health stays open (load balancers probe it without credentials; it tells only loading/ready/failed);
    # /metrics holds traffic figures, so it takes the key like /v1 (Prometheus sends it: bearer_token)
    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        authorize(request)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    frames = dashboard.Frames(metrics, settings.model_id)
    pages = {"/": "dashboard.html", "/chat": "chat.html"}

    # the pages and their files are open (they hold no data); what they fetch takes the key like /metrics
    @app.get("/")
    @app.get("/chat")
    async def page(request: Request) -> FileResponse:
        return FileResponse(dashboard.STATIC / pages[request.url.path], headers={"Cache-Control": "no-cache"})

    @app.get("/static/{name}")
    async def static(name: str) -> FileResponse:
        path = dashboard.STATIC / name
        if "/" in name or name.startswith(".") or not path.is_file():
            raise APIError(404, f"no static file {name!r}", code="not_found")
        return FileResponse(path, headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/state")
    async def dashboard_state(request: Request) -> dict:
        authorize(request)
        return {"settings": frames.settings(), **frames.frame()}

    @app.get("/dashboard/events")
    async def dashboard_events(request: Request) -> StreamingResponse:
        authorize(request)
        return StreamingResponse(dashboard.stream(frames, request.is_disconnected), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str, request: Request) -> dict:
        authorize(request)
        if name != settings.model_id:
            raise APIError(404, f"model {name!r} is not served here", param="model", code="model_not_found")
        return model_card()

    async def parse(request: Request, kind: type):
        authorize(request)
        req = schema.parse(kind, await read_body(request, settings.max_body_bytes))
        request.state.ignored = schema.ignored(req)
        if request.state.ignored:
            print(f"colibri serve: {request.url.path}: ignored parameters this server does not know:"
                  f" {', '.join(request.state.ignored)}", file=sys.stderr, flush=True)
        if isinstance(req, schema.Sampling):
            schema.refuse_unsupported(req)
        check_model(req.model)
        worker.check_ready()
        return req

    async def answer(request: Request, req, jobs: list[Job], queue: asyncio.Queue, reply) -> Response:
        worker.submit(jobs)  # every prompt of a list joins the same steps
        events = _events(request, worker, jobs, queue, settings.keepalive_s)
        if not req.stream:
            async for item in events:
                if item is not None:
                    reply.add(*item)
            response: Response = JSONResponse(reply.whole())
        else:
            usage = req.stream_options is not None and req.stream_options.include_usage
            response = await _sse(events, reply, usage)
        if request.state.ignored:
            response.headers[IGNORED_HEADER] = ", ".join(request.state.ignored)
        return response

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatRequest, components))
    async def chat(request: Request) -> Response:
        req = await parse(request, ChatRequest)
        tok = worker.model.tokenizer
        if tok is None or tok.chat_template is None:
            raise APIError(400, "this model has no chat template; use /v1/completions", code="no_chat_template")
        tool_list = tools.template_tools(req, tok.chat_template)
        syntax = tools.syntax_of(tok.chat_template)  # None only where no tools can be given (template_tools)
        forced = tools.forced_start(req, syntax) if tool_list else ""
        messages = tools.template_messages(req.messages, syntax)

        def render() -> list[int]:
            extra = {"tools": tool_list} if tool_list else {}
            return tok.encode(tok.apply_chat_template(messages, **extra) + forced, add_special_tokens=False)

        try:
            ids = await asyncio.to_thread(render)
        except InputError as e:
            raise APIError(400, str(e), param="messages", code="invalid_messages") from None
        # a forced call follows its tool's schema where llguidance is installed (else the model writes it freely,
        # as before structured output); response_format's JSON cannot do without it (a 400 then)
        if forced and grammars_available():
            grammar = await compiled(lambda: tools.call_grammar(req, forced, syntax), "tools")
        else:
            grammar = await compiled(lambda: response_grammar(req), "response_format")
        params = schema.sampling_params(req, len(ids), worker.model.context_length, grammar)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        n = req.n or 1
        jobs = [Job(ids, choice_params(params, j), loop, queue, index=j) for j in range(n)]
        names = frozenset(t["function"]["name"] for t in tool_list) if tool_list else None
        reply = ChatReply(settings.model_id, len(ids), names, forced, n, token_logprobs(params))
        return await answer(request, req, jobs, queue, reply)

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest, components))
    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        model = worker.model
        prompts = _prompts(req.prompt)
        try:
            encoded = await asyncio.to_thread(lambda: [model.prompt_ids(p) for p in prompts])
        except InputError as e:
            raise APIError(400, str(e), param="prompt", code="invalid_prompt") from None
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        n = req.n or 1
        jobs = []
        for i, ids in enumerate(encoded):
            params = schema.sampling_params(req, len(ids), model.context_length)
            jobs += [Job(ids, choice_params(params, j), loop, queue, index=i * n + j) for j in range(n)]
        echo = prompts if req.echo else None
        reply = CompletionReply(settings.model_id, [len(i) for i in encoded], echo, n, token_logprobs(jobs[0].params))
        return await answer(request, req, jobs, queue, reply)

    @app.post("/v1/embeddings", openapi_extra=body_schema(EmbeddingRequest, components))
    async def embeddings(request: Request) -> Response:
        """The last token's final hidden state of each input, unit length (Model.embed says why)."""
        req = await parse(request, EmbeddingRequest)
        model = worker.model
        width = model.args.hidden_size
        if req.dimensions is not None and req.dimensions != width:
            raise APIError(400, f"dimensions must be this model's hidden size, {width} (got {req.dimensions})",
                           param="dimensions", code="invalid_value")
        inputs = _prompts(req.input)
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise APIError(400, f"{len(inputs)} inputs in one request, at most {MAX_EMBEDDING_INPUTS}; split the list",
                           param="input", code="too_many_inputs")

        def embed() -> tuple[list, int]:
            encoded = [model.prompt_ids(x) for x in inputs]
            return [model.embed(ids) for ids in encoded], sum(len(ids) for ids in encoded)

        try:  # the engine's lock lets these passes run between the engine thread's steps
            vectors, tokens = await asyncio.to_thread(embed)
        except InputError as e:
            raise APIError(400, str(e), param="input", code="invalid_input") from None
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.numpy().astype("<f4").tobytes()).decode()
                 if req.encoding_format == "base64" else v.tolist()} for i, v in enumerate(vectors)]
        response = JSONResponse({"object": "list", "data": data, "model": settings.model_id,
                                 "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
        if request.state.ignored:
            response.headers[IGNORED_HEADER] = ", ".join(request.state.ignored)
        return response

    def token_logprobs(params) -> Logprobs | None:
        tok = worker.model.tokenizer
        if params.logprobs is None:
            return None
        return Logprobs(lambda i: tok.decode([i], skip_special_tokens=False) if tok is not None else str(i))

    async def compiled(make, param: str) -> str | None:
        """The grammar `make()` builds (None: none), checked against the model's tokenizer: a 400 naming `param`
        when it does not compile or llguidance is not installed."""
        def build() -> str | None:
            grammar = make()
            if grammar is not None:
                from colibri.engine.grammar import check
                check(grammar, worker.model.tokenizer)
            return grammar

        try:
            return await asyncio.to_thread(build)
        except InputError as e:
            raise APIError(400, str(e), param=param, code="invalid_value") from None

    metrics.attach(worker)
    base_openapi = app.openapi

    def openapi() -> dict:
        doc = base_openapi()
        doc.setdefault("components", {}).setdefault("schemas", {}).update(components)
        return doc

    app.openapi = openapi
    return app


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s params: the request's, with its seed (schema.choice_seed)."""
    return params if index == 0 else dataclasses.replace(params, seed=schema.choice_seed(params.seed, index))


def response_grammar(req: ChatRequest) -> str | None:
    """The grammar `response_format` asks for: any JSON object (json_object), JSON matching the schema
    (json_schema; llguidance enforces a schema's constraints whether or not `strict` is set), None for text."""
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    from colibri.engine.grammar import json_schema_grammar
    return json_schema_grammar(rf.json_schema.schema_ if rf.type == "json_schema" else None)


def body_schema(model, components: dict) -> dict:
    """A route's `openapi_extra`: `model` (a schema.py request model) as its required JSON body; the models it
    refers to go into `components` (the document's components.schemas)."""
    ref = "#/components/schemas/{model}"
    js = model.model_json_schema(ref_template=ref)
    components.update(js.pop("$defs", {}))
    components[model.__name__] = js
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": ref.format(model=model.__name__)}}}}}


def _prompts(prompt) -> list:
    """A completion's prompt as a list of prompts: strings or lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt", code="invalid_prompt")
    return list(prompt)


async def read_body(request: Request, cap: int) -> bytes:
    """The body, refused with 413 once it passes `cap` bytes (by its Content-Length or as it arrives)."""
    try:
        declared = int(request.headers.get("content-length", 0))
    except ValueError:
        raise APIError(400, "bad Content-Length header") from None
    too_big = APIError(413, f"the request body is larger than {cap} bytes", code="body_too_large")
    if declared > cap:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body is already read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _events(request: Request, worker: Worker, jobs: list[Job], queue: asyncio.Queue,
                  keepalive: float) -> AsyncIterator[tuple[int, Event] | None]:
    """(index, Event) as the engine thread delivers them until every job is done; None after `keepalive`
    seconds without one. A client disconnect, or the caller closing the iterator, aborts the unfinished jobs."""
    pending = len(jobs)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while pending:
            get = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({get, gone}, timeout=keepalive, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                if gone in done:
                    return
                yield None
                continue
            index, event = get.result()
            if event.kind == "done":
                pending -= 1
            yield index, event
    finally:
        gone.cancel()
        for job in jobs:
            worker.abort(job)


def _sse_line(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse(events: AsyncIterator, reply, usage: bool) -> Response:
    """A streaming answer. The first event is awaited (up to one keep-alive period) before the headers go out,
    so a request that fails at once still gets its error status."""
    first = await events.__anext__()
    if first is not None and first[1].kind == "done" and first[1].error is not None and reply.single:
        await events.aclose()
        raise first[1].error

    async def body() -> AsyncIterator[str]:
        try:
            yield _sse_line(reply.head())
            item = first
            while True:
                if item is None:
                    yield ": keep-alive\n\n"
                else:
                    for obj in reply.chunks(*item):
                        yield _sse_line(obj)
                try:
                    item = await events.__anext__()
                except StopAsyncIteration:
                    break
            if reply.error is not None:
                yield _sse_line(reply.error.body())
            elif usage:
                yield _sse_line(reply.usage_chunk())
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()

    return ClosingStream(body(), events, media_type="text/event-stream",
                   headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class ClosingStream(StreamingResponse):
    """A streaming response that closes its event source however the response ends (also when the client
    left before the body began: the body's own `finally` would never run then)."""

    def __init__(self, content, events: AsyncIterator, **kw):
        super().__init__(content, **kw)
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()


class _CountResponses:
    """ASGI middleware counting responses by route and status (pure ASGI: streaming and disconnects pass
    through untouched)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path if path in ("/health", "/metrics", "/v1/models", "/v1/chat/completions",
                                 "/v1/completions", "/v1/embeddings") else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.http.labels(route=route, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)

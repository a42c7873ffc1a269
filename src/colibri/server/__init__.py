"""`colibri serve`: an OpenAI-compatible HTTP server over one engine.

schema.py (request bodies, validation, the error shape), tools.py (tool definitions into the chat template,
tool-call blocks out of the reply), worker.py (the engine thread), replies.py (response bodies and stream
chunks), metrics.py (/metrics), app.py (the routes).
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from pathlib import Path
from typing import Callable

from colibri.core.config import EngineConfig
from colibri.core.errors import ColibriError, InputError

DEFAULT_HOST, DEFAULT_PORT, DEFAULT_MAX_QUEUE = "127.0.0.1", 8000, 64
DEFAULT_SHUTDOWN_GRACE_S = 10.0


def model_id(config: EngineConfig) -> str:
    """The name clients send as `model`: the checkpoint's file or directory name."""
    path = config.model_path()
    return path.stem if path.is_file() else path.name


def serve(config: EngineConfig, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, api_key: str | None = None,
          max_queue: int = DEFAULT_MAX_QUEUE, name: str | None = None, load: Callable | None = None,
          keepalive_s: float | None = None, shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S) -> None:
    """Serve until SIGINT/SIGTERM. The socket opens first; the model loads in the engine thread meanwhile (a
    load that fails stops the server with that error). `load(config)` builds the model (default
    `worker.load_model`: as `colibri run` loads it); `keepalive_s` is the SSE keep-alive period (default
    `app.KEEPALIVE_S`).

    On the signal the server drains: the listening socket closes, a request arriving on an open connection gets
    503, the requests in flight get `shutdown_grace_s` seconds to finish, and those still running then end with
    a 503 `shutting_down` error (JSON, or a final SSE error event and [DONE]); the process exits once every
    connection has its answer."""
    import uvicorn

    from colibri.server.app import Settings, create_app
    from colibri.server.metrics import ServerMetrics
    from colibri.server.worker import Worker

    from colibri.runtime.model import open_model
    ckpt, _, _ = open_model(config.model_path())  # a wrong path or architecture: one line, before the socket
    ckpt.close()
    if config.chat_template is not None and not Path(config.chat_template).is_file():
        raise InputError(f"--chat-template {config.chat_template}: no such file; give a Jinja template file")
    metrics = ServerMetrics()
    worker = Worker(config, max_queue, metrics, load)
    settings = Settings(model_id=name or model_id(config), api_key=api_key)
    if keepalive_s is not None:
        settings.keepalive_s = keepalive_s
    app = create_app(settings, worker, metrics)
    if not _loopback(host) and api_key is None:
        print(f"colibri serve: warning: listening on {host} without --api-key: anyone who can reach this port"
              " can use the model", file=sys.stderr)
    sock = listen(host, port)
    port = sock.getsockname()[1]
    base = f"http://{_url_host(host)}:{port}"
    print(f"colibri serve: {settings.model_id} on {base}/v1, dashboard {base}/, chat {base}/chat (the model is"
          " loading; GET /health)", file=sys.stderr, flush=True)
    class Draining(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            worker.drain(shutdown_grace_s)
            super().handle_exit(sig, frame)

    # uvicorn's own timeout, which cancels handlers mid-answer, only backs the drain up
    server = Draining(uvicorn.Config(app, log_level="warning", access_log=False,
                                     timeout_graceful_shutdown=shutdown_grace_s + 5))
    worker.on_failed = lambda: setattr(server, "should_exit", True)  # a server without a model is no server
    try:
        server.run(sockets=[sock])
    finally:
        worker.stop()
        sock.close()
    if worker.state == "failed":
        raise ColibriError(f"the model failed to load: {worker.error}")


def listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket (port 0: a free one), or one clear error line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise InputError(f"--host {host!r}: {e.strerror}; give an address such as 127.0.0.1") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror}; choose another --port (or stop the"
                         " process using it)") from None
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"

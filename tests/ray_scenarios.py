"""The Ray side of tests/test_cluster.py, run in a private network namespace (Ray binds to the machine's address;
there it is 127.0.0.1 and nothing reaches out): starts one local Ray cluster (2 CPUs, a small object store),
then runs the scenarios the test sends on stdin, one JSON line each ({"fn": name, "args": {...}}), answering
each with one line `RESULT <json>` on stdout."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import threading
import time
import traceback

import ray

from colibri import batch, cli, cluster, router
from colibri.core.config import EngineConfig


def run_batch(argv: list[str], kill_after: int | None = None) -> dict:
    """`colibri batch --ray ...` in this process. kill_after: SIGKILL one engine's process when that many
    results are written (the engine that did not just finish a line, so it has lines in flight)."""
    engines, killed = [], []
    start_engines, write = cluster.start_engines, batch.Output.write

    def recording_start(*a, **k):
        engines.extend(start_engines(*a, **k))
        return engines

    def killing_write(out, rec):
        write(out, rec)
        if kill_after is not None and out.written == kill_after and not killed:
            victim = engines[-1]
            pid = ray.get(victim.pid.remote())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    cluster.start_engines, batch.Output.write = recording_start, killing_write
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            rc = cli.main(argv)
    finally:
        cluster.start_engines, batch.Output.write = start_engines, write
    return {"rc": rc, "stderr": err.getvalue(), "killed": killed}


def run_cli(argv: list[str]) -> dict:
    """Any `colibri` command in this process (on this cluster): its exit status and stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return {"rc": rc, "stderr": err.getvalue()}


def run_serve(model: str) -> dict:
    """Two replicas of `model` (SmolLM2: slow enough that a 400-token stream is still running when its replica is
    killed) behind the router on a free loopback port: a conversation's two turns, two streams of
    which one loses its replica mid-stream, then /health, a request after the loss and /metrics."""
    import httpx
    import uvicorn

    from colibri.server import listen
    seen = {}
    ups = router.start_replicas(ray, EngineConfig(model=model, threads=1, max_sequences=2), 2, None, 8, "tiny")
    r = router.Router(ups, "tiny", None)
    sock = listen("127.0.0.1", 0)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(r.app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        with httpx.Client(base_url=base, timeout=60) as c:
            deadline = time.monotonic() + 60
            while (h := _health(c)).get("replicas") != 2:
                assert time.monotonic() < deadline, h
                time.sleep(0.2)
            seen["health_before"] = h
            first = [{"role": "user", "content": "Here is a list: " + ", ".join(f"item {k}" for k in range(40))}]
            a = c.post("/v1/chat/completions", json={"model": "tiny", "messages": first, "max_tokens": 4})
            assert a.status_code == 200, (a.status_code, a.text)
            second = first + [{"role": "assistant", "content": a.json()["choices"][0]["message"]["content"]},
                              {"role": "user", "content": "Which item is third?"}]
            b = c.post("/v1/chat/completions", json={"model": "tiny", "messages": second, "max_tokens": 4})
            seen["turns"] = [{"replica": x.headers["x-colibri-replica"], "status": x.status_code,
                              "cached": x.json()["usage"]["prompt_tokens_details"]["cached_tokens"]} for x in (a, b)]
            streams = []
            for k in range(2):  # the second goes to the other replica: the first is in flight (least loaded)
                body = {"model": "tiny", "stream": True, "max_tokens": [400, 24][k], "ignore_eos": True,
                        "messages": [{"role": "user", "content": f"Count from {k} to 500."}]}
                cm = c.stream("POST", "/v1/chat/completions", json=body)
                resp = cm.__enter__()
                lines = resp.iter_lines()
                streams.append((cm, resp, lines, [next(lines)]))
            victim = int(streams[0][1].headers["x-colibri-replica"])
            os.kill(ray.get(ups[victim].actor.pid.remote()), signal.SIGKILL)
            seen["streams"] = []
            for cm, resp, lines, got in streams:
                got += list(lines)
                cm.__exit__(None, None, None)
                events = [json.loads(x[6:]) for x in got if x.startswith("data: {")]
                seen["streams"].append({"replica": int(resp.headers["x-colibri-replica"]), "status": resp.status_code,
                                        "done": [x for x in got if x][-1] == "data: [DONE]", "errors": [e["error"] for e in events
                                                                                     if "error" in e],
                                        "finish": [ch["finish_reason"] for e in events for ch in e.get("choices", [])
                                                   if ch.get("finish_reason")]})
            seen["victim"] = victim
            after = c.post("/v1/completions", json={"model": "tiny", "prompt": "One, two,", "max_tokens": 3})
            seen["after"] = {"status": after.status_code, "replica": after.headers.get("x-colibri-replica")}
            seen["health_after"] = _health(c)
            seen["metrics"] = c.get("/metrics").text
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        for u in ups:
            ray.kill(u.actor)
    return seen


def _health(c) -> dict:
    import httpx
    try:
        return c.get("/health").json()
    except httpx.HTTPError:
        return {}


def main() -> None:
    ray.init(num_cpus=2, object_store_memory=80 * 1024**2, include_dashboard=False, log_to_driver=False)
    print("RESULT " + json.dumps({"ready": True}), flush=True)
    for raw in sys.stdin:
        msg = json.loads(raw)
        try:
            result = globals()[msg["fn"]](**msg["args"])
        except Exception:
            result = {"exception": traceback.format_exc()}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

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
import traceback

import ray

from colibri import batch, cli, cluster


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

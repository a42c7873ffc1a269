"""A real `colibri serve` child process on a free local port, for the server tests (with `hooks`, started through
serve_with_faults.py: faults put in from the test side)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from clirun import colibri_cmd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`colibri serve ARGS` started at once; `statuses` are the /health states seen while waiting for it."""

    def __init__(self, args: list[str], hooks: dict | None = None, api_key: str | None = None,
                 timeout: float = 300):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        launcher = [sys.executable, str(Path(__file__).with_name("serve_with_faults.py")), json.dumps(hooks)] \
            if hooks else colibri_cmd()
        cmd = launcher + ["serve", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.stderr, text=True)
        self.statuses: list[tuple[int, str]] = []
        self._wait(timeout)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"colibri serve exited with {self.proc.returncode}: {self.output()}")
            try:
                r = httpx.get(self.url + "/health", timeout=5)
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            self.statuses.append((r.status_code, r.json()["status"]))
            if r.json()["status"] == "ready":
                return
            if r.json()["status"] == "failed":
                raise RuntimeError(f"the model failed to load: {r.json()}")
            time.sleep(0.05)
        raise RuntimeError("colibri serve did not become ready in time")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def openai(self, **kw):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        """The unlabeled samples of /metrics by name."""
        out = {}
        for line in httpx.get(self.url + "/metrics", headers=self.headers, timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def output(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()

    def close(self) -> str:
        """Stop with SIGTERM; returns the server's stderr."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.output()

"""`colibri serve` with faults put in from the test side (tests/test_server.py starts it through serving.Server):

    python serve_with_faults.py HOOKS_JSON serve ARGS...

runs the real command (its parsing, `colibri.server.serve`, the routes) with a model `load` and an SSE keep-alive
period of its own. HOOKS_JSON's keys: `load_delay_s` holds the model load back (so /health is seen while it
loads), `fault_text` makes every forward pass that serves a request whose prompt contains that text raise (an
engine fault inside that request), `oom_text` likewise raise torch's CPU allocator error (the process out of
memory inside that request), `keepalive_s` shortens the keep-alive period.
"""

from __future__ import annotations

import functools
import json
import sys
import time

from colibri import cli, server  # not torch: `colibri serve` sets OMP_WAIT_POLICY before torch loads

FAULT_MESSAGE = "injected test fault"
# torch's CPU allocator refusing an allocation, as it words it
OOM_MESSAGE = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to"
               " allocate 7741440 bytes. Error code 12 (Cannot allocate memory)")


class FailingDecoder:
    """The family math, raising in a pass while a running request's prompt contains a marker: markers maps each
    to the error's text."""

    def __init__(self, decoder, engine, tokenizer, markers: dict[str, str]):
        self._decoder, self._engine, self._tokenizer, self._markers = decoder, engine, tokenizer, markers
        self._marked: dict[int, str | None] = {}  # request id -> the marker its prompt contains

    def _marker(self, req) -> str | None:
        if req.id not in self._marked:
            text = self._tokenizer.decode(req.prompt_ids)
            self._marked[req.id] = next((m for m in self._markers if m in text), None)
        return self._marked[req.id]

    def forward(self, store, batch):
        for r in self._engine.running:
            if (m := self._marker(r)) is not None:
                raise RuntimeError(self._markers[m])
        return self._decoder.forward(store, batch)

    def __getattr__(self, name):
        return getattr(self._decoder, name)


def load(config, load_delay_s: float = 0.0, fault_text: str | None = None, oom_text: str | None = None):
    from colibri.server.worker import load_model
    time.sleep(load_delay_s)
    model = load_model(config)
    markers = {**({fault_text: f"{FAULT_MESSAGE} ({fault_text!r} in a prompt)"} if fault_text else {}),
               **({oom_text: OOM_MESSAGE} if oom_text else {})}
    if markers:
        engine = model.engine
        engine.decoder = FailingDecoder(engine.decoder, engine, model.tokenizer, markers)
    return model


def main(argv: list[str]) -> int:
    hooks = json.loads(argv[0])
    loader = functools.partial(load, load_delay_s=hooks.get("load_delay_s", 0.0), fault_text=hooks.get("fault_text"),
                               oom_text=hooks.get("oom_text"))
    # `colibri serve` imports `serve` when it runs: it gets this one
    server.serve = functools.partial(server.serve, load=loader, keepalive_s=hooks.get("keepalive_s"))
    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`colibri serve` with faults put in from the test side (tests/test_server.py starts it through serving.Server):

    python serve_with_faults.py HOOKS_JSON serve ARGS...

runs the real command (its parsing, `colibri.server.serve`, the routes) with a model `load` and an SSE keep-alive
period of its own. HOOKS_JSON's keys: `load_delay_s` holds the model load back (so /health is seen while it
loads), `fault_text` makes every forward pass that serves a request whose prompt contains that text raise (an
engine fault inside that request), `keepalive_s` shortens the keep-alive period.
"""

from __future__ import annotations

import functools
import json
import sys
import time

from colibri import cli, server  # not torch: `colibri serve` sets OMP_WAIT_POLICY before torch loads

FAULT_MESSAGE = "injected test fault"


class FailingDecoder:
    """The family math, raising in a pass while a running request's prompt contains `marker`."""

    def __init__(self, decoder, engine, tokenizer, marker: str):
        self._decoder, self._engine, self._tokenizer, self._marker = decoder, engine, tokenizer, marker
        self._marked: dict[int, bool] = {}  # request id -> its prompt contains the marker

    def _is_marked(self, req) -> bool:
        if req.id not in self._marked:
            self._marked[req.id] = self._marker in self._tokenizer.decode(req.prompt_ids)
        return self._marked[req.id]

    def forward(self, store, batch):
        if any(self._is_marked(r) for r in self._engine.running):
            raise RuntimeError(f"{FAULT_MESSAGE} ({self._marker!r} in a prompt)")
        return self._decoder.forward(store, batch)

    def __getattr__(self, name):
        return getattr(self._decoder, name)


def load(config, load_delay_s: float = 0.0, fault_text: str | None = None):
    from colibri.server.worker import load_model
    time.sleep(load_delay_s)
    model = load_model(config)
    if fault_text:
        engine = model.engine
        engine.decoder = FailingDecoder(engine.decoder, engine, model.tokenizer, fault_text)
    return model


def main(argv: list[str]) -> int:
    hooks = json.loads(argv[0])
    loader = functools.partial(load, load_delay_s=hooks.get("load_delay_s", 0.0), fault_text=hooks.get("fault_text"))
    # `colibri serve` imports `serve` when it runs: it gets this one
    server.serve = functools.partial(server.serve, load=loader, keepalive_s=hooks.get("keepalive_s"))
    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

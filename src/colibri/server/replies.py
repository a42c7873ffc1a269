"""OpenAI response bodies built from engine events: a whole answer, or the chunks of a stream."""

from __future__ import annotations

import secrets
import time

from colibri.server import tools
from colibri.server.schema import APIError
from colibri.server.worker import Event


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class ChatReply:
    """One chat choice built from engine events, as a whole answer or as stream chunks."""

    single = True

    def __init__(self, model_id: str, prompt_tokens: int, tool_names: frozenset | None, forced: str = ""):
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.model_id, self.prompt_tokens = model_id, prompt_tokens
        self.names = tool_names
        self.filter = tools.StreamFilter(tool_names) if tool_names is not None else None
        # the reply's start that tool_choice wrote into the prompt: parsed as if the model had written it
        self.text, self.completion_tokens, self.cached = forced, 0, 0
        if forced:
            self.filter.push(forced)  # an open call block: nothing comes out until it closes
        self.finish_reason: str | None = None
        self.error: APIError | None = None
        self.calls = 0
        self.metrics = None

    def add(self, index: int, event: Event) -> None:
        if event.kind == "delta":
            self.text += event.text
            self.completion_tokens += event.tokens
        else:
            self._done(event)

    def _done(self, event: Event) -> None:
        self.finish_reason, self.error = event.finish_reason, event.error
        if event.metrics is not None:
            self.completion_tokens = event.metrics.generated_tokens
            self.cached = event.metrics.prefix_tokens
            self.metrics = event.metrics

    def whole(self) -> dict:
        if self.error is not None:
            raise self.error
        message: dict = {"role": "assistant", "content": self.text}
        reason = self.finish_reason
        if self.filter is not None:
            parsed = tools.parse(self.text, self.names, ended=reason == "stop")
            message["content"] = parsed.content
            if parsed.tool_calls:
                message["tool_calls"] = parsed.tool_calls
                if reason == "stop":
                    reason = "tool_calls"
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model_id,
                "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
                "usage": usage(self.prompt_tokens, self.completion_tokens, self.cached)}

    def _chunk(self, delta: dict, finish_reason: str | None = None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model_id,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}

    def head(self) -> dict:
        return self._chunk({"role": "assistant", "content": ""})

    def chunks(self, index: int, event: Event) -> list[dict]:
        if event.kind == "delta":
            self.completion_tokens += event.tokens
            return self._deltas(self.filter.push(event.text) if self.filter else [("text", event.text)])
        self._done(event)
        if self.error is not None:
            return []
        out = self._deltas(self.filter.finish(ended=self.finish_reason == "stop")) if self.filter else []
        reason = "tool_calls" if self.calls and self.finish_reason == "stop" else self.finish_reason
        return out + [self._chunk({}, reason)]

    def _deltas(self, events: list) -> list[dict]:
        out = []
        for kind, value in events:
            if kind == "text":
                if value:
                    out.append(self._chunk({"content": value}))
            else:
                out.append(self._chunk({"tool_calls": [{"index": self.calls, **value}]}))
                self.calls += 1
        return out

    def usage_chunk(self) -> dict:
        body = usage(self.prompt_tokens, self.completion_tokens, self.cached)
        m = self.metrics
        if m is not None:  # the engine's own figures for this reply (the chat page shows them); clients ignore it
            steps = m.generated_tokens - 1
            body["colibri"] = {"ttft_s": round(m.ttft_s, 4), "prefill_s": round(m.prefill_s, 4),
                               "decode_tok_s": round(steps / m.decode_s, 2) if steps > 0 and m.decode_s > 0 else None,
                               "disk_bytes_read": m.disk_bytes_read, "draft_tokens": m.draft_tokens,
                               "accepted_tokens": m.accepted_tokens}
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model_id,
                "choices": [], "usage": body}


class CompletionReply:
    """The choices of a (possibly batched) completion request."""

    def __init__(self, model_id: str, prompt_tokens: list[int], echo):
        self.id = "cmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.model_id, self.prompt_tokens = model_id, prompt_tokens
        self.single = len(prompt_tokens) == 1
        self.echo = echo
        n = len(prompt_tokens)
        self.texts, self.reasons = [""] * n, [None] * n
        self.tokens, self.cached = [0] * n, [0] * n
        self.error: APIError | None = None

    def add(self, index: int, event: Event) -> None:
        if event.kind == "delta":
            self.texts[index] += event.text
            self.tokens[index] += event.tokens
            return
        self.reasons[index] = event.finish_reason
        if event.error is not None and self.error is None:
            self.error = event.error
        if event.metrics is not None:
            self.tokens[index] = event.metrics.generated_tokens
            self.cached[index] = event.metrics.prefix_tokens

    def _prefix(self, index: int) -> str:
        return self.echo[index] if self.echo and isinstance(self.echo[index], str) else ""

    def whole(self) -> dict:
        if self.error is not None:
            raise self.error
        choices = [{"index": i, "text": self._prefix(i) + t, "finish_reason": r, "logprobs": None}
                   for i, (t, r) in enumerate(zip(self.texts, self.reasons))]
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model_id,
                "choices": choices, "usage": self.usage()}

    def usage(self) -> dict:
        return usage(sum(self.prompt_tokens), sum(self.tokens), sum(self.cached))

    def _chunk(self, index: int, text: str, reason: str | None = None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model_id,
                "choices": [{"index": index, "text": text, "finish_reason": reason, "logprobs": None}]}

    def head(self) -> dict:
        return self._chunk(0, self._prefix(0))

    def chunks(self, index: int, event: Event) -> list[dict]:
        self.add(index, event)
        if event.kind == "delta":
            return [self._chunk(index, event.text)] if event.text else []
        return [] if event.error is not None else [self._chunk(index, "", event.finish_reason)]

    def usage_chunk(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model_id,
                "choices": [], "usage": self.usage()}

"""OpenAI response bodies built from engine events: a whole answer, or the chunks of a stream.

A request's choices are engine jobs: `index` is the choice's (for completions with several prompts, prompt p's
choice j is p * n + j, OpenAI's order). Log-probabilities, when asked for, come with each token (worker.Event)
and are written in the chat shape (`logprobs.content`) or the legacy completions shape (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`).
"""

from __future__ import annotations

import secrets
import time
from typing import Callable

from colibri.server import tools
from colibri.server.schema import APIError
from colibri.server.worker import Event


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Logprobs:
    """Token log-probabilities in OpenAI's shapes; `token_text(id)` is a token's own text (a token that holds
    part of a UTF-8 character reads as U+FFFD; `bytes` is then that text's, not the token's raw bytes)."""

    def __init__(self, token_text: Callable[[int], str]):
        self.token_text = token_text

    def _one(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat(self, pairs: list) -> dict:
        """[(token id, TokenLogprobs)] -> a chat choice's `logprobs`."""
        return {"content": [{**self._one(t, lp.logprob), "top_logprobs": [self._one(i, v) for i, v in lp.top]}
                            for t, lp in pairs], "refusal": None}

    def completion(self, pairs: list, offset: int) -> dict:
        """[(token id, TokenLogprobs)] -> a completion choice's legacy `logprobs`; `offset`: where the first
        token's text starts in the choice's text."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp in pairs:
            text = self.token_text(t)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({self.token_text(i): v for i, v in lp.top})
            out["text_offset"].append(offset)
            offset += len(text)
        return out


class _ChatChoice:
    def __init__(self, names: frozenset | None, forced: str):
        self.filter = tools.StreamFilter(names) if names is not None else None
        # the reply's start that tool_choice wrote into the prompt: parsed as if the model had written it
        self.text, self.tokens, self.cached = forced, 0, 0
        if forced:
            self.filter.push(forced)  # an open call block: nothing comes out until it closes
        self.finish_reason: str | None = None
        self.calls = 0
        self.logprobs: list = []


class ChatReply:
    """The n choices of a chat request, built from engine events, as a whole answer or as stream chunks
    (`logprobs`: a Logprobs when the request asked for them)."""

    def __init__(self, model_id: str, prompt_tokens: int, tool_names: frozenset | None, forced: str = "",
                 n: int = 1, logprobs: Logprobs | None = None):
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.model_id, self.prompt_tokens = model_id, prompt_tokens
        self.names = tool_names
        self.choices = [_ChatChoice(tool_names, forced) for _ in range(n)]
        self.single = n == 1
        self.lp = logprobs
        self.error: APIError | None = None
        self.metrics = None  # the last finished choice's engine figures (usage.colibri of a stream's last chunk)

    def add(self, index: int, event: Event) -> None:
        c = self.choices[index]
        if event.kind == "delta":
            c.text += event.text
            c.tokens += event.tokens
            c.logprobs += event.logprobs
        else:
            self._done(c, event)

    def _done(self, c: _ChatChoice, event: Event) -> None:
        c.finish_reason = event.finish_reason
        if event.error is not None and self.error is None:
            self.error = event.error
        if event.metrics is not None:
            c.tokens = event.metrics.generated_tokens
            c.cached = event.metrics.prefix_tokens
            self.metrics = event.metrics

    def _usage(self) -> dict:  # the prompt is counted once, as it is computed once (the choices share its KV)
        return usage(self.prompt_tokens, sum(c.tokens for c in self.choices), self.choices[0].cached)

    def whole(self) -> dict:
        if self.error is not None:
            raise self.error
        choices = []
        for i, c in enumerate(self.choices):
            message: dict = {"role": "assistant", "content": c.text}
            reason = c.finish_reason
            if c.filter is not None:
                parsed = tools.parse(c.text, self.names, ended=reason == "stop")
                message["content"] = parsed.content
                if parsed.tool_calls:
                    message["tool_calls"] = parsed.tool_calls
                    if reason == "stop":
                        reason = "tool_calls"
            choices.append({"index": i, "message": message, "finish_reason": reason,
                            "logprobs": self.lp.chat(c.logprobs) if self.lp else None})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model_id,
                "choices": choices, "usage": self._usage()}

    def _chunk(self, index: int, delta: dict, finish_reason: str | None = None, logprobs=None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model_id,
                "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}

    def head(self) -> dict:
        head = self._chunk(0, {"role": "assistant", "content": ""})
        head["choices"] = [{**head["choices"][0], "index": i} for i in range(len(self.choices))]
        return head

    def chunks(self, index: int, event: Event) -> list[dict]:
        c = self.choices[index]
        if event.kind == "delta":
            c.tokens += event.tokens
            out = self._deltas(index, c.filter.push(event.text) if c.filter else [("text", event.text)])
            if self.lp and event.logprobs:  # on the delta's first chunk (one of its own if the text is held back)
                if not out:
                    out = [self._chunk(index, {"content": ""})]
                out[0]["choices"][0]["logprobs"] = self.lp.chat(event.logprobs)
            return out
        self._done(c, event)
        if event.error is not None:
            return []
        out = self._deltas(index, c.filter.finish(ended=c.finish_reason == "stop")) if c.filter else []
        reason = "tool_calls" if c.calls and c.finish_reason == "stop" else c.finish_reason
        return out + [self._chunk(index, {}, reason)]

    def _deltas(self, index: int, events: list) -> list[dict]:
        c, out = self.choices[index], []
        for kind, value in events:
            if kind == "text":
                if value:
                    out.append(self._chunk(index, {"content": value}))
            else:
                out.append(self._chunk(index, {"tool_calls": [{"index": c.calls, **value}]}))
                c.calls += 1
        return out

    def usage_chunk(self) -> dict:
        body = self._usage()
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
    """The choices of a completion request: n for each of its prompts."""

    def __init__(self, model_id: str, prompt_tokens: list[int], echo, n: int = 1, logprobs: Logprobs | None = None):
        self.id = "cmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.model_id, self.prompt_tokens = model_id, prompt_tokens
        self.n = n
        count = len(prompt_tokens) * n
        self.single = count == 1
        self.echo = echo
        self.lp = logprobs
        self.texts, self.reasons = [""] * count, [None] * count
        self.tokens, self.cached = [0] * count, [0] * count
        self.logprobs: list[list] = [[] for _ in range(count)]
        self.error: APIError | None = None

    def add(self, index: int, event: Event) -> None:
        if event.kind == "delta":
            self.texts[index] += event.text
            self.tokens[index] += event.tokens
            self.logprobs[index] += event.logprobs
            return
        self.reasons[index] = event.finish_reason
        if event.error is not None and self.error is None:
            self.error = event.error
        if event.metrics is not None:
            self.tokens[index] = event.metrics.generated_tokens
            self.cached[index] = event.metrics.prefix_tokens

    def _prefix(self, index: int) -> str:
        prompt = index // self.n
        return self.echo[prompt] if self.echo and isinstance(self.echo[prompt], str) else ""

    def whole(self) -> dict:
        if self.error is not None:
            raise self.error
        choices = [{"index": i, "text": self._prefix(i) + t, "finish_reason": r,
                    "logprobs": self.lp.completion(self.logprobs[i], len(self._prefix(i))) if self.lp else None}
                   for i, (t, r) in enumerate(zip(self.texts, self.reasons))]
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model_id,
                "choices": choices, "usage": self.usage()}

    def usage(self) -> dict:  # each prompt counted once: its n choices share its KV
        return usage(sum(self.prompt_tokens), sum(self.tokens), sum(self.cached[::self.n]))

    def _chunk(self, index: int, text: str, reason: str | None = None, logprobs=None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model_id,
                "choices": [{"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}]}

    def head(self) -> dict:
        return self._chunk(0, self._prefix(0))

    def chunks(self, index: int, event: Event) -> list[dict]:
        offset = len(self._prefix(index)) + len(self.texts[index])
        self.add(index, event)
        if event.kind == "delta":
            lp = self.lp.completion(event.logprobs, offset) if self.lp and event.logprobs else None
            return [self._chunk(index, event.text, logprobs=lp)] if event.text or lp else []
        return [] if event.error is not None else [self._chunk(index, "", event.finish_reason)]

    def usage_chunk(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model_id,
                "choices": [], "usage": self.usage()}

"""Tokenizer wrapper over HF `tokenizers`, chat templates rendered with jinja2, and streaming detokenization."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Iterable

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from colibri.core.errors import InputError, ModelLoadError


def _raise(message: str) -> None:
    raise InputError(f"chat template: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


ROLES = ("system", "user", "assistant", "tool")  # what chat templates are written for (the server maps "developer")


class ChatTemplate:
    """A checkpoint's jinja chat template, rendered the way HF `apply_chat_template` does."""

    def __init__(self, source: str, special_tokens: dict[str, str | None]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
            self.variables = frozenset(meta.find_undeclared_variables(env.parse(source)))
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"the checkpoint's chat template does not parse: {e}") from None
        self.source = source
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}

    @property
    def supports_tools(self) -> bool:
        """Whether the template renders a `tools` list (function definitions) into the prompt."""
        return "tools" in self.variables

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text; `kwargs` are template variables such as `tools` (a list of function schemas)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InputError("chat needs a non-empty list of messages ({'role': ..., 'content': ...})")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InputError("each chat message must be a dict with 'role' and 'content'")
            if m["role"] not in ROLES:
                raise InputError(f"chat message role {m['role']!r} is not one of {', '.join(ROLES)}")
            if not isinstance(m["content"], str):
                raise InputError(f"chat message content must be text (got {type(m['content']).__name__})")
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens, **kwargs)
        except jinja2.TemplateError as e:
            raise InputError(f"chat template failed to render: {e}") from None


class Tokenizer:
    """encode/decode text; `eos_ids` end generation; `chat_template` may be None (then chat() refuses)."""

    def __init__(self, tk, eos_ids: Iterable[int], bos_id: int | None = None,
                 chat_template: str | None = None, special_tokens: dict[str, str | None] | None = None):
        self.tk = tk
        self.eos_ids = sorted({int(i) for i in eos_ids})
        self.bos_id = bos_id
        self.special_tokens = special_tokens or {}
        self.chat_template = ChatTemplate(chat_template, self.special_tokens) if chat_template else None

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: bytes that were not UTF-8 (surrogateescape'd argv)
            raise InputError(f"the text is not valid Unicode at character {e.start} ({text[e.start]!r}, e.g. "
                             "bytes that are not UTF-8); give UTF-8 text") from None
        return self.tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if self.chat_template is None:
            raise InputError("this model has no chat template; use a raw prompt (--raw / generate())")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        # The template already writes BOS and friends, so no special tokens are added on top (as HF does).
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)


class StreamDecoder:
    """Incremental detokenization: emits text only once it is stable and never splits a UTF-8 character.

    Decodes a short window of ids (from `prefix` on) so SentencePiece-style leading-space handling and multi-token
    characters come out the same as decoding the whole sequence.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (e.g. an incomplete character at the very end)."""
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):]

"""Grammar-constrained sampling through llguidance (the optional `grammar` extra: pip install 'colibri[grammar]').

A request's `grammar` (SamplingParams.grammar: an llguidance grammar, e.g. from `json_schema_grammar`) becomes a
`Constraint`: one LLMatcher of its own that masks, before each draw, every token the grammar forbids after the
sequence's tokens so far, and follows each token drawn. A mask depends only on the sequence's own tokens, so
batching never changes what a constrained sequence samples. Once the grammar is complete only EOS is allowed.
"""

from __future__ import annotations

import importlib.util
import json
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

from colibri.core.errors import InputError

if TYPE_CHECKING:
    from colibri.formats.tokenizer import Tokenizer

_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Tokenizer -> llguidance LLTokenizer


def available() -> bool:
    """Whether llguidance is installed (the `grammar` extra)."""
    return importlib.util.find_spec("llguidance") is not None


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise InputError("structured output (response_format json_object / json_schema, required tool calls) needs"
                         " llguidance: pip install 'colibri[grammar]'") from None
    return llguidance


def _ll_tokenizer(tokenizer: "Tokenizer"):
    """The tokenizer as llguidance reads it (built once per tokenizer: about a second for a 50k vocabulary)."""
    ll = _TOKENIZERS.get(tokenizer)
    if ll is None:
        try:
            ll = _llguidance().LLTokenizer(tokenizer.tk.to_str(), eos_token=list(tokenizer.eos_ids))
        except (ValueError, TypeError, RuntimeError) as e:  # e.g. a word-level vocabulary that cannot spell bytes
            raise InputError(f"this model's tokenizer cannot drive constrained sampling ({e})") from None
        _TOKENIZERS[tokenizer] = ll
    return ll


# JSON as one line with the usual separators: no free-form whitespace for a small model to loop in
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _styled(schema: dict | None) -> dict:
    schema = {"type": "object"} if schema is None else schema
    if not isinstance(schema, dict):
        raise InputError(f"a JSON schema must be an object (got {type(schema).__name__})")
    return {**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}}


def json_schema_grammar(schema: dict | None) -> str:
    """An llguidance grammar for JSON text matching `schema` (None: any JSON object)."""
    try:
        return _llguidance().LLMatcher.grammar_from_json_schema(json.dumps(_styled(schema)))
    except (ValueError, TypeError) as e:
        raise InputError(f"the JSON schema cannot be compiled: {e}") from None


def choice_grammar(choices: list[tuple[str, dict | None]], suffix: str) -> str:
    """An llguidance grammar for one of `choices` (literal text, then JSON matching its schema), then `suffix`:
    e.g. the rest of a tool-call block after its opening, one choice per tool."""
    lines = ["start: choice " + json.dumps(suffix), "choice: " + " | ".join(f"c{i}" for i in range(len(choices)))]
    for i, (text, schema) in enumerate(choices):
        lines.append(f"c{i}: {json.dumps(text)} j{i}" if text else f"c{i}: j{i}")
        lines.append(f"j{i}: %json {json.dumps(_styled(schema))}")
    return _llguidance().LLMatcher.grammar_from_lark("\n".join(lines))


def check(grammar: str, tokenizer: "Tokenizer") -> None:
    """An InputError naming what is wrong when `grammar` does not compile (before any request runs it)."""
    Constraint(grammar, tokenizer)


class Constraint:
    """One sequence's grammar state: `mask(logits)` [V] -> logits with the forbidden tokens at -inf;
    `advance(token)` after each draw."""

    def __init__(self, grammar: str, tokenizer: "Tokenizer"):
        ll = _llguidance()
        self.tokenizer = _ll_tokenizer(tokenizer)
        self.matcher = ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise InputError(f"the grammar does not compile: {self.matcher.get_error()}")
        self.words = (self.tokenizer.vocab_size + 31) // 32
        self.bitmask = torch.empty(self.words, dtype=torch.int32)  # one bit per token, little-endian in each word

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        m = self.bitmask
        self.matcher.unsafe_compute_mask_ptr(m.data_ptr(), m.numel() * m.element_size())
        # in numpy: unpackbits is ~1000x faster than torch's broadcast int32 shift, and these [V] element-wise
        # steps stay off torch's thread pool (whose waits cost tens of ms on a busy machine)
        allowed = np.unpackbits(m.numpy().view(np.uint8), bitorder="little").view(np.bool_)  # [32 * words]
        out = logits.numpy().copy()
        n = min(out.shape[0], allowed.shape[0])
        out[:n][~allowed[:n]] = -np.inf
        out[n:] = -np.inf  # tokens past the tokenizer's vocabulary (padding rows) are never allowed
        return torch.from_numpy(out)

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token) and not self.matcher.is_stopped():
            raise InputError(f"the grammar rejected token {token}: {self.matcher.get_error()}")

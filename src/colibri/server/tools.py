"""Tool calls: OpenAI messages into a chat template's variables, and the model's tool-call blocks back out.

The tools reach the model through its own chat template (`tools=[...]`), so the prompt is the one the model was
trained on; a template that never reads `tools` cannot be given any. The template also says which call syntax
the model writes (`syntax_of`, by what its source renders):

- Hermes / Qwen2.5: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, anywhere in the reply;
- Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, a JSON array opening the reply;
- Llama 3.x: `{"name": ..., "parameters": {...}}`, bare JSON opening the reply (after `<|python_tag|>`), several
  separated by `;` or new lines.

The parser reads all three (their shapes do not overlap): a complete Hermes block with valid JSON becomes a
`tool_calls` entry; a block whose JSON does not parse is left in the text, and so is a block cut off by
max_tokens: nothing the model wrote is dropped (a block the model ended itself, with EOS instead of the closing
tag, is a call when its JSON is whole). A reply that opens with `{`, `[` or a call marker while tools are given
is held to its end and read as calls when it is nothing but call objects (or one array of them), each naming
one of the request's tools: the Mistral and Llama syntaxes, and the bare JSON small Hermes-family models often
write without the tags (Qwen2.5-Coder-0.5B does, greedy). Special tokens such as `[TOOL_CALLS]` and
`<|python_tag|>` are usually dropped from the decoded text; where they are not, they are skipped.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass

from colibri.server.schema import APIError, ChatRequest, Message

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MARKERS = ("[TOOL_CALLS]", "<|python_tag|>")  # what may open a reply of bare calls when the tokens decode as text


@dataclass(frozen=True)
class Syntax:
    """How a template's model writes one call: `open` + {"name": ..., `args`: {...}} + `close` (what tool_choice
    writes into the prompt and the grammar completes)."""

    name: str
    open: str
    args: str
    close: str


HERMES = Syntax("hermes", OPEN + "\n", "arguments", "\n" + CLOSE)
MISTRAL = Syntax("mistral", "[TOOL_CALLS] [", "arguments", "]")
LLAMA3 = Syntax("llama3", "", "parameters", "")


def syntax_of(template) -> Syntax | None:
    """The call syntax a chat template renders (None: none this server parses)."""
    src = template.source
    if OPEN in src:
        return HERMES
    if "[TOOL_CALLS]" in src:
        return MISTRAL
    if "<|start_header_id|>" in src and '"parameters"' in src:
        return LLAMA3
    return None


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def template_messages(messages: list[Message], syntax: "Syntax | None" = None) -> list[dict]:
    """OpenAI messages as chat templates read them: text parts joined, `developer` as `system`, an assistant's
    tool-call arguments as objects (templates serialize them with `tojson`). For the Mistral syntax, call ids
    become 9 letters and digits (its templates refuse any other id; the same id maps to the same 9)."""
    ident = _mistral_id if syntax is MISTRAL else str
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(
            p.text for p in m.content)
        msg: dict = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = ident(m.tool_call_id)
        if m.tool_calls:
            msg["tool_calls"] = [{"id": ident(c.id), "type": "function",
                                  "function": {"name": c.function.name, "arguments": _loads(c.function.arguments)}}
                                 for c in m.tool_calls]
        out.append(msg)
    return out


def _mistral_id(call_id: str) -> str:
    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def template_tools(req: ChatRequest, template) -> list[dict] | None:
    """The `tools` variable for the template, or None when the request has none (or tool_choice is "none").
    A template without tool support, or whose tool-call syntax is not parsed here, is a 400."""
    if req.tool_choice is not None and req.tool_choice != "none" and not req.tools:
        raise APIError(400, "tool_choice needs a tools list", param="tool_choice", code="invalid_value")
    if not req.tools or req.tool_choice == "none":
        return None
    if template is None or not template.supports_tools:
        raise APIError(400, "this model's chat template does not support tools (it never renders a `tools`"
                            " list); send the request without `tools`", param="tools", code="tools_unsupported")
    if syntax_of(template) is None:
        raise APIError(400, "this model's chat template renders tools, but its tool-call syntax is not one this"
                            " server parses (Hermes <tool_call>, Mistral [TOOL_CALLS], Llama 3 JSON); give one"
                            " with --chat-template", param="tools", code="tools_unsupported")
    return [t.model_dump(exclude_none=True) for t in req.tools]


def forced_start(req: ChatRequest, syntax: Syntax = HERMES) -> str:
    """The start of the reply that tool_choice imposes, written into the prompt for the model to continue:
    "required" opens a call (the model picks the tool), a named function opens that function's call (the model
    writes its arguments); "" for "auto" / "none"."""
    choice = req.tool_choice
    if choice in (None, "auto", "none"):
        return ""
    if choice == "required":
        return syntax.open + '{"name": "'
    names = [t.function.name for t in req.tools]
    if choice.function.name not in names:
        raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not in tools ({', '.join(names)})",
                       param="tool_choice", code="invalid_value")
    return syntax.open + json.dumps({"name": choice.function.name})[:-1] + f', "{syntax.args}": '


def call_grammar(req: ChatRequest, forced: str, syntax: Syntax = HERMES) -> str | None:
    """The grammar the rest of a forced call follows (None when tool_choice forces none): the tool's name among
    the request's tools ("required"), then arguments matching that tool's `parameters` schema, then the block's
    end. The reply then ends (EOS)."""
    if not forced:
        return None
    from colibri.engine.grammar import choice_grammar
    end = "}" + syntax.close
    schemas = {t.function.name: t.function.parameters for t in req.tools}
    if req.tool_choice == "required":
        return choice_grammar([(json.dumps(name)[1:] + f', "{syntax.args}": ', schema)
                               for name, schema in schemas.items()], end)
    return choice_grammar([("", schemas[req.tool_choice.function.name])], end)


def parse_block(body: str) -> dict | None:
    """One block's JSON as an OpenAI tool call, or None when it is not {"name": str, "arguments": ...}."""
    try:
        return as_call(json.loads(body))
    except json.JSONDecodeError:
        return None


def as_call(obj) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


@dataclass
class Parsed:
    content: str | None  # the text outside the parsed blocks (None when there is none)
    tool_calls: list[dict]
    unterminated: bool  # the text ends inside an open block (kept in `content`)


def parse(text: str, names: set[str] | frozenset = frozenset(), ended: bool = False) -> Parsed:
    """Split a whole reply into text and tool calls (`names`: the request's tools, for bare JSON calls; `ended`:
    the model ended the reply itself, see StreamFilter.finish)."""
    f = StreamFilter(names)
    events = f.push(text) + f.finish(ended)
    content = "".join(v for kind, v in events if kind == "text")
    calls = [v for kind, v in events if kind == "tool_call"]
    return Parsed(content if content.strip() or not calls else None, calls, f.unterminated)


class StreamFilter:
    """Text deltas in, ("text", str) and ("tool_call", dict) events out. Text that may be the start of a block
    is held back until it is known not to be; a block is held whole until it closes; a reply that starts with
    `{` while tools are named is held to its end (it may be bare calls)."""

    def __init__(self, names: set[str] | frozenset = frozenset()) -> None:
        self.names = names
        self.buf = ""
        self.inside = False
        self.unterminated = False
        self.bare: bool | None = None if names else False  # None: the reply's first character is still to come

    def push(self, delta: str) -> list[tuple[str, object]]:
        self.buf += delta
        out: list[tuple[str, object]] = []
        if self.bare is None and self.buf.strip():
            head = self.buf.lstrip()
            if any(m.startswith(head) for m in MARKERS if len(head) < len(m)):
                return out  # may still become a marker
            self.bare = head.startswith(("{", "[") + MARKERS)
        if self.bare is not False:
            return out
        while True:
            if self.inside:
                end = self.buf.find(CLOSE)
                if end < 0:
                    return out
                body, self.buf, self.inside = self.buf[len(OPEN):end], self.buf[end + len(CLOSE):], False
                call = parse_block(body)
                out.append(("tool_call", call) if call else ("text", OPEN + body + CLOSE))
                continue
            start = self.buf.find(OPEN)
            if start >= 0:
                if start:
                    out.append(("text", self.buf[:start]))
                self.buf, self.inside = self.buf[start:], True
                continue
            keep = _partial_suffix(self.buf, OPEN)
            cut = len(self.buf) - keep
            if cut:
                out.append(("text", self.buf[:cut]))
                self.buf = self.buf[cut:]
            return out

    def finish(self, ended: bool = False) -> list[tuple[str, object]]:
        """The end of the reply: what is held back goes out as text. A block left open is a call only when the
        model ended the reply itself (`ended`: EOS or a stop string) and its JSON is whole (models often end a
        call with EOS instead of the closing tag); cut off by max_tokens it stays text."""
        self.unterminated = self.inside
        if self.inside and ended:
            call = parse_block(self.buf[len(OPEN):])
            if call:
                self.buf, self.inside, self.unterminated = "", False, False
                return [("tool_call", call)]
        rest, self.buf, self.inside = self.buf, "", False
        if self.bare:
            calls = bare_calls(rest, self.names)
            if calls:
                return [("tool_call", c) for c in calls]
        return [("text", rest)] if rest else []


def bare_calls(text: str, names) -> list[dict] | None:
    """Calls written as bare JSON (one object, an array of them, or objects one per line or separated by `;`),
    after a call marker or none, each naming a known tool; None if the text is not that."""
    text = text.strip()
    for marker in MARKERS:
        text = text.removeprefix(marker).strip()
    objs, i, decoder = [], 0, json.JSONDecoder()
    while i < len(text):
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        objs += obj if isinstance(obj, list) and len(objs) == 0 and i == len(text) else [obj]
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
    calls = [as_call(o) if isinstance(o, dict) and o.get("name") in names else None for o in objs]
    return calls if calls and all(calls) else None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0

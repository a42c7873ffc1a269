"""What an open dashboard costs the engine: decode tok/s through `colibri serve` with no dashboard, with an SSE
client reading the dashboard's frames (the server's own cost: frames, the store's picture), and with the page
open in headless Chromium on the same machine (that cost plus a browser drawing 4 frames a second beside the
engine, on the same cores). Optionally saves a screenshot of the dashboard under load.

    python benchmarks/dashboard.py --model DIR [--memory-limit 150M] [--rounds 4] [--tokens 64] [--clients 2]
                                   [--threads 1] [--screenshot docs/img/dashboard.png] [--ids]

`--ids` sends token-id prompts (a container without a tokenizer: benchmarks/synth.py's; it streams no text, so
there is no rate to take: use it with `--rounds 0`, which only takes the screenshot). docs/img/dashboard.png is SmolLM2-135M at 120M, dashboard-moe.png the Mixtral-8x7B shape cut to 4
layers (benchmarks/synth.py --shape mixtral-8x7b --layers 4) at 1200M.

`--paired sse|browser` measures differently: `clients` long streams (EOS ignored, `--tokens` each) decode while the
dashboard is switched on and off every `--window` seconds (an SSE reader, or the page in headless Chromium
navigated to it and away); each "on" window's tok/s is set against the mean of the "off" windows beside it, so
slow drift in the machine's load cancels; prints the median of those ratios as the drop, in %.

Each round runs the conditions in turn, starting one further along each round (none, sse, browser; sse,
browser, none; ...), so drift on a shared machine and what earlier requests leave behind (the prefix cache, the
n-gram drafts) spread over all of them; per condition the decode rate is the median over rounds of `clients` concurrent greedy completions of
`tokens` tokens each (ignore_eos): tokens that arrived after the last first token, over that time. Prints one
line per round and a JSON summary (the drop of each condition against `none`, in %).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from serve import colibri, prompt  # noqa: E402


def decode_rate(url: str, count: int, tokens: int, ids: bool = False) -> float:
    """Aggregate decode tok/s of `count` concurrent streamed completions, counted after the last first token."""
    arrivals: list[list[float]] = [[] for _ in range(count)]

    def one(i: int) -> None:
        text = [1] + [100 + 7 * i + k for k in range(16)] if ids else prompt(i)
        body = {"model": "m", "prompt": text, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    arrivals[i].append(time.perf_counter())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not all(arrivals):  # no text came (a container without a tokenizer streams no text): no rate
        return float("nan")
    lo = max(a[0] for a in arrivals)
    hi = max(a[-1] for a in arrivals)
    inside = sum(1 for a in arrivals for t in a if t > lo)
    return inside / (hi - lo)


class SSEWatcher:
    """Reads /dashboard/events in a thread, as an open dashboard does, until stopped."""

    def __init__(self, url: str):
        self.url, self.frames, self.stop = url, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.stream("GET", self.url + "/dashboard/events", timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    self.frames += 1
                if self.stop.is_set():
                    return

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def paired(url: str, a, browser) -> dict:
    """Decode while the dashboard is switched on and off every a.window seconds; the drop per on-window against
    the mean of its neighbouring off-windows (see the module docstring)."""
    arrivals: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        body = {"model": "m", "prompt": prompt(i), "max_tokens": a.tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
            if r.status_code != 200:  # e.g. --tokens past the context the memory limit leaves
                r.read()
                errors.append(f"stream {i}: HTTP {r.status_code}: {r.text[:300]}")
                return
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    with lock:
                        arrivals.append(time.perf_counter())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(a.clients)]
    for t in threads:
        t.start()
    page = browser.new_page(viewport={"width": 1280, "height": 900}) if a.paired == "browser" else None
    time.sleep(3)  # every stream past its prefill
    windows: list[tuple[bool, float, float]] = []  # (dashboard on, start, end)
    on = False
    while any(t.is_alive() for t in threads):
        watcher = None
        if on and page is not None:
            page.goto(url + "/")
        elif on:
            watcher = SSEWatcher(url)
        start = time.perf_counter()
        time.sleep(a.window)
        windows.append((on, start, time.perf_counter()))
        if watcher is not None:
            watcher.close()
        if on and page is not None:
            page.goto("about:blank")
        on = not on
    rates = []
    for w0, w1 in [(w[1], w[2]) for w in windows]:
        n = sum(1 for t in arrivals if w0 <= t < w1)
        rates.append(n / (w1 - w0))
    for t in threads:
        t.join()
    end = sorted(arrivals)[-1] if arrivals else 0
    # only windows while every stream decoded (the streams end one by one in the last window or so)
    full = [i for i, w in enumerate(windows) if w[2] <= end - a.window]
    ratios = [rates[i] / ((rates[i - 1] + rates[i + 1]) / 2) for i in full
              if windows[i][0] and 0 < i < len(windows) - 1 and i + 1 in full and rates[i - 1] + rates[i + 1] > 0]
    if page is not None:
        page.close()
    if errors:
        raise SystemExit("\n".join(errors))
    return {"mode": a.paired, "window_s": a.window, "windows": len(full), "pairs": len(ratios),
            "drop_pct_median": round(100 * (1 - statistics.median(ratios)), 2) if ratios else None,
            "ratios": [round(r, 4) for r in ratios]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--memory-limit", default=None)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--port", type=int, default=8791)
    ap.add_argument("--screenshot", help="save a screenshot of the dashboard under load here (needs chromium)")
    ap.add_argument("--ids", action="store_true", help="token-id prompts (a container without a tokenizer)")
    ap.add_argument("--paired", choices=["sse", "browser"], help="switch the dashboard on and off during long streams")
    ap.add_argument("--window", type=float, default=2.0, help="--paired: seconds per on or off window")
    a = ap.parse_args()
    url = f"http://127.0.0.1:{a.port}"
    # no speculation: its n-gram drafts learn the repeated prompts, so later runs would decode faster whatever
    # the condition
    cmd = colibri() + ["serve", "--model", a.model, "--model-name", "m", "--port", str(a.port), "--threads",
                       str(a.threads), "--max-sequences", str(max(a.clients, 4)), "--draft-tokens", "0"]
    if a.memory_limit:
        cmd += ["--memory-limit", a.memory_limit]
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stderr=log, stdout=subprocess.DEVNULL)
    chromium = shutil.which("chromium")
    browser = pw = None
    try:
        while True:
            assert proc.poll() is None, "colibri serve exited"
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        decode_rate(url, a.clients, 8, a.ids)  # warm-up
        if a.paired:
            if a.paired == "browser":
                from playwright.sync_api import sync_playwright
                pw = sync_playwright().start()
                browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
            print(json.dumps({"model": a.model, "memory_limit": a.memory_limit, "clients": a.clients,
                              "tokens": a.tokens, "threads": a.threads, **paired(url, a, browser)}))
            return 0
        conditions = ["none", "sse"]
        if chromium:
            from playwright.sync_api import sync_playwright
            pw = sync_playwright().start()
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
            conditions.append("browser")
        rates: dict[str, list[float]] = {c: [] for c in conditions}
        for r in range(a.rounds):
            for c in conditions[r % len(conditions):] + conditions[:r % len(conditions)]:  # no order bias
                watcher = SSEWatcher(url) if c == "sse" else None
                page = browser.new_page(viewport={"width": 1280, "height": 900}) if c == "browser" else None
                if page is not None:
                    page.goto(url + "/")
                    page.wait_for_function("document.getElementById('model').textContent.includes('ready')")
                time.sleep(0.5)
                rates[c].append(decode_rate(url, a.clients, a.tokens, a.ids))
                if page is not None:
                    page.close()
                if watcher is not None:
                    watcher.close()
            print(f"round {r}: " + ", ".join(f"{c} {rates[c][-1]:.2f}" for c in conditions) + " tok/s",
                  file=sys.stderr, flush=True)
        if a.screenshot and browser is not None:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url + "/")
            load = threading.Thread(target=decode_rate, args=(url, a.clients, a.tokens * 4, a.ids))
            load.start()
            page.wait_for_function("[...document.querySelectorAll('#requests td')].filter(td => td.textContent"
                                   " === 'running').length >= 1")
            time.sleep(3)
            page.screenshot(path=a.screenshot, full_page=True)
            load.join()
            page.close()
        if not a.rounds:
            return 0
        base = statistics.median(rates["none"])
        summary = {c: {"median_tok_s": round(statistics.median(v), 3), "all": [round(x, 3) for x in v],
                       "drop_pct": round(100 * (1 - statistics.median(v) / base), 2)} for c, v in rates.items()}
        print(json.dumps({"model": a.model, "memory_limit": a.memory_limit, "clients": a.clients,
                          "tokens": a.tokens, "threads": a.threads, "rounds": a.rounds, "conditions": summary}))
    finally:
        if browser is not None:
            browser.close()
            pw.stop()
        proc.terminate()
        proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())

// Shared by the dashboard and the chat page: the API key (asked for when the server answers 401) and SSE parsing.
"use strict";
const colibri = {
  key() { return localStorage.getItem("colibri-key") || ""; },
  headers(extra) {
    const h = Object.assign({}, extra || {});
    if (colibri.key()) h["Authorization"] = "Bearer " + colibri.key();
    return h;
  },
  askKey(onSaved) {
    const box = document.getElementById("keybox");
    box.classList.add("shown");
    const input = box.querySelector("input");
    input.focus();
    box.querySelector("button").onclick = () => {
      localStorage.setItem("colibri-key", input.value.trim());
      box.classList.remove("shown");
      onSaved();
    };
  },
  // Calls onData(parsed JSON or "[DONE]") for each `data:` line of a text/event-stream response body.
  async readSSE(response, onData) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          onData(data === "[DONE]" ? data : JSON.parse(data));
        }
      }
    }
  },
  fmtBytes(n) {
    if (n == null) return "–";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : n.toFixed(0)) + " " + u[i];
  },
  fmt(x, digits) { return x == null ? "–" : Number(x).toFixed(digits == null ? 1 : digits); },
};

// The chat page: a conversation streamed from /v1/chat/completions; Stop aborts the request (the server drops the
// sequence when the connection closes); each reply shows its stats (TTFT, tok/s, reused tokens, bytes read).
"use strict";
const $ = (id) => document.getElementById(id);
let messages = [], model = null, controller = null;

async function loadSettings() {
  const response = await fetch("/dashboard/state", { headers: colibri.headers() });
  if (response.status === 401) { colibri.askKey(loadSettings); return; }
  const state = await response.json();
  model = state.settings.model;
  $("model").textContent = `${model} · ${state.settings.state}`;
  const dl = $("settings");
  dl.replaceChildren();
  for (const [k, v] of Object.entries(state.settings)) {
    if (v == null) continue;
    const dt = document.createElement("dt"), dd = document.createElement("dd");
    dt.textContent = k.replaceAll("_", " ");
    dd.textContent = k.endsWith("_bytes") ? colibri.fmtBytes(v) : v;
    dl.append(dt, dd);
  }
}

function bubble(role, content) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("span");
  body.className = "body";
  body.textContent = content;
  div.appendChild(body);
  $("log").appendChild(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

async function send(text) {
  messages.push({ role: "user", content: text });
  bubble("user", text);
  const reply = bubble("assistant", "");
  const body = reply.querySelector(".body");
  const stats = document.createElement("span");
  stats.className = "stats";
  reply.appendChild(stats);
  controller = new AbortController();
  busy(true);
  const t0 = performance.now();
  let first = null, usage = null, reason = null, content = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: colibri.headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({ model, messages, stream: true, stream_options: { include_usage: true },
                             temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value) }),
    });
    if (response.status === 401) { colibri.askKey(() => {}); throw new Error("the server wants an API key"); }
    if (!response.ok) throw new Error((await response.json()).error.message);
    await colibri.readSSE(response, (chunk) => {
      if (chunk === "[DONE]") return;
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) {
          if (first === null) first = performance.now();
          content += choice.delta.content;
          body.textContent = content;
          $("log").scrollTop = $("log").scrollHeight;
        }
        if (choice.finish_reason) reason = choice.finish_reason;
      }
    });
    messages.push({ role: "assistant", content });
    const secs = (performance.now() - (first || t0)) / 1000;
    const parts = [`TTFT ${colibri.fmt(first === null ? null : (first - t0) / 1000, 2)} s`];
    if (usage) {
      const c = usage.colibri || {};
      parts.push(`${usage.completion_tokens} tokens`,
                 `${colibri.fmt(c.decode_tok_s != null ? c.decode_tok_s : usage.completion_tokens / secs)} tok/s`,
                 `${usage.prompt_tokens_details.cached_tokens} of ${usage.prompt_tokens} prompt tokens reused`,
                 `${colibri.fmtBytes(c.disk_bytes_read || 0)} read`);
    }
    parts.push(`finish: ${reason}`);
    stats.textContent = parts.join(" · ");
  } catch (e) {
    if (e.name === "AbortError") {
      messages.push({ role: "assistant", content });
      stats.textContent = "stopped · " + content.length + " characters kept";
    } else {
      reply.classList.add("error");
      stats.textContent = "error: " + e.message;
      messages.pop();
    }
  } finally {
    controller = null;
    busy(false);
    $("input").focus();
  }
}

$("compose").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("compose").requestSubmit(); }
});
document.addEventListener("keydown", (ev) => { if (ev.key === "Escape" && controller) controller.abort(); });
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("reset").addEventListener("click", () => {
  if (controller) controller.abort();
  messages = [];
  $("log").replaceChildren();
  $("input").focus();
});
loadSettings();
$("input").focus();

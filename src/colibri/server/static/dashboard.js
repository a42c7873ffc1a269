// The dashboard: frames pushed over SSE from /dashboard/events (server/dashboard.py), drawn as they come.
"use strict";
const $ = (id) => document.getElementById(id);
const TIER_COLORS = { "pinned weights": "var(--pinned)", "staging": "var(--staging)", "expert cache": "var(--cache)",
  "KV in RAM": "var(--kv)", "activations": "var(--act)", "free": "var(--free)" };
const STATE_COLORS = ["var(--pinned)", "var(--resident)", "var(--loading)", "var(--disk)"];

function text(id, value) { const el = $(id); if (el.textContent !== value) el.textContent = value; }

// A section's nodes are rebuilt only when its data changed since the last frame: a browser on the engine's own
// machine spends its layout and paint on the same cores as the engine (docs/performance.md, dashboard overhead).
const last = {};
function changed(key, data) {
  const s = JSON.stringify(data);
  if (last[key] === s) return false;
  last[key] = s;
  return true;
}

function drawMemory(mem) {
  const total = mem.limit_bytes || mem.parts.reduce((a, p) => a + p.bytes, 0) || 1;
  text("limit", mem.limit_bytes ? "limit " + colibri.fmtBytes(mem.limit_bytes) :
       "no --memory-limit: every weight in RAM");
  const bar = $("tiers"), legend = $("tier-legend");
  bar.replaceChildren(...mem.parts.filter((p) => p.bytes > 0).map((p) => {
    const d = document.createElement("div");
    d.style.width = (100 * p.bytes / total).toFixed(2) + "%";
    d.style.background = TIER_COLORS[p.name];
    d.title = p.name + " " + colibri.fmtBytes(p.bytes);
    return d;
  }));
  const items = mem.parts.map((p) => {
    const s = document.createElement("span");
    s.style.setProperty("--c", TIER_COLORS[p.name]);
    s.textContent = p.name + " " + colibri.fmtBytes(p.bytes);
    return s;
  });
  const swap = document.createElement("span");
  swap.style.setProperty("--c", "var(--kvswap)");
  swap.textContent = "KV on swap (disk) " + colibri.fmtBytes(mem.kv_swap_bytes);
  legend.replaceChildren(...items, swap);
  bar.setAttribute("aria-label", "memory tiers: " + items.map((s) => s.textContent).join(", "));
}

function drawLayers(pic) {
  $("layers-section").hidden = false;
  const strip = $("layers");
  if (strip.children.length !== pic.layers.length) {  // built once: a cell per layer, a span per state
    strip.replaceChildren(...pic.layers.map(() => {
      const cell = document.createElement("div");
      STATE_COLORS.forEach((c) => {
        const s = document.createElement("span");
        s.style.background = c;
        cell.appendChild(s);
      });
      return cell;
    }));
  }
  pic.layers.forEach((row, i) => {  // then only heights and titles change
    const cell = strip.children[i], sum = row.reduce((a, b) => a + b, 0) || 1;
    row.forEach((b, k) => {
      const span = cell.children[k], h = b ? (100 * b / sum).toFixed(1) + "%" : "";
      if (span.style.height !== h) span.style.height = h;
      const shown = b ? "" : "none";  // not `hidden`: the stylesheet's display: block would win over it
      if (span.style.display !== shown) span.style.display = shown;
    });
    const title = "layer " + i + ": " + pic.tiers.map((t, k) => t + " " + colibri.fmtBytes(row[k])).join(", ");
    if (cell.title !== title) cell.title = title;
  });
}

function drawHeat(pic) {
  $("heat-section").hidden = false;
  const heat = pic.heat, rows = heat.length, cols = heat[0].length;
  const canvas = $("heat"), cell = Math.max(4, Math.floor(Math.min(24, 900 / cols)));
  canvas.width = cols * cell; canvas.height = rows * cell;
  const ctx = canvas.getContext("2d");
  const top = Math.max(1e-9, ...heat.flat());
  for (let i = 0; i < rows; i++) for (let e = 0; e < cols; e++) {
    const v = heat[i][e] / top;
    ctx.fillStyle = `rgb(${Math.round(255 - 40 * v)},${Math.round(245 - 190 * v)},${Math.round(235 - 200 * v)})`;
    ctx.fillRect(e * cell, i * cell, cell, cell);
  }
  ctx.strokeStyle = "#1d3557"; ctx.lineWidth = Math.max(1, cell / 6);
  for (const [i, e] of pic.pinned_experts) ctx.strokeRect(e * cell + 1, i * cell + 1, cell - 2, cell - 2);
  text("heat-note", `${rows} layers × ${cols} experts, decayed use counts (darker: hotter); outlined: pinned`);
}

function drawRequests(rows) {
  const body = $("requests");
  if (!rows.length) {
    if (!body.querySelector(".muted")) body.innerHTML = '<tr><td colspan="8" class="muted">no requests</td></tr>';
    return;
  }
  if (body.querySelector(".muted")) body.replaceChildren();
  while (body.rows.length > rows.length) body.deleteRow(-1);
  while (body.rows.length < rows.length) {
    const tr = body.insertRow();
    for (let k = 0; k < 8; k++) tr.insertCell();
  }
  rows.forEach((r, i) => {  // cells updated in place: only the text that changed is laid out again
    const cells = body.rows[i].cells;
    [r.id, r.state, r.prompt_tokens, r.reused_tokens, r.generated_tokens + " / " + r.max_tokens,
     colibri.fmt(r.ttft_s, 2), colibri.fmt(r.decode_tok_s), colibri.fmt(r.age_s, 1)].forEach((v, k) => {
      if (cells[k].textContent !== String(v)) cells[k].textContent = v;
    });
  });
}

function draw(f) {
  text("model", `${f.model} · ${f.state}`);
  if (!f.rates) return;
  const r = f.rates;
  text("agg", colibri.fmt(r.aggregate_tok_s));
  text("decode", colibri.fmt(r.decode_tok_s));
  text("prefill", colibri.fmt(r.prefill_tok_s));
  text("ttft", colibri.fmt(r.ttft_s, 2) + " / " + colibri.fmt(r.ttft_mean_s, 2));
  text("disk", colibri.fmt(r.disk_gb_s, 2));
  text("seqs", f.running + " / " + f.queued);
  if (changed("memory", f.memory)) drawMemory(f.memory);
  if (f.picture && f.picture.layers && changed("layers", [f.picture.layers, f.picture.tiers])) drawLayers(f.picture);
  if (f.picture && f.picture.heat && changed("heat", [f.picture.heat, f.picture.pinned_experts])) drawHeat(f.picture);
  const extra = [];
  if (f.speculation) {
    const s = f.speculation;
    extra.push(`speculation: ${s.spec_accepted_tokens} of ${s.spec_drafted_tokens} drafted tokens accepted ` +
               `(${colibri.fmt(100 * s.spec_acceptance_rate)} %), ${colibri.fmt(s.tokens_per_pass, 2)} tokens per pass`);
  }
  if (f.experts) {
    extra.push(`expert hit rate ${colibri.fmt(100 * f.experts.hit_rate)} %` + (f.experts.lookahead_recall == null ? "" :
               `, lookahead recall ${colibri.fmt(100 * f.experts.lookahead_recall)} %`));
  }
  $("extra-section").hidden = !extra.length;
  text("extra", extra.join(" · "));
  drawRequests(f.requests);
  const t = f.totals;
  text("totals", `${t.generated_tokens} tokens generated, ${t.requests} requests answered, ` +
       `${colibri.fmtBytes(t.disk_bytes_read)} of weights read, ${t.engine_steps} engine steps`);
}

async function connect() {
  try {
    const response = await fetch("/dashboard/events", { headers: colibri.headers() });
    if (response.status === 401) { colibri.askKey(connect); return; }
    if (!response.ok) throw new Error("HTTP " + response.status);
    await colibri.readSSE(response, draw);
  } catch (e) {
    text("model", "disconnected (" + e.message + "); retrying");
  }
  setTimeout(connect, 2000);
}
connect();

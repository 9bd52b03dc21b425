// The audit page: vanilla JavaScript over the JSON endpoints of
// src/http/audit_page.rs. The URL fragment `#c=CONV&event=ID` selects a
// conversation and clicks the chart point of event ID once it is drawn
// (`&summary=ID` also clicks that summary of the DAG).
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const state = { conv: null, audit: null, dag: null, selected: null };

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function svgEl(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}

async function getJson(url) {
  const resp = await fetch(url);
  const body = await resp.json();
  if (!resp.ok) throw new Error(body.error || resp.statusText);
  return body;
}

function fragment() {
  const out = {};
  for (const part of location.hash.replace(/^#/, "").split("&")) {
    const i = part.indexOf("=");
    if (i > 0) out[decodeURIComponent(part.slice(0, i))] = decodeURIComponent(part.slice(i + 1));
  }
  return out;
}

// The label of an assembled message's source, as data-source.
function sourceLabel(s) {
  if (s.kind === "turn") return "turn:" + s.seq;
  if (s.kind === "summary") return "summary:" + s.id;
  if (s.kind === "missing_tool_result") return "missing_tool_result:" + s.call_id;
  return s.kind;
}

function contentText(m) {
  if (m.content === undefined || m.content === null) return "";
  if (typeof m.content === "string") return m.content;
  return JSON.stringify(m.content);
}

async function loadConversations() {
  const list = await getJson("/api/conversations");
  const box = document.getElementById("conversations");
  box.textContent = "";
  for (const st of list) {
    const health = (st.health && st.health.status) || "ok";
    const d = el("div", { class: "conv", "data-conversation": st.conversation });
    d.append(el("div", {}, st.conversation));
    const meta = el("div", { class: "meta" });
    meta.append(el("span", { class: "health " + health }, health), " ");
    const turns = st.turns ? st.turns.total : 0;
    const tokens = st.tokens ? st.tokens.context : "";
    meta.append(`${turns} turns, ${tokens} context tokens`);
    d.append(meta);
    d.addEventListener("click", () => selectConversation(st.conversation));
    box.append(d);
  }
  document.getElementById("where").textContent = `${list.length} conversation(s)`;
  return list;
}

async function selectConversation(conv) {
  state.conv = conv;
  for (const d of document.querySelectorAll("#conversations .conv")) {
    d.classList.toggle("selected", d.dataset.conversation === conv);
  }
  const body = await getJson("/api/audit?c=" + encodeURIComponent(conv));
  state.audit = body.audit;
  state.dag = body.dag;
  drawChart();
  drawDag();
  drawTimeline();
  document.body.dataset.conversation = conv;
}

function drawChart() {
  const svg = document.getElementById("chart");
  svg.textContent = "";
  const pts = state.audit.points;
  const W = 900, H = 300, L = 60, R = 10, T = 10, B = 25;
  const n = Math.max(pts.length - 1, 1);
  const ymax = Math.max(1, ...pts.map((p) => Math.max(p.context_tokens, p.budget))) * 1.08;
  const x = (i) => L + (i / n) * (W - L - R);
  const y = (v) => T + (1 - v / ymax) * (H - T - B);
  for (let k = 0; k <= 4; k++) {
    const v = (ymax / 4) * k;
    svg.append(svgEl("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), stroke: "#eee" }));
    const t = svgEl("text", { x: L - 4, y: y(v) + 4, "text-anchor": "end", fill: "#777" });
    t.textContent = Math.round(v);
    svg.append(t);
  }
  const line = (f, attrs) => {
    const d = pts.map((p, i) => `${i ? "L" : "M"}${x(p.index).toFixed(1)},${y(f(p)).toFixed(1)}`).join("");
    svg.append(svgEl("path", Object.assign({ d, fill: "none" }, attrs)));
  };
  line((p) => p.budget, { stroke: "#333", "stroke-dasharray": "6 4", class: "budget" });
  line((p) => p.threshold_tokens, { stroke: "#ff7f0e", "stroke-dasharray": "6 4", class: "threshold" });
  line((p) => p.target_tokens, { stroke: "#2ca02c", "stroke-dasharray": "6 4", class: "target" });
  line((p) => p.context_tokens, { stroke: "#1f77b4", "stroke-width": 2, class: "context" });
  for (const p of pts) {
    const attrs = {
      class: "pt", cx: x(p.index), cy: y(p.context_tokens), r: 3,
      fill: "#1f77b4", "fill-opacity": 0.25, "data-event": p.event_id, "data-index": p.index,
    };
    if (p.mark === "compaction") Object.assign(attrs, { r: 6, fill: "#8e24aa", "fill-opacity": 1, class: "pt mark-compaction" });
    if (p.mark === "overflow") Object.assign(attrs, { r: 6, fill: "#d50000", "fill-opacity": 1, class: "pt mark-overflow" });
    const c = svgEl("circle", attrs);
    const title = svgEl("title");
    title.textContent = `#${p.index} ${p.type} ${p.event_id}: ${p.context_tokens} tokens`;
    c.append(title);
    c.addEventListener("click", () => selectEvent(p.event_id));
    svg.append(c);
  }
}

function drawDag() {
  const svg = document.getElementById("dag");
  svg.textContent = "";
  const dag = state.dag;
  const W = 900, H = 220, L = 40, R = 10;
  const turns = Math.max(dag.turns, 1);
  const depth = Math.max(0, ...dag.nodes.map((n) => n.depth));
  const rowH = (H - 30) / (depth + 2);
  const x = (t) => L + (t / turns) * (W - L - R);
  // Row -1 (the raw strip) at the bottom, depth d above it.
  const rowY = (d) => H - 20 - (d + 2) * rowH;
  const byId = new Map(dag.nodes.map((n) => [n.id, n]));
  for (const n of dag.nodes) {
    for (const c of n.children || []) {
      const ch = byId.get(c);
      if (!ch) continue;
      svg.append(svgEl("line", {
        x1: x((n.first_turn + n.last_turn + 1) / 2), y1: rowY(n.depth) + rowH * 0.8,
        x2: x((ch.first_turn + ch.last_turn + 1) / 2), y2: rowY(ch.depth) + rowH * 0.2,
        stroke: "#000", "stroke-opacity": n.in_context ? 0.5 : 0.15,
      }));
    }
  }
  for (const [a, b] of dag.raw_in_context) {
    svg.append(svgEl("rect", { x: x(a), y: rowY(-1) + rowH * 0.3, width: Math.max(1, x(b + 1) - x(a)), height: rowH * 0.4, fill: "#90a4ae" }));
  }
  for (const n of dag.nodes) {
    const fill = n.fallback ? "#ff9800" : n.kind === "leaf" ? "#4caf50" : "#3f51b5";
    const r = svgEl("rect", {
      x: x(n.first_turn), y: rowY(n.depth) + rowH * 0.2, width: Math.max(1, x(n.last_turn + 1) - x(n.first_turn) - 0.5),
      height: rowH * 0.6, fill, "fill-opacity": n.in_context ? 1 : 0.3, "data-summary": n.id,
    });
    const title = svgEl("title");
    title.textContent = `${n.id} depth ${n.depth}, turns ${n.first_turn}-${n.last_turn}, ${n.tokens} tokens`;
    r.append(title);
    r.addEventListener("click", () => drill(n.id, r));
    svg.append(r);
  }
  for (let d = -1; d <= depth; d++) {
    const t = svgEl("text", { x: 2, y: rowY(d) + rowH * 0.6, fill: "#777" });
    t.textContent = d < 0 ? "raw" : "d" + d;
    svg.append(t);
  }
}

async function drill(id, rect) {
  for (const r of document.querySelectorAll("#dag rect.selected")) r.classList.remove("selected");
  if (rect) rect.classList.add("selected");
  const box = document.getElementById("drill");
  box.textContent = "";
  const c = encodeURIComponent(state.conv);
  let desc;
  try {
    desc = await getJson(`/api/describe?c=${c}&id=${encodeURIComponent(id)}`);
  } catch (err) {
    box.textContent = "error: " + err.message;
    return;
  }
  box.append(el("h2", {}, "describe " + id));
  box.append(el("pre", { class: "describe" }, JSON.stringify(desc, null, 2)));
  const more = el("button", {}, "expand: children or raw turns");
  more.addEventListener("click", async () => {
    const exp = await getJson(`/api/expand?c=${c}&id=${encodeURIComponent(id)}`);
    box.append(el("h2", {}, "expand " + id));
    box.append(el("pre", { class: "expand" }, JSON.stringify(exp, null, 2)));
  });
  box.append(more);
}

function describeEntry(e) {
  switch (e.kind) {
    case "trigger": return `${e.updated ? "debt updated" : "debt recorded"} ${e.reason}: ${e.detail}`;
    case "rolling_due": return `rolling state due (${e.reason}): ${e.detail}`;
    case "provider_error": return `provider error${e.overflow ? " (overflow)" : ""}: ${e.error}`;
    case "manual_request": return `compaction requested${e.instructions ? ": " + e.instructions : ""}`;
    case "job_issued": return e.compact ? `job ${e.job_id} (${e.reason}${e.urgent ? ", urgent" : ""}): ${e.context_tokens} → ${e.target_tokens}, deadline ${e.deadline_ms} ms` : `job ${e.job_id}: rolling state only`;
    case "summary": return `${e.accepted ? "" : "NOT accepted "}${e.summary_kind} d${e.depth} ${e.summary_id} turns ${e.turns[0]}-${e.turns[1]} ${e.source_tokens}→${e.tokens} by ${e.model}${e.fallback ? " [fallback]" : ""}${e.supersedes ? " replaces " + e.supersedes : ""}`;
    case "summary_rejected": return `summary ${e.summary_id} rejected: ${e.reason}`;
    case "sweep_ended": return `sweep ${e.job_id} ${e.stop}: ${e.committed} summaries, ${e.calls} calls, ${e.tokens_spent} tokens, $${(e.cost_micros / 1e6).toFixed(4)}`;
    case "debt_cleared": return `debt cleared: ${e.reason}`;
    case "job_abandoned": return `job ${e.job_id} abandoned without a sweep end`;
    case "rolling_state_updated": return `rolling state through turn ${e.through_turn}`;
    case "memory_flush": return `memory flush (cycle ${e.cycle}, ${e.reason})`;
    case "model_declared": return `model ${e.model}${e.context_window ? ", window " + e.context_window : ""}`;
    case "reset": return `conversation reset${e.reason ? ": " + e.reason : ""}`;
    case "event_rejected": return `event ${e.rejected_id} rejected: ${e.reason}`;
    default: return e.kind + " " + JSON.stringify(e);
  }
}

function drawTimeline() {
  const a = state.audit, t = a.totals;
  document.getElementById("totals").textContent =
    `${t.events} events, ${t.turns} turns, ${t.compactions} compactions, ${t.summaries} summaries, ` +
    `${t.fallbacks} fallbacks (${t.fallbacks_replaced} replaced), ${t.rejections} rejections, ` +
    `${t.overflows} overflows, peak ${t.peak_context_tokens} tokens, ${t.calls} calls, $${(t.cost_micros / 1e6).toFixed(4)}`;
  const box = document.getElementById("timeline");
  box.textContent = "";
  for (const e of a.entries) {
    const d = el("div", { class: "entry", "data-event": e.event_id, "data-kind": e.kind });
    d.append(el("span", { class: "meta" }, `#${e.index} ${e.context_before}→${e.context_after} `));
    d.append(el("span", { class: "kind" }, e.kind + " "));
    d.append(describeEntry(e));
    d.addEventListener("click", () => selectEvent(e.event_id));
    box.append(d);
  }
}

async function selectEvent(id) {
  state.selected = id;
  for (const c of document.querySelectorAll("#chart circle.pt")) c.classList.toggle("selected", c.dataset.event === id);
  for (const d of document.querySelectorAll("#timeline .entry")) d.classList.toggle("selected", d.dataset.event === id);
  const point = state.audit.points.find((p) => p.event_id === id);
  const box = document.getElementById("context");
  box.className = "";
  box.textContent = "loading…";
  const c = encodeURIComponent(state.conv);
  let out;
  try {
    out = await getJson(`/api/context?c=${c}&at=${encodeURIComponent(id)}`);
  } catch (err) {
    box.textContent = "error: " + err.message;
    return;
  }
  document.getElementById("context-title").textContent =
    `What the model saw after #${point ? point.index : "?"} ${point ? point.type : ""} ${id}: ` +
    `${out.tokens} tokens of ${out.budget}, ${out.messages.length} messages`;
  box.textContent = "";
  box.dataset.event = id;
  box.dataset.tokens = out.tokens;
  box.dataset.messages = out.messages.length;
  out.messages.forEach((m, i) => {
    const src = sourceLabel(out.sources[i]);
    const d = el("div", { class: "msg", "data-index": i, "data-source": src, "data-role": m.role });
    d.append(el("div", { class: "who" }, `${m.role} · ${src}`));
    d.append(el("pre", { class: "content" }, contentText(m)));
    for (const call of m.tool_calls || []) {
      d.append(el("pre", { class: "call" }, `→ ${call.function.name}(${call.function.arguments})`));
    }
    box.append(d);
  });
  document.body.dataset.shown = id;
}

async function main() {
  try {
    const list = await loadConversations();
    const want = fragment();
    const conv = want.c || (list[0] && list[0].conversation);
    if (!conv) return;
    await selectConversation(conv);
    if (want.event) {
      // A real click on the drawn point: the same handler a user triggers.
      const pt = [...document.querySelectorAll("#chart circle.pt")].find((c) => c.dataset.event === want.event);
      if (pt) pt.dispatchEvent(new MouseEvent("click", { bubbles: true }));
      else document.getElementById("context").textContent = "no event " + want.event + " in this conversation";
    }
    if (want.summary) {
      const r = [...document.querySelectorAll("#dag rect")].find((x) => x.dataset.summary === want.summary);
      if (r) r.dispatchEvent(new MouseEvent("click", { bubbles: true }));
    }
  } catch (err) {
    document.getElementById("where").textContent = "error: " + err.message;
  }
}

main();

// The audit page: vanilla JavaScript over the JSON endpoints of
// src/http/audit_page.rs. The URL fragment drives it as a user would:
// `#q=TEXT` types TEXT into the search box, `&sort=key|health|recent`
// picks the order, `&page=N` clicks "next" until page N, `&c=CONV` selects
// a conversation, `&event=ID` clicks the chart point of event ID once it
// is drawn and `&summary=ID` that summary of the DAG, each through the
// handler a user's click or keystroke runs.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const state = {
  conv: null, audit: null, dag: null, chartTop: 1, selected: null,
  q: "", sort: "key", offset: 0, limit: 100, listing: Promise.resolve(), searchTimer: null,
};

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

const fmt = (n) => Number(n || 0).toLocaleString("en-US");

function when(ms) {
  if (!ms) return "no activity";
  return new Date(ms).toISOString().replace("T", " ").slice(0, 16) + " UTC";
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

// A step of 1, 2 or 5 times a power of ten giving about `count` ticks.
function niceStep(range, count) {
  const raw = Math.max(range, 1) / Math.max(count, 1);
  const pow = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [1, 2, 5, 10]) if (m * pow >= raw) return m * pow;
  return 10 * pow;
}

// ---- the conversation list ---------------------------------------------

function listUrl() {
  const p = new URLSearchParams({ q: state.q, sort: state.sort, offset: state.offset, limit: state.limit });
  return "/api/conversations?" + p.toString();
}

function loadList() {
  state.listing = (async () => {
    const page = await getJson(listUrl());
    const box = document.getElementById("conversations");
    box.textContent = "";
    for (const row of page.conversations) {
      const d = el("div", { class: "conv", "data-conversation": row.conversation, "data-health": row.health });
      if (row.conversation === state.conv) d.classList.add("selected");
      const key = el("div", { class: "key" });
      const badge = el("span", { class: "health " + row.health }, row.health);
      if (row.reasons && row.reasons.length) badge.title = row.reasons.join("\n");
      key.append(el("span", {}, row.conversation), badge);
      d.append(key);
      const meta = el("div", { class: "meta" });
      meta.append(`${fmt(row.turns)} turns · ${fmt(row.context_tokens)} of ${fmt(row.budget)} tokens · ` +
        `${fmt(row.summaries)} summaries${row.pending_job ? " · job running" : ""}`);
      meta.append(el("br"), `last event ${when(row.last_event_time)}`);
      d.append(meta);
      d.addEventListener("click", () => selectConversation(row.conversation));
      box.append(d);
    }
    const first = page.matched ? page.offset + 1 : 0;
    const last = page.offset + page.conversations.length;
    const info = document.getElementById("list-info");
    info.textContent = page.q
      ? `${fmt(first)}–${fmt(last)} of ${fmt(page.matched)} matching “${page.q}” (${fmt(page.total)} in all)`
      : `${fmt(first)}–${fmt(last)} of ${fmt(page.total)}`;
    Object.assign(info.dataset, { total: page.total, matched: page.matched, offset: page.offset, shown: page.conversations.length });
    const pages = Math.max(1, Math.ceil(page.matched / page.limit));
    const current = Math.floor(page.offset / page.limit) + 1;
    document.getElementById("page-of").textContent = `page ${fmt(current)} of ${fmt(pages)}`;
    document.getElementById("prev").disabled = page.offset === 0;
    document.getElementById("next").disabled = last >= page.matched;
    document.getElementById("where").textContent = `${fmt(page.total)} conversation${page.total === 1 ? "" : "s"}`;
    document.body.dataset.listed = `${state.q}|${state.sort}|${page.offset}`;
    return page;
  })();
  return state.listing;
}

function setupList() {
  const search = document.getElementById("search");
  search.addEventListener("input", () => {
    clearTimeout(state.searchTimer);
    state.searchTimer = setTimeout(() => {
      state.q = search.value.trim();
      state.offset = 0;
      loadList().catch(showError);
    }, 150);
  });
  document.getElementById("sort").addEventListener("change", (ev) => {
    state.sort = ev.target.value;
    state.offset = 0;
    loadList().catch(showError);
  });
  document.getElementById("prev").addEventListener("click", () => {
    state.offset = Math.max(0, state.offset - state.limit);
    loadList().catch(showError);
  });
  document.getElementById("next").addEventListener("click", () => {
    state.offset += state.limit;
    loadList().catch(showError);
  });
}

// Types `text` into the search box as a user would, and waits for the list.
async function typeSearch(text) {
  const search = document.getElementById("search");
  search.value = text;
  search.dispatchEvent(new Event("input", { bubbles: true }));
  await new Promise((r) => setTimeout(r, 200));
  await state.listing;
}

function showError(err) {
  document.getElementById("where").textContent = "error: " + err.message;
}

// ---- one conversation -----------------------------------------------------

async function selectConversation(conv) {
  state.conv = conv;
  for (const d of document.querySelectorAll("#conversations .conv")) {
    d.classList.toggle("selected", d.dataset.conversation === conv);
  }
  const body = await getJson("/api/audit?c=" + encodeURIComponent(conv));
  state.audit = body.audit;
  state.dag = body.dag;
  state.chartTop = body.chart_top;
  drawChart();
  drawDag();
  drawTimeline();
  document.getElementById("drill").textContent = "";
  document.body.dataset.conversation = conv;
}

function drawChart() {
  const svg = document.getElementById("chart");
  svg.textContent = "";
  const W = Math.max(400, Math.round(svg.getBoundingClientRect().width) || 900);
  const H = 300, L = 64, R = 12, T = 10, B = 30;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("preserveAspectRatio", "xMinYMin meet");
  const pts = state.audit.points;
  const n = Math.max(pts.length - 1, 1);
  // The server's scale: the budgets in force and the context, not a policy
  // event's default budget.
  const ymax = Math.max(state.chartTop, 1);
  const x = (i) => L + (i / n) * (W - L - R);
  const y = (v) => T + (1 - Math.min(v, ymax) / ymax) * (H - T - B);
  const ystep = niceStep(ymax, 5);
  for (let v = 0; v <= ymax; v += ystep) {
    svg.append(svgEl("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), stroke: "#eceff1" }));
    svg.append(svgEl("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end", fill: "#5f6b73", class: "ytick" }, fmt(v)));
  }
  const xstep = niceStep(n, 8);
  for (let i = 0; i <= n; i += xstep) {
    svg.append(svgEl("line", { x1: x(i), x2: x(i), y1: H - B, y2: H - B + 4, stroke: "#90a4ae" }));
    svg.append(svgEl("text", { x: x(i), y: H - B + 16, "text-anchor": "middle", fill: "#5f6b73" }, "#" + fmt(i)));
  }
  svg.append(svgEl("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: "#90a4ae" }));
  // The server says which points' levels are the conversation's.
  const scaled = pts.filter((p) => p.sets_scale);
  const line = (list, f, attrs) => {
    if (!list.length) return;
    const d = list.map((p, i) => `${i ? "L" : "M"}${x(p.index).toFixed(1)},${y(f(p)).toFixed(1)}`).join("");
    svg.append(svgEl("path", Object.assign({ d, fill: "none" }, attrs)));
  };
  line(scaled, (p) => p.budget, { stroke: "#212121", "stroke-dasharray": "6 4", class: "budget" });
  line(scaled, (p) => p.threshold_tokens, { stroke: "#e65100", "stroke-dasharray": "6 4", class: "threshold" });
  line(scaled, (p) => p.target_tokens, { stroke: "#2e7d32", "stroke-dasharray": "6 4", class: "target" });
  line(pts, (p) => p.context_tokens, { stroke: "#1565c0", "stroke-width": 2, class: "context" });
  for (const p of pts) {
    const attrs = {
      class: "pt", cx: x(p.index), cy: y(p.context_tokens), r: 3,
      fill: "#1565c0", "fill-opacity": 0.2, "data-event": p.event_id, "data-index": p.index,
    };
    if (p.mark === "compaction") Object.assign(attrs, { r: 6, fill: "#8e24aa", "fill-opacity": 1, class: "pt mark-compaction" });
    if (p.mark === "overflow") Object.assign(attrs, { r: 6, fill: "#d50000", "fill-opacity": 1, class: "pt mark-overflow" });
    const c = svgEl("circle", attrs);
    c.append(svgEl("title", {}, `#${p.index} ${p.label} ${p.event_id}: ${fmt(p.context_tokens)} tokens (budget ${fmt(p.budget)})`));
    c.addEventListener("click", () => selectEvent(p.event_id));
    svg.append(c);
  }
}

// Leaves green, condensed indigo, fallbacks orange; pale out of context.
function nodeFill(n) {
  return n.fallback ? "#ef6c00" : n.kind === "leaf" ? "#2e7d32" : "#3949ab";
}

// A label on a bar: white on the dark in-context fills, dark on pale bars
// and on orange.
function labelFill(n) {
  return n.in_context && !n.fallback ? "#ffffff" : "#212121";
}

function drawDag() {
  const svg = document.getElementById("dag");
  svg.textContent = "";
  const dag = state.dag;
  const W = Math.max(400, Math.round(svg.getBoundingClientRect().width) || 900);
  const L = 58, R = 12, T = 6, AXIS = 30;
  const depth = Math.max(0, ...dag.nodes.map((n) => n.depth));
  const rows = depth + 2; // raw strip, leaves, each condensed depth
  const rowH = Math.min(64, Math.max(52, 240 / rows));
  const H = T + rows * rowH + AXIS;
  svg.setAttribute("height", H);
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("preserveAspectRatio", "xMinYMin meet");
  const turns = Math.max(dag.turns, 1);
  const x = (t) => L + (t / turns) * (W - L - R);
  // Row -1 (the raw strip) at the bottom, depth d above it. A row is its
  // bar, then a lane for the labels of bars too narrow to hold theirs.
  const rowY = (d) => T + (rows - 1 - (d + 1)) * rowH;
  const barTop = (d) => rowY(d) + rowH * 0.06;
  const barH = rowH * 0.56;
  const axisY = T + rows * rowH + 2;
  // The turn axis.
  svg.append(svgEl("line", { x1: L, x2: W - R, y1: axisY, y2: axisY, stroke: "#90a4ae" }));
  const step = niceStep(turns, 10);
  for (let t = 0; t <= turns; t += step) {
    svg.append(svgEl("line", { x1: x(t), x2: x(t), y1: T, y2: axisY + 4, stroke: "#eceff1" }));
    svg.append(svgEl("text", { x: x(t), y: axisY + 15, "text-anchor": "middle", fill: "#5f6b73", class: "turn-tick" }, fmt(t)));
  }
  svg.append(svgEl("text", { x: W - R, y: axisY + 27, "text-anchor": "end", fill: "#5f6b73" }, `turn (of ${fmt(dag.turns)})`));
  for (let d = -1; d <= depth; d++) {
    const label = d < 0 ? "raw" : d === 0 ? "leaves" : "depth " + d;
    svg.append(svgEl("text", { x: 4, y: barTop(d) + barH * 0.62, fill: "#5f6b73" }, label));
  }
  const byId = new Map(dag.nodes.map((n) => [n.id, n]));
  for (const n of dag.nodes) {
    for (const c of n.children || []) {
      const ch = byId.get(c);
      if (!ch) continue;
      svg.append(svgEl("line", {
        x1: x((n.first_turn + n.last_turn + 1) / 2), y1: barTop(n.depth) + barH,
        x2: x((ch.first_turn + ch.last_turn + 1) / 2), y2: barTop(ch.depth),
        stroke: "#000", "stroke-opacity": n.in_context ? 0.4 : 0.12,
      }));
    }
  }
  const lanes = new Map(); // depth -> bars whose label goes below them
  const label = (d, a, b, x0, w, fill) => {
    if (!rangeLabel(svg, a, b, x0, w, barTop(d), barH, fill)) {
      if (!lanes.has(d)) lanes.set(d, []);
      lanes.get(d).push({ a, b, cx: x0 + w / 2 });
    }
  };
  for (const [a, b] of dag.raw_in_context) {
    const r = svgEl("rect", { x: x(a), y: barTop(-1) + barH * 0.2, width: Math.max(1, x(b + 1) - x(a)), height: barH * 0.6, fill: "#78909c", class: "raw" });
    r.append(svgEl("title", {}, `raw turns ${a}–${b} in context`));
    svg.append(r);
    label(-1, a, b, x(a), x(b + 1) - x(a), "#ffffff");
  }
  for (const n of dag.nodes) {
    const x0 = x(n.first_turn), w = Math.max(1, x(n.last_turn + 1) - x0 - 1);
    const r = svgEl("rect", {
      x: x0, y: barTop(n.depth), width: w, height: barH,
      fill: nodeFill(n), "fill-opacity": n.in_context ? 1 : 0.3, "data-summary": n.id, class: "node",
      "data-first": n.first_turn, "data-last": n.last_turn,
    });
    r.append(svgEl("title", {}, `${n.id}: ${n.kind}, depth ${n.depth}, turns ${n.first_turn}–${n.last_turn}, ` +
      `${fmt(n.source_tokens)} → ${fmt(n.tokens)} tokens by ${n.model}${n.fallback ? " (fallback)" : ""}` +
      `${n.in_context ? "" : ", out of context"}`));
    r.addEventListener("click", () => drill(n.id, r));
    svg.append(r);
    label(n.depth, n.first_turn, n.last_turn, x0, w, labelFill(n));
  }
  // Labels of narrow bars in the lane under their row, moved right as
  // little as keeps them apart, each with a line to its bar.
  for (const [d, list] of lanes) {
    list.sort((p, q) => p.cx - q.cx);
    let right = -Infinity;
    const y = barTop(d) + barH + rowH * 0.3;
    for (const item of list) {
      const text = `${item.a}–${item.b}`;
      const w = text.length * 6.3;
      const left = Math.min(Math.max(item.cx - w / 2, right + 8), W - R - w);
      right = left + w;
      svg.append(svgEl("line", { x1: item.cx, y1: barTop(d) + barH, x2: left + w / 2, y2: y - 9, stroke: "#90a4ae" }));
      svg.append(svgEl("text", {
        x: left + w / 2, y, "text-anchor": "middle", fill: "#37474f", class: "range",
        "data-range": text, "font-size": 10,
      }, text));
    }
  }
}

// The turn range `a–b` on a bar: on one line when it fits, else `a` over
// `b`. False when neither fits (the caller puts it under the bar).
function rangeLabel(svg, a, b, x0, w, top, h, fill) {
  const text = `${a}–${b}`;
  const attrs = { "text-anchor": "middle", fill, class: "range", "data-range": text, "pointer-events": "none", "font-size": 10 };
  const digit = 6.3;
  if (w >= text.length * digit + 4) {
    svg.append(svgEl("text", Object.assign({ x: x0 + w / 2, y: top + h / 2 + 3.5 }, attrs), text));
    return true;
  }
  if (w >= Math.max(String(a).length, String(b).length + 1) * digit + 2 && h >= 22) {
    const t = svgEl("text", Object.assign({ x: x0 + w / 2, y: top + h / 2 - 1.5 }, attrs));
    t.append(svgEl("tspan", { x: x0 + w / 2 }, String(a)));
    t.append(svgEl("tspan", { x: x0 + w / 2, dy: 10 }, "–" + b));
    svg.append(t);
    return true;
  }
  return false;
}

function fields(pairs) {
  const dl = el("dl", { class: "fields" });
  for (const [k, v] of pairs) {
    if (v === undefined || v === null || v === "") continue;
    dl.append(el("dt", {}, k), el("dd", {}, String(v)));
  }
  return dl;
}

function messageText(m) {
  if (!m) return "";
  let text = typeof m.content === "string" ? m.content
    : Array.isArray(m.content) ? m.content.map((p) => p.text || p.content || "").join("\n") : "";
  for (const call of m.tool_calls || []) {
    text += `${text ? "\n" : ""}→ ${call.function.name}(${call.function.arguments})`;
  }
  return text;
}

function summaryFields(s) {
  return [
    ["kind", `${s.summary_kind}, depth ${s.depth}`],
    ["turns", `${s.first_turn}–${s.last_turn} (${fmt(s.turn_span)} turns)`],
    ["tokens", `${fmt(s.source_tokens)} → ${fmt(s.tokens)}`],
    ["model", s.model],
    ["provider", s.provider],
    ["prompt", s.prompt_version],
    ["fallback", s.fallback ? "yes: deterministic, re-summarized when a model answers" : "no"],
    ["in context", s.in_context ? "yes" : "no"],
    ["covered by", s.covered_by !== s.summary_id ? s.covered_by : undefined],
    ["parent", s.parent],
    ["supersedes", s.supersedes],
    ["superseded by", s.superseded_by],
    ["job", s.job_id],
    ["written", when(s.time)],
  ];
}

function turnFields(t) {
  return [
    ["turn", t.seq],
    ["role", t.role || (t.message && t.message.role)],
    ["tokens", fmt(t.tokens)],
    ["event", t.event_id],
    ["sender", t.sender],
    ["model", t.model],
    ["large payload", t.large_payload ? "yes" : undefined],
    ["time", when(t.time)],
  ];
}

// A summary (or turn) as text, with its metadata beside it.
function described(text, pairs) {
  const box = el("div", { class: "described" });
  box.append(el("pre", { class: "text" }, text), fields(pairs));
  return box;
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
  if (desc.kind === "summary") {
    box.append(el("h3", {}, `Summary ${desc.summary_id}`));
    box.append(described(desc.content, summaryFields(desc)));
  } else {
    box.append(el("h3", {}, `Turn ${desc.seq}`));
    box.append(described(messageText(desc.message), turnFields(desc)));
  }
  box.dataset.described = id;
  if (desc.kind !== "summary") return;
  const more = el("button", { id: "expand" }, desc.summary_kind === "leaf" ? "expand: the raw turns under it" : "expand: its child summaries");
  more.addEventListener("click", async () => {
    more.disabled = true;
    const exp = await getJson(`/api/expand?c=${c}&id=${encodeURIComponent(id)}`);
    box.append(el("h3", {}, `${fmt(exp.total_items)} ${exp.children} under ${id}` +
      (exp.cut ? ` (first ${fmt(exp.items.length)} shown: ${fmt(exp.max_tokens)}-token cap)` : "")));
    for (const item of exp.items) {
      const d = el("div", { class: "item", "data-kind": item.kind });
      if (item.kind === "summary") {
        d.append(el("div", { class: "meta" }, `summary ${item.summary_id}: turns ${item.first_turn}–${item.last_turn}, ${fmt(item.tokens)} tokens by ${item.model}`));
        d.append(el("pre", {}, item.content));
      } else {
        d.append(el("div", { class: "meta" }, `turn ${item.seq} · ${item.role} · ${fmt(item.tokens)} tokens · ${when(item.time)}`));
        d.append(el("pre", {}, messageText(item.message)));
      }
      box.append(d);
    }
  });
  box.append(more);
}

function drawTimeline() {
  const a = state.audit, t = a.totals;
  document.getElementById("totals").textContent =
    `${fmt(t.events)} events, ${fmt(t.turns)} turns, ${fmt(t.compactions)} compactions, ${fmt(t.summaries)} summaries, ` +
    `${fmt(t.fallbacks)} fallbacks (${fmt(t.fallbacks_replaced)} replaced), ${fmt(t.rejections)} rejections, ` +
    `${fmt(t.overflows)} overflows, peak ${fmt(t.peak_context_tokens)} tokens, ${fmt(t.calls)} calls, $${(t.cost_micros / 1e6).toFixed(4)}`;
  const box = document.getElementById("timeline");
  box.textContent = "";
  for (const e of a.entries) {
    const d = el("div", { class: "entry", "data-event": e.event_id, "data-kind": e.kind });
    d.append(el("span", { class: "at" }, `#${e.index} ${fmt(e.context_before)}→${fmt(e.context_after)}`));
    d.append(el("span", { class: "sentence" }, e.sentence));
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
    `What the model saw after #${point ? point.index : "?"} ${point ? point.label : ""} ${id}: ` +
    `${fmt(out.tokens)} tokens of ${fmt(out.budget)}, ${out.messages.length} messages`;
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

async function main() {
  setupList();
  try {
    const want = fragment();
    let first;
    if (want.sort) {
      const sort = document.getElementById("sort");
      sort.value = want.sort;
      sort.dispatchEvent(new Event("change", { bubbles: true }));
      first = await state.listing;
    } else {
      first = await loadList();
    }
    if (want.q) await typeSearch(want.q);
    for (let p = 1; p < Number(want.page || 1); p++) {
      const next = document.getElementById("next");
      if (next.disabled) break;
      next.dispatchEvent(new MouseEvent("click", { bubbles: true }));
      await state.listing;
    }
    const shown = document.querySelector("#conversations .conv");
    const conv = want.c || (shown && shown.dataset.conversation) || (first.conversations[0] && first.conversations[0].conversation);
    if (!conv) return;
    await selectConversation(conv);
    if (want.event) {
      // A real click on the drawn point: the same handler a user triggers.
      const pt = [...document.querySelectorAll("#chart circle.pt")].find((c) => c.dataset.event === want.event);
      if (pt) pt.dispatchEvent(new MouseEvent("click", { bubbles: true }));
      else document.getElementById("context").textContent = "no event " + want.event + " in this conversation";
    }
    if (want.summary) {
      const r = [...document.querySelectorAll("#dag rect.node")].find((x) => x.dataset.summary === want.summary);
      if (r) r.dispatchEvent(new MouseEvent("click", { bubbles: true }));
    }
  } catch (err) {
    showError(err);
  }
}

main();

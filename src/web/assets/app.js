// kvroute's web view: polls the JSON endpoints under /ui/api and draws
// the page the address's #hash names. No framework; every value from the
// router is written with textContent, never parsed as HTML.
"use strict";

const POLL_MS = 2000;
const PAGE_SIZE = 100;
const state = { offset: 0, filter: "", lastSeq: 0, decisions: [], timer: null };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "style") node.style.cssText = v; // CSSOM: allowed by the page's CSP
    else node.setAttribute(k, v);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function num(v, digits) {
  if (v === null || v === undefined) return "";
  return digits === undefined ? Number(v).toLocaleString("en") : Number(v).toFixed(digits);
}

function td(v, cls) { return el("td", cls ? { class: cls } : {}, v); }

function tag(text, cls) { return el("span", { class: "tag " + (cls || "") }, text); }

async function api(path) {
  const headers = {};
  const token = sessionStorage.getItem("kvroute-token");
  if (token) headers["Authorization"] = "Bearer " + token;
  const response = await fetch(path, { headers, cache: "no-store" });
  if (response.status === 401 || response.status === 403) {
    document.getElementById("login").hidden = false;
    throw new Error(response.status === 401 ? "a token is needed" : "the token lacks operator-read");
  }
  if (!response.ok) throw new Error(path + ": HTTP " + response.status);
  return response.json();
}

function trustTag(reason) {
  if (reason === "exact") return tag("exact", "ok");
  if (reason.startsWith("blended")) return tag(reason, "warn");
  return tag(reason);
}

async function drawFleet() {
  const q = new URLSearchParams({ offset: state.offset, limit: PAGE_SIZE, filter: state.filter });
  const data = await api("/ui/api/fleet?" + q);
  const summary = document.getElementById("fleet-summary");
  summary.replaceChildren(
    el("div", { class: "card" }, el("b", {}, num(data.total)), "workers"),
    el("div", { class: "card" }, el("b", {}, num(data.cordoned)), "cordoned"),
    el("div", { class: "card" }, el("b", {}, num(data.untrusted)), "events untrusted"),
    el("div", { class: "card" }, el("b", {}, num(data.workers.reduce((a, w) => a + w.booked_load.active_requests, 0))), "booked requests (page)"));
  const end = Math.min(data.offset + data.workers.length, data.matching);
  document.getElementById("fleet-range").textContent =
    data.matching ? `${data.offset + 1}-${end} of ${data.matching}` : "none";
  const rows = data.workers.map((w) => {
    const used = w.ranks.reduce((a, r) => a + r.reported_load.kv_blocks_used, 0);
    const usedShare = w.total_kv_blocks ? used / (w.total_kv_blocks * Math.max(w.dp_size, 1)) : 0;
    return el("tr", { "data-worker": w.worker_id },
      td(w.worker_id, "num"), td(w.model), td(w.role),
      td(w.dp_size > 1 ? `${w.dp_start_rank}..${w.dp_start_rank + w.dp_size - 1}` : String(w.dp_start_rank)),
      el("td", {}, w.cordoned ? tag("cordoned", "cordoned") : tag("serving", "ok")),
      el("td", {}, ...w.taints.map((t) => tag(t))),
      td(num(w.lease_remaining_ms / 1000, 0), "num"),
      td(num(w.booked_load.prefill_tokens), "num"),
      td(num(w.booked_load.decode_blocks), "num"),
      td(num(w.booked_load.active_requests), "num"),
      td((usedShare * 100).toFixed(1) + " %", "num"),
      td(num(w.cached_blocks), "num"),
      el("td", {}, trustTag(w.cache_view_reason)));
  });
  document.querySelector("#fleet-table tbody").replaceChildren(...rows);
}

async function drawIndex() {
  const data = await api("/ui/api/index");
  const blocks = data.models.map((m) => el("div", { class: "model" },
    el("h2", {}, m.model),
    el("div", { class: "summary" },
      el("div", { class: "card" }, el("b", {}, num(m.entries)), "cached entries"),
      el("div", { class: "card" }, el("b", {}, num(m.memory_bytes / 1048576, 1)), "MiB of index"),
      el("div", { class: "card" }, el("b", {}, num(m.workers_holding)), "workers holding blocks"),
      el("div", { class: "card" }, el("b", {}, num(m.events_applied)), "events applied")),
    el("table", { class: "shares" },
      el("thead", {}, el("tr", {}, el("th", {}, "worker"), el("th", {}, "cached blocks"), el("th", {}, "share of the model's cache"))),
      el("tbody", {}, ...m.shares.map((s) => el("tr", { "data-share-worker": s.worker_id },
        td(s.worker_id, "num"), td(num(s.blocks), "num"),
        el("td", {}, el("span", { class: "bar", style: `width:${Math.round(s.share * 300)}px` }), " " + (s.share * 100).toFixed(1) + " %")))))));
  document.getElementById("index-models").replaceChildren(
    ...(blocks.length ? blocks : [el("p", { class: "hint" }, "No model has cached blocks yet.")]));
}

function feedbackText(f) {
  if (!f) return "";
  return `${f.reports} reports, |error| ${num(f.mean_abs_error_tokens, 1)} tok${f.contradicted ? ", contradicted" : ""}`;
}

async function drawEvents() {
  const q = new URLSearchParams({ offset: state.offset, limit: PAGE_SIZE, filter: state.filter });
  const data = await api("/ui/api/fleet?" + q);
  const rows = [];
  for (const w of data.workers) {
    for (const r of w.ranks) {
      rows.push(el("tr", {},
        td(w.worker_id, "num"), td(r.dp_rank, "num"),
        td(w.subscription || (w.kv_events === "approximate" ? "none (approximate)" : "PublishEvents")),
        td(num(r.last_event_id), "num"), td(num(r.events_skipped), "num"),
        el("td", { class: "num" }, r.events_rejected ? tag(num(r.events_rejected), "warn") : "0"),
        td(num(r.predicted_blocks), "num"),
        el("td", {}, trustTag(w.cache_view_reason)),
        td(feedbackText(w.cached_tokens_feedback))));
    }
  }
  document.querySelector("#events-table tbody").replaceChildren(...rows);
}

async function drawDecisions() {
  const data = await api(`/ui/api/decisions?after=${state.lastSeq}&limit=50`);
  for (const d of data.decisions) state.decisions.push(d);
  if (data.decisions.length) state.lastSeq = data.decisions[data.decisions.length - 1].seq;
  state.decisions = state.decisions.slice(-100);
  const shown = state.decisions.slice().reverse().map((d) => el("div", { class: "decision", "data-request": d.request_id },
    el("div", { class: "head" },
      el("b", {}, "#" + d.seq), el("span", {}, new Date(d.at_unix_ms).toLocaleTimeString()),
      el("span", {}, "request " + d.request_id), el("span", {}, "model " + d.model),
      el("span", {}, `→ worker ${d.worker_id} rank ${d.rank}`),
      el("span", {}, `overlap ${d.overlap_blocks}/${d.total_blocks} blocks`),
      tag(d.outcome), tag(d.policy), el("span", { class: "hint" }, `${d.candidates_total} candidates`)),
    el("table", {},
      el("thead", {}, el("tr", {}, ...["worker", "rank", "overlap", "booked prefill tok", "booked req", "prefill cost", "decode cost", "probability", ""].map((h) => el("th", {}, h)))),
      el("tbody", {}, ...d.candidates.map((c) => el("tr", { class: c.chosen ? "chosen" : "" },
        td(c.worker_id, "num"), td(c.rank, "num"), td(c.overlap_blocks, "num"),
        td(num(c.booked_prefill_tokens), "num"), td(c.booked_requests, "num"),
        td(c.prefill_cost === null ? "" : num(c.prefill_cost, 1), "num"),
        td(c.decode_cost === null ? "" : num(c.decode_cost, 1), "num"),
        td(c.probability === null ? "" : num(c.probability, 3), "num"),
        el("td", {}, c.chosen ? tag("chosen", "ok") : null, !c.eligible ? tag("ineligible", "warn") : null, c.busy ? tag("busy", "warn") : null)))))));
  document.getElementById("decisions-list").replaceChildren(
    ...(shown.length ? shown : [el("p", { class: "hint" }, "No decision yet.")]));
}

async function drawCluster() {
  const data = await api("/ui/api/cluster");
  const info = document.getElementById("cluster-info");
  if (!data.cluster) {
    info.replaceChildren(el("p", { class: "hint" }, "A single router: no cluster (start with --nats-url for replicas)."));
    return;
  }
  info.replaceChildren(el("div", { class: "summary" },
    el("div", { class: "card" }, el("b", {}, data.replica), "this replica"),
    el("div", { class: "card" }, el("b", {}, data.connected ? "connected" : "NATS away"), "shared log"),
    el("div", { class: "card" }, el("b", {}, num(data.log_position)), "log position applied"),
    el("div", { class: "card" }, el("b", {}, num(data.lag_mean_seconds * 1000, 2) + " ms"), "mean apply lag"),
    el("div", { class: "card" }, el("b", {}, num(data.booking_resyncs)), "booking resyncs")),
    el("p", { class: "hint" }, "Each replica serves its own view: open the others' to compare positions."));
}

const pages = { fleet: drawFleet, index: drawIndex, events: drawEvents, decisions: drawDecisions, cluster: drawCluster };

function current() {
  const name = location.hash.replace("#", "");
  return pages[name] ? name : "fleet";
}

async function refresh() {
  clearTimeout(state.timer);
  const name = current();
  for (const section of document.querySelectorAll(".page")) section.hidden = section.id !== "page-" + name;
  for (const link of document.querySelectorAll("nav a")) link.classList.toggle("active", link.dataset.page === name);
  const status = document.getElementById("status");
  try {
    await pages[name]();
    status.textContent = "updated " + new Date().toLocaleTimeString();
    status.classList.remove("error");
    document.body.dataset.loaded = name;
  } catch (error) {
    status.textContent = error.message;
    status.classList.add("error");
  }
  state.timer = setTimeout(refresh, POLL_MS);
}

window.addEventListener("hashchange", refresh);
window.addEventListener("DOMContentLoaded", () => {
  document.getElementById("fleet-filter").addEventListener("input", (e) => {
    state.filter = e.target.value; state.offset = 0; refresh();
  });
  document.getElementById("fleet-prev").addEventListener("click", () => {
    state.offset = Math.max(0, state.offset - PAGE_SIZE); refresh();
  });
  document.getElementById("fleet-next").addEventListener("click", () => {
    state.offset += PAGE_SIZE; refresh();
  });
  document.getElementById("login").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem("kvroute-token", document.getElementById("token").value);
    document.getElementById("login").hidden = true;
    refresh();
  });
  refresh();
});

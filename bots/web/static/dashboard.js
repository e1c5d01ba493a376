// The dashboard: one GET /api/dashboard every two seconds, drawn with Chart.js. Text from the server
// (reasons, errors, bot names) goes in as text, never as HTML.
"use strict";

const GOOD = "#2b9348", BAD = "#d62828", BEFORE = "#9aa5b1", AFTER = "#1d70b8";
const charts = {};
let started = null;  // {step, at} of the running run when first seen: the ETA's rate

function text(sel, value) { $(sel).textContent = value === null || value === undefined ? "–" : String(value); }

function chart(id, type, data, options) {
  if (charts[id]) {
    charts[id].data.labels = data.labels;
    data.datasets.forEach((d, i) => {
      if (charts[id].data.datasets[i]) Object.assign(charts[id].data.datasets[i], d);
      else charts[id].data.datasets.push(d);
    });
    charts[id].update("none");
    return;
  }
  charts[id] = new Chart($(id), { type, data, options: { animation: false, responsive: true, ...options } });
}

let acting = false;  // a command in flight: a second click (a double-click) is not a second command

async function act(body, question) {
  if (acting || (question && !window.confirm(question))) return;
  acting = true;
  document.querySelectorAll("main button").forEach((b) => { b.disabled = true; });
  try {
    const r = await post("/api/command", body);
    const said = $("#action-said");
    said.textContent = r.message;
    said.className = "said " + (r.ok ? "ok" : "err");
  } finally {
    acting = false;
    document.querySelectorAll("main button").forEach((b) => { b.disabled = false; });
  }
  refresh();
}

function ratings(st) {
  const r = st.ratings || {};
  text("#total", r.total); text("#good", r.good); text("#bad", r.bad);
  const threshold = st.threshold || 1, pending = r.pending || 0;
  $("#threshold").max = threshold;
  $("#threshold").value = Math.min(pending, threshold);
  $("#threshold-text").textContent = pending >= threshold
    ? `${pending} pending: a run is due`
    : `${pending} of ${threshold} pending: ${threshold - pending} more start a run`;
}

function training(st) {
  const t = st.training || {}, p = t.progress;
  let state = t.state || "idle";
  if (t.paused) state += " · automatic training paused";
  const pause = $("#pause");
  pause.textContent = t.paused ? "Resume automatic training" : "Pause automatic training";
  pause.dataset.name = t.paused ? "resume" : "pause";
  text("#training-state", state);
  const bar = $("#training-progress");
  if (t.state === "running" && p) {
    bar.hidden = false; bar.max = p.total || 1; bar.value = p.step || 0;
    const now = Date.now() / 1000;
    if (!started || started.run !== t.run_id || p.step < started.step) started = { run: t.run_id, step: p.step, at: now };
    const rate = (p.step - started.step) / Math.max(now - started.at, 1e-6);
    const eta = rate > 0 && p.total ? Math.round((p.total - p.step) / rate) : null;
    $("#training-detail").textContent = `${p.version || ""} ${p.phase || ""} step ${p.step}/${p.total}` +
      ` · ${Math.round(p.tokens_per_s || 0)} tok/s` + (eta !== null ? ` · about ${eta} s left` : "");
  } else {
    bar.hidden = true; started = null;
    $("#training-detail").textContent = t.error || "";
  }
}

function fleet(st) {
  const q = st.queue || {};
  text("#events", q.events); text("#dead", q.dead_letters); text("#workers", st.workers);
  const bots = $("#bots"); bots.textContent = "";
  for (const [name, b] of Object.entries(st.bots || {})) {
    const li = document.createElement("li");
    li.textContent = `${name}: ${b.state}` + (b.last_error ? ` (${b.last_error})` : "");
    bots.append(li);
  }
  const push = $("#push"); push.textContent = "";
  for (const p of st.push || []) {
    const li = document.createElement("li");
    li.textContent = `push ${p.target}: ${p.ok === null ? "manual" : p.ok ? "ok" : "failed"} ${p.version || ""} ${p.message || ""}`;
    push.append(li);
  }
}

function scopesTable(st) {  // each person's or channel's own adapter (docs/scopes.md)
  const entries = Object.entries(st.scopes || {}).sort(([a], [b]) => a.localeCompare(b));
  $("#scopes").hidden = entries.length === 0;
  const body = $("#scopes-table tbody"); body.textContent = "";
  for (const [key, sc] of entries) {
    const tr = document.createElement("tr");
    const r = sc.ratings || {};
    for (const cell of [key, (sc.adapter || {}).current || "base model", (sc.adapter || {}).versions,
                        `${r.total} (${r.good} · ${r.bad})`, r.pending, (sc.training || {}).state]) {
      const td = document.createElement("td"); td.textContent = cell === undefined ? "" : String(cell); tr.append(td);
    }
    body.append(tr);
  }
}

function fmt(v, digits) { return typeof v === "number" ? v.toFixed(digits) : ""; }

function versions(history, current) {
  const body = $("#versions tbody"); body.textContent = "";
  if (!history.length) {  // before the first run: say so, not an empty table
    const tr = document.createElement("tr"), td = document.createElement("td");
    td.colSpan = $("#versions thead tr").children.length;
    td.className = "empty";
    td.textContent = "no adapter versions yet: the first run starts when the pending ratings reach the threshold";
    tr.append(td); body.append(tr);
    return;
  }
  for (const v of [...history].reverse()) {
    const tr = document.createElement("tr");
    const kl = v.heldout_kl !== null && v.heldout_kl !== undefined ? v.heldout_kl : v.final_mean_kl;
    const margin = typeof v.heldout_margin_before === "number" && typeof v.heldout_margin_after === "number"
      ? `${fmt(v.heldout_margin_before, 3)} → ${fmt(v.heldout_margin_after, 3)}` : "–";
    const verdict = (v.verdict || "") + (v.reason ? `: ${v.reason}` : "");
    for (const cell of [v.version, v.status, (v.created || "").slice(5, 16).replace("T", " "),
                        (v.ratings_used || "") + (v.replayed ? ` +${v.replayed}` : ""), margin, fmt(kl, 3),
                        fmt(v.entropy_ratio, 2), verdict]) {
      const td = document.createElement("td"); td.textContent = cell; tr.append(td);
    }
    const used = tr.children[3];  // what it trained on: those ratings in the browser
    if (used.textContent) {
      const a = document.createElement("a");
      a.href = `/ratings?state=all&version=${encodeURIComponent(v.version)}`;
      a.textContent = used.textContent; used.textContent = ""; used.append(a);
    }
    const td = document.createElement("td");
    if (v.version !== current && v.status !== "stale") {
      const b = document.createElement("button");
      b.type = "button";
      b.textContent = v.status === "rejected" ? "serve anyway" : "serve this";
      b.addEventListener("click", () => act({ name: "promote", version: v.version },
        `Serve ${v.version}? The gate said: ${verdict || "nothing (unchecked)"}`));
      td.append(b);
    }
    if (v.version === current) {
      const b = document.createElement("button");
      b.type = "button"; b.textContent = "roll back";
      b.addEventListener("click", () => act({ name: "rollback" },
        `Roll back from ${v.version} to ${v.parent || "the base model"}? ${v.version}: ${verdict || "unchecked"}`));
      td.append(b);
    }
    tr.append(td);
    body.append(tr);
  }
}

function draw(d) {
  const tl = d.timeline;
  chart("#timeline-chart", "bar", {
    labels: tl.map((b) => b.hour.slice(5, 13).replace("T", " ") + "h"),
    datasets: [{ label: "👍 good", data: tl.map((b) => b.good), backgroundColor: GOOD },
               { label: "👎 bad", data: tl.map((b) => b.bad), backgroundColor: BAD }],
  }, { scales: { x: { stacked: true }, y: { stacked: true, beginAtZero: true, ticks: { precision: 0 } } } });
  const h = d.history.filter((v) => typeof v.heldout_margin_after === "number");
  chart("#versions-chart", "bar", {
    labels: h.map((v) => v.version),
    datasets: [{ label: "before", data: h.map((v) => v.heldout_margin_before), backgroundColor: BEFORE },
               { label: "after", data: h.map((v) => v.heldout_margin_after), backgroundColor: AFTER }],
  }, {});
  const s = d.sources;
  chart("#sources-chart", "bar", {
    labels: s.map((x) => x.source),
    datasets: [{ label: "👍 good", data: s.map((x) => x.good), backgroundColor: GOOD },
               { label: "👎 bad", data: s.map((x) => x.bad), backgroundColor: BAD },
               { label: "pending", data: s.map((x) => x.pending), backgroundColor: BEFORE }],
  }, { indexAxis: "y", scales: { x: { beginAtZero: true, ticks: { precision: 0 } } } });
}

async function refresh() {
  let r;
  try {
    r = await fetch("/api/dashboard", { credentials: "same-origin" });
  } catch (err) {  // what the page shows is no longer live: say so, and keep trying
    document.body.classList.add("offline");
    text("#serving", "not connected: is `rlfleet web` still running?");
    return;
  }
  if (r.status === 401) { location.reload(); return; }
  document.body.classList.remove("offline");
  const d = await r.json();
  const st = d.status;
  showModel(st.model);
  const current = (st.adapter || {}).current;
  text("#serving", current ? `adapter ${current}` : "base model");
  ratings(st); training(st); fleet(st); scopesTable(st);
  versions(d.history, current);
  draw(d);
  document.body.dataset.updated = d.now;
}

$("#train").addEventListener("click", () => act({ name: "train" }));
$("#pause").addEventListener("click", (ev) => act({ name: ev.target.dataset.name }));
refresh();
setInterval(refresh, 2000);

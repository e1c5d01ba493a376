// The ratings browser: filter, page, undo one, change its words. Every stored text goes in as text.
"use strict";

const PAGE = 50;
let offset = 0;

function query() {
  const params = new URLSearchParams();
  for (const [k, v] of new FormData($("#filter"))) if (String(v).trim() && !(k === "value" && v === "0")) params.set(k, String(v).trim());
  params.set("limit", PAGE); params.set("offset", offset);
  return params;
}

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "" : String(text);
  if (cls) td.className = cls;
  tr.append(td);
  return td;
}

function say(text, ok) { const s = $("#said"); s.textContent = text; s.className = "said " + (ok ? "ok" : "err"); }

function row(r) {
  const tr = document.createElement("tr");
  tr.dataset.id = r.id;
  cell(tr, r.created.slice(0, 16).replace("T", " "));
  cell(tr, r.source); cell(tr, r.actor);
  cell(tr, (r.value > 0 ? "👍" : "👎") + (r.stars ? ` ${r.stars}★` : "")
    + (r.reward === null || r.reward === undefined ? "" : ` reward ${r.reward}`));
  const qa = cell(tr, "", "qa");
  const q = document.createElement("div"); q.className = "q"; q.textContent = r.prompt;
  const a = document.createElement("div"); a.textContent = r.answer;
  qa.append(q, a);
  const comment = cell(tr, r.comment, "comment");
  cell(tr, r.trained_by || "pending");
  cell(tr, r.state);
  const td = document.createElement("td");
  if (r.state === "active") {
    const edit = document.createElement("button");
    edit.type = "button"; edit.className = "edit"; edit.textContent = "edit comment";
    edit.addEventListener("click", async () => {
      const words = window.prompt("The comment (why it is good or bad):", r.comment || "");
      if (words === null || !words.trim()) return;
      const res = await post("/api/ratings/comment", { id: r.id, comment: words.trim() });
      say(res.message, res.ok);
      if (res.ok) search(true);
    });
    const undo = document.createElement("button");
    undo.type = "button"; undo.className = "undo"; undo.textContent = "undo";
    undo.addEventListener("click", async () => {
      if (!window.confirm(`Undo ${r.actor}'s ${r.value > 0 ? "👍" : "👎"} on “${r.answer.slice(0, 60)}”?`)) return;
      const res = await post("/api/ratings/undo", { id: r.id });
      say(res.message, res.ok);
      if (res.ok) search(true);
    });
    td.append(edit, undo);
  }
  tr.append(td);
  return tr;
}

async function search(fresh) {
  if (fresh) offset = 0;
  const r = await fetch("/api/ratings?" + query(), { credentials: "same-origin" });
  if (r.status === 401) { location.reload(); return; }
  const d = await r.json();
  if (!r.ok) { say(d.message, false); return; }
  const body = $("#ratings tbody");
  if (fresh) body.textContent = "";
  for (const x of d.ratings) body.append(row(x));
  offset += d.ratings.length;
  $("#count").textContent = `${d.total} rating${d.total === 1 ? "" : "s"}` + (offset < d.total ? `, ${offset} shown` : "");
  $("#more").hidden = offset >= d.total;
}

// Filters from the address (the dashboard links a version's ratings as /ratings?version=v0002&state=all).
for (const [k, v] of new URLSearchParams(location.search)) {
  const field = $("#filter").elements.namedItem(k);
  if (field) field.value = v;
}
$("#filter").addEventListener("submit", (ev) => { ev.preventDefault(); search(true); });
$("#more").addEventListener("click", () => search(false));
search(true);

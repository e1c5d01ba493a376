// The chat page: ask, watch the answer stream in, rate it. Everything the model or a person wrote is put
// on the page as text (textContent), never as HTML.
"use strict";

const STORE = "rlfleet.chat";
let state = { conversation: null, turns: [] };  // turns: {role, content, capture?, version?, rated?}
let reasons = [];
let busy = false;  // an answer is streaming: another message waits until it is done
let inflight = null;  // its request: "New conversation" aborts it (the server stops drawing at once)

function save() { localStorage.setItem(STORE, JSON.stringify(state)); }

function load(fresh, maxText) {
  try {
    const s = JSON.parse(localStorage.getItem(STORE) || "null");
    if (s && s.conversation && Array.isArray(s.turns)) {  // a turn the server would refuse as history is dropped
      s.turns = s.turns.filter((t) => typeof t.content === "string" && t.content.length <= maxText);
      return s;
    }
  } catch (e) { /* a damaged copy: start over */ }
  return { conversation: fresh, turns: [] };
}

function userTurn(text) {
  const el = document.createElement("article");
  el.className = "turn you";
  const who = document.createElement("div"); who.className = "who"; who.textContent = "you";
  const body = document.createElement("div"); body.className = "text"; body.textContent = text;
  el.append(who, body);
  $("#log").append(el);
  el.scrollIntoView({ block: "end" });
}

function answerTurn(turn) {
  const el = $("#answer").content.firstElementChild.cloneNode(true);
  $(".text", el).textContent = turn.content || "";
  $(".ver", el).textContent = turn.version === undefined ? "" : `· ${turn.version || "base model"}`;
  $("#log").append(el);
  if (turn.capture) wire(el, turn);
  return el;
}

function say(el, text, ok) {
  const said = $(".said", el);
  said.textContent = text;
  said.className = "said " + (ok ? "ok" : "err");
}

function showReasons(el, turn) {
  const box = $(".reasons", el);
  box.hidden = false;
  if (box.querySelector("button")) return;
  for (const reason of reasons) {
    const chip = document.createElement("button");
    chip.type = "button"; chip.className = "chip"; chip.textContent = reason;
    chip.addEventListener("click", async () => {
      const r = await post("/api/why", { conversation: state.conversation, capture: turn.capture, reason });
      say(el, r.message, r.ok);
      if (r.ok) box.hidden = true;
    });
    box.append(chip);
  }
}

async function rate(el, turn, body) {
  const comment = $(".comment-text", el).value.trim();
  const r = await post("/api/rate", { conversation: state.conversation, capture: turn.capture,
                                     ...(comment ? { comment } : {}), ...body });
  say(el, r.ok && r.training ? `${r.message} · ${r.training}` : r.message, r.ok);
  if (!r.ok) return;
  $(".comment-text", el).value = "";
  const rated = body.value !== undefined ? body.value : (body.stars >= 4 ? 1 : -1);
  // the same thumb with no stars keeps the rating's stars, as the server does; the other thumb drops them
  turn.stars = body.stars !== undefined ? body.stars : (rated === turn.rated ? turn.stars : undefined);
  turn.rated = rated;
  save();
  mark(el, turn);
  if (turn.rated < 0 && !comment) showReasons(el, turn);
}

function mark(el, turn) {
  $(".good", el).classList.toggle("on", turn.rated === 1);
  $(".bad", el).classList.toggle("on", turn.rated === -1);
  el.querySelectorAll(".stars button").forEach((b) => b.classList.toggle("on", Number(b.dataset.stars) <= (turn.stars || 0)));
}

function wire(el, turn) {
  $(".rate", el).hidden = false;
  mark(el, turn);
  $(".good", el).addEventListener("click", () => rate(el, turn, { value: 1 }));
  $(".bad", el).addEventListener("click", () => rate(el, turn, { value: -1 }));
  el.querySelectorAll(".stars button").forEach((b) =>
    b.addEventListener("click", () => rate(el, turn, { stars: Number(b.dataset.stars) })));
  $(".comment", el).addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const words = $(".comment-text", el).value.trim();
    if (!words) return;
    if (!turn.rated) { say(el, "rate it (👍, 👎 or stars): your comment goes with the rating", false); return; }
    const r = await post("/api/why", { conversation: state.conversation, capture: turn.capture, reason: words });
    say(el, r.message, r.ok);
    if (r.ok) { $(".comment-text", el).value = ""; $(".reasons", el).hidden = true; }
  });
}

// The question and its answer join the conversation kept in localStorage only once the answer is done:
// a message the server refused, or an answer that failed, is shown with its error and never sent again
// as history. Rating controls appear only on an answer with a capture to rate.
async function ask(text) {
  const convo = state;
  const history = convo.turns.map((t) => ({ role: t.role, content: t.content })).slice(-8);
  userTurn(text);
  const turn = { role: "assistant", content: "" };
  const el = answerTurn(turn);
  el.classList.add("streaming");
  busy = true;
  $("#send").disabled = true;
  const ctl = new AbortController();
  inflight = ctl;
  try {
    const r = await fetch("/api/chat", { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ conversation: convo.conversation, text, history }), credentials: "same-origin",
      signal: ctl.signal });
    if (r.status === 401) { location.reload(); return; }
    if (!r.ok) { const e = await r.json().catch(() => ({})); say(el, e.message || `HTTP ${r.status}`, false); return; }
    let finished = false;
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffered = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffered += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buffered.indexOf("\n")) >= 0) {
        const msg = JSON.parse(buffered.slice(0, nl));
        buffered = buffered.slice(nl + 1);
        if (msg.type === "text") {
          turn.content += msg.text;
          $(".text", el).textContent = turn.content;
          el.scrollIntoView({ block: "end" });
        } else if (msg.type === "done") {
          turn.content = msg.text; turn.version = msg.version; turn.capture = msg.capture;
          $(".text", el).textContent = msg.text;
          $(".ver", el).textContent = `· ${msg.version || "base model"}`;
          $("#version").textContent = msg.version ? `adapter ${msg.version}` : "base model";
          if (msg.capture) wire(el, turn);
          if (msg.note) say(el, msg.note, false);
          finished = true;
        } else if (msg.type === "error") {
          say(el, msg.message, false);
        }
      }
    }
    if (!finished) return;
    convo.turns.push({ role: "user", content: text }, turn);
    if (state === convo) save();
  } catch (e) {
    if (!ctl.signal.aborted) say(el, `the answer broke off: ${e.message || e}`, false);
  } finally {
    el.classList.remove("streaming");
    if (inflight === ctl) {
      inflight = null;
      busy = false;
      $("#send").disabled = false;
    }
  }
}

function startOver(conversation) {
  if (inflight) {  // an answer nobody will see any more: stopped, not waited for
    inflight.abort();
    inflight = null;
    busy = false;
    $("#send").disabled = false;
  }
  state = { conversation, turns: [] };
  save();
  $("#log").textContent = "";
}

async function main() {
  const about = await (await fetch("/api/about", { credentials: "same-origin" })).json();
  reasons = about.reasons;
  showModel(about.model);
  $("#version").textContent = about.version ? `adapter ${about.version}` : "base model";
  state = load(about.conversation, about.max_text);
  for (const t of state.turns) t.role === "user" ? userTurn(t.content) : answerTurn(t);
  $("#new").addEventListener("click", () => startOver(`web-${crypto.randomUUID().slice(0, 8)}`));
  $("#ask").addEventListener("submit", (ev) => {
    ev.preventDefault();
    if (busy) return;  // Enter while an answer streams: the message stays in the box until it is done
    const text = $("#text").value.trim();
    if (!text) return;
    $("#text").value = "";
    if (text === "/new") { startOver(`web-${crypto.randomUUID().slice(0, 8)}`); return; }
    ask(text);
  });
  $("#text").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("#ask").requestSubmit(); }
  });
}

main();

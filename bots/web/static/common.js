// What the three pages share: a query helper and a JSON POST that sends a logged-out page back to the login.
"use strict";

const $ = (sel, root = document) => root.querySelector(sel);

const UNREACHABLE = "the server did not answer: is `rlfleet web` still running? (nothing was recorded)";

async function post(path, body) {
  let r;
  try {
    r = await fetch(path, { method: "POST", headers: { "Content-Type": "application/json" },
                            body: JSON.stringify(body), credentials: "same-origin" });
  } catch (err) {  // the server is down or the network gone: said where the action was, not thrown
    return { ok: false, message: UNREACHABLE };
  }
  if (r.status === 401) { location.reload(); return { ok: false, message: "logged out" }; }
  return r.json().catch(() => ({ ok: false, message: `HTTP ${r.status}` }));
}

// The header's model: a local folder by its own name (a path would fill the bar), the whole spec on hover.
function showModel(spec) {
  const el = $("#model");
  if (!el || !spec) return;
  const local = /^[/.~]/.test(spec) || /^[A-Za-z]:\\/.test(spec);
  const parts = spec.replace(/:[^/\\:]+\.gguf$/, "").split(/[/\\]/).filter(Boolean);
  el.textContent = local && parts.length ? parts[parts.length - 1] : spec;
  el.title = spec;
}

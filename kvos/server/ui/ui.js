// The memory map of `kvos serve` (served at /ui): every session of the key as a strip of its chunks in
// conversation order, updated from the key's event stream (GET /v1/events); a chunk's detail and its pin.
// Plain browser JavaScript with no build step and nothing fetched from elsewhere.
"use strict";

const KEY_STORE = "kvos.apiKey";
const state = {
  key: sessionStorage.getItem(KEY_STORE) || "",
  sessions: new Map(), // id -> {summary, detail, el, events: []}
  selected: null, // {session, chunk}
  stream: null, // the AbortController of the event stream
  timers: new Map(), // debounced refreshes, by name
};
const $ = (id) => document.getElementById(id);

class KeyRefused extends Error {}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (state.key) headers.Authorization = `Bearer ${state.key}`;
  const r = await fetch(path, { ...options, headers });
  if (r.status === 401) throw new KeyRefused("the server refused this key");
  const body = await r.json();
  if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
  return body;
}

function later(name, ms, fn) { // at most one pending per name: a burst of events redraws every ms, not at its end
  if (state.timers.has(name)) return;
  state.timers.set(name, setTimeout(() => { state.timers.delete(name); run(fn); }, ms));
}

async function run(fn) {
  try {
    await fn();
  } catch (err) {
    if (err instanceof KeyRefused) askForKey(err.message);
    else console.warn("kvos ui:", err.message);
  }
}

// ---------------------------------------------------------------- the key
function askForKey(message) {
  if (state.stream) state.stream.abort();
  $("key-form").hidden = false;
  $("key-error").textContent = message || "";
  $("key").focus();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = $("key").value.trim();
  sessionStorage.setItem(KEY_STORE, state.key);
  $("key-form").hidden = true;
  run(connect);
});

// ---------------------------------------------------------------- the sessions
async function refreshList() {
  const list = await api("/v1/sessions");
  showPool(list.pool);
  const seen = new Set(list.data.map((s) => s.id));
  for (const id of [...state.sessions.keys()]) if (!seen.has(id)) removeSession(id);
  for (const summary of list.data) {
    const known = state.sessions.get(summary.id);
    if (known) known.summary = summary;
    else {
      state.sessions.set(summary.id, { summary, detail: null, el: sessionElement(summary.id), events: [] });
      await refreshSession(summary.id);
    }
  }
  $("empty").hidden = state.sessions.size > 0;
}

function showPool(pool) {
  const cap = pool.max_bytes || pool.bytes;
  const mib = (b) => (b / 2 ** 20).toFixed(1);
  $("pool-live").style.width = `${(100 * pool.live_bytes) / Math.max(cap, 1)}%`;
  $("pool-held").style.width = `${(100 * pool.bytes) / Math.max(cap, 1)}%`;
  const capText = pool.max_bytes ? `cap ${mib(pool.max_bytes)} MiB` : "no cap";
  $("pool-text").textContent =
    `${pool.live_tokens} tokens in use (${mib(pool.live_bytes)} MiB) of ${pool.tokens} allocated ` +
    `(${mib(pool.bytes)} MiB), ${capText}; grown ${pool.resizes}x`;
}

function sessionElement(id) {
  const el = document.createElement("section");
  el.className = "session";
  el.dataset.session = id;
  el.innerHTML = '<h2></h2><div class="counters"></div><div class="strip"></div>' +
    '<div class="budget"></div><div class="events"></div>';
  el.querySelector("h2").textContent = id;
  el.querySelector(".strip").addEventListener("click", (event) => {
    const chunk = event.target.closest(".chunk");
    if (chunk) select(id, Number(chunk.dataset.chunk));
  });
  $("sessions").append(el);
  return el;
}

function removeSession(id) {
  const s = state.sessions.get(id);
  if (!s) return;
  s.el.remove();
  state.sessions.delete(id);
  if (state.selected && state.selected.session === id) closeDetail();
  $("empty").hidden = state.sessions.size > 0;
}

async function refreshSession(id) {
  const s = state.sessions.get(id);
  if (!s) return;
  const asked = (s.asked = (s.asked || 0) + 1);
  const detail = await api(`/v1/sessions/${encodeURIComponent(id)}?events=200`);
  if (asked !== s.asked) return; // a later read is on its way: draw that one
  s.detail = detail;
  drawSession(s);
  if (state.selected && state.selected.session === id) drawDetail();
}

function drawSession(s) {
  const d = s.detail;
  const branch = d.branches.length > 1 ? ` branch ${d.branch} of ${d.branches.length}` : "";
  s.el.querySelector("h2").innerHTML = "";
  s.el.querySelector("h2").append(d.id, Object.assign(document.createElement("span"),
    { className: "branch", textContent: branch }));
  s.el.querySelector(".counters").innerHTML =
    `turn <b>${d.turn}</b> · <b>${d.active_tokens}</b> of <b>${d.budget}</b> tokens resident · ` +
    `history <b>${d.history_tokens}</b> · evictions <b>${d.evictions}</b> · restored ` +
    `<b>${d.recoveries_restore}</b> · recomputed <b>${d.recoveries_recompute}</b>` + compression(d);
  const strip = s.el.querySelector(".strip");
  const old = new Map([...strip.children].map((c) => [c.dataset.chunk, c.className]));
  strip.replaceChildren(...d.chunks.map((c) => chunkElement(c, old.get(String(c.id)))));
  const pct = Math.round((100 * d.active_tokens) / Math.max(d.budget, 1));
  s.el.querySelector(".budget").textContent = `${pct}% of the session's budget resident`;
  s.el.querySelector(".events").textContent = s.events.slice(-5).reverse().join(" · "); // latest first
}

function compression(d) {
  // what K/V compression saves: a paged-out token's stored bytes beside a resident one's (the pool is dense)
  if (!d.kv_compression || d.kv_compression === "none") return "";
  const saved = d.saved_bytes_per_token ? Math.round(d.saved_bytes_per_token) : "-";
  return ` · <span class="compression">${d.kv_compression}: a saved token <b>${saved}</b> bytes, ` +
    `a resident one <b>${d.resident_bytes_per_token}</b></span>`;
}

function chunkElement(c, before) {
  const el = document.createElement("div");
  const selected = state.selected && state.selected.chunk === c.id;
  const hinted = c.keep === "pin" ? " pinned" : c.keep === "prefer" ? " preferred" : "";
  el.className = `chunk ${c.state}${hinted}${selected ? " selected" : ""}`;
  if (before && !before.includes(` ${c.state}`)) el.classList.add("flash");
  el.dataset.chunk = c.id;
  el.dataset.state = c.state;
  el.style.flexGrow = String(c.tokens);
  el.title = `#${c.id} ${c.kind}, ${c.tokens} tokens, ${c.state}, score ${c.score}`;
  return el;
}

// ---------------------------------------------------------------- a chunk's detail
function select(session, chunk) {
  state.selected = { session, chunk };
  $("detail").hidden = false;
  document.body.classList.add("detail-open");
  drawSession(state.sessions.get(session));
  drawDetail();
}

function closeDetail() {
  const s = state.selected && state.sessions.get(state.selected.session);
  state.selected = null;
  $("detail").hidden = true;
  document.body.classList.remove("detail-open");
  if (s) drawSession(s);
}

function selectedChunk() {
  const s = state.selected && state.sessions.get(state.selected.session);
  if (!s || !s.detail) return null;
  const chunk = s.detail.chunks.find((c) => c.id === state.selected.chunk);
  return chunk ? { s, chunk } : null;
}

function drawDetail() {
  const found = selectedChunk();
  if (!found) return closeDetail();
  const { s, chunk } = found;
  $("detail-title").textContent = `${s.detail.id} · chunk ${chunk.id}`;
  const facts = {
    kind: chunk.kind, message: chunk.message, tokens: `${chunk.tokens} (${chunk.start}-${chunk.end})`,
    state: chunk.state, position: chunk.position ?? "-", keep: chunk.keep ?? "-",
    priority: chunk.priority ?? "-", "last event": chunk.last_event ? describe(chunk.last_event) : "-",
  };
  $("detail-facts").replaceChildren(...Object.entries(facts).flatMap(([k, v]) => [
    Object.assign(document.createElement("dt"), { textContent: k }),
    Object.assign(document.createElement("dd"), { textContent: String(v) }),
  ]));
  $("pin").textContent = chunk.keep === "pin" ? "Unpin" : "Pin";
  $("priority").value = chunk.priority ?? "";
  const rows = [["score", chunk.score], ...Object.entries(chunk.signals)];
  $("signals").replaceChildren(...rows.map(([k, v]) => row(k, v === null ? "-" : v.toFixed(4))));
  $("detail-text").textContent = chunk.text;
  const history = s.detail.events.filter((e) => e.chunk === chunk.id);
  $("history").replaceChildren(...(history.length ? history : [{ event: "no events yet" }])
    .map((e) => Object.assign(document.createElement("li"), { textContent: describe(e) })));
}

function row(name, value) {
  const tr = document.createElement("tr");
  tr.append(Object.assign(document.createElement("td"), { textContent: name }),
    Object.assign(document.createElement("td"), { textContent: value, className: "num" }));
  return tr;
}

function describe(e) {
  const skip = new Set(["event", "turn", "chunk", "session", "owner"]);
  const rest = Object.entries(e).filter(([k]) => !skip.has(k)).map(([k, v]) => `${k} ${v}`);
  return `${e.turn !== undefined ? `turn ${e.turn}: ` : ""}${e.event}${rest.length ? ` (${rest.join(", ")})` : ""}`;
}

async function hint(body) {
  const found = selectedChunk();
  if (!found) return;
  const { s, chunk } = found;
  $("detail-error").textContent = "";
  const path = `/v1/sessions/${encodeURIComponent(s.detail.id)}/chunks/${chunk.id}` +
    `?branch=${encodeURIComponent(s.detail.branch)}`;
  try {
    await api(path, { method: "PATCH", body: JSON.stringify(body),
      headers: { "Content-Type": "application/json" } });
  } catch (err) {
    if (err instanceof KeyRefused) throw err;
    $("detail-error").textContent = err.message;
  }
  await refreshSession(s.detail.id);
}

$("pin").addEventListener("click", () => {
  const found = selectedChunk();
  if (found) run(() => hint({ keep: found.chunk.keep === "pin" ? null : "pin" }));
});
$("set-priority").addEventListener("click", () => {
  const value = $("priority").value;
  if (value !== "") run(() => hint({ priority: Number(value) }));
});
$("close").addEventListener("click", closeDetail);

// ---------------------------------------------------------------- the event stream
function onEvent(e) {
  if (e.event === "open") return later("list", 50, refreshList);
  if (e.event === "close") return removeSession(e.session);
  const s = state.sessions.get(e.session);
  if (!s) return later("list", 50, refreshList);
  s.events.push(describe(e));
  if (s.events.length > 50) s.events.shift();
  later(`session:${e.session}`, 150, () => refreshSession(e.session));
  later("list", 500, refreshList);
}

async function watch() {
  const controller = new AbortController();
  state.stream = controller;
  const headers = state.key ? { Authorization: `Bearer ${state.key}` } : {};
  const r = await fetch("/v1/events", { headers, signal: controller.signal });
  if (r.status === 401) throw new KeyRefused("the server refused this key");
  $("live").classList.remove("off");
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = frame.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6));
      if (data.length) onEvent(JSON.parse(data.join("\n")));
    }
  }
}

async function keepWatching() {
  for (;;) {
    try {
      await watch();
    } catch (err) {
      if (err instanceof KeyRefused) return askForKey(err.message);
      if (err.name === "AbortError") return;
    }
    $("live").classList.add("off");
    await new Promise((resolve) => setTimeout(resolve, 2000));
    await run(refreshList);
  }
}

async function connect() {
  await refreshList();
  keepWatching();
}

async function start() {
  const health = await (await fetch("/health")).json();
  $("model").textContent = health.model;
  setInterval(() => { if ($("key-form").hidden) run(refreshList); }, 10000); // the pool between events
  if (health.keys_required && !state.key) return askForKey("");
  await connect();
}

run(start);

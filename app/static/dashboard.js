// queue-gateway dashboard: polls the admin-protected GET /admin/v1/queues every second, lists
// the endpoints busiest first (a filter narrows them) and charts depth and throughput of one
// endpoint from the history kept in this tab.
// The admin token comes from the form or the URL fragment (#token=...), which browsers never
// send to a server; it is kept in sessionStorage and dropped when the gateway refuses it.
// No data is ever put into the page as HTML: every value goes in through textContent.
"use strict";

const POLL_MS = 1000;
const TIMEOUT_MS = 5000; // a gateway that accepts and never answers must not stall the page
// The server keeps an hour of samples 10 s apart (app/lifecycle/history.py), loaded once (by
// actions.js); this tab adds one sample a poll.
const HISTORY_S = 3600;
const MIN_SPAN_S = 5; // the time axis spans the samples held, but no less than this
// Throughput is completions over a sliding window: the difference between two one-second
// polls jumps between 0 and twice the rate as tasks finish either side of a poll.
const TPUT_WINDOW_S = 5;
// Samples further apart (tab asleep, gateway down) are not joined by a line; the server's
// are 10 s apart.
const GAP_S = 25;
const MAX_ROWS = 200; // rows kept in the DOM: laying out a thousand every second is slow
const KEY = "qgw-admin-token";
const BAD_CHARS = "the token has characters a browser cannot send in a header " +
  "(only Latin-1 is allowed): enter it again";
const NS = "http://www.w3.org/2000/svg";
const SPARK_W = 100;
const SPARK_H = 24;

const history = new Map(); // endpoint id -> {t: [], depth: [], done: []}; t in seconds
const rowCache = new Map(); // endpoint id -> {tr, cells}: rows are updated, not rebuilt
let latest = []; // the last answer, so the filter and a click redraw without waiting
let firstSample = null; // when this tab started recording (performance.now, seconds)
let pinned = null; // the endpoint the user clicked; null: follow the busiest
let followed = null; // the endpoint charted while nothing is pinned
let marked = null; // the row highlighted as charted
let filter = "";
let failureKey = null;
let timer = null;
let generation = 0; // bumped on every restart, so an answer to an older poll is dropped
// The chart's width, kept by a ResizeObserver: reading clientWidth after the rows changed
// would force a layout of the whole table on every poll.
let chartWidth = 0;

const $ = (id) => document.getElementById(id);
const clock = () => performance.now() / 1000; // monotonic: wall-clock jumps would bend lines

// ---- token and polling ----

function tokenFromFragment() {
  const m = /(?:^#|&)token=([^&]*)/.exec(location.hash);
  if (!m) return null;
  // Take the token out of the address bar, so it is not bookmarked, shared or screenshotted.
  window.history.replaceState(null, "", location.pathname + location.search);
  try {
    sessionStorage.setItem(KEY, decodeURIComponent(m[1]));
    return null;
  } catch {
    sessionStorage.removeItem(KEY);
    return "the token in the link is not valid percent-encoding: enter it here";
  }
}

// The Authorization header, or null when the token cannot go in one: fetch() would throw a
// TypeError that reads like a network failure and would be retried forever.
function authHeaders(token) {
  try {
    return new Headers({ Authorization: `Bearer ${token}` });
  } catch {
    return null;
  }
}

// One poll's outcome: {body}, {refused: message} (stop, ask again) or {retry: message}.
async function fetchQueues(headers) {
  const abort = new AbortController();
  const timeout = setTimeout(() => abort.abort(), TIMEOUT_MS);
  try {
    const r = await fetch("/admin/v1/queues", { headers, cache: "no-store", signal: abort.signal });
    if (r.status === 401 || r.status === 403) {
      return { refused: `token refused (HTTP ${r.status}): enter the admin token` };
    }
    if (r.status === 503) return { retry: await unavailable(r) };
    if (r.status === 502 || r.status === 504) {
      return { retry: `cannot reach the gateway (a proxy answered HTTP ${r.status}): retrying` };
    }
    if (!r.ok) return { retry: `the gateway answered HTTP ${r.status}: retrying` };
    return { body: await r.json() };
  } catch (err) {
    if (err.name === "AbortError") {
      return { retry: `no answer from the gateway in ${TIMEOUT_MS / 1000} s: retrying` };
    }
    if (err instanceof SyntaxError) return { retry: "the gateway sent no JSON: retrying" };
    return { retry: "cannot reach the gateway: retrying" };
  } finally {
    clearTimeout(timeout);
  }
}

// The app answers 503 naming the store that did not answer (app/errors.py): it is up and
// will recover. A 503 without that body came from something in front of it.
async function unavailable(r) {
  const code = await r.json().then((body) => body?.error?.code).catch(() => undefined);
  if (code === "redis_unavailable") return "gateway up, Redis unavailable: retrying";
  if (code === "database_unavailable") return "gateway up, database unavailable: retrying";
  if (code) return "gateway up, Redis/database unavailable: retrying";
  return "the gateway or a proxy answered HTTP 503: retrying";
}

async function poll() {
  const gen = generation;
  const token = sessionStorage.getItem(KEY);
  if (!token) return showLogin();
  const headers = authHeaders(token);
  if (!headers) {
    sessionStorage.removeItem(KEY);
    return showLogin(BAD_CHARS);
  }
  const answer = await fetchQueues(headers);
  if (gen !== generation) return; // a new token or sign-out came in meanwhile
  if (answer.refused) {
    sessionStorage.removeItem(KEY);
    return showLogin(answer.refused);
  }
  if (answer.body) {
    $("login").hidden = true;
    $("queues").hidden = false;
    $("forget").hidden = false;
    update(answer.body.endpoints);
    setStatus(`updated ${new Date().toLocaleTimeString()}`, false);
  } else {
    setStatus(answer.retry, true); // the last numbers stay on screen
  }
  timer = setTimeout(poll, POLL_MS);
}

function restart() {
  generation++;
  clearTimeout(timer);
  poll();
}

function showLogin(message) {
  $("login").hidden = false;
  $("queues").hidden = true;
  $("forget").hidden = true;
  setStatus(message || "admin token needed", true);
  $("token").focus();
}

function setStatus(text, bad) {
  const s = $("status");
  s.textContent = text;
  s.className = bad ? "bad" : "muted";
}

// ---- formatting ----

const formats = new Map(); // building an Intl.NumberFormat per call costs more than the page
function fmt(n, digits) {
  if (n === null || n === undefined) return "–";
  const d = digits ?? 1;
  if (!formats.has(d)) formats.set(d, new Intl.NumberFormat("en", { maximumFractionDigits: d }));
  return formats.get(d).format(n);
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 120) return `${fmt(s, 1)} s`;
  if (s < 7200) return `${fmt(s / 60, 1)} min`;
  return `${fmt(s / 3600, 1)} h`;
}

function setText(node, text) {
  if (node.textContent !== text) node.textContent = text; // untouched text keeps a selection
}

// ---- history ----

function record(q, t) {
  let h = history.get(q.id);
  if (!h) history.set(q.id, (h = { t: [], depth: [], done: [] }));
  h.t.push(t);
  h.depth.push(q.pending);
  h.done.push(q.completed + q.failed);
  let old = 0;
  while (h.t[old] < t - HISTORY_S) old++;
  if (old) for (const a of [h.t, h.depth, h.done]) a.splice(0, old);
}

// Finished tasks a second over the last TPUT_WINDOW_S at each sample (null: no earlier one).
function throughput(h) {
  const out = [];
  let j = 0;
  for (let i = 0; i < h.t.length; i++) {
    // +0.5: polls drift past a second; samples further apart (the server's) use the last one.
    while (j < i - 1 && h.t[i] - h.t[j] > TPUT_WINDOW_S + 0.5) j++;
    const span = h.t[i] - h.t[j];
    out.push(i > j && span <= GAP_S ? Math.max(0, (h.done[i] - h.done[j]) / span) : null);
  }
  return out;
}

function update(queues) {
  const t = clock();
  if (firstSample === null) firstSample = t;
  const ids = new Set();
  for (const q of queues) {
    ids.add(q.id);
    record(q, t);
  }
  for (const id of history.keys()) {
    if (!ids.has(id)) {
      history.delete(id); // endpoint deleted
      rowCache.delete(id);
    }
  }
  latest = queues;
  renderView();
  renderFailures(queues);
  if (typeof afterUpdate === "function") afterUpdate(queues); // actions.js
}

// ---- table ----

const load = (q) => q.pending + q.in_flight;
const busiestFirst = (a, b) => load(b) - load(a) || (a.id < b.id ? -1 : a.id > b.id ? 1 : 0);

function renderView() {
  if (firstSample === null) return;
  const t = clock();
  const span = Math.min(HISTORY_S, Math.max(MIN_SPAN_S, t - firstSample));
  const sorted = latest.slice().sort(busiestFirst);
  const rows = filter ? sorted.filter((q) => q.id.toLowerCase().includes(filter)) : sorted;
  renderRows(rows.slice(0, MAX_ROWS), t, span);
  renderCounts(rows.length, latest.length);
  const id = charted(rows);
  if (marked !== id) {
    rowCache.get(marked)?.tr.classList.remove("selected");
    marked = id;
  }
  rowCache.get(id)?.tr.classList.add("selected");
  drawChart(id, t, span);
}

function renderRows(queues, t, span) {
  const body = $("rows");
  let next = body.firstChild;
  for (const q of queues) {
    const row = rowFor(q.id);
    fillRow(row.cells, q, t, span);
    // Move a row only when it is out of place: re-inserting every row relays out the table.
    if (row.tr === next) next = next.nextSibling;
    else body.insertBefore(row.tr, next);
  }
  while (next) {
    const after = next.nextSibling;
    next.remove();
    next = after;
  }
}

const FIELDS = ["id", "pending", "in_flight", "admitted", "throughput", "exec", "wait_new",
  "oldest", "done_failed", "chart", "actions"];

function rowFor(id) {
  let row = rowCache.get(id);
  if (row) return row;
  const tr = document.createElement("tr");
  tr.dataset.endpoint = id;
  tr.tabIndex = 0; // a row is chosen for the chart by click or Enter
  const cells = {};
  for (const field of FIELDS) {
    const td = (cells[field] = document.createElement("td"));
    td.dataset.field = field;
    if (field === "actions") {
      for (const action of ["pause", "purge"]) {
        const b = document.createElement("button");
        b.type = "button";
        b.dataset.action = action;
        b.textContent = action;
        td.appendChild(b);
      }
    } else if (field !== "id") td.className = "num";
    tr.appendChild(td);
  }
  row = { tr, cells };
  rowCache.set(id, row);
  return row;
}

// What holds an endpoint's line back now (stats.py _binding), as the row says it.
function holdText(q) {
  if (!q.enabled) return " (disabled)";
  if (q.paused) return " (paused)";
  if (q.binding_limit === "upstream") {
    return q.admits_next_at
      ? ` (paused by upstream until ${new Date(q.admits_next_at).toLocaleTimeString()})`
      : " (paused by upstream: probing)";
  }
  return "";
}

function fillRow(c, q, t, span) {
  setText(c.id, q.id + holdText(q));
  setText(c.actions.firstChild, q.paused ? "resume" : "pause");
  const next = q.admits_next_at ? `, admits next at ${new Date(q.admits_next_at).toLocaleTimeString()}` : "";
  c.id.title = q.binding_limit ? `${q.id}: held by ${q.binding_limit}${next}` : q.id;
  setText(c.pending, fmt(q.pending, 0));
  // An adaptive endpoint's cap is the one it has learnt (of its max_concurrency).
  const cap = q.adaptive_limit ?? q.max_concurrency;
  const learnt = q.adaptive_limit != null ? ` (learnt, max ${q.max_concurrency})` : "";
  bar(c.in_flight, cap ? `${q.in_flight} / ${cap}${learnt}` : `${q.in_flight}`,
    cap ? q.in_flight / cap : null);
  const limit = q.rate_limit_per_s;
  bar(c.admitted, limit ? `${fmt(q.admitted_per_s, 2)} / ${fmt(limit, 2)}`
    : fmt(q.admitted_per_s, 2), limit ? q.admitted_per_s / limit : null);
  setText(c.throughput, fmt(q.throughput_per_s, 2));
  setText(c.exec, q.exec_ms === null && q.slot_ms === null ? "–"
    : `${fmt(q.exec_ms, 0)} / ${fmt(q.slot_ms, 0)}`);
  setText(c.wait_new, fmtSeconds(q.wait_time_new_s));
  setText(c.oldest, fmtSeconds(q.oldest_pending_age_s));
  setText(c.done_failed, `${fmt(q.completed, 0)} / ${fmt(q.failed, 0)}`);
  c.done_failed.classList.toggle("bad",
    q.recent_failures.length > 0 && q.recent_failures[0].at_s_ago < 300);
  sparkline(c.chart, history.get(q.id), t, span);
}

function bar(td, text, ratio) {
  if (!td.firstChild) {
    const outer = document.createElement("span");
    outer.className = "bar";
    outer.appendChild(document.createElement("span"));
    td.append(document.createElement("span"), outer);
  }
  const [value, outer] = td.children;
  setText(value, text);
  outer.hidden = ratio === null;
  if (ratio === null) return;
  outer.classList.toggle("hot", ratio >= 0.95);
  outer.firstChild.style.width = `${Math.min(100, Math.round(ratio * 100))}%`;
}

function renderCounts(matching, total) {
  const more = Math.max(0, matching - MAX_ROWS);
  $("more").hidden = more === 0;
  $("more").textContent = `${fmt(more, 0)} more not shown: narrow them with the filter`;
  $("shown").textContent = filter ? `${fmt(matching, 0)} of ${fmt(total, 0)} endpoints`
    : `${fmt(total, 0)} endpoints, busiest first`;
  $("empty").hidden = matching > 0;
  $("empty").textContent = total ? `No endpoint id contains "${filter}".`
    : "No endpoints registered yet.";
}

function renderFailures(queues) {
  const all = queues.flatMap((q) => q.recent_failures.map((f) => ({ ...f, endpoint: q.id })));
  all.sort((a, b) => a.at_s_ago - b.at_s_ago);
  const shown = all.slice(0, 200); // each endpoint's full list: its "failed" tasks
  // Rebuilt only when the failures change, so a task id can be selected and copied; hence a
  // clock time, not an age that would change every second.
  const key = shown.map((f) => f.task_id).join();
  if (key === failureKey) return;
  failureKey = key;
  const now = Date.now();
  const items = shown.map((f) => {
    const li = document.createElement("li");
    const code = document.createElement("code");
    code.textContent = f.task_id;
    const at = new Date(now - f.at_s_ago * 1000);
    const when = f.at_s_ago < 43200 ? at.toLocaleTimeString() : at.toLocaleString();
    li.append(`${when} · ${f.endpoint} · `, code, ` · ${f.code ?? "no response"} · ${f.reason}`);
    return li;
  });
  if (!items.length) {
    items.push(document.createElement("li"));
    items[0].className = "muted";
    items[0].textContent = "none";
  }
  $("failures").replaceChildren(...items);
}

// ---- events ----

function choose(ev) {
  const tr = ev.target.closest("tr[data-endpoint]");
  if (!tr || ev.target.closest("button") || (ev.type === "keydown" && ev.key !== "Enter")) return;
  pinned = tr.dataset.endpoint;
  renderView();
  if (typeof openTasks === "function") openTasks(pinned); // actions.js
}
$("rows").addEventListener("click", choose);
$("rows").addEventListener("keydown", choose);

new ResizeObserver(([entry]) => {
  chartWidth = entry.contentRect.width;
  renderView();
}).observe($("chart-panel"));

$("follow").addEventListener("click", () => {
  pinned = null;
  followed = null; // the busiest now, not the one followed before the click
  renderView();
});

$("filter").addEventListener("input", () => {
  filter = $("filter").value.trim().toLowerCase();
  renderView();
});

$("login").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const token = $("token").value.trim();
  $("token").value = "";
  if (!authHeaders(token)) return showLogin(BAD_CHARS); // said now, not after a round trip
  sessionStorage.setItem(KEY, token);
  restart();
});

$("forget").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  generation++;
  clearTimeout(timer);
  showLogin("signed out");
});

// A link with #token=... opened on this page already is a same-document navigation.
window.addEventListener("hashchange", () => {
  if (!/token=/.test(location.hash)) return;
  const problem = tokenFromFragment();
  if (problem) {
    generation++;
    clearTimeout(timer);
    showLogin(problem);
  } else {
    restart();
  }
});

const problem = tokenFromFragment();
if (problem) showLogin(problem);
else poll();

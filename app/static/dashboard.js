// queue-gateway dashboard: polls the admin-protected GET /admin/v1/queues every second and
// draws one row per endpoint, with a chart of depth and throughput kept in this tab.
// The admin token comes from the form or the URL fragment (#token=...), which browsers never
// send to a server; it is kept in sessionStorage and dropped on a 401. No data is ever put
// into the page as HTML: every value goes in through textContent.
"use strict";

const POLL_MS = 1000;
const HISTORY_S = 300;
const KEY = "qgw-admin-token";
const history = new Map(); // endpoint id -> [{t, depth, tput}]
const last = new Map(); // endpoint id -> {t, done}: for the throughput between two polls
let timer = null;

const $ = (id) => document.getElementById(id);

function tokenFromFragment() {
  const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
  if (!m) return;
  sessionStorage.setItem(KEY, decodeURIComponent(m[1]));
  clearFragment();
}

function clearFragment() {
  // Take the token out of the address bar, so it is not bookmarked, shared or screenshotted.
  window.history.replaceState(null, "", location.pathname + location.search);
}

function showLogin(message) {
  $("login").hidden = false;
  $("queues").hidden = true;
  $("forget").hidden = true;
  setStatus(message || "admin token needed", true);
}

function setStatus(text, bad) {
  const s = $("status");
  s.textContent = text;
  s.className = bad ? "bad" : "muted";
}

function fmt(n, digits) {
  if (n === null || n === undefined) return "–";
  return Number(n).toLocaleString("en", { maximumFractionDigits: digits ?? 1 });
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 120) return `${fmt(s, 1)} s`;
  if (s < 7200) return `${fmt(s / 60, 1)} min`;
  return `${fmt(s / 3600, 1)} h`;
}

function cell(row, field) {
  let td = row.querySelector(`td[data-field="${field}"]`);
  if (!td) {
    td = document.createElement("td");
    td.dataset.field = field;
    if (field !== "id") td.className = "num";
    row.appendChild(td);
  }
  return td;
}

function bar(td, text, ratio) {
  td.textContent = text;
  if (ratio === null) return;
  const outer = document.createElement("span");
  outer.className = ratio >= 0.95 ? "bar hot" : "bar";
  const inner = document.createElement("span");
  inner.style.width = `${Math.min(100, Math.round(ratio * 100))}%`;
  outer.appendChild(inner);
  td.appendChild(outer);
}

function chart(td, points) {
  const NS = "http://www.w3.org/2000/svg";
  let svg = td.querySelector("svg");
  if (!svg) {
    svg = document.createElementNS(NS, "svg");
    svg.setAttribute("class", "chart");
    svg.setAttribute("viewBox", "0 0 160 36");
    svg.setAttribute("preserveAspectRatio", "none");
    for (const cls of ["depth", "tput"]) {
      const line = document.createElementNS(NS, "polyline");
      line.setAttribute("class", cls);
      svg.appendChild(line);
    }
    td.appendChild(svg);
  }
  const now = points.length ? points[points.length - 1].t : 0;
  // The time axis grows with the history kept, from one minute up to HISTORY_S.
  const span = Math.min(HISTORY_S, Math.max(60, points.length ? now - points[0].t : 0));
  const path = (key) => {
    const max = Math.max(1, ...points.map((p) => p[key]));
    return points
      .map((p) => `${(160 - ((now - p.t) / span) * 160).toFixed(1)},` +
        `${(34 - (p[key] / max) * 32).toFixed(1)}`)
      .join(" ");
  };
  svg.querySelector(".depth").setAttribute("points", path("depth"));
  svg.querySelector(".tput").setAttribute("points", path("tput"));
  const d = Math.max(0, ...points.map((p) => p.depth));
  svg.setAttribute("aria-label", `depth up to ${d} in the last ${Math.round(span / 60)} min`);
}

function record(q, t) {
  const prev = last.get(q.id);
  const done = q.completed + q.failed;
  const tput = prev && t > prev.t ? (done - prev.done) / (t - prev.t) : q.throughput_per_s;
  last.set(q.id, { t, done });
  const points = history.get(q.id) || [];
  points.push({ t, depth: q.pending, tput: Math.max(0, tput) });
  while (points.length && points[0].t < t - HISTORY_S) points.shift();
  history.set(q.id, points);
  return points;
}

function render(queues) {
  const t = Date.now() / 1000;
  const rows = $("rows");
  const seen = new Set();
  for (const q of queues) {
    seen.add(q.id);
    let row = rows.querySelector(`tr[data-endpoint="${CSS.escape(q.id)}"]`);
    if (!row) {
      row = document.createElement("tr");
      row.dataset.endpoint = q.id;
      rows.appendChild(row);
    }
    cell(row, "id").textContent = q.enabled ? q.id : `${q.id} (disabled)`;
    cell(row, "pending").textContent = fmt(q.pending, 0);
    const cap = q.max_concurrency;
    bar(cell(row, "in_flight"), cap ? `${q.in_flight} / ${cap}` : `${q.in_flight}`,
      cap ? q.in_flight / cap : null);
    const limit = q.rate_limit_per_s;
    bar(cell(row, "admitted"), limit ? `${fmt(q.admitted_per_s, 2)} / ${fmt(limit, 2)}`
      : fmt(q.admitted_per_s, 2), limit ? q.admitted_per_s / limit : null);
    cell(row, "throughput").textContent = fmt(q.throughput_per_s, 2);
    cell(row, "exec").textContent =
      q.exec_ms === null && q.slot_ms === null ? "–" : `${fmt(q.exec_ms, 0)} / ${fmt(q.slot_ms, 0)}`;
    cell(row, "wait_new").textContent = fmtSeconds(q.wait_time_new_s);
    cell(row, "oldest").textContent = fmtSeconds(q.oldest_pending_age_s);
    const f = cell(row, "done_failed");
    f.textContent = `${fmt(q.completed, 0)} / ${fmt(q.failed, 0)}`;
    f.classList.toggle("bad", q.recent_failures.length > 0 && q.recent_failures[0].at_s_ago < 300);
    chart(cell(row, "chart"), record(q, t));
  }
  for (const row of [...rows.children]) {
    if (!seen.has(row.dataset.endpoint)) row.remove();
  }
  $("empty").hidden = queues.length > 0;
  renderFailures(queues);
}

function renderFailures(queues) {
  const all = queues.flatMap((q) => q.recent_failures.map((f) => ({ ...f, endpoint: q.id })));
  all.sort((a, b) => a.at_s_ago - b.at_s_ago);
  const list = $("failures");
  list.replaceChildren(...all.slice(0, 20).map((f) => {
    const li = document.createElement("li");
    const code = document.createElement("code");
    code.textContent = f.task_id;
    li.append(`${fmtSeconds(f.at_s_ago)} ago · ${f.endpoint} · `, code,
      ` · ${f.code ?? "no response"} · ${f.reason}`);
    return li;
  }));
  if (!all.length) {
    const li = document.createElement("li");
    li.className = "muted";
    li.textContent = "none";
    list.replaceChildren(li);
  }
}

async function poll() {
  const token = sessionStorage.getItem(KEY);
  if (!token) return showLogin();
  try {
    const r = await fetch("/admin/v1/queues", {
      headers: { Authorization: `Bearer ${token}` },
      cache: "no-store",
    });
    if (r.status === 401) {
      sessionStorage.removeItem(KEY);
      return showLogin("the admin token was not accepted");
    }
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const body = await r.json();
    $("login").hidden = true;
    $("queues").hidden = false;
    $("forget").hidden = false;
    render(body.endpoints);
    setStatus(`updated ${new Date().toLocaleTimeString()}`, false);
  } catch (err) {
    setStatus(`cannot reach the gateway (${err.message}); retrying`, true);
  }
  timer = setTimeout(poll, POLL_MS);
}

$("login").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY, $("token").value.trim());
  $("token").value = "";
  clearTimeout(timer);
  poll();
});

$("forget").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  clearTimeout(timer);
  showLogin("signed out");
});

// A link with #token=... opened on this page already is a same-document navigation.
window.addEventListener("hashchange", () => {
  if (!/token=/.test(location.hash)) return;
  tokenFromFragment();
  clearTimeout(timer);
  poll();
});

tokenFromFragment();
poll();

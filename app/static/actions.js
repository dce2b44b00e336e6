// The dashboard's operator side: pause/resume and purge per endpoint, the tasks of the endpoint
// clicked by state with one task in full (retry, cancel), the dispatchers alive, the outbox
// backlog and the database, and the server's history loaded once so a reload shows the last hour.
// Loaded after app.js: a classic script sharing its globals ($, KEY, authHeaders, history, ...);
// app.js calls afterUpdate() after each poll and openTasks() when a row is clicked.
// As in app.js, no data ever goes into the page as HTML: only through textContent.
"use strict";

const OVERVIEW_EVERY = 2; // polls between two overview requests
const PAGE = 50; // tasks a page of the task list
const STATES = ["pending", "processing", "failed", "completed", "cancelled", "expired"];

let polls = 0;
let historyLoaded = false;
let tasksOf = null; // the endpoint whose tasks are listed
let tasksState = "pending";
let tasksCursor = null;
let detailId = null;

// One admin call: {ok, status, body}; a refused token sends the page back to its login form.
async function admin(method, path, json) {
  const headers = authHeaders(sessionStorage.getItem(KEY) || "");
  if (!headers) return { ok: false, status: 0, body: null };
  if (json !== undefined) headers.set("Content-Type", "application/json");
  const abort = new AbortController();
  const timeout = setTimeout(() => abort.abort(), TIMEOUT_MS);
  try {
    const r = await fetch(path, { method, headers, cache: "no-store", signal: abort.signal,
      body: json === undefined ? undefined : JSON.stringify(json) });
    const body = await r.json().catch(() => null);
    if (r.status === 401) restart();
    return { ok: r.ok, status: r.status, body };
  } catch {
    return { ok: false, status: 0, body: null };
  } finally {
    clearTimeout(timeout);
  }
}

function why(answer) {
  return answer.body?.error?.message || (answer.status ? `HTTP ${answer.status}`
    : "no answer from the gateway");
}

function notice(text, bad) {
  const n = $("notice");
  n.hidden = false;
  n.textContent = text;
  n.className = bad ? "bad" : "";
}

const enc = encodeURIComponent;

// ---- after each poll: overview, history (once) ----

function afterUpdate(queues) {
  if (polls++ % OVERVIEW_EVERY === 0) loadOverview();
  if (typeof searchAfterPoll === "function") searchAfterPoll(); // search.js
  if (!historyLoaded) {
    historyLoaded = true;
    loadHistory(queues.slice().sort(busiestFirst).slice(0, 200).map((q) => q.id));
  }
}

async function loadOverview() {
  const a = await admin("GET", "/admin/v1/overview");
  if (!a.ok) return;
  const { dispatchers, outbox_backlog: backlog, database } = a.body;
  setText($("dispatcher-count"), `${dispatchers.length} alive`);
  setText($("outbox-backlog"), fmt(backlog, 0));
  setText($("database-state"), database);
  $("database-state").className = database === "ok" ? "" : "bad";
  const key = JSON.stringify(dispatchers.map((d) => [d.id, d.in_flight, d.capacity]));
  if ($("dispatchers").dataset.key === key) return;
  $("dispatchers").dataset.key = key;
  $("dispatchers").replaceChildren(...dispatchers.map((d) => {
    const li = document.createElement("li");
    li.dataset.dispatcher = d.id;
    const busiest = Object.entries(d.per_endpoint).map(([e, n]) => `${e}: ${n}`).join(", ");
    li.textContent = `${d.id} · ${d.in_flight} / ${d.capacity} in flight` +
      (busiest ? ` (${busiest})` : "");
    return li;
  }));
}

// The server's samples go before what this tab recorded; its clock becomes the tab's.
async function loadHistory(ids) {
  if (!ids.length) return;
  const a = await admin("GET", `/admin/v1/history?endpoints=${ids.map(enc).join(",")}`);
  if (!a.ok) {
    historyLoaded = false; // try again after the next poll
    return;
  }
  const now = clock();
  const wall = Date.now();
  let earliest = firstSample;
  for (const [id, samples] of Object.entries(a.body.endpoints)) {
    const h = history.get(id);
    if (!h) continue;
    const older = samples.map((s) => [now - (wall - s[0]) / 1000, s[1], s[3]])
      .filter(([t]) => t < (h.t[0] ?? now) - 0.5 && t > now - HISTORY_S);
    if (!older.length) continue;
    h.t.unshift(...older.map((s) => s[0]));
    h.depth.unshift(...older.map((s) => s[1]));
    h.done.unshift(...older.map((s) => s[2]));
    earliest = Math.min(earliest, older[0][0]);
  }
  firstSample = earliest;
  renderView();
}

// ---- endpoint actions ----

async function endpointAction(ev) {
  const button = ev.target.closest("button[data-action]");
  if (!button) return;
  const id = button.closest("tr[data-endpoint]").dataset.endpoint;
  const q = latest.find((e) => e.id === id);
  if (button.dataset.action === "pause") {
    const paused = !(q && q.paused);
    const a = await admin("PATCH", `/admin/v1/endpoints/${enc(id)}`, { paused });
    notice(a.ok ? `${id}: ${paused ? "paused (submits are still accepted)" : "resumed"}`
      : `${id}: not changed: ${why(a)}`, !a.ok);
  } else {
    const pending = q ? fmt(q.pending, 0) : "all";
    if (!confirm(`Cancel ${pending} pending tasks of ${id}, and the running ones (their calls ` +
      "are aborted)? Their owners will see them cancelled.")) {
      return;
    }
    const a = await admin("POST", `/admin/v1/endpoints/${enc(id)}/purge`);
    notice(a.ok ? `${id}: ${fmt(a.body.cancelled, 0)} tasks cancelled`
      : `${id}: not purged: ${why(a)}`, !a.ok);
    if (tasksOf === id) loadTasks(false);
  }
  restart(); // show the change now, not at the next poll
}
$("rows").addEventListener("click", endpointAction);

// ---- the task list ----

function openTasks(id) {
  if (tasksOf !== id) {
    tasksOf = id;
    $("task-detail").hidden = true;
    detailId = null;
  }
  $("tasks-panel").hidden = false;
  setText($("tasks-endpoint"), id);
  loadTasks(false);
}

function cell(text) {
  const td = document.createElement("td");
  td.textContent = text ?? "–";
  return td;
}

const when = (iso) => (iso ? new Date(iso).toLocaleTimeString() : "–");

async function loadTasks(more) {
  const id = tasksOf;
  for (const b of $("task-tabs").children) {
    b.setAttribute("aria-selected", String(b.dataset.status === tasksState));
  }
  const cursor = more && tasksCursor ? `&cursor=${enc(tasksCursor)}` : "";
  const a = await admin("GET", `/admin/v1/endpoints/${enc(id)}/tasks?status=${tasksState}` +
    `&limit=${PAGE}${cursor}`);
  if (id !== tasksOf) return; // another endpoint was clicked meanwhile
  if (!a.ok) {
    setText($("tasks-info"), `cannot list the tasks: ${why(a)}`);
    return;
  }
  const rows = a.body.tasks.map((t) => {
    const tr = document.createElement("tr");
    tr.dataset.task = t.task_id;
    const code = document.createElement("code");
    code.textContent = t.task_id;
    const first = document.createElement("td");
    first.appendChild(code);
    tr.append(first, cell(t.user_id), cell(t.priority), cell(t.attempts), cell(when(t.created_at)),
      cell(when(t.ended_at)), cell(t.result_status_code));
    return tr;
  });
  if (more) $("task-rows").append(...rows);
  else $("task-rows").replaceChildren(...rows);
  tasksCursor = a.body.next_cursor;
  $("tasks-more").hidden = !tasksCursor;
  const shown = $("task-rows").children.length;
  const total = a.body.total === null ? "" : ` of ${fmt(a.body.total, 0)}`;
  const db = a.body.database === "unavailable" ? " (database unavailable: Redis's only)" : "";
  setText($("tasks-info"), `${fmt(shown, 0)}${total} ${tasksState} tasks shown` +
    (tasksState === "pending" ? ", next to run first" : "") + db);
}

$("task-tabs").addEventListener("click", (ev) => {
  const b = ev.target.closest("button[data-status]");
  if (!b || !STATES.includes(b.dataset.status)) return;
  tasksState = b.dataset.status;
  loadTasks(false);
});
$("tasks-more").addEventListener("click", () => loadTasks(true));
$("tasks-refresh").addEventListener("click", () => loadTasks(false));
$("tasks-close").addEventListener("click", () => {
  $("tasks-panel").hidden = true;
  tasksOf = null;
});

// ---- one task in full ----

async function showTask(id) {
  detailId = id;
  const a = await admin("GET", `/admin/v1/tasks/${enc(id)}`);
  if (id !== detailId) return;
  $("task-detail").hidden = false;
  setText($("detail-id"), id);
  if (!a.ok) {
    setText($("detail-status"), `cannot show it: ${why(a)}`);
    return;
  }
  const t = a.body;
  setText($("detail-status"), t.task_status);
  const fields = [["user", t.user_id], ["endpoint", t.endpoint], ["type", t.task_type],
    ["attempts", t.attempts], ["created", t.created_at], ["started", t.started_at],
    ["ended", t.ended_at], ["result status", t.result_status_code]];
  $("detail-fields").replaceChildren(...fields.flatMap(([k, v]) => {
    const dt = document.createElement("dt");
    dt.textContent = k;
    const dd = document.createElement("dd");
    dd.textContent = v ?? "–";
    return [dt, dd];
  }));
  setText($("detail-request"), t.request ? JSON.stringify(t.request, null, 2)
    : "no longer held (only the ending is kept once Redis lets a task go)");
  setText($("detail-result"), t.task_result ?? "–");
  // A proxied request is never run again: its answer had one reader, its caller, now gone.
  $("detail-retry").hidden = !["failed", "expired"].includes(t.task_status)
    || t.task_type === "proxy";
  // A running task too: an offline call is aborted, an online task loses its permit.
  $("detail-cancel").hidden = !["pending", "processing"].includes(t.task_status);
}

$("task-rows").addEventListener("click", (ev) => {
  const tr = ev.target.closest("tr[data-task]");
  if (tr) showTask(tr.dataset.task);
});

async function taskAction(action) {
  const id = detailId;
  const a = await admin("POST", `/admin/v1/tasks/${enc(id)}/${action}`);
  notice(a.ok ? `${id}: ${action === "retry" ? "runs again" : "cancelled"}`
    : `${id}: ${action} refused: ${why(a)}`, !a.ok);
  await showTask(id);
  loadTasks(false);
}
$("detail-retry").addEventListener("click", () => taskAction("retry"));
$("detail-cancel").addEventListener("click", () => taskAction("cancel"));

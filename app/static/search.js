// The dashboard's search of every endpoint's tasks (GET /admin/v1/tasks): status tabs across
// endpoints (dead letters first), a box that finds any task by its id or the id's beginning, and
// "retry all shown" (after a confirm) for the failed or expired tasks listed.
// Loaded after actions.js: shares its globals ($, admin, why, notice, enc, cell, when, fmt,
// setText, openTasks, showTask). As elsewhere, data goes into the page only as textContent.
"use strict";

const SEARCH_PAGE = 50;
const FULL_ID = /^[0-9a-f]{32}\.[a-z0-9][a-z0-9_-]{0,63}$/;
const DEAD = ["failed", "expired"];

let searchStatus = "failed";
let searchPrefix = "";
let searchCursor = null;

function searchRow(t) {
  const tr = document.createElement("tr");
  tr.dataset.task = t.task_id;
  tr.dataset.endpoint = t.endpoint;
  const code = document.createElement("code");
  code.textContent = t.task_id;
  const first = document.createElement("td");
  first.appendChild(code);
  tr.append(first, cell(t.endpoint), cell(t.task_status), cell(t.attempts),
    cell(when(t.ended_at)), cell(t.result_status_code), cell(t.last_error));
  return tr;
}

// One page of the search; `more` appends the next page to those shown.
async function loadSearch(more) {
  for (const b of $("search-tabs").children) {
    b.setAttribute("aria-selected", String(!searchPrefix && b.dataset.status === searchStatus));
  }
  // What reads as a whole id is looked up first (it may be pending or running); unknown as a
  // whole, it is the beginning of others (`….d` begins `….dl-api`).
  if (!more && FULL_ID.test(searchPrefix) && await findOne(searchPrefix)) return;
  const params = new URLSearchParams({ limit: String(SEARCH_PAGE) });
  if (searchPrefix) params.set("id", searchPrefix);
  else if (searchStatus) params.set("status", searchStatus);
  if (more && searchCursor) params.set("cursor", searchCursor);
  const a = await admin("GET", `/admin/v1/tasks?${params}`);
  if (!a.ok) {
    setText($("search-info"), `cannot search: ${why(a)}`);
    return;
  }
  const rows = a.body.tasks.map(searchRow);
  if (more) $("search-rows").append(...rows);
  else $("search-rows").replaceChildren(...rows);
  searchCursor = a.body.next_cursor;
  $("search-more").hidden = !searchCursor;
  const shown = $("search-rows").children.length;
  const what = searchPrefix ? `ended tasks whose id begins with ${searchPrefix}`
    : `${searchStatus || "ended"} tasks`;
  const db = a.body.database === "unavailable" ? " (database unavailable: Redis's only)" : "";
  setText($("search-info"), `${fmt(shown, 0)} ${what} shown, newest first` + db);
  $("retry-shown").hidden = !(shown && !searchPrefix && DEAD.includes(searchStatus));
}

// A whole id: the task whatever its state (a pending or running one is in no search); false
// when there is no such task.
async function findOne(id) {
  const a = await admin("GET", `/admin/v1/tasks/${enc(id)}`);
  if (a.status === 404) return false;
  $("search-more").hidden = true;
  $("retry-shown").hidden = true;
  if (!a.ok) {
    $("search-rows").replaceChildren();
    setText($("search-info"), `${id}: ${why(a)}`);
    return true;
  }
  const t = a.body;
  $("search-rows").replaceChildren(searchRow({ ...t, last_error: DEAD.includes(t.task_status)
    ? t.task_result : null }));
  setText($("search-info"), `${t.task_status} task of ${t.endpoint}`);
  return true;
}

// No <form>: the page's policy allows no form submission (form-action 'none').
function find() {
  searchPrefix = $("search-id").value.trim().toLowerCase();
  loadSearch(false);
}
$("search-find").addEventListener("click", find);
$("search-id").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter") find();
});

$("search-tabs").addEventListener("click", (ev) => {
  const b = ev.target.closest("button[data-status]");
  if (!b) return;
  searchStatus = b.dataset.status;
  searchPrefix = "";
  $("search-id").value = "";
  loadSearch(false);
});

$("search-more").addEventListener("click", () => loadSearch(true));

// A row opens its endpoint's task list with the task in full (retry, cancel there).
$("search-rows").addEventListener("click", (ev) => {
  const tr = ev.target.closest("tr[data-task]");
  if (!tr) return;
  openTasks(tr.dataset.endpoint);
  showTask(tr.dataset.task);
});

// Each task shown, one retry each: exactly those the operator saw, not what matches by now.
$("retry-shown").addEventListener("click", async () => {
  const ids = [...$("search-rows").children].map((tr) => tr.dataset.task);
  if (!ids.length || !confirm(`Run the ${ids.length} ${searchStatus} tasks shown again, ` +
    "each with its original request?")) return;
  let retried = 0;
  const refused = new Map();
  for (const id of ids) {
    const a = await admin("POST", `/admin/v1/tasks/${enc(id)}/retry`);
    if (a.ok) retried += 1;
    else refused.set(why(a), (refused.get(why(a)) || 0) + 1);
  }
  const left = [...refused].map(([reason, n]) => `${n} not: ${reason}`).join("; ");
  notice(`${retried} of ${ids.length} tasks run again` + (left ? `; ${left}` : ""),
    refused.size > 0);
  loadSearch(false);
});

// The first list once the page has its token and its first poll is in (actions.js).
let searchLoaded = false;
function searchAfterPoll() {
  if (searchLoaded) return;
  searchLoaded = true;
  loadSearch(false);
}

// The dashboard's charts: the chart panel of one endpoint (depth on the left axis, throughput
// on the right, time below) and the depth sparkline of each row, drawn as plain SVG.
// Loaded before app.js; both are classic scripts, so these functions and app.js's constants
// (history, NS, GAP_S, ...) share one global scope, and nothing here runs before app.js has
// loaded (it is called from its polling).
// ---- charts ----

// The charted endpoint: the one clicked, else the busiest listed, kept until another has more
// than twice its load, so the chart does not flip between two similar queues every second.
function charted(rows) {
  if (pinned && history.has(pinned)) return pinned;
  pinned = null;
  const top = rows[0];
  const current = rows.find((q) => q.id === followed);
  if (!current || (top && load(top) > 2 * load(current))) followed = top ? top.id : null;
  return followed;
}

function svgEl(name, attrs) {
  const el = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  return el;
}

function label(x, y, text, cls, anchor) {
  const el = svgEl("text", { x, y, class: cls, "text-anchor": anchor });
  el.textContent = text;
  return el;
}

// An SVG path through samples (null values skipped): one point per pixel column, the
// highest, so a spike stays visible; a new segment after a hole in the samples.
function linePath(ts, vs, x, y) {
  const pts = []; // [column, value, starts a segment]
  let prev = -Infinity;
  for (let i = 0; i < ts.length; i++) {
    if (vs[i] === null) {
      prev = -Infinity;
      continue;
    }
    const col = Math.round(x(ts[i]));
    const move = ts[i] - prev > GAP_S;
    prev = ts[i];
    const last = pts[pts.length - 1];
    if (!move && last && last[0] === col) last[1] = Math.max(last[1], vs[i]);
    else pts.push([col, vs[i], move]);
  }
  // A lone point becomes a zero-length segment, which the round line cap shows as a dot.
  return pts.map(([c, v, move], i) => `${move ? "M" : "L"}${c},${y(v).toFixed(1)}` +
    (move && !(pts[i + 1] && !pts[i + 1][2]) ? "l0,0" : "")).join("");
}

// The axis maximum: the next of 1, 1.5, 2, 2.5, 3, 4, 5, 6, 8 x 10^k, so labels read easily.
function niceCeil(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  return [1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10].find((m) => m * p >= v * 0.9999) * p;
}

const maxOf = (vs) => vs.reduce((m, v) => (v !== null && v > m ? v : m), 0);

// Seconds before now that get a time label ("now", -30s, -1m ...): at most about six.
function timeTicks(span) {
  const step = [1, 2, 5, 10, 15, 30, 60, 120, 300].find((s) => span / s <= 6) || 300;
  const ticks = [];
  for (let a = 0; a <= span + 0.001; a += step) {
    const m = Math.floor(a / 60);
    const s = a % 60;
    ticks.push([a, a === 0 ? "now" : `-${m ? `${m}m` : ""}${s || !m ? `${s}s` : ""}`]);
  }
  return ticks;
}

function sparkline(td, h, t, span) {
  if (!td.firstChild) {
    const svg = svgEl("svg", { class: "chart", viewBox: `0 0 ${SPARK_W} ${SPARK_H}`,
      "aria-hidden": "true" });
    svg.appendChild(svgEl("path", { class: "depth" }));
    const peak = document.createElement("span");
    peak.className = "peak";
    td.append(svg, peak);
  }
  const peak = maxOf(h.depth);
  const x = (s) => SPARK_W - ((t - s) / span) * SPARK_W;
  const y = (v) => SPARK_H - 1 - (v / Math.max(1, peak)) * (SPARK_H - 2);
  td.firstChild.firstChild.setAttribute("d", linePath(h.t, h.depth, x, y));
  setText(td.lastChild, `max ${fmt(peak, 0)}`);
}

function drawChart(id, t, span) {
  const h = id === null ? undefined : history.get(id);
  $("chart-panel").hidden = !h;
  if (!h) return;
  const svg = $("chart");
  const tput = throughput(h);
  if (!chartWidth) chartWidth = $("chart-panel").clientWidth; // once, before the observer's
  const W = Math.max(360, Math.round(chartWidth)); // CSS pixels: the labels keep their size
  const H = 230;
  const box = { L: 56, R: W - 64, T: 24, B: H - 26 }; // the plot; the labels sit outside it
  const dMax = niceCeil(maxOf(h.depth));
  const tMax = niceCeil(maxOf(tput));
  const x = (s) => box.R - ((t - s) / span) * (box.R - box.L);
  const y = (max) => (v) => box.B - (v / max) * (box.B - box.T);
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("width", W);
  svg.setAttribute("height", H);
  svg.setAttribute("aria-label", `${id}: depth up to ${dMax}, throughput up to ${tMax}/s, ` +
    `last ${Math.round(span)} s`);
  // ~30 nodes a second: cheaper to rebuild than to keep in sync.
  svg.replaceChildren(...axes(box, dMax, tMax, span, x, t),
    svgEl("path", { class: "depth", d: linePath(h.t, h.depth, x, y(dMax)) }),
    svgEl("path", { class: "tput", d: linePath(h.t, tput, x, y(tMax)) }));
  const q = latest.find((e) => e.id === id);
  const nowTput = tput[tput.length - 1];
  setText($("chart-title"), id);
  setText($("chart-mode"), pinned ? "(selected)" : "(busiest)");
  setText($("legend-depth"), fmt(q ? q.pending : h.depth[h.depth.length - 1], 0));
  setText($("legend-tput"), nowTput === null ? "–" : `${fmt(nowTput, 2)}/s`);
  $("follow").hidden = !pinned;
}

// Grid, depth labels on the left, throughput labels on the right (the top ones classed
// "max"), and the time labels below.
function axes(box, dMax, tMax, span, x, t) {
  const { L, R, T, B } = box;
  const nodes = [
    label(L - 8, 12, "depth", "axis-title depth", "end"),
    label(R + 8, 12, "done /s", "axis-title tput", "start"),
  ];
  for (const f of [0, 0.5, 1]) {
    const y = B - f * (B - T);
    const cls = f === 1 ? " max" : "";
    nodes.push(svgEl("line", { class: "grid", x1: L, x2: R, y1: y, y2: y }),
      label(L - 8, y + 4, fmt(f * dMax, 1), `axis depth${cls}`, "end"),
      label(R + 8, y + 4, fmt(f * tMax, 2), `axis tput${cls}`, "start"));
  }
  for (const [ago, text] of timeTicks(span)) {
    const tx = x(t - ago);
    nodes.push(svgEl("line", { class: "grid", x1: tx, x2: tx, y1: T, y2: B }),
      label(tx, B + 18, text, "axis time", "middle"));
  }
  return nodes;
}

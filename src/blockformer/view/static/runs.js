// The runs page: the table of runs, their curves overlaid (polled for new lines while a
// run trains), and the config of one run or the difference of two.
"use strict";

const POLL_MS = 2000;
const DEFAULT_SHOWN = 5;  // the most recently written runs shown at first
const state = {runs: [], shown: new Set(), metrics: {}, cursors: {}, warnings: {}};
window.viewState = state;

const CHARTS = [  // [div, title, y axis, [[split, key, label]...], log y]
  ["chart-loss", "loss", "nats / token", [["train", "loss", "train"], ["val", "val_loss", "val"]], false],
  ["chart-lr", "learning rate", "lr", [["train", "lr", "lr"]], false],
  ["chart-throughput", "throughput", "tokens / s", [["train", "tokens_per_s", "tokens/s"]], false],
];

async function loadRuns() {
  const listing = STATIC ? STATIC.runs : await api("api/runs");
  document.getElementById("root").textContent = `runs folder: ${listing.root}`;
  state.message = listing.message;
  state.runs = listing.runs;
  if (!state.shown.size) {
    const recent = [...state.runs].sort((a, b) => (b.modified || 0) - (a.modified || 0));
    recent.slice(0, DEFAULT_SHOWN).forEach(r => state.shown.add(r.name));
  }
  drawTable();
  fillDiffSelects();
}

function drawTable() {
  const body = document.querySelector("#runs tbody");
  body.textContent = "";
  for (const run of state.runs) {
    const t = run.last_train || {}, v = run.last_val || {};
    const m = run.model || {};
    const tr = document.createElement("tr");
    tr.dataset.run = run.name;
    const model = m.arch ? `${m.arch} ${m.n_layers}×${m.d_model}, ${m.n_heads} heads, ${m.position}` : "";
    const step = t.step !== undefined ? t.step : v.step;
    const cells = [run.name + (run.live ? " ● live" : ""), model,
      step === undefined ? "" : `${step}${run.steps ? " / " + run.steps : ""}`,
      fmt(t.loss), fmt(v.val_loss), fmt(t.lr, 3), fmt(t.tokens_per_s, 3), run.checkpoints.join(", ")];
    const box = document.createElement("input");
    box.type = "checkbox";
    box.checked = state.shown.has(run.name);
    box.onchange = () => { box.checked ? state.shown.add(run.name) : state.shown.delete(run.name); refresh(); };
    const first = document.createElement("td");
    first.appendChild(box);
    tr.appendChild(first);
    cells.forEach((text, i) => {
      const td = document.createElement("td");
      td.textContent = text;
      if (i === 0 && run.live) td.className = "live";
      tr.appendChild(td);
    });
    if (run.problem) tr.title = run.problem;
    body.appendChild(tr);
  }
}

// New lines of one run's metrics.jsonl since its cursor, appended to its columns.
async function pull(name) {
  if (STATIC) { state.metrics[name] = STATIC.metrics[name] || {}; return false; }
  const answer = await api(`api/metrics?run=${encodeURIComponent(name)}&cursor=${encodeURIComponent(state.cursors[name] || "")}`);
  if (answer.reset || !state.metrics[name]) state.metrics[name] = {};
  state.cursors[name] = answer.cursor;
  state.warnings[name] = answer.warnings;
  let added = false;
  for (const [split, columns] of Object.entries(answer.columns)) {
    const have = state.metrics[name][split] = state.metrics[name][split] || {};
    const length = have.step ? have.step.length : 0;
    for (const key of new Set([...Object.keys(have), ...Object.keys(columns)])) {
      const extra = columns[key] || new Array(columns.step.length).fill(null);
      have[key] = (have[key] || new Array(length).fill(null)).concat(extra);
    }
    added = added || columns.step && columns.step.length > 0;
  }
  return added || answer.reset || answer.more;
}

function drawCharts() {
  for (const [div, title, yTitle, series] of CHARTS) {
    const traces = [];
    for (const name of state.shown) {
      const runMetrics = state.metrics[name] || {};
      for (const [split, key, label] of series) {
        const cols = runMetrics[split];
        if (!cols || !cols[key]) continue;
        traces.push({x: cols.step, y: cols[key], name: `${name} ${label}`, mode: "lines",
          meta: {run: name, split, key}, line: split === "val" ? {dash: "dot"} : {}});
      }
    }
    Plotly.react(div, traces, {title: {text: title}, margin: {t: 40, r: 10, b: 40, l: 60},
      xaxis: {title: {text: "step"}}, yaxis: {title: {text: yTitle}}, legend: {font: {size: 10}}},
      {displaylogo: false, responsive: true});
  }
}

function showMessages() {
  say(state.message || "", "info");
  for (const name of state.shown) for (const w of state.warnings[name] || []) say(`${name}: ${w}`, "warn", true);
}

// Pull what is new for the runs shown; redraw when something changed (or the selection did).
async function refresh(redraw = true) {
  if (state.busy) { state.again = state.again || redraw; return; }  // one poll at a time: cursors stay in order
  state.busy = true;
  try {
    let changed = redraw;
    for (const name of state.shown) changed = (await pull(name)) || changed;
    if (changed) drawCharts();
    showMessages();
  } catch (e) { say(e.message); }
  state.busy = false;
  if (state.again) { state.again = false; refresh(true); }
}

function fillDiffSelects() {
  for (const [id, index] of [["diff-a", 0], ["diff-b", 1]]) {
    const select = document.getElementById(id);
    const keep = select.value;
    select.textContent = "";
    state.runs.forEach(r => select.add(new Option(r.name, r.name)));
    select.value = keep || (state.runs[Math.min(index, state.runs.length - 1)] || {}).name || "";
    select.onchange = showConfig;
  }
  showConfig();
}

async function showConfig() {
  const a = document.getElementById("diff-a").value, b = document.getElementById("diff-b").value;
  const out = document.getElementById("diff"), pre = document.getElementById("config");
  out.textContent = pre.textContent = "";
  if (!a) return;
  try {
    const config = STATIC ? {config: STATIC.configs[a]} : await api(`api/config?run=${encodeURIComponent(a)}`);
    pre.textContent = config.text ? `# ${a}/config.toml\n${config.text}` :
      config.config ? `# ${a}\n` + JSON.stringify(config.config, null, 1) : (config.problem || "");
    if (!b || a === b) return;
    const diff = STATIC ? {diff: STATIC.diffs[`${a}\n${b}`]} :
      await api(`api/diff?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`);
    const table = document.createElement("table");
    table.innerHTML = "<thead><tr><th>key</th><th></th><th></th></tr></thead>";
    table.tHead.rows[0].cells[1].textContent = a;
    table.tHead.rows[0].cells[2].textContent = b;
    for (const row of diff.diff || []) {
      const tr = table.insertRow();
      tr.insertCell().textContent = row.key;
      for (const v of [row.a, row.b]) tr.insertCell().textContent = v === null ? "—" : JSON.stringify(v);
    }
    if (!diff.diff) out.textContent = "this export holds the config diffs of its first 25 runs only";
    else if (!diff.diff.length) out.textContent = `${a} and ${b} have the same config`;
    else out.appendChild(table);
  } catch (e) { say(e.message, "error", true); }
}

async function start() {
  header("runs");
  try { await loadRuns(); } catch (e) { say(e.message); }
  await refresh();
  if (STATIC) return;
  document.getElementById("live-note").textContent = `(new lines every ${POLL_MS / 1000} s)`;
  setInterval(() => refresh(false), POLL_MS);
  setInterval(async () => { try { await loadRuns(); } catch (e) { say(e.message); } }, 5 * POLL_MS);
}

start();

// The probes page: pick a probe, set its options (its `run` parameters), see its tables and plot.
"use strict";

const state = {probes: [], result: null, done: false};
window.viewState = state;

async function start() {
  header("probes");
  document.getElementById("form").onsubmit = e => { e.preventDefault(); run(); };
  const select = document.getElementById("probe");
  try { state.probes = await api("api/probes"); } catch (e) { say(e.message); return; }
  state.probes.forEach(p => select.add(new Option(p.name, p.name)));
  select.onchange = showOptions;
  const params = new URLSearchParams(window.location.search);
  if (params.has("probe")) select.value = params.get("probe");
  showOptions();
  for (const [key, value] of params) {
    const input = document.getElementById(`option-${key}`);
    if (input) input.type === "checkbox" ? input.checked = value === "true" : input.value = value;
  }
}

function showOptions() {
  const probe = state.probes.find(p => p.name === document.getElementById("probe").value);
  document.getElementById("claim").textContent = probe.claim;
  const box = document.getElementById("options");
  box.textContent = "";
  for (const o of probe.options) {
    const label = document.createElement("label");
    label.textContent = o.name;
    const input = document.createElement("input");
    input.id = `option-${o.name}`;
    if (o.type === "bool") { input.type = "checkbox"; input.checked = o.default; }
    else { input.type = o.type === "str" ? "text" : "number"; input.value = o.default === null ? "" : o.default;
      if (o.type === "float") input.step = "any"; }
    label.appendChild(input);
    box.appendChild(label);
  }
}

async function run() {
  say("");
  state.done = false;
  const name = document.getElementById("probe").value;
  const probe = state.probes.find(p => p.name === name);
  const options = {};
  for (const o of probe.options) {
    const input = document.getElementById(`option-${o.name}`);
    const value = o.type === "bool" ? input.checked : input.value;
    if (value !== (o.default === null ? "" : o.default) && String(value) !== String(o.default)) options[o.name] = value;
  }
  const out = document.getElementById("result");
  out.textContent = "running…";
  document.getElementById("go").disabled = true;
  try {
    state.result = await api("api/probe", {name, options});
    draw(state.result);
  } catch (e) { say(e.message); out.textContent = ""; }
  document.getElementById("go").disabled = false;
  state.done = true;
}

function table(columns, rows) {
  const t = document.createElement("table");
  const head = t.createTHead().insertRow();
  columns.forEach(c => { const th = document.createElement("th"); th.textContent = c; head.appendChild(th); });
  const body = t.createTBody();
  rows.forEach(r => { const tr = body.insertRow(); r.forEach(v => { tr.insertCell().textContent = fmt(v); }); });
  return t;
}

function draw(result) {
  const out = document.getElementById("result");
  out.textContent = "";
  const h = document.createElement("h3");
  h.textContent = `probe ${result.probe}: ${result.claim}`;
  out.appendChild(h);
  out.appendChild(table(result.columns, result.rows));
  for (const more of result.more_tables) {
    const p = document.createElement("h4");
    p.textContent = more.title;
    out.appendChild(p);
    out.appendChild(table(more.columns, more.rows));
  }
  for (const note of result.notes) {
    const p = document.createElement("p");
    p.className = "muted";
    p.textContent = note;
    out.appendChild(p);
  }
  if (result.plot) {
    const img = document.createElement("img");
    img.src = result.plot;
    img.style.maxWidth = "100%";
    out.appendChild(img);
  }
}

start();

// The attention page: a checkpoint and a text in, every attention module's weights out,
// drawn as a head view (lines between tokens, as bertviz does) and a heat map per head.
"use strict";

const state = {answer: null};
window.viewState = state;
const KIND = {
  causal: "causal self-attention: each query sees itself and the keys before it (above the diagonal is masked)",
  bidirectional: "self-attention, bidirectional: each query sees every key",
  cross: "cross-attention: the decoder's queries (target) read the encoder's output (source keys)",
};
const MAX_HEATMAPS = 96;  // past this only the chosen module's heads are drawn
const MAX_LINES = 20000;  // the head view draws at most this many lines, the strongest

async function start() {
  header("attention");
  const select = document.getElementById("checkpoint");
  select.onchange = showTarget;
  document.getElementById("form").onsubmit = e => { e.preventDefault(); show(); };
  if (STATIC) {
    document.getElementById("show").disabled = true;
    document.getElementById("text").value = STATIC.text || "";
    document.getElementById("target").value = STATIC.target || "";
  }
  try { await fillCheckpoints(select); } catch (e) { say(e.message); return; }
  const asked = STATIC ? new URLSearchParams() : fromURL(["checkpoint", "text", "target"]);
  if (STATIC) {
    select.value = STATIC.checkpoint || select.value;
    showTarget();
    if (STATIC.message) say(STATIC.message);
    if (STATIC.attention) draw(STATIC.attention);
    return;
  }
  showTarget();
  if (select.value && (asked.has("text") || !asked.has("checkpoint"))) show();
}

function showTarget() {
  const option = document.getElementById("checkpoint").selectedOptions[0];
  const seq2seq = option && option.dataset.arch === "encoder-decoder";
  document.getElementById("target-box").hidden = !seq2seq;
  document.getElementById("text-label").textContent = seq2seq ? "source" : "text";
}

async function show() {
  say("");
  const body = {checkpoint: document.getElementById("checkpoint").value,
    text: document.getElementById("text").value, target: document.getElementById("target").value};
  try {
    draw(await api("api/attention", body));
  } catch (e) {
    say(e.message);
    document.getElementById("result").hidden = true;
  }
}

function draw(answer) {
  state.answer = answer;
  document.getElementById("result").hidden = false;
  const modules = document.getElementById("module"), heads = document.getElementById("head");
  modules.textContent = heads.textContent = "";
  answer.layers.forEach((l, i) => modules.add(new Option(`${l.module} (${l.kind})`, i)));
  heads.add(new Option("all heads", "all"));
  for (let h = 0; h < answer.n_heads; h++) heads.add(new Option(`head ${h}`, h));
  modules.onchange = heads.onchange = () => { headView(); if (tooMany()) heatmaps(); };
  const bad = answer.layers.filter(l => l.reproduction_error > 1e-3);
  if (bad.length) say(`the weights shown rebuild ${bad[0].module}'s output only to ${bad[0].reproduction_error.toExponential(1)}`, "warn");
  headView();
  heatmaps();
}

const tooMany = () => state.answer.layers.length * state.answer.n_heads > MAX_HEATMAPS;
const HEAD_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
  "#bcbd22", "#17becf"];

// bertviz's head view: queries in a column on the left, keys on the right, one line per
// (query, key) pair with opacity = weight; hovering a token keeps only its lines.
function headView() {
  const layer = state.answer.layers[+document.getElementById("module").value];
  const choice = document.getElementById("head").value;
  const heads = choice === "all" ? layer.weights.map((_, h) => h) : [+choice];
  document.getElementById("kind").textContent = KIND[layer.kind];
  const svg = document.getElementById("headview");
  const rowH = 18, top = 20, left = 150, right = 370;
  const rows = Math.max(layer.queries.length, layer.keys.length);
  svg.setAttribute("height", top + rows * rowH + 10);
  svg.textContent = "";
  const ns = "http://www.w3.org/2000/svg";
  const el = (name, attrs, text) => {
    const e = document.createElementNS(ns, name);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.appendChild(e);
    return e;
  };
  el("text", {x: left - 8, y: 12, "text-anchor": "end", fill: "#777"}, "queries");
  el("text", {x: right + 8, y: 12, fill: "#777"}, "keys");
  let top1 = 0;  // line opacity is relative to the largest weight shown
  for (const h of heads) for (const row of layer.weights[h]) for (const w of row) top1 = Math.max(top1, w);
  let pairs = [];
  for (const h of heads) layer.weights[h].forEach((row, q) => row.forEach((w, k) => {
    if (w / top1 >= 0.02) pairs.push([h, q, k, w / top1]);
  }));
  if (pairs.length > MAX_LINES) pairs = pairs.sort((a, b) => b[3] - a[3]).slice(0, MAX_LINES);  // the strongest
  const lines = pairs.map(([h, q, k, r]) => {
    const line = el("line", {x1: left, y1: top + q * rowH + rowH / 2, x2: right, y2: top + k * rowH + rowH / 2,
      stroke: HEAD_COLOURS[h % HEAD_COLOURS.length], "stroke-width": 0.5 + 2.5 * r, "stroke-opacity": r});
    line.dataset.q = q; line.dataset.k = k;
    return line;
  });
  const focus = (side, i) => lines.forEach(l => { l.style.display = i === null || +l.dataset[side] === i ? "" : "none"; });
  layer.queries.forEach((t, q) => {
    const e = el("text", {x: left - 8, y: top + q * rowH + 13, "text-anchor": "end"}, label(t));
    e.onmouseenter = () => focus("q", q); e.onmouseleave = () => focus("q", null);
  });
  layer.keys.forEach((t, k) => {
    const e = el("text", {x: right + 8, y: top + k * rowH + 13}, label(t));
    e.onmouseenter = () => focus("k", k); e.onmouseleave = () => focus("k", null);
  });
}

// A token as a label: spaces and newlines made visible.
function label(token) {
  return token.replace(/ /g, "␣").replace(/\n/g, "⏎").replace(/\t/g, "⇥");
}

// One heat map per module (rows) and head (columns); a masked cell (weight exactly 0 where
// the module cannot look: above the diagonal of a causal module) is left empty (grey).
function heatmaps() {
  const box = document.getElementById("heatmaps");
  box.textContent = "";
  const answer = state.answer;
  const chosen = +document.getElementById("module").value;
  const layers = answer.layers.map((l, i) => [l, i]).filter(([, i]) => !tooMany() || i === chosen);
  box.className = "heatmaps";
  box.style.gridTemplateColumns = `repeat(${answer.n_heads}, 232px)`;
  for (const [layer, i] of layers) {
    layer.weights.forEach((w, h) => {
      const div = document.createElement("div");
      div.className = "heatmap";
      div.id = `heatmap-${i}-${h}`;
      box.appendChild(div);
      const z = w.map((row, q) => row.map((v, k) => layer.kind === "causal" && k > q ? null : v));
      Plotly.newPlot(div, [{type: "heatmap", z, x: layer.keys.map((t, k) => `${k}:${label(t)}`),
        y: layer.queries.map((t, q) => `${q}:${label(t)}`), zmin: 0, colorscale: "Viridis",
        showscale: false, hovertemplate: "query %{y}<br>key %{x}<br>weight %{z:.4f}<extra></extra>"}],
        {title: {text: `${layer.module.replace(/\.attn$/, "")} h${h}`, font: {size: 11}},
          margin: {t: 24, r: 4, b: 4, l: 4}, xaxis: {visible: false}, yaxis: {visible: false, autorange: "reversed"},
          plot_bgcolor: "#d8d8d8"},
        {displayModeBar: false, staticPlot: false});
    });
  }
}

start();

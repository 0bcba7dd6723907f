// The server page: a running `blockformer serve`'s queue, running batch, KV blocks,
// tokens/s and latency percentiles, read from its /metrics (through the view) every 2 s.
"use strict";

const POLL_MS = 2000;
const state = {status: null, times: [], series: {}, errors: 0};
window.viewState = state;
const GAUGES = [["requests_waiting", "requests waiting"], ["requests_running", "requests running"],
  ["kv_blocks_used", "KV blocks used"], ["kv_blocks_total", "KV blocks in the pool"],
  ["prefix_cache_hit_rate", "prefix-cache hit rate"], ["generation_tokens_per_second", "tokens / s (since the last read)"]];
const LATENCY = [["time_to_first_token_seconds", "time to first token"],
  ["time_per_output_token_seconds", "time per output token"], ["e2e_request_latency_seconds", "request, end to end"]];

async function poll() {
  let status;
  try {
    status = await api("api/server");
  } catch (e) {
    say(e.message);
    state.errors += 1;
    return;
  }
  say("");
  state.status = status;
  document.getElementById("about").textContent =
    `server ${status.url}, model ${status.model || "?"}, ${status.requests_finished} requests finished`;
  const body = document.querySelector("#gauges tbody");
  body.textContent = "";
  for (const [key, name] of GAUGES) {
    const tr = body.insertRow();
    tr.insertCell().textContent = name;
    tr.insertCell().textContent = fmt(status.gauges[key], 3);
  }
  const lat = document.querySelector("#latency tbody");
  lat.textContent = "";
  for (const [key, name] of LATENCY) {
    const h = status.latency[key], tr = lat.insertRow();
    tr.insertCell().textContent = name;
    tr.insertCell().textContent = fmt(h.count);
    for (const p of ["p50", "p90", "p99"]) tr.insertCell().textContent = h[p] === null ? "" : `${fmt(h[p] * 1000, 3)} ms`;
  }
  state.times.push(new Date());
  for (const [key] of GAUGES) (state.series[key] = state.series[key] || []).push(status.gauges[key]);
  draw();
}

function draw() {
  const line = (key, name) => ({x: state.times, y: state.series[key], name, mode: "lines"});
  const layout = title => ({title: {text: title}, margin: {t: 40, r: 10, b: 40, l: 50}, legend: {font: {size: 10}}});
  Plotly.react("chart-throughput", [line("generation_tokens_per_second", "tokens / s")], layout("generation"),
    {displaylogo: false});
  Plotly.react("chart-queue", [line("requests_waiting", "waiting"), line("requests_running", "running"),
    line("kv_blocks_used", "KV blocks used")], layout("queue and KV blocks"), {displaylogo: false});
}

header("server");
poll();
setInterval(poll, POLL_MS);

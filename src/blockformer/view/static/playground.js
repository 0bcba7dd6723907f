// The playground: a prompt and sampling settings in, the continuation streamed token by
// token from `generate`, each token coloured by its probability under the model.
"use strict";

const state = {tokens: [], done: false};
window.viewState = state;
const FIELDS = ["max_new_tokens", "temperature", "top_k", "top_p", "seed"];

async function start() {
  header("playground");
  document.getElementById("form").onsubmit = e => { e.preventDefault(); run(); };
  const via = document.getElementById("via");
  via.onchange = () => { document.getElementById("checkpoint").disabled = via.value === "server"; };
  try {
    const info = await api("api/info");
    if (info.server) via.add(new Option(`the server at ${info.server}`, "server"));
    await fillCheckpoints(document.getElementById("checkpoint"), c => c.arch === "decoder");
  } catch (e) { say(e.message); }
  fromURL(["via", "checkpoint", "prompt", ...FIELDS]);
  via.onchange();
}

function colour(prob) {
  return prob === null ? "#eee" : `hsl(${Math.round(120 * prob)}, 75%, 80%)`;
}

async function run() {
  say("");
  state.tokens = []; state.done = false;
  const out = document.getElementById("output");
  out.textContent = "";
  const body = {checkpoint: document.getElementById("checkpoint").value,
    prompt: document.getElementById("prompt").value, via: document.getElementById("via").value};
  for (const f of FIELDS) body[f] = document.getElementById(f).value;
  const prompt = document.createElement("span");
  prompt.textContent = body.prompt;
  prompt.style.fontWeight = "bold";
  out.appendChild(prompt);
  document.getElementById("go").disabled = true;
  try {
    await stream("api/generate", body, item => {
      if (item.error) { say(`generation stopped: ${item.error}`); return; }
      state.tokens.push(item);
      const span = document.createElement("span");
      span.textContent = item.token;
      span.style.background = colour(item.prob);
      span.title = item.prob === null ? "" : `p = ${item.prob.toFixed(4)}`;
      out.appendChild(span);
    });
  } catch (e) { say(e.message); }
  state.done = true;
  document.getElementById("go").disabled = false;
}

// POST body, then call onItem with each JSON line of the answer as it arrives.
async function stream(path, body, onItem) {
  let response;
  try {
    response = await fetch(path, {method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify(body)});
  } catch (e) { throw new Error("the view's server does not answer (stopped?); start `blockformer view` again"); }
  if (!response.ok) {
    let data = null;
    try { data = await response.json(); } catch (e) { /* not JSON */ }
    throw new Error((data && data.error) || `${path}: HTTP ${response.status}`);
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    let chunk;
    try { chunk = await reader.read(); } catch (e) { throw new Error("the stream was cut (the server stopped?)"); }
    if (chunk.done) break;
    buffer += decoder.decode(chunk.value, {stream: true});
    const lines = buffer.split("\n");
    buffer = lines.pop();
    for (const line of lines) if (line.trim()) onItem(JSON.parse(line));
  }
}

start();

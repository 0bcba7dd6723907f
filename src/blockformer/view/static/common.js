// blockformer view: what every page shares. In a static export (file://) the data is
// inlined as window.BLOCKFORMER_STATIC and nothing is fetched.
"use strict";

const STATIC = window.BLOCKFORMER_STATIC || null;

// GET (body undefined) or POST JSON; resolves to the parsed answer, rejects with a one-line message.
async function api(path, body) {
  let response;
  try {
    response = await fetch(path, body === undefined ? {} :
      {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
  } catch (e) {
    throw new Error("the view's server does not answer (stopped?); start `blockformer view` again");
  }
  let data = null;
  try { data = await response.json(); } catch (e) { /* not JSON */ }
  if (!response.ok) throw new Error((data && data.error) || `${path}: HTTP ${response.status}`);
  return data;
}

// Show one message (kind: error, warn, info) in #message; several with keep=true.
function say(text, kind = "error", keep = false) {
  const box = document.getElementById("message");
  if (!keep) box.textContent = "";
  if (!text) return;
  const div = document.createElement("div");
  div.className = `msg ${kind}`;
  div.textContent = text;
  box.appendChild(div);
}

// The header: links to the pages, the static export's files where it is one.
function header(here) {
  const pages = STATIC ? [["runs", "index.html"], ["attention", "attention.html"]] :
    [["runs", "./"], ["attention", "attention"], ["next token", "next"], ["playground", "playground"],
     ["probes", "probes"], ["server", "server"]];
  const bar = document.createElement("header");
  bar.innerHTML = "<b>blockformer view</b>";
  for (const [name, href] of pages) {
    const a = document.createElement("a");
    a.textContent = name;
    a.href = href;
    if (name === here) a.className = "here";
    bar.appendChild(a);
  }
  document.body.prepend(bar);
}

// Fill a <select> with checkpoint names; keeps the current choice when it is still there.
async function fillCheckpoints(select, wanted) {
  const list = STATIC ? STATIC.checkpoints : await api("api/checkpoints");
  const keep = select.value;
  select.textContent = "";
  for (const c of list.filter(c => !wanted || wanted(c))) {
    const option = document.createElement("option");
    option.value = c.name;
    option.textContent = c.arch ? `${c.name} (${c.arch})` : c.name;
    option.dataset.arch = c.arch || "";
    select.appendChild(option);
  }
  if ([...select.options].some(o => o.value === keep)) select.value = keep;
  if (!select.options.length) say("no checkpoints under the runs folder yet: train a run first", "info");
  return list;
}

// Fill the form fields named in the page's URL (?checkpoint=...&text=...): a link shows what it names.
function fromURL(ids) {
  const params = new URLSearchParams(window.location.search);
  for (const id of ids) if (params.has(id)) document.getElementById(id).value = params.get(id);
  return params;
}

function fmt(x, digits = 4) {
  if (x === null || x === undefined) return "";
  if (typeof x !== "number") return String(x);
  return Math.abs(x) >= 1e4 ? x.toExponential(3) : +x.toPrecision(digits) + "";
}

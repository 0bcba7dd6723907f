// The next-token page: per position, the model's top-k next tokens and their probabilities.
"use strict";

const state = {answer: null};
window.viewState = state;

async function start() {
  header("next token");
  document.getElementById("form").onsubmit = e => { e.preventDefault(); show(); };
  try {
    await fillCheckpoints(document.getElementById("checkpoint"), c => c.arch === "decoder");
  } catch (e) { say(e.message); return; }
  const asked = fromURL(["checkpoint", "text", "k"]);
  if (document.getElementById("checkpoint").value && (asked.has("text") || !asked.has("checkpoint"))) show();
}

async function show() {
  say("");
  const body = {checkpoint: document.getElementById("checkpoint").value,
    text: document.getElementById("text").value, k: +document.getElementById("k").value};
  const tbody = document.querySelector("#next tbody");
  try {
    state.answer = await api("api/next", body);
  } catch (e) { say(e.message); tbody.textContent = ""; return; }
  tbody.textContent = "";
  state.answer.positions.forEach((p, t) => {
    const tr = tbody.insertRow();
    tr.insertCell().textContent = t;
    tr.insertCell().textContent = JSON.stringify(p.token);
    tr.insertCell().textContent = p.next_actual === null ? "" : fmt(p.next_actual, 3);
    const cell = tr.insertCell();
    const following = state.answer.positions[t + 1];
    for (const c of p.top) {
      const span = document.createElement("span");
      span.style.marginRight = "12px";
      const bar = document.createElement("span");
      bar.className = "bar";
      bar.style.width = `${Math.round(60 * c.prob)}px`;
      span.appendChild(bar);
      span.appendChild(document.createTextNode(`${JSON.stringify(c.token)} ${fmt(c.prob, 3)}`));
      if (following && c.token === following.token) span.className = "actual";
      cell.appendChild(span);
    }
  });
}

start();

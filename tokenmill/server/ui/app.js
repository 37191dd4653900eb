// tokenmill's web page: a chat playground on /v1/chat/completions (playground.js) and a dashboard of
// /ui/stats, the server's own metrics as ready numbers (dashboard.js). Plain browser JavaScript without
// a build step or third-party code; the charts are drawn on <canvas>. This file: what both views share
// (the API key, the status line, switching views) and the start.
"use strict";

const $ = (id) => document.getElementById(id);

// ---- the API key --------------------------------------------------------------------------------
// Asked for when a data route answers 401, kept in sessionStorage (this tab only, gone when it closes)
// and sent as a Bearer header like any client's; never a cookie, so no other site can make the browser
// send it. The curl shown on the page names $TOKENMILL_API_KEY instead of the key.

const KEY = "tokenmill-api-key";
const apiKey = () => sessionStorage.getItem(KEY) || "";
let waitingForKey = false;

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (apiKey()) headers.Authorization = `Bearer ${apiKey()}`;
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) askForKey(apiKey() ? "the API key was refused" : "this server needs an API key");
  return response;
}

function askForKey(why) {
  waitingForKey = true;
  $("key-form").hidden = false;
  setStatus(why, true);
  $("key-input").focus();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("key-input").value.trim());
  $("key-input").value = "";
  $("key-form").hidden = true;
  waitingForKey = false;
  setStatus("");
  loadModels();
  restartPolling();
});

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return `HTTP ${response.status}`;
  }
}

function setStatus(text, bad = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error-text", bad);
}

// ---- views ----------------------------------------------------------------------------------------

function show(view) {
  for (const section of document.querySelectorAll(".view")) section.hidden = section.id !== view;
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.view === view);
  history.replaceState(null, "", `#${view}`);
  if (view === "dashboard") drawCharts();
}

for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => show(tab.dataset.view));

// every deferred script (playground.js, dashboard.js) has run by now
document.addEventListener("DOMContentLoaded", () => {
  buildDashboard();
  show(location.hash === "#dashboard" ? "dashboard" : "playground");
  loadModels();
  restartPolling();
});

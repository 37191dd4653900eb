// The chat playground: settings, a conversation streamed from /v1/chat/completions, the request as curl.
"use strict";

const chat = { messages: [], controller: null };

async function loadModels() {
  const response = await api("/v1/models");
  if (!response.ok) return;
  const { data } = await response.json();
  const select = $("model");
  const current = select.value;
  select.replaceChildren(...data.map((m) => new Option(m.id, m.id)));
  if (data.some((m) => m.id === current)) select.value = current;
  $("model-name").textContent = data[0]?.id || "";
  updateCurl();
}

function number(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

/** The request body from the settings and the conversation (plus `draft`, a message not sent yet);
 *  throws on a schema that is not JSON. */
function chatBody(draft) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...chat.messages);
  if (draft) messages.push({ role: "user", content: draft });
  const body = { model: $("model").value, messages };
  for (const field of ["max_tokens", "temperature", "top_p", "seed"]) {
    const value = number(field);
    if (value !== undefined) body[field] = value;
  }
  const stop = $("stop").value.split("\n").filter((s) => s !== "");
  if (stop.length) body.stop = stop;
  if ($("use-schema").checked) {
    let schema;
    try {
      schema = JSON.parse($("schema").value);
    } catch (e) {
      throw new Error(`the JSON schema is not valid JSON: ${e.message}`);
    }
    body.response_format = { type: "json_schema", json_schema: { name: "output", schema } };
  }
  if ($("stream").checked) Object.assign(body, { stream: true, stream_options: { include_usage: true } });
  return body;
}

function curlFor(body) {
  const json = JSON.stringify(body, null, 2).replaceAll("'", "'\\''");
  const lines = [`curl${body.stream ? " -N" : ""} ${location.origin}/v1/chat/completions`, `-H "Content-Type: application/json"`];
  if (apiKey()) lines.push(`-H "Authorization: Bearer $TOKENMILL_API_KEY"`);
  lines.push(`-d '${json}'`);
  return lines.join(" \\\n  ");
}

function updateCurl() {
  $("schema").hidden = !$("use-schema").checked;
  try {
    $("curl").textContent = curlFor(chatBody($("prompt").value.trim() || "…"));
    $("settings-error").hidden = true;
  } catch (e) {
    $("settings-error").textContent = e.message;
    $("settings-error").hidden = false;
  }
}

for (const id of ["model", "system", "temperature", "top_p", "max_tokens", "seed", "stop", "stream", "use-schema", "schema", "prompt"]) {
  $(id).addEventListener("input", updateCurl);
}

function addBubble(role, text) {
  const bubble = document.createElement("div");
  bubble.className = `bubble ${role}`;
  const thinking = document.createElement("span");
  thinking.className = "thinking";
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  bubble.append(thinking, body);
  $("messages").append(bubble);
  $("messages").scrollTop = $("messages").scrollHeight;
  return bubble;
}

function setMeta(bubble, text) {
  const meta = document.createElement("span");
  meta.className = "meta";
  meta.textContent = text;
  bubble.append(meta);
}

/** Calls `onEvent` with each `data:` object of a server-sent event stream until [DONE]. */
async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

async function send(event) {
  event?.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || chat.controller) return;
  let body;
  try {
    body = chatBody(text);
  } catch (e) {
    updateCurl();
    return;
  }
  chat.messages.push({ role: "user", content: text });
  $("prompt").value = "";
  $("curl").textContent = curlFor(body);
  addBubble("user", text);
  const bubble = addBubble("assistant", "");
  const [thinking, output] = bubble.children;
  bubble.classList.add("streaming");
  bubble.dataset.chunks = "0";
  chat.controller = new AbortController();
  $("send").disabled = true;
  $("stop-button").disabled = false;
  const started = performance.now();
  let first = null;
  let reply = "";
  let usage = null;
  let finish = null;
  const append = (element, piece) => {
    first ??= performance.now();
    element.textContent += piece;
    bubble.dataset.chunks = String(Number(bubble.dataset.chunks) + 1);
    $("messages").scrollTop = $("messages").scrollHeight;
  };
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: chat.controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    if (body.stream) {
      await readEvents(response, (chunk) => {
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          if (choice.delta?.reasoning_content) append(thinking, choice.delta.reasoning_content);
          if (choice.delta?.content) {
            reply += choice.delta.content;
            append(output, choice.delta.content);
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      });
    } else {
      const result = await response.json();
      const choice = result.choices[0];
      reply = choice.message.content || "";
      thinking.textContent = choice.message.reasoning_content || "";
      output.textContent = reply;
      first = performance.now();
      usage = result.usage;
      finish = choice.finish_reason;
    }
    chat.messages.push({ role: "assistant", content: reply });
    const seconds = (performance.now() - started) / 1000;
    const tokens = usage?.completion_tokens ?? Number(bubble.dataset.chunks);
    const decode = first ? (performance.now() - first) / 1000 : 0;
    const rate = tokens > 1 && decode > 0 ? `${((tokens - 1) / decode).toFixed(1)} tok/s` : "";
    setMeta(bubble, [`${tokens} tokens`, `first token ${((first - started) / 1000).toFixed(2)} s`, `total ${seconds.toFixed(2)} s`, rate, finish].filter(Boolean).join(" · "));
  } catch (e) {
    if (e.name === "AbortError") {
      chat.messages.push({ role: "assistant", content: reply });
      setMeta(bubble, "stopped");
    } else {
      chat.messages.pop(); // the conversation goes on without the message that failed
      bubble.classList.add("error");
      output.textContent = e.message;
    }
  } finally {
    bubble.classList.remove("streaming");
    bubble.dataset.done = "true";
    chat.controller = null;
    $("send").disabled = false;
    $("stop-button").disabled = true;
    updateCurl();
  }
}

$("chat-form").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) send(event);
});
$("stop-button").addEventListener("click", () => chat.controller?.abort());
$("clear").addEventListener("click", () => {
  chat.controller?.abort();
  chat.messages = [];
  $("messages").replaceChildren();
  updateCurl();
});


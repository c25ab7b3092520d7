// The chat page: streams /v1/chat/completions token by token, keeps the conversation, stops a
// generation with an AbortController (closing the stream makes the server abort the request
// and free its blocks) and shows tokens/s. With tools set, the assistant's tool calls show as
// `call name {arguments}` blocks; the next messages typed are the calls' results, sent as
// `tool` turns (one per call), and the conversation goes on once every call has its result.
import { authHeaders, errorMessage, readEvents } from "./sse.js";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "pagedserve.apiKey";

const state = {
  model: null,
  history: [], // {role, content[, tool_calls | tool_call_id]} sent with each request
  controller: null, // AbortController of the running generation
  pendingCalls: [], // the last answer's tool calls still waiting for a result
};

function settings() {
  const body = {
    max_tokens: Number($("max-tokens").value) || undefined,
    temperature: Number($("temperature").value),
  };
  if ($("ignore-eos").checked) body.ignore_eos = true; // a vLLM field
  const tools = $("tools").value.trim();
  if (tools) {
    body.tools = JSON.parse(tools);
    body.tool_choice = $("tool-choice").value;
  }
  return body;
}

function showCall(bubble, call) {
  let div = bubble.querySelector(`.tool-call[data-index="${call.index}"]`);
  if (!div) {
    div = document.createElement("div");
    div.className = "tool-call";
    div.dataset.index = String(call.index);
    bubble.append(div);
  }
  div.textContent = `${call.function.name} ${call.function.arguments}`;
}

// Adds one streamed `delta.tool_calls` entry to the calls so far (OpenAI's shape: id, type and
// name in a call's first delta, then pieces of its arguments).
function addCallDelta(calls, d) {
  if (!calls[d.index]) {
    calls[d.index] = { id: d.id, type: "function", index: d.index,
                       function: { name: d.function.name, arguments: "" } };
  }
  calls[d.index].function.arguments += (d.function && d.function.arguments) || "";
  return calls[d.index];
}

function answerCall(text) {
  const call = state.pendingCalls.shift();
  state.history.push({ role: "tool", tool_call_id: call.id, content: text });
  const bubble = addBubble("tool", text);
  bubble.parentElement.querySelector(".who").textContent = `tool · ${call.function.name}`;
  setPlaceholder();
  return state.pendingCalls.length === 0;
}

function setPlaceholder() {
  const next = state.pendingCalls[0];
  $("prompt").placeholder = next
    ? `Result of ${next.function.name} (sent as a tool message)`
    : "Message (Enter sends, Shift+Enter: new line)";
}

function addBubble(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  div.append(who, content);
  $("conversation").append(div);
  div.scrollIntoView({ block: "end" });
  return content;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("prompt").disabled = busy;
  document.body.dataset.generating = busy ? "1" : "0";
}

function showStats(s, done) {
  // decode rate: tokens after the first over the time between the first and the last
  const elapsed = s.firstAt ? (s.lastAt - s.firstAt) / 1000 : 0;
  const rate = s.tokens > 1 && elapsed > 0 ? (s.tokens - 1) / elapsed : 0;
  const parts = [`${s.tokens} tokens`, `${rate.toFixed(1)} tok/s`];
  if (s.ttft !== null) parts.push(`TTFT ${Math.round(s.ttft)} ms`);
  if (done) parts.push(done);
  $("gen-stats").textContent = parts.join(" · ");
  $("gen-stats").dataset.tokens = String(s.tokens);
  $("gen-stats").dataset.tokensPerS = rate.toFixed(2);
}

async function send(text) {
  const system = $("system-prompt").value.trim();
  const history = state.history; // "New chat" during a generation starts a fresh one
  if (state.pendingCalls.length) {
    if (!answerCall(text)) return; // more calls wait for their results
  } else {
    history.push({ role: "user", content: text });
    addBubble("user", text);
  }
  const out = addBubble("assistant", "");
  const calls = [];
  out.parentElement.classList.add("streaming");
  const messages = system ? [{ role: "system", content: system }, ...history] : [...history];
  const s = { tokens: 0, ttft: null, firstAt: null, lastAt: null, start: performance.now() };
  let finish = null;
  let answer = "";
  // One text node grown in place, and one scroll and stats update per frame: rewriting the
  // whole answer and scrolling per token is quadratic, and at a thousand tokens/s it starved
  // the page (the Stop button never settled enough to click).
  const node = document.createTextNode("");
  out.append(node);
  let frame = 0;
  const render = () => {
    frame = 0;
    out.parentElement.scrollIntoView({ block: "end" });
    showStats(s, null);
  };
  state.controller = new AbortController();
  setBusy(true);
  showStats(s, "waiting…");
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders($("api-key").value.trim()) },
      body: JSON.stringify({
        model: state.model, messages, stream: true, return_token_ids: true, ...settings(),
      }),
      signal: state.controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    await readEvents(response, ({ data }) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices[0];
      const n = (choice.token_ids || []).length;
      if (n && s.firstAt === null) {
        s.firstAt = performance.now();
        s.ttft = s.firstAt - s.start;
      }
      s.tokens += n;
      if (n) s.lastAt = performance.now();
      if (choice.delta && choice.delta.content) {
        answer += choice.delta.content;
        node.appendData(choice.delta.content);
      }
      for (const d of (choice.delta && choice.delta.tool_calls) || []) {
        showCall(out, addCallDelta(calls, d));
      }
      if (choice.finish_reason) finish = choice.finish_reason;
      if (!frame) frame = requestAnimationFrame(render);
    });
    cancelAnimationFrame(frame);
    render();
    showStats(s, `finished: ${finish || "?"}`);
  } catch (e) {
    cancelAnimationFrame(frame);
    if (e.name === "AbortError") {
      showStats(s, "stopped");
      out.parentElement.classList.add("stopped");
    } else {
      out.parentElement.classList.add("error");
      out.textContent = answer ? `${answer}\n\n[${e.message}]` : `[${e.message}]`;
      showStats(s, "error");
    }
  } finally {
    out.parentElement.classList.remove("streaming");
    const made = calls.filter(Boolean).map(({ index, ...call }) => call);
    if (made.length) {
      history.push({ role: "assistant", content: answer || null, tool_calls: made });
      state.pendingCalls = made.slice();
      setPlaceholder();
    } else {
      history.push({ role: "assistant", content: answer }); // partial answers count too
    }
    state.controller = null;
    setBusy(false);
    $("prompt").focus();
  }
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: authHeaders($("api-key").value.trim()) });
    if (!r.ok) throw new Error(await errorMessage(r));
    state.model = (await r.json()).data[0].id;
    $("model-name").textContent = state.model;
  } catch (e) {
    $("model-name").textContent = `models: ${e.message}`;
  }
}

function init() {
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem(KEY_STORE, $("api-key").value.trim());
    loadModel();
  });
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.history = [];
    state.pendingCalls = [];
    setPlaceholder();
    $("conversation").replaceChildren();
    $("gen-stats").textContent = "ready";
  });
  setBusy(false);
  loadModel();
  $("prompt").focus();
}

init();

// The dashboard: reads /admin/events (stats snapshots over SSE, sent with the admin key when
// one is needed) and draws cards, four live charts, the engines side by side (data
// parallelism), the request table and the settings.
import { TimeChart } from "./charts.js";
import { authHeaders, errorMessage, readEvents } from "./sse.js";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "pagedserve.adminKey";
const WINDOW_S = 60;

const charts = {
  queues: new TimeChart($("chart-queues"), [{ name: "running" }, { name: "waiting" }],
    { windowS: WINDOW_S }),
  kv: new TimeChart($("chart-kv"), [{ name: "used", color: "#16a34a" }],
    { windowS: WINDOW_S, unit: "%", minMax: 1, capMax: 100 }),
  tps: new TimeChart($("chart-tps"), [{ name: "prompt" }, { name: "generation" }],
    { windowS: WINDOW_S }),
  step: new TimeChart($("chart-step"), [{ name: "step", color: "#9333ea" }],
    { windowS: WINDOW_S, unit: "ms" }),
};

// What tests and curious operators can read from the console.
const dash = { snapshots: 0, last: null, charts };
window.pagedserveDashboard = dash;

let prevSteps = null;
let configShown = false;

function setConn(state, text) {
  $("conn").dataset.state = state;
  $("conn").textContent = text;
}

function text(id, v) {
  $(id).textContent = v;
}

function meanNewStepMs(snap) {
  const total = snap.scheduler.num_steps_total;
  const fresh = prevSteps === null ? 0 : Math.min(total - prevSteps, snap.steps.length);
  prevSteps = total;
  if (fresh <= 0) return null; // no step since the last snapshot: a gap, not a zero
  const rows = snap.steps.slice(-fresh);
  return rows.reduce((a, r) => a + r.duration_ms, 0) / rows.length;
}

function renderTable(rows) {
  const body = $("requests").tBodies[0];
  const trs = rows.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.state = r.state;
    const cells = [r.id, r.state, r.priority, r.prompt_tokens, r.output_tokens,
      r.num_computed_tokens, r.num_blocks, r.cached_tokens, r.age_s.toFixed(1),
      r.ttft_s === null ? "–" : r.ttft_s.toFixed(3)];
    for (const c of cells) {
      const td = document.createElement("td");
      td.textContent = String(c);
      tr.append(td);
    }
    tr.firstChild.title = r.id;
    return tr;
  });
  body.replaceChildren(...trs);
  text("req-count", `(${rows.length})`);
}

function renderConfig(snap) {
  const m = snap.model;
  const c = snap.config;
  const sv = snap.serving || {};
  const parser = sv.tool_call_parser
    ? `${sv.tool_call_parser} (${sv.tool_call_parser_source})` : "none";
  const items = [
    ["model", m.name], ["path", m.path], ["dtype", m.dtype], ["device", m.device],
    ["quantization", m.quantization ?? "none"], ["tool_call_parser", parser],
    ["auto tool choice", sv.auto_tool_choice ? "on" : "off"],
    ["served names", (sv.served_model_names || [m.name]).join(", ")],
    ["max_model_len", m.max_model_len], ["block_size", c.cache.block_size],
    ["num_blocks", c.cache.num_blocks], ["max_num_seqs", c.scheduler.max_num_seqs],
    ["max_num_batched_tokens", c.scheduler.max_num_batched_tokens],
    ["policy", snap.scheduler.policy],
  ];
  const nodes = [];
  for (const [k, v] of items) {
    const dt = document.createElement("dt");
    dt.textContent = k;
    const dd = document.createElement("dd");
    dd.textContent = String(v);
    nodes.push(dt, dd);
  }
  $("config").replaceChildren(...nodes);
}

// Speculative decoding: mean tokens per verify pass, acceptance per draft position, and
// drafting vs verifying time ("off" until a draft was scored).
function renderSpecDecode(sd) {
  if (!sd || !sd.num_drafts) {
    text("spec-mean-len", "off");
    return;
  }
  text("spec-mean-len", sd.mean_acceptance_length.toFixed(2));
  const rates = sd.acceptance_rate_per_pos.map((r) => `${(r * 100).toFixed(0)}%`);
  text("spec-per-pos", `accepted by position: ${rates.join(" · ")}`);
  text("spec-times", `draft ${sd.draft_time_s.toFixed(2)} s · verify ${sd.verify_time_s.toFixed(2)} s`);
}

// Data parallelism: one column per engine, side by side (the cards above are the totals).
const ENGINE_ROWS = [
  ["state", (e) => (e.failed ? `failed: ${e.failed}` : "serving")],
  ["routed", (e) => e.num_routed],
  ["load (router)", (e) => e.load],
  ["running", (e) => e.scheduler?.num_running ?? "–"],
  ["waiting", (e) => e.scheduler?.num_waiting ?? "–"],
  ["KV cache", (e) => (e.kv_cache ? `${(e.kv_cache.usage * 100).toFixed(1)}%` : "–")],
  ["hit rate", (e) => (e.kv_cache ? `${(e.kv_cache.prefix_cache_hit_rate * 100).toFixed(1)}%` : "–")],
  ["cached hashes", (e) => e.num_cached_hashes],
  ["generation tok/s", (e) => e.throughput?.generation_tokens_per_s.toFixed(0) ?? "–"],
];

function cell(tag, v) {
  const c = document.createElement(tag);
  c.textContent = String(v);
  return c;
}

function renderEngines(snap) {
  const engines = snap.engines;
  $("engines-panel").hidden = !engines;
  if (!engines) return;
  text("dp-routing", `(${engines.length}, routing: ${snap.data_parallel.routing})`);
  const head = $("engines").tHead.rows[0];
  head.replaceChildren(cell("th", ""), ...engines.map((e) => cell("th", `engine ${e.index}`)));
  const rows = ENGINE_ROWS.map(([name, get]) => {
    const tr = document.createElement("tr");
    tr.append(cell("th", name), ...engines.map((e) => cell("td", get(e))));
    return tr;
  });
  $("engines").tBodies[0].replaceChildren(...rows);
}

function onSnapshot(snap) {
  const s = snap.scheduler;
  const kv = snap.kv_cache;
  const tp = snap.throughput;
  const t = performance.now() / 1000;
  text("num-running", s.num_running);
  text("num-waiting", s.num_waiting);
  text("num-preempted", s.num_preempted_total);
  text("num-pooling", s.num_pooling_finished_total ?? 0);
  text("pooling-live", `${s.num_pooling_running ?? 0} running, ${s.num_pooling_waiting ?? 0} waiting`);
  text("kv-usage", `${(kv.usage * 100).toFixed(1)}%`);
  text("kv-blocks", `${kv.num_blocks - kv.num_free_blocks} / ${kv.num_blocks} blocks`);
  text("prompt-tps", tp.prompt_tokens_per_s.toFixed(0));
  text("gen-tps", tp.generation_tokens_per_s.toFixed(0));
  text("hit-rate", `${(kv.prefix_cache_hit_rate * 100).toFixed(1)}%`);
  text("cached-blocks", `${kv.num_cached_blocks} cached blocks`);
  text("num-steps", s.num_steps_total);
  renderSpecDecode(s.spec_decode);
  charts.queues.push(t, [s.num_running, s.num_waiting]);
  charts.kv.push(t, [kv.usage * 100]);
  charts.tps.push(t, [tp.prompt_tokens_per_s, tp.generation_tokens_per_s]);
  charts.step.push(t, [meanNewStepMs(snap)]);
  renderTable(s.requests);
  renderEngines(snap);
  if (!configShown) {
    renderConfig(snap);
    configShown = true;
  }
  dash.snapshots += 1;
  dash.last = snap;
}

function drawLoop() {
  const now = performance.now() / 1000;
  for (const c of Object.values(charts)) c.draw(now);
  requestAnimationFrame(drawLoop);
}

async function connect() {
  for (;;) {
    const key = localStorage.getItem(KEY_STORE) || "";
    try {
      const r = await fetch("/admin/events", { headers: authHeaders(key) });
      if (r.status === 401) {
        setConn("auth", "admin key needed");
        $("key-form").hidden = false;
        $("key-error").textContent = key ? await errorMessage(r) : "";
        await new Promise((resolve) => $("key-form").addEventListener("submit", resolve,
          { once: true }));
        continue;
      }
      if (!r.ok) throw new Error(await errorMessage(r));
      $("key-form").hidden = true;
      setConn("live", "live");
      await readEvents(r, ({ event, data }) => {
        if (event === "stats") onSnapshot(JSON.parse(data));
      });
      setConn("down", "stream ended; reconnecting…");
    } catch (e) {
      setConn("down", `disconnected (${e.message}); reconnecting…`);
    }
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  localStorage.setItem(KEY_STORE, $("admin-key").value.trim());
});
requestAnimationFrame(drawLoop);
connect();

// The dashboard: tiles and <canvas> charts of /ui/stats, polled once a second; on a router, a replica picker.
"use strict";

const POLL_MS = 1000;
const HISTORY = 180; // points per chart: three minutes at one a second
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777"];

const fixed = (x, digits = 1) => (x === null || x === undefined ? "–" : x.toFixed(digits));
const percent = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`);
const money = (x) => (x === null || x === undefined ? "–" : `$${x < 10 ? x.toFixed(3) : x.toFixed(2)}`);

function duration(x) {
  if (x === null || x === undefined) return "–";
  return x < 1 ? `${(1000 * x).toFixed(x < 0.01 ? 1 : 0)} ms` : `${x.toFixed(2)} s`;
}

function percentiles(p) {
  return [`${duration(p.p50)} / ${duration(p.p99)}`, p.count ? `${p.count} in window, mean ${duration(p.mean)}` : "none in window"];
}

// [label, stats -> [value, detail]]
const TILES = [
  ["TTFT p50 / p99", (s) => percentiles(s.latency.ttft)],
  ["Inter-token latency p50 / p99", (s) => percentiles(s.latency.itl)],
  ["End-to-end p50 / p99", (s) => percentiles(s.latency.e2e)],
  ["Input tokens / s", (s) => [fixed(s.throughput.input_tok_s), `${s.totals.prompt_tokens} since start`]],
  ["Output tokens / s", (s) => [fixed(s.throughput.output_tok_s), `${s.totals.generation_tokens} since start`]],
  ["Running / waiting", (s) => [`${s.requests.running} / ${s.requests.waiting}`, `${fixed(s.throughput.requests_s, 2)} requests / s finished`]],
  ["KV cache used", (s) => [percent(s.kv_cache.usage), `${s.kv_cache.blocks - s.kv_cache.free_blocks} of ${s.kv_cache.blocks} blocks`]],
  ["Prefix-cache hit rate", (s) => [percent(s.prefix_cache.hit_rate), `${percent(s.prefix_cache.hit_rate_total)} since start`]],
  ["Preemptions", (s) => [String(s.preemptions.window), `${s.preemptions.total} since start`]],
  ["Speculative acceptance", (s) => (s.spec_decode.drafted_tokens_total ? [percent(s.spec_decode.acceptance), `${percent(s.spec_decode.acceptance_total)} since start`] : ["off", "no drafted tokens"])],
  ["MoE load imbalance", (s) => (s.moe ? [`${fixed(s.moe.max, 2)}×`, `busiest layer; mean ${fixed(s.moe.mean, 2)}× over ${Object.keys(s.moe.layers).length} layers`] : ["–", "not a mixture of experts"])],
  ["Engine time: decode / prompt steps", (s) => [`${percent(s.engine_steps.decode.share)} / ${percent(s.engine_steps.prompt.share)}`, `steps of ${duration(s.engine_steps.decode.step_s)} / ${duration(s.engine_steps.prompt.step_s)}`]],
  ["CPU utilization", (s) => [percent(s.cpu.utilization), `${fixed(s.cpu.cores_busy)} of ${s.cpu.cores} cores busy (server + engine)`]],
  ["$ per M input tokens", (s) => (s.cost ? [money(s.cost.per_million_input), `at $${s.cost.price_per_hour}/hour`] : ["–", "serve --price-per-hour"])],
  ["$ per M output tokens", (s) => (s.cost ? [money(s.cost.per_million_output), `at $${s.cost.price_per_hour}/hour`] : ["–", "serve --price-per-hour"])],
];

const share = (x) => (x === null || x === undefined ? null : 100 * x);

// a hit-rate line for each tier the latest answer has one for
const tierSeries = (latest) =>
  Object.entries(latest.prefix_cache.tiers)
    .filter(([, tier]) => tier.hit_rate !== null)
    .map(([name]) => [`${name} tier hits`, (s) => share(s.prefix_cache.tiers[name]?.hit_rate)]);

// {title, series: [[name, stats -> number | null]], max?: fixed top of the scale, extra?: stats -> more series}
const CHARTS = [
  { title: "Time to first token (s)", series: [["p50", (s) => s.latency.ttft.p50], ["p99", (s) => s.latency.ttft.p99]] },
  { title: "Inter-token latency (s)", series: [["p50", (s) => s.latency.itl.p50], ["p99", (s) => s.latency.itl.p99]] },
  { title: "End-to-end latency (s)", series: [["p50", (s) => s.latency.e2e.p50], ["p99", (s) => s.latency.e2e.p99]] },
  { title: "Tokens per second", series: [["input", (s) => s.throughput.input_tok_s], ["output", (s) => s.throughput.output_tok_s]] },
  { title: "Requests", series: [["running", (s) => s.requests.running], ["waiting", (s) => s.requests.waiting]] },
  {
    title: "KV cache (%)",
    max: 100,
    series: [["used", (s) => share(s.kv_cache.usage)], ["prefix hits", (s) => share(s.prefix_cache.hit_rate)]],
    extra: tierSeries,
  },
  { title: "CPU utilization (%)", max: 100, series: [["server + engine", (s) => share(s.cpu.utilization)]] },
  {
    title: "Engine time (%)",
    max: 100,
    series: [["decode steps", (s) => share(s.engine_steps.decode.share)], ["prompt steps", (s) => share(s.engine_steps.prompt.share)]],
  },
];

let samples = []; // the last HISTORY answers of /ui/stats

function buildDashboard() {
  $("tiles").replaceChildren(
    ...TILES.map(([label]) => {
      const tile = document.createElement("div");
      tile.className = "tile";
      tile.innerHTML = '<div class="label"></div><div class="value">–</div><div class="sub"></div>';
      tile.querySelector(".label").textContent = label;
      return tile;
    }),
  );
  $("charts").replaceChildren(
    ...CHARTS.map((chart) => {
      const card = document.createElement("div");
      card.className = "chart";
      card.innerHTML = "<h3></h3><canvas></canvas>";
      card.querySelector("h3").textContent = chart.title;
      chart.canvas = card.querySelector("canvas");
      return card;
    }),
  );
}

function updateTiles(s) {
  TILES.forEach(([, value], i) => {
    const [main, detail] = value(s);
    const tile = $("tiles").children[i];
    tile.querySelector(".value").textContent = main;
    tile.querySelector(".sub").textContent = detail;
  });
}

function updateTiers(s) {
  const tiers = Object.entries(s.prefix_cache.tiers);
  if (!tiers.length) return $("tiers").replaceChildren();
  const table = document.createElement("table");
  table.innerHTML = "<caption>KV cache tiers</caption><tr><th>tier</th><th>hit rate (since start)</th><th>series</th></tr>";
  for (const [name, tier] of tiers) {
    const row = table.insertRow();
    const series = Object.entries(tier.metrics).map(([metric, m]) => `${metric} ${fixed(m.value, 0)}${m.rate === null ? "" : ` (${fixed(m.rate)}/s)`}`);
    for (const text of [name, percent(tier.hit_rate), series.join(", ")]) row.insertCell().textContent = text;
  }
  $("tiers").replaceChildren(table);
}

function niceTop(x) {
  if (!(x > 0)) return 1;
  const step = 10 ** Math.floor(Math.log10(x));
  return [1, 2, 4, 6, 8, 10].map((m) => m * step).find((top) => top >= x); // quarters print short
}

const label = (x) => String(+x.toPrecision(3));

function drawChart(chart) {
  const canvas = chart.canvas;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (!width) return; // hidden
  const scale = window.devicePixelRatio || 1;
  canvas.width = width * scale;
  canvas.height = height * scale;
  const g = canvas.getContext("2d");
  g.scale(scale, scale);
  const latest = samples[samples.length - 1];
  const series = [...chart.series, ...(chart.extra && latest ? chart.extra(latest) : [])].map(([name, get]) => [name, samples.map((s) => get(s))]);
  const values = series.flatMap(([, points]) => points.filter((v) => v !== null && Number.isFinite(v)));
  const top = chart.max ?? niceTop(Math.max(0, ...values));
  const left = 42;
  const right = width - 8;
  const topY = 22;
  const bottom = height - 16;
  g.font = "11px system-ui, sans-serif";
  g.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const y = bottom - ((bottom - topY) * i) / 4;
    g.strokeStyle = "#eceff3";
    g.beginPath();
    g.moveTo(left, y);
    g.lineTo(right, y);
    g.stroke();
    g.fillStyle = "#667085";
    g.textAlign = "right";
    g.fillText(label((top * i) / 4), left - 5, y);
  }
  // the samples kept span the width: the oldest at the left, labelled with its age
  const age = latest ? Math.max(0, Math.round(latest.uptime_s - samples[0].uptime_s)) : 0;
  g.textAlign = "left";
  g.fillText(age >= 120 ? `${Math.round(age / 60)} min ago` : `${age} s ago`, left, height - 6);
  g.textAlign = "right";
  g.fillText("now", right, height - 6);
  const x = (i) => left + (i * (right - left)) / Math.max(samples.length - 1, 1);
  const y = (v) => bottom - (Math.min(v, top) / top) * (bottom - topY);
  let legend = left;
  series.forEach(([name, points], k) => {
    const color = COLORS[k % COLORS.length];
    g.strokeStyle = color;
    g.lineWidth = 1.8;
    const known = (i) => points[i] !== null && points[i] !== undefined && Number.isFinite(points[i]);
    g.beginPath();
    points.forEach((v, i) => {
      if (!known(i)) return;
      if (known(i - 1)) g.lineTo(x(i), y(v));
      else if (known(i + 1)) g.moveTo(x(i), y(v));
      else g.rect(x(i) - 1.5, y(v) - 1.5, 3, 3); // a point with no neighbour: a dot
    });
    g.stroke();
    g.fillStyle = color;
    g.fillRect(legend, 6, 10, 10);
    g.fillStyle = "#1d2430";
    g.textAlign = "left";
    g.fillText(name, legend + 14, 11);
    legend += g.measureText(name).width + 30;
  });
  canvas.dataset.points = String(samples.length);
}

function drawCharts() {
  if (!$("dashboard").hidden) CHARTS.forEach(drawChart);
}

function pickReplicas(s) {
  if (!s.replicas) return;
  const select = $("replica");
  if (select.options.length !== s.replicas.length) {
    select.replaceChildren(...s.replicas.map((r) => new Option(`${r.index}: ${r.url}`, String(r.index))));
    select.value = String(s.replica);
  }
  s.replicas.forEach((r, i) => (select.options[i].textContent = `${r.index}: ${r.url}${r.healthy ? "" : " (unhealthy)"}`));
  $("replica-picker").hidden = false;
}

$("replica").addEventListener("change", () => {
  samples = [];
  restartPolling();
});

let timer = null;
let epoch = 0; // a poll of an earlier epoch (before a change of replica, window or key) schedules no more

function restartPolling() {
  clearTimeout(timer);
  poll(++epoch);
}

async function poll(mine) {
  if (waitingForKey) return;
  const params = new URLSearchParams({ window: $("window").value });
  if ($("replica").value) params.set("replica", $("replica").value);
  try {
    const response = await api(`/ui/stats?${params}`);
    if (response.status === 401 || mine !== epoch) return;
    if (!response.ok) throw new Error(await errorText(response));
    const s = await response.json();
    samples = [...samples, s].slice(-HISTORY);
    pickReplicas(s);
    updateTiles(s);
    updateTiers(s);
    drawCharts();
    $("updated").textContent = `updated ${new Date().toLocaleTimeString()} · up ${Math.round(s.uptime_s)} s`;
    setStatus(`live · ${s.model}`);
  } catch (e) {
    setStatus(`dashboard: ${e.message}`, true);
  }
  if (mine === epoch) timer = setTimeout(() => poll(mine), POLL_MS);
}

$("window").addEventListener("change", restartPolling);
window.addEventListener("resize", drawCharts);

// vllmstack dashboard page: live cards and charts from /api/metrics, benchmark runs and history.
// Plain DOM code, no build step. Untrusted text (history records, logs) is set with textContent.
"use strict";

const RING_MAX = 900;
const TOKEN_KEY = "vllmstack.dashboardToken";
const TAB_KEY = "vllmstack.dashboardTab";

const KINDS = {
  bench: { title: "Benchmark: prompt and generation speed", x: "time",
           fields: [["pp", "prompt tokens"], ["tg", "generated tokens"], ["runs", "runs"]] },
  depth: { title: "Depth sweep: speed as the context fills", x: "depth",
           fields: [["pp", "prompt tokens"], ["tg", "generated tokens"], ["runs", "runs"]] },
  conc: { title: "Concurrency sweep: speed under parallel load", x: "concurrency",
          fields: [["pp", "prompt tokens"], ["tg", "generated tokens"], ["duration", "seconds per rung"],
                   ["max_num_seqs", "max concurrency"]] },
};

const state = {
  info: null,
  token: localStorage.getItem(TOKEN_KEY) || "",
  pollTimer: null,
  pollDelay: 1000,
  baseDelay: 1000,
  lastTs: 0,
  charts: {},
  kinds: {},
  runTimer: null,
  active: null,
};

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// --- formatting ------------------------------------------------------------------------------

const isNum = (v) => typeof v === "number" && Number.isFinite(v);
const pct = (v, digits = 1) => (isNum(v) ? `${(v * 100).toFixed(digits)}%` : "–");
const int = (v) => (isNum(v) ? Math.round(v).toLocaleString("en-US") : "–");
const rate = (v) => (isNum(v) ? (v >= 100 ? Math.round(v).toLocaleString("en-US") : v.toFixed(1)) : "–");
const ms = (seconds) => (isNum(seconds) ? `${(seconds * 1000).toFixed(seconds < 0.1 ? 1 : 0)} ms` : "–");
const clock = (ts) => new Date(ts * 1000).toLocaleTimeString([], { hour12: false });
const when = (ts) => {
  if (!isNum(ts)) return "–";
  const d = new Date(ts * 1000);
  return `${d.toLocaleDateString("en-CA")} ${d.toLocaleTimeString([], { hour12: false })}`;
};

// --- API -------------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, { method = "GET", body, write = false, headers = {} } = {}) {
  const h = { ...headers };
  if (body !== undefined) h["Content-Type"] = "application/json";
  // Reading needs the token too where one is required (the server decides from the headers).
  if (state.token) h["X-Dashboard-Token"] = state.token;
  const res = await fetch(path, { method, headers: h, body: body === undefined ? undefined : JSON.stringify(body) });
  if (!res.ok && res.status !== 304) {
    let detail = res.statusText;
    try { const data = await res.json(); detail = data.detail || detail; } catch (_) { /* not JSON */ }
    if (typeof detail !== "string") detail = JSON.stringify(detail);
    throw new ApiError(res.status, detail);
  }
  return res;
}

// --- tabs ------------------------------------------------------------------------------------

function selectTab(name, focus = false) {
  for (const tab of ["live", "bench"]) {
    const on = tab === name;
    $(`tab-${tab}`).setAttribute("aria-selected", String(on));
    $(`tab-${tab}`).tabIndex = on ? 0 : -1;
    $(`panel-${tab}`).hidden = !on;
    if (on && focus) $(`tab-${tab}`).focus();
  }
  localStorage.setItem(TAB_KEY, name);
  history.replaceState(null, "", `#${name}`);
  if (name === "bench") refreshAllHistory();
}

function setupTabs() {
  for (const tab of ["live", "bench"]) {
    $(`tab-${tab}`).addEventListener("click", () => selectTab(tab));
    $(`tab-${tab}`).addEventListener("keydown", (ev) => {
      if (ev.key === "ArrowRight" || ev.key === "ArrowLeft") selectTab(tab === "live" ? "bench" : "live", true);
    });
  }
  const fromHash = location.hash.replace("#", "");
  selectTab(["live", "bench"].includes(fromHash) ? fromHash : (localStorage.getItem(TAB_KEY) || "live"));
}

// --- live metrics ----------------------------------------------------------------------------

function lineChart(canvas, datasets, scales) {
  return new Chart(canvas, {
    type: "line",
    data: { labels: [], datasets },
    options: {
      animation: false, responsive: true, maintainAspectRatio: false, spanGaps: false,
      interaction: { mode: "index", intersect: false },
      elements: { point: { radius: 0 }, line: { borderWidth: 2, tension: 0.25 } },
      plugins: { legend: { position: "bottom", labels: { boxWidth: 12 } } },
      scales: { x: { ticks: { maxTicksLimit: 8, autoSkip: true } }, ...scales },
    },
  });
}

function setupLiveCharts() {
  state.charts.tps = lineChart($("chart-tps"), [
    { label: "prefill t/s", data: [], borderColor: "#2f6fdb", backgroundColor: "#2f6fdb" },
    { label: "generated t/s", data: [], borderColor: "#d9822b", backgroundColor: "#d9822b", yAxisID: "y1" },
  ], {
    y: { beginAtZero: true, title: { display: true, text: "prefill t/s" } },
    y1: { beginAtZero: true, position: "right", grid: { drawOnChartArea: false }, title: { display: true, text: "gen t/s" } },
  });
  state.charts.load = lineChart($("chart-load"), [
    { label: "KV cache %", data: [], borderColor: "#7a4cc2", backgroundColor: "#7a4cc2" },
    { label: "running", data: [], borderColor: "#1f8a4c", backgroundColor: "#1f8a4c", yAxisID: "y1", stepped: true },
    { label: "waiting", data: [], borderColor: "#c23a3a", backgroundColor: "#c23a3a", yAxisID: "y1", stepped: true },
  ], {
    y: { beginAtZero: true, suggestedMax: 100, title: { display: true, text: "KV %" } },
    y1: { beginAtZero: true, position: "right", grid: { drawOnChartArea: false }, ticks: { precision: 0 },
          title: { display: true, text: "requests" } },
  });
}

function pushPoint(p) {
  if (!isNum(p.ts) || p.ts <= state.lastTs) return;
  state.lastTs = p.ts;
  const series = [
    [state.charts.tps, [p.pp, p.tg]],
    [state.charts.load, [isNum(p.kv) ? p.kv * 100 : null, p.running, p.waiting]],
  ];
  for (const [chart, values] of series) {
    chart.data.labels.push(clock(p.ts));
    values.forEach((v, i) => chart.data.datasets[i].data.push(isNum(v) ? v : null));
    if (chart.data.labels.length > RING_MAX) {
      chart.data.labels.shift();
      chart.data.datasets.forEach((d) => d.data.shift());
    }
  }
}

function redrawCharts() {
  state.charts.tps.update("none");
  state.charts.load.update("none");
}

async function loadRing() {
  try {
    const data = await (await api("api/metrics/history?limit=900")).json();
    for (const chart of [state.charts.tps, state.charts.load]) {
      chart.data.labels = [];
      chart.data.datasets.forEach((d) => { d.data = []; });
    }
    state.lastTs = 0;
    data.points.forEach(pushPoint);
    redrawCharts();
  } catch (_) { /* the next poll shows the error */ }
}

function setText(id, text) { $(id).textContent = text; }

function renderMetrics(m) {
  const badge = $("engine-badge");
  badge.textContent = m.engine_up ? "engine: up" : "engine: down";
  badge.className = `badge ${m.engine_up ? "badge-up" : "badge-down"}`;
  setText("model-badge", `model: ${m.model || "–"}`);
  setText("kv-badge", `KV: ${pct(m.kv_cache_usage)}`);
  const note = $("down-note");
  if (!m.engine_up) {
    const since = isNum(m.down_since) ? ` since ${clock(m.down_since)}` : "";
    note.textContent = `The engine has not answered${since}: ${m.error || "no reply"}. ` +
      `Next try in ${Math.round(m.retry_in || 1)} s.`;
    note.hidden = false;
  } else {
    note.hidden = true;
  }
  setText("kv-pct", pct(m.kv_cache_usage));
  $("kv-bar").style.width = isNum(m.kv_cache_usage) ? `${Math.min(100, m.kv_cache_usage * 100)}%` : "0";
  setText("kv-tokens", isNum(m.kv_cache_tokens) ? `${int(m.kv_tokens_used)} / ${int(m.kv_cache_tokens)}` : "–");
  setText("kv-blocks", isNum(m.num_gpu_blocks) ? `${int(m.num_gpu_blocks)} × ${m.block_size}` : "–");
  setText("kv-dtype", m.cache_dtype || "–");
  setText("req-running", int(m.requests_running));
  setText("req-waiting", int(m.requests_waiting));
  setText("hit-window", pct(m.prefix_hit_window));
  setText("hit-total", pct(m.prefix_hit_total));
  setText("hit-counts", isNum(m.prefix_cache_queries) ? `${int(m.prefix_cache_hits)} / ${int(m.prefix_cache_queries)}` : "–");
  setText("tps-prompt", rate(m.prompt_tps));
  setText("tps-gen", rate(m.generation_tps));
  setText("ttft", ms(m.ttft_window));
  setText("itl", ms(m.itl_window));
  $("card-spec").hidden = !m.spec_decode;
  setText("spec-accept", pct(m.spec_acceptance_window));
  setText("spec-len", isNum(m.spec_acceptance_length_window) ? m.spec_acceptance_length_window.toFixed(2) : "–");
  setText("spec-total", pct(m.spec_acceptance_total));
}

function schedulePoll(delay) {
  clearTimeout(state.pollTimer);
  state.pollTimer = document.hidden ? null : setTimeout(pollMetrics, delay);
}

async function pollMetrics() {
  state.pollTimer = null;
  if (document.hidden) return;  // paused; visibilitychange resumes it
  try {
    const m = await (await api("api/metrics")).json();
    renderMetrics(m);
    pushPoint({ ts: m.ts, kv: m.kv_cache_usage, running: m.requests_running, waiting: m.requests_waiting,
                pp: m.prompt_tps, tg: m.generation_tps });
    redrawCharts();
    // While the engine is down, back off (2 s, 4 s, ... 10 s) instead of hammering it.
    state.pollDelay = m.engine_up ? state.baseDelay : Math.min(Math.max(state.pollDelay * 2, 2000), 10000);
  } catch (err) {
    const badge = $("engine-badge");
    badge.textContent = "dashboard unreachable";
    badge.className = "badge badge-down";
    state.pollDelay = Math.min(Math.max(state.pollDelay * 2, 2000), 10000);
  }
  schedulePoll(state.pollDelay);
}

// `invoke router`: its resident model, queue and the recent swaps (hidden while none answers).
async function pollRouter() {
  try {
    const r = await (await api("api/router")).json();
    $("card-router").hidden = !r.running;
    if (r.running) {
      setText("router-loaded", r.loaded || "nothing resident");
      setText("router-state", r.state || "");
      setText("router-queue", `${r.queue ?? 0} / ${r.inflight ?? 0}`);
      const models = Object.entries(r.models || {}).map(([id, m]) => `${id}: ${m.state}`);
      setText("router-models", models.join(", ") || "–");
      const plan = r.plan || {};
      setText("router-plan", plan.card_gib
        ? `${plan.card_gib} GiB card, ${plan.capacity_gib} GiB for engines; asleep may hold ` +
          `${plan.host_limit_gib} GiB of host RAM; evict ${plan.policy}`
        : (plan.exclusive ? "one engine at a time" : "–"));
      const row = (cells) => {
        const tr = document.createElement("tr");
        for (const cell of cells) {
          const td = document.createElement("td");
          td.textContent = cell;
          tr.appendChild(td);
        }
        return tr;
      };
      const secs = (v) => (v === null || v === undefined) ? "–" : Number(v).toFixed(2);
      // Per engine: awake or asleep, how it swaps, its tier (and the swap back from there it
      // expects), what it holds on the card and in host RAM.
      $("router-engines").replaceChildren(...Object.entries(r.engines || {})
        .filter(([, e]) => e.state !== "unloaded")
        .map(([id, e]) => row([id, e.state === "ready" ? "awake" : e.state, e.swap,
                               e.tier ? `${e.tier}${e.swap_s ? ` (${secs(e.swap_s)} s)` : ""}` : "–",
                               e.gpu_gib ?? "–", e.host_gib ?? "–"])));
      // The last swaps with their split: sleep (what gave way), stop, wake or load, first answer.
      $("router-swaps").replaceChildren(...(r.swaps || []).slice(-5).reverse().map((s) =>
        row([`${s.unloaded || "–"} → ${s.loaded || "–"}` + (s.reason === "prime" ? " (first sleep)" : ""),
             secs(s.sleep_s), secs(s.stop_s), secs(s.wake_s), secs(s.start_s), secs(s.first_s),
             s.ok ? "yes" : (s.error || "no")])));
    }
  } catch (_) { $("card-router").hidden = true; }
  setTimeout(pollRouter, 5000);
}

// The last boots `up` recorded (api/boots): where each one's time went, cold or warm.
async function pollBoots() {
  try {
    const r = await (await api("api/boots")).json();
    const boots = (r.boots || []).slice().reverse();
    $("card-boots").hidden = boots.length === 0;
    const compiled = { cold: "cold (compiled)", warm: "warm (cache hit)" };
    $("boots-rows").replaceChildren(...boots.map((b) => {
      const longest = (b.phases || []).filter((p) => p.name !== "other")
        .sort((x, y) => y.seconds - x.seconds).slice(0, 3)
        .map((p) => `${p.name} ${Number(p.seconds).toFixed(1)} s`).join(", ");
      const tr = document.createElement("tr");
      const cells = [new Date(b.recorded * 1000).toLocaleString(), b.profile,
                     Number(b.wall_s).toFixed(1), compiled[b.compile] || "–", longest || "–"];
      for (const cell of cells) {
        const td = document.createElement("td");
        td.textContent = cell;
        tr.appendChild(td);
      }
      return tr;
    }));
  } catch (_) { $("card-boots").hidden = true; }
  setTimeout(pollBoots, 15000);
}

document.addEventListener("visibilitychange", async () => {
  if (document.hidden) { clearTimeout(state.pollTimer); state.pollTimer = null; return; }
  await loadRing();  // the server kept polling while the tab was hidden
  state.pollDelay = state.baseDelay;
  pollMetrics();
});

// --- auth ------------------------------------------------------------------------------------

function setupAuth(info) {
  if (!info.auth_required) return;
  $("auth-banner").hidden = false;
  $("auth-text").textContent =
    `This dashboard is reachable at ${info.exposed_on}, so reading it, starting runs and changing ` +
    "history need the dashboard token (DASHBOARD_TOKEN in .env on the serving machine). " +
    "The token is kept in this browser only.";
  $("token-input").value = state.token;
  const show = () => { $("token-state").textContent = state.token ? "token set" : "no token set"; };
  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.token = $("token-input").value.trim();
    localStorage.setItem(TOKEN_KEY, state.token);
    show();
    loadInfo();  // what the engine and the runs are, now that the token lets it be read
    refreshAllHistory();
  });
  show();
}

function explain(err) {
  if (err.status === 401) return "token missing or wrong: enter DASHBOARD_TOKEN above";
  return err.message || String(err);
}

// --- benchmark records -----------------------------------------------------------------------

// A statistic may be a number or a summary object {mean, p50, ...}.
function stat(value, key = "mean") {
  if (isNum(value)) return value;
  if (value && typeof value === "object") {
    if (isNum(value[key])) return value[key];
    if (isNum(value.mean)) return value.mean;
  }
  return null;
}

function rowsOf(record) {
  const rows = Array.isArray(record.results) && record.results.length ? record.results : [record];
  return rows.map((r) => ({
    pp: r.pp, tg: r.tg, depth: r.depth, concurrency: r.concurrency,
    ttft: stat(r.ttft_ms), pp_tps: stat(r.pp_tps), tg_tps: stat(r.tg_tps),
    total_tps: stat(r.total_tg_tps ?? r.throughput_tps ?? r.agg_tg_tps), itl: stat(r.itl_ms, "p50"),
    roofline: r.roofline,
  }));
}

const COLUMNS = [
  ["time", "time"], ["model", "model"], ["pp", "pp"], ["tg", "tg"], ["depth", "depth"],
  ["concurrency", "concurrency"], ["ttft", "TTFT ms"], ["pp_tps", "pp t/s"], ["tg_tps", "tg t/s"],
  ["total_tps", "total tg t/s"], ["itl", "ITL p50 ms"], ["roofline", "% roofline"], ["actions", ""],
];
// Columns that only mean something for one kind (a bench runs at depth 0, concurrency 1).
const ONLY = { depth: "depth", concurrency: "conc", total_tps: "conc", roofline: "bench" };

// The row's share of what the card allows at best (bench/report/roofline.py): "tg 41% / pp 28%".
function rooflineCell(roof) {
  if (!roof || typeof roof !== "object") return "–";
  if (!roof.card) return roof.note || "unknown card";
  const parts = [];
  if (isNum(roof.decode_pct)) parts.push(`tg ${roof.decode_pct.toFixed(0)}%`);
  if (isNum(roof.prefill_pct)) parts.push(`pp ${roof.prefill_pct.toFixed(0)}%`);
  return parts.join(" / ") || "–";
}
const columnsFor = (kind) => COLUMNS.filter(([key]) => !ONLY[key] || ONLY[key] === kind);

function cell(key, row) {
  const v = row[key];
  if (key === "roofline") return rooflineCell(v);
  if (["ttft", "itl"].includes(key)) return isNum(v) ? v.toFixed(1) : "–";
  if (["pp_tps", "tg_tps", "total_tps"].includes(key)) return rate(v);
  return isNum(v) ? String(v) : "–";
}

function renderRecords(kind, records) {
  const k = state.kinds[kind];
  const seen = k.ids;
  k.ids = new Set(records.map((r) => r.id));
  const newest = [...records].sort((a, b) => (b.ts || 0) - (a.ts || 0));
  const thead = k.node.querySelector("thead");
  const tbody = k.node.querySelector("tbody");
  const columns = columnsFor(kind);
  thead.replaceChildren(el("tr", {}, ...columns.map(([, label]) => el("th", {}, label))));
  tbody.replaceChildren();
  for (const record of newest) {
    const fresh = seen !== null && !seen.has(record.id);
    rowsOf(record).forEach((row, i) => {
      const tr = el("tr", { class: fresh ? "new-record" : "", "data-record": record.id || "" });
      for (const [key] of columns) {
        // A row this checkout cannot read (a newer row version): shown as stored, the reason on hover.
        if (key === "time") tr.append(el("td", i === 0 && record._unread ? { title: record._unread } : {},
          i === 0 ? when(record.ts) + (record._unread ? " ⚠" : "") : ""));
        else if (key === "model") tr.append(el("td", {}, i === 0 ? (record.model || record.served_model || "–") : ""));
        else if (key === "actions") tr.append(i === 0 ? actionsCell(kind, record) : el("td"));
        else tr.append(el("td", {}, cell(key, row)));
      }
      tbody.append(tr);
    });
  }
  k.node.querySelector(".empty").hidden = records.length > 0;
  k.node.querySelector(".table-wrap").hidden = records.length === 0;
  k.node.querySelector(".kind-chart").hidden = records.length === 0;
  renderKindChart(kind, newest);
}

function actionsCell(kind, record) {
  const id = encodeURIComponent(record.id || "");
  // Fetched, not a plain link: a link cannot send the token the server may require.
  const download = el("button", { type: "button" }, "download");
  download.addEventListener("click", async () => {
    try {
      const res = await api(`api/history/${kind}/${id}`);
      const url = URL.createObjectURL(await res.blob());
      const name = (/filename="([^"]+)"/.exec(res.headers.get("Content-Disposition") || "") || [])[1];
      const a = el("a", { href: url, download: name || `${kind}-record.json` });
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10_000);
    } catch (err) { showNotice(kind, explain(err)); }
  });
  const del = el("button", {
    type: "button", class: "danger",
    onclick: async () => {
      if (!confirm(`Delete this ${kind} record from ${when(record.ts)}?`)) return;
      try {
        await api(`api/history/${kind}/${id}`, { method: "DELETE", write: true });
        await refreshHistory(kind, true);
      } catch (err) { showNotice(kind, explain(err)); }
    },
  }, "delete");
  return el("td", { class: "actions" }, download, del);
}

function renderKindChart(kind, newest) {
  const k = state.kinds[kind];
  let labels = [];
  let pp = [];
  let tg = [];
  if (KINDS[kind].x === "time") {
    const recent = newest.slice(0, 30).reverse();
    labels = recent.map((r) => when(r.ts).slice(5, 16));
    const first = recent.map((r) => rowsOf(r)[0]);
    pp = first.map((r) => r.pp_tps);
    tg = first.map((r) => r.tg_tps);
  } else if (newest.length) {
    const axis = KINDS[kind].x;
    const rows = rowsOf(newest[0]).filter((r) => isNum(r[axis])).sort((a, b) => a[axis] - b[axis]);
    labels = rows.map((r) => String(r[axis]));
    pp = rows.map((r) => r.pp_tps);
    tg = rows.map((r) => (kind === "conc" && isNum(r.total_tps) ? r.total_tps : r.tg_tps));
  }
  const tgLabel = kind === "conc" ? "generated t/s, all requests" : "generated t/s (per request)";
  if (!k.chart) {
    k.chart = new Chart(k.node.querySelector("canvas"), {
      type: KINDS[kind].x === "time" ? "line" : "bar",
      data: { labels, datasets: [
        { label: "prompt t/s (per request)", data: pp, borderColor: "#2f6fdb", backgroundColor: "#2f6fdbaa" },
        { label: tgLabel, data: tg, borderColor: "#d9822b", backgroundColor: "#d9822baa", yAxisID: "y1" },
      ] },
      options: {
        animation: false, responsive: true, maintainAspectRatio: false,
        plugins: { legend: { position: "bottom", labels: { boxWidth: 12 } },
                   title: { display: KINDS[kind].x !== "time", text: `latest run, by ${KINDS[kind].x}` } },
        scales: {
          y: { beginAtZero: true, title: { display: true, text: "prompt t/s" } },
          y1: { beginAtZero: true, position: "right", grid: { drawOnChartArea: false }, title: { display: true, text: "gen t/s" } },
        },
      },
    });
  } else {
    k.chart.data.labels = labels;
    k.chart.data.datasets[0].data = pp;
    k.chart.data.datasets[1].data = tg;
    k.chart.update("none");
  }
}

async function refreshHistory(kind, force = false) {
  const k = state.kinds[kind];
  const headers = !force && k.etag ? { "If-None-Match": k.etag } : {};
  try {
    const res = await api(`api/history/${kind}`, { headers });
    if (res.status === 304) return;
    k.etag = res.headers.get("ETag");
    renderRecords(kind, (await res.json()).records);
  } catch (err) { showNotice(kind, `history: ${explain(err)}`); }
}

function refreshAllHistory() { Object.keys(KINDS).forEach((kind) => refreshHistory(kind)); }

// --- runs ------------------------------------------------------------------------------------

function setStatus(kind, text, tone) {
  const badge = state.kinds[kind].node.querySelector(".run-status");
  badge.textContent = text;
  badge.className = `run-status badge ${tone ? `badge-${tone}` : ""}`;
}

function showNotice(kind, text) {
  state.kinds[kind].notice = text;
  setStatus(kind, text, "down");
}

function renderRuns(data) {
  state.active = data.active;
  for (const [kind, run] of Object.entries(data.runs)) {
    const k = state.kinds[kind];
    if (!k) continue;
    const mine = data.active === kind;
    k.node.querySelector(".run-start").disabled = data.active !== null;
    k.node.querySelector(".run-cancel").disabled = !mine;
    const log = k.node.querySelector(".run-log");
    const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
    log.textContent = run.log || "";
    if (atEnd) log.scrollTop = log.scrollHeight;
    // The log opens while its run is active and folds away when it ends (the record is below).
    const box = k.node.querySelector(".run-log-box");
    if (mine && !k.wasRunning) box.open = true;
    if (!mine && k.wasRunning) box.open = false;
    box.hidden = !run.log;
    k.wasRunning = mine;
    if (mine) {
      setStatus(kind, `${run.status} · ${Math.round(run.elapsed || 0)} s`, "run");
    } else if (k.notice) {
      setStatus(kind, k.notice, "down");  // why the last click did nothing, until the next one
    } else if (run.status === "idle") {
      setStatus(kind, data.active ? `waiting: a ${data.active} run is active` : "idle", "");
    } else {
      const tone = run.status === "finished" ? "up" : (run.status === "cancelled" ? "" : "down");
      const detail = run.message && run.status !== "finished" ? `: ${run.message}` : "";
      setStatus(kind, `${run.status}${detail}`, tone);
    }
  }
}

async function pollRuns() {
  clearTimeout(state.runTimer);
  state.runTimer = null;
  const wasActive = state.active;
  try {
    const data = await (await api("api/runs")).json();
    renderRuns(data);
    if (wasActive && !data.active) refreshHistory(wasActive, true);
    if (data.active) state.runTimer = setTimeout(pollRuns, 1000);
  } catch (_) {
    state.runTimer = setTimeout(pollRuns, 3000);
  }
}

async function startRun(kind, form) {
  const body = {};
  for (const [name] of KINDS[kind].fields) {
    const raw = form.elements[name].value.trim();
    if (raw !== "") body[name] = Number(raw);
  }
  const k = state.kinds[kind];
  try {
    await api(`api/runs/${kind}`, { method: "POST", body, write: true });
    k.notice = null;
  } catch (err) {
    k.notice = err.status === 409 ? `busy: ${err.message}` : explain(err);
  }
  pollRuns();
}

async function cancelRun(kind) {
  const button = state.kinds[kind].node.querySelector(".run-cancel");
  button.disabled = true;
  setStatus(kind, "cancelling…", "run");
  try {
    await api(`api/runs/${kind}/cancel`, { method: "POST", write: true });
    state.kinds[kind].notice = null;
  } catch (err) { state.kinds[kind].notice = explain(err); }
  pollRuns();
}

function setupKinds() {
  const panel = $("panel-bench");
  const template = $("kind-template");
  for (const [kind, spec] of Object.entries(KINDS)) {
    const node = template.content.firstElementChild.cloneNode(true);
    node.id = `kind-${kind}`;
    node.querySelector(".kind-title").textContent = spec.title;
    const fields = node.querySelector(".run-fields");
    for (const [name, label] of spec.fields) {
      fields.append(el("label", {}, `${label} `,
        el("input", { name, type: "number", min: "1", step: name === "duration" ? "any" : "1", placeholder: "default" })), " ");
    }
    const form = node.querySelector(".run-form");
    form.addEventListener("submit", (ev) => { ev.preventDefault(); startRun(kind, form); });
    node.querySelector(".run-cancel").addEventListener("click", () => cancelRun(kind));
    node.querySelector(".run-refresh").addEventListener("click", () => refreshHistory(kind, true));
    node.querySelector(".run-clear").addEventListener("click", async () => {
      if (!confirm(`Delete every ${kind} record? This cannot be undone.`)) return;
      try {
        await api(`api/history/${kind}/clear`, { method: "POST", write: true });
        await refreshHistory(kind, true);
      } catch (err) { showNotice(kind, explain(err)); }
    });
    panel.append(node);
    state.kinds[kind] = { node, etag: null, ids: null, chart: null, wasRunning: false, notice: null };
  }
}

// --- start -----------------------------------------------------------------------------------

async function loadInfo() {
  try {
    const info = await (await api("api/info")).json();
    state.info = info;
    state.baseDelay = Math.max(250, (info.poll_interval || 1) * 1000);
    state.pollDelay = state.baseDelay;
    if (info.engine_url) setText("engine-url", info.engine_url);
    // The concurrency ladder needs the engine's max_num_seqs; the profile's is the default.
    const seqs = state.kinds.conc.node.querySelector('input[name="max_num_seqs"]');
    seqs.placeholder = info.max_num_seqs ? String(info.max_num_seqs) : "required";
    return info;
  } catch (_) { return null; /* shown by the first poll */ }
}

async function main() {
  setupLiveCharts();
  setupKinds();
  setupTabs();
  const info = await loadInfo();
  if (info) setupAuth(info);
  await loadRing();
  pollMetrics();
  pollRuns();
  pollRouter();
  pollBoots();
  refreshAllHistory();
}

window.addEventListener("DOMContentLoaded", main);

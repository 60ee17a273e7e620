/* servewell console. Plain browser JavaScript, no build step: polls /console/api/state every 2 s
 * and draws it; the charts are uPlot (vendored next to this file). Every value from the server is
 * put on the page as text (textContent), never as HTML. */
"use strict";
(function () {
  const POLL_MS = 2000;
  const RECENT_ROWS = 100;
  // client_error: 4xx answers no model outcome counts (bad input, unknown model, rate limited).
  const OUTCOMES = ["success", "rejected", "deadline_exceeded", "cancelled", "error", "client_error"];
  const OUTCOME_LABELS = { deadline_exceeded: "deadline exceeded", client_error: "client error (4xx)" };
  const COLORS = {
    success: "#1a7f37", rejected: "#d97706", deadline_exceeded: "#7c3aed", cancelled: "#9ca3af", error: "#c62828",
    client_error: "#db2777",
    p50: "#2563eb", p99: "#c62828", mean: "#2563eb", rate: "#9ca3af",
  };
  // load: the time a request waited for its model to load (a cold start), before its queue.
  const STAGES = ["preprocess", "load", "queue", "compute", "postprocess"];
  const CHARTS = [
    // Success is drawn last, on top: when nothing fails, the zero lines of the others stay under it.
    { id: "requests", unit: "/s", series: OUTCOMES.slice().reverse().map((o) => ({ key: o, label: OUTCOME_LABELS[o] || o, stroke: COLORS[o] })) },
    { id: "latency", unit: " ms", series: [
      { key: "latency_p50_ms", label: "p50", stroke: COLORS.p50 }, { key: "latency_p99_ms", label: "p99", stroke: COLORS.p99 }] },
    { id: "queue", unit: " ms", series: [
      { key: "queue_p50_ms", label: "p50", stroke: COLORS.p50 }, { key: "queue_p99_ms", label: "p99", stroke: COLORS.p99 }] },
    { id: "batch", unit: "", series: [
      { key: "batch_mean", label: "mean rows", stroke: COLORS.mean },
      { key: "batches_per_s", label: "batches/s", stroke: COLORS.rate, scale: "rate" }] },
    { id: "compute", unit: " ms", series: [
      { key: "compute_p50_ms", label: "p50", stroke: COLORS.p50 }, { key: "compute_p99_ms", label: "p99", stroke: COLORS.p99 }] },
    { id: "cache", unit: "", series: [
      { key: "cache_hit_ratio", label: "hit ratio", stroke: COLORS.success },
      { key: "cache_hit", label: "hits/s", stroke: COLORS.p50, scale: "rate" },
      { key: "cache_miss", label: "misses/s", stroke: COLORS.rejected, scale: "rate" }] },
  ];

  const $ = (id) => document.getElementById(id);
  const store = window.sessionStorage;
  const auth = { key: store.getItem("servewell.apiKey") || "", admin: store.getItem("servewell.adminToken") || "" };
  const keysRequired = document.body.dataset.keysRequired === "true";
  // What the page holds, for people poking around in the devtools and for the browser tests.
  const page = (window.servewellConsole = { state: null, charts: {}, polls: 0, lastTry: null, marks: [] });
  let chartModel = "*";
  let recentTenant = ""; // "" : every tenant's recent requests
  let waitingForKey = false;
  let pollTimer = null;
  let lastOk = 0;

  /* ---------- small helpers ---------- */

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
    return (i ? n.toFixed(n >= 100 ? 0 : 1) : n) + " " + units[i];
  }
  function ms(v) {
    if (v === null || v === undefined) return "–";
    if (v >= 1000) return (v / 1000).toFixed(2) + " s";
    return (v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2)) + " ms";
  }
  function num(v) {
    if (v === null || v === undefined) return "–";
    const a = Math.abs(v);
    return a >= 100 ? v.toFixed(0) : a >= 10 ? v.toFixed(1) : a >= 1 ? v.toFixed(2) : v.toPrecision(2);
  }
  function duration(s) {
    s = Math.max(0, Math.floor(s));
    const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60);
    return d ? `${d}d ${h}h` : h ? `${h}h ${m}m` : m ? `${m}m ${s % 60}s` : `${s}s`;
  }
  function clock(unixS) { return new Date(unixS * 1000).toLocaleTimeString([], { hour12: false }); }
  function headers() {
    const h = {};
    if (auth.key) h["X-API-Key"] = auth.key;
    if (auth.admin) h.Authorization = "Bearer " + auth.admin;
    return h;
  }
  async function errorMessage(response) {
    try {
      const doc = await response.json();
      if (doc && doc.error) return `${response.status} ${doc.error.code}: ${doc.error.message}`;
    } catch (e) { /* not our JSON error */ }
    return `HTTP ${response.status}`;
  }

  /* ---------- access ---------- */

  function showAuth(why) {
    $("auth").hidden = false;
    if (why) $("auth-why").textContent = why;
  }
  $("auth-open").addEventListener("click", () => { $("auth").hidden = !$("auth").hidden; });
  $("auth-form").addEventListener("submit", (event) => {
    event.preventDefault();
    auth.key = $("auth-key").value.trim();
    auth.admin = $("auth-admin").value.trim();
    store.setItem("servewell.apiKey", auth.key);
    store.setItem("servewell.adminToken", auth.admin);
    $("auth").hidden = true;
    waitingForKey = false;
    pollNow();
  });
  $("auth-forget").addEventListener("click", () => {
    auth.key = auth.admin = "";
    store.removeItem("servewell.apiKey");
    store.removeItem("servewell.adminToken");
    $("auth-key").value = $("auth-admin").value = "";
  });

  /* ---------- polling ---------- */

  function setLive(ok, text) {
    const live = $("live");
    live.textContent = text;
    live.classList.toggle("stale", !ok);
  }
  function schedule() {
    clearTimeout(pollTimer);
    pollTimer = setTimeout(poll, POLL_MS);
  }
  function pollNow() { clearTimeout(pollTimer); poll(); }

  async function poll() {
    if (waitingForKey || (keysRequired && !auth.key && !auth.admin)) {
      // Asking without a key would only earn a 401 (and a console error) every 2 s. The admin token
      // alone is enough: an operator needs no tenant's key (api/access.py).
      waitingForKey = true;
      showAuth("This server needs an API key for its data, as for inference.");
      setLive(false, "needs an API key");
      return;
    }
    const url = `/console/api/state?model=${encodeURIComponent(chartModel)}&recent=${RECENT_ROWS}` +
      (recentTenant ? `&tenant=${encodeURIComponent(recentTenant)}` : "");
    try {
      const response = await fetch(url, { headers: headers(), cache: "no-store" });
      if (response.status === 401 || response.status === 429) {
        waitingForKey = response.status === 401;
        showAuth(await errorMessage(response));
        setLive(false, response.status === 401 ? "API key refused" : "rate limited");
      } else if ((response.status === 404 && (chartModel !== "*" || recentTenant)) ||
                 (response.status === 403 && recentTenant)) {
        chartModel = "*"; // the model (or the tenant) went away, or the key no longer sees that tenant
        recentTenant = "";
      } else if (!response.ok) {
        setLive(false, await errorMessage(response));
      } else {
        const doc = await response.json();
        page.state = doc;
        page.polls += 1;
        lastOk = Date.now();
        render(doc);
        setLive(true, "live · " + new Date().toLocaleTimeString([], { hour12: false }));
      }
    } catch (error) {
      setLive(false, lastOk ? `server unreachable (last data ${clock(lastOk / 1000)})` : "server unreachable");
      $("server-ready").className = "badge down";
      $("server-ready").textContent = "unreachable";
    }
    if (!waitingForKey) schedule();
  }

  // The on-call panels (oncall.js: changes, replacements, memory, caches, refusals) use these helpers.
  page.util = { el: el, clear: clear, bytes: bytes, ms: ms, num: num, clock: clock, duration: duration };
  const oncall = () => window.servewellOncall || null;

  function render(doc) {
    if (oncall()) page.marks = oncall().marks(doc); // before the charts: they draw the marks
    renderServer(doc.server);
    renderAlerts(doc.alerts || [], doc.alerts_evaluated_at);
    renderModels(doc.models);
    renderPool(doc.server.pool, doc.models);
    renderComputeByBatch(doc.models);
    renderCharts(doc.series);
    renderTryModels(doc.models);
    renderRecent(doc);
    renderTenants(doc.tenants);
    renderConfigBanner(doc.config);
    if (oncall()) oncall().render(doc);
  }

  /* Tenants (issue 22): weights, quotas, in progress and refusals by reason; the select filters the
     recent requests to one tenant (the server filters: ?tenant=). Admin data, as recent requests. */
  function renderTenants(tenants) {
    const select = $("recent-tenant");
    const body = $("tenants-table").tBodies[0];
    clear(body);
    const known = (tenants || []).map((t) => t.tenant);
    const wanted = ["", ...known];
    if ([...select.options].map((o) => o.value).join("\n") !== wanted.join("\n")) {
      clear(select);
      for (const name of wanted) select.appendChild(new Option(name || "all tenants", name));
    }
    select.value = known.includes(recentTenant) ? recentTenant : "";
    if (!tenants) {
      const cell = el("td", "muted", "tenants are operator data and follow the admin rule");
      cell.colSpan = 9;
      body.insertRow().appendChild(cell);
      return;
    }
    const quota = (v) => (v === null || v === undefined ? "–" : String(v));
    const STATUS_LOOK = { ok: "ok", refused: "slow", failing: "failed" };
    for (const t of tenants) {
      const row = body.insertRow();
      row.dataset.tenant = t.tenant;
      row.insertCell().appendChild(el("code", null, t.tenant));
      // Never "ok" while the tenant's requests are refused or fail: the server decides (last 30 s).
      const status = t.status || "ok";
      const badge = el("span", "badge tenant-status " + (STATUS_LOOK[status] || "slow"), status);
      badge.dataset.status = status;
      row.insertCell().appendChild(badge);
      row.insertCell().textContent = String(t.weight);
      row.insertCell().textContent = `${quota(t.rate_per_s)} / ${quota(t.max_concurrent)} / ${quota(t.max_queued)}`;
      row.insertCell().textContent = String(t.inflight);
      const last = t.last_30s || {};
      const recent = row.insertCell();
      recent.className = "recent-counts";
      recent.textContent = `${quota(last.admitted)} · ${quota(last.refused)} · ${quota(last.failed)}`;
      row.insertCell().textContent = `${t.admitted} · ${quota(t.refused)} · ${quota(t.failed)}`;
      row.insertCell().textContent = `${t.over_rate} / ${t.over_concurrency} / ${t.over_queue}`;
      row.insertCell().textContent = Object.keys(t.overrides || {}).join(", ") || "–";
    }
  }
  $("recent-tenant").addEventListener("change", (event) => {
    recentTenant = event.target.value;
    pollNow();
  });

  /* Rejected configuration files (hot reload), one line each: file, field, reason, time. The
     banner is made here so that index.html stays as it is; text only (textContent), never HTML. */
  function renderConfigBanner(config) {
    let banner = document.getElementById("config-banner");
    const rejected = (config && config.rejected) || [];
    if (!rejected.length) { if (banner) banner.hidden = true; return; }
    if (!banner) {
      banner = el("section", "card config-banner");
      banner.id = "config-banner";
      banner.setAttribute("role", "alert");
      document.querySelector("main").before(banner);
    }
    clear(banner);
    banner.hidden = false;
    banner.appendChild(el("strong", "", "Configuration change rejected: the running configuration is kept"));
    const list = el("ul");
    for (const r of rejected) {
      list.appendChild(el("li", "", `${clock(r.at)} ${r.file}` + (r.field && r.field !== "(top level)" ?
        ` field ${r.field}` : "") + `: ${r.reason}`));
    }
    banner.appendChild(list);
  }

  /* ---------- server and models ---------- */

  function renderServer(server) {
    // The same word as /healthz: ok (green "ready"), degraded (amber, with why), else red.
    const status = server.status || (server.ready ? "ok" : "not_ready");
    const look = { ok: ["ready", "ready"], degraded: ["degraded", "degraded"],
      shutting_down: ["not-ready", "shutting down"] }[status] || ["not-ready", "not ready"];
    const badge = $("server-ready");
    badge.className = "badge " + look[0];
    badge.textContent = look[1];
    badge.dataset.status = status;
    const reason = $("server-reason");
    reason.textContent = status === "ok" ? "" : (server.status_reason || "");
    reason.className = "status-reason " + look[0];
    const budget = server.memory_budget;
    $("server-facts").textContent = [
      "v" + server.version,
      "up " + duration(Date.now() / 1000 - server.started_at),
      "engine + ingress RSS " + bytes(server.frontend_rss_bytes), // as /healthz: memory per process below
      `model memory budget ${bytes(budget.total_bytes)} (${bytes(budget.reserved_bytes)} reserved)`,
      `slow > ${server.slow_request_ms} ms`,
    ].join(" · ");
  }

  function renderModels(models) {
    const body = $("models").tBodies[0];
    clear(body);
    if (!models.length) {
      const row = body.insertRow();
      const cell = el("td", "muted", "no models in the repository");
      cell.colSpan = 12;
      row.appendChild(cell);
      return;
    }
    for (const m of models) {
      const row = body.insertRow();
      row.dataset.model = m.name;
      row.className = "model-row";
      const name = row.insertCell();
      name.appendChild(el("strong", null, m.name));
      name.appendChild(el("div", "muted small", [m.version && "v" + m.version, m.runtime].filter(Boolean).join(" · ")));
      if (m.batching) {
        const b = m.batching;
        name.appendChild(el("div", "muted small", `${b.policy} · wait ${b.max_wait_ms} ms · queue ≤ ${b.max_queue_size}`));
      }
      const state = row.insertCell();
      state.appendChild(el("span", "badge " + m.state, m.state));
      if (m.reason) {
        // An evicted or not yet loaded model is not a failure: its reason is shown, not in red.
        const quiet = m.residency === "evicted" || m.residency === "not_loaded";
        const reason = el("div", quiet ? "reason quiet" : "reason", m.reason);
        reason.title = m.reason; // three lines shown, all of it on hover
        state.appendChild(reason);
      }
      if (m.load_s !== null) state.appendChild(el("div", "muted small", `loaded in ${m.load_s} s`));
      state.appendChild(poolLine(m));
      if (m.rollout) state.appendChild(rolloutLine(m.rollout));
      if (m.streams) state.appendChild(streamLine(m.name, m.streams));
      const instances = row.insertCell();
      // An evicted or never loaded model has no worker: its last processes are history, not down.
      const shown = m.residency === "evicted" || m.residency === "not_loaded" ? [] : m.instances;
      if (!shown.length) instances.appendChild(el("span", "muted", "–"));
      for (const i of shown) {
        const line = el("div", "instance");
        line.appendChild(el("span", "dot" + (i.alive ? " alive" : "")));
        line.appendChild(document.createTextNode(`#${i.instance} pid ${i.pid === null ? "–" : i.pid} · ${bytes(i.rss_bytes)}`));
        line.title = `${i.rows_computed} rows computed`;
        instances.appendChild(line);
      }
      if (m.restarts) {
        // Every replacement is a restart, with its cause (crash, hung, memory), as /healthz and the metric count them.
        const by = m.restarts_by_reason || {};
        const causes = Object.keys(by).filter((r) => by[r]).map((r) => `${by[r]} ${r}`).join(", ");
        const line = el("div", "muted small restarts", `${m.restarts} restart${m.restarts === 1 ? "" : "s"} (${causes})`);
        const last = (m.replacements || [])[(m.replacements || []).length - 1];
        if (last) {
          const gap = last.gap_s === null ? `under way ${num(last.open_s || 0)} s` : `gap ${num(last.gap_s)} s`;
          line.appendChild(el("div", last.clients_waited ? "gap waited" : "gap",
            `last: #${last.instance} ${last.reason} at ${clock(last.at)}, ${gap}` +
            (last.clients_waited ? ", no other instance served" : "")));
          line.title = last.detail;
        }
        instances.appendChild(line);
      }
      const lanes = row.insertCell();
      const names = Object.keys(m.lanes);
      if (!names.length) lanes.appendChild(el("span", "muted", "–"));
      for (const lane of names) lanes.appendChild(el("span", "lane", `${lane} ${m.lanes[lane]}`));
      row.insertCell().textContent = String(m.running_rows);
      const batch = row.insertCell();
      batch.textContent = m.max_batch_size === null ? "–" : String(m.max_batch_size);
      if (m.max_batch_size !== null && m.configured_max_batch_size !== null && m.max_batch_size !== m.configured_max_batch_size) {
        batch.appendChild(el("div", "muted small", `of ${m.configured_max_batch_size} configured`));
      }
      const s = m.scheduler;
      row.insertCell().textContent = s ? `${s.batches} · ${s.rows}` : "–";
      row.insertCell().textContent = s ? `${s.rejected} · ${s.expired} · ${s.cancelled}` : "–";
      renderSignals(row, m);
    }
    markSlowest(body, models);
  }

  /* ---------- a generative model's live streams: running and waiting sequences, parts per second ---------- */
  const lastParts = {}; // model -> {parts, at}: the parts' rate between two polls
  function streamLine(model, st) {
    const line = el("div", "stream-line small");
    line.dataset.streamsRunning = String(st.running);
    line.dataset.streamsWaiting = String(st.waiting);
    const now = Date.now() / 1000;
    const before = lastParts[model];
    lastParts[model] = { parts: st.parts, at: now };
    const rate = before && now > before.at && st.parts >= before.parts ? (st.parts - before.parts) / (now - before.at) : null;
    line.appendChild(el("span", "badge streams" + (st.running ? " live" : ""),
      `${st.running} stream${st.running === 1 ? "" : "s"} of ${st.max_sequences}`));
    const facts = [`${st.waiting} waiting`, `${num(st.parts)} parts` + (rate === null ? "" : ` · ${num(rate)}/s`)];
    line.appendChild(el("span", "muted", facts.join(" · ")));
    const ended = Object.keys(st.ended).filter((k) => st.ended[k]).map((k) => `${st.ended[k]} ${k}`).join(", ");
    line.title = `${st.batching} batching; ${st.started} started since load` + (ended ? `; ended: ${ended}` : "");
    return line;
  }

  /* ---------- safe rollouts: a traffic split's state, the weights in force, why it rolled back ---------- */

  const ROLLOUT_LABELS = { rolled_back: "rolled back" };

  function rolloutLine(r) {
    const line = el("div", "rollout-line small");
    line.dataset.rolloutState = r.state;
    line.appendChild(el("span", "badge rollout-" + r.state, ROLLOUT_LABELS[r.state] || r.state));
    const total = Object.values(r.weights).reduce((a, b) => a + b, 0);
    const percent = (x) => +x.toFixed(1); // 95, 5, 33.3
    const shares = Object.keys(r.weights).sort().map((v) => `v${v} ${percent(total > 0 ? r.weights[v] / total * 100 : 0)}%`);
    if (r.shadow && r.shadow.percent > 0) shares.push(`shadow v${r.shadow.version} ${percent(r.shadow.percent)}%`);
    line.appendChild(el("span", "muted", shares.join(" · ")));
    if (r.state === "rolled_back" && r.reason) {
      const reason = el("div", "reason", r.reason); // the rule's numbers; the evidence: GET /admin/models/NAME/rollout
      reason.title = r.reason;
      line.appendChild(reason);
    }
    line.title = "since " + new Date(r.changed_at * 1000).toLocaleString();
    return line;
  }

  /* ---------- the model pool: each model's residency, and the summary ---------- */

  const RESIDENCY_LABELS = { not_loaded: "not loaded" };

  function poolLine(m) {
    // Where the model is (resident, loading, evicted, not loaded...), its pin, estimated memory and last use.
    const line = el("div", "pool-line small");
    const residency = m.residency || "resident";
    line.dataset.residency = residency;
    line.appendChild(el("span", "residency " + residency, RESIDENCY_LABELS[residency] || residency));
    if (m.pinned) line.appendChild(el("span", "pin", "pinned"));
    const facts = [];
    if (m.estimated_bytes !== null && m.estimated_bytes !== undefined) facts.push("est. " + bytes(m.estimated_bytes));
    facts.push(m.last_used_at ? "used " + clock(m.last_used_at) : "never used");
    const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;
    if (m.cold_starts || m.evictions) facts.push(plural(m.cold_starts, "cold start") + " · " + plural(m.evictions, "eviction"));
    line.appendChild(el("span", "muted", facts.join(" · ")));
    if (m.last_used_at) line.title = "last request at " + new Date(m.last_used_at * 1000).toLocaleString();
    return line;
  }

  function renderPool(pool, models) {
    const box = $("pool-summary");
    if (!pool) { box.textContent = ""; return; }
    const parts = [
      `${pool.mode} repository`,
      `${pool.resident} of ${pool.models} resident`,
      `${pool.loading} loading`,
      `${pool.pinned} pinned`,
      `reserved ${bytes(pool.reserved_bytes)} of ${bytes(pool.budget_bytes)}`,
    ];
    if (pool.device_budget_bytes !== null && pool.device_budget_bytes !== undefined) {
      parts.push(`device ${bytes(pool.device_reserved_bytes)} of ${bytes(pool.device_budget_bytes)}`);
    } else if (pool.device_reserved_bytes) {
      parts.push(`device ${bytes(pool.device_reserved_bytes)} reserved`);
    }
    const evicted = models.filter((m) => m.residency === "evicted").length;
    if (evicted) parts.push(`${evicted} evicted`);
    box.textContent = parts.join(" · ");
    box.dataset.mode = pool.mode;
  }

  /* ---------- per-model golden signals, p99 split, compute by batch size ---------- */

  function renderSignals(row, m) {
    const g = m.signals || {};
    const cell = (cls, text) => { const c = row.insertCell(); c.className = cls; c.textContent = text; return c; };
    cell("num rps", g.requests_per_s === undefined || g.requests_per_s === null ? "–" : num(g.requests_per_s));
    cell("num p50", ms(g.latency_p50_ms));
    cell("num p99", ms(g.latency_p99_ms));
    const errors = cell("num errors", g.error_ratio === undefined || g.error_ratio === null ? "–"
      : (100 * g.error_ratio).toFixed(g.error_ratio >= 0.1 ? 0 : 1) + "%");
    if (g.error_ratio > 0) errors.classList.add("bad");
    // The p99 split gets a line of its own under the model: a column would push the table off-screen.
    const splitRow = row.parentNode.insertRow();
    splitRow.className = "split-row";
    splitRow.dataset.model = m.name;
    splitRow.insertCell();
    const split = splitRow.insertCell();
    split.colSpan = 11;
    split.className = "split";
    split.appendChild(el("span", "split-label muted small", "p99 split"));
    const ls = m.latency_split;
    if (!ls || !ls.p99_ms) {
      split.appendChild(el("span", "muted small", ls ? ls.reading : "–"));
      if (oncall()) split.appendChild(oncall().diagnosis(m));
      return;
    }
    const bar = el("div", "stack wide");
    const parts = [["queue", ls.queue_ms], ["compute", ls.compute_ms], ["preprocess", ls.preprocess_ms],
      ["postprocess", ls.postprocess_ms]].filter(([, v]) => v);
    bar.title = parts.map(([k, v]) => `${k} ${ms(v)}`).join(" · ") + ` of p99 ${ms(ls.p99_ms)}`;
    for (const [kind, value] of parts) {
      const part = el("span", kind);
      part.style.width = (100 * Math.min(1, value / ls.p99_ms)).toFixed(2) + "%";
      bar.appendChild(part);
    }
    split.appendChild(bar);
    split.appendChild(el("span", "muted small", (parts.length ? parts.map(([k, v]) => `${k} ${ms(v)}`).join(" · ")
      : "no stage measured") + ` of ${ms(ls.p99_ms)}`));
    split.appendChild(el("span", "reading small", ls.reading)); // what the stages alone say
    // Under it, the model's reading (a tenant, the cache, a replacement, the CPU, then the stages),
    // with its evidence and what to do.
    if (oncall() && m.diagnosis) split.appendChild(oncall().diagnosis(m));
  }

  function markSlowest(body, models) {
    // The slow model stands out without picking it in the chart menu.
    const p99s = models.map((m) => (m.signals && m.signals.latency_p99_ms) || 0);
    const worst = Math.max(0, ...p99s);
    if (models.length < 2 || worst <= 0) return;
    models.forEach((m, i) => {
      if (p99s[i] === worst) body.querySelector(`tr[data-model="${CSS.escape(m.name)}"] td.p99`).classList.add("worst");
    });
  }

  function renderComputeByBatch(models) {
    const box = $("compute-by-batch");
    const withRows = models.filter((m) => Array.isArray(m.compute_by_batch_size) && m.compute_by_batch_size.length);
    box.hidden = withRows.length === 0;
    clear(box);
    if (!withRows.length) return;
    box.appendChild(el("h3", null, "Compute time per batch, by batch size"));
    for (const m of withRows) {
      const rows = m.compute_by_batch_size.slice().sort((a, b) => a.batch_size - b.batch_size);
      const worst = Math.max(1e-9, ...rows.map((r) => r.p99_ms || 0));
      const table = el("table", "grid by-batch-table");
      table.dataset.model = m.name;
      table.createCaption().textContent = m.name;
      const head = table.createTHead().insertRow();
      for (const h of ["batch size", "batches", "p50", "p99", ""]) head.appendChild(el("th", null, h));
      const body = table.createTBody();
      for (const r of rows) {
        const row = body.insertRow();
        row.insertCell().textContent = String(r.batch_size);
        row.insertCell().textContent = String(r.count);
        row.insertCell().textContent = ms(r.p50_ms);
        row.insertCell().textContent = ms(r.p99_ms);
        const bar = el("div", "hbar");
        const fill = el("span");
        fill.style.width = (100 * Math.min(1, (r.p99_ms || 0) / worst)).toFixed(1) + "%";
        bar.appendChild(fill);
        row.insertCell().appendChild(bar);
      }
      box.appendChild(table);
    }
  }

  /* ---------- active alerts ---------- */

  function renderAlerts(alerts, evaluatedAt) {
    const list = $("alerts-list");
    clear(list);
    $("alerts-note").textContent = evaluatedAt
      ? `evaluated by this server; last at ${clock(evaluatedAt)}` : "evaluated by this server; not yet evaluated";
    if (!alerts.length) {
      list.appendChild(el("li", "muted none", "none"));
      return;
    }
    for (const a of alerts) {
      const item = el("li", "alert " + a.severity);
      item.dataset.alert = a.name;
      item.dataset.model = a.model;
      const head = el("div", "alert-head");
      head.appendChild(el("span", "badge " + (a.severity === "critical" ? "failed" : "slow"), a.severity));
      head.appendChild(el("strong", null, a.summary));
      head.appendChild(el("span", "muted small", `${a.prometheus || a.name} · since ${clock(a.since)}`));
      item.appendChild(head);
      item.appendChild(el("div", "small action", "What to do: " + a.action));
      list.appendChild(item);
    }
  }

  /* ---------- charts ---------- */

  function chartOptions(spec, width) {
    const axis = { stroke: "#6b7280", grid: { stroke: "#eef0f3", width: 1 }, ticks: { stroke: "#e3e6eb", width: 1 } };
    const scales = { x: { time: true }, y: { range: (u, min, max) => [0, max > 0 ? max * 1.15 : 1] } };
    const xAxis = Object.assign({}, axis, { space: 70, values: (u, ticks, i, space, incr) => ticks.map((t) => timeTick(t, incr)) });
    const axes = [xAxis, Object.assign({}, axis, { scale: "y", size: 52, values: (u, ticks) => ticks.map(num) })];
    if (spec.series.some((s) => s.scale === "rate")) {
      scales.rate = { range: (u, min, max) => [0, max > 0 ? max * 1.15 : 1] };
      axes.push(Object.assign({}, axis, { scale: "rate", side: 1, size: 46, grid: { show: false },
        values: (u, ticks) => ticks.map(num) }));
    }
    return {
      width: width,
      height: 190,
      scales: scales,
      axes: axes,
      cursor: { drag: { x: false, y: false } },
      hooks: { draw: [drawMarks] },
      series: [{}].concat(spec.series.map((s) => ({
        label: s.label, stroke: s.stroke, width: 2, scale: s.scale || "y",
        value: (u, v) => (v === null || v === undefined ? "–" : num(v) + (s.scale === "rate" ? "/s" : spec.unit)),
      }))),
    };
  }

  // Changes (the audit trail) and worker replacements, lined up with every chart: a dashed line at
  // each, the replacement's gap shaded (oncall.js computes `page.marks`).
  function drawMarks(u) {
    const marks = page.marks || [];
    if (!marks.length) return;
    const ctx = u.ctx;
    const { left, top, width, height } = u.bbox;
    ctx.save();
    for (const m of marks) {
      const x0 = u.valToPos(m.t, "x", true);
      if (!(x0 >= left && x0 <= left + width)) continue;
      if (m.until) {
        const x1 = Math.min(left + width, u.valToPos(m.until, "x", true));
        ctx.fillStyle = "rgba(198, 40, 40, 0.12)";
        ctx.fillRect(x0, top, Math.max(2, x1 - x0), height);
      }
      ctx.strokeStyle = m.kind === "replacement" ? "#c62828" : "#7c3aed";
      ctx.lineWidth = 1;
      ctx.setLineDash([4, 3]);
      ctx.beginPath();
      ctx.moveTo(x0, top);
      ctx.lineTo(x0, top + height);
      ctx.stroke();
    }
    ctx.restore();
  }

  function timeTick(unixS, incrS) {
    const d = new Date(unixS * 1000);
    const two = (n) => String(n).padStart(2, "0");
    const hm = `${two(d.getHours())}:${two(d.getMinutes())}`;
    return incrS < 60 ? `${hm}:${two(d.getSeconds())}` : hm;
  }

  function chartData(spec, columns) {
    return [columns.t].concat(spec.series.map((s) => columns[s.key]));
  }

  function renderCharts(series) {
    const select = $("chart-model");
    const wanted = ["*"].concat(series.models.filter((m) => m !== "*"));
    const have = Array.from(select.options).map((o) => o.value);
    if (wanted.join("\n") !== have.join("\n")) {
      clear(select);
      for (const name of wanted) select.appendChild(new Option(name === "*" ? "all models" : name, name));
      select.value = chartModel;
    }
    const note = $("charts-note");
    if (!series.enabled) note.textContent = "metrics are turned off on this server (--metrics-enabled false): no charts";
    else if (!series.columns.t.length) note.textContent = `no traffic recorded yet; a point every ${series.interval_s} s`;
    else note.textContent = `one point every ${series.interval_s} s, the last ${Math.round(series.window_s / 60)} min`;
    for (const spec of CHARTS) {
      const figure = $("chart-" + spec.id);
      const data = chartData(spec, series.columns);
      const chart = page.charts[spec.id];
      if (chart) chart.setData(data);
      else page.charts[spec.id] = new uPlot(chartOptions(spec, chartWidth(figure)), data, figure);
    }
  }

  function chartWidth(figure) { return Math.max(280, Math.floor(figure.clientWidth)); }

  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => {
      for (const spec of CHARTS) {
        const chart = page.charts[spec.id];
        if (chart) chart.setSize({ width: chartWidth($("chart-" + spec.id)), height: 190 });
      }
    }, 150);
  });
  $("chart-model").addEventListener("change", (event) => { chartModel = event.target.value; pollNow(); });

  /* ---------- recent slow and failed requests ---------- */

  function stageBar(stages, total) {
    const bar = el("div", "stack");
    const known = STAGES.filter((s) => stages[s] !== undefined);
    bar.title = known.length ? known.map((s) => `${s} ${ms(stages[s])}`).join(" · ") + ` · total ${ms(total)}`
      : "no stages: the request stopped before its model ran";
    for (const s of known) {
      const part = el("span", s);
      part.style.width = (100 * Math.min(1, stages[s] / Math.max(total, 1e-9))).toFixed(2) + "%";
      bar.appendChild(part);
    }
    return bar;
  }

  function batchFacts(r) {
    // Which batch and worker served it (fields present once the server records them).
    const box = el("div", "batch-facts small");
    const facts = [];
    if (r.batch_size !== undefined && r.batch_size !== null) facts.push(`${r.batch_size} rows`);
    if (r.instance !== undefined && r.instance !== null) facts.push(`#${r.instance}`);
    if (r.queue_position !== undefined && r.queue_position !== null) facts.push(`pos ${r.queue_position}`);
    box.textContent = facts.length ? facts.join(" · ") : "–";
    if (r.batch_id !== undefined && r.batch_id !== null) box.title = `batch ${r.batch_id}`;
    return box;
  }

  function renderRecent(doc) {
    const note = $("recent-note");
    const body = $("recent-table").tBodies[0];
    clear(body);
    if (doc.recent === null) {
      note.textContent = "Per-request records are operator data and follow the admin rule: " +
        (doc.server.admin_reason || "") + " (enter the admin token under Keys).";
      return;
    }
    const slowFailed = `(slow: over ${doc.server.slow_request_ms} ms; failed: any 4xx/5xx); newest first; ` +
      "no payloads are kept.";
    note.textContent = doc.server.tenant
      ? `Tenant ${doc.server.tenant}'s own requests only ${slowFailed} Other tenants' and the whole ` +
        "server's are operator data (the admin token or an operator key)."
      : `${doc.recent_recorded} recorded since the server started ${slowFailed}`;
    const filter = $("recent-filter").value.trim().toLowerCase();
    for (const r of doc.recent) {
      const haystack = [r.request_id, r.route, r.model, r.code, String(r.status), r.batch_id || ""].join(" ").toLowerCase();
      if (filter && !haystack.includes(filter)) continue;
      const row = body.insertRow();
      row.dataset.requestId = r.request_id;
      if (filter && r.request_id.toLowerCase() === filter) row.className = "highlight";
      row.insertCell().textContent = clock(r.at);
      const rid = row.insertCell();
      rid.className = "rid";
      rid.appendChild(el("code", null, r.request_id));
      const route = row.insertCell();
      route.className = "route";
      route.textContent = r.route;
      row.insertCell().textContent = r.model || "–";
      const status = row.insertCell();
      if (r.status >= 400) status.appendChild(el("span", "badge failed", `${r.status} ${r.code}`.trim()));
      else status.appendChild(el("span", "badge ok", String(r.status)));
      if (r.slow) status.appendChild(el("span", "badge slow", "slow"));
      row.insertCell().textContent = ms(r.total_ms);
      row.insertCell().appendChild(stageBar(r.stages_ms, r.total_ms));
      row.insertCell().appendChild(batchFacts(r));
    }
    if (!body.rows.length) {
      const cell = el("td", "muted", filter ? "nothing matches the filter" : "none yet");
      cell.colSpan = 8;
      body.insertRow().appendChild(cell);
    }
  }
  $("recent-filter").addEventListener("input", () => { if (page.state) renderRecent(page.state); });

  /* ---------- try it ---------- */

  function renderTryModels(models) {
    const select = $("try-model");
    const names = models.filter((m) => m.takes_images && m.state === "ready").map((m) => m.name);
    $("try-none").hidden = names.length > 0;
    $("try-body").hidden = names.length === 0;
    const have = Array.from(select.options).map((o) => o.value);
    if (names.join("\n") !== have.join("\n")) {
      const previous = select.value;
      clear(select);
      for (const name of names) select.appendChild(new Option(name, name));
      if (names.includes(previous)) select.value = previous;
    }
  }

  function parseServerTiming(value) {
    const stages = {};
    for (const part of (value || "").split(",")) {
      const [name, ...params] = part.trim().split(";");
      const dur = params.map((p) => p.trim()).find((p) => p.startsWith("dur="));
      if (name && dur) stages[name.trim()] = parseFloat(dur.slice(4));
    }
    return stages;
  }

  function renderWaterfall(stages, roundTripMs) {
    const box = $("try-waterfall");
    clear(box);
    const total = stages.total !== undefined ? stages.total : 0;
    const scale = Math.max(roundTripMs, total, 1e-9);
    const rows = [];
    let at = 0;
    for (const s of STAGES) {
      if (stages[s] === undefined) continue;
      rows.push([s, s, at, stages[s]]); // the stages run one after another
      at += stages[s];
    }
    if (stages.total !== undefined) rows.push(["server total", "total", 0, total]);
    rows.push(["browser round trip", "network", 0, roundTripMs]);
    for (const [label, kind, start, length] of rows) {
      box.appendChild(el("span", null, label));
      const track = el("div", "track");
      const seg = el("div", "seg " + kind);
      seg.style.left = (100 * start / scale).toFixed(2) + "%";
      seg.style.width = (100 * length / scale).toFixed(2) + "%";
      track.appendChild(seg);
      box.appendChild(track);
      box.appendChild(el("span", "ms", ms(length)));
    }
  }

  function renderTopK(result) {
    const list = $("try-topk");
    clear(list);
    if (!result || !Array.isArray(result.top_k)) {
      list.appendChild(el("li", "mono", JSON.stringify(result).slice(0, 2000)));
      return;
    }
    for (const item of result.top_k) {
      const li = el("li");
      li.appendChild(el("span", "label", item.label));
      const bar = el("div", "bar");
      const fill = el("span");
      fill.style.width = (100 * Math.max(0, Math.min(1, item.score))).toFixed(1) + "%";
      bar.appendChild(fill);
      li.appendChild(bar);
      li.appendChild(el("span", "score", item.score.toFixed(4)));
      list.appendChild(li);
    }
  }

  function readAsBase64(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(String(reader.result).replace(/^data:[^,]*,/, ""));
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
  }

  async function tryImage(file) {
    const model = $("try-model").value;
    if (!file || !model) return;
    const preview = $("try-preview");
    if (preview.src.startsWith("blob:")) URL.revokeObjectURL(preview.src);
    preview.src = URL.createObjectURL(file);
    preview.hidden = false;
    $("try-drop-text").textContent = file.name;
    $("try-result").hidden = false;
    const error = $("try-error");
    error.hidden = true;
    clear($("try-topk"));
    clear($("try-waterfall"));
    $("try-request-id").textContent = "…";
    const limit = page.state ? page.state.server.max_body_bytes : Infinity;
    if (file.size * 4 / 3 + 200 > limit) {
      error.textContent = `${bytes(file.size)} is too large: base64 in JSON must fit the server's body limit of ${bytes(limit)}`;
      error.hidden = false;
      $("try-request-id").textContent = "–";
      return;
    }
    const body = JSON.stringify({ image_base64: await readAsBase64(file), model: model });
    const started = performance.now();
    let response;
    try {
      response = await fetch("/predict", { method: "POST", headers: Object.assign({ "Content-Type": "application/json" }, headers()), body: body });
    } catch (e) {
      error.textContent = "the server did not answer";
      error.hidden = false;
      return;
    }
    const roundTrip = performance.now() - started;
    const requestId = response.headers.get("X-Request-ID") || "";
    $("try-request-id").textContent = requestId;
    $("try-request-id").dataset.requestId = requestId;
    const stages = parseServerTiming(response.headers.get("Server-Timing"));
    page.lastTry = { status: response.status, requestId: requestId, stages: stages, roundTripMs: roundTrip };
    if (!response.ok) {
      error.textContent = await errorMessage(response);
      error.hidden = false;
    } else {
      const doc = await response.json();
      page.lastTry.result = doc.result;
      renderTopK(doc.result);
    }
    renderWaterfall(stages, roundTrip);
  }

  const fileInput = $("try-file");
  const drop = $("try-drop");
  fileInput.addEventListener("change", () => { if (fileInput.files.length) tryImage(fileInput.files[0]); });
  drop.addEventListener("dragover", (event) => { event.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (event) => {
    event.preventDefault();
    drop.classList.remove("over");
    if (!event.dataTransfer.files.length) return;
    fileInput.files = event.dataTransfer.files; // one path for dropped and chosen files
    fileInput.dispatchEvent(new Event("change"));
  });
  $("try-request-id").addEventListener("click", (event) => {
    const id = event.currentTarget.dataset.requestId;
    if (!id) return;
    $("recent-filter").value = id; // slow or failed ones are listed under Recent; others only in the logs
    if (page.state) renderRecent(page.state);
  });

  poll();
})();

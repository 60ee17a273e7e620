/* servewell console: the on-call panels (issue 47). Loaded before console.js, which calls
 * `window.servewellOncall.marks(doc)` before it draws the charts and `.render(doc)` after the rest;
 * both read the console's JSON only (/console/api/state). Every value goes on the page as text
 * (textContent), never as HTML. Helpers come from console.js (`servewellConsole.util`). */
"use strict";
(function () {
  const MIB = 1024 * 1024;
  const PROCESS_COLORS = ["#2563eb", "#d97706", "#1a7f37", "#7c3aed", "#db2777", "#0891b2", "#c62828", "#6b7280"];
  let memoryChart = null;
  let memoryKey = "";

  const u = () => window.servewellConsole.util;
  const $ = (id) => document.getElementById(id);

  /* ---------- marks on the charts: changes and worker replacements ---------- */

  function marks(doc) {
    const found = [];
    for (const c of doc.audit || []) found.push({ t: c.at, kind: "change", label: c.summary });
    for (const m of doc.models || []) {
      for (const r of m.replacements || []) {
        const gap = r.gap_s !== null && r.gap_s !== undefined ? r.gap_s : r.open_s || 0;
        found.push({ t: r.at, until: r.at + gap, kind: "replacement", label: `${m.name} #${r.instance} ${r.reason}` });
      }
    }
    return found;
  }

  /* ---------- a model's diagnosis: reading, evidence, advice ---------- */

  function diagnosis(m) {
    const { el } = u();
    const d = m.diagnosis;
    const box = el("div", "diagnosis small");
    box.dataset.model = m.name;
    if (!d) {
      box.appendChild(el("span", "muted", "no reading yet"));
      return box;
    }
    box.dataset.cause = d.cause;
    box.appendChild(el("span", "cause cause-" + d.cause, d.cause.replace(/_/g, " ")));
    box.appendChild(el("span", "reading", d.reading));
    if (d.evidence && d.evidence.length) {
      const list = el("ul", "evidence");
      for (const line of d.evidence) list.appendChild(el("li", null, line));
      box.appendChild(list);
    }
    if (d.advice) box.appendChild(el("div", "advice", "What to do: " + d.advice));
    return box;
  }

  /* ---------- changes and replacements, newest first ---------- */

  function renderChanges(doc) {
    const { el, clear, clock, num } = u();
    const list = $("changes-list");
    clear(list);
    const items = [];
    for (const c of doc.audit || []) items.push({ at: c.at, kind: "change", c: c });
    for (const m of doc.models || []) for (const r of m.replacements || []) items.push({ at: r.at, kind: "replacement", m: m, r: r });
    items.sort((a, b) => b.at - a.at);
    $("changes-note").textContent = doc.audit === null
      ? "changes are operator data (the admin token or an operator key): worker replacements only"
      : "the last minutes, marked on the charts above; GET /admin/audit has the server's latest 500 changes";
    if (!items.length) {
      list.appendChild(el("li", "muted none", "no change and no worker replaced in the charts' window"));
      return;
    }
    for (const item of items) {
      const li = el("li", "change " + item.kind);
      li.dataset.kind = item.kind;
      li.appendChild(el("span", "when", clock(item.at)));
      if (item.kind === "change") {
        const c = item.c;
        li.dataset.target = c.target;
        li.appendChild(el("span", "badge change-badge", c.what));
        li.appendChild(el("strong", null, c.summary));
        li.appendChild(el("span", "muted", ` by ${c.who} (${c.via})`));
        const diff = el("div", "diff mono small", `${short(c.old)} → ${short(c.new)}`);
        diff.title = JSON.stringify({ old: c.old, new: c.new });
        li.appendChild(diff);
      } else {
        const r = item.r;
        li.dataset.target = item.m.name;
        li.appendChild(el("span", "badge failed", "replaced"));
        const gap = r.gap_s === null ? `under way (${num(r.open_s || 0)} s)` : `gap ${num(r.gap_s)} s`;
        li.appendChild(el("strong", null, `${item.m.name} #${r.instance}: ${r.reason}, ${gap}`));
        li.appendChild(el("span", "muted", r.clients_waited ? " · no other instance served: requests waited"
          : ` · ${r.others_serving} other instance(s) served`));
        li.appendChild(el("div", "diff small", r.detail));
      }
      list.appendChild(li);
    }
  }

  function short(value) {
    const text = value === undefined ? "–" : JSON.stringify(value);
    return text.length > 160 ? text.slice(0, 157) + "..." : text;
  }

  /* ---------- memory per process ---------- */

  function renderMemory(memory) {
    const { el, clear, bytes, duration } = u();
    const body = $("memory-table").tBodies[0];
    clear(body);
    if (!memory) return;
    $("memory-note").textContent = `every figure: ${memory.definition}; a point every ${memory.interval_s} s`;
    for (const p of memory.processes || []) {
      const row = body.insertRow();
      row.dataset.process = p.name;
      row.insertCell().appendChild(el("code", null, p.name));
      row.insertCell().textContent = p.pid === null ? "–" : String(p.pid);
      row.insertCell().textContent = bytes(p.rss_bytes);
      const growth = row.insertCell();
      growth.textContent = p.growth_bytes_per_s === null ? "–" : `${(p.growth_bytes_per_s * 60 / MIB).toFixed(1)} MiB/min`;
      if (p.growth_bytes_per_s > 0 && p.limit_bytes) growth.className = "growing";
      row.insertCell().textContent = p.limit_bytes ? bytes(p.limit_bytes) : "–";
      const left = row.insertCell();
      left.className = "to-limit";
      left.textContent = p.seconds_to_limit === null ? "–" : duration(p.seconds_to_limit);
      if (p.seconds_to_limit !== null && p.seconds_to_limit < 300) left.classList.add("soon");
    }
    drawMemory(memory.series || []);
  }

  function drawMemory(series) {
    const figure = $("chart-memory");
    if (typeof uPlot === "undefined" || !figure) return;
    // One x axis for every process: the union of their times (the engine's ticks are everyone's).
    const times = Array.from(new Set(series.flatMap((s) => s.t))).sort((a, b) => a - b);
    const index = new Map(times.map((t, i) => [t, i]));
    const data = [times];
    for (const s of series) {
      const column = new Array(times.length).fill(null);
      s.t.forEach((t, i) => { column[index.get(t)] = s.rss_bytes[i] / 1e6; });
      data.push(column);
    }
    const key = series.map((s) => s.name).join("\n");
    if (memoryChart && key === memoryKey) {
      memoryChart.setData(data);
      return;
    }
    if (memoryChart) memoryChart.destroy();
    const caption = figure.querySelector("figcaption");
    while (figure.lastChild && figure.lastChild !== caption) figure.removeChild(figure.lastChild);
    memoryKey = key;
    const axis = { stroke: "#6b7280", grid: { stroke: "#eef0f3", width: 1 }, ticks: { stroke: "#e3e6eb", width: 1 } };
    memoryChart = new uPlot({
      width: Math.max(280, Math.floor(figure.clientWidth)), height: 200,
      scales: { x: { time: true }, y: { range: (p, min, max) => [0, max > 0 ? max * 1.15 : 1] } },
      axes: [axis, Object.assign({}, axis, { size: 52 })],
      cursor: { drag: { x: false, y: false } },
      series: [{}].concat(series.map((s, i) => ({ label: s.name, stroke: PROCESS_COLORS[i % PROCESS_COLORS.length],
        width: 2, spanGaps: false, value: (p, v) => (v === null || v === undefined ? "–" : v.toFixed(1) + " MB") }))),
    }, data, figure);
    window.servewellConsole.charts.memory = memoryChart;
  }

  /* ---------- response caches ---------- */

  function renderCaches(models) {
    const { el, clear, bytes, num } = u();
    const box = $("cache-models");
    clear(box);
    const cached = (models || []).filter((m) => m.cache);
    $("cache-note").textContent = cached.length
      ? "live entries and bytes leave expired answers out; repeats: requests for inputs asked for before, within or after the TTL"
      : "no model here has a response cache (cache: in model.yaml)";
    for (const m of cached) {
      const c = m.cache;
      const w = c.window || {};
      const card = el("div", "cache-model");
      card.dataset.model = m.name;
      card.appendChild(el("h3", null, m.name));
      const ratio = (r) => (r === null || r === undefined ? "–" : (100 * r).toFixed(0) + "%");
      const facts = [
        ["TTL", `${num(c.ttl_s)} s`], ["live entries", `${c.entries} (${bytes(c.bytes)} of ${bytes(c.max_bytes)})`],
        ["expired (dropped)", String(c.expired)], ["evicted for size", String(c.evicted.size)],
        ["hit ratio, 30 s", ratio(w.hit_ratio)], ["hit ratio, since loaded", ratio(c.hit_ratio)],
        ["repeats within · after the TTL (30 s)", `${w.reused_within_ttl === undefined ? "–" : num(w.reused_within_ttl)} · ${w.reused_beyond_ttl === undefined ? "–" : num(w.reused_beyond_ttl)}`],
      ];
      const table = el("table", "grid facts-table");
      for (const [k, v] of facts) {
        const row = table.insertRow();
        row.appendChild(el("th", null, k));
        const cell = row.insertCell();
        cell.textContent = v;
        cell.dataset.fact = k;
      }
      card.appendChild(table);
      card.appendChild(reuseHistogram(w.reuse_histogram || [], c.ttl_s));
      box.appendChild(card);
    }
  }

  function reuseHistogram(buckets, ttl) {
    // Reuse intervals of the last 30 s by bucket, the TTL's bucket marked: bars right of it expired.
    const { el } = u();
    const box = el("div", "reuse");
    box.appendChild(el("div", "muted small", "time between repeats (last 30 s), against the TTL"));
    const shown = buckets.filter((b) => b.count > 0 || b.le === "+Inf" || b.le >= ttl);
    const most = Math.max(1, ...buckets.map((b) => b.count));
    let previous = 0;
    for (const b of buckets) {
      const bound = b.le === "+Inf" ? Infinity : b.le;
      const beyond = previous >= ttl;
      previous = bound;
      if (!shown.includes(b) && !b.count) continue;
      const row = el("div", "reuse-row" + (beyond ? " beyond" : ""));
      row.appendChild(el("span", "le", b.le === "+Inf" ? "longer" : `≤ ${b.le} s`));
      const bar = el("div", "hbar");
      const fill = el("span");
      fill.style.width = (100 * b.count / most).toFixed(1) + "%";
      bar.appendChild(fill);
      row.appendChild(bar);
      row.appendChild(el("span", "n", String(b.count)));
      box.appendChild(row);
    }
    box.appendChild(el("div", "small ttl-line", `TTL ${ttl} s: repeats in the red rows came after their answer expired`));
    return box;
  }

  /* ---------- refusals and queue places ---------- */

  function renderRefusals(doc) {
    const { el, clear } = u();
    const body = $("refusals-table").tBodies[0];
    clear(body);
    const rows = doc.refusals_by;
    if (rows === null || rows === undefined) {
      const cell = el("td", "muted", "refusals by tenant are operator data (a tenant's key sees its own)");
      cell.colSpan = 6;
      body.insertRow().appendChild(cell);
    } else if (!rows.length) {
      const cell = el("td", "muted", "none refused since the server started");
      cell.colSpan = 6;
      body.insertRow().appendChild(cell);
    }
    for (const r of rows || []) {
      const row = body.insertRow();
      row.dataset.tenant = r.tenant;
      row.dataset.model = r.model;
      for (const v of [r.model, r.lane, r.tenant, r.reason, r.last_30s, r.total]) row.insertCell().textContent = String(v);
      if (r.last_30s) row.className = "recent";
    }
    const places = $("queue-places");
    clear(places);
    const held = doc.queue_places;
    if (!held || !Object.keys(held).length) {
      places.appendChild(el("span", "muted small", held ? "no request is queued now" : "operator data"));
      return;
    }
    for (const model of Object.keys(held).sort()) {
      for (const lane of Object.keys(held[model])) {
        const line = el("div", "place-line small");
        line.dataset.model = model;
        line.dataset.lane = lane;
        line.appendChild(el("strong", null, `${model} / ${lane}: `));
        const byTenant = held[model][lane];
        const total = Object.values(byTenant).reduce((a, b) => a + b, 0);
        const names = Object.keys(byTenant).sort((a, b) => byTenant[b] - byTenant[a]);
        line.appendChild(el("span", null, names.map((t) => `${t} ${byTenant[t]} (${Math.round(100 * byTenant[t] / total)}%)`).join(" · ")));
        places.appendChild(line);
      }
    }
  }

  function render(doc) {
    renderChanges(doc);
    renderMemory(doc.memory);
    renderCaches(doc.models);
    renderRefusals(doc);
  }

  window.servewellOncall = { marks: marks, diagnosis: diagnosis, render: render };
})();

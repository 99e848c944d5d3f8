// tailserve live dashboard: samples from GET /dashboard/events (SSE, one a second), last 60 kept.
// No libraries: canvas 2D only, so the page works offline and from the package alone.
(() => {
  "use strict";
  const KEEP = 60;
  const samples = [];

  // ---------------------------------------------------------------- colours
  // Viridis, 9 anchors (matplotlib's), interpolated linearly.
  const VIRIDIS = [
    [68, 1, 84], [71, 45, 123], [59, 82, 139], [44, 114, 142], [33, 145, 140],
    [40, 174, 128], [94, 201, 98], [173, 220, 48], [253, 231, 37],
  ];
  function viridis(v) {
    const x = Math.min(1, Math.max(0, v)) * (VIRIDIS.length - 1);
    const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
    const f = x - i;
    const a = VIRIDIS[i], b = VIRIDIS[i + 1];
    const c = [0, 1, 2].map((k) => Math.round(a[k] + (b[k] - a[k]) * f));
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }
  const COLORS = ["#4e9af1", "#f5a623", "#7ed321", "#e2526b", "#b58cf5", "#50e3c2", "#c8c8c8"];

  // ---------------------------------------------------------------- formatting
  const $ = (id) => document.getElementById(id);
  function ms(v) {
    if (v === null || v === undefined) return "–";
    const m = v * 1000;
    return m >= 100 ? m.toFixed(0) : m >= 10 ? m.toFixed(1) : m.toFixed(2);
  }
  const gib = (v) => (v === null || v === undefined ? null : v / 2 ** 30);

  // ---------------------------------------------------------------- heatmap
  function drawHeatmap() {
    const cv = $("kv-heatmap");
    const ctx = cv.getContext("2d");
    ctx.clearRect(0, 0, cv.width, cv.height);
    const colW = cv.width / KEEP;
    const offset = KEEP - samples.length;
    samples.forEach((s, i) => {
      // Bands of block ids when the engine sends them, else the pool as one row.
      const bands = s.kv_bands && s.kv_bands.length ? s.kv_bands
        : (s.kv_usage === undefined ? [] : [s.kv_usage]);
      const rowH = cv.height / Math.max(1, bands.length);
      bands.forEach((v, b) => {
        ctx.fillStyle = viridis(v);
        // Band 0 (lowest block ids) at the bottom.
        ctx.fillRect(Math.floor((offset + i) * colW), cv.height - (b + 1) * rowH,
          Math.ceil(colW), Math.ceil(rowH));
      });
    });
  }
  function drawColorbar() {
    const cv = $("kv-colorbar");
    const ctx = cv.getContext("2d");
    for (let y = 0; y < cv.height; y++) {
      ctx.fillStyle = viridis(1 - y / (cv.height - 1));
      ctx.fillRect(0, y, cv.width, 1);
    }
  }

  // ---------------------------------------------------------------- line charts
  function drawChart(id, series, fmt) {
    const cv = $(id);
    const ctx = cv.getContext("2d");
    const W = cv.width, H = cv.height, L = 44, R = 8, T = 20, B = 14;
    ctx.clearRect(0, 0, W, H);
    let max = 0;
    for (const s of series) for (const v of s.values) if (v !== null && v > max) max = v;
    max = max > 0 ? max * 1.1 : 1;
    ctx.font = "11px system-ui, sans-serif";
    ctx.strokeStyle = "#2a2e37";
    ctx.fillStyle = "#8a8f98";
    ctx.lineWidth = 1;
    for (let k = 0; k <= 4; k++) {
      const y = T + (H - T - B) * (1 - k / 4);
      ctx.beginPath(); ctx.moveTo(L, y); ctx.lineTo(W - R, y); ctx.stroke();
      ctx.fillText(fmt(max * k / 4), 2, y + 4);
    }
    ctx.fillText("-60 s", L, H - 2);
    ctx.fillText("now", W - R - 20, H - 2);
    const x = (i) => L + (W - L - R) * (KEEP - samples.length + i) / (KEEP - 1);
    const y = (v) => T + (H - T - B) * (1 - v / max);
    let lx = L;
    series.forEach((s, si) => {
      const color = s.color || COLORS[si % COLORS.length];
      ctx.strokeStyle = color;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let pen = false;
      s.values.forEach((v, i) => {
        if (v === null || v === undefined) { pen = false; return; }
        if (pen) ctx.lineTo(x(i), y(v)); else ctx.moveTo(x(i), y(v));
        pen = true;
      });
      ctx.stroke();
      ctx.fillStyle = color;
      ctx.fillText(s.label, lx, 12);
      lx += ctx.measureText(s.label).width + 12;
    });
  }

  const pick = (f) => samples.map((s) => { const v = f(s); return v === undefined ? null : v; });
  const num = (v) => (typeof v === "number" ? v : 0);

  // ---------------------------------------------------------------- render
  function render() {
    if (!samples.length) return;
    const s = samples[samples.length - 1];
    const first = samples[0];
    $("running").textContent = s.running ?? "–";
    $("waiting").textContent = s.waiting ?? "–";
    $("kv-usage").textContent = s.kv_usage === undefined ? "–"
      : `${(100 * s.kv_usage).toFixed(1)}%`;
    $("step").textContent = `${ms(s.step_p50)} / ${ms(s.step_p99)} ms`;
    $("ttft").textContent = `${ms(s.ttft_p50)} / ${ms(s.ttft_p99)} ms`;
    $("itl").textContent = `${ms(s.itl_p50)} / ${ms(s.itl_p99)} ms`;
    $("preemptions").textContent =
      `${num(s.preemptions_total) - num(first.preemptions_total)} / ${num(s.preemptions_total)}`;
    $("memory-alerts").textContent = s.memory_alerts ?? "–";
    $("updated").textContent = `updated ${new Date(s.t * 1000).toLocaleTimeString()}`;

    drawHeatmap();
    const toMs = (v) => (v === null || v === undefined ? null : v * 1000);
    drawChart("chart-requests", [
      { label: "running", values: pick((x) => x.running) },
      { label: "waiting", values: pick((x) => x.waiting) },
    ], (v) => v.toFixed(v < 10 ? 1 : 0));
    drawChart("chart-latency", [
      { label: "TTFT P50", values: pick((x) => toMs(x.ttft_p50)) },
      { label: "TTFT P99", values: pick((x) => toMs(x.ttft_p99)) },
      { label: "ITL P50", values: pick((x) => toMs(x.itl_p50)) },
      { label: "ITL P99", values: pick((x) => toMs(x.itl_p99)) },
    ], (v) => v.toFixed(v < 10 ? 1 : 0));
    drawChart("chart-step", [
      { label: "P50", values: pick((x) => toMs(x.step_p50)) },
      { label: "P99", values: pick((x) => toMs(x.step_p99)) },
      { label: "max", values: pick((x) => toMs(x.step_max)) },
    ], (v) => v.toFixed(v < 10 ? 1 : 0));
    const mem = [
      ["engine RSS", "engine_rss"], ["KV pool", "kv_cache"], ["torch allocated", "torch_allocated"],
      ["torch reserved", "torch_reserved"], ["device used", "device_used"],
      ["device total", "device_total"], ["host used", "host_used"],
    ].filter(([, k]) => samples.some((x) => x.memory && x.memory[k] !== undefined))
      .map(([label, k]) => ({ label, values: pick((x) => gib(x.memory && x.memory[k])) }));
    drawChart("chart-memory", mem, (v) => v.toFixed(v < 10 ? 2 : 0));
    const m = s.memory || {};
    const total = m.device_total ?? m.host_total;
    const used = m.device_used ?? m.host_used;
    $("memory-now").textContent = total ? `${(gib(used)).toFixed(2)} of ${(gib(total)).toFixed(1)} GiB in use` : "";
    drawChart("chart-preemptions", [{
      label: "preemptions/s",
      values: samples.map((x, i) => (i === 0 ? null
        : num(x.preemptions_total) - num(samples[i - 1].preemptions_total))),
    }], (v) => v.toFixed(v < 10 ? 1 : 0));
    renderErrors(s, first);
    if (s.watch) renderWatch(s);
  }

  // ---------------------------------------------------------------- tailserve watch
  // Samples from `tailserve watch --dashboard` carry a window of another server's /metrics:
  // SLO shares as the histogram buckets bound them, and the jumps with their likely cause.
  function share(b) {
    if (!b || b.low === null) return "–";
    const lo = (100 * b.low).toFixed(1);
    return b.high === null || b.high === b.low ? (b.high === null ? `≥ ${lo}%` : `${lo}%`)
      : `${lo}–${(100 * b.high).toFixed(1)}%`;
  }
  function renderWatch(s) {
    const w = s.watch.window;
    $("watch").hidden = false;
    document.title = `tailserve watch — ${s.watch.engine}`;
    document.querySelector("h1").firstChild.textContent = `watch: ${s.watch.engine} `;
    $("latency-caption").textContent = "TTFT and ITL per window (ms; P99 from histogram buckets)";
    // The tiles tailserve's own feed fills per second / per 60 s hold one window each here.
    for (const [id, text] of [["ttft", "TTFT P50 / P99 (window)"], ["itl", "ITL P50 / P99 (window)"],
      ["step", "step P50 / P99 (window)"], ["preemptions", "preemptions (60 windows / since start)"]]) {
      $(id).parentElement.querySelector(".label").textContent = text;
    }
    for (const m of ["ttft", "itl"]) {
      const mw = w.metrics[m];
      $(`watch-${m}`).textContent = !mw || mw.slo_ms === null ? "no SLO given"
        : `${share(mw.attained)} / ${share(w.slo_attained_since_start[m])}`;
    }
    $("watch-source").textContent = s.watch.url;
    const jumps = [];
    for (const x of samples) {
      if (!x.watch) continue;
      for (const line of x.watch.lines) if (line.includes("jumped") || line.includes("ALERT")) jumps.push(line.trim());
    }
    $("watch-jumps").replaceChildren(...(jumps.length ? jumps.slice(-10) : ["none in the last 60 windows"])
      .map((text) => { const li = document.createElement("li"); li.textContent = text; return li; }));
  }

  function renderErrors(s, first) {
    const rows = [];
    for (const [group, prefix] of [["errors", ""], ["rejected", "rejected: "], ["aborts", "aborted: "]]) {
      const now = s[group] || {};
      const then = first[group] || {};
      for (const type of Object.keys(now).sort()) {
        rows.push([prefix + type, now[type] - (then[type] || 0), now[type]]);
      }
    }
    const body = $("errors").tBodies[0];
    body.replaceChildren(...(rows.length ? rows : [["none", 0, 0]]).map((r) => {
      const tr = document.createElement("tr");
      for (const v of r) {
        const td = document.createElement("td");
        td.textContent = String(v);
        tr.appendChild(td);
      }
      return tr;
    }));
  }

  function add(s) {
    samples.push(s);
    while (samples.length > KEEP) samples.shift();
  }

  // ---------------------------------------------------------------- stream
  function connect() {
    // The API key, if the server has one, came in this page's ?key= and goes on to the stream.
    const key = new URLSearchParams(location.search).get("key");
    const url = location.pathname.replace(/\/+$/, "") + "/events"
      + (key ? `?key=${encodeURIComponent(key)}` : "");
    const es = new EventSource(url);
    const status = $("status");
    es.onopen = () => { status.textContent = "live"; status.className = "status on"; };
    es.onerror = () => { status.textContent = "reconnecting…"; status.className = "status off"; };
    es.addEventListener("history", (ev) => {
      samples.length = 0;
      for (const s of JSON.parse(ev.data)) add(s);
      render();
    });
    es.onmessage = (ev) => { add(JSON.parse(ev.data)); render(); };
  }

  drawColorbar();
  connect();
})();

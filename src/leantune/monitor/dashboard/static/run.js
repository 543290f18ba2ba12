// One run's page: charts of its metrics, eval rows, events and checkpoints, updated by polling
// the run's JSON endpoints for what is new since the last answer.
"use strict";

(function () {
  const name = location.pathname.slice("/run/".length).split("/").map(decodeURIComponent).join("/");
  const api = "/api/runs/" + Dash.runUrl(name);
  document.title = name + " - leantune";
  document.getElementById("run-name").textContent = name;

  const COLORS = { train: "#1f77b4", eval: "#d62728", a: "#2ca02c", b: "#9467bd", c: "#8c564b" };
  // Event kinds, grouped as the markers show them.
  const KINDS = {
    nonfinite: ["guard", "#d62728"], loss_spike: ["guard", "#d62728"], grad_norm: ["guard", "#d62728"],
    pause: ["guard", "#d62728"], stop: ["guard", "#d62728"],
    oom: ["oom", "#9467bd"], oom_eval: ["oom", "#9467bd"],
    rollback: ["rollback", "#ff7f0e"],
    signal: ["signal", "#17becf"], resume: ["resume", "#17becf"],
  };
  const MEMORY = [
    ["rss_bytes", "RSS", COLORS.a], ["mem_allocated_bytes", "allocated", COLORS.a],
    ["mem_reserved_bytes", "reserved", COLORS.c], ["peak_mem_bytes", "peak", COLORS.b],
  ];
  // A preference run's reward metrics (TRL's names, as metrics.jsonl holds them); their charts
  // stay hidden in a run that logs none (SFT).
  const REWARDS = [
    ["rewards/chosen", "chosen", COLORS.a], ["rewards/rejected", "rejected", COLORS.eval],
    ["rewards/margins", "margin", COLORS.train],
  ];
  const ACCURACY = [["rewards/accuracies", "accuracy", COLORS.train]];

  const chart = (id, title, format) =>
    new LeanChart(document.getElementById(id), { title, format: format || LeanChart.fmt });
  const charts = {
    loss: chart("chart-loss", "loss (train, eval)"),
    lr: chart("chart-lr", "learning rate"),
    grad: chart("chart-grad", "grad norm"),
    tps: chart("chart-tps", "tokens/s"),
    mem: chart("chart-mem", "memory", LeanChart.bytes),
    rewards: chart("chart-rewards", "rewards (chosen, rejected, margin)"),
    accuracy: chart("chart-accuracy", "reward accuracy"),
  };

  const state = { metrics: [], evals: [], events: [], mLast: null, eLast: null, detail: null };

  function seriesQuery(last) {
    return last ? "?after=" + last.step + "&sig=" + last.sig : "";
  }

  async function fetchSeries(kind, rows, last) {
    const answer = await Dash.getJSON(api + "/" + kind + seriesQuery(last));
    if (answer.reset || !last) rows.length = 0; // without `after` the answer is the whole file
    for (const r of answer.rows) rows.push(r);
    return answer.last;
  }

  const points = (rows, key) => rows.filter((r) => key in r).map((r) => [r.step, r[key]]);

  // The series of `table` ([key, label, colour]) that the run logged; its chart shows only then.
  function logged(id, m, table) {
    const series = table.filter(([key]) => m.some((r) => key in r))
      .map(([key, label, color]) => ({ name: label, color, points: points(m, key) }));
    document.getElementById(id).hidden = series.length === 0;
    return series;
  }

  function markers() {
    const out = state.events.map((e) => {
      const [group, color] = KINDS[e.kind] || [e.kind, "#555"];
      return { x: e.step, kind: group, color, label: e.kind + ": " + e.message };
    });
    for (const step of state.detail.checkpoints) {
      out.push({ x: step, kind: "checkpoint", color: "#6e7781", label: "step-" + String(step).padStart(6, "0") });
    }
    return out;
  }

  function drawCharts() {
    const m = state.metrics, marks = markers();
    charts.loss.setSeries([
      { name: "train loss", color: COLORS.train, points: points(m, "loss") },
      { name: "eval loss", color: COLORS.eval, points: points(state.evals, "eval_loss"), dots: true },
    ]);
    charts.lr.setSeries([{ name: "lr", color: COLORS.a, points: points(m, "lr") }]);
    charts.grad.setSeries([{ name: "grad norm", color: COLORS.b, points: points(m, "grad_norm") }]);
    charts.tps.setSeries([{ name: "tokens/s", color: COLORS.c, points: points(m, "tokens_per_s") }]);
    charts.mem.setSeries(
      MEMORY.filter(([key]) => m.some((r) => key in r))
        .map(([key, label, color]) => ({ name: label, color, points: points(m, key) })),
    );
    charts.rewards.setSeries(logged("chart-rewards", m, REWARDS));
    charts.accuracy.setSeries(logged("chart-accuracy", m, ACCURACY));
    const planned = state.detail.planned_peak_bytes;
    charts.mem.setLines(planned ? [{ y: planned, label: "planned peak", color: "#d62728" }] : []);
    charts.mem.setNote(planned ? "" : "no planned peak recorded by this run");
    for (const c of Object.values(charts)) c.setMarkers(marks);
  }

  function drawHeader(d) {
    const status = document.getElementById("status");
    status.className = "status " + d.status;
    status.textContent = d.status.replace("_", " ");
    document.body.dataset.status = d.status;
    document.getElementById("reason").textContent = d.reason;
    const last = state.metrics.length ? state.metrics[state.metrics.length - 1] : {};
    const lastEval = state.evals.length ? state.evals[state.evals.length - 1] : {};
    Dash.show("last-step", last.step);
    document.getElementById("max-steps").textContent = " / " + (d.max_steps ?? "?");
    Dash.show("last-loss", last.loss);
    Dash.show("last-eval-loss", lastEval.eval_loss);
    Dash.show("last-lr", last.lr, LeanChart.fmt);
    Dash.show("last-tps", last.tokens_per_s, (v) => String(Math.round(v)));
    Dash.show("method", d.method);
    Dash.show("model", d.model, String);
    document.getElementById("updated").textContent = Dash.ago(d.updated);
  }

  function drawTables(d) {
    const body = document.querySelector("#events tbody");
    body.replaceChildren(...state.events.map((e) => {
      const tr = document.createElement("tr");
      tr.dataset.kind = e.kind;
      Dash.cell(tr, String(e.step), "num");
      Dash.cell(tr, e.kind);
      Dash.cell(tr, e.message);
      return tr;
    }));
    document.getElementById("events-count").textContent = "(" + state.events.length + ")";
    document.getElementById("checkpoints").textContent =
      d.checkpoints.length ? d.checkpoints.map((s) => "step " + s).join(", ") + (d.has_final ? "; final/" : "")
        : d.has_final ? "final/" : "none";
    document.getElementById("summary").textContent = d.summary ? JSON.stringify(d.summary, null, 2) : "not finished";
    document.getElementById("config").textContent = d.config_text || "(no config.yaml)";
  }

  Dash.poll(async () => {
    const [detail, mLast, eLast, events] = await Promise.all([
      Dash.getJSON(api),
      fetchSeries("metrics", state.metrics, state.mLast),
      fetchSeries("eval", state.evals, state.eLast),
      Dash.getJSON(api + "/events?after=" + (state.events.length)),
    ]);
    state.detail = detail;
    state.mLast = mLast;
    state.eLast = eLast;
    if (events.reset) state.events.length = 0;
    for (const e of events.events) state.events.push(e);
    drawCharts();
    drawHeader(detail);
    drawTables(detail);
    document.body.dataset.ready = "1";
  });
})();

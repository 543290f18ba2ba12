// LeanChart: the dashboard's line charts, drawn on a canvas (no dependencies).
//
//   const chart = new LeanChart(element, {title: "loss", format: LeanChart.fmt});
//   chart.setSeries([{name: "train", color: "#1f77b4", points: [[1, 2.3], [2, 2.1]]}]);
//   chart.setMarkers([{x: 2, kind: "checkpoint", color: "#888", label: "step-000002"}]);
//   chart.setLines([{y: 5e8, label: "planned peak", color: "#c00"}]);
//
// Points are [x, y] pairs sorted by x; a y that is not a finite number (NaN is sent as the
// string "NaN") leaves a gap. A series with more points than two per pixel is drawn as the
// minimum and maximum of each pixel column, so long runs stay fast and keep their spikes.
// After each draw the element's data-summary attribute holds, per series, the number of
// points and the last point, and data-markers the number of markers: tests read them.
"use strict";

(function (global) {
  const MARGIN = { left: 64, right: 14, top: 12, bottom: 26 };
  const FONT = "11px system-ui, sans-serif";

  function fmt(v) {
    if (typeof v !== "number" || !Number.isFinite(v)) return String(v);
    const a = Math.abs(v);
    if (a === 0) return "0";
    if (a >= 1e9) return Number((v / 1e9).toPrecision(3)) + "G";
    if (a >= 1e6) return Number((v / 1e6).toPrecision(3)) + "M";
    if (a >= 1e4) return Number((v / 1e3).toPrecision(3)) + "k";
    if (a < 1e-3) return v.toExponential(1);
    return String(Number(v.toPrecision(4)));
  }

  function bytes(v) {
    if (typeof v !== "number" || !Number.isFinite(v)) return String(v);
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
    return Number(v.toPrecision(3)) + " " + units[i];
  }

  // Ticks at 1, 2 or 5 times a power of ten, about `count` of them over [lo, hi].
  function ticks(lo, hi, count) {
    const raw = (hi - lo) / Math.max(1, count);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
    const out = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) {
      out.push(Math.abs(t) < step * 1e-9 ? 0 : t);
    }
    return out;
  }

  const finite = (y) => typeof y === "number" && Number.isFinite(y);

  // [min, max] of `values` widened by `pad` of the range (a loop: a spread of 100k numbers
  // would overflow the call stack).
  function extent(values, pad) {
    let lo = Infinity, hi = -Infinity;
    for (const v of values) { if (v < lo) lo = v; if (v > hi) hi = v; }
    if (!Number.isFinite(lo)) return [0, 1];
    if (lo === hi) { const d = Math.abs(lo) * 0.1 || 1; lo -= d; hi += d; }
    const p = (hi - lo) * pad;
    return [lo - p, hi + p];
  }

  // Min and max of each pixel column, in x order: what the line would look like anyway.
  function decimate(points, x0, x1, width) {
    if (points.length <= 2 * width) return points;
    const out = [];
    let col = -1, lo = null, hi = null;
    const flush = () => {
      if (lo === null) return;
      if (lo[0] <= hi[0]) out.push(lo, hi); else out.push(hi, lo);
    };
    for (const p of points) {
      const c = Math.floor(((p[0] - x0) / (x1 - x0 || 1)) * width);
      if (c !== col) { flush(); col = c; lo = hi = null; }
      if (!finite(p[1])) { flush(); out.push(p); lo = hi = null; continue; }
      if (lo === null || p[1] < lo[1]) lo = p;
      if (hi === null || p[1] > hi[1]) hi = p;
    }
    flush();
    return out;
  }

  class LeanChart {
    constructor(el, opts) {
      this.el = el;
      this.opts = Object.assign({ title: "", format: fmt, height: 200 }, opts || {});
      this.series = [];
      this.markers = [];
      this.lines = [];
      this.hover = null;
      el.classList.add("leanchart");
      const title = document.createElement("div");
      title.className = "leanchart-title";
      title.textContent = this.opts.title;
      this.canvas = document.createElement("canvas");
      this.legend = document.createElement("div");
      this.legend.className = "leanchart-legend";
      this.tip = document.createElement("div");
      this.tip.className = "leanchart-tip";
      this.tip.hidden = true;
      this.note = document.createElement("div");
      this.note.className = "leanchart-note";
      el.append(title, this.canvas, this.legend, this.note, this.tip);
      this.canvas.addEventListener("mousemove", (e) => this._hover(e));
      this.canvas.addEventListener("mouseleave", () => { this.hover = null; this.tip.hidden = true; this.draw(); });
      if (global.ResizeObserver) new ResizeObserver(() => this.draw()).observe(el);
    }

    setSeries(series) { this.series = series; this.draw(); }
    setMarkers(markers) { this.markers = markers; this.draw(); }
    setLines(lines) { this.lines = lines; this.draw(); }
    setNote(text) { this.note.textContent = text || ""; }

    _domain() {
      const xs = [], ys = [];
      for (const s of this.series) {
        if (s.points.length) xs.push(s.points[0][0], s.points[s.points.length - 1][0]);
        for (const p of s.points) if (finite(p[1])) ys.push(p[1]);
      }
      for (const m of this.markers) xs.push(m.x);
      for (const l of this.lines) ys.push(l.y);
      const [x0, x1] = xs.length ? extent(xs, 0) : [0, 1];
      return { x0, x1: x1 > x0 ? x1 : x0 + 1, y: extent(ys, 0.06) };
    }

    draw() {
      const w = Math.max(120, this.el.clientWidth), h = this.opts.height;
      const dpr = global.devicePixelRatio || 1;
      this.canvas.width = Math.round(w * dpr);
      this.canvas.height = Math.round(h * dpr);
      this.canvas.style.width = w + "px";
      this.canvas.style.height = h + "px";
      const ctx = this.canvas.getContext("2d");
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      ctx.clearRect(0, 0, w, h);
      ctx.font = FONT;
      const d = this._domain();
      const pw = w - MARGIN.left - MARGIN.right, ph = h - MARGIN.top - MARGIN.bottom;
      const sx = (x) => MARGIN.left + ((x - d.x0) / (d.x1 - d.x0)) * pw;
      const sy = (y) => MARGIN.top + (1 - (y - d.y[0]) / (d.y[1] - d.y[0])) * ph;
      this._scale = { d, sx, pw, w };
      this._axes(ctx, d, sx, sy, w, h);
      for (const m of this.markers) this._marker(ctx, sx(m.x), m, h);
      for (const l of this.lines) this._line(ctx, sy(l.y), l, w);
      ctx.save();
      ctx.beginPath();
      ctx.rect(MARGIN.left, MARGIN.top - 2, pw, ph + 4);
      ctx.clip();
      for (const s of this.series) this._series(ctx, s, d, sx, sy, pw);
      ctx.restore();
      if (this.hover !== null) this._crosshair(ctx, sx(this.hover), h);
      this._legendAndSummary();
    }

    _axes(ctx, d, sx, sy, w, h) {
      ctx.strokeStyle = "#e3e3e3";
      ctx.fillStyle = "#555";
      ctx.lineWidth = 1;
      ctx.textAlign = "right";
      ctx.textBaseline = "middle";
      for (const t of ticks(d.y[0], d.y[1], 4)) {
        const y = Math.round(sy(t)) + 0.5;
        ctx.beginPath(); ctx.moveTo(MARGIN.left, y); ctx.lineTo(w - MARGIN.right, y); ctx.stroke();
        ctx.fillText(this.opts.format(t), MARGIN.left - 6, y);
      }
      ctx.textAlign = "center";
      ctx.textBaseline = "top";
      const xt = ticks(d.x0, d.x1, Math.max(2, Math.floor((w - MARGIN.left) / 90)));
      for (const t of xt.filter((t) => Number.isInteger(t) || d.x1 - d.x0 < 10)) {
        const label = Math.abs(t) >= 1e4 ? fmt(t) : String(t);
        const half = ctx.measureText(label).width / 2;
        ctx.fillText(label, Math.min(sx(t), w - half - 1), h - MARGIN.bottom + 6);
      }
      ctx.strokeStyle = "#999";
      ctx.beginPath();
      ctx.moveTo(MARGIN.left + 0.5, MARGIN.top);
      ctx.lineTo(MARGIN.left + 0.5, h - MARGIN.bottom + 0.5);
      ctx.lineTo(w - MARGIN.right, h - MARGIN.bottom + 0.5);
      ctx.stroke();
    }

    _marker(ctx, x, m, h) {
      ctx.save();
      ctx.strokeStyle = m.color;
      ctx.fillStyle = m.color;
      ctx.globalAlpha = 0.75;
      ctx.setLineDash(m.kind === "checkpoint" ? [2, 3] : [5, 3]);
      ctx.beginPath();
      ctx.moveTo(Math.round(x) + 0.5, MARGIN.top);
      ctx.lineTo(Math.round(x) + 0.5, h - MARGIN.bottom);
      ctx.stroke();
      ctx.setLineDash([]);
      ctx.beginPath(); // a flag on top, so that markers read at a glance
      ctx.moveTo(x - 4, MARGIN.top - 6); ctx.lineTo(x + 4, MARGIN.top - 6); ctx.lineTo(x, MARGIN.top);
      ctx.fill();
      ctx.restore();
    }

    _line(ctx, y, l, w) {
      ctx.save();
      ctx.strokeStyle = l.color;
      ctx.fillStyle = l.color;
      ctx.setLineDash([6, 4]);
      ctx.beginPath(); ctx.moveTo(MARGIN.left, y); ctx.lineTo(w - MARGIN.right, y); ctx.stroke();
      ctx.textAlign = "right";
      ctx.textBaseline = "bottom";
      ctx.fillText(l.label + " " + this.opts.format(l.y), w - MARGIN.right - 2, y - 2);
      ctx.restore();
    }

    _series(ctx, s, d, sx, sy, pw) {
      const pts = decimate(s.points, d.x0, d.x1, pw);
      ctx.strokeStyle = s.color;
      ctx.fillStyle = s.color;
      ctx.lineWidth = s.width || 1.6;
      ctx.setLineDash(s.dashed ? [4, 3] : []);
      ctx.beginPath();
      let open = false;
      for (const [x, y] of pts) {
        if (!finite(y)) { open = false; continue; }
        if (open) ctx.lineTo(sx(x), sy(y)); else ctx.moveTo(sx(x), sy(y));
        open = true;
      }
      ctx.stroke();
      const few = s.points.length <= 60 || s.dots;
      for (const [x, y] of few ? pts : pts.slice(-1)) {
        if (finite(y)) { ctx.beginPath(); ctx.arc(sx(x), sy(y), 2.4, 0, 2 * Math.PI); ctx.fill(); }
      }
    }

    _crosshair(ctx, x, h) {
      ctx.save();
      ctx.strokeStyle = "rgba(0,0,0,0.35)";
      ctx.beginPath(); ctx.moveTo(x, MARGIN.top); ctx.lineTo(x, h - MARGIN.bottom); ctx.stroke();
      ctx.restore();
    }

    _legendAndSummary() {
      const summary = {};
      this.legend.replaceChildren();
      for (const s of this.series) {
        const last = s.points.length ? s.points[s.points.length - 1] : null;
        summary[s.name] = { n: s.points.length, last };
        const item = document.createElement("span");
        const swatch = document.createElement("i");
        swatch.style.background = s.color;
        item.append(swatch, s.name + (last ? " " + this.opts.format(last[1]) : " (none yet)"));
        this.legend.append(item);
      }
      const kinds = new Map(this.markers.map((m) => [m.kind, m.color]));
      for (const [kind, color] of kinds) {
        const item = document.createElement("span");
        item.className = "leanchart-marker";
        const swatch = document.createElement("i");
        swatch.style.borderColor = color;
        item.append(swatch, kind);
        this.legend.append(item);
      }
      this.el.dataset.summary = JSON.stringify(summary);
      this.el.dataset.markers = String(this.markers.length);
      this.el.dataset.lines = JSON.stringify(this.lines.map(l => l.y));
      this.el.dataset.renders = String(Number(this.el.dataset.renders || 0) + 1);
    }

    _hover(e) {
      if (!this._scale) return;
      const { d, pw } = this._scale;
      const rect = this.canvas.getBoundingClientRect();
      const x = d.x0 + ((e.clientX - rect.left - MARGIN.left) / pw) * (d.x1 - d.x0);
      const lines = [];
      let at = null;
      for (const s of this.series) {
        const p = nearest(s.points, x);
        if (p === null) continue;
        if (at === null || Math.abs(p[0] - x) < Math.abs(at - x)) at = p[0];
        lines.push(s.name + " @" + p[0] + ": " + this.opts.format(p[1]));
      }
      const tol = ((d.x1 - d.x0) / pw) * 4;
      for (const m of this.markers) {
        if (Math.abs(m.x - x) <= tol) lines.push(m.kind + " @" + m.x + (m.label ? ": " + m.label : ""));
      }
      this.hover = at;
      this.tip.hidden = lines.length === 0;
      this.tip.textContent = lines.join("\n");
      this.tip.style.left = Math.min(e.offsetX + 14, this.el.clientWidth - 220) + "px";
      this.tip.style.top = e.offsetY + 24 + "px";
      this.draw();
    }
  }

  function nearest(points, x) {
    if (!points.length) return null;
    let lo = 0, hi = points.length - 1;
    while (hi - lo > 1) {
      const mid = (lo + hi) >> 1;
      if (points[mid][0] < x) lo = mid; else hi = mid;
    }
    return Math.abs(points[lo][0] - x) <= Math.abs(points[hi][0] - x) ? points[lo] : points[hi];
  }

  LeanChart.fmt = fmt;
  LeanChart.bytes = bytes;
  LeanChart.ticks = ticks;
  global.LeanChart = LeanChart;
})(window);

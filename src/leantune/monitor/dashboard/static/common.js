// What both pages share: fetching JSON, polling, and writing values into the page.
// Every value goes in through textContent, never as HTML: run files hold user data.
"use strict";

const Dash = (function () {
  const params = new URLSearchParams(location.search);
  // ?poll=MS sets the polling interval (default 2 s).
  const pollMs = Math.max(100, Number(params.get("poll")) || 2000);

  async function getJSON(url) {
    const r = await fetch(url, { cache: "no-store" });
    if (!r.ok) throw new Error(url + ": HTTP " + r.status);
    return r.json();
  }

  // Call `fn` now and every pollMs after it finishes; a failure shows the banner and retries.
  function poll(fn) {
    const banner = document.getElementById("conn");
    const tick = async () => {
      try {
        await fn();
        banner.hidden = true;
        document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
      } catch (e) {
        banner.hidden = false;
        banner.title = String(e);
      }
      setTimeout(tick, pollMs);
    };
    tick();
  }

  function ago(seconds) {
    if (typeof seconds !== "number") return "-";
    const s = Math.max(0, Date.now() / 1000 - seconds);
    if (s < 90) return Math.round(s) + " s ago";
    if (s < 5400) return Math.round(s / 60) + " min ago";
    if (s < 172800) return Math.round(s / 3600) + " h ago";
    return new Date(seconds * 1000).toISOString().slice(0, 16).replace("T", " ");
  }

  function num(v) {
    if (v === null || v === undefined) return "-";
    if (typeof v !== "number") return String(v);
    return Math.abs(v) >= 1e4 || Number.isInteger(v) ? String(Math.round(v)) : String(Number(v.toPrecision(5)));
  }

  // Show `value` in element `id`; its data-value keeps the exact number for scripts and tests.
  function show(id, value, format) {
    const el = document.getElementById(id);
    el.textContent = value === null || value === undefined ? "-" : (format || num)(value);
    el.dataset.value = value === null || value === undefined ? "" : String(value);
  }

  function cell(row, text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    row.append(td);
    return td;
  }

  function runUrl(name, suffix) {
    return name.split("/").map(encodeURIComponent).join("/") + (suffix || "");
  }

  return { pollMs, getJSON, poll, ago, num, show, cell, runUrl };
})();

// The run list: one row per run under the runs folder, refreshed every poll.
"use strict";

function statusBadge(td, status) {
  const span = document.createElement("span");
  span.className = "status " + status;
  span.textContent = status.replace("_", " ");
  td.replaceChildren(span);
}

Dash.poll(async () => {
  const data = await Dash.getJSON("/api/runs");
  document.getElementById("root").textContent = data.root;
  const body = document.querySelector("#runs tbody");
  const rows = data.runs.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.run = r.name;
    tr.dataset.status = r.status;
    const a = document.createElement("a");
    a.href = "/run/" + Dash.runUrl(r.name);
    a.textContent = r.name;
    Dash.cell(tr, "").append(a);
    Dash.cell(tr, r.method || "-");
    Dash.cell(tr, r.model || "-");
    Dash.cell(tr, r.steps_done + " / " + (r.max_steps ?? "?"), "num");
    Dash.cell(tr, Dash.num(r.last_loss), "num").dataset.value = String(r.last_loss ?? "");
    Dash.cell(tr, Dash.num(r.last_eval_loss), "num");
    statusBadge(Dash.cell(tr, ""), r.status);
    Dash.cell(tr, r.reason, "reason");
    Dash.cell(tr, Dash.ago(r.updated), "num");
    return tr;
  });
  body.replaceChildren(...rows);
  document.getElementById("empty").hidden = rows.length > 0;
});

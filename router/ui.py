"""The partition-map page a router serves at `/admin/ui`: the cluster as a picture, updating itself.

One self-contained HTML document (inline CSS and JavaScript, no external fonts, scripts or styles: it works
in an air-gapped cluster). The page polls `/admin/partition-map` every second with the admin token it was
opened with (`/admin/ui?token=...`; the token is then removed from the address bar and sent as
`Authorization: Bearer`), and redraws: the map generation, the map's age and staleness; every node with its URL and
whether it is leaving; per store, every partition's assigned replicas and the nodes serving it at which
version, a live partition's offset and lag per replica, and a node that is assigned but gone. Every text
from the map is set as text, never as markup.
"""

from __future__ import annotations

PATH = "/admin/ui"

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>keyroute - partition map</title>
<style>
  :root { --ok: #1f7a3a; --warn: #a86500; --bad: #b3261e; --muted: #666; --line: #ddd; }
  body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #222; }
  header { display: flex; gap: 1.5em; align-items: baseline; padding: 0.8em 1.2em; background: #f4f4f6;
           border-bottom: 1px solid var(--line); position: sticky; top: 0; }
  h1 { font-size: 1.15em; margin: 0; }
  h2 { font-size: 1.05em; margin: 1.2em 0 0.4em; }
  main { padding: 0 1.2em 2em; }
  .badge { display: inline-block; padding: 0 0.5em; border-radius: 0.8em; font-size: 0.85em; color: #fff; }
  .ok { background: var(--ok); } .warn { background: var(--warn); } .bad { background: var(--bad); }
  .muted { color: var(--muted); }
  table { border-collapse: collapse; margin: 0.3em 0; }
  th, td { border: 1px solid var(--line); padding: 0.2em 0.6em; text-align: left; vertical-align: top; }
  th { background: #fafafa; font-weight: 600; }
  .replica { display: inline-block; margin: 0.1em 0.3em 0.1em 0; padding: 0 0.4em; border-radius: 0.3em;
             border: 1px solid var(--line); white-space: nowrap; }
  .replica.serving { border-color: var(--ok); }
  .replica.assigned { border-color: var(--warn); border-style: dashed; }
  .replica.gone { border-color: var(--bad); color: var(--bad); text-decoration: line-through; }
  #error { color: var(--bad); }
</style>
</head>
<body>
<header>
  <h1>keyroute partition map</h1>
  <span id="summary" class="muted">loading...</span>
  <span id="error"></span>
</header>
<main>
  <h2>Nodes</h2>
  <table id="nodes"><thead><tr><th>node</th><th>url</th><th>state</th><th>serving</th></tr></thead>
    <tbody></tbody></table>
  <div id="stores"></div>
</main>
<script>
"use strict";
const params = new URLSearchParams(location.search);
const token = params.get("token");
if (token !== null) { history.replaceState(null, "", location.pathname); }
const headers = token ? { "Authorization": "Bearer " + token } : {};

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) { node.setAttribute(name, value); }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function badge(kind, text) { return el("span", { class: "badge " + kind }, text); }

function renderNodes(map) {
  const body = document.querySelector("#nodes tbody");
  const rows = [];
  for (const [id, node] of Object.entries(map.nodes)) {
    const serving = Object.entries(node.serving).map(([s, n]) => s + ": " + n).join(", ") || "-";
    rows.push(el("tr", { "data-node": id }, el("td", {}, id), el("td", {}, node.url),
      el("td", {}, node.leaving ? badge("warn", "leaving") : badge("ok", "up")), el("td", {}, serving)));
  }
  const gone = new Set();
  for (const store of Object.values(map.stores)) {
    for (const entry of store.partition_map) {
      for (const id of entry.assigned) { if (!(id in map.nodes)) { gone.add(id); } }
    }
  }
  for (const id of gone) {
    rows.push(el("tr", { "data-node": id }, el("td", {}, id), el("td", { class: "muted" }, "-"),
      el("td", {}, badge("bad", "gone")), el("td", {}, "assigned, not registered")));
  }
  body.replaceChildren(...rows);
}

function renderStore(name, store, nodes) {
  const live = store.live === true;
  const head = el("tr", {}, el("th", {}, "partition"), el("th", {}, "state"), el("th", {}, "replicas"));
  if (live) { head.append(el("th", {}, "offset / lag")); }
  const rows = [head];
  let unserved = 0;
  for (const entry of store.partition_map) {
    const serving = new Map(entry.serving.map((s) => [s.node, s]));
    const current = entry.serving.some((s) => s.version === store.version);
    let state;
    if (entry.serving.length === 0) { state = badge("bad", "unserved"); unserved += 1; }
    else if (!current) { state = badge("warn", "older version"); }
    else if (entry.assigned.some((id) => !serving.has(id))) { state = badge("warn", "moving"); }
    else { state = badge("ok", "served"); }
    const replicas = el("td", {});
    for (const id of entry.assigned) {
      const s = serving.get(id);
      const kind = !(id in nodes) ? "gone" : s ? "serving" : "assigned";
      replicas.append(el("span", { class: "replica " + kind, "data-replica": id, "data-state": kind },
        id + (s ? " v" + s.version : kind === "gone" ? " (gone)" : " (loading)")));
    }
    for (const s of entry.serving) {
      if (!entry.assigned.includes(s.node)) {
        replicas.append(el("span", { class: "replica serving", "data-replica": s.node, "data-state": "serving" },
          s.node + " v" + s.version + " (handing over)"));
      }
    }
    const row = el("tr", { "data-partition": String(entry.partition) }, el("td", {}, entry.partition),
      el("td", {}, state), replicas);
    if (live) {
      const reports = (entry.live || []).map((r) => r.node + ": " + r.offset + " / " + r.lag_records);
      row.append(el("td", {}, reports.join(", ") || "-"));
    }
    rows.push(row);
  }
  const title = el("h2", {}, "store " + name + " ", el("span", { class: "muted" },
    "version " + store.version + ", " + store.partitions + " partitions, rf " + store.replication_factor +
    (store.timeline ? ", " + store.timeline.kind : "") + (live ? ", live" : "")), " ",
    unserved ? badge("bad", unserved + " unserved") : badge("ok", "complete"));
  return el("section", { "data-store": name }, title, el("table", {}, ...rows));
}

function render(map) {
  const stale = map.stale ? badge("warn", "stale") : badge("ok", "fresh");
  document.getElementById("summary").replaceChildren(
    "map generation " + map.generation + ", age " + map.age_s.toFixed(1) + " s ", stale,
    " ", map.complete ? badge("ok", "complete") : badge("warn", "incomplete"));
  renderNodes(map);
  const stores = Object.entries(map.stores).map(([name, store]) => renderStore(name, store, map.nodes));
  document.getElementById("stores").replaceChildren(...stores);
  document.body.setAttribute("data-generation", String(map.generation));
}

async function refresh() {
  try {
    const answer = await fetch("/admin/partition-map", { headers, cache: "no-store" });
    const body = await answer.json();
    if (!answer.ok) { throw new Error(body.message || answer.statusText); }
    render(body);
    document.getElementById("error").textContent = "";
  } catch (error) {
    document.getElementById("error").textContent = "cannot read the map: " + error.message;
  } finally {
    setTimeout(refresh, 1000);
  }
}
refresh();
</script>
</body>
</html>
"""

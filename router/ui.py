"""The partition-map page a router serves at `/admin/ui`: the cluster as a picture, readable at 1,000 nodes.

One self-contained HTML document (inline CSS and JavaScript, no external fonts, scripts or styles: it works
in an air-gapped cluster). What it shows, top to bottom:

- the summary: map generation, fresh or stale and the map's age (explained in a tooltip), totals, and what
  is wrong right now with counts (unserved, loading, under-replicated and lagging partitions per store,
  nodes gone or leaving), a banner when the cluster is empty, the cluster policy and whether this router
  meets it;
- stores, problems first: per store its counts, live lag and a heat strip of its partitions (each cell the
  worst state among the partitions it covers);
- nodes as a grid, problems first (gone, leaving), each cell shaded by the partitions it serves against the
  mean, so balance and gaps show at a glance, and labelled with the node's name while the names fit (up to
  `LABELLED` nodes; beyond, the name is the cell's tooltip);
- the nodes that left or died (router/departures.py), by name: how they went, when they were last seen, what
  they held and how much of it is served as asked again, or since when they are back;
- a drill-down into one store or one node (a click), its partitions filtered and paged by the router
  (`?store=`, `?node=`, `?state=`, `limit`, `cursor`), problem states first;
- with quotas configured, each identity's rate against its quota per store (`/admin/quotas`, every 5 s).

It long-polls the summary (`?since=G&wait_s=N` with `If-None-Match`: a quiet cluster costs the router a 304
now and then), fetches a drill-down only while it is open, and never the whole document. It sends no token
of its own: same-origin requests carry the admin cookie, and a 401 sends the browser to
`/admin/login?next=/admin/ui`. Every text from the map is set as text, never as markup.
"""

from __future__ import annotations

PATH = "/admin/ui"
LOGIN = "/admin/login?next=/admin/ui"

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>keyroute - partition map</title>
<style>
  :root { --ok: #1f7a3a; --warn: #a86500; --bad: #b3261e; --load: #3b5bb5; --muted: #666; --line: #ddd; }
  body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #222; }
  header { display: flex; flex-wrap: wrap; gap: 1.2em; align-items: baseline; padding: 0.7em 1.2em;
           background: #f4f4f6; border-bottom: 1px solid var(--line); position: sticky; top: 0; z-index: 1; }
  h1 { font-size: 1.15em; margin: 0; }
  h2 { font-size: 1.05em; margin: 1.1em 0 0.4em; }
  main { padding: 0 1.2em 2em; }
  .badge { display: inline-block; padding: 0 0.5em; border-radius: 0.8em; font-size: 0.85em; color: #fff; }
  .ok { background: var(--ok); } .warn { background: var(--warn); } .bad { background: var(--bad); }
  .load { background: var(--load); }
  .muted { color: var(--muted); }
  [title] { cursor: help; }
  #banner { display: none; margin: 0.8em 0; padding: 0.6em 0.9em; background: #fff4e0;
            border: 1px solid var(--warn); border-radius: 0.3em; }
  #problems li { margin: 0.1em 0; }
  #problems.none { color: var(--ok); }
  table { border-collapse: collapse; margin: 0.3em 0; }
  th, td { border: 1px solid var(--line); padding: 0.15em 0.5em; text-align: left; vertical-align: top; }
  td.n { text-align: right; font-variant-numeric: tabular-nums; }
  th { background: #fafafa; font-weight: 600; }
  button.link { border: 0; background: none; color: #1a4fb4; cursor: pointer; padding: 0; font: inherit;
                text-decoration: underline; }
  canvas.heat { display: block; border: 1px solid var(--line); }
  #grid { display: grid; grid-template-columns: repeat(auto-fill, 14px); gap: 2px; max-width: 100%; }
  #grid .cell { width: 14px; height: 14px; border-radius: 2px; cursor: pointer; }
  #grid .cell.gone { background: var(--bad); } #grid .cell.leaving { background: var(--warn); }
  #grid .cell.left { background: #888; }
  #grid.labelled { grid-template-columns: repeat(auto-fill, minmax(5.5em, max-content)); gap: 3px; }
  #grid.labelled .cell { width: auto; height: auto; padding: 0.1em 0.45em; font-size: 0.85em; color: #fff;
                         white-space: nowrap; }
  #grid.labelled .cell.light { color: #111; }
  #departed li { margin: 0.15em 0; }
  .legend span { display: inline-block; margin-right: 1em; }
  .swatch { display: inline-block; width: 0.9em; height: 0.9em; vertical-align: -0.1em; border-radius: 2px; }
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
  <div id="banner"></div>
  <h2>What is wrong now</h2>
  <ul id="problems"></ul>
  <div id="totals" class="muted"></div>
  <div id="policy" class="muted"></div>
  <h2>Stores</h2>
  <div class="legend muted">
    <span><i class="swatch ok"></i> served</span><span><i class="swatch warn"></i> under-replicated</span>
    <span><i class="swatch load"></i> loading</span><span><i class="swatch bad"></i> unserved</span>
    <span>each cell: the worst state among the partitions it covers</span>
  </div>
  <table id="stores"><thead><tr><th>store</th><th>version</th><th>partitions</th><th>unserved</th>
    <th>loading</th><th>under-replicated</th><th>lagging</th><th>lag max / p99 (records)</th>
    <th>partitions, heat</th></tr></thead><tbody></tbody></table>
  <h2>Nodes</h2>
  <div class="legend muted">
    <span><i class="swatch bad"></i> gone (no longer registered: died, killed or restarting)</span>
    <span><i class="swatch warn"></i> leaving</span><span><i class="swatch" style="background:#888"></i> left</span>
    <span>up: darker = serves more partitions than the mean, lighter = fewer</span>
  </div>
  <div id="nodes"><div id="grid"></div></div>
  <section id="departures" hidden>
    <h2>Nodes that left or died</h2>
    <ul id="departed"></ul>
  </section>
  <section id="quotas" hidden>
    <h2>Quotas</h2>
    <div id="quota-routers" class="muted"></div>
    <table id="quota-table"><thead><tr><th>identity</th><th>store</th><th>quota (reads/s)</th>
      <th>this router's share</th><th>used</th><th>reads</th><th>refused 429</th></tr></thead><tbody></tbody></table>
  </section>
  <section id="detail" hidden>
    <h2 id="detail-title"></h2>
    <label>show <select id="detail-state">
      <option value="">all partitions</option><option value="unserved">unserved</option>
      <option value="loading">loading</option><option value="under_replicated">under-replicated</option>
      <option value="lagging">lagging</option></select></label>
    <button id="detail-close" class="link">close</button>
    <span id="detail-count" class="muted"></span>
    <table id="partitions"><tbody></tbody></table>
    <button id="detail-more" class="link" hidden>more</button>
  </section>
</main>
<script>
"use strict";
const MAP = "/admin/partition-map";
const LOGIN = "/admin/login?next=/admin/ui";
const QUOTAS = "/admin/quotas";
const STATES = ["unserved", "loading", "under_replicated", "lagging"];
const COLOR = { s: "#1f7a3a", r: "#a86500", l: "#3b5bb5", u: "#b3261e" };
let summary = null, etag = null, ageAt = 0, ageBase = 0;
let drill = null;  // { kind: "store" | "node", name, state, etag, cursor }
const LABELLED = 100;  // up to this many nodes, each cell shows its node's name

function plural(n, word) { return n + " " + word + (n === 1 ? "" : "s"); }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) { node.setAttribute(name, value); }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}
function badge(kind, text, title) {
  const b = el("span", { class: "badge " + kind }, text);
  if (title) { b.title = title; }
  return b;
}
function link(text, onclick, attrs) {
  const b = el("button", { class: "link", ...(attrs || {}) }, text);
  b.addEventListener("click", onclick);
  return b;
}

async function get(url, tag) {
  const headers = tag ? { "If-None-Match": tag } : {};
  const answer = await fetch(url, { headers, cache: "no-store", credentials: "same-origin" });
  if (answer.status === 401) { location.assign(LOGIN); throw new Error("not signed in"); }
  if (answer.status === 304) { return { answer, body: null }; }
  const body = await answer.json();
  if (!answer.ok) { throw new Error(body.message || answer.statusText); }
  return { answer, body };
}

const AGE_HELP = "How long ago this router's map last changed (a record in ZooKeeper was written). " +
  "A quiet cluster's map grows old: that is fine while it says fresh. Stale means the router has lost " +
  "ZooKeeper and keeps serving its last map.";

function tickAge() {
  if (summary === null) { return; }
  const age = ageBase + (performance.now() - ageAt) / 1000;
  const span = document.getElementById("age");
  if (span) { span.textContent = "age " + age.toFixed(0) + " s"; }
}

function renderHeader(s) {
  const fresh = s.stale ? badge("warn", "stale", AGE_HELP) : badge("ok", "fresh", AGE_HELP);
  const age = el("span", { id: "age", title: AGE_HELP }, "");
  document.getElementById("summary").replaceChildren(
    "map generation " + s.generation + " ", fresh, " ", age, " ",
    s.complete ? badge("ok", "complete") : badge("warn", "incomplete"));
  tickAge();
  const banner = document.getElementById("banner");
  if (s.cluster === "empty") {
    banner.style.display = "block";
    banner.textContent = s.cluster_message || "This cluster is empty: no store has been published yet.";
  } else { banner.style.display = "none"; }
  renderPolicy(s.policy);
}

function renderPolicy(p) {
  if (!p) { return; }
  const asks = [];
  if (p.require_access_control) { asks.push("caller access control"); }
  if (p.member_auth !== "none") { asks.push("member authentication " + p.member_auth); }
  if (p.require_tls.length) { asks.push("TLS on " + p.require_tls.join(", ")); }
  document.getElementById("policy").replaceChildren(
    "cluster policy: " + (asks.length ? asks.join("; ") : "asks nothing") + " ",
    p.satisfied ? badge("ok", "met by this router")
      : badge("bad", "not met by this router: it serves no read", p.unmet.join("; ")));
}

const SHOWN = 8;  // names per problem line; the rest are counted

function renderProblems(s) {
  const list = document.getElementById("problems");
  const items = [];
  const byState = new Map();
  for (const p of s.problems) {
    if (!byState.has(p.state)) { byState.set(p.state, []); }
    byState.get(p.state).push(p);
  }
  for (const [state, problems] of byState) {
    const nodes = problems[0].node !== undefined;
    const kind = state === "unserved" || state === "gone" ? "bad" : state === "loading" ? "load" : "warn";
    if (!nodes) { problems.sort((a, b) => b.partitions - a.partitions); }
    const total = nodes ? problems.length : problems.reduce((sum, p) => sum + p.partitions, 0);
    const what = nodes ? total + " node" + (total === 1 ? "" : "s") + ": "
      : total + " partition" + (total === 1 ? "" : "s") + " in " + problems.length + " store" +
        (problems.length === 1 ? "" : "s") + ": ";
    const li = el("li", { "data-problem": state, "data-count": String(total) },
      badge(kind, state.replace("_", "-")), " " + what);
    problems.slice(0, SHOWN).forEach((p, i) => {
      if (i > 0) { li.append(", "); }
      if (nodes) { li.append(link(p.node, () => openDrill("node", p.node), { "data-node": p.node })); }
      else {
        const store = link(p.store, () => openDrill("store", p.store), { "data-store": p.store });
        li.append(store, " (" + p.partitions + ")");
      }
    });
    if (problems.length > SHOWN) { li.append(" and " + (problems.length - SHOWN) + " more"); }
    items.push(li);
  }
  if (s.live_status_error) { items.push(el("li", {}, badge("warn", "live status"), " " + s.live_status_error)); }
  list.className = items.length ? "" : "none";
  list.replaceChildren(...(items.length ? items : [el("li", {}, "nothing: every partition is served as asked")]));
  const t = s.totals;
  document.getElementById("totals").textContent = plural(t.stores, "store") + ", " +
    plural(t.partitions, "partition") + ", " + plural(t.nodes, "node") + " registered (" + t.nodes_leaving +
    " leaving), " + t.nodes_gone + " gone; partitions: " +
    t.served + " served, " + t.under_replicated + " under-replicated, " + t.loading + " loading, " +
    t.unserved + " unserved, " + t.lagging + " lagging";
}

function worst(store) {
  return [store.unserved, store.loading, store.under_replicated, store.lagging || 0];
}

function heat(strip) {
  const canvas = el("canvas", { class: "heat", width: String(strip.length * 3), height: "12", "data-heat": strip });
  const g = canvas.getContext("2d");
  for (let i = 0; i < strip.length; i += 1) { g.fillStyle = COLOR[strip[i]] || "#999"; g.fillRect(i * 3, 0, 3, 12); }
  return canvas;
}

function renderStores(s) {
  const names = Object.keys(s.stores);
  names.sort((a, b) => {
    const x = worst(s.stores[a]), y = worst(s.stores[b]);
    for (let i = 0; i < x.length; i += 1) { if (x[i] !== y[i]) { return y[i] - x[i]; } }
    return a < b ? -1 : a > b ? 1 : 0;
  });
  const rows = names.map((name) => {
    const st = s.stores[name];
    const lag = st.live ? (st.lag_records_max ?? "-") + " / " + (st.lag_records_p99 ?? "-") : "";
    const served = st.versions_served;
    const version = st.version + (served.length > 1 ? " (serving " + served.join(", ") + ")" : "");
    return el("tr", { "data-store": name },
      el("td", {}, link(name, () => openDrill("store", name)), st.live ? " live" : "",
        st.orphaned ? " (orphaned)" : ""),
      el("td", {}, version), el("td", { class: "n" }, st.partitions + " (rf " + st.replication_factor + ")"),
      el("td", { class: "n" }, st.unserved), el("td", { class: "n" }, st.loading),
      el("td", { class: "n" }, st.under_replicated), el("td", { class: "n" }, st.live ? st.lagging : ""),
      el("td", { class: "n" }, lag), el("td", {}, heat(st.heat)));
  });
  document.querySelector("#stores tbody").replaceChildren(...rows);
}

function renderNodes(s) {
  const ids = Object.keys(s.nodes);
  const up = ids.filter((id) => s.nodes[id].state === "up");
  const mean = up.reduce((sum, id) => sum + s.nodes[id].serving, 0) / Math.max(1, up.length);
  const rank = { gone: 0, left: 1, leaving: 2, up: 3 };
  ids.sort((a, b) => (rank[s.nodes[a].state] - rank[s.nodes[b].state]) || (a < b ? -1 : a > b ? 1 : 0));
  const labelled = ids.length <= LABELLED;
  const cells = ids.map((id) => {
    const n = s.nodes[id];
    const cell = el("div", { class: "cell " + n.state, "data-node": id, "data-state": n.state });
    if (n.state === "up") {
      const ratio = mean > 0 ? n.serving / mean : 1;
      const light = Math.round(Math.max(20, Math.min(80, 80 - (ratio - 0.5) * 60)));
      cell.style.background = "hsl(145, 45%, " + light + "%)";
      if (light > 55) { cell.classList.add("light"); }
    }
    cell.title = id + (n.zone ? ", zone " + n.zone : "") + ": " + n.state + ", serves " + n.serving +
      ", assigned " + n.assigned + (n.url ? ", " + n.url : "");
    cell.setAttribute("aria-label", cell.title);
    if (labelled) { cell.textContent = id + (n.state === "up" ? "" : " (" + n.state + ")"); }
    cell.addEventListener("click", () => openDrill("node", id));
    return cell;
  });
  const grid = document.getElementById("grid");
  grid.className = labelled ? "labelled" : "";
  grid.replaceChildren(...cells);
  renderDeparted(s.departed || []);
}

function when(unix) {
  const ago = Math.max(0, Date.now() / 1000 - unix);
  const text = ago < 90 ? Math.round(ago) + " s ago" : ago < 5400 ? Math.round(ago / 60) + " min ago"
    : Math.round(ago / 3600) + " h ago";
  return new Date(unix * 1000).toLocaleTimeString() + " (" + text + ")";
}

const HOW = {
  gone: "gone: its ZooKeeper session ended without it leaving (it died, was killed, or is restarting)",
  left: "left: it was drained and handed its partitions over",
  back: "back: registered again",
};

function renderDeparted(departed) {
  document.getElementById("departures").hidden = departed.length === 0;
  const items = departed.map((d) => {
    const kind = d.state === "back" ? "ok" : d.state === "gone" ? "bad" : "warn";
    const held = Object.entries(d.held).map(([store, n]) => store + " " + n).join(", ");
    const li = el("li", { "data-node": d.node, "data-state": d.state },
      link(d.node, () => openDrill("node", d.node)), " ", badge(kind, d.state, HOW[d.state]),
      " last seen " + when(d.last_seen) + "; held " + plural(d.held_partitions, "partition") +
      (held ? " (" + held + ")" : ""));
    if (d.state === "back") { li.append("; back since " + when(d.back_at)); }
    else if (d.held_partitions > 0) {
      li.append("; " + d.served_again + " of them served as asked again" +
        (d.recovered_at !== null ? " since " + when(d.recovered_at) : ""));
    }
    return li;
  });
  document.getElementById("departed").replaceChildren(...items);
}

function render(s) {
  renderHeader(s);
  renderProblems(s);
  renderStores(s);
  renderNodes(s);
  document.body.setAttribute("data-generation", String(s.generation));
}

// -- the drill-down -------------------------------------------------------------------------------------

function openDrill(kind, name) {
  let state = "";
  if (kind === "store" && summary && summary.stores[name]) {
    const st = summary.stores[name];
    state = STATES.find((k) => (st[k] || 0) > 0) || "";
  }
  drill = { kind, name, state, etag: null };
  document.getElementById("detail-state").value = state;
  document.getElementById("detail").hidden = false;
  document.getElementById("detail-title").textContent = kind + " " + name;
  loadDrill(false);
  document.getElementById("detail").scrollIntoView();
}

function drillUrl(cursor) {
  const q = new URLSearchParams({ [drill.kind]: drill.name, limit: "200" });
  if (drill.state) { q.set("state", drill.state); }
  if (cursor) { q.set("cursor", cursor); }
  return MAP + "?" + q.toString();
}

function partitionRow(entry) {
  const nodes = summary ? summary.nodes : {};
  const serving = new Map(entry.serving.map((s) => [s.node, s]));
  const kind = entry.state === "unserved" ? "bad" : entry.state === "loading" ? "load"
    : entry.state === "under_replicated" ? "warn" : "ok";
  const replicas = el("td", {});
  for (const id of entry.assigned) {
    const s = serving.get(id);
    const known = nodes[id] && nodes[id].state !== "gone";
    const state = !known ? "gone" : s ? "serving" : "assigned";
    replicas.append(el("span", { class: "replica " + state, "data-replica": id, "data-state": state },
      id + (s ? " v" + s.version : state === "gone" ? " (gone)" : " (loading)")));
  }
  for (const s of entry.serving) {
    if (!entry.assigned.includes(s.node)) {
      replicas.append(el("span", { class: "replica serving", "data-replica": s.node, "data-state": "serving" },
        s.node + " v" + s.version + " (handing over)"));
    }
  }
  const row = el("tr", { "data-store": entry.store, "data-partition": String(entry.partition) },
    el("td", {}, entry.store), el("td", { class: "n" }, entry.partition),
    el("td", {}, badge(kind, entry.state.replace("_", "-")), entry.lagging ? badge("warn", "lagging") : ""), replicas);
  if (entry.live !== undefined) {
    row.append(el("td", {}, entry.live.map((r) => r.node + ": " + r.offset + " / " + r.lag_records +
      (r.state && r.state !== "live" ? " " + r.state : "")).join(", ") || "-"));
  }
  return row;
}

async function loadDrill(more) {
  if (drill === null) { return; }
  const mine = drill;
  try {
    const { answer, body } = await get(drillUrl(more ? mine.cursor : null), more ? null : mine.etag);
    if (drill !== mine || body === null) { return; }
    const tbody = document.querySelector("#partitions tbody");
    const rows = body.partitions.map(partitionRow);
    if (more) { tbody.append(...rows); } else {
      const head = el("tr", {}, el("th", {}, "store"), el("th", {}, "partition"), el("th", {}, "state"),
        el("th", {}, "replicas (assigned first)"));
      if (body.partitions.some((e) => e.live !== undefined)) { head.append(el("th", {}, "offset / lag")); }
      tbody.replaceChildren(head, ...rows);
      mine.etag = answer.headers.get("ETag");
    }
    mine.cursor = body.next || null;
    const shown = tbody.querySelectorAll("tr[data-partition]").length;
    document.getElementById("detail-count").textContent = shown + " of " + body.matched + " partitions";
    document.getElementById("detail-more").hidden = !body.next;
    document.getElementById("detail").setAttribute("data-loaded", mine.kind + ":" + mine.name);
  } catch (error) {
    document.getElementById("error").textContent = "cannot read the partitions: " + error.message;
  }
}

document.getElementById("detail-state").addEventListener("change", (event) => {
  if (drill) { drill.state = event.target.value; drill.etag = null; loadDrill(false); }
});
document.getElementById("detail-more").addEventListener("click", () => loadDrill(true));
document.getElementById("detail-close").addEventListener("click", () => {
  drill = null; document.getElementById("detail").hidden = true;
});

// -- the summary, long-polled ---------------------------------------------------------------------------

async function poll() {
  let pause = 0;
  try {
    let url = MAP;
    if (summary !== null) {
      const live = Object.values(summary.stores).some((s) => s.live);
      url += "?since=" + summary.generation + "&wait_s=" + (live ? 5 : 25);
    }
    const { answer, body } = await get(url, etag);
    ageBase = parseFloat(answer.headers.get("X-Keyroute-Map-Age-S") || "0");
    ageAt = performance.now();
    if (body !== null) {
      summary = body;
      etag = answer.headers.get("ETag");
      render(body);
      loadDrill(false);
    }
    tickAge();
    document.getElementById("error").textContent = "";
  } catch (error) {
    document.getElementById("error").textContent = "cannot read the map: " + error.message;
    pause = 2000;
  } finally {
    setTimeout(poll, pause);
  }
}
// -- each identity's rate against its quota, every few seconds --------------------------------------------

async function pollQuotas() {
  try {
    const { body } = await get(QUOTAS);
    const section = document.getElementById("quotas");
    section.hidden = Object.keys(body.identities).length === 0;
    document.getElementById("quota-routers").textContent =
      "each quota is shared by the " + plural(body.routers, "router") + " up; used: the share of the last burst spent";
    const rows = body.buckets.map((b) => el("tr", {}, el("td", {}, b.identity), el("td", {}, b.store),
      el("td", {}, String(b.quota)), el("td", {}, String(b.share)),
      el("td", {}, Math.round(b.used * 100) + "%"), el("td", {}, String(b.reads)),
      el("td", {}, String(b.rejected))));
    document.querySelector("#quota-table tbody").replaceChildren(...rows);
  } catch (error) {
    document.getElementById("quota-routers").textContent = "cannot read the quotas: " + error.message;
  } finally {
    setTimeout(pollQuotas, 5000);
  }
}
setInterval(tickAge, 1000);
setInterval(() => { if (summary !== null) { renderDeparted(summary.departed || []); } }, 5000);  // "N s ago"
poll();
pollQuotas();
</script>
</body>
</html>
"""

"""`GET /dashboard`: one static page showing the cluster live, and `GET /dashboard/data`, the JSON it polls.

The data: every worker as the router sees it (health, circuit, requests in flight, load) with the figures
its `/server_info` reports (queue depths by stage, KV use, transfer bytes and failures, decode
throughput; fetched in parallel with a short timeout, a worker that does not answer shows its error), the
router's request counts and admission, and TTFT / TPOT percentiles over the last minute as the router
observes them (TTFT: first byte of a streamed answer; TPOT: time between its streamed events). The page is
open (it holds no data); the data needs the client key when the router has one, which the page asks for.
With `--planner slo` a Planner panel shows the SLO planner's moves and failures, the move under way, and
its last decisions with their reasons (`planner`: router/planner.py `Planner.describe()`).
"""

from __future__ import annotations

import asyncio
import collections
import time

import aiohttp
import msgspec

INFO_TIMEOUT = 1.5
STAT_KEYS = ("num_running_reqs", "num_queued_reqs", "num_queue_reqs", "kv_total_tokens", "num_tokens_used",
             "gen_throughput", "transfer_bytes", "transfer_successes", "transfer_failures",
             "transfer_failures_bootstrap", "cache_hit_rate")


async def worker_stats(session: aiohttp.ClientSession, auth: dict, w) -> dict:
    """The figures of `STAT_KEYS` in the worker's `/server_info` stats, or {"error": why} (the SLO
    planner reads them too)."""
    try:
        async with session.get(w.url + "/server_info", headers=auth,
                               timeout=aiohttp.ClientTimeout(total=INFO_TIMEOUT)) as r:
            if r.status != 200:
                return {"error": f"/server_info answered {r.status}"}
            info = msgspec.json.decode(await r.read())
    except (TimeoutError, aiohttp.ClientError, OSError, msgspec.DecodeError) as e:
        return {"error": f"/server_info: {type(e).__name__}"}
    stats = info.get("stats") if isinstance(info, dict) else None
    if not isinstance(stats, dict):
        return {"error": "/server_info has no stats"}
    return {k: stats[k] for k in STAT_KEYS if k in stats}


async def dashboard_data(app) -> dict:
    """Everything the page shows, in one JSON object."""
    workers = app.registry.all()
    stats = await asyncio.gather(*(worker_stats(app.session, app.registry.auth, w) for w in workers))
    m = app.metrics
    by_status: collections.Counter = collections.Counter()
    for (_, status), n in m.requests.items():
        by_status[str(status)] += n
    adm = m.admission
    planner = getattr(app, "planner", None)  # router/planner.py, with --planner slo
    return {
        "time": time.time(),
        "workers": [{**w.describe(), "stats": s} for w, s in zip(workers, stats, strict=True)],
        "requests": {"total": sum(by_status.values()), "by_status": dict(by_status), "retries": m.retries,
                     "client_disconnects": m.client_disconnects, "stream_errors": m.stream_errors,
                     "in_flight": adm.in_flight if adm is not None else None,
                     "queued": adm.queued if adm is not None else None},
        "latency": m.latency.percentiles(),
        "planner": planner.describe() if planner is not None else {"enabled": False},
    }


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>pdserve cluster</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em;margin:0 0 .6em}
.cards{display:flex;gap:1em;flex-wrap:wrap;margin-bottom:1em}
.card{border:1px solid #ccc;border-radius:6px;padding:.6em 1em;min-width:9em}
.card b{display:block;font-size:1.4em}
table{border-collapse:collapse;width:100%}
th,td{border-bottom:1px solid #ddd;padding:.35em .6em;text-align:left;white-space:nowrap}
.bad{color:#b00020;font-weight:bold}.ok{color:#1b5e20}
#status{color:#666;margin-left:1em;font-size:.9em}
.note{color:#666;margin-left:1em;font-size:.9em;font-weight:normal}
h2{font-size:1.1em;margin:1.2em 0 .5em}
#planner-decisions td:last-child{white-space:normal}
</style></head>
<body>
<h1>pdserve cluster <span id="status">loading...</span></h1>
<div id="key" hidden>Router API key: <input id="keyinput" type="password">
 <button id="keybtn">use</button></div>
<div class="cards">
 <div class="card">requests<b id="req-total">-</b></div>
 <div class="card">requests/s<b id="req-rate">-</b></div>
 <div class="card">in flight<b id="in-flight">-</b></div>
 <div class="card">TTFT p50 / p99 (s)<b id="ttft">-</b></div>
 <div class="card">TPOT p50 / p99 (s)<b id="tpot">-</b></div>
 <div class="card">errors (5xx)<b id="errors">-</b></div>
</div>
<table><thead><tr><th>worker</th><th>type</th><th>health</th><th>circuit</th><th>in flight</th>
<th>running</th><th>queues</th><th>KV use</th><th>gen tok/s</th><th>transfer MB/s</th>
<th>transfers ok / failed</th></tr></thead><tbody id="workers"></tbody></table>
<h2>Planner <span id="planner-state" class="note">-</span></h2>
<div id="planner" hidden>
<div class="cards">
 <div class="card">moves<b id="planner-moves">-</b></div>
 <div class="card">failed moves<b id="planner-failures">-</b></div>
 <div class="card">under way<b id="planner-moving">-</b></div>
</div>
<p>last decision: <b id="planner-action">-</b> <span id="planner-reason"></span></p>
<table><thead><tr><th>time</th><th>decision</th><th>reason</th></tr></thead>
<tbody id="planner-decisions"></tbody></table>
</div>
<script>
"use strict";
let key = sessionStorage.getItem("pdserveKey") || "";
let prev = null;
const $ = (id) => document.getElementById(id);
const fmt = (v, d = 3) => (v === null || v === undefined) ? "-" : Number(v).toFixed(d);
function cell(text, cls) { const td = document.createElement("td"); td.textContent = text;
  if (cls) td.className = cls; return td; }
function render(d) {
  const rate = prev ? (d.requests.total - prev.requests.total) / Math.max(d.time - prev.time, 1e-3) : null;
  const mbps = {};
  for (const w of d.workers) {
    const p = prev && prev.workers.find((x) => x.url === w.url);
    if (p && p.stats.transfer_bytes !== undefined && w.stats.transfer_bytes !== undefined)
      mbps[w.url] = (w.stats.transfer_bytes - p.stats.transfer_bytes) / 1e6
        / Math.max(d.time - prev.time, 1e-3);
  }
  $("req-total").textContent = d.requests.total;
  $("req-rate").textContent = fmt(rate, 1);
  $("in-flight").textContent = d.requests.in_flight === null ? "-" : d.requests.in_flight;
  $("ttft").textContent = fmt(d.latency.ttft.p50) + " / " + fmt(d.latency.ttft.p99);
  $("tpot").textContent = fmt(d.latency.tpot.p50) + " / " + fmt(d.latency.tpot.p99);
  let errors = 0;
  for (const [s, n] of Object.entries(d.requests.by_status)) if (Number(s) >= 500) errors += n;
  $("errors").textContent = errors;
  const body = $("workers"); body.replaceChildren();
  for (const w of d.workers) {
    const s = w.stats || {}; const tr = document.createElement("tr"); tr.dataset.url = w.url;
    const local = w.local_prefill ? ", " + w.local_prefills + " local prefills" : "";
    const groups = w.dp_size > 1 ? " (" + w.dp_size + " DP groups)" : "";
    tr.append(cell(w.url), cell(w.worker_type + groups + local),
      cell(w.is_healthy ? "healthy" : "unhealthy", w.is_healthy ? "ok" : "bad"),
      cell(w.circuit_breaker, w.circuit_breaker === "closed" ? "ok" : "bad"), cell(w.active_requests));
    if (s.error) { const td = cell(s.error, "bad"); td.colSpan = 6; tr.append(td); }
    else {
      const queues = s.num_queue_reqs
        ? Object.entries(s.num_queue_reqs).map(([q, n]) => q + " " + n).join(", ") : "-";
      const kv = s.kv_total_tokens ? (100 * s.num_tokens_used / s.kv_total_tokens).toFixed(1) + " %" : "-";
      tr.append(cell(s.num_running_reqs ?? "-"), cell(queues), cell(kv), cell(fmt(s.gen_throughput, 1)),
        cell(fmt(mbps[w.url], 2)), cell((s.transfer_successes ?? "-") + " / " + (s.transfer_failures ?? "-"),
        s.transfer_failures ? "bad" : ""));
    }
    body.append(tr);
  }
  renderPlanner(d.planner || {enabled: false});
  $("status").textContent = "updated " + new Date(d.time * 1000).toLocaleTimeString();
  prev = d;
}
const SHOWN_DECISIONS = 8;
function renderPlanner(p) {
  $("planner").hidden = !p.enabled;
  if (!p.enabled) { $("planner-state").textContent = "off (--planner none)"; return; }
  $("planner-state").textContent = "SLOs: TTFT p90 " + p.ttft_slo + " s, ITL p90 " + p.itl_slo
    + " s (actuator " + p.actuator + ")";
  $("planner-moves").textContent = p.moves;
  $("planner-failures").textContent = p.failures;
  $("planner-failures").className = p.failures ? "bad" : "";
  $("planner-moving").textContent = p.moving || "-";
  const ds = p.decisions || [];
  const last = ds.length ? ds[ds.length - 1] : null;
  $("planner-action").textContent = last ? last.action : "-";
  $("planner-reason").textContent = last ? last.reason : "no window yet";
  const body = $("planner-decisions"); body.replaceChildren();
  for (const x of ds.slice(-SHOWN_DECISIONS).reverse()) {
    const tr = document.createElement("tr");
    tr.append(cell(new Date(x.time * 1000).toLocaleTimeString()),
      cell(x.action, x.action === "hold" ? "" : "ok"), cell(x.reason));
    body.append(tr);
  }
}
async function poll() {
  try {
    const r = await fetch("dashboard/data", {headers: key ? {"Authorization": "Bearer " + key} : {}});
    if (r.status === 401 || r.status === 403) {
      $("key").hidden = false; $("status").textContent = "needs the API key";
    }
    else if (!r.ok) $("status").textContent = "router answered " + r.status;
    else { $("key").hidden = true; render(await r.json()); }
  } catch (e) { $("status").textContent = "router unreachable"; }
  setTimeout(poll, 1000);
}
$("keybtn").onclick = () => { key = $("keyinput").value; sessionStorage.setItem("pdserveKey", key); };
poll();
</script></body></html>
"""

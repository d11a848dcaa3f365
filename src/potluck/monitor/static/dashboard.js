// potluck monitor dashboard: reads /api/events (Server-Sent Events, one a second) and redraws.
// Plain DOM and SVG, no library; every value from the server is set as text, never as HTML.
"use strict";

const MAX_POINTS = 10000;  // history kept for the charts (the server sends at most as many)
const history = [];        // HistoryPoint objects, oldest first
let updates = 0;

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";

function fmt(value, digits = 1) {
  if (value === null || value === undefined) return "–";
  if (Math.abs(value) >= 1000) return Math.round(value).toLocaleString("en-US");
  return Number(value).toFixed(digits);
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 90) return `${Math.round(seconds)} s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function shortId(id) { return id.length > 14 ? `${id.slice(0, 6)}…${id.slice(-6)}` : id; }

function cell(row, text, field, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (field) td.dataset.field = field;
  if (className) td.className = className;
  row.appendChild(td);
  return td;
}

function peerCell(row, peer) {
  const td = cell(row, peer.name ? `${peer.name} ` : "", "peer");
  const id = document.createElement("span");
  id.className = "id";
  id.textContent = shortId(peer.peer_id);
  id.title = peer.peer_id;
  td.appendChild(id);
}

function drawSwarm(swarm) {
  $("run-id").textContent = swarm.run_id;
  $("peers-online").textContent = swarm.peers_online;
  $("samples-per-second").textContent = fmt(swarm.samples_per_second);
  $("epoch").textContent = swarm.epoch;
  $("batch-progress").textContent = swarm.target_batch_size
    ? `${swarm.samples} / ${swarm.target_batch_size}` : `${swarm.samples}`;
  $("eta").textContent = duration(swarm.eta_seconds);
}

function drawPeers(peers, now) {
  const rows = peers.map((peer) => {
    const row = document.createElement("tr");
    row.dataset.peer = peer.peer_id;
    row.dataset.online = peer.online;
    if (!peer.online) row.className = peer.refused ? "offline refused" : "offline";
    peerCell(row, peer);
    cell(row, peer.refused ? "refused" : peer.online ? "online" : "offline", "state");
    if (peer.refused) row.title = peer.refused;  // why: another model or settings than the run's
    cell(row, peer.epoch, "epoch");
    cell(row, fmt(peer.samples_per_second), "samples_per_second");
    cell(row, peer.client_mode ? "client" : "full", "mode");
    cell(row, `${duration(Math.max(0, now - peer.last_seen))} ago`, "last_seen");
    return row;
  });
  $("peers").replaceChildren(...rows);
}

function drawContributors(contributors) {
  const rows = contributors.map((c, i) => {
    const row = document.createElement("tr");
    row.dataset.contributor = c.peer_id;
    cell(row, i + 1, "rank");
    peerCell(row, c);
    cell(row, c.samples, "samples");
    cell(row, `${(100 * c.share).toFixed(1)} %`, "share");
    cell(row, c.online_hours.toFixed(2), "online_hours");
    cell(row, c.epochs, "epochs");
    return row;
  });
  $("contributors").replaceChildren(...rows);
}

function drawEpochs(epochs) {
  const rows = epochs.map((e) => {
    const row = document.createElement("tr");
    row.dataset.epoch = e.epoch;
    cell(row, e.epoch, "epoch");
    cell(row, new Date(e.time * 1000).toLocaleTimeString(), "time");
    cell(row, e.samples, "samples");
    cell(row, e.group_sizes.join(" + ") || "–", "group_sizes");
    cell(row, e.failed_rounds, "failed_rounds");
    cell(row, Object.entries(e.metrics).map(([k, v]) => `${k} ${fmt(v, 3)}`).join(", ") || "–", "metrics");
    return row;
  });
  $("epochs").replaceChildren(...rows);
}

// A line chart of (time, value) pairs in an SVG with a 600 x 220 viewBox: one <path class="line">
// whose data-points / data-last / data-last-time attributes say what it shows (the browser check
// reads them).
function drawChart(svg, points, digits) {
  const W = 600, H = 220, left = 46, right = 8, top = 10, bottom = 22;
  svg.replaceChildren();
  svg.dataset.points = points.length;
  if (points.length === 0) return;
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs);
  let y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (y1 - y0 < 1e-12) { y0 -= 0.5; y1 += 0.5; }
  const X = (x) => left + (x1 > x0 ? (x - x0) / (x1 - x0) : 1) * (W - left - right);
  const Y = (y) => top + (1 - (y - y0) / (y1 - y0)) * (H - top - bottom);
  for (const [y, label] of [[y1, fmt(y1, digits)], [y0, fmt(y0, digits)]]) {
    const line = document.createElementNS(SVG, "line");
    line.setAttribute("class", "grid");
    line.setAttribute("x1", left); line.setAttribute("x2", W - right);
    line.setAttribute("y1", Y(y)); line.setAttribute("y2", Y(y));
    svg.appendChild(line);
    const text = document.createElementNS(SVG, "text");
    text.setAttribute("x", 2); text.setAttribute("y", Y(y) + 4);
    text.textContent = label;
    svg.appendChild(text);
  }
  const span = document.createElementNS(SVG, "text");
  span.setAttribute("x", W - right - 90); span.setAttribute("y", H - 4);
  span.textContent = `last ${duration(x1 - x0)}`;
  svg.appendChild(span);
  const path = document.createElementNS(SVG, "path");
  path.setAttribute("class", "line");
  path.setAttribute("d", points.map((p, i) => `${i ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" "));
  path.dataset.points = points.length;
  path.dataset.last = ys[ys.length - 1];
  path.dataset.lastTime = xs[xs.length - 1];
  svg.appendChild(path);
}

function drawCharts() {
  const loss = history.filter((p) => p.loss !== null).map((p) => [p.time, p.loss]);
  const sps = history.map((p) => [p.time, p.samples_per_second]);
  drawChart($("loss-chart"), loss, 3);
  drawChart($("sps-chart"), sps, 1);
  $("loss-last").textContent = loss.length ? `(now ${fmt(loss[loss.length - 1][1], 4)})` : "";
  $("sps-last").textContent = sps.length ? `(now ${fmt(sps[sps.length - 1][1])})` : "";
}

function onEvent(message) {
  const event = JSON.parse(message.data);
  const newest = history.length ? history[history.length - 1].time : -Infinity;
  for (const point of event.history) if (point.time > newest) history.push(point);
  if (history.length > MAX_POINTS) history.splice(0, history.length - MAX_POINTS);
  drawSwarm(event.swarm);
  drawPeers(event.peers, event.swarm.time);
  drawContributors(event.contributors);
  drawEpochs(event.epochs);
  drawCharts();
  updates += 1;
  const status = $("status");
  status.dataset.updates = updates;
  status.className = "";
  status.textContent = `live · updated ${new Date(event.swarm.time * 1000).toLocaleTimeString()}`;
}

const source = new EventSource("/api/events");
source.onmessage = onEvent;
source.onerror = () => {
  $("status").className = "stale";
  $("status").textContent = "connection lost: reconnecting…";
};

// batchgate dashboard: renders the snapshot served in the page (<script id="snapshot">),
// then the server's updates (server-sent events on "events"). Every URL is relative, so
// the page works under any path prefix. No external code.
"use strict";

const HISTORY = 240; // depth points kept per queue (2 minutes at the default 0.5 s)
const FAILURES_SHOWN = 8;
const COLORS = ["#d9480f", "#1971c2", "#868e96"]; // high, normal, low
const state = { config: null, cards: new Map(), history: new Map(), shown: new Map() };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function pick(obj, path) {
  return path.split(".").reduce((o, k) => (o == null ? null : o[k]), obj);
}

function fmt(v, unit) {
  if (v == null) return "–";
  if (unit === "ms") return v < 1000 ? `${v.toFixed(1)} ms` : `${(v / 1000).toFixed(2)} s`;
  if (unit === "/s") return `${v.toFixed(1)}/s`;
  if (typeof v === "number" && !Number.isInteger(v)) return v.toFixed(1);
  if (typeof v === "number") return v.toLocaleString("en");
  return String(v);
}

// A round number at or above `v`, for the top of a y axis: 1, 2, 5, 10, 20, 50…
function ceiling(v) {
  const step = 10 ** Math.floor(Math.log10(Math.max(1, v)));
  return [1, 2, 5, 10].map((m) => m * step).find((top) => top >= v);
}

function axes(chart, yTop, xLeft, xRight) {
  const plot = chart.closest(".plot");
  plot.querySelector(".y-top").textContent = yTop;
  if (xLeft != null) plot.querySelector(".x-left").textContent = xLeft;
  if (xRight != null) plot.querySelector(".x-right").textContent = xRight;
}

function token() {
  return document.getElementById("token").value.trim();
}

async function act(queue, path, body, question) {
  if (!window.confirm(question)) return;
  const res = await fetch(`api/queues/${encodeURIComponent(queue)}/${path}`, {
    method: "POST",
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${token()}` },
    body: JSON.stringify(body),
  });
  const answer = await res.json().catch(() => ({}));
  const text = res.ok ? JSON.stringify(answer) : `refused (${res.status}): ${answer.error}`;
  const notice = document.getElementById("notice");
  notice.textContent = text;
  notice.classList.toggle("bad", !res.ok);
  return res.ok;
}

function setStatus(text, bad) {
  const node = document.getElementById("status");
  node.textContent = text;
  node.classList.toggle("bad", !!bad);
}

function policyForm(card, queue) {
  const form = card.querySelector(".policy-form");
  const fields = ["strategy", ...Object.keys(state.config.limits)];
  for (const name of fields) {
    const input = name === "strategy"
      ? el("select", { name }, ...state.config.strategies.map((s) => el("option", { value: s }, s)))
      : el("input", { name, type: "text", inputmode: "numeric", size: 10,
                      title: `${state.config.limits[name][0]}–${state.config.limits[name][1]}` });
    form.append(el("label", {}, name, input));
  }
  form.append(el("button", { type: "submit" }, "apply"));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const body = {};
    for (const name of fields) {
      const value = form.elements[name].value;
      // Numbers as numbers; anything else (a future "auto") as typed, for the server to judge.
      if (value !== "") body[name] = name === "strategy" || !/^-?\d+$/.test(value) ? value
        : Number(value);
    }
    if (await act(queue, "policy", body, `Change the policy of queue ${queue}?`)) {
      form.dataset.filled = "";
    }
  });
}

// Folded: idle, and not unfolded by a click on its title.
function fold(card) {
  const folded = card.classList.contains("idle") && !card.classList.contains("open");
  card.classList.toggle("folded", folded);
  card.querySelector(".fold").textContent = folded ? "▸ " : "▾ ";
}

function cardFor(queue) {
  let card = state.cards.get(queue);
  if (card) return card;
  card = document.getElementById("queue-card").content.firstElementChild.cloneNode(true);
  card.dataset.queue = queue;
  card.id = `queue-${queue}`;
  card.querySelector(".name").textContent = queue;
  // An idle queue is folded to its title line; a click on the title unfolds it (and
  // keeps it so), or folds it back.
  card.querySelector("h2").addEventListener("click", () => {
    card.classList.toggle("open");
    fold(card);
  });
  if (state.config.actions) {
    for (const node of card.querySelectorAll(".action")) node.hidden = false;
    card.querySelector(".retry-all").addEventListener("click", () =>
      act(queue, "dead-letters/retry", { all: true },
          `Retry every dead letter of queue ${queue}?`));
    card.querySelector(".purge-all").addEventListener("click", () =>
      act(queue, "dead-letters/purge", { all: true },
          `Purge (delete for good) every dead letter of queue ${queue}?`));
    policyForm(card, queue);
  }
  state.cards.set(queue, card);
  return card;
}

// Replace a table body or list only when its content changed: a button must not be
// swapped out from under a click at every update.
function replaceIfChanged(card, key, container, rows, build) {
  const sig = JSON.stringify(rows);
  const shownKey = `${card.dataset.queue}/${key}`;
  if (state.shown.get(shownKey) === sig) return;
  state.shown.set(shownKey, sig);
  container.replaceChildren(...rows.map(build));
}

// Depth over the last HISTORY updates: x is time (seconds before the newest point: what
// the page has seen, at least 30 s), y requests waiting, from 0 to a round number at or
// above the highest.
function drawDepth(card, points) {
  const chart = card.querySelector(".depth-chart");
  const now = points[points.length - 1][0];
  const seen = Math.ceil((now - points[0][0]) / 30) * 30;
  const windowS = Math.min(HISTORY * state.config.interval_s, Math.max(30, seen));
  const top = ceiling(Math.max(...points.map((p) => Math.max(p[1], p[2], p[3]))));
  // One reading (a page just served): a short level line, not an invisible point.
  const drawn = points.length > 1 ? points
    : [[now - 2 * state.config.interval_s, ...points[0].slice(1)], points[0]];
  const lines = [0, 1, 2].map((prio) => {
    const coords = drawn.map((p) =>
      `${400 * (1 - (now - p[0]) / windowS)},${119 - (p[prio + 1] / top) * 114}`);
    return svg("polyline", { points: coords.join(" "), fill: "none",
                             stroke: COLORS[prio], "stroke-width": 2,
                             "vector-effect": "non-scaling-stroke" });
  });
  chart.replaceChildren(...lines);
  axes(chart, top.toLocaleString("en"), `−${Math.round(windowS)} s`);
}

function drawSizes(card, sizes) {
  const chart = card.querySelector(".size-chart");
  const entries = Object.entries(sizes).map(([s, n]) => [Number(s), n]);
  chart.closest(".plot").classList.toggle("empty", !entries.length);
  if (!entries.length) {
    chart.replaceChildren();
    axes(chart, "", "", "");
    return;
  }
  // x: batch size 1 to the largest seen (one bar each); y: batches of that size.
  const largest = Math.max(...entries.map((e) => e[0]));
  const top = ceiling(Math.max(...entries.map((e) => e[1])));
  const width = 400 / largest;
  const bars = entries.map(([size, n]) => {
    const h = (n / top) * 114;
    const bar = svg("rect", { x: (size - 1) * width + 0.5, y: 120 - h,
                              width: Math.max(1, width - 1), height: h, class: "bar" });
    const tip = svg("title", {});
    tip.textContent = `size ${size}: ${n} batches`;
    bar.append(tip);
    return bar;
  });
  chart.replaceChildren(...bars);
  axes(chart, top.toLocaleString("en"), "1", String(largest));
}

function render(snap) {
  const card = cardFor(snap.queue);
  const p = snap.policy;
  card.querySelector(".policy-line").textContent = snap.policy_text; // the CLI's words
  card.classList.toggle("idle", !snap.busy);
  fold(card);
  for (const node of card.querySelectorAll("[data-f]")) {
    node.textContent = fmt(pick(snap, node.dataset.f), node.dataset.unit);
  }

  const history = state.history.get(snap.queue) || [];
  if (!history.length || history[history.length - 1][0] < snap.time_s) {
    history.push([snap.time_s, snap.depth.high, snap.depth.normal, snap.depth.low]);
  }
  if (history.length > HISTORY) history.shift();
  state.history.set(snap.queue, history);
  drawDepth(card, history);
  drawSizes(card, snap.batch_sizes);

  replaceIfChanged(card, "consumers", card.querySelector(".consumers tbody"),
    snap.consumers.map((c) => [c.name, c.host, c.device || "–",
      `${c.heartbeat_age_s.toFixed(1)} s ago`,
      c.batch ? (c.batch_size ? `${c.batch} (${c.batch_size} requests)` : c.batch) : "idle",
      fmt(c.batches_per_s)]),
    (row) => el("tr", {}, ...row.map((v) => el("td", { title: v }, v))));

  // Tenants (docs/tenants.md): the busiest, the rest summed as "other"; a backlogged
  // tenant's share of the weighted service, Jain's index over them in the heading.
  const tenants = Object.entries(snap.tenants || {});
  replaceIfChanged(card, "tenants", card.querySelector(".tenants tbody"),
    tenants.map(([name, t]) => [name, fmt(t.waiting), fmt(t.in_flight), fmt(t.served),
                                fmt(t.served_cost), fmt(t.rejected),
                                t.share == null ? "–" : `${(100 * t.share).toFixed(1)}%`]),
    (row) => el("tr", {}, ...row.map((v) => el("td", { title: v }, v))));
  const fair = snap.tenant_fairness || {};
  const counters = snap.tenant_counters || {};
  let heading = `(${fmt(snap.tenant_count ?? tenants.length)}`;
  if (fair.jain_index != null) {
    heading += `; ${fmt(fair.backlogged)} backlogged, Jain's index ` +
      `${fair.jain_index.toFixed(3)} by ${fair.unit}`;
  }
  heading += ")";
  const unread = counters.read === false;
  if (unread) {
    heading = `(not read: ${fmt(counters.fields)} counters, over the ` +
      `${fmt(counters.read_cap)} read)`;
  }
  card.querySelector(".tenant-total").textContent = heading;
  card.querySelector(".tenants").hidden = !tenants.length;
  card.querySelector(".tenant-total").parentElement.hidden = !tenants.length && !unread;

  // Counts in the headings; a table with no rows is not drawn.
  card.querySelector(".consumer-total").textContent = `(${snap.consumers.length})`;
  card.querySelector(".consumers").hidden = !snap.consumers.length;
  card.querySelector(".dead-total").textContent = `(${snap.dead.total})`;
  card.querySelector(".dead").hidden = !snap.dead.total;
  card.querySelector(".failure-total").textContent =
    `(${Math.min(FAILURES_SHOWN, snap.recent_failures.length)})`;
  replaceIfChanged(card, "dead", card.querySelector(".dead tbody"),
    snap.dead.shown.map((d) => [d.id, `${d.error_type}: ${d.message}`, fmt(d.attempts),
                                d.payload_preview || ""]),
    (row) => {
      const tr = el("tr", { "data-id": row[0] }, ...row.map((v) => el("td", { title: v }, v)));
      const cell = el("td", {});
      if (state.config.actions) {
        cell.append(
          el("button", { class: "retry", onclick: () => act(snap.queue, "dead-letters/retry",
            { ids: [row[0]] }, `Retry request ${row[0]} of queue ${snap.queue}?`) }, "retry"),
          el("button", { class: "purge danger", onclick: () => act(snap.queue,
            "dead-letters/purge", { ids: [row[0]] },
            `Purge request ${row[0]} of queue ${snap.queue} for good?`) }, "purge"));
      }
      tr.append(cell);
      return tr;
    });

  replaceIfChanged(card, "failures", card.querySelector(".failures"),
    snap.recent_failures.slice(0, FAILURES_SHOWN).map((f) => [new Date(f.at_ms).toISOString().slice(11, 19),
                                     f.id, `${f.type}: ${f.message}`]),
    (row) => el("li", {}, `${row[0]} ${row[1]} — ${row[2]}`));

  const form = card.querySelector(".policy-form");
  if (state.config.actions && p && !form.dataset.filled && !form.contains(document.activeElement)) {
    for (const [k, v] of Object.entries(p)) if (form.elements[k]) form.elements[k].value = v;
    form.dataset.filled = "1";
  }
  return card;
}

function update(data) {
  if (data.error) {
    setStatus(data.error, true);
    return;
  }
  const main = document.getElementById("queues");
  const cards = data.queues.map(render);
  if (!cards.length) {
    main.replaceChildren(el("p", { class: "empty" }, "no queues registered yet: a consumer, " +
      "a producer's first submit or `batchgate policy set` registers one"));
    return;
  }
  // Keep the nodes (and what is typed in them); only add, drop or reorder.
  const current = [...main.children];
  if (current.length !== cards.length || current.some((n, i) => n !== cards[i])) {
    main.replaceChildren(...cards);
  }
  setStatus(`live · ${new Date(data.at * 1000).toLocaleTimeString()}`);
}

async function start() {
  state.config = await (await fetch("api/config")).json();
  // The snapshot served with the page: drawn before the live feed's first event.
  const first = JSON.parse(document.getElementById("snapshot").textContent);
  if (first) update(first);
  if (first && !first.error) {
    setStatus(`as served · ${new Date(first.at * 1000).toLocaleTimeString()} · ` +
              "connecting to the live feed…");
  }
  document.getElementById("mode").textContent = state.config.actions
    ? "actions allowed with the token" : "read-only";
  document.getElementById("token-box").hidden = !state.config.actions;
  const tokenInput = document.getElementById("token");
  tokenInput.value = sessionStorage.getItem("batchgate-token") || "";
  tokenInput.addEventListener("change", () =>
    sessionStorage.setItem("batchgate-token", tokenInput.value));
  const source = new EventSource("events");
  source.onmessage = (event) => update(JSON.parse(event.data));
  source.onerror = () => setStatus("disconnected, retrying…", true);
}

start().catch((err) => setStatus(`failed to start: ${err}`, true));

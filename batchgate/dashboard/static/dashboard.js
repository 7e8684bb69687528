// batchgate dashboard: renders the server's snapshots (server-sent events on "events").
// Every URL is relative, so the page works under any path prefix. No external code.
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

function fmt(v) {
  if (v == null) return "–";
  if (typeof v === "number" && !Number.isInteger(v)) return v.toFixed(1);
  return String(v);
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

function cardFor(queue) {
  let card = state.cards.get(queue);
  if (card) return card;
  card = document.getElementById("queue-card").content.firstElementChild.cloneNode(true);
  card.dataset.queue = queue;
  card.id = `queue-${queue}`;
  card.querySelector(".name").textContent = queue;
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

function drawDepth(card, points) {
  const chart = card.querySelector(".depth-chart");
  const most = Math.max(1, ...points.map((p) => Math.max(...p)));
  const lines = [0, 1, 2].map((prio) => {
    const coords = points.map((p, i) =>
      `${(i / (Math.max(points.length, 60) - 1)) * 400},${118 - (p[prio] / most) * 110}`);
    return svg("polyline", { points: coords.join(" "), fill: "none",
                             stroke: COLORS[prio], "stroke-width": 2,
                             "vector-effect": "non-scaling-stroke" });
  });
  const label = svg("text", { x: 4, y: 12, class: "axis" });
  label.textContent = `max ${most}`;
  chart.replaceChildren(...lines, label);
}

function drawSizes(card, sizes) {
  const chart = card.querySelector(".size-chart");
  const entries = Object.entries(sizes).map(([s, n]) => [Number(s), n]);
  if (!entries.length) {
    const t = svg("text", { x: 4, y: 60, class: "axis" });
    t.textContent = "no batches yet";
    chart.replaceChildren(t);
    return;
  }
  const largest = Math.max(...entries.map((e) => e[0]));
  const most = Math.max(...entries.map((e) => e[1]));
  const width = 400 / largest;
  const bars = entries.map(([size, n]) => {
    const h = (n / most) * 104;
    const bar = svg("rect", { x: (size - 1) * width + 0.5, y: 106 - h,
                              width: Math.max(1, width - 1), height: h, class: "bar" });
    const tip = svg("title", {});
    tip.textContent = `size ${size}: ${n} batches`;
    bar.append(tip);
    return bar;
  });
  const label = svg("text", { x: 396, y: 118, class: "axis", "text-anchor": "end" });
  label.textContent = `1…${largest}`;
  chart.replaceChildren(...bars, label);
}

function render(snap) {
  const card = cardFor(snap.queue);
  const p = snap.policy;
  card.querySelector(".policy-line").textContent = p
    ? `${p.strategy}, batch ≤ ${p.max_batch_size}, delay ${p.max_queue_delay_ms} ms, ` +
      `aging ${p.aging_ms} ms, max attempts ${p.max_attempts}`
    : "no policy yet";
  for (const node of card.querySelectorAll("[data-f]")) {
    node.textContent = fmt(pick(snap, node.dataset.f));
  }
  const adaptive = card.querySelector(".adaptive");
  const delay = Object.entries(snap.adaptive_delay || {});
  adaptive.hidden = !delay.length;
  adaptive.textContent = delay.map(([k, v]) => `${k}: ${v}`).join(", ");

  const history = state.history.get(snap.queue) || [];
  history.push([snap.depth.high, snap.depth.normal, snap.depth.low]);
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

  card.querySelector(".dead-total").textContent = `(${snap.dead.total})`;
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

// whet's page: chat (streamed), feedback on every answer, and the Learning view.
// Plain browser JavaScript, no build step and nothing fetched from elsewhere: it talks only to
// this server's API, with the key kept in localStorage (sent as a Bearer token).
"use strict";

const KEY = "whet.key";
const state = { model: null, session: null, messages: [], busy: false };

// ------------------------------------------------------------------ helpers

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (value !== null && value !== undefined) node.setAttribute(name, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function headers(extra = {}) {
  const key = localStorage.getItem(KEY);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: headers(options.headers || {}) });
  if (response.status === 401) { askKey("That key was not accepted."); throw new ApiError(401, "API key needed"); }
  if (!response.ok) throw new ApiError(response.status, await errorText(response));
  return response.status === 204 ? null : response.json();
}

async function errorText(response) {
  try { return (await response.json()).error.message; } catch { return `HTTP ${response.status}`; }
}

function when(iso) {
  const d = new Date(iso);
  return d.toLocaleString([], { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" });
}

function versionName(v) { return v || "base"; }

// ------------------------------------------------------------------ API key

function askKey(message = "") {
  const dialog = document.getElementById("key-dialog");
  document.getElementById("key-error").textContent = message;
  document.getElementById("key-input").value = localStorage.getItem(KEY) || "";
  if (!dialog.open) dialog.showModal();
}

function setupKeyDialog() {
  document.getElementById("key-button").addEventListener("click", () => askKey());
  document.getElementById("key-form").addEventListener("submit", () => {
    const key = document.getElementById("key-input").value.trim();
    if (key) localStorage.setItem(KEY, key);
    start();
  });
  document.getElementById("key-forget").addEventListener("click", () => {
    localStorage.removeItem(KEY);
    document.getElementById("key-input").value = "";
  });
}

// ------------------------------------------------------------------ start

async function start() {
  try {
    const models = await api("/v1/models");
    const card = models.data[0];
    state.model = card.id;
    document.getElementById("model-name").textContent = card.id;
    document.getElementById("live-adapter").textContent = versionName(card.adapter);
    await loadSessions();
  } catch (error) {
    if (error.status !== 401) document.getElementById("model-name").textContent = `server unreachable: ${error.message}`;
  }
}

async function refreshLive() {
  try {
    const card = (await api("/v1/models")).data[0];
    document.getElementById("live-adapter").textContent = versionName(card.adapter);
  } catch { /* the header keeps its last value */ }
}

// ------------------------------------------------------------------ sessions

async function loadSessions() {
  const list = document.getElementById("session-list");
  const sessions = await api("/v1/sessions?limit=50");
  list.replaceChildren(...sessions.map((s) =>
    el("li", { class: s.id === state.session ? "active" : "", "data-session": s.id, title: s.title,
               onclick: () => openSession(s.id) },
       s.title, el("span", { class: "meta" }, `${when(s.updated_at)} · ${s.turns} turns`))));
}

async function openSession(id) {
  document.querySelectorAll("#session-list li").forEach((li) => li.classList.toggle("active", li.dataset.session === id));
  const detail = await api(`/v1/sessions/${encodeURIComponent(id)}`);
  state.session = id;
  state.messages = detail.messages;
  const box = document.getElementById("messages");
  box.replaceChildren();
  for (const exchange of detail.exchanges) {
    if (exchange.user !== null) box.append(userMessage(exchange.user));
    const view = assistantMessage();
    box.append(view.node);
    showExchange(view, exchange);
  }
  box.scrollTop = box.scrollHeight;
  await loadSessions();
}

function newChat() {
  state.session = null;
  state.messages = [];
  document.getElementById("messages").replaceChildren(
    el("div", { class: "empty", id: "chat-empty" }, "New conversation. Rate answers with 👍 / 👎 or correct them: whet learns from it."));
  document.querySelectorAll("#session-list li").forEach((li) => li.classList.remove("active"));
  document.getElementById("prompt").focus();
}

// ------------------------------------------------------------------ messages

function userMessage(text) { return el("div", { class: "msg user" }, text); }

function assistantMessage() {
  const tools = el("div", { class: "tools" });
  const bubble = el("div", { class: "bubble" });
  const foot = el("div", { class: "foot" });
  const node = el("div", { class: "msg assistant" }, tools, bubble, foot);
  return { node, tools, bubble, foot };
}

function toolStep(step) {
  let args = step.arguments;
  try { args = JSON.stringify(JSON.parse(step.arguments)); } catch { /* shown as sent */ }
  let result = step.result === null ? (step.waiting ? "(waiting for approval)" : "(run by the client)") : step.result;
  try { result = JSON.stringify(JSON.parse(result)); } catch { /* plain text result */ }
  return el("div", { class: `tool${step.is_error ? " error" : ""}` },
    el("span", { class: "name" }, `🔧 ${step.name}`), " ", el("span", { class: "args" }, args),
    el("div", { class: "result" }, step.is_error ? result : `→ ${result}`));
}

function showExchange(view, exchange) {
  view.tools.replaceChildren(...exchange.tools.map(toolStep));
  view.bubble.classList.remove("streaming");
  view.bubble.textContent = exchange.answer || (exchange.approval ? "" : "(no text)");
  if (exchange.approval) {
    const messages = state.messages.slice(0, -1);  // the held answer is the last message
    view.foot.before(approvalBox(view, exchange.approval, (next) => answered(view, messages, next)));
    return;
  }
  feedbackBar(view, exchange.turn_id, exchange.policy_version, exchange.feedback, exchange.verdict);
}

function feedbackBar(view, turnId, version, given = [], verdict = null) {
  const status = el("span", { class: "sent" });
  const correction = el("form", { class: "correct hidden" });
  const input = el("input", { placeholder: "What should the answer have been? (optional)", "aria-label": "correction" });
  correction.append(input, el("button", { class: "primary", type: "submit" }, "Send 👎"));
  const send = async (thumbs, text) => {
    try {
      const ack = await api("/v1/feedback", { method: "POST", headers: { "Content-Type": "application/json" },
                                              body: JSON.stringify({ turn_id: turnId, thumbs, text: text || null }) });
      status.textContent = `✓ feedback recorded (${thumbs === "up" ? "👍" : "👎"}${text ? `: “${text}”` : ""})`;
      status.dataset.feedbackId = ack.id;
      status.className = "sent";
      correction.classList.add("hidden");
    } catch (error) {
      status.textContent = `feedback not recorded: ${error.message}`;
      status.className = "error";
    }
  };
  correction.addEventListener("submit", (event) => { event.preventDefault(); send("down", input.value.trim()); });
  const openCorrection = () => { correction.classList.remove("hidden"); input.focus(); };
  if (given.length) {
    const last = given[given.length - 1];
    status.textContent = `✓ feedback recorded (${last.score > 0 ? "👍" : last.score < 0 ? "👎" : "0"}${last.text ? `: “${last.text}”` : ""})`;
  }
  const verdictNode = verdict
    ? el("span", { class: "verdict", title: verdict.reason }, `judged ${verdict.score > 0 ? "+1" : verdict.score}`)
    : null;
  view.foot.replaceChildren(
    el("span", { class: "version", title: `turn ${turnId}` }, `adapter ${versionName(version)}`),
    el("button", { title: "good answer", "data-action": "up", onclick: () => send("up", "") }, "👍"),
    el("button", { title: "bad answer", "data-action": "down", onclick: openCorrection }, "👎"),
    el("button", { class: "link", "data-action": "correct", onclick: openCorrection }, "correct this"),
    status);
  if (verdictNode) view.foot.append(verdictNode);
  view.foot.after(correction);
}

// ------------------------------------------------------------------ chat

async function send(text) {
  if (state.busy || !text.trim()) return;
  state.busy = true;
  document.getElementById("send").disabled = true;
  document.getElementById("chat-empty")?.remove();
  const box = document.getElementById("messages");
  box.append(userMessage(text));
  const view = assistantMessage();
  view.bubble.classList.add("streaming");
  box.append(view.node);
  box.scrollTop = box.scrollHeight;
  const messages = [...state.messages, { role: "user", content: text }];
  try {
    const reply = await streamReply(messages, view, box);
    if (reply.session) state.session = reply.session;
    await answered(view, messages, reply);
  } catch (error) {
    view.bubble.classList.remove("streaming");
    view.bubble.append(el("span", { class: "err" }, `error: ${error.message}`));
  } finally {
    state.busy = false;
    document.getElementById("send").disabled = false;
  }
}

async function streamReply(messages, view, box) {
  const extra = { "Content-Type": "application/json" };
  if (state.session) extra["X-Whet-Session"] = state.session;
  const response = await fetch("/v1/chat/completions", {
    method: "POST", headers: headers(extra),
    body: JSON.stringify({ model: state.model, messages, stream: true }),
  });
  return readStream(response, view, box, "");
}

// reads an SSE answer into `view`; `text` is what the answer said before (a held step's continuation)
async function readStream(response, view, box, text) {
  if (response.status === 401) { askKey("That key was not accepted."); throw new ApiError(401, "API key needed"); }
  if (!response.ok) throw new ApiError(response.status, await errorText(response));
  view.bubble.classList.add("streaming");
  const reply = { text, turnId: null, version: null, failed: false, approval: null,
                  session: response.headers.get("X-Whet-Session") };
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) !== -1) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (!event.startsWith("data: ") || event === "data: [DONE]") continue;
      const chunk = JSON.parse(event.slice(6));
      if (chunk.error) {
        reply.failed = true;
        view.bubble.append(el("span", { class: "err" }, `error: ${chunk.error.message}`));
        continue;
      }
      reply.turnId = chunk.id;
      if (chunk.system_fingerprint !== undefined) reply.version = chunk.system_fingerprint;
      for (const choice of chunk.choices || []) {
        const piece = choice.delta.content || "";
        reply.text += piece;
        view.bubble.append(piece);
        for (const call of choice.delta.tool_calls || []) {
          if (call.function.name === APPROVAL_TOOL) reply.approval = JSON.parse(call.function.arguments);
        }
      }
      box.scrollTop = box.scrollHeight;
    }
  }
  view.bubble.classList.remove("streaming");
  if (reply.failed) reply.turnId = null;
  return reply;
}

// ------------------------------------------------------------------ approvals

const APPROVAL_TOOL = "whet_approval";

// a held step: the calls that wait, with Approve / Reject; deciding continues the answer in `view`
function approvalBox(view, approval, onAnswer) {
  const reason = el("input", { placeholder: "Why not? (optional, the model reads it)", "aria-label": "rejection reason" });
  const status = el("div", { class: "small muted" }, `waiting for your decision · expires ${when(approval.expires_at)}`);
  const calls = approval.calls.map((call) => el("div", { class: "call" },
    el("span", { class: "name" }, `🔧 ${call.name}`), " ",
    el("span", { class: "args" }, typeof call.arguments === "string" ? call.arguments : JSON.stringify(call.arguments))));
  const approve = el("button", { class: "primary", "data-action": "approve" }, "Approve");
  const reject = el("button", { class: "danger", "data-action": "reject" }, "Reject");
  const title = el("div", { class: "title" }, "⚠ This action needs your approval");
  const row = el("div", { class: "row" }, approve, reject, reason);
  const box = el("div", { class: "approval", "data-approval": approval.approval_id || approval.id },
    title, ...calls, row, status);
  const decide = async (decision) => {
    approve.disabled = reject.disabled = true;
    status.textContent = decision === "approve" ? "approved: running…" : "rejected: telling the model…";
    try {
      const response = await fetch(`/v1/approvals/${encodeURIComponent(box.dataset.approval)}`, {
        method: "POST", headers: headers({ "Content-Type": "application/json" }),
        body: JSON.stringify({ decision, reason: reason.value.trim() || null, stream: true }),
      });
      if (!response.ok) throw new ApiError(response.status, await errorText(response));
      const why = reason.value.trim();
      box.classList.add(decision === "approve" ? "approved" : "rejected");
      title.textContent = decision === "approve" ? "✓ You approved this action" : "✗ You rejected this action";
      row.remove();
      status.textContent = decision === "approve" ? "approved: it ran" : `rejected${why ? `: “${why}”` : ""}: it did not run`;
      const reply = await readStream(response, view, document.getElementById("messages"), view.bubble.textContent);
      await onAnswer(reply);
    } catch (error) {
      status.textContent = `not decided: ${error.message}`;
      status.className = "small error";
      approve.disabled = reject.disabled = error.status === 409 || error.status === 410;  // decided, or too late
    }
  };
  approve.addEventListener("click", () => decide("approve"));
  reject.addEventListener("click", () => decide("reject"));
  return box;
}

// an answer is in: a held step shows its approval box (the answer goes on once decided), else the foot
async function answered(view, messages, reply) {
  state.messages = [...messages, { role: "assistant", content: reply.text }];
  if (reply.approval) {
    view.foot.replaceChildren();
    view.foot.before(approvalBox(view, reply.approval, (next) => answered(view, messages, next)));
    await refreshTools(view, reply.turnId);
    return;
  }
  if (reply.turnId) await afterReply(view, reply);
}

async function refreshTools(view, turnId) {
  try {
    const detail = await api(`/v1/sessions/${encodeURIComponent(state.session)}`);
    const exchange = detail.exchanges.find((e) => e.turn_id === turnId);
    if (exchange) view.tools.replaceChildren(...exchange.tools.map(toolStep));
    await loadSessions();
  } catch { /* the answer stands; its tool steps show when the session is reopened */ }
}

async function afterReply(view, reply) {
  // the stream carries what was said; the tool steps behind it come from the recorded turns
  feedbackBar(view, reply.turnId, reply.version);
  await refreshTools(view, reply.turnId);
}

function setupChat() {
  const prompt = document.getElementById("prompt");
  document.getElementById("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    if (state.busy) return;  // the text stays in the box until the answer before it is done
    const text = prompt.value;
    prompt.value = "";
    send(text);
  });
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      document.getElementById("composer").requestSubmit();
    }
  });
  document.getElementById("new-chat").addEventListener("click", newChat);
}

// ------------------------------------------------------------------ learning

async function loadLearning() {
  const data = await api("/v1/learning");
  showLive(data);
  showAdapters(data.adapters);
  const oldestFirst = [...data.judgments].reverse();
  linePlot(document.getElementById("plot-score"), rolling(oldestFirst, (j) => j.score), -1, 1, "mean judged score");
  linePlot(document.getElementById("plot-success"), rolling(oldestFirst, (j) => (j.score > 0 ? 1 : 0)), 0, 1, "share judged +1");
  showLessons(data.lessons);
  showJudged(data.judgments.slice(0, 30));
  refreshLive();
}

function showLive(data) {
  const rows = [["global", data.live.global]];
  if (data.scope === "user" || data.live.user) rows.push(["yours", data.live.user]);
  document.getElementById("live").replaceChildren(...rows.map(([scope, version]) =>
    el("div", { class: "live-row" }, el("span", {}, scope), el("span", { class: "pill" }, versionName(version)))));
  const l = data.learner;
  document.getElementById("learner-status").textContent = l
    ? `learner: ${l.judged} judged · ${l.lessons} lessons${l.lessons_narrowed ? ` (${l.lessons_narrowed} narrowed)` : ""} · ${l.steps} steps · ${l.promoted} promoted · ${l.rejected} rejected · ${l.rolled_back} rolled back${l.busy ? " · working…" : ""}`
    : "the learner runs in another process (whet learn)";
}

function fmt(value, digits = 4) {
  return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
}

function showAdapters(adapters) {
  const body = document.querySelector("#adapters tbody");
  if (!adapters.length) {
    body.replaceChildren(el("tr", {}, el("td", { colspan: 8, class: "muted" }, "No adapter trained yet: answers come from the base weights.")));
    return;
  }
  body.replaceChildren(...[...adapters].reverse().map((a) => {
    const gate = a.gate || {};
    const reason = a.rolled_back || gate.reason || "";
    return el("tr", {},
      el("td", { class: "mono" }, a.id), el("td", {}, a.user_id ? `user ${a.user_id}` : a.scope),
      el("td", {}, el("span", { class: `status ${a.status.split(" ")[0]}`, title: reason }, a.status)),
      el("td", { class: "mono" }, versionName(a.parent)),
      el("td", { class: "small" }, reason || "–"),
      el("td", { class: "mono" }, fmt(gate.preference_margin)), el("td", { class: "mono" }, fmt(gate.regression_drift)),
      el("td", { class: "small" }, when(a.created_at)));
  }));
}

function showLessons(lessons) {
  const list = document.getElementById("lessons");
  if (!lessons.length) {
    list.replaceChildren(el("li", { class: "muted" }, "No lessons yet. Correct an answer and the lesson shows up here."));
    return;
  }
  list.replaceChildren(...lessons.map((lesson) => {
    const item = el("li", { "data-lesson": lesson.id },
      el("span", { class: "text" }, lesson.text),
      el("span", { class: "kind" }, `${lesson.kind} · ${when(lesson.created_at)}` +
        (lesson.min_score == null ? "" : ` · shown only to close requests (≥ ${lesson.min_score.toFixed(2)})`)));
    item.append(el("button", { title: "forget this lesson", onclick: async () => {
      try {
        await api(`/v1/lessons/${lesson.id}`, { method: "DELETE" });
        item.remove();
        if (!list.children.length) showLessons([]);
      } catch (error) { item.append(el("span", { class: "error" }, error.message)); }
    } }, "delete"));
    return item;
  }));
}

function showJudged(judgments) {
  const body = document.querySelector("#judged tbody");
  if (!judgments.length) {
    body.replaceChildren(el("tr", {}, el("td", { colspan: 6, class: "muted" }, "Nothing judged yet.")));
    return;
  }
  body.replaceChildren(...judgments.map((j) => {
    const sign = j.score > 0 ? "pos" : j.score < 0 ? "neg" : "zero";
    return el("tr", {},
      el("td", { class: "small" }, when(j.created_at)),
      el("td", { title: `${j.judge}: ${j.reason}` }, el("span", { class: `score ${sign}` }, j.score > 0 ? "+1" : String(j.score)),
         el("div", { class: "small muted" }, j.reason)),
      el("td", { class: "small" }, j.action), el("td", { class: "small" }, j.next_state),
      el("td", { class: "small" }, j.hint || "–"), el("td", { class: "mono" }, versionName(j.policy_version)));
  }));
}

// a rolling mean over the last `window` verdicts, one point per verdict, oldest first
function rolling(judgments, value, window = 10) {
  const points = [];
  let sum = 0;
  judgments.forEach((j, i) => {
    sum += value(j);
    if (i >= window) sum -= value(judgments[i - window]);
    points.push({ t: new Date(j.created_at), y: sum / Math.min(i + 1, window) });
  });
  return points;
}

function linePlot(box, points, lo, hi, label) {
  const W = 360, H = 170, L = 30, R = 8, T = 10, B = 22;
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", label);
  const add = (tag, attrs, text) => {
    const node = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    svg.append(node);
    return node;
  };
  const y = (v) => T + (H - T - B) * (1 - (v - lo) / (hi - lo));
  for (const tick of [lo, (lo + hi) / 2, hi]) {
    add("line", { x1: L, x2: W - R, y1: y(tick), y2: y(tick), class: "axis" });
    add("text", { x: L - 4, y: y(tick) + 3, "text-anchor": "end" }, String(tick));
  }
  if (points.length === 0) {
    add("text", { x: (L + W - R) / 2, y: H / 2, "text-anchor": "middle" }, "no judged turns yet");
  } else {
    const x = (i) => L + (points.length === 1 ? (W - L - R) / 2 : (W - L - R) * (i / (points.length - 1)));
    const path = points.map((p, i) => `${i ? "L" : "M"}${x(i).toFixed(1)},${y(p.y).toFixed(1)}`).join(" ");
    add("path", { d: path, fill: "none", stroke: "#2f6fde", "stroke-width": 2 });
    points.forEach((p, i) => add("circle", { cx: x(i), cy: y(p.y), r: 2.2, fill: "#2f6fde" }));
    add("text", { x: L, y: H - 6 }, when(points[0].t));
    add("text", { x: W - R, y: H - 6, "text-anchor": "end" }, `${when(points[points.length - 1].t)} · ${points.length} verdicts`);
  }
  box.replaceChildren(svg);
}

// ------------------------------------------------------------------ tabs

function showView(name) {
  for (const view of ["chat", "learning"]) {
    document.getElementById(`view-${view}`).classList.toggle("hidden", view !== name);
    document.getElementById(`tab-${view}`).classList.toggle("active", view === name);
  }
  if (name === "learning") loadLearning().catch((error) => {
    document.getElementById("learner-status").textContent = `could not load: ${error.message}`;
  });
}

document.querySelectorAll(".tab").forEach((tab) => tab.addEventListener("click", () => showView(tab.dataset.view)));
setupKeyDialog();
setupChat();
start();

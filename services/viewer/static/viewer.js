// The rollout viewer's page: reads the viewer's JSON API (read-only) and draws it.
"use strict";

const $ = (selector) => document.querySelector(selector);

// The run shown (a fleet that runs share: the run filter's choice, kept in the page's address as ?run=).
const RUN = new URLSearchParams(location.search).get("run") || "";

async function getJSON(path) {
  if (RUN) path += `${path.includes("?") ? "&" : "?"}run=${encodeURIComponent(RUN)}`;
  const response = await fetch(path, {credentials: "same-origin"});
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function fmt(value, digits = 3) {
  if (value === null || value === undefined) return "–";
  return typeof value === "number" && !Number.isInteger(value) ? value.toFixed(digits) : String(value);
}

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

// --- sortable tables: a click on a column's header sorts by it, a second click reverses ---------
function sortKey(row, column) {
  const text = row.cells[column] ? row.cells[column].textContent : "";
  const number = Number(text);
  return text === "" || text === "–" ? null : Number.isNaN(number) ? text : number;
}
function compareKeys(a, b) {
  if (a === null || b === null) return a === b ? 0 : a === null ? 1 : -1;   // missing values last
  if (typeof a !== typeof b) return typeof a === "number" ? -1 : 1;
  return a < b ? -1 : a > b ? 1 : 0;
}
function sortTable(table) {
  const th = table.querySelector("th[aria-sort]");
  if (!th) return;
  const column = th.cellIndex, sign = th.getAttribute("aria-sort") === "ascending" ? 1 : -1;
  const body = table.tBodies[0];
  const rows = [...body.rows].sort((a, b) => sign * compareKeys(sortKey(a, column), sortKey(b, column)));
  for (const row of rows) body.appendChild(row);
}
for (const table of document.querySelectorAll("table.sortable")) {
  for (const th of table.tHead.rows[0].cells) {
    th.addEventListener("click", () => {
      const ascending = th.getAttribute("aria-sort") !== "ascending";
      for (const other of table.tHead.rows[0].cells) other.removeAttribute("aria-sort");
      th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
      sortTable(table);
    });
  }
}

// --- tabs ---------------------------------------------------------------------------------------
for (const button of document.querySelectorAll("nav button")) {
  button.addEventListener("click", () => showTab(button.dataset.tab));
}
function showTab(name) {
  for (const b of document.querySelectorAll("nav button")) b.classList.toggle("active", b.dataset.tab === name);
  for (const s of document.querySelectorAll(".tab")) s.classList.toggle("active", s.id === name);
  if (name === "samples" && !$("#sample-table tbody").rows.length) loadSamples(false);
  if (name === "failures") loadFailures();
}

// --- the run's header ---------------------------------------------------------------------------
async function loadRuns() {   // a fleet that runs share: a run filter; every read is the chosen run's
  const {runs} = await getJSON("/api/runs");
  if (runs.length < 2) return;
  const select = document.createElement("select");
  select.id = "run-select";
  select.dataset.testid = "run-select";
  select.setAttribute("aria-label", "run");
  for (const name of runs) select.add(new Option(name, name, false, name === (RUN || runs[0])));
  select.addEventListener("change", () => {
    const query = new URLSearchParams(location.search);
    query.set("run", select.value);
    location.search = query.toString();
  });
  $("header h1").after(select);
}

async function loadRun() {
  const parts = [];
  try {
    const stats = await getJSON("/api/stats");
    parts.push(`buffer: ${stats.ready} ready, ${stats.leased} leased, ${stats.acked} acked, ` +
               `${stats.filtered_groups} groups filtered`);
  } catch (error) { parts.push(`trajectory service: ${error.message}`); }
  try {
    const status = await getJSON("/api/status");
    if (status.unavailable) {
      showNotice(status.unavailable, status.unavailable_details);
    } else {
      parts.unshift(`policy version ${status.policy_version} · ${status.serving ? "serving" : "NOT serving: " +
                     status.not_serving_reason} · mode ${status.mode}`);
    }
  } catch (error) { parts.unshift(`collector: ${error.message}`); }
  $("#run").textContent = parts.join(" · ");
}

function showNotice(text, details) {
  const notice = $("#notice");
  notice.textContent = text;
  notice.title = details || "";  // gRPC's own message, on hover
  notice.hidden = false;
}

// --- versions -----------------------------------------------------------------------------------
const charts = {};
function drawChart(id, title, versions, series) {
  const element = $(id);
  const width = Math.max(element.clientWidth, 320);
  const data = [versions, ...series.map((s) => s.values)];
  const options = {
    title, width, height: 220,
    scales: {x: {time: false}},
    axes: [{label: "policy version", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]}, {}],
    series: [{label: "version"}, ...series.map((s) => ({label: s.label, stroke: s.colour, width: 2,
                                                       points: {show: true}}))],
  };
  if (charts[id]) charts[id].destroy();
  element.textContent = "";
  charts[id] = new uPlot(options, data, element);
  element.dataset.points = String(versions.length);
}

let resizing = null;
window.addEventListener("resize", () => {   // charts follow their boxes' width, never overlap
  clearTimeout(resizing);
  resizing = setTimeout(() => {
    for (const [id, chart] of Object.entries(charts)) chart.setSize({width: Math.max($(id).clientWidth, 320), height: 220});
  }, 100);
});

async function loadVersions() {
  const {versions} = await getJSON("/api/versions");
  const column = (name) => versions.map((v) => v[name]);
  const x = column("version").map(Number);
  drawChart("#chart-score", "mean score (reward)", x, [{label: "score", values: column("mean_score"), colour: "#2e7d32"}]);
  drawChart("#chart-kl", "mean KL to the reference (per token)", x,
            [{label: "KL", values: column("mean_kl"), colour: "#c62828"}]);
  drawChart("#chart-length", "mean response length (tokens)", x,
            [{label: "tokens", values: column("mean_response_tokens"), colour: "#1565c0"}]);
  drawChart("#chart-staleness", "staleness (versions behind when visible)", x,
            [{label: "mean", values: column("mean_staleness"), colour: "#6a1b9a"},
             {label: "max", values: column("max_staleness").map((v) => (Number(v) < 0 ? null : Number(v))),
              colour: "#ad1457"}]);
  const body = $("#version-table tbody");
  body.textContent = "";
  for (const v of [...versions].reverse()) {
    const row = body.insertRow();
    for (const name of ["version", "groups", "trajectories", "filtered_groups", "mean_score", "mean_kl",
                        "mean_response_tokens", "mean_staleness"]) cell(row, fmt(v[name]));
    cell(row, Number(v.max_staleness) < 0 ? "–" : fmt(v.max_staleness));
  }
  sortTable($("#version-table"));
}

// --- samples ------------------------------------------------------------------------------------
let nextCursor = 0;
$("#sample-filters").addEventListener("submit", (event) => { event.preventDefault(); loadSamples(false); });
$("#more-samples").addEventListener("click", () => loadSamples(true));

async function loadSamples(more) {
  const query = new URLSearchParams();
  for (const [name, value] of new FormData($("#sample-filters"))) if (value !== "") query.set(name, value);
  if (more) query.set("before", String(nextCursor));
  $("#sample-error").textContent = "";
  let page;
  try {
    page = await getJSON(`/api/samples?${query}`);
  } catch (error) {
    $("#sample-error").textContent = error.message;
    return;
  }
  const body = $("#sample-table tbody");
  if (!more) body.textContent = "";
  for (const s of page.samples) {
    const row = body.insertRow();
    row.className = "clickable";
    row.dataset.cursor = s.cursor;
    cell(row, s.cursor);
    cell(row, s.policy_version_start === s.policy_version_end ? s.policy_version_start
                                                              : `${s.policy_version_start}→${s.policy_version_end}`);
    cell(row, fmt(s.score)); cell(row, fmt(s.advantage)); cell(row, fmt(s.kl_mean));
    cell(row, s.response_tokens); cell(row, s.turns);
    cell(row, Number(s.staleness) < 0 ? "–" : s.staleness);
    cell(row, s.group_id);
    row.dataset.promptId = s.prompt_id;
    // The prompt's end (the question, after any system prompt) and the completion's start, when the viewer
    // has the tokenizer; the prompt's id otherwise. Tool calls are in ⟦ ⟧, observations in ⟨ ⟩.
    cell(row, s.prompt_text === undefined ? s.prompt_id : `…${s.prompt_text.slice(-60)}`, "text prompt")
      .title = `${s.prompt_id}\n${s.prompt_text || ""}`;
    cell(row, s.completion_text === undefined ? "" : s.completion_text.slice(0, 80), "text completion")
      .title = s.completion_text || "";
    cell(row, s.ground_truth === undefined ? "" : s.ground_truth.slice(0, 40), "text truth").title = s.ground_truth || "";
    cell(row, s.reward_fn || "", "text reward-fn");
    cell(row, s.filtered ? "filtered" : "", "text");
    row.dataset.promptText = s.prompt_text === undefined ? s.prompt_id : s.prompt_text;
    row.dataset.version = s.policy_version_start;
    row.dataset.score = fmt(s.score);
    row.addEventListener("click", () => showSample(s.cursor, row));
  }
  nextCursor = Number(page.next_cursor);
  $("#more-samples").hidden = !nextCursor;
  sortTable($("#sample-table"));
  search();
  $("#sample-count").textContent = `${body.rows.length} shown of ${page.matching} matching ` +
    `(${page.logged} in the sample log)`;
}

// Search: the rows shown whose prompt or completion holds the text (case aside); the others are hidden.
$("#sample-search").addEventListener("input", search);
function search() {
  const term = $("#sample-search").value.trim().toLowerCase();
  const rows = [...$("#sample-table tbody").rows];
  let found = 0;
  for (const row of rows) {
    const text = `${row.cells[9].title}\n${row.cells[10].title}`.toLowerCase();
    row.hidden = term !== "" && !text.includes(term);
    found += !row.hidden;
  }
  $("#search-count").textContent = term ? `${found} of the ${rows.length} rows shown hold "${term}"` : "";
}

// --- one trajectory -----------------------------------------------------------------------------
let shown = null;
$("#colour-by").addEventListener("change", () => {
  if (shown) renderTokens(shown, $("#tokens"));
  if (compared) renderTokens(compared, $("#compare-tokens"));
});

async function showSample(cursor, row) {
  for (const r of document.querySelectorAll("#sample-table tr.selected")) r.classList.remove("selected");
  if (row) row.classList.add("selected");
  try {
    shown = await getJSON(`/api/samples/${cursor}`);
  } catch (error) {
    $("#sample-error").textContent = error.message;
    return;
  }
  $("#detail-title").textContent = describe(shown);
  $("#sample-detail").hidden = false;
  $(".sample-view").classList.add("with-detail");   // beside the table, where the click was
  renderTokens(shown, $("#tokens"));
  offerComparisons(row);
}

function describe(sample) {
  const s = sample.summary;
  return `trajectory ${s.trajectory_id || s.cursor} · prompt ${s.prompt_id} · version ${s.policy_version_start} · ` +
    `score ${fmt(s.score)}` + (sample.reward_fn ? ` · reward fn ${sample.reward_fn}` : "") +
    (sample.ground_truth ? ` · ground truth ${sample.ground_truth}` : "") + ` · ${sample.turns} turn(s) · ` +
    `${sample.prompt_tokens} prompt + ${sample.response_tokens} response tokens`;
}

function headline(sample) {   // one line over each of two panes side by side
  const s = sample.summary;
  return `version ${s.policy_version_start} · score ${fmt(s.score)}` +
    (sample.ground_truth ? ` · ground truth ${sample.ground_truth}` : "") + ` · #${s.cursor}`;
}

// --- the same prompt in another version, side by side ----------------------------------------------
let compared = null;
function offerComparisons(row) {
  const select = $("#compare-with");
  select.length = 1;   // "–" only
  closeComparison();
  if (!row) return;
  // The rows loaded with the same prompt text and another version, the nearest versions first.
  const version = Number(row.dataset.version);
  const same = [...$("#sample-table tbody").rows].filter((other) =>
    other.dataset.promptText === row.dataset.promptText && Number(other.dataset.version) !== version);
  same.sort((a, b) => Math.abs(Number(a.dataset.version) - version) - Math.abs(Number(b.dataset.version) - version) ||
                      Number(a.dataset.version) - Number(b.dataset.version));
  for (const other of same) {
    select.add(new Option(`version ${other.dataset.version} · score ${other.dataset.score} · #${other.dataset.cursor}`,
                          other.dataset.cursor));
  }
  select.disabled = same.length === 0;
}
$("#compare-with").addEventListener("change", async (event) => {
  const cursor = event.target.value;
  if (!cursor) { closeComparison(); return; }
  try {
    compared = await getJSON(`/api/samples/${cursor}`);
  } catch (error) {
    $("#sample-error").textContent = error.message;
    return;
  }
  for (const [id, sample] of [["#primary-title", shown], ["#compare-title", compared]]) {
    $(id).textContent = headline(sample);
    $(id).title = describe(sample);
  }
  $("#primary-title").hidden = $("#compare").hidden = false;
  $(".panes").classList.add("comparing");
  renderTokens(compared, $("#compare-tokens"));
});
function closeComparison() {
  compared = null;
  $("#primary-title").hidden = $("#compare").hidden = true;
  $(".panes").classList.remove("comparing");
}

// Colour strength of a difference of ``nats``: logarithmic, full at 8 nats, so 1, 2 and 4 nats stay
// apart (0.33, 0.5, 0.73) where a linear scale would be saturated.
const FULL_AT_NATS = 8;
const strength = (nats) => Math.min(Math.log1p(Math.abs(nats)) / Math.log1p(FULL_AT_NATS), 1);
const RED = "220,50,40", BLUE = "40,90,220";

function colour(token, by) {
  if (token.part !== "assistant" && token.part !== "tool_call") return "";
  if (token.logprob === null) return "";
  if (by === "logprob") return `rgba(${RED},${strength(token.logprob).toFixed(3)})`;   // surprise, in nats
  if (token.ref_logprob === null) return "";
  const diff = token.logprob - token.ref_logprob;
  return `rgba(${diff >= 0 ? RED : BLUE},${strength(diff).toFixed(3)})`;
}

function drawScale() {   // the legend: the colour of 1, 2, 4 and 8+ nats each way, for the chosen colouring
  const scale = $("#scale");
  scale.textContent = "";
  const steps = [1, 2, 4, FULL_AT_NATS];
  const swatch = (rgb, nats, text) => {
    const span = document.createElement("span");
    span.style.background = `rgba(${rgb},${strength(nats).toFixed(3)})`;
    span.textContent = text;
    scale.appendChild(span);
  };
  if ($("#colour-by").value === "logprob") {
    scale.append("behaviour log-prob: ");
    for (const nats of steps) swatch(RED, nats, `−${nats}${nats === FULL_AT_NATS ? "+" : ""}`);
    scale.append(" nats");
    return;
  }
  scale.append("reference likelier by ");
  for (const nats of [...steps].reverse()) swatch(BLUE, nats, `${nats}${nats === FULL_AT_NATS ? "+" : ""}`);
  scale.append(" · policy likelier by ");
  for (const nats of steps) swatch(RED, nats, `${nats}${nats === FULL_AT_NATS ? "+" : ""}`);
  scale.append(" nats");
}
$("#colour-by").addEventListener("change", drawScale);
drawScale();

const PROMPT_SHOWN = 48;   // a longer prompt (a system prompt, a task) is folded: the turns come first

function renderTokens(sample, box) {
  box.textContent = "";
  const by = $("#colour-by").value;
  let turn = 0;
  let into = box;
  if (sample.prompt_tokens > PROMPT_SHOWN) {
    const fold = document.createElement("details");
    fold.className = "prompt-fold";
    fold.dataset.testid = "prompt-fold";
    const summary = document.createElement("summary");
    const text = sample.tokens.slice(0, sample.prompt_tokens).map((t) => t.text).join("");
    summary.textContent = `prompt · ${sample.prompt_tokens} tokens · ${text.slice(0, 80).replace(/\s+/g, " ")}…`;
    fold.appendChild(summary);
    box.appendChild(fold);
    into = fold;
  }
  sample.tokens.forEach((token, index) => {
    if (index === sample.prompt_tokens) into = box;
    if (token.turn !== turn && token.part !== "observation") {
      turn = token.turn;
      const marker = document.createElement("span");
      marker.className = "turn";
      marker.dataset.testid = "turn-marker";
      marker.textContent = `turn ${turn}`;
      into.appendChild(marker);
    }
    const span = document.createElement("span");
    span.className = `t part-${token.part}`;
    span.textContent = token.text;
    span.dataset.index = index;
    span.dataset.part = token.part;
    const background = colour(token, by);
    if (background) span.style.background = background;
    span.addEventListener("mouseenter", () => {
      $("#token-info").textContent = `#${index} id ${token.id} ${JSON.stringify(token.text)} · ${token.part}` +
        ` · behaviour ${fmt(token.logprob, 4)} · reference ${fmt(token.ref_logprob, 4)}` +
        (token.logprob !== null && token.ref_logprob !== null
          ? ` (${fmt(token.logprob - token.ref_logprob, 2)} nats)` : "") +
        ` · version ${token.version === null ? "–" : token.version}`;
    });
    into.appendChild(span);
  });
  box.dataset.tokens = String(sample.tokens.length);
}

// --- dead letters -------------------------------------------------------------------------------
async function loadFailures() {
  const body = $("#failure-table tbody");
  let reply;
  try {
    reply = await getJSON("/api/failures");
  } catch (error) {
    body.textContent = "";
    cell(body.insertRow(), error.message, "text error");
    return;
  }
  body.textContent = "";
  if (reply.unavailable) {
    const notice = cell(body.insertRow(), reply.unavailable, "text notice");
    notice.colSpan = 6;
    notice.title = reply.unavailable_details || "";
  }
  for (const f of reply.failures) {
    const row = body.insertRow();
    cell(row, f.seq); cell(row, f.prompt_id, "text"); cell(row, f.stage, "text"); cell(row, f.code, "text");
    cell(row, f.attempts); cell(row, f.error, "text");
  }
  body.dataset.loaded = "true";
}

// --- start --------------------------------------------------------------------------------------
loadRuns().catch((error) => showNotice(`runs: ${error.message}`));
loadRun();
loadVersions().catch((error) => { $("#chart-score").textContent = error.message; })
  .finally(() => { document.body.dataset.ready = "true"; });

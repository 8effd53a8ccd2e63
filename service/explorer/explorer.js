// The attention explorer: calls the service's own API (/info, /v1/attention, /v1/similarity) and
// draws what comes back. Vanilla JS, no dependencies, nothing loaded from anywhere else.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const ROOT = document.body.dataset.root || "";
  const AUTH_REQUIRED = document.body.dataset.auth === "required";
  const TOKEN_KEY = "encoder-explorer-token";
  const MAX_TEXTS = 2;
  const TOP_K = 5;
  const SPARSE_TERMS = 12; // a sparse vector's largest weights drawn (SPLADE, BGE-M3)
  const ROW = 20; // px per unit in the head view's line diagram

  const state = {
    info: null,
    texts: [],
    level: "token",
    analyses: [], // one per text: {units, L, H, n, weights, rollout, entropy, topK}
    similarity: null,
    sparse: null, // with a model that has a sparse representation: per text, its largest terms
    current: 0, // which text the per-text views show
    layer: 0,
    head: 0,
    unit: 0,
  };

  // ---------- colours ----------

  function hex(c) {
    return [1, 3, 5].map((i) => parseInt(c.slice(i, i + 2), 16));
  }

  function ramp(stops, size = 256) {
    const rgb = stops.map(hex);
    const lut = new Uint8ClampedArray(size * 3);
    for (let k = 0; k < size; k++) {
      const t = (k / (size - 1)) * (rgb.length - 1);
      const i = Math.min(Math.floor(t), rgb.length - 2);
      const f = t - i;
      for (let c = 0; c < 3; c++) lut[k * 3 + c] = Math.round(rgb[i][c] + (rgb[i + 1][c] - rgb[i][c]) * f);
    }
    return lut;
  }

  const BLUES = ramp(["#f7fbff", "#c6dbef", "#6baed6", "#2171b5", "#08306b"]);
  const PURPLES = ramp(["#fcfbfd", "#e3e1f0", "#bcbddc", "#9e9ac8", "#756bb1", "#54278f"]);
  const DIVERGING = ramp(["#b2182b", "#ef8a62", "#fddbc7", "#f7f7f7", "#d1e5f0", "#67a9cf", "#2166ac"]);

  function lutIndex(t) {
    return Math.max(0, Math.min(255, Math.round(t * 255))) * 3;
  }

  function colour(lut, t) {
    const k = lutIndex(t);
    return `rgb(${lut[k]}, ${lut[k + 1]}, ${lut[k + 2]})`;
  }

  function isDark(lut, t) {
    const k = lutIndex(t);
    return 0.299 * lut[k] + 0.587 * lut[k + 1] + 0.114 * lut[k + 2] < 140;
  }

  // ---------- the API ----------

  class ApiError extends Error {
    constructor(status, type, message) {
      super(message);
      this.status = status;
      this.type = type;
    }
  }

  function token() {
    return $("api-token").value.trim();
  }

  async function api(path, body) {
    const headers = { accept: "application/json" };
    const init = { method: body === undefined ? "GET" : "POST", headers };
    if (body !== undefined) {
      headers["content-type"] = "application/json";
      init.body = JSON.stringify(body);
      if (token()) headers.authorization = `Bearer ${token()}`;
    }
    let response;
    try {
      response = await fetch(ROOT + path, init);
    } catch (e) {
      throw new ApiError(0, "network", `the service could not be reached (${e.message})`);
    }
    let data = null;
    try {
      data = await response.json();
    } catch (e) {
      data = null;
    }
    if (!response.ok) {
      const error = (data && data.error) || {};
      throw new ApiError(response.status, error.type || "http", error.message || `HTTP ${response.status}`);
    }
    return data;
  }

  function decodeWeights(att) {
    if (att.format === "base64") {
      const bytes = Uint8Array.from(atob(att.data), (c) => c.charCodeAt(0));
      return new Float32Array(bytes.buffer);
    }
    return Float32Array.from(att.data.flat(3));
  }

  async function analyseTexts(texts, level, model, sparse) {
    const chosen = model ? { model } : {}; // left out: the service's default model
    const body = {
      inputs: texts, level, weights: true, format: "base64", dtype: "float32",
      summaries: ["rollout", "entropy", "top_k"], top_k: TOP_K, truncate: true, ...chosen,
    };
    const attention = api("/v1/attention", body);
    const similarity = texts.length === 2
      ? api("/v1/similarity", { pairs: [texts], explain: true, level, truncate: true, ...chosen })
      : Promise.resolve(null);
    const terms = sparse
      ? api("/v1/encode", { inputs: texts, embedding: false, sparse: true, sparse_tokens: true, top_k: SPARSE_TERMS,
                            truncate: true, ...chosen })
      : Promise.resolve(null);
    const [att, sim, enc] = await Promise.all([attention, similarity, terms]);
    const analyses = att.data.map((item) => {
      const [L, H, n] = item.attention.shape;
      return {
        units: item.units, L, H, n,
        layers: item.attention.layers, heads: item.attention.heads,
        weights: decodeWeights(item.attention),
        rollout: item.rollout, entropy: item.entropy, topK: item.top_k,
      };
    });
    const sparseTerms = enc && enc.data.map((item) => item.sparse.indices
      .map((id, k) => ({ id, token: item.sparse.tokens[k], weight: item.sparse.values[k] }))
      .sort((a, b) => b.weight - a.weight));
    return { analyses, similarity: sim ? { ...sim.data[0], note: sim.note } : null, sparse: sparseTerms };
  }

  // ---------- the page's state and its address ----------

  function readAddress() {
    const params = new URLSearchParams(location.search);
    const texts = params.getAll("text").filter((t) => t.trim()).slice(0, MAX_TEXTS);
    const level = params.get("level") === "word" ? "word" : "token";
    return { texts, level, model: params.get("model") || "" };
  }

  function writeAddress(texts, level, model) {
    const params = new URLSearchParams();
    texts.forEach((t) => params.append("text", t));
    if (level !== "token") params.set("level", level);
    if (model) params.set("model", model);
    history.replaceState(null, "", `${location.pathname}?${params}`);
  }

  function setStatus(text) {
    $("status").textContent = text || "";
  }

  function showError(message) {
    $("error").textContent = message;
    $("error").hidden = !message;
  }

  function askForToken(message) {
    $("token-box").hidden = false;
    $("token-hint").textContent = message;
    $("api-token").focus();
  }

  async function analyse() {
    const texts = [$("text-a").value, $("text-b").value].map((t) => t.trim()).filter(Boolean);
    const level = $("level").value;
    const model = $("model-field").hidden ? "" : $("model").value;
    showError("");
    if (!texts.length) {
      showError("Type a text to analyse.");
      return;
    }
    writeAddress(texts, level, model);
    $("copy-link").disabled = false;
    if (AUTH_REQUIRED && !token()) {
      askForToken("This service needs an API token: enter it to analyse.");
      setStatus("");
      document.body.dataset.analysis = "needs-token";
      return;
    }
    $("analyse").disabled = true;
    document.body.dataset.analysis = "running";
    setStatus(texts.length === 2 ? "Analysing both texts and their similarity…" : "Analysing…");
    const started = performance.now();
    try {
      const models = state.info ? state.info.models || [state.info] : [];
      const chosen = models.find((m) => m.model === model) || models[0]; // the first listed is the default
      const hasSparse = Boolean(chosen && (chosen.representations || []).includes("sparse"));
      const { analyses, similarity, sparse } = await analyseTexts(texts, level, model, hasSparse);
      if (token()) sessionStorage.setItem(TOKEN_KEY, token());
      Object.assign(state, { texts, level, analyses, similarity, sparse, current: 0, unit: 0 });
      const a = analyses[0];
      state.layer = Math.min(state.layer, a.L - 1);
      state.head = Math.min(state.head, a.H - 1);
      render();
      const units = analyses.map((x) => x.n).join(" + ");
      setStatus(`${units} ${level === "word" ? "words" : "tokens"} · ${Math.round(performance.now() - started)} ms`);
      document.body.dataset.analysis = "done";
    } catch (e) {
      document.body.dataset.analysis = e.status === 401 ? "needs-token" : "error";
      setStatus("");
      if (e.status === 401) {
        sessionStorage.removeItem(TOKEN_KEY);
        askForToken(token() ? "The service refused this token: check it and try again." : "This service needs an API token: enter it to analyse.");
      }
      showError(e.message);
    } finally {
      $("analyse").disabled = false;
    }
  }

  // ---------- rendering ----------

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function current() {
    return state.analyses[state.current];
  }

  function weight(a, l, h, i, j) {
    return a.weights[((l * a.H + h) * a.n + i) * a.n + j];
  }

  function unitLabel(u) {
    return u.text === "" ? "␣" : u.text;
  }

  function render() {
    $("empty").hidden = true;
    $("results").hidden = false;
    renderSimilarity();
    renderSparse();
    renderTabs();
    renderText();
  }

  // A sparse vector's largest terms as bars, one list per text (the model's vocabulary weights).
  function renderSparse() {
    $("sparse-card").hidden = !state.sparse;
    if (!state.sparse) return;
    $("sparse-texts").replaceChildren(...state.sparse.map((terms, k) => {
      const box = el("div", "sparse-text");
      box.dataset.text = String(k);
      const largest = Math.max(1e-9, ...terms.map((t) => t.weight));
      const list = el("ol", "topk terms");
      list.replaceChildren(...terms.map((t) => {
        const li = el("li");
        li.dataset.token = t.token;
        li.title = `vocabulary id ${t.id}`;
        const bar = el("div", "bar"), fill = el("span");
        fill.style.width = `${(100 * t.weight / largest).toFixed(1)}%`;
        bar.append(fill);
        li.replaceChildren(el("span", "unit", t.token), bar, el("span", "value", t.weight.toFixed(4)));
        return li;
      }));
      box.replaceChildren(el("div", "sim-label", "AB"[k]), terms.length ? list : el("p", "card-note", "no term"));
      return box;
    }));
  }

  function renderText() {
    renderModelView();
    renderHeadView();
    renderRollout();
    renderEntropy();
  }

  function renderTabs() {
    const tabs = $("text-tabs");
    tabs.replaceChildren();
    tabs.hidden = state.analyses.length < 2;
    state.texts.forEach((text, k) => {
      const b = el("button", k === state.current ? "active" : "", `${"AB"[k]} · ${text}`);
      b.type = "button";
      b.dataset.text = String(k);
      b.addEventListener("click", () => {
        state.current = k;
        state.unit = 0;
        renderTabs();
        renderText();
      });
      tabs.append(b);
    });
  }

  function drawHeatmap(canvas, a, l, h) {
    const n = a.n;
    canvas.width = n;
    canvas.height = n;
    const ctx = canvas.getContext("2d");
    const image = ctx.createImageData(n, n);
    const base = (l * a.H + h) * n * n;
    for (let p = 0; p < n * n; p++) {
      const k = lutIndex(Math.sqrt(a.weights[base + p]));
      image.data[p * 4] = BLUES[k];
      image.data[p * 4 + 1] = BLUES[k + 1];
      image.data[p * 4 + 2] = BLUES[k + 2];
      image.data[p * 4 + 3] = 255;
    }
    ctx.putImageData(image, 0, 0);
  }

  // One head as a matrix with the units along both axes, drawn at the screen's pixel density.
  function drawMatrix(canvas, a, l, h) {
    const n = a.n;
    const cell = Math.max(4, Math.min(26, Math.floor(320 / n)));
    const labelled = cell >= 9;
    const ctx = canvas.getContext("2d");
    const font = `${Math.min(12, cell - 1)}px ui-monospace, Menlo, Consolas, "DejaVu Sans Mono", monospace`;
    ctx.font = font;
    const labels = a.units.map((u) => {
      const t = unitLabel(u);
      return t.length > 14 ? `${t.slice(0, 13)}…` : t;
    });
    const margin = labelled ? Math.ceil(Math.max(...labels.map((t) => ctx.measureText(t).width))) + 8 : 0;
    const width = margin + n * cell;
    const height = margin + n * cell;
    const ratio = window.devicePixelRatio || 1;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    canvas.style.width = `${width}px`;
    canvas.style.height = `${height}px`;
    ctx.scale(ratio, ratio);
    for (let i = 0; i < n; i++) {
      for (let j = 0; j < n; j++) {
        ctx.fillStyle = colour(BLUES, Math.sqrt(weight(a, l, h, i, j)));
        ctx.fillRect(margin + j * cell, margin + i * cell, cell, cell);
      }
    }
    if (labelled) {
      ctx.font = font;
      ctx.fillStyle = "#5d6b7b";
      ctx.textBaseline = "middle";
      ctx.textAlign = "right";
      labels.forEach((t, i) => ctx.fillText(t, margin - 5, margin + i * cell + cell / 2));
      ctx.textAlign = "left";
      labels.forEach((t, j) => {
        ctx.save();
        ctx.translate(margin + j * cell + cell / 2, margin - 5);
        ctx.rotate(-Math.PI / 2);
        ctx.fillText(t, 0, 0);
        ctx.restore();
      });
    }
    return { left: margin, top: margin, cell };
  }

  function renderModelView() {
    const a = current();
    const view = $("model-view");
    view.replaceChildren();
    view.style.gridTemplateColumns = `26px repeat(${a.H}, minmax(0, 1fr))`;
    view.append(el("span", "mv-label"));
    a.heads.forEach((h) => view.append(el("span", "mv-label", String(h))));
    a.layers.forEach((layer, l) => {
      view.append(el("span", "mv-label row", `L${layer}`));
      a.heads.forEach((head, h) => {
        const canvas = el("canvas", "cell");
        canvas.dataset.layer = String(layer);
        canvas.dataset.head = String(head);
        canvas.title = `layer ${layer}, head ${head} · entropy ${a.entropy[l][h].toFixed(2)} nats`;
        if (l === state.layer && h === state.head) canvas.classList.add("selected");
        drawHeatmap(canvas, a, l, h);
        canvas.addEventListener("click", () => selectHead(l, h));
        view.append(canvas);
      });
    });
  }

  function selectHead(l, h) {
    const a = current();
    state.layer = (l + a.L) % a.L;
    state.head = (h + a.H) % a.H;
    document.querySelectorAll(".cell.selected, .entropy td.selected").forEach((c) => c.classList.remove("selected"));
    document.querySelectorAll(
      `.cell[data-layer="${a.layers[state.layer]}"][data-head="${a.heads[state.head]}"],` +
      ` .entropy td[data-layer="${a.layers[state.layer]}"][data-head="${a.heads[state.head]}"]`,
    ).forEach((c) => c.classList.add("selected"));
    renderHeadView();
  }

  function stepHead(delta) {
    const a = current();
    if (!a) return;
    const flat = state.layer * a.H + state.head + delta;
    const wrapped = (flat + a.L * a.H) % (a.L * a.H);
    selectHead(Math.floor(wrapped / a.H), wrapped % a.H);
  }

  function renderHeadView() {
    const a = current();
    const l = state.layer;
    const h = state.head;
    const layer = a.layers[l];
    const head = a.heads[h];
    $("head-title").textContent = `Head view · layer ${layer}, head ${head}`;
    $("head-note").textContent =
      `Entropy ${a.entropy[l][h].toFixed(2)} nats. Left: each unit as it looks (query); right: what it looks at (key). ` +
      "Hover a unit to follow it; click one to choose it for the rollout.";
    const view = $("head-view");
    view.replaceChildren();
    view.dataset.layer = String(layer);
    view.dataset.head = String(head);

    // line diagram: tokens on both sides
    const lines = el("div", "hv-lines");
    const left = el("div", "hv-col left");
    const right = el("div", "hv-col right");
    const svgNS = "http://www.w3.org/2000/svg";
    const svg = document.createElementNS(svgNS, "svg");
    svg.setAttribute("class", "hv-svg");
    svg.setAttribute("viewBox", `0 0 150 ${a.n * ROW}`);
    svg.setAttribute("preserveAspectRatio", "none");
    svg.setAttribute("height", String(a.n * ROW));
    const leftUnits = [];
    const rightUnits = [];

    function draw(focus) {
      // focus: null (all), {side: "left", i} (one query's row) or {side: "right", i} (one key's column)
      svg.replaceChildren();
      leftUnits.forEach((u, i) => u.classList.toggle("hot", focus !== null && focus.side === "left" && focus.i === i));
      rightUnits.forEach((u, j) => u.classList.toggle("hot", focus !== null && focus.side === "right" && focus.i === j));
      for (let i = 0; i < a.n; i++) {
        if (focus && focus.side === "left" && focus.i !== i) continue;
        for (let j = 0; j < a.n; j++) {
          if (focus && focus.side === "right" && focus.i !== j) continue;
          const w = weight(a, l, h, i, j);
          if (w < (focus ? 0.005 : 0.02)) continue;
          const line = document.createElementNS(svgNS, "line");
          line.setAttribute("x1", "2");
          line.setAttribute("y1", String(i * ROW + ROW / 2));
          line.setAttribute("x2", "148");
          line.setAttribute("y2", String(j * ROW + ROW / 2));
          line.setAttribute("stroke-width", focus ? "2.5" : "2");
          line.setAttribute("stroke-opacity", String(Math.min(1, focus ? 0.15 + w : w)));
          svg.append(line);
        }
      }
    }

    a.units.forEach((u, i) => {
      for (const [side, list, col] of [["left", leftUnits, left], ["right", rightUnits, right]]) {
        const item = el("div", `hv-unit${u.special ? " special" : ""}${i === state.unit ? " chosen" : ""}`, unitLabel(u));
        item.dataset.unit = String(i);
        item.title = u.special ? u.text : `"${u.text}" (characters ${u.start}-${u.end})`;
        item.addEventListener("mouseenter", () => draw({ side, i }));
        item.addEventListener("mouseleave", () => draw(null));
        item.addEventListener("click", () => chooseUnit(i));
        list.push(item);
        col.append(item);
      }
    });
    draw(null);
    lines.append(left, svg, right);

    // the same head as a matrix, with a readout under the pointer
    const matrix = el("canvas", "hv-matrix");
    matrix.dataset.layer = String(layer);
    matrix.dataset.head = String(head);
    const geometry = drawMatrix(matrix, a, l, h);
    const readout = el("div", "hv-readout", "Point at the matrix to read a weight (row: query, column: key).");
    matrix.addEventListener("mousemove", (e) => {
      const i = Math.floor((e.offsetY - geometry.top) / geometry.cell);
      const j = Math.floor((e.offsetX - geometry.left) / geometry.cell);
      if (i < 0 || j < 0 || i >= a.n || j >= a.n) return;
      readout.textContent = `${unitLabel(a.units[i])} → ${unitLabel(a.units[j])}: ${weight(a, l, h, i, j).toFixed(3)}`;
    });
    const wrap = el("div", "hv-matrix-box");
    wrap.append(matrix, readout);
    view.append(lines, wrap);
  }

  function chooseUnit(i) {
    state.unit = i;
    document.querySelectorAll(".hv-unit").forEach((u) => u.classList.toggle("chosen", Number(u.dataset.unit) === i));
    renderRollout();
  }

  function renderRollout() {
    const a = current();
    const i = state.unit;
    const row = a.rollout[i];
    const top = Math.max(...row);
    $("token-title").textContent = `Rollout from “${unitLabel(a.units[i])}”`;
    const chips = $("rollout");
    chips.replaceChildren();
    a.units.forEach((u, j) => {
      const t = top > 0 ? Math.sqrt(row[j] / top) : 0;
      const chip = el("span", `chip${u.special ? " special" : ""}${j === i ? " chosen" : ""}${isDark(BLUES, t) ? " dark" : ""}`, unitLabel(u));
      chip.style.background = colour(BLUES, t);
      chip.dataset.unit = String(j);
      chip.title = `${row[j].toFixed(4)} of “${unitLabel(a.units[i])}” comes from here`;
      chip.addEventListener("click", () => chooseUnit(j));
      chips.append(chip);
    });
    const list = $("topk");
    list.replaceChildren();
    const best = a.topK[i];
    $("topk-k").textContent = String(best.length);
    const first = best.length ? best[0][1] : 1;
    best.forEach(([j, w]) => {
      const li = el("li");
      const bar = el("div", "bar");
      const fill = el("span");
      fill.style.width = `${first > 0 ? (100 * w) / first : 0}%`;
      bar.append(fill);
      const name = el("span", "unit", unitLabel(a.units[j]));
      name.append(el("span", "pos", `#${j}`));
      li.append(name, bar, el("span", "value", w.toFixed(3)));
      list.append(li);
    });
  }

  function renderEntropy() {
    const a = current();
    const values = a.entropy.flat();
    const lo = Math.min(...values);
    const hi = Math.max(...values);
    const table = el("table");
    const head = el("tr");
    head.append(el("th"));
    a.heads.forEach((h) => head.append(el("th", "", String(h))));
    table.append(head);
    a.layers.forEach((layer, l) => {
      const tr = el("tr");
      tr.append(el("th", "", `L${layer}`));
      a.heads.forEach((hd, h) => {
        const v = a.entropy[l][h];
        const t = hi > lo ? (v - lo) / (hi - lo) : 0;
        const td = el("td", l === state.layer && h === state.head ? "selected" : "", v.toFixed(2));
        td.style.background = colour(PURPLES, t);
        td.style.color = isDark(PURPLES, t) ? "#fff" : "#1b2430";
        td.dataset.layer = String(layer);
        td.dataset.head = String(hd);
        td.title = `layer ${layer}, head ${hd}: ${v.toFixed(3)} nats`;
        td.addEventListener("click", () => selectHead(l, h));
        tr.append(td);
      });
      table.append(tr);
    });
    $("entropy").replaceChildren(table);
  }

  function renderSimilarity() {
    const sim = state.similarity;
    $("similarity").hidden = !sim;
    if (!sim) return;
    $("sim-note").textContent = sim.note || "";
    $("sim-note").hidden = !sim.note;
    $("sim-score").textContent = sim.score.toFixed(3);
    $("sim-score").dataset.score = String(sim.score);
    const all = sim.texts.flatMap((t) => t.units.map((u) => Math.abs(u.contribution)));
    const scale = Math.max(...all, 1e-9);
    $("sim-min").textContent = `−${scale.toFixed(3)}`;
    $("sim-max").textContent = `+${scale.toFixed(3)}`;
    ["sim-a", "sim-b"].forEach((id, k) => {
      const box = $(id);
      box.replaceChildren();
      sim.texts[k].units.forEach((u) => {
        const t = 0.5 + u.contribution / (2 * scale);
        const chip = el("span", `chip sim-unit${u.special ? " special" : ""}${isDark(DIVERGING, t) ? " dark" : ""}`, unitLabel(u));
        chip.style.background = colour(DIVERGING, t);
        chip.dataset.contribution = String(u.contribution);
        chip.title = `contributes ${u.contribution >= 0 ? "+" : ""}${u.contribution.toFixed(4)} to ${sim.score.toFixed(4)}`;
        box.append(chip);
      });
    });
  }

  // ---------- start ----------

  async function start() {
    const saved = sessionStorage.getItem(TOKEN_KEY);
    if (saved) $("api-token").value = saved;
    if (AUTH_REQUIRED) $("token-box").hidden = false;
    $("input-form").addEventListener("submit", (e) => {
      e.preventDefault();
      analyse();
    });
    $("api-token").addEventListener("keydown", (e) => {
      if (e.key === "Enter") {
        e.preventDefault();
        analyse();
      }
    });
    $("copy-link").addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(location.href);
        setStatus("Link copied.");
      } catch (e) {
        setStatus("The link to this view is in the address bar.");
      }
    });
    $("head-prev").addEventListener("click", () => stepHead(-1));
    $("head-next").addEventListener("click", () => stepHead(1));
    document.addEventListener("keydown", (e) => {
      if (["TEXTAREA", "INPUT", "SELECT"].includes(document.activeElement.tagName)) return;
      if (e.key === "ArrowLeft") stepHead(-1);
      if (e.key === "ArrowRight") stepHead(1);
    });

    const { texts, level, model } = readAddress();
    $("text-a").value = texts[0] || "";
    $("text-b").value = texts[1] || "";
    $("level").value = level;
    try {
      state.info = await api("/info");
      const models = state.info.models || [state.info];
      const badge = () => {
        const i = models.find((m) => m.model === $("model").value) || models[0];
        $("model-badge").textContent = `${i.model} · ${i.num_layers} layers × ${i.num_heads} heads`;
      };
      if (models.length > 1) { // several served: choose one (the first is the service's default)
        models.forEach((m) => $("model").append(new Option(m.model, m.model)));
        if (models.some((m) => m.model === model)) $("model").value = model;
        $("model").addEventListener("change", badge);
        $("model-field").hidden = false;
      }
      badge();
    } catch (e) {
      showError(`Could not read /info: ${e.message}`);
    }
    if (texts.length) await analyse();
    document.body.dataset.ready = "true";
  }

  start();
})();

// The rerank explorer: a query and documents through the service's /v1/rerank with explain, drawn as a
// ranked list. A cross-encoder's words are coloured by their occlusion; a late-interaction model's (ColBERT,
// BGE-M3) MaxSim is drawn as each query token joined to its best document token, and BGE-M3's shared sparse
// terms as bars. Vanilla JS, nothing loaded from elsewhere.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const ROOT = document.body.dataset.root || "";
  // the diverging ramp of the attention explorer's similarity view: red takes from the score, blue adds
  const STOPS = ["#b2182b", "#ef8a62", "#fddbc7", "#f7f7f7", "#d1e5f0", "#67a9cf", "#2166ac"];
  const SVG = "http://www.w3.org/2000/svg";
  const NOTES = {
    occlusion: "Best first, by the cross-encoder's score. Each word is coloured by what it adds to the score "
      + "(occlusion: the score minus the score without that word): blue adds, red takes away.",
    maxsim: "Best first, by late interaction (MaxSim): each query token is joined to the document token it matches "
      + "best, the line coloured by their cosine (blue high, red low) and as thick as the token's share of the MaxSim.",
    bgeM3: " BGE-M3's score is the weighted mean of its dense, sparse and MaxSim scores (each shown); the bars are the "
      + "terms the two sparse vectors share, by their product (their part of the sparse score).",
  };
  const TERMS_SHOWN = 8;

  function hex(c) {
    return [1, 3, 5].map((i) => parseInt(c.slice(i, i + 2), 16));
  }

  function diverging(t) { // t in [-1, 1]
    const x = (Math.max(-1, Math.min(1, t)) + 1) / 2 * (STOPS.length - 1);
    const i = Math.min(Math.floor(x), STOPS.length - 2), f = x - i;
    const a = hex(STOPS[i]), b = hex(STOPS[i + 1]);
    const rgb = a.map((v, k) => Math.round(v + (b[k] - v) * f));
    return { css: `rgb(${rgb.join(", ")})`, dark: Math.abs(t) > 0.75 };
  }

  async function api(path, body) {
    const init = { method: body === undefined ? "GET" : "POST", headers: { accept: "application/json" } };
    if (body !== undefined) {
      init.headers["content-type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetch(ROOT + path, init);
    const data = await response.json().catch(() => null);
    if (!response.ok) {
      throw new Error((data && data.error && data.error.message) || `HTTP ${response.status}`);
    }
    return data;
  }

  function chip(word, scale) {
    const el = document.createElement("span");
    const c = diverging(scale ? word.occlusion / scale : 0);
    el.className = "chip sim-unit" + (c.dark ? " dark" : "");
    el.textContent = word.text;
    el.style.background = c.css;
    el.title = `occlusion ${word.occlusion.toFixed(4)}, rollout ${word.rollout.toFixed(3)}`;
    el.dataset.occlusion = String(word.occlusion);
    return el;
  }

  function svgElement(name, attributes, text) {
    const el = document.createElementNS(SVG, name);
    for (const [key, value] of Object.entries(attributes)) el.setAttribute(key, String(value));
    if (text !== undefined) el.textContent = text;
    return el;
  }

  // Query tokens on the left, the document tokens they matched on the right (in document order), one line per
  // query token to its best document token: colour by cosine, width by share of the MaxSim.
  function maxsimDrawing(matches) {
    const positions = [...new Set(matches.map((m) => m.document_position))].sort((a, b) => a - b);
    const documentToken = new Map(matches.map((m) => [m.document_position, m.document_token]));
    const row = 20, width = 480, left = 160, right = width - 160;
    const rows = Math.max(matches.length, positions.length), height = rows * row + 8;
    const y = (i, n) => 4 + (rows - n) * row / 2 + i * row + row / 2;
    const maxShare = Math.max(1e-9, ...matches.map((m) => Math.abs(m.share)));
    const svg = svgElement("svg", { class: "maxsim", width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
                                    "aria-label": "each query token joined to its best document token" });
    matches.forEach((m, k) => {
      const y1 = y(k, matches.length), y2 = y(positions.indexOf(m.document_position), positions.length);
      const line = svgElement("line", {
        x1: left + 6, y1, x2: right - 6, y2, stroke: diverging(m.similarity).css,
        "stroke-width": (1 + 5 * Math.abs(m.share) / maxShare).toFixed(2), "data-query": k,
        "data-document-position": m.document_position, "data-similarity": m.similarity, "data-share": m.share });
      line.append(svgElement("title", {}, `${m.query_token} → ${m.document_token}: cosine ${m.similarity.toFixed(3)}, `
                                          + `${(100 * m.share).toFixed(1)}% of the MaxSim`));
      svg.append(line, svgElement("text", { x: left, y: y1, class: "maxsim-token query", "text-anchor": "end" },
                                  m.query_token));
    });
    positions.forEach((p, j) => svg.append(svgElement("text", {
      x: right, y: y(j, positions.length), class: "maxsim-token document", "data-position": p }, documentToken.get(p))));
    return svg;
  }

  // BGE-M3: its three scores, and the sparse terms query and document share as bars (largest product first).
  function sparseTerms(explanation) {
    const box = document.createElement("div");
    box.className = "late-terms";
    const scores = document.createElement("div");
    scores.className = "late-scores";
    scores.textContent = ["dense", "sparse", "multivector"]
      .map((k) => `${k} ${explanation.scores[k].toFixed(3)}`).join(" · ");
    const terms = explanation.terms.slice(0, TERMS_SHOWN);
    const list = document.createElement("ol");
    list.className = "topk terms";
    const largest = Math.max(1e-9, ...terms.map((t) => t.product));
    list.replaceChildren(...terms.map((t) => {
      const li = document.createElement("li");
      li.dataset.token = t.token;
      li.title = `query weight ${t.query_weight.toFixed(4)} × document weight ${t.document_weight.toFixed(4)}`;
      const unit = document.createElement("span"), bar = document.createElement("div"),
            fill = document.createElement("span"), value = document.createElement("span");
      unit.className = "unit"; unit.textContent = t.token;
      bar.className = "bar"; fill.style.width = `${(100 * t.product / largest).toFixed(1)}%`; bar.append(fill);
      value.className = "value"; value.textContent = t.product.toFixed(4);
      li.replaceChildren(unit, bar, value);
      return li;
    }));
    const empty = document.createElement("p");
    empty.className = "card-note";
    empty.textContent = terms.length ? "" : "no sparse term in common";
    box.replaceChildren(scores, list, empty);
    return box;
  }

  function renderLateInteraction(data) {
    const explanations = data.results.map((r) => r.explanation);
    const bgeM3 = explanations[0].scores !== undefined;
    $("results-note").textContent = NOTES.maxsim + (bgeM3 ? NOTES.bgeM3 : "");
    $("legend-min").textContent = "−1";
    $("legend-max").textContent = "+1";
    $("legend-note").textContent = "cosine of a query token and its best document token";
    $("model-badge").textContent = data.model;
    $("query-chips").replaceChildren(...explanations[0].maxsim.map((m) => {
      const el = document.createElement("span");
      el.className = "chip";
      el.textContent = m.query_token;
      return el;
    }));
    $("ranked").replaceChildren(...data.results.map((r) => {
      const [li, score] = rankedItem(r, "ranked-item late");
      const body = document.createElement("div");
      body.className = "late-body";
      const text = document.createElement("div");
      text.className = "late-document";
      text.textContent = r.document ? r.document.text : "";
      body.replaceChildren(text, maxsimDrawing(r.explanation.maxsim), ...(bgeM3 ? [sparseTerms(r.explanation)] : []));
      li.replaceChildren(score, body);
      return li;
    }));
    $("results").hidden = false;
  }

  // One result's list item and its score, which each kind of model fills with its own explanation.
  function rankedItem(r, className) {
    const li = document.createElement("li");
    li.className = className;
    li.dataset.index = String(r.index);
    const score = document.createElement("span");
    score.className = "ranked-score";
    score.textContent = r.relevance_score.toFixed(3);
    return [li, score];
  }

  function render(data) {
    if (data.results.length && data.results[0].explanation.maxsim) {
      renderLateInteraction(data);
      return;
    }
    $("results-note").textContent = NOTES.occlusion;
    $("legend-note").textContent = "occlusion: the word's part of the score";
    const words = data.results.flatMap((r) => r.explanation.words);
    const scale = Math.max(1e-9, ...words.map((w) => Math.abs(w.occlusion)));
    $("legend-min").textContent = (-scale).toFixed(3);
    $("legend-max").textContent = `+${scale.toFixed(3)}`;
    $("model-badge").textContent = data.model;
    const query = $("query-chips");
    query.replaceChildren(...data.results[0].explanation.words.filter((w) => w.sequence === 0).map((w) => chip(w, scale)));
    const list = $("ranked");
    list.replaceChildren(...data.results.map((r) => {
      const [li, score] = rankedItem(r, "ranked-item");
      const chips = document.createElement("div");
      chips.className = "chips";
      chips.replaceChildren(...r.explanation.words.filter((w) => w.sequence === 1).map((w) => chip(w, scale)));
      li.replaceChildren(score, chips);
      return li;
    }));
    $("results").hidden = false;
  }

  function readAddress() {
    const params = new URLSearchParams(location.search);
    return { query: params.get("query") || "", documents: params.getAll("doc").filter((d) => d.trim()),
             model: params.get("model") || "" };
  }

  async function rank() {
    const query = $("query").value.trim();
    const documents = $("documents").value.split("\n").map((d) => d.trim()).filter(Boolean);
    const model = $("model").value;
    if (!query || !documents.length) return;
    const params = new URLSearchParams({ query, model });
    documents.forEach((d) => params.append("doc", d));
    history.replaceState(null, "", `${location.pathname}?${params}`);
    $("status").textContent = "Ranking and explaining…";
    $("error").hidden = true;
    document.body.dataset.analysis = "running";
    try {
      render(await api("/v1/rerank", { model, query, documents, explain: true, return_documents: true }));
      document.body.dataset.analysis = "done";
      $("status").textContent = "";
    } catch (e) {
      $("error").textContent = e.message;
      $("error").hidden = false;
      $("status").textContent = "";
      document.body.dataset.analysis = "error";
    }
  }

  async function start() {
    $("input-form").addEventListener("submit", (event) => { event.preventDefault(); rank(); });
    try {
      const info = await api("/info");
      // cross-encoders (one-label classifiers), and late-interaction models (a multi-vector representation)
      const rankers = info.models.filter((m) => (m.task === "classification" && (m.labels || []).length === 1)
                                           || (m.representations || []).includes("multivector"));
      if (!rankers.length) {
        throw new Error("no cross-encoder (a one-label classification model) or late-interaction model (ColBERT, "
                        + "BGE-M3) is served here");
      }
      $("model").replaceChildren(...rankers.map((m) => new Option(m.model, m.model)));
      const address = readAddress();
      if (address.model) $("model").value = address.model;
      $("query").value = address.query;
      $("documents").value = address.documents.join("\n");
      if (address.query && address.documents.length) await rank();
      document.body.dataset.ready = "true"; // as the attention explorer: after the ranking the address asks for
    } catch (e) {
      $("error").textContent = e.message;
      $("error").hidden = false;
      document.body.dataset.ready = "true";
      document.body.dataset.analysis = "error";
    }
  }

  start();
})();

// The rerank explorer: a query and documents through the service's /v1/rerank with explain, drawn as a
// ranked list whose words are coloured by their occlusion. Vanilla JS, nothing loaded from elsewhere.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const ROOT = document.body.dataset.root || "";
  // the diverging ramp of the attention explorer's similarity view: red takes from the score, blue adds
  const STOPS = ["#b2182b", "#ef8a62", "#fddbc7", "#f7f7f7", "#d1e5f0", "#67a9cf", "#2166ac"];

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

  function render(data) {
    const words = data.results.flatMap((r) => r.explanation.words);
    const scale = Math.max(1e-9, ...words.map((w) => Math.abs(w.occlusion)));
    $("legend-min").textContent = (-scale).toFixed(3);
    $("legend-max").textContent = `+${scale.toFixed(3)}`;
    $("model-badge").textContent = data.model;
    const query = $("query-chips");
    query.replaceChildren(...data.results[0].explanation.words.filter((w) => w.sequence === 0).map((w) => chip(w, scale)));
    const list = $("ranked");
    list.replaceChildren(...data.results.map((r) => {
      const li = document.createElement("li");
      li.className = "ranked-item";
      li.dataset.index = String(r.index);
      const score = document.createElement("span");
      score.className = "ranked-score";
      score.textContent = r.relevance_score.toFixed(3);
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
      render(await api("/v1/rerank", { model, query, documents, explain: true }));
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
      const rankers = info.models.filter((m) => m.task === "classification" && (m.labels || []).length === 1);
      if (!rankers.length) throw new Error("no cross-encoder (a one-label classification model) is served here");
      $("model").replaceChildren(...rankers.map((m) => new Option(m.model, m.model)));
      const address = readAddress();
      if (address.model) $("model").value = address.model;
      $("query").value = address.query;
      $("documents").value = address.documents.join("\n");
      document.body.dataset.ready = "true";
      if (address.query && address.documents.length) await rank();
    } catch (e) {
      $("error").textContent = e.message;
      $("error").hidden = false;
      document.body.dataset.ready = "true";
      document.body.dataset.analysis = "error";
    }
  }

  start();
})();

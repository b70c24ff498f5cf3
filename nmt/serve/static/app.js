// The try-the-model page: POST /translate, show the best translations (n-best if asked) and, for
// attention models, one heatmap per sentence (source pieces across, output pieces down); for a
// Transformer, the heatmap of the chosen layer and head and the per-head table of the sentences.
// A server started with an API key answers 401: the page then asks for the key and keeps it in memory only.
"use strict";
const $ = (id) => document.getElementById(id);
let info = null;
let pending = 0;
let shown = null;  // the last answer's translations, redrawn when another head is chosen
const STATS = ["confidence", "entropy", "previous", "same", "next", "rare"];
const KIND_TITLES = { encoder: "encoder self-attention", decoder: "decoder self-attention", cross: "cross-attention" };
let apiKey = "";

const withKey = (headers) => (apiKey ? { ...headers, Authorization: `Bearer ${apiKey}` } : headers);

async function askForKey(response) {
  $("key-form").hidden = false;
  $("key").focus();
  return (await response.json()).error;
}

async function loadInfo() {
  const response = await fetch("/info", { headers: withKey({}) });
  if (response.status === 401) { $("model").textContent = await askForKey(response); return; }
  info = await response.json();
  $("key-form").hidden = true;
  $("model").textContent = `${info.preset.encoder} → ${info.preset.decoder}, ` +
    `${info.parameters.toLocaleString("en")} parameters, ${info.training.run || ""}` +
    (info.training.test_bleu != null ? `, test BLEU ${info.training.test_bleu.toFixed(1)}` : "");
  $("src-label").textContent = `source (${info.src_lang || "?"})`;
  $("tgt-label").textContent = `translation (${info.tgt_lang || "?"})`;
  if (info.target_languages.length) {  // a multilingual model: the language to translate into
    for (const lang of info.target_languages) $("lang").add(new Option(lang, lang));
    $("lang-label").hidden = false;
    $("src-label").textContent = "source";
    $("tgt-label").textContent = "translation";
  }
  $("beam").value = info.decoding.beam_size || 1;
  $("beam").max = $("nbest").max = info.limits.max_beam_size;
  if (!info.attention) { $("attention").checked = false; $("attention-label").hidden = true; }
  $("head-label").hidden = !(info.attention && info.heads);
  if (info.report && !apiKey) { $("report-img").src = "/report.png"; $("report").hidden = false; }
  if (info.report && apiKey) {  // an <img> cannot send the key: fetch the chart and show the bytes
    const chart = await fetch("/report.png", { headers: withKey({}) });
    if (chart.ok) { $("report-img").src = URL.createObjectURL(await chart.blob()); $("report").hidden = false; }
  }
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function drawHeatmap(att, title) {
  const cell = 22, font = "12px sans-serif";
  const canvas = document.createElement("canvas");
  const ctx = canvas.getContext("2d");
  ctx.font = font;
  const width = (words) => Math.max(0, ...words.map((w) => ctx.measureText(w).width));
  const left = width(att.target) + 10, top = width(att.source) + 10 + 16;
  canvas.width = left + cell * att.source.length + 4;
  canvas.height = top + cell * att.target.length + 4;
  ctx.font = font;
  ctx.fillStyle = "#222";
  ctx.fillText(title, 2, 12);
  att.weights.forEach((row, t) => row.forEach((w, s) => {
    const shade = Math.round(255 * (1 - Math.sqrt(w)));  // sqrt: weak weights stay visible
    ctx.fillStyle = `rgb(${shade},${shade},255)`;
    ctx.fillRect(left + s * cell, top + t * cell, cell - 1, cell - 1);
  }));
  ctx.fillStyle = "#222";
  ctx.textBaseline = "middle";
  att.target.forEach((w, t) => ctx.fillText(w, left - 6 - ctx.measureText(w).width, top + t * cell + cell / 2));
  att.source.forEach((w, s) => {
    ctx.save();
    ctx.translate(left + s * cell + cell / 2, top - 6);
    ctx.rotate(-Math.PI / 2);
    ctx.fillText(w, 0, 0);
    ctx.restore();
  });
  canvas.className = "heatmap";
  return canvas;
}

async function translate() {
  const lines = $("source").value.split("\n").filter((l) => l.trim());
  if (!lines.length) return;
  const heads = $("attention").checked && info && info.heads > 0;
  const request = { text: lines, beam_size: Number($("beam").value), nbest: Number($("nbest").value),
                    attention: heads ? "heads" : $("attention").checked };
  if (info && info.target_languages.length) request.tgt_lang = $("lang").value;
  const mine = ++pending;
  $("status").textContent = "";
  const response = await fetch("/translate", { method: "POST", headers: withKey({ "Content-Type": "application/json" }),
                                               body: JSON.stringify(request) });
  if (response.status === 401) { $("status").textContent = await askForKey(response); return; }
  const body = await response.json();
  if (mine !== pending) return;  // a newer request was sent while this one ran
  if (!response.ok) { $("status").textContent = body.error; return; }
  const output = $("output");
  output.replaceChildren();
  body.translations.forEach((tr) => {
    const best = el("div", "best", tr.text);
    best.appendChild(el("span", "score", tr.score.toFixed(2)));
    output.appendChild(best);
    if (tr.nbest && tr.nbest.length > 1) {
      const list = el("ol");
      tr.nbest.forEach((h) => { const item = el("li", null, h.text); item.appendChild(el("span", "score", h.score.toFixed(2))); list.appendChild(item); });
      output.appendChild(list);
    }
  });
  shown = body.translations;
  headChoices(shown);
  drawHeatmaps();
  drawHeadTable(shown);
  output.dataset.done = String(mine);
}

function headChoices(translations) {
  // "layer l, head h" for every head of the answer's model (a pruned layer may have fewer heads)
  const withHeads = translations.find((tr) => tr.attention && tr.attention.heads);
  const select = $("head"), chosen = select.value;
  while (select.options.length > 1) select.remove(1);
  if (!withHeads) return;
  withHeads.attention.heads.forEach((layer, l) => layer.forEach((_, h) => {
    select.add(new Option(`layer ${l + 1}, head ${h + 1}`, `${l},${h}`));
  }));
  select.value = [...select.options].some((o) => o.value === chosen) ? chosen : "";
}

function drawHeatmaps() {
  const heatmaps = $("heatmaps"), choice = $("head").value;
  heatmaps.replaceChildren();
  (shown || []).forEach((tr, i) => {
    if (!tr.attention) return;
    if (choice && tr.attention.heads) {
      const [l, h] = choice.split(",").map(Number);
      heatmaps.appendChild(drawHeatmap({ ...tr.attention, weights: tr.attention.heads[l][h] },
                                       `layer ${l + 1}, head ${h + 1}, sentence ${i + 1}`));
    } else {
      heatmaps.appendChild(drawHeatmap(tr.attention, `attention, sentence ${i + 1}`));
    }
  });
}

function drawHeadTable(translations) {
  // each head's statistics averaged over the sentences that have them
  const sums = new Map();
  translations.forEach((tr) => (tr.heads || []).forEach((row) => {
    const key = `${row.kind},${row.layer},${row.head}`;
    const into = sums.get(key) || { row, n: 0, totals: {} };
    STATS.forEach((s) => { if (row[s] != null) into.totals[s] = (into.totals[s] || 0) + row[s]; });
    into.n += 1;
    sums.set(key, into);
  }));
  const table = $("heads");
  table.replaceChildren();
  $("head-table").hidden = sums.size === 0;
  if (!sums.size) return;
  const header = el("tr");
  ["attention", "layer", "head", ...STATS].forEach((c) => header.appendChild(el("th", null, c)));
  table.appendChild(header);
  for (const { row, n, totals } of sums.values()) {
    const tr = el("tr");
    [KIND_TITLES[row.kind] || row.kind, String(row.layer + 1), String(row.head + 1)].forEach((c) => tr.appendChild(el("td", null, c)));
    STATS.forEach((s) => tr.appendChild(el("td", "num", s in totals ? (totals[s] / n).toFixed(3) : "")));
    table.appendChild(tr);
  }
}

let timer = null;
$("translate").addEventListener("click", translate);
$("head").addEventListener("change", drawHeatmaps);
$("source").addEventListener("input", () => {
  if (!$("live").checked) return;
  clearTimeout(timer);
  timer = setTimeout(translate, 400);
});
$("source").addEventListener("keydown", (e) => { if (e.key === "Enter" && e.ctrlKey) translate(); });
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  apiKey = $("key").value.trim();
  loadInfo().catch((err) => { $("model").textContent = `cannot reach the server: ${err}`; });
});
loadInfo().catch((e) => { $("model").textContent = `cannot reach the server: ${e}`; });

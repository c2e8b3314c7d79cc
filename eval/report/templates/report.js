/* The report's gallery (eval/report/html_page.py): pages of prompts × decoders from the JSON block "gallery-data",
   filtered by decoder and by prompt text; images load lazily. What the page saw is written on <html>:
   data-images-loaded / -failed / -total, data-js-errors, data-ready (read by tests/test_html_report.py). */
(function () {
  "use strict";
  var html = document.documentElement;
  var errors = [];

  function noteError(text) {
    errors.push(String(text));
    html.setAttribute("data-js-errors", String(errors.length));
    var box = document.getElementById("js-errors");
    if (box) {
      box.hidden = false;
      var li = document.createElement("li");
      li.textContent = String(text);
      box.querySelector("ul").appendChild(li);
    }
  }
  window.addEventListener("error", function (e) {
    if (e.target && e.target.tagName === "IMG") { return; }  // counted by imageStatus
    noteError((e.message || "error") + (e.filename ? " (" + e.filename + ":" + e.lineno + ")" : ""));
  }, true);
  window.addEventListener("unhandledrejection", function (e) { noteError("unhandled rejection: " + e.reason); });

  function el(tag, cls, text) {
    var node = document.createElement(tag);
    if (cls) { node.className = cls; }
    if (text !== undefined && text !== null) { node.textContent = text; }
    return node;
  }
  function fmt(x, digits) { return (x === null || x === undefined) ? null : Number(x).toFixed(digits); }

  /* -- what loaded --------------------------------------------------------------------------------------- */
  var failedSrc = [];
  function imageStatus() {
    var imgs = document.querySelectorAll("img");
    var loaded = 0, failed = 0;
    failedSrc = [];
    for (var k = 0; k < imgs.length; k++) {
      var img = imgs[k];
      if (img.complete && img.naturalWidth > 0) { loaded++; }
      else if (img.getAttribute("data-failed") === "1") { failed++; failedSrc.push(img.getAttribute("src")); }
    }
    html.setAttribute("data-images-total", String(imgs.length));
    html.setAttribute("data-images-loaded", String(loaded));
    html.setAttribute("data-images-failed", String(failed));
    var line = document.getElementById("image-status");
    if (line) {
      line.textContent = "Images on this page: " + loaded + " of " + imgs.length + " loaded" +
        (imgs.length - loaded - failed > 0 ? " (the others load as they scroll into view)" : "") +
        (failed ? "; " + failed + " did not load: " + failedSrc.slice(0, 10).join(", ") +
         (failed > 10 ? " …" : "") : "") + ".";
    }
  }
  document.addEventListener("load", function (e) {
    var img = e.target;
    if (img.tagName === "IMG") {
      if (img.naturalWidth && img.naturalWidth < 96) { img.classList.add("pixel"); }
      imageStatus();
    }
  }, true);
  document.addEventListener("error", function (e) {
    if (e.target.tagName === "IMG") { e.target.setAttribute("data-failed", "1"); imageStatus(); }
  }, true);

  /* -- the gallery --------------------------------------------------------------------------------------- */
  var block = document.getElementById("gallery-data");
  var data = JSON.parse(block.textContent);
  var state = { page: 0, size: data.page_size, text: "", shown: data.columns.map(function () { return true; }) };
  var table = document.getElementById("gallery-table");

  function matches(p) {
    var q = state.text;
    if (!q) { return true; }
    if (/^#?\d+$/.test(q)) { return p.i === Number(q.replace("#", "")); }
    if (p.p && p.p.toLowerCase().indexOf(q) >= 0) { return true; }
    return p.c.some(function (c) { return c && c.p && c.p.toLowerCase().indexOf(q) >= 0; });
  }

  function cellNode(c) {
    var box = el("div", "cell");
    if (c === null) { return el("div", "cell empty", "not recorded"); }
    if (!c.src || c.missing) {
      box = el("div", "cell empty", c.missing ? "image file missing: " + c.missing : "no image saved");
    } else {
      var a = el("a");
      a.href = c.src;
      a.target = "_blank";
      var img = el("img");
      img.loading = "lazy";
      img.decoding = "async";
      img.alt = "image";
      img.src = c.src;
      a.appendChild(img);
      box.appendChild(a);
    }
    var parts = [];
    if (c.a !== null && c.a !== undefined) { parts.push("τ " + fmt(c.a, 2)); }
    if (c.t !== null && c.t !== undefined) { parts.push("TV " + fmt(c.t, 4)); }
    var stats = el("div", "stats", parts.join(" · "));
    if (c.n !== null && c.n !== undefined) { stats.title = c.n + " tokens in " + c.k + " verify forwards"; }
    box.appendChild(stats);
    if (c.p !== undefined || c.s !== undefined) {
      box.appendChild(el("div", "own", "own prompt/seed: " + (c.p !== undefined ? c.p : "") +
                         (c.s !== undefined ? " (seed " + c.s + ")" : "")));
    }
    return box;
  }

  function render() {
    var rows = data.prompts.filter(matches);
    var pages = Math.max(1, Math.ceil(rows.length / state.size));
    state.page = Math.min(Math.max(state.page, 0), pages - 1);
    var slice = rows.slice(state.page * state.size, (state.page + 1) * state.size);
    var cols = [];
    data.columns.forEach(function (c, k) { if (state.shown[k]) { cols.push(k); } });

    table.textContent = "";
    var head = el("thead"), tr = el("tr");
    tr.appendChild(el("th", "prompt", "prompt"));
    cols.forEach(function (k) {
      var c = data.columns[k];
      var th = el("th", c.incomplete ? "incomplete" : "", c.label);
      th.setAttribute("data-col", c.id);
      th.appendChild(el("span", "id", c.id + (c.rows ? " · " + c.rows : "") + (c.incomplete ? " (incomplete)" : "")));
      tr.appendChild(th);
    });
    head.appendChild(tr);
    table.appendChild(head);
    var body = el("tbody");
    slice.forEach(function (p) {
      var row = el("tr");
      row.setAttribute("data-index", String(p.i));
      var th = el("th", "prompt");
      th.appendChild(el("span", "idx", "#" + p.i + (p.s !== null ? " · seed " + p.s : "")));
      th.appendChild(document.createTextNode(p.p !== null ? p.p : "(no record)"));
      row.appendChild(th);
      cols.forEach(function (k) {
        var td = el("td");
        td.setAttribute("data-col", data.columns[k].id);
        td.appendChild(cellNode(p.c[k]));
        row.appendChild(td);
      });
      body.appendChild(row);
    });
    table.appendChild(body);

    var info = document.getElementById("page-info");
    var first = rows.length ? state.page * state.size + 1 : 0;
    info.textContent = "prompts " + first + "–" + (state.page * state.size + slice.length) + " of " + rows.length +
      (rows.length !== data.prompts.length ? " (filtered from " + data.prompts.length + ")" : "") +
      ", page " + (state.page + 1) + " of " + pages;
    document.getElementById("first").disabled = document.getElementById("prev").disabled = state.page === 0;
    document.getElementById("next").disabled = document.getElementById("last").disabled = state.page >= pages - 1;
    imageStatus();
  }

  var filter = document.getElementById("decoder-filter");
  data.columns.forEach(function (c, k) {
    var label = el("label");
    var box = el("input");
    box.type = "checkbox";
    box.checked = true;
    box.value = c.id;
    box.addEventListener("change", function () { state.shown[k] = box.checked; render(); });
    label.appendChild(box);
    label.appendChild(document.createTextNode(" " + c.label + " (" + c.id + ")"));
    filter.appendChild(label);
  });
  var timer = null;
  document.getElementById("filter-text").addEventListener("input", function (e) {
    clearTimeout(timer);
    timer = setTimeout(function () { state.text = e.target.value.trim().toLowerCase(); state.page = 0; render(); }, 150);
  });
  document.getElementById("page-size").addEventListener("change", function (e) {
    state.size = Number(e.target.value); state.page = 0; render();
  });
  document.getElementById("thumb-size").addEventListener("change", function (e) {
    html.style.setProperty("--thumb", e.target.value + "px");
  });
  document.getElementById("first").addEventListener("click", function () { state.page = 0; render(); });
  document.getElementById("prev").addEventListener("click", function () { state.page -= 1; render(); });
  document.getElementById("next").addEventListener("click", function () { state.page += 1; render(); });
  document.getElementById("last").addEventListener("click", function () { state.page = 1e9; render(); });

  render();
  html.setAttribute("data-ready", "1");
  window.addEventListener("load", imageStatus);
}());

// Coral report renderer: draws the view model (coral/report/view.py) into #app with plain DOM and inline SVG.
// Used by the static report (data embedded in #coral-data) and the live dashboard (polls config.poll_url).
(function () {
  "use strict";
  var SVGNS = "http://www.w3.org/2000/svg";
  var openDetails = {};

  function add(el, children) {
    (Array.isArray(children) ? children : [children]).forEach(function (c) {
      if (c === null || c === undefined || c === false) return;
      if (Array.isArray(c)) add(el, c);
      else el.appendChild(typeof c === "object" ? c : document.createTextNode(String(c)));
    });
    return el;
  }
  function attrs(el, a) {
    Object.keys(a || {}).forEach(function (k) {
      if (a[k] !== null && a[k] !== undefined) el.setAttribute(k, a[k]);
    });
    return el;
  }
  function h(tag, a) { return add(attrs(document.createElement(tag), a), [].slice.call(arguments, 2)); }
  function s(tag, a) { return add(attrs(document.createElementNS(SVGNS, tag), a), [].slice.call(arguments, 2)); }

  function fixed(v, d) {
    return Number(v).toLocaleString("en-US", { minimumFractionDigits: d, maximumFractionDigits: d });
  }
  function money(v) { return "$" + fixed(v, 2) + "/h"; }
  function pct(v) { return v === null || v === undefined ? "–" : fixed(100 * v, 1) + "%"; }
  function qty(v) {
    if (v === null || v === undefined) return "–";
    var a = Math.abs(v);
    if (Number.isInteger(v) && a < 1e4) return fixed(v, 0);
    if (a >= 1e6) return fixed(v / 1e6, 2) + "M";
    if (a >= 1e4) return fixed(v / 1e3, 1) + "k";
    if (a >= 100) return fixed(v, 0);
    return fixed(v, a >= 10 ? 1 : 2);
  }
  function ms(v) { return v === null || v === undefined ? "–" : qty(v) + " ms"; }
  function cap(t) { return t.charAt(0).toUpperCase() + t.slice(1); }

  function niceTicks(lo, hi, n) {
    if (!(hi > lo)) hi = lo + 1;
    var raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    var step = [1, 2, 2.5, 5, 10].map(function (m) { return m * mag; }).filter(function (x) { return x >= raw; })[0];
    var out = [];
    for (var t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(+t.toPrecision(12));
    out.step = step;
    return out;
  }
  // Tick labels with as many decimals as the tick step needs (1k/1M suffixes for large values).
  function tickFmt(step) {
    return function (v) {
      if (Math.abs(v) >= 1e4) return qty(v);
      var d = 0;
      while (d < 3 && Math.abs(step * Math.pow(10, d) - Math.round(step * Math.pow(10, d))) > 1e-6) d++;
      return fixed(v, d);
    };
  }

  // Horizontal bar chart: items [{label, value, color?, id?}].
  function barChart(items, fmt, opts) {
    opts = opts || {};
    var longest = Math.max.apply(null, items.map(function (i) { return String(i.label).length; }).concat([4]));
    var rowH = 26, labelW = Math.min(opts.labelW || 200, 7 * longest + 14), valueW = 84, width = opts.width || 420;
    var barW = width - labelW - valueW, height = items.length * rowH + 6;
    var max = Math.max.apply(null, items.map(function (i) { return i.value; }).concat([1e-9]));
    var svg = s("svg", { width: width, height: height, viewBox: "0 0 " + width + " " + height, role: "img" });
    items.forEach(function (it, k) {
      var y = 3 + k * rowH, w = Math.max(1, (barW - 8) * it.value / max);
      add(svg, [
        s("text", { x: labelW - 8, y: y + 17, "text-anchor": "end", "font-size": 13 }, it.label),
        s("rect", { x: labelW, y: y + 4, width: w, height: rowH - 8, rx: 3, fill: it.color || "#2f6fdf",
          opacity: it.dim ? 0.45 : 1 }),
        s("text", { x: labelW + w + 6, y: y + 17, "font-size": 13, "data-value": it.value,
          class: "bar-value", "data-label": it.label }, fmt(it.value)),
      ]);
    });
    return svg;
  }

  // Line / step chart: series [{name, color, points: [[x, y]]}]; vlines [{x, label}] drawn dashed.
  function lineChart(series, opts) {
    var W = opts.width || 400, H = opts.height || 230, m = { l: 56, r: 14, t: 12, b: 40 };
    var pw = W - m.l - m.r, ph = H - m.t - m.b;
    var xs = [], ys = [];
    series.forEach(function (sr) { sr.points.forEach(function (p) { xs.push(p[0]); ys.push(p[1]); }); });
    (opts.vlines || []).forEach(function (v) { xs.push(v.x); });
    (opts.hlines || []).forEach(function (v) { ys.push(v.y); });
    if (!xs.length) xs.push(0);
    if (!ys.length) ys.push(0);
    var x0 = opts.xmin !== undefined ? opts.xmin : Math.min.apply(null, xs);
    var x1 = Math.max.apply(null, xs), y0 = opts.ymin !== undefined ? opts.ymin : Math.min(0, Math.min.apply(null, ys));
    var y1 = opts.ymax !== undefined ? opts.ymax : Math.max.apply(null, ys);
    if (!(x1 > x0)) x1 = x0 + 1;
    if (!(y1 > y0)) y1 = y0 + 1;
    var xt = opts.xticks || niceTicks(x0, x1, 5), yt = niceTicks(y0, y1, 4);
    var xf = opts.xfmt || tickFmt(xt.step || 1), yf = opts.yfmt || tickFmt(yt.step);
    x1 = Math.max(x1, xt[xt.length - 1]); y1 = Math.max(y1, yt[yt.length - 1]);
    function X(v) { return m.l + pw * (v - x0) / (x1 - x0); }
    function Y(v) { return m.t + ph - ph * (Math.min(v, y1) - y0) / (y1 - y0); }
    var svg = s("svg", { width: W, height: H, viewBox: "0 0 " + W + " " + H, role: "img" });
    yt.forEach(function (t) {
      add(svg, [s("line", { x1: m.l, x2: m.l + pw, y1: Y(t), y2: Y(t), class: "gridline" }),
        s("text", { x: m.l - 6, y: Y(t) + 4, "text-anchor": "end", class: "tick" }, yf(t))]);
    });
    xt.forEach(function (t) {
      add(svg, s("text", { x: X(t), y: m.t + ph + 16, "text-anchor": "middle", class: "tick" }, xf(t)));
    });
    add(svg, [s("line", { x1: m.l, x2: m.l + pw, y1: m.t + ph, y2: m.t + ph, class: "axis" }),
      s("line", { x1: m.l, x2: m.l, y1: m.t, y2: m.t + ph, class: "axis" }),
      s("text", { x: m.l + pw / 2, y: H - 6, "text-anchor": "middle", "font-size": 12, fill: "#5c667a" }, opts.xlabel || "")]);
    (opts.vlines || []).forEach(function (v) {
      add(svg, [s("line", { x1: X(v.x), x2: X(v.x), y1: m.t, y2: m.t + ph, stroke: "#c23b32", "stroke-width": 1.5,
        "stroke-dasharray": "5 4", class: "slo-line" }),
        s("text", { x: X(v.x) + (X(v.x) > m.l + 0.75 * pw ? -4 : 4), y: m.t + ph - 8, "font-size": 11, style: "fill:#c23b32",
          "text-anchor": X(v.x) > m.l + 0.75 * pw ? "end" : "start" }, v.label)]);
    });
    (opts.hlines || []).forEach(function (v) {
      add(svg, [s("line", { x1: m.l, x2: m.l + pw, y1: Y(v.y), y2: Y(v.y), stroke: v.color || "#c23b32", "stroke-width": 1.5,
        "stroke-dasharray": "5 4", class: "slo-line" }),
        v.label ? s("text", { x: m.l + pw - 4, y: Y(v.y) - 4, "font-size": 11, style: "fill:" + (v.color || "#c23b32"), "text-anchor": "end" }, v.label) : null]);
    });
    series.forEach(function (sr) {
      var d = "", prev = null;
      sr.points.forEach(function (p, k) {
        if (opts.step) {
          d += k === 0 ? "M" + X(p[0]) + "," + Y(0) + "V" + Y(p[1]) : "H" + X(p[0]) + "V" + Y(p[1]);
        } else d += (k === 0 ? "M" : "L") + X(p[0]) + "," + Y(p[1]);
        prev = p;
      });
      if (opts.step && prev) d += "H" + (m.l + pw);
      add(svg, s("path", { d: d, fill: "none", stroke: sr.color, "stroke-width": 2 }));
      if (!opts.step && !opts.nodots) sr.points.forEach(function (p) {
        add(svg, s("circle", { cx: X(p[0]), cy: Y(p[1]), r: 3, fill: sr.color }));
      });
    });
    return svg;
  }

  function legend(entries) {
    return h("div", { class: "legend" }, entries.map(function (e) {
      return h("span", null, h("i", { class: "swatch", style: "background:" + e.color }), e.label);
    }));
  }

  function kpi(label, value, hint, id, dataValue) {
    return h("div", { class: "kpi" }, h("div", { class: "label" }, label),
      h("div", { class: "value", id: id, "data-value": dataValue }, value), hint ? h("div", { class: "hint" }, hint) : null);
  }

  // headers: the first `nLeft` columns (and those at the indices in `left`) are left-aligned text, the rest
  // right-aligned numbers.
  function table(headers, rows, id, nLeft, left) {
    return h("div", { class: "tablewrap" }, h("table", { id: id },
      h("thead", null, h("tr", null, headers.map(function (x, k) {
        return h("th", { class: k < (nLeft || 1) || (left || []).indexOf(k) >= 0 ? "l" : null }, x);
      }))),
      h("tbody", null, rows)));
  }

  function header(vm, cfg, status) {
    var sm = vm.summary, sv = sm.solve || {};
    var bits = ["scenario " + sm.scenario, "method " + sm.method, "mode " + sm.mode];
    if (sm.demand_scale !== 1) bits.push("demand ×" + fixed(sm.demand_scale, 2));
    if (sm.solve_words) bits.push(sm.solve_words);
    else if (sv.status) bits.push("solver " + sv.status + (sv.time_s ? " in " + fixed(sv.time_s, 2) + " s" : ""));
    if (sm.created_at) bits.push(sm.created_at);
    return h("header", null, h("h1", { id: "title", "data-engine": sm.engine }, vm.title),
      h("div", { class: "sub" }, cfg.poll_url ? [h("i", { class: "live-dot" + (status.ok ? "" : " off") }),
        (status.ok ? "live · updated " : "disconnected · last update ") + status.at + " · "] : null, bits.join(" · ")),
      (sv.notes || []).length ? h("details", { class: "solver-note" }, h("summary", null, "solver details"),
        sv.notes.map(function (n) { return h("div", null, n); })) : null);
  }

  function kpis(vm) {
    var sm = vm.summary, cmp = vm.comparison, cards = [
      kpi("Total cost", money(sm.cost_per_hour), sm.penalty_per_hour > 0 ? "+ " + money(sm.penalty_per_hour) + " scale-up penalty" : "provisioning", "total-cost", sm.cost_per_hour),
      kpi("Instances", String(sm.n_instances), sm.n_heterogeneous + " heterogeneous", "n-instances", sm.n_instances),
      kpi("Nodes / GPUs", sm.n_nodes + " / " + sm.n_gpus, null, "n-nodes", sm.n_nodes),
      kpi("Demand served", pct(sm.min_served_fraction), "worst model/phase", "served", sm.min_served_fraction),
    ];
    if (cmp) cmp.rows.slice(1).forEach(function (r) {
      var better = r.ratio >= 1;
      cards.push(kpi("vs " + r.method, fixed(better ? r.ratio : 1 / r.ratio, 2) + "× " + (better ? "cheaper" : "dearer"),
        [money(r.cost_per_hour) + " · ", attainmentText(r), " · serves " + pct(r.min_served_fraction)],
        "ratio-" + r.method, r.ratio));
    });
    if (vm.live) cards.push(kpi("In flight", qty(vm.live.total_inflight), [h("span", { id: "total-requests",
      "data-value": vm.live.total_requests }, qty(vm.live.total_requests)), " client requests so far"], "inflight", vm.live.total_inflight));
    return h("section", { class: "kpis" }, cards);
  }

  // "87.3% within SLOs" with a pass/fail badge, or why it is not known.
  function attainmentText(r) {
    if (r.attainment === null || r.attainment === undefined) return h("span", { class: "attainment" }, "SLO attainment not measured");
    return h("span", { class: "attainment", "data-value": r.attainment, title: r.attainment_source },
      pct(r.attainment) + " within SLOs ", passBadge(r.attainment_pass));
  }

  function passBadge(ok) {
    return ok === null || ok === undefined ? "" : h("span", { class: "badge " + (ok ? "pass" : "fail") }, ok ? "pass" : "fail");
  }

  // The headline: the plan's own verdict per model on held-out requests beside its cost (what `coral run` prints).
  function verdictSection(vm) {
    var v = vm.verdict;
    if (!v) return null;
    var failed = v.models.filter(function (r) { return !r.pass; }).length;
    var rows = v.models.map(function (r) {
      return h("tr", { "data-model": r.model, "data-pass": r.pass ? "pass" : "fail" }, h("td", null, r.model),
        h("td", { class: "target", "data-value": r.target }, pct(r.target)),
        h("td", { class: "att", "data-value": r.certified }, r.certified === null ? "" : pct(r.certified)),
        h("td", { class: "att", "data-value": r.held_out }, pct(r.held_out)),
        h("td", { class: "att", "data-value": r.p5 }, r.p5 === null ? "" : pct(r.p5)),
        h("td", { class: "att", "data-value": r.worst }, pct(r.worst)),
        h("td", { class: "l" }, passBadge(r.pass), r.pass ? "" : " " + r.verdict.replace(/^fail:?\s*/, "")));
    });
    return h("section", { id: "verdict" },
      h("h2", null, "Verdict: this plan, ", h("span", { id: "verdict-cost", "data-value": v.cost_per_hour }, money(v.cost_per_hour)),
        ", on held-out requests ", passBadge(v.passed)),
      h("div", { class: "sub", style: "margin-bottom:6px" }, (v.passed ? "every model meets its target" :
        failed + " of " + v.models.length + " models miss their target") + " on " + v.n_sets + " held-out windows of " +
        qty(v.duration_s / 60) + " min each (traffic no step of the search saw). Certified: the " +
        (v.confidence ? pct(v.confidence) + " " : "") + "one-sided lower bound of the pooled attainment over the windows; " +
        "a model passes when it is at or above the target and its 5th-percentile window is at most " + pct(v.tail) + " under it"),
      table(["Model", "Target", "Certified", "Pooled", "p5 window", "Worst window", "Verdict"], rows, "verdict-table", 1, [6]),
      v.notes.length ? h("div", { class: "sub" }, v.notes.join("; ")) : null);
  }

  // Overall and per-model SLO attainment of one simulated run, each SLO marked pass/fail against the target share.
  function sloSection(vm, live) {
    var slo = vm.slo;
    if (!slo) return null;
    var mixed = slo.models.some(function (r) { return r.target !== slo.target; });
    // beside a certified verdict, a simulated run is one window of its own policy: shown, not graded
    var graded = slo.graded !== false;
    var badge = function (ok) { return graded ? passBadge(ok) : ""; };
    var rows = slo.models.map(function (r) {
      return h("tr", { "data-model": r.model }, h("td", null, r.model),
        mixed ? h("td", { class: "target", "data-value": r.target }, pct(r.target)) : null,
        h("td", null, ms(r.slo_ttft_ms)), h("td", { class: "att" }, pct(r.ttft_attainment), " ", badge(r.ttft_pass)),
        h("td", null, ms(r.slo_tpot_ms)), h("td", { class: "att" }, pct(r.tpot_attainment), " ", badge(r.tpot_pass)),
        h("td", { class: "att" }, pct(r.attainment), " ", graded ? passBadge(r.pass) : ""));
    });
    var head = slo.overall === null ? null : h("div", { class: "slo-overall", id: "slo-overall", "data-value": slo.overall },
      "Overall: ", h("b", null, pct(slo.overall)), " of requests met both SLOs ", badge(slo.overall_pass));
    var title = live ? "SLO attainment (measured)" : slo.run ? "SLO attainment of " + slo.run : "SLO attainment (simulated)";
    return h("section", { id: "slo" }, h("h2", null, title), head,
      graded ? null : h("div", { class: "sub", id: "slo-ungraded" }, "one simulated window of this run, another " +
        "policy than the plan held fixed, at its own cost: what it shows, not a verdict (the plan's verdict is the " +
        "certified one above)"),
      h("div", { class: "sub", style: "margin-bottom:6px" }, graded ? "pass: at least " : "target: ",
        h("b", { id: "slo-target", "data-value": slo.target }, pct(slo.target)),
        mixed ? " (the strictest; each model's target in the table)" : "",
        " of a model's requests within the SLO, the plan's attainment target (TTFT: time to first token; TPOT: mean " +
        "time per output token)"),
      table(["Model"].concat(mixed ? ["Target"] : [], ["TTFT SLO", "Within TTFT SLO", "TPOT SLO", "Within TPOT SLO", "Both SLOs"]),
        rows, "slo-table"));
  }

  function methodsSection(vm) {
    if (!vm.methods || !vm.methods.length) return null;
    var models = [];
    vm.methods.forEach(function (r) { Object.keys(r.by_model).forEach(function (m) { if (models.indexOf(m) < 0) models.push(m); }); });
    models.sort();
    var rows = vm.methods.map(function (r) {
      return h("tr", { "data-method": r.method, "data-how": r.how }, h("td", null, r.method), h("td", { class: "l" }, r.how),
        models.map(function (m) { return h("td", null, pct(r.by_model[m])); }),
        h("td", { "data-value": r.slo_attainment }, h("b", null, pct(r.slo_attainment))),
        h("td", null, qty(r.goodput_tokens_s)), h("td", null, money(r.cost_per_hour)));
    });
    return h("div", { style: "margin-top:14px" }, h("h3", null, "Every method simulated on the same requests"),
      table(["Method", "Run"].concat(models, ["All (both SLOs)", "Goodput tok/s", "Mean cost"]), rows, "methods", 2));
  }

  function demandSection(vm) {
    if (!vm.demand || !vm.demand.length) return null;
    var rows = vm.demand.map(function (r) {
      return h("tr", { "data-model": r.model }, h("td", null, r.model), h("td", null, qty(r.request_rate) + " req/s"),
        h("td", null, qty(r.mean_input_tokens)), h("td", null, qty(r.mean_output_tokens)),
        h("td", null, ms(r.slo_ttft_ms)), h("td", null, ms(r.slo_tpot_ms)), h("td", { class: "l" }, r.trace));
    });
    return h("div", null, h("h3", null, "Demand assumptions (from the scenario)"),
      table(["Model", "Rate", "Mean prompt tokens", "Mean output tokens", "TTFT SLO", "TPOT SLO", "Trace"], rows, "demand"));
  }

  // What to rent: one row per cloud instance type and region, with the plan instances that use it.
  function bomSection(vm) {
    var b = vm.bom;
    if (!b) return null;
    var rows = b.rows.map(function (r) {
      return h("tr", { "data-instance-type": r.instance_type, "data-region": r.region }, h("td", null, r.cloud),
        h("td", { class: "l" }, r.region), h("td", { class: "l" }, r.instance_type), h("td", { class: "l" }, r.gpu + " × " + r.gpus_per_node),
        h("td", { class: "count" }, String(r.count)), h("td", { class: "each", "data-value": r.price_per_hour }, "$" + fixed(r.price_per_hour, 4)),
        h("td", { class: "total", "data-value": r.total_per_hour }, money(r.total_per_hour)),
        h("td", { class: "l", title: r.instances.join("\n") }, r.used_by));
    });
    rows.push(h("tr", { class: "total-row" }, h("td", null, h("b", null, "Total")), h("td", null), h("td", null), h("td", null),
      h("td", { id: "bom-count", "data-value": b.count }, h("b", null, String(b.count))), h("td", null),
      h("td", { id: "bom-total", "data-value": b.total_per_hour }, h("b", null, money(b.total_per_hour))), h("td", null)));
    var check = b.matches_plan ? h("div", { class: "sub", id: "bom-check" }, "The total equals the plan's cost, " +
      money(b.plan_cost_per_hour) + " (prices: " + b.offerings + ").") :
      h("div", { class: "short", id: "bom-check" }, b.notes.map(function (n) { return h("div", null, n); }));
    return h("section", { id: "bom" }, h("h2", null, "What to rent"),
      table(["Cloud", "Region", "Instance type", "GPU × per node", "Count", "$/h each", "$/h total", "Used by"], rows, "bom-table", 4, [7]),
      check);
  }

  function servingSection(vm) {
    var rows = vm.serving.map(function (r) {
      return h("tr", { "data-model": r.model, "data-phase": r.phase },
        h("td", null, r.model), h("td", { class: "l" }, r.phase), h("td", null, qty(r.demand)), h("td", null, qty(r.capacity)),
        h("td", { class: r.served_fraction < 0.999 ? "short" : null }, pct(r.served_fraction)),
        h("td", null, String(r.n_instances)), h("td", { class: "cost", "data-value": r.cost_per_hour }, money(r.cost_per_hour)));
    });
    return h("div", null, h("h3", null, "Demand and capacity (tokens/s)"),
      table(["Model", "Phase", "Demand", "Capacity", "Served", "Instances", "Cost"], rows, "serving", 2));
  }

  function costSection(vm) {
    var c = vm.costs, colors = vm.gpu_colors;
    function card(title, items, key) {
      return h("div", { class: "card", id: "cost-" + key }, h("h3", null, title),
        items.length ? barChart(items.map(function (i) {
          return { label: i.label, value: i.value, color: key === "gpu" ? colors[i.label] : null };
        }), money, { width: 286 }) : h("div", { class: "empty" }, "no instances"));
    }
    return h("div", { class: "grid4" }, card("Cost per model", c.by_model, "model"), card("Cost per phase", c.by_phase, "phase"),
      card("Cost per region", c.by_region, "region"), card("Cost per GPU type", c.by_gpu, "gpu"));
  }

  function comparisonSection(vm) {
    var cmp = vm.comparison;
    if (!cmp) return null;
    var bars = barChart(cmp.rows.map(function (r, k) {
      return { label: r.method, value: r.cost_per_hour, color: k === 0 ? "#2f6fdf" : "#8a94a6" };
    }), money, { width: 420 });
    var rows = cmp.rows.map(function (r) {
      return h("tr", { "data-method": r.method }, h("td", null, r.method),
        cmp.models.map(function (m) { return h("td", null, money(r.by_model[m])); }),
        h("td", { class: r.min_served_fraction < 0.999 ? "short" : null }, pct(r.min_served_fraction)),
        h("td", { class: r.attainment_pass === false ? "short" : null, "data-value": r.attainment, title: r.attainment_source },
          pct(r.attainment)),
        h("td", { "data-value": r.cost_per_hour }, money(r.cost_per_hour)),
        h("td", null, r.ratio === null ? "–" : fixed(r.ratio, 2) + "×"));
    });
    var saving = (vm.savings || []).map(function (sv) {
      var srows = sv.rows.map(function (r) {
        return h("tr", { "data-model": r.model, "data-phase": r.phase }, h("td", null, r.model), h("td", { class: "l" }, r.phase),
          h("td", null, money(r.plan)), h("td", null, money(r.baseline)),
          h("td", { class: r.saving < 0 ? "short" : null, "data-value": r.saving }, (r.saving < 0 ? "−" : "") + money(Math.abs(r.saving))));
      });
      return h("div", { class: "card saving", "data-method": sv.method }, h("h3", null, "Where the saving comes from: vs " + sv.method),
        h("div", { class: "sub", style: "margin-bottom:6px" }, sv.text),
        table(["Model", "Phase", cmp.rows[0].method, sv.method, "Saving"], srows, "saving-" + sv.method, 2));
    });
    return h("section", null, h("h2", null, "Comparison with baselines"),
      h("div", { class: "cmp" }, h("div", { class: "card" }, h("h3", null, "Total cost per method"), bars),
        table(["Method"].concat(cmp.models, ["Served", "Within SLOs", "Total", "vs " + cmp.rows[0].method]), rows, "comparison")),
      methodsSection(vm), saving.length ? h("div", { class: "grid2", style: "margin-top:14px" }, saving) : null);
  }

  // One instance (group): stage columns left to right, a box per node coloured by GPU type.
  function instanceDiagram(g, colors) {
    var colW = 132, boxH = 38, gap = 8, top = 40, arrow = 26;
    var maxNodes = Math.max.apply(null, g.stages.map(function (st) { return st.nodes.length; }));
    var W = g.stages.length * colW + (g.stages.length - 1) * arrow + 4, H = top + maxNodes * (boxH + gap) + 2;
    var svg = s("svg", { width: W, height: H, viewBox: "0 0 " + W + " " + H, class: "diagram", role: "img" });
    g.stages.forEach(function (st, k) {
      var x = 2 + k * (colW + arrow);
      add(svg, [s("text", { x: x + colW / 2, y: 14, "text-anchor": "middle", "font-size": 12, "font-weight": 700 }, "Stage " + (k + 1)),
        s("text", { x: x + colW / 2, y: 29, "text-anchor": "middle", "font-size": 11, class: "layers" },
          "layers " + st.first_layer + "–" + st.last_layer + " (" + st.layers + ")")]);
      st.nodes.forEach(function (n, j) {
        var y = top + j * (boxH + gap);
        add(svg, [s("rect", { x: x, y: y, width: colW, height: boxH, rx: 5, fill: colors[n.gpu] || "#888", class: "node",
          "data-config": n.config }),
          s("text", { x: x + colW / 2, y: y + 16, "text-anchor": "middle", "font-size": 12, "font-weight": 700, fill: "#fff", style: "fill:#fff" }, n.config),
          s("text", { x: x + colW / 2, y: y + 31, "text-anchor": "middle", "font-size": 11, style: "fill:#fff" },
            n.throughput === null ? "" : qty(n.throughput) + " tok/s")]);
      });
      if (k > 0) {
        var ax = x - arrow + 4, ay = top + boxH / 2;
        add(svg, s("path", { d: "M" + ax + "," + ay + "H" + (x - 5) + "m-5,-4l5,4l-5,4", fill: "none", stroke: "#9aa3b2", "stroke-width": 1.5 }));
      }
    });
    return svg;
  }

  function instanceCard(g, colors, states) {
    var key = g.ids[0], counts = {};
    g.ids.forEach(function (id) { var st = states[id]; if (st) counts[st] = (counts[st] || 0) + 1; });
    var det = h("details", { "data-key": key }, h("summary", null, g.count === 1 ? "instance id" : g.count + " instance ids"),
      g.ids.map(function (id) { return h("code", null, id + (states[id] ? "  [" + states[id] + "]" : "")); }));
    if (openDetails[key]) det.open = true;
    det.addEventListener("toggle", function () { openDetails[key] = det.open; });
    return h("div", { class: "card instance", "data-model": g.model, "data-phase": g.phase, "data-count": g.count },
      h("div", { class: "inst-head" }, h("span", { class: "count" }, g.model + " · " + g.phase + " ×" + g.count),
        g.heterogeneous ? h("span", { class: "badge het" }, "heterogeneous") : null,
        g.engines ? h("span", { class: "badge engine" }, "Coral engine") : null,
        g.engines ? h("span", { class: "badge " + (g.engines.vllm ? "engine" : "no-engine"),
          title: g.engines.vllm ? "stock vLLM can launch this layout" : "stock vLLM cannot: " + g.engines.vllm_reason },
          g.engines.vllm ? "vLLM" : "not stock vLLM") : null,
        Object.keys(counts).sort().map(function (st) { return h("span", { class: "badge " + st }, counts[st] + " " + st); })),
      h("div", { class: "sub", style: "margin:2px 0 6px" }, "template " + g.template_id + " · " + g.region + " · " +
        money(g.cost_per_hour) + " · " + qty(g.throughput) + " tok/s each"),
      instanceDiagram(g, colors), det);
  }

  function instancesSection(vm) {
    var states = {}, colors = vm.gpu_colors;
    if (vm.live) vm.live.instances.forEach(function (r) { states[r.id] = r.state; });
    return h("section", { id: "instances" }, h("h2", null, "Serving instances"),
      legend(Object.keys(colors).map(function (g) { return { label: g, color: colors[g] }; })),
      vm.instance_groups.length ? h("div", { class: "instances" }, vm.instance_groups.map(function (g) {
        return instanceCard(g, colors, states);
      })) : h("div", { class: "empty" }, "the plan has no instances"));
  }

  // The gateway's latency summary columns, in this order, with their headers; other numeric keys follow.
  var LATENCY_COLUMNS = [["requests", "Requests"], ["errors", "Errors"], ["count", "Window"], ["p50_ms", "e2e p50"],
    ["p99_ms", "e2e p99"], ["ttft_p50_ms", "TTFT p50"], ["ttft_p99_ms", "TTFT p99"], ["tpot_p50_ms", "TPOT p50"],
    ["tpot_p99_ms", "TPOT p99"]];
  var LATENCY_LABELS = {};
  LATENCY_COLUMNS.forEach(function (c) { LATENCY_LABELS[c[0]] = c[1]; });

  function liveSection(vm) {
    var lv = vm.live;
    if (!lv) return null;
    var rows = lv.instances.map(function (r) {
      return h("tr", { "data-id": r.id }, h("td", null, r.id), h("td", { class: "l" }, h("span", { class: "badge " + r.state }, r.state)),
        h("td", { class: "inflight" }, qty(r.inflight)), h("td", { class: "requests" }, qty(r.requests)), h("td", null, fixed(r.weight, 2)));
    });
    var split = lv.traffic.map(function (t) {
      return h("div", { class: "card" }, h("h3", null, t.model + " · " + t.phase + " traffic split"),
        barChart(t.shares.map(function (x) { return { label: x.id.split(".").slice(-2).join("."), value: x.share }; }), pct,
          { width: 300 }));
    });
    var lat = lv.latency_summary || [], cols = LATENCY_COLUMNS.filter(function (c) {
      return lat.some(function (r) { return r[c[0]] !== undefined; });
    }).map(function (c) { return c[0]; });
    lat.forEach(function (r) { Object.keys(r).forEach(function (k) { if (k !== "model" && cols.indexOf(k) < 0) cols.push(k); }); });
    var latTable = lat.length ? h("div", { style: "margin-top:14px" }, h("h3", null, "Recent latency"),
      h("div", { class: "sub", style: "margin-bottom:6px" }, "requests: client requests, each counted once; " +
        "percentiles over the last answers (window): end-to-end, time to first token (streamed answers and " +
        "prefill-decode requests) and time per output token (streamed answers)"),
      table(["Model"].concat(cols.map(function (k) { return LATENCY_LABELS[k] || k.replace(/_/g, " "); })), lat.map(function (r) {
        return h("tr", { "data-model": r.model }, h("td", null, r.model), cols.map(function (k) {
          return h("td", { "data-key": k, "data-value": r[k] }, r[k] === undefined ? "–" : (/_ms$/.test(k) ? ms(r[k]) : qty(r[k])));
        }));
      }), "live-latency")) : null;
    return h("section", { id: "live" }, h("h2", null, "Runtime"),
      h("div", { class: "legend", id: "states" }, Object.keys(lv.states).map(function (st) {
        return h("span", null, h("span", { class: "badge " + st }, st), String(lv.states[st]));
      })),
      h("div", { class: "grid2" }, table(["Instance", "State", "In flight", "Requests", "Weight"], rows, "live-instances", 2),
        h("div", { class: "grid2" }, split.length ? split : h("div", { class: "empty" }, "no instances reported"))), latTable);
  }

  var SERIES_COLORS = ["#2f6fdf", "#8a94a6", "#e69f00", "#009e73", "#cc79a7"];

  function epochsSection(vm) {
    if (!vm.epochs.length) return null;
    var colored = vm.epochs.map(function (sr, k) { return { name: sr.method, color: SERIES_COLORS[k % SERIES_COLORS.length], raw: sr.points }; });
    var xt = [];
    colored.forEach(function (sr) { sr.raw.forEach(function (p) { if (xt.indexOf(p.epoch) < 0) xt.push(p.epoch); }); });
    xt.sort(function (a, b) { return a - b; });
    function chart(field, title, fmt) {
      var series = colored.map(function (sr) {
        return { name: sr.name, color: sr.color, points: sr.raw.map(function (p) { return [p.epoch, p[field]]; }) };
      });
      return h("div", { class: "card", id: "epochs-" + field }, h("h3", null, title),
        lineChart(series, { xlabel: "epoch", xticks: xt.length <= 12 ? xt : null, xfmt: function (v) { return fixed(v, 0); },
          yfmt: fmt, ymin: 0, width: 410 }));
    }
    return h("section", { id: "epochs" }, h("h2", null, "Per epoch"),
      legend(colored.map(function (sr) { return { label: sr.name, color: sr.color }; })),
      h("div", { class: "grid3" }, chart("cost_per_hour", "Cost ($/h)", function (v) { return "$" + fixed(v, 0); }),
        chart("goodput", "Goodput (SLO-meeting tokens/s)", null), chart("churn", "Churn (instances changed)", null)));
  }

  function latencySection(vm) {
    if (!vm.latency.length) return null;
    var cards = vm.latency.map(function (c) {
      var name = c.metric === "ttft" ? "TTFT" : "TPOT";
      // long tails squash the body of the curve: show up to past p99 (and the SLO); the step runs on to the edge
      var xmax = Math.max(1.15 * c.p99, 1.25 * (c.slo_ms || 0)), pts = c.points;
      var clipped = pts.length && pts[pts.length - 1][0] > xmax;
      if (clipped) {
        pts = pts.filter(function (p) { return p[0] <= xmax; });
        pts.push([xmax, pts.length ? pts[pts.length - 1][1] : 0]);
      }
      var stats = "p50 " + ms(c.p50) + " · p90 " + ms(c.p90) + " · p99 " + ms(c.p99) + " · n=" + c.n;
      return h("div", { class: "card latency", "data-model": c.model, "data-metric": c.metric },
        h("h3", null, c.model + " · " + name), h("div", { class: "sub" }, stats),
        c.slo_ms !== null ? h("div", { class: (c.attainment < c.target ? "short" : "sub") + " within", "data-value": c.attainment,
          "data-target": c.target }, pct(c.attainment) + " within the " + ms(c.slo_ms) + " SLO (target " + pct(c.target) + ")") : null,
        lineChart([{ name: name, color: "#2f6fdf", points: pts }], {
          step: true, xmin: 0, ymin: 0, ymax: 1, yfmt: function (v) { return fixed(100 * v, 0) + "%"; },
          xlabel: name + " (ms)" + (clipped ? ", tail past " + ms(xmax) + " not shown" : ""),
          vlines: c.slo_ms !== null ? [{ x: c.slo_ms, label: "SLO " + ms(c.slo_ms) }] : [], width: 410,
        }));
    });
    return h("section", { id: "latency" }, h("h2", null, "Latency CDFs against SLOs"), h("div", { class: "grid3" }, cards));
  }

  // Time series per model: arrival rate, p99 TTFT and TPOT (SLO lines dashed) and queue depth.
  function timeseriesSection(vm, title) {
    var ts = vm.timeseries;
    if (!ts) return null;
    var models = Object.keys(ts.rate).sort(), slos = {};
    (vm.demand || []).forEach(function (d) { slos[d.model] = d; });
    (vm.slo ? vm.slo.models : []).forEach(function (r) { slos[r.model] = slos[r.model] || r; });
    function color(k) { return SERIES_COLORS[k % SERIES_COLORS.length]; }
    // latency charts: dashed line per model at its SLO, in the model's colour; the y axis stops at 3x the
    // largest SLO so that the SLO lines stay readable (higher points are drawn at the top edge)
    function chart(key, name, yfmt, sloKey) {
      var series = models.map(function (m, k) { return { name: m, color: color(k), points: ts[key][m] || [] }; });
      var hl = [], top, highest = 0, caption = null;
      series.forEach(function (sr) { sr.points.forEach(function (p) { highest = Math.max(highest, p[1]); }); });
      if (sloKey) models.forEach(function (m, k) {
        var v = slos[m] && slos[m][sloKey];
        if (v) hl.push({ y: v, color: color(k), label: models.length > 1 ? null : "SLO " + ms(v), name: m });
      });
      if (hl.length) {
        var maxSlo = Math.max.apply(null, hl.map(function (v) { return v.y; }));
        if (highest > 3 * maxSlo) top = 3 * maxSlo;
        caption = "dashed: SLO of " + hl.map(function (v) { return v.name + " " + ms(v.y); }).join(", ") +
          (top ? "; axis cut at " + ms(top) + " (peak " + ms(highest) + ")" : "");
      }
      return h("div", { class: "card", id: "ts-" + key }, h("h3", null, name),
        caption ? h("div", { class: "sub" }, caption) : null,
        lineChart(series, { xlabel: "time (s)", ymin: 0, ymax: top, yfmt: yfmt, hlines: hl, nodots: true, width: 620, height: 220 }));
    }
    return h("section", { id: "timeseries" }, h("h2", null, title || "Over time"),
      legend(models.map(function (m, k) { return { label: m, color: color(k) }; })),
      h("div", { class: "sub", style: "margin-bottom:6px" }, ts.queue_label ? "sampled on the server about every " + qty(ts.bin_s) +
        " s; the last " + qty(ts.keep_s / 60) + " min kept" :
        "bins of " + qty(ts.bin_s) + " s; latency of the requests arriving in each bin"),
      h("div", { class: "grid2" }, chart("rate", "Request rate (req/s)", null), chart("queue", ts.queue_label || "Queue depth (arrived, not yet decoding)", null),
        chart("ttft_p99_ms", "p99 TTFT (ms)", null, "slo_ttft_ms"), chart("tpot_p99_ms", "p99 TPOT (ms)", null, "slo_tpot_ms")));
  }

  function render(vm, cfg, status) {
    var app = document.getElementById("app");
    var notes = vm.notes && vm.notes.length ? h("div", { class: "notes" }, vm.notes.map(function (n) { return h("div", null, n); })) : null;
    var live = !!cfg.poll_url;  // the dashboard leads with the runtime; the report with what to rent
    var view = h("div", null, header(vm, cfg, status), notes, verdictSection(vm), live ? null : bomSection(vm), sloSection(vm, live), kpis(vm),
      liveSection(vm),
      h("section", null, h("h2", null, "Plan"), demandSection(vm), h("div", { style: "height:14px" }), servingSection(vm),
        h("div", { style: "height:14px" }), costSection(vm)),
      live ? bomSection(vm) : null, comparisonSection(vm), instancesSection(vm), timeseriesSection(vm, cfg.poll_url ? "Live over time" : null),
      epochsSection(vm), latencySection(vm));
    app.replaceChildren(view);
    document.title = vm.title;
    app.setAttribute("data-rendered", String(Number(app.getAttribute("data-rendered") || 0) + 1));
  }

  function now() { return new Date().toLocaleTimeString("en-GB"); }

  var vm = JSON.parse(document.getElementById("coral-data").textContent);
  var cfg = JSON.parse(document.getElementById("coral-config").textContent || "{}");
  render(vm, cfg, { ok: true, at: now() });
  if (cfg.poll_url) {
    setInterval(function () {
      fetch(cfg.poll_url, { cache: "no-store" })
        .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
        .then(function (next) { vm = next; render(vm, cfg, { ok: true, at: now() }); })
        .catch(function () { render(vm, cfg, { ok: false, at: now() }); });
    }, cfg.interval_ms || 3000);
  }
})();

// The console's live view: every second, the volumes' counters from /api/v1/stats; rates are the differences
// between two samples. The charts are uPlot's (vendor/); this only feeds them and the live table.
"use strict";
var openvsan = (function () {
  var WINDOW = 120;   // seconds kept on the charts

  function compact(v) {
    if (v == null) { return ""; }
    var a = Math.abs(v);
    return a >= 1e6 ? (v / 1e6).toFixed(1) + "M" : a >= 1e3 ? (v / 1e3).toFixed(a >= 1e4 ? 0 : 1) + "K"
      : v.toFixed(a < 10 && v !== 0 ? 2 : 0);
  }

  function chart(id, labels, unit) {
    var el = document.getElementById(id);
    var series = [{}].concat(labels.map(function (l, i) {
      return {label: l, stroke: ["#2f6fdf", "#df7d2f", "#3aa655"][i], width: 2,
              value: function (u, v) { return v == null ? "-" : v.toFixed(v < 10 ? 1 : 0) + " " + unit; }};
    }));
    var data = [[]].concat(labels.map(function () { return []; }));
    var plot = new uPlot({width: Math.max(el.clientWidth, 300), height: 180, series: series,
                          axes: [{space: 90}, {size: 56, values: function (u, vals) { return vals.map(compact); }}],
                          scales: {x: {time: true}}}, data, el);
    return {
      push: function (t, values) {
        data[0].push(t);
        values.forEach(function (v, i) { data[i + 1].push(v); });
        if (data[0].length > WINDOW) { data.forEach(function (s) { s.shift(); }); }
        plot.setData(data);
      }
    };
  }

  function fmt(v, digits) { return v == null ? "-" : v.toFixed(digits); }

  function live(ids) {
    var iops = chart(ids.iops, ["read", "write"], "IOPS");
    var mbps = chart(ids.mbps, ["read", "write"], "MB/s");
    var lat = chart(ids.lat, ["read", "write"], "µs");
    var table = document.getElementById(ids.table);
    var last = null;
    function tick() {
      fetch("/api/v1/stats", {credentials: "same-origin"}).then(function (r) {
        if (r.status === 401) { window.location = "/login"; return null; }
        return r.json();
      }).then(function (now) {
        if (!now) { return; }
        if (last) {
          var dt = now.t - last.t, before = {}, sum = {ro: 0, wo: 0, rb: 0, wb: 0, rs: 0, ws: 0};
          last.volumes.forEach(function (v) { before[v.name] = v; });
          now.volumes.forEach(function (v) {
            var b = before[v.name];
            if (!b || dt <= 0) { return; }
            var d = {ro: v.read_ops - b.read_ops, wo: v.write_ops - b.write_ops,
                     rb: v.read_bytes - b.read_bytes, wb: v.write_bytes - b.write_bytes,
                     rs: v.read_seconds - b.read_seconds, ws: v.write_seconds - b.write_seconds};
            Object.keys(sum).forEach(function (k) { sum[k] += Math.max(0, d[k]); });
            var row = table && table.querySelector('tr[data-volume="' + v.name + '"]');
            if (row) {
              row.querySelector(".r-iops").textContent = fmt(d.ro / dt, 0);
              row.querySelector(".w-iops").textContent = fmt(d.wo / dt, 0);
              row.querySelector(".r-mbps").textContent = fmt(d.rb / dt / 1e6, 1);
              row.querySelector(".w-mbps").textContent = fmt(d.wb / dt / 1e6, 1);
              row.querySelector(".r-lat").textContent = d.ro > 0 ? fmt(1e6 * d.rs / d.ro, 1) : "-";
              row.querySelector(".w-lat").textContent = d.wo > 0 ? fmt(1e6 * d.ws / d.wo, 1) : "-";
            }
          });
          iops.push(now.t, [sum.ro / dt, sum.wo / dt]);
          mbps.push(now.t, [sum.rb / dt / 1e6, sum.wb / dt / 1e6]);
          lat.push(now.t, [sum.ro > 0 ? 1e6 * sum.rs / sum.ro : null, sum.wo > 0 ? 1e6 * sum.ws / sum.wo : null]);
        }
        last = now;
      }).catch(function () { /* the node is restarting: the next tick tries again */ });
    }
    tick();
    setInterval(tick, 1000);
  }

  return {live: live};
})();

// A small time-series line chart on a <canvas>: a sliding time window, one line per series,
// a y axis from zero to a rounded maximum (1.2x the largest value seen in the window, at
// least `minMax`, at most `capMax`: a KV cache at 3% fills the chart, not a 0-100 axis),
// gaps where a value is missing (null).

const COLORS = ["#2563eb", "#ea580c", "#16a34a", "#9333ea"];

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 4, 6, 8, 10]) if (v <= m * p) return m * p; // quarters stay round
  return 10 * p;
}

function fmt(v) {
  if (v >= 1000) return `${(v / 1000).toFixed(v >= 10000 ? 0 : 1)}k`;
  if (Number.isInteger(v)) return String(v);
  return v < 10 ? String(Number(v.toFixed(2))) : v.toFixed(0); // 0.25 stays 0.25, not 0.3
}

export class TimeChart {
  // series: [{name, color?}], opts: {windowS, unit, minMax, capMax}
  constructor(canvas, series, opts = {}) {
    this.canvas = canvas;
    this.series = series.map((s, i) => ({ color: COLORS[i % COLORS.length], ...s }));
    this.windowS = opts.windowS || 60;
    this.unit = opts.unit || "";
    this.minMax = opts.minMax || 0;
    this.capMax = opts.capMax || Infinity;
    this.points = []; // {t (seconds), values: [..]}
    this.ymax = 1; // the y axis' top as last drawn (tests read it)
    this.draws = 0;
  }

  // The y axis' top for the values in the window.
  axisMax() {
    let max = 0;
    for (const p of this.points) for (const v of p.values) if (v > max) max = v;
    return Math.min(this.capMax, Math.max(this.minMax, niceMax(max * 1.2)));
  }

  push(t, values) {
    this.points.push({ t, values });
    while (this.points.length && this.points[0].t < t - this.windowS) this.points.shift();
  }

  latest(i) {
    for (let k = this.points.length - 1; k >= 0; k--) {
      const v = this.points[k].values[i];
      if (v !== null && v !== undefined) return v;
    }
    return null;
  }

  draw(now) {
    const c = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth;
    const h = c.clientHeight;
    if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
      c.width = Math.round(w * dpr);
      c.height = Math.round(h * dpr);
    }
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    const left = 44;
    const right = 8;
    const top = 22;
    const bottom = 18;
    const pw = w - left - right;
    const ph = h - top - bottom;

    const ymax = this.axisMax();
    this.ymax = ymax;
    const x = (t) => left + pw * (1 - (now - t) / this.windowS);
    const y = (v) => top + ph * (1 - v / ymax);

    // grid and axis labels
    g.font = "11px system-ui, sans-serif";
    g.fillStyle = "#6b7280";
    g.strokeStyle = "#e5e7eb";
    g.lineWidth = 1;
    g.textAlign = "right";
    g.textBaseline = "middle";
    for (let k = 0; k <= 4; k++) {
      const v = (ymax * k) / 4;
      const yy = Math.round(y(v)) + 0.5;
      g.beginPath();
      g.moveTo(left, yy);
      g.lineTo(left + pw, yy);
      g.stroke();
      g.fillText(fmt(v) + (k ? this.unit : ""), left - 4, yy);
    }
    g.textAlign = "center";
    g.textBaseline = "top";
    for (let s = 0; s <= this.windowS; s += this.windowS / 4) {
      g.textAlign = s === 0 ? "right" : s === this.windowS ? "left" : "center";
      g.fillText(s === 0 ? "now" : `-${s}s`, left + pw * (1 - s / this.windowS), top + ph + 4);
    }

    // lines
    this.series.forEach((s, i) => {
      g.strokeStyle = s.color;
      g.lineWidth = 2;
      g.setLineDash(i % 2 ? [6, 4] : []); // overlapping series stay distinguishable
      g.beginPath();
      let pen = false;
      for (const p of this.points) {
        const v = p.values[i];
        if (v === null || v === undefined || Number.isNaN(v)) {
          pen = false;
          continue;
        }
        const px = x(p.t);
        const py = y(Math.min(v, ymax));
        if (pen) g.lineTo(px, py);
        else g.moveTo(px, py);
        pen = true;
      }
      g.stroke();
    });
    g.setLineDash([]);

    // legend with latest values
    g.textAlign = "left";
    g.textBaseline = "middle";
    let lx = left;
    this.series.forEach((s, i) => {
      const v = this.latest(i);
      const label = `${s.name} ${v === null ? "–" : fmt(Math.round(v * 10) / 10) + this.unit}`;
      g.fillStyle = s.color;
      g.fillRect(lx, 7, 10, 10);
      g.fillStyle = "#111827";
      g.fillText(label, lx + 14, 12);
      lx += g.measureText(label).width + 30;
    });
    this.draws += 1;
  }
}

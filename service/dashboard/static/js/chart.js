// Step charts on uPlot (vendored, see ../vendor/uplot/VENDORED.md): one chart per metric, one line per
// run (or per metric sharing the chart, e.g. loss + valid_loss). Raw rows are kept; what is drawn is
// smoothed (optional, TensorBoard's debiased EMA) then downsampled to about two points per pixel with
// min/max buckets, so 5,000+ steps redraw in a frame and spikes stay visible.

import uPlot from '../vendor/uplot/uPlot.esm.js';
import { fmtNum, fmtTicks, h } from './util.js';

const PALETTE = ['#3b82f6', '#f97316', '#10b981', '#e11d48', '#8b5cf6', '#0891b2', '#ca8a04', '#db2777'];
export const colorAt = (i) => PALETTE[i % PALETTE.length];

const HEIGHT = 200;
const FIRST_PAINT_MARK = 'tunehouse:first-chart-paint';

/** Debiased exponential moving average; non-finite values pass through and do not poison the rest. */
export function smooth(ys, weight) {
  if (!weight) return ys;
  const out = new Array(ys.length);
  let last = 0;
  let n = 0;
  for (let i = 0; i < ys.length; i += 1) {
    const y = ys[i];
    if (y === null || !Number.isFinite(y)) { out[i] = y; continue; }
    last = last * weight + (1 - weight) * y;
    n += 1;
    out[i] = last / (1 - weight ** n);
  }
  return out;
}

/** Keep the first, min, max and last point of each of `buckets` x-ranges (in x order). */
export function downsample(xs, ys, buckets) {
  const n = xs.length;
  if (n <= buckets * 2) return [xs, ys];
  const ox = [];
  const oy = [];
  const size = n / buckets;
  for (let b = 0; b < buckets; b += 1) {
    const start = Math.floor(b * size);
    const end = Math.min(n, Math.floor((b + 1) * size));
    let lo = -1;
    let hi = -1;
    for (let i = start; i < end; i += 1) {
      const y = ys[i];
      if (y === null || !Number.isFinite(y)) continue;
      if (lo < 0 || y < ys[lo]) lo = i;
      if (hi < 0 || y > ys[hi]) hi = i;
    }
    if (lo < 0) continue;
    for (const i of lo === hi ? [lo] : [Math.min(lo, hi), Math.max(lo, hi)]) { ox.push(xs[i]); oy.push(ys[i]); }
  }
  // the newest point always shows, so the live edge of a running job is exact
  if (ox[ox.length - 1] !== xs[n - 1] && ys[n - 1] !== null) { ox.push(xs[n - 1]); oy.push(ys[n - 1]); }
  return [ox, oy];
}

function themeColors() {
  const css = getComputedStyle(document.documentElement);
  return { fg: css.getPropertyValue('--muted').trim() || '#666', grid: css.getPropertyValue('--grid').trim() || '#eee' };
}

export class StepChart {
  /**
   * @param {string} title  the metric shown (heading of the figure)
   * @param {{syncKey?: string}} options  charts with the same syncKey share the hover cursor
   */
  constructor(title, { syncKey = 'steps' } = {}) {
    this.title = title;
    this.syncKey = syncKey;
    this.lines = new Map(); // label -> {xs, ys, color}
    this.smoothing = 0;
    this.plot = null;
    this.pending = false;
    this.caption = h('figcaption', { class: 'chart-latest' });
    this.canvas = h('div', { class: 'chart-canvas' });
    this.el = h('figure', { class: 'chart', dataset: { metric: title, points: '0', lastStep: '0' } },
      h('h3', {}, title), this.canvas, this.caption);
    this.onTheme = () => this.rebuild();
    window.addEventListener('themechange', this.onTheme);
    this.resize = new ResizeObserver(() => {
      if (this.plot && this.canvas.clientWidth) this.plot.setSize({ width: this.canvas.clientWidth, height: HEIGHT });
      else this.schedule();
    });
    this.resize.observe(this.canvas);
  }

  /** Append points to a line (creating it); x must grow; an x already present is replaced. */
  add(label, points, color) {
    let line = this.lines.get(label);
    if (!line) {
      line = { xs: [], ys: [], color: color || colorAt(this.lines.size) };
      this.lines.set(label, line);
    }
    for (const [x, y] of points) {
      const last = line.xs.length - 1;
      if (last >= 0 && x <= line.xs[last]) {
        const i = line.xs.lastIndexOf(x);
        if (i >= 0) line.ys[i] = y;
        continue;
      }
      line.xs.push(x);
      line.ys.push(y);
    }
    this.schedule();
  }

  setSmoothing(weight) {
    this.smoothing = weight;
    this.schedule();
  }

  schedule() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => { this.pending = false; this.draw(); });
  }

  data() {
    const width = this.canvas.clientWidth || 600;
    const tables = [...this.lines.values()].map((l) => downsample(l.xs, smooth(l.ys, this.smoothing), width));
    return tables.length === 1 ? tables[0] : uPlot.join(tables);
  }

  draw() {
    if (!this.el.isConnected || !this.canvas.clientWidth) return;
    const labels = [...this.lines.keys()];
    if (!this.plot || this.plot.series.length !== labels.length + 1) this.rebuild();
    else this.plot.setData(this.data());
    this.describe();
  }

  rebuild() {
    this.plot?.destroy();
    this.plot = null;
    if (!this.lines.size || !this.canvas.clientWidth) return;
    const { fg, grid } = themeColors();
    const axis = { stroke: fg, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 } };
    const series = [{ label: 'step', value: (_u, v) => (v === null || v === undefined ? '—' : String(v)) }];
    for (const [label, line] of this.lines) {
      series.push({
        label,
        stroke: line.color,
        width: 1.5,
        spanGaps: true,
        value: (_u, v) => (v === null || v === undefined ? '—' : fmtNum(v)),
      });
    }
    this.plot = new uPlot({
      width: this.canvas.clientWidth,
      height: HEIGHT,
      cursor: { sync: { key: this.syncKey }, drag: { x: true, y: false } },
      scales: { x: { time: false } },
      legend: { live: true },
      axes: [{ ...axis, label: 'step', labelSize: 20 }, { ...axis, size: 60, values: (_u, vals, _axis, _space, incr) => fmtTicks(vals, incr) }],
      series,
      hooks: { draw: [() => markFirstPaint(this)] },
    }, this.data(), this.canvas);
  }

  describe() {
    let points = 0;
    let lastStep = 0;
    const parts = [];
    for (const [label, line] of this.lines) {
      points += line.xs.length;
      const n = line.xs.length;
      if (!n) continue;
      lastStep = Math.max(lastStep, line.xs[n - 1]);
      parts.push(`${label} ${fmtNum(line.ys[n - 1])}`);
    }
    this.el.dataset.points = String(points);
    this.el.dataset.lastStep = String(lastStep);
    this.caption.textContent = parts.length ? `latest: ${parts.join(' · ')} (step ${lastStep})` : '';
  }

  destroy() {
    window.removeEventListener('themechange', this.onTheme);
    this.resize.disconnect();
    this.plot?.destroy();
    this.plot = null;
  }
}

function markFirstPaint(chart) {
  // the browser tests read this mark to measure time to first chart paint
  if (performance.getEntriesByName(FIRST_PAINT_MARK).length === 0 && chart.plot?.data[0]?.length) {
    performance.mark(FIRST_PAINT_MARK);
  }
}

// ---- which metrics, in what order ----------------------------------------------------------------
// bookkeeping fields of a metric row, not measurements
const NOT_CHARTED = new Set(['object', 'step', 'epoch', 'logged_at', 'total_steps']);
// headline first (is it learning?), then the method's diagnostics, then throughput and optimiser state
const RANK = [/^loss$/, /^reward$/, /^rewards\//, /accurac/, /margin/, /^kl/, /chosen|rejected/, /clip/, /value|vf_/,
  /length/, /loss/, /reward/, /learning_rate/, /grad_norm/, /per_second|throughput|tokens/];

function rank(name) {
  const i = RANK.findIndex((re) => re.test(name));
  return i < 0 ? RANK.length - 3 : i;
}

/** The chart a metric key is drawn on: `valid_X` joins X's chart when X exists. */
export function chartOf(key, keys) {
  if (key.startsWith('valid_') && keys.has(key.slice(6))) return key.slice(6);
  return key;
}

export function numericKeys(row) {
  return Object.keys(row).filter((k) => !NOT_CHARTED.has(k) && typeof row[k] === 'number');
}

/**
 * Order charts: loss first, then the metrics the method declares (GET /v1/methods, in its order;
 * "{grader}" matches any grader name), then the rest by a generic rank.
 */
export function sortMetrics(names, declared = []) {
  const escape = (text) => text.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
  const patterns = declared.map((m) => new RegExp(`^${escape(m).replace('\\{grader\\}', '[^/]+')}$`));
  const place = (name) => {
    if (name === 'loss') return -1;
    const i = patterns.findIndex((re) => re.test(name));
    return i < 0 ? patterns.length + rank(name) : i;
  };
  return [...names].sort((a, b) => place(a) - place(b) || a.localeCompare(b));
}

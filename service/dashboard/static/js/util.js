// Small DOM and formatting helpers shared by every view.

/** h('div', {class: 'x', onclick: fn}, child, ...) -> Element. Strings become text nodes (never HTML). */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith('on') && typeof value === 'function') el.addEventListener(name.slice(2), value);
    else if (name === 'class') el.className = value;
    else if (name === 'dataset') Object.assign(el.dataset, value);
    else if (value === true) el.setAttribute(name, '');
    else el.setAttribute(name, String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** Replace an element's children. */
export function fill(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

export const TERMINAL = ['succeeded', 'failed', 'cancelled'];

export function fmtTime(unix) {
  if (!unix) return '—';
  const d = new Date(unix * 1000);
  const sameDay = d.toDateString() === new Date().toDateString();
  return sameDay
    ? d.toLocaleTimeString([], { hour: '2-digit', minute: '2-digit', second: '2-digit' })
    : d.toLocaleString([], { month: 'short', day: 'numeric', hour: '2-digit', minute: '2-digit' });
}

export function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return '—';
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}

export function fmtBytes(n) {
  if (n === null || n === undefined) return '—';
  const units = ['B', 'kB', 'MB', 'GB', 'TB'];
  let i = 0;
  let v = n;
  while (v >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
  return `${i === 0 ? v : v.toFixed(v < 10 ? 1 : 0)} ${units[i]}`;
}

export function fmtNum(v) {
  if (typeof v !== 'number') return String(v);
  if (!Number.isFinite(v)) return String(v);
  if (Number.isInteger(v)) return v.toLocaleString();
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(3);
  return v.toPrecision(4).replace(/\.?0+$/, '');
}

/** Axis labels: as many digits as the tick spacing `incr` needs (so neighbours never read the
 *  same), exponent notation for very small or large magnitudes so labels stay short. */
export function fmtTicks(vals, incr) {
  const top = Math.max(...vals.map((v) => Math.abs(v ?? 0)));
  const exponent = top !== 0 && (top < 1e-2 || top >= 1e6);
  let decimals = 0;
  while (decimals < 10 && Math.abs(Math.round(incr * 10 ** decimals) - incr * 10 ** decimals) > 1e-6) decimals += 1;
  return vals.map((v) => {
    if (v === null || !Number.isFinite(v)) return '';
    if (v === 0) return '0';
    if (exponent) {
      const digits = Math.min(6, Math.max(1, Math.ceil(Math.log10(Math.abs(v) / incr)) + 1));
      return v.toExponential(digits - 1).replace(/\.?0+e/, 'e');
    }
    return v.toFixed(decimals);
  });
}

/** Progress and ETA of a job, from what the API reports (steps and timestamps). */
export function progress(job) {
  const total = job.total_steps || 0;
  const step = job.current_step || 0;
  const pct = total ? Math.min(100, (100 * step) / total) : null;
  let eta = null;
  if (job.estimated_finish) eta = job.estimated_finish - Date.now() / 1000;
  else if (job.status === 'running' && job.started_at && step > 0 && total) {
    const perStep = (Date.now() / 1000 - job.started_at) / step;
    eta = perStep * (total - step);
  }
  return { step, total, pct, eta };
}

export function statusPill(status) {
  return h('span', { class: `pill st-${status}` }, h('span', { class: 'dot', 'aria-hidden': 'true' }), status.replace('_', ' '));
}

export function methodOf(job) {
  return job.method?.type || 'supervised';
}

export function shortId(id) {
  return id.length > 14 ? `${id.slice(0, 6)}…${id.slice(-6)}` : id;
}

export function runLabel(job) {
  return job.user_provided_suffix ? `${job.user_provided_suffix} (${shortId(job.id)})` : job.id;
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** Run fn every `ms` while the tab is visible; returns a stop function. Overlapping runs are skipped. */
export function every(ms, fn) {
  let stopped = false;
  let busy = false;
  let timer = null;
  const tick = async () => {
    if (stopped) return;
    if (!busy && document.visibilityState === 'visible') {
      busy = true;
      try { await fn(); } catch (e) { if (e?.name !== 'AbortError') console.debug('refresh failed', e); }
      busy = false;
    }
    if (!stopped) timer = setTimeout(tick, ms);
  };
  timer = setTimeout(tick, ms);
  return () => { stopped = true; clearTimeout(timer); };
}

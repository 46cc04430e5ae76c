// Job page: is this run healthy? Live charts of every metric the trainer reports (from the SSE
// stream, resumed with Last-Event-ID), status and progress, controls, error, events, checkpoints and
// the hyperparameters as stored.

import { api, ApiError, download, jobPath, listAll, methods } from '../api.js';
import { StepChart, chartOf, numericKeys, sortMetrics } from '../chart.js';
import { replaceParams } from '../route.js';
import { JobStream } from '../stream.js';
import {
  TERMINAL, every, fill, fmtBytes, fmtDuration, fmtNum, fmtTime, h, methodOf, progress, statusPill,
} from '../util.js';

const REFRESH_MS = 3000;
const MAX_EVENTS_SHOWN = 500;
const STREAM_LABEL = {
  connecting: 'connecting…', live: 'live', reconnecting: 'reconnecting…', ended: 'complete',
};

/** The smoothing control shared by the job and compare pages; state in the URL (`smooth=0.6`). */
export function smoothingControl(params, onChange) {
  const initial = params.get('smooth');
  const toggle = h('input', { type: 'checkbox', id: 'smooth-on', checked: initial !== null });
  const weight = h('input', {
    type: 'range', id: 'smooth-weight', min: '0', max: '0.99', step: '0.01', value: initial ?? '0.6',
    'aria-label': 'Smoothing weight', disabled: initial === null,
  });
  const shown = h('output', { for: 'smooth-weight' }, weight.value);
  const apply = () => {
    weight.disabled = !toggle.checked;
    shown.textContent = weight.value;
    const p = new URLSearchParams(location.hash.split('?')[1] || '');
    if (toggle.checked) p.set('smooth', weight.value); else p.delete('smooth');
    replaceParams(p);
    onChange(toggle.checked ? Number(weight.value) : 0);
  };
  toggle.addEventListener('change', apply);
  weight.addEventListener('input', apply);
  const el = h('div', { class: 'smoothing' }, h('label', { for: 'smooth-on' }, toggle, ' Smooth'), weight, shown);
  return { el, value: () => (toggle.checked ? Number(weight.value) : 0) };
}

/** Route metric rows to charts (one per metric; valid_X on X's chart) in a container, by rank. */
export class ChartGrid {
  constructor(container) {
    this.container = container;
    this.charts = new Map();
    this.keys = new Set();
    this.smoothing = 0;
    this.declared = [];
  }

  /** The method's own metrics (GET /v1/methods) come right after the loss. */
  setDeclared(metrics) {
    this.declared = metrics;
    this.order();
  }

  order() {
    for (const n of sortMetrics(this.charts.keys(), this.declared)) this.container.append(this.charts.get(n).el);
  }

  chart(name) {
    let chart = this.charts.get(name);
    if (!chart) {
      chart = new StepChart(name);
      chart.setSmoothing(this.smoothing);
      this.charts.set(name, chart);
      this.order();
    }
    return chart;
  }

  /** rows: metric objects ({step, epoch, <name>: number...}); `line(key)` names the line, `color` its colour. */
  add(rows, line = (key) => key, color = undefined) {
    const byKey = new Map();
    for (const row of rows) {
      for (const key of numericKeys(row)) {
        this.keys.add(key);
        if (!byKey.has(key)) byKey.set(key, []);
        byKey.get(key).push([row.step, row[key]]);
      }
    }
    for (const [key, points] of byKey) this.chart(chartOf(key, this.keys)).add(line(key), points, color?.(key));
  }

  setSmoothing(weight) {
    this.smoothing = weight;
    for (const c of this.charts.values()) c.setSmoothing(weight);
  }

  destroy() {
    for (const c of this.charts.values()) c.destroy();
  }
}

function dl(entries) {
  return h('dl', { class: 'facts' }, entries.filter(([, v]) => v !== null && v !== undefined && v !== '')
    .map(([k, v]) => h('div', {}, h('dt', {}, k), h('dd', {}, v))));
}

function errorBox(error) {
  const fault = error.fault === 'user'
    ? 'Your data or job spec caused this failure.'
    : 'The system caused this failure, not your data.';
  return h('section', { class: 'error-box', role: 'alert', 'aria-labelledby': 'err-h' },
    h('h2', { id: 'err-h' }, `Failed: ${error.code}`),
    h('p', {}, error.message),
    error.param ? h('p', {}, 'Parameter: ', h('code', {}, error.param)) : null,
    h('p', { class: 'fault', dataset: { fault: error.fault } }, `Fault: ${error.fault} — ${fault}`));
}

function hyperparameterTable(job) {
  const type = methodOf(job);
  const body = job.method?.[type] || {};
  const hp = body.hyperparameters || {};
  return h('div', {},
    h('p', {}, 'Method: ', h('strong', {}, type)),
    h('table', { class: 'kv' }, h('caption', { class: 'sr-only' }, 'Resolved hyperparameters'),
      h('tbody', {}, Object.entries(hp).map(([k, v]) => h('tr', {}, h('th', { scope: 'row' }, k),
        h('td', { class: 'mono' }, typeof v === 'number' ? fmtNum(v) : JSON.stringify(v)))))),
    body.grader ? h('details', { open: true }, h('summary', {}, 'Grader'),
      h('pre', { class: 'mono' }, JSON.stringify(body.grader, null, 2))) : null);
}

export function renderJob(main, jobId, params) {
  let job = null;
  let stopped = false;
  const title = h('h1', {}, jobId);
  const pill = h('span');
  const streamState = h('span', { class: 'stream-state', role: 'status', 'aria-live': 'polite', dataset: { state: 'connecting' } }, STREAM_LABEL.connecting);
  const facts = h('div');
  const errorSlot = h('div');
  const controlMsg = h('p', { class: 'control-msg', role: 'alert' });
  const buttons = {
    cancel: h('button', { type: 'button', class: 'danger', disabled: true }, 'Cancel'),
    pause: h('button', { type: 'button', disabled: true }, 'Pause'),
    resume: h('button', { type: 'button', disabled: true }, 'Resume'),
  };
  const chartsEl = h('div', { class: 'charts', 'aria-live': 'off' });
  const noMetrics = h('p', { class: 'muted' }, 'No metrics yet: charts appear with the first training step.');
  const grid = new ChartGrid(chartsEl);
  const smoothing = smoothingControl(params, (w) => grid.setSmoothing(w));
  grid.setSmoothing(smoothing.value());
  const eventsList = h('ol', { class: 'events', reversed: true });
  const ckptBody = h('tbody');
  const hpSlot = h('div');

  fill(main,
    h('p', { class: 'crumbs' }, h('a', { href: '#/jobs' }, '← Jobs')),
    h('div', { class: 'page-head' }, title, pill, streamState),
    facts,
    h('div', { class: 'controls', role: 'group', 'aria-label': 'Job controls' }, buttons.cancel, buttons.pause, buttons.resume),
    controlMsg,
    errorSlot,
    h('section', { 'aria-labelledby': 'charts-h' },
      h('div', { class: 'section-head' }, h('h2', { id: 'charts-h' }, 'Metrics'), smoothing.el),
      noMetrics, chartsEl),
    h('div', { class: 'two-col' },
      h('section', { 'aria-labelledby': 'events-h' }, h('h2', { id: 'events-h' }, 'Events'),
        h('div', { class: 'scroll', tabindex: '0', 'aria-label': 'Events log' }, eventsList)),
      h('section', { 'aria-labelledby': 'ckpt-h' }, h('h2', { id: 'ckpt-h' }, 'Checkpoints'),
        h('div', { class: 'table-wrap' }, h('table', { class: 'checkpoints' },
          h('thead', {}, h('tr', {}, ['Step', 'Metrics', 'Size', 'Created', ''].map((c) => h('th', { scope: 'col' }, c)))),
          ckptBody)))),
    h('section', { 'aria-labelledby': 'hp-h' }, h('h2', { id: 'hp-h' }, 'Hyperparameters (as stored)'), hpSlot));

  function renderJobFacts() {
    const { step, total, pct, eta } = progress(job);
    document.title = `${job.user_provided_suffix || job.id} · tunehouse`;
    title.textContent = job.user_provided_suffix || job.id;
    fill(pill, statusPill(job.status));
    main.dataset.jobStatus = job.status;
    const bar = total
      ? h('span', {}, h('progress', { max: total, value: step, 'aria-label': 'Training progress' }), ` ${step}/${total} · ${Math.floor(pct)}%`)
      : (step ? `step ${step}` : '—');
    const elapsed = job.started_at ? (job.finished_at || Date.now() / 1000) - job.started_at : null;
    fill(facts, dl([
      ['Job', h('span', { class: 'mono' }, job.id)],
      ['Method', methodOf(job)],
      ['Base model', h('span', { class: 'mono' }, job.model)],
      ['Fine-tuned model', job.fine_tuned_model ? h('span', { class: 'mono' }, job.fine_tuned_model) : null],
      ['Progress', bar],
      ['ETA', job.status === 'running' ? fmtDuration(eta) : null],
      ['Elapsed', elapsed !== null ? fmtDuration(elapsed) : null],
      ['Created', fmtTime(job.created_at)],
      ['Started', job.started_at ? fmtTime(job.started_at) : null],
      ['Finished', job.finished_at ? fmtTime(job.finished_at) : null],
      ['Trained tokens', job.trained_tokens ? fmtNum(job.trained_tokens) : null],
      ['Training file', h('span', { class: 'mono' }, job.training_file)],
      ['Validation file', job.validation_file ? h('span', { class: 'mono' }, job.validation_file) : null],
      ['Seed', String(job.seed)],
      ['Metadata', Object.keys(job.metadata || {}).length
        ? Object.entries(job.metadata).map(([k, v]) => h('span', { class: 'chip' }, `${k}=${v}`)) : null],
    ]));
    const terminal = TERMINAL.includes(job.status);
    buttons.cancel.disabled = terminal;
    buttons.pause.disabled = !['queued', 'running'].includes(job.status);
    buttons.resume.disabled = job.status !== 'paused';
    fill(errorSlot, job.error ? errorBox(job.error) : null);
    fill(hpSlot, hyperparameterTable(job));
  }

  function renderCheckpoints(ckpts) {
    fill(ckptBody, ckpts.length ? ckpts.sort((a, b) => b.step_number - a.step_number).map((c) => {
      const btn = h('button', { type: 'button', class: 'small', 'aria-label': `Download checkpoint at step ${c.step_number}` }, 'Download');
      btn.addEventListener('click', async () => {
        btn.disabled = true;
        btn.textContent = 'Downloading…';
        try { await download(`${jobPath(jobId)}/checkpoints/${encodeURIComponent(c.id)}/content`, `${c.id}.tar`); btn.textContent = 'Download'; }
        catch (e) { btn.textContent = `Failed: ${e.message}`; }
        btn.disabled = false;
      });
      return h('tr', {},
        h('td', { 'data-label': 'Step' }, String(c.step_number), c.is_final ? h('span', { class: 'chip' }, 'final') : null),
        h('td', { 'data-label': 'Metrics', class: 'mono small' }, Object.entries(c.metrics).map(([k, v]) => `${k} ${fmtNum(v)}`).join(' · ')),
        h('td', { 'data-label': 'Size' }, fmtBytes(c.bytes)),
        h('td', { 'data-label': 'Created' }, fmtTime(c.created_at)),
        h('td', {}, btn));
    }) : h('tr', {}, h('td', { colspan: 5, class: 'muted' }, 'No checkpoints yet.')));
  }

  function addEvents(events) {
    for (const ev of events) {
      eventsList.prepend(h('li', { class: `lvl-${ev.level}`, 'data-type': ev.type },
        h('time', { datetime: new Date(ev.created_at * 1000).toISOString() }, fmtTime(ev.created_at)), ' ',
        ev.level !== 'info' ? h('span', { class: 'chip' }, ev.level) : null, ' ', ev.message));
    }
    trimEvents();
    if (events.some((e) => /checkpoint/i.test(e.message))) refreshCheckpoints();
  }

  // Past MAX_EVENTS_SHOWN the oldest step events ("Step N/M", type "metrics") go first, so that a
  // job's start, state changes, warnings and checkpoints stay in view however many steps it logs.
  function trimEvents() {
    let over = eventsList.children.length - MAX_EVENTS_SHOWN;
    if (over <= 0) return;
    const steps = [...eventsList.querySelectorAll('li[data-type="metrics"]')].reverse(); // oldest first
    for (const li of steps.slice(0, over)) li.remove();
    for (over -= Math.min(over, steps.length); over > 0; over--) eventsList.lastChild.remove();
  }

  async function refreshJob() {
    try {
      job = await api(jobPath(jobId));
    } catch (e) {
      if (e instanceof ApiError && e.status === 404) {
        fill(main, h('p', { class: 'error-box', role: 'alert' }, e.message), h('a', { href: '#/jobs' }, 'Back to jobs'));
        stop();
      }
      return;
    }
    if (stopped) return;
    renderJobFacts();
    if (!grid.declared.length) {
      methods().then((all) => grid.setDeclared(all.get(methodOf(job))?.metrics || [])).catch(() => {});
    }
  }

  async function refreshCheckpoints() {
    try { renderCheckpoints(await listAll(`${jobPath(jobId)}/checkpoints`, { max: 200 })); } catch { /* next refresh */ }
  }

  async function control(action) {
    controlMsg.textContent = '';
    controlMsg.className = 'control-msg';
    for (const b of Object.values(buttons)) b.disabled = true;
    try {
      const body = await api(`${jobPath(jobId)}/${action}`, { method: 'POST' });
      if (body?.object === 'fine_tuning.job') job = body;
      controlMsg.textContent = `${action[0].toUpperCase()}${action.slice(1)} requested.`;
    } catch (e) {
      controlMsg.className = 'control-msg error';
      controlMsg.textContent = `${action[0].toUpperCase()}${action.slice(1)} failed: ${e instanceof ApiError ? e.describe() : e.message}`;
      await refreshJob();
    }
    if (job) renderJobFacts();
  }
  for (const [action, btn] of Object.entries(buttons)) btn.addEventListener('click', () => control(action));

  const stream = new JobStream(jobId, {
    onEvents: addEvents,
    onMetrics: (rows) => { noMetrics.hidden = true; grid.add(rows); },
    onState: (state, detail) => {
      streamState.dataset.state = state;
      streamState.textContent = STREAM_LABEL[state] || state;
      streamState.title = detail || '';
    },
    onEnd: () => { refreshJob(); refreshCheckpoints(); },
  }).start();

  refreshJob();
  refreshCheckpoints();
  const stopPolling = every(REFRESH_MS, async () => {
    if (job && TERMINAL.includes(job.status) && stream.state === 'ended') return;
    await refreshJob();
    await refreshCheckpoints();
  });
  function stop() {
    stopped = true;
    stopPolling();
    stream.close();
    grid.destroy();
  }
  return stop;
}

// Workers: the live training workers (GET /v1/workers), refreshed every few seconds: what each device
// is, what it is doing (GPU utilisation and memory from NVML, the processes' RSS), its last heartbeat
// and the jobs of yours it runs (other organizations' jobs are only counted).

import { api } from '../api.js';
import { every, fill, fmtBytes, fmtNum, h, shortId } from '../util.js';

const REFRESH_MS = 2000;

function gpuCell(gpu) {
  const used = gpu.memory_used_bytes / gpu.memory_total_bytes;
  return h('div', { class: 'gpu', dataset: { gpu: String(gpu.index) } },
    h('span', { class: 'mono' }, `GPU ${gpu.index}`), ' ',
    h('meter', { min: 0, max: 100, value: gpu.utilization, 'aria-label': `GPU ${gpu.index} utilisation` }), ' ',
    `${fmtNum(gpu.utilization)}% · ${fmtBytes(gpu.memory_used_bytes)} of ${fmtBytes(gpu.memory_total_bytes)}`,
    h('meter', { min: 0, max: 1, value: used, 'aria-label': `GPU ${gpu.index} memory in use` }));
}

function row(w, now) {
  const stats = w.stats || {};
  const gpus = stats.gpus || [];
  const device = `${w.device}${w.device_name ? ` · ${w.device_name}` : ''}${w.device_memory_bytes ? ` · ${fmtBytes(w.device_memory_bytes)}` : ''}`;
  const jobs = w.jobs.map((j) => h('div', {},
    h('a', { href: `#/jobs/${encodeURIComponent(j.id)}`, class: 'mono' }, shortId(j.id)),
    ` ${j.model} · step ${j.current_step}${j.total_steps ? `/${j.total_steps}` : ''}`));
  if (w.other_jobs) jobs.push(h('div', { class: 'muted' }, `${w.other_jobs} of other organizations`));
  return h('tr', { dataset: { workerId: w.id } },
    h('td', { 'data-label': 'Worker', class: 'mono wrap' }, w.id, h('div', { class: 'muted small' }, `queue ${w.queue}, ${w.gpus} device${w.gpus === 1 ? '' : 's'} a job`)),
    h('td', { 'data-label': 'Device', dataset: { field: 'device' } }, device),
    h('td', { 'data-label': 'GPUs', dataset: { field: 'gpus' } }, gpus.length ? gpus.map(gpuCell) : h('span', { class: 'muted' }, 'none (CPU)')),
    h('td', { 'data-label': 'Memory (RSS)', class: 'num', dataset: { field: 'rss' } }, stats.rss_bytes ? fmtBytes(stats.rss_bytes) : '—'),
    h('td', { 'data-label': 'Heartbeat', dataset: { field: 'heartbeat' } }, `${Math.max(0, Math.round(now - w.seen_at))} s ago`),
    h('td', { 'data-label': 'Jobs', dataset: { field: 'jobs' } }, jobs.length ? jobs : h('span', { class: 'muted' }, 'idle')));
}

export function renderWorkers(main) {
  const tbody = h('tbody');
  const count = h('span', { class: 'muted', role: 'status' }, 'Loading…');
  const error = h('p', { class: 'error-box', role: 'alert', hidden: true });
  fill(main,
    h('div', { class: 'page-head' }, h('h1', {}, 'Workers')),
    h('p', { class: 'muted' }, 'Live training workers, their devices and what they run; a job\'s own device figures are charted on its page.'),
    count,
    error,
    h('div', { class: 'table-wrap' }, h('table', { class: 'jobs responsive' },
      h('caption', { class: 'sr-only' }, 'Live training workers'),
      h('thead', {}, h('tr', {}, ['Worker', 'Device', 'GPUs', 'Memory (RSS)', 'Heartbeat', 'Jobs']
        .map((c) => h('th', { scope: 'col' }, c)))),
      tbody)));

  async function refresh() {
    try {
      const body = await api('/v1/workers');
      error.hidden = true;
      const now = Date.now() / 1000;
      if (body.data.length) fill(tbody, body.data.map((w) => row(w, now)));
      else fill(tbody, h('tr', { class: 'empty' }, h('td', { colspan: 6 }, 'No training worker is live.')));
      count.textContent = `${body.data.length} live worker${body.data.length === 1 ? '' : 's'}`;
    } catch (e) {
      error.hidden = false;
      error.textContent = `Could not load the workers: ${e.describe ? e.describe() : e.message}`;
    }
  }

  refresh();
  return every(REFRESH_MS, refresh);
}

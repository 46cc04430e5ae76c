// Jobs list: every job at a glance, refreshed every few seconds; filters and search in the URL;
// pick two or more to compare.

import { api, listAll } from '../api.js';
import { replaceParams } from '../route.js';
import { every, fill, fmtDuration, fmtTime, h, methodOf, progress, statusPill } from '../util.js';

const STATUSES = ['validating_files', 'queued', 'running', 'paused', 'succeeded', 'failed', 'cancelled'];
const REFRESH_MS = 3000;
const MAX_JOBS = 500;

function matches(job, { status, method, q }) {
  if (status && job.status !== status) return false;
  if (method && methodOf(job) !== method) return false;
  if (!q) return true;
  const hay = [job.id, job.user_provided_suffix, job.fine_tuned_model, job.model,
    ...Object.entries(job.metadata || {}).flatMap(([k, v]) => [k, v, `${k}=${v}`])];
  return hay.some((s) => s && String(s).toLowerCase().includes(q.toLowerCase()));
}

function progressCell(job) {
  const { step, total, pct } = progress(job);
  if (!total) return h('td', { 'data-label': 'Progress' }, step ? `step ${step}` : '—');
  return h('td', { 'data-label': 'Progress' },
    h('progress', { max: total, value: step, 'aria-label': `${step} of ${total} steps` }),
    h('span', { class: 'num' }, ` ${step}/${total} · ${Math.floor(pct)}%`));
}

export function renderJobs(main, params) {
  const filters = { status: params.get('status') || '', method: params.get('method') || '', q: params.get('q') || '' };
  const selected = new Set();
  let jobs = [];
  let loaded = false;

  const statusSel = h('select', { id: 'f-status', name: 'status' },
    h('option', { value: '' }, 'All statuses'), STATUSES.map((s) => h('option', { value: s }, s.replace('_', ' '))));
  const methodSel = h('select', { id: 'f-method', name: 'method' }, h('option', { value: '' }, 'All methods'));
  const search = h('input', { id: 'f-q', name: 'q', type: 'search', placeholder: 'id, suffix or metadata', value: filters.q });
  statusSel.value = filters.status;
  const compareBtn = h('button', { type: 'button', disabled: true }, 'Compare selected');
  const count = h('span', { class: 'muted', role: 'status' });
  const tbody = h('tbody');
  const error = h('p', { class: 'error-box', role: 'alert', hidden: true });
  const table = h('table', { class: 'jobs responsive' },
    h('caption', { class: 'sr-only' }, 'Fine-tuning jobs, newest first'),
    h('thead', {}, h('tr', {},
      h('th', { scope: 'col' }, h('span', { class: 'sr-only' }, 'Select')),
      ['Status', 'Job', 'Method', 'Model', 'Progress', 'ETA', 'Created', 'Finished'].map((c) => h('th', { scope: 'col' }, c)))),
    tbody);

  fill(main,
    h('div', { class: 'page-head' }, h('h1', {}, 'Fine-tuning jobs'), h('a', { class: 'button', href: '#/new' }, 'New job')),
    h('form', { class: 'filters', role: 'search', onsubmit: (e) => e.preventDefault() },
      h('label', { for: 'f-status' }, 'Status'), statusSel,
      h('label', { for: 'f-method' }, 'Method'), methodSel,
      h('label', { for: 'f-q' }, 'Search'), search,
      compareBtn, count),
    error,
    h('div', { class: 'table-wrap' }, table));

  const rows = new Map(); // id -> {tr, sig}

  function row(job) {
    const { eta } = progress(job);
    const box = h('input', { type: 'checkbox', 'aria-label': `Select ${job.id} to compare`, checked: selected.has(job.id) });
    box.addEventListener('change', () => {
      if (box.checked) selected.add(job.id); else selected.delete(job.id);
      compareBtn.disabled = selected.size < 2;
    });
    const meta = Object.entries(job.metadata || {}).map(([k, v]) => h('span', { class: 'chip' }, `${k}=${v}`));
    return h('tr', { dataset: { jobId: job.id, status: job.status } },
      h('td', { class: 'select' }, box),
      h('td', { 'data-label': 'Status' }, statusPill(job.status)),
      h('td', { 'data-label': 'Job', class: 'job-cell' },
        h('a', { href: `#/jobs/${encodeURIComponent(job.id)}` }, job.user_provided_suffix || job.id),
        job.user_provided_suffix ? h('span', { class: 'muted mono' }, ` ${job.id}`) : null,
        meta.length ? h('div', {}, meta) : null),
      h('td', { 'data-label': 'Method' }, methodOf(job)),
      h('td', { 'data-label': 'Model', class: 'mono wrap' }, job.model),
      progressCell(job),
      h('td', { 'data-label': 'ETA' }, job.status === 'running' ? fmtDuration(eta) : '—'),
      h('td', { 'data-label': 'Created' }, fmtTime(job.created_at)),
      h('td', { 'data-label': 'Finished' }, fmtTime(job.finished_at)));
  }

  function render() {
    const shown = jobs.filter((j) => matches(j, filters));
    const keep = new Set(shown.map((j) => j.id));
    for (const [id, r] of rows) if (!keep.has(id)) { r.tr.remove(); rows.delete(id); }
    let prev = null;
    for (const job of shown) {
      const { eta } = progress(job);
      const sig = JSON.stringify([job, job.status === 'running' ? Math.round(eta || 0) : 0]);
      let r = rows.get(job.id);
      if (!r || r.sig !== sig) {
        const focused = r && r.tr.contains(document.activeElement);
        const tr = row(job);
        if (r) r.tr.replaceWith(tr);
        r = { tr, sig };
        rows.set(job.id, r);
        if (focused) tr.querySelector('input, a')?.focus();
      }
      // keep the table in list order (newest first) without rebuilding unchanged rows
      const want = prev ? prev.nextSibling : tbody.firstChild;
      if (want !== r.tr) tbody.insertBefore(r.tr, want);
      prev = r.tr;
    }
    if (!shown.length && loaded) {
      const none = jobs.length ? 'No job matches these filters.' : 'No jobs yet.';
      fill(tbody, h('tr', { class: 'empty' }, h('td', { colspan: 9 }, none, ' ', h('a', { href: '#/new' }, 'Create a job'))));
      rows.clear();
    } else {
      tbody.querySelector('tr.empty')?.remove();
    }
    count.textContent = loaded ? `${shown.length} of ${jobs.length} jobs` : 'Loading…';
  }

  async function refresh() {
    try {
      jobs = await listAll('/v1/fine_tuning/jobs', { max: MAX_JOBS });
      loaded = true;
      error.hidden = true;
      const methods = new Set([...methodSel.options].map((o) => o.value));
      for (const m of new Set(jobs.map(methodOf))) if (!methods.has(m)) methodSel.append(h('option', { value: m }, m));
      methodSel.value = filters.method;
    } catch (e) {
      error.hidden = false;
      error.textContent = `Could not load jobs: ${e.message}`;
    }
    render();
  }

  api('/v1/methods').then((body) => {
    const have = new Set([...methodSel.options].map((o) => o.value));
    for (const m of body.data) if (!have.has(m.id)) methodSel.append(h('option', { value: m.id }, m.id));
    methodSel.value = filters.method;
  }).catch(() => {});

  const onFilter = () => {
    filters.status = statusSel.value;
    filters.method = methodSel.value;
    filters.q = search.value.trim();
    const p = new URLSearchParams();
    for (const [k, v] of Object.entries(filters)) if (v) p.set(k, v);
    replaceParams(p);
    render();
  };
  statusSel.addEventListener('change', onFilter);
  methodSel.addEventListener('change', onFilter);
  search.addEventListener('input', onFilter);
  compareBtn.addEventListener('click', () => {
    location.hash = `#/compare?ids=${[...selected].map(encodeURIComponent).join(',')}`;
  });

  render();
  refresh();
  return every(REFRESH_MS, refresh);
}

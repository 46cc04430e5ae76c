// Tinker runs: the training clients the `tinker` SDK drives (docs/tinker.md), refreshed every few seconds
// as their calls arrive: base model, rank, calls, optimizer steps, the last loss, the last checkpoint.
// Read from the Tinker API's own listing (/api/v1/training_runs, X-API-Key: the same key).

import { api, auth } from '../api.js';
import { every, fill, fmtNum, h } from '../util.js';

const REFRESH_MS = 3000;
const PAGE = 100;

const fmtIso = (iso) => (iso ? new Date(iso).toLocaleString([], { month: 'short', day: 'numeric', hour: '2-digit', minute: '2-digit', second: '2-digit' }) : '—');

function row(run) {
  const ckpt = run.last_sampler_checkpoint || run.last_checkpoint;
  return h('tr', { dataset: { runId: run.training_run_id } },
    h('td', { 'data-label': 'Run', class: 'mono wrap' }, run.training_run_id),
    h('td', { 'data-label': 'Base model', class: 'mono wrap' }, run.base_model),
    h('td', { 'data-label': 'Rank', class: 'num' }, run.lora_rank ?? '—'),
    h('td', { 'data-label': 'Calls', class: 'num', dataset: { field: 'calls' } }, fmtNum(run.calls ?? 0)),
    h('td', { 'data-label': 'Steps', class: 'num' }, fmtNum(run.steps ?? 0)),
    h('td', { 'data-label': 'Last loss (sum)', class: 'num', dataset: { field: 'loss' } },
      run.last_loss === null || run.last_loss === undefined ? '—' : fmtNum(run.last_loss)),
    h('td', { 'data-label': 'Last call' }, fmtIso(run.last_request_time)),
    h('td', { 'data-label': 'Last checkpoint', class: 'mono wrap' }, ckpt ? ckpt.tinker_path : '—'));
}

export function renderTinker(main) {
  const tbody = h('tbody');
  const count = h('span', { class: 'muted', role: 'status' }, 'Loading…');
  const error = h('p', { class: 'error-box', role: 'alert', hidden: true });
  fill(main,
    h('div', { class: 'page-head' }, h('h1', {}, 'Tinker runs')),
    h('p', { class: 'muted' }, 'Training clients of the tinker SDK (TINKER_API_KEY = tml- + your key). ',
      'Their named checkpoints are models too: see /v1/models.'),
    count,
    error,
    h('div', { class: 'table-wrap' }, h('table', { class: 'jobs responsive' },
      h('caption', { class: 'sr-only' }, 'Tinker training runs, newest first'),
      h('thead', {}, h('tr', {}, ['Run', 'Base model', 'Rank', 'Calls', 'Steps', 'Last loss (sum)', 'Last call', 'Last checkpoint']
        .map((c) => h('th', { scope: 'col' }, c)))),
      tbody)));

  async function refresh() {
    try {
      const body = await api(`/api/v1/training_runs?limit=${PAGE}`, { headers: { 'X-API-Key': auth.key || '' } });
      error.hidden = true;
      const runs = body.training_runs;
      if (runs.length) fill(tbody, runs.map(row));
      else fill(tbody, h('tr', { class: 'empty' }, h('td', { colspan: 8 }, 'No Tinker runs yet.')));
      const total = body.cursor?.total_count ?? runs.length;
      count.textContent = total > runs.length ? `${runs.length} newest of ${total} runs` : `${runs.length} run${runs.length === 1 ? '' : 's'}`;
    } catch (e) {
      error.hidden = false;
      error.textContent = `Could not load Tinker runs: ${e.describe ? e.describe() : e.message}`;
    }
  }

  refresh();
  return every(REFRESH_MS, refresh);
}

// Compare runs: two or more jobs' curves overlaid on shared axes, plus the hyperparameters that
// differ between them — "did this change help?". Job ids live in the URL (`#/compare?ids=a,b`).

import { api, jobPath, listAll, methods } from '../api.js';
import { chartOf, colorAt } from '../chart.js';
import { JobStream } from '../stream.js';
import { fill, fmtNum, h, methodOf, runLabel, statusPill } from '../util.js';
import { ChartGrid, smoothingControl } from './job.js';

function differingHyperparameters(jobs) {
  const hps = jobs.map((j) => ({ method: methodOf(j), ...(j.method?.[methodOf(j)]?.hyperparameters || {}), seed: j.seed, model: j.model }));
  const keys = [...new Set(hps.flatMap((x) => Object.keys(x)))].sort();
  return keys.filter((k) => new Set(hps.map((x) => JSON.stringify(x[k]))).size > 1);
}

function picker(ids) {
  const list = h('fieldset', { class: 'picker' }, h('legend', {}, 'Runs to compare'), h('p', { class: 'muted' }, 'Loading jobs…'));
  const go = h('button', { type: 'submit' }, 'Compare');
  const form = h('form', { class: 'card' }, list, go);
  form.addEventListener('submit', (e) => {
    e.preventDefault();
    const chosen = [...form.querySelectorAll('input[type=checkbox]:checked')].map((b) => b.value);
    location.hash = `#/compare?ids=${chosen.map(encodeURIComponent).join(',')}`;
  });
  listAll('/v1/fine_tuning/jobs', { max: 100 }).then((jobs) => {
    fill(list, h('legend', {}, 'Runs to compare'), jobs.length ? jobs.map((j) => h('label', { class: 'pick' },
      h('input', { type: 'checkbox', value: j.id, checked: ids.includes(j.id) }), ' ', runLabel(j), ' ',
      statusPill(j.status), h('span', { class: 'muted' }, ` ${methodOf(j)}`))) : h('p', {}, 'No jobs yet.'));
  }).catch((e) => fill(list, h('p', { class: 'error-box', role: 'alert' }, e.message)));
  return form;
}

export function renderCompare(main, params) {
  const ids = (params.get('ids') || '').split(',').map((s) => s.trim()).filter(Boolean);
  const chartsEl = h('div', { class: 'charts' });
  const grid = new ChartGrid(chartsEl);
  const smoothing = smoothingControl(params, (w) => grid.setSmoothing(w));
  grid.setSmoothing(smoothing.value());
  const summary = h('div', { class: 'table-wrap' });
  const streams = [];
  const head = h('div', { class: 'page-head' }, h('h1', {}, 'Compare runs'));

  if (ids.length < 2) {
    fill(main, head, h('p', {}, 'Pick two or more jobs to overlay their curves.'), picker(ids));
    return () => {};
  }
  fill(main, head, summary,
    h('section', { 'aria-labelledby': 'cmp-charts-h' },
      h('div', { class: 'section-head' }, h('h2', { id: 'cmp-charts-h' }, 'Metrics'), smoothing.el), chartsEl),
    h('details', {}, h('summary', {}, 'Change the selection'), picker(ids)));

  Promise.all(ids.map((id) => api(jobPath(id)).catch((e) => ({ id, missing: e.message })))).then((jobs) => {
    const found = jobs.filter((j) => !j.missing);
    const diff = differingHyperparameters(found);
    const last = new Map(); // id -> latest row
    let pending = false;
    const table = () => {
      pending = false;
      renderTable();
      for (const el of summary.querySelectorAll('.swatch')) el.style.background = el.dataset.color;
    };
    const later = () => { if (!pending) { pending = true; requestAnimationFrame(table); } };
    const renderTable = () => fill(summary, h('table', { class: 'compare' },
      h('caption', {}, `${found.length} runs`, diff.length ? ` — differing: ${diff.join(', ')}` : ' — same hyperparameters'),
      h('thead', {}, h('tr', {}, ['Run', 'Status', 'Method', 'Steps', 'Latest loss / reward', ...diff].map((c) => h('th', { scope: 'col' }, c)))),
      h('tbody', {}, jobs.map((j, i) => {
        if (j.missing) return h('tr', {}, h('td', { colspan: 5 + diff.length, class: 'error' }, `${j.id}: ${j.missing}`));
        const hp = { method: methodOf(j), ...(j.method?.[methodOf(j)]?.hyperparameters || {}), seed: j.seed, model: j.model };
        const row = last.get(j.id) || {};
        const headline = ['loss', 'reward', 'valid_loss'].filter((k) => k in row).map((k) => `${k} ${fmtNum(row[k])}`).join(' · ');
        return h('tr', {},
          h('td', {}, h('span', { class: 'swatch', dataset: { color: colorAt(i) } }), h('a', { href: `#/jobs/${encodeURIComponent(j.id)}` }, runLabel(j))),
          h('td', {}, statusPill(j.status)), h('td', {}, methodOf(j)),
          h('td', {}, `${j.current_step}/${j.total_steps ?? '?'}`), h('td', { class: 'mono' }, headline || '—'),
          diff.map((k) => h('td', { class: 'mono' }, hp[k] === undefined ? '—' : JSON.stringify(hp[k]))));
      }))));
    table();
    methods().then((all) => grid.setDeclared([...new Set(found.flatMap((j) => all.get(methodOf(j))?.metrics || []))]))
      .catch(() => {});
    jobs.forEach((j, i) => {
      if (j.missing) return;
      const run = runLabel(j);
      streams.push(new JobStream(j.id, {
        onMetrics: (rows) => {
          grid.add(rows, (key) => (chartOf(key, grid.keys) === key ? run : `${run} ${key}`), () => colorAt(i));
          last.set(j.id, { ...last.get(j.id), ...rows[rows.length - 1] });
          later();
        },
        onEnd: async () => {
          jobs[i] = await api(jobPath(j.id)).catch(() => j);
          found.splice(0, found.length, ...jobs.filter((x) => !x.missing));
          table();
        },
      }).start());
    });
  });
  return () => { for (const s of streams) s.close(); grid.destroy(); };
}

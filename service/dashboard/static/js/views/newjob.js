// New job form. Hyperparameter fields are built from the server's JSON Schema (GET /v1/methods), so
// defaults and ranges are the API's own; blank fields are not sent and take the server default. The
// server is the judge: its 400 is shown next to the field its `param` names.

import { api, ApiError, listAll } from '../api.js';
import { replaceParams } from '../route.js';
import { fill, h } from '../util.js';

const GRADER_EXAMPLE = {
  type: 'string_check', name: 'exact', operation: 'eq',
  input: '{{sample.output_text}}', reference: '{{item.answer}}',
};

function rangeText(v) {
  const parts = [];
  if (v.minimum !== undefined) parts.push(`≥ ${v.minimum}`);
  if (v.exclusiveMinimum !== undefined) parts.push(`> ${v.exclusiveMinimum}`);
  if (v.maximum !== undefined) parts.push(`≤ ${v.maximum}`);
  if (v.exclusiveMaximum !== undefined) parts.push(`< ${v.exclusiveMaximum}`);
  return `${v.type}${parts.length ? ` ${parts.join(', ')}` : ''}`;
}

/** What a JSON Schema property allows: a choice list (booleans, enums) or a typed value with ranges. */
export function describeProperty(schema) {
  const variants = schema.anyOf || [schema];
  const choices = [];
  const kinds = [];
  for (const v of variants) {
    if (v.type === 'boolean') choices.push(true, false);
    else if (v.enum) choices.push(...v.enum);
    else if (v.const !== undefined) { choices.push(v.const); kinds.push(JSON.stringify(v.const)); }
    else if (v.type === 'integer' || v.type === 'number') kinds.push(rangeText(v));
    else if (v.type === 'array') kinds.push('comma-separated list');
    else if (v.type === 'null') kinds.push('empty');
    else if (v.type) kinds.push(v.type);
  }
  const valueKinds = kinds.filter((k) => !k.startsWith('"'));
  const select = valueKinds.length === 0 && choices.length > 0;
  const hint = `default ${JSON.stringify(schema.default ?? null)}${select ? '' : ` · ${kinds.join(' or ')}`}`
    + (schema.description ? ` — ${schema.description}` : '');
  return { select, choices, hint, array: variants.some((v) => v.type === 'array') };
}

/** A typed value from a text field: numbers as numbers, lists split on commas; the rest as typed. */
function parseValue(text, isArray) {
  const t = text.trim();
  if (isArray) return t.split(',').map((s) => s.trim()).filter(Boolean);
  if (t !== '' && !Number.isNaN(Number(t))) return Number(t);
  if (t === 'true' || t === 'false') return t === 'true';
  if (t === 'null') return null;
  return t;
}

function field(param, id, labelText, control, hint) {
  return h('div', { class: 'field', dataset: { param } },
    h('label', { for: id }, labelText), control,
    hint ? h('p', { class: 'hint', id: `${id}-hint` }, hint) : null,
    h('p', { class: 'field-error', id: `${id}-error`, role: 'alert' }));
}

export function renderNewJob(main, params) {
  const formError = h('p', { class: 'error-box', role: 'alert', hidden: true });
  const form = h('form', { class: 'card newjob', novalidate: true }, h('p', { class: 'muted' }, 'Loading models, methods and files…'));
  fill(main, h('div', { class: 'page-head' }, h('h1', {}, 'New fine-tuning job')), formError, form);

  Promise.all([api('/v1/models'), api('/v1/methods'), listAll('/v1/files', { limit: 1000, max: 5000 })])
    .then(([models, methods, files]) => build(models.data, methods.data, files))
    .catch((e) => { formError.hidden = false; formError.textContent = `Could not load the form: ${e.message}`; });

  function build(models, methods, files) {
    const byId = new Map(methods.map((m) => [m.id, m]));
    const model = h('select', { id: 'nj-model', name: 'model' }, models.map((m) => h('option', { value: m.id }, m.id)));
    const method = h('select', { id: 'nj-method', name: 'method' }, methods.map((m) => h('option', { value: m.id }, m.id)));
    if (byId.has(params.get('method'))) method.value = params.get('method');
    const training = h('select', { id: 'nj-training', name: 'training_file' });
    const validation = h('select', { id: 'nj-validation', name: 'validation_file' });
    const hpBox = h('fieldset', { class: 'hp' });
    const graderSlot = h('div');
    const suffix = h('input', { id: 'nj-suffix', name: 'suffix', type: 'text', maxlength: 64, autocomplete: 'off' });
    const seed = h('input', { id: 'nj-seed', name: 'seed', type: 'text', inputmode: 'numeric', autocomplete: 'off' });
    const metadata = h('textarea', { id: 'nj-metadata', name: 'metadata', rows: 2, spellcheck: 'false', placeholder: '{"experiment": "lr-sweep"}' });
    const submit = h('button', { type: 'submit' }, 'Create job');
    // the pre-flight estimate of the same body (POST /v1/fine_tuning/jobs/estimate): nothing is created
    const estimateButton = h('button', { type: 'button', class: 'secondary' }, 'Estimate');
    const estimateBox = h('section', { id: 'nj-estimate', class: 'estimate', 'aria-live': 'polite' });
    let grader = null;
    let hpInputs = [];

    function fileOptions(select, optional) {
      const formats = new Set(byId.get(method.value).file_formats);
      const fits = files.filter((f) => formats.has(f.format));
      const others = files.filter((f) => !formats.has(f.format));
      const keep = select.value;
      const opt = (f) => h('option', { value: f.id }, `${f.filename} — ${f.format}, ${f.line_count} lines (${f.id})`);
      fill(select,
        optional ? h('option', { value: '' }, 'None') : (fits.length ? null : h('option', { value: '' }, 'No file of a matching format: upload one')),
        fits.map(opt),
        others.length ? h('optgroup', { label: 'Other formats (not accepted by this method)' }, others.map(opt)) : null);
      if ([...select.options].some((o) => o.value === keep)) select.value = keep;
    }

    function methodChanged() {
      const m = byId.get(method.value);
      const p = new URLSearchParams();
      p.set('method', m.id);
      replaceParams(p);
      fileOptions(training, false);
      fileOptions(validation, true);
      const props = m.hyperparameters.properties || {};
      // what the user typed survives a change of method wherever the new method has the same field
      const typed = new Map(hpInputs.map((x) => [x.name, x.control.value]));
      hpInputs = Object.entries(props).map(([name, schema]) => {
        const d = describeProperty(schema);
        const id = `hp-${name}`;
        const control = d.select
          ? h('select', { id, name, 'aria-describedby': `${id}-hint ${id}-error` },
            h('option', { value: '' }, `default (${JSON.stringify(schema.default)})`),
            [...new Set(d.choices)].map((c) => h('option', { value: JSON.stringify(c) }, String(c))))
          : h('input', { id, name, type: 'text', autocomplete: 'off', placeholder: schema.default === null || schema.default === undefined ? '' : String(schema.default), 'aria-describedby': `${id}-hint ${id}-error` });
        if (typed.get(name) && [...(control.options || [{ value: typed.get(name) }])].some((o) => o.value === typed.get(name))) {
          control.value = typed.get(name);
        }
        return { name, control, d, el: field(`method.${m.id}.hyperparameters.${name}`, id, name, control, d.hint) };
      });
      fill(hpBox, h('legend', {}, `Hyperparameters for ${m.id} (blank = default)`), h('div', { class: 'hp-grid' }, hpInputs.map((x) => x.el)));
      grader = null;
      if (m.grader) {
        grader = h('textarea', { id: 'nj-grader', name: 'grader', rows: 8, spellcheck: 'false', class: 'mono', 'aria-describedby': 'nj-grader-hint nj-grader-error' },
          JSON.stringify(GRADER_EXAMPLE, null, 2));
        grader.addEventListener('input', () => checkJson(grader, 'object'));
        fill(graderSlot, field(`method.${m.id}.grader`, 'nj-grader', 'Grader (JSON)', grader,
          'One grader in OpenAI\'s shape: string_check, text_similarity, score_model, python, or multi combining several.'));
      } else {
        fill(graderSlot);
      }
    }

    fill(form,
      field('model', 'nj-model', 'Base model', model, 'Base models and your fine-tuned models (GET /v1/models).'),
      field('method', 'nj-method', 'Method', method),
      field('training_file', 'nj-training', 'Training file', training),
      field('validation_file', 'nj-validation', 'Validation file (optional)', validation),
      hpBox,
      graderSlot,
      h('div', { class: 'row3' },
        field('suffix', 'nj-suffix', 'Suffix (optional)', suffix, 'Letters, digits, _ . - (up to 64).'),
        field('seed', 'nj-seed', 'Seed (optional)', seed, 'Blank = random.'),
        field('metadata', 'nj-metadata', 'Metadata (optional JSON object)', metadata, 'Up to 16 string values.')),
      h('div', { class: 'row3' }, estimateButton, submit),
      estimateBox);
    method.addEventListener('change', methodChanged);
    metadata.addEventListener('input', () => checkJson(metadata, 'object', true));
    methodChanged();

    /** The creation body from the form, or null when a JSON field is invalid (focused, shown in place). */
    function buildBody() {
      const m = method.value;
      const hyperparameters = {};
      for (const { name, control, d } of hpInputs) {
        if (control.value.trim() === '') continue;
        hyperparameters[name] = d.select ? JSON.parse(control.value) : parseValue(control.value, d.array);
      }
      const body = { model: model.value, training_file: training.value, method: { type: m, [m]: { hyperparameters } } };
      if (grader) {
        if (!checkJson(grader, 'object')) { grader.focus(); return null; }
        body.method[m].grader = JSON.parse(grader.value);
      }
      if (validation.value) body.validation_file = validation.value;
      if (suffix.value.trim()) body.suffix = suffix.value.trim();
      if (seed.value.trim()) body.seed = parseValue(seed.value, false);
      if (metadata.value.trim()) {
        if (!checkJson(metadata, 'object', true)) { metadata.focus(); return null; }
        body.metadata = JSON.parse(metadata.value);
      }
      return body;
    }

    estimateButton.addEventListener('click', async () => {
      clearErrors();
      const body = buildBody();
      if (!body) return;
      estimateButton.disabled = true;
      fill(estimateBox, h('p', {}, 'Estimating…'));
      try {
        showEstimate(await api('/v1/fine_tuning/jobs/estimate', { method: 'POST', json: body }));
      } catch (err) {
        fill(estimateBox);
        showServerError(err);
      } finally {
        estimateButton.disabled = false;
      }
    });

    function showEstimate(e) {
      const gib = (n) => (n == null ? '?' : `${(n / 2 ** 30).toFixed(2)} GiB`);
      const t = e.trained_tokens;
      const wall = e.estimated_wall_time;
      const facts = [
        ['Examples', `${e.examples}` + (e.trained_examples != null ? ` (${e.trained_examples} trained)` : '')],
        ['Trained tokens', t ? `${t.per_epoch} per epoch, ${t.total} in all` : `— ${e.tokens_reason}`],
        ['Steps', `${e.total_steps}`],
        ['Truncated', e.truncated ? `${e.truncated.count}` + (e.truncated.count ? ` (lines ${e.truncated.first_lines.join(', ')})` : '') : '—'],
        ['Wall time', wall.seconds != null ? `${wall.seconds} s` : `— ${wall.reason}`],
        ['Queue position', `${e.queue_position}`],
      ];
      const memory = e.peak_memory_bytes.map((f) => {
        const k = f.worker_kind;
        const verdict = f.fits === true ? 'fits' : f.fits === false ? `does not fit: ${f.reason}` : 'unknown';
        return h('li', { class: f.fits === false ? 'unfit' : '' },
          `${k.device} ${k.device_name || ''} (${gib(k.device_memory_bytes)} × ${k.gpus}): ${gib(f.peak_memory_bytes.total)} at peak per device — ${verdict}`);
      });
      const preview = e.preview.map((spans) => h('pre', { class: 'mono preview' },
        spans.map((s) => (s.trained ? h('mark', { title: 'trained' }, s.text) : h('span', {}, s.text)))));
      fill(estimateBox,
        h('h2', {}, 'Estimate'),
        h('dl', {}, facts.flatMap(([k, v]) => [h('dt', {}, k), h('dd', {}, v)])),
        h('h3', {}, 'Peak memory per device'),
        memory.length ? h('ul', { class: 'fits' }, memory) : h('p', {}, 'No training worker is running.'),
        h('h3', {}, 'First examples (highlighted: the tokens the loss trains on)'),
        ...preview);
    }

    form.addEventListener('submit', async (e) => {
      e.preventDefault();
      clearErrors();
      const body = buildBody();
      if (!body) return;
      submit.disabled = true;
      try {
        const job = await api('/v1/fine_tuning/jobs', { method: 'POST', json: body });
        location.hash = `#/jobs/${encodeURIComponent(job.id)}`;
      } catch (err) {
        showServerError(err);
      } finally {
        submit.disabled = false;
      }
    });
  }

  /** Client-side JSON check, shown in place; the server still validates the content. */
  function checkJson(control, kind, optional = false) {
    const box = control.closest('.field').querySelector('.field-error');
    if (optional && !control.value.trim()) { box.textContent = ''; control.removeAttribute('aria-invalid'); return true; }
    try {
      const v = JSON.parse(control.value);
      if (kind === 'object' && (typeof v !== 'object' || v === null || Array.isArray(v))) throw new Error('expected a JSON object');
      box.textContent = '';
      control.removeAttribute('aria-invalid');
      return true;
    } catch (e) {
      box.textContent = `Invalid JSON: ${e.message}`;
      control.setAttribute('aria-invalid', 'true');
      return false;
    }
  }

  function clearErrors() {
    formError.hidden = true;
    for (const el of form.querySelectorAll('.field-error')) el.textContent = '';
    for (const el of form.querySelectorAll('[aria-invalid]')) el.removeAttribute('aria-invalid');
  }

  /** Find the field the server's `param` names (or its nearest named parent) and show the error there. */
  function showServerError(err) {
    const message = err instanceof ApiError ? err.describe() : err.message;
    let param = err instanceof ApiError ? err.param : null;
    while (param) {
      const box = [...form.querySelectorAll('.field')].find((f) => f.dataset.param === param);
      if (box) {
        box.querySelector('.field-error').textContent = message;
        const control = box.querySelector('input, select, textarea');
        control.setAttribute('aria-invalid', 'true');
        control.focus();
        return;
      }
      const cut = Math.max(param.lastIndexOf('.'), param.lastIndexOf('['));
      param = cut > 0 ? param.slice(0, cut) : null;
    }
    formError.hidden = false;
    formError.textContent = message;
    formError.scrollIntoView({ block: 'nearest' });
  }
}

// Files: what was uploaded (detected format, size, lines), upload with the server's line-level
// validation error shown where the file was chosen, delete.

import { api, ApiError, listAll, request } from '../api.js';
import { fill, fmtBytes, fmtTime, h } from '../util.js';

export function renderFiles(main) {
  const input = h('input', { id: 'upload-file', name: 'file', type: 'file', accept: '.jsonl,.json,application/jsonl', required: true, 'aria-describedby': 'upload-error upload-help' });
  const error = h('p', { id: 'upload-error', class: 'field-error', role: 'alert' });
  const status = h('p', { class: 'muted', role: 'status' });
  const button = h('button', { type: 'submit' }, 'Upload');
  const form = h('form', { class: 'card upload', novalidate: true },
    h('h2', {}, 'Upload a training file'),
    h('label', { for: 'upload-file' }, 'JSONL file'), input,
    h('p', { id: 'upload-help', class: 'hint' }, 'One JSON object per line: chat, prompt/completion, text, preference or RL prompts. Checked line by line on upload.'),
    error, button, status);
  const tbody = h('tbody');
  const listError = h('p', { class: 'error-box', role: 'alert', hidden: true });

  fill(main,
    h('div', { class: 'page-head' }, h('h1', {}, 'Files')),
    form,
    listError,
    h('div', { class: 'table-wrap' }, h('table', { class: 'files responsive' },
      h('caption', { class: 'sr-only' }, 'Uploaded files'),
      h('thead', {}, h('tr', {}, ['File', 'Format', 'Size', 'Lines', 'Created', ''].map((c) => h('th', { scope: 'col' }, c)))),
      tbody)));

  function row(f) {
    const del = h('button', { type: 'button', class: 'small danger', 'aria-label': `Delete ${f.filename} (${f.id})` }, 'Delete');
    let armed = null;
    del.addEventListener('click', async () => {
      // two clicks, no modal: a stray click or keypress never deletes
      if (!armed) {
        del.textContent = 'Confirm delete';
        armed = setTimeout(() => { armed = null; del.textContent = 'Delete'; }, 5000);
        return;
      }
      clearTimeout(armed);
      del.disabled = true;
      try {
        await api(`/v1/files/${encodeURIComponent(f.id)}`, { method: 'DELETE' });
        status.textContent = `Deleted ${f.filename}.`;
        await refresh();
      } catch (e) {
        del.disabled = false;
        del.textContent = 'Delete';
        armed = null;
        status.textContent = `Delete failed: ${e instanceof ApiError ? e.describe() : e.message}`;
      }
    });
    return h('tr', { dataset: { fileId: f.id } },
      h('td', { 'data-label': 'File' }, h('strong', {}, f.filename), h('div', { class: 'muted mono' }, f.id)),
      h('td', { 'data-label': 'Format' }, f.format),
      h('td', { 'data-label': 'Size' }, fmtBytes(f.bytes)),
      h('td', { 'data-label': 'Lines' }, f.line_count.toLocaleString()),
      h('td', { 'data-label': 'Created' }, fmtTime(f.created_at)),
      h('td', {}, del));
  }

  async function refresh() {
    try {
      const files = await listAll('/v1/files', { limit: 1000, max: 5000 });
      listError.hidden = true;
      fill(tbody, files.length ? files.map(row) : h('tr', {}, h('td', { colspan: 6, class: 'muted' }, 'No files yet.')));
    } catch (e) {
      listError.hidden = false;
      listError.textContent = `Could not load files: ${e.message}`;
    }
  }

  form.addEventListener('submit', async (e) => {
    e.preventDefault();
    error.textContent = '';
    input.removeAttribute('aria-invalid');
    const file = input.files[0];
    if (!file) {
      error.textContent = 'Choose a file first.';
      input.focus();
      return;
    }
    const body = new FormData();
    body.append('purpose', 'fine-tune');
    body.append('file', file);
    button.disabled = true;
    status.textContent = `Uploading ${file.name}…`;
    try {
      const res = await request('/v1/files', { method: 'POST', body });
      const created = await res.json();
      status.textContent = `Uploaded ${created.filename}: ${created.format}, ${created.line_count} lines.`;
      form.reset();
      await refresh();
    } catch (err) {
      status.textContent = '';
      error.textContent = err instanceof ApiError ? err.describe() : err.message;
      input.setAttribute('aria-invalid', 'true');
      input.focus();
    } finally {
      button.disabled = false;
    }
  });

  refresh();
  return () => {};
}

// Files: what was uploaded (detected format, size, lines, images), upload with the server's line-level
// validation error shown where the file was chosen, delete; a file with images shows their thumbnails,
// each with the line and field it stands in (GET /v1/files/{id}/images, docs/vision.md).

import { api, ApiError, listAll, request } from '../api.js';
import { fill, fmtBytes, fmtTime, h } from '../util.js';

const THUMBNAILS_SHOWN = 24;

export function renderFiles(main) {
  const input = h('input', { id: 'upload-file', name: 'file', type: 'file', accept: '.jsonl,.json,application/jsonl', required: true, 'aria-describedby': 'upload-error upload-help' });
  const error = h('p', { id: 'upload-error', class: 'field-error', role: 'alert' });
  const status = h('p', { class: 'muted', role: 'status' });
  const button = h('button', { type: 'submit' }, 'Upload');
  const form = h('form', { class: 'card upload', novalidate: true },
    h('h2', {}, 'Upload a training file'),
    h('label', { for: 'upload-file' }, 'JSONL file'), input,
    h('p', { id: 'upload-help', class: 'hint' }, 'One JSON object per line: chat (with images for vision bases), prompt/completion, text, preference or RL prompts. Checked line by line on upload.'),
    error, button, status);
  const tbody = h('tbody');
  const listError = h('p', { class: 'error-box', role: 'alert', hidden: true });

  fill(main,
    h('div', { class: 'page-head' }, h('h1', {}, 'Files')),
    form,
    listError,
    h('div', { class: 'table-wrap' }, h('table', { class: 'files responsive' },
      h('caption', { class: 'sr-only' }, 'Uploaded files'),
      h('thead', {}, h('tr', {}, ['File', 'Format', 'Size', 'Lines', 'Images', 'Created', ''].map((c) => h('th', { scope: 'col' }, c)))),
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
    const images = f.images || 0;
    const gallery = h('tr', { class: 'file-images', hidden: true }, h('td', { colspan: 7 }));
    const show = images ? h('button', { type: 'button', class: 'small', 'aria-expanded': 'false', 'aria-label': `Show the images of ${f.filename}` }, `${images.toLocaleString()} ▸`) : '—';
    if (images) show.addEventListener('click', () => toggleImages(f, show, gallery));
    return [h('tr', { dataset: { fileId: f.id } },
      h('td', { 'data-label': 'File' }, h('strong', {}, f.filename), h('div', { class: 'muted mono' }, f.id)),
      h('td', { 'data-label': 'Format' }, f.format),
      h('td', { 'data-label': 'Size' }, fmtBytes(f.bytes)),
      h('td', { 'data-label': 'Lines' }, f.line_count.toLocaleString()),
      h('td', { 'data-label': 'Images' }, show),
      h('td', { 'data-label': 'Created' }, fmtTime(f.created_at)),
      h('td', {}, del)), gallery];
  }

  // the first images of a file, as the upload checked them: a thumbnail, its line and field, its size
  async function toggleImages(f, button, gallery) {
    const open = gallery.hidden;
    gallery.hidden = !open;
    button.setAttribute('aria-expanded', String(open));
    button.textContent = `${f.images.toLocaleString()} ${open ? '▾' : '▸'}`;
    if (!open || gallery.dataset.loaded) return;
    const cell = gallery.firstChild;
    fill(cell, h('p', { class: 'muted', role: 'status' }, 'Loading images…'));
    try {
      const page = await api(`/v1/files/${encodeURIComponent(f.id)}/images?limit=${THUMBNAILS_SHOWN}`);
      gallery.dataset.loaded = '1';
      const figures = page.data.map((img) => {
        const caption = `line ${img.line}, ${img.field}: ${img.width}×${img.height} ${img.media_type.replace('image/', '').toUpperCase()}`;
        const picture = img.thumbnail
          ? h('img', { src: img.thumbnail, alt: caption, loading: 'lazy' })
          : h('div', { class: 'no-thumbnail', role: 'img', 'aria-label': caption }, 'no thumbnail');
        return h('figure', { class: 'thumb', dataset: { line: img.line } }, picture,
          h('figcaption', {}, `line ${img.line}`, h('span', { class: 'muted' }, ` ${img.width}×${img.height}`)));
      });
      const more = page.has_more ? h('p', { class: 'muted' }, `The first ${page.data.length} of ${f.images.toLocaleString()} images.`) : '';
      fill(cell, h('div', { class: 'thumbs', role: 'list', 'aria-label': `Images of ${f.filename}` }, figures), more);
    } catch (e) {
      fill(cell, h('p', { class: 'error-box', role: 'alert' }, `Could not load the images: ${e instanceof ApiError ? e.describe() : e.message}`));
    }
  }

  async function refresh() {
    try {
      const files = await listAll('/v1/files', { limit: 1000, max: 5000 });
      listError.hidden = true;
      fill(tbody, files.length ? files.flatMap(row) : h('tr', {}, h('td', { colspan: 7, class: 'muted' }, 'No files yet.')));
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
      const pictures = created.images ? `, ${created.images} images` : '';
      status.textContent = `Uploaded ${created.filename}: ${created.format}, ${created.line_count} lines${pictures}.`;
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

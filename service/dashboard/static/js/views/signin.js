// Sign in with an API key. The key is checked against the API (GET /v1/models) before it is kept,
// and kept in sessionStorage only (this tab, until it closes).

import { ApiError, auth, request } from '../api.js';
import { fill, h } from '../util.js';

export function renderSignIn(main, params, reason) {
  const input = h('input', {
    id: 'api-key', name: 'api_key', type: 'password', autocomplete: 'off', spellcheck: 'false', required: true,
    'aria-describedby': 'signin-error signin-help', placeholder: 'th-…',
  });
  const error = h('p', { id: 'signin-error', class: 'field-error', role: 'alert' }, reason || '');
  const button = h('button', { type: 'submit' }, 'Sign in');
  const form = h('form', { class: 'card signin', novalidate: true },
    h('h1', {}, 'Sign in'),
    h('label', { for: 'api-key' }, 'API key'),
    input,
    h('p', { id: 'signin-help', class: 'hint' },
      'Create one with ', h('code', {}, 'tunehouse keys create --tenant NAME'),
      '. It is kept for this browser tab only.'),
    error,
    button);
  form.addEventListener('submit', async (e) => {
    e.preventDefault();
    const key = input.value.trim();
    if (!key) {
      error.textContent = 'Enter an API key.';
      input.focus();
      return;
    }
    button.disabled = true;
    error.textContent = '';
    try {
      await request('/v1/models', { key });
      auth.set(key);
      const next = params.get('next');
      location.hash = next && next.startsWith('#/') && !next.startsWith('#/signin') ? next : '#/jobs';
    } catch (err) {
      error.textContent = err instanceof ApiError ? err.describe() : String(err);
      input.setAttribute('aria-invalid', 'true');
      input.focus();
    } finally {
      button.disabled = false;
    }
  });
  fill(main, form);
  input.focus();
}

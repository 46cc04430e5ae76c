// The public /v1 API, exactly as the SDK uses it: Bearer key, OpenAI error envelope, cursor pages.
// The key lives in sessionStorage: it survives reloads of this tab and is gone when the tab closes.

const KEY_NAME = 'tunehouse.apiKey';

export class ApiError extends Error {
  constructor(status, body) {
    const err = body?.error || {};
    super(err.message || `HTTP ${status}`);
    this.status = status;
    this.type = err.type || null;
    this.param = err.param || null;
    this.code = err.code || null;
  }

  /** "message (code)" — what the user should read. */
  describe() {
    return this.code ? `${this.message} (${this.code})` : this.message;
  }
}

export const auth = {
  get key() { return sessionStorage.getItem(KEY_NAME); },
  set(key) { sessionStorage.setItem(KEY_NAME, key); },
  clear() { sessionStorage.removeItem(KEY_NAME); },
};

// --- who wants to know: the app shell shows a banner and sends the user to sign-in -----------------
let authLost = () => {};
export function onAuthLost(fn) { authLost = fn; }

const connectionListeners = new Set();
let online = true;
export function onConnection(fn) { connectionListeners.add(fn); fn(online); return () => connectionListeners.delete(fn); }
export function setOnline(value) {
  if (value === online) return;
  online = value;
  for (const fn of connectionListeners) fn(online);
}

export function authHeaders(extra = {}) {
  return { Authorization: `Bearer ${auth.key || ''}`, ...extra };
}

/** fetch() that reports lost connections and lost keys; throws ApiError for any non-2xx answer. */
export async function request(path, { method = 'GET', json, body, headers = {}, signal, key } = {}) {
  const h = key ? { Authorization: `Bearer ${key}`, ...headers } : authHeaders(headers);
  if (json !== undefined) {
    h['content-type'] = 'application/json';
    body = JSON.stringify(json);
  }
  let res;
  try {
    res = await fetch(path, { method, headers: h, body, signal });
  } catch (e) {
    if (e.name === 'AbortError') throw e;
    setOnline(false);
    throw new ApiError(0, { error: { message: 'Cannot reach the server', type: 'connection_error' } });
  }
  setOnline(true);
  if (res.ok) return res;
  const data = await res.json().catch(() => null);
  const err = new ApiError(res.status, data);
  if (res.status === 401 && !key) authLost(err.message);
  throw err;
}

export async function api(path, options) {
  const res = await request(path, options);
  return res.json();
}

/** Every item of a cursor-paginated list (`after` = the last item's id), up to `max` items. */
export async function listAll(path, { limit = 100, max = 1000, signal } = {}) {
  const out = [];
  let after = null;
  for (;;) {
    const sep = path.includes('?') ? '&' : '?';
    const page = await api(`${path}${sep}limit=${limit}${after ? `&after=${encodeURIComponent(after)}` : ''}`, { signal });
    out.push(...page.data);
    if (!page.has_more || out.length >= max || page.data.length === 0) return out;
    after = page.data[page.data.length - 1].id;
  }
}

export const jobPath = (id) => `/v1/fine_tuning/jobs/${encodeURIComponent(id)}`;

/** Download an authenticated URL: links cannot carry the Bearer header, so fetch it and save a blob. */
export async function download(path, filename) {
  const res = await request(path);
  const blob = await res.blob();
  const url = URL.createObjectURL(blob);
  const a = document.createElement('a');
  a.href = url;
  a.download = filename;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

let methodsCatalog = null;
/** GET /v1/methods, once per page load (it changes only with a deployment). */
export function methods() {
  methodsCatalog ||= api('/v1/methods').then((body) => new Map(body.data.map((m) => [m.id, m])))
    .catch((e) => { methodsCatalog = null; throw e; });
  return methodsCatalog;
}

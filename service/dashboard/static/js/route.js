// The view's state lives in the URL hash, so a reload or a shared link lands on the same view.

/** '#/jobs/ftjob-1?x=y' -> {path: 'jobs/ftjob-1', parts: ['jobs', 'ftjob-1'], params: URLSearchParams} */
export function currentRoute() {
  const raw = location.hash.replace(/^#\/?/, '');
  const [path, query = ''] = raw.split('?');
  return { path, parts: path.split('/').filter(Boolean).map(decodeURIComponent), params: new URLSearchParams(query) };
}

/** Put view state in the URL without adding a history entry or re-rendering. */
export function replaceParams(params) {
  const { path } = currentRoute();
  const query = params.toString();
  history.replaceState(null, '', `#/${path}${query ? `?${query}` : ''}`);
}

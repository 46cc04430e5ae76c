// The shell: hash routes (so a reload or a shared link lands on the same view), sign-in guard,
// theme, and the banner for a lost connection. Each view is `render(main, params) -> cleanup`.

import { auth, onAuthLost, onConnection } from './api.js';
import { currentRoute } from './route.js';
import { renderCompare } from './views/compare.js';
import { renderFiles } from './views/files.js';
import { renderJob } from './views/job.js';
import { renderJobs } from './views/jobs.js';
import { renderNewJob } from './views/newjob.js';
import { renderSignIn } from './views/signin.js';
import { renderTinker } from './views/tinker.js';
import { renderWorkers } from './views/workers.js';

const main = document.getElementById('main');
let cleanup = null;
let signInReason = '';

function route(event) {
  cleanup?.();
  cleanup = null;
  const { parts, params, path } = currentRoute();
  const signedIn = Boolean(auth.key);
  document.getElementById('nav').hidden = !signedIn;
  document.getElementById('signout').hidden = !signedIn;
  if (!signedIn && parts[0] !== 'signin') {
    const next = path && path !== 'signin' ? location.hash : '';
    location.replace(`#/signin${next ? `?next=${encodeURIComponent(next)}` : ''}`);
    return;
  }
  for (const a of document.querySelectorAll('[data-nav]')) {
    if (a.dataset.nav === (parts[0] || 'jobs')) a.setAttribute('aria-current', 'page');
    else a.removeAttribute('aria-current');
  }
  const view = {
    signin: () => renderSignIn(main, params, signInReason),
    files: () => renderFiles(main, params),
    new: () => renderNewJob(main, params),
    compare: () => renderCompare(main, params),
    tinker: () => renderTinker(main),
    workers: () => renderWorkers(main),
    jobs: () => (parts[1] ? renderJob(main, parts[1], params) : renderJobs(main, params)),
  }[parts[0] || 'jobs'];
  if (!view) {
    location.replace('#/jobs');
    return;
  }
  if (parts[0] !== 'signin') signInReason = '';
  if (event) main.focus({ preventScroll: true }); // keyboard and screen-reader users start at the new view
  cleanup = view() || null;
}

// ---- theme: the system's by default; a click pins the other one for this browser -----------------
function applyTheme(theme) {
  document.documentElement.dataset.theme = theme;
  const button = document.getElementById('theme');
  const other = theme === 'dark' ? 'light' : 'dark';
  button.setAttribute('aria-label', `Switch to ${other} theme`);
  button.title = `Switch to ${other} theme`;
  window.dispatchEvent(new Event('themechange'));
}
const systemDark = matchMedia('(prefers-color-scheme: dark)');
applyTheme(localStorage.getItem('tunehouse.theme') || (systemDark.matches ? 'dark' : 'light'));
systemDark.addEventListener('change', (e) => {
  if (!localStorage.getItem('tunehouse.theme')) applyTheme(e.matches ? 'dark' : 'light');
});
document.getElementById('theme').addEventListener('click', () => {
  const next = document.documentElement.dataset.theme === 'dark' ? 'light' : 'dark';
  localStorage.setItem('tunehouse.theme', next);
  applyTheme(next);
});

// ---- signing out, by hand or because the API refused the key -------------------------------------
function signOut(reason) {
  auth.clear();
  signInReason = reason;
  if (currentRoute().parts[0] === 'signin') {
    route(); // already there (several requests failed at once): keep its `next`, show the reason
    return;
  }
  location.hash = `#/signin?next=${encodeURIComponent(location.hash || '#/jobs')}`;
}
document.getElementById('signout').addEventListener('click', () => signOut('You signed out.'));
onAuthLost((message) => signOut(`The API refused the key: ${message}`));

const banner = document.getElementById('conn');
onConnection((online) => {
  banner.hidden = online;
  banner.textContent = online ? '' : 'Connection lost — retrying…';
});

window.addEventListener('hashchange', route);
route();

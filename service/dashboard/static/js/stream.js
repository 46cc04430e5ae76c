// A job's metrics and events, live: history first from `GET .../metrics` (one JSON page per 2,000
// steps: about 4x faster than replaying them as SSE frames, measured with 5,000 steps), then the
// Server-Sent Events stream (`GET .../stream`) from the step after it. The stream's id is the cursor
// `e<event seq>.m<metric step>`, so the first connection asks for every event and the metrics after
// the history. EventSource cannot send an Authorization header, so this reads the stream with
// fetch() and parses the frames itself. After a dropped connection it reconnects with `Last-Event-ID`
// set to the last id it saw, so the server sends exactly what was missed; the state ('connecting',
// 'live', 'reconnecting', 'ended') is reported so the page can show it.

import { ApiError, api, authHeaders, jobPath, request, setOnline } from './api.js';
import { sleep } from './util.js';

const MAX_BACKOFF_MS = 8000;
const HISTORY_PAGE = 2000;

export class JobStream {
  /**
   * @param {string} jobId
   * @param {{onEvents?: Function, onMetrics?: Function, onEnd?: Function, onState?: Function}} handlers
   *   onEvents(events[]) and onMetrics(rows[]) get every frame of one network read at once, so a
   *   replay of thousands of steps costs one redraw per chunk, not one per step.
   */
  constructor(jobId, handlers) {
    this.jobId = jobId;
    this.handlers = handlers;
    this.lastId = null;
    this.closed = false;
    this.state = null;
    this.controller = null;
  }

  start() {
    this.loop();
    return this;
  }

  close() {
    this.closed = true;
    this.controller?.abort();
  }

  setState(state, detail = '') {
    this.state = state;
    this.handlers.onState?.(state, detail);
  }

  /** Metric rows so far, page by page (each page drawn as it arrives); returns the last step. */
  async history() {
    let last = 0;
    for (;;) {
      const after = last ? `&after=${last}` : '';
      const page = await api(`${jobPath(this.jobId)}/metrics?limit=${HISTORY_PAGE}${after}`, { signal: this.controller.signal });
      if (page.data.length) {
        last = page.data[page.data.length - 1].step;
        this.handlers.onMetrics?.(page.data);
      }
      if (!page.has_more || !page.data.length || this.closed) return last;
    }
  }

  async loop() {
    let backoff = 500;
    this.setState('connecting');
    this.controller = new AbortController();
    try {
      const last = await this.history();
      if (last) this.lastId = `e0m${last}`;
    } catch (e) {
      if (this.closed || e.name === 'AbortError') return;
      // no history: the stream replays it all
    }
    while (!this.closed) {
      let detail = 'connection dropped';
      try {
        const ended = await this.connect(() => { backoff = 500; });
        if (ended) return;
      } catch (e) {
        if (this.closed || e.name === 'AbortError') return;
        if (e instanceof ApiError && e.status === 401) return; // the app sends the user to sign-in
        if (e instanceof ApiError && e.status === 404) { this.setState('ended', e.message); return; }
        if (e instanceof TypeError) setOnline(false); // the network went away mid-stream
        detail = e.message;
      }
      if (this.closed) return;
      this.setState('reconnecting', detail);
      await sleep(backoff);
      backoff = Math.min(backoff * 2, MAX_BACKOFF_MS);
    }
  }

  /** One connection; true when the server said `end`. */
  async connect(onOpen) {
    this.controller = new AbortController();
    const headers = this.lastId ? authHeaders({ 'Last-Event-ID': this.lastId }) : authHeaders();
    const res = await request(`${jobPath(this.jobId)}/stream`, { headers, signal: this.controller.signal });
    onOpen();
    this.setState('live');
    const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return false; // closed without `end`: reconnect and resume
      setOnline(true);
      buffer += value;
      const frames = buffer.split(/\r?\n\r?\n/);
      buffer = frames.pop();
      if (this.dispatch(frames)) {
        this.controller.abort();
        return true;
      }
    }
  }

  dispatch(frames) {
    const events = [];
    const metrics = [];
    let end = null;
    for (const frame of frames) {
      let type = 'message';
      let id = null;
      const data = [];
      for (const line of frame.split(/\r?\n/)) {
        if (line.startsWith(':')) continue; // keep-alive comment
        const colon = line.indexOf(':');
        const field = colon < 0 ? line : line.slice(0, colon);
        const val = colon < 0 ? '' : line.slice(colon + 1).replace(/^ /, '');
        if (field === 'event') type = val;
        else if (field === 'id') id = val;
        else if (field === 'data') data.push(val);
      }
      if (id !== null) this.lastId = id;
      if (!data.length) continue;
      const payload = JSON.parse(data.join('\n'));
      if (type === 'metrics') metrics.push(payload);
      else if (type === 'event') events.push(payload);
      else if (type === 'end') end = payload;
    }
    if (events.length) this.handlers.onEvents?.(events);
    if (metrics.length) this.handlers.onMetrics?.(metrics);
    if (end) {
      this.setState('ended', end.status);
      this.handlers.onEnd?.(end);
      return true;
    }
    return false;
  }
}

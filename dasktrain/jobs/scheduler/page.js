'use strict';
const STATES = ['queued', 'running', 'finished', 'failed', 'cancelled',
                'pruned'];
const SVG = 'http://www.w3.org/2000/svg';
const CARDS = 12;  // curves shown: running jobs first, then the newest
const logs = {};   // job id -> {epoch: last row's epoch fetched, rows}

// Control characters (C0, DEL, C1, bidirectional overrides) shown as
// escapes, as `dasktrain jobs` prints them: a name reads as it is.
const CONTROL = /[\u0000-\u001f\u007f-\u009f\u2028\u2029\u202a-\u202e\u2066-\u2069]/g;
function printable(text) {
  return String(text).replace(CONTROL, c => {
    const n = c.charCodeAt(0);
    return n < 0x100 ? '\\x' + n.toString(16).padStart(2, '0')
                     : '\\u' + n.toString(16).padStart(4, '0');
  });
}
function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = printable(text);
  if (cls) e.className = cls;
  return e;
}
function svgEl(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  return e;
}
function num(v, digits) {
  return (typeof v === 'number') ? v.toFixed(digits) : '-';
}
function when(t) {  // as `dasktrain jobs` prints it: MM-DD HH:MM:SS
  if (!t) return '-';
  const d = new Date(t * 1000), p = n => String(n).padStart(2, '0');
  return p(d.getMonth() + 1) + '-' + p(d.getDate()) + ' ' + p(d.getHours())
    + ':' + p(d.getMinutes()) + ':' + p(d.getSeconds());
}
function gpus(job) {
  if (job.held && job.held.length) return job.held.join(',');
  return job.gpus_asked;
}

function estimate(job) {  // the queue's, in a column named estimate
  if (job.state === 'queued' && job.position) {
    return '#' + job.position + (job.start ? ', start ~' + when(job.start)
                                 : ', start unknown');
  }
  // a job the queue started before its worker says so: already its end
  if ((job.state === 'running' || job.state === 'queued') && job.end) {
    return 'end ~' + when(job.end) + (job.overdue ? ' OVERDUE' : '');
  }
  return '-';
}

function summary(jobs) {
  const box = document.getElementById('summary');
  box.replaceChildren();
  for (const s of STATES) {
    const n = jobs.filter(j => j.state === s).length;
    const span = el('span');
    span.append(el('b', n), ' ' + s);
    box.append(span);
  }
}

function table(jobs) {
  const body = document.querySelector('#queue tbody');
  body.replaceChildren();
  for (const job of jobs.slice().reverse()) {
    const r = job.row || {};
    const tr = el('tr');
    tr.dataset.job = job.id;
    const progress = el('td');
    if (job.epochs) {  // a job of no epochs (a command's): no progress
      const bar = el('span', null, 'bar');
      const fill = el('i');
      fill.style.width = (100 * Math.min(r.epoch || 0, job.epochs) /
                          job.epochs) + '%';
      bar.append(fill);
      progress.append(bar, (r.epoch || 0) + '/' + job.epochs);
    } else {
      progress.append('-');
    }
    const state = el('td', null, 'text');
    const badge = el('span', job.state, 'state ' + job.state);
    if (job.error) badge.title = printable(job.error);  // why, on hover
    state.append(badge);
    // how it ended, where that says more: finished (stopped by request)
    if (job.ending) state.append(' ', el('span', '(' + job.ending + ')',
                                         'ending'));
    // long text wraps: the table fits the window, else scrolls in its box
    tr.append(el('td', job.id, 'text'), el('td', job.name, 'text'),
              el('td', job.user, 'text'), state, el('td', gpus(job)),
              progress,
              el('td', num(r['validation/main/accuracy'], 4), 'num'),
              el('td', num(r['main/loss'], 4), 'num'),
              el('td', num(r.images_per_sec, 0), 'num'),
              el('td', job.worker || '-', 'text'),
              el('td', when(job.submitted)),
              el('td', estimate(job), 'text'),
              el('td', job.reason || '-', 'text'));
    body.append(tr);
  }
}

function chart(rows, keys, title, colours) {
  const W = 300, H = 160, L = 40, R = 8, T = 18, B = 22;
  const svg = svgEl('svg', {width: W, height: H, class: 'curve'});
  svg.append(svgEl('rect', {x: L, y: T, width: W - L - R, height: H - T - B,
                            fill: '#fafafa', stroke: '#ccc'}));
  const t = svgEl('text', {x: L, y: 12});
  t.textContent = title;
  svg.append(t);
  const values = [];
  for (const k of keys) for (const r of rows)
    if (typeof r[k] === 'number') values.push(r[k]);
  const maxEpoch = Math.max(1, ...rows.map(r => r.epoch));
  let lo = Math.min(...values), hi = Math.max(...values);
  if (!values.length) { lo = 0; hi = 1; }
  if (hi - lo < 1e-9) { lo -= 0.5; hi += 0.5; }
  const x = e => L + (W - L - R) * e / maxEpoch;
  const y = v => T + (H - T - B) * (1 - (v - lo) / (hi - lo));
  for (const [v, yy] of [[hi, T + 4], [lo, H - B]]) {
    const label = svgEl('text', {x: 2, y: yy});
    label.textContent = v.toPrecision(3);
    svg.append(label);
  }
  const axis = svgEl('text', {x: W - R - 40, y: H - 6});
  axis.textContent = 'epoch ' + maxEpoch;
  svg.append(axis);
  let points = 0;
  keys.forEach((k, i) => {
    const pts = rows.filter(r => typeof r[k] === 'number');
    if (!pts.length) return;
    svg.append(svgEl('polyline', {
      fill: 'none', stroke: colours[i], 'stroke-width': 1.5,
      points: pts.map(r => x(r.epoch) + ',' + y(r[k])).join(' ')}));
    for (const r of pts) {
      svg.append(svgEl('circle', {cx: x(r.epoch), cy: y(r[k]), r: 2.5,
                                  fill: colours[i], class: 'point'}));
      points++;
    }
    const key = svgEl('text', {x: L + 70 + 70 * i, y: 12,
                               fill: colours[i]});
    key.textContent = k.startsWith('validation/') ? 'validation' : 'train';
    svg.append(key);
  });
  svg.dataset.points = points;
  return svg;
}

function pick(jobs) {
  return jobs.filter(j => j.row).sort((a, b) =>
    (b.state === 'running') - (a.state === 'running') ||
    b.submitted - a.submitted).slice(0, CARDS);
}

function cards(shown) {
  const box = document.getElementById('cards');
  box.replaceChildren();
  for (const job of shown) {
    const rows = (logs[job.id] || {}).rows || [];
    const card = el('div', null, 'card');
    card.dataset.job = job.id;
    card.append(el('h2', job.name),
                el('div', job.id + ' - ' + job.user + ' - ' + job.state,
                   'sub'));
    card.append(chart(rows, ['main/loss', 'validation/main/loss'], 'loss',
                      ['#1f6fd1', '#e07b00']),
                chart(rows, ['main/accuracy', 'validation/main/accuracy'],
                      'accuracy', ['#1f6fd1', '#e07b00']));
    if (job.error) card.append(el('div', job.error, 'error'));
    box.append(card);
  }
}

async function fetchLogs(jobs) {
  await Promise.all(jobs.map(async job => {
    const epoch = job.row ? job.row.epoch : 0;
    if (logs[job.id] && logs[job.id].epoch === epoch) return;
    const reply = await fetch('api/jobs/' + encodeURIComponent(job.id) +
                              '/log');
    if (reply.ok) logs[job.id] = {epoch: epoch, rows: await reply.json()};
  }));
}

async function refresh() {
  try {
    const reply = await fetch('api/jobs');
    const answer = await reply.json();
    const jobs = answer.jobs;
    summary(jobs);
    table(jobs);
    const shown = answer.private ? [] : pick(jobs);
    if (shown.length) await fetchLogs(shown);
    cards(shown);
    document.getElementById('updated').textContent =
      'updated ' + new Date().toLocaleTimeString() + ', every {poll} ms' +
      (answer.private ? '; progress, accuracy, curves and errors: their ' +
       'owners see them with `dasktrain jobs`' : '');
  } catch (e) {
    document.getElementById('updated').textContent =
      'cannot reach the scheduler: ' + e;
  }
}
refresh();
setInterval(refresh, {poll});

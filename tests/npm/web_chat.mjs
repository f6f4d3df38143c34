// Drives the web chat a running `kiln serve` answers at GET / in headless Chromium (puppeteer-core):
// the API key and the model's name, a streamed answer that is the API's own, history and the system
// prompt, the Stop button, and reasoning and errors as the page shows them. Run by
// tests/web_chat_test.cpp against stories260K (models/stories260K, with its own chat template)
// and --api-key; standalone (KILN_API_KEY only when the server has one):
//   KILN_BASE_URL=http://127.0.0.1:PORT KILN_MODEL=stories260K KILN_CHROMIUM=/usr/bin/chromium \
//     KILN_API_KEY=KEY node tests/npm/web_chat.mjs
import test from 'node:test';
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const npmCache =
  process.env.KILN_NPM_CACHE ?? path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../../.cache/npm');
const require = createRequire(path.join(npmCache, 'package.json'));
const puppeteer = require('puppeteer-core');

const baseURL = process.env.KILN_BASE_URL;
const model = process.env.KILN_MODEL;
const chromium = process.env.KILN_CHROMIUM;
const apiKey = process.env.KILN_API_KEY ?? '';
if (!baseURL || !model || !chromium) throw new Error('set KILN_BASE_URL, KILN_MODEL and KILN_CHROMIUM');
if (!/^http:\/\/(127\.0\.0\.1|localhost)(:\d+)?$/.test(baseURL)) throw new Error('KILN_BASE_URL must be loopback');

const timeout = 60_000;
let browser;
let page;
const requested = [];  // every URL the page asked for

test.before(async () => {
  browser = await puppeteer.launch({
    executablePath: chromium,
    headless: true,
    pipe: true,
    // The sandbox needs user namespaces, which containers and root (CI) often lack; the page is
    // kiln's own, on loopback.
    args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'],
  });
});

test.after(async () => {
  await browser?.close();
});

async function openPage() {
  const opened = await browser.newPage();
  opened.setDefaultTimeout(timeout);
  opened.on('request', (request) => requested.push(request.url()));
  await opened.goto(`${baseURL}/`);
  return opened;
}

async function showsModel(opened) {
  await opened.waitForFunction((name) => document.getElementById('model').textContent === name, {}, model);
}

test.beforeEach(async () => {
  page = await openPage();
  if (apiKey) await page.locator('#api-key').fill(apiKey);
  await showsModel(page);
});

test.afterEach(async () => {
  await page.close();
});

async function fill(selector, value) {
  await page.locator(selector).fill(value);
}

// Sends `text` from the composer and waits for the answer to end; its element's state and text.
async function ask(text) {
  const before = await page.$$eval('.message.assistant', (answers) => answers.length);
  await page.type('#message', text);
  await page.keyboard.press('Enter');
  await page.waitForFunction(
    (count) => {
      const answers = document.querySelectorAll('.message.assistant');
      return answers.length > count && answers[answers.length - 1].dataset.state !== 'streaming';
    },
    {},
    before,
  );
  return page.$eval('.message.assistant:last-child', (answer) => ({
    state: answer.dataset.state,
    content: answer.querySelector('.content').textContent,
    stats: answer.querySelector('.stats')?.textContent ?? '',
    notice: answer.querySelector('.notice')?.textContent ?? '',
  }));
}

// The whole (non-streamed) answer of the API to `body`.
async function apiAnswer(body) {
  const response = await fetch(`${baseURL}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', ...(apiKey ? { Authorization: `Bearer ${apiKey}` } : {}) },
    body: JSON.stringify({ model, ...body }),
  });
  assert.equal(response.status, 200);
  const answer = await response.json();
  return { content: answer.choices[0].message.content, tokens: answer.usage.completion_tokens };
}

// The body of every /v1/chat/completions request the page sends from now on.
function chatRequests() {
  const bodies = [];
  page.on('request', (request) => {
    if (request.url().endsWith('/v1/chat/completions')) bodies.push(JSON.parse(request.postData()));
  });
  return bodies;
}

test('the page names the served model, after the API key, and asks nothing of any other origin', async () => {
  assert.equal(await page.title(), 'kiln chat');
  if (apiKey) {
    const keyless = await openPage();
    await keyless.waitForSelector('#model.error');
    assert.match(await keyless.$eval('#model', (label) => label.textContent), /^no model: a valid API key is required/);
    assert.equal(await keyless.$eval('#send', (button) => button.disabled), true);
    await keyless.type('#api-key', apiKey);
    await showsModel(keyless);
    assert.equal(await keyless.$eval('#send', (button) => button.disabled), false);
    await keyless.close();
  }
  assert.ok(requested.length > 0);
  for (const url of requested) assert.ok(url.startsWith(`${baseURL}/`), `the page requested ${url}`);
});

test('a message streams in the answer the API gives for the same request at temperature 0', async () => {
  await fill('#temperature', '0');
  await fill('#max-tokens', '40');
  const bodies = chatRequests();
  // Counts the times the answer's text changed: a streamed answer arrives in several pieces.
  await page.evaluate(() => {
    window.answerUpdates = 0;
    new MutationObserver(() => (window.answerUpdates += 1)).observe(document.getElementById('messages'), {
      subtree: true,
      childList: true,
      characterData: true,
    });
  });
  const answer = await ask('Once upon a time');
  assert.equal(answer.state, 'done');
  assert.deepEqual(bodies[0], {
    model,
    messages: [{ role: 'user', content: 'Once upon a time' }],
    stream: true,
    stream_options: { include_usage: true },
    temperature: 0,
    max_tokens: 40,
  });
  const expected = await apiAnswer({ messages: bodies[0].messages, temperature: 0, max_tokens: 40 });
  assert.ok(expected.content.length > 0);
  assert.equal(answer.content, expected.content);
  assert.ok((await page.evaluate(() => window.answerUpdates)) > 4, 'the answer did not arrive in pieces');
  assert.match(answer.stats, new RegExp(`^${expected.tokens} tokens · [0-9.]+ tok/s · first token after [0-9.]+ s`));
});

test('the next message carries the conversation and the system prompt', async () => {
  await fill('#temperature', '0');
  await fill('#max-tokens', '24');
  await fill('#system', 'A story.');
  const bodies = chatRequests();
  const first = await ask('The dog ran');
  const second = await ask('Then the cat');
  assert.equal(second.state, 'done');
  assert.deepEqual(bodies[1].messages, [
    { role: 'system', content: 'A story.' },
    { role: 'user', content: 'The dog ran' },
    { role: 'assistant', content: first.content },
    { role: 'user', content: 'Then the cat' },
  ]);
  const expected = await apiAnswer({ messages: bodies[1].messages, temperature: 0, max_tokens: 24 });
  assert.equal(second.content, expected.content);
  // The settings outlive a reload; the conversation starts again with New chat.
  await page.reload();
  assert.equal(await page.$eval('#system', (field) => field.value), 'A story.');
  await page.click('#new-chat');
  assert.equal(await page.$$eval('.message', (messages) => messages.length), 0);
});

test('Stop ends a streaming answer where it is, and the chat goes on', async () => {
  await fill('#temperature', '0');
  await fill('#max-tokens', '400');
  // A slow link keeps the answer arriving long after the server wrote it all.
  const cdp = await page.createCDPSession();
  await cdp.send('Network.emulateNetworkConditions', {
    offline: false,
    latency: 0,
    downloadThroughput: 3000,
    uploadThroughput: -1,
  });
  await page.type('#message', 'Once upon a time');
  await page.keyboard.press('Enter');
  await page.waitForFunction(() => document.querySelector('.message.assistant .content')?.textContent.length > 0);
  await page.click('#stop');
  await page.waitForFunction(() => document.querySelector('.message.assistant').dataset.state !== 'streaming');
  const stopped = await page.$eval('.message.assistant', (answer) => ({
    state: answer.dataset.state,
    content: answer.querySelector('.content').textContent,
    stats: answer.querySelector('.stats')?.textContent ?? '',
  }));
  assert.equal(stopped.state, 'stopped');
  const whole = await apiAnswer({
    messages: [{ role: 'user', content: 'Once upon a time' }],
    temperature: 0,
    max_tokens: 400,
  });
  assert.ok(stopped.content.length < whole.content.length, 'the answer was not cut short');
  assert.ok(whole.content.startsWith(stopped.content));
  assert.match(stopped.stats, /^≈\d+ tokens/);
  await cdp.send('Network.emulateNetworkConditions', {
    offline: false,
    latency: 0,
    downloadThroughput: -1,
    uploadThroughput: -1,
  });
  await fill('#max-tokens', '8');
  assert.equal((await ask('The end')).state, 'done');
});

test('reasoning is shown folded, apart from the answer; a failure mid-stream is shown as an error', async () => {
  // Stands in for a reasoning model (stories260K has no <think>): the server's own event format.
  const event = (payload) => `data: ${JSON.stringify(payload)}\n\n`;
  const chunk = (delta, finish = null) =>
    event({ object: 'chat.completion.chunk', model, choices: [{ index: 0, delta, finish_reason: finish }] });
  const replies = [
    chunk({ role: 'assistant', content: '' }) +
      chunk({ reasoning_content: 'The user greets; ' }) +
      chunk({ reasoning_content: 'greet back.' }) +
      chunk({ content: 'Hello' }) +
      chunk({ content: ' there.' }) +
      chunk({}, 'stop') +
      event({ choices: [], usage: { prompt_tokens: 5, completion_tokens: 9, total_tokens: 14 } }) +
      'data: [DONE]\n\n',
    chunk({ content: 'Half' }) +
      event({ error: { message: 'the server is shutting down', type: 'server_error' } }),
  ];
  await page.setRequestInterception(true);
  page.on('request', (request) => {
    if (!request.url().endsWith('/v1/chat/completions')) return request.continue();
    return request.respond({ status: 200, contentType: 'text/event-stream', body: replies.shift() });
  });
  const answer = await ask('Hi');
  assert.equal(answer.state, 'done');
  assert.equal(answer.content, 'Hello there.');
  assert.match(answer.stats, /^9 tokens/);
  const reasoning = await page.$eval('.message.assistant .reasoning', (details) => ({
    open: details.open,
    text: details.querySelector('div').textContent,
  }));
  assert.deepEqual(reasoning, { open: false, text: 'The user greets; greet back.' });
  const failed = await ask('Again');
  assert.equal(failed.state, 'error');
  assert.equal(failed.content, 'Half');
  assert.equal(failed.notice, 'error: the server is shutting down');
});

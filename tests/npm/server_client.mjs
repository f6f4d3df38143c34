// Drives a running `kiln serve` with the official openai and @anthropic-ai/sdk npm clients.
// Run by tests/server_test.cpp (ServerNpm.*) against stories260K (models/stories260K) served with its
// own chat template; standalone:
//   KILN_BASE_URL=http://127.0.0.1:PORT KILN_MODEL=stories260K node tests/npm/server_client.mjs
import test from 'node:test';
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const npmCache =
  process.env.KILN_NPM_CACHE ?? path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../../.cache/npm');
const require = createRequire(path.join(npmCache, 'package.json'));
const { OpenAI } = require('openai');
const { Anthropic } = require('@anthropic-ai/sdk');

const baseURL = process.env.KILN_BASE_URL;
const model = process.env.KILN_MODEL;
if (!baseURL || !model) throw new Error('set KILN_BASE_URL and KILN_MODEL');
if (!/^http:\/\/(127\.0\.0\.1|localhost)(:\d+)?$/.test(baseURL)) throw new Error('KILN_BASE_URL must be loopback');

const openai = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: 'kiln-test', maxRetries: 0, timeout: 60_000 });
const anthropic = new Anthropic({ baseURL, apiKey: 'kiln-test', maxRetries: 0, timeout: 60_000 });
const user = (content) => [{ role: 'user', content }];
const story = 'Once upon a time, there was a little dog';

async function streamChat(params, signal) {
  const stream = await openai.chat.completions.create({ model, ...params, stream: true }, { signal });
  let text = '';
  let finish = null;
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices) {
      text += choice.delta?.content ?? '';
      if (choice.finish_reason) finish = choice.finish_reason;
    }
  }
  return { text, finish, usage };
}

async function metric(name) {
  const text = await (await fetch(`${baseURL}/metrics`)).text();
  // Every series carries the server's model_name label.
  const line = text.split('\n').find((l) => l.startsWith(`${name}{model_name=`));
  return line === undefined ? undefined : Number(line.split(' ')[1]);
}

async function cancelledCount() {
  const text = await (await fetch(`${baseURL}/metrics`)).text();
  return text
    .split('\n')
    .filter((l) => l.startsWith('kiln_requests_total{') && l.includes('finish_reason="cancelled"'))
    .reduce((sum, l) => sum + Number(l.split(' ')[1]), 0);
}

test('chat completion: text, finish reason and usage', async () => {
  const response = await openai.chat.completions.create({ model, messages: user(story), max_tokens: 40, temperature: 0 });
  const choice = response.choices[0];
  assert.equal(response.object, 'chat.completion');
  assert.equal(choice.message.role, 'assistant');
  assert.ok(choice.message.content.length > 0);
  assert.ok(['stop', 'length'].includes(choice.finish_reason));
  const usage = response.usage;
  assert.ok(usage.prompt_tokens > 5);
  assert.equal(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens);
  if (choice.finish_reason === 'length') assert.equal(usage.completion_tokens, 40);
  else assert.ok(usage.completion_tokens <= 40);
});

test('a fixed number of tokens with ignore_eos, counted in usage and logprobs', async () => {
  const response = await openai.chat.completions.create({
    model, messages: user(story), max_tokens: 25, temperature: 0.7, seed: 5, ignore_eos: true, logprobs: true, top_logprobs: 3,
  });
  const choice = response.choices[0];
  assert.equal(choice.finish_reason, 'length');
  assert.equal(response.usage.completion_tokens, 25);
  assert.equal(choice.logprobs.content.length, 25);
  for (const entry of choice.logprobs.content) {
    assert.ok(entry.logprob <= 0);
    assert.equal(entry.top_logprobs.length, 3);
    assert.ok(entry.top_logprobs[0].logprob >= entry.top_logprobs[2].logprob);
  }
  assert.equal(choice.logprobs.content.map((e) => e.token).join(''), choice.message.content);
});

test('streaming gives the same text and usage as a plain response', async () => {
  const params = { messages: user(story), max_tokens: 48, temperature: 0 };
  const plain = await openai.chat.completions.create({ model, ...params });
  const streamed = await streamChat({ ...params, stream_options: { include_usage: true } });
  assert.equal(streamed.text, plain.choices[0].message.content);
  assert.equal(streamed.finish, plain.choices[0].finish_reason);
  assert.deepEqual(streamed.usage, plain.usage);
});

test('stop strings cut the text before the match, streamed or not', async () => {
  const params = { messages: user(story), max_tokens: 80, temperature: 0, ignore_eos: true };
  const full = (await openai.chat.completions.create({ model, ...params })).choices[0].message.content;
  assert.ok(full.length > 40, `too short to cut: ${JSON.stringify(full)}`);
  const middle = Math.floor(full.length / 2);
  const stop = full.slice(middle, middle + 5);
  const expected = full.slice(0, full.indexOf(stop));
  const cut = await openai.chat.completions.create({ model, ...params, stop: [stop, 'NEVER-PRODUCED'] });
  assert.equal(cut.choices[0].message.content, expected);
  assert.equal(cut.choices[0].finish_reason, 'stop');
  assert.ok(cut.usage.completion_tokens < 80);
  const streamed = await streamChat({ ...params, stop });
  assert.equal(streamed.text, expected);
  assert.equal(streamed.finish, 'stop');
});

test('the same seed gives the same text; another seed another text', async () => {
  const params = { model, messages: user(story), max_tokens: 40, temperature: 1.0, ignore_eos: true };
  const first = await openai.chat.completions.create({ ...params, seed: 1234 });
  const again = await openai.chat.completions.create({ ...params, seed: 1234 });
  const other = await openai.chat.completions.create({ ...params, seed: 4321 });
  assert.equal(again.choices[0].message.content, first.choices[0].message.content);
  assert.notEqual(other.choices[0].message.content, first.choices[0].message.content);
});

test('32 parallel streams each equal their solo run', async () => {
  const openings = ['Once upon a time', 'The cat', 'Lily wanted', 'One day, a big', 'Tom and Sue'];
  const requests = Array.from({ length: 32 }, (_, i) => ({
    messages: user(openings[i % openings.length]),
    max_tokens: 20 + (i * 7) % 40,
    temperature: i % 3 === 0 ? 0 : 0.9,
    top_k: i % 2 ? 40 : undefined,
    seed: 100 + i,
  }));
  const solo = [];
  for (const request of requests) solo.push(await streamChat(request));
  const parallel = await Promise.all(requests.map((request) => streamChat(request)));
  for (let i = 0; i < requests.length; ++i) {
    assert.equal(parallel[i].text, solo[i].text, `request ${i}`);
    assert.equal(parallel[i].finish, solo[i].finish, `request ${i}`);
  }
});

test('an aborted stream is cancelled and frees its cache', async () => {
  const before = await cancelledCount();
  const controller = new AbortController();
  const stream = await openai.chat.completions.create(
    { model, messages: user(story), max_tokens: 400, temperature: 0.8, ignore_eos: true, stream: true },
    { signal: controller.signal });
  // The SDK ends the iteration quietly when its signal aborts the request.
  let chunks = 0;
  for await (const chunk of stream) {
    if (++chunks === 2) controller.abort();
  }
  assert.ok(chunks < 400, `the stream ran to its end (${chunks} chunks) instead of being aborted`);
  let running = 1;
  let used = 1;
  for (let i = 0; i < 100 && (running !== 0 || used !== 0); ++i) {
    await new Promise((resolve) => setTimeout(resolve, 50));
    running = await metric('kiln_requests_running');
    used = await metric('kiln_kv_cache_tokens_used');
  }
  assert.equal(running, 0);
  assert.equal(used, 0);
  assert.ok((await cancelledCount()) > before);
});

test('completions: text prompt, token-id prompt, logprobs, streaming', async () => {
  const response = await openai.completions.create({ model, prompt: story, max_tokens: 20, temperature: 0, logprobs: 2 });
  const choice = response.choices[0];
  assert.equal(response.object, 'text_completion');
  assert.equal(choice.logprobs.tokens.length, response.usage.completion_tokens);
  assert.equal(choice.logprobs.tokens.join(''), choice.text);
  assert.ok(choice.logprobs.top_logprobs.every((top) => Object.keys(top).length >= 1));
  const byIds = await openai.completions.create({ model, prompt: [1, 403, 407], max_tokens: 5, temperature: 0 });
  assert.equal(byIds.usage.prompt_tokens, 3);
  const stream = await openai.completions.create({
    model, prompt: story, max_tokens: 20, temperature: 0, stream: true, stream_options: { include_usage: true } });
  let text = '';
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) text += c.text;
  }
  assert.equal(text, choice.text);
  assert.deepEqual(usage, response.usage);
});

test('models and errors', async () => {
  const models = [];
  for await (const entry of openai.models.list()) models.push(entry.id);
  assert.deepEqual(models, [model]);
  await assert.rejects(
    openai.chat.completions.create({ model, messages: user('hi'), n: 0 }),
    (error) => error.status === 400 && error.param === 'n' && error.type === 'invalid_request_error');
  const schema = { type: 'object', properties: { n: { type: 'number', minimum: 0 } } };
  await assert.rejects(
    openai.chat.completions.create({
      model, messages: user('hi'), response_format: { type: 'json_schema', json_schema: { name: 's', schema } } }),
    (error) => error.status === 400 && error.param === 'response_format.json_schema.schema' &&
      error.message.includes('"minimum"'));
  const structured = await openai.chat.completions.create({
    model, messages: user('hi'), max_tokens: 100, temperature: 0,
    response_format: { type: 'json_schema', json_schema: { name: 's', schema: {
      type: 'object', properties: { ok: { type: 'boolean' } }, required: ['ok'] } } } });
  assert.deepEqual(Object.keys(JSON.parse(structured.choices[0].message.content)), ['ok']);
  await assert.rejects(
    openai.chat.completions.create({ model: 'gpt-4o', messages: user('hi') }),
    (error) => error.status === 404);
  await assert.rejects(
    openai.chat.completions.create({ model, messages: user('hi'), max_tokens: 100000 }),
    (error) => error.status === 400 && error.code === 'context_length_exceeded');
});

test('anthropic messages: same text as chat, usage, stop sequences', async () => {
  const chat = await openai.chat.completions.create({ model, messages: user(story), max_tokens: 30, temperature: 0 });
  const message = await anthropic.messages.create({ model, max_tokens: 30, temperature: 0, messages: user(story) });
  assert.equal(message.type, 'message');
  assert.equal(message.role, 'assistant');
  assert.equal(message.content[0].type, 'text');
  assert.equal(message.content[0].text, chat.choices[0].message.content);
  assert.equal(message.usage.input_tokens, chat.usage.prompt_tokens);
  assert.equal(message.usage.output_tokens, chat.usage.completion_tokens);
  assert.equal(message.stop_reason, chat.choices[0].finish_reason === 'length' ? 'max_tokens' : 'end_turn');

  const text = message.content[0].text;
  const stop = text.slice(Math.floor(text.length / 2), Math.floor(text.length / 2) + 4);
  const stopped = await anthropic.messages.create({
    model, max_tokens: 30, temperature: 0, messages: user(story), stop_sequences: [stop] });
  assert.equal(stopped.stop_reason, 'stop_sequence');
  assert.equal(stopped.stop_sequence, stop);
  assert.equal(stopped.content[0].text, text.slice(0, text.indexOf(stop)));
});

test('anthropic streaming events', async () => {
  const plain = await anthropic.messages.create({ model, max_tokens: 30, temperature: 0, messages: user(story) });
  const stream = await anthropic.messages.create({
    model, max_tokens: 30, temperature: 0, messages: user(story), stream: true });
  const types = [];
  let text = '';
  let outputTokens = null;
  for await (const event of stream) {
    types.push(event.type);
    if (event.type === 'content_block_delta') text += event.delta.text;
    if (event.type === 'message_delta') outputTokens = event.usage.output_tokens;
  }
  assert.equal(types[0], 'message_start');
  assert.equal(types[1], 'content_block_start');
  assert.deepEqual(types.slice(-3), ['content_block_stop', 'message_delta', 'message_stop']);
  assert.equal(text, plain.content[0].text);
  assert.equal(outputTokens, plain.usage.output_tokens);
  const streamed = await anthropic.messages.stream({ model, max_tokens: 30, temperature: 0, messages: user(story) }).finalMessage();
  assert.equal(streamed.content[0].text, plain.content[0].text);
});

test('anthropic errors have the Anthropic shape', async () => {
  await assert.rejects(
    anthropic.messages.create({ model, messages: user('hi') }),
    (error) => error.status === 400 && error.error?.type === 'error' &&
      error.error?.error?.type === 'invalid_request_error');
});

// Drives a running `kiln serve --embeddings` with the official openai npm client. Run by
// tests/embedding_test.cpp (EmbeddingServer.*) against a copy of stories260K that declares mean
// pooling; standalone:
//   KILN_BASE_URL=http://127.0.0.1:PORT KILN_MODEL=NAME node tests/npm/embeddings_client.mjs
import test from 'node:test';
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const npmCache =
  process.env.KILN_NPM_CACHE ?? path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../../.cache/npm');
const require = createRequire(path.join(npmCache, 'package.json'));
const { OpenAI } = require('openai');

const baseURL = process.env.KILN_BASE_URL;
const model = process.env.KILN_MODEL;
if (!baseURL || !model) throw new Error('set KILN_BASE_URL and KILN_MODEL');
if (!/^http:\/\/(127\.0\.0\.1|localhost)(:\d+)?$/.test(baseURL)) throw new Error('KILN_BASE_URL must be loopback');

const openai = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: 'kiln-test', maxRetries: 0, timeout: 60_000 });
const input = ['Once upon a time', 'The cat sat on the mat.'];
const norm = (values) => Math.sqrt(values.reduce((sum, value) => sum + value * value, 0));

test("the client's default (base64, decoded by the client) gives the floats of encoding_format float", async () => {
  const decoded = await openai.embeddings.create({ model, input });
  const floats = await openai.embeddings.create({ model, input, encoding_format: 'float' });
  assert.equal(decoded.object, 'list');
  assert.equal(decoded.model, model);
  assert.equal(decoded.data.length, 2);
  decoded.data.forEach((item, index) => {
    assert.equal(item.object, 'embedding');
    assert.equal(item.index, index);
    assert.equal(item.embedding.length, 64);
    assert.ok(Math.abs(norm(item.embedding) - 1) < 1e-5);
    assert.deepEqual(Array.from(item.embedding), floats.data[index].embedding);
  });
  assert.ok(decoded.usage.prompt_tokens > 4);
  assert.equal(decoded.usage.total_tokens, decoded.usage.prompt_tokens);
});

test('dimensions keeps that many values, normalised', async () => {
  const response = await openai.embeddings.create({ model, input: input[0], dimensions: 16 });
  assert.equal(response.data[0].embedding.length, 16);
  assert.ok(Math.abs(norm(response.data[0].embedding) - 1) < 1e-5);
});

test('a bad request is a 400 the client raises', async () => {
  await assert.rejects(openai.embeddings.create({ model, input: '' }), (error) => {
    assert.ok(error instanceof OpenAI.BadRequestError);
    assert.equal(error.status, 400);
    assert.equal(error.param, 'input');
    return true;
  });
});

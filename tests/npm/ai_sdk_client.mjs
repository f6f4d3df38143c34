// Drives a running `kiln serve` with the Vercel AI SDK (`ai` with @ai-sdk/openai-compatible) and zod
// schemas: forced tool calls (generateText / streamText with toolChoice) and structured output
// (generateObject / streamObject, i.e. response_format json_schema), each whole and streamed; the
// SDK parses and validates every call's input and every object against its zod schema itself.
// Run by tests/structured_output_test.cpp (StructuredOutputNpm.*) against stories260K served with a
// small chat template in the Hermes tool-call syntax; standalone:
//   KILN_BASE_URL=http://127.0.0.1:PORT KILN_MODEL=stories260K node tests/npm/ai_sdk_client.mjs
import test from 'node:test';
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const npmCache =
  process.env.KILN_NPM_CACHE ?? path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../../.cache/npm');
const require = createRequire(path.join(npmCache, 'package.json'));
const { createOpenAICompatible } = require('@ai-sdk/openai-compatible');
const { generateText, streamText, generateObject, streamObject, tool } = require('ai');
const { z } = require('zod');

const baseURL = process.env.KILN_BASE_URL;
const modelName = process.env.KILN_MODEL;
if (!baseURL || !modelName) throw new Error('set KILN_BASE_URL and KILN_MODEL');
if (!/^http:\/\/(127\.0\.0\.1|localhost)(:\d+)?$/.test(baseURL)) throw new Error('KILN_BASE_URL must be loopback');

const kiln = createOpenAICompatible({
  name: 'kiln',
  baseURL: `${baseURL}/v1`,
  apiKey: 'kiln-test',
  supportsStructuredOutputs: true,
});
const model = kiln.chatModel(modelName);
const common = { model, maxRetries: 0, temperature: 1, seed: 4 };

// Integers: zod writes their bounds (the safe-integer ones for a bare z.number().int()) as minimum
// and maximum, which kiln compiles to exact digit grammars.
const tools = {
  go: tool({ description: 'Walk somewhere', inputSchema: z.object({ to: z.enum(['N', 'S']) }) }),
  add: tool({
    description: 'Add things',
    inputSchema: z.object({
      a: z.enum(['one', 'two']), b: z.boolean(), times: z.number().int().min(1).max(12),
      note: z.string().max(12).optional(),
    }),
  }),
};

const story = z.object({
  title: z.string().max(24),
  year: z.number().int(),
  mood: z.enum(['happy', 'sad', 'sleepy']),
  friends: z.array(z.string().max(10)).min(1).max(3),
  ending: z.boolean(),
});

test('generateText with a required tool call', async () => {
  // One call: "required" otherwise lets the model go on writing calls (providerOptions under the
  // provider's name become body fields).
  const result = await generateText({
    ...common,
    tools,
    toolChoice: 'required',
    providerOptions: { kiln: { parallel_tool_calls: false } },
    prompt: 'Add',
    maxOutputTokens: 120,
  });
  assert.equal(result.finishReason, 'tool-calls');
  assert.equal(result.toolCalls.length, 1);
  for (const call of result.toolCalls) {
    assert.ok(call.toolName in tools, call.toolName);
    assert.equal(call.invalid, undefined, JSON.stringify(call));
    tools[call.toolName].inputSchema.parse(call.input);
  }
});

test('streamText with a named tool: the call starts first, its input streams in pieces', async () => {
  const result = streamText({
    ...common,
    tools,
    toolChoice: { type: 'tool', toolName: 'add' },
    prompt: 'Add',
    maxOutputTokens: 120,
  });
  const starts = [];
  const deltas = [];
  const calls = [];
  for await (const part of result.fullStream) {
    if (part.type === 'error') throw part.error;
    if (part.type === 'tool-input-start') starts.push(part.toolName);
    if (part.type === 'tool-input-delta') deltas.push(part.delta);
    if (part.type === 'tool-call') calls.push(part);
  }
  assert.deepEqual(starts, ['add']);
  assert.ok(deltas.length > 1, `the input came in ${deltas.length} piece(s)`);
  assert.equal(calls.length, 1);
  assert.deepEqual(JSON.parse(deltas.join('')), calls[0].input);
  tools.add.inputSchema.parse(calls[0].input);
  assert.equal(await result.finishReason, 'tool-calls');
});

test('generateObject with a zod schema', async () => {
  const { object, finishReason } = await generateObject({
    ...common,
    schema: story,
    schemaName: 'story',
    prompt: 'Tell me a story.',
    maxOutputTokens: 300,
  });
  assert.equal(finishReason, 'stop');
  story.parse(object);
});

test('streamObject with a zod schema: partial objects, then the whole one', async () => {
  const result = streamObject({
    ...common,
    seed: 9,
    schema: story,
    schemaName: 'story',
    prompt: 'Tell me a story.',
    maxOutputTokens: 300,
  });
  let partials = 0;
  for await (const partial of result.partialObjectStream) {
    assert.equal(typeof partial, 'object');
    partials += 1;
  }
  assert.ok(partials > 1, `${partials} partial object(s)`);
  story.parse(await result.object);
});

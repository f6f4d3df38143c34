// Load benchmark for a running `kiln serve`: throughput and time-to-first-token at several
// concurrency levels. Each client sends streamed chat completions back to back; the first content
// chunk of each stream marks its time to first token, and the usage chunk counts its tokens.
//
//   node bench/serve_load.mjs --url http://127.0.0.1:8080 --model stories260K \
//        [--concurrency 1,8,32] [--requests 8] [--max-tokens 128] [--json]
//
// Uses only Node's fetch (no npm packages). Loopback addresses only.
const args = Object.fromEntries(
  process.argv.slice(2).reduce((pairs, arg, i, all) => {
    if (arg.startsWith('--')) pairs.push([arg.slice(2), all[i + 1]?.startsWith('--') ? 'true' : all[i + 1] ?? 'true']);
    return pairs;
  }, []));
const url = args.url ?? 'http://127.0.0.1:8080';
if (!/^http:\/\/(127\.\d+\.\d+\.\d+|localhost|\[::1\])(:\d+)?$/.test(url)) throw new Error('--url must be a loopback address');
const model = args.model ?? 'stories260K';
const levels = (args.concurrency ?? '1,8,32').split(',').map(Number);
const requestsPerClient = Number(args.requests ?? 8);
const maxTokens = Number(args['max-tokens'] ?? 128);
const prompts = ['Once upon a time', 'The little dog', 'Lily and Tom went to the park', 'One day, a big bird', 'The sun was'];

async function streamOnce(index) {
  const started = performance.now();
  const response = await fetch(`${url}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({
      model,
      messages: [{ role: 'user', content: prompts[index % prompts.length] }],
      max_tokens: maxTokens,
      temperature: 0.8,
      seed: index,
      ignore_eos: true,
      stream: true,
      stream_options: { include_usage: true },
    }),
  });
  if (!response.ok) throw new Error(`HTTP ${response.status}: ${await response.text()}`);
  const decoder = new TextDecoder();
  let buffer = '';
  let firstToken = null;
  let tokens = 0;
  for await (const bytes of response.body) {
    buffer += decoder.decode(bytes, { stream: true });
    let end;
    while ((end = buffer.indexOf('\n\n')) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (!event.startsWith('data: ') || event === 'data: [DONE]') continue;
      const chunk = JSON.parse(event.slice(6));
      if (chunk.error) throw new Error(chunk.error.message);
      if (firstToken === null && chunk.choices?.[0]?.delta?.content) firstToken = performance.now() - started;
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
    }
  }
  return { ttft: firstToken, tokens, seconds: (performance.now() - started) / 1000 };
}

function percentile(values, p) {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1))];
}

async function runLevel(concurrency) {
  const results = [];
  const started = performance.now();
  await Promise.all(Array.from({ length: concurrency }, async (_, client) => {
    for (let r = 0; r < requestsPerClient; ++r) results.push(await streamOnce(client * requestsPerClient + r));
  }));
  const wall = (performance.now() - started) / 1000;
  const ttfts = results.map((r) => r.ttft);
  const tokens = results.reduce((sum, r) => sum + r.tokens, 0);
  return {
    concurrency,
    requests: results.length,
    tokens,
    wall_seconds: wall,
    throughput_tokens_per_second: tokens / wall,
    requests_per_second: results.length / wall,
    ttft_p50_ms: percentile(ttfts, 50),
    ttft_p99_ms: percentile(ttfts, 99),
  };
}

await streamOnce(0);  // warm-up
const report = [];
for (const level of levels) report.push(await runLevel(level));
if (args.json === 'true') {
  console.log(JSON.stringify({ url, model, max_tokens: maxTokens, requests_per_client: requestsPerClient, levels: report }, null, 2));
} else {
  console.log(`model ${model}, ${maxTokens} tokens per request, ${requestsPerClient} requests per client`);
  console.log('| clients | requests | tokens | wall s | tokens/s | requests/s | TTFT p50 ms | TTFT p99 ms |');
  console.log('|---:|---:|---:|---:|---:|---:|---:|---:|');
  for (const r of report)
    console.log(`| ${r.concurrency} | ${r.requests} | ${r.tokens} | ${r.wall_seconds.toFixed(2)} | ` +
      `${r.throughput_tokens_per_second.toFixed(0)} | ${r.requests_per_second.toFixed(1)} | ` +
      `${r.ttft_p50_ms.toFixed(1)} | ${r.ttft_p99_ms.toFixed(1)} |`);
}

#!/usr/bin/env python3
"""Load benchmark for a running `kiln serve`: throughput, time to first token and inter-token
latency at several concurrency levels, and the multi-turn prefix-cache benchmark of issue 30.

Python 3 standard library only (it runs on the GPU machine, which has Python but no Node.js);
loopback addresses only. Each request is a streamed completion sent over HTTP/1.0 (the body then
ends when the server closes the connection, so no chunked decoding is needed).

Load (each client sends its requests back to back):

  python3 bench/serve_load.py --url http://127.0.0.1:8080 --concurrency 8,64 --requests 4 \
      --prompt-tokens 128 --max-tokens 128

  With --prompt-tokens N every prompt is N token ids drawn from a seeded generator (for `kiln
  synth` checkpoints, whose vocabulary has no text worth sending) on /v1/completions; without it,
  short TinyStories openings go to /v1/chat/completions. Every request sets ignore_eos, so it
  generates exactly --max-tokens tokens. Reported per level: generated tokens over wall time, time
  to first token p50/p99 (request sent → first chunk with a token) and inter-token p99 (the gaps
  between a stream's successive token chunks, over all streams).

Multi-turn prefix reuse (issue 30: a system prompt and a history that grows every turn):

  python3 bench/serve_load.py --url http://127.0.0.1:8080 --multi-turn 10 --system-tokens 2048 \
      --turn-tokens 256 --max-tokens 8

  Turn t's prompt is the system prompt and t·turn-tokens of history, each turn extending the one
  before, so a prefix cache holds all but the newest tokens. Before each turn a prompt of the same
  length that shares nothing with any other (a cold prefill) is timed too. Reported per turn: cold
  and warm time to first token, their ratio, and the cached tokens the server reports
  (usage.prompt_tokens_details.cached_tokens).
"""
import argparse
import asyncio
import json
import random
import re
import sys
import time
import urllib.parse
import urllib.request

STORY_OPENINGS = ['Once upon a time', 'The little dog', 'Lily and Tom went to the park',
                  'One day, a big bird', 'The sun was']


def percentile(values, p):
    ordered = sorted(values)
    if not ordered:
        return float('nan')
    rank = min(len(ordered) - 1, max(0, -(-p * len(ordered) // 100) - 1))
    return ordered[rank]


class Stream:
    """One streamed request's timings."""

    def __init__(self):
        self.ttft = None        # seconds from sending to the first token chunk
        self.gaps = []          # seconds between successive token chunks
        self.tokens = 0         # completion tokens, from the usage chunk
        self.cached_tokens = 0  # prompt tokens served from the prefix cache, from the usage chunk
        self.seconds = 0.0


async def stream_request(host, port, path, body):
    """Sends `body` as a streamed request and times the chunks that carry tokens."""
    stream = Stream()
    payload = json.dumps({**body, 'stream': True, 'stream_options': {'include_usage': True}}).encode()
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write((f'POST {path} HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\n'
                  f'Content-Length: {len(payload)}\r\n\r\n').encode() + payload)
    await writer.drain()
    status = await reader.readline()
    if not re.match(rb'HTTP/1\.[01] 200', status):
        rest = await reader.read()
        writer.close()
        raise RuntimeError(f'{status.decode().strip()}: {rest.decode(errors="replace")[-400:]}')
    while (await reader.readline()) not in (b'\r\n', b'\n', b''):
        pass
    last_token_at = None
    async for line in reader:
        if not line.startswith(b'data: ') or line.startswith(b'data: [DONE]'):
            continue
        chunk = json.loads(line[6:])
        if 'error' in chunk:
            raise RuntimeError(chunk['error'].get('message', str(chunk['error'])))
        now = time.perf_counter()
        choice = (chunk.get('choices') or [{}])[0]
        text = choice.get('text') if 'text' in choice else (choice.get('delta') or {}).get('content')
        if text:
            if last_token_at is None:
                stream.ttft = now - started
            else:
                stream.gaps.append(now - last_token_at)
            last_token_at = now
        usage = chunk.get('usage')
        if usage:
            stream.tokens = usage.get('completion_tokens', 0)
            stream.cached_tokens = (usage.get('prompt_tokens_details') or {}).get('cached_tokens', 0)
    writer.close()
    stream.seconds = time.perf_counter() - started
    if stream.ttft is None:
        raise RuntimeError(f'{path}: the stream carried no token')
    return stream


def request_body(args, rng, index):
    if args.prompt_tokens:
        prompt = [rng.randrange(args.token_low, args.token_high) for _ in range(args.prompt_tokens)]
        return '/v1/completions', {'model': args.model, 'prompt': prompt, 'max_tokens': args.max_tokens,
                                   'temperature': 0.8, 'seed': index, 'ignore_eos': True}
    return '/v1/chat/completions', {
        'model': args.model, 'max_tokens': args.max_tokens, 'temperature': 0.8, 'seed': index,
        'ignore_eos': True, 'messages': [{'role': 'user', 'content': STORY_OPENINGS[index % len(STORY_OPENINGS)]}]}


async def run_level(args, host, port, concurrency):
    rng = random.Random(concurrency)
    streams = []

    async def client(number):
        for r in range(args.requests):
            path, body = request_body(args, rng, number * args.requests + r)
            streams.append(await stream_request(host, port, path, body))

    started = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(concurrency)))
    wall = time.perf_counter() - started
    tokens = sum(s.tokens for s in streams)
    gaps = [g for s in streams for g in s.gaps]
    return {'concurrency': concurrency, 'requests': len(streams), 'tokens': tokens, 'wall_seconds': wall,
            'tokens_per_second': tokens / wall, 'requests_per_second': len(streams) / wall,
            'ttft_p50_ms': 1e3 * percentile([s.ttft for s in streams], 50),
            'ttft_p99_ms': 1e3 * percentile([s.ttft for s in streams], 99),
            'inter_token_p50_ms': 1e3 * percentile(gaps, 50),
            'inter_token_p99_ms': 1e3 * percentile(gaps, 99)}


async def run_multi_turn(args, host, port):
    rng = random.Random(2048)

    def tokens(count):
        return [rng.randrange(args.token_low, args.token_high) for _ in range(count)]

    def body(prompt, seed):
        return {'model': args.model, 'prompt': prompt, 'max_tokens': args.max_tokens, 'temperature': 0.0,
                'seed': seed, 'ignore_eos': True}

    conversation = tokens(args.system_tokens)
    turns = []
    for turn in range(1, args.multi_turn + 1):
        conversation += tokens(args.turn_tokens)
        cold = await stream_request(host, port, '/v1/completions', body(tokens(len(conversation)), turn))
        warm = await stream_request(host, port, '/v1/completions', body(conversation, turn))
        turns.append({'turn': turn, 'prompt_tokens': len(conversation), 'cold_ttft_ms': 1e3 * cold.ttft,
                      'warm_ttft_ms': 1e3 * warm.ttft, 'ratio': warm.ttft / cold.ttft,
                      'cached_tokens': warm.cached_tokens, 'cold_cached_tokens': cold.cached_tokens})
    return turns


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--url', default='http://127.0.0.1:8080')
    parser.add_argument('--model', help="the served model's name (default: the first of /v1/models)")
    parser.add_argument('--concurrency', default='1,8,32', help='comma-separated client counts')
    parser.add_argument('--requests', type=int, default=8, help='requests per client and level')
    parser.add_argument('--max-tokens', type=int, default=128)
    parser.add_argument('--prompt-tokens', type=int, default=0, help='token-id prompts of this length')
    parser.add_argument('--token-low', type=int, default=1000, help='the lowest token id drawn')
    parser.add_argument('--token-high', type=int, default=30000, help='one past the highest token id drawn')
    parser.add_argument('--multi-turn', type=int, default=0, help='run the multi-turn benchmark for this many turns')
    parser.add_argument('--system-tokens', type=int, default=2048)
    parser.add_argument('--turn-tokens', type=int, default=256)
    parser.add_argument('--json', action='store_true')
    args = parser.parse_args()
    url = urllib.parse.urlparse(args.url)
    if url.scheme != 'http' or url.hostname not in ('127.0.0.1', 'localhost', '::1'):
        sys.exit('serve_load: --url must be an http:// loopback address')
    host, port = url.hostname, url.port or 80
    if not args.model:
        with urllib.request.urlopen(f'{args.url}/v1/models') as response:
            args.model = json.load(response)['data'][0]['id']

    if args.multi_turn:
        turns = asyncio.run(run_multi_turn(args, host, port))
        if args.json:
            print(json.dumps({'url': args.url, 'turns': turns}, indent=2))
            return
        print(f'system prompt {args.system_tokens} tokens, {args.turn_tokens} more a turn, {args.max_tokens} generated')
        print('| turn | prompt tokens | cached tokens | cold TTFT ms | warm TTFT ms | warm / cold |')
        print('|---:|---:|---:|---:|---:|---:|')
        for t in turns:
            print(f"| {t['turn']} | {t['prompt_tokens']} | {t['cached_tokens']} | {t['cold_ttft_ms']:.1f} | "
                  f"{t['warm_ttft_ms']:.1f} | {t['ratio']:.3f} |")
        return

    asyncio.run(stream_request(host, port, *request_body(args, random.Random(0), 0)))  # warm-up
    report = [asyncio.run(run_level(args, host, port, int(level))) for level in args.concurrency.split(',')]
    if args.json:
        print(json.dumps({'url': args.url, 'max_tokens': args.max_tokens, 'prompt_tokens': args.prompt_tokens,
                          'requests_per_client': args.requests, 'levels': report}, indent=2))
        return
    print(f'{args.max_tokens} tokens per request, {args.requests} requests per client'
          + (f', {args.prompt_tokens}-token prompts' if args.prompt_tokens else ''))
    print('| clients | requests | tokens | wall s | tokens/s | requests/s | TTFT p50 ms | TTFT p99 ms | inter-token p99 ms |')
    print('|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
    for r in report:
        print(f"| {r['concurrency']} | {r['requests']} | {r['tokens']} | {r['wall_seconds']:.2f} | "
              f"{r['tokens_per_second']:.0f} | {r['requests_per_second']:.1f} | {r['ttft_p50_ms']:.1f} | "
              f"{r['ttft_p99_ms']:.1f} | {r['inter_token_p99_ms']:.1f} |")


if __name__ == '__main__':
    main()

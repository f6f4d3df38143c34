#!/usr/bin/env python3
"""Soak test for `kiln serve` (issue 33): many concurrent clients for a long time, then checks.

Starts `kiln serve` itself on port 0 (or uses --url), records each prompt's answer alone, then runs
--clients concurrent clients for --duration seconds. Each client loops over a fixed set of seeded
prompts: streamed (SSE) and whole requests; a third of its streams are closed after a few chunks;
some of its requests are garbage (malformed HTTP or JSON, truncated or oversized) that must get
their documented 4xx. It then checks:

  * nothing lost or mixed: every completed answer (text, finish reason, token count) equals the
    prompt's solo answer, every completed stream keeps one id and ends with a finish reason (or an
    error event) and [DONE] (message_stop on /v1/messages), and no request outlives its deadline;
  * 429 (queue full) and 503 (connection or request cap) are answers: they are retried after Retry-After and
    counted, not lost;
  * RSS flat: the server's RSS, threads and file descriptors are sampled every few seconds; the RSS
    growth after warm-up must stay under --max-rss-growth-mib;
  * no stuck requests: once the clients stop, /metrics must show no running or waiting request, and
    the server's threads and descriptors must come back to their level before the load;
  * health always answering: a probe opens a connection to /health every second; any failure, and
    the worst latency, are reported.

Prints a summary (and --json-out) and exits 1 when a check fails. Python 3 standard library only;
traffic goes to loopback addresses only. Kept out of CI: a full run takes --duration plus a minute.

  python3 bench/soak.py --duration 60 --clients 200                 # a short run
  python3 bench/soak.py                                             # 1,000 clients, 10 minutes
  python3 bench/soak.py --server-binary build/kiln --device cuda --model DIR
  python3 bench/soak.py --url http://127.0.0.1:8080 --server-pid PID
"""
import argparse
import asyncio
import collections
import json
import os
import random
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Story openings in the style of TinyStories, the data stories260K was trained on.
OPENINGS = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park",
    "One day, a big bird",
    "The sun was",
    "Tim had a red ball",
    "Sue liked to",
    "There was a cat named",
]

# The server's 503s when it is full (src/server/http_server.cpp): a connection over
# --max-connections, and a complete request over --max-concurrent-requests. Both carry Retry-After
# and are answers, not losses.
OVERLOAD_503_MESSAGES = (b"too many open connections", b"as many requests as it may at once")


def is_overload_503(status, payload):
    return status == 503 and any(message in payload for message in OVERLOAD_503_MESSAGES)

EXAMPLES_KEPT = 5  # failures of each kind kept verbatim for the report


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server = parser.add_argument_group("server (started here unless --url is given)")
    server.add_argument("--url", help="a running server (loopback only); then RSS is sampled only with --server-pid")
    server.add_argument("--server-pid", type=int, help="the pid of the --url server, for RSS/threads/fds")
    server.add_argument("--server-binary", default=os.path.join(REPO_ROOT, "build", "kiln"))
    server.add_argument("--model", default=os.path.join(REPO_ROOT, "models", "stories260K"))
    server.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    server.add_argument("--chat-template",
                        help="a Jinja chat template for kiln serve instead of the model's own"
                             "; also soaks /v1/chat/completions and /v1/messages")
    server.add_argument("--chat", action="store_true",
                        help="also soak /v1/chat/completions and /v1/messages with the model's own chat template")
    server.add_argument("--server-arg", action="append", default=[],
                        help="an extra argument for kiln serve (repeat it), e.g. --server-arg=--max-batch=16")
    server.add_argument("--server-request-timeout", type=float, default=10,
                        help="kiln serve --request-timeout: a truncated body must get 408 after it")
    server.add_argument("--max-body-bytes", type=int, default=8 << 20, help="the server's --max-body-bytes (413 beyond)")
    server.add_argument("--max-header-bytes", type=int, default=64 << 10, help="the server's header limit (431 beyond)")
    load = parser.add_argument_group("load")
    load.add_argument("--clients", type=int, default=1000)
    load.add_argument("--duration", type=float, default=600, help="seconds of load (default 10 minutes)")
    load.add_argument("--prompts", type=int, default=24, help="size of the fixed prompt set")
    load.add_argument("--seed", type=int, default=33, help="seeds the prompt set and the clients' choices")
    load.add_argument("--stream-fraction", type=float, default=0.6, help="requests that stream (SSE)")
    load.add_argument("--disconnect-fraction", type=float, default=1 / 3, help="streams closed after a few chunks")
    load.add_argument("--abandon-fraction", type=float, default=0.05, help="whole requests closed before the answer")
    load.add_argument("--garbage-fraction", type=float, default=0.05, help="requests that are malformed on purpose")
    load.add_argument("--request-deadline", type=float, default=180,
                      help="seconds one attempt may take before it counts as stuck")
    checks = parser.add_argument_group("checks")
    checks.add_argument("--warmup", type=float, help="seconds before RSS growth is measured (default: 10%% of the run)")
    checks.add_argument("--max-rss-growth-mib", type=float, default=32)
    checks.add_argument("--max-health-latency", type=float, default=2.0, help="seconds a /health answer may take")
    checks.add_argument("--sample-interval", type=float, default=2.0, help="seconds between RSS samples")
    checks.add_argument("--json-out", help="write the figures and verdicts to this file")
    args = parser.parse_args()
    if args.warmup is None:
        args.warmup = max(5.0, args.duration / 10)
    return args


# ---------------------------------------------------------------- the prompt set

def make_prompts(count, seed):
    """A fixed set of prompts: a quarter greedy, the rest at temperature 0.8 with their own seed;
    some end on a stop string so that both finish reasons occur."""
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        prompt = {
            "text": OPENINGS[index % len(OPENINGS)],
            "temperature": 0.0 if index % 4 == 0 else 0.8,
            "seed": rng.randrange(1 << 31),
            "max_tokens": rng.choice([16, 32, 48, 64, 96]),
        }
        if index % 3 == 2:
            prompt["stop"] = ["."]
        prompts.append(prompt)
    return prompts


def request_body(endpoint, prompt, model, stream, include_usage):
    if endpoint == "/v1/completions":
        body = {"model": model, "prompt": prompt["text"]}
    else:
        body = {"model": model, "messages": [{"role": "user", "content": prompt["text"]}]}
    body.update(max_tokens=prompt["max_tokens"], temperature=prompt["temperature"], seed=prompt["seed"])
    if "stop" in prompt:
        body["stop_sequences" if endpoint == "/v1/messages" else "stop"] = prompt["stop"]
    if stream:
        body["stream"] = True
        if include_usage and endpoint != "/v1/messages":
            body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


# ---------------------------------------------------------------- raw HTTP/1.1

class ConnectionLost(Exception):
    """The server closed or reset the connection before (the rest of) its answer."""


def http_request(method, path, host, body=b"", keep_alive=True, extra_headers=()):
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    if body or method == "POST":
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += list(extra_headers)
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def read_line(reader):
    try:
        line = await reader.readuntil(b"\r\n")
    except asyncio.IncompleteReadError as error:
        raise ConnectionLost(f"closed mid-line after {len(error.partial)} bytes") from None
    except (ConnectionError, OSError) as error:
        raise ConnectionLost(str(error)) from None
    return line[:-2]


async def read_exactly(reader, count):
    try:
        return await reader.readexactly(count)
    except asyncio.IncompleteReadError as error:
        raise ConnectionLost(f"closed after {len(error.partial)} of {count} bytes") from None
    except (ConnectionError, OSError) as error:
        raise ConnectionLost(str(error)) from None


async def read_head(reader):
    """The status and the headers (names in lower case) of a response."""
    status_line = await read_line(reader)
    match = re.match(rb"HTTP/1\.[01] (\d{3})", status_line)
    if not match:
        raise ValueError(f"bad status line {status_line[:80]!r}")
    headers = {}
    while True:
        line = await read_line(reader)
        if not line:
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(match.group(1)), headers


async def body_pieces(reader, headers):
    """The body of a response, piece by piece as it arrives (chunks of a chunked body)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await read_line(reader)).split(b";")[0], 16)
            if size == 0:
                await read_line(reader)  # the empty trailer
                return
            data = await read_exactly(reader, size + 2)
            yield data[:-2]
    elif "content-length" in headers:
        yield await read_exactly(reader, int(headers["content-length"]))
    else:
        try:
            yield await reader.read()
        except (ConnectionError, OSError) as error:
            raise ConnectionLost(str(error)) from None


async def read_body(reader, headers):
    return b"".join([piece async for piece in body_pieces(reader, headers)])


async def sse_events(reader, headers):
    """(event name, data) of each server-sent event of a streamed body."""
    buffer = b""
    async for piece in body_pieces(reader, headers):
        buffer += piece
        while b"\n\n" in buffer:
            raw, buffer = buffer.split(b"\n\n", 1)
            name, data = "", []
            for line in raw.decode().split("\n"):
                if line.startswith("event: "):
                    name = line[len("event: "):]
                elif line.startswith("data: "):
                    data.append(line[len("data: "):])
            yield name, "\n".join(data)
    if buffer.strip():
        raise ValueError(f"the stream ended inside an event: {buffer[:80]!r}")


def close_writer(writer, reset=False):
    if reset:
        writer.transport.abort()
    else:
        writer.close()


# ---------------------------------------------------------------- answers

class Answer:
    """What one request produced, in a form comparable across endpoints and stream modes."""

    def __init__(self, text, finish_reason, completion_tokens):
        self.text = text
        self.finish_reason = finish_reason
        self.completion_tokens = completion_tokens

    def differences(self, reference):
        found = []
        if self.text != reference.text:
            found.append(f"text {self.text!r} != solo {reference.text!r}")
        if self.finish_reason != reference.finish_reason:
            found.append(f"finish_reason {self.finish_reason!r} != solo {reference.finish_reason!r}")
        if self.completion_tokens is not None and self.completion_tokens != reference.completion_tokens:
            found.append(f"completion_tokens {self.completion_tokens} != solo {reference.completion_tokens}")
        return found


class StreamBroken(Exception):
    """A completed stream whose events break the protocol (order, ids, missing end)."""


def whole_answer(endpoint, body):
    if endpoint == "/v1/messages":
        text = "".join(block["text"] for block in body["content"] if block["type"] == "text")
        return Answer(text, body["stop_reason"], body["usage"]["output_tokens"])
    choice = body["choices"][0]
    text = choice["message"]["content"] if endpoint == "/v1/chat/completions" else choice["text"]
    return Answer(text, choice["finish_reason"], body["usage"]["completion_tokens"])


class StreamReader:
    """Follows one SSE stream's events and checks its protocol. `content_events` counts the events
    that carried text (for a client that disconnects after a few)."""

    def __init__(self, endpoint):
        self.endpoint = endpoint
        self.text = []
        self.finish_reason = None
        self.completion_tokens = None
        self.error = None
        self.ids = set()
        self.done = False
        self.content_events = 0

    def add(self, name, data):
        if self.done:
            raise StreamBroken(f"event after the end: {name} {data[:80]}")
        if self.endpoint == "/v1/messages":
            event = json.loads(data)
            if event["type"] != name:
                raise StreamBroken(f"event {name!r} carries data of type {event['type']!r}")
            self._add_anthropic(event)
        elif data == "[DONE]":
            if self.finish_reason is None and self.error is None:
                raise StreamBroken("[DONE] without a finish reason or an error event")
            self.done = True
        else:
            self._add_openai(json.loads(data))

    def _add_openai(self, chunk):
        if "error" in chunk:
            self.error = chunk["error"]
            return
        if self.finish_reason is not None and chunk.get("choices"):
            raise StreamBroken("a choice after the finish reason")
        self.ids.add(chunk["id"])
        if chunk.get("usage"):
            self.completion_tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk["choices"]:
            piece = choice["delta"].get("content") if self.endpoint == "/v1/chat/completions" else choice["text"]
            if piece:
                self.text.append(piece)
                self.content_events += 1
            if choice["finish_reason"] is not None:
                self.finish_reason = choice["finish_reason"]

    def _add_anthropic(self, event):
        kind = event["type"]
        if kind == "message_start":
            self.ids.add(event["message"]["id"])
        elif kind == "content_block_delta":
            self.text.append(event["delta"]["text"])
            self.content_events += 1
        elif kind == "message_delta":
            self.finish_reason = event["delta"]["stop_reason"]
            self.completion_tokens = event["usage"]["output_tokens"]
        elif kind == "error":
            self.error = event["error"]
            self.done = True
        elif kind == "message_stop":
            if self.finish_reason is None:
                raise StreamBroken("message_stop without a message_delta stop_reason")
            self.done = True

    def answer(self):
        if not self.done:
            raise StreamBroken("the stream ended without [DONE] (message_stop)")
        if len(self.ids) > 1:
            raise StreamBroken(f"one stream carried several ids: {sorted(self.ids)}")
        return Answer("".join(self.text), self.finish_reason, self.completion_tokens)


# ---------------------------------------------------------------- the soak

class Tally:
    """Counts by outcome, and the first few examples of each failure."""

    def __init__(self):
        self.counts = collections.Counter()
        self.examples = collections.defaultdict(list)
        self.stream_ids = set()
        self.duplicate_ids = 0

    def fail(self, kind, detail):
        self.counts[kind] += 1
        if len(self.examples[kind]) < EXAMPLES_KEPT:
            self.examples[kind].append(detail)

    def note_id(self, answer_id):
        if answer_id in self.stream_ids:
            self.duplicate_ids += 1
        self.stream_ids.add(answer_id)


class Soak:
    def __init__(self, args, host, port, model_name, endpoints, prompts):
        self.args = args
        self.host = host
        self.port = port
        self.model_name = model_name
        self.endpoints = endpoints
        self.prompts = prompts
        self.references = {}
        self.tally = Tally()
        self.stop_at = None
        self.worst_loop_lag = 0.0

    async def connect(self):
        return await asyncio.open_connection(self.host, self.port, limit=1 << 20)

    # One attempt of a generation request. Returns ("answer", Answer), ("retry", kind, seconds),
    # ("disconnected", None) or ("failed", kind, detail); `connection` is the client's open
    # keep-alive connection or None, and the one to keep is returned alongside.
    async def generate_once(self, connection, endpoint, prompt, stream, disconnect_after, abandon, rng):
        fresh = connection is None
        reader, writer = connection if connection else await self.connect()
        try:
            return await self.exchange(reader, writer, fresh, endpoint, prompt, stream, disconnect_after, abandon,
                                       rng)
        except BaseException:
            # A broken or timed-out exchange must not leave its connection (and a server thread) open.
            close_writer(writer, reset=True)
            raise

    async def exchange(self, reader, writer, fresh, endpoint, prompt, stream, disconnect_after, abandon, rng):
        include_usage = rng.random() < 0.5
        keep_alive = not (disconnect_after or abandon) and rng.random() < 0.5
        body = request_body(endpoint, prompt, self.model_name, stream, include_usage)
        try:
            writer.write(http_request("POST", endpoint, self.host, body, keep_alive))
            await writer.drain()
            if abandon:
                await asyncio.sleep(rng.uniform(0, 0.05))
                close_writer(writer, reset=rng.random() < 0.5)
                return ("disconnected", None), None
            status, headers = await read_head(reader)
        except (ConnectionLost, ConnectionError, OSError) as error:
            close_writer(writer)
            # A reused connection may have met the server's idle timeout as the request left: HTTP
            # lets the client retry. A fresh one must be answered, if only by the cap's 503.
            if fresh:
                return ("failed", "closed_unanswered", f"{type(error).__name__}: {error}"), None
            return ("retry", "keepalive_closed", 0.05), None
        if status != 200:
            payload = await read_body(reader, headers)
            close_writer(writer)
            retry_after = float(headers.get("retry-after", "1"))
            if status == 429:
                return ("retry", "queue_full_429", retry_after), None
            if is_overload_503(status, payload):
                return ("retry", "connection_cap_503", retry_after), None
            return ("failed", f"http_{status}", payload[:300].decode(errors="replace")), None
        server_keeps = headers.get("connection", "").lower() != "close"
        if not stream:
            answer = whole_answer(endpoint, json.loads(await read_body(reader, headers)))
        else:
            follower = StreamReader(endpoint)
            async for name, data in sse_events(reader, headers):
                follower.add(name, data)
                if disconnect_after and follower.content_events >= disconnect_after and not follower.done:
                    close_writer(writer, reset=rng.random() < 0.5)
                    return ("disconnected", None), None
            answer = follower.answer()
            if follower.error is not None:
                close_writer(writer)
                return ("failed", "stream_error_event", json.dumps(follower.error)[:300]), None
            for answer_id in follower.ids:
                self.tally.note_id(answer_id)
        if keep_alive and server_keeps:
            return ("answer", answer), (reader, writer)
        close_writer(writer)
        return ("answer", answer), None

    async def generation(self, connection, rng):
        """One generation request, retried while the server says busy; returns the connection to keep."""
        prompt_index = rng.randrange(len(self.prompts))
        endpoint = rng.choice(self.endpoints)
        stream = rng.random() < self.args.stream_fraction
        disconnect_after = rng.randint(1, 3) if stream and rng.random() < self.args.disconnect_fraction else 0
        abandon = not stream and rng.random() < self.args.abandon_fraction
        prompt = self.prompts[prompt_index]
        while True:
            try:
                outcome, connection = await asyncio.wait_for(
                    self.generate_once(connection, endpoint, prompt, stream, disconnect_after, abandon, rng),
                    self.args.request_deadline)
            except asyncio.TimeoutError:
                self.tally.fail("stuck", f"{endpoint} prompt {prompt_index} stream={stream}: no end within "
                                         f"{self.args.request_deadline:g} s")
                return None
            except (ConnectionLost, ConnectionError, OSError, StreamBroken, ValueError, KeyError) as error:
                self.tally.fail("broken_response", f"{endpoint} prompt {prompt_index} stream={stream}: "
                                                   f"{type(error).__name__}: {error}")
                return None
            if outcome[0] == "retry":
                self.tally.counts[outcome[1]] += 1
                if time.monotonic() >= self.stop_at:
                    return None
                await asyncio.sleep(outcome[2] * rng.uniform(1.0, 1.5))
                continue
            if outcome[0] == "disconnected":
                self.tally.counts["disconnected_mid_stream" if stream else "abandoned_whole"] += 1
            elif outcome[0] == "failed":
                self.tally.fail(outcome[1], f"{endpoint} prompt {prompt_index} stream={stream}: {outcome[2]}")
            else:
                differences = outcome[1].differences(self.references[(endpoint, prompt_index)])
                if differences:
                    self.tally.fail("mismatch", f"{endpoint} prompt {prompt_index} stream={stream}: "
                                                + "; ".join(differences))
                else:
                    self.tally.counts["matched_stream" if stream else "matched_whole"] += 1
            return connection

    # ---- garbage: each kind with the status the server documents for it

    def garbage_kinds(self):
        completions = "/v1/completions"
        valid = json.dumps({"model": self.model_name, "prompt": "Once", "max_tokens": 4}).encode()
        truncated_length = len(valid) + 40
        return {
            "malformed_request_line": (b"THIS IS NOT HTTP\r\n\r\n", 400),
            "binary_noise": (bytes(range(1, 32)) + b"\r\n\r\n", 400),
            "malformed_json": (http_request("POST", completions, self.host, b'{"model": "x", "prompt": ', False), 400),
            "unknown_field": (http_request("POST", completions, self.host, json.dumps(
                {"model": self.model_name, "prompt": "Once", "no_such_field": 1}).encode(), False), 400),
            "bad_chunk_size": (http_request("POST", completions, self.host, b"", False,
                                            ["Transfer-Encoding: chunked"]).replace(b"Content-Length: 0\r\n", b"")
                               + b"zz\r\n{}\r\n0\r\n\r\n", 400),
            "truncated_body": (http_request("POST", completions, self.host, valid, False).replace(
                f"Content-Length: {len(valid)}".encode(), f"Content-Length: {truncated_length}".encode()), 408),
            "oversized_headers": (http_request("GET", "/v1/models", self.host, b"", False,
                                               ["X-Filler: " + "a" * (self.args.max_header_bytes + 1024)]), 431),
            "oversized_body": (http_request("POST", completions, self.host, b"", False).replace(
                b"Content-Length: 0", f"Content-Length: {self.args.max_body_bytes + 1}".encode()), 413),
        }

    async def garbage_once(self, payload, expected):
        reader, writer = await self.connect()
        try:
            return await self.garbage_exchange(reader, writer, payload, expected)
        except BaseException:
            close_writer(writer, reset=True)
            raise

    async def garbage_exchange(self, reader, writer, payload, expected):
        try:
            writer.write(payload)
            await writer.drain()
            status, headers = await read_head(reader)
            body = await read_body(reader, headers)
        except (ConnectionLost, ConnectionError, OSError) as error:
            close_writer(writer)
            return ("unanswered", f"{type(error).__name__}: {error}")
        close_writer(writer)
        if is_overload_503(status, body):
            return ("retry", "connection_cap_503", float(headers.get("retry-after", "1")))
        if status != expected:
            return ("failed", f"expected {expected}, got {status}: {body[:200].decode(errors='replace')}")
        try:
            error = json.loads(body)
            if "error" not in error:
                raise ValueError("no `error` member")
        except ValueError as problem:
            return ("failed", f"{status} without a JSON error body ({problem}): {body[:200]!r}")
        return ("answered", status)

    async def garbage(self, rng):
        kinds = self.garbage_kinds()
        kind = rng.choice(sorted(kinds))
        payload, expected = kinds[kind]
        # A truncated body is answered only when the request timeout passes.
        deadline = self.args.server_request_timeout + 30 if expected == 408 else 60
        while True:
            try:
                outcome = await asyncio.wait_for(self.garbage_once(payload, expected), deadline)
            except asyncio.TimeoutError:
                self.tally.fail("garbage_unanswered", f"{kind}: no answer within {deadline:.0f} s")
                return
            except (ConnectionError, OSError, ValueError) as error:
                self.tally.fail("garbage_wrong_answer", f"{kind}: {type(error).__name__}: {error}")
                return
            if outcome[0] == "retry":
                self.tally.counts[outcome[1]] += 1
                if time.monotonic() >= self.stop_at:
                    return
                await asyncio.sleep(outcome[2] * rng.uniform(1.0, 1.5))
                continue
            if outcome[0] == "unanswered":
                self.tally.fail("garbage_unanswered", f"{kind}: closed without an answer ({outcome[1]})")
            elif outcome[0] == "failed":
                self.tally.fail("garbage_wrong_answer", f"{kind}: {outcome[1]}")
            else:
                self.tally.counts[f"garbage_{kind}_{outcome[1]}"] += 1
            return

    async def client(self, index):
        rng = random.Random(self.args.seed * 1_000_003 + index)
        # Spread the first requests over a second so that the clients do not arrive as one burst.
        await asyncio.sleep(rng.uniform(0, 1))
        connection = None
        while time.monotonic() < self.stop_at:
            if rng.random() < self.args.garbage_fraction:
                await self.garbage(rng)
            else:
                connection = await self.generation(connection, rng)
        if connection:
            close_writer(connection[1])

    async def record_references(self):
        """Each prompt alone, whole and streamed, one after another: the answers load must reproduce."""
        rng = random.Random(self.args.seed)
        for endpoint in self.endpoints:
            for index, prompt in enumerate(self.prompts):
                answers = []
                for stream in (False, True):
                    outcome, connection = await self.generate_once(None, endpoint, prompt, stream, 0, False, rng)
                    if connection:
                        close_writer(connection[1])
                    if outcome[0] != "answer":
                        raise RuntimeError(f"solo run of {endpoint} prompt {index} (stream={stream}): {outcome}")
                    answers.append(outcome[1])
                differences = answers[1].differences(answers[0])
                if differences:
                    raise RuntimeError(f"solo {endpoint} prompt {index}: the stream differs from the whole answer: "
                                       + "; ".join(differences))
                self.references[(endpoint, index)] = answers[0]

    async def watch_loop_lag(self):
        """The clients' own event loop falling behind would slow them, not the server: measure it."""
        while True:
            expected = time.monotonic() + 0.25
            await asyncio.sleep(0.25)
            self.worst_loop_lag = max(self.worst_loop_lag, time.monotonic() - expected)

    async def report_progress(self):
        started = time.monotonic()
        while True:
            await asyncio.sleep(30)
            counts = self.tally.counts
            failures = sum(counts[kind] for kind in self.tally.examples)
            print(f"soak: {time.monotonic() - started:4.0f} s: {counts['matched_stream'] + counts['matched_whole']} "
                  f"answers matched, {counts['disconnected_mid_stream']} disconnected, {counts['queue_full_429']} "
                  f"429, {counts['connection_cap_503']} 503 (cap), {failures} failures", flush=True)

    async def run_clients(self):
        self.stop_at = time.monotonic() + self.args.duration
        tasks = [asyncio.create_task(self.client(index)) for index in range(self.args.clients)]
        progress = asyncio.create_task(self.report_progress())
        lag = asyncio.create_task(self.watch_loop_lag())
        # Every attempt is bounded by --request-deadline, so the clients end soon after stop_at.
        done, pending = await asyncio.wait(tasks, timeout=self.args.duration + self.args.request_deadline + 60)
        progress.cancel()
        lag.cancel()
        for task in pending:
            task.cancel()
            self.tally.fail("client_never_ended", "a client task was still running at the end")
        for task in done:
            if task.exception() is not None:
                self.tally.fail("client_crashed", f"{type(task.exception()).__name__}: {task.exception()}")


# ---------------------------------------------------------------- probes (threads: they must not wait on the clients' event loop)

def blocking_get(host, port, path, timeout):
    """(status, body) of a GET on a fresh connection."""
    with socket.create_connection((host, port), timeout=timeout) as connection:
        connection.sendall(http_request("GET", path, host, keep_alive=False))
        received = []
        while True:
            data = connection.recv(65536)
            if not data:
                break
            received.append(data)
    response = b"".join(received)
    head, _, body = response.partition(b"\r\n\r\n")
    match = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    if not match:
        raise ValueError(f"bad response {response[:80]!r}")
    return int(match.group(1)), body


class HealthProbe(threading.Thread):
    def __init__(self, host, port, timeout):
        super().__init__(daemon=True)
        self.host, self.port, self.timeout = host, port, timeout
        self.stopping = threading.Event()
        self.latencies = []
        self.failures = []
        self.connection_cap_503 = 0
        self.began = time.monotonic()

    def run(self):
        while not self.stopping.is_set():
            started = time.monotonic()
            when = f"{started - self.began:.0f} s into the load"
            try:
                status, body = blocking_get(self.host, self.port, "/health", self.timeout)
                elapsed = time.monotonic() - started
                self.latencies.append(elapsed)
                if status != 200:
                    if is_overload_503(status, body):
                        self.connection_cap_503 += 1
                    self.failures.append(f"{when}: {status} {body[:120].decode(errors='replace')}")
            except (OSError, ValueError) as error:
                self.latencies.append(time.monotonic() - started)
                self.failures.append(f"{when}: {type(error).__name__}: {error}")
            self.stopping.wait(max(0.0, 1.0 - (time.monotonic() - started)))


def descriptor_limit_of(pid):
    """The soft `Max open files` of a process, or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/limits") as limits:
            for line in limits:
                if line.startswith("Max open files"):
                    return int(line.split()[3])
    except (FileNotFoundError, PermissionError):
        return None
    return None


def process_sample(pid):
    """(rss MiB, threads, open file descriptors) of a process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        descriptors = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["Threads"]), descriptors


class ProcessSampler(threading.Thread):
    def __init__(self, pid, interval):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.stopping = threading.Event()
        self.samples = []  # (seconds since start, rss MiB, threads, fds)
        self.started = time.monotonic()

    def run(self):
        while not self.stopping.is_set():
            sample = process_sample(self.pid)
            if sample is None:
                return
            self.samples.append((time.monotonic() - self.started, *sample))
            self.stopping.wait(self.interval)


def scheduler_gauges(host, port):
    status, body = blocking_get(host, port, "/metrics", 10)
    if status != 200:
        raise ValueError(f"/metrics answered {status}")
    values = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            # Every series carries the server's model_name label: the keys here leave it out.
            name = re.sub(r'model_name="(?:[^"\\]|\\.)*",?', "", name).replace("{}", "")
            values[name] = float(value)
    return values


def wait_until_idle(host, port, seconds):
    """Polls /metrics until no request runs or waits; returns (idle, seconds waited, last metrics)."""
    started = time.monotonic()
    while True:
        metrics = scheduler_gauges(host, port)
        idle = metrics["kiln_requests_running"] == 0 and metrics["kiln_requests_waiting"] == 0
        waited = time.monotonic() - started
        if idle or waited > seconds:
            return idle, waited, metrics
        time.sleep(0.5)


# ---------------------------------------------------------------- the server

def start_server(args, log_path):
    command = [args.server_binary, "serve", "--model", args.model, "--device", args.device, "--host", "127.0.0.1",
               "--port", "0", "--request-timeout", str(args.server_request_timeout),
               "--max-body-bytes", str(args.max_body_bytes)]
    if args.chat_template:
        command += ["--chat-template", args.chat_template]
    command += args.server_arg
    log = open(log_path, "w")
    # The server inherits the raised descriptor limit (set in main before this).
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 300  # a large model on a GPU can take minutes to load
    while time.monotonic() < deadline:
        with open(log_path) as text:
            log_text = text.read()
        # The port opens before the weights load: wait until the model is served.
        match = re.search(r"listening on http://([\d.]+):(\d+)", log_text)
        if match and "ready in" in log_text:
            return server, match.group(1), int(match.group(2)), command
        if server.poll() is not None:
            with open(log_path) as text:
                last_line = (text.read().strip().splitlines() or [""])[-1]
            raise RuntimeError(f"kiln serve exited with {server.returncode}: {last_line} (log {log_path})")
        time.sleep(0.2)
    server.kill()
    raise RuntimeError(f"kiln serve did not listen within 300 s: see {log_path}")


def stop_server(server, grace):
    """SIGTERM, then the exit status and how long the shutdown took."""
    started = time.monotonic()
    server.send_signal(signal.SIGTERM)
    try:
        returncode = server.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        server.kill()
        returncode = f"killed after {grace:.0f} s"
    return returncode, time.monotonic() - started


def raise_descriptor_limit(needed):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return soft
    if hard != resource.RLIM_INFINITY and hard < needed:
        sys.exit(f"soak: {needed} file descriptors are needed but the hard limit is {hard} (raise ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    return needed


# ---------------------------------------------------------------- the report

def linear_slope(points):
    """Least-squares slope of (x, y) points, or 0 with fewer than two."""
    if len(points) < 2:
        return 0.0
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0


def main():
    args = parse_args()
    descriptors = raise_descriptor_limit(args.clients * 2 + 256)
    log_path = None
    server = None
    if args.url:
        parsed = urllib.parse.urlparse(args.url)
        if not re.fullmatch(r"127\.\d+\.\d+\.\d+|localhost", parsed.hostname or ""):
            sys.exit("soak: --url must be a loopback address")
        host, port, pid = parsed.hostname, parsed.port or 80, args.server_pid
    else:
        log_path = tempfile.mkstemp(prefix="kiln-soak-", suffix=".log")[1]
        server, host, port, command = start_server(args, log_path)
        pid = server.pid
        print(f"soak: started {' '.join(command)} (pid {pid}, log {log_path})", flush=True)

    settled = None
    checks = {}
    figures = {"clients": args.clients, "duration_s": args.duration, "prompts": args.prompts,
               "descriptor_limit": descriptors, "server_descriptor_limit": descriptor_limit_of(pid) if pid else None}
    try:
        status, body = blocking_get(host, port, "/v1/models", 10)
        if status != 200:
            raise RuntimeError(f"GET /v1/models answered {status}: {body[:200]!r}")
        model_name = json.loads(body)["data"][0]["id"]
        endpoints = ["/v1/completions"]
        if args.chat_template or args.chat:
            endpoints += ["/v1/chat/completions", "/v1/messages"]
        prompts = make_prompts(args.prompts, args.seed)
        soak = Soak(args, host, port, model_name, endpoints, prompts)
        started = time.monotonic()
        asyncio.run(soak.record_references())
        print(f"soak: recorded {len(soak.references)} solo answers in {time.monotonic() - started:.1f} s; "
              f"{args.clients} clients for {args.duration:.0f} s on {', '.join(endpoints)}", flush=True)

        sampler = ProcessSampler(pid, args.sample_interval) if pid else None
        if sampler:
            sampler.start()
            time.sleep(0.1)  # the first sample is the level before the load
        health = HealthProbe(host, port, timeout=10)
        health.start()
        figures["loadavg_at_start"] = open("/proc/loadavg").read().split()[0]
        load_started = time.monotonic()
        asyncio.run(soak.run_clients())
        figures["loadavg_at_end"] = open("/proc/loadavg").read().split()[0]
        load_seconds = time.monotonic() - load_started
        idle, waited, metrics = wait_until_idle(host, port, 30)
        # Connections finish closing (a graceful close lingers up to 200 ms) before the level is read.
        time.sleep(3)
        health.stopping.set()
        health.join()
        if sampler:
            sampler.stopping.set()
            sampler.join()
            settled = process_sample(pid)
    except BaseException:
        if server:
            server.kill()
        raise

    tally = soak.tally
    counts = tally.counts
    matched = counts["matched_stream"] + counts["matched_whole"]
    lost = {kind: counts[kind] for kind in counts if kind in tally.examples}
    figures.update({
        "load_seconds": round(load_seconds, 1),
        "answers_matched": matched,
        "answers_matched_streamed": counts["matched_stream"],
        "answers_matched_whole": counts["matched_whole"],
        "answers_per_second": round(matched / load_seconds, 1),
        "disconnected_mid_stream": counts["disconnected_mid_stream"],
        "abandoned_whole": counts["abandoned_whole"],
        "garbage_answered": {kind[len("garbage_"):]: n for kind, n in sorted(counts.items())
                             if kind.startswith("garbage_") and kind not in tally.examples},
        "queue_full_429": counts["queue_full_429"],
        "connection_cap_503": counts["connection_cap_503"],
        "keepalive_closed": counts["keepalive_closed"],
        "duplicate_stream_ids": tally.duplicate_ids,
        "client_worst_event_loop_lag_s": round(soak.worst_loop_lag, 3),
        "failures": lost,
        "failure_examples": dict(tally.examples),
    })
    checks["nothing lost or mixed"] = (matched > 0 and not lost and tally.duplicate_ids == 0,
                                       f"{matched} answers equal their solo run; failures {lost or 'none'}; "
                                       f"{tally.duplicate_ids} duplicate stream ids")

    figures["metrics_after"] = {name: metrics[name] for name in
                                ("kiln_requests_running", "kiln_requests_waiting", "kiln_kv_cache_tokens_used")}
    figures["metrics_responses"] = {name: value for name, value in metrics.items()
                                    if name.startswith("kiln_http_responses_total")}
    checks["no stuck requests"] = (idle and metrics["kiln_kv_cache_tokens_used"] == 0,
                                   f"/metrics {waited:.1f} s after the clients stopped: running "
                                   f"{metrics['kiln_requests_running']:.0f}, waiting "
                                   f"{metrics['kiln_requests_waiting']:.0f}, KV tokens used "
                                   f"{metrics['kiln_kv_cache_tokens_used']:.0f}")

    latencies = sorted(health.latencies)
    figures["health"] = {"probes": len(latencies), "failures": len(health.failures),
                         "connection_cap_503": health.connection_cap_503,
                         "worst_latency_s": round(latencies[-1], 4) if latencies else None,
                         "p99_latency_s": round(latencies[int(len(latencies) * 0.99)], 4) if latencies else None,
                         "failure_examples": health.failures[:EXAMPLES_KEPT]}
    checks["health always answering"] = (
        bool(latencies) and not health.failures and latencies[-1] <= args.max_health_latency,
        f"{len(latencies)} probes, {len(health.failures)} failed ({health.connection_cap_503} at the connection "
        f"cap), worst {latencies[-1] if latencies else float('nan'):.3f} s (limit {args.max_health_latency} s)")

    if sampler and sampler.samples:
        samples = sampler.samples
        base = samples[0]
        under_load = [s for s in samples if s[0] <= load_seconds]
        after_warmup = [s for s in under_load if s[0] >= args.warmup] or under_load[-1:]
        peak = max(s[1] for s in samples)
        growth = under_load[-1][1] - after_warmup[0][1]
        slope = linear_slope([(s[0] / 60, s[1]) for s in after_warmup])
        figures["rss_mib"] = {"before_load": round(base[1], 1), "after_warmup": round(after_warmup[0][1], 1),
                              "peak": round(peak, 1), "end_of_load": round(under_load[-1][1], 1),
                              "after_drain": round(settled[0], 1) if settled else None,
                              "growth_after_warmup": round(growth, 1), "slope_mib_per_min": round(slope, 2),
                              "samples": len(samples)}
        figures["threads"] = {"before_load": base[2], "peak": max(s[2] for s in samples),
                              "after_drain": settled[1] if settled else None}
        figures["fds"] = {"before_load": base[3], "peak": max(s[3] for s in samples),
                          "after_drain": settled[2] if settled else None}
        checks["RSS flat"] = (growth <= args.max_rss_growth_mib,
                              f"RSS {base[1]:.1f} MiB before, {after_warmup[0][1]:.1f} after warm-up "
                              f"({args.warmup:.0f} s), peak {peak:.1f}, end {under_load[-1][1]:.1f}: growth "
                              f"{growth:+.1f} MiB (limit {args.max_rss_growth_mib}), {slope:+.2f} MiB/min")
        # Every connection is closed by now: its thread and socket must be gone too.
        checks["threads and descriptors released"] = (
            settled is not None and settled[1] <= base[2] + 1 and settled[2] <= base[3] + 1,
            f"threads {base[2]} before, {settled[1] if settled else '?'} after; descriptors {base[3]} before, "
            f"{settled[2] if settled else '?'} after")
    elif not pid:
        print("soak: the server's RSS, threads and descriptors were not sampled (--url without --server-pid)")
    else:
        checks["RSS flat"] = (False, f"no sample of process {pid}: is it the server, and is it running?")
    if server:
        returncode, shutdown_seconds = stop_server(server, 60)
        figures["shutdown"] = {"returncode": returncode, "seconds": round(shutdown_seconds, 2)}
        checks["server alive and exits cleanly"] = (returncode == 0,
                                                    f"SIGTERM: exit {returncode} in {shutdown_seconds:.1f} s")

    print(f"\nsoak: {args.clients} clients, {load_seconds:.0f} s of load; descriptor limit {descriptors} here, "
          f"{figures['server_descriptor_limit']} in the server; machine load average {figures['loadavg_at_start']} "
          f"at the start, {figures['loadavg_at_end']} at the end ({os.cpu_count()} CPUs)")
    print(f"  answers equal to their solo run: {matched} ({counts['matched_stream']} streamed, "
          f"{counts['matched_whole']} whole), {matched / load_seconds:.1f}/s")
    print(f"  disconnected mid-stream: {counts['disconnected_mid_stream']}; whole requests abandoned: "
          f"{counts['abandoned_whole']}")
    print(f"  garbage answered as documented: {sum(figures['garbage_answered'].values())} "
          f"{figures['garbage_answered']}")
    print(f"  429 queue full (retried): {counts['queue_full_429']}; 503 connection or request cap (retried): "
          f"{counts['connection_cap_503']}; keep-alive closed by the server (retried): {counts['keepalive_closed']}")
    print(f"  the clients' event loop fell behind by {soak.worst_loop_lag:.3f} s at worst")
    for kind, examples in tally.examples.items():
        print(f"  {kind}: {counts[kind]}")
        for example in examples:
            print(f"    {example}")
    for example in health.failures[:EXAMPLES_KEPT]:
        print(f"  health failure: {example}")
    print()
    for name, (passed, detail) in checks.items():
        print(f"  [{'ok' if passed else 'FAIL'}] {name}: {detail}")
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump({"figures": figures, "checks": {name: {"passed": passed, "detail": detail}
                                                       for name, (passed, detail) in checks.items()}}, out, indent=2)
    if log_path:
        print(f"  server log: {log_path}")
    return 0 if all(passed for passed, _ in checks.values()) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as error:
        # The soak could not start (no server, or its solo runs failed): no figures to report.
        sys.exit(f"soak: {error}")

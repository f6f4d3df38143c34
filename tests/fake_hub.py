#!/usr/bin/env python3
"""A stand-in for the Hugging Face hub on a loopback port, for tests/hub_test.cpp (no network).

It serves one repo made of the files under --root, with the headers huggingface_hub reads:
  GET  /api/models/{repo}/revision/{rev}  -> {"id", "sha", "siblings": [{"rfilename"}]}
  HEAD/GET /{repo}/resolve/{rev}/{file}   -> X-Repo-Commit, ETag (a git blob sha1), Content-Length,
       Accept-Ranges; an LFS file (*.safetensors, *.bin) is a 302 to /cdn/{sha256} on another host
       name (localhost instead of 127.0.0.1) with X-Linked-Etag (its sha256) and X-Linked-Size
  GET  /cdn/{sha256}                      -> the bytes, honouring "Range: bytes=N-"
Errors carry X-Error-Code and X-Error-Message as the hub's do. Faults a test asks for:
  --drop-once FILE      the first body of FILE stops half-way and the connection is closed
  --corrupt FILE=N      the first N bodies of FILE have one byte flipped
  --claim-size FILE=N   X-Linked-Size says N
  --require-token T     requests without "Authorization: Bearer T" get 401 GatedRepo
  --index               a model.safetensors.index.json naming model.safetensors is added
It prints "port N" once listening and appends one JSON line per request to --log.
"""
import argparse
import hashlib
import json
import os
import socket
import struct
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin")


def git_blob_sha1(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def safetensors_index(model):
    header_size = struct.unpack("<Q", model[:8])[0]
    header = json.loads(model[8:8 + header_size])
    names = sorted(name for name in header if name != "__metadata__")
    return json.dumps({"metadata": {"total_size": len(model) - 8 - header_size},
                       "weight_map": {name: "model.safetensors" for name in names}}, indent=2).encode()


class Hub:
    def __init__(self, args):
        self.args = args
        self.files = {}
        for folder, _, names in os.walk(args.root):
            for name in names:
                path = os.path.join(folder, name)
                with open(path, "rb") as f:
                    self.files[os.path.relpath(path, args.root)] = f.read()
        if args.index:
            self.files["model.safetensors.index.json"] = safetensors_index(self.files["model.safetensors"])
        self.by_sha256 = {hashlib.sha256(data).hexdigest(): name for name, data in self.files.items()}
        self.drops = set(args.drop_once)
        self.corruptions = {name: int(count) for name, count in (item.split("=") for item in args.corrupt)}
        self.claimed = {name: int(size) for name, size in (item.split("=") for item in args.claim_size)}
        self.lock = threading.Lock()

    def take_fault(self, name):
        """Which fault the next body of `name` gets: "drop", "corrupt" or None."""
        with self.lock:
            if name in self.drops:
                self.drops.discard(name)
                return "drop"
            if self.corruptions.get(name, 0) > 0:
                self.corruptions[name] -= 1
                return "corrupt"
        return None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.handle_request(head=True)

    def do_GET(self):
        self.handle_request(head=False)

    def log_request_line(self):
        entry = {"method": self.command, "path": self.path, "host": self.headers.get("Host", ""),
                 "range": self.headers.get("Range"), "authorization": self.headers.get("Authorization")}
        with hub.lock, open(hub.args.log, "a") as log:
            log.write(json.dumps(entry) + "\n")

    def send_error_headers(self, status, code, message):
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def handle_request(self, head):
        self.log_request_line()
        path = unquote(urlsplit(self.path).path)
        repo, commit = hub.args.repo, hub.args.commit
        if path.startswith("/cdn/"):
            name = hub.by_sha256.get(path[len("/cdn/"):])
            if name is None:
                return self.send_error_headers(404, "EntryNotFound", "no such blob")
            return self.send_body(name, head)
        if hub.args.require_token and self.headers.get("Authorization") != "Bearer " + hub.args.require_token:
            return self.send_error_headers(401, "GatedRepo", f"Access to model {repo} is restricted.")
        api = f"/api/models/{repo}/revision/"
        if path.startswith(api):
            if path[len(api):] not in ("main", commit):
                return self.send_error_headers(404, "RevisionNotFound", "Invalid rev id")
            body = json.dumps({"id": repo, "sha": commit,
                               "siblings": [{"rfilename": name} for name in sorted(hub.files)]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)
            return
        resolve = f"/{repo}/resolve/"
        if not path.startswith(resolve):
            return self.send_error_headers(401, "RepoNotFound", "Repository not found")
        revision, _, name = path[len(resolve):].partition("/")
        if revision not in ("main", commit):
            return self.send_error_headers(404, "RevisionNotFound", "Invalid rev id")
        if name not in hub.files:
            return self.send_error_headers(404, "EntryNotFound", "Entry not found")
        data = hub.files[name]
        if name.endswith(LFS_SUFFIXES):
            sha256 = hashlib.sha256(data).hexdigest()
            port = self.server.server_address[1]
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{port}/cdn/{sha256}")
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", '"%s"' % git_blob_sha1(b"version https://git-lfs.github.com/spec/v1\n"))
            self.send_header("X-Linked-Etag", '"%s"' % sha256)
            self.send_header("X-Linked-Size", str(hub.claimed.get(name, len(data))))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_body(name, head, extra={"X-Repo-Commit": commit, "ETag": '"%s"' % git_blob_sha1(data)})

    def send_body(self, name, head, extra=None):
        data = hub.files[name]
        start = 0
        range_header = self.headers.get("Range")
        if range_header and range_header.startswith("bytes=") and range_header.endswith("-"):
            start = int(range_header[len("bytes="):-1])
            if start >= len(data):
                return self.send_error_headers(416, "RangeNotSatisfiable", "range not satisfiable")
        self.send_response(206 if start else 200)
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if head:
            return
        fault = hub.take_fault(name)
        body = data[start:]
        if fault == "corrupt":
            middle = len(body) // 2
            body = body[:middle] + bytes([body[middle] ^ 0xFF]) + body[middle + 1:]
        if fault == "drop":
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self.wfile.write(body)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--repo", required=True)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--drop-once", action="append", default=[])
    parser.add_argument("--corrupt", action="append", default=[])
    parser.add_argument("--claim-size", action="append", default=[])
    parser.add_argument("--require-token")
    parser.add_argument("--index", action="store_true")
    global hub
    hub = Hub(parser.parse_args())
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(f"port {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())

// Reads one HTTP/1.x request at a time from bytes as they arrive (Boost.Beast's parser underneath),
// with no I/O of its own: the server's event loop feeds it what a socket delivered, and a fuzzer
// can feed it anything. Bytes after a complete request are left to the caller (pipelining).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "server/http_server.h"

namespace kiln::server {

class HttpRequestReader {
 public:
  HttpRequestReader(size_t max_header_bytes, size_t max_body_bytes);
  ~HttpRequestReader();
  HttpRequestReader(HttpRequestReader&&) noexcept;
  HttpRequestReader& operator=(HttpRequestReader&&) noexcept;

  // Consumes bytes of the next request; returns how many it took (bytes after a complete request
  // are not taken: they belong to the next one, for pipelining). Takes nothing once complete() or
  // failed().
  size_t feed(std::string_view bytes);
  bool complete() const;  // a whole request has been read
  bool failed() const;    // malformed or over a limit: error_status()/error_message() say why
  int error_status() const;  // 400, 413 (body too large) or 431 (header too large)
  const std::string& error_message() const;
  // The complete request; the reader is then ready for the next one.
  HttpRequest take();

  // Some byte of the current request has been fed.
  bool started() const { return started_; }
  // The header is complete and asked for "Expect: 100-continue" while its body is still to come.
  bool expects_continue() const;
  // Of the request being read, once its header is complete: 10 or 11, and whether the
  // connection may serve another request after it.
  unsigned version() const;
  bool keep_alive() const;
  // The target's path once the request line is read (an error response's format follows it),
  // else empty.
  std::string path() const;

 private:
  struct Parser;
  void take_ready_parser();
  void reject(int status, std::string message);

  size_t max_header_bytes_;
  size_t max_body_bytes_;
  std::unique_ptr<Parser> parser_;
  // Bytes the parser asked to see again with more behind them (an incomplete header or chunk
  // header must be parsed in one piece).
  std::string unparsed_;
  bool started_ = false;
  bool complete_ = false;
  int error_status_ = 0;
  std::string error_message_;
};

}  // namespace kiln::server

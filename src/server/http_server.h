// An HTTP/1.1 server (Boost.Beast parsing over Asio sockets): one event-loop thread reads every
// connection, and only a complete request takes a handler thread.
//
// The event loop (epoll) accepts connections, reads requests through HttpRequestReader until each
// is whole (header and body, within the size limits and the request timeout), keeps idle
// keep-alive connections, writes the transport's own short responses (errors, 100 Continue, the
// answers of `event_loop_paths`) and closes connections gracefully. A client that sends its
// request slowly therefore costs a file descriptor and a few kilobytes, not a thread: connections
// are bounded by the descriptor limit, and handler threads by their own, much smaller cap. A
// handler runs on its own thread and may block (a generation); it writes its response directly
// (every write bounded by the write timeout) and learns that its client went away from a failed
// write or from client_gone(), which peeks at the socket without blocking. When it returns, the
// connection goes back to the event loop for the next request.
//
// Beast is included only by this header's implementation (with http_exchange.h) and by
// HttpRequestReader's (compile time).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "server/cors.h"
#include "server/http_message.h"

namespace kiln::server {

// The response channel of one request. A handler either calls respond() once, or
// start_stream() and then write() any number of chunks; the transport ends a stream (last
// chunk) when the handler returns. For a HEAD request the transport sends only the head of the
// response (Content-Length as GET's would be), and write() returns false: nobody reads the body.
class HttpExchange {
 public:
  virtual ~HttpExchange() = default;
  virtual void respond(const HttpResponse& response) = 0;
  // Sends the head of a chunked response. False when the client is gone.
  virtual bool start_stream(int status, const std::string& content_type, const HeaderList& headers) = 0;
  // Sends one chunk. False when the client is gone (or stopped reading past the write timeout).
  virtual bool write(std::string_view data) = 0;
  // True when the peer has closed or reset the connection; never blocks.
  virtual bool client_gone() = 0;
  virtual bool responded() const = 0;
};

using HttpHandler = std::function<void(const HttpRequest&, HttpExchange&)>;

// The body of an error the transport itself reports (malformed HTTP, body too large, timeout):
// the application decides its format from the path, when the request line got that far.
using ProtocolErrorBody = std::function<HttpResponse(int status, const std::string& message, const std::string& path)>;

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 8080;  // 0: any free port (see HttpServer::port())
  size_t max_body_bytes = 8u << 20;
  size_t max_header_bytes = 64u << 10;
  // Open connections (being read, handled or idle); beyond it a new connection gets 503 and is
  // closed. 0: connection_limit_for_descriptors().
  int max_connections = 0;
  // Requests handled at once, each on its own thread; beyond it a request gets 503.
  int max_concurrent_requests = 256;
  // Requests for these paths are answered on the event loop, without a handler thread, so they
  // are answered when every handler thread is busy: their handler must never block.
  std::vector<std::string> event_loop_paths;
  std::chrono::milliseconds idle_timeout{60'000};     // keep-alive wait for the next request
  std::chrono::milliseconds request_timeout{30'000};  // first byte to the end of a request
  std::chrono::milliseconds write_timeout{30'000};    // longest a write may make no progress
  int retry_after_seconds = 1;                        // sent with the transport's 503s
  CorsPolicy cors;  // which other origins' pages may call the server (answered by the transport)
};

// The connections a server may hold open under the process's RLIMIT_NOFILE: all of it but a
// reserve for the rest of the process.
size_t connection_limit_for_descriptors();

class HttpServer {
 public:
  // Binds and listens (a kiln::Error names the address when that fails); serves once start()ed.
  HttpServer(HttpServerOptions options, HttpHandler handler, ProtocolErrorBody error_body);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  uint16_t port() const;
  // The connection limit in force (max_connections, or what the descriptor limit allows).
  size_t connection_limit() const;
  void start();
  // From now on every response closes its connection, and idle keep-alive connections are
  // closed; new connections are still accepted and served (a draining server still answers
  // /health). Idempotent.
  void drain();
  // Drains and stops accepting; requests in progress go on.
  void stop_accepting();
  // Aborts every connection's I/O and joins all threads (idempotent).
  void close();
  size_t open_connections() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::server

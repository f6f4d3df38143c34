// An HTTP/1.1 server (Boost.Beast parsing over Asio sockets) with one thread per connection.
//
// Every wait on a socket is a poll() with a deadline, so a client that sends half a request, or
// stops reading a streamed response, only ever holds its own thread: the idle keep-alive wait,
// the time to receive a whole request and the progress of each write are all bounded. A handler
// runs on its connection's thread and may block (a generation); it learns that its client went
// away from a failed write or from client_gone(), which peeks at the socket without blocking.
//
// Only this header's implementation includes Beast (compile time).
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

namespace kiln::server {

using HeaderList = std::vector<std::pair<std::string, std::string>>;

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string path;    // the target without its query string
  std::string query;   // after '?', or empty
  HeaderList headers;  // names in lower case
  std::string body;

  // The value of a header (name in lower case), or nullptr.
  const std::string* header(std::string_view name) const;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  HeaderList headers;
  std::string body;
};

// The response channel of one request. A handler either calls respond() once, or
// start_stream() and then write() any number of chunks; the transport ends a stream (last
// chunk) when the handler returns.
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
  int max_connections = 256;                          // beyond this a connection gets 503 and is closed
  std::chrono::milliseconds idle_timeout{60'000};     // keep-alive wait for the next request
  std::chrono::milliseconds request_timeout{30'000};  // first byte to the end of a request
  std::chrono::milliseconds write_timeout{30'000};    // longest a write may make no progress
  int retry_after_seconds = 1;                        // sent with the connection-limit 503
};

class HttpServer {
 public:
  // Binds and listens (a kiln::Error names the address when that fails); serves once start()ed.
  HttpServer(HttpServerOptions options, HttpHandler handler, ProtocolErrorBody error_body);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  uint16_t port() const;
  void start();
  // Stops accepting and closes idle keep-alive connections; requests in progress go on.
  void stop_accepting();
  // Aborts every connection's I/O and joins all threads (idempotent).
  void close();
  size_t open_connections() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::server

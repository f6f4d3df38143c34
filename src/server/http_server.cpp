#include "server/http_server.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <cerrno>
#include <climits>
#include <cstring>
#include <list>
#include <mutex>
#include <thread>

#include "core/error.h"

namespace kiln::server {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;
using boost::system::error_code;

const std::string* HttpRequest::header(std::string_view name) const {
  for (const auto& [key, value] : headers)
    if (key == name) return &value;
  return nullptr;
}

namespace {

// An eventfd that, once signalled, stays readable, so every poll() that includes it wakes.
class Latch {
 public:
  Latch() : fd_(::eventfd(0, EFD_CLOEXEC)) {
    if (fd_ < 0) fail("eventfd failed: {}", std::strerror(errno));
  }
  ~Latch() { ::close(fd_); }
  Latch(const Latch&) = delete;
  Latch& operator=(const Latch&) = delete;
  void signal() {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t written = ::write(fd_, &one, sizeof one);
  }
  int fd() const { return fd_; }

 private:
  int fd_;
};

// A non-blocking socket whose reads and writes wait in poll() with deadlines. It satisfies
// Beast's SyncReadStream and Asio's SyncWriteStream.
//
// Reads: while no byte of the next request has arrived the socket is idle, and the idle timeout
// applies (the drain latch also ends the wait: a server that stops closes idle connections);
// from the first byte on, the whole request must arrive within the request timeout.
// Writes: each write must make progress within the write timeout. The close latch ends any wait.
class PolledSocket {
 public:
  PolledSocket(tcp::socket socket, const HttpServerOptions& options, const Latch& drain, const Latch& closing)
      : socket_(std::move(socket)), options_(options), drain_(drain), closing_(closing) {}

  // Starts waiting for a request; `has_bytes`: some of it is already buffered (pipelining).
  void await_request(bool has_bytes) {
    idle_ = !has_bytes;
    read_deadline_ = Clock::now() + (idle_ ? options_.idle_timeout : options_.request_timeout);
  }
  bool idle() const { return idle_; }

  template <class MutableBuffers>
  size_t read_some(const MutableBuffers& buffers, error_code& ec) {
    for (;;) {
      const size_t received = socket_.read_some(buffers, ec);
      if (ec != net::error::would_block) {
        if (received > 0 && idle_) {
          idle_ = false;
          read_deadline_ = Clock::now() + options_.request_timeout;
        }
        return received;
      }
      if (!wait(POLLIN, read_deadline_, idle_, ec)) return 0;
    }
  }
  template <class MutableBuffers>
  size_t read_some(const MutableBuffers& buffers) {
    error_code ec;
    const size_t received = read_some(buffers, ec);
    if (ec) throw boost::system::system_error(ec);
    return received;
  }

  template <class ConstBuffers>
  size_t write_some(const ConstBuffers& buffers, error_code& ec) {
    const auto deadline = Clock::now() + options_.write_timeout;
    for (;;) {
      const size_t sent = socket_.write_some(buffers, ec);
      if (ec != net::error::would_block) return sent;
      if (!wait(POLLOUT, deadline, false, ec)) return 0;
    }
  }
  template <class ConstBuffers>
  size_t write_some(const ConstBuffers& buffers) {
    error_code ec;
    const size_t sent = write_some(buffers, ec);
    if (ec) throw boost::system::system_error(ec);
    return sent;
  }

  // The peer closed (FIN) or reset the connection. Pipelined bytes are not a disconnect.
  bool peer_gone() {
    pollfd entry{socket_.native_handle(), static_cast<short>(POLLIN | POLLRDHUP), 0};
    if (::poll(&entry, 1, 0) <= 0) return false;
    if (entry.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return true;
    char byte;
    const ssize_t peeked = ::recv(socket_.native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    return peeked == 0 || (peeked < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
  }

  // Half-closes, then reads what the client still sends for a moment, so that closing with
  // unread bytes does not reset the connection before the client has read our last response.
  void close_gracefully() {
    error_code ec;
    socket_.shutdown(tcp::socket::shutdown_send, ec);
    const auto deadline = Clock::now() + std::chrono::milliseconds(200);
    char sink[4096];
    for (size_t drained = 0; !ec && drained < (1u << 20);) {
      drained += read_some(net::buffer(sink), ec);
      if (Clock::now() > deadline) break;
    }
    socket_.close(ec);
  }

 private:
  bool wait(short events, Clock::time_point deadline, bool stop_on_drain, error_code& ec) {
    pollfd entries[3] = {{socket_.native_handle(), events, 0}, {closing_.fd(), POLLIN, 0}, {drain_.fd(), POLLIN, 0}};
    const nfds_t count = stop_on_drain ? 3 : 2;
    for (;;) {
      const auto remaining = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (remaining <= 0) {
        ec = net::error::timed_out;
        return false;
      }
      const int ready = ::poll(entries, count, static_cast<int>(std::min<int64_t>(remaining, INT_MAX)));
      if (ready < 0 && errno == EINTR) continue;
      if (ready < 0) {
        ec = error_code(errno, boost::system::system_category());
        return false;
      }
      if (ready == 0) continue;
      if (entries[1].revents || (count == 3 && entries[2].revents)) {
        ec = net::error::operation_aborted;
        return false;
      }
      return true;  // readable/writable, or an error the next read/write reports
    }
  }

  tcp::socket socket_;
  const HttpServerOptions& options_;
  const Latch& drain_;
  const Latch& closing_;
  bool idle_ = true;
  Clock::time_point read_deadline_;
};

class Exchange final : public HttpExchange {
 public:
  Exchange(PolledSocket& socket, unsigned version, bool keep_alive)
      : socket_(socket), version_(version), keep_alive_(keep_alive) {}

  void respond(const HttpResponse& response) override {
    if (responded_) fail("an HTTP response was already sent for this request");
    responded_ = true;
    http::response<http::string_body> message{static_cast<http::status>(response.status), version_};
    message.set(http::field::server, "kiln");
    message.set(http::field::content_type, response.content_type);
    for (const auto& [name, value] : response.headers) message.set(name, value);
    message.body() = response.body;
    message.keep_alive(keep_alive_);
    message.prepare_payload();
    error_code ec;
    http::write(socket_, message, ec);
    if (ec) broken_ = true;
  }

  bool start_stream(int status, const std::string& content_type, const HeaderList& headers) override {
    if (responded_) fail("an HTTP response was already sent for this request");
    responded_ = true;
    streaming_ = true;
    // HTTP/1.0 has no chunked encoding: the body then ends when the connection closes.
    chunked_ = version_ >= 11;
    if (!chunked_) keep_alive_ = false;
    http::response<http::empty_body> message{static_cast<http::status>(status), version_};
    message.set(http::field::server, "kiln");
    message.set(http::field::content_type, content_type);
    message.set(http::field::cache_control, "no-cache");
    for (const auto& [name, value] : headers) message.set(name, value);
    message.keep_alive(keep_alive_);
    if (chunked_) message.chunked(true);
    http::response_serializer<http::empty_body> serializer{message};
    error_code ec;
    http::write_header(socket_, serializer, ec);
    if (ec) broken_ = true;
    return !broken_;
  }

  bool write(std::string_view data) override {
    if (!streaming_) fail("write() before start_stream()");
    if (broken_) return false;
    if (data.empty()) return true;
    error_code ec;
    if (chunked_)
      net::write(socket_, http::make_chunk(net::const_buffer(data.data(), data.size())), ec);
    else
      net::write(socket_, net::const_buffer(data.data(), data.size()), ec);
    if (ec) broken_ = true;
    return !broken_;
  }

  bool client_gone() override {
    if (!broken_ && socket_.peer_gone()) broken_ = true;
    return broken_;
  }
  bool responded() const override { return responded_; }

  // Ends a streamed body. After this the connection may serve the next request.
  void finish() {
    if (!streaming_ || broken_ || !chunked_) return;
    error_code ec;
    net::write(socket_, http::make_chunk_last(), ec);
    if (ec) broken_ = true;
  }
  bool reusable() const { return keep_alive_ && !broken_; }

 private:
  PolledSocket& socket_;
  unsigned version_;
  bool keep_alive_;
  bool responded_ = false;
  bool streaming_ = false;
  bool chunked_ = true;
  bool broken_ = false;
};

net::ip::address parse_host(const std::string& host) {
  error_code ec;
  const auto address = net::ip::make_address(host == "localhost" ? "127.0.0.1" : host, ec);
  if (ec) fail("--host {} is not a numeric IP address (or localhost)", host);
  return address;
}

}  // namespace

class HttpServer::Impl {
 public:
  Impl(HttpServerOptions options, HttpHandler handler, ProtocolErrorBody error_body)
      : options_(std::move(options)), handler_(std::move(handler)), error_body_(std::move(error_body)), acceptor_(io_) {
    const tcp::endpoint endpoint(parse_host(options_.host), options_.port);
    error_code ec;
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) acceptor_.set_option(net::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(net::socket_base::max_listen_connections, ec);
    if (!ec) acceptor_.non_blocking(true, ec);
    if (ec) fail("cannot listen on {}:{}: {}", options_.host, options_.port, ec.message());
    port_ = acceptor_.local_endpoint().port();
  }

  ~Impl() { close(); }

  uint16_t port() const { return port_; }

  void start() {
    accept_thread_ = std::thread([this] { accept_loop(); });
  }

  void stop_accepting() {
    std::call_once(stop_accepting_once_, [this] {
      draining_.store(true);
      drain_.signal();
      if (accept_thread_.joinable()) accept_thread_.join();
      error_code ec;
      acceptor_.close(ec);
    });
  }

  void close() {
    stop_accepting();
    closing_.signal();
    std::list<Connection> connections;
    {
      std::lock_guard lock(mutex_);
      connections.splice(connections.end(), connections_);
    }
    for (auto& connection : connections) connection.thread.join();
  }

  size_t open_connections() const {
    std::lock_guard lock(mutex_);
    return static_cast<size_t>(std::count_if(connections_.begin(), connections_.end(),
                                             [](const Connection& connection) { return !connection.done.load(); }));
  }

 private:
  struct Connection {
    std::thread thread;
    std::atomic<bool> done{false};
  };

  void accept_loop() {
    for (;;) {
      pollfd entries[2] = {{acceptor_.native_handle(), POLLIN, 0}, {drain_.fd(), POLLIN, 0}};
      const int ready = ::poll(entries, 2, -1);
      if (ready < 0 && errno == EINTR) continue;
      if (ready < 0 || entries[1].revents) return;
      tcp::socket socket(io_);
      error_code ec;
      acceptor_.accept(socket, ec);
      if (ec == net::error::would_block || ec == net::error::try_again || ec == net::error::connection_aborted)
        continue;
      if (ec) {
        // Out of file descriptors, typically: back off instead of spinning on the ready socket.
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        continue;
      }
      std::lock_guard lock(mutex_);
      std::erase_if(connections_, [](Connection& connection) {
        if (!connection.done.load()) return false;
        connection.thread.join();
        return true;
      });
      if (static_cast<int>(connections_.size()) >= options_.max_connections) {
        refuse(std::move(socket));
        continue;
      }
      socket.non_blocking(true, ec);
      socket.set_option(tcp::no_delay(true), ec);
      Connection& connection = connections_.emplace_back();
      connection.thread = std::thread([this, &connection, socket = std::move(socket)]() mutable {
        serve(std::move(socket));
        connection.done.store(true);
      });
    }
  }

  // Over the connection limit: a 503 written without waiting, then close.
  void refuse(tcp::socket socket) {
    const HttpResponse response = error_body_(503, "the server has too many open connections", "");
    const std::string text = fmt::format(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: {}\r\nRetry-After: {}\r\nConnection: close\r\n"
        "Content-Length: {}\r\n\r\n{}",
        response.content_type, options_.retry_after_seconds, response.body.size(), response.body);
    error_code ec;
    socket.non_blocking(true, ec);
    socket.write_some(net::buffer(text), ec);
    socket.shutdown(tcp::socket::shutdown_send, ec);
    socket.close(ec);
  }

  void serve(tcp::socket socket) {
    PolledSocket stream(std::move(socket), options_, drain_, closing_);
    beast::flat_buffer buffer;
    for (;;) {
      http::request_parser<http::string_body> parser;
      parser.header_limit(static_cast<std::uint32_t>(options_.max_header_bytes));
      parser.body_limit(options_.max_body_bytes);
      stream.await_request(buffer.size() > 0);
      error_code ec;
      http::read_header(stream, buffer, parser, ec);
      if (!ec && beast::iequals(parser.get()[http::field::expect], "100-continue")) {
        http::response<http::empty_body> proceed{http::status::continue_, parser.get().version()};
        http::write(stream, proceed, ec);
      }
      if (!ec) http::read(stream, buffer, parser, ec);
      if (ec) {
        report_read_error(stream, parser, ec);
        break;
      }
      http::request<http::string_body> message = parser.release();
      HttpRequest request = to_request(message);
      // A draining server answers what it has been sent, then closes the connection.
      Exchange exchange(stream, message.version(), message.keep_alive() && !draining_.load());
      try {
        handler_(request, exchange);
      } catch (const std::exception& error) {
        if (!exchange.responded()) exchange.respond(error_body_(500, error.what(), request.path));
      }
      if (!exchange.responded()) exchange.respond(error_body_(500, "the handler sent no response", request.path));
      exchange.finish();
      if (!exchange.reusable()) break;
    }
    stream.close_gracefully();
  }

  // A request that could not be read: silence when none had begun (an idle keep-alive connection
  // closing, timing out or being drained); otherwise a status that says why, and close.
  void report_read_error(PolledSocket& stream, http::request_parser<http::string_body>& parser, error_code ec) {
    if (stream.idle() || ec == http::error::end_of_stream || ec == http::error::partial_message ||
        ec == net::error::operation_aborted || ec == net::error::eof || ec == net::error::connection_reset)
      return;
    int status = 400;
    std::string message = "malformed HTTP request: " + ec.message();
    if (ec == net::error::timed_out) {
      status = 408;
      message = fmt::format("the request did not arrive within {} ms", options_.request_timeout.count());
    } else if (ec == http::error::body_limit) {
      status = 413;
      message = fmt::format("the request body exceeds {} bytes", options_.max_body_bytes);
    } else if (ec == http::error::header_limit) {
      status = 431;
      message = fmt::format("the request headers exceed {} bytes", options_.max_header_bytes);
    }
    const std::string path = parser.is_header_done() ? std::string(parser.get().target()) : std::string();
    Exchange exchange(stream, 11, false);
    exchange.respond(error_body_(status, message, path.substr(0, path.find('?'))));
  }

  static HttpRequest to_request(const http::request<http::string_body>& message) {
    HttpRequest request;
    request.method = std::string(message.method_string());
    const std::string target(message.target());
    const size_t question = target.find('?');
    request.path = target.substr(0, question);
    if (question != std::string::npos) request.query = target.substr(question + 1);
    for (const auto& field : message) {
      std::string name(field.name_string());
      std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
      request.headers.emplace_back(std::move(name), std::string(field.value()));
    }
    request.body = message.body();
    return request;
  }

  HttpServerOptions options_;
  HttpHandler handler_;
  ProtocolErrorBody error_body_;
  net::io_context io_;
  tcp::acceptor acceptor_;
  uint16_t port_ = 0;
  Latch drain_;
  Latch closing_;
  std::thread accept_thread_;
  std::once_flag stop_accepting_once_;
  std::atomic<bool> draining_{false};
  mutable std::mutex mutex_;
  std::list<Connection> connections_;
};

HttpServer::HttpServer(HttpServerOptions options, HttpHandler handler, ProtocolErrorBody error_body)
    : impl_(std::make_unique<Impl>(std::move(options), std::move(handler), std::move(error_body))) {}
HttpServer::~HttpServer() = default;
uint16_t HttpServer::port() const { return impl_->port(); }
void HttpServer::start() { impl_->start(); }
void HttpServer::stop_accepting() { impl_->stop_accepting(); }
void HttpServer::close() { impl_->close(); }
size_t HttpServer::open_connections() const { return impl_->open_connections(); }

}  // namespace kiln::server

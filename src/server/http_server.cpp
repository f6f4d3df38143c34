#include "server/http_server.h"

#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/http.hpp>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <list>
#include <mutex>
#include <optional>
#include <set>
#include <system_error>
#include <thread>
#include <unordered_map>

#include "core/error.h"
#include "server/http_exchange.h"
#include "server/http_request_reader.h"

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

size_t connection_limit_for_descriptors() {
  // Descriptors left to the rest of the process: the listening socket, the event loop's own, model
  // files, logs, a GPU driver's.
  constexpr rlim_t kReserved = 128;
  // Linux's default fs.nr_open (Documentation/admin-guide/sysctl/fs.rst), the most an unlimited
  // RLIMIT_NOFILE can give one process.
  constexpr rlim_t kUnlimited = 1u << 20;
  rlimit limit{};
  const rlim_t descriptors = ::getrlimit(RLIMIT_NOFILE, &limit) != 0 ? 1024
                             : limit.rlim_cur == RLIM_INFINITY     ? kUnlimited
                                                                   : limit.rlim_cur;
  return static_cast<size_t>(descriptors > 2 * kReserved ? descriptors - kReserved : descriptors / 2);
}

namespace {

using transport::BufferSink;
using transport::EventFd;
using transport::Exchange;
using transport::PolledSocket;

net::ip::address parse_host(const std::string& host) {
  error_code ec;
  const auto address = net::ip::make_address(host == "localhost" ? "127.0.0.1" : host, ec);
  if (ec) fail("--host {} is not a numeric IP address (or localhost)", host);
  return address;
}

// The event loop's names for what epoll reports: the listening socket, the wake-up eventfd, and
// connections by an id never reused (a descriptor number is reused as soon as it is closed).
constexpr uint64_t kListenerId = 0;
constexpr uint64_t kWakeupId = 1;
constexpr uint64_t kFirstConnectionId = 2;

constexpr size_t kReadChunk = 16 << 10;
// Reads per readiness report, so that one fast client does not starve the others.
constexpr int kReadsPerEvent = 4;
// How long, and how much, a closing connection's late bytes are read and dropped, so that the
// close does not reset the connection before the client has read our last response.
constexpr std::chrono::milliseconds kLingerTime{200};
constexpr size_t kLingerBytes = 1u << 20;
// A failing accept() (out of descriptors, typically) pauses accepting this long instead of
// spinning on the still-ready listener.
constexpr std::chrono::milliseconds kAcceptBackoff{50};

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
    connection_limit_ = options_.max_connections > 0 ? static_cast<size_t>(options_.max_connections)
                                                     : connection_limit_for_descriptors();
    epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
    if (epoll_ < 0) fail("epoll_create1 failed: {}", std::strerror(errno));
  }

  ~Impl() {
    close();
    ::close(epoll_);
  }

  uint16_t port() const { return port_; }
  size_t connection_limit() const { return connection_limit_; }
  size_t open_connections() const { return open_connections_.load(); }

  void start() {
    watch(kWakeupId, wakeup_.fd(), EPOLLIN);
    watch(kListenerId, acceptor_.native_handle(), EPOLLIN);
    loop_thread_ = std::thread([this] { run(); });
  }

  void drain() {
    draining_.store(true);
    wakeup_.signal();
  }

  void stop_accepting() {
    std::call_once(stop_accepting_once_, [this] {
      drain();
      if (!loop_thread_.joinable()) {
        error_code ec;
        acceptor_.close(ec);
        return;
      }
      std::unique_lock lock(command_mutex_);
      stop_accepting_requested_ = true;
      wakeup_.signal();
      command_done_.wait(lock, [&] { return !accepting_; });
    });
  }

  void close() {
    std::call_once(close_once_, [this] {
      stop_accepting();
      closing_requested_.store(true);
      closing_.signal();  // ends every handler's socket waits
      wakeup_.signal();
      if (loop_thread_.joinable()) loop_thread_.join();
      for (auto& handler : handlers_) handler.thread.join();
      handlers_.clear();
      connections_.clear();
      open_connections_.store(0);
    });
  }

 private:
  enum class Phase {
    reading,   // waiting for, or reading, a request (EPOLLIN)
    writing,   // sending the event loop's response (EPOLLOUT)
    handling,  // a handler thread owns the socket (not watched)
    closing,   // half-closed, dropping the client's late bytes (EPOLLIN)
    closed,    // to be destroyed at the end of the loop's turn
  };

  struct Connection {
    Connection(uint64_t id, tcp::socket socket, const HttpServerOptions& options)
        : id(id), socket(std::move(socket)), reader(options.max_header_bytes, options.max_body_bytes) {}
    int fd() { return socket.native_handle(); }

    const uint64_t id;
    tcp::socket socket;
    HttpRequestReader reader;
    std::string input;   // received, not yet taken by the reader: the next request's bytes
    std::string output;  // the event loop's response, sent from output_sent on
    size_t output_sent = 0;
    bool close_after_output = false;
    Phase phase = Phase::reading;
    uint32_t watched_events = 0;  // 0: not in the epoll set
    std::optional<Clock::time_point> deadline;
    bool served_one = false;  // idle between requests now, not waiting for its first
    bool continue_sent = false;
    size_t lingered = 0;
    bool keep_open = false;  // set by the handler thread: the connection may serve another request
  };

  struct HandlerThread {
    std::thread thread;
    std::atomic<bool> done{false};
  };

  // --- the event loop ---

  void run() {
    std::array<epoll_event, 256> events;
    while (!closing_requested_.load()) {
      apply_commands();
      take_back_connections();
      reap_handlers();
      expire_deadlines();
      destroy_closed();
      const int ready = ::epoll_wait(epoll_, events.data(), static_cast<int>(events.size()), wait_milliseconds());
      if (ready < 0 && errno == EINTR) continue;
      if (ready < 0) fail("epoll_wait failed: {}", std::strerror(errno));
      for (int i = 0; i < ready; ++i) {
        const uint64_t id = events[static_cast<size_t>(i)].data.u64;
        if (id == kWakeupId)
          wakeup_.clear();
        else if (id == kListenerId)
          accept_connections();
        else if (auto found = connections_.find(id); found != connections_.end())
          on_ready(*found->second);
      }
      destroy_closed();
    }
  }

  void on_ready(Connection& connection) {
    switch (connection.phase) {
      case Phase::reading: read_input(connection); break;
      case Phase::writing:
        flush_output(connection);
        process_input(connection);
        break;
      case Phase::closing: drop_late_input(connection); break;
      case Phase::handling:
      case Phase::closed: break;
    }
  }

  void apply_commands() {
    if (draining_.load() && !drain_applied_) {
      drain_applied_ = true;
      for (auto& [id, connection] : connections_)
        if (idle_keep_alive(*connection)) close_now(*connection);
    }
    {
      std::lock_guard lock(command_mutex_);
      if (stop_accepting_requested_ && accepting_) {
        if (listener_watched_) unwatch(acceptor_.native_handle());
        listener_watched_ = false;
        error_code ec;
        acceptor_.close(ec);
        accepting_ = false;
        command_done_.notify_all();
      }
    }
    if (accepting_ && !listener_watched_ && Clock::now() >= accept_resume_) {
      watch(kListenerId, acceptor_.native_handle(), EPOLLIN);
      listener_watched_ = true;
    }
  }

  void accept_connections() {
    for (int accepted = 0; accepted < 64; ++accepted) {
      tcp::socket socket(io_);
      error_code ec;
      acceptor_.accept(socket, ec);
      if (ec == net::error::would_block || ec == net::error::try_again) return;
      if (ec == net::error::connection_aborted) continue;
      if (ec) {
        unwatch(acceptor_.native_handle());
        listener_watched_ = false;
        accept_resume_ = Clock::now() + kAcceptBackoff;
        return;
      }
      if (connections_.size() >= connection_limit_) {
        refuse(std::move(socket));
        continue;
      }
      socket.non_blocking(true, ec);
      socket.set_option(tcp::no_delay(true), ec);
      const uint64_t id = next_connection_id_++;
      Connection& connection =
          *connections_.emplace(id, std::make_unique<Connection>(id, std::move(socket), options_)).first->second;
      open_connections_.store(connections_.size());
      resume_reading(connection);
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

  // --- reading a request ---

  // Waits for the next request: the idle timeout until its first byte (pipelined bytes already
  // here start the request timeout at once).
  void resume_reading(Connection& connection) {
    connection.phase = Phase::reading;
    if (draining_.load() && idle_keep_alive(connection)) {
      close_now(connection);
      return;
    }
    watch(connection, EPOLLIN);
    const bool started = connection.reader.started() || !connection.input.empty();
    set_deadline(connection, Clock::now() + (started ? options_.request_timeout : options_.idle_timeout));
  }

  bool idle_keep_alive(const Connection& connection) const {
    return connection.phase == Phase::reading && connection.served_one && connection.input.empty() &&
           !connection.reader.started();
  }

  void read_input(Connection& connection) {
    char chunk[kReadChunk];
    for (int reads = 0; reads < kReadsPerEvent && connection.phase == Phase::reading; ++reads) {
      const ssize_t received = ::recv(connection.fd(), chunk, sizeof chunk, 0);
      if (received < 0 && errno == EINTR) continue;
      if (received < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (received <= 0) {  // closed or reset by the client: nobody to answer
        close_now(connection);
        return;
      }
      if (connection.input.empty() && !connection.reader.started())
        set_deadline(connection, Clock::now() + options_.request_timeout);
      connection.input.append(chunk, static_cast<size_t>(received));
      process_input(connection);
    }
  }

  // Feeds the reader and dispatches each complete request, while the connection is the event
  // loop's to read (a response being written or handled holds the next pipelined request back).
  void process_input(Connection& connection) {
    while (connection.phase == Phase::reading) {
      if (!connection.input.empty()) connection.input.erase(0, connection.reader.feed(connection.input));
      HttpRequestReader& reader = connection.reader;
      if (reader.failed()) {
        respond_now(connection, error_body_(reader.error_status(), reader.error_message(), reader.path()), 11, false,
                    false, {});
        return;
      }
      if (reader.expects_continue() && !connection.continue_sent) send_continue(connection);
      if (connection.phase != Phase::reading || !reader.complete()) return;
      dispatch(connection);
    }
  }

  // The interim 100 Continue, sent at once: nothing else is being written on this connection.
  void send_continue(Connection& connection) {
    connection.continue_sent = true;
    constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
    if (::send(connection.fd(), kContinue.data(), kContinue.size(), MSG_NOSIGNAL | MSG_DONTWAIT) !=
        static_cast<ssize_t>(kContinue.size()))
      close_now(connection);
  }

  void dispatch(Connection& connection) {
    const unsigned version = connection.reader.version();
    // A draining server answers what it has been sent, then closes the connection.
    const bool keep_alive = connection.reader.keep_alive() && !draining_.load();
    HttpRequest request = connection.reader.take();
    connection.continue_sent = false;
    connection.served_one = true;
    const bool head = request.method == "HEAD";
    HeaderList cors = options_.cors.response_headers(request);
    if (auto preflight = options_.cors.preflight(request)) {
      respond_now(connection, std::move(*preflight), version, keep_alive, head, {});
      return;
    }
    if (std::find(options_.event_loop_paths.begin(), options_.event_loop_paths.end(), request.path) !=
        options_.event_loop_paths.end()) {
      BufferSink sink(connection.output);
      Exchange<BufferSink> exchange(sink, version, keep_alive, head, std::move(cors));
      run_handler(request, exchange);
      send_output(connection, !exchange.reusable());
      return;
    }
    if (active_handlers_ >= options_.max_concurrent_requests) {
      respond_now(connection,
                  error_body_(503,
                              fmt::format("the server is handling as many requests as it may at once ({})",
                                          options_.max_concurrent_requests),
                              request.path),
                  version, keep_alive, head, std::move(cors));
      return;
    }
    start_handler(connection, std::move(request), version, keep_alive, head, std::move(cors));
  }

  // --- responses written by the event loop ---

  void respond_now(Connection& connection, HttpResponse response, unsigned version, bool keep_alive, bool head,
                   HeaderList common_headers) {
    if (response.status == 503 && std::none_of(response.headers.begin(), response.headers.end(), [](const auto& h) {
          return beast::iequals(h.first, "retry-after");
        }))
      response.headers.emplace_back("Retry-After", std::to_string(options_.retry_after_seconds));
    BufferSink sink(connection.output);
    Exchange<BufferSink> exchange(sink, version, keep_alive, head, std::move(common_headers));
    exchange.respond(response);
    send_output(connection, !exchange.reusable());
  }

  void send_output(Connection& connection, bool close_after) {
    connection.close_after_output = close_after;
    connection.phase = Phase::writing;
    flush_output(connection);
  }

  // Sends what the socket takes now; the rest when it is writable again (each wait bounded by the
  // write timeout). Then the connection reads its next request, or closes.
  void flush_output(Connection& connection) {
    while (connection.output_sent < connection.output.size()) {
      const ssize_t sent = ::send(connection.fd(), connection.output.data() + connection.output_sent,
                                  connection.output.size() - connection.output_sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (sent > 0) {
        connection.output_sent += static_cast<size_t>(sent);
        continue;
      }
      if (sent < 0 && errno == EINTR) continue;
      if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        watch(connection, EPOLLOUT);
        set_deadline(connection, Clock::now() + options_.write_timeout);
        return;
      }
      close_now(connection);
      return;
    }
    connection.output.clear();
    connection.output_sent = 0;
    if (connection.close_after_output)
      close_gracefully(connection);
    else
      resume_reading(connection);
  }

  // Half-closes, then drops what the client still sends for a moment.
  void close_gracefully(Connection& connection) {
    error_code ec;
    connection.socket.shutdown(tcp::socket::shutdown_send, ec);
    connection.phase = Phase::closing;
    connection.input.clear();
    connection.lingered = 0;
    watch(connection, EPOLLIN);
    set_deadline(connection, Clock::now() + kLingerTime);
  }

  void drop_late_input(Connection& connection) {
    char chunk[kReadChunk];
    for (int reads = 0; reads < kReadsPerEvent; ++reads) {
      const ssize_t received = ::recv(connection.fd(), chunk, sizeof chunk, 0);
      if (received < 0 && errno == EINTR) continue;
      if (received < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (received <= 0 || (connection.lingered += static_cast<size_t>(received)) >= kLingerBytes) {
        close_now(connection);
        return;
      }
    }
  }

  void close_now(Connection& connection) {
    if (connection.phase == Phase::closed) return;
    if (connection.watched_events) unwatch(connection.fd());
    connection.watched_events = 0;
    clear_deadline(connection);
    error_code ec;
    connection.socket.close(ec);
    connection.phase = Phase::closed;
    closed_.push_back(connection.id);
  }

  void destroy_closed() {
    for (const uint64_t id : closed_) connections_.erase(id);
    closed_.clear();
    open_connections_.store(connections_.size());
  }

  // --- deadlines ---

  void set_deadline(Connection& connection, Clock::time_point deadline) {
    clear_deadline(connection);
    connection.deadline = deadline;
    deadlines_.emplace(deadline, connection.id);
  }
  void clear_deadline(Connection& connection) {
    if (connection.deadline) deadlines_.erase({*connection.deadline, connection.id});
    connection.deadline.reset();
  }

  void expire_deadlines() {
    const auto now = Clock::now();
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      Connection& connection = *connections_.at(deadlines_.begin()->second);
      clear_deadline(connection);
      const bool request_begun = connection.reader.started() || !connection.input.empty();
      if (connection.phase == Phase::reading && request_begun)
        respond_now(connection,
                    error_body_(408,
                                fmt::format("the request did not arrive within {} ms", options_.request_timeout.count()),
                                connection.reader.path()),
                    11, false, false, {});
      else
        close_now(connection);  // idle past the idle timeout, a stalled write, or the end of a linger
    }
  }

  int wait_milliseconds() const {
    std::optional<Clock::time_point> next;
    if (!deadlines_.empty()) next = deadlines_.begin()->first;
    if (accepting_ && !listener_watched_ && (!next || accept_resume_ < *next)) next = accept_resume_;
    if (!next) return -1;
    const auto wait = std::chrono::ceil<std::chrono::milliseconds>(*next - Clock::now()).count();
    return static_cast<int>(std::clamp<int64_t>(wait, 0, INT_MAX));
  }

  // --- handler threads ---

  void start_handler(Connection& connection, HttpRequest request, unsigned version, bool keep_alive, bool head,
                     HeaderList common_headers) {
    watch(connection, 0);
    clear_deadline(connection);
    connection.phase = Phase::handling;
    HandlerThread& handler = handlers_.emplace_back();
    Connection* owned = &connection;
    try {
      handler.thread = std::thread([this, owned, &handler, request = std::move(request), version, keep_alive, head,
                                    common_headers]() mutable {
        PolledSocket stream(owned->socket, options_.write_timeout, closing_);
        Exchange<PolledSocket> exchange(stream, version, keep_alive, head, std::move(common_headers));
        run_handler(request, exchange);
        owned->keep_open = exchange.reusable();
        {
          std::lock_guard lock(returned_mutex_);
          returned_.push_back(owned->id);
        }
        wakeup_.signal();
        handler.done.store(true);
      });
    } catch (const std::system_error& error) {
      handlers_.pop_back();
      connection.phase = Phase::reading;
      respond_now(connection, error_body_(503, fmt::format("cannot start a handler thread: {}", error.what()), ""),
                  version, false, head, std::move(common_headers));
      return;
    }
    ++active_handlers_;
  }

  template <class Stream>
  void run_handler(const HttpRequest& request, Exchange<Stream>& exchange) {
    try {
      handler_(request, exchange);
    } catch (const std::exception& error) {
      if (!exchange.responded()) exchange.respond(error_body_(500, error.what(), request.path));
    }
    if (!exchange.responded()) exchange.respond(error_body_(500, "the handler sent no response", request.path));
    exchange.finish();
  }

  // Connections whose handler returned: they read their next request (pipelined bytes may
  // already hold it), or close.
  void take_back_connections() {
    std::vector<uint64_t> returned;
    {
      std::lock_guard lock(returned_mutex_);
      returned.swap(returned_);
    }
    for (const uint64_t id : returned) {
      --active_handlers_;
      Connection& connection = *connections_.at(id);
      if (!connection.keep_open) {
        close_gracefully(connection);
        continue;
      }
      resume_reading(connection);
      process_input(connection);
    }
  }

  void reap_handlers() {
    std::erase_if(handlers_, [](HandlerThread& handler) {
      if (!handler.done.load()) return false;
      handler.thread.join();
      return true;
    });
  }

  // --- the epoll set ---

  void watch(uint64_t id, int fd, uint32_t events) {
    epoll_event event{};
    event.events = events;
    event.data.u64 = id;
    if (::epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &event) != 0) fail("epoll_ctl failed: {}", std::strerror(errno));
  }
  void watch(Connection& connection, uint32_t events) {
    if (connection.watched_events == events) return;
    if (events == 0) {
      unwatch(connection.fd());
    } else {
      epoll_event event{};
      event.events = events;
      event.data.u64 = connection.id;
      ::epoll_ctl(epoll_, connection.watched_events ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, connection.fd(), &event);
    }
    connection.watched_events = events;
  }
  void unwatch(int fd) { ::epoll_ctl(epoll_, EPOLL_CTL_DEL, fd, nullptr); }

  HttpServerOptions options_;
  HttpHandler handler_;
  ProtocolErrorBody error_body_;
  net::io_context io_;
  tcp::acceptor acceptor_;
  uint16_t port_ = 0;
  size_t connection_limit_ = 0;
  int epoll_ = -1;
  EventFd wakeup_;
  EventFd closing_;
  std::thread loop_thread_;
  std::once_flag stop_accepting_once_;
  std::once_flag close_once_;
  std::atomic<bool> draining_{false};
  std::atomic<bool> closing_requested_{false};
  std::atomic<size_t> open_connections_{0};
  std::mutex command_mutex_;
  std::condition_variable command_done_;
  bool stop_accepting_requested_ = false;  // under command_mutex_
  bool accepting_ = true;                  // under command_mutex_ (written by the loop only)
  std::mutex returned_mutex_;
  std::vector<uint64_t> returned_;  // under returned_mutex_

  // The event loop's own (and close()'s, once the loop has stopped).
  std::unordered_map<uint64_t, std::unique_ptr<Connection>> connections_;
  std::set<std::pair<Clock::time_point, uint64_t>> deadlines_;
  std::vector<uint64_t> closed_;
  std::list<HandlerThread> handlers_;
  int active_handlers_ = 0;
  uint64_t next_connection_id_ = kFirstConnectionId;
  bool drain_applied_ = false;
  bool listener_watched_ = true;
  Clock::time_point accept_resume_{};
};

HttpServer::HttpServer(HttpServerOptions options, HttpHandler handler, ProtocolErrorBody error_body)
    : impl_(std::make_unique<Impl>(std::move(options), std::move(handler), std::move(error_body))) {}
HttpServer::~HttpServer() = default;
uint16_t HttpServer::port() const { return impl_->port(); }
size_t HttpServer::connection_limit() const { return impl_->connection_limit(); }
void HttpServer::start() { impl_->start(); }
void HttpServer::drain() { impl_->drain(); }
void HttpServer::stop_accepting() { impl_->stop_accepting(); }
void HttpServer::close() { impl_->close(); }
size_t HttpServer::open_connections() const { return impl_->open_connections(); }

}  // namespace kiln::server

// The transport's pieces around a socket, for http_server.cpp only (it is the one translation unit
// that includes this, and Beast): an eventfd, a handler thread's polled socket, the event loop's
// output buffer, and the HttpExchange that writes a response to either.
#pragma once

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/http.hpp>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <string>

#include "core/error.h"
#include "server/http_server.h"

namespace kiln::server::transport {

namespace net = boost::asio;
namespace http = boost::beast::http;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;
using boost::system::error_code;

// An eventfd: signal() makes it readable until clear(); a latch when never cleared, so every
// poll() that includes it wakes.
class EventFd {
 public:
  EventFd() : fd_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    if (fd_ < 0) fail("eventfd failed: {}", std::strerror(errno));
  }
  ~EventFd() { ::close(fd_); }
  EventFd(const EventFd&) = delete;
  EventFd& operator=(const EventFd&) = delete;
  void signal() {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t written = ::write(fd_, &one, sizeof one);
  }
  void clear() {
    uint64_t count;
    [[maybe_unused]] const ssize_t read = ::read(fd_, &count, sizeof count);
  }
  int fd() const { return fd_; }

 private:
  int fd_;
};

// A handler thread's view of its connection's socket (non-blocking): writes wait in poll() and
// must make progress within the write timeout; the closing latch ends any wait. It satisfies
// Asio's SyncWriteStream.
class PolledSocket {
 public:
  PolledSocket(tcp::socket& socket, std::chrono::milliseconds write_timeout, const EventFd& closing)
      : socket_(socket), write_timeout_(write_timeout), closing_(closing) {}

  template <class ConstBuffers>
  size_t write_some(const ConstBuffers& buffers, error_code& ec) {
    const auto deadline = Clock::now() + write_timeout_;
    for (;;) {
      const size_t sent = socket_.write_some(buffers, ec);
      if (ec != net::error::would_block) return sent;
      if (!wait_writable(deadline, ec)) return 0;
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

 private:
  bool wait_writable(Clock::time_point deadline, error_code& ec) {
    pollfd entries[2] = {{socket_.native_handle(), POLLOUT, 0}, {closing_.fd(), POLLIN, 0}};
    for (;;) {
      const auto remaining = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (remaining <= 0) {
        ec = net::error::timed_out;
        return false;
      }
      const int ready = ::poll(entries, 2, static_cast<int>(std::min<int64_t>(remaining, INT_MAX)));
      if (ready < 0 && errno == EINTR) continue;
      if (ready < 0) {
        ec = error_code(errno, boost::system::system_category());
        return false;
      }
      if (ready == 0) continue;
      if (entries[1].revents) {
        ec = net::error::operation_aborted;
        return false;
      }
      return true;  // writable, or an error the next write reports
    }
  }

  tcp::socket& socket_;
  std::chrono::milliseconds write_timeout_;
  const EventFd& closing_;
};

// A SyncWriteStream that appends to a string: the event loop's responses, sent without blocking
// as the socket takes them.
class BufferSink {
 public:
  explicit BufferSink(std::string& out) : out_(out) {}
  template <class ConstBuffers>
  size_t write_some(const ConstBuffers& buffers, error_code& ec) {
    ec = {};
    const size_t size = net::buffer_size(buffers);
    const size_t start = out_.size();
    out_.resize(start + size);
    net::buffer_copy(net::buffer(out_.data() + start, size), buffers);
    return size;
  }
  template <class ConstBuffers>
  size_t write_some(const ConstBuffers& buffers) {
    error_code ec;
    return write_some(buffers, ec);
  }
  bool peer_gone() { return false; }

 private:
  std::string& out_;
};

template <class Stream>
class Exchange final : public HttpExchange {
 public:
  // `common_headers` go on the response whatever it is (the CORS grant).
  Exchange(Stream& stream, unsigned version, bool keep_alive, bool head_only, HeaderList common_headers)
      : stream_(stream),
        version_(version),
        keep_alive_(keep_alive),
        head_only_(head_only),
        common_headers_(std::move(common_headers)) {}

  void respond(const HttpResponse& response) override {
    if (responded_) fail("an HTTP response was already sent for this request");
    responded_ = true;
    http::response<http::string_body> message{static_cast<http::status>(response.status), version_};
    message.set(http::field::server, "kiln");
    message.set(http::field::content_type, response.content_type);
    for (const auto& [name, value] : common_headers_) message.set(name, value);
    for (const auto& [name, value] : response.headers) message.set(name, value);
    message.body() = response.body;
    message.keep_alive(keep_alive_);
    message.prepare_payload();
    error_code ec;
    if (head_only_) {
      http::response_serializer<http::string_body> serializer{message};
      http::write_header(stream_, serializer, ec);
    } else {
      http::write(stream_, message, ec);
    }
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
    for (const auto& [name, value] : common_headers_) message.set(name, value);
    for (const auto& [name, value] : headers) message.set(name, value);
    message.keep_alive(keep_alive_);
    if (chunked_) message.chunked(true);
    http::response_serializer<http::empty_body> serializer{message};
    error_code ec;
    http::write_header(stream_, serializer, ec);
    if (ec) broken_ = true;
    return !broken_;
  }

  bool write(std::string_view data) override {
    if (!streaming_) fail("write() before start_stream()");
    if (broken_ || head_only_) return false;
    if (data.empty()) return true;
    error_code ec;
    if (chunked_)
      net::write(stream_, http::make_chunk(net::const_buffer(data.data(), data.size())), ec);
    else
      net::write(stream_, net::const_buffer(data.data(), data.size()), ec);
    if (ec) broken_ = true;
    return !broken_;
  }

  bool client_gone() override {
    if (!broken_ && stream_.peer_gone()) broken_ = true;
    return broken_;
  }
  bool responded() const override { return responded_; }

  // Ends a streamed body. After this the connection may serve the next request.
  void finish() {
    if (!streaming_ || broken_ || !chunked_ || head_only_) return;
    error_code ec;
    net::write(stream_, http::make_chunk_last(), ec);
    if (ec) broken_ = true;
  }
  bool reusable() const { return keep_alive_ && !broken_; }

 private:
  Stream& stream_;
  unsigned version_;
  bool keep_alive_;
  bool head_only_;
  HeaderList common_headers_;
  bool responded_ = false;
  bool streaming_ = false;
  bool chunked_ = true;
  bool broken_ = false;
};

}  // namespace kiln::server::transport

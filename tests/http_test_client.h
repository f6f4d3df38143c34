// A raw HTTP/1.1 client over a loopback socket, for tests that need what a library client hides:
// half-sent requests, malformed bytes, disconnecting mid-stream, reading a stream piece by piece.
// Every read has a deadline, so a test never hangs on a silent server.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace kiln::testing {

struct RawResponse {
  int status = 0;
  std::map<std::string, std::string> headers;  // names in lower case
  std::string body;                            // de-chunked
};

class RawConnection {
 public:
  explicit RawConnection(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);  // 127.0.0.1 only
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~RawConnection() { close(); }
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;

  bool connected() const { return fd_ >= 0; }
  int fd() const { return fd_; }  // for socket options
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  // Closes with a reset (SO_LINGER 0), as a killed client would.
  void reset() {
    if (fd_ < 0) return;
    linger option{1, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_LINGER, &option, sizeof option);
    close();
  }

  bool send(std::string_view bytes) {
    while (!bytes.empty()) {
      const ssize_t sent = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (sent <= 0) return false;
      bytes.remove_prefix(static_cast<size_t>(sent));
    }
    return true;
  }

  // Receives more bytes into the buffer; false on EOF, error or timeout.
  bool receive_more(std::chrono::milliseconds timeout) {
    pollfd entry{fd_, POLLIN, 0};
    if (::poll(&entry, 1, static_cast<int>(timeout.count())) <= 0) return false;
    char chunk[16384];
    const ssize_t received = ::recv(fd_, chunk, sizeof chunk, 0);
    if (received <= 0) {
      eof_ = true;
      return false;
    }
    buffer_.append(chunk, static_cast<size_t>(received));
    return true;
  }

  // Reads until `text` has arrived (the buffer keeps everything read).
  bool read_until(std::string_view text, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (buffer_.find(text) == std::string::npos) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0 || !receive_more(left)) return false;
    }
    return true;
  }

  // True when the server closes the connection within `timeout` (data before the close is kept).
  bool closed_within(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!eof_) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      if (!receive_more(left) && !eof_) return false;
    }
    return true;
  }

  // One whole response (Content-Length, chunked, or ended by close), removed from the buffer.
  std::optional<RawResponse> read_response(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto more = [&] {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      return left.count() > 0 && receive_more(left);
    };
    size_t head_end;
    while ((head_end = buffer_.find("\r\n\r\n")) == std::string::npos)
      if (!more()) return std::nullopt;
    RawResponse response;
    const std::string head = buffer_.substr(0, head_end);
    if (head.size() < 12 || head.compare(0, 5, "HTTP/") != 0) return std::nullopt;
    response.status = std::stoi(head.substr(9, 3));
    for (size_t line = head.find("\r\n"); line != std::string::npos;) {
      const size_t next = head.find("\r\n", line + 2);
      const std::string field = head.substr(line + 2, next == std::string::npos ? std::string::npos : next - line - 2);
      const size_t colon = field.find(':');
      if (colon != std::string::npos) {
        std::string name = field.substr(0, colon);
        for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        response.headers[name] = field.substr(field.find_first_not_of(' ', colon + 1));
      }
      line = next;
    }
    size_t position = head_end + 4;
    if (response.status == 100) {  // an interim response: the caller reads the final one next
      buffer_.erase(0, position);
      return response;
    }
    if (auto length = response.headers.find("content-length"); length != response.headers.end()) {
      const size_t size = std::stoul(length->second);
      while (buffer_.size() < position + size)
        if (!more()) return std::nullopt;
      response.body = buffer_.substr(position, size);
      buffer_.erase(0, position + size);
    } else if (response.headers["transfer-encoding"] == "chunked") {
      for (;;) {
        size_t line_end;
        while ((line_end = buffer_.find("\r\n", position)) == std::string::npos)
          if (!more()) return std::nullopt;
        const size_t size = std::stoul(buffer_.substr(position, line_end - position), nullptr, 16);
        while (buffer_.size() < line_end + 2 + size + 2)
          if (!more()) return std::nullopt;
        response.body += buffer_.substr(line_end + 2, size);
        position = line_end + 2 + size + 2;
        if (size == 0) break;
      }
      buffer_.erase(0, position);
    } else {
      while (more()) {
      }
      if (!eof_) return std::nullopt;
      response.body = buffer_.substr(position);
      buffer_.clear();
    }
    return response;
  }

  const std::string& buffer() const { return buffer_; }

 private:
  int fd_ = -1;
  std::string buffer_;
  bool eof_ = false;
};

// A request with Content-Length, on a connection the server keeps open (HTTP/1.1 default).
inline std::string http_request(const std::string& method, const std::string& path, const std::string& body,
                                const std::string& extra_headers = "") {
  std::string request = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" + extra_headers;
  if (!body.empty() || method == "POST")
    request += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  return request + "\r\n" + body;
}

// One request on a fresh connection.
inline std::optional<RawResponse> http_exchange(uint16_t port, const std::string& method, const std::string& path,
                                                const std::string& body, const std::string& extra_headers = "",
                                                std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  RawConnection connection(port);
  if (!connection.connected() || !connection.send(http_request(method, path, body, extra_headers))) return std::nullopt;
  return connection.read_response(timeout);
}

}  // namespace kiln::testing

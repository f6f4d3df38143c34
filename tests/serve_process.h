// `kiln serve` as a real process on a free loopback port, on the stories260K model, and the small
// HTTP helpers the tests that drive it share.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "http_test_client.h"
#include "test_support.h"

namespace kiln::testing {

using namespace std::chrono_literals;

// `kiln serve` started on a free loopback port; its stderr is collected. Stopped (SIGTERM, then
// SIGKILL after a bound) when the object dies.
class ServeProcess {
 public:
  explicit ServeProcess(std::vector<std::string> arguments) {
    int pipe_fds[2];
    if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return;
    std::vector<std::string> argv = {kiln_binary().string(), "serve", "--host", "127.0.0.1", "--port", "0"};
    argv.insert(argv.end(), arguments.begin(), arguments.end());
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(pipe_fds[1], STDERR_FILENO);
      ::dup2(pipe_fds[1], STDOUT_FILENO);
      std::vector<char*> raw;
      for (auto& argument : argv) raw.push_back(argument.data());
      raw.push_back(nullptr);
      ::execv(raw[0], raw.data());
      ::_exit(127);
    }
    ::close(pipe_fds[1]);
    reader_ = std::thread([this, fd = pipe_fds[0]] {
      char buffer[4096];
      ssize_t count;
      while ((count = ::read(fd, buffer, sizeof buffer)) > 0) {
        std::lock_guard lock(mutex_);
        log_.append(buffer, static_cast<size_t>(count));
      }
      ::close(fd);
    });
    const std::regex listening(R"(listening on http://127\.0\.0\.1:(\d+))");
    for (int i = 0; i < 300 && port_ == 0 && running(); ++i) {
      std::smatch match;
      const std::string text = log();
      if (std::regex_search(text, match, listening))
        port_ = static_cast<uint16_t>(std::stoi(match[1]));
      else
        std::this_thread::sleep_for(50ms);
    }
    // The port opens before the weights load (/health says "loading" until then).
    for (int i = 0; i < 600 && port_ != 0 && running() && log().find("ready in") == std::string::npos; ++i)
      std::this_thread::sleep_for(50ms);
  }
  ~ServeProcess() {
    if (pid_ > 0 && running()) stop(SIGKILL, 5s);
    if (reader_.joinable()) reader_.join();
  }

  uint16_t port() const { return port_; }
  std::string log() const {
    std::lock_guard lock(mutex_);
    return log_;
  }
  bool running() {
    if (exit_status_) return false;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) exit_status_ = status;
    return !exit_status_;
  }
  // Sends `signal` and waits for the exit; the exit code, or -1 if it did not exit in time.
  int stop(int signal, std::chrono::milliseconds timeout) {
    if (running()) ::kill(pid_, signal);
    return wait_exit(timeout);
  }
  void signal(int signal) { ::kill(pid_, signal); }
  int wait_exit(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (running() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(20ms);
    if (running()) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      return -1;
    }
    return WIFEXITED(*exit_status_) ? WEXITSTATUS(*exit_status_) : -1;
  }

 private:
  pid_t pid_ = -1;
  uint16_t port_ = 0;
  std::optional<int> exit_status_;
  std::thread reader_;
  mutable std::mutex mutex_;
  std::string log_;
};

#define KILN_REQUIRE_STORIES(dir)            \
  const std::filesystem::path dir = stories_dir(); \
  if (!std::filesystem::exists(kiln_binary())) GTEST_SKIP() << kiln_binary() << " is not built"

inline std::vector<std::string> stories_arguments(const std::filesystem::path& dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> arguments = {"--model", dir.string()};
  arguments.insert(arguments.end(), extra.begin(), extra.end());
  return arguments;
}

inline nlohmann::ordered_json chat_body(const std::string& content, int max_tokens,
                                        nlohmann::ordered_json extra = nlohmann::ordered_json::object()) {
  nlohmann::ordered_json body = {{"model", "stories260K"},
               {"messages", {{{"role", "user"}, {"content", content}}}},
               {"max_tokens", max_tokens},
               {"temperature", 0}};
  body.update(extra);
  return body;
}

inline std::optional<RawResponse> post(uint16_t port, const std::string& path, const nlohmann::ordered_json& body,
                                const std::string& headers = "") {
  return http_exchange(port, "POST", path, body.dump(), headers);
}

inline double metric_value(uint16_t port, const std::string& name) {
  auto response = http_exchange(port, "GET", "/metrics", "");
  if (!response) return -1;
  std::smatch match;
  // Every series carries the server's model_name label (and only that, for the gauges read here).
  if (!std::regex_search(response->body, match, std::regex("\n" + name + "\\{model_name=\"[^\"]*\"\\} ([0-9.e+-]+)\n")))
    return -1;
  return std::stod(match[1]);
}

}  // namespace kiln::testing

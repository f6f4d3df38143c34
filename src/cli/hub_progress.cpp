#include "cli/hub_progress.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>

#include <fmt/format.h>

namespace kiln::cli {
namespace {

using Clock = std::chrono::steady_clock;

std::string duration_text(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto whole = static_cast<long long>(seconds + 0.5);
  if (whole >= 3600) return fmt::format("{}h{:02}m", whole / 3600, whole / 60 % 60);
  if (whole >= 60) return fmt::format("{}m{:02}s", whole / 60, whole % 60);
  return fmt::format("{}s", whole);
}

class ProgressDisplay {
 public:
  explicit ProgressDisplay(bool terminal) : terminal_(terminal) {}

  void progress(const DownloadProgress& progress) {
    const Clock::time_point now = Clock::now();
    if (progress.file != file_ || progress.bytes < start_bytes_) {
      file_ = progress.file;
      start_ = last_shown_ = now;
      start_bytes_ = progress.resumed_from;
    }
    // A terminal is redrawn ten times a second; a log gets a line every five seconds.
    const auto interval = terminal_ ? std::chrono::milliseconds(100) : std::chrono::milliseconds(5000);
    if (!progress.finished && now - last_shown_ < interval) return;
    last_shown_ = now;
    const double seconds = std::chrono::duration<double>(now - start_).count();
    const double rate = seconds > 0 ? (progress.bytes - start_bytes_) / seconds : 0;
    std::string amount = human_bytes(progress.bytes);
    std::string left;
    int percent = -1;
    if (progress.size && *progress.size > 0) {
      amount += " of " + human_bytes(*progress.size);
      percent = static_cast<int>(100.0 * progress.bytes / *progress.size);
      left = rate > 0 ? duration_text((*progress.size - std::min(*progress.size, progress.bytes)) / rate) : "?";
    }
    if (!terminal_) {
      if (progress.finished)
        fmt::print(stderr, "kiln: {}: {} in {} ({}/s)\n", progress.file, human_bytes(progress.bytes),
                   duration_text(seconds), human_bytes(static_cast<uint64_t>(rate)));
      else
        fmt::print(stderr, "kiln: {}: {}{}, {}/s{}\n", progress.file, amount,
                   percent >= 0 ? fmt::format(" ({}%)", percent) : "", human_bytes(static_cast<uint64_t>(rate)),
                   left.empty() ? "" : ", " + left + " left");
      return;
    }
    constexpr int kBarWidth = 24;
    const int filled = percent >= 0 ? std::min(kBarWidth, percent * kBarWidth / 100) : 0;
    fmt::print(stderr, "\r\x1b[K{} [{}{}] {}{} {}/s{}{}", progress.file, std::string(filled, '#'),
               std::string(kBarWidth - filled, ' '), percent >= 0 ? fmt::format("{:3}% ", percent) : "", amount,
               human_bytes(static_cast<uint64_t>(rate)), left.empty() || progress.finished ? "" : " ETA " + left,
               progress.finished ? "\n" : "");
    std::fflush(stderr);
  }

  void note(const std::string& line) {
    fmt::print(stderr, "{}kiln: {}\n", terminal_ ? "\r\x1b[K" : "", line);
  }

 private:
  bool terminal_;
  std::string file_;
  Clock::time_point start_;
  Clock::time_point last_shown_;
  uint64_t start_bytes_ = 0;
};

}  // namespace

PullListener stderr_pull_listener() {
  auto display = std::make_shared<ProgressDisplay>(::isatty(STDERR_FILENO) == 1);
  return {[display](const DownloadProgress& progress) { display->progress(progress); },
          [display](const std::string& line) { display->note(line); }};
}

}  // namespace kiln::cli

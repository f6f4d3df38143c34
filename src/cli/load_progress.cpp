#include "cli/load_progress.h"

#include <fmt/format.h>

namespace kiln::cli {
namespace {

// Decimal gigabytes, as disks and bandwidths are quoted.
double gigabytes(uint64_t bytes) { return static_cast<double>(bytes) / 1e9; }

double rate(uint64_t bytes, double seconds) { return seconds > 0 ? gigabytes(bytes) / seconds : 0; }

int tenths(const LoadProgress& progress) {
  return progress.bytes_total ? static_cast<int>(10 * progress.bytes_done / progress.bytes_total) : 10;
}

}  // namespace

std::string load_progress_text(const LoadProgress& progress, double seconds) {
  const int percent =
      progress.bytes_total ? static_cast<int>(100 * progress.bytes_done / progress.bytes_total) : 100;
  return fmt::format("loading weights: {}/{} tensors, {:.1f}/{:.1f} GB ({}%), {:.1f} GB/s", progress.tensors_done,
                     progress.tensors_total, gigabytes(progress.bytes_done), gigabytes(progress.bytes_total), percent,
                     rate(progress.bytes_done, seconds));
}

std::string load_done_text(const LoadProgress& progress, double seconds) {
  return fmt::format("loaded {} tensors, {:.1f} GB in {:.1f} s ({:.1f} GB/s)", progress.tensors_done,
                     gigabytes(progress.bytes_done), seconds, rate(progress.bytes_done, seconds));
}

void LoadProgressPrinter::update(const LoadProgress& progress, double seconds) {
  last_ = progress;
  if (progress.tensors_done == progress.tensors_total) return;  // finish() says it
  if (seconds < kLoadProgressQuietSeconds) return;
  if (terminal_) {
    if (seconds - shown_at_ < kLoadProgressRedrawInterval) return;
    shown_ = true;
    shown_at_ = seconds;
    fmt::print(out_, "\r\x1b[Kkiln: {}", load_progress_text(progress, seconds));
    std::fflush(out_);
    return;
  }
  // A log line at each new tenth, or when the last one is kLoadProgressLogInterval old.
  if (tenths(progress) <= shown_tenths_ && seconds - shown_at_ < kLoadProgressLogInterval) return;
  shown_tenths_ = tenths(progress);
  shown_ = true;
  shown_at_ = seconds;
  fmt::print(out_, "kiln: {}\n", load_progress_text(progress, seconds));
}

void LoadProgressPrinter::finish(double seconds) {
  if (!shown_) return;
  fmt::print(out_, "{}kiln: {}\n", terminal_ ? "\r\x1b[K" : "", load_done_text(last_, seconds));
  std::fflush(out_);
}

}  // namespace kiln::cli

// The progress line of a weight load on stderr, for every command that opens a model
// (build_prepared_model): loads of kLoadProgressMinBytes or more that are still running after
// kLoadProgressQuietSeconds show one, as a line redrawn in place on a terminal, or a plain line every
// tenth of the load (or kLoadProgressLogInterval) in a log, and end with a summary. A load that is
// over sooner prints nothing: on the CPU the weights are views of the mapped files, whose pages are
// read as the first steps use them, so the load itself takes a moment and its rate would mean nothing.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include "model/load_plan.h"

namespace kiln::cli {

inline constexpr uint64_t kLoadProgressMinBytes = 1'000'000'000;  // smaller loads take a moment
inline constexpr double kLoadProgressQuietSeconds = 1.0;
inline constexpr double kLoadProgressLogInterval = 5.0;           // seconds between log lines at most
inline constexpr double kLoadProgressRedrawInterval = 0.1;        // seconds between terminal redraws

// "loading weights: 120/435 tensors, 4.2/16.1 GB (26%), 2.1 GB/s" (`seconds` since the load began).
std::string load_progress_text(const LoadProgress& progress, double seconds);
// "loaded 435 tensors, 16.1 GB in 7.7 s (2.1 GB/s)".
std::string load_done_text(const LoadProgress& progress, double seconds);

class LoadProgressPrinter {
 public:
  // `terminal`: `out` is one, so the line is redrawn in place.
  LoadProgressPrinter(std::FILE* out, bool terminal) : out_(out), terminal_(terminal) {}
  // A report `seconds` after the load began; prints when one is due.
  void update(const LoadProgress& progress, double seconds);
  // The final line, once the model is built, when a progress line was shown.
  void finish(double seconds);

 private:
  std::FILE* out_;
  bool terminal_;
  LoadProgress last_;
  bool shown_ = false;
  double shown_at_ = 0;
  int shown_tenths_ = 0;
};

}  // namespace kiln::cli

// The load's progress reports (model/load_plan.h's LoadProgress through build_model) and the CLI's
// progress line (cli/load_progress.h).
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cli/load_progress.h"
#include "model/loader.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

std::vector<LoadProgress> load_reports(const ModelPlan& plan, std::optional<DType> dtype) {
  std::unique_ptr<Backend> backend = make_cpu_backend();
  std::vector<LoadProgress> reports;
  const auto model =
      build_model(plan, *backend, dtype, [&](const LoadProgress& progress) { reports.push_back(progress); });
  EXPECT_NE(model, nullptr);
  return reports;
}

// Each report one more tensor, bytes growing, the last one the whole load: every planned tensor,
// and the bytes the plan said the weights would hold.
void expect_whole_load(const ModelPlan& plan, std::optional<DType> dtype) {
  const std::vector<LoadProgress> reports = load_reports(plan, dtype);
  const auto tensors = static_cast<int64_t>(plan.load_plan.tensors.size());
  ASSERT_EQ(static_cast<int64_t>(reports.size()), tensors);
  uint64_t bytes = 0;
  for (size_t index = 0; index < reports.size(); ++index) {
    const LoadProgress& report = reports[index];
    EXPECT_EQ(report.tensors_done, static_cast<int64_t>(index) + 1);
    EXPECT_EQ(report.tensors_total, tensors);
    EXPECT_EQ(report.bytes_total, planned_weight_bytes(plan, dtype));
    EXPECT_GT(report.bytes_done, bytes);
    bytes = report.bytes_done;
  }
  EXPECT_EQ(reports.back().bytes_done, reports.back().bytes_total);
}

TEST(LoadProgress, ReportsEveryTensorUpToThePlannedBytes) {
  for (const char* fixture : {"llama3-tiny/f32", "llama3-tiny/bf16", "qwen3-mlx-tiny/q", "qwen3_5-text-tiny/bf16"}) {
    SCOPED_TRACE(fixture);
    const ModelPlan plan = plan_model(fixtures_dir() / fixture, Device::CPU, /*backend_present=*/true);
    expect_whole_load(plan, std::nullopt);
  }
}

TEST(LoadProgress, CountsTheBytesOfConvertedWeights) {
  const ModelPlan plan = plan_model(fixtures_dir() / "llama3-tiny/bf16", Device::CPU, /*backend_present=*/true);
  EXPECT_EQ(planned_weight_bytes(plan, DType::F32), 2 * planned_weight_bytes(plan));
  expect_whole_load(plan, DType::F32);
}

TEST(LoadProgress, FormatsTheLineAndTheSummary) {
  const LoadProgress quarter{120, 435, 4'025'000'000, 16'100'000'000};
  EXPECT_EQ(cli::load_progress_text(quarter, 2.0), "loading weights: 120/435 tensors, 4.0/16.1 GB (25%), 2.0 GB/s");
  const LoadProgress done{435, 435, 16'100'000'000, 16'100'000'000};
  EXPECT_EQ(cli::load_done_text(done, 7.0), "loaded 435 tensors, 16.1 GB in 7.0 s (2.3 GB/s)");
  EXPECT_EQ(cli::load_done_text(done, 0.0), "loaded 435 tensors, 16.1 GB in 0.0 s (0.0 GB/s)");
}

std::string printed(bool terminal, const std::vector<std::pair<LoadProgress, double>>& updates, double end) {
  std::FILE* file = std::tmpfile();
  cli::LoadProgressPrinter printer(file, terminal);
  for (const auto& [progress, seconds] : updates) printer.update(progress, seconds);
  printer.finish(end);
  std::rewind(file);
  std::string text;
  for (int c = std::fgetc(file); c != EOF; c = std::fgetc(file)) text += static_cast<char>(c);
  std::fclose(file);
  return text;
}

TEST(LoadProgress, LogsALineEachTenthOrEveryFewSeconds) {
  const uint64_t total = 10'000'000'000;
  std::vector<std::pair<LoadProgress, double>> updates;
  // 100 tensors of 0.1 GB at 1 GB/s, then a slow last tensor.
  for (int64_t tensor = 1; tensor <= 100; ++tensor)
    updates.push_back({{tensor, 101, static_cast<uint64_t>(tensor) * 95'000'000, total}, tensor * 0.095});
  updates.push_back({{101, 101, total, total}, 20.0});
  const std::string log = printed(false, updates, 20.0);
  // Nothing in the first second, then tenths 1..9 (95 % is the last reached before the end), then
  // the summary; no carriage returns.
  EXPECT_EQ(std::count(log.begin(), log.end(), '\n'), 10) << log;
  EXPECT_EQ(log.find('\r'), std::string::npos);
  EXPECT_TRUE(log.starts_with("kiln: loading weights: 11/101 tensors, 1.0/10.0 GB (10%), 1.0 GB/s\n")) << log;
  EXPECT_TRUE(log.ends_with("kiln: loaded 101 tensors, 10.0 GB in 20.0 s (0.5 GB/s)\n")) << log;

  // Slow tensors: a line every kLoadProgressLogInterval seconds even within a tenth.
  const std::string slow =
      printed(false, {{{1, 1000, 1'000'000, total}, 1.0}, {{2, 1000, 2'000'000, total}, 7.0}}, 8.0);
  EXPECT_EQ(std::count(slow.begin(), slow.end(), '\n'), 2) << slow;
  // A load over within the first second prints nothing.
  EXPECT_EQ(printed(false, {{{1, 2, total / 2, total}, 0.2}, {{2, 2, total, total}, 0.4}}, 0.5), "");

  // A terminal gets one line redrawn in place, ended by the summary.
  const std::string terminal = printed(true, updates, 20.0);
  EXPECT_TRUE(terminal.starts_with("\r\x1b[Kkiln: loading weights: ")) << terminal;
  EXPECT_EQ(std::count(terminal.begin(), terminal.end(), '\n'), 1) << terminal;
  EXPECT_TRUE(terminal.ends_with("\r\x1b[Kkiln: loaded 101 tensors, 10.0 GB in 20.0 s (0.5 GB/s)\n")) << terminal;
}

}  // namespace

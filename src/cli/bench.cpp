// kiln bench: prefill and decode throughput, and decode bandwidth against the measured roofline.
//
// Decode streams every weight once per step (plus the KV rows read by attention and, for hybrid
// models, each sequence's recurrent state read and written), so
// bytes-per-step / step-time is the bandwidth the engine reaches; divided by the device's
// measured copy bandwidth it is the roofline ratio recorded in docs/perf.md.
//
// With --speculative, bench instead times generate() from a prompt (--ids, else the model's BOS)
// plainly and with speculation, checks that both give the same tokens, and reports tokens per
// verify step, the acceptance rate and the end-to-end speed-up. `--speculative oracle` is for
// benchmarks only: it proposes the plain run's own tokens (acceptance 1), the machinery's ceiling.
// It also times the forward of an n-token append for n = 1 … k+1 at the run's context (a verify
// step of k proposals is the (k+1)-token one, with a logit row per token): issue 31 asks the
// (k+1)-token step to stay within 10 % of the one-token step, which is what lets speculation win.
#include <algorithm>
#include <chrono>
#include <random>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/model_options.h"
#include "cli/speculative_options.h"
#include "core/error.h"
#include "engine/decode_graph.h"
#include "engine/generation.h"

namespace kiln::cli {
namespace {

struct BenchCommand {
  ModelOptions model;
  std::vector<int64_t> prompt_tokens{512};
  int64_t decode_tokens = 32;
  int64_t decode_context = 128;
  std::vector<int64_t> batches{1};
  uint64_t seed = 1;
  bool json = false;
  bool eager_decode = false;
  SpeculativeOptions speculative;
  std::string ids;  // the speculative comparison's prompt
  float temperature = 0.0f;
  int repeats = 3;
};

std::vector<int32_t> random_tokens(int64_t count, int64_t vocab, std::mt19937_64& random) {
  std::vector<int32_t> tokens(count);
  for (auto& token : tokens) token = static_cast<int32_t>(random() % vocab);
  return tokens;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The fastest of `repeats` runs of generate(); every run must give the same tokens.
GenerationResult fastest_run(Model& model, const std::vector<int32_t>& prompt, const GenerationOptions& generation,
                             int repeats) {
  GenerationResult best;
  for (int run = 0; run < repeats; ++run) {
    GenerationResult result = generate(model, prompt, generation);
    if (run > 0 && result.tokens != best.tokens) fail("two runs of one seeded request gave different tokens");
    if (run == 0 || result.decode_seconds < best.decode_seconds) best = std::move(result);
  }
  return best;
}

double decode_tokens_per_second(const GenerationResult& result) {
  return result.decode_seconds > 0 ? static_cast<double>(result.tokens.size() - 1) / result.decode_seconds : 0.0;
}

// The median time of `repeats` direct forwards that append n tokens after `context` tokens of one
// sequence, every row's logits read back as a verify step reads them, for n = 1 … max_tokens.
std::vector<double> append_step_seconds(Model& model, int64_t context, int32_t max_tokens, int repeats,
                                        std::mt19937_64& random) {
  const int64_t vocab = model.config().vocab_size;
  auto cache = model.make_cache(1, context + max_tokens);
  run_step(model, *cache, {SequenceStep{0, 0, random_tokens(context, vocab, random), false}});
  std::vector<double> medians;
  for (int32_t tokens = 1; tokens <= max_tokens; ++tokens) {
    const SequenceStep step{0, static_cast<int32_t>(context), random_tokens(tokens, vocab, random), true};
    run_step(model, *cache, {step});  // warm-up: the first call of a shape allocates its scratch
    std::vector<double> times;
    for (int run = 0; run < repeats; ++run) {
      model.backend().synchronize();
      const auto start = std::chrono::steady_clock::now();
      run_step(model, *cache, {step});
      times.push_back(seconds_since(start));
    }
    std::nth_element(times.begin(), times.begin() + repeats / 2, times.end());
    medians.push_back(times[static_cast<size_t>(repeats / 2)]);
  }
  return medians;
}

// Plain against speculative decoding of one prompt through generate(), as `kiln generate` runs it.
void bench_speculative(const BenchCommand& options, PreparedModel prepared) {
  OpenedModel opened = build_prepared_model(std::move(prepared));
  Model& model = *opened.model;
  const ModelConfig& config = model.config();
  std::vector<int32_t> prompt;
  if (!options.ids.empty()) prompt = parse_token_ids(options.ids);
  else if (config.bos_token_id) prompt = {static_cast<int32_t>(*config.bos_token_id)};
  else fail("bench --speculative: the model has no bos_token_id to start from; give the prompt with --ids");
  GenerationOptions generation;
  generation.max_tokens = options.decode_tokens;
  generation.sampling.temperature = options.temperature;
  generation.sampling.seed = options.seed;
  const GenerationResult plain = fastest_run(model, prompt, generation, options.repeats);

  SpeculativeSetup setup;
  const bool oracle = options.speculative.method == "oracle";
  if (oracle) {
    setup.speculation = {std::make_shared<ReplayProposer>(prompt, plain.tokens), options.speculative.tokens};
  } else {
    const int64_t context = static_cast<int64_t>(prompt.size()) + options.decode_tokens + 1;
    setup = make_speculation(options.speculative, options.model, model, 1, context, kDefaultPrefillChunk);
  }
  generation.speculation = setup.speculation;
  const GenerationResult speculative = fastest_run(model, prompt, generation, options.repeats);
  if (speculative.tokens != plain.tokens)
    fail("bench --speculative: the speculative run's tokens differ from the plain run's (exactness is broken)");

  const SpeculationCounts& counts = speculative.speculation;
  const double plain_rate = decode_tokens_per_second(plain), speculative_rate = decode_tokens_per_second(speculative);
  const double per_verify =
      counts.verify_steps ? static_cast<double>(counts.verify_steps + counts.accepted) / counts.verify_steps : 0.0;
  const double acceptance = counts.proposed ? static_cast<double>(counts.accepted) / counts.proposed : 0.0;
  std::mt19937_64 random(options.seed);
  constexpr int kAppendRepeats = 15;
  const std::vector<double> append_seconds =
      append_step_seconds(model, static_cast<int64_t>(prompt.size()) + options.decode_tokens / 2,
                          options.speculative.tokens + 1, kAppendRepeats, random);
  nlohmann::json report = {{"model", options.model.model_dir},
                           {"device", opened.backend->name()},
                           {"method", options.speculative.method},
                           {"oracle", oracle},
                           {"num_speculative_tokens", options.speculative.tokens},
                           {"temperature", options.temperature},
                           {"generated_tokens", plain.tokens.size()},
                           {"plain_tokens_per_second", plain_rate},
                           {"speculative_tokens_per_second", speculative_rate},
                           {"speedup", plain_rate > 0 ? speculative_rate / plain_rate : 0.0},
                           {"verify_steps", counts.verify_steps},
                           {"proposed", counts.proposed},
                           {"accepted", counts.accepted},
                           {"acceptance_rate", acceptance},
                           {"tokens_per_verify_step", per_verify},
                           {"append_step_seconds", append_seconds},
                           {"verify_step_over_decode_step", append_seconds.back() / append_seconds.front()}};
  if (options.json) {
    fmt::print("{}\n", report.dump());
    return;
  }
  fmt::print("model {}  device {}  speculative {}{} k={}  temperature {}  {} tokens (identical to the plain run)\n",
             options.model.model_dir, opened.backend->name(), options.speculative.method,
             oracle ? " (benchmark-only oracle: replays the plain run, acceptance 1)" : "", options.speculative.tokens,
             options.temperature, plain.tokens.size());
  fmt::print("plain        {:>10.1f} tok/s\n", plain_rate);
  fmt::print("speculative  {:>10.1f} tok/s  speed-up {:.2f}x\n", speculative_rate, speculative_rate / plain_rate);
  fmt::print("verify steps {}  accepted {} of {} proposed ({:.1f} %)  {:.2f} tokens per verify step\n",
             counts.verify_steps, counts.accepted, counts.proposed, 100 * acceptance, per_verify);
  fmt::print("append step (direct forward, all rows' logits read back), median of {}:", kAppendRepeats);
  for (size_t n = 0; n < append_seconds.size(); ++n) fmt::print("  {} tok {:.3f} ms", n + 1, 1e3 * append_seconds[n]);
  fmt::print("\nverify step of k={} over a one-token step: {:.3f}\n", options.speculative.tokens,
             append_seconds.back() / append_seconds.front());
}

RegisterCommand register_bench([](CLI::App& app) {
  auto options = std::make_shared<BenchCommand>();
  CLI::App* command = app.add_subcommand("bench", "Measure prefill and decode throughput against the bandwidth roofline");
  options->model.add_to(*command);
  command->add_option("--prompt-tokens", options->prompt_tokens, "Prefill lengths to time")->delimiter(',');
  command->add_option("--decode-tokens", options->decode_tokens, "Decode steps to time")->check(CLI::PositiveNumber);
  command->add_option("--decode-context", options->decode_context, "Prompt length before decode")->check(CLI::PositiveNumber);
  command->add_option("--batch", options->batches, "Decode batch sizes to time")->delimiter(',');
  command->add_option("--seed", options->seed, "Seed for the random prompt tokens");
  command->add_flag("--json", options->json, "Print one JSON object instead of a table");
  command->add_flag("--eager-decode", options->eager_decode,
                    "Run decode steps directly even where the backend captures them as graphs (for comparison)");
  options->speculative.add_to(*command, true);
  command->add_option("--ids", options->ids, "With --speculative: the prompt's token ids (default: the model's BOS)");
  command
      ->add_option("--temperature", options->temperature,
                   "With --speculative: the sampling temperature (seeded by --seed)")
      ->capture_default_str();
  command->add_option("--repeats", options->repeats, "With --speculative: runs of each kind, the fastest reported")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  command->callback([options] {
    if (options->batches.empty()) fail("--batch: no batch size given");
    options->model.resolve();
    if (options->speculative.enabled()) {
      const ServingSizes sizes{1, 0, kDefaultPrefillChunk};
      options->model.mtp = options->speculative.uses_mtp_head();
      PreparedModel prepared = prepare_model(options->model, sizes);
      options->speculative.check(prepared);
      bench_speculative(*options, std::move(prepared));
      return;
    }
    // Each decode batch runs at its own sizes; the smallest is the one the batch rule can refuse.
    const ServingSizes sizes{static_cast<int32_t>(*std::min_element(options->batches.begin(), options->batches.end())),
                             options->decode_context + options->decode_tokens + 1, kDefaultPrefillChunk};
    OpenedModel opened = open_model(options->model, sizes);
    Model& model = *opened.model;
    Backend& backend = *opened.backend;
    const ModelConfig& config = model.config();
    std::mt19937_64 random(options->seed);
    nlohmann::json report;
    report["model"] = options->model.model_dir;
    report["device"] = backend.name();
    report["copy_bandwidth_gbps"] = backend.measure_copy_bandwidth_gbps();
    report["decode_weight_bytes"] = model.decode_weight_bytes();

    for (int64_t length : options->prompt_tokens) {
      auto cache = model.make_cache(1, length);
      run_step(model, *cache, {SequenceStep{0, 0, random_tokens(std::min<int64_t>(length, 16), config.vocab_size, random), false}});
      const auto prompt = random_tokens(length, config.vocab_size, random);
      backend.synchronize();
      const auto start = std::chrono::steady_clock::now();
      run_step(model, *cache, {SequenceStep{0, 0, prompt, false}});
      backend.synchronize();
      report["prefill"].push_back({{"tokens", length}, {"tokens_per_second", length / seconds_since(start)}});
    }

    const size_t kv_bytes_per_token = static_cast<size_t>(2 * config.num_key_value_heads * config.head_dim) *
                                      dtype_size(backend.activation_dtype()) *
                                      static_cast<size_t>(std::count(config.layer_types.begin(), config.layer_types.end(),
                                                                     LayerKind::FullAttention));
    // Hybrid models also read and write each sequence's recurrent state every step: the f32
    // delta-rule state [Hv, dk, dv] and the f32 conv tail [K−1, C] of every linear-attention layer.
    const auto linear_layers = static_cast<size_t>(
        std::count(config.layer_types.begin(), config.layer_types.end(), LayerKind::LinearAttention));
    const size_t conv_channels =
        static_cast<size_t>(2 * config.linear_num_key_heads * config.linear_key_head_dim +
                            config.linear_num_value_heads * config.linear_value_head_dim);
    const size_t state_bytes_per_sequence =
        2 * linear_layers * sizeof(float) *
        (static_cast<size_t>(config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim) +
         static_cast<size_t>(std::max<int64_t>(config.linear_conv_kernel_dim - 1, 0)) * conv_channels);
    // Decode as the engine runs it: captured graphs with greedy tokens chosen on the device where
    // the backend can (engine/decode_graph.h), otherwise one direct step with host-side tokens.
    const bool graphs = DecodeGraphs::supported(model) && !options->eager_decode;
    report["decode_graphs"] = graphs;
    for (int64_t batch : options->batches) {
      const int64_t context = options->decode_context;
      auto cache = model.make_cache(graphs ? decode_bucket(batch) : batch, context + options->decode_tokens + 1);
      std::unique_ptr<DecodeGraphs> decode_graphs;
      if (graphs) decode_graphs = std::make_unique<DecodeGraphs>(model, *cache);
      std::vector<SequenceStep> prefill;
      for (int32_t slot = 0; slot < batch; ++slot)
        prefill.push_back({slot, 0, random_tokens(context, config.vocab_size, random), false});
      run_step(model, *cache, prefill);
      // Graph steps run as generate() runs them: each queued before the previous step's tokens
      // are read, taking those tokens on the device (engine/decode_graph.h).
      auto decode_step = [&](int64_t position, bool fed) {
        if (decode_graphs) {
          std::vector<DecodeRow> rows;
          for (int32_t slot = 0; slot < batch; ++slot)
            rows.push_back({slot, static_cast<int32_t>(position),
                            fed ? 0 : random_tokens(1, config.vocab_size, random)[0], nullptr, fed ? slot : -1});
          decode_graphs->launch(rows);
          if (decode_graphs->queued() == DecodeGraphs::kMaxQueuedSteps || !fed) decode_graphs->collect();
          return;
        }
        std::vector<SequenceStep> step;
        for (int32_t slot = 0; slot < batch; ++slot)
          step.push_back({slot, static_cast<int32_t>(position), random_tokens(1, config.vocab_size, random), false});
        run_step(model, *cache, step);
      };
      decode_step(context, false);  // warm-up
      // The weight bytes of the timed steps (a mixture's experts: the union its tokens chose in each
      // step, counted on the device) are read once they have run; this starts the count.
      model.weight_bytes_read(0);
      backend.synchronize();
      const auto start = std::chrono::steady_clock::now();
      for (int64_t i = 1; i <= options->decode_tokens; ++i) decode_step(context + i, true);
      while (decode_graphs && decode_graphs->queued() > 0) decode_graphs->collect();
      backend.synchronize();
      const double seconds = seconds_since(start);
      const double steps_per_second = options->decode_tokens / seconds;
      const double mean_context = context + 1 + options->decode_tokens / 2.0;
      const double weights_per_step = model.weight_bytes_read(options->decode_tokens) / options->decode_tokens;
      const double bytes_per_step = weights_per_step + batch * mean_context * kv_bytes_per_token +
                                    static_cast<double>(batch * state_bytes_per_sequence);
      const double gbps = bytes_per_step * steps_per_second / 1e9;
      report["decode"].push_back({{"batch", batch},
                                  {"tokens_per_second", steps_per_second * batch},
                                  {"bytes_per_step", bytes_per_step},
                                  {"gbps", gbps},
                                  {"roofline_ratio", gbps / report["copy_bandwidth_gbps"].get<double>()}});
    }

    if (options->json) {
      fmt::print("{}\n", report.dump());
      return;
    }
    fmt::print("model {}  device {}  copy bandwidth {:.1f} GB/s  decode weights {:.1f} MB  decode {}\n",
               options->model.model_dir, backend.name(), report["copy_bandwidth_gbps"].get<double>(),
               model.decode_weight_bytes() / 1e6, graphs ? "graphs" : "direct");
    for (const auto& row : report["prefill"])
      fmt::print("prefill {:>6} tokens  {:>10.1f} tok/s\n", row["tokens"].get<int64_t>(), row["tokens_per_second"].get<double>());
    for (const auto& row : report["decode"])
      fmt::print("decode  batch {:>4}  {:>10.1f} tok/s  {:>8.2f} GB/s  {:>5.1f} % of roofline\n", row["batch"].get<int64_t>(),
                 row["tokens_per_second"].get<double>(), row["gbps"].get<double>(), 100 * row["roofline_ratio"].get<double>());
  });
});

}  // namespace
}  // namespace kiln::cli

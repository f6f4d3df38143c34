// kiln serve: the OpenAI- and Anthropic-compatible HTTP server over the continuous-batching
// scheduler (with --embeddings: /v1/embeddings over the embedding scheduler). Loopback only unless --host says otherwise. SIGINT/SIGTERM shut it down cleanly:
// new requests get 503, those in flight finish within --shutdown-grace, the rest are cancelled;
// a second signal cancels at once.
#include <fmt/format.h>
#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cli/command.h"
#include "cli/model_options.h"
#include "cli/speculative_options.h"
#include "core/error.h"
#include "engine/embedding_scheduler.h"
#include "engine/memory_plan.h"
#include "engine/scheduler.h"
#include "io/pooling_config.h"
#include "server/server.h"
#include "text/tokenizer_codec.h"

namespace kiln::cli {
namespace {

struct ServeCommand {
  ModelOptions model;
  std::string host = "127.0.0.1";
  uint16_t port = 8080;
  ServingSizes sizes;
  int64_t max_queue = 64;
  std::string api_key;
  std::string served_model_name;
  std::string chat_template;
  double shutdown_grace_seconds = 30;
  double request_timeout_seconds = 30;
  double idle_timeout_seconds = 60;
  size_t max_body_bytes = 8u << 20;
  int max_connections = 0;  // 0: what the descriptor limit allows
  int max_concurrent_requests = 256;
  std::vector<std::string> allowed_origins;
  bool no_loopback_origins = false;
  std::string log_format = "text";
  std::string config_file;
  bool no_prefix_cache = false;
  std::string generation_config = "auto";
  bool embeddings = false;
  SpeculativeOptions speculative;
};

// --config FILE: `name = value` lines (TOML, or INI; read by CLI11's reader), a serve flag's long
// name each, with or without a [serve] section. A flag the command line or the environment gave
// keeps that value. (CLI11 2.1 reads config files for the top-level app only, hence this.)
void apply_config_file(CLI::App& command, const std::string& path) {
  std::vector<CLI::ConfigItem> items;
  try {
    items = CLI::ConfigTOML().from_file(path);
  } catch (const CLI::Error& error) {
    fail("--config {}: {}", path, error.what());
  }
  for (const CLI::ConfigItem& item : items) {
    if (item.name == "++" || item.name == "--") continue;  // CLI11's marks of a section's start and end
    if (!item.parents.empty() && item.parents != std::vector<std::string>{"serve"})
      fail("--config {}: [{}] is not a section kiln serve reads (only [serve], or none)", path, item.fullname());
    std::string name = item.name;
    std::replace(name.begin(), name.end(), '_', '-');
    CLI::Option* option = command.get_option_no_throw("--" + name);
    if (!option || name == "config" || name == "help") fail("--config {}: '{}' is not a kiln serve flag", path, item.name);
    if (option->count() > 0) continue;
    option->add_result(item.inputs);
    option->run_callback();
  }
}

std::chrono::milliseconds to_milliseconds(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

// Fails, before any weight is read, when the model with `request` does not fit the device's
// memory, saying what would.
void refuse_what_does_not_fit(PreparedModel& prepared, const MemoryRequest& request) {
  Backend& backend = *prepared.backend;
  const MemoryPlan plan = plan_memory(prepared.plan, backend, prepared.load_dtype, request);
  if (plan.fits()) return;
  const int64_t longest = longest_fitting_context(prepared.plan, backend, prepared.load_dtype, plan);
  const std::string advice =
      longest > 0 ? fmt::format("--max-context {} fits at --max-batch {}", longest, request.sequences)
                  : fmt::format("not even a one-token context fits at --max-batch {}", request.sequences);
  fail("{}: {} sequences of {} tokens need {:.2f} GiB on {} but {:.2f} GiB are available; {} (kiln fit shows the "
       "plan)",
       prepared.options.model_dir, request.sequences, request.context,
       static_cast<double>(plan.total()) / (1u << 30), backend.name(),
       static_cast<double>(plan.memory.available) / (1u << 30), advice);
}

// Raises the soft limit on open descriptors to the hard limit, where the system allows it: each
// connection is one descriptor, and the connection limit follows the descriptor limit.
void raise_descriptor_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur >= limit.rlim_max) return;
  limit.rlim_cur = limit.rlim_max;
  // An unlimited hard limit is refused above fs.nr_open: the soft limit then stays as it is.
  ::setrlimit(RLIMIT_NOFILE, &limit);
}

void serve(const ServeCommand& options) {
  // Every thread started from here on (scheduler, thread pool, connections) inherits this mask, so
  // the signals reach only the sigwait below.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // A client that disconnects mid-write must not kill the process.
  signal(SIGPIPE, SIG_IGN);
  raise_descriptor_limit();

  const auto load_start = std::chrono::steady_clock::now();
  // Everything that reads no weight comes first, so that a model that cannot be served fails
  // before the port opens: the plan, the memory check and the tokenizer.
  PreparedModel prepared = prepare_model(options.model, options.sizes);
  // The KV cache is slots x context: the model's context, or less when --max-context asks.
  const int64_t context = options.sizes.context(prepared.plan.config);
  std::optional<PoolingConfig> pooling;
  if (options.embeddings) pooling = read_pooling_config(options.model.model_dir, prepared.plan.config.hidden_size);
  if (options.speculative.enabled()) {
    if (options.embeddings) fail("--speculative applies to generation, not to --embeddings");
    options.speculative.check(prepared);
  }
  std::optional<PreparedModel> draft =
      options.speculative.prepare_draft(options.model, {options.sizes.max_batch, context, options.sizes.prefill_chunk});
  MemoryRequest memory_request = options.speculative.memory_request(options.sizes, context, options.embeddings, draft);
  if (options.no_prefix_cache) memory_request.prefix_snapshots = 0;  // the scheduler allocates none
  apply_memory_share(options.sizes, prepared, memory_request);
  refuse_what_does_not_fit(prepared, memory_request);
  const TokenizerCodec codec(options.model.model_dir, read_chat_template(options.chat_template));
  const int64_t vocab_size = prepared.plan.config.vocab_size;
  codec.tokenizer().check_fits_model(vocab_size);

  SchedulerOptions scheduler_options;
  scheduler_options.max_batch = options.sizes.max_batch;
  scheduler_options.context_tokens = context;
  scheduler_options.max_queue = options.max_queue;
  scheduler_options.prefill_chunk = options.sizes.prefill_chunk;
  scheduler_options.prefix_cache = !options.no_prefix_cache;
  scheduler_options.kv_cache_tokens = memory_request.kv_blocks * kKvBlockTokens;
  scheduler_options.prefix_snapshots = memory_request.prefix_snapshots;

  server::ServerOptions server_options;
  server_options.http.host = options.host;
  server_options.http.port = options.port;
  server_options.http.max_body_bytes = options.max_body_bytes;
  server_options.http.max_connections = options.max_connections;
  server_options.http.max_concurrent_requests = options.max_concurrent_requests;
  server_options.http.request_timeout = to_milliseconds(options.request_timeout_seconds);
  server_options.http.idle_timeout = to_milliseconds(options.idle_timeout_seconds);
  server_options.http.cors.allowed_origins = options.allowed_origins;
  server_options.http.cors.allow_loopback_origins = !options.no_loopback_origins;
  server_options.request_log = server::parse_log_format(options.log_format);
  // A hub id names the model (its snapshot folder's name is a commit); a folder by its name.
  const bool from_hub = options.model.model != options.model.model_dir;
  server_options.model_name =
      !options.served_model_name.empty() ? options.served_model_name
      : from_hub ? options.model.model
                 : std::filesystem::path(options.model.model_dir).lexically_normal().filename().string();
  if (server_options.model_name.empty()) server_options.model_name = "model";
  server_options.vocab_size = vocab_size;
  if (pooling) {
    fmt::print(stderr, "kiln: serving embeddings: {} pooling{} ({})\n", pooling_mode_name(pooling->mode),
               pooling->normalize ? ", L2-normalised" : "", pooling->source);
  } else {
    const SamplingDefaults defaults = generation_defaults(options.generation_config, options.model.model_dir);
    server_options.sampling_defaults = defaults.sampling;
    server_options.default_max_tokens = defaults.max_new_tokens;
    const SamplingParams& sampling = server_options.sampling_defaults;
    fmt::print(stderr,
               "kiln: requests that do not set them get temperature {}, top_p {}, top_k {}, min_p {}, "
               "repetition_penalty {}{} (--generation-config {})\n",
               sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p, sampling.repetition_penalty,
               defaults.max_new_tokens ? fmt::format(", max_tokens ≤ {}", *defaults.max_new_tokens) : "",
               options.generation_config);
  }
  server_options.api_key = options.api_key;
  server_options.shutdown_grace = to_milliseconds(options.shutdown_grace_seconds);
  // Declared before the server, which uses them until it is destroyed; the speculation (a draft
  // model, or a cache of the target's MTP head) after the target it serves.
  std::optional<OpenedModel> opened;
  SpeculativeSetup speculation;
  std::optional<Scheduler> scheduler;
  std::optional<EmbeddingScheduler> embedding_scheduler;
  server::Server server(server_options);
  server.start();
  fmt::print(stderr, "kiln: listening on http://{}:{} (up to {} connections, {} requests handled at once); loading {}\n",
             options.host, server.port(), server.connection_limit(), options.max_concurrent_requests,
             server_options.model_name);

  // The weights load on a thread while this one watches for signals: an interrupted load ends the
  // process at once (nothing is being served yet).
  std::exception_ptr load_failure;
  std::atomic<bool> loaded{false};
  std::thread loader([&] {
    try {
      opened.emplace(build_prepared_model(std::move(prepared)));
      // A draft model loads with the target (the memory check planned it beside the target). With
      // --speculative, a request may also ask for n-gram proposals.
      if (options.speculative.enabled()) {
        speculation = make_speculation(options.speculative, options.model, *opened->model, options.sizes.max_batch,
                                       context, options.sizes.prefill_chunk, std::move(draft));
        server.offer_speculation(speculation.speculation,
                                 {{"ngram", std::make_shared<NgramProposer>()},
                                  {speculation.speculation.proposer->name(), speculation.speculation.proposer}});
      }
      if (pooling) {
        embedding_scheduler.emplace(*opened->model,
                                    EmbeddingSchedulerOptions{scheduler_options.max_batch, scheduler_options.context_tokens,
                                                              scheduler_options.max_queue,
                                                              scheduler_options.prefill_chunk, *pooling});
        server.serve_embeddings(*embedding_scheduler, codec);
      } else {
        scheduler.emplace(*opened->model, scheduler_options);
        server.serve_model(*scheduler, codec);
      }
    } catch (...) {
      load_failure = std::current_exception();
    }
    loaded.store(true);
  });
  const timespec load_poll{0, 50'000'000};
  while (!loaded.load()) {
    const int signal_number = sigtimedwait(&signals, nullptr, &load_poll);
    if (signal_number > 0) {
      fmt::print(stderr, "kiln: {} received while loading; stopping\n", signal_number == SIGINT ? "SIGINT" : "SIGTERM");
      std::_Exit(128 + signal_number);
    }
  }
  loader.join();
  if (load_failure) std::rethrow_exception(load_failure);
  const double load_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - load_start).count();
  fmt::print(stderr, "kiln: serving {} ({} on {}, batch {}, context {}) — ready in {:.0f} ms\n",
             server_options.model_name, opened->model->config().model_type, opened->backend->name(),
             scheduler_options.max_batch, scheduler_options.context_tokens, load_ms);

  int received = 0;
  while (sigwait(&signals, &received) != 0) {
  }
  fmt::print(stderr, "kiln: {} received; finishing requests in flight (up to {:.0f} s; signal again to cancel them)\n",
             received == SIGINT ? "SIGINT" : "SIGTERM", options.shutdown_grace_seconds);
  std::atomic<bool> stopped{false};
  std::thread drain([&] {
    server.shutdown();
    stopped.store(true);
  });
  // A second signal cancels what is still running instead of waiting for it.
  const timespec poll_interval{0, 100'000'000};
  while (!stopped.load()) {
    if (sigtimedwait(&signals, nullptr, &poll_interval) > 0) {
      fmt::print(stderr, "kiln: cancelling the requests in flight\n");
      server.cancel_in_flight();
      break;
    }
  }
  drain.join();
  fmt::print(stderr, "kiln: stopped\n");
}

RegisterCommand register_serve([](CLI::App& app) {
  auto options = std::make_shared<ServeCommand>();
  CLI::App* command = app.add_subcommand("serve", "Serve a model over OpenAI- and Anthropic-compatible HTTP APIs");
  options->model.add_to(*command);
  command->add_option("--host", options->host, "Address to listen on (loopback by default)");
  command->add_option("--port", options->port, "Port to listen on (0: any free port)");
  add_serving_size_options(*command, options->sizes);
  command->add_option("--max-queue", options->max_queue, "Waiting requests beyond which new ones get 429")
      ->check(CLI::NonNegativeNumber);
  command->add_option("--api-key", options->api_key, "Require this key (Authorization: Bearer, or x-api-key)");
  command->add_option("--served-model-name", options->served_model_name,
                      "The model id clients use (default: the directory name)");
  command->add_option("--chat-template", options->chat_template, "A Jinja chat template file replacing the model's");
  command->add_option("--shutdown-grace", options->shutdown_grace_seconds, "Seconds shutdown lets requests finish")
      ->check(CLI::NonNegativeNumber);
  command
      ->add_option("--request-timeout", options->request_timeout_seconds,
                   "Seconds a client has to send a whole request")
      ->check(CLI::PositiveNumber);
  command
      ->add_option("--idle-timeout", options->idle_timeout_seconds, "Seconds an idle keep-alive connection stays open")
      ->check(CLI::PositiveNumber);
  command->add_option("--max-body-bytes", options->max_body_bytes, "Largest request body accepted (413 beyond)")
      ->check(CLI::PositiveNumber);
  command
      ->add_option("--max-connections", options->max_connections,
                   "Open connections beyond which new ones get 503 (0: what the descriptor limit allows)")
      ->check(CLI::NonNegativeNumber);
  command
      ->add_option("--max-concurrent-requests", options->max_concurrent_requests,
                   "Requests handled at once beyond which new ones get 503 (/health is always answered)")
      ->check(CLI::PositiveNumber);
  command->add_option("--allowed-origins", options->allowed_origins,
                      "Web origins whose pages may call the server (CORS), e.g. https://app.example; * for any")
      ->delimiter(',');
  command->add_flag("--no-prefix-cache", options->no_prefix_cache,
                    "Prefill every prompt in full instead of reusing cached KV blocks of an earlier prompt as its prefix");
  command->add_flag("--no-loopback-origins", options->no_loopback_origins,
                    "Refuse pages served from this machine (localhost, 127.0.0.1, [::1]) too, unless listed");
  command->add_option("--log-format", options->log_format, "The per-request log line: text, or one JSON object")
      ->check(CLI::IsMember({"text", "json"}));
  add_generation_config_option(*command, options->generation_config);
  options->speculative.add_to(*command);
  command->add_flag("--embeddings", options->embeddings,
                    "Serve /v1/embeddings for an embedding model (Qwen3-Embedding, ...) instead of generating text: "
                    "pooling and normalisation as the model folder's modules.json and its Pooling module's "
                    "config.json say (sentence-transformers; last-token, mean or cls), or, without modules.json, "
                    "the last token's hidden state L2-normalised (vLLM's default for decoder models)");
  command->add_option("--config", options->config_file,
                      "A file of serve flags, one `name = value` a line (TOML or INI): the command line and the "
                      "environment win over it")
      ->check(CLI::ExistingFile);
  // Every flag can also come from the environment (KILN_PORT for --port, ...) and from --config;
  // the command line wins, then the environment.
  for (CLI::Option* option : command->get_options()) {
    if (option->get_lnames().empty() || option->get_lnames().front() == "help") continue;
    std::string variable = "KILN_" + option->get_lnames().front();
    for (char& c : variable) c = c == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    option->envname(variable);
  }
  command->callback([options, command] {
    if (!options->config_file.empty()) apply_config_file(*command, options->config_file);
    options->model.resolve();
    options->model.mtp = options->speculative.uses_mtp_head();
    serve(*options);
  });
});

}  // namespace
}  // namespace kiln::cli

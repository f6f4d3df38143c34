// kiln serve: the OpenAI- and Anthropic-compatible HTTP server over the continuous-batching
// scheduler. Loopback only unless --host says otherwise. SIGINT/SIGTERM shut it down cleanly:
// new requests get 503, those in flight finish within --shutdown-grace, the rest are cancelled;
// a second signal cancels at once.
#include <fmt/format.h>
#include <signal.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "cli/command.h"
#include "cli/model_options.h"
#include "core/error.h"
#include "engine/memory_plan.h"
#include "engine/scheduler.h"
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
};

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("--chat-template {}: cannot open the file", path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
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
  PreparedModel prepared = prepare_model(options.model, options.sizes);
  // The KV cache is slots x context: the model's context, or less when --max-context asks.
  const int64_t context = options.sizes.context(prepared.plan.config);
  refuse_what_does_not_fit(prepared, {options.sizes.max_batch, context, options.sizes.prefill_chunk});
  OpenedModel opened = build_prepared_model(std::move(prepared));
  const ModelConfig& config = opened.model->config();
  std::optional<std::string> chat_template;
  if (!options.chat_template.empty()) chat_template = read_text_file(options.chat_template);
  const TokenizerCodec codec(options.model.model_dir, chat_template);
  codec.tokenizer().check_fits_model(config.vocab_size);

  SchedulerOptions scheduler_options;
  scheduler_options.max_batch = options.sizes.max_batch;
  scheduler_options.context_tokens = context;
  scheduler_options.max_queue = options.max_queue;
  scheduler_options.prefill_chunk = options.sizes.prefill_chunk;
  Scheduler scheduler(*opened.model, scheduler_options);

  server::ServerOptions server_options;
  server_options.http.host = options.host;
  server_options.http.port = options.port;
  server_options.http.max_body_bytes = options.max_body_bytes;
  server_options.http.max_connections = options.max_connections;
  server_options.http.max_concurrent_requests = options.max_concurrent_requests;
  server_options.http.request_timeout = to_milliseconds(options.request_timeout_seconds);
  server_options.http.idle_timeout = to_milliseconds(options.idle_timeout_seconds);
  // A hub id names the model (its snapshot folder's name is a commit); a folder by its name.
  const bool from_hub = options.model.model != options.model.model_dir;
  server_options.model_name =
      !options.served_model_name.empty() ? options.served_model_name
      : from_hub ? options.model.model
                 : std::filesystem::path(options.model.model_dir).lexically_normal().filename().string();
  if (server_options.model_name.empty()) server_options.model_name = "model";
  server_options.vocab_size = config.vocab_size;
  server_options.api_key = options.api_key;
  server_options.shutdown_grace = to_milliseconds(options.shutdown_grace_seconds);
  server::Server server(scheduler, codec, server_options);
  server.start();
  const double load_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - load_start).count();
  fmt::print(stderr, "kiln: serving {} ({} on {}, batch {}, context {}) — ready in {:.0f} ms\n",
             server_options.model_name, config.model_type, opened.backend->name(), scheduler_options.max_batch,
             scheduler_options.context_tokens, load_ms);
  fmt::print(stderr, "kiln: listening on http://{}:{} (up to {} connections, {} requests handled at once)\n",
             options.host, server.port(), server.connection_limit(), options.max_concurrent_requests);

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
  command->callback([options] {
    options->model.resolve();
    serve(*options);
  });
});

}  // namespace
}  // namespace kiln::cli

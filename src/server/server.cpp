#include "server/server.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "server/anthropic_api.h"
#include "server/generation_response.h"
#include "server/json_fields.h"
#include "server/openai_api.h"
#include "server/openai_embeddings.h"
#include "server/web_chat.h"
#include "text/tool_call_grammar.h"

namespace kiln::server {

using json = nlohmann::ordered_json;

namespace {

// Runs a non-streamed generation to its end; any end but stop or length is thrown as generation_failure.
WholeGeneration run_to_end(TextGeneration& generation, const std::function<bool()>& client_gone) {
  WholeGeneration whole;
  do {
    whole.last = generation.next(client_gone);
    whole.text += whole.last.text;
    whole.tokens.insert(whole.tokens.end(), whole.last.tokens.begin(), whole.last.tokens.end());
  } while (!whole.last.finished);
  if (!ended_normally(whole.last.finish_reason)) throw generation_failure(whole.last);
  return whole;
}

// /health never blocks, and a load balancer's probe must be answered when every handler thread
// is busy: the transport answers it on its event loop.
HttpServerOptions transport_options(HttpServerOptions http) {
  http.event_loop_paths.push_back("/health");
  return http;
}

// A failure after the scheduler accepted a request is the server's, never the client's: the request
// was valid. An ApiError of the server's own (a 5xx, e.g. a cancelled generation) keeps its status;
// anything else is a 500.
ApiError failure_after_acceptance(const std::exception& error) {
  if (const auto* api_error = dynamic_cast<const ApiError*>(&error); api_error && api_error->status() >= 500)
    return *api_error;
  return ApiError(500, fmt::format("the server failed while generating: {}", error.what()), "", "internal_error");
}

// Runs what follows a request's acceptance (its generation and its response).
template <typename Work>
void after_acceptance(Work&& work) {
  try {
    work();
  } catch (const std::exception& error) {
    throw failure_after_acceptance(error);
  }
}

// The exchange a handler writes to, noting the status it answers with in the request's record.
class RecordingExchange final : public HttpExchange {
 public:
  RecordingExchange(HttpExchange& exchange, RequestRecord& record) : exchange_(exchange), record_(record) {}
  void respond(const HttpResponse& response) override {
    record_.status = response.status;
    exchange_.respond(response);
  }
  bool start_stream(int status, const std::string& content_type, const HeaderList& headers) override {
    record_.status = status;
    return exchange_.start_stream(status, content_type, headers);
  }
  bool write(std::string_view data) override { return exchange_.write(data); }
  bool client_gone() override { return exchange_.client_gone(); }
  bool responded() const override { return exchange_.responded(); }

 private:
  HttpExchange& exchange_;
  RequestRecord& record_;
};

// The page is compiled into the binary, so a cached copy may belong to another kiln on the same
// port: no-cache makes the browser ask again each time (the page is small). The policy confines it
// to its own server: inline script and style only, requests only to the origin that served it, no
// framing.
HeaderList web_chat_headers() {
  return {{"Cache-Control", "no-cache"},
          {"Content-Security-Policy",
           "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
           "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"},
          {"X-Content-Type-Options", "nosniff"},
          {"Referrer-Policy", "no-referrer"}};
}

// The Messages API's paths answer errors in Anthropic's shape.
bool anthropic_path(const std::string& path) { return path == "/v1/messages" || path == "/v1/messages/count_tokens"; }

bool constant_time_equal(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char difference = 0;
  for (size_t i = 0; i < a.size(); ++i) difference |= static_cast<unsigned char>(a[i] ^ b[i]);
  return difference == 0;
}

// A grammar holds the reply from its first token, so a prompt that opened reasoning (<think>) would
// have the grammar shape the reasoning instead of the answer: refused, naming the field.
void refuse_grammar_in_reasoning(bool prompt_in_reasoning, const std::string& what, const std::string& param,
                                 const char* code) {
  if (!prompt_in_reasoning) return;
  throw ApiError(400,
                 fmt::format("`{}` cannot {} where the prompt opens reasoning (<think>); turn thinking off "
                             "(chat_template_kwargs {{\"enable_thinking\": false}}, or Anthropic's thinking "
                             "{{\"type\": \"disabled\"}})",
                             param, what),
                 param, code);
}

}  // namespace

Server::InFlight::InFlight(Server& server) : server_(server) {
  std::lock_guard lock(server_.in_flight_mutex_);
  ++server_.in_flight_;
}

Server::InFlight::~InFlight() {
  std::lock_guard lock(server_.in_flight_mutex_);
  if (--server_.in_flight_ == 0) server_.in_flight_done_.notify_all();
}

bool Server::wait_in_flight(std::chrono::milliseconds timeout) {
  std::unique_lock lock(in_flight_mutex_);
  return in_flight_done_.wait_for(lock, timeout, [&] { return in_flight_ == 0 || cancel_now_; });
}

void Server::cancel_in_flight() {
  std::lock_guard lock(in_flight_mutex_);
  cancel_now_ = true;
  in_flight_done_.notify_all();
}

Server::Server(ServerOptions options)
    : options_(std::move(options)),
      metrics_(options_.model_name),
      http_(
          transport_options(options_.http),
          [this](const HttpRequest& request, HttpExchange& exchange) { handle(request, exchange); },
          [this](int status, const std::string& message, const std::string& path) {
            metrics_.count_response(status);
            return error_response(anthropic_path(path) ? Dialect::Anthropic : Dialect::OpenAI, status, message, "", "");
          }) {
  if (options_.model_name.empty()) fail("the server needs a model name");
}

Server::Server(Scheduler& scheduler, const TextCodec& codec, ServerOptions options) : Server(std::move(options)) {
  serve_model(scheduler, codec);
}

void Server::offer_speculation(Speculation speculation, std::map<std::string, std::shared_ptr<Proposer>> proposers) {
  // Requests read these only once the model is served (ready_ publishes them).
  if (ready_.load()) fail("speculation is offered before the server serves its model");
  options_.speculation = std::move(speculation);
  options_.proposers = std::move(proposers);
}

void Server::serve_model(Scheduler& scheduler, const TextCodec& codec) {
  if (ready_.load()) fail("the server already serves a model");
  scheduler_ = &scheduler;
  codec_ = &codec;
  ready_.store(true);
}

void Server::serve_embeddings(EmbeddingScheduler& embeddings, const TextCodec& codec) {
  if (ready_.load()) fail("the server already serves a model");
  embedding_scheduler_ = &embeddings;
  codec_ = &codec;
  ready_.store(true);
}

int64_t Server::context_tokens() const {
  return scheduler_ ? scheduler_->options().context_tokens : embedding_scheduler_->options().context_tokens;
}

Server::~Server() { shutdown(); }

void Server::shutdown() {
  std::call_once(shutdown_once_, [this] {
    draining_.store(true);
    // Connections are still accepted during the grace period, so that /health says 503 and new
    // requests get a 503 instead of a refused connection.
    http_.drain();
    wait_in_flight(options_.shutdown_grace);
    // Whatever is still running is cancelled; its handlers tell their clients and return.
    if (ready_.load()) scheduler_ ? scheduler_->shutdown(false) : embedding_scheduler_->shutdown(false);
    {
      std::unique_lock lock(in_flight_mutex_);
      in_flight_done_.wait_for(lock, options_.http.write_timeout, [&] { return in_flight_ == 0; });
    }
    http_.close();
  });
}

std::string Server::metrics_text() const {
  if (!ready_.load()) return metrics_.render(SchedulerStats{});
  return metrics_.render(scheduler_ ? scheduler_->stats() : embedding_scheduler_->stats());
}

HttpResponse Server::error_response(Dialect dialect, int status, const std::string& message, const std::string& param,
                                    const std::string& code) {
  HttpResponse response;
  response.status = status;
  const json body = dialect == Dialect::Anthropic ? anthropic_error_body(status, message)
                                                  : openai_error_body(status, message, param, code);
  response.body = dump_json(body);
  if (status == 429 || status == 503)
    response.headers.emplace_back("Retry-After", std::to_string(options_.retry_after_seconds));
  return response;
}

void Server::respond_json(HttpExchange& exchange, int status, const json& body, HeaderList headers) {
  metrics_.count_response(status);
  exchange.respond({status, "application/json", std::move(headers), dump_json(body)});
}

void Server::respond_error(HttpExchange& exchange, Dialect dialect, const ApiError& error) {
  metrics_.count_response(error.status());
  exchange.respond(error_response(dialect, error.status(), error.what(), error.param(), error.code()));
}

void Server::check_api_key(const HttpRequest& request) const {
  if (options_.api_key.empty()) return;
  if (const std::string* authorization = request.header("authorization");
      authorization && authorization->rfind("Bearer ", 0) == 0 &&
      constant_time_equal(authorization->substr(7), options_.api_key))
    return;
  if (const std::string* key = request.header("x-api-key"); key && constant_time_equal(*key, options_.api_key)) return;
  throw ApiError(401, "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)", "",
                 "invalid_api_key");
}

void Server::stream_until_end(HttpExchange& exchange, const GenerationResponse& response,
                              const std::function<void()>& loop) {
  try {
    loop();
  } catch (const std::exception& error) {
    exchange.write(response.stream_failure(failure_after_acceptance(error)));
  }
}

void Server::handle(const HttpRequest& request, HttpExchange& transport_exchange) {
  RequestRecord record;
  record.arrival = Clock::now();
  record.id = ++requests_received_;
  record.method = request.method;
  record.path = request.path;
  RecordingExchange exchange(transport_exchange, record);
  handle_recorded(request, exchange, record);
  log_request(record);
}

void Server::log_request(const RequestRecord& record) const {
  if (!options_.request_log || record.path == "/health" || record.path == "/metrics") return;
  const double seconds = std::chrono::duration<double>(Clock::now() - record.arrival).count();
  const std::string line = format_request_log(record, seconds, *options_.request_log);
  if (*options_.request_log == LogFormat::Json)
    fmt::print(stderr, "{}\n", line);
  else
    fmt::print(stderr, "kiln: {}\n", line);
}

void Server::handle_recorded(const HttpRequest& request, HttpExchange& exchange, RequestRecord& record) {
  const Dialect dialect = anthropic_path(request.path) ? Dialect::Anthropic : Dialect::OpenAI;
  try {
    route(request, exchange, record);
  } catch (const ApiError& error) {
    if (!exchange.responded()) respond_error(exchange, dialect, error);
  } catch (const Error& error) {
    // kiln's own errors here come from the request's content (a template that rejects the
    // conversation, a token id the scheduler refuses).
    if (!exchange.responded()) respond_error(exchange, dialect, ApiError(400, error.what()));
  } catch (const std::exception& error) {
    if (!exchange.responded())
      respond_error(exchange, dialect, ApiError(500, std::string("internal error: ") + error.what()));
  }
}

void Server::route(const HttpRequest& request, HttpExchange& exchange, RequestRecord& record) {
  const std::string& path = request.path;
  struct Route {
    const char* path;
    const char* method;
  };
  static const Route kRoutes[] = {{"/", "GET"},
                                  {"/health", "GET"},
                                  {"/metrics", "GET"},
                                  {"/v1/models", "GET"},
                                  {"/v1/chat/completions", "POST"},
                                  {"/v1/completions", "POST"},
                                  {"/v1/messages", "POST"},
                                  {"/v1/messages/count_tokens", "POST"},
                                  {"/tokenize", "POST"},
                                  {"/detokenize", "POST"},
                                  {"/v1/embeddings", "POST"}};
  const std::string model_prefix = "/v1/models/";
  const bool model_path = path.rfind(model_prefix, 0) == 0;
  const Route* route = nullptr;
  for (const auto& candidate : kRoutes)
    if (path == candidate.path) route = &candidate;
  if (!route && !model_path)
    throw ApiError(404, fmt::format("no route for {} {}", quote_client_text(request.method), quote_client_text(path)),
                   "", "not_found");
  const std::string method = route ? route->method : "GET";
  // HEAD is GET without the body (RFC 9110 §9.3.2): the transport drops the body.
  if (request.method != method && !(request.method == "HEAD" && method == "GET"))
    throw ApiError(405,
                   fmt::format("{} takes {}, not {}", quote_client_text(path), method, quote_client_text(request.method)),
                   "", "method_not_allowed");

  if (path == "/health") {
    const HeaderList retry_after = {{"Retry-After", std::to_string(options_.retry_after_seconds)}};
    if (draining_.load())
      respond_json(exchange, 503, {{"status", "shutting down"}}, retry_after);
    else if (!ready_.load())
      respond_json(exchange, 503, {{"status", "loading"}}, retry_after);
    else
      respond_json(exchange, 200, {{"status", "ok"}});
    return;
  }
  if (path == "/metrics") {
    metrics_.count_response(200);
    exchange.respond({200, "text/plain; version=0.0.4; charset=utf-8", {}, metrics_text()});
    return;
  }
  // The page holds no secret and asks for the key itself, so it is served without one; an
  // embeddings server has no chat to offer it (known once the model is loaded).
  if (path == "/" && ready_.load() && embedding_scheduler_)
    throw ApiError(404, "this server serves embeddings (kiln serve --embeddings): the web chat needs a generation model",
                   "", "generation_not_served");
  if (path == "/") {
    metrics_.count_response(200);
    exchange.respond({200, "text/html; charset=utf-8", web_chat_headers(), std::string(web_chat_page())});
    return;
  }
  check_api_key(request);
  if (!ready_.load())
    throw ApiError(503, fmt::format("the model {} is still loading; retry later", options_.model_name), "",
                   "model_loading");
  const int64_t context = context_tokens();
  if (path == "/v1/models") {
    respond_json(exchange, 200, models_list(options_.model_name, context, unix_seconds()));
    return;
  }
  if (model_path) {
    const std::string requested = path.substr(model_prefix.size());
    if (requested != options_.model_name)
      throw ApiError(404, fmt::format("the model `{}` does not exist", quote_client_text(requested)), "model",
                     "model_not_found");
    respond_json(exchange, 200, models_list(options_.model_name, context, unix_seconds())["data"][0]);
    return;
  }
  if (path == "/tokenize") return tokenize(request, exchange);
  if (path == "/detokenize") return detokenize(request, exchange);
  if (path == "/v1/messages/count_tokens") return count_tokens(request, exchange);

  InFlight in_flight(*this);
  if (draining_.load()) throw ApiError(503, "the server is shutting down", "", "shutting_down");
  if (path == "/v1/embeddings") {
    if (!embedding_scheduler_)
      throw ApiError(400,
                     "this server generates text; /v1/embeddings is served by kiln serve --embeddings, for an "
                     "embedding model",
                     "", "embeddings_not_served");
    return embeddings(request, exchange, record);
  }
  if (embedding_scheduler_)
    throw ApiError(400,
                   fmt::format("this server serves embeddings (kiln serve --embeddings): {} is not served, "
                               "/v1/embeddings is",
                               path),
                   "", "generation_not_served");
  if (path == "/v1/chat/completions")
    chat_completions(request, exchange, record);
  else if (path == "/v1/completions")
    completions(request, exchange, record);
  else
    messages(request, exchange, record);
}

std::string Server::chat_prompt_text(const json& messages, const ChatPromptOptions& options) const {
  if (!codec_->has_chat_template())
    throw ApiError(400,
                   "this model has no chat template: start the server with --chat-template FILE, or use "
                   "/v1/completions",
                   "messages", "no_chat_template");
  try {
    return codec_->render_chat(messages, options);
  } catch (const Error& error) {
    // The template's message may quote the conversation.
    throw ApiError(400,
                   fmt::format("the chat template rejected the conversation: {}", quote_client_text(error.what())),
                   "messages");
  }
}

Server::ChatPrompt Server::chat_prompt(const json& messages, const ChatPromptOptions& options) const {
  const std::string text = chat_prompt_text(messages, options);
  ChatOutputSyntax syntax = codec_->chat_output_syntax();
  const bool tools = options.tools.is_array() && !options.tools.empty();
  if (!tools) syntax.tool_calls = ToolCallSyntax::None;
  const bool in_reasoning = prompt_opens_reasoning(text);
  // The template writes the special tokens (BOS) itself.
  return {codec_->encode(text, false), ChatOutputParser(syntax, tools ? options.tools : json(), in_reasoning),
          in_reasoning && syntax.reasoning};
}

TextGenerationRequest Server::generation_request(std::vector<int32_t> prompt, const GenerationFields& fields,
                                                 const std::string& prompt_param,
                                                 const std::string& max_tokens_param) const {
  for (const auto& [token, bias] : fields.sampling.logit_bias)
    if (token >= options_.vocab_size)
      throw ApiError(400,
                     fmt::format("logit_bias names token id {}, outside the vocabulary (0 to {})", token,
                                 options_.vocab_size - 1),
                     "logit_bias");
  TextGenerationRequest request;
  request.max_tokens = completion_budget(static_cast<int64_t>(prompt.size()), fields.max_tokens,
                                         scheduler_->options().context_tokens, prompt_param, max_tokens_param);
  // Without max_tokens: the room the prompt leaves, bounded by the dialect's default and the
  // generation config's max_new_tokens (vLLM takes the least of the three too).
  if (!fields.max_tokens) {
    if (fields.default_max_tokens) request.max_tokens = std::min(request.max_tokens, *fields.default_max_tokens);
    if (options_.default_max_tokens) request.max_tokens = std::min(request.max_tokens, *options_.default_max_tokens);
  }
  request.prompt = std::move(prompt);
  request.sampling = fields.sampling;
  request.stop = fields.stop;
  request.ignore_eos = fields.ignore_eos;
  if (fields.grammar)
    request.grammar = std::make_shared<const grammar::CompiledGrammar>(*fields.grammar, token_vocabulary());
  request.speculation = speculation_for(fields.speculative);
  return request;
}

grammar::Grammar Server::forced_tool_grammar(const ChatPrompt& prompt, const json& tools,
                                             const std::optional<std::string>& forced, bool several,
                                             const std::string& param) const {
  refuse_grammar_in_reasoning(prompt.in_reasoning, "force a tool call", param, "unsupported_tool_choice");
  try {
    return tool_call_grammar(codec_->chat_output_syntax().tool_calls, tools, forced, several);
  } catch (const Error& error) {
    throw ApiError(400, quote_client_text(error.what()), param, "unsupported_tool_choice");
  }
}

Speculation Server::speculation_for(const std::optional<GenerationFields::Speculative>& field) const {
  if (!field) return options_.speculation;
  if (field->disabled) return {};
  Speculation speculation = options_.speculation;
  if (field->num_tokens) speculation.tokens = static_cast<int32_t>(*field->num_tokens);
  const std::string method = field->method.value_or(speculation.enabled() ? speculation.proposer->name() : "ngram");
  if (options_.proposers.empty())
    throw ApiError(400, "this server runs without speculative decoding (kiln serve --speculative)", "speculative");
  const auto proposer = options_.proposers.find(method);
  if (proposer == options_.proposers.end()) {
    std::string offered;
    for (const auto& [name, unused] : options_.proposers) offered += (offered.empty() ? "" : ", ") + name;
    throw ApiError(400, fmt::format("speculative.method \"{}\" is not offered by this server (it offers: {})",
                                    quote_client_text(method), offered), "speculative.method");
  }
  speculation.proposer = proposer->second;
  return speculation;
}

void Server::cap_reasoning(TextGenerationRequest& request, const GenerationFields& fields,
                           const ChatPrompt& prompt) const {
  if (fields.reasoning_budget)
    request.reasoning_budget = codec_->reasoning_budget(*fields.reasoning_budget, prompt.in_reasoning);
}

std::shared_ptr<const grammar::TokenVocabulary> Server::token_vocabulary() const {
  std::call_once(vocabulary_once_, [&] {
    vocabulary_ = std::make_shared<const grammar::TokenVocabulary>(codec_->token_bytes(options_.vocab_size));
  });
  return vocabulary_;
}

std::unique_ptr<TextGeneration> Server::submit(TextGenerationRequest request, const std::string& endpoint,
                                              const RequestRecord& record) {
  const bool shutting_down = draining_.load();
  try {
    return std::make_unique<TextGeneration>(*scheduler_, *codec_, std::move(request), metrics_, endpoint,
                                            record.arrival);
  } catch (const QueueFull& error) {
    throw ApiError(429, fmt::format("the server is busy: {}; retry later", error.what()), "", "queue_full");
  } catch (const Error& error) {
    // The scheduler refuses everything once it stops; the server knows it is shutting down.
    if (shutting_down) throw ApiError(503, "the server is shutting down", "", "shutting_down");
    throw ApiError(400, error.what());
  }
}

void Server::run(HttpExchange& exchange, RequestRecord& record, const std::string& endpoint,
                 const TextGenerationRequest& request, int32_t choices, bool stream, GenerationResponse& response) {
  record.stream = stream;
  // Each choice is its own sequence: kiln has no prefix cache yet (issue 30), so each prefills the
  // prompt. A refusal part-way cancels the choices already submitted (their destructors).
  std::vector<std::unique_ptr<TextGeneration>> generations;
  for (int32_t choice = 0; choice < choices; ++choice) {
    TextGenerationRequest submitted = request;
    if (request.sampling.seed) submitted.sampling.seed = choice_seed(*request.sampling.seed, choice);
    generations.push_back(submit(std::move(submitted), endpoint, record));
  }
  // The prompt once (and what of it the prefix cache served the first choice), every choice's tokens.
  const auto usage = [&] {
    TokenUsage total{generations.front()->prompt_tokens(), 0, generations.front()->cached_tokens()};
    for (const auto& generation : generations) total.completion_tokens += generation->completion_tokens();
    return total;
  };
  // What the request log reports, however the response ends: the prompt once, every choice's tokens.
  struct RecordUsage {
    RequestRecord& record;
    const std::vector<std::unique_ptr<TextGeneration>>& generations;
    const std::function<TokenUsage()> usage;
    ~RecordUsage() {
      const TokenUsage total = usage();
      record.prompt_tokens = total.prompt_tokens;
      record.generated_tokens = total.completion_tokens;
      record.cached_tokens = total.cached_tokens;
      for (const auto& generation : generations)
        if (const auto first = generation->time_to_first_token();
            first && (!record.time_to_first_token_seconds || *first < *record.time_to_first_token_seconds))
          record.time_to_first_token_seconds = first;
    }
  } record_usage{record, generations, usage};
  const auto client_gone = [&] { return exchange.client_gone(); };

  if (!stream) {
    after_acceptance([&] {
      std::vector<WholeGeneration> wholes;
      for (const auto& generation : generations) wholes.push_back(run_to_end(*generation, client_gone));
      respond_json(exchange, 200, response.whole(wholes, usage()));
    });
    return;
  }

  metrics_.count_response(200);
  if (!exchange.start_stream(200, "text/event-stream", {})) return;
  for (const std::string& event : response.stream_start(usage()))
    if (!exchange.write(event)) return;
  stream_until_end(exchange, response, [&] {
    // The choices take turns, each waiting a share of the disconnect poll, so that one thread
    // streams every choice's deltas as they come.
    const auto wait = std::max(std::chrono::milliseconds(1), TextGeneration::kDisconnectPoll / choices);
    size_t open = generations.size();
    bool failed = false;
    while (open > 0 && !failed) {
      for (size_t choice = 0; choice < generations.size() && !failed; ++choice) {
        TextGeneration& generation = *generations[choice];
        if (generation.finished()) continue;
        const std::optional<TextDelta> delta = generation.next_within(client_gone, wait);
        if (!delta) continue;
        for (const std::string& event : response.stream_delta(choice, *delta, usage()))
          if (!exchange.write(event)) return;
        if (!delta->finished) continue;
        --open;
        failed = !ended_normally(delta->finish_reason);
      }
    }
    for (const std::string& event : response.stream_end(usage()))
      if (!exchange.write(event)) return;
  });
}

void Server::chat_completions(const HttpRequest& http_request, HttpExchange& exchange, RequestRecord& record) {
  const ChatCompletionRequest request = parse_chat_completion_request(
      parse_request_json(http_request.body), options_.model_name, options_.sampling_defaults);
  ChatPrompt prompt = chat_prompt(request.messages, request.prompt);
  GenerationFields fields = request.generation;
  if (fields.grammar)
    refuse_grammar_in_reasoning(prompt.in_reasoning, "constrain the reply", fields.grammar_field, "unsupported_schema");
  if (request.tool_call_required)
    fields.grammar = forced_tool_grammar(prompt, request.prompt.tools, request.forced_tool,
                                         request.parallel_tool_calls, "tool_choice");
  TextGenerationRequest generation = generation_request(std::move(prompt.ids), fields, "messages", "max_tokens");
  cap_reasoning(generation, fields, prompt);
  generation.logprobs = request.logprobs;
  generation.top_logprobs = request.top_logprobs;
  ChatCompletionResponse response(request, options_.model_name, *codec_, prompt.parser);
  run(exchange, record, "chat", generation, request.generation.n, request.generation.stream, response);
}

void Server::completions(const HttpRequest& http_request, HttpExchange& exchange, RequestRecord& record) {
  const CompletionRequest request = parse_completion_request(
      parse_request_json(http_request.body), options_.model_name, options_.vocab_size, options_.sampling_defaults);
  std::vector<int32_t> prompt = request.prompt_text ? codec_->encode(*request.prompt_text, true) : request.prompt_ids;
  if (prompt.empty()) throw ApiError(400, "the prompt is empty (it encodes to no tokens)", "prompt");
  TextGenerationRequest generation = generation_request(std::move(prompt), request.generation, "prompt", "max_tokens");
  generation.logprobs = request.logprobs.has_value();
  generation.top_logprobs = request.logprobs.value_or(0);
  CompletionResponse response(request, options_.model_name, *codec_);
  run(exchange, record, "completions", generation, request.generation.n, request.generation.stream, response);
}

void Server::messages(const HttpRequest& http_request, HttpExchange& exchange, RequestRecord& record) {
  const MessagesRequest request =
      parse_messages_request(parse_request_json(http_request.body), options_.model_name, options_.sampling_defaults);
  ChatPrompt prompt = chat_prompt(request.messages, request.prompt);
  GenerationFields fields = request.generation;
  if (fields.grammar)
    refuse_grammar_in_reasoning(prompt.in_reasoning, "constrain the reply", fields.grammar_field, "unsupported_schema");
  if (request.tool_call_required)
    fields.grammar = forced_tool_grammar(prompt, request.prompt.tools, request.forced_tool, request.parallel_tool_calls,
                                         "tool_choice");
  TextGenerationRequest generation = generation_request(std::move(prompt.ids), fields, "messages", "max_tokens");
  cap_reasoning(generation, fields, prompt);
  MessagesResponse response(options_.model_name, std::move(prompt.parser));
  run(exchange, record, "messages", generation, 1, request.generation.stream, response);
}

void Server::count_tokens(const HttpRequest& http_request, HttpExchange& exchange) {
  const MessagesRequest request = parse_count_tokens_request(parse_request_json(http_request.body), options_.model_name);
  const ChatPrompt prompt = chat_prompt(request.messages, request.prompt);
  respond_json(exchange, 200, {{"input_tokens", prompt.ids.size()}});
}

void Server::tokenize(const HttpRequest& http_request, HttpExchange& exchange) {
  const TokenizeRequest request = parse_tokenize_request(parse_request_json(http_request.body), options_.model_name);
  const std::vector<int32_t> ids =
      request.prompt ? codec_->encode(*request.prompt, request.add_special_tokens)
                     : codec_->encode(chat_prompt_text(request.messages, request.chat), request.add_special_tokens);
  json body = {{"count", ids.size()}, {"max_model_len", context_tokens()}, {"tokens", ids}};
  if (request.return_token_strs) {
    json texts = json::array();
    for (int32_t id : ids) texts.push_back(codec_->token_text(id));
    body["token_strs"] = std::move(texts);
  }
  respond_json(exchange, 200, body);
}

void Server::detokenize(const HttpRequest& http_request, HttpExchange& exchange) {
  const std::vector<int32_t> ids =
      parse_detokenize_request(parse_request_json(http_request.body), options_.model_name, options_.vocab_size);
  respond_json(exchange, 200, {{"prompt", codec_->decode(ids)}});
}

void Server::embeddings(const HttpRequest& http_request, HttpExchange& exchange, RequestRecord& record) {
  EmbeddingScheduler& scheduler = *embedding_scheduler_;
  const EmbeddingRequest request = parse_embedding_request(parse_request_json(http_request.body), options_.model_name,
                                                           options_.vocab_size, scheduler.hidden_size());
  const int64_t context = context_tokens();
  std::vector<std::vector<int32_t>> inputs;
  for (const EmbeddingInput& input : request.inputs) {
    // A text gets the tokenizer's specials as its post-processor adds them (Qwen3-Embedding's
    // closing <|endoftext|>, whose hidden state its last-token pooling reads).
    std::vector<int32_t> ids = input.text ? codec_->encode(*input.text, true) : input.ids;
    if (ids.empty()) reject_field(input.param, "`{}` encodes to no tokens", input.param);
    if (static_cast<int64_t>(ids.size()) > context)
      reject_field(input.param, "`{}` has {} tokens but the context holds {} (--max-context)", input.param, ids.size(),
                   context);
    inputs.push_back(std::move(ids));
  }
  const bool shutting_down = draining_.load();
  std::shared_ptr<EmbeddingJob> job;
  try {
    job = scheduler.submit(std::move(inputs), request.dimensions.value_or(scheduler.hidden_size()));
  } catch (const QueueFull& error) {
    throw ApiError(429, fmt::format("the server is busy: {}; retry later", error.what()), "", "queue_full");
  } catch (const Error& error) {
    if (shutting_down) throw ApiError(503, "the server is shutting down", "", "shutting_down");
    throw ApiError(400, error.what());
  }
  record.prompt_tokens = job->tokens();
  metrics_.add_tokens(job->tokens(), 0);
  const auto count = [&](FinishReason reason) {
    metrics_.count_request("embeddings", reason);
    metrics_.observe_request_duration(std::chrono::duration<double>(Clock::now() - record.arrival).count());
  };
  std::optional<std::vector<std::vector<float>>> embeddings;
  try {
    while (!(embeddings = job->wait(TextGeneration::kDisconnectPoll))) {
      if (!exchange.client_gone()) continue;
      job->cancel();  // no one is left to answer: its inputs give up their slots
      count(FinishReason::Cancelled);
      return;
    }
  } catch (const Error& error) {
    count(draining_.load() ? FinishReason::Cancelled : FinishReason::Error);
    if (draining_.load()) throw ApiError(503, "the server is shutting down", "", "shutting_down");
    throw ApiError(500, fmt::format("the server failed while embedding: {}", error.what()), "", "internal_error");
  }
  count(FinishReason::Stop);
  respond_json(exchange, 200, embeddings_body(*embeddings, request.encoding, options_.model_name, job->tokens()));
}

}  // namespace kiln::server

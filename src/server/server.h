// kiln's API server: OpenAI-compatible (/v1/chat/completions, /v1/completions, /v1/models, and
// vLLM's /tokenize and /detokenize) and Anthropic-compatible (/v1/messages,
// /v1/messages/count_tokens) endpoints, /health and /metrics, over the continuous-batching
// scheduler. Each request's handler thread drives it; the scheduler batches them all. The server
// only routes requests and runs their generations: each dialect (openai_api.h, anthropic_api.h)
// parses its requests and writes its answers, whole and streamed.
//
// A server started for embeddings (kiln serve --embeddings, serve_embeddings()) answers
// /v1/embeddings (openai_embeddings.h) over an EmbeddingScheduler instead, and refuses the
// generation endpoints; a generation server refuses /v1/embeddings. Neither guesses: a generation
// model's hidden states are no embedding anyone trained.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/embedding_scheduler.h"
#include "engine/scheduler.h"
#include "server/api_error.h"
#include "server/generation_response.h"
#include "server/http_server.h"
#include "server/metrics.h"
#include "server/request_fields.h"
#include "server/request_log.h"
#include "text/text_codec.h"
#include "text/text_generation.h"

namespace kiln::server {

using Clock = std::chrono::steady_clock;

struct ServerOptions {
  HttpServerOptions http;
  std::string model_name;  // the id clients name in `model`
  int64_t vocab_size = 0;  // the model's (token-id prompts are checked against it)
  // What a request gets for the sampling fields it does not set (the model's generation_config.json
  // over kiln's defaults), and the most tokens it generates without max_tokens (its max_new_tokens).
  SamplingParams sampling_defaults;
  std::optional<int64_t> default_max_tokens;
  std::string api_key;     // when set, /v1/* requires "Authorization: Bearer KEY" or "x-api-key: KEY"
  std::chrono::milliseconds shutdown_grace{30'000};  // how long shutdown lets requests finish
  int retry_after_seconds = 1;                       // Retry-After on 429 and 503
  // One line per request on stderr (request_log.h), but for /health and /metrics, whose probes
  // and scrapes every few seconds would bury the requests; nothing: no request log.
  std::optional<LogFormat> request_log;
  // Speculative decoding (--speculative): what a request gets unless its `speculative` field says
  // otherwise, and the proposers a request may name there, by method (docs/server.md).
  Speculation speculation;
  std::map<std::string, std::shared_ptr<Proposer>> proposers;
};

class Server {
 public:
  // Listens at once (an error names the address); answers after start(). Until serve_model() hands
  // it the model, /health says 503 "loading" and every other route 503 with Retry-After, so that
  // a load balancer and clients see a server that is coming up, not a refused connection.
  explicit Server(ServerOptions options);
  // Listens and serves `scheduler`'s model at once (serve_model() already called).
  Server(Scheduler& scheduler, const TextCodec& codec, ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  uint16_t port() const { return http_.port(); }
  size_t connection_limit() const { return http_.connection_limit(); }
  void start() { http_.start(); }
  // Speculative decoding set up with the loaded model (a draft model, the model's MTP head): what a
  // request gets unless its `speculative` field says otherwise, and the proposers it may name there
  // (ServerOptions::speculation and proposers). Before serve_model().
  void offer_speculation(Speculation speculation, std::map<std::string, std::shared_ptr<Proposer>> proposers);
  // The model is loaded: from here on the server answers with it. Called once, this or
  // serve_embeddings().
  void serve_model(Scheduler& scheduler, const TextCodec& codec);
  // The embedding model is loaded: from here on the server answers /v1/embeddings with it.
  void serve_embeddings(EmbeddingScheduler& embeddings, const TextCodec& codec);
  // Refuses new requests (503, /health included, on connections still accepted), lets those in
  // flight run for up to shutdown_grace, then cancels the rest by shutting the scheduler down, and
  // closes every connection. Idempotent.
  void shutdown();
  // Ends shutdown's grace period now: requests still running are cancelled.
  void cancel_in_flight();
  std::string metrics_text() const;

 private:
  enum class Dialect { OpenAI, Anthropic };

  void handle(const HttpRequest& request, HttpExchange& exchange);
  void handle_recorded(const HttpRequest& request, HttpExchange& exchange, RequestRecord& record);
  void route(const HttpRequest& request, HttpExchange& exchange, RequestRecord& record);
  void log_request(const RequestRecord& record) const;
  void respond_json(HttpExchange& exchange, int status, const nlohmann::ordered_json& body, HeaderList headers = {});
  void respond_error(HttpExchange& exchange, Dialect dialect, const ApiError& error);
  HttpResponse error_response(Dialect dialect, int status, const std::string& message, const std::string& param,
                              const std::string& code);
  void check_api_key(const HttpRequest& request) const;
  // Runs a streamed response's loop after its 200 went out. What the loop throws can no longer be a
  // status, so the stream ends with the dialect's error event (response.stream_failure) rather than
  // stopping with neither a finish reason nor an error.
  void stream_until_end(HttpExchange& exchange, const GenerationResponse& response, const std::function<void()>& loop);

  // A conversation's prompt ids, and the parser of the reply (text/chat_output.h): the template's
  // reasoning syntax (in reasoning from the start when the prompt ends inside <think>) and, when the
  // request offers tools, its tool-call syntax.
  struct ChatPrompt {
    std::vector<int32_t> ids;
    ChatOutputParser parser;
    bool in_reasoning = false;  // the prompt ends inside <think>
  };
  ChatPrompt chat_prompt(const nlohmann::ordered_json& messages, const ChatPromptOptions& options) const;
  // The conversation rendered by the chat template (a 400 without one, or when it refuses).
  std::string chat_prompt_text(const nlohmann::ordered_json& messages, const ChatPromptOptions& options) const;
  TextGenerationRequest generation_request(std::vector<int32_t> prompt, const GenerationFields& fields,
                                           const std::string& prompt_param, const std::string& max_tokens_param) const;
  // The grammar a forced tool choice holds the reply to, in the template's tool-call syntax
  // (text/tool_call_grammar.h): `forced` names the tool, else any; a 400 naming `param` where the
  // prompt opened reasoning, the syntax cannot be forced or a tool's schema is refused.
  grammar::Grammar forced_tool_grammar(const ChatPrompt& prompt, const nlohmann::ordered_json& tools,
                                       const std::optional<std::string>& forced, bool several,
                                       const std::string& param) const;
  // The request's reasoning budget in the chat template's markers (none where the template writes
  // no reasoning: there is nothing to cap).
  void cap_reasoning(TextGenerationRequest& request, const GenerationFields& fields, const ChatPrompt& prompt) const;
  // The server's speculation with the request's `speculative` field over it (a 400 for a method the
  // server does not offer).
  Speculation speculation_for(const std::optional<GenerationFields::Speculative>& field) const;

  // The model's vocabulary as bytes, for structured output: built (a trie of every token) on the
  // first request that asks for it.
  std::shared_ptr<const grammar::TokenVocabulary> token_vocabulary() const;

  // Submits a generation; the scheduler's refusals become what the client sees (429 when its queue
  // is full, 503 while shutting down, else 400).
  std::unique_ptr<TextGeneration> submit(TextGenerationRequest request, const std::string& endpoint,
                                         const RequestRecord& record);
  // Submits `choices` generations of `request` (choice i seeded with choice_seed(seed, i) when the
  // request has a seed) and answers them, whole or streamed, in the words of `response`'s dialect.
  // `endpoint` labels the request in the metrics.
  // The request's tokens and time to first token go into `record`.
  void run(HttpExchange& exchange, RequestRecord& record, const std::string& endpoint, const TextGenerationRequest& request,
           int32_t choices, bool stream, GenerationResponse& response);
  void chat_completions(const HttpRequest& request, HttpExchange& exchange, RequestRecord& record);
  void completions(const HttpRequest& request, HttpExchange& exchange, RequestRecord& record);
  void messages(const HttpRequest& request, HttpExchange& exchange, RequestRecord& record);
  void count_tokens(const HttpRequest& request, HttpExchange& exchange);
  void tokenize(const HttpRequest& request, HttpExchange& exchange);
  void detokenize(const HttpRequest& request, HttpExchange& exchange);
  void embeddings(const HttpRequest& request, HttpExchange& exchange, RequestRecord& record);
  // Tokens per sequence of whichever scheduler serves.
  int64_t context_tokens() const;

  // Counts a generation request in flight for the duration of a handler.
  class InFlight {
   public:
    explicit InFlight(Server& server);
    ~InFlight();
    InFlight(const InFlight&) = delete;
    InFlight& operator=(const InFlight&) = delete;

   private:
    Server& server_;
  };
  bool wait_in_flight(std::chrono::milliseconds timeout);

  // Set once by serve_model() or serve_embeddings() (one of the schedulers); every route but
  // /health and /metrics waits for `ready_` before touching them (the store of `ready_` publishes
  // them).
  Scheduler* scheduler_ = nullptr;
  EmbeddingScheduler* embedding_scheduler_ = nullptr;
  const TextCodec* codec_ = nullptr;
  std::atomic<bool> ready_{false};
  ServerOptions options_;
  ServerMetrics metrics_;
  std::atomic<bool> draining_{false};
  std::atomic<uint64_t> requests_received_{0};
  std::mutex in_flight_mutex_;
  std::condition_variable in_flight_done_;
  int64_t in_flight_ = 0;
  bool cancel_now_ = false;
  std::once_flag shutdown_once_;
  mutable std::once_flag vocabulary_once_;
  mutable std::shared_ptr<const grammar::TokenVocabulary> vocabulary_;
  HttpServer http_;  // last: its threads call into everything above
};

}  // namespace kiln::server

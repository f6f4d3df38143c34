// kiln chat: a conversation in the terminal, on the server's path: the TokenizerCodec renders the
// history with the chat template, a TextGeneration streams each answer from the Scheduler, and a
// ChatOutputParser tells the reply's reasoning from its content. Ctrl-C stops an answer; at the
// prompt it leaves, as Ctrl-D (end of input) and /exit do. Read from a pipe, it answers each line.
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/model_options.h"
#include "core/error.h"
#include "engine/scheduler.h"
#include "text/chat_output.h"
#include "text/generation_metrics.h"
#include "text/text_generation.h"
#include "text/tokenizer_codec.h"

namespace kiln::cli {
namespace {

using json = nlohmann::ordered_json;

struct ChatCommand {
  ModelOptions model;
  std::string chat_template;
  std::string system;
  int64_t max_tokens = 1024;
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  std::optional<uint64_t> seed;
  bool ignore_eos = false;
  ServingSizes sizes{1, 0, kDefaultPrefillChunk};  // one conversation at the model's context
};

constexpr const char* kHelp =
    "/system TEXT  set the system prompt (/system alone clears it)\n"
    "/reset        forget the conversation (the system prompt stays)\n"
    "/exit         leave (also Ctrl-D, or Ctrl-C at the prompt)\n"
    "/help         this list\n"
    "Ctrl-C while an answer streams stops it.\n";

// Set by SIGINT, on whichever thread the signal lands; read by the loop (a lock-free atomic is
// async-signal-safe).
std::atomic<bool> interrupted{false};

extern "C" void note_interrupt(int) { interrupted.store(true); }

void install_interrupt_handler() {
  struct sigaction action {};
  action.sa_handler = note_interrupt;
  sigemptyset(&action.sa_mask);
  // Restarted, an interrupted write to a full pipe or terminal loses nothing; the input is waited
  // for with poll(), which a signal always interrupts, and with a timeout, in case the signal went
  // to another thread.
  action.sa_flags = SA_RESTART;
  sigaction(SIGINT, &action, nullptr);
}

void print_now(std::string_view text) {
  fmt::print("{}", text);
  std::fflush(stdout);
}

// Lines of the standard input, read with read() so that a Ctrl-C while waiting is seen at once.
class LineReader {
 public:
  enum class Result { Line, End, Interrupted };

  Result read(std::string& line) {
    for (;;) {
      if (interrupted.exchange(false)) return Result::Interrupted;
      if (const size_t newline = buffer_.find('\n'); newline != std::string::npos) {
        line = buffer_.substr(0, newline);
        buffer_.erase(0, newline + 1);
        if (line.ends_with('\r')) line.pop_back();
        return Result::Line;
      }
      if (ended_) {
        if (buffer_.empty()) return Result::End;
        line = std::exchange(buffer_, {});
        return Result::Line;
      }
      pollfd input{STDIN_FILENO, POLLIN, 0};
      if (::poll(&input, 1, kPollMilliseconds) <= 0) continue;  // a timeout or a signal: look again
      char chunk[4096];
      const ssize_t got = ::read(STDIN_FILENO, chunk, sizeof chunk);
      if (got < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        fail("cannot read the standard input: {}", std::strerror(errno));
      }
      if (got == 0) ended_ = true;
      buffer_.append(chunk, static_cast<size_t>(got));
    }
  }

 private:
  static constexpr int kPollMilliseconds = 100;
  std::string buffer_;
  bool ended_ = false;
};

// Writes a reply's events: reasoning dimmed on a terminal, between <think> and </think> otherwise.
class ReplyPrinter {
 public:
  explicit ReplyPrinter(bool terminal) : terminal_(terminal) {}

  void print(const std::vector<ChatOutputEvent>& events) {
    for (const ChatOutputEvent& event : events) {
      const bool reasoning = event.kind == ChatOutputEvent::Kind::Reasoning;
      if (reasoning != in_reasoning_) print_now(reasoning ? open() : close());
      in_reasoning_ = reasoning;
      print_now(event.text);
    }
  }

  void end() {
    if (in_reasoning_) print_now(close());
    in_reasoning_ = false;
    print_now("\n");
  }

 private:
  const char* open() const { return terminal_ ? "\x1b[2m" : "<think>"; }
  const char* close() const { return terminal_ ? "\x1b[0m\n" : "</think>\n"; }

  bool terminal_;
  bool in_reasoning_ = false;
};

// The chat keeps no metrics.
class NoMetrics final : public GenerationMetrics {
 public:
  void count_request(const std::string&, FinishReason) override {}
  void add_tokens(int64_t, int64_t) override {}
  void observe_time_to_first_token(double) override {}
  void observe_inter_token_latency(double) override {}
  void observe_request_duration(double) override {}
};

// Notes go to stderr, so that stdout holds the answers alone.
template <typename... Args>
void note(fmt::format_string<Args...> format, Args&&... args) {
  fmt::print(stderr, "{}\n", fmt::format(format, std::forward<Args>(args)...));
}

class Conversation {
 public:
  Conversation(Scheduler& scheduler, const TokenizerCodec& codec, const ChatCommand& options)
      : scheduler_(scheduler), codec_(codec), options_(options), system_(options.system) {}

  // Runs a /command; false when it asks to leave.
  bool command(const std::string& line) {
    const size_t space = line.find(' ');
    const std::string name = line.substr(0, space);
    std::string argument = space == std::string::npos ? "" : line.substr(space + 1);
    argument.erase(0, argument.find_first_not_of(' '));
    if (name == "/exit" || name == "/quit") return false;
    if (name == "/reset") {
      history_ = json::array();
      note("(conversation cleared)");
    } else if (name == "/system") {
      system_ = argument;
      note("{}", system_.empty() ? "(system prompt cleared)" : "(system prompt set)");
    } else if (name == "/help") {
      fmt::print(stderr, "{}", kHelp);
    } else {
      note("unknown command {}; /help lists them", name);
    }
    return true;
  }

  // Streams the answer to `message` and keeps both in the history.
  void answer(const std::string& message, bool terminal) {
    history_.push_back({{"role", "user"}, {"content", message}});
    json messages = json::array();
    if (!system_.empty()) messages.push_back({{"role", "system"}, {"content", system_}});
    for (const json& turn : history_) messages.push_back(turn);
    std::unique_ptr<TextGeneration> generation;
    std::optional<ChatOutputParser> parser;
    try {
      const std::string prompt = codec_.render_chat(messages, ChatPromptOptions{});
      ChatOutputSyntax syntax = codec_.chat_output_syntax();
      syntax.tool_calls = ToolCallSyntax::None;  // no tools are offered
      parser.emplace(syntax, json(), prompt_opens_reasoning(prompt));
      TextGenerationRequest request;
      // The template writes the special tokens (BOS) itself.
      request.prompt = codec_.encode(prompt, false);
      request.max_tokens = options_.max_tokens;
      request.sampling = {options_.temperature, options_.top_k, options_.top_p, options_.min_p, options_.seed};
      request.ignore_eos = options_.ignore_eos;
      generation = std::make_unique<TextGeneration>(scheduler_, codec_, std::move(request), metrics_, "chat",
                                                    TextGeneration::Clock::now());
    } catch (const Error& error) {
      history_.erase(history_.size() - 1);
      note("kiln: {} (/reset starts a new conversation)", error.what());
      return;
    }
    ReplyPrinter printer(terminal);
    TextDelta delta;
    for (;;) {
      // Asked while no text comes (a long prefill), and after each piece of text.
      delta = generation->next([] { return interrupted.load(); });
      printer.print(parser->push(delta.text));
      if (delta.finished) break;
      if (interrupted.load()) {
        generation.reset();  // cancels the rest
        delta.finish_reason = FinishReason::Cancelled;
        break;
      }
    }
    printer.print(parser->finish());
    printer.end();
    // A Ctrl-C as the answer ended was meant for the answer, not for the prompt that follows.
    interrupted.store(false);
    if (delta.finish_reason == FinishReason::Cancelled)
      note("(stopped)");
    else if (!ended_normally(delta.finish_reason))
      note("kiln: the answer failed: {}", delta.error);
    // What was shown is what the model said, stopped or not.
    history_.push_back({{"role", "assistant"}, {"content", parser->output().content}});
  }

 private:
  Scheduler& scheduler_;
  const TokenizerCodec& codec_;
  const ChatCommand& options_;
  std::string system_;
  json history_ = json::array();
  NoMetrics metrics_;
};

RegisterCommand register_chat([](CLI::App& app) {
  auto options = std::make_shared<ChatCommand>();
  CLI::App* command =
      app.add_subcommand("chat", "Chat with a model in the terminal (its chat template over the conversation)");
  options->model.add_to(*command);
  command->add_option("--chat-template", options->chat_template, "A Jinja chat template file replacing the model's");
  command->add_option("--system", options->system, "The system prompt (/system changes it)");
  command->add_option("--max-tokens", options->max_tokens, "Most tokens per answer")->check(CLI::NonNegativeNumber);
  command->add_option("--temperature", options->temperature, "Sampling temperature (0: greedy)");
  command->add_option("--top-k", options->top_k, "Keep the k most likely tokens (0: off)");
  command->add_option("--top-p", options->top_p, "Nucleus sampling mass (1: off)");
  command->add_option("--min-p", options->min_p, "Drop tokens below min-p × the top probability (0: off)");
  command->add_option("--seed", options->seed, "Random seed (same seed, same answers)");
  command->add_flag("--ignore-eos", options->ignore_eos, "Keep answering past the end of the model's turn");
  command->add_option("--max-context", options->sizes.max_context,
                      "Tokens of the conversation kept in the cache (default: the model's context)");
  add_prefill_chunk_option(*command, options->sizes);
  command->callback([options] {
    SamplingParams{options->temperature, options->top_k, options->top_p, options->min_p, options->seed}.validate();
    options->model.resolve();
    PreparedModel prepared = prepare_model(options->model, options->sizes);
    const int64_t context = options->sizes.context(prepared.plan.config);
    // The tokenizer and template are read before the weights: a model that cannot chat fails at once.
    const TokenizerCodec codec(options->model.model_dir, read_chat_template(options->chat_template));
    codec.tokenizer().check_fits_model(prepared.plan.config.vocab_size);
    if (!codec.has_chat_template())
      fail("{} has no chat template: give one with --chat-template FILE", options->model.model_dir);
    const OpenedModel opened = build_prepared_model(std::move(prepared));
    SchedulerOptions scheduler_options;
    scheduler_options.max_batch = 1;
    scheduler_options.context_tokens = context;
    scheduler_options.prefill_chunk = options->sizes.prefill_chunk;
    Scheduler scheduler(*opened.model, scheduler_options);
    Conversation conversation(scheduler, codec, *options);

    // Until the model is loaded, Ctrl-C ends the program as usual.
    install_interrupt_handler();
    const bool interactive = ::isatty(STDIN_FILENO) == 1;
    const bool terminal = ::isatty(STDOUT_FILENO) == 1;
    if (interactive)
      note("kiln chat: {} ({} tokens of context). /help lists the commands; Ctrl-D leaves.", options->model.model,
           context);
    LineReader reader;
    for (;;) {
      if (interactive) print_now("> ");
      std::string line;
      if (reader.read(line) != LineReader::Result::Line) {
        if (interactive) print_now("\n");
        return;
      }
      if (line.find_first_not_of(" \t") == std::string::npos) continue;
      if (line.starts_with('/')) {
        if (!conversation.command(line)) return;
        continue;
      }
      conversation.answer(line, terminal);
    }
  });
});

}  // namespace
}  // namespace kiln::cli

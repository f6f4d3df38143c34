// kiln chat driven through a pipe: its answers are the library's for the same conversation,
// /system and /reset change what the model sees, and SIGINT stops an answer, not the chat.
#include <fcntl.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "test_support.h"
#include "text/text_model.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

using json = nlohmann::ordered_json;

json message(const std::string& role, const std::string& content) { return {{"role", role}, {"content", content}}; }

// The library's greedy answer to `messages`.
std::string library_answer(TextModel& model, const json& messages, int64_t max_tokens, bool ignore_eos = false) {
  TextOptions options;
  options.max_tokens = max_tokens;
  options.sampling.temperature = 0;
  options.ignore_eos = ignore_eos;
  return model.chat(messages, options).text;
}

std::string chat_command(const std::string& flags) {
  return kiln_command("chat --model " + stories_dir().string() + " --temperature 0 " + flags);
}

TEST(ChatCli, AnswersAsTheLibraryDoesForTheSameConversation) {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  TextModel model = TextModel::open(stories_dir(), *cpu);
  const int64_t max_tokens = 40;  // three short turns fit the model's 512 tokens
  const std::string system = "The sun was hot.";
  const std::string first = library_answer(model, json::array({message("user", "Once upon a time")}), max_tokens);
  const std::string second = library_answer(
      model,
      json::array({message("system", system), message("user", "Once upon a time"), message("assistant", first),
                   message("user", "The cat")}),
      max_tokens);
  // After /reset only the system prompt is left.
  const std::string third =
      library_answer(model, json::array({message("system", system), message("user", "Once upon a time")}), max_tokens);
  const std::string with_history = library_answer(
      model,
      json::array({message("system", system), message("user", "Once upon a time"), message("assistant", first),
                   message("user", "The cat"), message("assistant", second), message("user", "Once upon a time")}),
      max_tokens);
  ASSERT_NE(third, with_history);  // else the test could not tell that /reset dropped the history
  ASSERT_NE(third, first);         // nor that /system reached the model

  const CommandResult chat = run_command("{ printf 'Once upon a time\\n/system " + system +
                                         "\\nThe cat\\n/reset\\n\\nOnce upon a time\\n/exit\\nnever answered\\n' | " +
                                         chat_command("--max-tokens 40 2>/dev/null; }"));
  ASSERT_EQ(chat.exit_code, 0) << chat.output;
  EXPECT_EQ(chat.output, first + "\n" + second + "\n" + third + "\n");

  // kiln generate --chat answers the first message alike.
  const CommandResult generate = run_command(kiln_command(
      "generate --model " + stories_dir().string() +
      " --chat 'Once upon a time' --temperature 0 --max-tokens 40 2>/dev/null"));
  ASSERT_EQ(generate.exit_code, 0) << generate.output;
  EXPECT_EQ(generate.output, first + "\n");
}

TEST(ChatCli, SaysWhatIsWrongAndGoesOn) {
  // An unknown command and a conversation too long for the context are noted; the chat continues.
  const CommandResult result = run_command("{ printf '/bogus\\n/help\\nOnce upon a time\\nThe end\\n' | " +
                                           chat_command("--ignore-eos --max-context 64 2>&1 >/dev/null; }"));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("unknown command /bogus"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("/reset"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("the context holds 64"), std::string::npos) << result.output;
}

void write_all(int descriptor, const std::string& data) {
  for (size_t written = 0; written < data.size();) {
    const ssize_t count = ::write(descriptor, data.data() + written, data.size() - written);
    ASSERT_GT(count, 0);
    written += static_cast<size_t>(count);
  }
}

TEST(ChatCli, InterruptStopsTheAnswerAndTheChatGoesOn) {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  TextModel model = TextModel::open(stories_dir(), *cpu);
  // With --ignore-eos the answer runs to --max-tokens: long enough that a stop shows.
  const std::string whole = library_answer(model, json::array({message("user", "Once upon a time")}), 400, true);

  int input[2], output[2];
  ASSERT_EQ(::pipe(input), 0);
  ASSERT_EQ(::pipe(output), 0);
  // The answer's pipe is filled beforehand to a few bytes short of its capacity, so that the chat
  // blocks writing its first words (the model writes the rest in a fraction of a second) until
  // the SIGINT has been sent: the signal always lands mid-answer.
  const int capacity = ::fcntl(output[1], F_GETPIPE_SZ);
  ASSERT_GT(capacity, 64);
  const std::string filler(static_cast<size_t>(capacity) - 16, '#');
  write_all(output[1], filler);
  TempDir temp;
  const std::string errors = (temp.path() / "stderr").string();
  const std::string binary = kiln_binary().string(), stories = stories_dir().string();

  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::dup2(input[0], STDIN_FILENO);
    ::dup2(output[1], STDOUT_FILENO);
    const int error_file = ::open(errors.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(error_file, STDERR_FILENO);
    for (int descriptor : {input[0], input[1], output[0], output[1], error_file}) ::close(descriptor);
    ::execl(binary.c_str(), binary.c_str(), "chat", "--model", stories.c_str(), "--temperature", "0", "--ignore-eos",
            "--max-tokens", "400", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(input[0]);
  ::close(output[1]);
  // The second question is answered whole after /reset.
  write_all(input[1], "Once upon a time\n/reset\nOnce upon a time\n");
  ::close(input[1]);

  // The answer has begun once the pipe holds more than the filler.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int waiting = 0;; std::this_thread::sleep_for(std::chrono::milliseconds(2))) {
    ASSERT_EQ(::ioctl(output[0], FIONREAD, &waiting), 0);
    if (waiting > static_cast<int>(filler.size())) break;
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the chat never began to answer";
  }
  ASSERT_EQ(::kill(child, SIGINT), 0);

  std::string printed;
  char chunk[4096];
  for (ssize_t count; (count = ::read(output[0], chunk, sizeof chunk)) > 0;) printed.append(chunk, count);
  ::close(output[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  std::stringstream error_text;
  error_text << std::ifstream(errors).rdbuf();
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status << ": " << error_text.str();

  ASSERT_TRUE(printed.starts_with(filler));
  const std::string answers = printed.substr(filler.size());
  ASSERT_TRUE(answers.ends_with("\n" + whole + "\n")) << answers;
  const std::string stopped = answers.substr(0, answers.size() - whole.size() - 2);
  EXPECT_LT(stopped.size(), whole.size() / 2) << stopped;
  EXPECT_TRUE(whole.starts_with(stopped)) << stopped;
  EXPECT_NE(error_text.str().find("(stopped)"), std::string::npos) << error_text.str();
}

}  // namespace

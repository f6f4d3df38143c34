// The command line end to end: the README's main job, logits as .npy, and one-line errors.
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "io/npy.h"
#include "test_support.h"
#include "tokenizer/tokenizer.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

// The last line of the output (stderr comes after stdout here).
std::string last_line(const std::string& output) {
  std::string trimmed = output;
  while (!trimmed.empty() && trimmed.back() == '\n') trimmed.pop_back();
  return trimmed.substr(trimmed.rfind('\n') == std::string::npos ? 0 : trimmed.rfind('\n') + 1);
}

TEST(Cli, GenerateFromTextPrintsTheReferenceStory) {
  const auto model = stories_dir();
  const auto ref = nlohmann::json::parse(std::ifstream(model / "ref_greedy.json"));
  std::vector<int32_t> path = {1};
  for (int32_t id : ref["greedy_ids"].get<std::vector<int32_t>>()) path.push_back(id);
  const std::string story = Tokenizer::load(model).decode(path, true);
  ASSERT_TRUE(story.starts_with("Once upon a time, there was a little girl named Lily."));
  // "Once upon a time" is 4 of the 256 reference steps; llama2.c's run counts the prompt in them.
  const CommandResult result =
      run_command(kiln_command("generate --model " + model.string() + " --prompt 'Once upon a time' --temperature 0 --max-tokens 252 2>/dev/null"));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(result.output, story + "\n");
}

TEST(Cli, GenerateStopsAtAStopString) {
  const auto model = stories_dir();
  const CommandResult result = run_command(
      kiln_command("generate --model " + model.string() + " --prompt 'Once upon a time' --temperature 0 --stop 'park' 2>/dev/null"));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(result.output, "Once upon a time, there was a little girl named Lily. She loved to play outside in the \n");
}

// kiln generate takes the generation config's sampling defaults and max_new_tokens where its flags
// are not given; --generation-config none and the flags override them; a bad value names the file.
TEST(Cli, GenerateTakesTheGenerationConfigDefaults) {
  const auto stories = stories_dir();
  TempDir model;
  for (const auto& entry : std::filesystem::directory_iterator(stories))
    if (entry.is_regular_file() && entry.path().filename() != "generation_config.json")
      std::filesystem::create_symlink(entry.path(), model.path() / entry.path().filename());
  std::ofstream(model.path() / "generation_config.json")
      << R"({"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.0, "max_new_tokens": 12})";
  auto generate = [](const std::filesystem::path& dir, const std::string& flags) {
    const CommandResult result = run_command(
        kiln_command("generate --model " + dir.string() + " --prompt 'Once upon a time' " + flags + " 2>/dev/null"));
    EXPECT_EQ(result.exit_code, 0) << flags << ": " << result.output;
    return result.output;
  };
  const std::string greedy = generate(stories, "--temperature 0 --max-tokens 12");
  EXPECT_EQ(generate(model.path(), "--seed 1"), greedy);
  EXPECT_EQ(generate(model.path(), "--seed 2"), greedy);
  EXPECT_NE(generate(model.path(), "--generation-config none --seed 1 --max-tokens 12"), greedy);
  EXPECT_NE(generate(model.path(), "--temperature 1 --seed 1"), greedy);
  std::ofstream(model.path() / "generation_config.json", std::ios::trunc) << R"({"top_p": 0})";
  expect_one_line_error(
      {"generate --model " + model.path().string() + " --prompt 'Once'", "generation_config.json: top_p must be in (0, 1]"});
}

// "1,2,...,count"
std::string counting_ids(int count) {
  std::string ids = "1";
  for (int id = 2; id <= count; ++id) ids += fmt::format(",{}", id);
  return ids;
}

TEST(Cli, LogitsWritesEveryPositionAsNpy) {
  TempDir temp;
  const auto out = temp.path() / "logits.npy";
  // 70 positions in prefill chunks of 64: the logits of both chunks are written.
  const CommandResult result =
      run_command(kiln_command("logits --model " + (fixtures_dir() / "llama3-tiny/f32").string() + " --ids " +
                               counting_ids(70) + " --prefill-chunk 64 --out " + out.string()));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const NpyArray logits = read_npy(out);
  EXPECT_EQ(logits.shape, (Shape{70, 512}));
}

TEST(Cli, ErrorsAreOneLineAndNonZero) {
  const std::string model = (fixtures_dir() / "llama3-tiny/f32").string();
  const FailingCommand cases[] = {
      {"generate --model " + model + " --ids 1,x,3", "'x' is not a token id"},
      {"generate --model " + model + " --ids 1,99999", "99999"},
      {"generate --model /nonexistent --ids 1", "/nonexistent"},
      {"generate --model " + model + " --ids 1 --top-p 2", "top_p"},
      {"logits --model " + model + " --ids 1", "--out"},
      {"frobnicate", "frobnicate"},
  };
  for (const FailingCommand& command : cases) expect_one_line_error(command);
}

// A size a command cannot run at is named before any weight is read: here the checkpoint beside the
// config is not even a safetensors file, and only the run at valid sizes gets as far as saying so.
TEST(Cli, SizesAreCheckedBeforeAnyWeightIsRead) {
  TempDir temp;
  std::filesystem::copy_file(fixtures_dir() / "llama3-tiny/f32/config.json", temp.path() / "config.json");
  std::ofstream(temp.path() / "model.safetensors") << "not a safetensors file";
  const std::string model = temp.path().string();
  const std::string out = (temp.path() / "logits.npy").string();
  const FailingCommand cases[] = {
      {"generate --model " + model + " --ids 1 --prefill-chunk 100", "prefill chunk must be a positive multiple of 64, got 100"},
      {"logits --model " + model + " --ids 1 --out " + out + " --prefill-chunk 0", "prefill chunk must be a positive multiple of 64, got 0"},
      {"bench --model " + model + " --batch 1,0", "max batch must be at least 1, got 0"},
      {"fit --model " + model + " --max-batch 0", "max batch must be at least 1, got 0"},
      {"fit --model " + model + " --max-context -1", "max context must not be negative, got -1"},
      {"serve --model " + model + " --port 0 --prefill-chunk 96", "prefill chunk must be a positive multiple of 64, got 96"},
      {"generate --model " + model + " --ids 1 --prefill-chunk 128", "model.safetensors"},
  };
  for (const auto& c : cases) {
    const CommandResult result = run_command("{ " + kiln_command(c.arguments) + " 2>&1 >/dev/null; }");
    EXPECT_EQ(result.exit_code, 1) << c.arguments;
    EXPECT_NE(last_line(result.output).find(c.expected), std::string::npos) << c.arguments << ": " << result.output;
  }
}

TEST(Cli, EveryCommandHasHelp) {
  for (const char* command :
       {"generate", "chat", "logits", "bench", "synth", "inspect", "tokenize", "render", "serve", "fit", "pull"}) {
    const CommandResult result = run_command(kiln_command(std::string(command) + " --help"));
    EXPECT_EQ(result.exit_code, 0) << command;
    EXPECT_NE(result.output.find("Usage"), std::string::npos) << command;
  }
}

TEST(Cli, HelpShowsDefaultsAndServeFlagsComeFromTheEnvironmentOrAFile) {
  const CommandResult help = run_command(kiln_command("serve --help"));
  EXPECT_NE(help.output.find("--port UINT=8080 (Env:KILN_PORT)"), std::string::npos) << help.output;
  EXPECT_NE(help.output.find("--max-batch INT=8"), std::string::npos) << help.output;
  const std::string model = stories_dir().string();
  // A value from the environment is checked like one on the command line...
  const CommandResult from_environment =
      run_command("{ KILN_MAX_BATCH=1000000 " + kiln_command("serve --model " + model + " --port 0") + " 2>&1; }");
  EXPECT_EQ(from_environment.exit_code, 1) << from_environment.output;
  EXPECT_NE(from_environment.output.find("1000000 sequences"), std::string::npos) << from_environment.output;
  // ...and so is one from --config, which the command line overrides.
  TempDir dir;
  std::ofstream(dir.path() / "serve.toml") << "max-batch = 1000000\nport = 0\n";
  const std::string with_config = "serve --model " + model + " --config " + (dir.path() / "serve.toml").string();
  const CommandResult from_file = run_command("{ " + kiln_command(with_config) + " 2>&1; }");
  EXPECT_EQ(from_file.exit_code, 1) << from_file.output;
  EXPECT_NE(from_file.output.find("1000000 sequences"), std::string::npos) << from_file.output;
  const CommandResult overridden =
      run_command("{ " + kiln_command(with_config + " --max-batch 2000000") + " 2>&1; }");
  EXPECT_NE(overridden.output.find("2000000 sequences"), std::string::npos) << overridden.output;
  std::ofstream(dir.path() / "bad.toml") << "max-batches = 4\n";
  expect_one_line_error({"serve --model " + model + " --config " + (dir.path() / "bad.toml").string(),
                         "'max-batches' is not a kiln serve flag"});
}

TEST(Cli, FitSaysWhetherTheModelAndContextFit) {
  const std::string model = (stories_dir()).string();
  const CommandResult fits = run_command(kiln_command("fit --model " + model + " --max-batch 4"));
  ASSERT_EQ(fits.exit_code, 0) << fits.output;
  EXPECT_NE(fits.output.find("weights"), std::string::npos) << fits.output;
  EXPECT_NE(fits.output.find("fits: 4 sequences of 512 tokens"), std::string::npos) << fits.output;
  // A million sequences of the model's 512 tokens fit no machine: status 2, the shortfall, and the
  // longest context that would fit (none, on a machine under ~3 GB free).
  const CommandResult too_big = run_command(kiln_command("fit --model " + model + " --max-batch 1000000"));
  EXPECT_EQ(too_big.exit_code, 2) << too_big.output;
  EXPECT_NE(too_big.output.find("does not fit"), std::string::npos) << too_big.output;
  EXPECT_TRUE(too_big.output.find("the longest context that fits 1000000 sequences") != std::string::npos ||
              too_big.output.find("not even a one-token context fits") != std::string::npos)
      << too_big.output;
}

// A draft model (--speculative draft:DIR) is planned beside the target: its own line, in the total.
TEST(Cli, FitPlansADraftModelBesideTheTarget) {
  const std::string model = (stories_dir()).string();
  const CommandResult plain = run_command(kiln_command("fit --model " + model + " --max-batch 4"));
  const CommandResult drafted =
      run_command(kiln_command("fit --model " + model + " --max-batch 4 --speculative draft:" + model));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  ASSERT_EQ(drafted.exit_code, 0) << drafted.output;
  EXPECT_EQ(plain.output.find("draft model"), std::string::npos) << plain.output;
  EXPECT_NE(drafted.output.find("draft model"), std::string::npos) << drafted.output;
  EXPECT_NE(drafted.output.find("4 slots x 512 tokens of cache"), std::string::npos) << drafted.output;
}

TEST(Cli, ServeRefusesWhatDoesNotFitBeforeLoading) {
  const std::string model = (stories_dir()).string();
  const CommandResult result =
      run_command("{ " + kiln_command("serve --model " + model + " --port 0 --max-batch 1000000") + " 2>&1; }");
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_NE(result.output.find("GiB are available"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("--max-batch 1000000"), std::string::npos) << result.output;
  EXPECT_EQ(result.output.find("listening"), std::string::npos) << result.output;
}

}  // namespace

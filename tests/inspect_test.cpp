// `kiln inspect`: the JSON report for a real checkpoint, and resolution failures as a non-zero
// exit with the error on stderr.
#include <fstream>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "test_support.h"

using kiln::testing::kiln_binary;
using kiln::testing::run_command;

namespace {

std::string inspect_command(const std::filesystem::path& model_dir, const std::string& extra = "") {
  return fmt::format("'{}' inspect --model '{}' {}", kiln_binary().string(), model_dir.string(), extra);
}

// run_command captures stdout and stderr together; these keep only one of them.
kiln::testing::CommandResult stdout_of(const std::string& command) {
  return run_command(fmt::format("{{ {} 2>/dev/null; }}", command));
}
kiln::testing::CommandResult stderr_of(const std::string& command) {
  return run_command(fmt::format("{{ {} 2>&1 >/dev/null; }}", command));
}

}  // namespace

TEST(InspectCli, ReportsHowTheFixtureWouldBeBuilt) {
  const auto model_dir = kiln::testing::fixtures_dir() / "llama3-tiny" / "f32";
  // stdout alone: the report must be parseable JSON.
  const auto result = stdout_of(inspect_command(model_dir));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const auto report = nlohmann::json::parse(result.output);
  for (const char* key : {"model_type", "profile", "artifact_fingerprint", "config_fingerprint", "exact_artifact",
                          "implementation", "capabilities", "parameters", "bytes_by_dtype", "load_plan"})
    EXPECT_TRUE(report.contains(key)) << key;
  EXPECT_EQ(report["model_type"], "llama");
  EXPECT_EQ(report["profile"]["id"], "llama-family");
  for (const char* key : {"id", "fidelity", "capabilities", "execution", "artifact_fingerprint", "config_fingerprint"})
    EXPECT_TRUE(report["profile"].contains(key)) << "profile." << key;
  EXPECT_TRUE(report["artifact_fingerprint"].is_null()) << "a plain folder has no artifact fingerprint";
  EXPECT_EQ(report["exact_artifact"], false);
  EXPECT_EQ(report["implementation"], "llama");
  // The fixture is all f32: every parameter is 4 bytes, and the safetensors file holds them all
  // plus its header.
  const int64_t parameters = report["parameters"];
  EXPECT_GT(parameters, 0);
  EXPECT_EQ(report["bytes_by_dtype"], nlohmann::json({{"F32", 4 * parameters}}));
  EXPECT_LT(4 * parameters, static_cast<int64_t>(std::filesystem::file_size(model_dir / "model.safetensors")));
  EXPECT_EQ(report["load_plan"]["tensors"].size(), 3u + 9u * 2u);
  EXPECT_TRUE(report["load_plan"]["dropped"].empty());
}

TEST(InspectCli, HashesTheArtifactOnRequest) {
  kiln::testing::TempDir memo;
  const auto model_dir = kiln::testing::fixtures_dir() / "llama3-tiny" / "f32";
  const auto result = stdout_of(fmt::format("KILN_ARTIFACT_HASH_MEMO='{}' {}", (memo.path() / "memo.json").string(),
                                            inspect_command(model_dir, "--hash-artifact")));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const auto report = nlohmann::json::parse(result.output);
  EXPECT_EQ(report["artifact_fingerprint"].get<std::string>().rfind("sha256:", 0), 0u);
  EXPECT_EQ(report["exact_artifact"], false) << "no built-in profile is bound to the fixture";
}

#ifndef KILN_HAVE_CUDA
TEST(InspectCli, ACudaRequestWithoutACudaBackendFails) {
  const auto result = stderr_of(inspect_command(kiln::testing::fixtures_dir() / "llama3-tiny" / "f32", "--device cuda"));
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.output.find("llama-family"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("backend:cuda"), std::string::npos) << result.output;
}
#endif

TEST(InspectCli, AnUnsupportedModelFailsOnStderr) {
  kiln::testing::TempDir dir;
  std::ofstream(dir.path() / "config.json") << R"({"model_type": "gpt_neox", "hidden_size": 64})";
  const auto result = stderr_of(inspect_command(dir.path()));
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.output.find("gpt_neox"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("llama"), std::string::npos) << result.output;
}

TEST(InspectCli, ReportsTheChatTemplatesReplySyntax) {
  const auto source = kiln::testing::stories_dir();
  kiln::testing::TempDir temp;
  for (const char* file : {"config.json", "model.safetensors", "tokenizer.json"})
    std::filesystem::copy_file(source / file, temp.path() / file);
  nlohmann::json tokenizer_config = nlohmann::json::parse(std::ifstream(source / "tokenizer_config.json"));
  // A Qwen3-style template: Hermes tool calls and <think> reasoning.
  tokenizer_config["chat_template"] =
      "{%- if tools %}<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
      "{%- endif %}{%- for m in messages %}{{ m.content }}{%- endfor %}<think>\n\n</think>\n\n";
  std::ofstream(temp.path() / "tokenizer_config.json") << tokenizer_config.dump();
  const auto result = stdout_of(inspect_command(temp.path()));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(nlohmann::json::parse(result.output)["chat_output"],
            nlohmann::json({{"tool_calls", "hermes"}, {"reasoning", true}}));
  const auto plain = stdout_of(inspect_command(source));
  EXPECT_EQ(nlohmann::json::parse(plain.output)["chat_output"]["tool_calls"], "none");
}

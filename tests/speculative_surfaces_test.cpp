// Speculative decoding's surfaces: the request field `speculative`, `kiln serve --speculative` (a
// request's override, /metrics), the flags' checks at start, and `kiln bench --speculative`.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <nlohmann/json.hpp>

#include "mtp_support.h"
#include "serve_process.h"
#include "server/anthropic_api.h"
#include "server/api_error.h"
#include "server/json_fields.h"
#include "server/openai_api.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::server;
using namespace kiln::testing;
using json = nlohmann::ordered_json;

namespace {

// The status and param of parsing a chat request with `speculative` set to `field` (JSON text).
std::pair<int, std::string> parse_speculative(const std::string& field) {
  const std::string body = R"({"model":"m","messages":[{"role":"user","content":"hi"}],"speculative":)" + field + "}";
  try {
    const ChatCompletionRequest request = parse_chat_completion_request(parse_request_json(body), "m");
    EXPECT_TRUE(request.generation.speculative.has_value());
    return {200, ""};
  } catch (const ApiError& error) {
    return {error.status(), error.param()};
  }
}

TEST(SpeculativeField, IsFalseOrAMethodAndACount) {
  EXPECT_EQ(parse_speculative("false").first, 200);
  EXPECT_EQ(parse_speculative(R"({"method":"ngram","num_tokens":16})").first, 200);
  EXPECT_EQ(parse_speculative(R"({"num_tokens":1})").first, 200);
  EXPECT_EQ(parse_speculative("{}").first, 200);
  EXPECT_EQ(parse_speculative("true"), (std::pair<int, std::string>{400, "speculative"}));
  EXPECT_EQ(parse_speculative(R"("ngram")"), (std::pair<int, std::string>{400, "speculative"}));
  EXPECT_EQ(parse_speculative(R"({"num_tokens":0})"), (std::pair<int, std::string>{400, "speculative.num_tokens"}));
  EXPECT_EQ(parse_speculative(R"({"num_tokens":17})"), (std::pair<int, std::string>{400, "speculative.num_tokens"}));
  EXPECT_EQ(parse_speculative(R"({"method":3})"), (std::pair<int, std::string>{400, "speculative.method"}));
  EXPECT_EQ(parse_speculative(R"({"tokens":3})"), (std::pair<int, std::string>{400, "speculative.tokens"}));
  // Anthropic's bodies take it too.
  const json messages = parse_request_json(
      R"({"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}],"speculative":false})");
  EXPECT_TRUE(parse_messages_request(messages, "m").generation.speculative->disabled);
}

// A server drafting with stories260K for itself: every way a request may ask gives the plain
// greedy text; a method the server does not offer is a 400; /metrics counts the verify steps.
TEST(SpeculativeServe, RequestsChooseTheirSpeculationAndGetThePlainText) {
  KILN_REQUIRE_STORIES(dir);
  ServeProcess server(stories_arguments(
      dir, {"--max-batch", "4", "--speculative", "draft:" + dir.string(), "--num-speculative-tokens", "3"}));
  ASSERT_NE(server.port(), 0) << "kiln serve did not start:\n" << server.log();
  const auto completion = [&](json extra) {
    json body = {{"model", "stories260K"}, {"prompt", "Once upon a time"}, {"max_tokens", 60}, {"temperature", 0},
                 {"ignore_eos", true}};
    body.update(extra);
    return post(server.port(), "/v1/completions", body);
  };
  const auto plain = completion({{"speculative", false}});
  ASSERT_TRUE(plain);
  ASSERT_EQ(plain->status, 200) << plain->body;
  const std::string text = json::parse(plain->body)["choices"][0]["text"];
  const json ways = {nullptr, {{"method", "ngram"}}, {{"method", "draft"}, {"num_tokens", 5}}, {{"num_tokens", 2}}};
  for (const json& speculative : ways) {
    json extra = json::object();
    if (!speculative.is_null()) extra["speculative"] = speculative;
    const auto response = completion(extra);
    ASSERT_TRUE(response);
    ASSERT_EQ(response->status, 200) << response->body;
    EXPECT_EQ(json::parse(response->body)["choices"][0]["text"], text) << speculative.dump();
  }
  const auto refused = completion({{"speculative", {{"method", "mtp"}}}});
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 400);
  EXPECT_NE(refused->body.find("draft, ngram"), std::string::npos) << refused->body;
  EXPECT_GT(metric_value(server.port(), "kiln_speculative_verify_steps_total"), 0);
  EXPECT_GT(metric_value(server.port(), "kiln_speculative_accepted_tokens_total"), 0);
  EXPECT_GT(metric_value(server.port(), "kiln_speculative_acceptance_ratio"), 0);

  // Without --speculative, a request may decline speculation but not ask for it.
  ServeProcess plain_server(stories_arguments(dir, {"--max-batch", "2"}));
  ASSERT_NE(plain_server.port(), 0) << "kiln serve did not start:\n" << plain_server.log();
  json body = {{"model", "stories260K"}, {"prompt", "Once"}, {"max_tokens", 3}, {"speculative", false}};
  const auto declined = post(plain_server.port(), "/v1/completions", body);
  ASSERT_TRUE(declined);
  EXPECT_EQ(declined->status, 200) << declined->body;
  body["speculative"] = json::object();
  const auto asked = post(plain_server.port(), "/v1/completions", body);
  ASSERT_TRUE(asked);
  EXPECT_EQ(asked->status, 400);
  EXPECT_NE(asked->body.find("without speculative decoding"), std::string::npos) << asked->body;
}

TEST(SpeculativeFlags, AreCheckedAtStart) {
  KILN_REQUIRE_STORIES(dir);
  const std::string model = "--model " + dir.string() + " --ids 1,2 --max-tokens 4 ";
  expect_one_line_error({"generate " + model + "--speculative ngram --num-speculative-tokens 17", "1..16"});
  expect_one_line_error({"generate " + model + "--speculative ngram --num-speculative-tokens 0", "1..16"});
  expect_one_line_error({"generate " + model + "--speculative eagle", "unknown method"});
  expect_one_line_error({"generate " + model + "--speculative oracle", "unknown method"});

  // A draft whose tokenizer maps a token to another id.
  TempDir other;
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    if (entry.is_regular_file()) std::filesystem::copy_file(entry.path(), other.path() / entry.path().filename());
  nlohmann::json tokenizer = nlohmann::json::parse(std::ifstream(dir / "tokenizer.json"));
  auto& vocab = tokenizer["model"]["vocab"];
  const std::string first = vocab.begin().key();
  vocab[first] = vocab[first].get<int>() + 1000;
  std::ofstream(other.path() / "tokenizer.json") << tokenizer.dump();
  expect_one_line_error({"generate " + model + "--speculative draft:" + other.path().string(), "tokenizer differs"});
}

// --speculative mtp needs a family with an MTP head and a checkpoint holding its weights, on one
// device: each refused in one line before any weight is read.
TEST(SpeculativeFlags, MtpIsRefusedWhereNoHeadRuns) {
  KILN_REQUIRE_STORIES(dir);
  for (const std::string command : {"generate --ids 1,2 --max-tokens 4", "serve --port 0", "fit", "bench --ids 1,2"})
    expect_one_line_error({command + " --model " + dir.string() + " --speculative mtp",
                           "model_type llama has no multi-token-prediction head"});
  const std::filesystem::path dense = fixtures_dir() / "qwen3_5-text-tiny" / "f32";
  for (const std::string command : {"generate --ids 1,2 --max-tokens 4", "serve --port 0", "fit", "bench --ids 1,2"})
    expect_one_line_error({command + " --model " + dense.string() + " --speculative mtp", "no MTP weights"});
  TempDir with_head;
  write_with_mtp(dense, with_head.path());
  expect_one_line_error({"generate --ids 1,2 --max-tokens 4 --tensor-parallel 2 --model " + with_head.path().string() +
                             " --speculative mtp",
                         "not split over --tensor-parallel 2 ranks"});
}

// The dense fixture with random MTP weights: kiln generate --speculative mtp prints the plain ids
// and its counts, kiln fit plans the head's cache, kiln bench reports the exact run.
TEST(SpeculativeGenerate, TheMtpHeadGivesThePlainIds) {
  KILN_REQUIRE_STORIES(stories);
  TempDir dir;
  write_with_mtp(fixtures_dir() / "qwen3_5-text-tiny" / "f32", dir.path());
  const std::string model = "--model " + dir.path().string() + " --ids 1,5,9,3,5,9,3,5,9,7 --max-tokens 120 ";
  for (const std::string sampling : {"--temperature 0", "--temperature 0.8 --seed 4"}) {
    const CommandResult plain = run_command(kiln_command("generate " + model + sampling));
    const CommandResult mtp = run_command(kiln_command("generate " + model + sampling + " --speculative mtp"));
    ASSERT_EQ(plain.exit_code, 0) << plain.output;
    ASSERT_EQ(mtp.exit_code, 0) << mtp.output;
    const auto ids = [](const std::string& output) { return output.substr(0, output.find_first_not_of("0123456789,")); };
    EXPECT_EQ(ids(mtp.output), ids(plain.output)) << sampling;
    EXPECT_NE(mtp.output.find("tokens per verify step"), std::string::npos) << mtp.output;
  }
  const CommandResult fit =
      run_command(kiln_command("fit --model " + dir.path().string() + " --max-batch 2 --speculative mtp"));
  ASSERT_EQ(fit.exit_code, 0) << fit.output;
  EXPECT_NE(fit.output.find("mtp head cache"), std::string::npos) << fit.output;
  const CommandResult bench = run_command(kiln_command("bench --model " + dir.path().string() +
                                                       " --ids 1,5,9 --speculative mtp --decode-tokens 48 --repeats 1 --json"));
  ASSERT_EQ(bench.exit_code, 0) << bench.output;
  const nlohmann::json report = nlohmann::json::parse(bench.output.substr(bench.output.find('{')));
  EXPECT_EQ(report["method"], "mtp");
  EXPECT_EQ(report["generated_tokens"], 48);
  EXPECT_GT(report["verify_steps"].get<int64_t>(), 0);
}

// A server with the MTP head (the dense fixture with random MTP weights, and stories260K's tokenizer
// of the same 512 ids): a request gets the plain text whether it takes the server's MTP speculation,
// asks for it or for n-gram proposals by name, or declines; /metrics counts the verify steps.
TEST(SpeculativeServe, TheMtpHeadServesThePlainText) {
  KILN_REQUIRE_STORIES(stories);
  TempDir dir;
  write_with_mtp(fixtures_dir() / "qwen3_5-text-tiny" / "f32", dir.path());
  std::filesystem::copy_file(stories / "tokenizer.json", dir.path() / "tokenizer.json");
  ServeProcess server({"--model", dir.path().string(), "--max-batch", "3", "--speculative", "mtp"});
  ASSERT_NE(server.port(), 0) << "kiln serve did not start:\n" << server.log();
  const auto completion = [&](nlohmann::json extra) {
    nlohmann::json body = {{"model", dir.path().filename().string()}, {"prompt", "Once upon a time"},
                           {"max_tokens", 60}, {"temperature", 0}, {"ignore_eos", true}};
    body.update(extra);
    return post(server.port(), "/v1/completions", body);
  };
  const auto plain = completion({{"speculative", false}});
  ASSERT_TRUE(plain);
  ASSERT_EQ(plain->status, 200) << plain->body;
  const std::string text = nlohmann::json::parse(plain->body)["choices"][0]["text"];
  for (const nlohmann::json& speculative :
       {nlohmann::json(nullptr), nlohmann::json{{"method", "mtp"}, {"num_tokens", 2}}, nlohmann::json{{"method", "ngram"}}}) {
    nlohmann::json extra = nlohmann::json::object();
    if (!speculative.is_null()) extra["speculative"] = speculative;
    const auto response = completion(extra);
    ASSERT_TRUE(response);
    ASSERT_EQ(response->status, 200) << response->body;
    EXPECT_EQ(nlohmann::json::parse(response->body)["choices"][0]["text"], text) << speculative.dump();
  }
  EXPECT_GT(metric_value(server.port(), "kiln_speculative_verify_steps_total"), 0);
}

TEST(SpeculativeGenerate, PrintsThePlainIdsAndItsCounts) {
  KILN_REQUIRE_STORIES(dir);
  const std::string model = "--model " + dir.string() + " --ids 1 --max-tokens 80 --temperature 0 ";
  const CommandResult plain = run_command(kiln_command("generate " + model));
  const CommandResult drafted = run_command(kiln_command("generate " + model + "--speculative draft:" + dir.string()));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  ASSERT_EQ(drafted.exit_code, 0) << drafted.output;
  // The ids (stdout) lead the output; the summary lines (stderr) follow.
  const auto ids = [](const std::string& output) { return output.substr(0, output.find_first_not_of("0123456789,")); };
  const std::string plain_ids = ids(plain.output);
  EXPECT_EQ(std::count(plain_ids.begin(), plain_ids.end(), ','), 79);
  EXPECT_EQ(ids(drafted.output), ids(plain.output));
  EXPECT_NE(drafted.output.find("tokens per verify step"), std::string::npos) << drafted.output;
}

// Split over two tensor-parallel ranks, the hybrid fixture's rollbacks restore every rank's state.
TEST(SpeculativeGenerate, TensorParallelHybridRanksRollBackTogether) {
  KILN_REQUIRE_STORIES(dir);
  const std::string model = "--model " + (fixtures_dir() / "qwen3_5-text-tiny" / "f32").string() +
                            " --tensor-parallel 2 --ids 1,5,9,3,5,9,3,5,9,7 --max-tokens 200 --temperature 0 ";
  const CommandResult plain = run_command(kiln_command("generate " + model));
  const CommandResult speculative = run_command(kiln_command("generate " + model + "--speculative ngram"));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  ASSERT_EQ(speculative.exit_code, 0) << speculative.output;
  const auto ids = [](const std::string& output) { return output.substr(0, output.find_first_not_of("0123456789,")); };
  EXPECT_EQ(ids(speculative.output), ids(plain.output));
  // Some proposals were accepted and some rejected: the restore ran after partial acceptance.
  std::smatch counts;
  ASSERT_TRUE(std::regex_search(speculative.output, counts, std::regex(R"((\d+) of (\d+) proposed tokens accepted)")))
      << speculative.output;
  EXPECT_GT(std::stoi(counts[1]), 0);
  EXPECT_LT(std::stoi(counts[1]), std::stoi(counts[2]));
}

TEST(SpeculativeBench, ReportsTheSpeedUpOfAnExactRun) {
  KILN_REQUIRE_STORIES(dir);
  for (const std::string method : {"ngram", "oracle"}) {
    const CommandResult result = run_command(kiln_command("bench --model " + dir.string() + " --speculative " +
                                                          method + " --decode-tokens 64 --repeats 1 --json"));
    ASSERT_EQ(result.exit_code, 0) << result.output;
    const nlohmann::json report = nlohmann::json::parse(result.output.substr(result.output.find('{')));
    EXPECT_EQ(report["method"], method);
    EXPECT_EQ(report["oracle"], method == "oracle");
    EXPECT_EQ(report["generated_tokens"], 64);
    EXPECT_GT(report["verify_steps"].get<int64_t>(), 0);
    EXPECT_GT(report["tokens_per_verify_step"].get<double>(), 1.0);
    if (method == "oracle") {
      EXPECT_EQ(report["acceptance_rate"].get<double>(), 1.0);
    }
  }
}

}  // namespace

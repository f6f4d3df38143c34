// kiln pull and --model ORG/NAME against a fake hub (tests/fake_hub.py on a loopback port, no
// network): the huggingface_hub cache layout, resumed and re-fetched downloads, and the errors
// people meet (a gated repo, offline, an unknown id, a full disk).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/sha256.h"
#include "io/hub_cache.h"
#include "serve_process.h"
#include "test_support.h"

namespace kiln::testing {
namespace {

namespace fs = std::filesystem;

constexpr const char* kRepo = "kiln-test/stories260K";
constexpr const char* kCommit = "0123456789abcdef0123456789abcdef01234567";

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

void write_file(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

// tests/fake_hub.py serving a model folder as kRepo at kCommit, with the faults asked for; stopped
// when the object dies.
class FakeHub {
 public:
  FakeHub(const fs::path& model_dir, const fs::path& log, const std::vector<std::string>& faults) : log_(log) {
    std::vector<std::string> argv = {"python3", (source_dir() / "tests/fake_hub.py").string(),
                                     "--root", model_dir.string(), "--repo", kRepo, "--commit", kCommit,
                                     "--log", log.string()};
    argv.insert(argv.end(), faults.begin(), faults.end());
    int pipe_fds[2];
    if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(pipe_fds[1], STDOUT_FILENO);
      std::vector<char*> raw;
      for (auto& argument : argv) raw.push_back(argument.data());
      raw.push_back(nullptr);
      ::execvp(raw[0], raw.data());
      ::_exit(127);
    }
    ::close(pipe_fds[1]);
    // Its first line says the port ("port N").
    std::string line;
    pollfd readable{pipe_fds[0], POLLIN, 0};
    char c;
    while (line.find('\n') == std::string::npos && ::poll(&readable, 1, 10000) > 0 && ::read(pipe_fds[0], &c, 1) == 1)
      line += c;
    ::close(pipe_fds[0]);
    if (line.starts_with("port ")) port_ = std::stoi(line.substr(5));
  }
  ~FakeHub() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    ::waitpid(pid_, nullptr, 0);
  }
  FakeHub(const FakeHub&) = delete;
  FakeHub& operator=(const FakeHub&) = delete;

  int port() const { return port_; }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  std::vector<nlohmann::json> requests() const {
    std::vector<nlohmann::json> requests;
    std::istringstream lines(read_file(log_));
    for (std::string line; std::getline(lines, line);) requests.push_back(nlohmann::json::parse(line));
    return requests;
  }
  // The requests for blobs on the CDN host.
  std::vector<nlohmann::json> cdn_requests() const {
    std::vector<nlohmann::json> found;
    for (const auto& request : requests())
      if (request["path"].get<std::string>().starts_with("/cdn/")) found.push_back(request);
    return found;
  }

 private:
  fs::path log_;
  pid_t pid_ = -1;
  int port_ = 0;
};

struct KilnRun {
  int exit_code;
  std::string out;
  std::string err;
};

class HubTest : public ::testing::Test {
 protected:
  // HF_HOME and HF_HUB_CACHE in a fresh folder; no token, no proxy, online unless `environment`
  // says otherwise.
  KilnRun kiln(const std::string& arguments, const std::string& environment = "") const {
    const fs::path err = temp_.path() / "stderr.txt";
    // Grouped, so run_command's own 2>&1 does not take stderr back.
    const CommandResult result =
        run_command("{ " + command_line(arguments, environment) + " 2>" + err.string() + "; }");
    return {result.exit_code, result.output, read_file(err)};
  }
  std::string command_line(const std::string& arguments, const std::string& environment) const {
    return "env -u HF_TOKEN -u HF_TOKEN_PATH -u HF_HUB_OFFLINE -u HF_ENDPOINT NO_PROXY='*' no_proxy='*' HF_HOME=" +
           home().string() + " HF_HUB_CACHE=" + cache().string() + " " + environment + " " + kiln_command(arguments);
  }
  std::string online(const FakeHub& hub) const { return "HF_ENDPOINT=" + hub.endpoint(); }

  fs::path home() const { return temp_.path() / "hf-home"; }
  fs::path cache() const { return temp_.path() / "hub-cache"; }
  fs::path repo_folder() const { return cache() / "models--kiln-test--stories260K"; }
  fs::path snapshot() const { return repo_folder() / "snapshots" / kCommit; }
  fs::path log() const { return temp_.path() / "requests.jsonl"; }

  static std::string sha256_of(const fs::path& path) {
    Sha256 hash;
    hash.update(read_file(path));
    return hash.finish_hex();
  }

  TempDir temp_;
};

// Expects a failure whose last line on stderr (after any progress lines) is the error, holding
// every fragment.
void expect_error_line(const KilnRun& run, const std::vector<std::string>& fragments) {
  EXPECT_NE(run.exit_code, 0);
  std::string err = run.err;
  while (!err.empty() && err.back() == '\n') err.pop_back();
  const std::string last = err.substr(err.rfind('\n') == std::string::npos ? 0 : err.rfind('\n') + 1);
  EXPECT_TRUE(last.starts_with("kiln: error: ")) << err;
  for (const auto& fragment : fragments)
    EXPECT_NE(last.find(fragment), std::string::npos) << fragment << " in: " << last;
}

TEST(HubModelId, ReadsOrgNameAndRevisionAsHuggingfaceHubDoes) {
  const auto id = parse_hub_model_id("Qwen/Qwen3-0.6B");
  ASSERT_TRUE(id);
  EXPECT_EQ(id->repo, "Qwen/Qwen3-0.6B");
  EXPECT_EQ(id->revision, "main");
  const auto pinned = parse_hub_model_id("meta-llama/Llama-3.2-1B@refs/pr/1");
  ASSERT_TRUE(pinned);
  EXPECT_EQ(pinned->revision, "refs/pr/1");
  EXPECT_EQ(pinned->to_string(), "meta-llama/Llama-3.2-1B@refs/pr/1");
  for (const char* not_an_id : {"gpt2", "./org/name", "/models/llama", "org/name/extra", "org/na--me", "org/name.git",
                                "-org/name", "org/name@", "org/name@../x", "../shared/models"})
    EXPECT_FALSE(parse_hub_model_id(not_an_id)) << not_an_id;
}

TEST_F(HubTest, PullMakesHuggingfaceHubsLayoutAndTheModelRunsFromItOffline) {
  KILN_REQUIRE_STORIES(model);
  FakeHub hub(model, log(), {});
  ASSERT_GT(hub.port(), 0) << "tests/fake_hub.py did not start (python3 is needed)";

  const KilnRun pull = kiln(std::string("pull ") + kRepo, online(hub));
  ASSERT_EQ(pull.exit_code, 0) << pull.err;
  EXPECT_EQ(pull.out, snapshot().string() + "\n");
  EXPECT_EQ(read_file(repo_folder() / "refs/main"), kCommit);
  for (const char* file : {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                           "model.safetensors"}) {
    ASSERT_TRUE(fs::is_symlink(snapshot() / file)) << file;
    const fs::path target = fs::read_symlink(snapshot() / file);
    EXPECT_EQ(target.parent_path(), fs::path("../../blobs")) << file;
    EXPECT_EQ(read_file(snapshot() / file), read_file(model / file)) << file;
  }
  // An LFS file's blob is named by its sha256 (the hub's X-Linked-Etag), and its lock sits in .locks.
  const std::string weights_sha = sha256_of(model / "model.safetensors");
  EXPECT_EQ(fs::read_symlink(snapshot() / "model.safetensors"), fs::path("../../blobs") / weights_sha);
  EXPECT_TRUE(fs::exists(cache() / ".locks/models--kiln-test--stories260K" / (weights_sha + ".lock")));
  // Only what kiln reads is fetched.
  EXPECT_FALSE(fs::exists(snapshot() / "README.md"));
  EXPECT_FALSE(fs::exists(snapshot() / "llama2c"));
  for (const auto& blob : fs::directory_iterator(repo_folder() / "blobs"))
    EXPECT_FALSE(blob.path().string().ends_with(".incomplete")) << blob.path();
  // HF_ENDPOINT is where every request went, and the file list came from its API.
  const auto requests = hub.requests();
  ASSERT_FALSE(requests.empty());
  EXPECT_EQ(requests.front()["path"], std::string("/api/models/") + kRepo + "/revision/main");

  const std::string generate = "generate --prompt 'Once upon a time' --temperature 0 --max-tokens 24 --model ";
  const KilnRun from_cache = kiln(generate + kRepo, "HF_HUB_OFFLINE=1");
  ASSERT_EQ(from_cache.exit_code, 0) << from_cache.err;
  const KilnRun from_folder = kiln(generate + model.string());
  EXPECT_EQ(from_cache.out, from_folder.out);
  EXPECT_FALSE(from_cache.out.empty());
  // A snapshot is fingerprinted by its repo and commit.
  const KilnRun inspect = kiln(std::string("inspect --model ") + kRepo, "HF_HUB_OFFLINE=1");
  EXPECT_NE(inspect.out.find(std::string("hf:") + kRepo + "@" + kCommit), std::string::npos)
      << inspect.out << inspect.err;

  // Pulled again, nothing is fetched, and an HF_ENDPOINT with a trailing '/' is the same endpoint.
  const size_t cdn_before = hub.cdn_requests().size();
  const KilnRun again = kiln(std::string("pull ") + kRepo, "HF_ENDPOINT=" + hub.endpoint() + "/");
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_NE(again.err.find("0 of them fetched"), std::string::npos) << again.err;
  EXPECT_EQ(hub.cdn_requests().size(), cdn_before);
}

TEST_F(HubTest, ACommandGivenAHubIdFetchesWhatTheCacheLacks) {
  KILN_REQUIRE_STORIES(model);
  FakeHub hub(model, log(), {});
  ASSERT_GT(hub.port(), 0);
  const KilnRun by_id = kiln(std::string("tokenize --text 'Once upon a time' --model ") + kRepo, online(hub));
  ASSERT_EQ(by_id.exit_code, 0) << by_id.err;
  EXPECT_EQ(by_id.out, kiln("tokenize --text 'Once upon a time' --model " + model.string()).out);
  EXPECT_TRUE(fs::exists(snapshot() / "model.safetensors"));
  // Once cached, the hub is not asked again.
  const size_t asked = hub.requests().size();
  EXPECT_EQ(kiln(std::string("tokenize --text 'Once' --model ") + kRepo, online(hub)).exit_code, 0);
  EXPECT_EQ(hub.requests().size(), asked);
}

TEST_F(HubTest, AnInterruptedDownloadResumesWithARange) {
  KILN_REQUIRE_STORIES(model);
  FakeHub hub(model, log(), {"--drop-once", "model.safetensors"});
  ASSERT_GT(hub.port(), 0);
  const KilnRun pull = kiln(std::string("pull ") + kRepo, online(hub));
  ASSERT_EQ(pull.exit_code, 0) << pull.err;
  EXPECT_EQ(read_file(snapshot() / "model.safetensors"), read_file(model / "model.safetensors"));
  // The server dropped the connection after half the bytes; the next request asked for the rest.
  const auto cdn = hub.cdn_requests();
  ASSERT_EQ(cdn.size(), 2u);
  EXPECT_TRUE(cdn[0]["range"].is_null());
  EXPECT_EQ(cdn[1]["range"], "bytes=" + std::to_string(fs::file_size(model / "model.safetensors") / 2) + "-");
  EXPECT_NE(pull.err.find("resuming"), std::string::npos) << pull.err;
}

TEST_F(HubTest, AnIncompleteBlobLeftByAnEarlierPullIsResumed) {
  KILN_REQUIRE_STORIES(model);
  FakeHub hub(model, log(), {});
  ASSERT_GT(hub.port(), 0);
  const std::string weights = read_file(model / "model.safetensors");
  write_file(repo_folder() / "blobs" / (sha256_of(model / "model.safetensors") + ".incomplete"),
             weights.substr(0, 4096));
  const KilnRun pull = kiln(std::string("pull ") + kRepo, online(hub));
  ASSERT_EQ(pull.exit_code, 0) << pull.err;
  EXPECT_EQ(read_file(snapshot() / "model.safetensors"), weights);
  const auto cdn = hub.cdn_requests();
  ASSERT_EQ(cdn.size(), 1u);
  EXPECT_EQ(cdn[0]["range"], "bytes=4096-");
}

TEST_F(HubTest, PullsRunningAtOnceFetchEachBlobOnce) {
  KILN_REQUIRE_STORIES(model);
  FakeHub hub(model, log(), {});
  ASSERT_GT(hub.port(), 0);
  // Each waits on the blob's lock file while another writes it, then finds it whole.
  const std::string pull = command_line(std::string("pull ") + kRepo, online(hub)) + " > /dev/null";
  const CommandResult three =
      run_command(pull + " & a=$!; " + pull + " & b=$!; " + pull + " & c=$!; wait $a && wait $b && wait $c");
  ASSERT_EQ(three.exit_code, 0) << three.output;
  EXPECT_EQ(hub.cdn_requests().size(), 1u);
  EXPECT_EQ(read_file(snapshot() / "model.safetensors"), read_file(model / "model.safetensors"));
}

TEST_F(HubTest, ACorruptedShardIsRefusedAndFetchedAgain) {
  KILN_REQUIRE_STORIES(model);
  const std::string weights = read_file(model / "model.safetensors");
  {
    // Corrupted in transit once: deleted, fetched again whole.
    FakeHub hub(model, log(), {"--corrupt", "model.safetensors=1"});
    ASSERT_GT(hub.port(), 0);
    const KilnRun pull = kiln(std::string("pull ") + kRepo, online(hub));
    ASSERT_EQ(pull.exit_code, 0) << pull.err;
    EXPECT_EQ(read_file(snapshot() / "model.safetensors"), weights);
    EXPECT_EQ(hub.cdn_requests().size(), 2u);
    EXPECT_NE(pull.err.find("sha256"), std::string::npos) << pull.err;
  }
  fs::remove_all(cache());
  {
    // A .incomplete blob that is not a prefix of the file: resuming it gives the wrong sha256, so
    // it is deleted and the file fetched from its start.
    FakeHub hub(model, log(), {});
    ASSERT_GT(hub.port(), 0);
    write_file(repo_folder() / "blobs" / (sha256_of(model / "model.safetensors") + ".incomplete"),
               std::string(4096, 'x'));
    const KilnRun pull = kiln(std::string("pull ") + kRepo, online(hub));
    ASSERT_EQ(pull.exit_code, 0) << pull.err;
    EXPECT_EQ(read_file(snapshot() / "model.safetensors"), weights);
    const auto cdn = hub.cdn_requests();
    ASSERT_GE(cdn.size(), 2u);
    EXPECT_EQ(cdn[cdn.size() - 2]["range"], "bytes=4096-");
    EXPECT_TRUE(cdn.back()["range"].is_null());
  }
  fs::remove_all(cache());
  {
    // Corrupted every time: an error naming the file, and nothing left in the cache for it.
    FakeHub hub(model, log(), {"--corrupt", "model.safetensors=2"});
    ASSERT_GT(hub.port(), 0);
    const KilnRun pull = kiln(std::string("pull ") + kRepo, online(hub));
    expect_error_line(pull, {kRepo, "model.safetensors", "sha256"});
    const fs::path blob = repo_folder() / "blobs" / sha256_of(model / "model.safetensors");
    EXPECT_FALSE(fs::exists(blob));
    EXPECT_FALSE(fs::exists(blob.string() + ".incomplete"));
    EXPECT_FALSE(fs::exists(snapshot() / "model.safetensors"));
  }
}

TEST_F(HubTest, AGatedRepoAsksForHfTokenWhichNeverLeavesTheEndpointsHost) {
  KILN_REQUIRE_STORIES(model);
  FakeHub hub(model, log(), {"--require-token", "hf_secret"});
  ASSERT_GT(hub.port(), 0);
  expect_error_line(kiln(std::string("pull ") + kRepo, online(hub)), {kRepo, "401", "gated", "HF_TOKEN"});
  expect_error_line(kiln(std::string("generate --prompt hi --model ") + kRepo, online(hub)),
                        {"--model kiln-test/stories260K", "HF_TOKEN"});

  const size_t refused = hub.requests().size();
  const KilnRun pull = kiln(std::string("pull ") + kRepo, online(hub) + " HF_TOKEN=hf_secret");
  ASSERT_EQ(pull.exit_code, 0) << pull.err;
  const auto requests = hub.requests();
  for (size_t i = refused; i < requests.size(); ++i) {
    // The CDN is another host (the hub redirects LFS files there): the token stays behind.
    const bool cdn = requests[i]["path"].get<std::string>().starts_with("/cdn/");
    const nlohmann::json expected = cdn ? nlohmann::json() : nlohmann::json("Bearer hf_secret");
    EXPECT_EQ(requests[i]["authorization"], expected) << requests[i].dump();
  }
  EXPECT_FALSE(hub.cdn_requests().empty());

  // The token file under HF_HOME (where `huggingface-cli login` writes it) serves as well.
  fs::remove_all(cache());
  write_file(home() / "token", "hf_secret\n");
  const KilnRun with_file = kiln(std::string("pull ") + kRepo, online(hub));
  EXPECT_EQ(with_file.exit_code, 0) << with_file.err;
}

TEST_F(HubTest, OfflineOnlyTheCacheIsReadAndAMissingFileIsAClearError) {
  KILN_REQUIRE_STORIES(model);
  FakeHub hub(model, log(), {});
  ASSERT_GT(hub.port(), 0);
  expect_error_line(kiln(std::string("pull ") + kRepo, online(hub) + " HF_HUB_OFFLINE=1"),
                        {kRepo, "HF_HUB_OFFLINE", "refs/main"});
  EXPECT_TRUE(hub.requests().empty());

  ASSERT_EQ(kiln(std::string("pull ") + kRepo, online(hub)).exit_code, 0);
  fs::remove(snapshot() / "model.safetensors");
  expect_error_line(kiln(std::string("generate --prompt hi --model ") + kRepo, online(hub) + " HF_HUB_OFFLINE=1"),
                        {kRepo, "HF_HUB_OFFLINE", "model.safetensors"});
  const KilnRun cached = kiln(std::string("pull ") + kRepo + "@" + kCommit, "HF_HUB_OFFLINE=yes");
  expect_error_line(cached, {"model.safetensors", "HF_HUB_OFFLINE"});
}

TEST_F(HubTest, AnIdTheHubDoesNotKnowSaysWhatWasTried) {
  KILN_REQUIRE_STORIES(model);
  FakeHub hub(model, log(), {});
  ASSERT_GT(hub.port(), 0);
  const KilnRun unknown = kiln("generate --prompt hi --model kiln-test/no-such-model", online(hub));
  expect_error_line(unknown, {"--model kiln-test/no-such-model: no such folder",
                                  "no model kiln-test/no-such-model on " + hub.endpoint()});
  EXPECT_EQ(unknown.err.find("cannot open"), std::string::npos) << unknown.err;
  expect_error_line(kiln(std::string("pull ") + kRepo + "@v9", online(hub)), {"no revision v9"});
  // Nothing listens on port 1: the error names the endpoint and offers the cache.
  expect_error_line(kiln(std::string("pull ") + kRepo, "HF_ENDPOINT=http://127.0.0.1:1"),
                        {"cannot reach http://127.0.0.1:1/api/models/", "HF_HUB_OFFLINE"});
}

TEST_F(HubTest, FreeDiskSpaceIsCheckedBeforeDownloading) {
  KILN_REQUIRE_STORIES(model);
  FakeHub hub(model, log(), {"--claim-size", "model.safetensors=1000000000000000000"});
  ASSERT_GT(hub.port(), 0);
  expect_error_line(kiln(std::string("pull ") + kRepo, online(hub)), {kRepo, "not enough disk space"});
  EXPECT_TRUE(hub.cdn_requests().empty());
}

TEST_F(HubTest, AShardedCheckpointIsFetchedThroughItsIndex) {
  KILN_REQUIRE_STORIES(model);
  FakeHub hub(model, log(), {"--index"});
  ASSERT_GT(hub.port(), 0);
  ASSERT_EQ(kiln(std::string("pull ") + kRepo, online(hub)).exit_code, 0);
  EXPECT_TRUE(fs::exists(snapshot() / "model.safetensors.index.json"));
  EXPECT_TRUE(missing_model_files(snapshot()).empty());
  const KilnRun run = kiln(std::string("generate --ids 1 --max-tokens 4 --model ") + kRepo, "HF_HUB_OFFLINE=1");
  EXPECT_EQ(run.exit_code, 0) << run.err;
}

TEST_F(HubTest, AnEmbeddingModelsSentenceTransformersModulesAreFetched) {
  KILN_REQUIRE_STORIES(stories);
  TempDir model;
  for (const char* file : {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"})
    fs::copy_file(stories / file, model.path() / file);
  const std::string modules = R"([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}])";
  write_file(model.path() / "modules.json", modules);
  write_file(model.path() / "1_Pooling/config.json", R"({"pooling_mode_mean_tokens": true})");
  write_file(model.path() / "3_Unlisted/config.json", "{}");
  FakeHub hub(model.path(), log(), {});
  ASSERT_GT(hub.port(), 0);
  const KilnRun pull = kiln(std::string("pull ") + kRepo, online(hub));
  ASSERT_EQ(pull.exit_code, 0) << pull.err;
  EXPECT_EQ(read_file(snapshot() / "modules.json"), modules);
  EXPECT_EQ(read_file(snapshot() / "1_Pooling/config.json"), R"({"pooling_mode_mean_tokens": true})");
  EXPECT_FALSE(fs::exists(snapshot() / "3_Unlisted"));
}

}  // namespace
}  // namespace kiln::testing

// SHA-256 against the NIST vectors, config fingerprints over the documented graph-shaping fields,
// and artifact fingerprints: Hugging Face snapshot paths and memoised content hashes.
#include <fcntl.h>
#include <sys/stat.h>

#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/sha256.h"
#include "io/fingerprint.h"
#include "profile_support.h"
#include "test_support.h"

using namespace kiln;
using kiln::testing::TempDir;
using kiln::testing::tiny_config;

// --- SHA-256 ------------------------------------------------------------------------------------

// FIPS 180-4 examples (NIST CSRC "Examples with Intermediate Values", SHA256.pdf) and the
// one-million-'a' vector of FIPS 180-2 Appendix B.3.
TEST(Sha256, MatchesTheNistVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrs"
                       "mnopqrstnopqrstu"),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  EXPECT_EQ(sha256_hex(std::string(1'000'000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, StreamingEqualsOneShotAtEverySplit) {
  std::string message;
  for (int i = 0; i < 200; ++i) message += static_cast<char>(i * 37 + 11);
  const std::string whole = sha256_hex(message);
  for (size_t first = 0; first <= message.size(); first += 7) {
    for (size_t second = first; second <= message.size(); second += 29) {
      Sha256 hash;
      hash.update(std::string_view(message).substr(0, first));
      hash.update(std::string_view(message).substr(first, second - first));
      hash.update(std::string_view(message).substr(second));
      ASSERT_EQ(hash.finish_hex(), whole) << "split at " << first << ", " << second;
    }
  }
}

TEST(Sha256, RefusesUseAfterFinish) {
  Sha256 hash;
  hash.update("abc");
  hash.finish();
  EXPECT_THROW(hash.update("more"), Error);
  EXPECT_THROW(hash.finish(), Error);
}

// --- config fingerprints ------------------------------------------------------------------------

namespace {

struct ConfigEdit {
  const char* field;
  std::function<void(ModelConfig&)> edit;
};

// One edit per documented graph-shaping field of the dense families.
std::vector<ConfigEdit> transformer_edits() {
  return {
      {"model_type", [](ModelConfig& c) { c.model_type = "qwen2"; }},
      {"hidden_size", [](ModelConfig& c) { c.hidden_size = 96; }},
      {"intermediate_size", [](ModelConfig& c) { c.intermediate_size = 192; }},
      {"num_hidden_layers", [](ModelConfig& c) { c.num_hidden_layers = 5; }},
      {"num_attention_heads", [](ModelConfig& c) { c.num_attention_heads = 8; }},
      {"num_key_value_heads", [](ModelConfig& c) { c.num_key_value_heads = 4; }},
      {"head_dim", [](ModelConfig& c) { c.head_dim = 8; }},
      {"vocab_size", [](ModelConfig& c) { c.vocab_size = 257; }},
      {"rms_norm_eps", [](ModelConfig& c) { c.rms_norm_eps = 1e-6; }},
      {"hidden_act", [](ModelConfig& c) { c.hidden_act = "gelu"; }},
      {"rope.type", [](ModelConfig& c) { c.rope.type = "llama3"; }},
      {"rope.theta", [](ModelConfig& c) { c.rope.theta = 500000.0; }},
      {"rope.partial_rotary_factor", [](ModelConfig& c) { c.rope.partial_rotary_factor = 0.5; }},
      {"rope.factor", [](ModelConfig& c) { c.rope.factor = 8.0; }},
      {"rope.low_freq_factor", [](ModelConfig& c) { c.rope.low_freq_factor = 2.0; }},
      {"rope.high_freq_factor", [](ModelConfig& c) { c.rope.high_freq_factor = 8.0; }},
      {"rope.original_max_position_embeddings", [](ModelConfig& c) { c.rope.original_max_position_embeddings = 8192; }},
      {"tie_word_embeddings", [](ModelConfig& c) { c.tie_word_embeddings = true; }},
      {"attention_bias", [](ModelConfig& c) { c.attention_bias = true; }},
      {"mlp_bias", [](ModelConfig& c) { c.mlp_bias = true; }},
      {"qk_norm", [](ModelConfig& c) { c.qk_norm = true; }},
  };
}

std::vector<ConfigEdit> hybrid_edits() {
  return {
      {"layer_types", [](ModelConfig& c) { c.layer_types[1] = LayerKind::FullAttention; }},
      {"linear_num_key_heads", [](ModelConfig& c) { c.linear_num_key_heads = 4; }},
      {"linear_num_value_heads", [](ModelConfig& c) { c.linear_num_value_heads = 8; }},
      {"linear_key_head_dim", [](ModelConfig& c) { c.linear_key_head_dim = 32; }},
      {"linear_value_head_dim", [](ModelConfig& c) { c.linear_value_head_dim = 32; }},
      {"linear_conv_kernel_dim", [](ModelConfig& c) { c.linear_conv_kernel_dim = 3; }},
      {"rope.mrope_section", [](ModelConfig& c) { c.rope.mrope_section = {1, 1, 2}; }},
      {"rope.mrope_interleaved", [](ModelConfig& c) { c.rope.mrope_interleaved = false; }},
  };
}

// Edits of fields that do not shape the graph.
std::vector<ConfigEdit> non_graph_edits() {
  return {
      {"source", [](ModelConfig& c) { c.source = "/elsewhere/config.json"; }},
      {"outer_model_type", [](ModelConfig& c) { c.outer_model_type = "wrapper"; }},
      {"architectures", [](ModelConfig& c) { c.architectures = {"SomethingForCausalLM"}; }},
      {"max_position_embeddings", [](ModelConfig& c) { c.max_position_embeddings = 4096; }},
      {"torch_dtype", [](ModelConfig& c) { c.torch_dtype = "bfloat16"; }},
      {"bos_token_id", [](ModelConfig& c) { c.bos_token_id = 1; }},
      {"eos_token_ids", [](ModelConfig& c) { c.eos_token_ids = {2, 3}; }},
  };
}

}  // namespace

TEST(ConfigFingerprint, IsASha256OfTheGraphShapingFields) {
  const std::string fingerprint = config_fingerprint(tiny_config());
  ASSERT_EQ(fingerprint.size(), std::string("sha256:").size() + 64);
  EXPECT_EQ(fingerprint.rfind("sha256:", 0), 0u);
  EXPECT_EQ(config_fingerprint(tiny_config()), fingerprint);
  const auto fields = graph_shaping_fields(tiny_config());
  EXPECT_EQ(fields.size(), transformer_edits().size());
  for (const auto& edit : transformer_edits()) EXPECT_TRUE(fields.contains(edit.field)) << edit.field;
}

TEST(ConfigFingerprint, EveryGraphShapingFieldChangesIt) {
  for (const char* model_type : {"llama", "qwen3_5_text"}) {
    const ModelConfig base = tiny_config(model_type);
    auto edits = transformer_edits();
    if (builtin_families().find(model_type)->loop == Loop::HybridRecurrent) {
      auto more = hybrid_edits();
      edits.insert(edits.end(), more.begin(), more.end());
      edits.front().edit = [](ModelConfig& c) { c.model_type = "qwen3_next"; };
    }
    EXPECT_EQ(graph_shaping_fields(base).size(), edits.size()) << model_type;
    for (const auto& edit : edits) {
      ModelConfig edited = base;
      edit.edit(edited);
      EXPECT_NE(config_fingerprint(edited), config_fingerprint(base)) << model_type << ": " << edit.field;
    }
  }
}

// Exact-artifact profiles are bound to these hashes: they change only with the fingerprint's
// domain, never because the field lists moved (values from the lists as io/fingerprint.cpp kept
// them before the families declared theirs).
TEST(ConfigFingerprint, StaysTheSameForEveryFamily) {
  const std::pair<const char*, const char*> pinned[] = {
      {"llama", "sha256:76589d65db1db59c60ae1a3170b30cbf6705577b0806157f83be901f401f30d9"},
      {"qwen2", "sha256:56e4f094857c1611d174d99ddc87b9ad18d5d7e2961e1514581fa415a9459643"},
      {"qwen3", "sha256:ab4c2470c80df2f12736cf78a06bf98677744d3a5576b964dbaddf8f2a634053"},
      {"qwen3_5_text", "sha256:501ec5173a2df3e0f2f608996550f5585c7a7497ba4eaba806344429bbbda0c7"},
      {"qwen3_next", "sha256:ccddb1405743151377dc1d28dfc17a5c03a59cdbf1b604a05962d4cb1ee28aba"},
  };
  for (const auto& [model_type, fingerprint] : pinned)
    EXPECT_EQ(config_fingerprint(tiny_config(model_type)), fingerprint) << model_type;
}

TEST(ConfigFingerprint, FieldsThatDoNotShapeTheGraphLeaveItAlone) {
  for (const char* model_type : {"llama", "qwen3_5_text"}) {
    const ModelConfig base = tiny_config(model_type);
    for (const auto& edit : non_graph_edits()) {
      ModelConfig edited = base;
      edit.edit(edited);
      EXPECT_EQ(config_fingerprint(edited), config_fingerprint(base)) << model_type << ": " << edit.field;
    }
  }
}

TEST(ConfigFingerprint, AnUnlistedModelTypeIsAnError) {
  auto config = tiny_config();
  config.model_type = "mamba";
  EXPECT_FAILS_MENTIONING(config_fingerprint(config), "/models/tiny/config.json", "mamba");
}

// --- Hugging Face snapshots ---------------------------------------------------------------------

TEST(ArtifactFingerprint, NamesAHuggingFaceSnapshot) {
  const std::string commit = "0123456789abcdef0123456789abcdef01234567";
  const std::string hub = "/home/user/.cache/huggingface/hub/";
  EXPECT_EQ(hf_snapshot_fingerprint(hub + "models--Qwen--Qwen3-0.6B/snapshots/" + commit),
            "hf:Qwen/Qwen3-0.6B@" + commit);
  EXPECT_EQ(hf_snapshot_fingerprint(hub + "models--meta-llama--Llama-3.2-1B/snapshots/" + commit + "/"),
            "hf:meta-llama/Llama-3.2-1B@" + commit);
  EXPECT_EQ(hf_snapshot_fingerprint(hub + "models--gpt2/snapshots/" + commit), "hf:gpt2@" + commit);
  EXPECT_EQ(hf_snapshot_fingerprint(hub + "models--org--name/snapshots/./" + commit), "hf:org/name@" + commit);
}

TEST(ArtifactFingerprint, APlainFolderHasNone) {
  const std::string commit = "0123456789abcdef0123456789abcdef01234567";
  for (const std::string& path : std::vector<std::string>{
           "/models/tiny",
           "/hub/models--org--name/snapshots/0123456789abcdef",             // not a full commit
           "/hub/models--org--name/snapshots/0123456789ABCDEF0123456789ABCDEF01234567",  // not lower case
           "/hub/models--org--name/revisions/" + commit,                      // not a snapshot
           "/hub/datasets--org--name/snapshots/" + commit,                    // not a model
           "/hub/models--org--name--extra/snapshots/" + commit,               // not a repo id
           "/hub/models--org--name/snapshots/" + commit + "/subfolder",       // inside a snapshot
       })
    EXPECT_EQ(hf_snapshot_fingerprint(path), std::nullopt) << path;
  TempDir plain;
  EXPECT_EQ(artifact_fingerprint(plain.path(), /*hash_artifact=*/false), std::nullopt);
}

// --- content hashes -----------------------------------------------------------------------------

namespace {

void write_file(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
  ASSERT_TRUE(out.good()) << path;
}

timespec mtime_of(const std::filesystem::path& path) {
  struct stat info;
  EXPECT_EQ(::stat(path.c_str(), &info), 0) << path;
  return info.st_mtim;
}

void set_mtime(const std::filesystem::path& path, timespec mtime) {
  const timespec times[2] = {mtime, mtime};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0) << path;
}

// A model folder with two weight shards, an index, and files that are not weights.
struct ArtifactFolder {
  TempDir root;
  std::filesystem::path dir = root.path() / "model";
  std::filesystem::path memo = root.path() / "memo" / "artifact-hashes.json";

  ArtifactFolder() {
    std::filesystem::create_directories(dir);
    write_file(dir / "model-00001-of-00002.safetensors", std::string(1000, 'x'));
    write_file(dir / "model-00002-of-00002.safetensors", std::string(500, 'y'));
    write_file(dir / "model.safetensors.index.json", "{\"weight_map\": {}}");
    write_file(dir / "config.json", "{}");
    write_file(dir / "README.md", "readme");
  }
  // The content hash computed from scratch (a memo of its own).
  std::string fresh() const { return content_fingerprint(dir, root.path() / "fresh" / std::to_string(counter++)); }
  // Memoises the hash, applies `change` to the second shard, and expects the memoised hash to be
  // recomputed: it differs from the first one and equals a hash from scratch.
  void expect_memo_invalidated_by(const std::function<void(const std::filesystem::path& shard)>& change) const {
    const std::string original = content_fingerprint(dir, memo);
    change(dir / "model-00002-of-00002.safetensors");
    const std::string rehashed = content_fingerprint(dir, memo);
    EXPECT_NE(rehashed, original);
    EXPECT_EQ(rehashed, fresh());
  }
  mutable int counter = 0;
};

}  // namespace

TEST(ArtifactFingerprint, HashesTheWeightFilesOnly) {
  ArtifactFolder folder;
  const std::string fingerprint = content_fingerprint(folder.dir, folder.memo);
  EXPECT_EQ(fingerprint.rfind("sha256:", 0), 0u);
  EXPECT_EQ(fingerprint.size(), std::string("sha256:").size() + 64);
  EXPECT_EQ(folder.fresh(), fingerprint);
  write_file(folder.dir / "config.json", "{\"edited\": true}");
  write_file(folder.dir / "README.md", "edited");
  EXPECT_EQ(folder.fresh(), fingerprint);
  write_file(folder.dir / "model.safetensors.index.json", "{\"weight_map\": {\"a\": 1}}");
  EXPECT_NE(folder.fresh(), fingerprint);
}

TEST(ArtifactFingerprint, AddingOrRenamingAWeightFileChangesIt) {
  ArtifactFolder folder;
  const std::string before = folder.fresh();
  write_file(folder.dir / "extra.safetensors", "z");
  const std::string added = folder.fresh();
  EXPECT_NE(added, before);
  std::filesystem::rename(folder.dir / "extra.safetensors", folder.dir / "renamed.safetensors");
  EXPECT_NE(folder.fresh(), added);
}

TEST(ArtifactFingerprint, IsMemoisedWhileSizeMtimeAndInodeHold) {
  ArtifactFolder folder;
  const std::string original = content_fingerprint(folder.dir, folder.memo);
  ASSERT_TRUE(std::filesystem::exists(folder.memo));
  // Rewrite a shard in place with other bytes of the same size and the same mtime: the memo's
  // stamps still match, so the memoised hash comes back (proving the memo is consulted).
  const auto shard = folder.dir / "model-00002-of-00002.safetensors";
  const timespec mtime = mtime_of(shard);
  write_file(shard, std::string(500, 'Y'));
  set_mtime(shard, mtime);
  EXPECT_EQ(content_fingerprint(folder.dir, folder.memo), original);
  EXPECT_NE(folder.fresh(), original);
}

TEST(ArtifactFingerprint, AChangedMtimeInvalidatesTheMemo) {
  ArtifactFolder().expect_memo_invalidated_by([](const std::filesystem::path& shard) {
    timespec mtime = mtime_of(shard);
    write_file(shard, std::string(500, 'Y'));
    mtime.tv_sec += 1;
    set_mtime(shard, mtime);
  });
}

TEST(ArtifactFingerprint, AChangedSizeInvalidatesTheMemo) {
  ArtifactFolder().expect_memo_invalidated_by([](const std::filesystem::path& shard) {
    const timespec mtime = mtime_of(shard);
    write_file(shard, std::string(501, 'y'));
    set_mtime(shard, mtime);
  });
}

TEST(ArtifactFingerprint, AChangedInodeInvalidatesTheMemo) {
  ArtifactFolder folder;
  // Replace the shard by another file of the same size and mtime, renamed over it: only the inode
  // tells them apart.
  folder.expect_memo_invalidated_by([&](const std::filesystem::path& shard) {
    const auto replacement = folder.root.path() / "replacement";
    write_file(replacement, std::string(500, 'Y'));
    set_mtime(replacement, mtime_of(shard));
    std::filesystem::rename(replacement, shard);
  });
}

TEST(ArtifactFingerprint, AMalformedMemoIsRewritten) {
  ArtifactFolder folder;
  std::filesystem::create_directories(folder.memo.parent_path());
  write_file(folder.memo, "{ not json");
  const std::string fingerprint = content_fingerprint(folder.dir, folder.memo);
  EXPECT_EQ(fingerprint, folder.fresh());
  std::ifstream memo(folder.memo);
  const auto json = nlohmann::json::parse(memo);
  EXPECT_EQ(json[std::filesystem::canonical(folder.dir).string()]["fingerprint"], fingerprint);
}

TEST(ArtifactFingerprint, AFolderWithoutWeightsIsAnError) {
  TempDir root;
  write_file(root.path() / "config.json", "{}");
  EXPECT_FAILS_MENTIONING(content_fingerprint(root.path(), root.path() / "memo.json"), root.path().string(),
                          "no *.safetensors");
}

TEST(ArtifactFingerprint, HashingIsOnRequestAndASnapshotKeepsItsName) {
  ArtifactFolder folder;
  const kiln::testing::ScopedEnv memo("KILN_ARTIFACT_HASH_MEMO", folder.memo.string());
  EXPECT_EQ(artifact_fingerprint(folder.dir, /*hash_artifact=*/false), std::nullopt);
  EXPECT_EQ(artifact_fingerprint(folder.dir, /*hash_artifact=*/true), folder.fresh());
  EXPECT_TRUE(std::filesystem::exists(folder.memo));

  const std::string commit(40, 'c');
  const auto snapshot = folder.root.path() / "hub" / "models--org--tiny" / "snapshots" / commit;
  std::filesystem::create_directories(snapshot);
  write_file(snapshot / "model.safetensors", "weights");
  EXPECT_EQ(artifact_fingerprint(snapshot, /*hash_artifact=*/true), "hf:org/tiny@" + commit);
}

TEST(ArtifactFingerprint, TheMemoLivesInTheUserCache) {
  {
    const kiln::testing::ScopedEnv memo("KILN_ARTIFACT_HASH_MEMO", "/explicit/memo.json");
    EXPECT_EQ(default_artifact_hash_memo(), "/explicit/memo.json");
  }
  const kiln::testing::ScopedEnv no_memo("KILN_ARTIFACT_HASH_MEMO", "");
  {
    const kiln::testing::ScopedEnv cache("XDG_CACHE_HOME", "/xdg");
    EXPECT_EQ(default_artifact_hash_memo(), "/xdg/kiln/artifact-hashes.json");
  }
  const kiln::testing::ScopedEnv no_cache("XDG_CACHE_HOME", "");
  const kiln::testing::ScopedEnv home("HOME", "/home/someone");
  EXPECT_EQ(default_artifact_hash_memo(), "/home/someone/.cache/kiln/artifact-hashes.json");
}

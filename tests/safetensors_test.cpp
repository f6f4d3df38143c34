// safetensors reading, writing and load plans: valid round trips (suite Safetensors) and a table of
// malformed checkpoints that must each fail with one clear kiln::Error (suite Loader).
#include <cstring>
#include <fstream>
#include <functional>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"
#include "model/load_plan.h"
#include "test_support.h"

using namespace kiln;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::vector<uint8_t> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// Bytes 0, 1, 2, … (mod 251, so neighbouring tensors never repeat each other's pattern), offset by `salt`.
std::vector<uint8_t> pattern(size_t size, uint8_t salt) {
  std::vector<uint8_t> bytes(size);
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<uint8_t>((i + salt) % 251);
  return bytes;
}

SafetensorsEntry entry(const std::string& name, DType dtype, Shape shape, uint8_t salt) {
  SafetensorsEntry result{name, dtype, std::move(shape), {}, {}};
  result.bytes = pattern(result.nbytes(), salt);
  return result;
}

// A small checkpoint in the Llama layout with every accepted dtype, a scalar and an empty tensor.
std::vector<SafetensorsEntry> sample_entries() {
  std::vector<SafetensorsEntry> entries;
  entries.push_back(entry("model.embed_tokens.weight", DType::F32, {32, 16}, 1));
  entries.push_back(entry("model.layers.3.mlp.up_proj.weight", DType::BF16, {64, 160}, 2));
  entries.push_back(entry("model.layers.3.input_layernorm.weight", DType::F16, {16}, 3));
  entries.push_back(entry("model.norm.weight", DType::BF16, {16}, 4));
  entries.push_back(entry("scalar.weight", DType::F32, {}, 5));
  entries.push_back(entry("empty.weight", DType::F16, {0, 4}, 6));
  return entries;
}

void expect_matches(const Checkpoint& checkpoint, const std::vector<SafetensorsEntry>& entries) {
  ASSERT_EQ(checkpoint.tensors().size(), entries.size());
  uint64_t total = 0;
  for (const SafetensorsEntry& expected : entries) {
    SCOPED_TRACE(expected.name);
    ASSERT_TRUE(checkpoint.contains(expected.name));
    const TensorInfo& info = checkpoint.info(expected.name);
    EXPECT_EQ(info.dtype, expected.dtype);
    EXPECT_EQ(info.shape, expected.shape);
    EXPECT_EQ(info.nbytes, expected.bytes.size());
    const Tensor view = checkpoint.view(expected.name);
    EXPECT_EQ(view.shape(), expected.shape);
    EXPECT_EQ(view.dtype(), expected.dtype);
    ASSERT_EQ(view.nbytes(), expected.bytes.size());
    if (!expected.bytes.empty()) {
      EXPECT_EQ(std::memcmp(view.raw(), expected.bytes.data(), expected.bytes.size()), 0);
    }
    total += expected.bytes.size();
  }
  EXPECT_EQ(checkpoint.total_bytes(), total);
}

// The header of a safetensors file as JSON, and the data section after it.
struct SplitFile {
  json header;
  std::vector<uint8_t> data;
};

SplitFile split(const fs::path& file) {
  const std::vector<uint8_t> bytes = read_bytes(file);
  uint64_t length = 0;
  std::memcpy(&length, bytes.data(), 8);
  SplitFile result;
  result.header = json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<int64_t>(length));
  result.data.assign(bytes.begin() + 8 + static_cast<int64_t>(length), bytes.end());
  return result;
}

// Sets the header length field (the first 8 bytes) of a safetensors file, leaving the rest as it is.
void overwrite_header_length(const fs::path& file, uint64_t length) {
  auto bytes = read_bytes(file);
  std::memcpy(bytes.data(), &length, 8);
  write_bytes(file, bytes);
}

// Writes raw header text and the data section back as a safetensors file.
void join(const fs::path& file, const std::string& header_text, const std::vector<uint8_t>& data) {
  std::vector<uint8_t> bytes(8);
  const uint64_t length = header_text.size();
  std::memcpy(bytes.data(), &length, 8);
  bytes.insert(bytes.end(), header_text.begin(), header_text.end());
  bytes.insert(bytes.end(), data.begin(), data.end());
  write_bytes(file, bytes);
}

void edit_header(const fs::path& file, const std::function<void(json&)>& edit) {
  SplitFile parts = split(file);
  edit(parts.header);
  join(file, parts.header.dump(), parts.data);
}

void edit_json_file(const fs::path& file, const std::function<void(json&)>& edit) {
  json value = json::parse(read_bytes(file));
  edit(value);
  std::ofstream(file, std::ios::trunc) << value.dump(2);
}

const std::string kUpProj = "model.layers.3.mlp.up_proj.weight";

void write_single(const fs::path& dir) { write_safetensors(dir / "model.safetensors", sample_entries()); }

// Three shards: the sample tensors at most 4 KiB per shard.
void write_sharded(const fs::path& dir) { write_sharded_safetensors(dir, sample_entries(), 4096); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Valid checkpoints.

TEST(Safetensors, SingleFileRoundTripsEveryDtype) {
  kiln::testing::TempDir dir;
  const auto entries = sample_entries();
  write_single(dir.path());
  const Checkpoint checkpoint = Checkpoint::open(dir.path());
  EXPECT_EQ(checkpoint.files(), std::vector<fs::path>{dir.path() / "model.safetensors"});
  EXPECT_EQ(checkpoint.location(), dir.path());
  expect_matches(checkpoint, entries);
  // The writer pads the header to 8 bytes and writes wider dtypes first, so every tensor starts
  // aligned to its element size.
  for (const auto& [name, info] : checkpoint.tensors())
    EXPECT_EQ(info.offset % dtype_size(info.dtype), 0u) << name;
}

TEST(Safetensors, MisalignedTensorsFromOtherWritersAreCopiedAligned) {
  kiln::testing::TempDir dir;
  // A BF16 scalar first puts the F32 pair at data offset 2, as a writer that keeps insertion
  // order would.
  const std::vector<float> pair = {1.5f, -2.25f};
  std::vector<uint8_t> data = {0x80, 0x3f};
  data.resize(10);
  std::memcpy(data.data() + 2, pair.data(), 8);
  std::string header = R"({"a":{"dtype":"BF16","shape":[],"data_offsets":[0,2]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[2,10]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  join(dir.path() / "model.safetensors", header, data);

  const Checkpoint checkpoint = Checkpoint::open(dir.path());
  const Tensor b = checkpoint.view("b");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.raw()) % 4, 0u);
  EXPECT_EQ(b.data<const float>()[0], 1.5f);
  EXPECT_EQ(b.data<const float>()[1], -2.25f);
  EXPECT_EQ(bf16_to_f32(checkpoint.view("a").data<const uint16_t>()[0]), 1.0f);
}

TEST(Safetensors, ViewsAreZeroCopyIntoTheMapping) {
  kiln::testing::TempDir dir;
  write_single(dir.path());
  Tensor first;
  {
    const Checkpoint checkpoint = Checkpoint::open(dir.path());
    first = checkpoint.view(kUpProj);
    // Two views of one tensor are the same bytes, and neighbouring tensors sit at their file offsets.
    EXPECT_EQ(checkpoint.view(kUpProj).raw(), first.raw());
    const TensorInfo& up = checkpoint.info(kUpProj);
    const TensorInfo& embed = checkpoint.info("model.embed_tokens.weight");
    EXPECT_EQ(static_cast<const uint8_t*>(checkpoint.view("model.embed_tokens.weight").raw()) +
                  (static_cast<int64_t>(up.offset) - static_cast<int64_t>(embed.offset)),
              static_cast<const uint8_t*>(first.raw()));
  }
  // The view keeps the mapping alive after the checkpoint is gone.
  const auto expected = pattern(64 * 160 * 2, 2);
  EXPECT_EQ(std::memcmp(first.raw(), expected.data(), expected.size()), 0);
}

TEST(Safetensors, ShardedRoundTripThroughTheIndex) {
  kiln::testing::TempDir dir;
  const auto entries = sample_entries();
  const auto written = write_sharded_safetensors(dir.path(), entries, 4096);
  ASSERT_EQ(written.size(), 4u);  // 20480-byte up_proj alone, then the rest, then the index
  EXPECT_EQ(written.back().filename(), "model.safetensors.index.json");
  EXPECT_EQ(written.front().filename(), "model-00001-of-00003.safetensors");
  EXPECT_FALSE(fs::exists(dir.path() / "model.safetensors"));
  const json index = json::parse(read_bytes(written.back()));
  EXPECT_EQ(index["weight_map"][kUpProj], "model-00002-of-00003.safetensors");
  EXPECT_EQ(index["metadata"]["total_size"], 32 * 16 * 4 + 64 * 160 * 2 + 16 * 2 + 16 * 2 + 4);

  const Checkpoint checkpoint = Checkpoint::open(dir.path());
  EXPECT_EQ(checkpoint.files().size(), 3u);
  expect_matches(checkpoint, entries);
  EXPECT_EQ(checkpoint.info(kUpProj).file, dir.path() / "model-00002-of-00003.safetensors");
}

TEST(Safetensors, ShardedWriterWritesOneFileWhenEverythingFits) {
  kiln::testing::TempDir dir;
  const auto written = write_sharded_safetensors(dir.path(), sample_entries(), 1 << 20);
  EXPECT_EQ(written, std::vector<fs::path>{dir.path() / "model.safetensors"});
  expect_matches(Checkpoint::open(dir.path()), sample_entries());
}

TEST(Safetensors, StreamedTensorsAreWrittenChunkByChunk) {
  kiln::testing::TempDir dir;
  // 5M f32 elements = 20 MB, more than one 16 MiB chunk.
  SafetensorsEntry streamed{"streamed.weight", DType::F32, {5, 1000000}, {}, {}};
  std::vector<uint64_t> offsets;
  streamed.fill = [&](uint64_t offset, std::span<uint8_t> out) {
    offsets.push_back(offset);
    auto* values = reinterpret_cast<float*>(out.data());
    for (size_t i = 0; i < out.size() / 4; ++i) values[i] = static_cast<float>(offset / 4 + i);
  };
  std::vector<SafetensorsEntry> entries;
  entries.push_back(entry("small.weight", DType::BF16, {3}, 7));
  entries.push_back(std::move(streamed));
  write_safetensors(dir.path() / "model.safetensors", entries);
  EXPECT_EQ(offsets, (std::vector<uint64_t>{0, 16ull << 20}));

  const Checkpoint checkpoint = Checkpoint::open(dir.path());
  const Tensor view = checkpoint.view("streamed.weight");
  const float* values = view.data<const float>();
  for (int64_t i : {int64_t{0}, int64_t{1}, int64_t{4194303}, int64_t{4194304}, int64_t{4999999}})
    EXPECT_EQ(values[i], static_cast<float>(i)) << "element " << i;
}

TEST(Safetensors, WriterRejectsInconsistentEntriesAndLeavesNoFile) {
  kiln::testing::TempDir dir;
  const auto file = dir.path() / "model.safetensors";
  std::vector<SafetensorsEntry> wrong_size = {entry("a.weight", DType::F32, {4}, 0)};
  wrong_size[0].bytes.pop_back();
  EXPECT_THROW(write_safetensors(file, wrong_size), Error);
  std::vector<SafetensorsEntry> twice = {entry("a.weight", DType::F32, {4}, 0), entry("a.weight", DType::F32, {4}, 0)};
  EXPECT_THROW(write_safetensors(file, twice), Error);

  SafetensorsEntry failing{"failing.weight", DType::F32, {4}, {}, {}};
  failing.fill = [](uint64_t, std::span<uint8_t>) { throw Error("generator failed"); };
  EXPECT_THROW(write_safetensors(file, {failing}), Error);
  EXPECT_FALSE(fs::exists(file));
  EXPECT_FALSE(fs::exists(file.string() + ".partial"));
}

TEST(Safetensors, ReadsTheTransformersFixtures) {
  for (const char* precision : {"f32", "bf16"}) {
    const auto dir = kiln::testing::fixtures_dir() / "llama3-tiny" / precision;
    const Checkpoint checkpoint = Checkpoint::open(dir);
    EXPECT_EQ(checkpoint.tensors().size(), 21u);
    const TensorInfo& q = checkpoint.info("model.layers.1.self_attn.q_proj.weight");
    EXPECT_EQ(q.shape, (Shape{64, 64}));
    EXPECT_EQ(q.dtype, std::string(precision) == "f32" ? DType::F32 : DType::BF16);
    EXPECT_EQ(checkpoint.info("model.layers.0.self_attn.k_proj.weight").shape, (Shape{32, 64}));
  }
  const Checkpoint vl = Checkpoint::open(kiln::testing::fixtures_dir() / "qwen3_5-vl-tiny/f32");
  EXPECT_EQ(vl.info("model.language_model.layers.0.linear_attn.conv1d.weight").shape, (Shape{256, 1, 4}));
}

// ---------------------------------------------------------------------------------------------
// Load plans over a checkpoint.

TEST(LoaderPlan, IdentityPlanTakesEveryTensorZeroCopy) {
  kiln::testing::TempDir dir;
  write_single(dir.path());
  const Checkpoint checkpoint = Checkpoint::open(dir.path());
  const LoadPlan plan = identity_plan(checkpoint);
  ASSERT_EQ(plan.tensors.size(), checkpoint.tensors().size());
  WeightMap weights(checkpoint, plan);
  for (const auto& [name, info] : checkpoint.tensors()) {
    EXPECT_EQ(weights.source_name(name), name);
    EXPECT_EQ(weights.take(name, info.shape).raw(), checkpoint.view(name).raw()) << name;
  }
  EXPECT_NO_THROW(weights.require_all_used());
}

TEST(LoaderPlan, FixUpsReshapeConvWeightsAndShiftGainsExactly) {
  kiln::testing::TempDir dir;
  // A stored 1 + γ gain in bf16: values whose γ = stored − 1 is exact in f32 but not in bf16.
  const std::vector<float> stored_gain = {1.0f, 1.5f, 0.99609375f, 3.0e-5f, -2.0f, 257.0f};
  SafetensorsEntry gain{"norm.weight", DType::BF16, {6}, {}, {}};
  for (float value : stored_gain) {
    const uint16_t bits = f32_to_bf16(value);
    gain.bytes.push_back(static_cast<uint8_t>(bits));
    gain.bytes.push_back(static_cast<uint8_t>(bits >> 8));
  }
  std::vector<SafetensorsEntry> entries = {entry("conv_a.weight", DType::F32, {8, 1, 4}, 1),
                                           entry("conv_b.weight", DType::F32, {8, 4, 1}, 2), gain};
  write_safetensors(dir.path() / "model.safetensors", entries);
  const Checkpoint checkpoint = Checkpoint::open(dir.path());

  LoadPlan plan;
  plan.tensors.push_back({"a", "conv_a.weight", {FixUp::ConvToChannelsKernel}, {8, 4}});
  plan.tensors.push_back({"b", "conv_b.weight", {FixUp::ConvFromKernelLast}, {8, 4}});
  plan.tensors.push_back({"gamma", "norm.weight", {FixUp::SubtractOne}, {6}});
  WeightMap weights(checkpoint, plan);
  EXPECT_EQ(weights.take("a", {8, 4}).raw(), checkpoint.view("conv_a.weight").raw());
  EXPECT_EQ(weights.take("b", {8, 4}).raw(), checkpoint.view("conv_b.weight").raw());
  const Tensor gamma = weights.take("gamma", {6});
  ASSERT_EQ(gamma.dtype(), DType::F32);
  // 257 is not a bf16 value: it was stored as 256 (ties to even).
  const std::vector<float> expected = {0.0f, 0.5f, -0.00390625f, round_to_bf16(3.0e-5f) - 1.0f, -3.0f, 255.0f};
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_EQ(gamma.data<const float>()[i], expected[i]) << i;
  EXPECT_NO_THROW(weights.require_all_used());

  const json described = plan.to_json();
  EXPECT_EQ(described["tensors"][0]["fixups"][0], "conv_to_channels_kernel");
  EXPECT_EQ(described["tensors"][2]["fixups"][0], "subtract_one");
  EXPECT_EQ(described["tensors"][2]["canonical_shape"], json::array({6}));
}

TEST(LoaderPlan, DroppedTensorsNeedNoGraphAndAreListedInJson) {
  kiln::testing::TempDir dir;
  write_single(dir.path());
  const Checkpoint checkpoint = Checkpoint::open(dir.path());
  LoadPlan plan;
  plan.tensors.push_back({"embed", "model.embed_tokens.weight", {}, {32, 16}});
  for (const auto& [name, info] : checkpoint.tensors())
    if (name != "model.embed_tokens.weight") plan.dropped.push_back({name, "not part of this test's graph"});
  plan.notes.push_back("only the embedding is loaded");
  WeightMap weights(checkpoint, plan);
  weights.take("embed", {32, 16});
  EXPECT_NO_THROW(weights.require_all_used());
  const json described = plan.to_json();
  EXPECT_EQ(described["dropped"].size(), checkpoint.tensors().size() - 1);
  EXPECT_EQ(described["notes"][0], "only the embedding is loaded");
}

// ---------------------------------------------------------------------------------------------
// Malformed checkpoints: each is made by damaging a valid one, and each must fail with a
// kiln::Error naming the file, the tensor where there is one, and what is wrong.

namespace {

void open_checkpoint(const fs::path& dir) { Checkpoint::open(dir); }

using DirectoryAction = std::function<void(const fs::path& dir)>;

struct MalformedCase {
  MalformedCase(std::string label, DirectoryAction make, std::vector<std::string> expected,
                DirectoryAction load = open_checkpoint)
      : label(std::move(label)), make(std::move(make)), expected(std::move(expected)), load(std::move(load)) {}

  std::string label;
  DirectoryAction make;               // writes the broken checkpoint
  std::vector<std::string> expected;  // substrings of the message
  DirectoryAction load;               // what must fail on it
};

void take_all_but(const fs::path& dir, const std::string& skipped) {
  const Checkpoint checkpoint = Checkpoint::open(dir);
  WeightMap weights(checkpoint, identity_plan(checkpoint));
  for (const auto& [name, info] : checkpoint.tensors())
    if (name != skipped) weights.take(name, info.shape);
  weights.require_all_used();
}

fs::path single_file(const fs::path& dir) { return dir / "model.safetensors"; }

std::vector<MalformedCase> malformed_cases() {
  const std::string single = "model.safetensors";
  return {
      {"empty_file", [](const fs::path& dir) { write_bytes(single_file(dir), {}); },
       {single, "0 bytes", "shorter than the 8-byte"}},
      {"truncated_file",
       [](const fs::path& dir) {
         write_single(dir);
         fs::resize_file(single_file(dir), 5);
       },
       {single, "5 bytes"}},
      {"truncated_header",
       [](const fs::path& dir) {
         write_single(dir);
         fs::resize_file(single_file(dir), 8 + 40);
       },
       {single, "runs past the end of the file (48 bytes)"}},
      {"header_length_beyond_file",
       [](const fs::path& dir) {
         write_single(dir);
         // 8 more than the bytes after the length field.
         overwrite_header_length(single_file(dir), fs::file_size(single_file(dir)));
       },
       {single, "runs past the end of the file"}},
      {"absurd_header_length",
       [](const fs::path& dir) {
         write_single(dir);
         overwrite_header_length(single_file(dir), 1ull << 40);
       },
       {single, "1099511627776 is absurd"}},
      {"bad_json",
       [](const fs::path& dir) {
         write_single(dir);
         join(single_file(dir), R"({"model.norm.weight": {"dtype": "BF16", )", split(single_file(dir)).data);
       },
       {single, "header is not valid JSON"}},
      {"number_beyond_a_double",
       [](const fs::path& dir) {
         write_single(dir);
         join(single_file(dir), R"({"__metadata__": {}, "x": 1e9551615})", split(single_file(dir)).data);
       },
       {single, "header is not valid JSON"}},
      {"json_array_instead_of_object",
       [](const fs::path& dir) {
         write_single(dir);
         join(single_file(dir), "[1, 2, 3]", split(single_file(dir)).data);
       },
       {single, "header is a JSON array, not an object"}},
      {"duplicate_tensor_name",
       [](const fs::path& dir) {
         write_single(dir);
         const SplitFile parts = split(single_file(dir));
         const std::string norm = parts.header["model.norm.weight"].dump();
         join(single_file(dir), R"({"model.norm.weight": )" + norm + R"(, "model.norm.weight": )" + norm + "}",
              parts.data);
       },
       {single, "'model.norm.weight' twice"}},
      {"overlapping_ranges",
       [](const fs::path& dir) {
         write_single(dir);
         edit_header(single_file(dir), [](json& header) {
           const uint64_t begin = header[kUpProj]["data_offsets"][0].get<uint64_t>() + 100;
           header["model.norm.weight"]["data_offsets"] = {begin, begin + 32};
         });
       },
       {single, "model.norm.weight", "overlap tensor '" + kUpProj + "'"}},
      {"size_mismatch",
       [](const fs::path& dir) {
         write_single(dir);
         edit_header(single_file(dir), [](json& header) {
           auto& offsets = header[kUpProj]["data_offsets"];
           offsets[1] = offsets[0].get<uint64_t>() + 20000;
         });
       },
       {single, kUpProj, "shape [64, 160] × BF16 = 20480 bytes but data_offsets span 20000"}},
      {"range_outside_file",
       [](const fs::path& dir) {
         write_single(dir);
         edit_header(single_file(dir), [](json& header) { header["model.norm.weight"]["data_offsets"] = {1u << 20, (1u << 20) + 32}; });
       },
       {single, "model.norm.weight", "run past the end of the data section"}},
      {"truncated_data",
       [](const fs::path& dir) {
         write_single(dir);
         fs::resize_file(single_file(dir), fs::file_size(single_file(dir)) - 1);
       },
       {single, "past the end of the data section"}},
      {"unsupported_dtype",
       [](const fs::path& dir) {
         write_single(dir);
         edit_header(single_file(dir), [](json& header) { header[kUpProj]["dtype"] = "F8_E5M2"; });
       },
       {single, kUpProj, "unsupported dtype 'F8_E5M2'", "quantized weights"}},
      {"integer_dtype",
       [](const fs::path& dir) {
         write_single(dir);
         edit_header(single_file(dir), [](json& header) { header["model.norm.weight"]["dtype"] = "I64"; });
       },
       {single, "model.norm.weight", "unsupported dtype 'I64'"}},
      {"unknown_dtype",
       [](const fs::path& dir) {
         write_single(dir);
         edit_header(single_file(dir), [](json& header) { header["model.norm.weight"]["dtype"] = "Q4_K"; });
       },
       {single, "model.norm.weight", "unknown dtype 'Q4_K'"}},
      {"negative_shape",
       [](const fs::path& dir) {
         write_single(dir);
         edit_header(single_file(dir), [](json& header) { header[kUpProj]["shape"] = {-64, 160}; });
       },
       {single, kUpProj, "shape entry 0 is -64, negative"}},
      {"fractional_shape",
       [](const fs::path& dir) {
         write_single(dir);
         edit_header(single_file(dir), [](json& header) { header[kUpProj]["shape"] = {64, 160.5}; });
       },
       {single, kUpProj, "shape entry 1 is 160.5, not an integer"}},
      {"missing_data_offsets",
       [](const fs::path& dir) {
         write_single(dir);
         edit_header(single_file(dir), [](json& header) { header["model.norm.weight"].erase("data_offsets"); });
       },
       {single, "model.norm.weight", "no 'data_offsets'"}},
      {"bad_metadata",
       [](const fs::path& dir) {
         write_single(dir);
         edit_header(single_file(dir), [](json& header) { header["__metadata__"] = {{"format", 1}}; });
       },
       {single, "'__metadata__' entry 'format'", "not a string"}},
      {"two_files_without_index",
       [](const fs::path& dir) {
         write_safetensors(dir / "a.safetensors", sample_entries());
         write_safetensors(dir / "b.safetensors", sample_entries());
       },
       {"a.safetensors", "b.safetensors", "no model.safetensors.index.json"}},
      {"missing_shard",
       [](const fs::path& dir) {
         write_sharded(dir);
         fs::remove(dir / "model-00002-of-00003.safetensors");
       },
       {"model.safetensors.index.json", kUpProj, "shard 'model-00002-of-00003.safetensors' does not exist"}},
      {"index_tensor_absent_from_shard",
       [](const fs::path& dir) {
         write_sharded(dir);
         edit_json_file(dir / "model.safetensors.index.json",
                        [](json& index) { index["weight_map"]["lm_head.weight"] = "model-00003-of-00003.safetensors"; });
       },
       {"model-00003-of-00003.safetensors", "lm_head.weight", "the shard does not hold it"}},
      {"shard_tensor_missing_from_index",
       [](const fs::path& dir) {
         write_sharded(dir);
         edit_json_file(dir / "model.safetensors.index.json",
                        [](json& index) { index["weight_map"].erase("model.norm.weight"); });
       },
       {"model-00003-of-00003.safetensors", "model.norm.weight", "not listed in"}},
      {"duplicate_across_shards",
       [](const fs::path& dir) {
         write_sharded(dir);
         // Shard 3 keeps its own tensors and gains a second copy of shard 2's.
         std::vector<SafetensorsEntry> entries;
         for (SafetensorsEntry& sample : sample_entries())
           if (sample.name != kUpProj && sample.name != "model.embed_tokens.weight") entries.push_back(std::move(sample));
         entries.push_back(entry(kUpProj, DType::BF16, {64, 160}, 9));
         write_safetensors(dir / "model-00003-of-00003.safetensors", entries);
       },
       {"model-00003-of-00003.safetensors", kUpProj, "also stored in", "model-00002-of-00003.safetensors"}},
      {"index_shard_outside_directory",
       [](const fs::path& dir) {
         write_sharded(dir);
         edit_json_file(dir / "model.safetensors.index.json",
                        [](json& index) { index["weight_map"]["model.norm.weight"] = "../model.safetensors"; });
       },
       {"model.safetensors.index.json", "model.norm.weight", "not a file name in the model directory"}},
      {"missing_tensor_for_graph", [](const fs::path& dir) { write_single(dir); },
       {"model.layers.0.self_attn.q_proj.weight", "missing from the checkpoint"},
       [](const fs::path& dir) {
         const Checkpoint checkpoint = Checkpoint::open(dir);
         WeightMap weights(checkpoint, identity_plan(checkpoint));
         weights.take("model.layers.0.self_attn.q_proj.weight", {64, 64});
       }},
      {"wrong_shape_for_graph", [](const fs::path& dir) { write_single(dir); },
       {single, kUpProj, "wrong shape: config implies [64, 128] but the checkpoint has [64, 160]"},
       [](const fs::path& dir) {
         const Checkpoint checkpoint = Checkpoint::open(dir);
         WeightMap weights(checkpoint, identity_plan(checkpoint));
         weights.take(kUpProj, {64, 128});
       }},
      {"unused_tensor", [](const fs::path& dir) { write_single(dir); },
       {single, "model.norm.weight", "never used"}, [](const fs::path& dir) { take_all_but(dir, "model.norm.weight"); }},
      {"tensor_the_plan_ignores", [](const fs::path& dir) { write_single(dir); },
       {single, "scalar.weight", "neither maps nor drops"},
       [](const fs::path& dir) {
         const Checkpoint checkpoint = Checkpoint::open(dir);
         LoadPlan plan = identity_plan(checkpoint);
         std::erase_if(plan.tensors, [](const PlannedTensor& tensor) { return tensor.source == "scalar.weight"; });
         WeightMap weights(checkpoint, plan);
         for (const PlannedTensor& tensor : plan.tensors) weights.take(tensor.canonical, tensor.canonical_shape);
         weights.require_all_used();
       }},
      {"conv_fixup_on_wrong_layout", [](const fs::path& dir) { write_single(dir); },
       {single, kUpProj, "is not [channels, 1, kernel]"},
       [](const fs::path& dir) {
         const Checkpoint checkpoint = Checkpoint::open(dir);
         LoadPlan plan;
         plan.tensors.push_back({"conv", kUpProj, {FixUp::ConvToChannelsKernel}, {64, 160}});
         WeightMap weights(checkpoint, plan);
       }},
  };
}

void PrintTo(const MalformedCase& test_case, std::ostream* out) { *out << test_case.label; }

class LoaderMalformed : public ::testing::TestWithParam<MalformedCase> {};

TEST_P(LoaderMalformed, FailsWithOneClearError) {
  const MalformedCase& test_case = GetParam();
  kiln::testing::TempDir dir;
  test_case.make(dir.path());
  try {
    test_case.load(dir.path());
    FAIL() << "loading did not fail";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    EXPECT_NE(message.find(dir.path().filename().string()), std::string::npos) << message;
    for (const std::string& expected : test_case.expected)
      EXPECT_NE(message.find(expected), std::string::npos) << "expected '" << expected << "' in: " << message;
  }
}

INSTANTIATE_TEST_SUITE_P(Loader, LoaderMalformed, ::testing::ValuesIn(malformed_cases()),
                         [](const ::testing::TestParamInfo<MalformedCase>& info) { return info.param.label; });

}  // namespace

// How an embedding model turns its final hidden states into one vector per input, read from the
// model folder as sentence-transformers reads it: modules.json lists the modules in order, a
// `sentence_transformers.models.Transformer` (the model itself, at the folder's root), a
// `sentence_transformers.models.Pooling` whose folder's config.json sets one pooling_mode_* flag,
// and optionally a `sentence_transformers.models.Normalize` (L2 normalisation).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

enum class PoolingMode {
  LastToken,  // the last token's hidden state (pooling_mode_lasttoken: Qwen3-Embedding)
  Mean,       // the mean over every token (pooling_mode_mean_tokens)
  Cls,        // the first token's (pooling_mode_cls_token)
};

struct PoolingConfig {
  PoolingMode mode = PoolingMode::LastToken;
  bool normalize = true;  // L2-normalised after pooling
  std::string source;     // where it was read from, or why it is the default (for the startup log)
};

// "last-token", "mean" or "cls".
std::string_view pooling_mode_name(PoolingMode mode);

// The model folder's pooling. Without modules.json: last-token pooling, L2-normalised (what vLLM
// gives a decoder LM served as an embedding model). A module, pooling mode or word_embedding_dimension
// (against `hidden_size`) kiln cannot honour is an error naming the file and the field.
PoolingConfig read_pooling_config(const std::filesystem::path& model_dir, int64_t hidden_size);

// The config.json of each module modules.json lists at `modules_json` (as paths relative to its
// folder, e.g. "1_Pooling/config.json"), for fetching a model from the hub; an entry whose path is
// not a plain relative folder is an error naming it.
std::vector<std::string> sentence_transformers_module_configs(const std::filesystem::path& modules_json);

}  // namespace kiln

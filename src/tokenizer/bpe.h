// The BPE model of a tokenizer.json ("model": {"type": "BPE", ...}): vocabulary, ranked merges,
// byte fallback (<0xXX> tokens), the unknown token and ignore_merges, with the exact merge order of
// Hugging Face tokenizers (models/bpe/word.rs: the lowest-ranked adjacent pair first, the leftmost
// among equals) and a cache of recently encoded words.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kiln {

// Token ids index dense tables (the vocabulary's, the special-token flags, the model's embedding
// rows), so kiln refuses ids at or past this bound instead of allocating for them: a tokenizer.json
// holding one id of two billion would otherwise take gigabytes. The largest vocabularies published
// hold 262,144 tokens (Gemma 3); this leaves sixteen times that.
inline constexpr int32_t kMaxTokenIds = int32_t{1} << 22;

// Hash for string-keyed maps looked up by std::string_view without a copy.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view text) const { return std::hash<std::string_view>{}(text); }
};
template <typename Value>
using StringMap = std::unordered_map<std::string, Value, StringHash, std::equal_to<>>;

// Memo of recently encoded words: word -> ids, in flat arrays (no allocation per word).
class WordCache {
 public:
  WordCache();
  // Appends the ids of `word` and returns true when it is cached.
  bool find(std::string_view word, std::vector<int32_t>& ids) const;
  void insert(std::string_view word, std::span<const int32_t> ids);

 private:
  struct Slot {
    uint64_t hash;  // 0: empty
    uint32_t key_offset;
    uint32_t key_length;
    uint32_t ids_offset;
    uint32_t ids_count;
  };
  std::vector<Slot> slots_;
  std::string keys_;
  std::vector<int32_t> ids_;
  size_t count_ = 0;
};

class BpeModel {
 public:
  // `byte_level`: words arrive as raw bytes that the ByteLevel pre-tokenizer maps to GPT-2's byte
  // characters, so the vocabulary is matched on the bytes those characters stand for.
  static BpeModel from_json(const nlohmann::json& model, bool byte_level, const std::string& where);

  // Exclusive use of the model's word cache for one encode call, or none when another thread
  // holds it (encoding then just does the merges itself: the ids are the same either way).
  class CacheLease {
   public:
    explicit CacheLease(const BpeModel& model);
    WordCache* cache() const { return lock_.owns_lock() ? cache_ : nullptr; }

   private:
    std::unique_lock<std::mutex> lock_;
    WordCache* cache_;
  };

  // Appends the ids of one pre-tokenized word (non-empty, well-formed UTF-8 unless byte-level).
  void encode_word(std::string_view word, std::vector<int32_t>& ids, WordCache* cache) const;

  // Tokens as tokenizer.json spells them.
  std::optional<int32_t> token_to_id(std::string_view token) const;
  const std::string* id_to_token(int32_t id) const;
  // One past the largest id in the vocabulary.
  int32_t id_limit() const { return static_cast<int32_t>(tokens_.size()); }
  // Number of tokens in the vocabulary.
  int32_t vocab_count() const { return static_cast<int32_t>(vocab_.size()); }

  BpeModel(BpeModel&& other) noexcept;
  BpeModel& operator=(BpeModel&&) = delete;

 private:
  BpeModel() = default;

  // Open-addressing hash map keyed by a pair of 32-bit values.
  template <typename Value>
  class PairMap {
   public:
    void reserve(size_t count);
    void insert_or_assign(uint32_t first, uint32_t second, Value value);
    const Value* find(uint32_t first, uint32_t second) const;

   private:
    struct Slot {
      uint64_t key;
      Value value;
    };
    static constexpr uint64_t kEmpty = ~uint64_t{0};
    size_t slot_of(uint64_t key) const;
    std::vector<Slot> slots_;
    size_t count_ = 0;
  };
  struct Merge {
    uint32_t rank;
    int32_t merged_id;
  };

  void encode_piece(std::string_view piece, std::vector<int32_t>& ids, WordCache* cache) const;
  void merge_word(std::string_view word, std::vector<int32_t>& ids) const;
  void initial_symbols(std::string_view word, std::vector<int32_t>& symbol_ids) const;
  bool can_split_between(char32_t left, char32_t right) const;

  std::vector<std::string> tokens_;  // id -> token as spelled in tokenizer.json ("" where unused)
  std::vector<bool> token_present_;
  StringMap<int32_t> vocab_;        // token as spelled in tokenizer.json -> id
  StringMap<int32_t> unit_vocab_;   // byte-level models only: token as raw bytes -> id
  PairMap<Merge> merges_;           // (left id, right id) -> the merge
  PairMap<int32_t> character_ids_;  // (code point, 0) -> id of the one-character token
  bool byte_level_ = false;
  bool byte_fallback_ = false;
  bool fuse_unknown_ = false;
  bool ignore_merges_ = false;
  std::optional<int32_t> unknown_id_;
  std::array<int32_t, 256> byte_fallback_ids_{};  // id of <0xXX> or -1
  std::array<int32_t, 128> single_unit_ids_{};    // id of a one-byte unit (ASCII, or a byte when byte-level) or -1
  std::array<int32_t, 128> high_byte_ids_{};      // byte-level: id of the units 0x80..0xFF or -1
  // Character pairs (last character of a merge's left token, first of its right token): no merge
  // can join two symbols across a boundary whose pair is absent.
  PairMap<bool> merge_boundaries_;

  mutable std::mutex cache_mutex_;
  std::unique_ptr<WordCache> cache_ = std::make_unique<WordCache>();
};

}  // namespace kiln

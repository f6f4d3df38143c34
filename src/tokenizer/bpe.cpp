#include "tokenizer/bpe.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace kiln {

namespace {

// Hugging Face caches words up to this many bytes (models/bpe/model.rs MAX_LENGTH).
constexpr size_t kMaxCachedWordBytes = 256;
// Enough distinct words for long documents; the cache is emptied when it fills.
constexpr size_t kMaxCachedWords = size_t{1} << 16;
constexpr size_t kCacheSlots = kMaxCachedWords * 2;
// Words at least this long are cut at boundaries no merge can cross before merging (SentencePiece-
// style models have no pre-tokenizer, so their "word" is a whole span of text).
constexpr size_t kSplitWordBytes = 32;

// A token spelled in GPT-2 byte characters -> the raw bytes, or nothing when some character is
// not one of the 256 byte characters (such a token can never come out of a byte-level word).
std::optional<std::string> byte_level_bytes(std::string_view token) {
  std::string bytes;
  size_t offset = 0;
  while (offset < token.size()) {
    const auto byte = unicode::char_to_byte(unicode::next_code_point(token, offset));
    if (!byte) return std::nullopt;
    bytes.push_back(static_cast<char>(*byte));
  }
  return bytes;
}

uint64_t mix(uint64_t key) {
  // The 64-bit finalizer of MurmurHash3.
  key ^= key >> 33;
  key *= 0xff51afd7ed558ccdULL;
  key ^= key >> 33;
  key *= 0xc4ceb9fe1a85ec53ULL;
  key ^= key >> 33;
  return key;
}

uint64_t hash_bytes(std::string_view text) {
  uint64_t hash = 0x9E3779B97F4A7C15ULL ^ text.size();
  size_t offset = 0;
  for (; offset + 8 <= text.size(); offset += 8) {
    uint64_t chunk;
    std::memcpy(&chunk, text.data() + offset, 8);
    hash = mix(hash ^ chunk);
  }
  if (offset < text.size()) {
    uint64_t chunk = 0;
    std::memcpy(&chunk, text.data() + offset, text.size() - offset);
    hash = mix(hash ^ chunk);
  }
  return hash | 1;  // 0 marks an empty slot
}

}  // namespace

WordCache::WordCache() : slots_(kCacheSlots, Slot{}) {}

bool WordCache::find(std::string_view word, std::vector<int32_t>& ids) const {
  const uint64_t hash = hash_bytes(word);
  for (size_t slot = hash & (kCacheSlots - 1);; slot = (slot + 1) & (kCacheSlots - 1)) {
    const Slot& entry = slots_[slot];
    if (entry.hash == 0) return false;
    if (entry.hash == hash && std::string_view(keys_).substr(entry.key_offset, entry.key_length) == word) {
      ids.insert(ids.end(), ids_.begin() + entry.ids_offset, ids_.begin() + entry.ids_offset + entry.ids_count);
      return true;
    }
  }
}

void WordCache::insert(std::string_view word, std::span<const int32_t> ids) {
  if (count_ == kMaxCachedWords) {
    std::fill(slots_.begin(), slots_.end(), Slot{});
    keys_.clear();
    ids_.clear();
    count_ = 0;
  }
  const uint64_t hash = hash_bytes(word);
  size_t slot = hash & (kCacheSlots - 1);
  while (slots_[slot].hash != 0) slot = (slot + 1) & (kCacheSlots - 1);
  slots_[slot] = Slot{hash, static_cast<uint32_t>(keys_.size()), static_cast<uint32_t>(word.size()),
                      static_cast<uint32_t>(ids_.size()), static_cast<uint32_t>(ids.size())};
  keys_.append(word);
  ids_.insert(ids_.end(), ids.begin(), ids.end());
  ++count_;
}

BpeModel::CacheLease::CacheLease(const BpeModel& model)
    : lock_(model.cache_mutex_, std::try_to_lock), cache_(model.cache_.get()) {}

template <typename Value>
void BpeModel::PairMap<Value>::reserve(size_t count) {
  size_t capacity = 16;
  while (capacity < count * 2) capacity *= 2;
  slots_.assign(capacity, Slot{kEmpty, {}});
}

template <typename Value>
size_t BpeModel::PairMap<Value>::slot_of(uint64_t key) const {
  const size_t mask = slots_.size() - 1;
  size_t slot = mix(key) & mask;
  while (slots_[slot].key != kEmpty && slots_[slot].key != key) slot = (slot + 1) & mask;
  return slot;
}

template <typename Value>
void BpeModel::PairMap<Value>::insert_or_assign(uint32_t first, uint32_t second, Value value) {
  if (slots_.empty() || (count_ + 1) * 2 > slots_.size()) {
    // Grow keeping at most half the slots full.
    std::vector<Slot> old = std::move(slots_);
    reserve(std::max<size_t>(count_ + 1, old.size()));
    for (const Slot& slot : old)
      if (slot.key != kEmpty) slots_[slot_of(slot.key)] = slot;
  }
  const uint64_t key = (uint64_t{first} << 32) | second;
  Slot& slot = slots_[slot_of(key)];
  if (slot.key == kEmpty) ++count_;
  slot = Slot{key, value};
}

template <typename Value>
const Value* BpeModel::PairMap<Value>::find(uint32_t first, uint32_t second) const {
  if (slots_.empty()) return nullptr;
  const Slot& slot = slots_[slot_of((uint64_t{first} << 32) | second)];
  return slot.key == kEmpty ? nullptr : &slot.value;
}

BpeModel::BpeModel(BpeModel&& other) noexcept
    : tokens_(std::move(other.tokens_)),
      token_present_(std::move(other.token_present_)),
      vocab_(std::move(other.vocab_)),
      unit_vocab_(std::move(other.unit_vocab_)),
      merges_(std::move(other.merges_)),
      character_ids_(std::move(other.character_ids_)),
      byte_level_(other.byte_level_),
      byte_fallback_(other.byte_fallback_),
      fuse_unknown_(other.fuse_unknown_),
      ignore_merges_(other.ignore_merges_),
      unknown_id_(other.unknown_id_),
      byte_fallback_ids_(other.byte_fallback_ids_),
      single_unit_ids_(other.single_unit_ids_),
      high_byte_ids_(other.high_byte_ids_),
      merge_boundaries_(std::move(other.merge_boundaries_)),
      cache_(std::move(other.cache_)) {}

BpeModel BpeModel::from_json(const nlohmann::json& model, bool byte_level, const std::string& where) {
  if (!model.is_object()) fail("{}: \"model\" must be an object", where);
  const std::string type = model.value("type", std::string("BPE"));
  if (type != "BPE") fail("{}: model type \"{}\" is not supported (only BPE)", where, type);
  if (!model.contains("vocab") || !model["vocab"].is_object()) fail("{}: model.vocab must be an object", where);
  if (!model.contains("merges") || !model["merges"].is_array()) fail("{}: model.merges must be a list", where);
  auto optional_string = [&](const char* field) -> std::optional<std::string> {
    if (!model.contains(field) || model[field].is_null()) return std::nullopt;
    if (!model[field].is_string()) fail("{}: model.{} must be a string or null", where, field);
    return model[field].get<std::string>();
  };
  auto flag = [&](const char* field) {
    if (!model.contains(field) || model[field].is_null()) return false;
    if (!model[field].is_boolean()) fail("{}: model.{} must be true or false", where, field);
    return model[field].get<bool>();
  };
  for (const char* affix : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const auto value = optional_string(affix);
    if (value && !value->empty()) fail("{}: model.{} \"{}\" is not supported", where, affix, *value);
  }
  if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() != 0.0)
    fail("{}: model.dropout is not supported (encoding must be deterministic)", where);

  BpeModel bpe;
  bpe.byte_level_ = byte_level;
  bpe.byte_fallback_ = flag("byte_fallback");
  bpe.fuse_unknown_ = flag("fuse_unk");
  bpe.ignore_merges_ = flag("ignore_merges");

  const auto& vocab = model["vocab"];
  bpe.vocab_.reserve(vocab.size());
  int32_t limit = 0;
  for (const auto& [token, id_json] : vocab.items()) {
    if (!id_json.is_number_integer() || id_json.get<int64_t>() < 0 || id_json.get<int64_t>() >= kMaxTokenIds)
      fail("{}: model.vocab[\"{}\"] must be an integer id from 0 to {}, not {}", where, token, kMaxTokenIds - 1,
           id_json.dump());
    const auto id = id_json.get<int32_t>();
    bpe.vocab_[token] = id;
    limit = std::max(limit, id + 1);
  }
  bpe.tokens_.assign(limit, std::string());
  bpe.token_present_.assign(limit, false);
  for (const auto& [token, id] : bpe.vocab_) {
    bpe.tokens_[id] = token;
    bpe.token_present_[id] = true;
    if (byte_level) {
      if (auto bytes = byte_level_bytes(token)) bpe.unit_vocab_.emplace(std::move(*bytes), id);
    } else {
      size_t offset = 0;
      const char32_t character = unicode::next_code_point(token, offset);
      if (offset == token.size()) bpe.character_ids_.insert_or_assign(character, 0, id);
    }
  }
  const StringMap<int32_t>& units = byte_level ? bpe.unit_vocab_ : bpe.vocab_;
  auto unit_id = [&](std::string_view unit) -> int32_t {
    const auto found = units.find(unit);
    return found == units.end() ? -1 : found->second;
  };
  for (int byte = 0; byte < 128; ++byte) bpe.single_unit_ids_[byte] = unit_id(std::string(1, static_cast<char>(byte)));
  for (int byte = 128; byte < 256; ++byte)
    bpe.high_byte_ids_[byte - 128] = byte_level ? unit_id(std::string(1, static_cast<char>(byte))) : -1;
  for (int byte = 0; byte < 256; ++byte) {
    const auto found = bpe.vocab_.find(fmt::format("<0x{:02X}>", byte));
    bpe.byte_fallback_ids_[byte] = found == bpe.vocab_.end() ? -1 : found->second;
  }
  if (const auto unknown = optional_string("unk_token")) {
    const auto found = bpe.vocab_.find(*unknown);
    if (found == bpe.vocab_.end()) fail("{}: model.unk_token \"{}\" is not in the vocabulary", where, *unknown);
    bpe.unknown_id_ = found->second;
  }

  // Merges are "left right" strings or [left, right] pairs; the rank is the position in the list,
  // and a pair listed twice keeps its last rank, as Hugging Face's map construction does.
  const auto& merges = model["merges"];
  bpe.merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& merge = merges[rank];
    std::string left, right;
    if (merge.is_string()) {
      const std::string text = merge;
      const size_t space = text.find(' ', 1);
      if (space == std::string::npos) fail("{}: model.merges[{}] \"{}\" is not two tokens", where, rank, text);
      left = text.substr(0, space);
      right = text.substr(space + 1);
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
      left = merge[0];
      right = merge[1];
    } else {
      fail("{}: model.merges[{}] must be \"a b\" or [\"a\", \"b\"]", where, rank);
    }
    const auto left_id = bpe.vocab_.find(left), right_id = bpe.vocab_.find(right),
               merged_id = bpe.vocab_.find(left + right);
    if (left_id == bpe.vocab_.end() || right_id == bpe.vocab_.end() || merged_id == bpe.vocab_.end())
      fail("{}: model.merges[{}] (\"{}\", \"{}\") uses a token that is not in the vocabulary", where, rank, left,
           right);
    bpe.merges_.insert_or_assign(static_cast<uint32_t>(left_id->second), static_cast<uint32_t>(right_id->second),
                                 Merge{static_cast<uint32_t>(rank), merged_id->second});
    if (!byte_level) {
      size_t last = left.size() - 1;
      while (last > 0 && (static_cast<unsigned char>(left[last]) & 0xC0) == 0x80) --last;
      size_t first = 0;
      const char32_t left_character = unicode::next_code_point(left, last);
      const char32_t right_character = unicode::next_code_point(right, first);
      bpe.merge_boundaries_.insert_or_assign(left_character, right_character, true);
    }
  }
  return bpe;
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  const auto found = vocab_.find(token);
  if (found == vocab_.end()) return std::nullopt;
  return found->second;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  if (id < 0 || id >= id_limit() || !token_present_[id]) return nullptr;
  return &tokens_[id];
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& ids, WordCache* cache) const {
  if (ignore_merges_) {
    const StringMap<int32_t>& units = byte_level_ ? unit_vocab_ : vocab_;
    if (const auto found = units.find(word); found != units.end()) {
      ids.push_back(found->second);
      return;
    }
  }
  if (byte_level_ || word.size() < kSplitWordBytes) {
    encode_piece(word, ids, cache);
    return;
  }
  // Merges only join adjacent symbols, so between two characters that are each a token and that
  // no merge joins (no merge's left token ends with the first while its right token starts with
  // the second) the word falls apart into pieces that merge independently: the ids are the same,
  // and the pieces are short enough to cache.
  size_t piece_begin = 0, offset = 0;
  char32_t previous = 0;
  bool previous_is_token = false;
  while (offset < word.size()) {
    const size_t character_begin = offset;
    const char32_t character = unicode::next_code_point(word, offset);
    const bool is_token = character_ids_.find(character, 0) != nullptr;
    if (previous_is_token && is_token && can_split_between(previous, character)) {
      encode_piece(word.substr(piece_begin, character_begin - piece_begin), ids, cache);
      piece_begin = character_begin;
    }
    previous = character;
    previous_is_token = is_token;
  }
  encode_piece(word.substr(piece_begin), ids, cache);
}

bool BpeModel::can_split_between(char32_t left, char32_t right) const {
  return merge_boundaries_.find(left, right) == nullptr;
}

void BpeModel::encode_piece(std::string_view piece, std::vector<int32_t>& ids, WordCache* cache) const {
  const bool cacheable = cache && piece.size() < kMaxCachedWordBytes;
  if (cacheable && cache->find(piece, ids)) return;
  const size_t first = ids.size();
  merge_word(piece, ids);
  if (cacheable) cache->insert(piece, std::span<const int32_t>(ids).subspan(first));
}

void BpeModel::initial_symbols(std::string_view word, std::vector<int32_t>& symbol_ids) const {
  // The word's units are bytes for byte-level models and characters otherwise. A unit outside the
  // vocabulary becomes its <0xXX> byte tokens when the model has them all, else the unknown token
  // (one per run of unknown units when fuse_unk); both then take part in merges like any symbol.
  // This follows models/bpe/model.rs merge_word, including where a pending unknown token lands.
  int32_t pending_unknown = -1;
  size_t offset = 0;
  while (offset < word.size()) {
    const auto lead = static_cast<unsigned char>(word[offset]);
    size_t length = 1;
    int32_t id = -1;
    if (byte_level_) {
      id = lead < 128 ? single_unit_ids_[lead] : high_byte_ids_[lead - 128];
    } else if (lead < 128) {
      id = single_unit_ids_[lead];
    } else {
      size_t next = offset;
      const char32_t character = unicode::next_code_point(word, next);
      length = next - offset;
      if (const int32_t* found = character_ids_.find(character, 0)) id = *found;
    }
    const std::string_view unit = word.substr(offset, length);
    offset += length;
    if (id >= 0) {
      if (pending_unknown >= 0) symbol_ids.push_back(pending_unknown);
      pending_unknown = -1;
      symbol_ids.push_back(id);
      continue;
    }
    if (byte_fallback_ && std::all_of(unit.begin(), unit.end(), [&](char byte) {
          return byte_fallback_ids_[static_cast<unsigned char>(byte)] >= 0;
        })) {
      for (char byte : unit) symbol_ids.push_back(byte_fallback_ids_[static_cast<unsigned char>(byte)]);
      continue;
    }
    // Without an unknown token Hugging Face drops the unit; kiln's ids must equal its ids.
    if (!unknown_id_) continue;
    if (pending_unknown >= 0 && !fuse_unknown_) symbol_ids.push_back(pending_unknown);
    pending_unknown = *unknown_id_;
  }
  if (pending_unknown >= 0) symbol_ids.push_back(pending_unknown);
}

void BpeModel::merge_word(std::string_view word, std::vector<int32_t>& ids) const {
  struct Symbol {
    int32_t id;
    int32_t previous, next;  // indices into symbols, -1 at the ends
    bool alive;
  };
  struct Candidate {
    uint32_t rank;
    int32_t position;
    int32_t left_id, right_id;  // the pair as it was when queued
    int32_t merged_id;
    // Orders the heap so that the lowest rank, then the leftmost position, comes out first.
    bool operator<(const Candidate& other) const {
      return rank != other.rank ? rank > other.rank : position > other.position;
    }
  };
  thread_local std::vector<int32_t> symbol_ids;
  thread_local std::vector<Symbol> symbols;
  thread_local std::vector<Candidate> heap;
  symbol_ids.clear();
  symbols.clear();
  heap.clear();
  initial_symbols(word, symbol_ids);

  const auto count = static_cast<int32_t>(symbol_ids.size());
  for (int32_t i = 0; i < count; ++i) symbols.push_back({symbol_ids[i], i - 1, i + 1 < count ? i + 1 : -1, true});
  auto queue_pair = [&](int32_t position, int32_t left_id, int32_t right_id) {
    if (const auto* merge = merges_.find(left_id, right_id)) {
      heap.push_back({merge->rank, position, left_id, right_id, merge->merged_id});
      std::push_heap(heap.begin(), heap.end());
    }
  };
  for (int32_t i = 0; i + 1 < count; ++i) queue_pair(i, symbols[i].id, symbols[i + 1].id);

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    const Candidate top = heap.back();
    heap.pop_back();
    Symbol& left = symbols[top.position];
    if (!left.alive || left.next < 0) continue;
    // Skip entries made stale by an earlier merge of either symbol. (Hugging Face compares the
    // merged token instead; a symbol only grows to the right, so the two tests agree.)
    if (left.id != top.left_id || symbols[left.next].id != top.right_id) continue;
    const int32_t right_index = left.next;
    const Symbol& right = symbols[right_index];
    left.id = top.merged_id;
    left.next = right.next;
    symbols[right_index].alive = false;
    if (left.next >= 0) symbols[left.next].previous = top.position;
    if (left.previous >= 0) queue_pair(left.previous, symbols[left.previous].id, left.id);
    if (left.next >= 0) queue_pair(top.position, left.id, symbols[left.next].id);
  }
  for (int32_t i = 0; i >= 0 && i < count; i = symbols[i].next) ids.push_back(symbols[i].id);
}

}  // namespace kiln

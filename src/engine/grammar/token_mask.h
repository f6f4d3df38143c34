// Which tokens a grammar allows next: the vocabulary as a trie of byte strings, a grammar compiled
// against it, and a per-request matcher that follows the generated tokens and fills the mask of
// the next step.
//
// Compiling does what XGrammar does for context-independent tokens: for every byte-set position
// of the grammar (every possible stack top) the vocabulary trie is walked once from a stack holding
// only that position, so shared prefixes are walked once and a dead prefix prunes its subtree.
// A token whose bytes all match before that stack empties is accepted from the position in any
// context; one that dies first is rejected in any context; one that empties the stack with bytes
// left over depends on what lies below, and only its leftover bytes are kept, in a small trie of
// their own. At run time the mask of a state is, for each of its stacks, the position's accepted
// set plus the leftovers that the rest of that stack accepts (a walk of the small trie), so a
// step costs a few bitset ORs and a walk over the few tokens that can close the current rule.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/grammar/grammar.h"
#include "engine/grammar/stack_machine.h"

namespace kiln::grammar {

// Byte strings with token ids, as a trie stored in preorder: a node's subtree is the nodes up to
// subtree_end, so a walk skips a dead prefix's whole subtree with one jump.
class TokenTrie {
 public:
  struct Entry {
    std::string_view bytes;  // not empty
    int32_t id;
  };
  explicit TokenTrie(std::vector<Entry> entries);

  size_t nodes() const { return byte_.size(); }  // node 0 is the root (no byte)
  uint8_t byte(size_t node) const { return byte_[node]; }
  size_t depth(size_t node) const { return depth_[node]; }
  size_t subtree_end(size_t node) const { return subtree_end_[node]; }
  // The ids whose bytes end at this node.
  std::span<const int32_t> ids(size_t node) const {
    return std::span<const int32_t>(ids_).subspan(ids_begin_[node], ids_end_[node] - ids_begin_[node]);
  }
  size_t max_depth() const { return max_depth_; }

 private:
  std::vector<uint8_t> byte_;
  std::vector<uint32_t> depth_, subtree_end_, ids_begin_, ids_end_;
  std::vector<int32_t> ids_;
  size_t max_depth_ = 0;
};

// A model's vocabulary as bytes: what each token id adds to the text. An empty string marks a token
// that never belongs to constrained output (special tokens, ids past the tokenizer); end-of-text
// ids are allowed separately, where the grammar can end.
class TokenVocabulary {
 public:
  explicit TokenVocabulary(std::vector<std::string> token_bytes);
  int32_t size() const { return static_cast<int32_t>(bytes_.size()); }
  const std::string& bytes(int32_t id) const { return bytes_[id]; }
  const TokenTrie& trie() const { return *trie_; }

 private:
  std::vector<std::string> bytes_;
  std::unique_ptr<TokenTrie> trie_;
};

// A mask over the vocabulary: bit id of word id / 64.
using TokenMask = std::vector<uint64_t>;
inline TokenMask empty_mask(int32_t vocab_size) { return TokenMask((static_cast<size_t>(vocab_size) + 63) / 64, 0); }
inline bool mask_allows(std::span<const uint64_t> mask, int32_t id) { return (mask[id >> 6] >> (id & 63)) & 1; }

class CompiledGrammar {
 public:
  // Checks the grammar (Grammar::check) and precomputes each position's tokens.
  CompiledGrammar(Grammar grammar, std::shared_ptr<const TokenVocabulary> vocabulary);
  ~CompiledGrammar();

  const Grammar& grammar() const { return grammar_; }
  const TokenVocabulary& vocabulary() const { return *vocabulary_; }

  // What a stack topped by a byte-set position allows (see the file comment).
  struct PositionTokens {
    std::vector<uint64_t> accepted_bits;        // a mask, when many are accepted
    std::vector<int32_t> accepted_ids;          // else the ids
    std::unique_ptr<TokenTrie> leftovers;       // bytes left when the stack emptied (null: none)
  };
  const PositionTokens& position_tokens(int32_t position) const { return *positions_[position]; }

 private:
  Grammar grammar_;
  std::shared_ptr<const TokenVocabulary> vocabulary_;
  std::vector<std::unique_ptr<PositionTokens>> positions_;  // null where the symbol is not a byte set
};

// One request's position in its grammar.
class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar);

  // Advances over a token's bytes; false (and no change) when the grammar does not allow them.
  bool accept_token(int32_t id);
  bool accept_bytes(std::string_view bytes);
  // Sets the bit of every token that may come next (end-of-text ids are the caller's: allowed
  // where can_end()). `mask` has a bit per vocabulary id.
  void fill_mask(std::span<uint64_t> mask);
  // The grammar has matched a whole sentence.
  bool can_end() const { return machine_->can_end(state_); }
  // More bytes may follow.
  bool can_continue() const { return machine_->can_continue(state_); }

 private:
  void restart_machine();

  std::shared_ptr<const CompiledGrammar> grammar_;
  std::unique_ptr<StackMachine> machine_;
  int32_t state_ = StackMachine::kDeadState;
  std::vector<int32_t> walk_states_;  // per trie depth, reused by fill_mask
};

}  // namespace kiln::grammar

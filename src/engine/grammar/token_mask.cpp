#include "engine/grammar/token_mask.h"

#include <algorithm>

#include "core/error.h"

namespace kiln::grammar {

TokenTrie::TokenTrie(std::vector<Entry> entries) {
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.bytes < b.bytes || (a.bytes == b.bytes && a.id < b.id);
  });
  auto add_node = [&](uint8_t byte, size_t depth) {
    byte_.push_back(byte);
    depth_.push_back(static_cast<uint32_t>(depth));
    subtree_end_.push_back(0);
    ids_begin_.push_back(static_cast<uint32_t>(ids_.size()));
    ids_end_.push_back(static_cast<uint32_t>(ids_.size()));
    max_depth_ = std::max(max_depth_, depth);
  };
  add_node(0, 0);
  // The open path from the root: path[d] is the node at depth d of the previous entry.
  std::vector<uint32_t> path = {0};
  std::string_view previous;
  for (const Entry& entry : entries) {
    size_t common = 0;
    while (common < previous.size() && common < entry.bytes.size() && previous[common] == entry.bytes[common]) ++common;
    while (path.size() > common + 1) {
      subtree_end_[path.back()] = static_cast<uint32_t>(byte_.size());
      path.pop_back();
    }
    for (size_t depth = common; depth < entry.bytes.size(); ++depth) {
      add_node(static_cast<uint8_t>(entry.bytes[depth]), depth + 1);
      path.push_back(static_cast<uint32_t>(byte_.size() - 1));
    }
    // Sorted entries end at the newest node: a prefix sorts before its extensions.
    ids_.push_back(entry.id);
    ids_end_[path.back()] = static_cast<uint32_t>(ids_.size());
    previous = entry.bytes;
  }
  for (uint32_t node : path) subtree_end_[node] = static_cast<uint32_t>(byte_.size());
}

TokenVocabulary::TokenVocabulary(std::vector<std::string> token_bytes) : bytes_(std::move(token_bytes)) {
  std::vector<TokenTrie::Entry> entries;
  for (size_t id = 0; id < bytes_.size(); ++id)
    if (!bytes_[id].empty()) entries.push_back({bytes_[id], static_cast<int32_t>(id)});
  trie_ = std::make_unique<TokenTrie>(std::move(entries));
}

namespace {

// Walks `trie` from `start`, calling visit(node, state) at every node whose bytes the machine
// accepts, and descending below it while the state can take more bytes.
template <class Visit>
void walk(const TokenTrie& trie, StackMachine& machine, int32_t start, std::vector<int32_t>& states, Visit visit) {
  states.assign(trie.max_depth() + 1, StackMachine::kDeadState);
  states[0] = start;
  for (size_t node = 1; node < trie.nodes();) {
    const size_t depth = trie.depth(node);
    const int32_t state = machine.step(states[depth - 1], trie.byte(node));
    if (state == StackMachine::kDeadState) {
      node = trie.subtree_end(node);
      continue;
    }
    states[depth] = state;
    visit(node, state);
    node = machine.can_continue(state) ? node + 1 : trie.subtree_end(node);
  }
}

void set_bits(std::span<uint64_t> mask, std::span<const int32_t> ids) {
  for (int32_t id : ids) mask[id >> 6] |= uint64_t{1} << (id & 63);
}

}  // namespace

CompiledGrammar::CompiledGrammar(Grammar grammar, std::shared_ptr<const TokenVocabulary> vocabulary)
    : grammar_(std::move(grammar)), vocabulary_(std::move(vocabulary)), positions_(grammar_.positions()) {
  grammar_.check();
  const TokenTrie& trie = vocabulary_->trie();
  // A stack holding one position empties when the position's alternative (and every alternative it
  // returns to within that stack) has matched: whatever follows belongs to the caller's context.
  StackMachine machine(grammar_);
  std::vector<int32_t> states;
  for (size_t position = 0; position < grammar_.positions(); ++position) {
    if (grammar_.at(static_cast<int32_t>(position)).kind != Symbol::Kind::Bytes) continue;
    auto tokens = std::make_unique<PositionTokens>();
    std::vector<int32_t> accepted;
    std::vector<TokenTrie::Entry> leftovers;
    const int32_t start = machine.state_of({machine.push(StackMachine::kEmptyStack, static_cast<int32_t>(position))});
    walk(trie, machine, start, states, [&](size_t node, int32_t state) {
      const auto ids = trie.ids(node);
      accepted.insert(accepted.end(), ids.begin(), ids.end());
      if (!machine.can_end(state)) return;
      const size_t depth = trie.depth(node);
      for (size_t below = node + 1; below < trie.subtree_end(node); ++below)
        for (int32_t id : trie.ids(below))
          leftovers.push_back({std::string_view(vocabulary_->bytes(id)).substr(depth), id});
    });
    if (accepted.size() * 64 > static_cast<size_t>(vocabulary_->size())) {
      tokens->accepted_bits = empty_mask(vocabulary_->size());
      set_bits(tokens->accepted_bits, accepted);
    } else {
      tokens->accepted_ids = std::move(accepted);
    }
    if (!leftovers.empty()) tokens->leftovers = std::make_unique<TokenTrie>(std::move(leftovers));
    positions_[position] = std::move(tokens);
  }
}

CompiledGrammar::~CompiledGrammar() = default;

GrammarMatcher::GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar)
    : grammar_(std::move(grammar)), machine_(std::make_unique<StackMachine>(grammar_->grammar())) {
  std::vector<int32_t> stacks;
  const Grammar& rules = grammar_->grammar();
  for (int32_t start : rules.alternatives(rules.root())) {
    const int32_t state = machine_->expand(machine_->push(StackMachine::kEmptyStack, start));
    const auto expanded = machine_->stacks(state);
    stacks.insert(stacks.end(), expanded.begin(), expanded.end());
  }
  state_ = machine_->state_of(std::move(stacks));
}

// The machine keeps every state it has seen (their transitions are its cache); a long generation
// would keep growing it, so past a bound it starts over from the current stacks.
void GrammarMatcher::restart_machine() {
  constexpr size_t kMaxStates = 4096;  // × 256 transitions × 4 bytes: 4 MiB
  if (machine_->state_count() < kMaxStates) return;
  std::vector<std::vector<int32_t>> stacks;
  for (int32_t stack : machine_->stacks(state_)) stacks.push_back(machine_->positions(stack));
  machine_ = std::make_unique<StackMachine>(grammar_->grammar());
  std::vector<int32_t> ids;
  for (const auto& positions : stacks) {
    int32_t stack = StackMachine::kEmptyStack;
    for (int32_t position : positions) stack = machine_->push(stack, position);
    ids.push_back(stack);
  }
  state_ = machine_->state_of(std::move(ids));
}

bool GrammarMatcher::accept_bytes(std::string_view bytes) {
  restart_machine();
  int32_t state = state_;
  for (char byte : bytes) {
    state = machine_->step(state, static_cast<uint8_t>(byte));
    if (state == StackMachine::kDeadState) return false;
  }
  state_ = state;
  return true;
}

bool GrammarMatcher::accept_token(int32_t id) {
  if (id < 0 || id >= grammar_->vocabulary().size()) return false;
  const std::string& bytes = grammar_->vocabulary().bytes(id);
  return !bytes.empty() && accept_bytes(bytes);
}

void GrammarMatcher::fill_mask(std::span<uint64_t> mask) {
  std::fill(mask.begin(), mask.end(), 0);
  const std::vector<int32_t> stacks(machine_->stacks(state_).begin(), machine_->stacks(state_).end());
  for (int32_t stack : stacks) {
    if (stack == StackMachine::kEmptyStack) continue;
    const CompiledGrammar::PositionTokens& tokens = grammar_->position_tokens(machine_->top(stack));
    for (size_t word = 0; word < tokens.accepted_bits.size(); ++word) mask[word] |= tokens.accepted_bits[word];
    set_bits(mask, tokens.accepted_ids);
    if (!tokens.leftovers) continue;
    const int32_t below = machine_->expand(machine_->pop(stack));
    if (!machine_->can_continue(below)) continue;
    walk(*tokens.leftovers, *machine_, below, walk_states_,
         [&](size_t node, int32_t) { set_bits(mask, tokens.leftovers->ids(node)); });
  }
}

}  // namespace kiln::grammar

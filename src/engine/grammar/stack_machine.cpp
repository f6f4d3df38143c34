#include "engine/grammar/stack_machine.h"

#include <algorithm>

namespace kiln::grammar {

StackMachine::StackMachine(const Grammar& grammar) : grammar_(grammar) { state_of({}); }

int32_t StackMachine::push(int32_t stack, int32_t position) {
  const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(stack)) << 32) | static_cast<uint32_t>(position);
  const auto [found, inserted] = node_index_.try_emplace(key, static_cast<int32_t>(nodes_.size()));
  if (inserted) nodes_.push_back({position, stack});
  return found->second;
}

std::vector<int32_t> StackMachine::positions(int32_t stack) const {
  std::vector<int32_t> result;
  for (; stack != kEmptyStack; stack = pop(stack)) result.push_back(top(stack));
  std::reverse(result.begin(), result.end());
  return result;
}

void StackMachine::expand_into(int32_t stack, std::vector<int32_t>& out) {
  if (stack == kEmptyStack) {
    out.push_back(stack);
    return;
  }
  const int32_t position = top(stack);
  const Symbol& symbol = grammar_.at(position);
  switch (symbol.kind) {
    case Symbol::Kind::Bytes:
      out.push_back(stack);
      return;
    case Symbol::Kind::End:
      expand_into(pop(stack), out);
      return;
    case Symbol::Kind::Rule: {
      int32_t below = pop(stack);
      if (grammar_.at(position + 1).kind != Symbol::Kind::End) below = push(below, position + 1);
      for (int32_t start : grammar_.alternatives(symbol.rule)) expand_into(push(below, start), out);
      return;
    }
  }
}

int32_t StackMachine::expand(int32_t stack) {
  std::vector<int32_t> stacks;
  expand_into(stack, stacks);
  return state_of(std::move(stacks));
}

size_t StackMachine::StacksHash::operator()(const std::vector<int32_t>& stacks) const {
  uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a over the ids
  for (int32_t stack : stacks) hash = (hash ^ static_cast<uint32_t>(stack)) * 0x100000001b3ull;
  return hash;
}

int32_t StackMachine::state_of(std::vector<int32_t> stacks) {
  std::sort(stacks.begin(), stacks.end());
  stacks.erase(std::unique(stacks.begin(), stacks.end()), stacks.end());
  if (const auto found = state_index_.find(stacks); found != state_index_.end()) return found->second;
  const auto id = static_cast<int32_t>(states_.size());
  State state;
  state.can_end = !stacks.empty() && stacks.front() == kEmptyStack;
  state.can_continue = !stacks.empty() && stacks.back() != kEmptyStack;
  state.stacks = stacks;
  states_.push_back(std::move(state));
  state_index_.emplace(std::move(stacks), id);
  transitions_.resize(states_.size() * 256, -1);
  return id;
}

int32_t StackMachine::step(int32_t state, uint8_t byte) {
  const size_t slot = static_cast<size_t>(state) * 256 + byte;
  if (transitions_[slot] >= 0) return transitions_[slot];
  std::vector<int32_t> next;
  for (int32_t stack : states_[state].stacks) {
    if (stack == kEmptyStack) continue;
    const int32_t position = top(stack);
    if (grammar_.at(position).bytes.contains(byte)) expand_into(push(pop(stack), position + 1), next);
  }
  const int32_t result = state_of(std::move(next));
  transitions_[slot] = result;
  return result;
}

}  // namespace kiln::grammar

// The grammar's pushdown automaton, run over bytes. A stack holds positions in the grammar (the
// next symbol of each open alternative, innermost on top); after expansion every stack's top is a
// byte set, or the stack is empty (everything matched). A state is the set of stacks one input can
// leave (the grammar may be ambiguous), and a byte maps a state to the next: for each stack whose
// top admits the byte, the top moves on and the stack is expanded again (a finished alternative
// pops, a rule reference is replaced by its alternatives; a reference in last place is replaced
// rather than returned to, so loops written as tail recursion keep the stack flat).
//
// Stacks are hash-consed (equal stacks are one node, sharing their tails) and states interned, so
// a transition, once computed, is a table lookup: walking a vocabulary trie revisits the same few
// states (inside a JSON string every character leads back to the same one) at the cost of one read.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "engine/grammar/grammar.h"

namespace kiln::grammar {

class StackMachine {
 public:
  static constexpr int32_t kEmptyStack = -1;
  static constexpr int32_t kDeadState = 0;  // no stack: the input matched nothing

  // `grammar` must have passed check() and outlive the machine.
  explicit StackMachine(const Grammar& grammar);

  // The stack `stack` with `position` pushed on top.
  int32_t push(int32_t stack, int32_t position);
  int32_t top(int32_t stack) const { return nodes_[stack].position; }
  int32_t pop(int32_t stack) const { return nodes_[stack].below; }
  // A stack's positions, bottom first.
  std::vector<int32_t> positions(int32_t stack) const;

  // The state of the stacks `stack` expands to.
  int32_t expand(int32_t stack);
  // The state holding exactly these expanded stacks (any order, repeats allowed).
  int32_t state_of(std::vector<int32_t> stacks);
  // The state after `byte`, or kDeadState.
  int32_t step(int32_t state, uint8_t byte);

  std::span<const int32_t> stacks(int32_t state) const { return states_[state].stacks; }
  bool can_end(int32_t state) const { return states_[state].can_end; }
  bool can_continue(int32_t state) const { return states_[state].can_continue; }
  size_t state_count() const { return states_.size(); }

 private:
  struct Node {
    int32_t position;
    int32_t below;
  };
  struct State {
    std::vector<int32_t> stacks;  // sorted, distinct
    bool can_end = false;         // holds the empty stack
    bool can_continue = false;    // holds a stack that is not empty
  };
  struct StacksHash {
    size_t operator()(const std::vector<int32_t>& stacks) const;
  };

  void expand_into(int32_t stack, std::vector<int32_t>& out);

  const Grammar& grammar_;
  std::vector<Node> nodes_;
  std::unordered_map<uint64_t, int32_t> node_index_;
  std::vector<State> states_;
  std::unordered_map<std::vector<int32_t>, int32_t, StacksHash> state_index_;
  std::vector<int32_t> transitions_;  // state × 256 → state; -1 until computed
};

}  // namespace kiln::grammar

// Running a piece of work on a thread whose stack size is chosen, not inherited from RLIMIT_STACK:
// for work whose recursion is bounded by a budget measured against a known stack (the chat-template
// interpreter's, tokenizer/jinja_limits.h), and for checking that bound.
#pragma once

#include <cstddef>
#include <functional>

namespace kiln {

// Runs `work` on a new thread with a `stack_bytes` stack and waits for it; an exception `work`
// throws is rethrown here. A thread that cannot be started is a kiln::Error.
void run_with_stack(size_t stack_bytes, const std::function<void()>& work);

}  // namespace kiln

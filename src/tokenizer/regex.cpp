#include "tokenizer/regex.h"

#include <pcre2.h>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace kiln {

namespace {

// Per-thread matching state: one ovector pair is enough (only whole matches are used), and a JIT
// stack large enough for long runs of one character class in a pre-token.
struct ThreadMatchState {
  pcre2_match_data* match_data = pcre2_match_data_create(1, nullptr);
  pcre2_jit_stack* jit_stack = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr);
  pcre2_match_context* context = [this] {
    pcre2_match_context* created = pcre2_match_context_create(nullptr);
    pcre2_jit_stack_assign(created, nullptr, jit_stack);
    return created;
  }();
  ~ThreadMatchState() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_data_free(match_data);
  }
};

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof(buffer));
  return reinterpret_cast<const char*>(buffer);
}

}  // namespace

Regex::Regex(std::string_view pattern, std::string what) : what_(std::move(what)) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                        &error_code, &error_offset, nullptr);
  if (!code_) fail("{}: regex does not compile at offset {}: {}", what_, error_offset, pcre2_message(error_code));
  jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() {
  if (code_) pcre2_code_free(code_);
}

Regex::Regex(Regex&& other) noexcept : code_(other.code_), jit_(other.jit_), what_(std::move(other.what_)) {
  other.code_ = nullptr;
}

void Regex::for_each_match(std::string_view text, const std::function<void(size_t, size_t)>& on_match) const {
  thread_local ThreadMatchState state;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  while (start <= text.size()) {
    // The caller guarantees well-formed UTF-8, so PCRE2's own check is skipped.
    const int result =
        jit_ ? pcre2_jit_match(code_, subject, text.size(), start, PCRE2_NO_UTF_CHECK, state.match_data, state.context)
             : pcre2_match(code_, subject, text.size(), start, PCRE2_NO_UTF_CHECK, state.match_data, state.context);
    if (result == PCRE2_ERROR_NOMATCH) return;
    if (result < 0)
      fail("{}: regex matching failed on {} bytes of text: {}", what_, text.size(), pcre2_message(result));
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.match_data);
    const size_t begin = ovector[0], end = ovector[1];
    on_match(begin, end);
    if (end > begin) {
      start = end;
    } else if (end < text.size()) {
      const int length = unicode::utf8_sequence_length(static_cast<unsigned char>(text[end]));
      start = end + static_cast<size_t>(length > 0 ? length : 1);
    } else {
      return;
    }
  }
}

std::string Regex::escape(std::string_view literal) {
  std::string escaped;
  for (char c : literal) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) escaped.push_back('\\');
    escaped.push_back(c);
  }
  return escaped;
}

}  // namespace kiln

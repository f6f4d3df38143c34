// A compiled PCRE2 pattern in Unicode mode (UTF + UCP: \s, \w, \p{L} follow Unicode), JIT-compiled
// when the library supports it. Tokenizer split patterns written for Oniguruma (what Hugging Face
// tokenizers uses), lookahead included, run unchanged.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

struct pcre2_real_code_8;

namespace kiln {

class Regex {
 public:
  // `what` names the pattern's origin for error messages (file and field).
  Regex(std::string_view pattern, std::string what);
  ~Regex();
  Regex(Regex&& other) noexcept;
  Regex& operator=(Regex&&) = delete;
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Calls on_match(begin, end) for every successive non-overlapping match in well-formed UTF-8
  // text, leftmost first. After an empty match the search resumes one character later.
  void for_each_match(std::string_view text, const std::function<void(size_t, size_t)>& on_match) const;

  // A pattern matching `literal` exactly.
  static std::string escape(std::string_view literal);

 private:
  pcre2_real_code_8* code_ = nullptr;
  bool jit_ = false;
  std::string what_;
};

}  // namespace kiln

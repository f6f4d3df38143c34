// What the libFuzzer targets share: a scratch directory for the loaders that read files, the
// split of one input into two parts, and the rule for which exceptions are expected.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <utility>

namespace kiln::fuzz {

// The input as text (loaders take bytes as they come; nothing here assumes UTF-8).
inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// The bytes before the first NUL and those after it (empty when there is none). JSON text cannot
// hold a raw NUL byte, so it separates a JSON document from a second input without limiting either.
inline std::pair<std::string_view, std::string_view> split_at_nul(std::string_view input) {
  const size_t nul = input.find('\0');
  if (nul == std::string_view::npos) return {input, {}};
  return {input.substr(0, nul), input.substr(nul + 1)};
}

// A directory of this process's own (parallel workers of one target run side by side), under
// $TMPDIR, removed when the process exits normally. Loaders that take a path read from it.
class ScratchDirectory {
 public:
  static ScratchDirectory& instance() {
    static ScratchDirectory directory;
    return directory;
  }

  const std::filesystem::path& path() const { return path_; }

  // Writes `bytes` to `name` in the directory (replacing it) and returns its path.
  std::filesystem::path write(const std::string& name, std::string_view bytes) const {
    const std::filesystem::path file = path_ / name;
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) {
      std::fprintf(stderr, "fuzz: cannot write %s\n", file.c_str());
      std::abort();  // not a finding in kiln: the target cannot go on without its scratch files
    }
    return file;
  }

 private:
  ScratchDirectory() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/kiln-fuzz-XXXXXX";
    if (!::mkdtemp(pattern.data())) {
      std::perror("fuzz: mkdtemp");
      std::abort();
    }
    path_ = pattern;
  }
  ~ScratchDirectory() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }

  std::filesystem::path path_;
};

}  // namespace kiln::fuzz

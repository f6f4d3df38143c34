// What the libFuzzer targets share: a scratch directory for the loaders that read files, the
// split of one input into two parts, and the rule for which exceptions are expected.
#pragma once

#include <pthread.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <functional>
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

// Runs `work` on a thread with a 64 MiB stack and passes back its exception. kiln renders chat
// templates on threads of 8 MiB, and ASan's frames are about six times larger than Release's
// (tokenizer/jinja_limits.h measures both), so on the fuzzer's own 8 MiB stack a render within the
// interpreter's depth limits could overflow here and nowhere else. A stack overflow on 64 MiB is a
// finding: the limits do not bound the recursion.
inline void on_large_stack(const std::function<void()>& work) {
  struct Job {
    const std::function<void()>* work;
    std::exception_ptr error;
  } job{&work, nullptr};
  pthread_attr_t attributes;
  pthread_attr_init(&attributes);
  pthread_attr_setstacksize(&attributes, size_t{64} << 20);
  pthread_t thread;
  const int created = pthread_create(
      &thread, &attributes,
      [](void* argument) -> void* {
        auto* job = static_cast<Job*>(argument);
        try {
          (*job->work)();
        } catch (...) {
          job->error = std::current_exception();
        }
        return nullptr;
      },
      &job);
  pthread_attr_destroy(&attributes);
  if (created != 0) {
    std::fprintf(stderr, "fuzz: cannot start a thread (error %d)\n", created);
    std::abort();  // not a finding in kiln
  }
  pthread_join(thread, nullptr);
  if (job.error) std::rethrow_exception(job.error);
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

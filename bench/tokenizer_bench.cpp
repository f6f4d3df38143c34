// Encoding speed of kiln's tokenizer on one thread.
//   kiln_tokenizer_bench TOKENIZER_DIR_OR_JSON [TEXT_FILE...]
// Without text files it reads Debian's license texts (/usr/share/common-licenses, English prose
// of about 240 KB). Prints MB/s for the first pass (empty word cache) and for later passes, in
// the thread's CPU time.
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace {

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) kiln::fail("{}: cannot open", path.string());
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// CPU time of the calling thread: on a shared machine wall time also counts other processes.
double thread_seconds() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s TOKENIZER_DIR_OR_JSON [TEXT_FILE...]\n", argv[0]);
    return 2;
  }
  try {
    const kiln::Tokenizer tokenizer = kiln::Tokenizer::load(argv[1]);
    std::vector<std::filesystem::path> files(argv + 2, argv + argc);
    if (files.empty()) {
      for (const auto& entry : std::filesystem::directory_iterator("/usr/share/common-licenses"))
        if (entry.is_regular_file() && !entry.is_symlink()) files.push_back(entry.path());
      std::sort(files.begin(), files.end());
    }
    std::vector<std::string> documents;
    size_t total_bytes = 0;
    for (const auto& file : files) {
      documents.push_back(read_file(file));
      total_bytes += documents.back().size();
    }

    auto encode_all = [&] {
      size_t tokens = 0;
      for (const auto& document : documents) tokens += tokenizer.encode(document, false).size();
      return tokens;
    };
    double start = thread_seconds();
    const size_t tokens = encode_all();
    const double first_seconds = thread_seconds() - start;

    int passes = 0;
    start = thread_seconds();
    while (thread_seconds() - start < 2.0 || passes < 3) {
      encode_all();
      ++passes;
    }
    const double steady_seconds = (thread_seconds() - start) / passes;
    const double megabytes = static_cast<double>(total_bytes) / 1e6;
    std::printf("%s: %zu files, %.3f MB, %zu tokens (%.2f bytes/token)\n", tokenizer.source().string().c_str(),
                documents.size(), megabytes, tokens, static_cast<double>(total_bytes) / static_cast<double>(tokens));
    std::printf("first pass: %.1f MB/s; later passes: %.1f MB/s (1 thread, thread CPU time, %d passes)\n",
                megabytes / first_seconds, megabytes / steady_seconds, passes);
  } catch (const kiln::Error& error) {
    std::fprintf(stderr, "kiln_tokenizer_bench: %s\n", error.what());
    return 1;
  }
  return 0;
}

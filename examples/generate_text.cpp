// Continues a prompt with a model folder, streaming the text: kiln used as a library, built
// against the installed package (examples/CMakeLists.txt).
//   generate_text MODEL_DIR [PROMPT] [MAX_TOKENS]
#include <cstdio>
#include <exception>
#include <memory>
#include <string>

#include "backend/backend.h"
#include "text/text_model.h"

int main(int argc, char** argv) {
  if (argc < 2 || argc > 4) {
    std::fprintf(stderr, "usage: %s MODEL_DIR [PROMPT] [MAX_TOKENS]\n", argv[0]);
    return 2;
  }
  const std::string prompt = argc > 2 ? argv[2] : "Once upon a time";
  try {
    // The backend outlives the model built on it.
    std::unique_ptr<kiln::Backend> cpu = kiln::make_cpu_backend();
    kiln::TextModel model = kiln::TextModel::open(argv[1], *cpu);

    kiln::TextOptions options;
    options.max_tokens = argc > 3 ? std::stoll(argv[3]) : 64;
    options.sampling.temperature = 0;  // greedy: the same text every run
    std::printf("%s", prompt.c_str());
    const kiln::TextResult result = model.generate(prompt, options, [](std::string_view text) {
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
      return true;
    });
    std::printf("\n");
    std::fprintf(stderr, "%lld prompt tokens, %lld generated (%s)\n", static_cast<long long>(result.prompt_tokens),
                 static_cast<long long>(result.completion_tokens),
                 std::string(kiln::finish_reason_name(result.finish_reason)).c_str());
  } catch (const std::exception& error) {
    std::fprintf(stderr, "generate_text: %s\n", error.what());
    return 1;
  }
}

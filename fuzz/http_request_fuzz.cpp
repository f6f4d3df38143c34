// Bytes off a keep-alive connection: fed to the HTTP request reader (server/http_request_reader.h)
// in pieces of the sizes a network delivers, taking every complete request, until the reader
// fails or the bytes run out. The first input byte chooses the piece size, so the fuzzer explores
// how requests split across reads. The reader must keep its contract: it never takes more than it
// is given, a taken request stays within the limits, and a failure carries a 4xx/5xx status and a
// message.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "fuzz_support.h"
#include "server/http_request_reader.h"

namespace {

// Small limits, so that inputs of a few kilobytes reach them.
constexpr size_t kMaxHeaderBytes = 2048;
constexpr size_t kMaxBodyBytes = 4096;

[[noreturn]] void broken_contract(const char* what) {
  std::fprintf(stderr, "HttpRequestReader: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t piece_size = 1 + data[0] % 128;
  std::string_view rest = kiln::fuzz::as_text(data + 1, size - 1);
  kiln::server::HttpRequestReader reader(kMaxHeaderBytes, kMaxBodyBytes);
  // Bytes received but not yet taken: after a complete request they begin the next one.
  std::string pending;
  while (true) {
    const size_t arriving = std::min(piece_size, rest.size());
    pending.append(rest.substr(0, arriving));
    rest.remove_prefix(arriving);
    const size_t taken = reader.feed(pending);
    if (taken > pending.size()) broken_contract("feed() took more bytes than it was given");
    pending.erase(0, taken);
    if (reader.failed()) {
      if (reader.error_status() < 400 || reader.error_status() > 599) broken_contract("a failure without a 4xx/5xx status");
      if (reader.error_message().empty()) broken_contract("a failure without a message");
      return 0;
    }
    if (reader.complete()) {
      const kiln::server::HttpRequest request = reader.take();
      if (request.body.size() > kMaxBodyBytes) broken_contract("a request body over the limit");
      if (request.method.empty()) broken_contract("a request without a method");
      continue;
    }
    if (rest.empty() && taken == 0) return 0;  // an unfinished request at the end of the input
  }
}

// SHA-256 (FIPS 180-4), streaming. Used for config and artifact fingerprints; checked against
// the NIST example vectors in tests/fingerprint_test.cpp.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kiln {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t size);
  void update(std::string_view text) { update(text.data(), text.size()); }
  // The digest of everything passed to update(); the object must not be updated afterwards.
  std::array<uint8_t, 32> finish();
  // finish() as 64 lower-case hex digits.
  std::string finish_hex();

 private:
  void compress(const uint8_t* block);

  std::array<uint32_t, 8> state_;
  std::array<uint8_t, 64> block_{};
  size_t block_used_ = 0;
  uint64_t total_bytes_ = 0;
  bool finished_ = false;
};

// The hex digest of `text`.
std::string sha256_hex(std::string_view text);

}  // namespace kiln

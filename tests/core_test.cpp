#include <atomic>
#include <chrono>
#include <thread>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>
#include <cstring>

#include <gtest/gtest.h>

#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "core/thread_pool.h"
#include "core/thread_stack.h"
#include "core/weight.h"

using namespace kiln;

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1 + 2^-7: ties go to the even mantissa.
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(-2.5f)), -2.5f);
}

TEST(DType, F16RoundTripsEveryHalf) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    float value = f16_to_f32(static_cast<uint16_t>(bits));
    if (std::isnan(value)) continue;
    ASSERT_EQ(f32_to_f16(value), bits) << "f16 bits " << bits;
  }
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);  // rounds to infinity
}

TEST(DType, ParsesSafetensorsNames) {
  EXPECT_EQ(parse_dtype("BF16"), DType::BF16);
  EXPECT_EQ(parse_dtype("F32"), DType::F32);
  EXPECT_EQ(parse_dtype("F8_E4M3"), DType::F8E4M3);
  EXPECT_EQ(parse_dtype("U32"), DType::U32);
  EXPECT_FALSE(parse_dtype("F8_E5M2").has_value());
}

// e4m3fn: every finite code decodes exactly and rounds back to itself; values between codes
// round to the nearer (ties to the even code); out of range saturates at 448.
TEST(DType, Fp8E4m3RoundTripsEveryCode) {
  EXPECT_EQ(fp8_e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_e4m3_to_f32(0xb8), -1.0f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0x7f)));
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    const float value = fp8_e4m3_to_f32(static_cast<uint8_t>(code));
    if (code == 0x80) continue;  // -0 rounds to the code of -0 too; checked below
    EXPECT_EQ(f32_to_fp8_e4m3(value), code) << "code " << code;
  }
  EXPECT_EQ(f32_to_fp8_e4m3(-0.0f), 0x80);
  EXPECT_EQ(f32_to_fp8_e4m3(1.0625f), 0x38);  // halfway between 1 (0x38) and 1.125 (0x39): the even code
  EXPECT_EQ(f32_to_fp8_e4m3(1.1f), 0x39);
  EXPECT_EQ(f32_to_fp8_e4m3(1000.0f), 0x7e);
}

// MLX packs 3- and 6-bit codes into bytes, not words (mlx/backend/cpu/quantized.cpp, quantize():
// 8 three-bit codes into 3 bytes, 4 six-bit codes into 3 bytes, code j of a pack at bits
// [j·bits, (j+1)·bits) of the pack's little-endian bytes, packs in order). Read as uint32 words
// that is core/weight.h's one little-endian bit stream per row. The first pack of each row is
// packed by hand (3 bits: codes 0..7 → 88 c6 fa; 6 bits: codes 1, 2, 3, 63 → 81 30 fc, as mlx's
// extract_bits reads them back), the rest by mlx's rule from random codes.
TEST(Weight, AffineCodesFollowMlxBytePackingOf3And6Bits) {
  struct Case {
    int bits;
    std::vector<uint32_t> first_pack;  // codes
    std::vector<uint8_t> first_bytes;  // packed by hand
  };
  const Case cases[] = {{3, {0, 1, 2, 3, 4, 5, 6, 7}, {0x88, 0xc6, 0xfa}}, {6, {1, 2, 3, 63}, {0x81, 0x30, 0xfc}}};
  std::mt19937 rng(5);
  for (const Case& c : cases) {
    SCOPED_TRACE(std::to_string(c.bits) + " bits");
    const int64_t k = 64, pack_codes = static_cast<int64_t>(c.first_pack.size()), pack_bytes = 3;
    std::vector<uint32_t> codes = c.first_pack;
    while (static_cast<int64_t>(codes.size()) < k) codes.push_back(rng() % (1u << c.bits));
    std::vector<uint8_t> bytes = c.first_bytes;
    for (int64_t pack = 1; pack < k / pack_codes; ++pack) {
      uint64_t packed = 0;
      for (int64_t j = 0; j < pack_codes; ++j) packed |= uint64_t{codes[pack * pack_codes + j]} << (j * c.bits);
      for (int64_t byte = 0; byte < pack_bytes; ++byte) bytes.push_back(static_cast<uint8_t>(packed >> (8 * byte)));
    }
    Tensor words = Tensor::empty({1, k * c.bits / 32}, DType::U32);
    ASSERT_EQ(bytes.size(), words.nbytes());
    std::memcpy(words.raw(), bytes.data(), bytes.size());
    Tensor ones = Tensor::empty({1, 1}, DType::F32), zeros = Tensor::empty({1, 1}, DType::F32);
    ones.data<float>()[0] = 1.0f;
    zeros.data<float>()[0] = 0.0f;
    const Weight w = Weight::affine(words, ones, zeros, c.bits, 64);
    std::vector<float> decoded(k);
    decode_rows(w, 0, 1, decoded.data());
    for (int64_t i = 0; i < k; ++i) {
      EXPECT_EQ(affine_code(words.data<uint32_t>(), c.bits, i), codes[i]) << "code " << i;
      EXPECT_EQ(decoded[i], static_cast<float>(codes[i])) << "code " << i;
    }
  }
}

TEST(Tensor, ReshapeAndSliceShareStorage) {
  Tensor t = Tensor::zeros({4, 3}, DType::F32);
  t.data<float>()[7] = 5.0f;
  Tensor rows = t.slice_rows(2, 2);
  EXPECT_EQ(rows.data<float>()[1], 5.0f);
  EXPECT_EQ(t.reshape({12}).dim(0), 12);
  EXPECT_THROW(t.reshape({5}), Error);
  EXPECT_THROW(t.slice_rows(3, 2), Error);
}

TEST(ThreadPool, CoversRangeOnceWithGrainAlignedBlocks) {
  ThreadPool pool(3);
  std::vector<int> hits(1000, 0);
  pool.parallel_for(1000, 16, [&](int64_t begin, int64_t end) {
    EXPECT_EQ(begin % 16, 0);
    for (int64_t i = begin; i < end; ++i) hits[i]++;
  });
  for (int hit : hits) EXPECT_EQ(hit, 1);
}

TEST(ThreadPool, BackToBackJobsAndSleepingWorkersEachCoverTheirRangeOnce) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> hits(257);
  for (int job = 0; job < 2000; ++job) {
    // Every 500th job runs after the workers have gone from spinning to sleeping.
    if (job % 500 == 499) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    const int64_t count = 1 + job % 257;
    pool.parallel_for(count, 1 + job % 5, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) hits[i].fetch_add(1, std::memory_order_relaxed);
    });
    for (int64_t i = 0; i < count; ++i) ASSERT_EQ(hits[i].exchange(0), 1) << "job " << job << " index " << i;
  }
}

TEST(ThreadStack, RunsTheWorkAndPassesItsExceptionBack) {
  int ran = 0;
  kiln::run_with_stack(size_t{1} << 20, [&] { ++ran; });
  EXPECT_EQ(ran, 1);
  EXPECT_THROW(kiln::run_with_stack(size_t{1} << 20, [] { kiln::fail("from the thread"); }), kiln::Error);
  // A stack below PTHREAD_STACK_MIN cannot be set: one clear error, not a thread on another stack.
  try {
    kiln::run_with_stack(1, [&] { ++ran; });
    ADD_FAILURE() << "a 1-byte stack was accepted";
  } catch (const kiln::Error& error) {
    EXPECT_NE(std::string(error.what()).find("cannot start a thread with a 1-byte stack"), std::string::npos)
        << error.what();
  }
  EXPECT_EQ(ran, 1);
}

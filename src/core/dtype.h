// Element types and the exact conversions between them.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace kiln {

// F32/F16/BF16 are the checkpoint dtypes kiln accepts; I32 is internal (token ids, positions).
enum class DType : uint8_t { F32, F16, BF16, I32 };

constexpr size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::I32: return 4;
  }
  return 0;
}

// Names as the safetensors header spells them.
constexpr std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::I32: return "I32";
  }
  return "?";
}

std::optional<DType> parse_dtype(std::string_view name);

inline float bf16_to_f32(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof value);
  return value;
}

// Round to nearest, ties to even (what torch's .to(bfloat16) does); NaN stays a quiet NaN.
inline uint16_t f32_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

// The float that bf16 rounding of `value` represents.
inline float round_to_bf16(float value) { return bf16_to_f32(f32_to_bf16(value)); }

float f16_to_f32(uint16_t bits);
uint16_t f32_to_f16(float value);

}  // namespace kiln

// Element types and the exact conversions between them.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace kiln {

// F32/F16/BF16 are the floating-point checkpoint dtypes; I32 also holds token ids and positions.
// U32, I32 and F8E4M3 appear only inside quantized weights (core/weight.h): MLX's packed words,
// AWQ/GPTQ's packed qweight/qzeros, and FP8 (e4m3fn) values.
enum class DType : uint8_t { F32, F16, BF16, I32, U32, F8E4M3 };

constexpr size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::I32: return 4;
    case DType::U32: return 4;
    case DType::F8E4M3: return 1;
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
    case DType::U32: return "U32";
    case DType::F8E4M3: return "F8_E4M3";
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

// The floating-point dtypes activations and dense weights may have.
constexpr bool is_float_dtype(DType dtype) { return dtype == DType::F32 || dtype == DType::F16 || dtype == DType::BF16; }

float f16_to_f32(uint16_t bits);
uint16_t f32_to_f16(float value);

// float8 e4m3fn (OCP FP8, what torch.float8_e4m3fn stores): 1 sign, 4 exponent (bias 7), 3 mantissa
// bits, no infinities, 0x7f/0xff are NaN. Every value is exact in f32.
inline float fp8_e4m3_to_f32(uint8_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x80u) << 24;
  const uint32_t exponent = (bits >> 3) & 0xfu;
  const uint32_t mantissa = bits & 0x7u;
  uint32_t result;
  if (exponent == 0xf && mantissa == 0x7) {
    result = sign | 0x7fc00000u;
  } else if (exponent == 0) {
    // Subnormal: mantissa · 2^-9, exact in f32.
    float value = static_cast<float>(mantissa) * 0.001953125f;
    std::memcpy(&result, &value, sizeof result);
    result |= sign;
  } else {
    result = sign | (exponent + 127 - 7) << 23 | mantissa << 20;
  }
  float value;
  std::memcpy(&value, &result, sizeof value);
  return value;
}

// Round to nearest even e4m3fn, saturating at ±448 (torch's cast of a finite value out of range
// is not defined; quantizers divide by amax/448 first, so they never rely on it); NaN stays NaN.
uint8_t f32_to_fp8_e4m3(float value);

}  // namespace kiln

#include "core/dtype.h"

#include <cmath>

namespace kiln {

std::optional<DType> parse_dtype(std::string_view name) {
  for (DType dtype : {DType::F32, DType::F16, DType::BF16, DType::I32, DType::U32, DType::F8E4M3})
    if (dtype_name(dtype) == name) return dtype;
  return std::nullopt;
}

float f16_to_f32(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  uint32_t result;
  if (exponent == 0) {
    if (mantissa == 0) {
      result = sign;
    } else {  // subnormal: normalise into an f32 exponent
      int shift = 0;
      while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        ++shift;
      }
      mantissa &= 0x3ffu;
      result = sign | static_cast<uint32_t>(127 - 15 - shift + 1) << 23 | mantissa << 13;
    }
  } else if (exponent == 0x1f) {
    result = sign | 0x7f800000u | mantissa << 13;
  } else {
    result = sign | (exponent + 127 - 15) << 23 | mantissa << 13;
  }
  float value;
  std::memcpy(&value, &result, sizeof value);
  return value;
}

uint16_t f32_to_f16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return sign | 0x7e00u;  // NaN
  if (abs_bits >= 0x477ff000u) return sign | 0x7c00u;  // rounds to infinity
  if (abs_bits < 0x38800000u) {  // result is subnormal or zero
    float magnitude;
    std::memcpy(&magnitude, &abs_bits, sizeof magnitude);
    // 2^-24 is the f16 subnormal step; nearbyint rounds half to even.
    return sign | static_cast<uint16_t>(std::nearbyint(magnitude * 16777216.0f));
  }
  const uint32_t rounding_bias = 0xfffu + ((abs_bits >> 13) & 1u);
  return sign | static_cast<uint16_t>((abs_bits - (112u << 23) + rounding_bias) >> 13);
}

uint8_t f32_to_fp8_e4m3(float value) {
  if (std::isnan(value)) return 0x7f;
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  // The nearest of the 127 non-negative finite codes, ties to the even code (codes are ordered
  // like their values, so "even" is the code's last bit, as for IEEE formats).
  const float magnitude = std::fabs(value);
  uint8_t best = 0;
  for (uint8_t code = 1; code < 0x7f; ++code) {
    const float candidate = fp8_e4m3_to_f32(code);
    const float below = fp8_e4m3_to_f32(best);
    if (candidate <= magnitude) {
      best = code;
      continue;
    }
    const float over = candidate - magnitude, under = magnitude - below;
    if (over < under || (over == under && (code & 1) == 0)) best = code;
    break;
  }
  return sign | best;
}

}  // namespace kiln

#include "core/dtype.h"

#include <cmath>

namespace kiln {

std::optional<DType> parse_dtype(std::string_view name) {
  for (DType dtype : {DType::F32, DType::F16, DType::BF16, DType::I32})
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

}  // namespace kiln

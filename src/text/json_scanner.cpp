#include "text/json_scanner.h"

#include <cmath>
#include <cstdlib>

namespace kiln {

namespace {

bool is_layout(uint8_t byte) { return byte == ' ' || byte == '\n' || byte == '\t' || byte == '\r'; }
bool is_digit(uint8_t byte) { return byte >= '0' && byte <= '9'; }

int hex_value(uint8_t byte) {
  if (is_digit(byte)) return byte - '0';
  if (byte >= 'a' && byte <= 'f') return byte - 'a' + 10;
  if (byte >= 'A' && byte <= 'F') return byte - 'A' + 10;
  return -1;
}

}  // namespace

bool JsonScanner::in_string() const {
  switch (state_) {
    case State::String:
    case State::Escape:
    case State::UnicodeDigits:
    case State::LowSurrogateBackslash:
    case State::LowSurrogateU:
    case State::Utf8Continuation: return true;
    default: return false;
  }
}

bool JsonScanner::complete() const {
  if (state_ == State::Done) return true;
  // A number at the top level ends with the text.
  const bool number_may_end = state_ == State::Zero || state_ == State::Integer || state_ == State::Fraction ||
                              state_ == State::ExponentDigits;
  return number_may_end && containers_.empty();
}

JsonScanner::Byte JsonScanner::refuse() {
  state_ = State::Refused;
  return Byte::Refused;
}

void JsonScanner::end_value() { state_ = containers_.empty() ? State::Done : State::AfterValue; }

JsonScanner::Byte JsonScanner::take(char character) {
  const auto byte = static_cast<uint8_t>(character);
  switch (state_) {
    case State::Refused: return Byte::Refused;
    case State::Value: return start_value(byte, false);
    case State::ValueOrEnd: return start_value(byte, true);
    case State::KeyOrEnd:
    case State::Key:
      if (is_layout(byte)) return Byte::Layout;
      if (byte == '"') {
        state_ = State::String;
        key_ = true;
        return Byte::Taken;
      }
      if (byte == '}' && state_ == State::KeyOrEnd) {
        containers_.pop_back();
        end_value();
        return Byte::Taken;
      }
      return refuse();
    case State::Colon:
      if (is_layout(byte)) return Byte::Layout;
      if (byte != ':') return refuse();
      state_ = State::Value;
      return Byte::Taken;
    case State::AfterValue: return after_value_byte(byte);
    case State::Done: return is_layout(byte) ? Byte::Layout : refuse();
    case State::String:
    case State::Escape:
    case State::UnicodeDigits:
    case State::LowSurrogateBackslash:
    case State::LowSurrogateU:
    case State::Utf8Continuation: return string_byte(byte);
    case State::Literal:
      if (byte != static_cast<uint8_t>(*literal_)) return refuse();
      if (*++literal_ == '\0') end_value();
      return Byte::Taken;
    default: return number_byte(byte);
  }
}

JsonScanner::Byte JsonScanner::start_value(uint8_t byte, bool array_may_end) {
  if (is_layout(byte)) return Byte::Layout;
  switch (byte) {
    case '{':
      containers_.push_back(true);
      state_ = State::KeyOrEnd;
      return Byte::Taken;
    case '[':
      containers_.push_back(false);
      state_ = State::ValueOrEnd;
      return Byte::Taken;
    case ']':
      if (!array_may_end) return refuse();
      containers_.pop_back();
      end_value();
      return Byte::Taken;
    case '"':
      state_ = State::String;
      key_ = false;
      return Byte::Taken;
    case '-':
    case '0':
      number_ = static_cast<char>(byte);
      state_ = byte == '-' ? State::Minus : State::Zero;
      return Byte::Taken;
    case 't': literal_ = "rue"; state_ = State::Literal; return Byte::Taken;
    case 'f': literal_ = "alse"; state_ = State::Literal; return Byte::Taken;
    case 'n': literal_ = "ull"; state_ = State::Literal; return Byte::Taken;
    default:
      if (byte < '1' || byte > '9') return refuse();
      number_ = static_cast<char>(byte);
      state_ = State::Integer;
      return Byte::Taken;
  }
}

JsonScanner::Byte JsonScanner::after_value_byte(uint8_t byte) {
  if (is_layout(byte)) return Byte::Layout;
  const bool object = containers_.back();
  if (byte == ',') {
    state_ = object ? State::Key : State::Value;
    return Byte::Taken;
  }
  if (byte != (object ? '}' : ']')) return refuse();
  containers_.pop_back();
  end_value();
  return Byte::Taken;
}

JsonScanner::Byte JsonScanner::string_byte(uint8_t byte) {
  switch (state_) {
    case State::Escape:
      if (byte == 'u') {
        state_ = State::UnicodeDigits;
        unicode_digits_ = 4;
        unicode_ = 0;
        low_surrogate_ = false;
        return Byte::Taken;
      }
      if (byte != '"' && byte != '\\' && byte != '/' && byte != 'b' && byte != 'f' && byte != 'n' && byte != 'r' &&
          byte != 't')
        return refuse();
      state_ = State::String;
      return Byte::Taken;
    case State::UnicodeDigits: {
      const int digit = hex_value(byte);
      if (digit < 0) return refuse();
      unicode_ = unicode_ * 16 + static_cast<uint32_t>(digit);
      if (--unicode_digits_ > 0) return Byte::Taken;
      const bool high = unicode_ >= 0xD800 && unicode_ <= 0xDBFF, low = unicode_ >= 0xDC00 && unicode_ <= 0xDFFF;
      if (low != low_surrogate_) return refuse();
      state_ = high ? State::LowSurrogateBackslash : State::String;
      return Byte::Taken;
    }
    case State::LowSurrogateBackslash:
      if (byte != '\\') return refuse();
      state_ = State::LowSurrogateU;
      return Byte::Taken;
    case State::LowSurrogateU:
      if (byte != 'u') return refuse();
      state_ = State::UnicodeDigits;
      unicode_digits_ = 4;
      unicode_ = 0;
      low_surrogate_ = true;
      return Byte::Taken;
    case State::Utf8Continuation:
      if (byte < continuation_low_ || byte > continuation_high_) return refuse();
      continuation_low_ = 0x80;
      continuation_high_ = 0xBF;
      if (--continuation_bytes_ == 0) state_ = State::String;
      return Byte::Taken;
    default: break;
  }
  if (byte == '"') {
    if (key_)
      state_ = State::Colon;
    else
      end_value();
    return Byte::Taken;
  }
  if (byte == '\\') {
    state_ = State::Escape;
    return Byte::Taken;
  }
  if (byte < 0x20) return refuse();
  if (byte < 0x80) return Byte::Taken;
  // The first byte of a multi-byte character (the Unicode standard's table 3-7).
  if (byte >= 0xC2 && byte <= 0xDF)
    continuation_bytes_ = 1;
  else if (byte >= 0xE0 && byte <= 0xEF)
    continuation_bytes_ = 2;
  else if (byte >= 0xF0 && byte <= 0xF4)
    continuation_bytes_ = 3;
  else
    return refuse();
  if (byte == 0xE0) continuation_low_ = 0xA0;
  if (byte == 0xED) continuation_high_ = 0x9F;
  if (byte == 0xF0) continuation_low_ = 0x90;
  if (byte == 0xF4) continuation_high_ = 0x8F;
  state_ = State::Utf8Continuation;
  return Byte::Taken;
}

JsonScanner::Byte JsonScanner::number_taken(uint8_t byte, State next) {
  number_ += static_cast<char>(byte);
  state_ = next;
  // Below 300 characters without an exponent a number is below 1e300, in range; past it, or in
  // the exponent, more digits only move the number further from zero (a negative exponent's
  // towards it, which never overflows), so the first digit out of range is the one to refuse.
  // strtod is what nlohmann converts with.
  const bool may_overflow = next == State::ExponentDigits || number_.size() >= 300;
  if (may_overflow && std::isinf(std::strtod(number_.c_str(), nullptr))) return refuse();
  return Byte::Taken;
}

JsonScanner::Byte JsonScanner::number_byte(uint8_t byte) {
  const bool digit = is_digit(byte);
  switch (state_) {
    case State::Minus:
      if (!digit) return refuse();
      return number_taken(byte, byte == '0' ? State::Zero : State::Integer);
    case State::Zero:
    case State::Integer:
      if (digit && state_ == State::Integer) return number_taken(byte, State::Integer);
      if (byte == '.') return number_taken(byte, State::Point);
      if (byte == 'e' || byte == 'E') return number_taken(byte, State::Exponent);
      break;
    case State::Point:
      if (!digit) return refuse();
      return number_taken(byte, State::Fraction);
    case State::Fraction:
      if (digit) return number_taken(byte, State::Fraction);
      if (byte == 'e' || byte == 'E') return number_taken(byte, State::Exponent);
      break;
    case State::Exponent:
      if (byte == '+' || byte == '-') return number_taken(byte, State::ExponentSign);
      [[fallthrough]];
    case State::ExponentSign:
      if (!digit) return refuse();
      return number_taken(byte, State::ExponentDigits);
    case State::ExponentDigits:
      if (digit) return number_taken(byte, State::ExponentDigits);
      break;
    default: return refuse();
  }
  // The number ended before this byte, which follows it as it would any value.
  end_value();
  return take(static_cast<char>(byte));
}

}  // namespace kiln

// JSON text (RFC 8259, held to what nlohmann::json parses: UTF-8 checked, surrogate escapes
// paired, numbers within a double's range) checked one byte at a time as it streams in. A byte is refused the moment no JSON text
// can continue with it, so whatever the scanner took is a prefix of some JSON text, and a text it
// took whole and calls complete parses. The tool-call reader (text/tool_call_reader.h) streams a
// call's arguments through it: only bytes it took go out, without the whitespace between tokens.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kiln {

class JsonScanner {
 public:
  enum class Byte {
    Refused,  // no JSON text continues this way; every later byte is refused too
    Layout,   // whitespace between tokens: taken, but no part of the value
    Taken,    // a byte of the value
  };
  Byte take(char byte);

  // A whole value was read (a number once a byte past it came): only whitespace may follow.
  bool complete() const;
  // Containers ({ or [) open around the next byte.
  size_t depth() const { return containers_.size(); }
  bool in_string() const;
  // Inside a string that is an object's key.
  bool in_key() const { return in_string() && key_; }
  bool refused() const { return state_ == State::Refused; }

 private:
  enum class State : uint8_t {
    Value,          // a value must come (the start, after ':' or after ',' in an array)
    ValueOrEnd,     // after '[': a value or ']'
    KeyOrEnd,       // after '{': a key or '}'
    Key,            // after ',' in an object: a key
    Colon,          // after a key
    AfterValue,     // inside a container after a value: ',' or its end
    Done,           // the outermost value ended
    String,
    Escape,         // after '\'
    UnicodeDigits,  // in \uXXXX
    LowSurrogateBackslash,  // after a high surrogate's escape: its low one must follow
    LowSurrogateU,
    Utf8Continuation,
    Minus,
    Zero,
    Integer,
    Point,
    Fraction,
    Exponent,
    ExponentSign,
    ExponentDigits,
    Literal,  // in true, false or null
    Refused,
  };

  Byte start_value(uint8_t byte, bool array_may_end);
  Byte string_byte(uint8_t byte);
  Byte number_byte(uint8_t byte);
  // Takes a byte of a number: refused where the number, now past a double's range, could only
  // stay past it (nlohmann refuses 1e400).
  Byte number_taken(uint8_t byte, State next);
  Byte after_value_byte(uint8_t byte);
  // The state after a value ended: inside its container, or done.
  void end_value();
  Byte refuse();

  State state_ = State::Value;
  std::vector<bool> containers_;  // open containers, innermost last: true for an object
  bool key_ = false;              // the string being read is a key
  // \uXXXX: digits still to come and the code so far; whether it must be a low surrogate.
  int unicode_digits_ = 0;
  uint32_t unicode_ = 0;
  bool low_surrogate_ = false;
  // A multi-byte UTF-8 character: continuation bytes still to come, and the range the next one
  // must fall in (narrower after E0, ED, F0 and F4, which would otherwise allow overlong forms,
  // surrogates or code points past U+10FFFF).
  int continuation_bytes_ = 0;
  uint8_t continuation_low_ = 0x80, continuation_high_ = 0xBF;
  const char* literal_ = nullptr;  // the rest of the literal being read
  std::string number_;             // the number being read
};

}  // namespace kiln

// Names of parameterised test cases.
#pragma once

#include <cctype>
#include <string>

namespace kiln::testing {

// A gtest parameter name from free text (fixture names hold '-' and '.'): every character but
// letters and digits becomes '_'.
inline std::string parameter_name(std::string text) {
  for (char& c : text)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return text;
}

}  // namespace kiln::testing

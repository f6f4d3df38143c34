// The error a request handler reports to its client: an HTTP status and a message, rendered as
// an OpenAI error body ({"error": {message, type, param, code}}) or an Anthropic one
// ({"type": "error", "error": {type, message}}) by the endpoint that caught it.
#pragma once

#include <fmt/format.h>

#include <initializer_list>
#include <stdexcept>
#include <string>

namespace kiln::server {

class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string message, std::string param = {}, std::string code = {})
      : std::runtime_error(std::move(message)), status_(status), param_(std::move(param)), code_(std::move(code)) {}

  int status() const { return status_; }
  const std::string& param() const { return param_; }  // the offending request field, if one
  const std::string& code() const { return code_; }    // a machine-readable reason, if one

 private:
  int status_;
  std::string param_;
  std::string code_;
};

// A status's error type in a dialect's words: the dialect's own name for that status if `named` has
// one, else `server_error` for any 5xx, else "invalid_request_error" (both dialects' word).
struct NamedStatus {
  int status;
  const char* type;
};
inline std::string error_type_for(int status, std::initializer_list<NamedStatus> named, const char* server_error) {
  for (const NamedStatus& entry : named)
    if (entry.status == status) return entry.type;
  return status >= 500 ? server_error : "invalid_request_error";
}

// A 400 naming the field.
template <typename... Args>
[[noreturn]] void reject_field(const std::string& param, fmt::format_string<Args...> format, Args&&... args) {
  throw ApiError(400, fmt::format(format, std::forward<Args>(args)...), param);
}

// A 400 for an option kiln does not implement (yet): it is refused rather than ignored.
[[noreturn]] inline void reject_unsupported(const std::string& param, const std::string& what) {
  throw ApiError(400, fmt::format("{} is not supported by this server", what), param, "unsupported_parameter");
}

}  // namespace kiln::server

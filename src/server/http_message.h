// The request and response an HTTP handler sees (http_server.h), apart from the transport.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kiln::server {

using HeaderList = std::vector<std::pair<std::string, std::string>>;

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string path;    // the target without its query string
  std::string query;   // after '?', or empty
  HeaderList headers;  // names in lower case
  std::string body;

  // The value of a header (name in lower case), or nullptr.
  const std::string* header(std::string_view name) const;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  HeaderList headers;
  std::string body;
};

}  // namespace kiln::server

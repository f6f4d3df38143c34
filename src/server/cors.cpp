#include "server/cors.h"

#include <algorithm>
#include <string_view>

namespace kiln::server {
namespace {

// The host of an origin "scheme://host[:port]" (an IPv6 host keeps its brackets), or empty when
// the origin is not of that form ("null" is what a sandboxed page or a file sends).
std::string_view origin_host(std::string_view origin) {
  const size_t scheme_end = origin.find("://");
  if (scheme_end == std::string_view::npos) return {};
  const std::string_view scheme = origin.substr(0, scheme_end);
  if (scheme != "http" && scheme != "https") return {};
  std::string_view authority = origin.substr(scheme_end + 3);
  if (authority.find('/') != std::string_view::npos) return {};
  if (!authority.empty() && authority.front() == '[') {
    const size_t close = authority.find(']');
    return close == std::string_view::npos ? std::string_view{} : authority.substr(0, close + 1);
  }
  return authority.substr(0, authority.find(':'));
}

}  // namespace

bool CorsPolicy::allows(const std::string& origin) const {
  for (const std::string& allowed : allowed_origins)
    if (allowed == "*" || allowed == origin) return true;
  if (!allow_loopback_origins) return false;
  const std::string_view host = origin_host(origin);
  return host == "localhost" || host == "127.0.0.1" || host == "[::1]";
}

HeaderList CorsPolicy::response_headers(const HttpRequest& request) const {
  const std::string* origin = request.header("origin");
  if (!origin || !allows(*origin)) return {};
  // The origin is echoed rather than "*", so that a response may differ by origin: caches must
  // key on it (Vary).
  return {{"Access-Control-Allow-Origin", *origin}, {"Vary", "Origin"}};
}

std::optional<HttpResponse> CorsPolicy::preflight(const HttpRequest& request) const {
  if (request.method != "OPTIONS" || !request.header("access-control-request-method")) return std::nullopt;
  HttpResponse response;
  response.status = 204;
  response.content_type = "text/plain";
  response.headers = response_headers(request);
  if (response.headers.empty()) return response;  // no grant: the browser refuses the request
  response.headers.emplace_back("Access-Control-Allow-Methods", "GET, POST, HEAD, OPTIONS");
  // The headers the OpenAI and Anthropic clients send (and any the page asks for).
  const std::string* asked = request.header("access-control-request-headers");
  response.headers.emplace_back("Access-Control-Allow-Headers",
                                asked ? *asked
                                      : "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta");
  response.headers.emplace_back("Access-Control-Max-Age", "86400");
  return response;
}

}  // namespace kiln::server

// Cross-origin requests (CORS, the Fetch standard): which web pages on other origins may call the
// server from a browser. The transport adds Access-Control-Allow-Origin to every response to an
// allowed Origin and answers preflights (OPTIONS with Access-Control-Request-Method) itself, with
// no handler and no API key, as browsers send them without credentials.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "server/http_message.h"

namespace kiln::server {

struct CorsPolicy {
  // Origins allowed as written ("https://app.example:3000"), or "*" for every origin.
  std::vector<std::string> allowed_origins;
  // Pages served from this machine (http or https on localhost, 127.0.0.1 or [::1], any port)
  // are allowed: Ollama's default, which keeps a page on the open web from reading a local server
  // while local tools and pages work.
  bool allow_loopback_origins = true;

  bool allows(const std::string& origin) const;
  // The headers every response to `request` carries: none unless its Origin is allowed.
  HeaderList response_headers(const HttpRequest& request) const;
  // A preflight's answer (204 with the methods and headers allowed, cached for a day), or nothing
  // when `request` is not a preflight.
  std::optional<HttpResponse> preflight(const HttpRequest& request) const;
};

}  // namespace kiln::server

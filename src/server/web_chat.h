// The web chat `kiln serve` answers at GET /: one self-contained page (HTML, CSS and script, no
// external requests) that talks to /v1/models and /v1/chat/completions. Its source is
// src/server/web/chat.html, compiled in at build time (cmake/embed_text.cmake).
#pragma once

#include <string_view>

namespace kiln::server {

// The page's bytes (UTF-8 HTML).
std::string_view web_chat_page();

}  // namespace kiln::server

// A Jinja template as transformers renders chat templates: Jinja2 semantics with trim_blocks and
// lstrip_blocks, the loopcontrols extension (break/continue), {% generation %} blocks, and the
// globals namespace(), range(), dict(), raise_exception() and strftime_now(). Unsupported syntax
// is an error naming the template line, when parsing or rendering.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "tokenizer/jinja_limits.h"
#include "tokenizer/jinja_syntax.h"

namespace kiln::jinja {

class Template {
 public:
  // `origin` names the template in errors (e.g. ".../tokenizer_config.json chat_template");
  // going over a limit is an error naming the template and the limit.
  Template(std::string_view source, std::string origin, Limits limits = {});

  // Renders with the top-level variables of a JSON object.
  std::string render(const nlohmann::ordered_json& variables) const;

  const std::string& origin() const { return *origin_; }

 private:
  std::shared_ptr<const std::string> origin_;
  Limits limits_;
  std::shared_ptr<const Body> body_;
};

}  // namespace kiln::jinja

#include <fmt/format.h>

#include <new>
#include <unordered_map>

#include "core/error.h"
#include "tokenizer/jinja_builtins.h"
#include "tokenizer/jinja_template.h"
#include "tokenizer/unicode.h"

namespace kiln::jinja {

namespace {

using Frame = std::unordered_map<std::string, Value>;

class Renderer {
 public:
  Renderer(const std::string& origin, const Limits& limits) : origin_(origin), limits_(limits), budget_(limits) {}

  std::string run(const Body& body, Frame globals) {
    frames_.push_back(std::move(globals));
    std::string out;
    if (render(body, out) != Flow::Normal) fail("{}: break or continue outside a loop", origin_);
    return out;
  }

 private:
  enum class Flow { Normal, Break, Continue };

  Location at(int line) { return Location{&origin_, line, &budget_}; }

  // One more level of rendering (a node, an expression): counted against the stack it takes.
  NestingLevel deeper(int line) {
    return NestingLevel(depth_, limits_.render_depth, [this, line] {
      at(line).error(fmt::format(
          "rendering nests deeper than {} levels (blocks, expressions and macro calls), the limit of a template render",
          limits_.render_depth));
    });
  }

  // Appends to a rendered text (the output, or a captured block), within Limits::output_bytes.
  void emit(std::string& out, std::string_view text, int line) {
    if (text.size() > limits_.output_bytes || out.size() > limits_.output_bytes - text.size())
      at(line).error(fmt::format("the rendered text would exceed {}, the limit of a template's output",
                                 describe_bytes(limits_.output_bytes)));
    at(line).charge(text.size() / kBytesCopiedPerStep);
    out += text;
  }

  Flow render(const Body& body, std::string& out) {
    for (const NodePtr& node : body) {
      const Flow flow = render(*node, out);
      if (flow != Flow::Normal) return flow;
    }
    return Flow::Normal;
  }

  Flow render(const Node& node, std::string& out) {
    const NestingLevel level = deeper(node.line);
    at(node.line).charge(1);
    try {
      return render_node(node, out);
    } catch (const ValueLimitError& error) {
      at(node.line).error(error.what());
    }
  }

  Flow render_node(const Node& node, std::string& out) {
    switch (node.kind) {
      case Node::Kind::Text:
        emit(out, node.text, node.line);
        return Flow::Normal;
      case Node::Kind::Output: {
        const Value value = evaluate(*node.expression);
        if (value.is_function()) at(node.line).error("cannot print a function; call it with ()");
        emit(out, value.str(), node.line);
        return Flow::Normal;
      }
      case Node::Kind::If:
        for (size_t i = 0; i < node.conditions.size(); ++i)
          if (evaluate(*node.conditions[i]).truthy()) return render(node.bodies[i], out);
        return render(node.else_body, out);
      case Node::Kind::For:
        return render_for(node, out);
      case Node::Kind::Set: {
        const Value value = evaluate(*node.expression);
        if (!node.attribute.empty()) {
          const Value target = lookup(node.targets[0]);
          if (!target.is_namespace())
            at(node.line).error(
                fmt::format("cannot assign attribute '{}' on '{}': only namespace() objects take "
                            "attribute assignment",
                            node.attribute, node.targets[0]));
          if (value.holds_namespace())
            at(node.line).error(fmt::format(
                "cannot assign a namespace (or a value holding one) to attribute '{}' of namespace '{}'",
                node.attribute, node.targets[0]));
          target.namespace_dict().set(node.attribute, value);
        } else {
          assign_targets(node.targets, value, node.line);
        }
        return Flow::Normal;
      }
      case Node::Kind::SetBlock: {
        std::string captured;
        if (render(node.body, captured) != Flow::Normal) at(node.line).error("break or continue inside {% set %}");
        frames_.back()[node.targets[0]] = Value(std::move(captured));
        return Flow::Normal;
      }
      case Node::Kind::Macro:
        frames_.back()[node.name] = make_macro(node);
        return Flow::Normal;
      case Node::Kind::Break:
      case Node::Kind::Continue:
        if (loop_depth_ == 0) at(node.line).error("break or continue outside a loop");
        return node.kind == Node::Kind::Break ? Flow::Break : Flow::Continue;
      case Node::Kind::FilterBlock: {
        std::string captured;
        const Flow flow = render(node.body, captured);
        CallArguments arguments = evaluate_arguments(*node.filter);
        emit(out, apply_filter(node.filter->name, Value(std::move(captured)), arguments, at(node.line)).str(),
             node.line);
        return flow;
      }
      case Node::Kind::Generation:
        return render(node.body, out);
    }
    return Flow::Normal;
  }

  void assign_targets(const std::vector<std::string>& targets, const Value& value, int line) {
    if (targets.size() == 1) {
      frames_.back()[targets[0]] = value;
      return;
    }
    const List items = iterate(value, at(line));
    if (items.size() != targets.size())
      at(line).error(fmt::format("cannot unpack {} values into {} names", items.size(), targets.size()));
    for (size_t i = 0; i < targets.size(); ++i) frames_.back()[targets[i]] = items[i];
  }

  Flow render_for(const Node& node, std::string& out) {
    const Value iterable = evaluate(*node.expression);
    List items = iterate(iterable, at(node.line));
    if (node.condition) {
      // `for x in xs if cond`: the filter runs before the loop, so loop.length counts what passes.
      List kept;
      for (const Value& item : items) {
        frames_.emplace_back();
        assign_targets(node.targets, item, node.line);
        if (evaluate(*node.condition).truthy()) kept.push_back(item);
        frames_.pop_back();
      }
      items = std::move(kept);
    }
    if (items.empty()) return render(node.else_body, out);
    frames_.emplace_back();
    ++loop_depth_;
    const auto length = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < length; ++i) {
      Dict loop;
      loop.entries = {
          {"index", Value(i + 1)},
          {"index0", Value(i)},
          {"revindex", Value(length - i)},
          {"revindex0", Value(length - i - 1)},
          {"first", Value(i == 0)},
          {"last", Value(i == length - 1)},
          {"length", Value(length)},
          {"depth", Value(1)},
          {"depth0", Value(0)},
      };
      if (i > 0) loop.entries.emplace_back("previtem", items[static_cast<size_t>(i - 1)]);
      if (i + 1 < length) loop.entries.emplace_back("nextitem", items[static_cast<size_t>(i + 1)]);
      at(node.line).charge(loop.entries.size());  // an iteration builds its loop variable
      frames_.back()["loop"] = Value(std::move(loop));
      assign_targets(node.targets, items[static_cast<size_t>(i)], node.line);
      const Flow flow = render(node.body, out);
      if (flow == Flow::Break) break;
    }
    --loop_depth_;
    frames_.pop_back();
    return Flow::Normal;
  }

  Value make_macro(const Node& node) {
    const Node* macro = &node;
    return Value(Function{node.name, [this, macro](CallArguments& arguments) {
                            const Location location = arguments.at;
                            const NestingLevel level(call_depth_, limits_.call_depth, [&] {
                              location.error(fmt::format(
                                  "macro '{}': macro calls nest deeper than {} levels, the limit of a template render "
                                  "(a macro calling itself without end?)",
                                  macro->name, limits_.call_depth));
                            });
                            if (arguments.positional.size() > macro->parameters.size())
                              location.error(fmt::format("macro '{}' takes {} arguments ({} given)", macro->name,
                                                         macro->parameters.size(), arguments.positional.size()));
                            // A macro sees the template's top-level variables and its own arguments.
                            std::vector<Frame> saved = std::move(frames_);
                            frames_.clear();
                            frames_.push_back(saved.front());
                            frames_.emplace_back();
                            const int saved_depth = loop_depth_;
                            loop_depth_ = 0;
                            for (size_t i = 0; i < macro->parameters.size(); ++i) {
                              const auto& [name, default_value] = macro->parameters[i];
                              Value value;
                              if (i < arguments.positional.size())
                                value = arguments.positional[i];
                              else if (default_value)
                                value = evaluate(*default_value);
                              else
                                value = Value::undefined(fmt::format("'{}' is undefined", name));
                              frames_.back()[name] = value;
                            }
                            for (const auto& [key, value] : arguments.keyword) {
                              // Captured by a name: clang before 16 cannot capture a structured binding.
                              const bool known =
                                  std::any_of(macro->parameters.begin(), macro->parameters.end(),
                                              [&keyword = key](const auto& parameter) { return parameter.first == keyword; });
                              if (!known)
                                location.error(fmt::format("macro '{}' has no parameter '{}'", macro->name, key));
                              frames_.back()[key] = value;
                            }
                            std::string out;
                            const Flow flow = render(macro->body, out);
                            saved.front() = std::move(frames_.front());
                            frames_ = std::move(saved);
                            loop_depth_ = saved_depth;
                            if (flow != Flow::Normal) location.error("break or continue outside a loop");
                            return Value(std::move(out));
                          }});
  }

  Value lookup(const std::string& name) {
    for (auto frame = frames_.rbegin(); frame != frames_.rend(); ++frame)
      if (const auto found = frame->find(name); found != frame->end()) return found->second;
    if (auto builtin = global_function(name)) return *builtin;
    return Value::undefined(fmt::format("'{}' is undefined", name));
  }

  CallArguments evaluate_arguments(const Expression& expression) {
    CallArguments arguments;
    arguments.at = at(expression.line);
    for (const ExpressionPtr& operand : expression.operands) arguments.positional.push_back(evaluate(*operand));
    for (const auto& [name, value] : expression.keywords) arguments.keyword.emplace_back(name, evaluate(*value));
    return arguments;
  }

  Value evaluate(const Expression& expression) {
    const NestingLevel level = deeper(expression.line);
    const Location location = at(expression.line);
    location.charge(1);
    try {
      return evaluate_expression(expression, location);
    } catch (const ValueLimitError& error) {
      location.error(error.what());
    }
  }

  Value evaluate_expression(const Expression& expression, const Location& location) {
    switch (expression.kind) {
      case Expression::Kind::Literal:
        return expression.literal;
      case Expression::Kind::Name:
        return lookup(expression.name);
      case Expression::Kind::Attribute:
        return get_attribute(evaluate(*expression.object), expression.name, location);
      case Expression::Kind::Item:
        return get_item(evaluate(*expression.object), evaluate(*expression.operands[0]), location);
      case Expression::Kind::Slice: {
        const Value object = evaluate(*expression.object);
        Value bounds[3];
        const Value* pointers[3] = {nullptr, nullptr, nullptr};
        for (int i = 0; i < 3; ++i) {
          if (!expression.operands[i]) continue;
          bounds[i] = evaluate(*expression.operands[i]);
          pointers[i] = &bounds[i];
        }
        return get_slice(object, pointers[0], pointers[1], pointers[2], location);
      }
      case Expression::Kind::Call: {
        const Value callee = evaluate(*expression.object);
        if (callee.is_undefined()) location.error(callee.undefined_description() + " (called as a function)");
        if (!callee.is_function()) location.error(fmt::format("'{}' object is not callable", callee.type_name()));
        CallArguments arguments = evaluate_arguments(expression);
        return callee.function().call(arguments);
      }
      case Expression::Kind::Filter: {
        const Value input = evaluate(*expression.object);
        CallArguments arguments = evaluate_arguments(expression);
        return apply_filter(expression.name, input, arguments, location);
      }
      case Expression::Kind::Test: {
        const Value input = evaluate(*expression.object);
        CallArguments arguments = evaluate_arguments(expression);
        return Value(apply_test(expression.name, input, arguments, location) != expression.negated);
      }
      case Expression::Kind::Unary:
        return unary_operation(expression.name, evaluate(*expression.object), location);
      case Expression::Kind::Binary: {
        const Value left = evaluate(*expression.operands[0]);
        // and / or return an operand, short-circuiting as in Python.
        if (expression.name == "and") return left.truthy() ? evaluate(*expression.operands[1]) : left;
        if (expression.name == "or") return left.truthy() ? left : evaluate(*expression.operands[1]);
        return binary_operation(expression.name, left, evaluate(*expression.operands[1]), location);
      }
      case Expression::Kind::Compare: {
        Value left = evaluate(*expression.operands[0]);
        for (size_t i = 0; i < expression.names.size(); ++i) {
          Value right = evaluate(*expression.operands[i + 1]);
          if (!compare(expression.names[i], left, right, location)) return Value(false);
          left = std::move(right);
        }
        return Value(true);
      }
      case Expression::Kind::Conditional:
        if (evaluate(*expression.object).truthy()) return evaluate(*expression.operands[0]);
        if (expression.operands[1]) return evaluate(*expression.operands[1]);
        return Value::undefined("the conditional expression has no else branch");
      case Expression::Kind::List:
      case Expression::Kind::Tuple: {
        List items;
        for (const ExpressionPtr& operand : expression.operands) items.push_back(evaluate(*operand));
        return Value(std::move(items));
      }
      case Expression::Kind::Dict: {
        Dict dict;
        for (size_t i = 0; i < expression.keys.size(); ++i) {
          const Value key = evaluate(*expression.keys[i]);
          if (!key.is_string()) location.error("dict keys must be strings, not " + key.type_name());
          dict.set(key.string(), evaluate(*expression.operands[i]));
        }
        return Value(std::move(dict));
      }
    }
    location.error("unknown expression");
  }

  const std::string& origin_;
  const Limits& limits_;
  Budget budget_;
  std::vector<Frame> frames_;
  int loop_depth_ = 0;
  int depth_ = 0;       // nodes and expressions being rendered
  int call_depth_ = 0;  // macro calls
};

}  // namespace

Template::Template(std::string_view source, std::string origin, Limits limits)
    : origin_(std::make_shared<const std::string>(std::move(origin))), limits_(limits) {
  // Templates are text (transformers reads them as Python str); the interpreter's string
  // functions decode UTF-8 and rely on it being well formed.
  if (const size_t invalid = unicode::find_invalid_utf8(source); invalid != std::string_view::npos)
    fail("{}: the template is not valid UTF-8 (at byte {})", *origin_, invalid);
  try {
    body_ = std::make_shared<const Body>(parse_template(source, *origin_, limits_.parse_depth));
  } catch (const std::bad_alloc&) {
    fail("{}: out of memory while parsing the template", *origin_);
  }
}

std::string Template::render(const nlohmann::ordered_json& variables) const {
  if (!variables.is_object()) fail("{}: template variables must be a JSON object", *origin_);
  try {
    Frame globals;
    for (const auto& [name, value] : variables.items()) {
      try {
        globals[name] = Value::from_json(value);
      } catch (const ValueLimitError& error) {
        fail("{}: template variable '{}': {}", *origin_, name, error.what());
      }
    }
    Renderer renderer(*origin_, limits_);
    return renderer.run(*body_, std::move(globals));
  } catch (const ValueLimitError& error) {
    fail("{}: {}", *origin_, error.what());
  } catch (const std::bad_alloc&) {
    fail("{}: out of memory while rendering the template", *origin_);
  }
}

}  // namespace kiln::jinja

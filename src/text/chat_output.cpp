#include "text/chat_output.h"

#include <algorithm>
#include <array>
#include <span>

namespace kiln {
namespace {

constexpr std::string_view kThinkOpen = "<think>", kThinkClose = "</think>";
constexpr std::string_view kCallOpen = "<tool_call>", kCallClose = "</tool_call>";
// MiniCPM5's calls have no wrapper: the function element itself is the call.
constexpr std::string_view kFunctionOpen = "<function name=", kFunctionClose = "</function>";
constexpr std::string_view kCdataOpen = "<![CDATA[", kCdataClose = "]]>";

// The markers that open and close a call in `syntax` (empty for untagged syntaxes).
std::string_view call_open(ToolCallSyntax syntax) {
  if (syntax == ToolCallSyntax::Hermes || syntax == ToolCallSyntax::QwenXml) return kCallOpen;
  if (syntax == ToolCallSyntax::MiniCpmXml) return kFunctionOpen;
  return {};
}
std::string_view call_close(ToolCallSyntax syntax) {
  return syntax == ToolCallSyntax::MiniCpmXml ? kFunctionClose : kCallClose;
}

// The length of the longest end of `text` that is a proper beginning of one of `markers`: text a
// marker may still complete, held back until more arrives.
size_t partial_marker(std::string_view text, std::span<const std::string_view> markers) {
  size_t held = 0;
  for (std::string_view marker : markers)
    for (size_t length = std::min(text.size(), marker.size() - 1); length > held; --length)
      if (text.substr(text.size() - length) == marker.substr(0, length)) {
        held = length;
        break;
      }
  return held;
}

// The first of `markers` in `text`: its position and which, or npos.
std::pair<size_t, std::string_view> first_marker(std::string_view text, std::span<const std::string_view> markers) {
  std::pair<size_t, std::string_view> first{std::string_view::npos, {}};
  for (std::string_view marker : markers)
    if (const size_t at = text.find(marker); at < first.first) first = {at, marker};
  return first;
}

}  // namespace

ChatOutputSyntax chat_output_syntax(std::string_view chat_template) {
  ChatOutputSyntax syntax;
  syntax.reasoning = chat_template.find(kThinkOpen) != std::string_view::npos;
  if (chat_template.find(kFunctionOpen) != std::string_view::npos &&
      chat_template.find("<param name=") != std::string_view::npos)
    syntax.tool_calls = ToolCallSyntax::MiniCpmXml;
  else if (chat_template.find(kCallOpen) != std::string_view::npos)
    syntax.tool_calls = chat_template.find("<function=") != std::string_view::npos ? ToolCallSyntax::QwenXml
                                                                                    : ToolCallSyntax::Hermes;
  else if (chat_template.find("<|python_tag|>") != std::string_view::npos ||
           chat_template.find("\"parameters\": ") != std::string_view::npos)
    syntax.tool_calls = ToolCallSyntax::LlamaJson;
  return syntax;
}

bool prompt_opens_reasoning(std::string_view prompt) {
  const size_t opened = prompt.rfind("<think>"), closed = prompt.rfind("</think>");
  return opened != std::string_view::npos && (closed == std::string_view::npos || closed < opened);
}

std::string reasoning_close_text(std::string_view chat_template) {
  // A line break is written "\n" in a template's string literal, or stands in its text.
  const auto breaks = [&](size_t at, int direction) {
    size_t count = 0;
    while (true) {
      if (direction > 0 && chat_template.substr(at).starts_with("\\n")) {
        at += 2;
      } else if (direction > 0 && at < chat_template.size() && chat_template[at] == '\n') {
        at += 1;
      } else if (direction < 0 && at >= 2 && chat_template.substr(at - 2, 2) == "\\n") {
        at -= 2;
      } else if (direction < 0 && at >= 1 && chat_template[at - 1] == '\n') {
        at -= 1;
      } else {
        return count;
      }
      ++count;
    }
  };
  // The close of a reasoning block with text in it; an empty block ("<think>\n\n</think>", which
  // templates write where thinking is off) counts only where there is no other.
  std::string best(kThinkClose);
  std::pair<bool, size_t> most{false, 0};  // (closes text, line breaks)
  for (size_t at = chat_template.find(kThinkClose); at != std::string_view::npos;
       at = chat_template.find(kThinkClose, at + 1)) {
    size_t before = breaks(at, -1);
    const size_t after = breaks(at + kThinkClose.size(), 1);
    size_t opened = at;
    for (size_t count = before; count > 0; --count) opened -= chat_template[opened - 1] == '\n' ? 1 : 2;
    const bool closes_text = !chat_template.substr(0, opened).ends_with(kThinkOpen);
    if (!closes_text) before = 0;
    const std::pair<bool, size_t> score{closes_text, before + after};
    if (score > most) {
      most = score;
      best = std::string(before, '\n') + std::string(kThinkClose) + std::string(after, '\n');
    }
  }
  return best;
}

const char* tool_call_syntax_name(ToolCallSyntax syntax) {
  switch (syntax) {
    case ToolCallSyntax::None: return "none";
    case ToolCallSyntax::Hermes: return "hermes";
    case ToolCallSyntax::QwenXml: return "qwen_xml";
    case ToolCallSyntax::LlamaJson: return "llama_json";
    case ToolCallSyntax::MiniCpmXml: return "minicpm_xml";
  }
  return "?";
}

ChatOutputParser::ChatOutputParser(ChatOutputSyntax syntax, nlohmann::ordered_json tools, bool in_reasoning)
    : syntax_(syntax),
      tools_(std::make_shared<const nlohmann::ordered_json>(std::move(tools))),
      state_(in_reasoning && syntax.reasoning ? State::Reasoning : State::Content) {}

ChatOutput ChatOutputParser::parse(std::string_view reply) const {
  ChatOutputParser parser = *this;
  parser.stream_calls_ = false;
  parser.push(reply);
  parser.finish();
  return std::move(parser.output_);
}

void ChatOutputParser::emit(std::vector<ChatOutputEvent>& events, ChatOutputEvent::Kind kind, std::string text) {
  // The spaces a template puts after </think> or between calls are layout, not content.
  if (kind == ChatOutputEvent::Kind::Content && skip_spaces_) {
    const size_t first = text.find_first_not_of(" \n\t\r");
    text.erase(0, first == std::string::npos ? text.size() : first);
    if (!text.empty()) skip_spaces_ = false;
  }
  if (text.empty()) return;
  (kind == ChatOutputEvent::Kind::Reasoning ? output_.reasoning : output_.content) += text;
  if (!events.empty() && events.back().kind == kind) {
    events.back().text += text;
    return;
  }
  events.push_back({kind, std::move(text), 0});
}

// An event of the last call, recorded in the output: its start (the name), a piece of its
// arguments (joined to the piece before it in the same push), its end.
void ChatOutputParser::emit_call_event(std::vector<ChatOutputEvent>& events, ChatOutputEvent::Kind kind,
                                       std::string text) {
  if (kind == ChatOutputEvent::Kind::ToolCallStart) output_.tool_calls.push_back({text, "", false});
  const size_t index = output_.tool_calls.size() - 1;
  if (kind == ChatOutputEvent::Kind::ToolCallArguments) {
    if (text.empty()) return;
    output_.tool_calls.back().arguments += text;
    if (!events.empty() && events.back().kind == kind && events.back().call_index == index) {
      events.back().text += text;
      return;
    }
  }
  events.push_back({kind, std::move(text), index});
}

void ChatOutputParser::start_call(State state) {
  state_ = state;
  call_.emplace(syntax_.tool_calls, tools_);
  call_text_.clear();
  call_fed_ = close_search_from_ = 0;
  close_search_in_cdata_ = call_started_ = call_ended_ = false;
}

size_t ChatOutputParser::find_call_close() {
  const std::string_view close = call_close(syntax_.tool_calls);
  const bool cdata = syntax_.tool_calls == ToolCallSyntax::MiniCpmXml;
  size_t at = close_search_from_;
  while (true) {
    if (close_search_in_cdata_) {
      const size_t cdata_end = call_text_.find(kCdataClose, at);
      if (cdata_end == std::string::npos) {
        close_search_from_ = std::max(at, call_text_.size() - std::min(call_text_.size(), kCdataClose.size() - 1));
        return std::string::npos;
      }
      at = cdata_end + kCdataClose.size();
      close_search_in_cdata_ = false;
    }
    const size_t found = call_text_.find(close, at);
    const size_t cdata_open = cdata ? call_text_.find(kCdataOpen, at) : std::string::npos;
    if (found != std::string::npos && found < cdata_open) return found;
    if (cdata_open == std::string::npos) {
      // Neither marker starts before the last few bytes, which more text may complete.
      const size_t longest = std::max(close.size(), cdata ? kCdataOpen.size() : 0);
      close_search_from_ = std::max(at, call_text_.size() - std::min(call_text_.size(), longest - 1));
      return std::string::npos;
    }
    at = cdata_open + kCdataOpen.size();
    close_search_in_cdata_ = true;
  }
}

void ChatOutputParser::feed_call(std::vector<ChatOutputEvent>& events, size_t end) {
  if (call_ended_) return;
  if (end > call_fed_) call_->read(std::string_view(call_text_).substr(call_fed_, end - call_fed_));
  call_fed_ = std::max(call_fed_, end);
  if (!stream_calls_) return;
  if (!call_started_ && call_->name()) {
    emit_call_event(events, ChatOutputEvent::Kind::ToolCallStart, *call_->name());
    call_started_ = true;
  }
  if (!call_started_) return;
  emit_call_event(events, ChatOutputEvent::Kind::ToolCallArguments, call_->take_arguments());
  if (call_->broken()) {
    emit_call_event(events, ChatOutputEvent::Kind::ToolCallEnd, "");
    call_ended_ = true;
    skip_spaces_ = true;
  }
}

bool ChatOutputParser::read_call(std::vector<ChatOutputEvent>& events) {
  call_text_ += pending_;
  pending_.clear();
  if (state_ == State::WholeReply) {
    feed_call(events, call_text_.size());
    return false;
  }
  const std::string_view close = call_close(syntax_.tool_calls);
  const size_t close_at = find_call_close();
  if (close_at == std::string::npos) {
    // Held back: an end of the text that may be the closing marker's beginning.
    const std::array<std::string_view, 1> markers = {close};
    feed_call(events, call_text_.size() - partial_marker(call_text_, markers));
    return false;
  }
  pending_ = call_text_.substr(close_at + close.size());
  call_text_.resize(close_at);
  feed_call(events, close_at);
  end_call(events, true);
  return true;
}

// The open call's text ended (at its closing marker, or with the reply): it is a call, or content.
void ChatOutputParser::end_call(std::vector<ChatOutputEvent>& events, bool closed) {
  const bool whole_reply = state_ == State::WholeReply;
  state_ = State::Content;
  if (!call_ended_) {
    call_->end();
    feed_call(events, call_fed_);
  }
  if (call_started_) {
    if (!call_ended_) emit_call_event(events, ChatOutputEvent::Kind::ToolCallEnd, "");
    output_.tool_calls.back().complete = call_->complete();
  } else if (call_->complete()) {
    emit_call_event(events, ChatOutputEvent::Kind::ToolCallStart, *call_->name());
    emit_call_event(events, ChatOutputEvent::Kind::ToolCallArguments, call_->take_arguments());
    emit_call_event(events, ChatOutputEvent::Kind::ToolCallEnd, "");
    output_.tool_calls.back().complete = true;
  } else {
    emit(events, ChatOutputEvent::Kind::Content,
         whole_reply ? call_text_
                     : std::string(call_open(syntax_.tool_calls)) + call_text_ +
                           std::string(closed ? call_close(syntax_.tool_calls) : ""));
    call_.reset();
    return;
  }
  skip_spaces_ = true;
  call_.reset();
}

std::vector<ChatOutputEvent> ChatOutputParser::push(std::string_view text) {
  pending_ += text;
  std::vector<ChatOutputEvent> events;
  const std::string_view open = call_open(syntax_.tool_calls);
  while (true) {
    if (state_ == State::ToolCall || state_ == State::WholeReply) {
      if (!read_call(events)) return events;
      continue;
    }
    if (state_ == State::Content && syntax_.tool_calls == ToolCallSyntax::LlamaJson && !started_) {
      const size_t first = pending_.find_first_not_of(" \n\t\r");
      if (first == std::string::npos) return events;  // only spaces so far: undecided
      started_ = true;
      if (pending_[first] == '{') {
        start_call(State::WholeReply);
        continue;
      }
    }
    const bool reasoning = state_ == State::Reasoning;
    std::vector<std::string_view> markers;
    if (reasoning) {
      markers.push_back(kThinkClose);
    } else {
      if (syntax_.reasoning) markers.push_back(kThinkOpen);
      if (!open.empty()) markers.push_back(open);
    }
    const auto kind = reasoning ? ChatOutputEvent::Kind::Reasoning : ChatOutputEvent::Kind::Content;
    const auto [at, marker] = first_marker(pending_, markers);
    if (at == std::string::npos) {
      const size_t held = partial_marker(pending_, markers);
      emit(events, kind, pending_.substr(0, pending_.size() - held));
      pending_.erase(0, pending_.size() - held);
      return events;
    }
    emit(events, kind, pending_.substr(0, at));
    pending_.erase(0, at + marker.size());
    if (marker == open)
      start_call(State::ToolCall);
    else
      state_ = marker == kThinkOpen ? State::Reasoning : State::Content;
    if (marker == kThinkClose) skip_spaces_ = true;
    started_ = true;
  }
}

std::vector<ChatOutputEvent> ChatOutputParser::finish() {
  std::vector<ChatOutputEvent> events;
  switch (state_) {
    case State::Content: emit(events, ChatOutputEvent::Kind::Content, std::move(pending_)); break;
    case State::Reasoning: emit(events, ChatOutputEvent::Kind::Reasoning, std::move(pending_)); break;
    case State::ToolCall:
    case State::WholeReply:
      // What read_call held back as a possible closing marker stays out of the reader: a call
      // whose marker was cut short is whole without it.
      end_call(events, false);
      break;
  }
  pending_.clear();
  state_ = State::Content;
  return events;
}

}  // namespace kiln

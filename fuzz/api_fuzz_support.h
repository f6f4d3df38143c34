// What the API request targets share: the server's text codec over a small byte-level tokenizer
// and a fixed ChatML chat template with tools, tool calls and thinking, so that every field a
// request parser accepts reaches the template and the tokenizer as `kiln serve` would send it.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "fuzz_support.h"
#include "text/tokenizer_codec.h"
#include "tokenizer/unicode.h"

namespace kiln::fuzz {

// The model name the requests must give (seed requests use it).
inline const std::string kServedModel = "kiln-fuzz";

// ChatML, as Qwen models use it, written for these targets: a system prompt, tool schemas, tool
// results, tool calls with their arguments, reasoning content and the thinking switch.
inline constexpr const char* kChatTemplate = R"({%- if tools %}<|im_start|>system
{%- if messages and messages[0].role == 'system' %}
{{ messages[0].content }}
{%- endif %}
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% elif messages and messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}{{ raise_exception('the system message must come first') }}{% endif %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{%- if message.reasoning_content %}
<think>
{{ message.reasoning_content | trim }}
</think>
{%- endif %}
{{ message.content if message.content is string else message.content | tojson }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %})";

// A byte-level BPE tokenizer (GPT-2's byte alphabet, a few merges) with ChatML's special tokens.
inline nlohmann::json byte_level_tokenizer_json() {
  nlohmann::json vocab = nlohmann::json::object();
  for (int byte = 0; byte < 256; ++byte) {
    std::string token;
    unicode::append_utf8(token, unicode::byte_to_char()[byte]);
    vocab[token] = byte;
  }
  const nlohmann::json merges = nlohmann::json::array({"\xC4\xA0 t", "h e", "\xC4\xA0t he"});
  int next_id = 256;
  for (const char* merged : {"\xC4\xA0t", "he", "\xC4\xA0the"}) vocab[merged] = next_id++;
  nlohmann::json added = nlohmann::json::array();
  for (const char* special : {"<|im_start|>", "<|im_end|>", "<|endoftext|>"})
    added.push_back({{"id", next_id++}, {"content", special}, {"special", true}, {"normalized", false},
                     {"lstrip", false}, {"rstrip", false}, {"single_word", false}});
  const nlohmann::json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  return {{"version", "1.0"},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", byte_level},
          {"post_processor", byte_level},
          {"decoder", byte_level},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
}

// The codec a server over that tokenizer and template would use, built once per process.
inline const TokenizerCodec& api_codec() {
  static const TokenizerCodec codec = [] {
    const auto model_dir = ScratchDirectory::instance().path() / "model";
    std::filesystem::create_directories(model_dir);
    const auto& scratch = ScratchDirectory::instance();
    scratch.write("model/tokenizer.json", byte_level_tokenizer_json().dump());
    return TokenizerCodec(model_dir, std::string(kChatTemplate));
  }();
  return codec;
}

}  // namespace kiln::fuzz

// Beast 1.74 (Debian's Boost) asserts `n >= 5` when a final chunk's trailer arrives in small
// pieces, e.g. "0\r\n" then "\r": a wrong assertion (the code after it returns need_more correctly;
// fixed upstream in 2024 by boostorg/beast#2861). With assertions on, a client could abort
// a Debug server that way (fuzz/http_request_fuzz found it). This file is the only one that
// instantiates the request parser, so its assertions are off here alone; ASan still checks every
// access the parser makes.
#define BOOST_DISABLE_ASSERTS
#include "server/http_request_reader.h"

#include <algorithm>
#include <boost/beast/core/string.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/field.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>
#include <cctype>
#include <fmt/format.h>

#include "core/error.h"

namespace kiln::server {

namespace beast = boost::beast;
namespace http = beast::http;

struct HttpRequestReader::Parser {
  http::request_parser<http::string_body> beast;
};

HttpRequestReader::HttpRequestReader(size_t max_header_bytes, size_t max_body_bytes)
    : max_header_bytes_(max_header_bytes), max_body_bytes_(max_body_bytes) {
  take_ready_parser();
}

HttpRequestReader::~HttpRequestReader() = default;
HttpRequestReader::HttpRequestReader(HttpRequestReader&&) noexcept = default;
HttpRequestReader& HttpRequestReader::operator=(HttpRequestReader&&) noexcept = default;

void HttpRequestReader::take_ready_parser() {
  parser_ = std::make_unique<Parser>();
  parser_->beast.header_limit(static_cast<std::uint32_t>(std::min<size_t>(max_header_bytes_, UINT32_MAX)));
  parser_->beast.body_limit(max_body_bytes_);
  // The body is parsed in the same call as the header when both are there.
  parser_->beast.eager(true);
  unparsed_.clear();
  started_ = false;
  complete_ = false;
}

size_t HttpRequestReader::feed(std::string_view bytes) {
  if (complete_ || failed() || bytes.empty()) return 0;
  started_ = true;
  const size_t carried = unparsed_.size();
  unparsed_.append(bytes);
  size_t parsed = 0;
  auto& parser = parser_->beast;
  while (parsed < unparsed_.size() && !parser.is_done()) {
    boost::system::error_code ec;
    const size_t taken = parser.put(boost::asio::buffer(unparsed_.data() + parsed, unparsed_.size() - parsed), ec);
    parsed += taken;
    if (ec == http::error::need_more) break;
    if (ec == http::error::body_limit) {
      reject(413, fmt::format("the request body exceeds {} bytes", max_body_bytes_));
      return bytes.size();
    }
    if (ec == http::error::header_limit) {
      reject(431, fmt::format("the request headers exceed {} bytes", max_header_bytes_));
      return bytes.size();
    }
    if (ec) {
      reject(400, "malformed HTTP request: " + ec.message());
      return bytes.size();
    }
    if (taken == 0) break;
  }
  if (parser.is_done()) {
    complete_ = true;
    // The request ended inside `bytes`: the carried bytes were an unfinished part of it.
    const size_t taken = parsed > carried ? parsed - carried : 0;
    unparsed_.clear();
    return taken;
  }
  unparsed_.erase(0, parsed);
  // Beast bounds what it holds back of a header by the header limit, but not a chunk header
  // (its extensions) or the trailer after the last chunk: hold those to the same bound.
  if (parser.is_header_done() && unparsed_.size() > max_header_bytes_)
    reject(431, fmt::format("a chunk header or trailer of the request exceeds {} bytes", max_header_bytes_));
  return bytes.size();
}

void HttpRequestReader::reject(int status, std::string message) {
  error_status_ = status;
  error_message_ = std::move(message);
  unparsed_.clear();
}

bool HttpRequestReader::complete() const { return complete_; }
bool HttpRequestReader::failed() const { return error_status_ != 0; }
int HttpRequestReader::error_status() const { return error_status_; }
const std::string& HttpRequestReader::error_message() const { return error_message_; }

bool HttpRequestReader::expects_continue() const {
  const auto& parser = parser_->beast;
  return !complete_ && !failed() && parser.is_header_done() &&
         beast::iequals(parser.get()[http::field::expect], "100-continue");
}

unsigned HttpRequestReader::version() const {
  return parser_->beast.is_header_done() ? parser_->beast.get().version() : 11;
}

bool HttpRequestReader::keep_alive() const {
  return parser_->beast.is_header_done() && parser_->beast.get().keep_alive();
}

std::string HttpRequestReader::path() const {
  if (!parser_->beast.is_header_done()) return {};
  const std::string_view target(parser_->beast.get().target().data(), parser_->beast.get().target().size());
  return std::string(target.substr(0, target.find('?')));
}

HttpRequest HttpRequestReader::take() {
  if (!complete_) kiln::fail("HttpRequestReader::take() before a request is complete");
  http::request<http::string_body> message = parser_->beast.release();
  HttpRequest request;
  request.method = std::string(message.method_string());
  const std::string target(message.target());
  const size_t question = target.find('?');
  request.path = target.substr(0, question);
  if (question != std::string::npos) request.query = target.substr(question + 1);
  for (const auto& field : message) {
    std::string name(field.name_string());
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
    request.headers.emplace_back(std::move(name), std::string(field.value()));
  }
  request.body = std::move(message.body());
  take_ready_parser();
  return request;
}

}  // namespace kiln::server

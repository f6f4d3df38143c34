// kiln serve: the HTTP transport (keep-alive, timeouts, limits, disconnects), request validation,
// stop strings and metrics; then the real `kiln serve` process on a free loopback port, driven by
// raw HTTP here and by the official openai / Anthropic npm clients (tests/npm/server_client.mjs).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "core/error.h"
#include "http_test_client.h"
#include "npm_reference.h"
#include "server/anthropic_api.h"
#include "server/api_error.h"
#include "server/http_server.h"
#include "server/json_fields.h"
#include "server/metrics.h"
#include "server/cors.h"
#include "server/request_log.h"
#include "server/openai_api.h"
#include "engine/stop_matcher.h"
#include "serve_process.h"
#include "text/tokenizer_codec.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::server;
using namespace kiln::testing;
using namespace std::chrono_literals;
using json = nlohmann::ordered_json;

namespace {

HttpResponse plain_error(int status, const std::string& message, const std::string&) {
  return {status, "application/json", {}, json{{"error", {{"message", message}}}}.dump()};
}

// An HttpServer on a free loopback port with a handler given by the test.
struct TestHttpServer {
  explicit TestHttpServer(HttpHandler handler, HttpServerOptions options = {}) {
    options.host = "127.0.0.1";
    options.port = 0;
    server = std::make_unique<HttpServer>(options, std::move(handler), plain_error);
    server->start();
  }
  uint16_t port() const { return server->port(); }
  std::unique_ptr<HttpServer> server;
};

void echo(const HttpRequest& request, HttpExchange& exchange) {
  exchange.respond({200, "text/plain", {{"X-Path", request.path}}, request.method + " " + request.body});
}

TEST(ServerHttp, KeepAliveAndPipelinedRequestsShareOneConnection) {
  TestHttpServer server(echo);
  RawConnection connection(server.port());
  ASSERT_TRUE(connection.connected());
  ASSERT_TRUE(connection.send(http_request("POST", "/a", "one")));
  auto first = connection.read_response(5s);
  ASSERT_TRUE(first);
  EXPECT_EQ(first->status, 200);
  EXPECT_EQ(first->body, "POST one");
  // Two requests in one write: both answered, in order, on the same connection.
  ASSERT_TRUE(connection.send(http_request("POST", "/b?x=1", "two") + http_request("GET", "/c", "")));
  auto second = connection.read_response(5s);
  auto third = connection.read_response(5s);
  ASSERT_TRUE(second && third);
  EXPECT_EQ(second->body, "POST two");
  EXPECT_EQ(second->headers["x-path"], "/b");
  EXPECT_EQ(third->body, "GET ");
}

TEST(ServerHttp, HalfSentRequestDoesNotBlockOthersAndTimesOut) {
  HttpServerOptions options;
  options.request_timeout = 600ms;
  TestHttpServer server(echo, options);
  RawConnection stalled(server.port());
  ASSERT_TRUE(stalled.send("POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nonly part of it"));
  const auto start = std::chrono::steady_clock::now();
  auto other = http_exchange(server.port(), "POST", "/fast", "hello");
  ASSERT_TRUE(other);
  EXPECT_EQ(other->body, "POST hello");
  EXPECT_LT(std::chrono::steady_clock::now() - start, 500ms) << "a stalled client delayed another one";
  auto timed_out = stalled.read_response(5s);
  ASSERT_TRUE(timed_out) << "the stalled request was never answered";
  EXPECT_EQ(timed_out->status, 408);
  EXPECT_TRUE(stalled.closed_within(2s));
}

TEST(ServerHttp, OversizedBodyIs413AndMalformedHttpIs400) {
  HttpServerOptions options;
  options.max_body_bytes = 1024;
  TestHttpServer server(echo, options);
  auto too_large = http_exchange(server.port(), "POST", "/x", std::string(4096, 'a'));
  ASSERT_TRUE(too_large);
  EXPECT_EQ(too_large->status, 413);
  RawConnection garbage(server.port());
  ASSERT_TRUE(garbage.send("THIS IS NOT HTTP\r\n\r\n"));
  auto malformed = garbage.read_response(5s);
  ASSERT_TRUE(malformed);
  EXPECT_EQ(malformed->status, 400);
  EXPECT_TRUE(garbage.closed_within(2s));
  RawConnection bad_length(server.port());
  ASSERT_TRUE(bad_length.send("POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n"));
  auto bad = bad_length.read_response(5s);
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
}

TEST(ServerHttp, ExpectContinueGetsAnInterimResponse) {
  TestHttpServer server(echo);
  RawConnection connection(server.port());
  ASSERT_TRUE(connection.send("POST /x HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n"));
  auto interim = connection.read_response(5s);
  ASSERT_TRUE(interim);
  EXPECT_EQ(interim->status, 100);
  ASSERT_TRUE(connection.send("body"));
  auto final_response = connection.read_response(5s);
  ASSERT_TRUE(final_response);
  EXPECT_EQ(final_response->body, "POST body");
}

TEST(ServerHttp, StreamedResponseIsChunkedAndADisconnectIsSeen) {
  std::atomic<bool> handler_saw_disconnect{false};
  TestHttpServer server([&](const HttpRequest&, HttpExchange& exchange) {
    if (!exchange.start_stream(200, "text/event-stream", {})) return;
    // Writes until the client goes away (bounded: 10 s).
    for (int i = 0; i < 2000; ++i) {
      if (!exchange.write("data: tick\n\n") || exchange.client_gone()) {
        handler_saw_disconnect = true;
        return;
      }
      std::this_thread::sleep_for(5ms);
    }
  });
  {
    RawConnection connection(server.port());
    ASSERT_TRUE(connection.send(http_request("GET", "/stream", "")));
    ASSERT_TRUE(connection.read_until("data: tick\n\n", 5s));
    EXPECT_NE(connection.buffer().find("Transfer-Encoding: chunked"), std::string::npos);
  }
  for (int i = 0; i < 200 && !handler_saw_disconnect; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(handler_saw_disconnect) << "the handler did not notice the client leaving within 2 s";
}

TEST(ServerHttp, DisconnectIsSeenWhileAHandlerWaitsWithoutWriting) {
  std::atomic<bool> saw_disconnect{false};
  TestHttpServer server([&](const HttpRequest&, HttpExchange& exchange) {
    for (int i = 0; i < 500; ++i) {  // 5 s at most
      if (exchange.client_gone()) {
        saw_disconnect = true;
        break;
      }
      std::this_thread::sleep_for(10ms);
    }
    exchange.respond({200, "text/plain", {}, "late"});
  });
  {
    RawConnection connection(server.port());
    ASSERT_TRUE(connection.send(http_request("POST", "/wait", "{}")));
    std::this_thread::sleep_for(50ms);
  }
  for (int i = 0; i < 200 && !saw_disconnect; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(saw_disconnect);
}

TEST(ServerHttp, ConnectionsBeyondTheLimitGet503) {
  HttpServerOptions options;
  options.max_connections = 2;
  TestHttpServer server(echo, options);
  RawConnection first(server.port()), second(server.port());
  ASSERT_TRUE(first.connected() && second.connected());
  // Both are served (and stay open, idle), so the server has taken them.
  ASSERT_TRUE(first.send(http_request("GET", "/1", "")) && first.read_response(5s));
  ASSERT_TRUE(second.send(http_request("GET", "/2", "")) && second.read_response(5s));
  RawConnection third(server.port());
  auto refused = third.read_response(5s);
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 503);
  EXPECT_EQ(refused->headers["retry-after"], "1");
  first.close();
  second.close();
}

TEST(ServerHttp, StopAcceptingClosesIdleConnectionsAndCloseJoinsEverything) {
  TestHttpServer server(echo);
  RawConnection idle(server.port());
  ASSERT_TRUE(idle.send(http_request("GET", "/x", "")) && idle.read_response(5s));
  server.server->stop_accepting();
  EXPECT_TRUE(idle.closed_within(2s));
  RawConnection late(server.port());
  EXPECT_FALSE(late.connected() && late.send(http_request("GET", "/x", "")) && late.read_response(1s));
  server.server->close();
  EXPECT_EQ(server.server->open_connections(), 0u);
}

TEST(ServerHttp, RefusesToListenOnANonNumericHost) {
  HttpServerOptions options;
  options.host = "example.invalid";
  options.port = 0;
  EXPECT_THROW(HttpServer(options, echo, plain_error), Error);
}

// --- stop strings ---

std::string run_stops(const std::vector<std::string>& stops, const std::vector<std::string>& pieces,
                      std::optional<std::string>* matched = nullptr) {
  StopMatcher matcher(stops);
  std::string out;
  for (const auto& piece : pieces) {
    auto output = matcher.push(piece);
    out += output.text;
    if (output.matched) {
      if (matched) *matched = output.matched;
      return out;
    }
  }
  return out + matcher.flush();
}

TEST(ServerStopStrings, CutsAtTheEarliestMatchAcrossPieces) {
  std::optional<std::string> matched;
  EXPECT_EQ(run_stops({"END"}, {"Hello E", "N", "D world"}, &matched), "Hello ");
  EXPECT_EQ(matched, "END");
  EXPECT_EQ(run_stops({"world", "lo"}, {"Hello world"}, &matched), "Hel");
  EXPECT_EQ(matched, "lo");
  EXPECT_EQ(run_stops({"ab", "abc"}, {"xxab", "c"}, &matched), "xx");
}

TEST(ServerStopStrings, HoldsBackOnlyWhatCouldStartAStop) {
  StopMatcher matcher({"STOP"});
  EXPECT_EQ(matcher.push("abc ST").text, "abc ");  // "ST" may begin STOP
  EXPECT_EQ(matcher.push("x").text, "STx");        // it did not
  EXPECT_EQ(matcher.push("S").text, "");
  EXPECT_EQ(matcher.flush(), "S");  // the end: held text is output after all
  EXPECT_EQ(run_stops({"\n\n"}, {"line\n", "\n", "more"}), "line");
  EXPECT_EQ(run_stops({"é!"}, {"caf", "é", "?"}), "café?");
  EXPECT_EQ(run_stops({}, {"no ", "stops"}), "no stops");
}

// --- validation (the parsers alone; the same rules are driven over HTTP below) ---

struct ParseCase {
  const char* body;
  int status;
  const char* param;
};

int parse_status(const std::string& endpoint, const std::string& body, std::string* param) {
  try {
    const json parsed = parse_request_json(body);
    if (endpoint == "chat") parse_chat_completion_request(parsed, "m");
    if (endpoint == "completions") parse_completion_request(parsed, "m", 512);
    if (endpoint == "messages") parse_messages_request(parsed, "m");
    return 200;
  } catch (const ApiError& error) {
    if (param) *param = error.param();
    return error.status();
  }
}

TEST(ServerValidation, ChatRequestsAreCheckedFieldByField) {
  const std::vector<ParseCase> cases = {
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}]})", 200, ""},
      {R"({"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"temperature":0,"top_p":0.5,"top_k":-1,"min_p":0.1,"seed":-3,"stop":["a","b"],"max_tokens":5,"logprobs":true,"top_logprobs":3,"stream":true,"stream_options":{"include_usage":true},"chat_template_kwargs":{"enable_thinking":false},"user":"u","n":1})",
       200, ""},
      {R"({"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]},{"role":"tool","tool_call_id":"c","content":"r"}],"tools":[{"type":"function","function":{"name":"f","parameters":{}}}],"tool_choice":"auto"})",
       200, ""},
      {R"({"messages":[{"role":"user","content":"hi"}]})", 400, "model"},
      {R"({"model":"other","messages":[{"role":"user","content":"hi"}]})", 404, "model"},
      {R"({"model":"m"})", 400, "messages"},
      {R"({"model":"m","messages":[]})", 400, "messages"},
      {R"({"model":"m","messages":"hi"})", 400, "messages"},
      {R"({"model":"m","messages":[{"role":"wizard","content":"hi"}]})", 400, "messages[0].role"},
      {R"({"model":"m","messages":[{"role":"user"}]})", 400, "messages[0].content"},
      {R"({"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]})", 400,
       "messages[0].content[0].type"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi","colour":"red"}]})", 400, "messages[0].colour"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":"hot"})", 400, "temperature"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":3})", 400, "temperature"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"top_p":0})", 400, "top_p"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"top_k":2.5})", 400, "top_k"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":-1})", 400, "max_tokens"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1e30})", 400, "max_tokens"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":99999999999999999999})", 400,
       "max_tokens"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"max_completion_tokens":5})", 400,
       "max_tokens"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"stop":[""]})", 400, "stop"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"stop":[1]})", 400, "stop"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"seed":"1"})", 400, "seed"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"stream":"yes"})", 400, "stream"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"stream_options":{"include_usage":true}})", 400,
       "stream_options"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"top_logprobs":2})", 400, "top_logprobs"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"logprobs":true,"top_logprobs":21})", 400,
       "top_logprobs"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"n":2,"logit_bias":{"5":10,"7":-100},"presence_penalty":0.5,"frequency_penalty":-2,"repetition_penalty":1.1,"safety_identifier":"s","prompt_cache_key":"k"})",
       200, ""},
      {R"({"model":"m","messages":[{"role":"user","content":"hi","name":"ann"}],"user":"u","metadata":{"a":"b"},"store":false,"service_tier":"auto","parallel_tool_calls":true,"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":false}})",
       200, ""},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"n":0})", 400, "n"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"n":129})", 400, "n"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"logit_bias":{"x":1}})", 400, "logit_bias.x"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"logit_bias":{"-1":1}})", 400, "logit_bias.-1"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"logit_bias":{"5":101}})", 400, "logit_bias.5"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"logit_bias":{"5":"up"}})", 400, "logit_bias.5"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"logit_bias":[1]})", 400, "logit_bias"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"frequency_penalty":2.5})", 400, "frequency_penalty"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"repetition_penalty":0})", 400, "repetition_penalty"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_schema","json_schema":{}}})",
       400, "response_format.json_schema.name"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_schema","json_schema":{"name":"a","schema":{"not":{}}}}})",
       400, "response_format.json_schema.schema"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"response_format":{"type":"yaml"}})",
       400, "response_format.type"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"tool_choice":"required","tools":[{"type":"function","function":{"name":"f"}}]})",
       200, ""},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"tool_choice":"required"})", 400, "tool_choice"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"tool_choice":{"type":"function","function":{"name":"f","x":1}},"tools":[{"type":"function","function":{"name":"f"}}]})",
       400, "tool_choice.function.x"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{}}]})", 400,
       "tools[0].function.name"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":true})", 400,
       "chat_template_kwargs"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"frobnicate":1})", 400, "frobnicate"},
      {R"({"model":"m","messages":[{"role":"tool","content":"r"}]})", 400, "messages[0].tool_call_id"},
      {R"([1,2,3])", 400, ""},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],)", 400, ""},
      {"", 400, ""},
  };
  for (const auto& test : cases) {
    std::string param;
    EXPECT_EQ(parse_status("chat", test.body, &param), test.status) << test.body;
    EXPECT_EQ(param, test.param) << test.body;
  }
}

TEST(ServerValidation, CompletionAndMessagesRequests) {
  const std::vector<std::tuple<const char*, ParseCase>> cases = {
      {"completions", {R"({"model":"m","prompt":"Once"})", 200, ""}},
      {"completions", {R"({"model":"m","prompt":[1,2,3],"logprobs":2,"echo":false})", 200, ""}},
      {"completions", {R"({"model":"m","prompt":["Once"]})", 200, ""}},
      {"completions", {R"({"model":"m","prompt":["a","b"]})", 400, "prompt"}},
      {"completions", {R"({"model":"m","prompt":[1,600]})", 400, "prompt"}},
      {"completions", {R"({"model":"m","prompt":[-1]})", 400, "prompt"}},
      {"completions", {R"({"model":"m","prompt":{}})", 400, "prompt"}},
      {"completions", {R"({"model":"m","prompt":"x","logprobs":6})", 400, "logprobs"}},
      {"completions", {R"({"model":"m","prompt":"x","echo":true})", 400, "echo"}},
      {"completions", {R"({"model":"m","prompt":"x","best_of":3})", 400, "best_of"}},
      {"completions", {R"({"model":"m","prompt":"x","best_of":3,"n":2})", 400, "best_of"}},
      {"completions", {R"({"model":"m","prompt":"x","best_of":2,"n":2,"presence_penalty":1,"logit_bias":{"3":5}})", 200, ""}},
      {"messages",
       {R"({"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}],"presence_penalty":1})", 400,
        "presence_penalty"}},
      {"messages",
       {R"({"model":"m","max_tokens":5,"system":[{"type":"text","text":"s","cache_control":{"type":"ephemeral"}}],"messages":[{"role":"user","content":[{"type":"text","text":"hi","cache_control":{"type":"ephemeral"}}]}],"tools":[{"name":"f","input_schema":{"type":"object"},"cache_control":{"type":"ephemeral"}}]})",
        200, ""}},
      {"messages",
       {R"({"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}],"system":"be brief","stop_sequences":["x"],"temperature":1,"top_k":5,"stream":true,"metadata":{"user_id":"u"}})",
        200, ""}},
      {"messages",
       {R"({"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]},{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"f","input":{}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"ok"}]}],"tools":[{"name":"f","input_schema":{"type":"object"}}],"thinking":{"type":"disabled"}})",
        200, ""}},
      {"messages", {R"({"model":"m","messages":[{"role":"user","content":"hi"}]})", 400, "max_tokens"}},
      {"messages", {R"({"model":"m","max_tokens":0,"messages":[{"role":"user","content":"hi"}]})", 400, "max_tokens"}},
      {"messages",
       {R"({"model":"m","max_tokens":5,"messages":[{"role":"system","content":"hi"}]})", 400, "messages[0].role"}},
      {"messages",
       {R"({"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}],"temperature":1.5})", 400,
        "temperature"}},
      {"messages",
       {R"({"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}],"stop_sequences":"x"})", 400,
        "stop_sequences"}},
      {"messages",
       {R"({"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"image","source":{}}]}]})", 400,
        "messages[0].content[0].type"}},
      {"messages",
       {R"({"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}],"tool_choice":{"type":"any"}})", 400,
        "tool_choice"}},
  };
  for (const auto& [endpoint, test] : cases) {
    std::string param;
    EXPECT_EQ(parse_status(endpoint, test.body, &param), test.status) << endpoint << " " << test.body;
    EXPECT_EQ(param, test.param) << endpoint << " " << test.body;
  }
}

TEST(ServerValidation, DeeplyNestedJsonIsRefusedBeforeAnyWalk) {
  std::string deep = std::string(100000, '[') + std::string(100000, ']');
  EXPECT_EQ(parse_status("chat", deep, nullptr), 400);
  EXPECT_EQ(parse_status("chat", R"({"a":)" + std::string(70, '[') + std::string(70, ']') + "}", nullptr), 400);
}

TEST(ServerValidation, ContextBudget) {
  EXPECT_EQ(completion_budget(10, std::nullopt, 512, "messages", "max_tokens"), 502);
  EXPECT_EQ(completion_budget(10, 502, 512, "messages", "max_tokens"), 502);
  try {
    completion_budget(10, 503, 512, "messages", "max_tokens");
    FAIL() << "no error for a completion past the context";
  } catch (const ApiError& error) {
    EXPECT_EQ(error.param(), "max_tokens");
    EXPECT_NE(std::string(error.what()).find("512"), std::string::npos) << error.what();
  }
  try {
    completion_budget(512, std::nullopt, 512, "prompt", "max_tokens");
    FAIL() << "no error for a prompt that fills the context";
  } catch (const ApiError& error) {
    EXPECT_EQ(error.param(), "prompt");
    EXPECT_NE(std::string(error.what()).find("the prompt has 512 tokens"), std::string::npos) << error.what();
  }
}

TEST(Cors, LoopbackPagesAndListedOriginsAreAllowedAndPreflightsAnswered) {
  CorsPolicy policy;
  policy.allowed_origins = {"https://app.example"};
  for (const char* origin : {"http://localhost:5173", "http://127.0.0.1", "https://[::1]:8443", "https://app.example"})
    EXPECT_TRUE(policy.allows(origin)) << origin;
  for (const char* origin : {"https://evil.example", "http://localhost.evil.example", "null", "http://app.example",
                             "https://app.example:444", "file://localhost"})
    EXPECT_FALSE(policy.allows(origin)) << origin;
  policy.allow_loopback_origins = false;
  EXPECT_FALSE(policy.allows("http://localhost:5173"));
  policy.allowed_origins = {"*"};
  EXPECT_TRUE(policy.allows("https://evil.example"));

  HttpRequest preflight{"OPTIONS", "/v1/chat/completions", "",
                        {{"origin", "https://web.example"},
                         {"access-control-request-method", "POST"},
                         {"access-control-request-headers", "authorization, content-type"}},
                        ""};
  const std::optional<HttpResponse> answer = policy.preflight(preflight);
  ASSERT_TRUE(answer);
  EXPECT_EQ(answer->status, 204);
  const auto header = [&](const std::string& name) {
    for (const auto& [key, value] : answer->headers)
      if (key == name) return value;
    return std::string();
  };
  EXPECT_EQ(header("Access-Control-Allow-Origin"), "https://web.example");
  EXPECT_EQ(header("Access-Control-Allow-Headers"), "authorization, content-type");
  EXPECT_NE(header("Access-Control-Allow-Methods").find("POST"), std::string::npos);
  policy.allowed_origins.clear();
  const std::optional<HttpResponse> refused = policy.preflight(preflight);
  ASSERT_TRUE(refused);
  EXPECT_TRUE(refused->headers.empty()) << "a refused origin gets no grant";
  preflight.headers.pop_back();
  preflight.headers.pop_back();
  EXPECT_FALSE(policy.preflight(preflight)) << "an OPTIONS without Access-Control-Request-Method is no preflight";
}

TEST(RequestLog, OneLineOfTextOrJsonPerRequest) {
  RequestRecord record;
  record.id = 7;
  record.method = "POST";
  record.path = "/v1/chat/completions";
  record.status = 200;
  record.stream = true;
  record.prompt_tokens = 15;
  record.generated_tokens = 32;
  record.cached_tokens = 0;
  record.time_to_first_token_seconds = 0.0123;
  EXPECT_EQ(format_request_log(record, 0.2105, LogFormat::Text),
            "request 7 POST /v1/chat/completions 200 prompt=15 generated=32 cached=0 stream ttft=12.3ms "
            "duration=210.5ms");
  const json line = json::parse(format_request_log(record, 0.2105, LogFormat::Json));
  EXPECT_EQ(line["request_id"], 7);
  EXPECT_EQ(line["status"], 200);
  EXPECT_EQ(line["generated_tokens"], 32);
  EXPECT_EQ(line["cached_tokens"], 0);
  EXPECT_NEAR(line["time_to_first_token_ms"].get<double>(), 12.3, 1e-9);
  EXPECT_NEAR(line["duration_ms"].get<double>(), 210.5, 1e-9);
  RequestRecord refused;
  refused.id = 8;
  refused.method = "GET";
  refused.path = "/nowhere";
  refused.status = 404;
  EXPECT_EQ(format_request_log(refused, 0.001, LogFormat::Text), "request 8 GET /nowhere 404 duration=1.0ms");
  EXPECT_FALSE(json::parse(format_request_log(refused, 0.001, LogFormat::Json)).contains("prompt_tokens"));
  EXPECT_THROW(parse_log_format("xml"), Error);
}

TEST(ServerMetrics, PrometheusTextHasCountersGaugesAndHistograms) {
  ServerMetrics metrics("stories\"260K");
  metrics.count_request("chat", FinishReason::Stop);
  metrics.count_request("chat", FinishReason::Stop);
  metrics.count_response(200);
  metrics.add_tokens(7, 3);
  metrics.observe_time_to_first_token(0.003);
  metrics.observe_inter_token_latency(0.0004);
  SchedulerStats stats;
  stats.waiting = 2;
  stats.cache_tokens_used = 128;
  stats.cache_tokens_total = 512;
  const std::string text = metrics.render(stats);
  EXPECT_NE(text.find("kiln_requests_total{model_name=\"stories\\\"260K\",endpoint=\"chat\",finish_reason=\"stop\"} 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kiln_prompt_tokens_total{model_name=\"stories\\\"260K\"} 7\n"), std::string::npos);
  EXPECT_NE(text.find("kiln_requests_waiting{model_name=\"stories\\\"260K\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("kiln_kv_cache_usage_ratio{model_name=\"stories\\\"260K\"} 0.25\n"), std::string::npos);
  EXPECT_NE(text.find("kiln_time_to_first_token_seconds_bucket{model_name=\"stories\\\"260K\",le=\"0.0025\"} 0\n"), std::string::npos);
  EXPECT_NE(text.find("kiln_time_to_first_token_seconds_bucket{model_name=\"stories\\\"260K\",le=\"0.005\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("kiln_inter_token_latency_seconds_count{model_name=\"stories\\\"260K\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE kiln_time_to_first_token_seconds histogram\n"), std::string::npos);
}

// --- the real `kiln serve` process (ServeProcess: serve_process.h) ---

// One server shared by the tests that do not stop it.
class ServerEndToEnd : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(kiln_binary())) return;
    server_ = new ServeProcess(
        stories_arguments(stories_dir(), {"--max-batch", "8", "--request-timeout", "2"}));
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    KILN_REQUIRE_STORIES(dir);
    ASSERT_NE(server_->port(), 0) << "kiln serve did not start:\n" << server_->log();
    port_ = server_->port();
  }
  static ServeProcess* server_;
  uint16_t port_ = 0;
};
ServeProcess* ServerEndToEnd::server_ = nullptr;

TEST_F(ServerEndToEnd, HealthModelsAndMetrics) {
  auto health = http_exchange(port_, "GET", "/health", "");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  auto models = http_exchange(port_, "GET", "/v1/models", "");
  ASSERT_TRUE(models);
  const json list = json::parse(models->body);
  EXPECT_EQ(list["data"][0]["id"], "stories260K");
  EXPECT_EQ(list["data"][0]["max_model_len"], 512);
  auto metrics = http_exchange(port_, "GET", "/metrics", "");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->headers["content-type"].find("text/plain"), std::string::npos);
  for (const char* name :
       {"kiln_requests_waiting", "kiln_kv_cache_usage_ratio", "kiln_time_to_first_token_seconds_bucket",
        "kiln_inter_token_latency_seconds_bucket", "kiln_generation_tokens_total"})
    EXPECT_NE(metrics->body.find(name), std::string::npos) << name;
  EXPECT_NE(server_->log().find("ready in"), std::string::npos) << "the load time is not logged";
}

TEST_F(ServerEndToEnd, EachRequestIsOneLogLineAndBrowsersFromLoopbackPagesMayCall) {
  auto response = http_exchange(port_, "POST", "/v1/completions",
                                json{{"model", "stories260K"}, {"prompt", "The fox"}, {"max_tokens", 5},
                                     {"ignore_eos", true}}.dump(),
                                "Origin: http://localhost:5173\r\n");
  ASSERT_TRUE(response);
  EXPECT_EQ(response->status, 200);
  EXPECT_EQ(response->headers["access-control-allow-origin"], "http://localhost:5173");
  const std::regex line(R"(kiln: request \d+ POST /v1/completions 200 prompt=5 generated=5 cached=0 ttft=[0-9.]+ms )"
                        R"(duration=[0-9.]+ms\n)");
  bool logged = false;
  for (int i = 0; i < 50 && !logged; ++i) {
    logged = std::regex_search(server_->log(), line);
    if (!logged) std::this_thread::sleep_for(20ms);
  }
  EXPECT_TRUE(logged) << server_->log();
  auto preflight = http_exchange(port_, "OPTIONS", "/v1/chat/completions", "",
                                 "Origin: http://127.0.0.1:3000\r\nAccess-Control-Request-Method: POST\r\n");
  ASSERT_TRUE(preflight);
  EXPECT_EQ(preflight->status, 204);
  EXPECT_EQ(preflight->headers["access-control-allow-origin"], "http://127.0.0.1:3000");
  auto foreign = http_exchange(port_, "GET", "/v1/models", "", "Origin: https://elsewhere.example\r\n");
  ASSERT_TRUE(foreign);
  EXPECT_EQ(foreign->status, 200);
  EXPECT_EQ(foreign->headers.count("access-control-allow-origin"), 0u);
}

TEST_F(ServerEndToEnd, UsageCountsThePromptAfterTemplatingAndEveryGeneratedToken) {
  KILN_REQUIRE_STORIES(dir);
  std::ifstream template_file(stories_dir() / "chat_template.jinja");
  const TokenizerCodec codec(dir, std::string(std::istreambuf_iterator<char>(template_file), {}));
  const json messages = {{{"role", "system"}, {"content", "A story."}}, {{"role", "user"}, {"content", "The dog ran"}}};
  const size_t expected_prompt = codec.encode(codec.render_chat(messages, {}), false).size();
  auto response = post(port_, "/v1/chat/completions",
                       {{"model", "stories260K"},
                        {"messages", messages},
                        {"max_tokens", 17},
                        {"ignore_eos", true},
                        {"temperature", 0.5},
                        {"seed", 3}});
  ASSERT_TRUE(response);
  ASSERT_EQ(response->status, 200) << response->body;
  const json body = json::parse(response->body);
  EXPECT_EQ(body["usage"]["prompt_tokens"], expected_prompt);
  EXPECT_EQ(body["usage"]["completion_tokens"], 17);
  EXPECT_EQ(body["usage"]["total_tokens"], expected_prompt + 17);
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
}

struct BadRequest {
  std::string path;
  std::string body;
  int status;
  std::string param;  // expected `param` (OpenAI), "" to skip the check
};

// The `data:` payloads of an SSE body, in order, with [DONE] counted apart.
std::vector<json> sse_payloads(const std::string& body, int* done = nullptr) {
  std::vector<json> payloads;
  size_t start = 0;
  while ((start = body.find("data: ", start)) != std::string::npos) {
    const size_t end = body.find("\n\n", start);
    const std::string data = body.substr(start + 6, end - start - 6);
    start = end;
    if (data == "[DONE]") {
      if (done) ++*done;
      continue;
    }
    payloads.push_back(json::parse(data));
  }
  return payloads;
}

// n choices: indexes 0..n-1, each its own stream from (seed, index), so the same request gives the
// same choices, choice 0 is the request without n, and the stream carries each choice's deltas
// under its index; usage counts the prompt once.
TEST_F(ServerEndToEnd, NChoicesAreSeededPerChoiceAndStreamedByIndex) {
  const json request = {{"model", "stories260K"}, {"prompt", "Once upon a time"}, {"max_tokens", 12},
                        {"ignore_eos", true},     {"temperature", 1.0},               {"seed", 7},
                        {"n", 3}};
  auto first = post(port_, "/v1/completions", request);
  ASSERT_TRUE(first);
  ASSERT_EQ(first->status, 200) << first->body;
  const json body = json::parse(first->body);
  ASSERT_EQ(body["choices"].size(), 3u);
  std::vector<std::string> texts;
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(body["choices"][i]["index"], i);
    EXPECT_EQ(body["choices"][i]["finish_reason"], "length");
    texts.push_back(body["choices"][i]["text"]);
  }
  EXPECT_FALSE(texts[0] == texts[1] && texts[1] == texts[2]) << "every choice drew the same stream";
  const int64_t prompt_tokens = body["usage"]["prompt_tokens"];
  EXPECT_EQ(body["usage"]["completion_tokens"], 36);
  EXPECT_EQ(body["usage"]["total_tokens"], prompt_tokens + 36);

  auto again = post(port_, "/v1/completions", request);
  ASSERT_TRUE(again);
  EXPECT_EQ(json::parse(again->body)["choices"], body["choices"]) << "the same request and seed gave other choices";
  json single = request;
  single.erase("n");
  auto one = post(port_, "/v1/completions", single);
  ASSERT_TRUE(one);
  EXPECT_EQ(json::parse(one->body)["choices"][0]["text"], texts[0]);

  json streamed = request;
  streamed["stream"] = true;
  streamed["stream_options"] = {{"include_usage", true}};
  auto stream = post(port_, "/v1/completions", streamed);
  ASSERT_TRUE(stream);
  ASSERT_EQ(stream->status, 200) << stream->body;
  int done = 0;
  std::vector<std::string> pieces(3);
  std::vector<int> finishes(3, 0);
  json usage;
  for (const json& chunk : sse_payloads(stream->body, &done)) {
    if (!chunk["usage"].is_null()) usage = chunk["usage"];
    for (const json& choice : chunk["choices"]) {
      const size_t index = choice["index"];
      ASSERT_LT(index, 3u);
      pieces[index] += choice["text"].get<std::string>();
      if (!choice["finish_reason"].is_null()) ++finishes[index];
    }
  }
  EXPECT_EQ(pieces, texts);
  EXPECT_EQ(finishes, std::vector<int>(3, 1));
  EXPECT_EQ(done, 1);
  EXPECT_EQ(usage["prompt_tokens"], prompt_tokens);
  EXPECT_EQ(usage["completion_tokens"], 36);

  auto chat = post(port_, "/v1/chat/completions",
                   chat_body("The cat", 6, {{"n", 2}, {"temperature", 0.9}, {"seed", 3}, {"ignore_eos", true}, {"stream", true}}));
  ASSERT_TRUE(chat);
  std::vector<int> roles(2, 0), chat_finishes(2, 0);
  for (const json& chunk : sse_payloads(chat->body)) {
    ASSERT_EQ(chunk["choices"].size(), 1u) << chunk.dump();
    const json& choice = chunk["choices"][0];
    const size_t index = choice["index"];
    ASSERT_LT(index, 2u);
    if (choice["delta"].contains("role")) ++roles[index];
    if (!choice["finish_reason"].is_null()) ++chat_finishes[index];
  }
  EXPECT_EQ(roles, std::vector<int>(2, 1));
  EXPECT_EQ(chat_finishes, std::vector<int>(2, 1));
}

// logit_bias and the penalties through the server: a +100 bias makes greedy decoding repeat the
// token while its logprob stays the unprocessed distribution's; a penalised seeded request gives
// the same text alone and among others.
TEST_F(ServerEndToEnd, LogitBiasAndPenaltiesKeepTheSeedContract) {
  auto tokenized = post(port_, "/tokenize", {{"prompt", " dog"}, {"add_special_tokens", false}});
  ASSERT_TRUE(tokenized);
  ASSERT_EQ(tokenized->status, 200) << tokenized->body;
  const int32_t dog = json::parse(tokenized->body)["tokens"].back();
  auto biased = post(port_, "/v1/completions",
                     {{"model", "stories260K"}, {"prompt", "Once upon a time"}, {"max_tokens", 5}, {"ignore_eos", true},
                      {"temperature", 0}, {"logprobs", 1}, {"logit_bias", {{std::to_string(dog), 100}}}});
  ASSERT_TRUE(biased);
  ASSERT_EQ(biased->status, 200) << biased->body;
  const json logprobs = json::parse(biased->body)["choices"][0]["logprobs"];
  ASSERT_EQ(logprobs["tokens"].size(), 5u);
  double lowest = 0;
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(logprobs["tokens"][i], logprobs["tokens"][0]);
    lowest = std::min(lowest, logprobs["token_logprobs"][i].get<double>());
  }
  EXPECT_LT(lowest, -0.01) << "the logprobs are the biased distribution's, not the model's";

  const json penalised = {{"model", "stories260K"}, {"prompt", "The little dog"}, {"max_tokens", 40},
                          {"ignore_eos", true},     {"temperature", 0.8},       {"seed", 11},
                          {"presence_penalty", 1.0}, {"frequency_penalty", 0.5}, {"repetition_penalty", 1.3},
                          {"logit_bias", {{std::to_string(dog), 3}}}};
  auto alone = post(port_, "/v1/completions", penalised);
  ASSERT_TRUE(alone);
  ASSERT_EQ(alone->status, 200) << alone->body;
  const std::string text = json::parse(alone->body)["choices"][0]["text"];
  json plain = penalised;
  for (const char* field : {"presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"})
    plain.erase(field);
  auto unpenalised = post(port_, "/v1/completions", plain);
  ASSERT_TRUE(unpenalised);
  EXPECT_NE(json::parse(unpenalised->body)["choices"][0]["text"], text) << "the penalties changed nothing";

  std::vector<std::thread> others;
  for (int i = 0; i < 3; ++i)
    others.emplace_back([&, i] {
      post(port_, "/v1/completions",
           {{"model", "stories260K"}, {"prompt", "A cat " + std::to_string(i)}, {"max_tokens", 60}, {"ignore_eos", true},
            {"temperature", 1.0}, {"presence_penalty", 0.5}});
    });
  auto batched = post(port_, "/v1/completions", penalised);
  for (auto& other : others) other.join();
  ASSERT_TRUE(batched);
  EXPECT_EQ(json::parse(batched->body)["choices"][0]["text"], text) << "batched, the penalised request changed";
}

TEST_F(ServerEndToEnd, TokenizeDetokenizeAndCountTokens) {
  KILN_REQUIRE_STORIES(dir);
  std::ifstream template_file(stories_dir() / "chat_template.jinja");
  const TokenizerCodec codec(dir, std::string(std::istreambuf_iterator<char>(template_file), {}));
  const std::string text = "The cat sat on the mat.";
  auto tokenized = post(port_, "/tokenize", {{"model", "stories260K"}, {"prompt", text}});
  ASSERT_TRUE(tokenized);
  ASSERT_EQ(tokenized->status, 200) << tokenized->body;
  json body = json::parse(tokenized->body);
  const std::vector<int32_t> with_specials = codec.encode(text, true);
  EXPECT_EQ(body["tokens"].get<std::vector<int32_t>>(), with_specials);
  EXPECT_EQ(body["count"], with_specials.size());
  EXPECT_EQ(body["max_model_len"], 512);

  auto bare = post(port_, "/tokenize", {{"prompt", text}, {"add_special_tokens", false}, {"return_token_strs", true}});
  ASSERT_TRUE(bare);
  body = json::parse(bare->body);
  const std::vector<int32_t> ids = codec.encode(text, false);
  EXPECT_EQ(body["tokens"].get<std::vector<int32_t>>(), ids);
  ASSERT_EQ(body["token_strs"].size(), ids.size());
  EXPECT_EQ(body["token_strs"][1], codec.token_text(ids[1]));

  const json messages = {{{"role", "system"}, {"content", "A story."}}, {{"role", "user"}, {"content", "The dog ran"}}};
  const size_t chat_tokens = codec.encode(codec.render_chat(messages, {}), false).size();
  auto conversation = post(port_, "/tokenize", {{"messages", messages}});
  ASSERT_TRUE(conversation);
  ASSERT_EQ(conversation->status, 200) << conversation->body;
  EXPECT_EQ(json::parse(conversation->body)["count"], chat_tokens);

  auto detokenized = post(port_, "/detokenize", {{"tokens", ids}});
  ASSERT_TRUE(detokenized);
  ASSERT_EQ(detokenized->status, 200) << detokenized->body;
  EXPECT_EQ(json::parse(detokenized->body)["prompt"], codec.decode(ids));
  EXPECT_NE(json::parse(detokenized->body)["prompt"].get<std::string>().find("cat sat on the mat."), std::string::npos);

  auto counted = post(port_, "/v1/messages/count_tokens",
                      {{"model", "stories260K"},
                       {"system", "A story."},
                       {"messages", {{{"role", "user"}, {"content", "The dog ran"}}}}});
  ASSERT_TRUE(counted);
  ASSERT_EQ(counted->status, 200) << counted->body;
  EXPECT_EQ(json::parse(counted->body), json({{"input_tokens", chat_tokens}}));

  const std::vector<BadRequest> bad = {
      {"/tokenize", R"({"model":"stories260K"})", 400, "prompt"},
      {"/tokenize", R"({"prompt":"a","messages":[{"role":"user","content":"b"}]})", 400, "messages"},
      {"/tokenize", R"({"prompt":"a","model":"other"})", 404, "model"},
      {"/detokenize", R"({"tokens":[1,99999]})", 400, "tokens[1]"},
      {"/detokenize", R"({"tokens":"1"})", 400, "tokens"},
      {"/v1/messages/count_tokens",
       R"({"model":"stories260K","max_tokens":5,"messages":[{"role":"user","content":"hi"}]})", 400, ""},
  };
  for (const auto& test : bad) {
    auto response = http_exchange(port_, "POST", test.path, test.body);
    ASSERT_TRUE(response);
    EXPECT_EQ(response->status, test.status) << test.body << "\n" << response->body;
    const json error = json::parse(response->body);
    if (test.path == "/v1/messages/count_tokens")
      EXPECT_EQ(error["type"], "error") << response->body;
    else
      EXPECT_EQ(error["error"]["param"], test.param) << response->body;
  }
}


TEST_F(ServerEndToEnd, MalformedRequestsGetClearErrorsAndNeverHurtTheServer) {
  const std::string long_prompt = [] {
    std::string text;
    for (int i = 0; i < 400; ++i) text += "Once upon a time there was a dog. ";
    return text;
  }();
  const std::string chat = "/v1/chat/completions";
  auto with = [](json body, const std::string& key, json value) {
    body[key] = std::move(value);
    return body.dump();
  };
  const json ok = chat_body("The cat", 8);
  const std::vector<BadRequest> cases = {
      {chat, "{", 400, ""},
      {chat, "not json at all", 400, ""},
      {chat, "[]", 400, ""},
      {chat, "\"a string\"", 400, ""},
      {chat, "", 400, ""},
      {chat, R"({"model":"stories260K","messages":[{"role":"user","content":"hi"}]} trailing)", 400, ""},
      {chat, std::string(200, '[') + std::string(200, ']'), 400, ""},
      {chat, "{\"model\":\"stories260K\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}", 400, ""},
      {chat, R"({"model":"stories260K"})", 400, "messages"},
      {chat, with(ok, "messages", "hi"), 400, "messages"},
      {chat, with(ok, "messages", json::array()), 400, "messages"},
      {chat, with(ok, "messages", {{{"role", 5}, {"content", "hi"}}}), 400, "messages[0].role"},
      {chat, with(ok, "messages", {{{"role", "user"}, {"content", 5}}}), 400, "messages[0].content"},
      {chat, with(ok, "model", 7), 400, "model"},
      {chat, with(ok, "model", "gpt-4"), 404, "model"},
      {chat, with(ok, "temperature", "warm"), 400, "temperature"},
      {chat, with(ok, "temperature", -1), 400, "temperature"},
      {chat, with(ok, "top_p", 1.5), 400, "top_p"},
      {chat, with(ok, "top_k", "ten"), 400, "top_k"},
      {chat, with(ok, "min_p", 2), 400, "min_p"},
      {chat, with(ok, "max_tokens", -5), 400, "max_tokens"},
      {chat, with(ok, "max_tokens", 0), 400, "max_tokens"},
      {chat, with(ok, "max_tokens", 1e12), 400, "max_tokens"},
      {chat, with(ok, "max_tokens", 4000000000LL), 400, "max_tokens"},
      {chat, with(ok, "max_tokens", 100000), 400, "max_tokens"},
      {chat, with(ok, "max_tokens", "10"), 400, "max_tokens"},
      {chat, with(ok, "seed", 1.5), 400, "seed"},
      {chat, with(ok, "stop", 5), 400, "stop"},
      {chat, with(ok, "stop", json::array({"a", 1})), 400, "stop"},
      {chat, with(ok, "stream", 1), 400, "stream"},
      {chat, with(ok, "logprobs", "true"), 400, "logprobs"},
      {chat, with(ok, "n", 0), 400, "n"},
      {chat, with(ok, "logit_bias", {{"512", 5}}), 400, "logit_bias"},
      {chat, with(ok, "presence_penalty", 9), 400, "presence_penalty"},
      {chat, with(ok, "response_format", {{"type", "json_object"}, {"schema", {}}}), 400, "response_format.schema"},
      {chat, with(ok, "tools", "all"), 400, "tools"},
      {chat, with(ok, "tool_choice", {{"type", "function"}, {"function", {{"name", "f"}}}}), 400, "tool_choice"},
      {chat, with(ok, "chat_template_kwargs", json::array()), 400, "chat_template_kwargs"},
      {chat, with(ok, "mystery_option", true), 400, "mystery_option"},
      {chat, with(ok, "messages", {{{"role", "user"}, {"content", long_prompt}}}), 400, "messages"},
      {"/v1/completions", R"({"model":"stories260K"})", 400, "prompt"},
      {"/v1/completions", R"({"model":"stories260K","prompt":[1,2,99999]})", 400, "prompt"},
      {"/v1/completions", R"({"model":"stories260K","prompt":["a","b"]})", 400, "prompt"},
      {"/v1/completions", json{{"model", "stories260K"}, {"prompt", long_prompt}}.dump(), 400, "prompt"},
      {"/v1/completions", R"({"model":"stories260K","prompt":"hi","max_tokens":-1})", 400, "max_tokens"},
      {"/v1/messages", R"({"model":"stories260K","messages":[{"role":"user","content":"hi"}]})", 400, ""},
      {"/v1/messages", R"({"model":"stories260K","max_tokens":"5","messages":[{"role":"user","content":"hi"}]})", 400,
       ""},
      {"/v1/messages",
       R"({"model":"stories260K","max_tokens":5,"messages":[{"role":"user","content":[{"type":"image"}]}]})", 400, ""},
      {"/v1/messages", "{oops", 400, ""},
      {"/v1/nothing", "{}", 404, ""},
      // A generation model's hidden states are no embedding: only kiln serve --embeddings answers.
      {"/v1/embeddings", R"({"model":"stories260K","input":"hi"})", 400, ""},
  };
  for (const auto& test : cases) {
    auto response = http_exchange(port_, "POST", test.path, test.body);
    ASSERT_TRUE(response) << "no response to " << test.body.substr(0, 200);
    EXPECT_EQ(response->status, test.status) << test.body.substr(0, 200) << "\n" << response->body;
    const json error = json::parse(response->body, nullptr, false);
    ASSERT_TRUE(error.is_object()) << response->body;
    if (test.path == "/v1/messages") {
      EXPECT_EQ(error["type"], "error") << response->body;
      EXPECT_EQ(error["error"]["type"], "invalid_request_error") << response->body;
      EXPECT_TRUE(error["error"]["message"].is_string());
    } else {
      ASSERT_TRUE(error.contains("error")) << response->body;
      EXPECT_FALSE(error["error"]["message"].get<std::string>().empty());
      EXPECT_TRUE(error["error"]["type"].is_string());
      if (!test.param.empty()) {
        EXPECT_EQ(error["error"]["param"], test.param) << response->body;
      }
    }
  }
  EXPECT_GE(cases.size(), 30u);
  // The context error names both lengths.
  auto overflow = http_exchange(port_, "POST", chat, with(ok, "max_tokens", 100000));
  ASSERT_TRUE(overflow);
  EXPECT_NE(overflow->body.find("512"), std::string::npos) << overflow->body;
  // Wrong method; and the server still answers.
  auto wrong_method = http_exchange(port_, "GET", chat, "");
  ASSERT_TRUE(wrong_method);
  EXPECT_EQ(wrong_method->status, 405);
  auto still = post(port_, chat, ok);
  ASSERT_TRUE(still);
  EXPECT_EQ(still->status, 200) << still->body;
}

TEST_F(ServerEndToEnd, HalfSentRequestDoesNotBlockOthers) {
  RawConnection stalled(port_);
  ASSERT_TRUE(stalled.send("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"model\":"));
  const auto start = std::chrono::steady_clock::now();
  auto response = post(port_, "/v1/chat/completions", chat_body("The cat", 16));
  ASSERT_TRUE(response);
  EXPECT_EQ(response->status, 200) << response->body;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1500ms);
  auto timed_out = stalled.read_response(5s);  // --request-timeout 2
  ASSERT_TRUE(timed_out);
  EXPECT_EQ(timed_out->status, 408);
}

// Sends a sampled chat stream of `max_tokens` that ignores end-of-sequence and waits for its first
// content, so the request is still in flight when the test acts.
void start_long_chat_stream(RawConnection& connection, int max_tokens) {
  ASSERT_TRUE(connection.send(
      http_request("POST", "/v1/chat/completions",
                   chat_body("The cat", max_tokens, {{"stream", true}, {"ignore_eos", true}, {"temperature", 0.8}})
                       .dump())));
  ASSERT_TRUE(connection.read_until("\"content\":", 10s)) << connection.buffer();
}

TEST_F(ServerEndToEnd, AClientThatDisconnectsCancelsItsRequestAndFreesTheCache) {
  {
    RawConnection connection(port_);
    ASSERT_NO_FATAL_FAILURE(start_long_chat_stream(connection, 450));
    connection.reset();
  }
  double running = -1, used = -1;
  for (int i = 0; i < 100 && (running != 0 || used != 0); ++i) {
    std::this_thread::sleep_for(50ms);
    running = metric_value(port_, "kiln_requests_running");
    used = metric_value(port_, "kiln_kv_cache_tokens_used");
  }
  EXPECT_EQ(running, 0);
  EXPECT_EQ(used, 0);
  auto metrics = http_exchange(port_, "GET", "/metrics", "");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("finish_reason=\"cancelled\""), std::string::npos);
  // A non-streamed request whose client leaves is cancelled too.
  {
    RawConnection connection(port_);
    ASSERT_TRUE(connection.send(http_request(
        "POST", "/v1/completions",
        json{{"model", "stories260K"}, {"prompt", "The dog"}, {"max_tokens", 450}, {"ignore_eos", true}}.dump())));
    std::this_thread::sleep_for(30ms);
  }
  for (int i = 0; i < 100 && metric_value(port_, "kiln_requests_running") != 0; ++i) std::this_thread::sleep_for(50ms);
  EXPECT_EQ(metric_value(port_, "kiln_requests_running"), 0);
}

// generation_config.json's defaults apply to what a request does not set (vLLM's behaviour), and
// --generation-config none turns them off.
TEST(ServerProcess, GenerationConfigDefaultsApplyUnlessTurnedOff) {
  KILN_REQUIRE_STORIES(dir);
  TempDir model;
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    if (entry.is_regular_file() && entry.path().filename() != "generation_config.json")
      std::filesystem::create_symlink(entry.path(), model.path() / entry.path().filename());
  std::ofstream(model.path() / "generation_config.json")
      << R"({"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.0, "max_new_tokens": 7})";
  const json request = {{"model", "stories260K"}, {"prompt", "Once upon a time"}, {"ignore_eos", true}};
  auto completion = [&](uint16_t port, json body) {
    auto response = post(port, "/v1/completions", body);
    EXPECT_TRUE(response && response->status == 200) << (response ? response->body : "no response");
    return response ? json::parse(response->body) : json();
  };
  {
    ServeProcess server(stories_arguments(model.path(), {"--served-model-name", "stories260K"}));
    ASSERT_NE(server.port(), 0) << server.log();
    EXPECT_NE(server.log().find("temperature 0"), std::string::npos) << server.log();
    json seeded = request;
    seeded["seed"] = 1;
    const json first = completion(server.port(), seeded);
    EXPECT_EQ(first["usage"]["completion_tokens"], 7) << "max_new_tokens bounds a request without max_tokens";
    seeded["seed"] = 2;
    json greedy = request;
    greedy["temperature"] = 0;
    greedy["max_tokens"] = 7;
    EXPECT_EQ(completion(server.port(), seeded)["choices"][0]["text"], first["choices"][0]["text"]);
    EXPECT_EQ(completion(server.port(), greedy)["choices"][0]["text"], first["choices"][0]["text"]);
    greedy["max_tokens"] = 20;
    EXPECT_EQ(completion(server.port(), greedy)["usage"]["completion_tokens"], 20) << "an explicit max_tokens wins";
  }
  ServeProcess server(
      stories_arguments(model.path(), {"--served-model-name", "stories260K", "--generation-config", "none"}));
  ASSERT_NE(server.port(), 0) << server.log();
  EXPECT_EQ(completion(server.port(), request)["usage"]["completion_tokens"], 16) << "OpenAI's default of 16";
}

TEST(ServerProcess, AFullQueueGets429WithRetryAfter) {
  KILN_REQUIRE_STORIES(dir);
  ServeProcess server(stories_arguments(dir, {"--max-batch", "1", "--max-queue", "1"}));
  ASSERT_NE(server.port(), 0) << server.log();
  const std::string long_request = http_request(
      "POST", "/v1/completions",
      json{{"model", "stories260K"}, {"prompt", "The dog"}, {"max_tokens", 500}, {"ignore_eos", true}, {"stream", true}}
          .dump());
  RawConnection running(server.port()), waiting(server.port());
  ASSERT_TRUE(running.send(long_request));
  ASSERT_TRUE(running.read_until("data:", 10s));
  ASSERT_TRUE(waiting.send(long_request));
  for (int i = 0; i < 100 && metric_value(server.port(), "kiln_requests_waiting") != 1; ++i)
    std::this_thread::sleep_for(20ms);
  auto refused = http_exchange(server.port(), "POST", "/v1/completions",
                               json{{"model", "stories260K"}, {"prompt", "x"}, {"max_tokens", 2}}.dump());
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 429) << refused->body;
  EXPECT_EQ(refused->headers["retry-after"], "1");
  EXPECT_EQ(json::parse(refused->body)["error"]["type"], "rate_limit_error");
}

TEST(ServerProcess, ApiKeyIsRequiredWhenSet) {
  KILN_REQUIRE_STORIES(dir);
  ServeProcess server(stories_arguments(dir, {"--api-key", "sesame"}));
  ASSERT_NE(server.port(), 0) << server.log();
  auto missing = http_exchange(server.port(), "GET", "/v1/models", "");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 401);
  auto bearer = http_exchange(server.port(), "GET", "/v1/models", "", "Authorization: Bearer sesame\r\n");
  ASSERT_TRUE(bearer);
  EXPECT_EQ(bearer->status, 200);
  auto anthropic =
      post(server.port(), "/v1/messages",
           {{"model", "stories260K"}, {"max_tokens", 3}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}},
           "x-api-key: wrong\r\n");
  ASSERT_TRUE(anthropic);
  EXPECT_EQ(anthropic->status, 401);
  EXPECT_EQ(json::parse(anthropic->body)["error"]["type"], "authentication_error");
  EXPECT_EQ(http_exchange(server.port(), "GET", "/health", "")->status, 200);
}

// Serves `arguments`, sends `signal_number` while a long chat stream of `max_tokens` is in flight,
// reads the stream's response within `response_wait` and hands its body to `expect_body`; the
// server must then exit with 0 within 10 s.
void expect_stream_signalled_mid_flight(const std::vector<std::string>& arguments, int max_tokens, int signal_number,
                                        std::chrono::seconds response_wait,
                                        const std::function<void(const std::string& body)>& expect_body) {
  ServeProcess server(arguments);
  ASSERT_NE(server.port(), 0) << server.log();
  RawConnection streaming(server.port());
  ASSERT_NO_FATAL_FAILURE(start_long_chat_stream(streaming, max_tokens));
  server.signal(signal_number);
  auto response = streaming.read_response(response_wait);
  ASSERT_TRUE(response);
  expect_body(response->body);
  EXPECT_EQ(server.wait_exit(10s), 0) << server.log();
}

TEST(ServerProcess, SigtermFinishesRequestsInFlightThenExits) {
  KILN_REQUIRE_STORIES(dir);
  expect_stream_signalled_mid_flight(stories_arguments(dir), 300, SIGTERM, 20s, [](const std::string& body) {
    EXPECT_NE(body.find("\"finish_reason\":\"length\""), std::string::npos) << body.substr(0, 300);
    EXPECT_NE(body.find("data: [DONE]"), std::string::npos);
  });
}

TEST(ServerProcess, ShutdownPastTheGraceCancelsAndTellsTheClient) {
  KILN_REQUIRE_STORIES(dir);
  expect_stream_signalled_mid_flight(
      stories_arguments(dir, {"--shutdown-grace", "0"}), 450, SIGINT, 10s, [](const std::string& body) {
        EXPECT_NE(body.find("shutting down"), std::string::npos)
            << body.substr(body.size() > 400 ? body.size() - 400 : 0);
      });
}

// The official npm clients (openai, @anthropic-ai/sdk) against the real server.
TEST(ServerNpm, OfficialClientsAgainstTheRealServer) {
  KILN_REQUIRE_STORIES(dir);
  const auto npm_cache = npm_cache_dir();
  if (std::system("node --version > /dev/null 2>&1") != 0) GTEST_SKIP() << "node is not installed";
  if (!std::filesystem::exists(npm_cache / "node_modules/openai") ||
      !std::filesystem::exists(npm_cache / "node_modules/@anthropic-ai/sdk"))
    GTEST_SKIP() << "the npm clients are not installed in " << npm_cache << " (scripts/setup.sh installs them)";
  ServeProcess server(stories_arguments(dir, {"--max-batch", "8"}));
  ASSERT_NE(server.port(), 0) << server.log();
  const auto result = run_command(fmt::format(
      "cd {} && KILN_BASE_URL=http://127.0.0.1:{} KILN_MODEL=stories260K KILN_NPM_CACHE={} timeout 120 node "
      "tests/npm/server_client.mjs",
      source_dir().string(), server.port(), npm_cache.string()));
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("# fail 0"), std::string::npos) << result.output;
}

}  // namespace

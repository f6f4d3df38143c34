// kiln serve: the HTTP transport (keep-alive, timeouts, limits, disconnects), request validation,
// stop strings and metrics; then the real `kiln serve` process on a free loopback port, driven by
// raw HTTP here and by the official openai / Anthropic npm clients (tests/npm/server_client.mjs).
#include <atomic>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "http_test_client.h"
#include "server/anthropic_api.h"
#include "server/api_error.h"
#include "server/http_server.h"
#include "server/json_fields.h"
#include "server/metrics.h"
#include "server/openai_api.h"
#include "server/stop_matcher.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::server;
using namespace kiln::testing;
using namespace std::chrono_literals;
using nlohmann::json;

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
      {R"({"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"temperature":0,"top_p":0.5,"top_k":-1,"min_p":0.1,"seed":-3,"stop":["a","b"],"max_tokens":5,"logprobs":true,"top_logprobs":3,"stream":true,"stream_options":{"include_usage":true},"chat_template_kwargs":{"enable_thinking":false},"user":"u","n":1})", 200, ""},
      {R"({"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]},{"role":"tool","tool_call_id":"c","content":"r"}],"tools":[{"type":"function","function":{"name":"f","parameters":{}}}],"tool_choice":"auto"})", 200, ""},
      {R"({"messages":[{"role":"user","content":"hi"}]})", 400, "model"},
      {R"({"model":"other","messages":[{"role":"user","content":"hi"}]})", 404, "model"},
      {R"({"model":"m"})", 400, "messages"},
      {R"({"model":"m","messages":[]})", 400, "messages"},
      {R"({"model":"m","messages":"hi"})", 400, "messages"},
      {R"({"model":"m","messages":[{"role":"wizard","content":"hi"}]})", 400, "messages[0].role"},
      {R"({"model":"m","messages":[{"role":"user"}]})", 400, "messages[0].content"},
      {R"({"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]})", 400, "messages[0].content[0].type"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi","colour":"red"}]})", 400, "messages[0].colour"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":"hot"})", 400, "temperature"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":3})", 400, "temperature"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"top_p":0})", 400, "top_p"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"top_k":2.5})", 400, "top_k"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":-1})", 400, "max_tokens"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1e30})", 400, "max_tokens"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":99999999999999999999})", 400, "max_tokens"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"max_completion_tokens":5})", 400, "max_tokens"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"stop":[""]})", 400, "stop"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"stop":[1]})", 400, "stop"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"seed":"1"})", 400, "seed"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"stream":"yes"})", 400, "stream"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"stream_options":{"include_usage":true}})", 400, "stream_options"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"top_logprobs":2})", 400, "top_logprobs"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"logprobs":true,"top_logprobs":21})", 400, "top_logprobs"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"n":2})", 400, "n"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_schema","json_schema":{}}})", 400, "response_format"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"logit_bias":{"5":10}})", 400, "logit_bias"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"presence_penalty":0.5})", 400, "presence_penalty"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"tool_choice":"required","tools":[{"type":"function","function":{"name":"f"}}]})", 400, "tool_choice"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{}}]})", 400, "tools[0].function.name"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":true})", 400, "chat_template_kwargs"},
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
      {"messages", {R"({"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}],"system":"be brief","stop_sequences":["x"],"temperature":1,"top_k":5,"stream":true,"metadata":{"user_id":"u"}})", 200, ""}},
      {"messages", {R"({"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]},{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"f","input":{}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"ok"}]}],"tools":[{"name":"f","input_schema":{"type":"object"}}],"thinking":{"type":"disabled"}})", 200, ""}},
      {"messages", {R"({"model":"m","messages":[{"role":"user","content":"hi"}]})", 400, "max_tokens"}},
      {"messages", {R"({"model":"m","max_tokens":0,"messages":[{"role":"user","content":"hi"}]})", 400, "max_tokens"}},
      {"messages", {R"({"model":"m","max_tokens":5,"messages":[{"role":"system","content":"hi"}]})", 400, "messages[0].role"}},
      {"messages", {R"({"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}],"temperature":1.5})", 400, "temperature"}},
      {"messages", {R"({"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}],"stop_sequences":"x"})", 400, "stop_sequences"}},
      {"messages", {R"({"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"image","source":{}}]}]})", 400, "messages[0].content[0].type"}},
      {"messages", {R"({"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}],"tool_choice":{"type":"any"}})", 400, "tool_choice"}},
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

TEST(ServerMetrics, PrometheusTextHasCountersGaugesAndHistograms) {
  ServerMetrics metrics;
  metrics.count_request("chat", "stop");
  metrics.count_request("chat", "stop");
  metrics.count_response(200);
  metrics.add_tokens(7, 3);
  metrics.observe_time_to_first_token(0.003);
  metrics.observe_inter_token_latency(0.0004);
  SchedulerStats stats;
  stats.waiting = 2;
  stats.cache_tokens_used = 128;
  stats.cache_tokens_total = 512;
  const std::string text = metrics.render(stats);
  EXPECT_NE(text.find("kiln_requests_total{endpoint=\"chat\",finish_reason=\"stop\"} 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kiln_prompt_tokens_total 7\n"), std::string::npos);
  EXPECT_NE(text.find("kiln_requests_waiting 2\n"), std::string::npos);
  EXPECT_NE(text.find("kiln_kv_cache_usage_ratio 0.25\n"), std::string::npos);
  EXPECT_NE(text.find("kiln_time_to_first_token_seconds_bucket{le=\"0.0025\"} 0\n"), std::string::npos);
  EXPECT_NE(text.find("kiln_time_to_first_token_seconds_bucket{le=\"0.005\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("kiln_inter_token_latency_seconds_count 1\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE kiln_time_to_first_token_seconds histogram\n"), std::string::npos);
}

}  // namespace

// The HTTP transport: HttpRequestReader (bytes in, a request or an error out), the event loop
// that reads every connection so that slow clients cost no thread, HEAD, handler-thread limits and
// draining; then the same on a real Server over stories260K, in this process.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <atomic>
#include <condition_variable>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <vector>

#include "engine/scheduler.h"
#include "http_test_client.h"
#include "model_test_support.h"
#include "server/http_request_reader.h"
#include "server/http_server.h"
#include "server/server.h"
#include "text/tokenizer_codec.h"
#include "test_support.h"

using namespace kiln;
using namespace kiln::server;
using namespace kiln::testing;
using namespace std::chrono_literals;
using json = nlohmann::ordered_json;

namespace {

// --- HttpRequestReader ---

TEST(HttpRequestReader, AByteAtATimeReadsTheSameRequestAsAllAtOnce) {
  const std::string bytes =
      "POST /v1/x?debug=1 HTTP/1.1\r\nHost: a\r\nX-Mixed-Case: Value\r\nContent-Length: 5\r\n\r\nhello";
  HttpRequestReader reader(1024, 1024);
  for (size_t i = 0; i < bytes.size(); ++i) {
    ASSERT_FALSE(reader.complete()) << "complete before byte " << i;
    ASSERT_EQ(reader.feed(std::string_view(bytes).substr(i, 1)), 1u) << "byte " << i;
  }
  ASSERT_TRUE(reader.complete());
  EXPECT_FALSE(reader.failed());
  EXPECT_EQ(reader.version(), 11u);
  EXPECT_TRUE(reader.keep_alive());
  const HttpRequest request = reader.take();
  EXPECT_EQ(request.method, "POST");
  EXPECT_EQ(request.path, "/v1/x");
  EXPECT_EQ(request.query, "debug=1");
  ASSERT_NE(request.header("x-mixed-case"), nullptr);
  EXPECT_EQ(*request.header("x-mixed-case"), "Value");
  EXPECT_EQ(request.body, "hello");
  EXPECT_FALSE(reader.complete());
  EXPECT_FALSE(reader.started());
}

TEST(HttpRequestReader, BytesAfterARequestAreLeftForTheNext) {
  const std::string first = "GET /a HTTP/1.1\r\nHost: a\r\n\r\n";
  const std::string second = "POST /b HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi";
  HttpRequestReader reader(1024, 1024);
  const std::string both = first + second;
  // Split inside the first header: the part held back is counted when the rest arrives.
  ASSERT_EQ(reader.feed(std::string_view(both).substr(0, 10)), 10u);
  const size_t taken = reader.feed(std::string_view(both).substr(10));
  EXPECT_EQ(taken, first.size() - 10);
  ASSERT_TRUE(reader.complete());
  EXPECT_EQ(reader.feed("more"), 0u) << "a complete reader takes nothing until take()";
  EXPECT_EQ(reader.take().path, "/a");
  EXPECT_EQ(reader.feed(std::string_view(both).substr(10 + taken)), second.size());
  ASSERT_TRUE(reader.complete());
  EXPECT_EQ(reader.version(), 10u);
  EXPECT_FALSE(reader.keep_alive());
  EXPECT_EQ(reader.take().body, "hi");
}

TEST(HttpRequestReader, ChunkedBodyArrivingInPieces) {
  const std::string bytes =
      "POST /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\nGET /";
  HttpRequestReader reader(1024, 1024);
  size_t fed = 0;
  while (!reader.complete() && !reader.failed() && fed < bytes.size())
    fed += reader.feed(std::string_view(bytes).substr(fed, 3));
  ASSERT_TRUE(reader.complete());
  EXPECT_EQ(bytes.substr(fed), "GET /");
  EXPECT_EQ(reader.take().body, "hello, world");
}

// Found by fuzz/http_request_fuzz: a last chunk whose end arrives a byte at a time tripped a wrong
// assertion of Beast 1.74 (boostorg/beast#2861), aborting any build with assertions on (this test
// checks it under build-asan). Also a trailer field, and a malformed trailer, arriving the same way.
TEST(HttpRequestReader, TheLastChunkAndTrailerArrivingAByteAtATime) {
  const std::string header = "POST /c HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n";
  for (const std::string& pieces : {std::string("0\r\n\r\n"), std::string("0\r\nX-Sum: 1\r\n\r\n")}) {
    HttpRequestReader reader(1024, 1024);
    reader.feed(header);
    for (char byte : pieces) reader.feed(std::string_view(&byte, 1));
    ASSERT_TRUE(reader.complete()) << pieces;
    EXPECT_EQ(reader.take().body, "");
  }
  HttpRequestReader reader(1024, 1024);
  reader.feed(header);
  for (char byte : std::string("0\r\n{\"a\":\r\n\r\n")) reader.feed(std::string_view(&byte, 1));
  EXPECT_TRUE(reader.failed());
  EXPECT_EQ(reader.error_status(), 400);
}

TEST(HttpRequestReader, LimitsAndMalformedRequestsAreErrorsWithTheirStatus) {
  // A request the reader refuses (under its header and body bounds): the status it fails with and
  // words its error message must contain ("" where any message will do).
  struct Refusal {
    std::string bytes;
    size_t max_header, max_body;
    int status;
    std::string mentions;
  };
  const std::vector<Refusal> refusals = {
      {"GET / HTTP/1.1\r\nX-Long: " + std::string(200, 'a') + "\r\n\r\n", 100, 1000, 431, "100 bytes"},
      // Refused from the header alone, before any of the body is sent.
      {"POST / HTTP/1.1\r\nContent-Length: 5000\r\n\r\n", 1000, 1000, 413, "1000 bytes"},
      {"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n800\r\n" + std::string(2048, 'x'), 1000, 1000, 413, ""},
      {"THIS IS NOT HTTP\r\n\r\n", 1000, 1000, 400, ""},
      {"POST / HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 1000, 1000, 400, ""},
      {"GET / HTTP/1.1\r\nBad Header\r\n\r\n", 1000, 1000, 400, "malformed HTTP request"},
      // A chunk header never ends: held to the header bound, not buffered without end.
      {"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5;" + std::string(500, 'e'), 100, 1000, 431, ""},
  };
  for (const Refusal& refusal : refusals) {
    HttpRequestReader reader(refusal.max_header, refusal.max_body);
    reader.feed(refusal.bytes);
    const std::string request = refusal.bytes.substr(0, 60);
    EXPECT_FALSE(reader.complete()) << request;
    EXPECT_TRUE(reader.failed()) << request;
    EXPECT_EQ(reader.error_status(), refusal.status) << request;
    EXPECT_NE(reader.error_message().find(refusal.mentions), std::string::npos) << reader.error_message();
  }
}

TEST(HttpRequestReader, ExpectContinueIsSeenOnceTheHeaderIsComplete) {
  HttpRequestReader reader(1024, 1024);
  reader.feed("POST /x HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 4\r\n");
  EXPECT_FALSE(reader.expects_continue()) << "the header is not complete yet";
  reader.feed("\r\n");
  EXPECT_TRUE(reader.expects_continue());
  EXPECT_EQ(reader.path(), "/x");
  reader.feed("body");
  EXPECT_FALSE(reader.expects_continue());
  ASSERT_TRUE(reader.complete());
  EXPECT_EQ(reader.take().body, "body");
}

// --- the transport ---

HttpResponse plain_error(int status, const std::string& message, const std::string&) {
  return {status, "application/json", {}, json{{"error", {{"message", message}}}}.dump()};
}

void echo(const HttpRequest& request, HttpExchange& exchange) {
  exchange.respond({200, "text/plain", {}, request.method + " " + request.path + " " + request.body});
}

std::unique_ptr<HttpServer> start_server(HttpHandler handler, HttpServerOptions options = {}) {
  options.host = "127.0.0.1";
  options.port = 0;
  auto server = std::make_unique<HttpServer>(options, std::move(handler), plain_error);
  server->start();
  return server;
}

// Lets handlers block until the test releases them.
class Gate {
 public:
  void wait_open() {
    std::unique_lock lock(mutex_);
    ++waiting_;
    changed_.notify_all();
    changed_.wait(lock, [&] { return open_; });
    --waiting_;
  }
  bool wait_for_waiting(int count) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, 5s, [&] { return waiting_ >= count; });
  }
  void open() {
    std::lock_guard lock(mutex_);
    open_ = true;
    changed_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  int waiting_ = 0;
  bool open_ = false;
};

// What a keep-alive connection received for HEAD then GET: the HEAD response must be a head
// only, so the GET response starts right after it.
void expect_head_then_get(RawConnection& connection, const std::string& path, const std::string& get_body_end) {
  ASSERT_TRUE(connection.send("HEAD " + path + " HTTP/1.1\r\nHost: x\r\n\r\n"));
  ASSERT_TRUE(connection.read_until("\r\n\r\n", 5s));
  ASSERT_TRUE(connection.send("GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n"));
  ASSERT_TRUE(connection.read_until(get_body_end, 5s)) << connection.buffer();
  const std::string& received = connection.buffer();
  const size_t head_end = received.find("\r\n\r\n") + 4;
  EXPECT_EQ(received.substr(0, 12), "HTTP/1.1 200") << received;
  EXPECT_EQ(received.substr(head_end, 12), "HTTP/1.1 200") << "the HEAD response carried a body:\n" << received;
}

TEST(HttpTransport, HeadGetsTheHeadOfTheResponseAndNoBody) {
  auto server = start_server([](const HttpRequest& request, HttpExchange& exchange) {
    if (request.path == "/stream") {
      if (!exchange.start_stream(200, "text/event-stream", {})) return;
      // Nobody reads a HEAD response's body: the first write says so, and the handler stops.
      if (request.method == "HEAD" && exchange.write("data: x\n\n")) ADD_FAILURE() << "a HEAD stream took a write";
      if (request.method == "GET") exchange.write("data: x\n\n");
      return;
    }
    exchange.respond({200, "text/plain", {}, "the body of " + request.path});
  });
  RawConnection connection(server->port());
  expect_head_then_get(connection, "/x", "the body of /x");
  EXPECT_NE(connection.buffer().find("Content-Length: 14\r\n"), std::string::npos) << "as GET's";
  RawConnection streaming(server->port());
  expect_head_then_get(streaming, "/stream", "0\r\n\r\n");
}

// `count` connections that each send the first byte of `request` at once, then (once all have) one
// more byte every `period` from a thread of their own, until destroyed.
class SlowClients {
 public:
  SlowClients(uint16_t port, int count, std::string request, std::chrono::milliseconds period)
      : request_(std::move(request)) {
    for (int i = 0; i < count; ++i) {
      clients_.push_back(std::make_unique<RawConnection>(port));
      if (!clients_.back()->connected() || !clients_.back()->send(request_.substr(0, 1))) {
        first_failed_ = i;
        return;
      }
    }
    trickle_ = std::thread([this, period] {
      for (size_t byte = 1; byte < request_.size() && !done_; ++byte) {
        for (auto& client : clients_) client->send(request_.substr(byte, 1));
        for (auto waited = 0ms; waited < period && !done_; waited += 10ms) std::this_thread::sleep_for(10ms);
      }
    });
  }
  ~SlowClients() {
    done_ = true;
    if (trickle_.joinable()) trickle_.join();
  }
  // The first client that could not connect or send its first byte, or -1.
  int first_failed() const { return first_failed_; }

 private:
  std::string request_;
  std::vector<std::unique_ptr<RawConnection>> clients_;
  int first_failed_ = -1;
  std::atomic<bool> done_{false};
  std::thread trickle_;
};

TEST(HttpTransport, SlowClientsHoldNoThreadAndLockNobodyOut) {
  // Each slow client below is a descriptor here and one in the server.
  rlimit limit{};
  ::getrlimit(RLIMIT_NOFILE, &limit);
  if (limit.rlim_cur < 2048 && limit.rlim_max >= 2048) {
    limit.rlim_cur = 2048;
    ::setrlimit(RLIMIT_NOFILE, &limit);
  }
  HttpServerOptions options;
  options.event_loop_paths = {"/health"};
  auto server = start_server(echo, options);
  ASSERT_GE(server->connection_limit(), 600u);
  constexpr int kSlowClients = 300;
  // Every slow client sends one more byte of its request every 500 ms while the others are served.
  SlowClients slow(server->port(), kSlowClients, "POST /slow HTTP/1.1\r\nHost: x\r\n", 500ms);
  ASSERT_EQ(slow.first_failed(), -1) << "a slow client could not connect and send";
  const auto start = std::chrono::steady_clock::now();
  int answered = 0;
  for (int i = 0; i < 20; ++i) {
    // std::string("n") +, not "n" +: GCC 12 inlines the latter into a false -Wrestrict warning (bug 105329).
    auto normal = http_exchange(server->port(), "POST", "/work", std::string("n") + std::to_string(i), "", 5s);
    auto health = http_exchange(server->port(), "GET", "/health", "", "", 5s);
    EXPECT_TRUE(normal && normal->status == 200) << "request " << i << ": " << (normal ? normal->body : "no answer");
    EXPECT_TRUE(health && health->status == 200) << "probe " << i << ": " << (health ? health->body : "no answer");
    answered += normal && normal->status == 200 && health && health->status == 200;
    std::this_thread::sleep_for(100ms);  // spread over the slow clients' trickle
  }
  EXPECT_EQ(answered, 20);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  EXPECT_GE(server->open_connections(), static_cast<size_t>(kSlowClients)) << "slow clients were dropped";
}

TEST(HttpTransport, BusyHandlerThreadsGet503ButEventLoopPathsAreAnswered) {
  Gate gate;
  HttpServerOptions options;
  options.max_concurrent_requests = 2;
  options.event_loop_paths = {"/health"};
  auto server = start_server(
      [&](const HttpRequest& request, HttpExchange& exchange) {
        if (request.path == "/block") gate.wait_open();
        exchange.respond({200, "text/plain", {}, "ok " + request.path});
      },
      options);
  RawConnection first(server->port()), second(server->port());
  ASSERT_TRUE(first.send(http_request("GET", "/block", "")) && second.send(http_request("GET", "/block", "")));
  ASSERT_TRUE(gate.wait_for_waiting(2));
  auto busy = http_exchange(server->port(), "GET", "/other", "", "", 5s);
  ASSERT_TRUE(busy);
  EXPECT_EQ(busy->status, 503);
  EXPECT_EQ(busy->headers["retry-after"], "1");
  EXPECT_NE(busy->body.find("at once (2)"), std::string::npos) << busy->body;
  auto health = http_exchange(server->port(), "GET", "/health", "", "", 5s);
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(health->body, "ok /health");
  gate.open();
  auto released = first.read_response(5s);
  ASSERT_TRUE(released);
  EXPECT_EQ(released->body, "ok /block");
  // The slot is free again.
  std::optional<RawResponse> after;
  for (int i = 0; i < 50 && !(after && after->status == 200); ++i) {
    if (i) std::this_thread::sleep_for(20ms);
    after = http_exchange(server->port(), "GET", "/other", "", "", 5s);
  }
  ASSERT_TRUE(after);
  EXPECT_EQ(after->status, 200);
}

TEST(HttpTransport, TheDefaultConnectionLimitFollowsTheDescriptorLimit) {
  auto server = start_server(echo);
  rlimit limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &limit), 0);
  EXPECT_EQ(server->connection_limit(), connection_limit_for_descriptors());
  if (limit.rlim_cur != RLIM_INFINITY) {
    EXPECT_LT(connection_limit_for_descriptors(), limit.rlim_cur);
    EXPECT_GE(connection_limit_for_descriptors(), limit.rlim_cur / 2);
  }
  HttpServerOptions options;
  options.max_connections = 7;
  EXPECT_EQ(start_server(echo, options)->connection_limit(), 7u);
}

TEST(HttpTransport, DrainingKeepsAcceptingClosesIdleConnectionsAndLetsRequestsFinish) {
  Gate gate;
  auto server = start_server([&](const HttpRequest& request, HttpExchange& exchange) {
    if (request.path == "/block") gate.wait_open();
    exchange.respond({200, "text/plain", {}, "ok " + request.path});
  });
  RawConnection idle(server->port()), busy(server->port());
  ASSERT_TRUE(idle.send(http_request("GET", "/first", "")) && idle.read_response(5s));
  ASSERT_TRUE(busy.send(http_request("GET", "/block", "")));
  ASSERT_TRUE(gate.wait_for_waiting(1));
  server->drain();
  EXPECT_TRUE(idle.closed_within(2s)) << "an idle keep-alive connection stayed open";
  // A new connection is still accepted and answered, and closed after its response.
  RawConnection late(server->port());
  ASSERT_TRUE(late.connected() && late.send(http_request("GET", "/late", "")));
  auto answer = late.read_response(5s);
  ASSERT_TRUE(answer);
  EXPECT_EQ(answer->body, "ok /late");
  EXPECT_EQ(answer->headers["connection"], "close");
  EXPECT_TRUE(late.closed_within(2s));
  gate.open();
  auto finished = busy.read_response(5s);
  ASSERT_TRUE(finished);
  EXPECT_EQ(finished->body, "ok /block");
  EXPECT_TRUE(busy.closed_within(2s));
}

// --- a real Server over stories260K, in this process ---

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The model, its tokenizer, a scheduler and the Server on a free loopback port.
struct LiveServer {
  LiveServer(const std::filesystem::path& dir, std::chrono::milliseconds shutdown_grace)
      : model(open_cpu_model(dir)),
        codec(dir, read_file(stories_dir() / "chat_template.jinja")),
        scheduler(*model.model, scheduler_options()),
        server(scheduler, codec, server_options(shutdown_grace)) {
    server.start();
  }
  uint16_t port() const { return server.port(); }
  static SchedulerOptions scheduler_options() {
    SchedulerOptions options;
    options.max_batch = 4;
    options.context_tokens = 512;
    options.prefill_chunk = 64;
    return options;
  }
  ServerOptions server_options(std::chrono::milliseconds shutdown_grace) const {
    ServerOptions options;
    options.http.host = "127.0.0.1";
    options.http.port = 0;
    options.model_name = "stories260K";
    options.vocab_size = model.model->config().vocab_size;
    options.shutdown_grace = shutdown_grace;
    return options;
  }

  TestModel model;
  TokenizerCodec codec;
  Scheduler scheduler;
  Server server;
};

#define KILN_REQUIRE_STORIES(dir) const std::filesystem::path dir = stories_dir()

std::string completion(int max_tokens) {
  return json{{"model", "stories260K"}, {"prompt", "The cat"}, {"max_tokens", max_tokens}, {"temperature", 0}}.dump();
}

TEST(HttpServerLive, ListensWhileTheModelLoadsAndSaysSo) {
  ServerOptions options;
  options.http.host = "127.0.0.1";
  options.http.port = 0;
  options.model_name = "stories260K";
  options.vocab_size = 512;
  Server server(options);
  server.start();
  auto health = http_exchange(server.port(), "GET", "/health", "", "", 5s);
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 503);
  EXPECT_EQ(json::parse(health->body)["status"], "loading");
  EXPECT_EQ(health->headers["retry-after"], "1");
  auto early = http_exchange(server.port(), "POST", "/v1/completions", completion(4), "", 5s);
  ASSERT_TRUE(early);
  EXPECT_EQ(early->status, 503);
  EXPECT_EQ(json::parse(early->body)["error"]["code"], "model_loading") << early->body;
  auto metrics = http_exchange(server.port(), "GET", "/metrics", "", "", 5s);
  ASSERT_TRUE(metrics);
  EXPECT_EQ(metrics->status, 200);

  TestModel model = open_cpu_model(stories_dir());
  const TokenizerCodec codec(stories_dir(), std::nullopt);
  Scheduler scheduler(*model.model, LiveServer::scheduler_options());
  server.serve_model(scheduler, codec);
  health = http_exchange(server.port(), "GET", "/health", "", "", 5s);
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  auto ready = http_exchange(server.port(), "POST", "/v1/completions", completion(4), "", 10s);
  ASSERT_TRUE(ready);
  EXPECT_EQ(ready->status, 200) << ready->body;
  server.shutdown();
}

TEST(HttpServerLive, HeadHealthIsAHeadOnlyAndTheConnectionGoesOn) {
  KILN_REQUIRE_STORIES(dir);
  LiveServer live(dir, 5s);
  RawConnection connection(live.port());
  expect_head_then_get(connection, "/health", "{\"status\":\"ok\"}");
  ASSERT_TRUE(connection.send(http_request("HEAD", "/v1/completions", "")));
  // HEAD is only where GET is.
  EXPECT_TRUE(connection.read_until("HTTP/1.1 405 Method Not Allowed", 5s)) << connection.buffer();
}

TEST(HttpServerLive, SlowClientsLockOutNeitherRequestsNorHealthProbes) {
  KILN_REQUIRE_STORIES(dir);
  LiveServer live(dir, 5s);
  constexpr int kSlowClients = 300;
  SlowClients slow(live.port(), kSlowClients, "POST /v1/completions HTTP/1.1\r\n", 1000ms);
  ASSERT_EQ(slow.first_failed(), -1) << "a slow client could not connect and send";
  int answered = 0;
  for (int i = 0; i < 20; ++i) {
    auto normal = http_exchange(live.port(), "POST", "/v1/completions", completion(4), "", 10s);
    auto health = http_exchange(live.port(), "GET", "/health", "", "", 5s);
    EXPECT_TRUE(normal && normal->status == 200) << "request " << i << ": " << (normal ? normal->body : "no answer");
    EXPECT_TRUE(health && health->status == 200) << "probe " << i << ": " << (health ? health->body : "no answer");
    answered += normal && normal->status == 200 && health && health->status == 200;
    std::this_thread::sleep_for(150ms);  // spread over several of the slow clients' bytes
  }
  EXPECT_EQ(answered, 20);
}

TEST(HttpServerLive, DuringTheShutdownGraceNewClientsGet503AndRequestsInFlightFinish) {
  KILN_REQUIRE_STORIES(dir);
  LiveServer live(dir, 20s);
  // A request in flight whose handler is held in a write: its client reads nothing for now, into
  // a small receive buffer, while each streamed token carries 20 alternatives.
  RawConnection streaming(live.port());
  const int small_buffer = 4096;
  ASSERT_EQ(::setsockopt(streaming.fd(), SOL_SOCKET, SO_RCVBUF, &small_buffer, sizeof small_buffer), 0);
  const json chat = {{"model", "stories260K"},
                     {"messages", {{{"role", "user"}, {"content", "The cat"}}}},
                     {"max_tokens", 400},
                     {"ignore_eos", true},
                     {"logprobs", true},
                     {"top_logprobs", 20},
                     {"stream", true}};
  ASSERT_TRUE(streaming.send(http_request("POST", "/v1/chat/completions", chat.dump())));
  ASSERT_TRUE(streaming.read_until("\"content\":", 10s));
  std::thread stopper([&] { live.server.shutdown(); });
  std::optional<RawResponse> health;
  for (int i = 0; i < 100 && !(health && health->status == 503); ++i) {
    if (i) std::this_thread::sleep_for(10ms);
    health = http_exchange(live.port(), "GET", "/health", "", "", 5s);
  }
  ASSERT_TRUE(health) << "a health probe was refused during the grace period";
  EXPECT_EQ(health->status, 503);
  EXPECT_EQ(json::parse(health->body)["status"], "shutting down");
  EXPECT_EQ(health->headers["retry-after"], "1");
  auto refused = http_exchange(live.port(), "POST", "/v1/completions", completion(4), "", 5s);
  ASSERT_TRUE(refused) << "a new request was refused a connection during the grace period";
  EXPECT_EQ(refused->status, 503);
  EXPECT_NE(refused->body.find("shutting down"), std::string::npos) << refused->body;
  auto finished = streaming.read_response(30s);
  ASSERT_TRUE(finished);
  EXPECT_NE(finished->body.find("\"finish_reason\":\"length\""), std::string::npos);
  EXPECT_NE(finished->body.find("data: [DONE]"), std::string::npos);
  stopper.join();
  // After the grace period the server is closed.
  RawConnection after(live.port());
  EXPECT_FALSE(after.connected() && after.send(http_request("GET", "/health", "")) && after.read_response(1s));
}

}  // namespace

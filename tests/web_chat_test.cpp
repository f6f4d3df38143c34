// The web chat `kiln serve` answers at GET / (src/server/web/chat.html): served as the file itself,
// with its headers, to GET and HEAD; then driven in headless Chromium by tests/npm/web_chat.mjs
// (puppeteer-core), against stories260K.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "http_test_client.h"
#include "npm_reference.h"
#include "serve_process.h"
#include "test_support.h"

using namespace kiln::testing;
using namespace std::chrono_literals;

namespace {

// Chromium from $KILN_CHROMIUM, else Debian's `chromium` on the PATH; empty when neither is there.
std::string chromium_binary() {
  if (const char* configured = std::getenv("KILN_CHROMIUM")) return configured;
  const CommandResult found = run_command("command -v chromium");
  if (found.exit_code != 0) return "";
  return found.output.substr(0, found.output.find('\n'));
}

TEST(WebChat, GetSlashServesThePageWithoutTheApiKey) {
  KILN_REQUIRE_STORIES(dir);
  // With an API key: the page holds no secret and asks for the key itself.
  ServeProcess server(stories_arguments(dir, {"--api-key", "sesame"}));
  ASSERT_NE(server.port(), 0) << server.log();
  auto page = http_exchange(server.port(), "GET", "/", "");
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
  EXPECT_EQ(page->headers["content-type"], "text/html; charset=utf-8");
  EXPECT_EQ(page->headers["cache-control"], "no-cache");
  EXPECT_NE(page->headers["content-security-policy"].find("connect-src 'self'"), std::string::npos);
  EXPECT_EQ(page->body, read_text_file(source_dir() / "src/server/web/chat.html"))
      << "the page served is not src/server/web/chat.html as it is";

  // HEAD gets GET's head and no body: the GET that follows on the connection is answered next.
  RawConnection connection(server.port());
  ASSERT_TRUE(connection.send("HEAD / HTTP/1.1\r\nHost: x\r\n\r\n"));
  ASSERT_TRUE(connection.read_until("\r\n\r\n", 5s));
  ASSERT_TRUE(connection.send("GET / HTTP/1.1\r\nHost: x\r\n\r\n"));
  ASSERT_TRUE(connection.read_until("</html>\n", 5s)) << connection.buffer();
  const std::string& received = connection.buffer();
  const size_t head_end = received.find("\r\n\r\n") + 4;
  EXPECT_EQ(received.substr(0, 12), "HTTP/1.1 200") << received.substr(0, 300);
  EXPECT_NE(received.substr(0, head_end).find("Content-Length: " + std::to_string(page->body.size()) + "\r\n"),
            std::string::npos)
      << "HEAD's Content-Length is not GET's:\n"
      << received.substr(0, head_end);
  EXPECT_EQ(received.substr(head_end, 12), "HTTP/1.1 200") << "the HEAD response carried a body";

  auto posted = http_exchange(server.port(), "POST", "/", "{}");
  ASSERT_TRUE(posted);
  EXPECT_EQ(posted->status, 405);
  auto elsewhere = http_exchange(server.port(), "GET", "/index.html", "");
  ASSERT_TRUE(elsewhere);
  EXPECT_EQ(elsewhere->status, 404);
}

TEST(WebChat, ChromiumStreamsTheAnswersOfTheServer) {
  KILN_REQUIRE_STORIES(dir);
  const std::string chromium = chromium_binary();
  if (chromium.empty())
    GTEST_SKIP() << "Chromium is not installed (Debian's `chromium` package, or set KILN_CHROMIUM): the web chat "
                    "is not driven in a browser";
  if (run_command("command -v node").exit_code != 0) GTEST_SKIP() << "node is not installed";
  if (!std::filesystem::exists(npm_package_dir("puppeteer-core") / "package.json"))
    GTEST_SKIP() << "puppeteer-core is not installed in " << npm_cache_dir() << " (scripts/setup.sh installs it)";
  // With an API key, so the page's key field is driven too.
  ServeProcess server(stories_arguments(dir, {"--max-batch", "4", "--api-key", "sesame"}));
  ASSERT_NE(server.port(), 0) << server.log();
  const auto result = run_command(fmt::format(
      "cd '{}' && KILN_BASE_URL=http://127.0.0.1:{} KILN_MODEL=stories260K KILN_API_KEY=sesame KILN_CHROMIUM='{}' "
      "KILN_NPM_CACHE='{}' timeout 180 node tests/npm/web_chat.mjs",
      source_dir().string(), server.port(), chromium, npm_cache_dir().string()));
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("# fail 0"), std::string::npos) << result.output;
}

}  // namespace

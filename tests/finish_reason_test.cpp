// How each API dialect names the ends of a generation on the wire.
#include <gtest/gtest.h>

#include "engine/finish_reason.h"
#include "server/anthropic_api.h"
#include "server/openai_api.h"

using namespace kiln;

namespace {

TEST(FinishReason, KilnNamesEveryReason) {
  EXPECT_EQ(finish_reason_name(FinishReason::Stop), "stop");
  EXPECT_EQ(finish_reason_name(FinishReason::Length), "length");
  EXPECT_EQ(finish_reason_name(FinishReason::Cancelled), "cancelled");
  EXPECT_EQ(finish_reason_name(FinishReason::Error), "error");
  EXPECT_TRUE(ended_normally(FinishReason::Stop));
  EXPECT_TRUE(ended_normally(FinishReason::Length));
  EXPECT_FALSE(ended_normally(FinishReason::Cancelled));
  EXPECT_FALSE(ended_normally(FinishReason::Error));
}

TEST(FinishReason, OpenAiSendsStopOrLength) {
  EXPECT_EQ(server::openai_finish_reason(FinishReason::Stop), "stop");
  EXPECT_EQ(server::openai_finish_reason(FinishReason::Length), "length");
}

TEST(FinishReason, AnthropicSendsEndTurnMaxTokensOrStopSequence) {
  EXPECT_EQ(server::anthropic_stop_reason(FinishReason::Stop, std::nullopt), "end_turn");
  EXPECT_EQ(server::anthropic_stop_reason(FinishReason::Stop, std::string("park")), "stop_sequence");
  EXPECT_EQ(server::anthropic_stop_reason(FinishReason::Length, std::nullopt), "max_tokens");
}

}  // namespace

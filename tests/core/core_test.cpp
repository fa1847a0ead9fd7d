// core: strings, logging, RNG capture/restore, timers, progress.
#include "core/error.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/rng.h"
#include "core/strings.h"
#include "core/timer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <thread>

using namespace parallax;

TEST(StringsTest, DidYouMeanFindsTyposOnly) {
  const std::vector<std::string> keys = {"lr", "weight_decay", "betas", "momentum"};
  EXPECT_EQ(core::closest_match("weight_decy", keys), "weight_decay");
  EXPECT_EQ(core::closest_match("betaz", keys), "betas");
  EXPECT_EQ(core::closest_match("lrr", keys), "lr");
  EXPECT_EQ(core::closest_match("completely_else", keys), "");
  EXPECT_EQ(core::did_you_mean("momentun", keys), " (did you mean 'momentum'?)");
  EXPECT_EQ(core::edit_distance("kitten", "sitting"), 3u);
}

TEST(StringsTest, HumanReadableSizesAndDurations) {
  EXPECT_EQ(core::human_bytes(512), "512 B");
  EXPECT_EQ(core::human_bytes(1536), "1.5 KiB");
  EXPECT_EQ(core::human_bytes(3.0 * 1024 * 1024 * 1024), "3.0 GiB");
  EXPECT_EQ(core::human_duration(59.4), "59s");
  EXPECT_EQ(core::human_duration(3725), "1h02m05s");
  EXPECT_EQ(core::human_duration(-1), "--");
  EXPECT_EQ(core::split("a.b..c", '.'), (std::vector<std::string>{"a", "b", "", "c"}));
  EXPECT_EQ(core::trim("  x y \n"), "x y");
}

TEST(StringsTest, ClipKeepsShortValuesAndCutsTheMiddleOfLongOnes) {
  EXPECT_EQ(core::clip("adamw"), "adamw");
  EXPECT_EQ(core::clip(std::string(80, 'x')), std::string(80, 'x'));  // at the limit: whole
  // One line whatever the value holds.
  EXPECT_EQ(core::clip("a\nb\tc\x01"
                       "d\x7f"),
            "a\\nb\\tc\\x01d\\x7f");
  const std::string big = "HEAD" + std::string(1 << 20, 'm') + "TAIL";
  const std::string c = core::clip(big);
  EXPECT_EQ(c, std::string("HEAD") + std::string(36, 'm') + "...(1048584 bytes)..." +
                   std::string(36, 'm') + "TAIL");
  EXPECT_LT(c.size(), 110u);
  // A cut never splits a UTF-8 sequence: "é" is 2 bytes, so byte 40 (the cut) falls inside one.
  std::string accents;
  for (int i = 0; i < 100; ++i) accents += "\xc3\xa9";
  const std::string a = core::clip("x" + accents, 80);
  const auto mid = a.find("...(");
  ASSERT_NE(mid, std::string::npos);
  EXPECT_EQ(a.substr(0, mid),
            "x" + accents.substr(0, 38));  // 39 bytes: the 40th would split a character
  const auto tail = a.substr(a.find(")...") + 4);
  EXPECT_EQ(tail, accents.substr(accents.size() - 40));
}

TEST(StringsTest, PathComponentProblemNamesEachUnsafeForm) {
  EXPECT_EQ(core::path_component_problem("run-1_b.v2"), "");
  EXPECT_EQ(core::path_component_problem("with space"), "");
  EXPECT_EQ(core::path_component_problem(""), "is empty");
  EXPECT_NE(core::path_component_problem(".").find("'.'"), std::string::npos);
  EXPECT_NE(core::path_component_problem("..").find("'..'"), std::string::npos);
  EXPECT_EQ(core::path_component_problem("../../escape"), "contains '/'");
  EXPECT_EQ(core::path_component_problem("/abs"), "contains '/'");
  EXPECT_EQ(core::path_component_problem("a/b"), "contains '/'");
  EXPECT_EQ(core::path_component_problem("~"), "starts with '~'");
  EXPECT_EQ(core::path_component_problem("~user"), "starts with '~'");
  EXPECT_EQ(core::path_component_problem(std::string("a\0b", 3)), "contains a control character");
  EXPECT_EQ(core::path_component_problem("a\nb"), "contains a control character");
  EXPECT_NE(core::path_component_problem(std::string(256, 'n')).find("255"), std::string::npos);
  EXPECT_EQ(core::path_component_problem(std::string(255, 'n')), "");
}

// The JSON writer (core/strings.h): every value one way, and a reader gets back what was written.
TEST(StringsTest, JsonWriterQuotesEscapesAndWritesNumbersThatReadBack) {
  EXPECT_EQ(core::json_quote("a\"b\\c\n\x01"), "\"a\\\"b\\\\c\\n\\u0001\"");
  EXPECT_EQ(core::json_number(1), "1.0");
  EXPECT_EQ(core::json_number(0.1), "0.1");
  EXPECT_EQ(core::json_number(-2.5e-300), "-2.5e-300");
  for (const double v : {0.1, 1.0 / 3.0, 6.02214076e23, -1e-7, 123456789.125}) {
    EXPECT_EQ(std::stod(core::json_number(v)), v)
        << core::json_number(v);  // shortest round trip: exact
  }
  EXPECT_EQ(core::json_number(std::nan("")), "null");
  EXPECT_EQ(core::json_number(-INFINITY), "null");
  EXPECT_EQ(core::json_fixed(2.0 / 3.0, 3), "0.667");
  EXPECT_EQ(core::json_fixed(INFINITY, 3), "null");
  EXPECT_EQ(core::json_strings({}), "[]");
  EXPECT_EQ(core::json_strings({"a", "b\"c"}), "[\"a\", \"b\\\"c\"]");
  EXPECT_EQ(core::json_ints({3, -1, 0}), "[3, -1, 0]");
}

TEST(ErrorTest, ContextFramesAppearInWhat) {
  ConfigError e("key 'x' is bad");
  e.add_context("while loading a.yaml").add_context("rank 3");
  EXPECT_STREQ(e.what(), "key 'x' is bad (while loading a.yaml; rank 3)");
  try {
    throw_error<DataError>("scene {} in '{}' is truncated", 7, "shard_0.h5");
  } catch (const Error& err) {
    EXPECT_STREQ(err.what(), "scene 7 in 'shard_0.h5' is truncated");
  }
}

class LogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    core::log::set_sink(
        [this](core::log::Level, std::string_view line) { lines_.emplace_back(line); });
  }
  void TearDown() override {
    core::log::set_sink(nullptr);
    core::log::set_rank(0, 1);
    core::log::set_level(core::log::Level::kInfo);
    core::log::set_all_ranks(false);
  }
  std::vector<std::string> lines_;
};

TEST_F(LogTest, RankZeroOnlyByDefaultButWarningsFromEveryRank) {
  core::log::set_rank(3, 4);
  core::log::info("hidden {}", 1);
  core::log::warn("shown {}", 2);
  ASSERT_EQ(lines_.size(), 1u);
  EXPECT_NE(lines_[0].find("r3/4 WARN] shown 2"), std::string::npos) << lines_[0];
  core::log::set_all_ranks(true);
  core::log::info("now shown");
  ASSERT_EQ(lines_.size(), 2u);
  EXPECT_NE(lines_[1].find("r3/4 INFO] now shown"), std::string::npos) << lines_[1];
}

TEST_F(LogTest, LevelFiltersAndParses) {
  core::log::set_level(core::log::parse_level("WARN"));
  core::log::info("no");
  core::log::error("yes");
  ASSERT_EQ(lines_.size(), 1u);
  EXPECT_NE(lines_[0].find("ERROR] yes"), std::string::npos);
  EXPECT_THROW(core::log::parse_level("loud"), ConfigError);
  EXPECT_EQ(core::log::parse_level("debug"), core::log::Level::kDebug);
}

TEST_F(LogTest, ProgressPrintsRateAndEta) {
  core::Progress p("work", 4, 0.0);
  for (int i = 1; i <= 4; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    p.update(i, "loss 1.0");
  }
  p.finish();
  ASSERT_GE(lines_.size(), 4u);
  EXPECT_NE(lines_[1].find("work 2/4 (50%)"), std::string::npos) << lines_[1];
  // Every field in its place: rate, the caller's text, elapsed time, then the ETA.
  EXPECT_NE(lines_[1].find("/s | loss 1.0 | elapsed "), std::string::npos) << lines_[1];
  EXPECT_NE(lines_[1].find(" | ETA "), std::string::npos) << lines_[1];
  EXPECT_EQ(lines_[1].find("ETA --"), std::string::npos) << "no ETA after two items: " << lines_[1];
  EXPECT_NE(lines_.back().find("work done: 4"), std::string::npos) << lines_.back();
}

TEST(RngTest, CaptureRestoreReplaysTheSameStream) {
  core::seed_all(1234);
  const at::Tensor a0 = at::randn({16});
  const auto state = core::capture_rng();
  const at::Tensor a1 = at::randn({16});
  core::restore_rng(state);
  const at::Tensor a2 = at::randn({16});
  EXPECT_TRUE(at::equal(a1, a2));
  EXPECT_FALSE(at::equal(a0, a1));
  core::seed_all(1234);
  EXPECT_TRUE(at::equal(at::randn({16}), a0));
}

TEST(RngTest, DerivedSeedsDifferPerRankAndStream) {
  EXPECT_NE(core::derive_seed(1, 0, 0), core::derive_seed(1, 1, 0));
  EXPECT_NE(core::derive_seed(1, 0, 0), core::derive_seed(1, 0, 1));
  EXPECT_EQ(core::derive_seed(7, 3, 2), core::derive_seed(7, 3, 2));
}

TEST(TimerTest, CpuDeviceTimerMeasuresWallTime) {
  core::DeviceTimer t(c10::Device(c10::kCPU));
  t.start();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  t.stop();
  EXPECT_GE(t.elapsed_ms(), 15.0);
  EXPECT_LT(t.elapsed_ms(), 2000.0);
}

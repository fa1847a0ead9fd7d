// Config system: typed reading, composition through _base_, overrides, and every error path.
#include "core/config.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

namespace fs = std::filesystem;
using parallax::ConfigError;
using parallax::core::Check;
using parallax::core::ConfigTree;
using parallax::core::load_config;

namespace {

struct InnerCfg {
  int64_t width = 64;
  std::vector<int> sizes = {224, 224};
  template <class V>
  void visit(V& v) {
    v("width", width, "", Check::positive());
    v("sizes", sizes);
  }
};

struct OptCfg {
  std::string name = "adamw";
  double lr = 1e-3;
  std::vector<double> betas = {0.9, 0.999};
  template <class V>
  void visit(V& v) {
    v("name", name, "", Check::one_of({"adamw", "sgd"}));
    v("lr", lr, "", Check::positive());
    v("betas", betas);
  }
};

struct RootCfg {
  std::string run_name = "x";
  bool flag = false;
  int steps = 10;
  std::vector<std::string> tags;
  OptCfg optim;
  InnerCfg model;
  template <class V>
  void visit(V& v) {
    v("run_name", run_name);
    v("flag", flag);
    v("steps", steps, "", Check::at_least(0));
    v("tags", tags);
    v("optim", optim);
    v("model", model);
  }
  void validate() const {
    if (optim.betas.size() != 2) throw ConfigError("key 'optim.betas' needs 2 values");
  }
};

class ConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::random_device rd;
    dir_ = fs::temp_directory_path() / ("parallax_cfg_" + std::to_string(rd()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& text) {
    const fs::path p = dir_ / name;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
    return p.string();
  }

  // Runs `fn` expecting a ConfigError; returns its message.
  template <class F>
  std::string error_of(F&& fn) {
    try {
      fn();
    } catch (const ConfigError& e) {
      return e.what();
    }
    ADD_FAILURE() << "expected a ConfigError";
    return "";
  }

  fs::path dir_;
};

TEST_F(ConfigTest, DefaultsWhenFileIsAnEmptyMappingOrOmitted) {
  const auto cfg = load_config<RootCfg>(write("all_defaults.yaml", "{}\n"), {});
  EXPECT_EQ(cfg.steps, 10);
  EXPECT_EQ(cfg.optim.name, "adamw");
  EXPECT_EQ(cfg.model.sizes, (std::vector<int>{224, 224}));
  const auto cfg2 = load_config<RootCfg>("", {});
  EXPECT_EQ(cfg2.optim.lr, 1e-3);  // the default, copied: exact
}

TEST_F(ConfigTest, EmptyFileIsAnErrorNamingIt) {
  for (const char* text : {"", "# only a comment\n", "\n\n"}) {
    const auto f = write("empty.yaml", text);
    EXPECT_EQ(error_of([&] { load_config<RootCfg>(f, {}); }),
              f + ": the config is empty (no keys; write '{}' for all defaults)");
  }
  // Anywhere in the _base_ chain.
  write("empty_base.yaml", "");
  const auto child = write("child.yaml", "_base_: empty_base.yaml\nsteps: 2\n");
  const std::string msg = error_of([&] { load_config<RootCfg>(child, {}); });
  EXPECT_NE(msg.find("empty_base.yaml: the config is empty"), std::string::npos) << msg;
}

// The hostile inputs of issue 17: each must be a one-line ConfigError naming the file, in bounded
// time and memory, never a crash.
TEST_F(ConfigTest, RecursiveAliasIsAnErrorNotACrash) {
  const auto a = write("self.yaml", "a: &x [*x]\n");
  EXPECT_EQ(error_of([&] { load_config<RootCfg>(a, {}); }),
            a + ":1:8: recursive alias '*x': it refers to the node that contains it (anchor '&x' "
                "at line 1); "
                "a config cannot contain itself");
  const auto e = write("rec.yaml", "steps: 1\nexperiment: &e {name: rec, sub: *e}\n");
  std::string msg = error_of([&] { load_config<RootCfg>(e, {}); });
  EXPECT_NE(msg.find("rec.yaml:2:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("recursive alias '*e'"), std::string::npos) << msg;
  // Deeper: the alias sits two levels inside its anchor.
  const auto d = write("deep.yaml", "optim: &o\n  name: sgd\n  sub:\n    inner: [1, *o]\n");
  msg = error_of([&] { load_config<RootCfg>(d, {}); });
  EXPECT_NE(msg.find("deep.yaml:4:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("anchor '&o' at line 1"), std::string::npos) << msg;
  // In an override's value.
  msg = error_of([&] { load_config<RootCfg>("", {"tags=&t [a, *t]"}); });
  EXPECT_NE(msg.find("command-line override 'tags=&t [a, *t]'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("recursive alias '*t'"), std::string::npos) << msg;
}

// "Billion laughs": level k holds ten aliases of level k-1, so level 9 expands to 10^9 scalars
// while the file is 1 KiB. The expanded size is counted from the anchors' sizes, never built.
std::string alias_bomb(int levels, const std::string& indent) {
  std::string text = indent + "l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n";
  for (int k = 1; k < levels; ++k) {
    text += fmt::format("{}l{}: &l{} [", indent, k, k);
    for (int i = 0; i < 10; ++i) text += fmt::format("{}*l{}", i ? ", " : "", k - 1);
    text += "]\n";
  }
  return text;
}

TEST_F(ConfigTest, AliasBombIsCappedByItsExpandedSize) {
  const auto f = write("laughs.yaml", "tags:\n" + alias_bomb(10, "  - "));
  const auto start = std::chrono::steady_clock::now();
  const std::string msg = error_of([&] { load_config<RootCfg>(f, {}); });
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
  // Level k expands to s_k = 1 + 10 s_(k-1) nodes (s_0 = 11: the list and its 10 scalars), each
  // list entry adds its map and key, and `tags:` its key and list: 2 + 4 * 2 + (11 + 111 + 1111 +
  // 11111) = 12354 nodes before the entry of l4 on line 6, whose map, key and list make 12357;
  // each *l3 adds 11111, so the 8th (12357 + 8 * 11111 = 101245) is the first past 100000.
  EXPECT_EQ(msg, f + ":6: too large: more than 100000 YAML nodes once aliases are expanded through "
                     "alias '*l3' "
                     "(a config holds a few hundred; is this a data file, or an alias bomb?)");
  // A bomb of long strings trips the byte limit first.
  const std::string s(1 << 20, 'x');
  const auto g = write("long_laughs.yaml", "a: &a " + s +
                                               "\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                                               "c: [*b, *b]\n");
  const std::string msg2 = error_of([&] { load_config<RootCfg>(g, {}); });
  EXPECT_NE(
      msg2.find(
          "long_laughs.yaml:3: too large: more than 16.0 MiB of text once aliases are expanded"),
      std::string::npos)
      << msg2;
  // Same for an override's value.
  std::string flow = "{";
  for (int k = 0; k < 8; ++k) {
    flow += fmt::format("{}l{}: &l{} [", k ? ", " : "", k, k);
    for (int i = 0; i < 10; ++i) {
      if (i) flow += ", ";
      flow += k ? fmt::format("*l{}", k - 1) : std::string("lol");
    }
    flow += "]";
  }
  flow += "}";
  const std::string msg3 = error_of([&] { load_config<RootCfg>("", {"model=" + flow}); });
  EXPECT_NE(msg3.find("too large: more than 100000 YAML nodes"), std::string::npos) << msg3;
  EXPECT_NE(msg3.find("command-line override 'model={l0: &l0"), std::string::npos) << msg3;
}

TEST_F(ConfigTest, AliasesThatAreNotHostileStillWork) {
  const auto f =
      write("aliases.yaml",
            "model:\n  width: &w 7\n  sizes: &s [3, 4]\nsteps: *w\noptim:\n  betas: [0.5, 0.6]\n"
            "tags: &t [a, b]\n");
  const auto cfg = load_config<RootCfg>(f, {"model.sizes[0]=9"});
  EXPECT_EQ(cfg.steps, 7);
  EXPECT_EQ(cfg.model.width, 7);
  EXPECT_EQ(cfg.model.sizes, (std::vector<int>{9, 4}));
  EXPECT_EQ(cfg.tags, (std::vector<std::string>{"a", "b"}));
}

TEST_F(ConfigTest, DuplicateKeyIsAnErrorNamingBothLines) {
  const auto f = write("dup.yaml", "optim:\n  lr: 0.1\n  name: sgd\n  lr: 0.2\n");
  EXPECT_EQ(
      error_of([&] { load_config<RootCfg>(f, {}); }),
      f + ":4: duplicate key 'optim.lr' (first set at line 2); a key may appear once per section");
  // A repeated section, and a duplicate inside a list element.
  const auto g = write("dup_section.yaml", "optim:\n  lr: 1\nsteps: 3\noptim:\n  name: sgd\n");
  EXPECT_NE(error_of([&] {
              load_config<RootCfg>(g, {});
            }).find("dup_section.yaml:4: duplicate key 'optim' (first set at line 1)"),
            std::string::npos);
  const auto h = write("dup_list.yaml", "tags:\n  - {a: 1, a: 2}\n");
  EXPECT_NE(error_of([&] { load_config<RootCfg>(h, {}); }).find("duplicate key 'tags[0].a'"),
            std::string::npos);
  // In every file of the _base_ chain.
  write("dup_base.yaml", "steps: 1\nflag: true\nsteps: 2\n");
  const auto child = write("dup_child.yaml", "_base_: dup_base.yaml\nflag: false\n");
  EXPECT_NE(error_of([&] {
              load_config<RootCfg>(child, {});
            }).find("dup_base.yaml:3: duplicate key 'steps' (first set at line 1)"),
            std::string::npos);
  // In an override's value.
  const std::string msg = error_of([&] { load_config<RootCfg>("", {"optim={lr: 1, lr: 2}"}); });
  EXPECT_NE(msg.find("command-line override 'optim={lr: 1, lr: 2}':1: duplicate key 'lr'"),
            std::string::npos)
      << msg;
  // The same key in different sections is no duplicate.
  EXPECT_EQ(load_config<RootCfg>(write("ok.yaml", "optim:\n  name: sgd\nmodel:\n  width: 3\n"), {})
                .model.width,
            3);
}

TEST_F(ConfigTest, RestoringAnUnknownKeyIsAnError) {
  EXPECT_EQ(
      error_of([&] { load_config<RootCfg>("", {"~optim.lrr"}); }),
      "command-line override '~optim.lrr': unknown key 'optim.lrr' (did you mean 'optim.lr'?)");
  EXPECT_EQ(error_of([&] { load_config<RootCfg>("", {"~optimm"}); }),
            "command-line override '~optimm': unknown key 'optimm' (did you mean 'optim'?)");
  EXPECT_EQ(error_of([&] { load_config<RootCfg>("", {"~model.lr"}); }),
            "command-line override '~model.lr': unknown key 'model.lr' (did you mean 'optim.lr'?)");
  EXPECT_EQ(error_of([&] { load_config<RootCfg>("", {"~model.sizes[1]"}); }),
            "command-line override '~model.sizes[1]': '~' restores a whole key to its default, not "
            "one element of "
            "list 'model.sizes'; write '~model.sizes'");
  // Known keys and whole sections restore their defaults.
  const auto f = write("ok.yaml", "optim:\n  lr: 0.5\n  name: sgd\nmodel:\n  sizes: [1]\n");
  const auto cfg = load_config<RootCfg>(f, {"~optim", "~model.sizes"});
  EXPECT_DOUBLE_EQ(cfg.optim.lr, 1e-3);
  EXPECT_EQ(cfg.optim.name, "adamw");
  EXPECT_EQ(cfg.model.sizes, (std::vector<int>{224, 224}));
}

TEST_F(ConfigTest, LongValuesAreCutInErrorMessages) {
  const std::string big(1 << 20, 'v');
  for (const std::string& expr :
       {"optim.name=" + big, "steps=" + big, "optim.lr=" + big, "flag=" + big, big + "=1",
        "optim." + big + "=1", "~optim." + big, "tags=[" + big + "", "steps=[" + big + "]"}) {
    const std::string msg = error_of([&] { load_config<RootCfg>("", {expr}); });
    EXPECT_LT(msg.size(), 600u) << msg.substr(0, 600);
    EXPECT_NE(msg.find("(1048"), std::string::npos)
        << msg.substr(0, 600);  // says how long the value was
  }
  const auto f = write("long.yaml", "optim:\n  name: " + big + "\n");
  const std::string msg = error_of([&] { load_config<RootCfg>(f, {}); });
  EXPECT_EQ(msg, f + ":2: key 'optim.name' must be one of adamw|sgd, got '" + std::string(40, 'v') +
                     "...(1048576 bytes)..." + std::string(40, 'v') + "'");
}

// A NUL byte cut the value there without a word ("ab\0cd" read as "ab"): one error naming the
// file, the line and the key, whether the NUL is written as an escape or raw.
TEST_F(ConfigTest, NulByteInAValueIsAnErrorNamingTheKey) {
  const auto escaped = write("nul.yaml", "optim:\n  lr: 0.1\nrun_name: \"ab\\0cd\"\n");
  std::string msg = error_of([&] { load_config<RootCfg>(escaped, {}); });
  EXPECT_EQ(msg.rfind(escaped + ":3:", 0), 0u) << msg;
  EXPECT_NE(msg.find("the value of key 'run_name' holds a NUL byte (at character 2 of 'ab\\0cd')"),
            std::string::npos)
      << msg;
  const char kRaw[] = "steps: 3\noptim:\n  name: sg\0d\n";
  const auto raw = write("raw.yaml", std::string(kRaw, sizeof(kRaw) - 1));
  msg = error_of([&] { load_config<RootCfg>(raw, {}); });
  EXPECT_EQ(msg.rfind(raw + ":3:", 0), 0u) << msg;
  EXPECT_NE(msg.find("'optim.name'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("NUL byte"), std::string::npos) << msg;
  const auto listed = write("list.yaml", "tags: [a, \"b\\x00\"]\n");
  msg = error_of([&] { load_config<RootCfg>(listed, {}); });
  EXPECT_NE(msg.find("the value of key 'tags[1]' holds a NUL byte"), std::string::npos) << msg;
}

TEST_F(ConfigTest, ConfigPathThatIsNotAFileSaysWhatItIs) {
  const auto sub = dir_ / "configs";
  write("configs/bev.yaml", "steps: 1\n");
  EXPECT_EQ(error_of([&] { load_config<RootCfg>(sub.string(), {}); }),
            "config file '" + sub.string() +
                "' is a directory, not a YAML file (pass a YAML file, e.g. '" +
                (sub / "bev.yaml").string() + "')");
  const auto loop = dir_ / "loop.yaml";
  fs::create_symlink(loop, loop);
  EXPECT_EQ(error_of([&] { load_config<RootCfg>(loop.string(), {}); }),
            "config file '" + loop.string() +
                "' cannot be resolved: symlink loop (too many levels of symbolic links)");
  const auto dangling = dir_ / "dangling.yaml";
  fs::create_symlink(dir_ / "gone.yaml", dangling);
  std::string msg = error_of([&] { load_config<RootCfg>(dangling.string(), {}); });
  EXPECT_NE(msg.find("is a dangling symlink"), std::string::npos) << msg;
  // As a base, the including file is named.
  const auto child = write("child.yaml", "_base_: loop.yaml\n");
  msg = error_of([&] { load_config<RootCfg>(child, {}); });
  EXPECT_EQ(msg, child + ": base config '" + loop.string() +
                     "' cannot be resolved: symlink loop (too many levels of "
                     "symbolic links)");
}

TEST_F(ConfigTest, ReadsEveryFieldTypeFromAValidFile) {
  const auto f = write("ok.yaml",
                       "run_name: demo\nflag: true\nsteps: 250\ntags: [a, b]\n"
                       "optim:\n  name: sgd\n  lr: 3e-4\n  betas: [0.8, 0.95]\n"
                       "model:\n  width: 1000000\n  sizes: [64, 32]\n");
  const auto cfg = load_config<RootCfg>(f, {});
  EXPECT_EQ(cfg.run_name, "demo");
  EXPECT_TRUE(cfg.flag);
  EXPECT_EQ(cfg.steps, 250);
  EXPECT_EQ(cfg.tags, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(cfg.optim.name, "sgd");
  // Parsed values are exact: the text is rounded to the nearest double (strtod), as the literal is.
  EXPECT_EQ(cfg.optim.lr, 3e-4);
  EXPECT_EQ(cfg.optim.betas, (std::vector<double>{0.8, 0.95}));
  EXPECT_EQ(cfg.model.width, 1000000);
  EXPECT_EQ(cfg.model.sizes, (std::vector<int>{64, 32}));
}

TEST_F(ConfigTest, OverridesOfEveryType) {
  const auto f = write("ok.yaml", "optim:\n  lr: 0.1\n");
  const auto cfg = load_config<RootCfg>(
      f, {"optim.lr=3e-4", "steps=7", "flag=true", "run_name=hello world", "tags=[x,y,z]",
          "optim.betas=[0.5,0.6]", "model.sizes[1]=17", "model.sizes.0=5", "+model.width=9"});
  EXPECT_EQ(cfg.optim.lr, 3e-4);
  EXPECT_EQ(cfg.steps, 7);
  EXPECT_TRUE(cfg.flag);
  EXPECT_EQ(cfg.run_name, "hello world");
  EXPECT_EQ(cfg.tags, (std::vector<std::string>{"x", "y", "z"}));
  EXPECT_EQ(cfg.optim.betas, (std::vector<double>{0.5, 0.6}));
  EXPECT_EQ(cfg.model.sizes, (std::vector<int>{5, 17}));
  EXPECT_EQ(cfg.model.width, 9);
}

TEST_F(ConfigTest, TildeOverrideRestoresTheDefault) {
  const auto f = write("ok.yaml", "optim:\n  lr: 0.5\n");
  EXPECT_EQ(load_config<RootCfg>(f, {}).optim.lr, 0.5);
  EXPECT_EQ(load_config<RootCfg>(f, {"~optim.lr"}).optim.lr, 1e-3);
}

TEST_F(ConfigTest, ListIndexOutOfRangeNamesTheList) {
  const std::string msg = error_of([&] { load_config<RootCfg>("", {"model.sizes[5]=1"}); });
  EXPECT_NE(msg.find("index 5 is out of range for list 'model.sizes' of 2 elements"),
            std::string::npos)
      << msg;
}

TEST_F(ConfigTest, UnknownKeyNamesFileLineAndSuggests) {
  const auto f = write("typo.yaml", "steps: 3\noptim:\n  name: adamw\n  lrr: 0.1\n");
  const std::string msg = error_of([&] { load_config<RootCfg>(f, {}); });
  EXPECT_NE(msg.find("typo.yaml:4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unknown key 'optim.lrr'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean 'optim.lr'?"), std::string::npos) << msg;
}

TEST_F(ConfigTest, UnknownKeyInWrongSectionSuggestsTheRightSection) {
  const auto f = write("misplaced.yaml", "model:\n  lr: 0.1\n");
  const std::string msg = error_of([&] { load_config<RootCfg>(f, {}); });
  EXPECT_NE(msg.find("unknown key 'model.lr'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean 'optim.lr'?"), std::string::npos) << msg;
}

TEST_F(ConfigTest, UnknownSectionListsSections) {
  const std::string msg = error_of([&] { load_config<RootCfg>("", {"optimm.lr=1"}); });
  EXPECT_NE(msg.find("command-line override 'optimm.lr=1'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unknown section 'optimm'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean 'optim'?"), std::string::npos) << msg;
}

TEST_F(ConfigTest, UnknownOverrideKeySuggests) {
  const std::string msg = error_of([&] { load_config<RootCfg>("", {"optim.betaz=[1,2]"}); });
  EXPECT_NE(msg.find("unknown key 'optim.betaz'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean 'optim.betas'?"), std::string::npos) << msg;
}

TEST_F(ConfigTest, WrongTypesNameKeyAndValue) {
  const auto f = write("types.yaml", "steps: many\n");
  std::string msg = error_of([&] { load_config<RootCfg>(f, {}); });
  EXPECT_NE(msg.find("types.yaml:1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("key 'steps' expects an integer, got 'many'"), std::string::npos) << msg;

  msg = error_of([&] { load_config<RootCfg>("", {"steps=3.5"}); });
  EXPECT_NE(msg.find("expects an integer, got '3.5'"), std::string::npos) << msg;
  msg = error_of([&] { load_config<RootCfg>("", {"optim.lr=fast"}); });
  EXPECT_NE(msg.find("key 'optim.lr' expects a number, got 'fast'"), std::string::npos) << msg;
  msg = error_of([&] { load_config<RootCfg>("", {"flag=maybe"}); });
  EXPECT_NE(msg.find("expects a boolean"), std::string::npos) << msg;
  msg = error_of([&] { load_config<RootCfg>("", {"model.sizes=7"}); });
  EXPECT_NE(msg.find("key 'model.sizes' expects a list of integers"), std::string::npos) << msg;
  msg = error_of([&] { load_config<RootCfg>("", {"model.sizes=[1,x]"}); });
  EXPECT_NE(msg.find("key 'model.sizes[1]' expects an integer, got 'x'"), std::string::npos) << msg;
  msg = error_of([&] { load_config<RootCfg>("", {"optim=3"}); });
  EXPECT_NE(msg.find("key 'optim' expects a section"), std::string::npos) << msg;
  msg = error_of([&] { load_config<RootCfg>("", {"run_name=[1,2]"}); });
  EXPECT_NE(msg.find("key 'run_name' expects a string, got a list"), std::string::npos) << msg;
}

TEST_F(ConfigTest, ConstraintsAreChecked) {
  std::string msg = error_of([&] { load_config<RootCfg>("", {"optim.name=adamm"}); });
  EXPECT_NE(msg.find("must be one of adamw|sgd, got 'adamm' (did you mean 'adamw'?)"),
            std::string::npos)
      << msg;
  msg = error_of([&] { load_config<RootCfg>("", {"optim.lr=0"}); });
  EXPECT_NE(msg.find("key 'optim.lr' must be > 0"), std::string::npos) << msg;
  msg = error_of([&] { load_config<RootCfg>("", {"steps=-1"}); });
  EXPECT_NE(msg.find("key 'steps' must be >= 0"), std::string::npos) << msg;
  msg = error_of([&] { load_config<RootCfg>("", {"optim.betas=[0.9]"}); });
  EXPECT_NE(msg.find("optim.betas' needs 2 values"), std::string::npos) << msg;
}

TEST_F(ConfigTest, MissingFileIsAClearErrorWithSuggestion) {
  write("configs/bev_tiny.yaml", "steps: 1\n");
  std::string msg =
      error_of([&] { load_config<RootCfg>((dir_ / "configs/bev_tin.yaml").string(), {}); });
  EXPECT_NE(msg.find("config file '"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not found"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean"), std::string::npos) << msg;
  EXPECT_NE(msg.find("bev_tiny.yaml"), std::string::npos) << msg;
  msg = error_of([&] { load_config<RootCfg>("nope.yaml", {}); });
  EXPECT_EQ(msg, "config file 'nope.yaml' not found");
}

TEST_F(ConfigTest, MalformedYamlReportsLineAndColumn) {
  const auto f = write("bad.yaml", "steps: 3\noptim:\n  lr: [0.1, 0.2\n  name: sgd\n");
  const std::string msg = error_of([&] { load_config<RootCfg>(f, {}); });
  EXPECT_NE(msg.find("bad.yaml:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("malformed YAML"), std::string::npos) << msg;
  // yaml-cpp reports the line where the flow sequence breaks (3 or 4 depending on version).
  EXPECT_TRUE(msg.find("bad.yaml:3:") != std::string::npos ||
              msg.find("bad.yaml:4:") != std::string::npos)
      << msg;

  const auto g = write("bad2.yaml", "steps: 3\n  bad_indent: 1\n");
  const std::string msg2 = error_of([&] { load_config<RootCfg>(g, {}); });
  EXPECT_NE(msg2.find("bad2.yaml:2:"), std::string::npos) << msg2;
}

TEST_F(ConfigTest, MalformedOverrides) {
  std::string msg = error_of([&] { load_config<RootCfg>("", {"steps"}); });
  EXPECT_NE(msg.find("expected key=value"), std::string::npos) << msg;
  msg = error_of([&] { load_config<RootCfg>("", {"tags=[a,b"}); });
  EXPECT_NE(msg.find("is not valid YAML"), std::string::npos) << msg;
  msg = error_of([&] { load_config<RootCfg>("", {"a..b=1"}); });
  EXPECT_NE(msg.find("malformed key"), std::string::npos) << msg;
  msg = error_of([&] { load_config<RootCfg>("", {"steps.x=1"}); });
  EXPECT_NE(msg.find("'steps' is '10', not a section"), std::string::npos) << msg;
}

TEST_F(ConfigTest, BaseComposition) {
  write("base/optim.yaml", "optim:\n  name: sgd\n  lr: 0.5\n  betas: [0.1, 0.2]\n");
  write("base/model.yaml", "model:\n  width: 8\n  sizes: [1, 2]\nsteps: 99\n");
  const auto child = write("child.yaml",
                           "_base_: [base/optim.yaml, base/model.yaml]\n"
                           "optim:\n  lr: 0.25\n"  // child restates only what changes
                           "model:\n  sizes: [3]\n");
  const auto cfg = load_config<RootCfg>(child, {});
  EXPECT_EQ(cfg.optim.name, "sgd");  // from base
  EXPECT_EQ(cfg.optim.lr, 0.25);     // child wins
  EXPECT_EQ(cfg.optim.betas, (std::vector<double>{0.1, 0.2}));
  EXPECT_EQ(cfg.model.width, 8);                      // nested maps merge
  EXPECT_EQ(cfg.model.sizes, (std::vector<int>{3}));  // lists replace
  EXPECT_EQ(cfg.steps, 99);
  // Overrides win over both.
  EXPECT_EQ(load_config<RootCfg>(child, {"steps=1"}).steps, 1);
}

TEST_F(ConfigTest, BaseChainsAndDeleteReplacesAMap) {
  write("a.yaml", "optim:\n  name: sgd\n  lr: 0.5\n");
  write("b.yaml", "_base_: a.yaml\noptim:\n  lr: 0.4\n");
  const auto c = write("c.yaml", "_base_: b.yaml\noptim:\n  _delete_: true\n  lr: 0.3\n");
  const auto cfg = load_config<RootCfg>(c, {});
  EXPECT_EQ(cfg.optim.lr, 0.3);
  EXPECT_EQ(cfg.optim.name, "adamw");  // the base's `name: sgd` was deleted: back to the default
  EXPECT_EQ(load_config<RootCfg>((dir_ / "b.yaml").string(), {}).optim.name, "sgd");
}

TEST_F(ConfigTest, BaseErrors) {
  const auto a = write("cyc_a.yaml", "_base_: cyc_b.yaml\n");
  write("cyc_b.yaml", "_base_: cyc_a.yaml\n");
  std::string msg = error_of([&] { load_config<RootCfg>(a, {}); });
  EXPECT_NE(msg.find("_base_ cycle: cyc_a.yaml -> cyc_b.yaml -> cyc_a.yaml"), std::string::npos)
      << msg;
  const auto m = write("missing_base.yaml", "_base_: gone.yaml\n");
  msg = error_of([&] { load_config<RootCfg>(m, {}); });
  EXPECT_NE(msg.find("missing_base.yaml: base config"), std::string::npos) << msg;
  EXPECT_NE(msg.find("gone.yaml' not found"), std::string::npos) << msg;
  // An error inside a base file names the base file and line.
  write("bad_base.yaml", "optim:\n  lr: fast\n");
  const auto k = write("uses_bad.yaml", "_base_: bad_base.yaml\nsteps: 2\n");
  msg = error_of([&] { load_config<RootCfg>(k, {}); });
  EXPECT_NE(msg.find("bad_base.yaml:2"), std::string::npos) << msg;
}

TEST_F(ConfigTest, TopLevelMustBeAMapping) {
  const auto f = write("list.yaml", "- a\n- b\n");
  const std::string msg = error_of([&] { load_config<RootCfg>(f, {}); });
  EXPECT_NE(msg.find("must be a mapping"), std::string::npos) << msg;
}

TEST_F(ConfigTest, ResolvedConfigRoundTrips) {
  const auto f = write("ok.yaml", "optim:\n  lr: 3e-4\n  name: sgd\nmodel:\n  sizes: [7, 9]\n");
  auto cfg = load_config<RootCfg>(f, {"tags=[q]"});
  const std::string text = parallax::core::emit_yaml(parallax::core::to_yaml(cfg));
  auto again = load_config<RootCfg>(write("resolved.yaml", text), {});
  EXPECT_EQ(parallax::core::emit_yaml(parallax::core::to_yaml(again)), text);
  EXPECT_EQ(again.optim.lr, 3e-4);
  EXPECT_EQ(again.model.sizes, (std::vector<int>{7, 9}));
  EXPECT_EQ(again.tags, (std::vector<std::string>{"q"}));
  EXPECT_EQ(parallax::core::stable_hash(text).size(), 16u);
}

TEST_F(ConfigTest, KeyListingCoversEveryLeaf) {
  RootCfg cfg;
  const auto keys = parallax::core::list_keys(cfg);
  std::vector<std::string> paths;
  for (const auto& k : keys) paths.push_back(k.path);
  EXPECT_EQ(paths,
            (std::vector<std::string>{"run_name", "flag", "steps", "tags", "optim.name", "optim.lr",
                                      "optim.betas", "model.width", "model.sizes"}));
}

// --help-config shows a double as its shortest round-trip text (YAML's emitter writes 3e-4 as
// 0.00029999999999999997) and a choice key's fixed set.
TEST_F(ConfigTest, KeyListingShowsShortestFloatsAndChoices) {
  RootCfg cfg;
  cfg.optim.lr = 3e-4;
  cfg.optim.betas = {0.1 + 0.2, 0.95};
  std::map<std::string, parallax::core::KeyLister::Entry> by_path;
  for (const auto& k : parallax::core::list_keys(cfg)) by_path[k.path] = k;
  EXPECT_EQ(by_path["optim.lr"].default_value, "0.0003");
  EXPECT_EQ(by_path["optim.betas"].default_value, "[0.30000000000000004, 0.95]");
  EXPECT_EQ(by_path["model.sizes"].default_value, "[224, 224]");
  EXPECT_EQ(by_path["optim.name"].choices, (std::vector<std::string>{"adamw", "sgd"}));
  EXPECT_TRUE(by_path["steps"].choices.empty());
}

}  // namespace

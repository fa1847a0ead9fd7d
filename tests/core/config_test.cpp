// Config system: typed reading, composition through _base_, overrides, and every error path.
#include "core/config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
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

TEST_F(ConfigTest, DefaultsWhenFileIsEmptyOrOmitted) {
  const auto cfg = load_config<RootCfg>(write("empty.yaml", ""), {});
  EXPECT_EQ(cfg.steps, 10);
  EXPECT_EQ(cfg.optim.name, "adamw");
  EXPECT_EQ(cfg.model.sizes, (std::vector<int>{224, 224}));
  const auto cfg2 = load_config<RootCfg>("", {});
  EXPECT_DOUBLE_EQ(cfg2.optim.lr, 1e-3);
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
  EXPECT_DOUBLE_EQ(cfg.optim.lr, 3e-4);
  EXPECT_EQ(cfg.optim.betas, (std::vector<double>{0.8, 0.95}));
  EXPECT_EQ(cfg.model.width, 1000000);
  EXPECT_EQ(cfg.model.sizes, (std::vector<int>{64, 32}));
}

TEST_F(ConfigTest, OverridesOfEveryType) {
  const auto f = write("ok.yaml", "optim:\n  lr: 0.1\n");
  const auto cfg = load_config<RootCfg>(
      f, {"optim.lr=3e-4", "steps=7", "flag=true", "run_name=hello world", "tags=[x,y,z]",
          "optim.betas=[0.5,0.6]", "model.sizes[1]=17", "model.sizes.0=5", "+model.width=9"});
  EXPECT_DOUBLE_EQ(cfg.optim.lr, 3e-4);
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
  EXPECT_DOUBLE_EQ(load_config<RootCfg>(f, {}).optim.lr, 0.5);
  EXPECT_DOUBLE_EQ(load_config<RootCfg>(f, {"~optim.lr"}).optim.lr, 1e-3);
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
  EXPECT_EQ(cfg.optim.name, "sgd");      // from base
  EXPECT_DOUBLE_EQ(cfg.optim.lr, 0.25);  // child wins
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
  EXPECT_DOUBLE_EQ(cfg.optim.lr, 0.3);
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
  EXPECT_DOUBLE_EQ(again.optim.lr, 3e-4);
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

}  // namespace

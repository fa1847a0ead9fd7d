// The verbs of the `parallax` binary. Each takes the arguments after the verb name and returns the
// process exit code; errors are thrown as parallax::Error and reported once by main().
#pragma once

#include <string>
#include <vector>

namespace parallax::launch {

struct Verb {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>& args);
};

int verb_train(const std::vector<std::string>& args);
int verb_export(const std::vector<std::string>& args);
int verb_eval(const std::vector<std::string>& args);
int verb_datagen(const std::vector<std::string>& args);
int verb_convert(const std::vector<std::string>& args);
int verb_inspect(const std::vector<std::string>& args);
int verb_launch(const std::vector<std::string>& args);
int verb_plan(const std::vector<std::string>& args);
int verb_quantize(const std::vector<std::string>& args);

// Every verb that works, in the order `parallax --help` lists them.
const std::vector<Verb>& verbs();

}  // namespace parallax::launch

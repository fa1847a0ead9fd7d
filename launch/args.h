// Command-line parsing for `parallax <verb>`: GNU-style options (`--name value`, `--name=value`,
// flags), Hydra-style `key=value` overrides, positionals, and everything after `--` passed
// through. Unknown options are UsageErrors with a did-you-mean. Help text is generated from the
// declarations, so `--help` can never drift from what the parser accepts.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace parallax::launch {

class Args {
 public:
  Args(std::string verb, std::string summary);

  // `--name VALUE`; `metavar` names VALUE in the help; "" default means "not given".
  Args& option(const std::string& name, const std::string& metavar, const std::string& help,
               const std::string& default_value = "");
  // `--name` (boolean).
  Args& flag(const std::string& name, const std::string& help);
  // Accept `key=value` config overrides.
  Args& overrides(const std::string& help);
  // Accept one positional argument (e.g. a checkpoint path).
  Args& positional(const std::string& name, const std::string& help, bool required = true);
  // Free text appended to --help (examples).
  Args& epilog(const std::string& text);

  // Parses argv after the verb. Throws UsageError (unknown option, missing value or positional).
  // `--help`/`-h` sets help_requested() and skips the required-argument checks.
  void parse(const std::vector<std::string>& argv);

  bool help_requested() const { return help_; }
  std::string help_text() const;

  bool has(const std::string& name) const;  // option given or flag set
  std::string get(const std::string& name) const;
  // UsageError naming the flag for a non-number, an infinite or NaN value, or one that overflows
  // a double ('1e999').
  double get_double(const std::string& name) const;
  // UsageError naming the flag for a non-integer, or one out of range for a 64-bit integer.
  int64_t get_int(const std::string& name) const;
  // The same, also UsageError when the value is outside [min, max]; `why` (the reason for the
  // bound) ends the message. Verbs take every integer through this form: no flag then sizes an
  // allocation, a process count or a loop beyond a stated bound (issue 35).
  int64_t get_int(const std::string& name, int64_t min, int64_t max,
                  const std::string& why = "") const;
  // The same for numbers: `min_exclusive` makes the lower bound strict ("must be > 0").
  double get_double(const std::string& name, double min, double max, bool min_exclusive,
                    const std::string& why = "") const;
  bool flag_set(const std::string& name) const { return has(name); }
  const std::vector<std::string>& override_args() const { return overrides_; }
  std::string positional_value() const { return positional_value_; }

 private:
  struct Spec {
    std::string name, metavar, help, default_value;
    bool is_flag = false;
  };
  const Spec* find(const std::string& name) const;

  std::string verb_, summary_, epilog_;
  std::vector<Spec> specs_;
  std::map<std::string, std::string> values_;
  bool accepts_overrides_ = false, help_ = false;
  std::string overrides_help_, positional_name_, positional_help_;
  bool has_positional_ = false, positional_required_ = false;
  std::vector<std::string> overrides_;
  std::string positional_value_;
};

}  // namespace parallax::launch

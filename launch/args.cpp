#include "launch/args.h"

#include "core/error.h"
#include "core/strings.h"

#include <fmt/format.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>

namespace parallax::launch {

Args::Args(std::string verb, std::string summary)
    : verb_(std::move(verb)), summary_(std::move(summary)) {}

Args& Args::option(const std::string& name, const std::string& metavar, const std::string& help,
                   const std::string& default_value) {
  specs_.push_back({name, metavar, help, default_value, false});
  return *this;
}

Args& Args::flag(const std::string& name, const std::string& help) {
  specs_.push_back({name, "", help, "", true});
  return *this;
}

Args& Args::overrides(const std::string& help) {
  accepts_overrides_ = true;
  overrides_help_ = help;
  return *this;
}

Args& Args::positional(const std::string& name, const std::string& help, bool required) {
  has_positional_ = true;
  positional_name_ = name;
  positional_help_ = help;
  positional_required_ = required;
  return *this;
}

Args& Args::epilog(const std::string& text) {
  epilog_ = text;
  return *this;
}

const Args::Spec* Args::find(const std::string& name) const {
  for (const auto& s : specs_) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

void Args::parse(const std::vector<std::string>& argv) {
  for (std::size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a == "--help" || a == "-h") {
      help_ = true;
      continue;
    }
    if (a == "--") throw_error<UsageError>("{}: unexpected '--'", verb_);
    if (core::starts_with(a, "--")) {
      std::string name = a.substr(2), value;
      bool inline_value = false;
      if (const auto eq = name.find('='); eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
        inline_value = true;
      }
      const Spec* s = find(name);
      if (!s) {
        std::vector<std::string> names;
        for (const auto& sp : specs_) names.push_back(sp.name);
        names.push_back("help");
        const std::string m = core::closest_match(name, names);
        throw_error<UsageError>("{}: unknown option '--{}'{}; see 'parallax {} --help'", verb_,
                                name, m.empty() ? "" : fmt::format(" (did you mean '--{}'?)", m),
                                verb_);
      }
      if (s->is_flag) {
        if (inline_value) throw_error<UsageError>("{}: option '--{}' takes no value", verb_, name);
        values_[name] = "1";
        continue;
      }
      if (!inline_value) {
        if (i + 1 >= argv.size()) {
          throw_error<UsageError>("{}: option '--{}' needs a value ({})", verb_, name, s->metavar);
        }
        value = argv[++i];
      }
      values_[name] = value;
      continue;
    }
    if (accepts_overrides_ && (a.find('=') != std::string::npos || core::starts_with(a, "~"))) {
      overrides_.push_back(a);
      continue;
    }
    if (has_positional_ && positional_value_.empty()) {
      positional_value_ = a;
      continue;
    }
    throw_error<UsageError>("{}: unexpected argument '{}'{}; see 'parallax {} --help'", verb_, a,
                            accepts_overrides_ ? " (config overrides are key=value)" : "", verb_);
  }
  if (help_) return;
  if (has_positional_ && positional_required_ && positional_value_.empty()) {
    throw_error<UsageError>("{}: missing <{}>; see 'parallax {} --help'", verb_, positional_name_,
                            verb_);
  }
}

bool Args::has(const std::string& name) const {
  return values_.count(name) > 0;
}

std::string Args::get(const std::string& name) const {
  auto it = values_.find(name);
  if (it != values_.end()) return it->second;
  const Spec* s = find(name);
  return s ? s->default_value : std::string();
}

double Args::get_double(const std::string& name) const {
  const std::string v = get(name);
  char* end = nullptr;
  errno = 0;
  const double d = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0')
    throw_error<UsageError>("{}: --{} expects a number, got '{}'", verb_, name, core::clip(v));
  // strtod takes "inf" and "nan", and saturates '1e999' to infinity (ERANGE): none is a usable
  // bandwidth, size or timeout. Underflow (ERANGE with a tiny result) keeps the tiny value.
  if (!std::isfinite(d) || (errno == ERANGE && std::fabs(d) > 1.0))
    throw_error<UsageError>("{}: --{} expects a finite number, got '{}'", verb_, name,
                            core::clip(v));
  return d;
}

int64_t Args::get_int(const std::string& name) const {
  const std::string v = get(name);
  char* end = nullptr;
  errno = 0;
  const long long d = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0')
    throw_error<UsageError>("{}: --{} expects an integer, got '{}'", verb_, name, core::clip(v));
  // strtoll saturates to LLONG_MIN/MAX with ERANGE; a later cast to int then turned
  // 99999999999999999999 into -1 ("must not be negative").
  if (errno == ERANGE)
    throw_error<UsageError>("{}: --{} value '{}' is out of range for a 64-bit integer ({}..{})",
                            verb_, name, core::clip(v), std::numeric_limits<int64_t>::min(),
                            std::numeric_limits<int64_t>::max());
  return d;
}

int64_t Args::get_int(const std::string& name, int64_t min, int64_t max,
                      const std::string& why) const {
  const int64_t v = get_int(name);
  if (v < min || v > max) {
    const std::string range = max == std::numeric_limits<int64_t>::max()
                                  ? fmt::format("at least {}", min)
                                  : fmt::format("in {}..{}", min, max);
    throw_error<UsageError>("{}: --{} must be {}, got {}{}", verb_, name, range, v,
                            why.empty() ? "" : "; " + why);
  }
  return v;
}

double Args::get_double(const std::string& name, double min, double max, bool min_exclusive,
                        const std::string& why) const {
  const double v = get_double(name);
  if (v < min || v > max || (min_exclusive && v == min)) {
    throw_error<UsageError>("{}: --{} must be {} {} and at most {}, got {}{}", verb_, name,
                            min_exclusive ? ">" : ">=", min, max, v, why.empty() ? "" : "; " + why);
  }
  return v;
}

std::string Args::help_text() const {
  std::string usage = fmt::format("usage: parallax {}", verb_);
  for (const auto& s : specs_) {
    if (s.default_value.empty() && !s.is_flag)
      usage += fmt::format(" [--{} {}]", s.name, s.metavar);
    else if (s.is_flag)
      usage += fmt::format(" [--{}]", s.name);
    else
      usage += fmt::format(" [--{} {}]", s.name, s.metavar);
  }
  if (has_positional_)
    usage += positional_required_ ? fmt::format(" <{}>", positional_name_)
                                  : fmt::format(" [<{}>]", positional_name_);
  if (accepts_overrides_) usage += " [key=value ...]";
  std::string out = usage + "\n\n" + summary_ + "\n\n";
  if (has_positional_) out += fmt::format("  <{}>\n      {}\n", positional_name_, positional_help_);
  if (accepts_overrides_) out += fmt::format("  key=value\n      {}\n", overrides_help_);
  for (const auto& s : specs_) {
    out +=
        s.is_flag ? fmt::format("  --{}\n", s.name) : fmt::format("  --{} {}\n", s.name, s.metavar);
    out +=
        fmt::format("      {}{}\n", s.help,
                    s.default_value.empty() ? "" : fmt::format(" (default: {})", s.default_value));
  }
  out += "  -h, --help\n      show this help\n";
  if (!epilog_.empty()) out += "\n" + epilog_ + "\n";
  return out;
}

}  // namespace parallax::launch

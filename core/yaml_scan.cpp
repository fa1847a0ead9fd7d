// The hostile-input scan of a YAML config (core/yaml_scan.h).
#include "core/yaml_scan.h"

#include "core/config.h"
#include "core/error.h"
#include "core/strings.h"

#include <fmt/format.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/parser.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

namespace parallax::core::detail {
namespace {

// What a raw NUL byte of a config file is read as (U+FFFF, a noncharacter), so that the scan can
// name its key (scan_and_load).
constexpr const char* kNulMarker = "\xEF\xBF\xBF";

// The hostile-input scan of one YAML document (see config.h), run on the parser's event stream
// before any node tree exists: a node tree cannot hold this check, because yaml-cpp turns an
// alias into a shared node, so a recursive alias is a cycle that every recursive walk (Clone,
// iteration, our own) follows forever, and a billion-laughs document is small as a tree and
// explodes only when walked. Here an alias costs the size its anchor had when it closed, so the
// expanded size is known without expanding anything.
class YamlScan : public YAML::EventHandler {
 public:
  // `nul_marked`: the text's raw NUL bytes were replaced by kNulMarker (scan_and_load).
  YamlScan(std::string name, bool nul_marked) : name_(std::move(name)), nul_marked_(nul_marked) {}

  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}

  void OnNull(const YAML::Mark& mark, YAML::anchor_t anchor) override {
    add({1, 0}, mark, "");
    close_anchor(anchor, {1, 0}, std::string("~"));
    end_node(mark, std::string("~"));
  }

  void OnAlias(const YAML::Mark& mark, YAML::anchor_t anchor) override {
    const auto done = anchors_.find(anchor);
    if (done == anchors_.end()) {
      // yaml-cpp resolves an alias only to an anchor it has seen, so an anchor without a size is
      // still open: the alias sits inside the node it names.
      const auto at = anchor_lines_.find(anchor);
      const int line = at == anchor_lines_.end() ? mark.line + 1 : at->second;
      throw_error<ConfigError>(
          "{}:{}:{}: recursive alias '*{}': it refers to the node that contains it "
          "(anchor '&{}' at line {}); a config cannot contain itself",
          name_, mark.line + 1, mark.column + 1, anchor_name(anchor), anchor_name(anchor), line);
    }
    add(done->second.size, mark, fmt::format(" through alias '*{}'", anchor_name(anchor)));
    end_node(mark, done->second.scalar);
  }

  void OnScalar(const YAML::Mark& mark, const std::string&, YAML::anchor_t anchor,
                const std::string& value) override {
    if (value.find('\0') != std::string::npos ||
        (nul_marked_ && value.find(kNulMarker) != std::string::npos))
      refuse_nul(mark, value);
    const Size size{1, value.size()};
    add(size, mark, "");
    close_anchor(anchor, size, value);
    end_node(mark, value);
  }

  void OnSequenceStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t anchor,
                       YAML::EmitterStyle::value) override {
    open(mark, anchor, false);
  }
  void OnSequenceEnd() override { close(); }

  void OnMapStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t anchor,
                  YAML::EmitterStyle::value) override {
    open(mark, anchor, true);
  }
  void OnMapEnd() override { close(); }

  void OnAnchor(const YAML::Mark& mark, const std::string& name) override {
    pending_anchor_ = name;
    pending_anchor_line_ = mark.line + 1;
  }

 private:
  struct Size {
    std::size_t nodes = 0, bytes = 0;
  };
  struct Anchor {
    Size size;
    std::optional<std::string> scalar;  // the value when the anchored node is a scalar
  };
  struct Frame {
    bool is_map = false;
    YAML::anchor_t anchor = 0;
    Size size;                        // this container's expanded size so far (itself included)
    std::string path;                 // dotted path of this container ("" for the root)
    std::size_t index = 0;            // sequences: next element
    bool expect_key = true;           // maps: the next node is a key
    std::string key;                  // maps: the key whose value comes next ("" for a complex key)
    std::map<std::string, int> keys;  // maps: each key seen, with its line
  };

  std::string anchor_name(YAML::anchor_t a) const {
    const auto it = anchor_names_.find(a);
    return it == anchor_names_.end() ? std::to_string(a) : clip(it->second);
  }

  // Path of the node that starts now, in the frame on top (a key is named by its map's path).
  std::string child_path() const {
    if (frames_.empty()) return "";
    const Frame& f = frames_.back();
    if (!f.is_map) return f.path + "[" + std::to_string(f.index) + "]";
    if (f.expect_key) return f.path;
    return f.key.empty() ? f.path : detail::child_path(f.path, f.key);
  }

  // A NUL byte (written "\0" or "\x00" in a quoted scalar, or raw) would cut the value wherever it
  // is used as a C string (a path, a name): refused, naming the key.
  [[noreturn]] void refuse_nul(const YAML::Mark& mark, const std::string& value) const {
    const bool key = !frames_.empty() && frames_.back().is_map && frames_.back().expect_key;
    const std::string path = child_path();
    const std::size_t marker = std::strlen(kNulMarker);
    std::string shown;  // each NUL as "\0"
    std::size_t first = std::string::npos;
    for (std::size_t i = 0; i < value.size(); ++i) {
      const bool nul =
          value[i] == '\0' || (nul_marked_ && value.compare(i, marker, kNulMarker) == 0);
      if (nul && first == std::string::npos) first = i;
      shown += nul ? "\\0" : std::string(1, value[i]);
      if (nul && value[i] != '\0') i += marker - 1;
    }
    throw_error<ConfigError>(
        "{}:{}:{}: {} holds a NUL byte (at character {} of '{}'), which would cut it there; "
        "remove it",
        name_, mark.line + 1, mark.column + 1,
        key ? (path.empty() ? std::string("a key") : fmt::format("a key of '{}'", clip(path)))
            : fmt::format("the value of key '{}'", clip(path)),
        first, clip(shown));
  }

  // Adds `size` to the running total and to every open container; throws past a limit.
  void add(const Size& size, const YAML::Mark& mark, const std::string& via) {
    total_.nodes += size.nodes;
    total_.bytes += size.bytes;
    for (auto& f : frames_) {
      f.size.nodes += size.nodes;
      f.size.bytes += size.bytes;
    }
    if (total_.nodes > kMaxYamlNodes) {
      throw_error<ConfigError>(
          "{}:{}: too large: more than {} YAML nodes once aliases are expanded{} "
          "(a config holds a few hundred; is this a data file, or an alias bomb?)",
          name_, mark.line + 1, kMaxYamlNodes, via);
    }
    if (total_.bytes > kMaxYamlBytes) {
      throw_error<ConfigError>("{}:{}: too large: more than {} of text once aliases are expanded{}",
                               name_, mark.line + 1,
                               human_bytes(static_cast<double>(kMaxYamlBytes)), via);
    }
  }

  // yaml-cpp reports an anchor's name (OnAnchor) just before the event of the node it names.
  void name_anchor(YAML::anchor_t anchor) {
    if (anchor == 0 || pending_anchor_.empty()) return;
    anchor_names_[anchor] = std::exchange(pending_anchor_, "");
    anchor_lines_[anchor] = pending_anchor_line_;
  }

  // A scalar or null node with `anchor` is complete as soon as it starts.
  void close_anchor(YAML::anchor_t anchor, const Size& size, std::optional<std::string> scalar) {
    if (anchor == 0) return;
    name_anchor(anchor);
    anchors_[anchor] = Anchor{size, std::move(scalar)};
  }

  // A node has been read completely: a key of the map on top (checked for duplicates; `scalar` is
  // its text, none for a complex key), a value, or a sequence element.
  void end_node(const YAML::Mark& mark, const std::optional<std::string>& scalar) {
    if (frames_.empty()) return;
    Frame& f = frames_.back();
    if (!f.is_map) {
      ++f.index;
      return;
    }
    if (!f.expect_key) {
      f.expect_key = true;
      return;
    }
    f.expect_key = false;
    f.key = scalar.value_or("");
    if (!scalar) return;
    const int line = mark.line + 1;
    const auto [it, fresh] = f.keys.emplace(*scalar, line);
    if (!fresh) {
      throw_error<ConfigError>(
          "{}:{}: duplicate key '{}' (first set at line {}); a key may appear once per section",
          name_, line, clip(detail::child_path(f.path, *scalar)), it->second);
    }
  }

  void open(const YAML::Mark& mark, YAML::anchor_t anchor, bool is_map) {
    name_anchor(anchor);
    add({1, 0}, mark, "");  // counts the container in its parents, before it is on the stack
    Frame f;
    f.is_map = is_map;
    f.anchor = anchor;
    f.path = child_path();
    f.size = {1, 0};
    frames_.push_back(std::move(f));
  }

  void close() {
    Frame f = std::move(frames_.back());
    frames_.pop_back();
    if (f.anchor != 0) anchors_[f.anchor] = Anchor{f.size, std::nullopt};
    end_node(YAML::Mark(), std::nullopt);
  }

  std::string name_;
  bool nul_marked_ = false;
  std::vector<Frame> frames_;
  std::map<YAML::anchor_t, Anchor> anchors_;  // closed anchors
  std::map<YAML::anchor_t, std::string> anchor_names_;
  std::map<YAML::anchor_t, int> anchor_lines_;  // 1-based line of each anchor's '&name'
  std::string pending_anchor_;
  int pending_anchor_line_ = 0;
  Size total_;
};

}  // namespace

YAML::Node scan_and_load(const std::string& text, const std::string& name) {
  // yaml-cpp misreads a raw NUL byte ("unknown escape character"): the scan reads the text with a
  // marker in its place, so that it names the key that holds it (YamlScan::refuse_nul).
  const std::size_t nul = text.find('\0');
  std::string marked = text;
  for (std::size_t at = nul; at != std::string::npos; at = marked.find('\0', at))
    marked.replace(at, 1, kNulMarker);
  {
    std::istringstream in(marked);
    YAML::Parser parser(in);
    YamlScan scan(name, nul != std::string::npos);
    parser.HandleNextDocument(scan);  // YAML::Load reads the first document only, as here
  }
  if (nul != std::string::npos) {  // outside any value (a comment): named by its line
    const auto line =
        std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(nul), '\n');
    throw_error<ConfigError>("{}:{}: holds a NUL byte; a config is text: remove it", name,
                             line + 1);
  }
  return YAML::Load(text);
}

}  // namespace parallax::core::detail

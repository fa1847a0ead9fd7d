// The two passes of pickle.h over one opcode stream. Opcode formats follow Python's pickletools
// documentation (protocols 0 to 5); only the subset torch.save writes is given a meaning by load().
#include "checkpoint/pickle.h"

#include "core/error.h"

#include <fmt/format.h>

#include <cstring>
#include <map>
#include <optional>

namespace parallax::checkpoint::pickle {
namespace {

// How an opcode's argument is encoded.
enum class Arg { kNone, kU1, kU2, kI4, kU4, kU8, kF8, kBytes1, kBytes4, kBytes8, kLine, kTwoLines };

struct OpInfo {
  const char* name;
  Arg arg;
};

// Opcode byte -> name and argument format; name nullptr: not an opcode.
const OpInfo& op_info(uint8_t code) {
  static const auto table = [] {
    std::array<OpInfo, 256> t{};
    auto set = [&](int c, const char* n, Arg a) { t[c] = {n, a}; };
    set('(', "MARK", Arg::kNone), set('.', "STOP", Arg::kNone), set('0', "POP", Arg::kNone);
    set('1', "POP_MARK", Arg::kNone), set('2', "DUP", Arg::kNone);
    set('F', "FLOAT", Arg::kLine), set('I', "INT", Arg::kLine), set('J', "BININT", Arg::kI4);
    set('K', "BININT1", Arg::kU1), set('L', "LONG", Arg::kLine), set('M', "BININT2", Arg::kU2);
    set('N', "NONE", Arg::kNone), set('P', "PERSID", Arg::kLine);
    set('Q', "BINPERSID", Arg::kNone), set('R', "REDUCE", Arg::kNone);
    set('S', "STRING", Arg::kLine), set('T', "BINSTRING", Arg::kBytes4);
    set('U', "SHORT_BINSTRING", Arg::kBytes1), set('V', "UNICODE", Arg::kLine);
    set('X', "BINUNICODE", Arg::kBytes4), set('a', "APPEND", Arg::kNone);
    set('b', "BUILD", Arg::kNone), set('c', "GLOBAL", Arg::kTwoLines), set('d', "DICT", Arg::kNone);
    set('}', "EMPTY_DICT", Arg::kNone), set('e', "APPENDS", Arg::kNone);
    set('g', "GET", Arg::kLine), set('h', "BINGET", Arg::kU1), set('i', "INST", Arg::kTwoLines);
    set('j', "LONG_BINGET", Arg::kU4), set('l', "LIST", Arg::kNone);
    set(']', "EMPTY_LIST", Arg::kNone), set('o', "OBJ", Arg::kNone), set('p', "PUT", Arg::kLine);
    set('q', "BINPUT", Arg::kU1), set('r', "LONG_BINPUT", Arg::kU4);
    set('s', "SETITEM", Arg::kNone), set('t', "TUPLE", Arg::kNone);
    set(')', "EMPTY_TUPLE", Arg::kNone), set('u', "SETITEMS", Arg::kNone);
    set('G', "BINFLOAT", Arg::kF8);
    set(0x80, "PROTO", Arg::kU1), set(0x81, "NEWOBJ", Arg::kNone), set(0x82, "EXT1", Arg::kU1);
    set(0x83, "EXT2", Arg::kU2), set(0x84, "EXT4", Arg::kU4), set(0x85, "TUPLE1", Arg::kNone);
    set(0x86, "TUPLE2", Arg::kNone), set(0x87, "TUPLE3", Arg::kNone);
    set(0x88, "NEWTRUE", Arg::kNone), set(0x89, "NEWFALSE", Arg::kNone);
    set(0x8a, "LONG1", Arg::kBytes1), set(0x8b, "LONG4", Arg::kBytes4);
    set('B', "BINBYTES", Arg::kBytes4), set('C', "SHORT_BINBYTES", Arg::kBytes1);
    set(0x8c, "SHORT_BINUNICODE", Arg::kBytes1), set(0x8d, "BINUNICODE8", Arg::kBytes8);
    set(0x8e, "BINBYTES8", Arg::kBytes8), set(0x8f, "EMPTY_SET", Arg::kNone);
    set(0x90, "ADDITEMS", Arg::kNone), set(0x91, "FROZENSET", Arg::kNone);
    set(0x92, "NEWOBJ_EX", Arg::kNone), set(0x93, "STACK_GLOBAL", Arg::kNone);
    set(0x94, "MEMOIZE", Arg::kNone), set(0x95, "FRAME", Arg::kU8);
    set(0x96, "BYTEARRAY8", Arg::kBytes8), set(0x97, "NEXT_BUFFER", Arg::kNone);
    set(0x98, "READONLY_BUFFER", Arg::kNone);
    return t;
  }();
  return table[code];
}

struct Op {
  uint8_t code = 0;
  const char* name = "";
  size_t pos = 0;
  uint64_t n = 0;    // integer arguments (BININT's sign-extended into int64 bits)
  double f = 0;      // BINFLOAT
  std::string a, b;  // byte strings and lines (GLOBAL / INST: module, name)
};

// Walks the opcode stream; every read is bounds-checked.
class Cursor {
 public:
  Cursor(std::string_view data, const std::string& file) : data_(data), file_(file) {}
  bool done() const { return pos_ >= data_.size(); }

  Op next() {
    Op op;
    op.pos = pos_;
    op.code = static_cast<uint8_t>(take(1)[0]);
    const OpInfo& info = op_info(op.code);
    if (!info.name) fail(op.pos, fmt::format("byte 0x{:02x} is not a pickle opcode", op.code));
    op.name = info.name;
    switch (info.arg) {
      case Arg::kNone:
        break;
      case Arg::kU1:
        op.n = le(take(1));
        break;
      case Arg::kU2:
        op.n = le(take(2));
        break;
      case Arg::kU4:
        op.n = le(take(4));
        break;
      case Arg::kU8:
        op.n = le(take(8));
        break;
      case Arg::kI4:
        op.n = static_cast<uint64_t>(
            static_cast<int64_t>(static_cast<int32_t>(static_cast<uint32_t>(le(take(4))))));
        break;
      case Arg::kF8: {
        const std::string_view b = take(8);
        uint8_t rev[8];
        for (int k = 0; k < 8; ++k) rev[k] = static_cast<uint8_t>(b[7 - k]);  // big-endian
        std::memcpy(&op.f, rev, 8);
        break;
      }
      case Arg::kBytes1:
        op.a = std::string(take(le(take(1))));
        break;
      case Arg::kBytes4: {
        const uint64_t len = le(take(4));
        if (len > 0x7fffffffu) fail(op.pos, "a negative length");
        op.a = std::string(take(len));
        break;
      }
      case Arg::kBytes8:
        op.a = std::string(take(le(take(8))));
        break;
      case Arg::kLine:
        op.a = line();
        break;
      case Arg::kTwoLines:
        op.a = line(), op.b = line();
        break;
    }
    return op;
  }

  [[noreturn]] void fail(size_t pos, const std::string& what) const {
    throw_error<CheckpointError>("'{}': data.pkl is not a valid pickle: {} at byte {}", file_, what,
                                 pos);
  }

 private:
  std::string_view take(uint64_t n) {
    if (n > data_.size() - pos_) fail(pos_, "the stream ends inside an opcode");
    const std::string_view out = data_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  static uint64_t le(std::string_view b) {
    uint64_t v = 0;
    for (size_t k = b.size(); k-- > 0;) v = (v << 8) | static_cast<uint8_t>(b[k]);
    return v;
  }
  std::string line() {
    const size_t eol = data_.find('\n', pos_);
    if (eol == std::string_view::npos) fail(pos_, "a line argument without its newline");
    std::string out(data_.substr(pos_, eol - pos_));
    pos_ = eol + 1;
    return out;
  }

  std::string_view data_;
  const std::string& file_;
  size_t pos_ = 0;
};

bool is_string_push(uint8_t c) {
  return c == 'X' || c == 0x8c || c == 0x8d || c == 'U' || c == 'T';
}

[[noreturn]] void refuse_global(const std::string& file, const std::string& what) {
  throw_error<CheckpointError>(
      "'{}': the pickle asks for {}, which is not a tensor or a plain container; nothing was "
      "loaded",
      file, what);
}

// Storage classes of torch.save (legacy typed storages) and the dtypes torch.save names.
const std::map<std::string, at::ScalarType>& storage_classes() {
  static const std::map<std::string, at::ScalarType> m = {
      {"torch.FloatStorage", at::kFloat},
      {"torch.DoubleStorage", at::kDouble},
      {"torch.HalfStorage", at::kHalf},
      {"torch.BFloat16Storage", at::kBFloat16},
      {"torch.LongStorage", at::kLong},
      {"torch.IntStorage", at::kInt},
      {"torch.ShortStorage", at::kShort},
      {"torch.CharStorage", at::kChar},
      {"torch.ByteStorage", at::kByte},
      {"torch.BoolStorage", at::kBool},
      {"torch.storage.UntypedStorage", at::ScalarType::Undefined}};
  return m;
}
const std::map<std::string, at::ScalarType>& dtype_globals() {
  static const std::map<std::string, at::ScalarType> m = {
      {"torch.float8_e4m3fn", at::kFloat8_e4m3fn},
      {"torch.float8_e5m2", at::kFloat8_e5m2},
      {"torch.float32", at::kFloat},
      {"torch.float64", at::kDouble},
      {"torch.float16", at::kHalf},
      {"torch.bfloat16", at::kBFloat16},
      {"torch.int64", at::kLong},
      {"torch.int32", at::kInt},
      {"torch.int16", at::kShort},
      {"torch.int8", at::kChar},
      {"torch.uint8", at::kByte},
      {"torch.bool", at::kBool}};
  return m;
}
constexpr const char* kCallables[] = {
    "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3",
    "torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state",
    "collections.OrderedDict"};

// ---- pass 2 -----------------------------------------------------------------------------------

ValuePtr make(Value::Kind kind) {
  auto v = std::make_shared<Value>();
  v->kind = kind;
  return v;
}

class Loader {
 public:
  Loader(std::string_view data, const std::string& file) : cur_(data, file), file_(file) {}

  ValuePtr run() {
    while (!cur_.done()) {
      op_ = cur_.next();
      if (op_.code == '.') {
        if (stack_.size() != 1 || !marks_.empty()) bad("STOP leaves a stack that is not one value");
        return stack_.back();
      }
      step();
    }
    bad("the stream ends without STOP");
  }

 private:
  [[noreturn]] void bad(const std::string& what) const { cur_.fail(op_.pos, what); }
  [[noreturn]] void unsupported() const {
    throw_error<CheckpointError>(
        "'{}': data.pkl uses pickle opcode {} (at byte {}), outside what torch.save writes for "
        "tensors and plain containers; nothing was loaded",
        file_, op_.name, op_.pos);
  }

  ValuePtr pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back()))
      bad(fmt::format("{} finds too few values on the stack", op_.name));
    ValuePtr v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  ValuePtr& top() {
    if (stack_.empty()) bad(fmt::format("{} finds an empty stack", op_.name));
    return stack_.back();
  }
  std::vector<ValuePtr> pop_mark() {
    if (marks_.empty()) bad(fmt::format("{} without a MARK", op_.name));
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<ValuePtr> out(std::make_move_iterator(stack_.begin() + m),
                              std::make_move_iterator(stack_.end()));
    stack_.resize(m);
    return out;
  }
  void push(ValuePtr v) { stack_.push_back(std::move(v)); }
  ValuePtr integer(int64_t i, Value::Kind kind = Value::Kind::kInt) {
    auto v = make(kind);
    v->i = i;
    return v;
  }
  ValuePtr text(std::string s, Value::Kind kind = Value::Kind::kString) {
    auto v = make(kind);
    v->s = std::move(s);
    return v;
  }
  ValuePtr tuple(std::vector<ValuePtr> items) {
    auto v = make(Value::Kind::kTuple);
    v->items = std::move(items);
    return v;
  }
  ValuePtr& memo_get(uint64_t id) {
    const auto it = memo_.find(id);
    if (it == memo_.end()) bad(fmt::format("memo entry {} is read before it is written", id));
    return it->second;
  }
  static std::string key_of(const Value& k) {
    switch (k.kind) {
      case Value::Kind::kString:
        return "s" + k.s;
      case Value::Kind::kInt:
      case Value::Kind::kBool:
        return "i" + std::to_string(k.i);
      default:
        return fmt::format("p{}", static_cast<const void*>(&k));
    }
  }
  void set_item(Value& dict, ValuePtr key, ValuePtr value) {
    if (dict.kind != Value::Kind::kDict)
      bad(fmt::format("{} on a value that is not a dict", op_.name));
    const auto [it, fresh] = dict.key_index.emplace(key_of(*key), dict.entries.size());
    if (fresh)
      dict.entries.emplace_back(std::move(key), std::move(value));
    else
      dict.entries[it->second].second = std::move(value);
  }
  int64_t as_int(const ValuePtr& v, const char* what) const {
    if (v->kind != Value::Kind::kInt) bad(fmt::format("{} is not an integer", what));
    return v->i;
  }
  std::vector<int64_t> as_ints(const ValuePtr& v, const char* what) const {
    if (v->kind != Value::Kind::kTuple && v->kind != Value::Kind::kList)
      bad(fmt::format("{} is not a tuple of integers", what));
    std::vector<int64_t> out;
    for (const auto& x : v->items) out.push_back(as_int(x, what));
    return out;
  }
  int64_t long_bytes(const std::string& b) const {
    if (b.size() > 8) bad("an integer wider than 64 bits");
    if (b.empty()) return 0;
    uint64_t u = 0;
    for (size_t k = b.size(); k-- > 0;) u = (u << 8) | static_cast<uint8_t>(b[k]);
    if (b.size() < 8 && (static_cast<uint8_t>(b.back()) & 0x80))
      u |= ~uint64_t{0} << (8 * b.size());
    return static_cast<int64_t>(u);
  }
  int64_t line_int(const std::string& s) const {
    try {
      size_t used = 0;
      std::string t = s;
      if (!t.empty() && t.back() == 'L') t.pop_back();
      const int64_t v = std::stoll(t, &used);
      if (used != t.size()) throw std::invalid_argument(s);
      return v;
    } catch (const std::exception&) {
      bad(fmt::format("'{}' is not an integer", s));
    }
  }

  ValuePtr global(const std::string& qualified) {
    if (!is_allowed_global(qualified)) refuse_global(file_, "'" + qualified + "'");
    if (const auto d = dtype_globals().find(qualified); d != dtype_globals().end()) {
      auto v = make(Value::Kind::kDtype);
      v->dtype = d->second;
      return v;
    }
    auto v = text(qualified, Value::Kind::kGlobal);
    if (const auto s = storage_classes().find(qualified); s != storage_classes().end())
      v->dtype = s->second;
    return v;
  }

  // ('storage', <storage class>, key, location, numel): a storage record, not read here.
  ValuePtr persistent(const ValuePtr& pid) {
    if (pid->kind != Value::Kind::kTuple || pid->items.size() != 5 ||
        pid->items[0]->kind != Value::Kind::kString || pid->items[0]->s != "storage")
      bad("a persistent id that is not ('storage', type, key, location, size)");
    const ValuePtr& cls = pid->items[1];
    if (cls->kind != Value::Kind::kGlobal || !storage_classes().count(cls->s))
      bad("a persistent id whose storage type is not a storage class");
    if (pid->items[2]->kind != Value::Kind::kString) bad("a storage key that is not a string");
    const int64_t numel = as_int(pid->items[4], "a storage size");
    if (numel < 0) bad("a negative storage size");
    auto v = make(Value::Kind::kStorage);
    v->tensor.storage_key = pid->items[2]->s;
    v->tensor.dtype = cls->dtype;  // Undefined: untyped storage, numel counts bytes
    const int64_t item = cls->dtype == at::ScalarType::Undefined
                             ? 1
                             : static_cast<int64_t>(c10::elementSize(cls->dtype));
    if (__builtin_mul_overflow(numel, item, &v->tensor.storage_bytes))
      bad("a storage size overflows");
    return v;
  }

  ValuePtr call(const ValuePtr& fn, const ValuePtr& args) {
    if (fn->kind != Value::Kind::kGlobal) bad("REDUCE of a value that is not a global");
    if (args->kind != Value::Kind::kTuple) bad("REDUCE with arguments that are not a tuple");
    const auto& a = args->items;
    const std::string& f = fn->s;
    if (f == "collections.OrderedDict") {
      if (!a.empty()) unsupported();
      return make(Value::Kind::kDict);
    }
    if (f == "torch._utils._rebuild_parameter" ||
        f == "torch._utils._rebuild_parameter_with_state") {
      if (a.empty() || a[0]->kind != Value::Kind::kTensor)
        bad(f + " of a value that is not a tensor");
      return a[0];
    }
    const bool v3 = f == "torch._utils._rebuild_tensor_v3";
    if (f == "torch._utils._rebuild_tensor_v2" || v3) {
      if (a.size() < (v3 ? 7u : 6u) || a[0]->kind != Value::Kind::kStorage)
        bad(f + " with arguments that are not (storage, offset, size, stride, ...)");
      auto v = make(Value::Kind::kTensor);
      v->tensor = a[0]->tensor;
      if (v3) {
        if (a[6]->kind != Value::Kind::kDtype) bad(f + " without a dtype");
        v->tensor.dtype = a[6]->dtype;
      } else if (v->tensor.dtype == at::ScalarType::Undefined) {
        bad(f + " of an untyped storage");
      }
      v->tensor.offset = as_int(a[1], "a tensor's storage offset");
      v->tensor.sizes = as_ints(a[2], "a tensor's size");
      v->tensor.strides = as_ints(a[3], "a tensor's stride");
      return v;
    }
    bad("REDUCE of global '" + f + "', which is not a function");
  }

  void step() {
    using K = Value::Kind;
    switch (op_.code) {
      case 0x80:
        if (op_.n > 5) bad(fmt::format("pickle protocol {} (at most 5 is known)", op_.n));
        break;
      case 0x95:
        break;  // FRAME: a buffering hint
      case '(':
        marks_.push_back(stack_.size());
        break;
      case '0':
        if (!marks_.empty() && marks_.back() == stack_.size())
          marks_.pop_back();
        else
          pop();
        break;
      case '1':
        pop_mark();
        break;
      case '2':
        push(top());
        break;
      case 'N':
        push(make(K::kNone));
        break;
      case 0x88:
        push(integer(1, K::kBool));
        break;
      case 0x89:
        push(integer(0, K::kBool));
        break;
      case 'K':
      case 'M':
      case 'J':
        push(integer(static_cast<int64_t>(op_.n)));
        break;
      case 'I':
        if (op_.a == "00" || op_.a == "01")
          push(integer(op_.a == "01", K::kBool));
        else
          push(integer(line_int(op_.a)));
        break;
      case 'L':
        push(integer(line_int(op_.a)));
        break;
      case 0x8a:
      case 0x8b:
        push(integer(long_bytes(op_.a)));
        break;
      case 'G': {
        auto v = make(K::kFloat);
        v->f = op_.f;
        push(v);
        break;
      }
      case 'F': {
        auto v = make(K::kFloat);
        try {
          v->f = std::stod(op_.a);
        } catch (const std::exception&) {
          bad("a FLOAT that is not a number");
        }
        push(v);
        break;
      }
      case 'X':
      case 0x8c:
      case 0x8d:
      case 'U':
      case 'T':
        push(text(op_.a));
        break;
      case 'B':
      case 'C':
      case 0x8e:
      case 0x96:
        push(text(op_.a, K::kBytes));
        break;
      case ')':
        push(tuple({}));
        break;
      case 't':
        push(tuple(pop_mark()));
        break;
      case 0x85:
      case 0x86:
      case 0x87: {
        std::vector<ValuePtr> items(op_.code - 0x84);
        for (size_t k = items.size(); k-- > 0;) items[k] = pop();
        push(tuple(std::move(items)));
        break;
      }
      case ']':
        push(make(K::kList));
        break;
      case 'l': {
        auto v = make(K::kList);
        v->items = pop_mark();
        push(v);
        break;
      }
      case 'a': {
        ValuePtr item = pop();
        if (top()->kind != K::kList) bad("APPEND to a value that is not a list");
        top()->items.push_back(std::move(item));
        break;
      }
      case 'e': {
        std::vector<ValuePtr> items = pop_mark();
        if (top()->kind != K::kList) bad("APPENDS to a value that is not a list");
        for (auto& x : items) top()->items.push_back(std::move(x));
        break;
      }
      case '}':
        push(make(K::kDict));
        break;
      case 'd': {
        std::vector<ValuePtr> items = pop_mark();
        if (items.size() % 2) bad("DICT with an odd number of values");
        auto v = make(K::kDict);
        for (size_t k = 0; k < items.size(); k += 2) set_item(*v, items[k], items[k + 1]);
        push(v);
        break;
      }
      case 's': {
        ValuePtr value = pop(), key = pop();
        set_item(*top(), std::move(key), std::move(value));
        break;
      }
      case 'u': {
        std::vector<ValuePtr> items = pop_mark();
        if (items.size() % 2) bad("SETITEMS with an odd number of values");
        ValuePtr dict = top();
        for (size_t k = 0; k < items.size(); k += 2) set_item(*dict, items[k], items[k + 1]);
        break;
      }
      case 'h':
      case 'j':
        push(memo_get(op_.n));
        break;
      case 'g':
        push(memo_get(static_cast<uint64_t>(line_int(op_.a))));
        break;
      case 'q':
      case 'r':
        memo_[op_.n] = top();
        break;
      case 'p':
        memo_[static_cast<uint64_t>(line_int(op_.a))] = top();
        break;
      case 0x94:
        memo_[memo_.size()] = top();
        break;
      case 'c':
        push(global(op_.a + "." + op_.b));
        break;
      case 0x93: {
        ValuePtr name = pop(), module = pop();
        if (module->kind != K::kString || name->kind != K::kString)
          bad("STACK_GLOBAL of values that are not strings");
        push(global(module->s + "." + name->s));
        break;
      }
      case 'Q':
        push(persistent(pop()));
        break;
      case 'R': {
        ValuePtr args = pop(), fn = pop();
        push(call(fn, args));
        break;
      }
      case 'b': {
        pop();  // the state: an OrderedDict's attributes (a state_dict's _metadata)
        if (top()->kind != K::kDict) unsupported();
        break;
      }
      default:
        unsupported();
    }
  }

  Cursor cur_;
  const std::string& file_;
  Op op_;
  std::vector<ValuePtr> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, ValuePtr> memo_;
};

}  // namespace

bool is_allowed_global(const std::string& qualified) {
  if (storage_classes().count(qualified) || dtype_globals().count(qualified)) return true;
  for (const char* c : kCallables)
    if (qualified == c) return true;
  return false;
}

void check_globals(std::string_view pickle, const std::string& file) {
  Cursor cur(pickle, file);
  // The strings known to sit on top of the stack (innermost last), as far as a plain walk can
  // tell: string pushes and memo reads of strings; any other opcode makes the top unknown.
  std::vector<std::optional<std::string>> top;
  std::map<uint64_t, std::optional<std::string>> memo;
  auto top_string = [&]() { return top.empty() ? std::nullopt : top.back(); };
  while (!cur.done()) {
    const Op op = cur.next();
    const uint8_t c = op.code;
    if (c == '.') break;
    if (is_string_push(c)) {
      top.push_back(op.a);
    } else if (c == 'h' || c == 'j' || c == 'g') {
      uint64_t id = op.n;
      if (c == 'g') id = static_cast<uint64_t>(std::strtoull(op.a.c_str(), nullptr, 10));
      const auto it = memo.find(id);
      top.push_back(it == memo.end() ? std::nullopt : it->second);
    } else if (c == 'q' || c == 'r' || c == 'p') {
      uint64_t id = op.n;
      if (c == 'p') id = static_cast<uint64_t>(std::strtoull(op.a.c_str(), nullptr, 10));
      memo[id] = top_string();
    } else if (c == 0x94) {
      memo[memo.size()] = top_string();
    } else if (c == 0x80 || c == 0x95) {
      // PROTO, FRAME: no effect on the stack
    } else if (c == 'c' || c == 'i') {
      if (!is_allowed_global(op.a + "." + op.b)) refuse_global(file, "'" + op.a + "." + op.b + "'");
      top.clear();
    } else if (c == 0x93) {
      if (top.size() < 2 || !top[top.size() - 2] || !top.back())
        refuse_global(file, fmt::format("a global (STACK_GLOBAL at byte {}) whose name cannot be "
                                        "told before unpickling",
                                        op.pos));
      const std::string q = *top[top.size() - 2] + "." + *top.back();
      if (!is_allowed_global(q)) refuse_global(file, "'" + q + "'");
      top.clear();
    } else if (c == 0x82 || c == 0x83 || c == 0x84) {
      refuse_global(file, fmt::format("extension code {} ({} at byte {}), a global that cannot be "
                                      "checked",
                                      op.n, op.name, op.pos));
    } else {
      top.clear();
    }
  }
}

ValuePtr load(std::string_view pickle, const std::string& file) {
  return Loader(pickle, file).run();
}

}  // namespace parallax::checkpoint::pickle

// Foreign tensor files (tensor_source.h) from C++ alone: safetensors written and read back bitwise
// (every dtype, empty and scalar shapes, unaligned data), read() as a view of the mapping, sharded
// sets, hostile headers and indexes (each a CheckpointError naming the file and the tensor), a
// failing write (no file, no temporary left), and the pickle global check on hand-made opcode
// streams. Files made by the Python libraries are tested by tensor_source_test.py.
#include "checkpoint/tensor_source.h"
#include "checkpoint/pickle.h"
#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "test_util.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <fstream>

using namespace parallax;
using namespace parallax::checkpoint;
using parallax::ckpt_test::bitwise_equal;
using parallax::ckpt_test::contains;
using parallax::ckpt_test::random_tensor;
using parallax::ckpt_test::ScratchDir;
namespace fs = std::filesystem;

namespace {

template <class E, class F>
std::string expect_error(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
    return {};
  }
  ADD_FAILURE() << "no exception";
  return {};
}

const std::vector<at::ScalarType> kAllDtypes = {
    at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kLong,          at::kInt,
    at::kShort,  at::kChar,  at::kByte, at::kBool,     at::kFloat8_e4m3fn, at::kFloat8_e5m2};

at::Tensor fresh(at::ScalarType dtype, const std::vector<int64_t>& shape, at::Generator& gen) {
  if (dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2)
    return random_tensor(at::kFloat, shape, gen).to(dtype);
  return random_tensor(dtype, shape, gen);
}

// A file of: 8-byte header length (`length`, or the header's size), the header, `data` bytes.
void craft(const fs::path& path, const std::string& header, size_t data_bytes,
           int64_t length = -1) {
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = length >= 0 ? static_cast<uint64_t>(length) : header.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << std::string(data_bytes, '\x01');
}

}  // namespace

TEST(SafetensorsTest, RoundTripOfEveryDtypeIsBitwise) {
  ScratchDir tmp("st_roundtrip");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  std::vector<std::pair<std::string, at::Tensor>> in;
  for (size_t i = 0; i < kAllDtypes.size(); ++i)
    in.emplace_back("t" + std::to_string(100 - i), fresh(kAllDtypes[i], {3, 5}, gen));
  in.emplace_back("empty", at::empty({0, 4}, at::kFloat));
  in.emplace_back("scalar", fresh(at::kFloat, {}, gen));
  in.emplace_back("strided", fresh(at::kFloat, {6, 4}, gen).t());  // not contiguous in memory
  const std::string file = (tmp / "w.safetensors").string();
  const int64_t bytes = write_safetensors(file, in, {{"format", "pt"}, {"step", "12"}});
  EXPECT_EQ(bytes, static_cast<int64_t>(fs::file_size(file)));
  EXPECT_TRUE(is_tensor_source(file));
  auto src = open_tensor_source(file);
  EXPECT_EQ(src->format(), "safetensors");
  EXPECT_EQ(src->metadata(),
            (std::map<std::string, std::string>{{"format", "pt"}, {"step", "12"}}));
  ASSERT_EQ(src->tensors().size(), in.size());
  for (size_t i = 1; i < src->tensors().size(); ++i)
    EXPECT_LT(src->tensors()[i - 1].name, src->tensors()[i].name);
  for (const auto& [name, t] : in) {
    const at::Tensor r = src->read(name);
    EXPECT_TRUE(bitwise_equal(r, t)) << name;
    EXPECT_EQ(r.scalar_type(), t.scalar_type()) << name;
  }
  const std::string m = expect_error<CheckpointError>([&] { src->read("nope"); });
  EXPECT_TRUE(contains(m, file) && contains(m, "nope")) << m;
}

TEST(SafetensorsTest, ReadIsAViewOfTheMappingThatOutlivesTheSource) {
  ScratchDir tmp("st_view");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  const at::Tensor a = fresh(at::kFloat, {64, 64}, gen);
  const std::string file = (tmp / "v.safetensors").string();
  write_safetensors(file, {{"a", a}});
  at::Tensor r;
  {
    auto src = open_tensor_source(file);
    const auto [begin, end] = safetensors::mapped_range(*src);
    r = src->read("a");
    const auto* p = static_cast<const uint8_t*>(r.const_data_ptr());
    EXPECT_GE(p, static_cast<const uint8_t*>(begin));
    EXPECT_LE(p + r.nbytes(), static_cast<const uint8_t*>(end));
  }
  fs::remove(file);  // the mapping keeps the data; the view keeps the mapping
  EXPECT_TRUE(bitwise_equal(r, a));
}

TEST(SafetensorsTest, UnalignedTensorsReadByCopy) {
  ScratchDir tmp("st_unaligned");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  const at::Tensor a = fresh(at::kChar, {3}, gen), b = fresh(at::kFloat, {7}, gen);
  const std::string file = (tmp / "u.safetensors").string();
  write_safetensors(file, {{"b", b}, {"a", a}});  // laid out by name: b starts 3 bytes in
  auto src = open_tensor_source(file);
  const at::Tensor r = src->read("b");
  EXPECT_NE(reinterpret_cast<uintptr_t>(r.const_data_ptr()) % alignof(float), 0u);
  at::Tensor param = at::zeros({7});
  param.copy_(r);
  EXPECT_TRUE(bitwise_equal(param, b));
  EXPECT_TRUE(bitwise_equal(r.clone(), b));
}

TEST(SafetensorsTest, HostileHeadersAreRefusedNamingFileAndTensor) {
  ScratchDir tmp("st_hostile");
  int k = 0;
  // Each case: header, data bytes, forced header length; the parts the message must name.
  auto refused = [&](const std::string& header, size_t data, int64_t length,
                     const std::vector<std::string>& parts) {
    const fs::path p = tmp / ("bad" + std::to_string(k++) + ".safetensors");
    craft(p, header, data, length);
    const std::string m = expect_error<CheckpointError>([&] { open_tensor_source(p.string()); });
    EXPECT_TRUE(contains(m, p.string())) << m;
    for (const auto& part : parts) EXPECT_TRUE(contains(m, part)) << header << " -> " << m;
  };
  const std::string ok = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  refused(ok, 8, 1 << 20, {"past the end"});    // header length larger than file
  refused(ok, 8, int64_t{1} << 40, {"limit"});  // over 100 MB
  refused("{not json", 0, -1, {"not valid UTF-8 JSON"});
  refused("[1,2]", 0, -1, {"not an object"});
  refused(ok, 4, -1, {"'w'", "past the"});  // data truncated
  refused(R"({"w":{"dtype":"F31","shape":[2],"data_offsets":[0,8]}})", 8, -1, {"'w'", "F31"});
  refused(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, -1, {"'w'", "-2"});
  refused(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, -1, {"'w'", "needs 12"});
  refused(R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", 8, -1,
          {"'w'", "overflows"});
  refused(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8, -1, {"'w'"});
  refused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
              "b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
          12, -1, {"'a'", "'b'", "overlap"});
  refused(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
              "b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
          12, -1, {"hole", "'b'"});
  refused(ok, 12, -1, {"cover 8 bytes"});  // trailing bytes no tensor owns
  refused(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
              "w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
          8, -1, {"'w' twice"});
  refused(R"({"__metadata__":{"a":1},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, -1,
          {"__metadata__"});
  // Shorter than the 8-byte length.
  const fs::path tiny = tmp / "tiny.safetensors";
  std::ofstream(tiny, std::ios::binary) << "abc";
  const std::string m = expect_error<CheckpointError>([&] { open_tensor_source(tiny.string()); });
  EXPECT_TRUE(contains(m, tiny.string()) && contains(m, "too short")) << m;
  // A file that is not there.
  const std::string m2 =
      expect_error<IoError>([&] { open_tensor_source((tmp / "none.safetensors").string()); });
  EXPECT_TRUE(contains(m2, "none.safetensors")) << m2;
}

TEST(SafetensorsTest, ATruncatedFileIsRefused) {
  ScratchDir tmp("st_trunc");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  const std::string file = (tmp / "t.safetensors").string();
  write_safetensors(file,
                    {{"a", fresh(at::kFloat, {100}, gen)}, {"b", fresh(at::kLong, {9}, gen)}});
  for (const auto size : {fs::file_size(file) - 1, fs::file_size(file) / 2, uint64_t{7}}) {
    fs::resize_file(file, size);
    const std::string m = expect_error<CheckpointError>([&] { open_tensor_source(file); });
    EXPECT_TRUE(contains(m, file)) << m;
  }
}

TEST(SafetensorsTest, ShardedSetsReadAsOneAndBadIndexesAreRefused) {
  ScratchDir tmp("st_sharded");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  const at::Tensor a = fresh(at::kFloat, {4}, gen), b = fresh(at::kBFloat16, {2, 3}, gen),
                   c = fresh(at::kLong, {5}, gen);
  const fs::path dir = tmp / "model";
  fs::create_directories(dir);
  write_safetensors((dir / "model-00001-of-00002.safetensors").string(), {{"a", a}, {"c", c}});
  write_safetensors((dir / "model-00002-of-00002.safetensors").string(), {{"b", b}});
  const auto index = [&](const std::string& text, const std::string& name) {
    std::ofstream(dir / name) << text;
    return (dir / name).string();
  };
  const std::string good = index(R"({"metadata": {"total_size": 72}, "weight_map": {
      "a": "model-00001-of-00002.safetensors", "c": "model-00001-of-00002.safetensors",
      "b": "model-00002-of-00002.safetensors"}})",
                                 "model.safetensors.index.json");
  EXPECT_TRUE(is_tensor_source(dir.string()));
  for (const std::string& path : {good, dir.string()}) {
    auto src = open_tensor_source(path);
    ASSERT_EQ(src->tensors().size(), 3u);
    EXPECT_EQ(src->tensors()[1].name, "b");
    EXPECT_EQ(src->tensors()[1].dtype, at::kBFloat16);
    EXPECT_EQ(src->metadata().at("total_size"), "72");
    EXPECT_TRUE(bitwise_equal(src->read("a"), a));
    EXPECT_TRUE(bitwise_equal(src->read("b"), b));
    EXPECT_TRUE(bitwise_equal(src->read("c"), c));
  }
  fs::create_directories(tmp / "elsewhere");
  write_safetensors((tmp / "elsewhere" / "x.safetensors").string(), {{"x", a}});
  const auto refused = [&](const std::string& text, const std::vector<std::string>& parts) {
    const std::string p = index(text, "bad.safetensors.index.json");
    const std::string m = expect_error<CheckpointError>([&] { open_tensor_source(p); });
    EXPECT_TRUE(contains(m, p)) << m;
    for (const auto& part : parts) EXPECT_TRUE(contains(m, part)) << m;
  };
  refused(R"({"weight_map": {"x": "../elsewhere/x.safetensors"}})", {"../elsewhere", "inside"});
  refused(R"({"weight_map": {"x": ")" + (tmp / "elsewhere" / "x.safetensors").string() + R"("}})",
          {"inside"});
  refused(R"({"weight_map": {"a": "model-00001-of-00002.safetensors",
                             "z": "model-00002-of-00002.safetensors"}})",
          {"'z'", "lacks"});
  write_safetensors((dir / "dup.safetensors").string(), {{"a", a}});
  refused(R"({"weight_map": {"a": "dup.safetensors", "c": "model-00001-of-00002.safetensors"}})",
          {"'a'", "two shards"});
  refused(R"({"weight": {}})", {"weight_map"});
}

TEST(SafetensorsTest, AFailedWriteLeavesNoFileAndNamesIt) {
  ScratchDir tmp("st_full");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  const at::Tensor big = fresh(at::kFloat, {1 << 19}, gen);  // 2 MiB
  const std::string file = (tmp / "big.safetensors").string();
  // The file size limit fails writes past 1 MiB with EFBIG, as a full disk fails them (ENOSPC).
  rlimit old{};
  getrlimit(RLIMIT_FSIZE, &old);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit lim = old;
  lim.rlim_cur = 1 << 20;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &lim), 0);
  const std::string m = expect_error<IoError>([&] { write_safetensors(file, {{"big", big}}); });
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_TRUE(contains(m, file)) << m;
  EXPECT_TRUE(fs::is_empty(tmp.str())) << "a temporary file was left";
  // Bad input is refused before anything is created.
  const std::string m2 = expect_error<CheckpointError>([&] {
    write_safetensors(file, {{"a", big}, {"a", big}});
  });
  EXPECT_TRUE(contains(m2, "'a'")) << m2;
  EXPECT_THROW(write_safetensors(file, {{"c", at::zeros({2}, at::kComplexFloat)}}),
               CheckpointError);
  EXPECT_TRUE(fs::is_empty(tmp.str()));
}

// ---- the pickle global check, on hand-made opcode streams -------------------------------------

namespace {
using namespace std::string_literals;
std::string refusal(const std::string& pkl) {
  return expect_error<CheckpointError>([&] { pickle::check_globals(pkl, "w.pt"); });
}
std::string short_unicode(const std::string& s) {
  return "\x8c"s + static_cast<char>(s.size()) + s;
}
std::string unicode(const std::string& s) {  // BINUNICODE
  const uint32_t n = static_cast<uint32_t>(s.size());
  return "X"s + std::string(reinterpret_cast<const char*>(&n), 4) + s;
}
std::string byte1(int v) {
  return "K"s + static_cast<char>(v);
}  // BININT1
}  // namespace

TEST(PickleCheckTest, GlobalsOffTheAllowListAreRefused) {
  // protocol 2: GLOBAL 'os system', then REDUCE of ('touch x',)
  const std::string p2 =
      "\x80\x02"s + "cos\nsystem\n" + "q"s + '\0' + unicode("touch x") + "\x85R.";
  const std::string m = refusal(p2);
  EXPECT_TRUE(contains(m, "w.pt") && contains(m, "'os.system'") &&
              contains(m, "nothing was loaded"))
      << m;
  // protocol 4: STACK_GLOBAL of two memoized strings.
  const std::string p4 = "\x80\x04\x95"s + std::string(8, '\0') + short_unicode("os") + "\x94" +
                         short_unicode("system") + "\x94\x93.";
  EXPECT_TRUE(contains(refusal(p4), "'os.system'"));
  // The same strings fetched back from the memo (BINGET 0, BINGET 1).
  const std::string p4m = "\x80\x04"s + short_unicode("builtins") + "\x94" + short_unicode("eval") +
                          "\x94" + "00" + "h"s + '\0' + "h\x01\x93.";
  EXPECT_TRUE(contains(refusal(p4m), "'builtins.eval'"));
  // Strings the walk cannot tell (one made by DUP): refused rather than guessed.
  const std::string dup = "\x80\x04"s + short_unicode("os") + "2\x93.";
  EXPECT_TRUE(contains(refusal(dup), "cannot be told"));
  // EXT1 (a copyreg code) and INST.
  EXPECT_TRUE(contains(refusal("\x80\x02\x82\x05."s), "EXT1"));
  EXPECT_TRUE(contains(refusal("(ios\nsystem\n."s), "'os.system'"));
  // Allowed globals pass.
  EXPECT_NO_THROW(pickle::check_globals("\x80\x02"s + "ccollections\nOrderedDict\n)R.", "w.pt"));
}

TEST(PickleCheckTest, ALoadedOrderedDictKeepsTensorRefs) {
  // OrderedDict(w=_rebuild_tensor_v2(('storage', FloatStorage, '0', 'cpu', 6), 1, (2, 2), (2, 1),
  // False, OrderedDict())) with BUILD of its attributes ({'_metadata': None}), protocol 2, as
  // torch.save writes a state_dict.
  const std::string pkl = "\x80\x02"s + "ccollections\nOrderedDict\n" + "q"s + '\0' + ")R(" +
                          unicode("w") + "ctorch._utils\n_rebuild_tensor_v2\n" + "((" +
                          unicode("storage") + "ctorch\nFloatStorage\n" + unicode("0") +
                          unicode("cpu") + byte1(6) + "tQ" + byte1(1) + byte1(2) + byte1(2) +
                          "\x86" + byte1(2) + byte1(1) + "\x86" + "\x89" + "h"s + '\0' + ")Rt" +
                          "Ru" + "}" + unicode("_metadata") + "Nsb.";
  pickle::check_globals(pkl, "w.pt");
  const auto v = pickle::load(pkl, "w.pt");
  ASSERT_EQ(v->kind, pickle::Value::Kind::kDict);
  ASSERT_EQ(v->entries.size(), 1u);
  const auto& t = v->entries[0].second->tensor;
  EXPECT_EQ(v->entries[0].first->s, "w");
  EXPECT_EQ(t.storage_key, "0");
  EXPECT_EQ(t.storage_bytes, 24);
  EXPECT_EQ(t.dtype, at::kFloat);
  EXPECT_EQ(t.offset, 1);
  EXPECT_EQ(t.sizes, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(t.strides, (std::vector<int64_t>{2, 1}));
}

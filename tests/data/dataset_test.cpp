// Datasets on disk: generation determinism, reading back, and every bad-data case.
#include "data/dataset.h"
#include "core/error.h"
#include "core/timer.h"
#include "data/datagen.h"
#include "data/loader.h"
#include "data/sampler.h"
#include "data/shard.h"
#include "test_util.h"

#include <hdf5.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

namespace parallax::data {
namespace {

using testing::expect_data_error;
using testing::read_bytes;
using testing::small_options;
using testing::TempDir;
namespace fs = std::filesystem;

void expect_same_record(const SceneRecord& a, const SceneRecord& b) {
  EXPECT_EQ(a.index, b.index);
  EXPECT_TRUE(at::equal(a.images, b.images));
  EXPECT_TRUE(at::equal(a.intrinsics, b.intrinsics));
  EXPECT_TRUE(at::equal(a.cam_to_ego, b.cam_to_ego));
  EXPECT_TRUE(at::equal(a.bev_semantics, b.bev_semantics));
  EXPECT_TRUE(at::equal(a.boxes, b.boxes));
}

// One generated dataset shared by the read-only tests (7 train scenes in 2 shards, 3 val).
class GeneratedDatasetTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<TempDir>("shared");
    opts_ = small_options(dir_->str(), 7, 3);
    generate_dataset(opts_);
  }
  static void TearDownTestSuite() { dir_.reset(); }
  static std::unique_ptr<TempDir> dir_;
  static DatagenOptions opts_;
};
std::unique_ptr<TempDir> GeneratedDatasetTest::dir_;
DatagenOptions GeneratedDatasetTest::opts_;

TEST_F(GeneratedDatasetTest, DatasetJsonDescribesTheShards) {
  const DatasetInfo info = read_dataset_info(dir_->str());
  EXPECT_EQ(info.schema_version, kSchemaVersion);
  EXPECT_EQ(info.cameras, 4);
  EXPECT_EQ(info.image_height, 48);
  EXPECT_EQ(info.image_width, 80);
  EXPECT_EQ(info.bev.x_cells(), 100);
  EXPECT_EQ(info.split("train").scenes, 7);
  EXPECT_EQ(info.split("train").shards,
            (std::vector<std::string>{"train_00000.h5", "train_00001.h5"}));
  EXPECT_EQ(info.split("val").scenes, 3);
  EXPECT_NE(info.generator.find("seed 7"), std::string::npos);
  const core::SceneSpec spec = info.scene_spec();
  EXPECT_EQ(spec.num_cameras, 4);
  EXPECT_EQ(spec.bev_x_cells(), 100);
  EXPECT_EQ(spec.box_classes.size(), 3u);
  EXPECT_THROW(info.split("test"), DataError);
}

TEST_F(GeneratedDatasetTest, ScenesReadBackExactlyAsGenerated) {
  const auto train = Dataset::open(dir_->str(), "train");
  const auto val = Dataset::open(dir_->str(), "val");
  ASSERT_EQ(train->size(), 7);
  ASSERT_EQ(val->size(), 3);
  for (int64_t i : {0, 4, 6}) {
    expect_same_record(train->read(i), generate_scene(opts_.gen, split_seed(7, "train"), i).record);
  }
  expect_same_record(val->read(2), generate_scene(opts_.gen, split_seed(7, "val"), 2).record);
  // The splits have their own seeds.
  EXPECT_FALSE(at::equal(train->read(0).images, val->read(0).images));
  EXPECT_THROW(train->read(7), DataError);
}

TEST(DatagenTest, SameSeedGivesBitwiseIdenticalFilesWithOneOrTwoThreads) {
  TempDir a("det_a"), b("det_b"), c("det_c");
  auto oa = small_options(a.str(), 6, 2, 3);
  oa.threads = 1;
  auto ob = small_options(b.str(), 6, 2, 3);
  ob.threads = 2;
  auto oc = small_options(c.str(), 6, 2, 4);
  generate_dataset(oa);
  generate_dataset(ob);
  generate_dataset(oc);
  for (const char* f : {"dataset.json", "train_00000.h5", "train_00001.h5", "val_00000.h5"}) {
    const std::string fa = read_bytes(a.file(f)), fb = read_bytes(b.file(f));
    EXPECT_GT(fa.size(), 0u) << f;
    EXPECT_TRUE(fa == fb) << f << " differs between 1 and 2 threads";
  }
  EXPECT_FALSE(read_bytes(a.file("train_00000.h5")) == read_bytes(c.file("train_00000.h5")))
      << "seed ignored";
}

TEST(DatagenTest, RefusesToOverwriteWithoutPermission) {
  TempDir d("overwrite");
  auto o = small_options(d.str(), 2, 0);
  generate_dataset(o);
  EXPECT_THROW(generate_dataset(o), UsageError);
  o.overwrite = true;
  o.train_scenes = 1;
  generate_dataset(o);
  EXPECT_EQ(read_dataset_info(d.str()).split("train").scenes, 1);
  EXPECT_FALSE(fs::exists(d.file("val_00000.h5")));
}

// ---- Bad data
// --------------------------------------------------------------------------------------

class BadDataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::make_unique<TempDir>("bad");
    generate_dataset(small_options(dir_->str(), 7, 0));
  }
  std::unique_ptr<TempDir> dir_;
};

TEST_F(BadDataTest, MissingDatasetJson) {
  fs::remove(dir_->file("dataset.json"));
  expect_data_error([&] { Dataset::open(dir_->str(), "train"); },
                    {dir_->file("dataset.json"), "not found"});
  expect_data_error([&] { Dataset::open(dir_->file("nope"), "train"); },
                    {dir_->file("nope"), "does not exist"});
}

TEST_F(BadDataTest, MalformedDatasetJson) {
  std::ofstream(dir_->file("dataset.json")) << "{\"schema_version\": 1, \"cameras\": [4,\n";
  expect_data_error([&] { Dataset::open(dir_->str(), "train"); },
                    {"dataset.json", "malformed JSON"});
  std::ofstream(dir_->file("dataset.json")) << "{\"schema_version\": 1, \"cameras\": \"four\"}";
  expect_data_error([&] { Dataset::open(dir_->str(), "train"); }, {"dataset.json", "'cameras'"});
}

TEST_F(BadDataTest, MissingShard) {
  fs::remove(dir_->file("train_00001.h5"));
  expect_data_error([&] { Dataset::open(dir_->str(), "train"); },
                    {dir_->file("train_00001.h5"), "not found"});
}

TEST_F(BadDataTest, TruncatedShard) {
  const std::string f = dir_->file("train_00001.h5");
  fs::resize_file(f, fs::file_size(f) / 2);
  const std::string msg =
      expect_data_error([&] { Dataset::open(dir_->str(), "train"); }, {f, "HDF5: "});
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
}

TEST_F(BadDataTest, CorruptBytesInTheMiddleOfAShard) {
  const std::string f = dir_->file("train_00000.h5");
  {
    std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(static_cast<std::streamoff>(fs::file_size(f) / 2));
    std::mt19937 gen(1234);
    std::string junk(512, '\0');
    for (char& c : junk) c = static_cast<char>(gen());
    io.write(junk.data(), static_cast<std::streamsize>(junk.size()));
  }
  // Either opening or reading some scene must fail, with the file (and the scene) named.
  std::string msg;
  try {
    const auto ds = Dataset::open(dir_->str(), "train");
    for (int64_t i = 0; i < ds->size(); ++i) ds->read(i);
  } catch (const DataError& e) {
    msg = e.what();
  }
  ASSERT_FALSE(msg.empty()) << "corruption went unnoticed";
  EXPECT_NE(msg.find(f), std::string::npos) << msg;
  EXPECT_NE(msg.find("scene 0000"), std::string::npos) << msg;
  EXPECT_NE(msg.find("HDF5: "), std::string::npos) << msg;
}

TEST_F(BadDataTest, WrongSchemaVersion) {
  std::string json = read_bytes(dir_->file("dataset.json"));
  json.replace(json.find("\"schema_version\": 1"), 19, "\"schema_version\": 2");
  std::ofstream(dir_->file("dataset.json"), std::ios::trunc) << json;
  expect_data_error([&] { Dataset::open(dir_->str(), "train"); },
                    {dir_->file("dataset.json"), "schema_version 2"});
}

TEST_F(BadDataTest, WrongSchemaVersionInAShard) {
  {
    const hid_t f = H5Fopen(dir_->file("train_00001.h5").c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    const hid_t a = H5Aopen(f, "schema_version", H5P_DEFAULT);
    const int64_t v = 9;
    ASSERT_GE(H5Awrite(a, H5T_NATIVE_INT64, &v), 0);
    H5Aclose(a);
    H5Fclose(f);
  }
  expect_data_error([&] { Dataset::open(dir_->str(), "train"); },
                    {dir_->file("train_00001.h5"), "schema_version 9"});
}

// Rewrites train_00001.h5 with the HDF5 C API, giving scene 000006 images one row short.
void write_shard_with_bad_scene(const std::string& path, const Dataset& ds) {
  const hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  const hid_t s1 = H5Screate(H5S_SCALAR);
  const hid_t attr = H5Acreate2(f, "schema_version", H5T_STD_I64LE, s1, H5P_DEFAULT, H5P_DEFAULT);
  const int64_t version = kSchemaVersion;
  H5Awrite(attr, H5T_NATIVE_INT64, &version);
  H5Aclose(attr);
  H5Sclose(s1);
  const hid_t scenes = H5Gcreate2(f, "scenes", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  for (int64_t idx : {5, 6}) {
    SceneRecord r = ds.read(idx);
    if (idx == 6) r.images = r.images.slice(1, 0, r.images.size(1) - 1).contiguous();
    const hid_t g =
        H5Gcreate2(scenes, scene_name(idx).c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    auto put = [&](const char* name, const at::Tensor& t, hid_t ftype, hid_t mtype) {
      std::vector<hsize_t> dims(t.sizes().begin(), t.sizes().end());
      const hid_t sp = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
      const hid_t d = H5Dcreate2(g, name, ftype, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
      H5Dwrite(d, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, t.contiguous().data_ptr());
      H5Dclose(d);
      H5Sclose(sp);
    };
    put("images", r.images, H5T_STD_U8LE, H5T_NATIVE_UINT8);
    put("intrinsics", r.intrinsics, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT);
    put("cam_to_ego", r.cam_to_ego, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT);
    put("bev_semantics", r.bev_semantics, H5T_STD_U8LE, H5T_NATIVE_UINT8);
    put("boxes", r.boxes, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT);
    H5Gclose(g);
  }
  H5Gclose(scenes);
  H5Fclose(f);
}

TEST_F(BadDataTest, WrongImageShapeInOneScene) {
  {
    const auto ds = Dataset::open(dir_->str(), "train");
    write_shard_with_bad_scene(dir_->file("bad.h5"), *ds);
  }
  fs::rename(dir_->file("bad.h5"), dir_->file("train_00001.h5"));
  const auto ds = Dataset::open(dir_->str(), "train");
  EXPECT_NO_THROW(ds->read(5));  // the good scene of that shard (written without chunks/checksums)
  expect_data_error([&] { ds->read(6); }, {dir_->file("train_00001.h5"), "scene 000006", "'images'",
                                           "[4, 47, 80, 3]", "[4, 48, 80, 3]"});
}

TEST_F(BadDataTest, ErrorInAWorkerThreadSurfacesFromNext) {
  {
    const auto ds = Dataset::open(dir_->str(), "train");
    write_shard_with_bad_scene(dir_->file("bad.h5"), *ds);
  }
  fs::rename(dir_->file("bad.h5"), dir_->file("train_00001.h5"));
  const auto ds = Dataset::open(dir_->str(), "train");
  LoaderOptions o;
  o.batch_size = 1;
  o.num_workers = 2;
  o.shuffle = false;
  o.repeat = false;
  o.drop_last = false;
  DataLoader loader(ds, o);
  ::testing::internal::CaptureStderr();
  std::string msg;
  int good = 0;
  try {
    while (loader.next()) ++good;
  } catch (const DataError& e) {
    msg = e.what();
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(good, 6);  // scenes 0..5 come first, in order
  EXPECT_NE(msg.find("scene 000006"), std::string::npos) << msg;
  EXPECT_NE(msg.find("train_00001.h5"), std::string::npos) << msg;
  EXPECT_EQ(err.find("HDF5-DIAG"), std::string::npos) << "HDF5 printed its own stack: " << err;
}

TEST_F(BadDataTest, Hdf5PrintsNothingToStderrOnErrorsInAnyThread) {
  const std::string f = dir_->file("train_00001.h5");
  fs::resize_file(f, fs::file_size(f) / 3);
  ::testing::internal::CaptureStderr();
  std::string main_msg, thread_msg;
  try {
    ShardReader r(f);
  } catch (const DataError& e) {
    main_msg = e.what();
  }
  std::thread t([&] {
    try {
      ShardReader r(f);
    } catch (const DataError& e) {
      thread_msg = e.what();
    }
  });
  t.join();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err, "");
  EXPECT_NE(main_msg.find(f), std::string::npos);
  EXPECT_EQ(main_msg, thread_msg);
}

TEST_F(BadDataTest, NotAnHdf5File) {
  std::ofstream(dir_->file("train_00000.h5"), std::ios::trunc) << "this is not HDF5";
  expect_data_error([&] { Dataset::open(dir_->str(), "train"); }, {dir_->file("train_00000.h5")});
  EXPECT_FALSE(is_data_shard(dir_->file("train_00000.h5")));
  EXPECT_TRUE(is_data_shard(dir_->file("train_00001.h5")));
}

TEST_F(BadDataTest, SceneCountDisagreesWithDatasetJson) {
  std::string json = read_bytes(dir_->file("dataset.json"));
  json.replace(json.find("\"scenes\": 7"), 11, "\"scenes\": 8");
  std::ofstream(dir_->file("dataset.json"), std::ios::trunc) << json;
  expect_data_error([&] { Dataset::open(dir_->str(), "train"); },
                    {"scene 000007", "in none of the split's shards"});
}

TEST_F(BadDataTest, ShardEntriesResolvingOutsideTheFolderAreRefused) {
  // A shard outside the dataset folder, named by '..', by its absolute path, and reached through
  // a symlink inside the folder: each is refused naming dataset.json, the key, the entry and
  // where it resolves, before any shard is opened (train and inspect open datasets this way).
  TempDir elsewhere("elsewhere");
  const fs::path moved = elsewhere.file("train_00001.h5");
  fs::rename(dir_->file("train_00001.h5"), moved);
  const std::string json = read_bytes(dir_->file("dataset.json"));
  const std::string quoted = "\"train_00001.h5\"";
  ASSERT_NE(json.find(quoted), std::string::npos);
  auto write_entry = [&](const std::string& entry) {
    std::string j = json;
    j.replace(j.find(quoted), quoted.size(), "\"" + entry + "\"");
    std::ofstream(dir_->file("dataset.json"), std::ios::trunc) << j;
  };
  const std::string real = fs::canonical(moved).string();
  const std::string up = fs::relative(moved, dir_->str()).string();
  ASSERT_EQ(up.rfind("../", 0), 0u) << up;
  write_entry(up);
  expect_data_error([&] { Dataset::open(dir_->str(), "train"); },
                    {dir_->file("dataset.json"), "key 'splits.train.shards[1]' is '" + up + "'",
                     "resolves to '" + real + "', outside the dataset folder '" +
                         fs::canonical(dir_->str()).string() + "'"});
  write_entry(moved.string());
  expect_data_error([&] { Dataset::open(dir_->str(), "train"); },
                    {dir_->file("dataset.json"), "key 'splits.train.shards[1]'",
                     "absolute path '" + moved.string() + "'"});
  write_entry("train_00001.h5");
  fs::create_symlink(moved, dir_->file("train_00001.h5"));
  expect_data_error([&] { read_dataset_info(dir_->str()); },
                    {dir_->file("dataset.json"), "key 'splits.train.shards[1]' is 'train_00001.h5'",
                     "resolves to '" + real + "', outside the dataset folder"});
  // Inside the folder, '..' and symlinks are fine.
  fs::remove(dir_->file("train_00001.h5"));
  fs::create_directories(dir_->file("sub"));
  fs::rename(moved, dir_->file("sub/shard.h5"));
  fs::create_symlink("sub/shard.h5", dir_->file("train_00001.h5"));
  write_entry("sub/../train_00001.h5");
  EXPECT_EQ(Dataset::open(dir_->str(), "train")->size(), 7);
}

}  // namespace
}  // namespace parallax::data

namespace parallax::data {
namespace {

double proc_status_mib(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key, 0) == 0) return std::stod(line.substr(std::strlen(key) + 1)) / 1024.0;
  }
  return 0;
}

// Issue 38's scale target: a dataset.json for 2,000,000 scenes (8,000 shards of 250; metadata
// only, no shard files) loads in under 5 s and 500 MB, and an epoch's sampler list for it is 8
// bytes a scene (the loader's only per-scene state; shards are opened, never read whole).
TEST(DatasetScaleTest, TwoMillionScenesOfMetadataLoadUnderFiveSecondsAndHalfAGigabyte) {
  testing::TempDir dir("scale");
  DatasetInfo info;
  info.generator = "metadata-only fixture";
  SplitInfo si;
  si.scenes = 2'000'000;
  for (int64_t k = 0; k < 8'000; ++k) si.shards.push_back(fmt::format("train_{:05d}.h5", k));
  info.splits["train"] = si;
  write_dataset_json(dir.str(), info);
  const double rss_before = proc_status_mib("VmRSS:");
  core::Stopwatch clock;
  const DatasetInfo got = read_dataset_info(dir.str());
  const double load_s = clock.elapsed_s();
  ASSERT_EQ(got.split("train").scenes, 2'000'000);
  ASSERT_EQ(got.split("train").shards.size(), 8'000u);
  const DistributedSampler sampler(got.split("train").scenes, 3, 8, true, 7);
  const std::vector<int64_t> idx = sampler.indices(5);
  EXPECT_EQ(static_cast<int64_t>(idx.size()), 250'000);
  const double grown = proc_status_mib("VmHWM:") - rss_before;
  std::printf("  2,000,000 scenes: dataset.json read in %.3f s; peak grew %.1f MiB\n", load_s,
              grown);
  EXPECT_LT(load_s, 5.0);
  EXPECT_LT(grown, 500.0);
}

}  // namespace
}  // namespace parallax::data

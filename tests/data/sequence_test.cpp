// Synthetic driving sequences (datagen --sequence-length; docs/data.md, "Sequences"): the stored
// motion agrees with the stored poses and times, identities and the walk back through prev_index
// hold, sequence length 1 is today's output, and a reader refuses broken sequence fields.
#include "core/error.h"
#include "data/datagen.h"
#include "data/dataset.h"
#include "data/geometry.h"
#include "data/shard.h"
#include "test_util.h"

#include <hdf5.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>

namespace parallax::data {
namespace {

using testing::expect_data_error;
using testing::read_bytes;
using testing::small_options;
using testing::TempDir;

constexpr int64_t kLength = 4;

DatagenOptions sequence_options(const std::string& out, int64_t train, int64_t val) {
  DatagenOptions o = small_options(out, train, val, 5);
  o.gen.sequence_length = kLength;
  o.gen.frame_interval_us = 500000;
  return o;
}

// One stored box seen in the world frame.
struct WorldBox {
  double x = 0, y = 0, yaw = 0;
  float vx = 0, vy = 0;  // as stored, in the frame's ego frame
};

// Frame `index`'s boxes by instance id, mapped to the world frame with its stored ego_to_global.
std::map<int64_t, WorldBox> world_boxes(const Dataset& ds, int64_t index, at::Tensor* pose) {
  const SceneRecord r = ds.read(index);
  const at::Tensor T = r.ego_to_global;
  EXPECT_TRUE(T.defined()) << "scene " << index << " has no ego_to_global";
  // The metadata-only reader gives the same pose.
  EXPECT_TRUE(at::equal(T, ds.shard_of(index).sample_meta(index).ego_to_global));
  EXPECT_TRUE(r.velocities.defined() && r.instance_ids.defined()) << "scene " << index;
  if (pose) *pose = T;
  const double* t = T.data_ptr<double>();
  std::map<int64_t, WorldBox> out;
  for (int64_t k = 0; k < r.boxes.size(0); ++k) {
    const float* b = r.boxes.data_ptr<float>() + k * kBoxColumns;
    WorldBox w;
    w.x = t[0] * b[kBoxX] + t[1] * b[kBoxY] + t[3];
    w.y = t[4] * b[kBoxX] + t[5] * b[kBoxY] + t[7];
    w.yaw = static_cast<double>(b[kBoxYaw]) + std::atan2(t[4], t[0]);
    w.vx = r.velocities.data_ptr<float>()[2 * k];
    w.vy = r.velocities.data_ptr<float>()[2 * k + 1];
    const int64_t id = r.instance_ids.data_ptr<int64_t>()[k];
    EXPECT_EQ(out.count(id), 0u) << "instance id " << id << " twice in scene " << index;
    out[id] = w;
  }
  return out;
}

// Float32 storage of a box centre: the BEV grid keeps |x|, |y| <= 25.25 m < 64 m, so each stored
// coordinate is within half an ulp, 2^-24 * 64 = 3.8e-6 m, of the generator's float64 position.
// The float64 arithmetic of the generator and of the mapping below adds ~1e-14 m.
constexpr double kPositionError = 0x1.0p-24 * 64 + 1e-12;

class SequenceDatasetTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<TempDir>("seq");
    generate_dataset(sequence_options(dir_->str(), 8 * kLength, 2 * kLength));
  }
  static void TearDownTestSuite() { dir_.reset(); }
  static std::unique_ptr<TempDir> dir_;
};
std::unique_ptr<TempDir> SequenceDatasetTest::dir_;

TEST_F(SequenceDatasetTest, VelocitiesAreTheFiniteDifferenceOfStoredPositionsOverStoredTimes) {
  const auto ds = Dataset::open(dir_->str(), "train");
  EXPECT_EQ(ds->info().sequence_length, kLength);
  EXPECT_EQ(ds->info().frame_interval, 0.5);
  int64_t moving = 0, ego_moves = 0;
  for (int64_t i = 1; i < ds->size(); ++i) {
    const SequenceInfo cur = ds->sequence_info(i);
    if (cur.prev_index < 0) continue;
    const int64_t p = cur.prev_index;
    const SequenceInfo prev = ds->sequence_info(p);
    const double dt = static_cast<double>(cur.timestamp_us - prev.timestamp_us) * 1e-6;
    ASSERT_GT(dt, 0);
    at::Tensor pose0, pose1;
    const auto a = world_boxes(*ds, p, &pose0), b = world_boxes(*ds, i, &pose1);
    ego_moves += at::equal(pose0, pose1) ? 0 : 1;
    const double* R = pose0.data_ptr<double>();  // frame p's ego rotation
    for (const auto& [id, wa] : a) {
      const auto it = b.find(id);
      if (it == b.end()) continue;  // left the BEV grid
      const WorldBox& wb = it->second;
      // World displacement over dt, rotated into frame p's ego frame (R^T d).
      const double dx = (wb.x - wa.x) / dt, dy = (wb.y - wa.y) / dt;
      const double ex = R[0] * dx + R[4] * dy, ey = R[1] * dx + R[5] * dy;
      // Bound: each frame's centre is within kPositionError per coordinate of the true one, so
      // the displacement's error vector has norm <= sqrt(2) * 2 * kPositionError, divided by dt;
      // a rotation keeps that norm, which bounds each component. The stored velocity is float32
      // of |v| <= 13 m/s < 16: half an ulp, 2^-24 * 16 = 9.5e-7 m/s.
      const double tol = std::sqrt(2.0) * 2 * kPositionError / dt + 0x1.0p-24 * 16;
      EXPECT_NEAR(ex, wa.vx, tol) << "scene " << p << " instance " << id;
      EXPECT_NEAR(ey, wa.vy, tol) << "scene " << p << " instance " << id;
      // Constant velocities: the next frame stores the same world velocity.
      EXPECT_EQ(wa.vx, wb.vx);
      EXPECT_EQ(wa.vy, wb.vy);
      moving += (wa.vx != 0 || wa.vy != 0) ? 1 : 0;
    }
  }
  // The check must have seen motion: objects and ego that move.
  EXPECT_GT(moving, 10);
  EXPECT_GT(ego_moves, 0);
}

TEST_F(SequenceDatasetTest, StationaryObjectsStayAtOneWorldPoint) {
  const auto ds = Dataset::open(dir_->str(), "train");
  int64_t checked = 0;
  std::map<int64_t, WorldBox> first;  // per instance, within the current sequence
  for (int64_t i = 0; i < ds->size(); ++i) {
    if (ds->sequence_info(i).frame == 0) first.clear();
    for (const auto& [id, w] : world_boxes(*ds, i, nullptr)) {
      if (w.vx != 0 || w.vy != 0) continue;
      const auto it = first.emplace(id, w).first;
      // Two float32-stored centres of one world point: within 2 * kPositionError per coordinate.
      EXPECT_NEAR(w.x, it->second.x, 2 * kPositionError) << "scene " << i << " instance " << id;
      EXPECT_NEAR(w.y, it->second.y, 2 * kPositionError) << "scene " << i << " instance " << id;
      // The ego keeps its heading, so the stored yaw is the world yaw, bit for bit.
      EXPECT_EQ(w.yaw, it->second.yaw) << "scene " << i << " instance " << id;
      checked += it->first == id && i > 0 ? 1 : 0;
    }
  }
  EXPECT_GT(checked, 10);
}

TEST_F(SequenceDatasetTest, NothingOverlapsAnythingElseOrTheEgoInAnyFrame) {
  // The generator stops whatever would touch something (footprints 0.2 m apart at 4 instants per
  // frame interval, frames among them); the stored float32 boxes are within 4e-6 m of those, so
  // no two footprints of a frame may intersect, nor any the ego's (4.8 x 2 m at the origin).
  const auto ds = Dataset::open(dir_->str(), "train");
  geom::Box ego;
  ego.l = 4.8;
  ego.w = 2.0;
  for (int64_t i = 0; i < ds->size(); ++i) {
    const at::Tensor b = ds->read(i).boxes;
    std::vector<geom::Box> boxes;
    for (int64_t k = 0; k < b.size(0); ++k) {
      const float* r = b.data_ptr<float>() + k * kBoxColumns;
      geom::Box box;
      box.x = r[kBoxX];
      box.y = r[kBoxY];
      box.l = r[kBoxL];
      box.w = r[kBoxW];
      box.yaw = r[kBoxYaw];
      EXPECT_FALSE(box.footprint_overlaps(ego, 0)) << "scene " << i << " box " << k;
      for (size_t j = 0; j < boxes.size(); ++j)
        EXPECT_FALSE(box.footprint_overlaps(boxes[j], 0))
            << "scene " << i << " boxes " << j << ", " << k;
      boxes.push_back(box);
    }
  }
}

TEST_F(SequenceDatasetTest, PrevIndexWalksBackThroughOneSequence) {
  const auto ds = Dataset::open(dir_->str(), "train");
  ASSERT_EQ(ds->size(), 8 * kLength);
  for (int64_t s = 0; s < 8; ++s) {
    int64_t i = s * kLength + kLength - 1, frames = 1;
    SequenceInfo at_i = ds->sequence_info(i);
    EXPECT_EQ(at_i.sequence, s);
    EXPECT_EQ(at_i.frame, kLength - 1);
    while (ds->prev_index(i) >= 0) {
      const int64_t p = ds->prev_index(i);
      const SequenceInfo before = ds->sequence_info(p);
      EXPECT_EQ(p, i - 1);
      EXPECT_EQ(before.sequence, s);
      EXPECT_EQ(before.frame, at_i.frame - 1);
      EXPECT_EQ(at_i.timestamp_us - before.timestamp_us, 500000);
      i = p;
      at_i = before;
      ++frames;
    }
    EXPECT_EQ(frames, kLength);
    EXPECT_EQ(at_i.frame, 0);
    EXPECT_EQ(at_i.timestamp_us, 0);
  }
}

TEST_F(SequenceDatasetTest, FrameZeroIsTheLoneSceneOfTheSequenceSeed) {
  const auto ds = Dataset::open(dir_->str(), "val");
  DatagenOptions lone = small_options("", 1, 0, 5);
  for (int64_t s : {0, 1}) {
    const SceneRecord a = ds->read(s * kLength);
    const SceneRecord b = generate_scene(lone.gen, split_seed(5, "val"), s).record;
    EXPECT_TRUE(at::equal(a.images, b.images));
    EXPECT_TRUE(at::equal(a.boxes, b.boxes));
    EXPECT_TRUE(at::equal(a.bev_semantics, b.bev_semantics));
    EXPECT_TRUE(at::equal(a.cam_to_ego, b.cam_to_ego));
    EXPECT_FALSE(b.velocities.defined());
    EXPECT_EQ(b.sequence, -1);
  }
}

TEST(SequenceDatagenTest, SequenceLengthOneIsTodaysFilesWhateverTheFrameInterval) {
  TempDir a("seq1_a"), b("seq1_b");
  auto oa = small_options(a.str(), 6, 2, 3);
  auto ob = small_options(b.str(), 6, 2, 3);
  ob.gen.sequence_length = 1;
  ob.gen.frame_interval_us = 123456;
  generate_dataset(oa);
  generate_dataset(ob);
  for (const char* f : {"dataset.json", "train_00000.h5", "train_00001.h5", "val_00000.h5"})
    EXPECT_TRUE(read_bytes(a.file(f)) == read_bytes(b.file(f))) << f;
  EXPECT_EQ(read_bytes(a.file("dataset.json")).find("sequence"), std::string::npos);
  const auto ds = Dataset::open(a.str(), "train");
  EXPECT_EQ(ds->info().sequence_length, 1);
  for (int64_t i = 0; i < ds->size(); ++i) {
    const SceneRecord r = ds->read(i);
    EXPECT_FALSE(r.velocities.defined() || r.instance_ids.defined() || r.ego_to_global.defined());
    EXPECT_EQ(r.sequence, -1);
    EXPECT_EQ(ds->prev_index(i), -1);
    EXPECT_FALSE(ds->sequence_info(i).in_sequence());
  }
}

TEST(SequenceDatagenTest, SameSeedGivesTheSameSequencesWithOneOrTwoThreads) {
  TempDir a("seqt_a"), b("seqt_b");
  // 7 train scenes: sequences of 3, 3 and a last one of 1 frame.
  auto oa = sequence_options(a.str(), 7, 2);
  auto ob = sequence_options(b.str(), 7, 2);
  oa.gen.sequence_length = ob.gen.sequence_length = 3;
  oa.threads = 1;
  ob.threads = 2;
  generate_dataset(oa);
  generate_dataset(ob);
  for (const char* f : {"dataset.json", "train_00000.h5", "train_00001.h5", "val_00000.h5"}) {
    const std::string fa = read_bytes(a.file(f));
    EXPECT_GT(fa.size(), 0u) << f;
    EXPECT_TRUE(fa == read_bytes(b.file(f))) << f << " differs between 1 and 2 threads";
  }
  const auto ds = Dataset::open(a.str(), "train");
  const SequenceInfo last = ds->sequence_info(6);
  EXPECT_EQ(last.sequence, 2);
  EXPECT_EQ(last.frame, 0);
  EXPECT_EQ(last.prev_index, -1);
}

TEST(SequenceDatagenTest, BadSequenceOptionsAreOneUsageErrorEach) {
  TempDir d("seq_bad");
  auto o = sequence_options(d.str(), 4, 0);
  o.gen.sequence_length = 0;
  try {
    generate_dataset(o);
    ADD_FAILURE() << "sequence length 0 accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("--sequence-length must be >= 1, got 0"),
              std::string::npos)
        << e.what();
  }
  o.gen.sequence_length = 2;
  for (int64_t us : {0, -500000}) {
    o.gen.frame_interval_us = us;
    try {
      generate_dataset(o);
      ADD_FAILURE() << "frame interval " << us << " us accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("--frame-interval"), std::string::npos) << e.what();
    }
  }
}

// ---- Broken sequence fields -------------------------------------------------------------------

class BadSequenceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::make_unique<TempDir>("seq_broken");
    generate_dataset(sequence_options(dir_->str(), 2 * kLength, 0));
  }
  // Opens train_00001.h5 (scenes 5..7) read-write and runs `f` on scene `index`'s group.
  template <class F>
  void edit_scene(int64_t index, F&& f) {
    const hid_t file = H5Fopen(dir_->file("train_00001.h5").c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(file, 0);
    const hid_t g = H5Gopen2(file, ("scenes/" + scene_name(index)).c_str(), H5P_DEFAULT);
    ASSERT_GE(g, 0);
    f(g);
    H5Gclose(g);
    H5Fclose(file);
  }
  void set_prev_index(int64_t index, int64_t v) {
    edit_scene(index, [&](hid_t g) {
      const hid_t a = H5Aopen(g, "prev_index", H5P_DEFAULT);
      ASSERT_GE(H5Awrite(a, H5T_NATIVE_INT64, &v), 0);
      H5Aclose(a);
    });
  }
  std::unique_ptr<TempDir> dir_;
};

TEST_F(BadSequenceTest, APrevIndexThatIsNotAnEarlierSceneOfTheSplitIsRefused) {
  const std::string shard = dir_->file("train_00001.h5");
  for (int64_t bad : {6, 7, 100, -2}) {
    set_prev_index(6, bad);
    const auto ds = Dataset::open(dir_->str(), "train");
    expect_data_error([&] { ds->read(6); },
                      {shard, "scene 000006", "'prev_index' is " + std::to_string(bad)});
    expect_data_error([&] { ds->prev_index(6); }, {shard, "scene 000006", "prev_index"});
  }
  set_prev_index(6, 2);  // earlier and inside the split: accepted (a reader may skip frames)
  EXPECT_EQ(Dataset::open(dir_->str(), "train")->prev_index(6), 2);
}

TEST_F(BadSequenceTest, InfiniteVelocitiesAreRefusedAndNanIsUnknown) {
  const auto put = [&](float value) {
    edit_scene(5, [&](hid_t g) {
      const hid_t d = H5Dopen2(g, "velocities", H5P_DEFAULT);
      const hid_t sp = H5Dget_space(d);
      hsize_t dims[2] = {0, 0};
      H5Sget_simple_extent_dims(sp, dims, nullptr);
      std::vector<float> v(dims[0] * dims[1], 0.5f);
      v[1] = value;
      ASSERT_GE(H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()), 0);
      H5Sclose(sp);
      H5Dclose(d);
    });
  };
  put(std::numeric_limits<float>::quiet_NaN());
  const SceneRecord r = Dataset::open(dir_->str(), "train")->read(5);
  EXPECT_TRUE(std::isnan(r.velocities.data_ptr<float>()[1]));
  put(-std::numeric_limits<float>::infinity());
  const auto ds = Dataset::open(dir_->str(), "train");
  expect_data_error([&] { ds->read(5); },
                    {dir_->file("train_00001.h5"), "scene 000005", "'velocities'", "infinite"});
}

TEST_F(BadSequenceTest, InstanceIdsOfTheWrongLengthAreRefused) {
  int64_t boxes = 0;
  edit_scene(7, [&](hid_t g) {
    const hid_t d = H5Dopen2(g, "boxes", H5P_DEFAULT);
    const hid_t sp = H5Dget_space(d);
    hsize_t dims[2] = {0, 0};
    H5Sget_simple_extent_dims(sp, dims, nullptr);
    boxes = static_cast<int64_t>(dims[0]);
    H5Sclose(sp);
    H5Dclose(d);
    ASSERT_GE(H5Ldelete(g, "instance_ids", H5P_DEFAULT), 0);
    const hsize_t n = dims[0] + 1;
    const hid_t s2 = H5Screate_simple(1, &n, nullptr);
    const hid_t d2 =
        H5Dcreate2(g, "instance_ids", H5T_STD_I64LE, s2, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    std::vector<int64_t> ids(n, 3);
    H5Dwrite(d2, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, ids.data());
    H5Dclose(d2);
    H5Sclose(s2);
  });
  const auto ds = Dataset::open(dir_->str(), "train");
  expect_data_error([&] { ds->read(7); },
                    {dir_->file("train_00001.h5"), "scene 000007", "'instance_ids'",
                     "[" + std::to_string(boxes + 1) + "]", "[" + std::to_string(boxes) + "]"});
  // The writer refuses to store one either.
  SceneRecord r = ds->read(6);
  r.instance_ids = at::zeros({r.boxes.size(0) + 2}, at::kLong);
  ShardWriter w(dir_->file("other.h5"), 0);
  expect_data_error([&] { w.write(r); }, {"scene 000006", "instance_ids"});
}

TEST_F(BadSequenceTest, DatasetJsonSequenceKeysAreValidated) {
  const std::string file = dir_->file("dataset.json");
  const std::string good = read_bytes(file);
  const auto with = [&](const std::string& from, const std::string& to) {
    std::string text = good;
    const size_t at = text.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
    std::ofstream(file, std::ios::binary) << text;
  };
  with("\"sequence_length\": 4", "\"sequence_length\": 0");
  expect_data_error([&] { read_dataset_info(dir_->str()); }, {file, "'sequence_length' is 0"});
  with("\"frame_interval\": 0.5", "\"frame_interval\": -1");
  expect_data_error([&] { read_dataset_info(dir_->str()); }, {file, "'frame_interval' is -1"});
  with("\"sequence_length\": 4, ", "");
  expect_data_error([&] { read_dataset_info(dir_->str()); },
                    {file, "'frame_interval' without 'sequence_length'"});
  with("\"frame_interval\": 0.5", "\"frame_interval\": \"soon\"");
  expect_data_error([&] { read_dataset_info(dir_->str()); }, {file, "frame_interval"});
}

}  // namespace
}  // namespace parallax::data

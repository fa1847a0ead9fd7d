// JPEG image shards (data/jpeg.h, ShardWriter with a JPEG quality): the codec's round trip, a
// dataset generated with --image-codec jpeg read back, and damaged JPEG bytes named at load.
#include "data/jpeg.h"

#include "core/error.h"
#include "data/datagen.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "data/shard.h"
#include "test_util.h"

#include <hdf5.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

namespace parallax::data {
namespace {

using testing::expect_data_error;
using testing::read_bytes;
using testing::small_options;
using testing::TempDir;
namespace fs = std::filesystem;

double psnr(const at::Tensor& a, const at::Tensor& b) {
  const double mse = (a.to(at::kDouble) - b.to(at::kDouble)).pow(2).mean().item<double>();
  return mse == 0 ? 1e9 : 10 * std::log10(255.0 * 255.0 / mse);
}

// A rendered camera image (the generator's: flat regions and hard edges, anti-aliased).
at::Tensor rendered(int64_t h, int64_t w) {
  DatagenOptions o = small_options("", 1, 0);
  o.gen.height = static_cast<int>(h);
  o.gen.width = static_cast<int>(w);
  o.gen.samples_per_pixel = 4;
  return generate_scene(o.gen, split_seed(3, "train"), 0).record.images[0].contiguous();
}

TEST(JpegTest, RoundTripIsWithinJpegErrorAndScalesInTheDctDomain) {
  if (!jpeg_available()) GTEST_SKIP() << "built without libjpeg-turbo";
  const at::Tensor img = rendered(96, 160);
  const auto q95 = encode_jpeg(img, 95, "test");
  const auto q50 = encode_jpeg(img, 50, "test");
  EXPECT_LT(q50.size(), q95.size());
  EXPECT_LT(q95.size(), static_cast<std::size_t>(img.numel()));
  const JpegSize size = jpeg_size(q95.data(), q95.size(), "test");
  EXPECT_EQ(size.height, 96);
  EXPECT_EQ(size.width, 160);
  const at::Tensor back = decode_jpeg(q95.data(), q95.size(), 1, "test");
  ASSERT_EQ(back.sizes(), img.sizes());
  // The bound for quality 95 (PSNR >= 35 dB; measured 36.5 here, and 31.0 at quality 50).
  // The same on every x86-64 CPU: the image is the generator's (exact arithmetic), and
  // libjpeg-turbo's accurate DCT and upsampling are integer code, bit-exact across its SIMD paths.
  const double p95 = psnr(back, img), p50 = psnr(decode_jpeg(q50.data(), q50.size(), 1, "t"), img);
  EXPECT_GE(p95, 35.0);
  EXPECT_GT(p95, p50);
  // DCT-domain downscaling: ceil(H / s) x ceil(W / s), close to the area average of the full image
  // (the scaled IDCT keeps each block's low frequencies, not a box filter: measured 42.7, 47.8 and
  // 51.2 dB against the rounded s x s average at 1/2, 1/4 and 1/8, deterministic as above; the
  // bound leaves 2.7 dB for rounding).
  for (int s : {2, 4, 8}) {
    const at::Tensor small = decode_jpeg(q95.data(), q95.size(), s, "test");
    EXPECT_EQ(small.size(0), (96 + s - 1) / s);
    EXPECT_EQ(small.size(1), (160 + s - 1) / s);
    const at::Tensor pooled = at::avg_pool2d(img.permute({2, 0, 1}).to(at::kFloat).unsqueeze(0),
                                             {s, s}, {s, s}, {0, 0}, /*ceil_mode=*/true)
                                  .squeeze(0)
                                  .permute({1, 2, 0})
                                  .round();
    EXPECT_GE(psnr(small, pooled), 40.0) << "scale 1/" << s;
  }
  EXPECT_THROW(decode_jpeg(q95.data(), q95.size(), 3, "test"), DataError);
  EXPECT_THROW(encode_jpeg(img, 0, "test"), DataError);
  EXPECT_THROW(encode_jpeg(img.to(at::kFloat), 95, "test"), DataError);
}

TEST(JpegTest, BytesThatAreNotACleanJpegAreADataErrorNamingThem) {
  if (!jpeg_available()) GTEST_SKIP() << "built without libjpeg-turbo";
  const auto bytes = encode_jpeg(rendered(64, 96), 90, "test");
  const std::vector<uint8_t> half(bytes.begin(), bytes.begin() + bytes.size() / 2);
  const std::vector<uint8_t> junk(100, 0x5a);
  // Into a tensor of another size (a scene whose stored size disagrees with its JPEG): named.
  at::Tensor wrong = at::empty({64, 95, 3}, at::kByte);
  expect_data_error([&] { decode_jpeg(bytes.data(), bytes.size(), 1, "cam 1", &wrong); },
                    {"cam 1", "64 x 96", "expected [64, 95, 3]"});
  at::Tensor right = at::empty({64, 96, 3}, at::kByte);
  EXPECT_EQ(decode_jpeg(bytes.data(), bytes.size(), 1, "cam 1", &right).data_ptr(),
            right.data_ptr());
  for (const auto* b : {&half, &junk}) {
    expect_data_error([&] { decode_jpeg(b->data(), b->size(), 1, "'x.h5' scene 000004 camera 2"); },
                      {"'x.h5' scene 000004 camera 2"});
  }
}

class JpegDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!jpeg_available()) GTEST_SKIP() << "built without libjpeg-turbo";
    dir_ = std::make_unique<TempDir>("jpeg");
    opts_ = small_options(dir_->str(), 6, 2);
    opts_.gen.height = 64;
    opts_.gen.width = 112;
    opts_.gen.samples_per_pixel = 4;
    opts_.image_codec = "jpeg";
    opts_.jpeg_quality = 95;
    generate_dataset(opts_);
  }
  std::unique_ptr<TempDir> dir_;
  DatagenOptions opts_;
};

TEST_F(JpegDatasetTest, ScenesReadBackWithTheirLabelsExactAndImagesWithinJpegError) {
  const std::string json = read_bytes(dir_->file("dataset.json"));
  EXPECT_NE(json.find("\"image_codec\": \"jpeg\", \"jpeg_quality\": 95"), std::string::npos)
      << json;
  const auto train = Dataset::open(dir_->str(), "train");
  EXPECT_EQ(train->info().image_codec, "jpeg");
  for (int64_t i = 0; i < train->size(); ++i) {
    const SceneRecord got = train->read(i);
    const SceneRecord want = generate_scene(opts_.gen, split_seed(7, "train"), i).record;
    EXPECT_TRUE(at::equal(got.intrinsics, want.intrinsics));
    EXPECT_TRUE(at::equal(got.cam_to_ego, want.cam_to_ego));
    EXPECT_TRUE(at::equal(got.bev_semantics, want.bev_semantics));
    EXPECT_TRUE(at::equal(got.boxes, want.boxes));
    ASSERT_EQ(got.images.sizes(), want.images.sizes());
    EXPECT_GE(psnr(got.images, want.images), 35.0) << "scene " << i;  // 35.7..36.8 measured
  }
  // The shard's stored shapes are the decoded images'.
  ShardReader shard(dir_->file("train_00000.h5"));
  const auto shapes = shard.shapes(0);
  EXPECT_EQ(shapes.at("images").dims, (std::vector<int64_t>{4, 64, 112, 3}));
}

TEST_F(JpegDatasetTest, ATruncatedCameraIsOneErrorNamingTheShardSceneAndCamera) {
  // Camera 0's bytes cut in half through the offsets (written by HDF5, so its checksums hold and
  // the damage reaches the decoder).
  const std::string f = dir_->file("train_00000.h5");
  {
    const hid_t file = H5Fopen(f.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(file, 0);
    const hid_t ds = H5Dopen2(file, "scenes/000001/images_jpeg_offsets", H5P_DEFAULT);
    ASSERT_GE(ds, 0);
    int64_t offsets[5];
    ASSERT_GE(H5Dread(ds, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, offsets), 0);
    offsets[1] /= 2;
    ASSERT_GE(H5Dwrite(ds, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, offsets), 0);
    H5Dclose(ds);
    H5Fclose(file);
  }
  const auto train = Dataset::open(dir_->str(), "train");
  train->read(0);  // the others are whole
  expect_data_error([&] { train->read(1); }, {f, "scene 000001 camera 0", "does not decode"});
}

TEST_F(JpegDatasetTest, AnUnknownCodecInDatasetJsonNamesTheKey) {
  std::string json = read_bytes(dir_->file("dataset.json"));
  json.replace(json.find("\"jpeg\""), 6, "\"webp\"");
  std::ofstream(dir_->file("dataset.json")) << json;
  expect_data_error([&] { Dataset::open(dir_->str(), "train"); }, {"key 'image_codec' is 'webp'"});
}

}  // namespace
}  // namespace parallax::data

namespace parallax::data {
namespace {

// data.image_size and data.cameras (issue 38): a model input at most half the stored size decodes
// in the DCT domain and resamples; only the selected cameras are decoded; the intrinsics follow.
TEST_F(JpegDatasetTest, TheLoaderDecodesOnlyTheSelectedCamerasAtADctScaleWithExactIntrinsics) {
  const auto ds = Dataset::open(dir_->str(), "train");
  LoaderOptions o;
  o.batch_size = 2;
  o.num_workers = 1;
  o.shuffle = false;
  o.repeat = false;
  o.drop_last = false;
  o.image_height = 24;  // stored 64 x 112: 1/2 covers it (32 x 56), 1/4 does not (16 x 28)
  o.image_width = 42;
  o.cameras = {2, 0};
  DataLoader loader(ds, o);
  EXPECT_EQ(loader.decode_scale(), 2);
  const core::SceneSpec spec = loader.scene_spec();
  EXPECT_EQ(spec.num_cameras, 2);
  EXPECT_EQ(spec.image_height, 24);
  EXPECT_EQ(spec.image_width, 42);
  const auto batch = loader.next();
  ASSERT_TRUE(batch.has_value());
  const at::Tensor images = batch->at("images"), K = batch->at("intrinsics");
  const at::Tensor T = batch->at("cam_to_ego");
  EXPECT_EQ(images.sizes(), (std::vector<int64_t>{2, 2, 24, 42, 3}));
  for (int64_t b = 0; b < 2; ++b) {
    const SceneRecord full = ds->read(b);  // every camera at the stored size
    for (int64_t i = 0; i < 2; ++i) {
      const int64_t c = o.cameras[static_cast<size_t>(i)];
      EXPECT_TRUE(at::equal(T[b][i], full.cam_to_ego[c]));
      // K' = diag(24 / 64, 42 / 112, 1) K, in float32 from the stored floats: the reader's
      // halving is exact and the resample's 0.75 scale costs one float32 rounding.
      at::Tensor want = full.intrinsics[c].to(at::kDouble).clone();
      want[0] *= 42.0 / 112.0;
      want[1] *= 24.0 / 64.0;
      EXPECT_LE((K[b][i].to(at::kDouble) - want).abs().max().item<double>(),
                1e-6 * want.abs().max().item<double>())
          << "scene " << b << " camera " << c;
      // The image against the full decode resampled by the same filter (no DCT scaling): the
      // 1/2 DCT decode is a 2 x 2 average of the full decode up to JPEG's rounding, so 30 dB.
      at::Tensor ref = at::empty({24, 42, 3}, at::kByte);
      const at::Tensor src = full.images[c].contiguous();
      resample(src.data_ptr<uint8_t>(), 64, 112, ref.data_ptr<uint8_t>(), 24, 42, 42.0 / 112.0,
               24.0 / 64.0, 0, 0);
      EXPECT_GE(psnr(images[b][i], ref), 30.0) << "scene " << b << " camera " << c;
    }
  }
  // A camera that is not in the rig is named.
  o.cameras = {4};
  expect_data_error([&] { DataLoader bad(ds, o); }, {"data.cameras [4]", "0..3"});
}

}  // namespace
}  // namespace parallax::data

#include "comm/agree.h"

#include "core/error.h"
#include "core/strings.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>

namespace parallax::comm {
namespace {

// Room per member in the exchange: a kind byte, the int64 token, the NUL-terminated message.
constexpr int64_t kAgreeBytes = 2048;
enum class AgreeKind : uint8_t {
  kOk = 0,
  kConfig,
  kLayout,
  kData,
  kIo,
  kCheckpoint,
  kNumerics,
  kTimeout,
  kComm,
  kOther
};

[[noreturn]] void throw_kind(AgreeKind kind, const std::string& message) {
  switch (kind) {
    case AgreeKind::kConfig:
      throw ConfigError(message);
    case AgreeKind::kLayout:
      throw LayoutError(message);
    case AgreeKind::kData:
      throw DataError(message);
    case AgreeKind::kIo:
      throw IoError(message);
    case AgreeKind::kCheckpoint:
      throw CheckpointError(message);
    case AgreeKind::kNumerics:
      throw NumericsError(message);
    case AgreeKind::kTimeout:
      throw TimeoutError(message);
    case AgreeKind::kComm:
      throw CommError(message);
    default:
      throw Error(message);
  }
}

}  // namespace

std::vector<int64_t> agree_on(Communicator& comm, const c10::Device& device,
                              const std::string& what, const std::function<int64_t()>& body) {
  if (comm.size() == 1) return {body()};
  AgreeKind kind = AgreeKind::kOk;
  std::string message;
  int64_t token = 0;
  try {
    token = body();
  } catch (const ConfigError& e) {
    kind = AgreeKind::kConfig, message = e.what();
  } catch (const LayoutError& e) {
    kind = AgreeKind::kLayout, message = e.what();
  } catch (const DataError& e) {
    kind = AgreeKind::kData, message = e.what();
  } catch (const IoError& e) {
    kind = AgreeKind::kIo, message = e.what();
  } catch (const CheckpointError& e) {
    kind = AgreeKind::kCheckpoint, message = e.what();
  } catch (const NumericsError& e) {
    kind = AgreeKind::kNumerics, message = e.what();
  } catch (const TimeoutError& e) {
    kind = AgreeKind::kTimeout, message = e.what();
  } catch (const CommError& e) {
    kind = AgreeKind::kComm, message = e.what();
  } catch (const c10::Error& e) {
    kind = AgreeKind::kOther, message = std::string("LibTorch: ") + e.what_without_backtrace();
  } catch (const std::exception& e) {
    kind = AgreeKind::kOther, message = e.what();
  }
  at::Tensor mine = at::zeros({kAgreeBytes}, at::kByte);
  auto* p = mine.data_ptr<uint8_t>();
  p[0] = static_cast<uint8_t>(kind);
  std::memcpy(p + 1, &token, sizeof(token));
  const std::string text = core::clip(message, kAgreeBytes - 64);
  std::memcpy(p + 1 + sizeof(token), text.data(),
              std::min<std::size_t>(text.size(), kAgreeBytes - 2 - sizeof(token)));
  const c10::Device at = comm.device_type() == c10::kCPU ? c10::Device(c10::kCPU) : device;
  at::Tensor in = mine.to(at);
  at::Tensor out = at::empty({comm.size() * kAgreeBytes}, in.options());
  comm.all_gather_async(in, out)->wait();
  const at::Tensor all = out.cpu();
  const auto* a = all.data_ptr<uint8_t>();
  std::vector<int> failed;
  std::vector<int64_t> tokens(static_cast<std::size_t>(comm.size()));
  for (int r = 0; r < comm.size(); ++r) {
    const uint8_t* q = a + r * kAgreeBytes;
    std::memcpy(&tokens[static_cast<std::size_t>(r)], q + 1, sizeof(int64_t));
    if (q[0] != static_cast<uint8_t>(AgreeKind::kOk)) failed.push_back(r);
  }
  if (failed.empty()) return tokens;
  const uint8_t* q = a + failed[0] * kAgreeBytes;
  const char* msg = reinterpret_cast<const char*>(q + 1 + sizeof(int64_t));
  const std::string first(msg, strnlen(msg, kAgreeBytes - 1 - sizeof(int64_t)));
  const auto first_kind = static_cast<AgreeKind>(q[0]);
  if (what.empty()) throw_kind(first_kind, first);
  std::vector<int> ranks;  // world ranks of the failing members
  for (const int r : failed) ranks.push_back(comm.world_ranks().at(static_cast<std::size_t>(r)));
  const std::vector<int> others(ranks.begin() + 1, ranks.end());
  throw_kind(first_kind,
             fmt::format("{} failed on world rank {} (of {}){}: {}", what, ranks[0], comm.size(),
                         others.empty()
                             ? std::string()
                             : fmt::format(" (and on world rank(s) {})", fmt::join(others, ", ")),
                         first));
}

}  // namespace parallax::comm

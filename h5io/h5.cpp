#include "h5io/h5.h"

#include <algorithm>
#include <vector>

namespace parallax::h5io {
namespace {

herr_t collect_error(unsigned /*n*/, const H5E_error2_t* err, void* data) {
  auto* out = static_cast<std::vector<std::string>*>(data);
  if (err->desc && *err->desc) out->emplace_back(err->desc);
  return 0;
}

}  // namespace

void quiet_errors() {
  thread_local bool done = false;
  if (done) return;
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  done = true;
}

std::string error_message() {
  std::vector<std::string> descs;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, collect_error, &descs);
  H5Eclear2(H5E_DEFAULT);
  if (descs.empty()) return "";
  std::string m = (descs.size() == 1 || descs.front() == descs.back())
                      ? descs.front()
                      : descs.front() + ": " + descs.back();
  // One line: some HDF5 messages carry newlines (a failed write's "time = <ctime>\n, filename
  // = ..."), and every error is one `parallax: error:` line.
  std::replace(m.begin(), m.end(), '\n', ' ');
  return m;
}

std::string describe(const std::string& context) {
  const std::string m = error_message();
  return m.empty() ? context : context + ": HDF5: " + m;
}

void Id::reset() {
  if (id_ < 0) return;
  switch (H5Iget_type(id_)) {
    case H5I_FILE:
      H5Fclose(id_);
      break;
    case H5I_GROUP:
      H5Gclose(id_);
      break;
    case H5I_DATASET:
      H5Dclose(id_);
      break;
    case H5I_DATASPACE:
      H5Sclose(id_);
      break;
    case H5I_DATATYPE:
      H5Tclose(id_);
      break;
    case H5I_ATTR:
      H5Aclose(id_);
      break;
    case H5I_GENPROP_LST:
      H5Pclose(id_);
      break;
    default:
      H5Idec_ref(id_);
      break;
  }
  H5Eclear2(H5E_DEFAULT);
  id_ = -1;
}

}  // namespace parallax::h5io

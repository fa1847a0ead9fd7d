#include "checkpoint/shard_index.h"

#include "core/error.h"

#include <fmt/format.h>

#include <sstream>

namespace parallax::checkpoint {

std::string RankIndex::serialize() const {
  std::string out = fmt::format("parallax-shard-index 3\nfile {} {} {}\n", file, rank, bytes);
  for (const auto& s : shards) {
    out += fmt::format("{} {} {} {} {}", s.flat ? "flat" : "shard", s.crc32, s.piece,
                       dtype_name(s.dtype), s.shape.size());
    for (const int64_t x : s.shape) out += fmt::format(" {}", x);
    if (s.flat) {
      out += fmt::format(" {} {}", s.flat->begin, s.flat->end);
    } else {
      for (const auto* v : {&s.offsets, &s.lengths}) {
        for (const int64_t x : *v) out += fmt::format(" {}", x);
      }
    }
    out += " " + s.name + "\n";
  }
  return out;
}

RankIndex RankIndex::parse(const std::string& text, int from_rank) {
  auto bad = [&](const std::string& what) -> void {
    throw_error<CheckpointError>("malformed shard index from rank {}: {}", from_rank, what);
  };
  std::istringstream in(text);
  std::string line;
  RankIndex idx;
  if (!std::getline(in, line) || line != "parallax-shard-index 3") bad("bad header '" + line + "'");
  if (!std::getline(in, line)) bad("no file line");
  {
    std::istringstream ls(line);
    std::string tag;
    ls >> tag >> idx.file >> idx.rank >> idx.bytes;
    if (tag != "file" || ls.fail()) bad("bad file line '" + line + "'");
  }
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::istringstream ls(line);
    std::string tag, dtype;
    ShardRecord s;
    size_t nd = 0;
    ls >> tag >> s.crc32 >> s.piece >> dtype >> nd;
    if ((tag != "shard" && tag != "flat") || ls.fail() || nd > 64 || s.piece < 0)
      bad("bad shard line '" + line + "'");
    s.dtype = dtype_from_name(dtype, fmt::format("shard index of rank {}", from_rank));
    s.shape.resize(nd);
    for (auto& x : s.shape) ls >> x;
    if (tag == "flat") {
      FlatRange f;
      ls >> f.begin >> f.end;
      s.flat = f;
    } else {
      for (auto* v : {&s.offsets, &s.lengths}) {
        v->resize(nd);
        for (auto& x : *v) ls >> x;
      }
    }
    if (ls.fail()) bad("bad shard line '" + line + "'");
    ls.get();  // the space before the name
    std::getline(ls, s.name);
    if (s.name.empty()) bad("a shard without a name");
    idx.shards.push_back(std::move(s));
  }
  return idx;
}

}  // namespace parallax::checkpoint

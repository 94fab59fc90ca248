// Fuzz target: a DCP checkpoint's .metadata (checkpoint/dcp_metadata.h), PyTorch's unrestricted
// pickle in PyTorch, read here with an allow-list of DCP's classes. Each input is the file's
// bytes; read_dcp_metadata must return a Status (never throw, crash or run past the bytes), and
// what it accepts must be what it promises: every tensor's chunks inside it, disjoint, covering
// it, every storage a plain file name; check_dcp_files must then hold against any file sizes.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/dcp_metadata.h"
#include "fuzz/fuzz_target.h"

namespace {

namespace ck = dtrain::checkpoint;

ck::DcpMetadata sample() {
  ck::DcpMetadata md;
  ck::DcpTensor w;
  w.dtype = at::kDouble;
  w.size = {5, 6};
  w.chunks.push_back({{0, 0}, {3, 6}, {"__0_0.distcp", 0, 100}});
  w.chunks.push_back({{3, 0}, {2, 6}, {"__1_0.distcp", 0, 90}});
  md.tensors["model.w"] = w;
  ck::DcpTensor step;
  step.chunks.push_back({{}, {}, {"__0_0.distcp", 100, 50}});
  md.tensors["optim.state.w.step"] = step;
  md.objects["optim.param_groups.0.lr"] = {"__0_0.distcp", 150, 20};
  md.objects["optim.param_groups.0.params"] = {"__1_0.distcp", 90, 20};
  md.save_id = "fuzz";
  return md;
}

}  // namespace

namespace dtrain::fuzz {

std::vector<std::string> seeds() { return {ck::write_dcp_metadata(sample())}; }

}  // namespace dtrain::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  try {
    absl::StatusOr<ck::DcpMetadata> md = ck::read_dcp_metadata(bytes, "fuzz");
    if (!md.ok()) return 0;
    for (const auto& [key, t] : md->tensors) {
      int64_t numel = 1;
      for (int64_t d : t.size) numel *= d;
      int64_t total = 0;
      for (const ck::DcpChunk& c : t.chunks) {
        DTRAIN_FUZZ_CHECK(c.offsets.size() == t.size.size() && c.sizes.size() == t.size.size(),
                          absl::StrCat("'", key, "' accepted with a chunk of another rank"));
        for (size_t d = 0; d < t.size.size(); ++d) {
          DTRAIN_FUZZ_CHECK(
              c.offsets[d] >= 0 && c.sizes[d] >= 0 && c.offsets[d] + c.sizes[d] <= t.size[d],
              absl::StrCat("'", key, "' accepted with a chunk outside it"));
        }
        total += ck::box_numel(c.sizes);
        DTRAIN_FUZZ_CHECK(c.storage.relative_path.find('/') == std::string::npos &&
                              c.storage.offset >= 0 && c.storage.length >= 0,
                          absl::StrCat("'", key, "' accepted with storage outside the checkpoint"));
      }
      DTRAIN_FUZZ_CHECK(total == numel, absl::StrCat("'", key,
                                                     "' accepted with chunks that do "
                                                     "not cover it exactly"));
    }
    for (int64_t file_size : {int64_t{0}, int64_t{120}, int64_t{1} << 40}) {
      (void)ck::check_dcp_files(*md, {{"__0_0.distcp", file_size}, {"__1_0.distcp", file_size}},
                                "fuzz");
    }
  } catch (const std::exception& e) {
    DTRAIN_FUZZ_CHECK(false, absl::StrCat("the DCP metadata reader threw: ", e.what()));
  }
  return 0;
}

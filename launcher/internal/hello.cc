#include "launcher/internal/hello.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace dtrain::comm::internal {
namespace {

constexpr absl::string_view kForm = "HELLO node_rank nproc_per_node nnodes max_restarts rdzv_id";

// A sender's text as it may appear in a reply or a log line: escaped, at most `n` characters.
std::string shown(absl::string_view text, size_t n = 64) {
  std::string out = absl::StrCat("\"", absl::CHexEscape(text.substr(0, n)), "\"");
  if (text.size() > n) out.insert(out.size() - 1, "...");
  return out;
}

absl::Status refuse(const std::string& why) { return absl::InvalidArgumentError(why); }

}  // namespace

bool valid_rdzv_id(absl::string_view id) {
  return !id.empty() && id.size() <= kMaxRdzvIdLength &&
         std::all_of(id.begin(), id.end(), [](char c) {
           return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' ||
                  c == '-';
         });
}

std::string hello_line(const Hello& h) {
  return absl::StrCat("HELLO ", h.node_rank, " ", h.nproc_per_node, " ", h.nnodes, " ",
                      h.max_restarts, " ", h.rdzv_id);
}

absl::StatusOr<int> admit(const std::string& line, const Hello& job) {
  const std::vector<absl::string_view> w = absl::StrSplit(line, ' ');
  if (w[0] != "HELLO") {
    return refuse(absl::StrCat("the first line, ", shown(line),
                               ", is not a launcher's HELLO; is another program using node 0's "
                               "--master_port?"));
  }
  int v[4] = {};
  bool numbers = w.size() >= 5;
  for (size_t i = 0; numbers && i < 4; ++i) numbers = absl::SimpleAtoi(w[i + 1], &v[i]);
  if (numbers && w.size() == 5) {
    return refuse(absl::StrCat("node ", v[0], "'s HELLO carries no run id (", shown(line),
                               "); every node's launcher must be given the same --rdzv_id (",
                               "a launcher of an older dtrain?)"));
  }
  if (!numbers || w.size() != 6) {
    return refuse(absl::StrCat("a malformed HELLO ", shown(line), "; expected \"", kForm, "\""));
  }
  const int k = v[0];
  if (k < 1 || k >= job.nnodes) {
    return refuse(absl::StrCat("node_rank ", k, " is not in [1, ", job.nnodes - 1, "]"));
  }
  if (w[5] != job.rdzv_id) {
    return refuse(absl::StrCat("node ", k, "'s --rdzv_id ", shown(w[5]),
                               " is not this job's; give every node's launcher the same "
                               "--rdzv_id"));
  }
  if (v[1] != job.nproc_per_node || v[2] != job.nnodes || v[3] != job.max_restarts) {
    return refuse(absl::StrCat("node ", k, " has nproc_per_node ", v[1], ", nnodes ", v[2],
                               ", max_restarts ", v[3], "; node 0 has ", job.nproc_per_node, ", ",
                               job.nnodes, ", ", job.max_restarts, "; give every node the same"));
  }
  return k;
}

}  // namespace dtrain::comm::internal

#include "checkpoint/step_checkpoints.h"

#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace dtrain::checkpoint {
namespace {

namespace fs = std::filesystem;

constexpr char kStepPrefix[] = "step-";
constexpr char kLatest[] = "latest";
constexpr char kCommitted[] = "COMMITTED";  // inside a step directory, written after its commit
constexpr int64_t kMaxStep = 1'000'000'000'000'000;

// std::filesystem::remove_all without std::filesystem: against PyPI's LibTorch the call reached
// the older copy of std::filesystem that the wheel's libtorch.so exports, which crashed (SIGSEGV)
// removing a non-empty directory (docs/libtorch.md; third_party/libtorch.bzl now links libstdc++
// first). glibc's nftw, depth first, never following symbolic links. A missing path is no error.
std::error_code remove_tree(const fs::path& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    return errno == ENOENT ? std::error_code() : std::error_code(errno, std::generic_category());
  }
  const int rc = ::nftw(
      path.c_str(),
      [](const char* p, const struct stat*, int, struct FTW*) {
        return ::remove(p) == 0 ? 0 : errno;
      },
      /*nopenfd=*/16, FTW_DEPTH | FTW_PHYS);
  if (rc == 0) return {};
  return std::error_code(rc > 0 ? rc : errno, std::generic_category());
}

absl::Status io_error(const std::string& what, const std::string& path, const std::error_code& ec) {
  const std::string msg = absl::StrCat("checkpoint: cannot ", what, " ", path, ": ", ec.message());
  if (ec == std::errc::permission_denied || ec == std::errc::operation_not_permitted) {
    return absl::PermissionDeniedError(msg);
  }
  return absl::UnavailableError(msg);
}

// The step a directory name stands for, or -1.
int64_t step_of(const std::string& name) {
  const std::string prefix = kStepPrefix;
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return -1;
  const std::string digits = name.substr(prefix.size());
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return -1;
  int64_t step = -1;
  if (!absl::SimpleAtoi(digits, &step) || step < 0 || step >= kMaxStep) return -1;
  return step;
}

absl::Status fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return io_error("open", path, std::error_code(errno, std::generic_category()));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return io_error("fsync", path, std::error_code(err, std::generic_category()));
  return absl::OkStatus();
}

// Points `link` at `target` atomically: a new symlink under a temporary name, renamed over it.
absl::Status replace_symlink(const fs::path& link, const std::string& target) {
  const fs::path tmp =
      link.parent_path() / absl::StrCat(".", link.filename().string(), ".tmp.", ::getpid());
  std::error_code ec;
  fs::remove(tmp, ec);
  fs::create_symlink(target, tmp, ec);
  if (ec) return io_error("create the link", tmp.string(), ec);
  fs::rename(tmp, link, ec);
  if (ec) {
    fs::remove(tmp, ec);
    return io_error("replace", link.string(), ec);
  }
  return absl::OkStatus();
}

}  // namespace

StepCheckpoints::StepCheckpoints(std::string root, int keep) : root_(std::move(root)), keep_(keep) {
  if (keep_ < 1) keep_ = 1;
}

std::string StepCheckpoints::dir_of(int64_t step) const {
  return (fs::path(root_) / absl::StrFormat("%s%08d", kStepPrefix, step)).string();
}

absl::StatusOr<std::string> StepCheckpoints::begin(int64_t step) {
  if (step < 0 || step >= kMaxStep) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint: step ", step, " is out of range [0, ", kMaxStep, ")"));
  }
  if (absl::StatusOr<CommittedStep> cur = latest(); cur.ok() && cur->step == step) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint: step ", step, " is the committed step in ", root_,
                     "; saving over it would leave no complete step if interrupted"));
  }
  const std::string dir = dir_of(step);
  std::error_code ec;
  ec = remove_tree(dir);  // an earlier, interrupted attempt at this step
  if (ec) return io_error("remove the unfinished", dir, ec);
  fs::create_directories(dir, ec);
  if (ec) return io_error("create", dir, ec);
  return dir;
}

absl::Status StepCheckpoints::commit(int64_t step) {
  const std::string dir = dir_of(step);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint: cannot commit step ", step, ": ", dir,
                     " does not exist (call begin(step) and write it first)"));
  }
  // Everything in the step directory is durable before it becomes current.
  for (const auto& e : fs::recursive_directory_iterator(dir, ec)) {
    if (e.is_directory(ec)) {
      if (absl::Status s = fsync_path(e.path().string()); !s.ok()) return s;
    }
  }
  if (absl::Status s = fsync_path(dir); !s.ok()) return s;
  // The commit point.
  if (absl::Status s =
          replace_symlink(fs::path(root_) / kLatest, fs::path(dir).filename().string());
      !s.ok())
    return s;
  if (absl::Status s = fsync_path(root_); !s.ok()) return s;
  // After it: the marker that tells an older step directory from an interrupted save, and the
  // stable name Python users load.
  {
    std::FILE* f = std::fopen((fs::path(dir) / kCommitted).c_str(), "w");
    if (f != nullptr) std::fclose(f);
  }
  const fs::path ckpt_link = fs::path(root_) / "checkpoint.pt";
  if (!fs::is_symlink(ckpt_link, ec) ||
      fs::read_symlink(ckpt_link, ec) != fs::path(kLatest) / "checkpoint.pt") {
    if (absl::Status s = replace_symlink(ckpt_link, (fs::path(kLatest) / "checkpoint.pt").string());
        !s.ok())
      return s;
  }
  // Clean up: keep the newest `keep` committed steps; drop interrupted saves and temporaries.
  std::vector<int64_t> kept = steps_on_disk();
  if (kept.size() > static_cast<size_t>(keep_)) kept.erase(kept.begin(), kept.end() - keep_);
  for (const auto& e : fs::directory_iterator(root_, ec)) {
    const std::string name = e.path().filename().string();
    const int64_t s = step_of(name);
    const bool stale_step =
        s >= 0 && e.is_directory(ec) && std::find(kept.begin(), kept.end(), s) == kept.end();
    const bool temporary = name.find(".tmp.") != std::string::npos;
    if (stale_step || temporary) ec = remove_tree(e.path());
  }
  for (int64_t s : kept) {
    for (const auto& e : fs::recursive_directory_iterator(dir_of(s), ec)) {
      if (e.path().filename().string().find(".tmp.") != std::string::npos)
        ec = remove_tree(e.path());
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<CommittedStep> StepCheckpoints::latest() const {
  const fs::path link = fs::path(root_) / kLatest;
  std::error_code ec;
  if (!fs::is_symlink(link, ec)) {
    return absl::NotFoundError(
        absl::StrCat("no committed checkpoint in ", root_, " (no ", link.string(), ")"));
  }
  const fs::path target = fs::read_symlink(link, ec);
  const int64_t step = ec ? -1 : step_of(target.filename().string());
  if (step < 0 || target.has_parent_path() || !fs::is_directory(dir_of(step), ec)) {
    return absl::DataLossError(
        absl::StrCat("checkpoint: ", link.string(), " points at '", target.string(),
                     "', which is not a step directory here; point it at the newest ",
                     "step-* directory (ln -sfn step-N ", link.string(), ") or start afresh"));
  }
  return CommittedStep{step, dir_of(step)};
}

std::vector<int64_t> StepCheckpoints::steps_on_disk() const {
  std::vector<int64_t> steps;
  absl::StatusOr<CommittedStep> cur = latest();
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root_, ec)) {
    const int64_t s = step_of(e.path().filename().string());
    if (s < 0 || !e.is_directory(ec)) continue;
    const bool current = cur.ok() && cur->step == s;
    const bool committed = fs::exists(e.path() / kCommitted, ec);
    // A marked directory newer than the current step was committed before a resume from an
    // older one rewound the job: it is not part of this history.
    if (current || (committed && (!cur.ok() || s < cur->step))) steps.push_back(s);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

}  // namespace dtrain::checkpoint

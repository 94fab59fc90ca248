#include "examples/train_checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <random>
#include <system_error>
#include <vector>

#include <torch/types.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/state_file.h"

namespace dtrain::examples {
namespace {

constexpr int64_t kMaxStep = 1'000'000'000'000;

absl::Status bad(const std::string& file, const std::string& what) {
  return absl::DataLossError(
      absl::StrCat("checkpoint ", file, ": ", what,
                   "; it was not written by this program's save, or is damaged"));
}

std::string os_error(int err) { return std::error_code(err, std::generic_category()).message(); }

std::string kind_of(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  return "a file of another kind";
}

// "a symbolic link to <target>, which does not exist" when `p` is a link whose target is
// missing, else "".
std::string dangling_link(const std::filesystem::path& p) {
  struct stat st;
  if (::lstat(p.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return "";
  std::error_code ec;
  const std::filesystem::path target = std::filesystem::read_symlink(p, ec);
  return absl::StrCat("a symbolic link to ", ec ? "a path it cannot read" : target.string(),
                      ", which does not exist");
}

}  // namespace

absl::Status check_checkpoint_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  auto unusable = [&](const std::string& problem) {
    return absl::FailedPreconditionError(
        absl::StrCat("--checkpoint_dir=", dir, ": ", problem,
                     "; pass a directory this job can create and write in (on every "
                     "host that runs a rank), or --checkpoint_dir= to train without checkpoints"));
  };
  std::string path = dir;
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  // The path, else its nearest existing ancestor: a directory (a link to one included).
  struct stat st;
  for (fs::path p = path;;) {
    if (::stat(p.c_str(), &st) == 0) {
      if (S_ISDIR(st.st_mode)) break;
      if (p == fs::path(path))
        return unusable(absl::StrCat("it is ", kind_of(st.st_mode), ", not a directory"));
      return unusable(absl::StrCat("it cannot be created: ", p.string(), " is ",
                                   kind_of(st.st_mode), ", not a directory"));
    }
    const int err = errno;
    if (err != ENOENT && err != ENOTDIR)
      return unusable(absl::StrCat("cannot look at ", p.string(), ": ", os_error(err)));
    // A symbolic link to nothing: creating the directory would fail with "File exists".
    if (const std::string dangling = dangling_link(p); !dangling.empty()) {
      return unusable(p == fs::path(path)
                          ? absl::StrCat("it is ", dangling)
                          : absl::StrCat("it cannot be created: ", p.string(), " is ", dangling));
    }
    const fs::path parent = p.parent_path();
    if (parent.empty() || parent == p) break;  // the current directory, or the root
    p = parent;
  }
  std::error_code ec;
  fs::create_directories(path, ec);
  if (ec) return unusable(absl::StrCat("cannot create it: ", ec.message()));
  // What every save does there: create a file, write it, remove it (begin() replaces directories).
  std::random_device rd;
  const std::string probe =
      (fs::path(path) / absl::StrCat(".write-probe.tmp.", ::getpid(), ".", rd())).string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int err = errno;
    return unusable(
        absl::StrCat("cannot write in it (creating ", probe, " failed: ", os_error(err), ")"));
  }
  constexpr char kProbe[] = "dtrain: can this job write checkpoints here?\n";
  const ssize_t n = ::write(fd, kProbe, sizeof(kProbe) - 1);
  int err = n < 0 ? errno : (n != static_cast<ssize_t>(sizeof(kProbe) - 1) ? ENOSPC : 0);
  if (::close(fd) != 0 && err == 0) err = errno;
  if (::unlink(probe.c_str()) != 0) {
    const int unlink_err = errno;
    return unusable(
        absl::StrCat("cannot remove the file ", probe, " it wrote there: ", os_error(unlink_err)));
  }
  if (err != 0)
    return unusable(
        absl::StrCat("cannot write in it (writing ", probe, " failed: ", os_error(err), ")"));
  return absl::OkStatus();
}

std::string hook_file(const std::string& step_dir, int rank) {
  return (std::filesystem::path(step_dir) / absl::StrCat("hook-rank", rank, ".pt")).string();
}

absl::StatusOr<TrainCheckpoint> read_train_checkpoint(const checkpoint::StepCheckpoints& ckpts,
                                                      c10::Device device) {
  absl::StatusOr<checkpoint::CommittedStep> last = ckpts.latest();
  if (!last.ok()) return last.status();
  TrainCheckpoint c;
  c.dir = last->dir;
  c.file = (std::filesystem::path(c.dir) / kCheckpointFile).string();
  absl::StatusOr<c10::IValue> loaded =
      checkpoint::load_state(c.file, checkpoint::LoadOptions{.map_location = device});
  if (!loaded.ok()) return loaded.status();
  if (!loaded->isGenericDict())
    return bad(c.file, absl::StrCat("holds a ", loaded->tagKind(), ", not a dict"));
  const c10::impl::GenericDict d = loaded->toGenericDict();
  auto field = [&](const char* key, bool (c10::IValue::*is)() const,
                   const char* type) -> absl::StatusOr<c10::IValue> {
    const c10::IValue k(key);
    if (!d.contains(k)) return bad(c.file, absl::StrCat("has no '", key, "'"));
    c10::IValue v = d.at(k);
    if (!(v.*is)())
      return bad(c.file, absl::StrCat("'", key, "' is a ", v.tagKind(), ", not ", type));
    return v;
  };
  absl::StatusOr<c10::IValue> step = field("step", &c10::IValue::isInt, "an int");
  if (!step.ok()) return step.status();
  c.step = step->toInt();
  if (c.step < 0 || c.step > kMaxStep) {
    return bad(c.file,
               absl::StrCat("its step ", c.step, " is outside [0, ", kMaxStep,
                            "], the steps this program saves (--steps is at most 2147483647)"));
  }
  if (c.step != last->step) {
    return bad(c.file, absl::StrCat("its step is ", c.step, " but it is in the directory of step ",
                                    last->step));
  }
  absl::StatusOr<c10::IValue> world = field("world_size", &c10::IValue::isInt, "an int");
  if (!world.ok()) return world.status();
  c.world_size = world->toInt();
  if (c.world_size < 1 || c.world_size > kMaxWorldSize) {
    return bad(c.file,
               absl::StrCat("world_size ", c.world_size, " is outside [1, ", kMaxWorldSize, "]"));
  }
  absl::StatusOr<c10::IValue> model = field("model", &c10::IValue::isGenericDict, "a dict");
  if (!model.ok()) return model.status();
  for (const auto& kv : model->toGenericDict()) {
    if (!kv.key().isString() || !kv.value().isTensor()) {
      return bad(c.file, "'model' must map parameter names to tensors");
    }
    c.model.insert(kv.key(), kv.value());
  }
  absl::StatusOr<c10::IValue> hook = field("hook", &c10::IValue::isString, "a str");
  if (!hook.ok()) return hook.status();
  c.hook = hook->toStringRef();
  if (d.contains(c10::IValue("run_id"))) {
    absl::StatusOr<c10::IValue> run = field("run_id", &c10::IValue::isString, "a str");
    if (!run.ok()) return run.status();
    c.run_id = run->toStringRef();
  }
  c.sharded = d.contains(c10::IValue("optimizer_shards"));
  c.dcp = d.contains(c10::IValue("optimizer_dcp"));
  if (!c.sharded && !c.dcp) {
    absl::StatusOr<c10::IValue> o = field("optimizer", &c10::IValue::isGenericDict, "a dict");
    if (!o.ok()) return o.status();
    c.optimizer = *o;
  }
  return c;
}

absl::Status load_weights(const c10::impl::GenericDict& weights, torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  for (const auto& item : model.named_parameters()) {
    const c10::IValue key(item.key());
    if (!weights.contains(key)) {
      return absl::InvalidArgumentError(absl::StrCat("the checkpoint has no parameter ", item.key(),
                                                     "; was it written with another --hidden?"));
    }
    const at::Tensor saved = weights.at(key).toTensor();
    if (!saved.sizes().equals(item.value().sizes()) ||
        saved.scalar_type() != item.value().scalar_type()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter ", item.key(), " is ", c10::toString(saved.scalar_type()), " [",
          absl::StrJoin(saved.sizes(), ","), "] in the checkpoint but ",
          c10::toString(item.value().scalar_type()), " [", absl::StrJoin(item.value().sizes(), ","),
          "] here; use the --hidden it was written with"));
    }
    item.value().copy_(saved);
  }
  return absl::OkStatus();
}

}  // namespace dtrain::examples

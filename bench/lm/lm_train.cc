// Trains the character language model of bench/lm/char_lm.h on real English text with one of
// dtrain's functional optimizers and writes its loss curve: the benchmark that compares
// optimizers and optimizer-state precisions. bench/lm/lm_peer.py runs the same thing in PyTorch.
//
//   ./bazelw run //bench/lm:lm_train -- --steps=300 --csv=/tmp/lm/cpp.csv --init_out=/tmp/i.pt
//   ./bazelw run //bench/lm:lm_train -- --optimizer=Adam --lr=1e-3 --options=betas=0.9:0.95
//   ./bazelw run //bench/lm:lm_train -- --options=state_dtype=bfloat16   # where AdamW takes it
//
// The default text is base-files' license texts (/usr/share/common-licenses, 383 KB of
// English, present on every Debian system). Prints a progress line at every validation and ends
// with "final train_loss X val_loss Y steps/s Z" (train_loss: the mean of the last 10 steps').
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_split.h"
#include "bench/lm/char_lm.h"
#include "bench/lm/lm_trainer.h"

ABSL_FLAG(std::string, text, "/usr/share/common-licenses",
          "Text to train on: files or directories (their regular files, recursively, symbolic "
          "links skipped), comma-separated, read in sorted path order; the last 10% is the "
          "validation split.");
ABSL_FLAG(int64_t, steps, 400, "Optimizer steps, at least 1.");
ABSL_FLAG(int64_t, batch_size, 32, "Sequences per step, at least 1.");
ABSL_FLAG(uint64_t, seed, 0, "Seed of the initial weights and of the batches.");
ABSL_FLAG(std::string, optimizer, "AdamW",
          "A functional optimizer registry name (PyTorch's class name: AdamW, Adam, SGD, ...).");
ABSL_FLAG(double, lr, 1e-3, "Learning rate.");
ABSL_FLAG(double, weight_decay, 0.01,
          "Weight decay, passed as the option weight_decay; negative: not passed (for "
          "optimizers without one, or to keep the optimizer's default).");
ABSL_FLAG(int64_t, warmup, 30,
          "Linear learning-rate warmup: step s uses lr * min(1, s / warmup); 0: constant lr.");
ABSL_FLAG(std::string, options, "",
          "More optimizer options, key=value,...: true/false, none, ints, floats, a:b tuples of "
          "floats (betas=0.9:0.95), other values strings (state_dtype=bfloat16).");
ABSL_FLAG(std::string, csv, "", "Write step,train_loss,val_loss here (empty: no CSV).");
ABSL_FLAG(int64_t, eval_every, 50, "Steps between validation losses (and after the last step).");
ABSL_FLAG(int64_t, eval_batches, 4, "Fixed validation batches of --batch_size sequences.");
ABSL_FLAG(std::string, init_out, "",
          "Save the initial weights here (a dict of tensors torch.load reads; lm_peer.py "
          "--init_in).");
ABSL_FLAG(std::string, init_in, "",
          "Start from these weights (from --init_out, or torch.save(model.state_dict())) "
          "instead of the seed's.");
ABSL_FLAG(std::string, param_dtype, "float32",
          "The model's parameters (and so its gradients and activations): float32, or bfloat16 "
          "(converted after --init_in / --init_out; with AdamW's param_remainders=true in "
          "--options, each keeps a float32 master in its int16 remainder).");
ABSL_FLAG(int, threads, 2, "at::set_num_threads, at least 1.");
ABSL_FLAG(int64_t, d_model, 192, "Model width (a multiple of --n_heads).");
ABSL_FLAG(int64_t, n_layers, 4, "Transformer blocks.");
ABSL_FLAG(int64_t, n_heads, 4, "Attention heads.");
ABSL_FLAG(int64_t, context, 128, "Sequence length (bytes).");

namespace {

using namespace dtrain::bench;  // NOLINT: a benchmark's main reads better with short names

int fail(const std::string& what) {
  std::fprintf(stderr, "lm_train: %s\n", what.c_str());
  return 1;
}

CharLMOptions model_options() {
  CharLMOptions m;
  m.d_model = absl::GetFlag(FLAGS_d_model);
  m.n_layers = absl::GetFlag(FLAGS_n_layers);
  m.n_heads = absl::GetFlag(FLAGS_n_heads);
  m.context = absl::GetFlag(FLAGS_context);
  m.seed = absl::GetFlag(FLAGS_seed);
  return m;
}

TrainOptions train_options() {
  TrainOptions o;
  o.steps = absl::GetFlag(FLAGS_steps);
  o.batch_size = absl::GetFlag(FLAGS_batch_size);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.optimizer = absl::GetFlag(FLAGS_optimizer);
  o.lr = absl::GetFlag(FLAGS_lr);
  o.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  o.warmup_steps = absl::GetFlag(FLAGS_warmup);
  o.extra_options = absl::GetFlag(FLAGS_options);
  o.eval_every = absl::GetFlag(FLAGS_eval_every);
  o.eval_batches = absl::GetFlag(FLAGS_eval_batches);
  return o;
}

int run() {
  const int threads = absl::GetFlag(FLAGS_threads);
  if (threads < 1) return fail("--threads must be at least 1");
  at::set_num_threads(threads);
  const std::vector<std::string> entries =
      absl::StrSplit(absl::GetFlag(FLAGS_text), ',', absl::SkipEmpty());
  absl::StatusOr<TextData> text = load_text(entries);
  if (!text.ok()) return fail(std::string(text.status().message()));
  CharLM model(model_options());
  if (const std::string in = absl::GetFlag(FLAGS_init_in); !in.empty()) {
    if (absl::Status s = load_weights(model, in); !s.ok()) return fail(std::string(s.message()));
  }
  if (const std::string out = absl::GetFlag(FLAGS_init_out); !out.empty()) {
    if (absl::Status s = save_weights(model, out); !s.ok()) return fail(std::string(s.message()));
  }
  if (const std::string dtype = absl::GetFlag(FLAGS_param_dtype); dtype == "bfloat16") {
    model->to(at::kBFloat16);
  } else if (dtype != "float32") {
    return fail("--param_dtype=" + dtype + " is not float32 or bfloat16");
  }
  const TrainOptions o = train_options();
  std::printf("text: %zu files, %lld bytes (train %lld, val %lld); model: %lld parameters; %s\n",
              text->files.size(), static_cast<long long>(text->total_bytes),
              static_cast<long long>(text->train.numel()),
              static_cast<long long>(text->val.numel()),
              static_cast<long long>(model->parameter_count()), o.optimizer.c_str());
  std::ofstream csv;
  if (const std::string path = absl::GetFlag(FLAGS_csv); !path.empty()) {
    csv.open(path);
    if (!csv) return fail("cannot write --csv=" + path);
    csv << kCsvHeader << "\n";
  }
  const TrainResult r = train_lm(model, *text, o, [&](const StepRecord& rec) {
    if (csv.is_open()) csv << csv_row(rec) << "\n";
    if (rec.has_val) {
      if (csv.is_open()) csv.flush();
      std::printf("step %lld/%lld  train_loss %.4f  val_loss %.4f\n",
                  static_cast<long long>(rec.step), static_cast<long long>(o.steps), rec.train_loss,
                  rec.val_loss);
      std::fflush(stdout);
    }
  });
  if (csv.is_open() && !csv.flush()) return fail("writing --csv failed");
  std::printf("final train_loss %.4f val_loss %.4f steps/s %.3f\n", r.final_train_loss,
              r.final_val_loss, r.steps_per_second);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Trains bench/lm's character language model with a dtrain functional optimizer.");
  absl::ParseCommandLine(argc, argv);
  try {
    return run();
  } catch (const c10::Error& e) {
    return fail(e.what_without_backtrace());
  }
}

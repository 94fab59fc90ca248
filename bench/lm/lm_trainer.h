// The training loop of //bench/lm:lm_train (and of its tests): a CharLM trained on TextData with
// a functional optimizer from dtrain's registry, step by step as bench/lm/lm_peer.py trains its
// PyTorch twin, so the two write comparable CSVs (step,train_loss,val_loss).
//
//   dtrain::bench::TrainOptions o;                     // AdamW, lr 1e-3 (30 warmup), 400 steps
//   o.extra_options = "betas=0.9:0.95,state_dtype=bfloat16";   // into the OptionsDict
//   dtrain::bench::TrainResult r = dtrain::bench::train_lm(model, text, o,
//       [](const dtrain::bench::StepRecord& s) { /* a CSV row, a progress line */ });
//   // r.final_train_loss, r.final_val_loss, r.steps_per_second
//
// Step s = 1..steps: the training batch of (seed, kTrainStream, s); its loss before the update
// is s's train_loss; the learning rate is lr * min(1, s / warmup_steps) (lr without warmup);
// gradients (set to none first) go to the optimizer as one vector. After the updates of every
// eval_every-th step and of the last one, val_loss is the mean loss of the eval_batches fixed
// validation batches (seed, kValStream, 0..eval_batches-1), without grad.
#ifndef DTRAIN_BENCH_LM_LM_TRAINER_H_
#define DTRAIN_BENCH_LM_LM_TRAINER_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bench/lm/char_lm.h"
#include "optim/functional/optimizer.h"

namespace dtrain::bench {

struct TrainOptions {
  int64_t steps = 400;
  int64_t batch_size = 32;
  uint64_t seed = 0;                // of the batches (the weights have CharLMOptions::seed)
  std::string optimizer = "AdamW";  // a FunctionalRegistry name (PyTorch's class name)
  double lr = 1e-3;
  double weight_decay = 0.01;  // negative: not passed (the optimizer's own default)
  // Linear warmup: step s uses lr * min(1, s / warmup_steps) (set_lr before the step); 0: none.
  int64_t warmup_steps = 30;
  // "key=value,key=value": more options for the optimizer (see parse_options).
  std::string extra_options;
  int64_t eval_every = 50;   // steps between validation losses (and the last step)
  int64_t eval_batches = 4;  // validation batches of batch_size sequences
  // TORCH_CHECK that the counts are positive (warmup_steps non-negative).
  void check() const;
};

// "key=value,..." as an OptionsDict: "true"/"false" are bools, "none" is None, integers are ints,
// other numbers floats, "a:b[:c]" of numbers a tuple of floats (betas=0.9:0.95), anything else a
// string (state_dtype=bfloat16). TORCH_CHECK on an item without '=' or an empty or repeated key.
optim::OptionsDict parse_options(const std::string& text);
// lr and weight_decay (when >= 0) of `o`, then parse_options(o.extra_options); TORCH_CHECK when an
// extra option repeats lr or weight_decay (use the flags).
optim::OptionsDict optimizer_options(const TrainOptions& o);

struct StepRecord {
  int64_t step = 0;
  double train_loss = 0;
  double val_loss = 0;
  bool has_val = false;
};

struct TrainResult {
  std::vector<StepRecord> records;
  double final_train_loss = 0;  // mean train_loss of the last min(10, steps) steps
  double final_val_loss = 0;    // after the last step
  double steps_per_second = 0;  // training steps only (validation excluded)
};

// Mean loss of the fixed validation batches, without grad.
double validation_loss(CharLM& model, const at::Tensor& val, int64_t batch_size,
                       int64_t eval_batches, uint64_t seed);

// Trains `model` in place; `on_step` (may be empty) sees each record as it is made.
TrainResult train_lm(CharLM& model, const TextData& text, const TrainOptions& o,
                     const std::function<void(const StepRecord&)>& on_step = {});

// One CSV row "step,train_loss,val_loss" (val_loss empty when not evaluated), %.9g, no newline.
std::string csv_row(const StepRecord& r);
inline constexpr char kCsvHeader[] = "step,train_loss,val_loss";

}  // namespace dtrain::bench

#endif  // DTRAIN_BENCH_LM_LM_TRAINER_H_

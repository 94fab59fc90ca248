#include "bench/lm/lm_trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <utility>

#include <torch/torch.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "optim/functional/registry.h"

namespace dtrain::bench {
namespace {

// A number as parse_options reads one: an int when it is all digits (with a sign), else a double.
bool parse_number(const std::string& s, c10::IValue* out) {
  int64_t i = 0;
  if (absl::SimpleAtoi(s, &i)) {
    *out = i;
    return true;
  }
  double d = 0;
  if (absl::SimpleAtod(s, &d)) {
    *out = d;
    return true;
  }
  return false;
}

c10::IValue parse_value(const std::string& s) {
  const std::string lower = absl::AsciiStrToLower(s);
  if (lower == "true") return true;
  if (lower == "false") return false;
  if (lower == "none") return c10::IValue();
  c10::IValue number;
  if (parse_number(s, &number)) return number;
  if (s.find(':') != std::string::npos) {
    std::vector<c10::IValue> items;
    for (absl::string_view part : absl::StrSplit(s, ':')) {
      double d = 0;
      if (!absl::SimpleAtod(part, &d)) return s;  // not all numbers: a string
      items.emplace_back(d);
    }
    return c10::ivalue::Tuple::create(std::move(items));
  }
  return s;
}

}  // namespace

void TrainOptions::check() const {
  TORCH_CHECK(steps > 0 && batch_size > 0 && eval_every > 0 && eval_batches > 0,
              "TrainOptions: steps (", steps, "), batch_size (", batch_size, "), eval_every (",
              eval_every, ") and eval_batches (", eval_batches, ") must be positive");
  TORCH_CHECK(warmup_steps >= 0, "TrainOptions: warmup_steps must be at least 0, got ",
              warmup_steps);
  TORCH_CHECK(std::isfinite(lr), "TrainOptions: lr must be finite, got ", lr);
}

optim::OptionsDict parse_options(const std::string& text) {
  optim::OptionsDict d = optim::new_options_dict();
  if (text.empty()) return d;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    const size_t eq = item.find('=');
    TORCH_CHECK(eq != absl::string_view::npos && eq > 0, "option '", std::string(item),
                "' must be key=value (e.g. --options=state_dtype=bfloat16,betas=0.9:0.95)");
    const std::string key(item.substr(0, eq));
    TORCH_CHECK(!d.contains(key), "option '", key, "' is given twice in '", text, "'");
    d.insert(key, parse_value(std::string(item.substr(eq + 1))));
  }
  return d;
}

optim::OptionsDict optimizer_options(const TrainOptions& o) {
  optim::OptionsDict d = optim::new_options_dict();
  d.insert("lr", o.lr);
  if (o.weight_decay >= 0) d.insert("weight_decay", o.weight_decay);
  for (const auto& entry : parse_options(o.extra_options)) {
    TORCH_CHECK(!d.contains(entry.key()), "option '", entry.key().toStringRef(),
                "' has its own flag (--", entry.key().toStringRef(),
                "); do not repeat it in "
                "--options");
    d.insert(entry.key(), entry.value());
  }
  return d;
}

double validation_loss(CharLM& model, const at::Tensor& val, int64_t batch_size,
                       int64_t eval_batches, uint64_t seed) {
  torch::NoGradGuard no_grad;
  double sum = 0;
  for (int64_t i = 0; i < eval_batches; ++i) {
    const Batch b = sample_batch(val, batch_size, model->options().context, seed, kValStream,
                                 static_cast<uint64_t>(i));
    sum += model->loss(b.inputs, b.targets).item<double>();
  }
  return sum / double(eval_batches);
}

TrainResult train_lm(CharLM& model, const TextData& text, const TrainOptions& o,
                     const std::function<void(const StepRecord&)>& on_step) {
  o.check();
  TORCH_CHECK(model->options().vocab_size >= 256, "train_lm: the text is bytes; vocab_size (",
              model->options().vocab_size, ") must be at least 256");
  std::vector<at::Tensor> params = model->parameters();
  std::unique_ptr<optim::FunctionalOptimizer> opt =
      optim::FunctionalRegistry::global().create(o.optimizer, params, optimizer_options(o));
  model->train();
  TrainResult r;
  double train_seconds = 0;
  for (int64_t s = 1; s <= o.steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    const Batch b = sample_batch(text.train, o.batch_size, model->options().context, o.seed,
                                 kTrainStream, static_cast<uint64_t>(s));
    if (o.warmup_steps > 0) {
      opt->set_lr(o.lr * std::min(1.0, double(s) / double(o.warmup_steps)));
    }
    for (at::Tensor& p : params) p.mutable_grad().reset();
    at::Tensor loss = model->loss(b.inputs, b.targets);
    loss.backward();
    std::vector<at::Tensor> grads;
    grads.reserve(params.size());
    for (const at::Tensor& p : params) grads.push_back(p.grad());
    opt->step(grads);
    train_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    StepRecord rec;
    rec.step = s;
    rec.train_loss = loss.item<double>();
    if (s % o.eval_every == 0 || s == o.steps) {
      rec.val_loss = validation_loss(model, text.val, o.batch_size, o.eval_batches, o.seed);
      rec.has_val = true;
    }
    r.records.push_back(rec);
    if (on_step) on_step(rec);
  }
  const int64_t tail = std::min<int64_t>(10, o.steps);
  for (int64_t i = o.steps - tail; i < o.steps; ++i) r.final_train_loss += r.records[i].train_loss;
  r.final_train_loss /= double(tail);
  r.final_val_loss = r.records.back().val_loss;
  r.steps_per_second = train_seconds > 0 ? double(o.steps) / train_seconds : 0;
  return r;
}

std::string csv_row(const StepRecord& r) {
  return r.has_val ? absl::StrFormat("%d,%.9g,%.9g", r.step, r.train_loss, r.val_loss)
                   : absl::StrFormat("%d,%.9g,", r.step, r.train_loss);
}

}  // namespace dtrain::bench

// One rank of the language-model cluster benchmark (bench/cluster/lm_run): bench/lm's character
// GPT trained data-parallel across the hosts of a comm/testing/netns_cluster.py cluster (one rank
// per host, Gloo over the shaped links, joined from torchrun's environment), with the model kept
// in agreement four ways -- the rows of issue 43's comparison:
//   ddp        DistributedDataParallel: gradients all-reduced every step
//   localsgd   PostLocalSGDOptimizer with a PeriodicModelAverager (parameters averaged every
//              --localsgd_period steps)
//   diloco     DiLoCo: --sync_every inner steps, then the pseudo-gradients all-reduced and the outer
//              optimizer (Nesterov SGD, lr 0.7, momentum 0.9) steps the global parameters
//   streaming  Streaming DiLoCo: the same with --fragments fragments on a staggered schedule, each
//              fragment's exchange in flight for --fragment_sync_delay inner steps, the outer
//              gradients sent as --outer_compression codes
// Every rank starts from the same weights (seed 0) and trains on its own batches: step s of rank r
// takes the training batch of (seed, stream 0, s * world + r + 1), so the world's batches of a step
// are distinct. The inner optimizer is dtrain's AdamW (lr with linear warm-up, weight decay 0.01).
//
//   lm_cluster_bench [--modes=ddp,localsgd,diloco,streaming] [--steps=400] [--sync_every=100] ...
//
// With --lighthouse=HOST:PORT a process is one replica of fault-tolerant DiLoCo instead
// (DiLoCoOptions::quorum, comm/quorum.h): no world group; it joins the running job (healing from a
// peer when restarted), prints a JSON line per round (members, participants, wall clock, losses,
// a hash of the global parameters); --serve_lighthouse=PORT runs only the Lighthouse.
// bench/cluster/lm_faults drives these: a replica killed, cut off, brought back.
//
// "diloco@H" and "streaming@H" take H from the mode instead of --sync_every (a sweep in one run);
// "localsgd@P" the averaging period instead of --localsgd_period.
//
// Rank 0 prints one JSON object per mode: ms per step (every step timed, syncs included),
// tx_bytes per step and peak_tx_bytes (the most sent in one step) by rank 0's host on its link,
// total_tx_bytes, train_loss (rank 0's mean of the last 10 steps), val_loss (rank 0's model on the
// fixed validation batches after the last step) and curve ([step, val_loss] every --eval_every).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <absl/flags/flag.h>
#include <absl/flags/parse.h>
#include <absl/strings/numbers.h>
#include <absl/strings/str_format.h>
#include <absl/strings/str_join.h>
#include <absl/strings/str_split.h>
#include <torch/torch.h>

#include "bench/cluster/link_stats.h"
#include "bench/lm/char_lm.h"
#include "bench/lm/lm_trainer.h"
#include "comm/process_group.h"
#include "comm/quorum.h"
#include "ddp_hooks/distributed_data_parallel.h"
#include "optim/diloco.h"
#include "optim/functional/adapter.h"
#include "optim/model_averagers.h"
#include "optim/post_local_sgd_optimizer.h"

ABSL_FLAG(std::string, modes, "ddp,localsgd,diloco,streaming", "Rows, comma-separated.");
ABSL_FLAG(std::string, text, "/usr/share/common-licenses", "Text files or directories.");
ABSL_FLAG(int64_t, steps, 400, "Inner steps per row (a multiple of --sync_every).");
ABSL_FLAG(int64_t, batch_size, 8, "Sequences per rank per step.");
ABSL_FLAG(double, lr, 3e-3, "AdamW's learning rate (after warm-up).");
ABSL_FLAG(int64_t, warmup, 20, "Steps of linear learning-rate warm-up.");
ABSL_FLAG(int64_t, sync_every, 100, "DiLoCo's H (inner steps per outer round).");
ABSL_FLAG(int64_t, localsgd_period, 8, "PostLocalSGD: steps between parameter averages.");
ABSL_FLAG(int64_t, fragments, 4, "Streaming DiLoCo: fragments.");
ABSL_FLAG(int64_t, fragment_sync_delay, 5, "Streaming DiLoCo: inner steps an exchange overlaps.");
ABSL_FLAG(std::string, outer_compression, "4bit", "Streaming DiLoCo: outer gradients' codes.");
ABSL_FLAG(int64_t, eval_every, 50, "Steps between validation losses (and after the last).");
ABSL_FLAG(int64_t, eval_batches, 4, "Fixed validation batches of --batch_size sequences.");
ABSL_FLAG(int64_t, d_model, 64, "Model width.");
ABSL_FLAG(int64_t, n_layers, 2, "Transformer blocks.");
ABSL_FLAG(int64_t, n_heads, 2, "Attention heads.");
ABSL_FLAG(int64_t, context, 64, "Sequence length (bytes).");
ABSL_FLAG(double, outer_lr, 0.7, "DiLoCo's outer Nesterov SGD: learning rate.");
ABSL_FLAG(double, outer_momentum, 0.9,
          "DiLoCo's outer Nesterov SGD: momentum (0: plain SGD, no Nesterov).");
// Fault-tolerant replicas (bench/cluster/lm_faults; run_replica below).
ABSL_FLAG(int32_t, serve_lighthouse, 0, "Only run a comm::Lighthouse on this port, until killed.");
ABSL_FLAG(std::string, lighthouse, "",
          "HOST:PORT of a Lighthouse: run as fault-tolerant DiLoCo replica --replica_id "
          "(DiLoCoOptions::quorum; --modes=diloco@H only), one JSON line per round.");
ABSL_FLAG(int64_t, replica_id, 0, "With --lighthouse: this replica's id (its batches' index).");
ABSL_FLAG(int64_t, replicas, 2, "With --lighthouse: the job's replicas (the first quorum's).");
ABSL_FLAG(int64_t, join_timeout_ms, 5000, "With --lighthouse: a lost replica is dropped after it.");
ABSL_FLAG(bool, round_lines, false,
          "diloco rows: a JSON line per round on stderr (round, wall clock), for lm_faults.");
ABSL_FLAG(int64_t, group_timeout_ms, 10000, "With --lighthouse: each quorum's Gloo timeout.");

namespace dtrain::bench {
namespace {

struct Row {
  double ms = 0;
  int64_t tx = 0, peak_tx = 0, total_tx = 0;
  double train_loss = 0, val_loss = 0;
  std::vector<std::pair<int64_t, double>> curve;
};

std::unique_ptr<torch::optim::Optimizer> adamw(CharLM& model) {
  optim::OptionsDict o = optim::new_options_dict();
  o.insert("lr", absl::GetFlag(FLAGS_lr));
  o.insert("weight_decay", 0.01);
  return std::make_unique<optim::FunctionalOptimizerAdapter>(model->parameters(), "AdamW", o);
}

// A row: its mode and the step count after '@' (0: none, the flags decide).
struct RowSpec {
  std::string mode;
  int64_t every = 0;
};

RowSpec parse_row(const std::string& row) {
  const std::vector<std::string> parts = absl::StrSplit(row, absl::MaxSplits('@', 1));
  RowSpec spec{parts[0], 0};
  TORCH_CHECK(parts.size() == 1 || (absl::SimpleAtoi(parts[1], &spec.every) && spec.every > 0),
              "lm_cluster_bench: '", row, "': what follows '@' must be a positive step count");
  TORCH_CHECK(spec.mode == "ddp" || spec.mode == "localsgd" || spec.mode == "diloco" ||
                  spec.mode == "streaming",
              "lm_cluster_bench: unknown mode '", spec.mode,
              "'; use ddp, localsgd, diloco or streaming");
  return spec;
}

// DiLoCo's options of a diloco or streaming row.
optim::DiLoCoOptions diloco_options(const RowSpec& spec, const comm::Group& g) {
  optim::DiLoCoOptions o;
  o.group = g;
  o.sync_every = spec.every > 0 ? spec.every : absl::GetFlag(FLAGS_sync_every);
  o.outer_options = optim::default_outer_options();
  o.outer_options.insert_or_assign("lr", absl::GetFlag(FLAGS_outer_lr));
  o.outer_options.insert_or_assign("momentum", absl::GetFlag(FLAGS_outer_momentum));
  o.outer_options.insert_or_assign("nesterov", absl::GetFlag(FLAGS_outer_momentum) > 0);
  if (spec.mode == "streaming") {
    o.fragments = absl::GetFlag(FLAGS_fragments);
    o.fragment_sync_delay = absl::GetFlag(FLAGS_fragment_sync_delay);
    o.outer_compression = absl::GetFlag(FLAGS_outer_compression);
  }
  return o;
}

// Every row's options checked before the first trains (a bad one would end the run late).
void check_rows(const std::vector<std::string>& rows, const comm::Group& g, size_t num_params) {
  for (const std::string& row : rows) {
    const RowSpec spec = parse_row(row);
    if (spec.mode == "diloco" || spec.mode == "streaming") {
      optim::check_diloco_options(diloco_options(spec, g), num_params);
    }
  }
}

// The optimizer of `row` over `model` (DDP's is plain AdamW; `ddp` is then set).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(
    const std::string& row, CharLM& model, const comm::Group& g,
    std::unique_ptr<ddp_hooks::DistributedDataParallel>* ddp) {
  const RowSpec spec = parse_row(row);
  if (spec.mode == "ddp") {
    ddp_hooks::DDPOptions o;
    o.group = g;
    *ddp = std::make_unique<ddp_hooks::DistributedDataParallel>(model.ptr(), o);
    return adamw(model);
  }
  if (spec.mode == "localsgd") {
    return std::make_unique<optim::PostLocalSGDOptimizer>(
        adamw(model), std::make_shared<optim::PeriodicModelAverager>(
                          spec.every > 0 ? spec.every : absl::GetFlag(FLAGS_localsgd_period),
                          /*warmup_steps=*/0, g));
  }
  return std::make_unique<optim::DiLoCo>(adamw(model), diloco_options(spec, g));
}

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// --round_lines: after a DiLoCo row's sync, its round and the wall clock on stderr.
void print_round_line(torch::optim::Optimizer* opt, int rank) {
  auto* diloco = dynamic_cast<optim::DiLoCo*>(opt);
  if (!absl::GetFlag(FLAGS_round_lines) || diloco == nullptr || diloco->local_step() != 0) return;
  std::fprintf(stderr, "{\"event\": \"round\", \"replica\": %d, \"t\": %.3f, \"round\": %lld}\n",
               rank, wall_seconds(), static_cast<long long>(diloco->outer_step()));
  std::fflush(stderr);
}

Row run_mode(const std::string& mode, const comm::Group& g, const TextData& text,
             const CharLMOptions& mo) {
  CharLM model(mo);  // the same weights on every rank
  std::unique_ptr<ddp_hooks::DistributedDataParallel> ddp;
  auto opt = make_optimizer(mode, model, g, &ddp);
  const int64_t steps = absl::GetFlag(FLAGS_steps), batch = absl::GetFlag(FLAGS_batch_size);
  const int64_t warmup = absl::GetFlag(FLAGS_warmup), every = absl::GetFlag(FLAGS_eval_every);
  const double lr = absl::GetFlag(FLAGS_lr);
  Row r;
  std::vector<double> losses;
  double train_ms = 0;
  g->barrier()->wait();
  for (int64_t s = 1; s <= steps; ++s) {
    const auto start = std::chrono::steady_clock::now();
    const int64_t tx0 = tx_bytes();
    const Batch b = sample_batch(text.train, batch, mo.context, /*seed=*/0, kTrainStream,
                                 static_cast<uint64_t>((s - 1) * g.size() + g.rank() + 1));
    for (auto& group : opt->param_groups()) {
      group.options().set_lr(warmup > 0 ? lr * std::min<double>(1.0, double(s) / warmup) : lr);
    }
    opt->zero_grad();
    at::Tensor loss;
    if (ddp) {
      loss = ddp->forward([&] { return model->loss(b.inputs, b.targets); });
    } else {
      loss = model->loss(b.inputs, b.targets);
    }
    loss.backward();
    opt->step();
    losses.push_back(loss.item<double>());
    print_round_line(opt.get(), g.rank());
    const int64_t sent = tx_bytes() - tx0;
    r.peak_tx = std::max(r.peak_tx, sent);
    r.total_tx += sent;
    train_ms +=
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (s % every == 0 || s == steps) {
      r.curve.emplace_back(
          s, validation_loss(model, text.val, batch, absl::GetFlag(FLAGS_eval_batches), 0));
    }
  }
  g->barrier()->wait();
  r.ms = train_ms / steps;
  r.tx = r.total_tx / steps;
  const size_t last = std::min<size_t>(10, losses.size());
  for (size_t i = losses.size() - last; i < losses.size(); ++i) r.train_loss += losses[i] / last;
  r.val_loss = r.curve.back().second;
  return r;
}

// --- Fault-tolerant replicas (--lighthouse; bench/cluster/lm_faults) ---------------------------

// FNV-1a over the bytes of the global parameters: equal on replicas that agree bit for bit.
uint64_t params_hash(const std::vector<at::Tensor>& params) {
  uint64_t h = 1469598103934665603ULL;
  for (const at::Tensor& p : params) {
    const at::Tensor c = p.contiguous();
    const auto* b = static_cast<const unsigned char*>(c.data_ptr());
    for (size_t i = 0; i < c.nbytes(); ++i) h = (h ^ b[i]) * 1099511628211ULL;
  }
  return h;
}

std::string ids(const std::vector<int64_t>& v) { return "[" + absl::StrJoin(v, ", ") + "]"; }

// One line per sync: the committed round, the quorum's members and participants (replica ids),
// the wall clock (seconds since the epoch: the driver lines it up with its faults), losses.
void print_round(const char* event, optim::DiLoCo& opt, CharLM& model, const TextData& text,
                 double train_loss) {
  const comm::Quorum* q = opt.last_quorum();
  std::vector<int64_t> members = q ? q->replica_ids() : std::vector<int64_t>{}, parts;
  if (q) {
    for (int r : q->participants()) parts.push_back(q->members[r].replica_id);
  }
  const double val = validation_loss(model, text.val, absl::GetFlag(FLAGS_batch_size),
                                     absl::GetFlag(FLAGS_eval_batches), 0);
  std::printf(
      "{\"event\": \"%s\", \"replica\": %lld, \"t\": %.3f, \"round\": %lld, \"quorum\": %lld, "
      "\"members\": %s, \"participants\": %s, \"train_loss\": %.6g, \"val_loss\": %.6g, "
      "\"hash\": \"%016llx\"}\n",
      event, static_cast<long long>(absl::GetFlag(FLAGS_replica_id)), wall_seconds(),
      static_cast<long long>(opt.outer_step()), static_cast<long long>(q ? q->quorum_id : 0),
      ids(members).c_str(), ids(parts).c_str(), train_loss, val,
      static_cast<unsigned long long>(params_hash(opt.global_params())));
  std::fflush(stdout);
}

absl::StatusOr<std::shared_ptr<comm::QuorumClient>> connect_quorum() {
  comm::QuorumOptions q;
  const std::string lh = absl::GetFlag(FLAGS_lighthouse);
  const size_t colon = lh.rfind(':');
  if (colon == std::string::npos || !absl::SimpleAtoi(lh.substr(colon + 1), &q.lighthouse_port)) {
    return absl::InvalidArgumentError("--lighthouse='" + lh + "': give HOST:PORT");
  }
  q.lighthouse_host = lh.substr(0, colon);
  q.replica_id = absl::GetFlag(FLAGS_replica_id);
  q.min_replicas = 1;  // the lighthouse decides alone: a cut replica cannot form its own quorum
  q.expected_replicas = static_cast<int>(absl::GetFlag(FLAGS_replicas));
  q.join_timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_join_timeout_ms));
  q.quorum_timeout = std::chrono::minutes(10);
  q.timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_group_timeout_ms));
  if (const char* addr = std::getenv("DTRAIN_HOST_ADDR")) q.gloo_hostname = addr;
  absl::StatusOr<std::unique_ptr<comm::QuorumClient>> c = comm::QuorumClient::connect(q);
  if (!c.ok()) return c.status();
  return std::shared_ptr<comm::QuorumClient>(std::move(*c));
}

// A replica of fault-tolerant DiLoCo: joins the running job (healing from a peer when it is a
// restarted one), then trains to --steps, step s taking the batch of (s - 1) * replicas + id + 1.
int run_replica(const TextData& text, const CharLMOptions& mo) {
  const RowSpec spec = parse_row(absl::GetFlag(FLAGS_modes));
  TORCH_CHECK(spec.mode == "diloco", "lm_cluster_bench: --lighthouse runs --modes=diloco@H only");
  absl::StatusOr<std::shared_ptr<comm::QuorumClient>> client = connect_quorum();
  if (!client.ok()) {
    std::fprintf(stderr, "lm_cluster_bench: %s\n", std::string(client.status().message()).c_str());
    return 1;
  }
  CharLM model(mo);
  optim::DiLoCoOptions o = diloco_options(spec, comm::Group());
  o.quorum = *client;
  optim::DiLoCo opt(adamw(model), o);
  std::printf("{\"event\": \"start\", \"replica\": %lld, \"t\": %.3f}\n",
              static_cast<long long>(absl::GetFlag(FLAGS_replica_id)), wall_seconds());
  std::fflush(stdout);
  opt.join_quorum();
  print_round("join", opt, model, text, 0);
  const int64_t steps = absl::GetFlag(FLAGS_steps), batch = absl::GetFlag(FLAGS_batch_size);
  const int64_t warmup = absl::GetFlag(FLAGS_warmup), world = absl::GetFlag(FLAGS_replicas);
  const double lr = absl::GetFlag(FLAGS_lr);
  double loss_sum = 0;
  for (int64_t s = opt.outer_step() * o.sync_every + 1; s <= steps; ++s) {
    const Batch b =
        sample_batch(text.train, batch, mo.context, /*seed=*/0, kTrainStream,
                     static_cast<uint64_t>((s - 1) * world + absl::GetFlag(FLAGS_replica_id) + 1));
    for (auto& group : opt.param_groups()) {
      group.options().set_lr(warmup > 0 ? lr * std::min<double>(1.0, double(s) / warmup) : lr);
    }
    opt.zero_grad();
    at::Tensor loss = model->loss(b.inputs, b.targets);
    loss.backward();
    opt.step();
    loss_sum += loss.item<double>();
    if (opt.local_step() == 0) {  // a sync: the round may have healed this replica forwards
      print_round("round", opt, model, text, loss_sum / o.sync_every);
      loss_sum = 0;
      s = opt.outer_step() * o.sync_every;
    }
  }
  return 0;
}

int serve_lighthouse() {
  comm::LighthouseOptions lo;
  lo.port = absl::GetFlag(FLAGS_serve_lighthouse);
  comm::Lighthouse lighthouse(lo);
  std::printf("{\"event\": \"lighthouse\", \"port\": %d}\n", lighthouse.port());
  std::fflush(stdout);
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

int main_impl(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);  // one core per host: the cluster runs every host on this machine
  CharLMOptions mo;
  mo.d_model = absl::GetFlag(FLAGS_d_model);
  mo.n_layers = absl::GetFlag(FLAGS_n_layers);
  mo.n_heads = absl::GetFlag(FLAGS_n_heads);
  mo.context = absl::GetFlag(FLAGS_context);
  mo.check();
  if (absl::GetFlag(FLAGS_serve_lighthouse) > 0) return serve_lighthouse();
  const std::vector<std::string> paths = absl::StrSplit(absl::GetFlag(FLAGS_text), ',');
  absl::StatusOr<TextData> text = load_text(paths);
  if (!absl::GetFlag(FLAGS_lighthouse).empty()) {
    if (!text.ok()) {
      std::fprintf(stderr, "lm_cluster_bench: %s\n", std::string(text.status().message()).c_str());
      return 1;
    }
    return run_replica(*text, mo);
  }
  comm::InitOptions init;
  init.timeout = std::chrono::seconds(300);
  absl::StatusOr<comm::Group> g = comm::init_process_group(init);
  if (!text.ok() || !g.ok()) {
    std::fprintf(stderr, "lm_cluster_bench: %s\n",
                 std::string((text.ok() ? g.status() : text.status()).message()).c_str());
    return 1;
  }
  const std::vector<std::string> modes =
      absl::StrSplit(absl::GetFlag(FLAGS_modes), ',', absl::SkipEmpty());
  check_rows(modes, *g, CharLM(mo)->parameters().size());
  for (const std::string& mode : modes) {
    const Row r = run_mode(mode, *g, *text, mo);
    if (g->rank() != 0) continue;
    std::vector<std::string> curve;
    for (const auto& [s, v] : r.curve) curve.push_back(absl::StrFormat("[%d, %.6g]", s, v));
    std::printf(
        "{\"impl\": \"dtrain\", \"mode\": \"%s\", \"world\": %d, \"params\": %lld, \"ms\": %.2f, "
        "\"tx_bytes\": %lld, \"peak_tx_bytes\": %lld, \"total_tx_bytes\": %lld, \"train_loss\": "
        "%.6g, \"val_loss\": %.6g, \"curve\": [%s]}\n",
        mode.c_str(), g->size(), static_cast<long long>(CharLM(mo)->parameter_count()), r.ms,
        static_cast<long long>(r.tx), static_cast<long long>(r.peak_tx),
        static_cast<long long>(r.total_tx), r.train_loss, r.val_loss,
        absl::StrJoin(curve, ", ").c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace dtrain::bench

int main(int argc, char** argv) { return dtrain::bench::main_impl(argc, argv); }

// ZeRO (dtrain's functional Adam inside) and torch.distributed.checkpoint, both ways, against
// PyTorch at test time (optim/zero/testdata/dcp_continue.py): a dtrain checkpoint saved at world
// W with each rank writing only its shard is loaded by dcp.load into a plain module +
// torch.optim.Adam at another world size, and PyTorch's next steps equal dtrain's; a checkpoint
// PyTorch saved (nested and flattened optimizer layouts) is resumed by ZeRO at another world size
// and partition, and dtrain's next steps equal PyTorch's.
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "checkpoint/dcp.h"
#include "checkpoint/dcp_state.h"
#include "checkpoint/python_test_files.h"
#include "checkpoint/torch_file_reader.h"
#include "comm/testing/test_harness.h"
#include "optim/functional/adapter.h"
#include "optim/zero/zero_redundancy_optimizer.h"

namespace dtrain::optim {
namespace {

namespace ck = ::dtrain::checkpoint;
namespace t = ::dtrain::checkpoint::testing;

// The script's SHAPES, initial values and gradients.
const std::vector<std::vector<int64_t>> kShapes = {{4, 3}, {5}, {2, 3, 2}, {7}, {}};
const std::vector<std::string> kNames = {"p0", "p1", "p2", "p3", "p4"};

std::vector<at::Tensor> initial_params() {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    const int64_t n = at::empty(kShapes[i]).numel();
    out.push_back((at::cos(at::arange(n, at::kFloat) * 0.37 + static_cast<double>(i)))
                      .view(kShapes[i])
                      .requires_grad_());
  }
  return out;
}

void set_grads(std::vector<at::Tensor>& params, int step) {
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].mutable_grad() = at::sin(at::arange(params[i].numel(), at::kFloat) * 0.1 + step +
                                       0.3 * static_cast<double>(i))
                                   .view(kShapes[i]);
  }
}

ZeroRedundancyOptimizer make_zero(comm::Group& g, std::vector<at::Tensor>& params, bool flat) {
  ZeroOptions o;
  o.group = g;
  o.strategy = flat ? PartitionStrategy::kFlat : PartitionStrategy::kSortedGreedy;
  if (flat) o.flat_alignment = 4;  // ranges that split parameters mid-row
  OptionsDict adam = new_options_dict();
  adam.insert("lr", 0.01);
  return ZeroRedundancyOptimizer(params, local_optimizer<FunctionalOptimizerAdapter>("Adam", adam),
                                 o);
}

using Trace = std::vector<std::vector<at::Tensor>>;  // parameters after each step

// Steps 3..5 on every rank; rank 0's parameters after each.
void continue_steps(comm::Group& g, std::vector<at::Tensor>& params, ZeroRedundancyOptimizer& zero,
                    Trace* trace) {
  for (int step = 3; step < 6; ++step) {
    set_grads(params, step);
    zero.step();
    if (g.rank() == 0) {
      trace->emplace_back();
      for (const at::Tensor& p : params) trace->back().push_back(p.detach().clone());
    }
  }
}

Trace read_trace(const std::string& path) {
  std::string bytes;
  std::string out;
  EXPECT_EQ(t::run_command("test -s '" + path + "'", &out), 0) << path << " was not written";
  std::ifstream in(path, std::ios::binary);
  bytes.assign(std::istreambuf_iterator<char>(in), {});
  absl::StatusOr<c10::IValue> v = ck::read_torch_file(bytes, path);
  EXPECT_TRUE(v.ok()) << v.status();
  Trace trace;
  if (!v.ok()) return trace;
  for (const c10::IValue& step : v->toListRef()) {
    trace.emplace_back();
    for (const c10::IValue& p : step.toListRef()) trace.back().push_back(p.toTensor());
  }
  return trace;
}

void expect_same(const Trace& got, const Trace& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t s = 0; s < got.size(); ++s) {
    ASSERT_EQ(got[s].size(), want[s].size()) << what;
    for (size_t i = 0; i < got[s].size(); ++i) {
      EXPECT_TRUE(got[s][i].allclose(want[s][i], 1e-6, 1e-7))
          << what << ": step " << s + 3 << ", parameter p" << i << "\n"
          << got[s][i] << "\nvs PyTorch\n"
          << want[s][i];
    }
  }
}

std::string python(const std::string& args) {
  std::string out;
  const int rc = t::run_command(
      absl::StrCat(t::python_binary(), " optim/zero/testdata/dcp_continue.py ", args), &out);
  EXPECT_EQ(rc, 0) << out;
  return out;
}

std::string fresh_dir(const std::string& name) {
  const std::string dir = absl::StrCat(t::test_tmpdir(), "/", name);
  std::string out;
  t::run_command(absl::StrCat("rm -rf '", dir, "' && mkdir -p '", dir, "'"), &out);
  return dir;
}

struct Case {
  int dtrain_world;
  bool flat;
  int python_world;
};

TEST(ZeroDcpTest, PyTorchContinuesFromDtrainsShardedCheckpoint) {
  for (const Case& c : {Case{1, false, 2}, Case{2, false, 3}, Case{3, true, 1}, Case{2, true, 2}}) {
    const std::string name =
        absl::StrCat("to_python_w", c.dtrain_world, c.flat ? "_flat" : "_greedy");
    const std::string dir = fresh_dir(name);
    Trace mine;
    comm::testing::run_ranks_as_threads(c.dtrain_world, [&](comm::Group& g) {
      std::vector<at::Tensor> params = initial_params();
      ZeroRedundancyOptimizer zero = make_zero(g, params, c.flat);
      for (int step = 0; step < 3; ++step) {
        set_grads(params, step);
        zero.step();
      }
      std::vector<ck::DcpWriteItem> items;
      if (g.rank() == 0) {
        std::vector<std::pair<std::string, at::Tensor>> named;
        for (size_t i = 0; i < params.size(); ++i) named.emplace_back(kNames[i], params[i]);
        items = ck::dcp_model_items(named);
      }
      absl::StatusOr<std::vector<ck::DcpWriteItem>> opt =
          ck::dcp_optimizer_items(zero.sharded_state(), kNames, g.rank() == 0);
      ASSERT_TRUE(opt.ok()) << opt.status();
      items.insert(items.end(), opt->begin(), opt->end());
      const absl::Status s = ck::save_dcp(g, dir, items);
      ASSERT_TRUE(s.ok()) << s;
      continue_steps(g, params, zero, &mine);
    });
    python(absl::StrCat("continue ", dir, " ", c.python_world, " ", dir, "/python.pt"));
    expect_same(mine, read_trace(dir + "/python.pt"), name);
  }
}

TEST(ZeroDcpTest, DtrainResumesFromPyTorchsCheckpointAtAnotherWorldSize) {
  for (const char* layout : {"", "flat"}) {
    const std::string dir = fresh_dir(absl::StrCat("from_python", layout));
    python(absl::StrCat("save ", dir, " 2 ", dir, "/python.pt ", layout));
    const Trace want = read_trace(dir + "/python.pt");
    for (const auto& [world, flat] : std::vector<std::pair<int, bool>>{{3, true}, {1, false}}) {
      Trace mine;
      comm::testing::run_ranks_as_threads(world, [&](comm::Group& g) {
        absl::StatusOr<ck::DcpReader> r = ck::DcpReader::open(dir);
        ASSERT_TRUE(r.ok()) << r.status();
        std::vector<at::Tensor> params = initial_params();
        absl::StatusOr<c10::impl::GenericDict> model = ck::load_dcp_model(*r, kNames);
        ASSERT_TRUE(model.ok()) << model.status();
        {
          at::NoGradGuard no_grad;
          for (size_t i = 0; i < params.size(); ++i)
            params[i].copy_(model->at(kNames[i]).toTensor());
        }
        ZeroRedundancyOptimizer zero = make_zero(g, params, flat);
        absl::StatusOr<ck::ShardedState> state =
            ck::load_dcp_optimizer(*r, kNames, zero.owned_ranges(), kShapes);
        ASSERT_TRUE(state.ok()) << state.status();
        zero.load_sharded_state(*state);
        continue_steps(g, params, zero, &mine);
      });
      expect_same(mine, want,
                  absl::StrCat("world ", world, flat ? " flat" : " greedy", " from ",
                               *layout ? "flattened" : "nested", " PyTorch checkpoint"));
    }
  }
}

// Every functional optimizer with state (SparseAdam aside: PyTorch's takes sparse gradients
// only) under ZeRO at world 2: its DCP checkpoint loads into torch.optim.<Name> and PyTorch's next
// steps equal dtrain's. Whole 2-D parameters (sorted-greedy): Adafactor's factored variances and
// Muon (2-D only) as PyTorch keeps them.
TEST(ZeroDcpTest, EveryOptimizerContinuesInPyTorch) {
  struct Opt {
    std::string name;
    std::vector<std::pair<std::string, c10::IValue>> options;
    std::string json;  // the same options for Python
  };
  const std::vector<Opt> opts = {
      {"SGD", {{"lr", 0.05}, {"momentum", 0.9}}, R"({"lr": 0.05, "momentum": 0.9})"},
      {"Adam", {{"lr", 0.01}, {"amsgrad", true}}, R"({"lr": 0.01, "amsgrad": true})"},
      {"AdamW", {{"lr", 0.01}}, R"({"lr": 0.01})"},
      {"Adagrad", {{"lr", 0.1}}, R"({"lr": 0.1})"},
      {"Adadelta", {}, R"({})"},
      {"Adamax", {{"lr", 0.01}}, R"({"lr": 0.01})"},
      {"RMSprop",
       {{"lr", 0.01}, {"centered", true}, {"momentum", 0.5}},
       R"({"lr": 0.01, "centered": true, "momentum": 0.5})"},
      {"Rprop", {{"lr", 0.01}}, R"({"lr": 0.01})"},
      {"NAdam", {{"lr", 0.01}}, R"({"lr": 0.01})"},
      {"RAdam", {{"lr", 0.01}}, R"({"lr": 0.01})"},
      {"ASGD", {{"lr", 0.01}, {"t0", 1.0}}, R"({"lr": 0.01, "t0": 1.0})"},
      {"Adafactor", {{"lr", 0.01}}, R"({"lr": 0.01})"},
      {"Muon", {{"lr", 0.02}}, R"({"lr": 0.02})"},
  };
  const std::vector<std::vector<int64_t>> shapes = {{4, 3}, {2, 5}, {6, 2}};
  const std::vector<std::string> names = {"p0", "p1", "p2"};
  const std::string root = fresh_dir("optimizers");
  std::map<std::string, Trace> mine;
  std::string spec = "[";
  for (const Opt& opt : opts) {
    const std::string dir = absl::StrCat(root, "/", opt.name);
    std::string out;
    t::run_command("mkdir -p '" + dir + "'", &out);
    comm::testing::run_ranks_as_threads(2, [&](comm::Group& g) {
      std::vector<at::Tensor> params;
      for (size_t i = 0; i < shapes.size(); ++i) {
        const int64_t n = shapes[i][0] * shapes[i][1];
        params.push_back(at::cos(at::arange(n, at::kFloat) * 0.37 + static_cast<double>(i))
                             .view(shapes[i])
                             .requires_grad_());
      }
      ZeroOptions o;
      o.group = g;
      OptionsDict options = new_options_dict();
      for (const auto& [k, v] : opt.options) options.insert(k, v);
      ZeroRedundancyOptimizer zero(
          params, local_optimizer<FunctionalOptimizerAdapter>(opt.name, options), o);
      auto grads = [&](int step) {
        for (size_t i = 0; i < params.size(); ++i) {
          params[i].mutable_grad() = at::sin(at::arange(params[i].numel(), at::kFloat) * 0.1 +
                                             step + 0.3 * static_cast<double>(i))
                                         .view(shapes[i]);
        }
      };
      for (int step = 0; step < 3; ++step) {
        grads(step);
        zero.step();
      }
      absl::StatusOr<std::vector<ck::DcpWriteItem>> items =
          ck::dcp_optimizer_items(zero.sharded_state(), names, g.rank() == 0);
      ASSERT_TRUE(items.ok()) << opt.name << ": " << items.status();
      if (g.rank() == 0) {
        std::vector<std::pair<std::string, at::Tensor>> named;
        for (size_t i = 0; i < params.size(); ++i) named.emplace_back(names[i], params[i]);
        for (ck::DcpWriteItem& m : ck::dcp_model_items(named)) items->push_back(std::move(m));
      }
      const absl::Status s = ck::save_dcp(g, dir, *items);
      ASSERT_TRUE(s.ok()) << opt.name << ": " << s;
      for (int step = 3; step < 6; ++step) {
        grads(step);
        zero.step();
        if (g.rank() == 0) {
          mine[opt.name].emplace_back();
          for (const at::Tensor& p : params) mine[opt.name].back().push_back(p.detach().clone());
        }
      }
    });
    absl::StrAppend(&spec, spec.size() > 1 ? ", " : "", "[\"", dir, "\", \"", opt.name, "\", ",
                    opt.json, ", \"", dir, "/python.pt\"]");
  }
  spec += "]";
  std::ofstream(root + "/spec.json") << spec;
  const std::string output = python(absl::StrCat("optimizers 1 ", root, "/spec.json"));
  int compared = 0;
  for (const Opt& opt : opts) {
    if (output.find("skipped " + opt.name) != std::string::npos) {
      std::printf("skipped %s: this PyTorch has no torch.optim.%s\n", opt.name.c_str(),
                  opt.name.c_str());
      continue;
    }
    expect_same(mine[opt.name], read_trace(absl::StrCat(root, "/", opt.name, "/python.pt")),
                opt.name);
    ++compared;
  }
  EXPECT_GE(compared, 12);
}

// FSDP2 (fully_shard, uneven row shards) at world 2 and 4 on Gloo: its DTensor chunks are read by
// ZeRO at world 3 (flat: ranges that cut rows) and 1, and the next steps of the same loss equal
// FSDP2's. Every rank runs the whole model on the same input (FSDP2's ranks do likewise), so the
// averaged gradients are each rank's own.
TEST(ZeroDcpTest, DtrainResumesFromAnFsdp2Checkpoint) {
  const std::vector<std::string> names = {"0.weight", "0.bias", "1.weight", "1.bias"};
  const std::vector<std::vector<int64_t>> shapes = {{7, 5}, {7}, {3, 7}, {3}};
  for (int fsdp_world : {2, 4}) {
    const std::string dir = fresh_dir(absl::StrCat("fsdp2_w", fsdp_world));
    python(absl::StrCat("fsdp2 ", dir, "/ckpt ", fsdp_world, " ", dir, "/python.pt"));
    std::ifstream unsupported(dir + "/python.pt.unsupported");
    if (unsupported) {  // PyTorch 2.6 (counted as a skip, with PyTorch's reason)
      GTEST_SKIP() << std::string(std::istreambuf_iterator<char>(unsupported), {});
    }
    const Trace want = read_trace(dir + "/python.pt");
    for (const auto& [world, flat] : std::vector<std::pair<int, bool>>{{3, true}, {1, false}}) {
      Trace mine;
      comm::testing::run_ranks_as_threads(world, [&](comm::Group& g) {
        absl::StatusOr<ck::DcpReader> r = ck::DcpReader::open(dir + "/ckpt");
        ASSERT_TRUE(r.ok()) << r.status();
        torch::nn::Sequential model(torch::nn::Linear(5, 7), torch::nn::Linear(7, 3));
        absl::StatusOr<c10::impl::GenericDict> saved = ck::load_dcp_model(*r, names);
        ASSERT_TRUE(saved.ok()) << saved.status();
        std::vector<at::Tensor> params;
        {
          at::NoGradGuard no_grad;
          for (const auto& item : model->named_parameters()) {
            item.value().copy_(saved->at(item.key()).toTensor());
            params.push_back(item.value());
          }
        }
        ZeroOptions o;
        o.group = g;
        o.strategy = flat ? PartitionStrategy::kFlat : PartitionStrategy::kSortedGreedy;
        if (flat) o.flat_alignment = 4;
        OptionsDict adam = new_options_dict();
        adam.insert("lr", 0.01);
        ZeroRedundancyOptimizer zero(params,
                                     local_optimizer<FunctionalOptimizerAdapter>("Adam", adam), o);
        absl::StatusOr<ck::ShardedState> state =
            ck::load_dcp_optimizer(*r, names, zero.owned_ranges(), shapes);
        ASSERT_TRUE(state.ok()) << state.status();
        zero.load_sharded_state(*state);
        const at::Tensor x = at::cos(at::arange(20, at::kFloat)).view({4, 5});
        for (int step = 3; step < 6; ++step) {
          zero.zero_grad();
          model->forward(x).sum().backward();
          zero.step();
          if (g.rank() == 0) {
            mine.emplace_back();
            for (const at::Tensor& p : params) mine.back().push_back(p.detach().clone());
          }
        }
      });
      expect_same(mine, want,
                  absl::StrCat("world ", world, flat ? " flat" : " greedy", " from FSDP2 at world ",
                               fsdp_world));
    }
  }
}

}  // namespace
}  // namespace dtrain::optim

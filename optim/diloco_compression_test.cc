// DiLoCo's compressed outer gradients (DiLoCoOptions::outer_compression): what the outer optimizer
// receives against scalar re-implementations of each codec's definition, bit for bit, at world
// sizes 1-3; each codec's error bound; "none" unchanged; the bytes each mode sends per sync (the
// formula of comm/testing/counting_group.h); refused options and resumes.
#include "optim/diloco_compression.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "checkpoint/state_file.h"
#include "comm/testing/counting_group.h"
#include "comm/testing/test_harness.h"
#include "optim/diloco.h"
#include "testing/test_util.h"

namespace dtrain::optim {
namespace {

using comm::testing::run_ranks_as_threads;
using test_util::expect_error;

const std::vector<std::string> kCompressed = {"bfloat16", "fp8_e4m3", "4bit"};

std::vector<at::Tensor> fresh(const std::vector<at::Tensor>& init) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : init) out.push_back(t.detach().clone().requires_grad_());
  return out;
}

// --- Scalar re-implementations of the codecs' definitions (optim/diloco.h) ---------------------

float ref_bfloat16(float x) {  // round to nearest even, finite x
  uint32_t b = 0;
  std::memcpy(&b, &x, 4);
  b = (b + 0x7FFFU + ((b >> 16) & 1U)) & 0xFFFF0000U;
  float y = 0;
  std::memcpy(&y, &b, 4);
  return y;
}

// float8_e4m3fn's nearest value (ties to even) to y, |y| <= 448: 3 mantissa bits, normal from
// 2^-6, subnormals multiples of 2^-9.
double ref_e4m3(double y) {
  if (y == 0) return y;
  int ex = 0;
  (void)std::frexp(y, &ex);  // |y| in [2^(ex-1), 2^ex)
  const double quantum = std::ldexp(1.0, std::max(ex - 1, -6) - 3);
  return std::nearbyint(y / quantum) * quantum;
}

std::vector<float> ref_round_trip(const std::vector<float>& x, const std::string& mode) {
  std::vector<float> out(x.size());
  if (mode == "bfloat16") {
    for (size_t i = 0; i < x.size(); ++i) out[i] = ref_bfloat16(x[i]);
    return out;
  }
  const float top = mode == "4bit" ? 7.0F : 448.0F;
  for (size_t b = 0; b < x.size(); b += kOuterCompressionBlock) {
    const size_t e = std::min(x.size(), b + kOuterCompressionBlock);
    float absmax = 0;
    for (size_t i = b; i < e; ++i) absmax = std::max(absmax, std::fabs(x[i]));
    const float step = absmax / top;
    for (size_t i = b; i < e; ++i) {
      const float y = std::clamp(x[i] / (step > 0 ? step : 1.0F), -top, top);
      const float code = mode == "4bit" ? std::nearbyint(y) : static_cast<float>(ref_e4m3(y));
      out[i] = code * step;
    }
  }
  return out;
}

std::vector<float> values(const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kFloat).contiguous().reshape(-1);
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

at::Tensor tensor_of(const std::vector<float>& v) {
  return at::from_blob(const_cast<float*>(v.data()), {static_cast<int64_t>(v.size())}, at::kFloat)
      .clone();
}

// --- 1. What the outer optimizer receives ---------------------------------------------------------

// 231 elements in blocks of 64: two blocks of one parameter spanning 2^-8..2^8 (fp8 subnormals),
// a block of zeros, a last short block across two parameters.
std::vector<at::Tensor> definition_grads(int rank) {
  const at::Tensor k = at::arange(128, at::kFloat);
  const at::Tensor wide = at::sin(k * 0.37 + rank) * at::pow(2.0, at::remainder(k, 17) - 8);
  const at::Tensor mid = at::cos(at::arange(35, at::kFloat) * 1.3 + 2.0 * rank) * 1e-3;
  const at::Tensor last = at::arange(4, at::kFloat) * (rank - 1.5) + 0.25;
  return {wide, at::zeros({64}), mid.reshape({5, 7}), last};
}

// Zero parameters, inner SGD lr 1 (local = -grad, so the pseudo-gradient is the gradient exactly)
// and outer SGD lr 1 without momentum (global = 0 + -1 * average): the global parameters after one
// sync are exactly minus what the outer optimizer received.
TEST(DiLoCoCompressionTest, OuterOptimizerReceivesTheMeanOfDecodedCodes) {
  for (const std::string& mode : kCompressed) {
    for (int world : {1, 2, 3}) {
      run_ranks_as_threads(world, [&](comm::Group& g) {
        std::vector<at::Tensor> init;
        for (at::Tensor& t : definition_grads(0)) init.push_back(at::zeros_like(t));
        std::vector<at::Tensor> p = fresh(init);
        DiLoCoOptions o;
        o.group = g;
        o.sync_every = 1;
        o.outer_options = new_options_dict();
        o.outer_options.insert("lr", 1.0);
        o.outer_compression = mode;
        DiLoCo opt(std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(1.0)), o);
        const std::vector<at::Tensor> mine = definition_grads(g.rank());
        for (size_t i = 0; i < p.size(); ++i) p[i].mutable_grad() = mine[i].clone();
        opt.step();
        at::Tensor sum;
        for (int r = 0; r < world; ++r) {
          std::vector<at::Tensor> flat;
          for (const at::Tensor& t : definition_grads(r)) flat.push_back(t.reshape(-1));
          const at::Tensor decoded = tensor_of(ref_round_trip(values(at::cat(flat)), mode));
          sum = r == 0 ? decoded : sum.add_(decoded);
        }
        const at::Tensor want = at::zeros_like(sum).add_(sum.div_(world), -1.0);
        int64_t offset = 0;
        for (size_t i = 0; i < p.size(); ++i) {
          const at::Tensor expected = want.narrow(0, offset, p[i].numel()).view(p[i].sizes());
          offset += p[i].numel();
          EXPECT_TRUE(opt.global_params()[i].equal(expected))
              << mode << " world " << world << " param " << i << ": max difference "
              << (opt.global_params()[i] - expected).abs().max().item<double>();
          EXPECT_TRUE(p[i].detach().equal(expected)) << mode << " local " << i;
        }
      });
    }
  }
}

// --- 2. Round trips within each codec's bound ------------------------------------------------------

at::Tensor round_trip_input() {
  at::manual_seed(7);
  const at::Tensor scales = at::pow(2.0, at::randint(-20, 20, {40}, at::kFloat))
                                .repeat_interleave(kOuterCompressionBlock);
  at::Tensor x = at::randn({40 * kOuterCompressionBlock}) * scales;
  x.narrow(0, 3 * kOuterCompressionBlock, kOuterCompressionBlock).zero_();  // a zero block
  return x.narrow(0, 0, x.numel() - 21).contiguous();  // a short last block, odd length
}

TEST(DiLoCoCompressionTest, RoundTripsStayWithinTheirBounds) {
  const at::Tensor x = round_trip_input();
  const int64_t n = x.numel();
  const std::vector<float> xs = values(x);
  std::map<std::string, double> worst;  // largest error / bound
  for (const std::string& mode : {std::string("none"), std::string("bfloat16"),
                                  std::string("fp8_e4m3"), std::string("4bit")}) {
    const at::Tensor bytes = encode_outer(x, mode);
    ASSERT_EQ(bytes.scalar_type(), at::kByte);
    ASSERT_EQ(bytes.numel(), outer_compressed_bytes(mode, n)) << mode;
    const std::vector<float> back = values(decode_outer(bytes, n, mode));
    ASSERT_EQ(back, mode == "none" ? xs : ref_round_trip(xs, mode)) << mode;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = i / kOuterCompressionBlock * kOuterCompressionBlock;
      const int64_t e = std::min(n, b + kOuterCompressionBlock);
      float absmax = 0;
      for (int64_t j = b; j < e; ++j) absmax = std::max(absmax, std::fabs(xs[j]));
      const double err = std::fabs(static_cast<double>(back[i]) - xs[i]);
      const double ax = std::fabs(static_cast<double>(xs[i]));
      double bound = 0;
      if (mode == "bfloat16") bound = std::ldexp(ax, -8);
      if (mode == "fp8_e4m3") bound = std::max(std::ldexp(ax, -4), std::ldexp(absmax / 448.0, -10));
      if (mode == "4bit") bound = absmax / 14.0;
      EXPECT_LE(err, bound * (1 + 1e-5)) << mode << " element " << i << " of " << xs[i];
      if (absmax == 0) {
        EXPECT_EQ(back[i], 0.0F) << mode;
      }
      if (bound > 0) worst[mode] = std::max(worst[mode], err / bound);
    }
  }
  for (const auto& [mode, w] : worst) std::cout << mode << ": largest error / bound " << w << "\n";
}

// --- 3. "none" is the path without the option ------------------------------------------------------

TEST(DiLoCoCompressionTest, NoneIsBitForBitTheDefault) {
  for (int world : {1, 2, 3}) {
    run_ranks_as_threads(world, [&](comm::Group& g) {
      std::vector<at::Tensor> init = {at::cos(at::arange(12, at::kFloat)).reshape({3, 4}),
                                      at::sin(at::arange(5, at::kFloat))};
      std::vector<at::Tensor> a = fresh(init), b = fresh(init);
      DiLoCoOptions plain;
      plain.group = g;
      plain.sync_every = 2;
      plain.fragments = 2;
      DiLoCoOptions none = plain;
      none.outer_compression = "none";
      DiLoCo run_a(std::make_unique<torch::optim::AdamW>(a, torch::optim::AdamWOptions(0.01)),
                   plain);
      DiLoCo run_b(std::make_unique<torch::optim::AdamW>(b, torch::optim::AdamWOptions(0.01)),
                   none);
      for (int step = 0; step < 9; ++step) {
        for (auto* p : {&a, &b}) {
          for (size_t i = 0; i < p->size(); ++i) {
            (*p)[i].mutable_grad() = (*p)[i].detach() * (g.rank() + 1.0) + 0.1 * step;
          }
        }
        run_a.step();
        run_b.step();
        for (size_t i = 0; i < a.size(); ++i) {
          ASSERT_TRUE(a[i].detach().equal(b[i].detach())) << "step " << step;
          ASSERT_TRUE(run_a.global_params()[i].equal(run_b.global_params()[i])) << step;
        }
      }
    });
  }
}

// --- 4. Bytes per sync -------------------------------------------------------------------------------

TEST(DiLoCoCompressionTest, BytesPerSyncFollowTheFormula) {
  // 1037 elements: 17 blocks. Bytes of one rank's message (I): none 4148, bfloat16 2074,
  // fp8_e4m3 4*17 + 1037 = 1105, 4bit 4*17 + 519 = 587 (587 / 4148 = 0.1415, about 1/8).
  const std::map<std::string, int64_t> message = {
      {"none", 4148}, {"bfloat16", 2074}, {"fp8_e4m3", 1105}, {"4bit", 587}};
  for (int world : {2, 3}) {
    for (const auto& [mode, bytes] : message) {
      ASSERT_EQ(outer_compressed_bytes(mode, 1037), bytes) << mode;
      run_ranks_as_threads(world, [&](comm::Group& g) {
        auto counter = std::make_shared<comm::ByteCounter>();
        std::vector<at::Tensor> p = fresh({at::ones({1000}), at::ones({37})});
        DiLoCoOptions o;
        o.group = comm::counting_group(g, counter);
        o.sync_every = 2;
        o.outer_compression = mode;
        DiLoCo opt(std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1)), o);
        for (int step = 0; step < 4; ++step) {  // two syncs
          for (auto& t : p) t.mutable_grad() = at::full_like(t, g.rank() + step + 1.0);
          opt.step();
        }
        const auto counts = counter->snapshot();
        ASSERT_EQ(counts.size(), 1U) << mode;
        const int64_t n = world;
        if (mode == "none") {  // ring all-reduce: 2 (n-1) S / n
          EXPECT_EQ(counts.at("allreduce").calls, 2);
          EXPECT_EQ(counts.at("allreduce").bytes, 2 * (2 * (n - 1) * bytes / n));
        } else {  // all-gather: (n-1) I
          EXPECT_EQ(counts.at("allgather").calls, 2) << mode;
          EXPECT_EQ(counts.at("allgather").bytes, 2 * (n - 1) * bytes) << mode;
        }
        if (g.rank() == 0) {
          std::cout << "world " << world << " " << mode << ": " << counter->total_bytes() / 2
                    << " bytes per sync per rank (fp32 all-gather equivalent " << (n - 1) * 4148
                    << ")\n";
        }
      });
    }
  }
}

// --- 5. Refused options, resumes -----------------------------------------------------------------

TEST(DiLoCoCompressionTest, UnknownCompressionIsRefused) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    std::vector<at::Tensor> p = fresh({at::ones({3})});
    DiLoCoOptions o;
    o.group = g;
    o.outer_compression = "int4";
    expect_error(
        [&] { DiLoCo(std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1)), o); },
        "DiLoCoOptions::outer_compression is 'int4'; use one of \"none\" (float32, exact), "
        "\"bfloat16\", \"fp8_e4m3\", \"4bit\"");
  });
}

c10::IValue with_compression(const c10::IValue& sd, const c10::IValue* value) {
  c10::impl::GenericDict top = sd.toGenericDict().copy();
  c10::impl::GenericDict d = top.at("diloco").toGenericDict().copy();
  if (value != nullptr) {
    d.insert_or_assign("outer_compression", *value);
  } else {
    (void)d.erase("outer_compression");
  }
  top.insert_or_assign("diloco", d);
  return top;
}

// A 4bit run resumes bit for bit through a file; a resume with another compression is refused;
// a dict without the entry (written before the option) is "none"'s.
TEST(DiLoCoCompressionTest, ResumeKeepsTheCompressionAndRefusesAnother) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = tmp != nullptr ? tmp : "/tmp";
  run_ranks_as_threads(2, [&](comm::Group& g) {
    auto options = [&](const std::string& mode) {
      DiLoCoOptions o;
      o.group = g;
      o.sync_every = 2;
      o.outer_compression = mode;
      return o;
    };
    auto inner = [](std::vector<at::Tensor> p) {
      return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(0.05));
    };
    auto grads = [&](std::vector<at::Tensor>& p, int step) {
      for (auto& t : p) t.mutable_grad() = at::sin(t.detach() * (g.rank() + 2.0) + step);
    };
    std::vector<at::Tensor> a = fresh({at::cos(at::arange(100, at::kFloat)), at::ones({3})});
    DiLoCo run_a(inner(a), options("4bit"));
    for (int step = 0; step < 3; ++step) {
      grads(a, step);
      run_a.step();
    }
    const std::string path = dir + "/compressed_" + std::to_string(g.rank()) + ".pt";
    ASSERT_TRUE(checkpoint::save_state(path, run_a.state_dict()).ok());
    const absl::StatusOr<c10::IValue> sd = checkpoint::load_state(path);
    ASSERT_TRUE(sd.ok()) << sd.status();
    std::vector<at::Tensor> b = fresh(a);
    DiLoCo run_b(inner(b), options("4bit"));
    run_b.load_state_dict(*sd);
    for (int step = 3; step < 8; ++step) {
      grads(a, step);
      grads(b, step);
      run_a.step();
      run_b.step();
      for (size_t i = 0; i < a.size(); ++i) ASSERT_TRUE(a[i].detach().equal(b[i].detach()));
    }
    for (const std::string other : {"none", "bfloat16"}) {
      DiLoCo c(inner(fresh(a)), options(other));
      expect_error(
          [&] { c.load_state_dict(*sd); },
          "DiLoCo.load_state_dict: diloco.outer_compression is '4bit', this DiLoCo's is '" + other +
              "'; the outer optimizer's state was built on those outer "
              "gradients: resume with DiLoCoOptions::outer_compression = \"4bit\"");
    }
    DiLoCo none(inner(fresh(a)), options("none"));
    none.load_state_dict(with_compression(*sd, nullptr));
    EXPECT_EQ(none.outer_step(), 1);
    expect_error([&] { run_b.load_state_dict(with_compression(*sd, nullptr)); },
                 "diloco.outer_compression is 'none', this DiLoCo's is '4bit'");
    const c10::IValue four(int64_t{4});
    expect_error([&] { run_b.load_state_dict(with_compression(*sd, &four)); },
                 "diloco.outer_compression is a Int, not a string");
  });
}

}  // namespace
}  // namespace dtrain::optim

#include "comm/reduce_scatter.h"

#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/libtorch_compat.h"
#include "comm/testing/test_harness.h"

namespace dtrain::comm {
namespace {

using ::testing::HasSubstr;
using testing::run_ranks_as_threads;

// Rank r's input: element i is (r + 1) * 1000 + i, integer-valued so every sum is exact.
at::Tensor rank_input(int rank, int64_t numel, at::ScalarType dtype) {
  return at::arange(numel, at::TensorOptions().dtype(dtype)).add_((rank + 1) * 1000);
}

// Sum over ranks of chunk `chunk` of rank_input: sum_r ((r+1)*1000 + chunk*c + j).
at::Tensor expected_chunk(int n, int chunk, int64_t c, at::ScalarType dtype) {
  at::Tensor j = at::arange(c, at::TensorOptions().dtype(dtype));
  return (j + chunk * c) * n + 1000.0 * n * (n + 1) / 2;
}

std::string message(const c10::Error& e) { return e.what_without_backtrace(); }

class ReduceScatterTest : public ::testing::TestWithParam<int> {};

TEST_P(ReduceScatterTest, SumsChunkRankAcrossRanks) {
  const int world = GetParam();
  run_ranks_as_threads(world, [world](Group& g) {
    for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
      for (int64_t c : {int64_t{1}, int64_t{7}, int64_t{1001}}) {
        at::Tensor input = rank_input(g.rank(), world * c, dtype);
        const at::Tensor input_before = input.clone();
        at::Tensor output = at::full({c}, -1.0, at::TensorOptions().dtype(dtype));
        ReduceScatterWork w = reduce_scatter_tensor(g, output, input);
        EXPECT_TRUE(w.defined());
        ReduceScatterWork copy = w;  // shares the collective
        copy.wait();
        w.wait();  // done through the copy: idempotent
        w.wait();
        EXPECT_TRUE(output.equal(expected_chunk(world, g.rank(), c, dtype)))
            << "world " << world << " dtype " << dtype << " c " << c << " rank " << g.rank();
        EXPECT_TRUE(input.equal(input_before)) << "the input must be left as it was";
      }
    }
  });
}

TEST_P(ReduceScatterTest, AcceptsAnyShapeWithTheRightNumel) {
  const int world = GetParam();
  run_ranks_as_threads(world, [world](Group& g) {
    const int64_t c = 6;
    at::Tensor input = rank_input(g.rank(), world * c, at::kFloat).view({world, 2, 3});
    at::Tensor output = at::zeros({3, 2});
    reduce_scatter_tensor(g, output, input).wait();
    EXPECT_TRUE(output.view({-1}).equal(expected_chunk(world, g.rank(), c, at::kFloat)));
  });
}

TEST_P(ReduceScatterTest, SeveralInFlightCompleteIndependently) {
  const int world = GetParam();
  run_ranks_as_threads(world, [world](Group& g) {
    const int64_t c = 5;
    std::vector<at::Tensor> inputs, outputs;
    std::vector<ReduceScatterWork> works;
    for (int k = 0; k < 3; ++k) {
      inputs.push_back(rank_input(g.rank(), world * c, at::kDouble).mul_(k + 1));
      outputs.push_back(at::empty({c}, at::kDouble));
      works.push_back(reduce_scatter_tensor(g, outputs.back(), inputs.back()));
    }
    for (int k = 2; k >= 0; --k) {
      works[k].wait();
      EXPECT_TRUE(outputs[k].equal(expected_chunk(world, g.rank(), c, at::kDouble) * (k + 1)));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, ReduceScatterTest, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& p) {
                           return "world" + std::to_string(p.param);
                         });

TEST(ReduceScatterTest, GroupOfOneCopies) {
  run_ranks_as_threads(1, [](Group& g) {
    at::Tensor input = at::arange(9, at::kDouble);
    at::Tensor output = at::zeros({9}, at::kDouble);
    ReduceScatterWork w = reduce_scatter_tensor(g, output, input);
    EXPECT_TRUE(w.defined());
    EXPECT_TRUE(output.equal(input));  // copied at once
    w.wait();
    EXPECT_TRUE(output.equal(input));
    EXPECT_NE(output.data_ptr(), input.data_ptr());
  });
}

TEST(ReduceScatterTest, DefaultWorkIsUndefinedAndWaitIsANoOp) {
  ReduceScatterWork w;
  EXPECT_FALSE(w.defined());
  w.wait();
}

TEST(ReduceScatterTest, MisuseIsAClearError) {
  run_ranks_as_threads(2, [](Group& g) {
    auto expect_error = [&](const at::Tensor& out, const at::Tensor& in, const std::string& what) {
      try {
        reduce_scatter_tensor(g, out, in);
        ADD_FAILURE() << "expected an error containing: " << what;
      } catch (const c10::Error& e) {
        EXPECT_THAT(message(e), HasSubstr(what));
      }
    };
    // 7 elements in, 3 out: a group of 2 needs 6.
    expect_error(at::zeros({3}), at::zeros({7}),
                 "input has 7 elements and output 3, but a group of 2 ranks needs input = 2 x "
                 "output elements (here 6)");
    expect_error(at::zeros({4}), at::zeros({4}), "input has 4 elements and output 4");
    expect_error(at::zeros({3}, at::kDouble), at::zeros({6}),
                 "input is Float but output is Double");
    expect_error(at::zeros({3}), at::zeros({12}).slice(0, 0, 12, 2), "must be contiguous");
    expect_error(at::zeros({6}).slice(0, 0, 6, 2), at::zeros({6}), "must be contiguous");
    at::Tensor buf = at::zeros({6});
    expect_error(buf.narrow(0, 3, 3), buf, "output (3 elements) overlaps input (6 elements)");
    expect_error(at::Tensor(), buf, "must be defined");
    // Nothing was started: the group still works, in step on both ranks.
    at::Tensor out = at::zeros({2});
    reduce_scatter_tensor(g, out, rank_input(g.rank(), 4, at::kFloat)).wait();
    EXPECT_TRUE(out.equal(expected_chunk(2, g.rank(), 2, at::kFloat)));
  });
}

// What this LibTorch's Gloo offers natively: _reduce_scatter_base sums (as an all-reduce
// underneath, see comm/reduce_scatter.h); the list form, reduce_scatter, throws "does not support"
// in 2.6 and sums in 2.14.
TEST(ReduceScatterTest, GlooNativeReduceScatter) {
  run_ranks_as_threads(2, [](Group& g) {
    at::Tensor in = rank_input(g.rank(), 6, at::kFloat);
    at::Tensor out = at::zeros({3});
    g->_reduce_scatter_base(out, in)->wait();
    EXPECT_TRUE(out.equal(expected_chunk(2, g.rank(), 3, at::kFloat)));
    std::vector<at::Tensor> outs = {at::zeros({3})};
    std::vector<std::vector<at::Tensor>> ins = {{in.narrow(0, 0, 3), in.narrow(0, 3, 3)}};
    try {
      // 2.6's Gloo has no list form; 2.14's has one, which must then sum.
      g->reduce_scatter(outs, ins)->wait();
      EXPECT_TRUE(outs[0].equal(expected_chunk(2, g.rank(), 3, at::kFloat)));
    } catch (const c10::Error& e) {
      EXPECT_THAT(message(e), HasSubstr("does not support reduce_scatter"));
    }
    // Both ranks threw before communicating, or both reduced: the group still works.
    reduce_scatter_tensor(g, out, in).wait();
    EXPECT_TRUE(out.equal(expected_chunk(2, g.rank(), 3, at::kFloat)));
  });
}

}  // namespace
}  // namespace dtrain::comm

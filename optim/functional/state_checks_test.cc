#include "optim/functional/state_checks.h"

#include <limits>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/test_util.h"

namespace dtrain::optim {
namespace {

using ::testing::HasSubstr;

std::string step_error(const c10::IValue& v) {
  absl::StatusOr<int64_t> s = loaded_step(v);
  EXPECT_FALSE(s.ok()) << "accepted step " << v;
  return s.ok() ? "" : std::string(s.status().message());
}

TEST(LoadedStep, TakesWholeNonNegativeNumbers) {
  EXPECT_EQ(*loaded_step(c10::IValue(int64_t{7})), 7);
  EXPECT_EQ(*loaded_step(c10::IValue(3.0)), 3);
  EXPECT_EQ(*loaded_step(at::scalar_tensor(12.0, at::kFloat)), 12);
  EXPECT_EQ(*loaded_step(at::full({1}, 5, at::kLong)), 5);
  EXPECT_EQ(*loaded_step(at::scalar_tensor(0.0, at::kDouble)), 0);
  // The largest float below 2^63 is still a step count.
  EXPECT_EQ(*loaded_step(c10::IValue(9223372036854774784.0)), int64_t{9223372036854774784});
}

TEST(LoadedStep, RefusesWhatIsNotAStepCount) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_THAT(step_error(c10::IValue(nan)), HasSubstr("is nan"));
  EXPECT_THAT(step_error(at::scalar_tensor(nan, at::kFloat)), HasSubstr("is nan"));
  EXPECT_THAT(step_error(c10::IValue(inf)), HasSubstr("is inf"));
  EXPECT_THAT(step_error(at::scalar_tensor(-inf)), HasSubstr("is -inf"));
  EXPECT_THAT(step_error(c10::IValue(-50.0)), HasSubstr("is -50, below 0"));
  EXPECT_THAT(step_error(c10::IValue(int64_t{-50})), HasSubstr("is -50, below 0"));
  EXPECT_THAT(step_error(at::full({}, -3, at::kInt)), HasSubstr("is -3, below 0"));
  EXPECT_THAT(step_error(c10::IValue(1e300)), HasSubstr("is 1e+300, beyond"));
  EXPECT_THAT(step_error(c10::IValue(9223372036854775808.0)), HasSubstr("beyond"));
  EXPECT_THAT(step_error(c10::IValue(2.5)), HasSubstr("is 2.5, not a whole number"));
  EXPECT_THAT(step_error(c10::IValue(std::string("3"))), HasSubstr("is a String, not a number"));
  EXPECT_THAT(step_error(c10::IValue(true)), HasSubstr("is a Bool, not a number"));
  EXPECT_THAT(step_error(c10::IValue()), HasSubstr("is a None, not a number"));
  EXPECT_THAT(step_error(at::ones({2})), HasSubstr("a tensor of 2 elements (shape [2])"));
  EXPECT_THAT(step_error(at::ones({0})), HasSubstr("a tensor of 0 elements"));
  EXPECT_THAT(step_error(at::ones({}, at::kBool)), HasSubstr("a Bool tensor"));
  EXPECT_THAT(step_error(at::ones({}, at::kComplexFloat)), HasSubstr("a ComplexFloat tensor"));
}

std::string tensor_error(const at::Tensor& t, const at::Tensor& param) {
  absl::Status s = check_state_tensor(t, param, param.sizes());
  EXPECT_FALSE(s.ok()) << "accepted " << t;
  return std::string(s.message());
}

TEST(CheckStateTensor, RefusesWrongShapeDtypeAndNonFinite) {
  const at::Tensor p = at::zeros({2, 3});
  EXPECT_TRUE(check_state_tensor(at::ones({2, 3}), p, p.sizes()).ok());
  // Another floating dtype is cast, as PyTorch casts; a negative second moment is PyTorch's to
  // take (the update's square root then gives NaN there too).
  EXPECT_TRUE(check_state_tensor(at::full({2, 3}, -1.0, at::kDouble), p, p.sizes()).ok());
  EXPECT_THAT(tensor_error(at::ones({5}), p), HasSubstr("has shape [5], the parameter has shape "
                                                        "[2, 3]"));
  EXPECT_THAT(
      check_state_tensor(at::ones({3}), p, {}, "NAdam").message(),
      HasSubstr("has shape [3], NAdam keeps it with shape [] for a parameter of shape [2, 3]"));
  EXPECT_THAT(tensor_error(at::ones({2, 3}, at::kLong), p), HasSubstr("is a Long tensor"));
  EXPECT_THAT(tensor_error(at::ones({2, 3}, at::kBool), p), HasSubstr("is a Bool tensor"));
  at::Tensor with_nan = at::ones({2, 3});
  with_nan[1][2] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(tensor_error(with_nan, p), HasSubstr("holds nan (element 5)"));
  EXPECT_THAT(tensor_error(at::full({2, 3}, -INFINITY), p), HasSubstr("holds -inf (element 0)"));
  // Finite in float64 but inf once cast to the parameter's float32.
  EXPECT_THAT(tensor_error(at::full({2, 3}, 1e300, at::kDouble), p),
              HasSubstr("holds inf (element 0, once cast to Float)"));
  EXPECT_THAT(tensor_error(at::ones({2, 3}).to_sparse(), p), HasSubstr("tensor; optimizer state "
                                                                       "is dense"));
}

checkpoint::OptimizerStateDict dict_with_params(std::vector<std::vector<int64_t>> groups) {
  checkpoint::OptimizerStateDict sd;
  for (auto& g : groups) sd.param_groups.push_back(checkpoint::ParamGroup{std::move(g)});
  return sd;
}

TEST(CheckParamIndices, EachIndexOnceAndStateOnlyForListedOnes) {
  EXPECT_TRUE(check_param_indices(dict_with_params({{0, 1}, {2}}), 3, "w").ok());
  EXPECT_TRUE(check_param_indices(dict_with_params({{1, 0}}), 2, "w").ok());
  EXPECT_THAT(check_param_indices(dict_with_params({{-1, 1}}), 2, "w").message(),
              HasSubstr("w: param_groups[0]['params'] holds -1, not a parameter index in [0, 2)"));
  EXPECT_THAT(check_param_indices(dict_with_params({{0}, {5}}), 2, "w").message(),
              HasSubstr("param_groups[1]['params'] holds 5"));
  EXPECT_THAT(check_param_indices(dict_with_params({{0, 1}, {1}}), 2, "w").message(),
              HasSubstr("parameter 1 is listed twice in 'params' (param_groups[0] and "
                        "param_groups[1])"));
  EXPECT_THAT(check_param_indices(dict_with_params({{1, 1}}), 2, "w", 3).message(),
              HasSubstr("(param_groups[3] and param_groups[3])"));
  checkpoint::OptimizerStateDict extra = dict_with_params({{0, 1}});
  extra.state.emplace(2, checkpoint::new_state_entry());
  EXPECT_THAT(check_param_indices(extra, 2, "w").message(),
              HasSubstr("'state' has an entry for parameter 2, which no param group lists"));
}

TEST(CheckOptionNumbers, RefusesNonFiniteNumbers) {
  checkpoint::ParamGroup g;
  g.options.insert("lr", 0.1);
  g.options.insert("betas", test_util::tuple({0.9, 0.999}));
  g.options.insert("param_names", c10::List<std::string>({"w"}));
  EXPECT_TRUE(check_option_numbers(g, 0, "w").ok());
  g.options.insert_or_assign("betas", test_util::tuple({0.9, std::nan("")}));
  EXPECT_THAT(check_option_numbers(g, 2, "w").message(),
              HasSubstr("w: param_groups[2]['betas'] holds nan"));
  g.options.insert_or_assign("betas", test_util::tuple({0.9, 0.999}));
  g.options.insert_or_assign("lr", INFINITY);
  EXPECT_THAT(check_option_numbers(g, 0, "w").message(), HasSubstr("['lr'] holds inf"));
}

TEST(CheckGenericEntry, NamesKeyAndFileIndex) {
  checkpoint::StateEntry e = checkpoint::new_state_entry();
  e.insert("step", at::scalar_tensor(3.0));
  e.insert("exp_avg", at::zeros({4}));
  e.insert("max_exp_avg_sq", c10::IValue());
  EXPECT_TRUE(check_generic_entry(e, at::zeros({4}), 7, "Adam.load_state_dict").ok());
  e.insert_or_assign("exp_avg", at::full({4}, NAN));
  EXPECT_THAT(check_generic_entry(e, at::zeros({4}), 7, "Adam.load_state_dict").message(),
              HasSubstr("Adam.load_state_dict: state 'exp_avg' of parameter 7 holds nan"));
  e.insert_or_assign("exp_avg", std::string("x"));
  EXPECT_THAT(check_generic_entry(e, at::zeros({4}), 7, "w").message(),
              HasSubstr("state 'exp_avg' of parameter 7 is a String, not a tensor"));
  e.insert_or_assign("exp_avg", at::zeros({4}));
  e.insert_or_assign("step", -1.0);
  EXPECT_THAT(check_generic_entry(e, at::zeros({4}), 7, "w").message(),
              HasSubstr("w: state 'step' of parameter 7 is -1, below 0; load a state dict saved "
                        "by this optimizer"));
}

}  // namespace
}  // namespace dtrain::optim

#include "ddp_hooks/bucket_hook.h"

#include <ATen/ATen.h>

#include "ddp_hooks/libtorch_compat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dtrain::ddp_hooks {
namespace {

class Identity : public BucketHook {
 public:
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket&) override { return {}; }
};

struct Counter {
  int calls = 0;
};

class Counting : public StatefulHook<Counter> {
 public:
  explicit Counting(std::shared_ptr<Counter> s) : StatefulHook(std::move(s), "Counting") {}
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket&) override {
    ++state().calls;
    return {};
  }
};

TEST(BucketHookTest, ParsesATensorOrTheFirstOfAList) {
  Identity hook;
  at::Tensor a = at::arange(3, at::kFloat), b = at::ones({2});
  EXPECT_TRUE(hook.parseHookResult(c10::IValue(a)).is_same(a));
  EXPECT_TRUE(hook.parseHookResult(c10::IValue(std::vector<at::Tensor>{a, b})).is_same(a));
  c10::impl::GenericList generic(c10::AnyType::get());
  generic.push_back(c10::IValue(b));
  EXPECT_TRUE(hook.parseHookResult(c10::IValue(generic)).is_same(b));
}

TEST(BucketHookTest, RejectsWhatIsNoBucket) {
  Identity hook;
  EXPECT_THAT([&] { hook.parseHookResult(c10::IValue(int64_t{3})); },
              testing::ThrowsMessage<c10::Error>(
                  testing::HasSubstr("must be a tensor or a list of tensors")));
  EXPECT_THAT([&] { hook.parseHookResult(c10::IValue(std::vector<at::Tensor>{})); },
              testing::ThrowsMessage<c10::Error>(testing::HasSubstr("empty tensor list")));
  c10::impl::GenericList generic(c10::AnyType::get());
  generic.push_back(c10::IValue(1.5));
  EXPECT_THAT(
      [&] { hook.parseHookResult(c10::IValue(generic)); },
      testing::ThrowsMessage<c10::Error>(testing::HasSubstr("first element is not a tensor")));
}

TEST(BucketHookTest, StatefulHookKeepsTheCallersStateAndNamesItselfWhenThereIsNone) {
  auto counter = std::make_shared<Counter>();
  Counting hook(counter);
  const std::vector<int64_t> shape = {4};
  c10d::GradBucket bucket =
      make_grad_bucket(0, 1, at::zeros({4}), {0}, {4}, {shape}, {at::zeros({4})});
  hook.runHook(bucket);
  EXPECT_EQ(counter->calls, 1);
  EXPECT_THAT([] { Counting nothing(nullptr); },
              testing::ThrowsMessage<c10::Error>(testing::HasSubstr("Counting needs a state")));
}

}  // namespace
}  // namespace dtrain::ddp_hooks

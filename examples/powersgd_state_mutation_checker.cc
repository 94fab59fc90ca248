#include "examples/powersgd_state_mutation_checker.h"

#include <chrono>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <utility>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/state_file.h"
#include "comm/process_group.h"
#include "comm/testing/test_harness.h"

namespace dtrain::examples::mutation {

std::shared_ptr<PowerSGDState> make_state(comm::Group& g) {
  auto s = std::make_shared<PowerSGDState>(g);
  s->matrix_approximation_rank = 1;
  s->start_powerSGD_iter = 2;
  s->random_seed = 3;
  return s;
}

const std::string& original_file() {
  static const std::string* path = [] {
    auto* p = new std::string(::testing::TempDir() + "hook-rank0.pt");
    comm::testing::run_ranks_as_threads(2, [p](comm::Group& g) {
      auto state = make_state(g);
      PowerSGDHook hook(state);
      const Model model;
      for (int iter = 0; iter < kSavedIter; ++iter) {
        const Model::Step s = model.step(hook, g.rank(), iter);
        ASSERT_FALSE(s.error.has_value()) << *s.error;
      }
      ASSERT_TRUE(state->iter == kSavedIter && state->error_dict.size() == 2 &&
                  state->p_memory_dict.size() == 2);
      if (g.rank() == 0) {
        const absl::Status s = checkpoint::save_state(*p, state->state_dict());
        ASSERT_TRUE(s.ok()) << s;
      }
    });
    return p;
  }();
  return *path;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

c10::IValue with(const c10::IValue& base, const std::string& key, c10::IValue value, bool drop) {
  GenericDict d = base.toGenericDict().copy();
  if (drop) d.erase(key);
  if (!drop) d.insert_or_assign(key, std::move(value));
  return d;
}
GenericDict untyped(const c10::IValue& dict) {
  GenericDict out(c10::AnyType::get(), c10::AnyType::get());
  for (const auto& kv : dict.toGenericDict()) out.insert(kv.key(), kv.value());
  return out;
}
c10::IValue with_memory(const c10::IValue& base, const std::string& key,
                        const std::function<void(GenericDict&)>& edit) {
  GenericDict m = untyped(base.toGenericDict().at(key));
  edit(m);
  return with(base, key, m);
}
at::Tensor entry(const c10::IValue& base, const std::string& key, int64_t bucket) {
  return base.toGenericDict().at(key).toGenericDict().at(bucket).toTensor();
}

void sweep(const std::string& title, int at_least,
           const std::function<void(const c10::IValue&, Checker&)>& mutate) {
  const std::string& original = original_file();
  absl::StatusOr<c10::IValue> base = checkpoint::load_state(original);
  ASSERT_TRUE(base.ok()) << base.status();
  ASSERT_TRUE(base->isGenericDict());
  comm::testing::HarnessOptions options;
  options.timeout =
      std::chrono::minutes(5);  // one rank: no peer to wait for, only the sweep's length
  comm::testing::run_ranks_as_threads(
      1,
      [&](comm::Group& g) {
        Checker s(g, ::testing::TempDir() + "mutant.pt");
        if (!s.init(original)) return;
        mutate(*base, s);
        s.report(absl::StrCat(title, " (", read_file(original).size(), "-byte file)"));
        EXPECT_GE(s.mutants(), at_least);
      },
      options);
}

}  // namespace dtrain::examples::mutation

// Helpers the DiLoCo tests share (optim/diloco_test.cc, optim/diloco_streaming_test.cc, the quorum
// tests): copies of parameters, the largest difference, a list of tensors from a reference file, a
// state dict with one "diloco" entry replaced or removed, the result a replica process of a
// quorum test hands its parent (its parameters and the rounds it saw, record_round), and DiLoCo
// written out over those rounds (replay_rounds).
//
//   std::vector<at::Tensor> p = dtrain::optim::diloco_testing::fresh(init);
//   c10::IValue bad = dtrain::optim::diloco_testing::with_entry(sd, "steps", c10::IValue(-1));
#ifndef DTRAIN_OPTIM_TESTING_DILOCO_TESTING_H_
#define DTRAIN_OPTIM_TESTING_DILOCO_TESTING_H_

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/jit/serialization/pickle.h>

namespace dtrain::optim::diloco_testing {

// Leaf copies of `init` that require grad.
inline std::vector<at::Tensor> fresh(const std::vector<at::Tensor>& init) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : init) out.push_back(t.detach().clone().requires_grad_());
  return out;
}

inline double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.detach().to(at::kDouble) - b.detach().to(at::kDouble)).abs().max().item<double>();
}

// The tensors of a List[Tensor] IValue (a reference file's entry).
inline std::vector<at::Tensor> tensors(const c10::IValue& list) {
  std::vector<at::Tensor> out;
  for (const auto& t : list.toList()) out.push_back(t.get().toTensor());
  return out;
}

// `sd` (a DiLoCo state dict) with its "diloco" entry `key` set to `value`, or removed (nullopt).
inline c10::IValue with_entry(const c10::IValue& sd, const std::string& key,
                              const std::optional<c10::IValue>& value) {
  c10::impl::GenericDict top = sd.toGenericDict().copy();
  c10::impl::GenericDict d = top.at("diloco").toGenericDict().copy();
  if (value.has_value()) {
    d.insert_or_assign(key, *value);
  } else {
    (void)d.erase(key);
  }
  top.insert_or_assign("diloco", d);
  return top;
}

// $TEST_TMPDIR/<name><id>.pt (/tmp outside Bazel): where replica process `id` leaves its result.
inline std::string result_path(const std::string& name, int id) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/" + name + std::to_string(id) + ".pt";
}

// Pickles {"params": detached copies' list, "outer_step", "rounds": [[step, participant ids...]]}.
inline void save_result(const std::string& path, const std::vector<at::Tensor>& params,
                        int64_t outer_step, const c10::List<c10::List<int64_t>>& rounds) {
  c10::List<at::Tensor> list;
  for (const at::Tensor& p : params) list.push_back(p.detach());
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("params", list);
  d.insert("outer_step", outer_step);
  d.insert("rounds", rounds);
  const std::vector<char> bytes = torch::jit::pickle_save(d);
  std::ofstream(path, std::ios::binary).write(bytes.data(), bytes.size());
}

inline c10::impl::GenericDict load_result(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return torch::jit::pickle_load(bytes).toGenericDict();
}

// A result's rounds, [step, participant ids...] each.
inline std::vector<std::vector<int64_t>> rounds_of(const c10::impl::GenericDict& d) {
  std::vector<std::vector<int64_t>> out;
  const c10::List<c10::IValue> list = d.at("rounds").toList();
  for (size_t i = 0; i < list.size(); ++i) out.push_back(list.get(i).toIntVector());
  return out;
}

// Appends the round a quorum DiLoCo has just committed (`step`, the quorum `q` it committed in)
// to `rounds` as [step, participant replica ids...], prints "<who> <id> committed step <step>
// participants <ids>" for the parent's dumps, and returns the ids.
template <typename Quorum>
std::vector<int64_t> record_round(const Quorum& q, int64_t step,
                                  c10::List<c10::List<int64_t>>& rounds, const char* who, int id) {
  std::vector<int64_t> ids;
  for (int r : q.participants()) ids.push_back(q.members[r].replica_id);
  c10::List<int64_t> entry({step});
  std::string joined;
  for (int64_t i : ids) {
    entry.push_back(i);
    joined += (joined.empty() ? "" : ",") + std::to_string(i);
  }
  rounds.push_back(entry);
  std::printf("%s %d committed step %lld participants %s\n", who, id, static_cast<long long>(step),
              joined.c_str());
  std::fflush(stdout);
  return ids;
}

// DiLoCo written out over recorded rounds ([step, participant ids...] each): in each round every
// participant trains a fresh copy of `global` (`train(local, participant id, step)`), the
// pseudo-gradients global - local are averaged over the participants, and `outer` steps on them.
template <typename Outer, typename Train>
void replay_rounds(std::vector<at::Tensor>& global, Outer& outer,
                   const std::vector<std::vector<int64_t>>& rounds, const Train& train) {
  for (const std::vector<int64_t>& r : rounds) {
    const double n = static_cast<double>(r.size() - 1);
    std::vector<at::Tensor> avg;
    for (const at::Tensor& g : global) avg.push_back(at::zeros_like(g));
    for (size_t i = 1; i < r.size(); ++i) {
      std::vector<at::Tensor> local = fresh(global);
      train(local, r[i], r[0]);
      for (size_t j = 0; j < global.size(); ++j) avg[j] += (global[j] - local[j].detach()) / n;
    }
    outer.step(avg);
  }
}

}  // namespace dtrain::optim::diloco_testing

#endif  // DTRAIN_OPTIM_TESTING_DILOCO_TESTING_H_

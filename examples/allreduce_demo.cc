// A first multi-rank program: joins the job from torchrun-style environment variables, sums a
// tensor across ranks and gathers every rank's host name. Run it with
//   ./bazelw build //examples:allreduce_demo
//   ./bazelw run //launcher:launch -- --nproc_per_node=2 -- bazel-bin/examples/allreduce_demo
#include <unistd.h>

#include <iostream>

#include <ATen/ATen.h>

#include "comm/object_collectives.h"
#include "comm/process_group.h"

int main() {
  absl::StatusOr<dtrain::comm::Group> world = dtrain::comm::init_process_group({});
  if (!world.ok()) {
    std::cerr << "allreduce_demo: " << world.status().message() << "\n";
    return 1;
  }
  const int rank = world->rank();
  std::vector<at::Tensor> t = {at::full({4}, static_cast<double>(rank + 1))};
  (*world)->allreduce(t)->wait();

  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  auto hosts = dtrain::comm::all_gather_object(*world, c10::IValue(std::string(host)));
  if (!hosts.ok()) {
    std::cerr << "allreduce_demo: " << hosts.status().message() << "\n";
    return 1;
  }
  std::cout << "rank " << rank << " of " << world->size()
            << ": allreduce sum = " << t[0][0].item<double>() << " (expected "
            << world->size() * (world->size() + 1) / 2 << "), ranks on hosts:";
  for (const auto& h : *hosts) std::cout << " " << h.toStringRef();
  std::cout << std::endl;
  return 0;
}

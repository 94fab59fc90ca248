// DiLoCo's fault-tolerant sync (DiLoCoOptions::quorum): a quorum per round, the state of a healthy
// replica for those behind, the pseudo-gradients of the participants averaged over the quorum's
// group. Part of //optim:diloco (diloco.h declares it).
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "comm/exception_status.h"
#include "comm/object_collectives.h"
#include "optim/diloco.h"

namespace dtrain::optim {

void DiLoCo::join_quorum() {
  TORCH_CHECK(options_.quorum != nullptr,
              "DiLoCo::join_quorum: DiLoCoOptions::quorum is not set; join_quorum is for "
              "fault-tolerant DiLoCo: give it a comm::QuorumClient");
  TORCH_CHECK(local_step_ == 0, "DiLoCo::join_quorum: ", local_step_,
              " inner steps were taken since the last sync; call it before the first step");
  sync_options(/*to_inner=*/true);
  quorum_sync(/*has_update=*/false);
  sync_options(/*to_inner=*/false);
}

void DiLoCo::quorum_sync(bool has_update) {
  std::string errors;
  for (int64_t attempt = 0; attempt < options_.max_quorum_retries; ++attempt) {
    absl::StatusOr<comm::Quorum> q = options_.quorum->quorum(outer_step_, has_update);
    if (absl::IsAborted(q.status())) {  // its group did not form: a member died since
      absl::StrAppend(&errors, "; attempt ", attempt + 1, ": ", q.status().ToString());
      continue;
    }
    TORCH_CHECK(q.ok(), "DiLoCo: no quorum for outer step ", outer_step_, " of replica ",
                options_.quorum->options().replica_id, ": ", q.status().ToString(), errors);
    const absl::Status done = quorum_round(*q, has_update);
    if (done.ok()) {
      last_quorum_ = std::move(*q);
      return;
    }
    absl::StrAppend(&errors, "; after attempt ", attempt + 1, " in ", q->describe(), ": ",
                    done.ToString());
  }
  TORCH_CHECK(false, "DiLoCo: replica ", options_.quorum->options().replica_id,
              " could not commit outer step ", outer_step_, " in ", options_.max_quorum_retries,
              " quorums (DiLoCoOptions::max_quorum_retries)", errors,
              "; check the replicas' links, or raise max_quorum_retries");
}

// One round in quorum `q`: the healers load the state of q.recover_src() (has_update is cleared
// then: their local parameters are stale), the participants' pseudo-gradients are averaged (the
// others send zeros) and the outer optimizer commits round q.max_step. A failed collective leaves
// the round uncommitted on this replica (a Status; the caller retries in the next quorum). With a
// replica group of several ranks (QuorumOptions::replica_group) its ranks vote before the commit:
// the round is committed by all of them or by none.
absl::Status DiLoCo::quorum_round(const comm::Quorum& q, bool& has_update) {
  c10::NoGradGuard no_grad;
  at::Tensor average;
  absl::Status done = quorum_exchange(q, has_update, average);
  const comm::Group& replica_group = options_.quorum->options().replica_group;
  if (replica_group.is_member() && replica_group.size() > 1) {
    at::Tensor failed = at::full({1}, done.ok() ? 0 : 1, at::kInt);
    std::vector<at::Tensor> bufs = {failed};
    try {
      replica_group->allreduce(bufs)->wait();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "DiLoCo: replica ", options_.quorum->options().replica_id,
                  ": its replica group's ranks could not vote on outer step ", q.max_step, ": ",
                  e.what(), "; a rank of the replica group was lost: restart the replica group");
    }
    // Healers loaded the state before the vote: if a rank failed, they may differ now.
    TORCH_CHECK(failed.item<int>() == 0 || !q.healing(q.rank), "DiLoCo: replica ",
                options_.quorum->options().replica_id, ": ", failed.item<int>(),
                " rank(s) of its replica group failed while it caught up with outer step ",
                q.max_step, " (", done.ToString(),
                "); its ranks may hold different states: restart the replica group");
    if (done.ok() && failed.item<int>() > 0) {
      done = absl::AbortedError(
          absl::StrCat(failed.item<int>(), " rank(s) of this replica group failed the round"));
    }
  }
  if (!done.ok()) return done;
  if (average.defined()) {
    std::vector<at::Tensor> grads;
    int64_t offset = 0;
    for (const at::Tensor& g : global_) {
      grads.push_back(average.narrow(0, offset, g.numel()).view(g.sizes()).to(g.scalar_type()));
      offset += g.numel();
    }
    outer_->step(grads);
    outer_step_ = q.max_step + 1;
  }
  const std::vector<at::Tensor> local = checked_local_params();
  for (size_t i = 0; i < global_.size(); ++i) local[i].detach().copy_(global_[i]);
  return absl::OkStatus();
}

// The collectives of a round: the state for the healers, the participants' average (left
// undefined when there are none).
absl::Status DiLoCo::quorum_exchange(const comm::Quorum& q, bool& has_update, at::Tensor& average) {
  const comm::Group& group = q.group;
  if (q.any_healing()) {
    const int src = q.recover_src();
    c10::IValue sd = group.rank() == src ? state_dict() : c10::IValue();
    if (absl::Status s = comm::broadcast_object(group, sd, src); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("the state transfer failed: ", s.message()));
    }
    if (q.healing(q.rank)) {
      has_update = false;
      const int64_t from = q.members[src].replica_id;
      try {
        load_state_dict(sd);
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, "DiLoCo: the state replica ", from,
                    " sent failed its checks: ", e.what_without_backtrace(),
                    "; the replicas run different models or options: start them alike");
      }
      TORCH_CHECK(outer_step_ == q.max_step, "DiLoCo: replica ", from, " sent the state of step ",
                  outer_step_, " but reported step ", q.max_step, " to the quorum");
    }
  }
  const std::vector<int> participants = q.participants();
  if (participants.empty()) return absl::OkStatus();
  const std::vector<at::Tensor> local = checked_local_params();
  const bool mine =
      std::find(participants.begin(), participants.end(), q.rank) != participants.end();
  std::vector<at::Tensor> parts;
  for (size_t i = 0; i < global_.size(); ++i) {
    parts.push_back(mine ? (global_[i] - local[i].detach()).reshape(-1)
                         : at::zeros({global_[i].numel()}, global_[i].options()));
  }
  at::Tensor flat = at::cat(parts).div_(static_cast<double>(participants.size()));
  std::vector<at::Tensor> bufs = {flat};
  try {
    group->allreduce(bufs)->wait();
  } catch (...) {
    return comm::current_exception_status(absl::StatusCode::kUnavailable,
                                          "the pseudo-gradients' all-reduce");
  }
  average = flat;
  return absl::OkStatus();
}

}  // namespace dtrain::optim

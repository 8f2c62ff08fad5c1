#include "runtime/scheduler.h"

#include <algorithm>
#include <set>

#include "common/error.h"

namespace dsv4 {

Scheduler::Scheduler(const SchedulerOptions& options) : opt_(options) {
  DSV4_REQUIRE(options.token_budget > 0, "scheduler: token budget must be positive");
  DSV4_REQUIRE(options.max_running > 0, "scheduler: max_running must be positive");
}

void Scheduler::add(const WorkloadRequest& r) {
  DSV4_REQUIRE(r.prompt_len > 0 && r.gen_len >= 0, "request " + std::to_string(r.id) + ": prompt must be non-empty");
  waiting_.push_back(r);
}

ScheduledStep Scheduler::next_step() {
  ScheduledStep step;
  int budget = opt_.token_budget;
  // Decode first: one token each for requests past their prompt.
  for (const Live& l : running_) {
    if (budget == 0) break;
    if (l.pos >= l.req.prompt_len && l.pos < l.total()) {
      step.runs.push_back({l.req.id, l.pos, 1});
      step.decode.push_back(true);
      --budget;
    }
  }
  while (running_.size() < size_t(opt_.max_running) && !waiting_.empty()) {
    running_.push_back({waiting_.front(), 0});
    step.admitted.push_back(waiting_.front().id);
    waiting_.pop_front();
  }
  // Then prefill chunks, oldest request first.
  for (const Live& l : running_) {
    if (budget == 0) break;
    if (l.pos >= l.req.prompt_len) continue;
    const int len = int(std::min<int64_t>(budget, l.req.prompt_len - l.pos));
    step.runs.push_back({l.req.id, l.pos, len});
    step.decode.push_back(false);
    budget -= len;
  }
  return step;
}

void Scheduler::complete(const ScheduledStep& step, const std::vector<size_t>& rejected_runs,
                         std::vector<int64_t>& finished, std::vector<int64_t>& failed) {
  const std::set<size_t> rejected(rejected_runs.begin(), rejected_runs.end());
  std::set<int64_t> dropped;
  for (size_t i = 0; i < step.runs.size(); ++i) {
    const Run& run = step.runs[i];
    if (rejected.count(i)) {
      dropped.insert(run.request);
      continue;
    }
    for (Live& l : running_)
      if (l.req.id == run.request) l.pos += run.len;
  }
  std::vector<Live> keep;
  for (Live& l : running_) {
    if (dropped.count(l.req.id)) failed.push_back(l.req.id);
    else if (l.pos >= l.total()) finished.push_back(l.req.id);
    else keep.push_back(l);
  }
  running_ = std::move(keep);
}

}  // namespace dsv4

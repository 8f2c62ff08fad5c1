#include "runtime/scheduler.h"

#include <algorithm>
#include <cstdint>
#include <map>

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

size_t Scheduler::oldest_stalled() const {
  for (size_t i = 0; i < running_.size(); ++i)
    if (running_[i].stalled) return i;
  return SIZE_MAX;
}

ScheduledStep Scheduler::next_step() {
  ScheduledStep step;
  int budget = opt_.token_budget;
  // Requests admitted after the oldest stalled one wait.
  const size_t last = oldest_stalled();
  // Decode first: one token each for requests past their prompt.
  for (size_t i = 0; i < running_.size() && i <= last && budget > 0; ++i) {
    const Live& l = running_[i];
    if (l.pos >= l.req.prompt_len && l.pos < l.total()) {
      step.runs.push_back({l.req.id, l.pos, 1});
      step.decode.push_back(true);
      --budget;
    }
  }
  // Then prefill chunks, oldest request first.
  auto prefill = [&](size_t i) {
    const Live& l = running_[i];
    if (l.pos >= l.req.prompt_len) return;
    const int len = int(std::min<int64_t>(std::min(budget, l.max_chunk), l.req.prompt_len - l.pos));
    step.runs.push_back({l.req.id, l.pos, len});
    step.decode.push_back(false);
    budget -= len;
  };
  for (size_t i = 0; i < running_.size() && i <= last && budget > 0; ++i) prefill(i);
  // Then new requests, as many as the budget has tokens for: an admitted
  // request is opened, and one without tokens would hold its place for
  // nothing. None while a request is stalled: they would wait behind it.
  while (last == SIZE_MAX && budget > 0 && running_.size() < size_t(opt_.max_running) && !waiting_.empty()) {
    running_.emplace_back().req = waiting_.front();
    step.admitted.push_back(waiting_.front().id);
    waiting_.pop_front();
    prefill(running_.size() - 1);
  }
  return step;
}

void Scheduler::resolve_stall(size_t stalled, const Run& run, const std::string& reason, StepOutcome& out) {
  // The youngest request after it that holds pages (pos > 0): preempted,
  // unless it finishes or fails now (its pages go back at the step's end).
  for (size_t i = running_.size(); i-- > stalled + 1;) {
    const Live& v = running_[i];
    if (v.pos == 0) continue;
    if (v.pos >= v.total() || !v.failure.empty()) return;
    out.preempted.push_back(v.req.id);
    out.recomputed_tokens += v.pos;
    waiting_.push_front(v.req);
    running_.erase(running_.begin() + std::ptrdiff_t(i));
    return;
  }
  // None: an older request holding pages may still let them go.
  for (size_t i = 0; i < stalled; ++i)
    if (running_[i].pos > 0) return;
  // Every page it could ever get is free or its own, and the run does not fit.
  Live& l = running_[stalled];
  if (run.len > 1) l.max_chunk = run.len / 2;
  else l.failure = reason + " (no other request holds cache pages: it cannot fit)";
}

StepOutcome Scheduler::complete(const ScheduledStep& step, const std::vector<RunError>& rejected) {
  StepOutcome out;
  std::map<size_t, const RunError*> by_run;
  for (const RunError& e : rejected) {
    DSV4_REQUIRE(e.run < step.runs.size(), "scheduler: rejected run " + std::to_string(e.run) + " is not in the step");
    by_run[e.run] = &e;
  }
  std::map<int64_t, std::pair<Run, std::string>> full;  // requests whose run the caches could not hold, and why
  for (size_t i = 0; i < step.runs.size(); ++i) {
    const Run& run = step.runs[i];
    const auto l =
        std::find_if(running_.begin(), running_.end(), [&](const Live& x) { return x.req.id == run.request; });
    DSV4_REQUIRE(l != running_.end(), "scheduler: request " + std::to_string(run.request) + " is not running");
    const auto e = by_run.find(i);
    if (e == by_run.end()) {
      l->pos += run.len;
      l->stalled = false;
      if (!step.decode[i] && l->max_chunk <= INT32_MAX / 2) l->max_chunk *= 2;  // room may have come back
    } else if (e->second->cache_full) {
      l->stalled = true;
      full[run.request] = {run, e->second->message};
    } else {
      l->failure = e->second->message;
    }
  }
  const size_t stalled = oldest_stalled();
  if (stalled < running_.size()) {
    const auto f = full.find(running_[stalled].req.id);
    if (f != full.end()) resolve_stall(stalled, f->second.first, f->second.second, out);
  }
  std::vector<Live> keep;
  for (Live& l : running_) {
    if (!l.failure.empty()) out.failed.push_back({l.req.id, l.failure});
    else if (l.pos >= l.total()) out.finished.push_back(l.req.id);
    else keep.push_back(std::move(l));
  }
  running_ = std::move(keep);
  return out;
}

}  // namespace dsv4

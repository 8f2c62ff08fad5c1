#pragma once
// A small continuous-batching scheduler: each step is filled under a token
// budget with one decode token per generating request first, then prefill
// chunks of admitted requests (chunked prefill mixed with decode).
#include <cstdint>
#include <deque>
#include <vector>

#include "step/step.h"

namespace dsv4 {

struct WorkloadRequest {
  int64_t id = 0;
  int prompt_len = 0;
  int gen_len = 0;  // decode steps after the prompt
};

struct SchedulerOptions {
  int token_budget = 512;  // tokens per step
  int max_running = 8;     // requests holding cache at once
};

struct ScheduledStep {
  std::vector<Run> runs;
  std::vector<bool> decode;       // per run: a decode token (else a prefill chunk)
  std::vector<int64_t> admitted;  // requests whose first run is in this step: open them first
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerOptions& options);

  void add(const WorkloadRequest& r);
  ScheduledStep next_step();
  // Reports the outcome of a step: accepted runs advance; a rejected run's
  // request is dropped (returned in `failed`). Finished requests are returned
  // in `finished`; their caches can be closed.
  void complete(const ScheduledStep& step, const std::vector<size_t>& rejected_runs, std::vector<int64_t>& finished,
                std::vector<int64_t>& failed);
  bool done() const { return waiting_.empty() && running_.empty(); }
  size_t running() const { return running_.size(); }

 private:
  struct Live {
    WorkloadRequest req;
    int64_t pos = 0;  // tokens processed
    int64_t total() const { return int64_t(req.prompt_len) + req.gen_len; }
  };
  SchedulerOptions opt_;
  std::deque<WorkloadRequest> waiting_;
  std::vector<Live> running_;
};

}  // namespace dsv4

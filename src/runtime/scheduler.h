#pragma once
// A small continuous-batching scheduler: each step is filled under a token
// budget with one decode token per generating request first, then prefill
// chunks of admitted requests (chunked prefill mixed with decode).
//
// When the caches cannot hold a run (RunError::cache_full) its request
// stalls: it keeps its tokens and retries, and every request admitted after
// the oldest stalled one waits, so that no younger request takes the pages
// it needs. While it stays stalled, the youngest request holding cache is
// preempted, one a step: its pages go back and it starts again from position
// 0 (recompute: every state is a function of (request, position), so it
// computes the same tokens again). A stalled request with nothing else left
// to preempt and no older request to wait for has the caches to itself: a
// prefill chunk is halved and retried (a chunk's transient pages, its
// compressor rows and window, shrink with it), and the cap doubles again
// after each chunk that fits; a run of one token that still does not fit
// never will, and its request fails.
#include <algorithm>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "step/step.h"

namespace dsv4 {

struct WorkloadRequest {
  int64_t id = 0;
  int prompt_len = 0;
  int gen_len = 0;      // decode steps after the prompt
  double arrival = 0;   // seconds after the run's start (for the runner; the scheduler takes what has come)
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

// What a step's end did to the requests; each one listed here gives its
// cache pages back (close it). A preempted request is opened again when it
// is admitted again.
struct StepOutcome {
  std::vector<int64_t> finished;   // served every token
  std::vector<int64_t> preempted;  // back to the waiting queue's front, from position 0
  int64_t recomputed_tokens = 0;   // tokens the preempted requests had served
  struct Failure {
    int64_t request = 0;
    std::string reason;
  };
  std::vector<Failure> failed;  // dropped: a bad run, or one the caches cannot hold at all
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerOptions& options);

  void add(const WorkloadRequest& r);
  ScheduledStep next_step();
  // The end of a step: accepted runs advance; `rejected` are the runs the
  // step left out (RunError::run indexes step.runs). A bad run drops its
  // request; a run the caches could not hold stalls it (see the top).
  StepOutcome complete(const ScheduledStep& step, const std::vector<RunError>& rejected);
  bool done() const { return waiting_.empty() && running_.empty(); }
  // Whether its queue holds fewer requests than a step may admit (each one
  // admitted gets a token of the budget): a source of requests adds them as
  // this asks, instead of all at once.
  bool wants_requests() const {
    return waiting_.size() < size_t(std::min(opt_.max_running, opt_.token_budget));
  }
  size_t running() const { return running_.size(); }

 private:
  struct Live {
    WorkloadRequest req;
    int64_t pos = 0;       // tokens processed
    bool stalled = false;          // its last run did not fit in the caches
    int max_chunk = INT32_MAX;     // prefill chunks at most this long (halved when alone it did not fit)
    std::string failure;           // why it is dropped at the step's end (empty: it is not)
    int64_t total() const { return int64_t(req.prompt_len) + req.gen_len; }
  };
  // Index in running_ (admission order) of the oldest stalled request; SIZE_MAX if none.
  size_t oldest_stalled() const;
  // After a step in which the oldest stalled request's run (`run`) did not fit again.
  void resolve_stall(size_t stalled, const Run& run, const std::string& reason, StepOutcome& out);
  SchedulerOptions opt_;
  std::deque<WorkloadRequest> waiting_;
  std::vector<Live> running_;
};

}  // namespace dsv4

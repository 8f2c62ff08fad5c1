// The dsv4 binary end to end: inspect, verify and run, and their errors.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <array>
#include <functional>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "model/safetensors.h"
#include "support/edited_safetensors.h"
#include "support/temp_dir.h"

namespace {

struct Result {
  int status;
  std::string out;
};

// Runs `dsv4 ARGS REDIRECT` and collects what reaches the pipe: by default
// stderr folded into stdout.
Result cli(const std::string& args, const std::string& redirect = "2>&1") {
  const std::string cmd = std::string(DSV4_BINARY_DIR) + "/dsv4 " + args + " " + redirect;
  FILE* p = popen(cmd.c_str(), "r");
  Result r{-1, {}};
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

bool has(const Result& r, const std::string& s) { return r.out.find(s) != std::string::npos; }

// A failure the user can act on: status 1, a message, no signal, no internal error.
void expect_user_error(const Result& r, const std::string& message) {
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_TRUE(has(r, message)) << "expected '" << message << "' in:\n" << r.out;
  EXPECT_FALSE(has(r, "internal error")) << r.out;
}

namespace fs = std::filesystem;
using dsv4::test::OwnedTensor;
using dsv4::test::rewrite_safetensors;

// A checkpoint directory as a real one looks: config.json (from a golden case)
// and the golden weights, `edit` applied to the weights' tensors.
void make_checkpoint(const fs::path& dir, const std::string& golden_case,
                     const dsv4::test::TensorListEdit& edit = {}) {
  fs::create_directories(dir);
  std::ifstream in(std::string(DSV4_GOLDEN_DIR) + "/" + golden_case + ".json");
  std::ofstream(dir / "config.json") << nlohmann::json::parse(in).at("config").dump(2);
  rewrite_safetensors(fs::path(DSV4_GOLDEN_DIR) / (golden_case + ".weights.safetensors"), dir / "model.safetensors",
                      edit);
}

// Puts a NaN into element 3 of a BF16 or F32 tensor.
void poison(std::vector<OwnedTensor>& ts, const std::string& name) {
  for (auto& t : ts) {
    if (t.name != name) continue;
    if (t.dtype == dsv4::DType::kBF16) t.bytes[6] = 0xc0, t.bytes[7] = 0x7f;  // bf16 0x7fc0
    else if (t.dtype == dsv4::DType::kF32) t.bytes[14] = 0xc0, t.bytes[15] = 0x7f;
    else throw std::runtime_error("test bug: " + name + " is neither BF16 nor F32");
    return;
  }
  throw std::runtime_error("test bug: no tensor " + name);
}

}  // namespace

TEST(Cli, InspectDefaultIsFlash) {
  const Result r = cli("inspect");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r, "layers: 43  (swaonly 2, c4a 21, c128a 20)")) << r.out;
  EXPECT_TRUE(has(r, "3.51 KB/token with MXFP4 indexer keys, 3.85 KB/token with FP8 keys")) << r.out;
  EXPECT_TRUE(has(r, "dense MLA")) << r.out;
}

TEST(Cli, InspectGoldenFp8Checkpoint) {
  const Result r = cli(std::string("inspect ") + DSV4_GOLDEN_DIR + "/mini-fp8.weights.safetensors");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r, "layers: 3  (swaonly 1, c4a 1, c128a 1)")) << r.out;
  EXPECT_TRUE(has(r, "wq_b.weight")) << r.out;
  EXPECT_TRUE(has(r, "F8_E4M3")) << r.out;
  EXPECT_TRUE(has(r, "indexer.compressor.ape")) << r.out;
  EXPECT_TRUE(has(r, "all 3 layers load")) << r.out;
}

TEST(Cli, InspectErrorsNameTheProblem) {
  Result r = cli("inspect /no/such/path");
  EXPECT_EQ(r.status, 1);
  EXPECT_TRUE(has(r, "no such file or directory: '/no/such/path'")) << r.out;
  r = cli(std::string("inspect ") + DSV4_GOLDEN_DIR + "/mini.r0.safetensors");
  EXPECT_EQ(r.status, 1);
  EXPECT_TRUE(has(r, "no config found")) << r.out;
}

void copy_mini(const fs::path& dir, const std::function<void(nlohmann::json&)>& edit_json,
               const std::function<void(int, std::vector<OwnedTensor>&)>& edit_tensors = {});

// Without --profile a case replays in its own numerics: exact for the float32
// `mini` (PASS, where production numerics FAIL it), which the GPU cannot run.
TEST(Cli, VerifyTakesTheCasesOwnProfile) {
  const std::string dir = DSV4_GOLDEN_DIR;
  const Result r = cli("verify " + dir + " mini");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r, "profile exact (the case is float32), float32 caches")) << r.out;
  EXPECT_TRUE(has(r, "PASS")) << r.out;
  expect_user_error(cli("verify " + dir + " mini --device cuda"),
                    "--device cuda: case mini is float32, replayed in the exact profile, which is CPU-only");
  expect_user_error(cli("verify " + dir + " mini --profile exact --device cuda"),
                    "--device cuda: the GPU runs production numerics only; the exact profile is CPU-only");
  dsv4::test::TempDir bad;
  copy_mini(bad.path(), [](nlohmann::json& j) { j["precision"] = 32; });
  expect_user_error(cli("verify " + bad.path().string() + " x"), "x.json: field 'precision' is not a string");
}

TEST(Cli, VerifyPassesAndFails) {
  Result r = cli(std::string("verify ") + DSV4_GOLDEN_DIR + " mini --profile exact");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r, "PASS")) << r.out;
  r = cli(std::string("verify ") + DSV4_GOLDEN_DIR + " mini-fp8 --profile exact");
  EXPECT_EQ(r.status, 1) << r.out;  // exact numerics are ~6e-2 from the production golden
  EXPECT_TRUE(has(r, "FAIL")) << r.out;
}

TEST(Cli, RunSmallWorkloadWithJson) {
  const std::string json = std::string(DSV4_BINARY_DIR) + "/cli_test_run.json";
  const Result r = cli("run --preset mini --device cpu --requests 3 --prompt 300 --gen 4 --budget 128 --json " + json);
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r, "finished 3 requests, 0 rejected")) << r.out;
  EXPECT_TRUE(has(r, "tokens/s")) << r.out;
  std::ifstream in(json);
  ASSERT_TRUE(in.good());
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_TRUE(j.contains("decode"));
  EXPECT_TRUE(j.contains("peak_cache_bytes"));
  EXPECT_TRUE(j.at("peak_cache_bytes_by_group").contains("c4a_state"));  // per cache group
  // The memory line's figures (the CPU's float32 copies among them, by default).
  const nlohmann::json& m = j.at("memory_bytes");
  for (const char* k : {"weights", "weight_copies", "caches", "workspace"}) EXPECT_GT(m.at(k).get<int64_t>(), 0) << k;
  EXPECT_EQ(j.at("device"), "cpu");
  EXPECT_EQ(j.at("finished"), 3);
  EXPECT_EQ(j.at("rejected"), 0);
  // A first token per request, then one per decode step.
  EXPECT_EQ(j.at("latency_ms").at("first_token").at("count"), 3);
  EXPECT_EQ(j.at("latency_ms").at("between_tokens").at("count"), 3 * 4);
  EXPECT_GT(j.at("latency_ms").at("between_tokens").at("median").get<double>(), 0.0);
  EXPECT_TRUE(has(r, "latency: first token median ")) << r.out;
  EXPECT_TRUE(has(r, "arriving all at the start")) << r.out;
  EXPECT_EQ(j.at("request_rate"), "inf");
  EXPECT_TRUE(j.at("errors").empty());
  EXPECT_TRUE(has(r, "by cache: compressed entries + indexer keys")) << r.out;
  // '-': standard output holds the JSON alone, the text report goes to standard error.
  const std::string small = "run --preset mini --device cpu --requests 1 --prompt 8 --gen 1 --json -";
  const Result stdout_only = cli(small, "2>/dev/null");
  ASSERT_EQ(stdout_only.status, 0) << stdout_only.out;
  EXPECT_EQ(nlohmann::json::parse(stdout_only.out).at("finished"), 1) << stdout_only.out;
  const Result stderr_only = cli(small, "2>&1 >/dev/null");
  EXPECT_TRUE(has(stderr_only, "finished 1 requests, 0 rejected")) << stderr_only.out;
  EXPECT_FALSE(has(stderr_only, "\"finished\"")) << stderr_only.out;
}

TEST(Cli, RunRejectsBadArguments) {
  Result r = cli("run --preset nope");
  EXPECT_NE(r.status, 0);
  r = cli("run --profile fast");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(has(r, "fast")) << r.out;
}

TEST(Cli, RunServesACheckpointDirectory) {
  // A checkpoint directory as a real one looks: config.json + weights with
  // the official names and dtypes (FP8 + UE8M0 scales).
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(DSV4_BINARY_DIR) / "cli_test_ckpt";
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ifstream in(std::string(DSV4_GOLDEN_DIR) + "/mini-fp8.json");
  const auto golden = nlohmann::json::parse(in);
  std::ofstream(dir / "config.json") << golden.at("config").dump(2);
  fs::copy_file(fs::path(DSV4_GOLDEN_DIR) / "mini-fp8.weights.safetensors", dir / "model-00001-of-00001.safetensors");
  const Result r = cli("run --checkpoint " + dir.string() + " --requests 2 --prompt 200 --gen 3");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r, "3 layers (swaonly 1, c4a 1, c128a 1)")) << r.out;
  EXPECT_TRUE(has(r, "finished 2 requests")) << r.out;
  // Without a config next to it, the error says what to do.
  fs::remove(dir / "config.json");
  const Result bad = cli("run --checkpoint " + dir.string());
  EXPECT_EQ(bad.status, 1);
  EXPECT_TRUE(has(bad, "no config.json")) << bad.out;
  fs::remove_all(dir);
}

// ---- argument checks: exit status 1, readable bounds --------------------------------------------

TEST(Cli, NumericOptionsAreCheckedWithReadableBounds) {
  expect_user_error(cli("run --seed -1"), "--seed: '-1' is not an integer in [0, 18446744073709551615]");
  expect_user_error(cli("run --seed 18446744073709551616"), "is not an integer in [0, 18446744073709551615]");
  expect_user_error(cli("run --seed 12abc"), "--seed: '12abc' is not an integer");
  expect_user_error(cli("run --budget 0"), "--budget: '0' is not an integer in [1, 2147483647]");
  expect_user_error(cli("run --budget 99999999999"), "--budget: '99999999999' is not an integer in [1, 2147483647]");
  expect_user_error(cli("run --gen -1"), "--gen: '-1' is not an integer in [0, 2147483647]");
  expect_user_error(cli("run --requests 1.5"), "--requests: '1.5' is not an integer");
  expect_user_error(cli("run --weight-cache-gib nan"), "--weight-cache-gib: 'nan' is not a finite number >= 0");
  expect_user_error(cli("run --weight-cache-gib -1"), "is not a finite number >= 0");
  expect_user_error(cli("run --request-rate 0"), "--request-rate: '0' is not a number > 0 or inf");
  expect_user_error(cli("run --request-rate nan"), "--request-rate: 'nan' is not a number > 0 or inf");
  expect_user_error(cli("run --request-rate 5/s"), "--request-rate: '5/s' is not a number > 0 or inf");
  // A size without its unit: bytes come whole, so "2.5" is an error, not 2 bytes.
  expect_user_error(cli("run --cache-memory 2.5"),
                    "--cache-memory: '2.5' is not a memory size (whole bytes, or a number with K, M, G or T)");
  expect_user_error(cli("run --device cpu --gpu-memory 2.5"),
                    "--gpu-memory '2.5': expected a fraction in (0, 1] or a size such as 80G");
  const Result r = cli(std::string("verify ") + DSV4_GOLDEN_DIR + " mini --max-chunk -1");
  expect_user_error(r, "--max-chunk: '-1' is not an integer in [0, 2147483647]");
  // No bound is printed as the largest double in full.
  for (const char* args : {"run --budget 0", "run --gen -5", "run --max-running 0", "run --prompt 0"}) {
    const Result e = cli(args);
    EXPECT_EQ(e.status, 1) << args;
    EXPECT_FALSE(has(e, "1797693134862315")) << e.out;
    EXPECT_LT(e.out.size(), 300u) << e.out;
  }
  const Result rate = cli("run --preset mini --device cpu --requests 3 --prompt 8 --gen 1 --request-rate 200");
  EXPECT_EQ(rate.status, 0) << rate.out;
  EXPECT_TRUE(has(rate, "arriving 200 a second (Poisson)")) << rate.out;
  EXPECT_TRUE(has(rate, "finished 3 requests, 0 rejected")) << rate.out;
  const Result seed = cli("run --preset mini --requests 1 --prompt 8 --gen 1 --seed 18446744073709551615");
  EXPECT_EQ(seed.status, 0) << seed.out;
  EXPECT_TRUE(has(seed, "synthetic, seed 18446744073709551615")) << seed.out;
}

TEST(Cli, PresetExcludesCheckpointAndConfig) {
  expect_user_error(cli(std::string("run --preset mini --checkpoint ") + DSV4_GOLDEN_DIR), "--preset excludes --checkpoint");
  dsv4::test::TempDir dir;
  std::ofstream(dir / "c.json") << "{}";
  expect_user_error(cli("run --preset mini --config " + (dir / "c.json").string()), "--preset excludes --config");
}

TEST(Cli, JsonPathIsCheckedBeforeTheRun) {
  const Result r = cli("run --preset mini --requests 1 --prompt 8 --gen 1 --json /no/such/dir/report.json");
  expect_user_error(r, "--json: cannot write '/no/such/dir/report.json': No such file or directory");
  EXPECT_FALSE(has(r, "workload:")) << "the run started:\n" << r.out;
  dsv4::test::TempDir dir;
  expect_user_error(cli("run --preset mini --json " + dir.path().string()), "Is a directory");
  // A write that fails at the end is an error too, not exit 0.
  const Result full = cli("run --preset mini --requests 1 --prompt 8 --gen 1 --json /dev/full");
  expect_user_error(full, "--json: cannot write '/dev/full': No space left on device");
  EXPECT_TRUE(has(full, "finished 1 requests")) << full.out;
  // stdout on a full device, stderr to the pipe.
  const Result out = cli("run --preset mini --requests 1 --prompt 8 --gen 1 --json -", "2>&1 >/dev/full");
  expect_user_error(out, "--json: cannot write standard output: No space left on device");
  expect_user_error(cli("inspect", "2>&1 >/dev/full"), "dsv4: error: cannot write standard output");
}

// The workload line gives the prompts the requests have (spread over
// [P/2, P], at least one token each).
TEST(Cli, TheWorkloadLineGivesThePromptsServed) {
  const Result one = cli("run --preset mini --device cpu --requests 3 --prompt 1 --gen 0");
  EXPECT_EQ(one.status, 0) << one.out;
  EXPECT_TRUE(has(one, "workload: 3 requests, prompts 1..1 tokens, 0 decode steps each")) << one.out;
  EXPECT_TRUE(has(one, "prefill: 3 tokens")) << one.out;
  const Result spread = cli("run --preset mini --device cpu --requests 3 --prompt 9 --gen 1");
  EXPECT_TRUE(has(spread, "workload: 3 requests, prompts 4..9 tokens, 1 decode steps each")) << spread.out;
  EXPECT_TRUE(has(spread, "prefill: 19 tokens")) << spread.out;  // 4 + 6 + 9
}

TEST(Cli, RunFailsWhenEveryRequestIsRejected) {
  dsv4::test::TempDir dir;
  std::ifstream in(std::string(DSV4_GOLDEN_DIR) + "/mini.json");
  nlohmann::json config = nlohmann::json::parse(in).at("config");
  config["max_position_embeddings"] = 64;
  std::ofstream(dir / "config.json") << config.dump();
  const Result r = cli("run --config " + (dir / "config.json").string() + " --requests 2 --prompt 200 --gen 2");
  expect_user_error(r, "every request was rejected (2 rejected; the first: request 0: a prompt of 100 tokens and 2 "
                       "generated need positions up to 101, past max_position_embeddings (64))");
  EXPECT_TRUE(has(r, "steps 0,")) << r.out;  // rejected before any work
  EXPECT_TRUE(has(r, "finished 0 requests, 2 rejected")) << r.out;
  // Many: every one counted, the first reasons listed.
  const Result many = cli("run --config " + (dir / "config.json").string() + " --requests 40 --prompt 200 --gen 2");
  expect_user_error(many, "every request was rejected (40 rejected; the first: request 0: ");
  EXPECT_TRUE(has(many, "  rejected: request 31: ")) << many.out;
  EXPECT_FALSE(has(many, "  rejected: request 32: ")) << many.out;
  EXPECT_TRUE(has(many, "  (and 8 more rejected)")) << many.out;
  // Some rejected, some served: the run did its job for those.
  const Result some = cli("run --config " + (dir / "config.json").string() + " --requests 2 --prompt 100 --gen 2");
  EXPECT_EQ(some.status, 0) << some.out;
  EXPECT_TRUE(has(some, "finished 1 requests, 1 rejected")) << some.out;
}

// A cache too small for the workload at once: requests wait and are
// preempted, and all are served; one too small for a single token rejects
// every request with the reason, before any step.
TEST(Cli, ACacheTooSmallForTheWorkloadServesItInTurn) {
  // (1.5M-2M of pages preempt here; with 2.5M the requests only wait.)
  const Result r = cli("run --preset mini --device cpu --requests 8 --prompt 200 --gen 16 --cache-memory 1800K");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r, "cache full: ")) << r.out;
  EXPECT_TRUE(has(r, " preemptions, ")) << r.out;
  EXPECT_FALSE(has(r, "; 0 preemptions")) << r.out;
  EXPECT_TRUE(has(r, "finished 8 requests, 0 rejected")) << r.out;
  const Result tiny = cli("run --preset mini --device cpu --requests 2 --prompt 20 --gen 2 --cache-memory 100K");
  expect_user_error(tiny, "every request was rejected (2 rejected; the first: request 0: position 0 needs ");
  EXPECT_TRUE(has(tiny, "bytes of cache, beyond the limit of 102400 (one token a step, the caches to itself): it "
                        "cannot fit")) << tiny.out;
  EXPECT_TRUE(has(tiny, "steps 0,")) << tiny.out;  // rejected before any work
}

// An option the run cannot use (--gpu-memory on the CPU, --index-keys in the
// exact profile) changes nothing: the run goes on and says so.
TEST(Cli, AnOptionTheRunCannotUseIsNoted) {
  const std::string run = "run --preset mini --device cpu --requests 1 --prompt 8 --gen 1";
  const Result noted = cli(run + " --gpu-memory 0.5");
  EXPECT_EQ(noted.status, 0) << noted.out;
  EXPECT_TRUE(has(noted, "note: --gpu-memory is for --device cuda; this run is on the CPU")) << noted.out;
  const Result keys = cli(run + " --profile exact --index-keys fp8");
  EXPECT_EQ(keys.status, 0) << keys.out;
  EXPECT_TRUE(has(keys, "note: --index-keys is for production numerics")) << keys.out;
  const Result quiet = cli(run + " --cache-memory 64M");
  EXPECT_EQ(quiet.status, 0) << quiet.out;
  EXPECT_FALSE(has(quiet, "note:")) << quiet.out;
}

// The CPU backend's float32 weight copies (4 bytes an element) are memory the
// run holds: the memory line counts them, and drops them with the copies.
TEST(Cli, TheMemoryLineCountsTheFloat32WeightCopies) {
  const std::string run = "run --preset mini --device cpu --requests 1 --prompt 8 --gen 1";
  const Result copies = cli(run);
  EXPECT_EQ(copies.status, 0) << copies.out;
  EXPECT_TRUE(has(copies, " MiB of float32 copies, caches ")) << copies.out;
  const Result capped = cli(run + " --cache-memory 10M");
  EXPECT_TRUE(has(capped, ", caches 0.0 MiB (pages in use capped at 10.0 MiB), workspace ")) << capped.out;
  const Result none = cli(run + " --weight-cache-gib 0");
  EXPECT_EQ(none.status, 0) << none.out;
  EXPECT_TRUE(has(none, "host memory: weights ")) << none.out;
  EXPECT_FALSE(has(none, "float32 copies,")) << none.out;
}

TEST(Cli, NonFiniteWeightsAreReportedAndNonFiniteRunsFail) {
  dsv4::test::TempDir dir;
  make_checkpoint(dir / "ckpt", "mini-fp8", [](std::vector<OwnedTensor>& ts) {
    poison(ts, "layers.1.attn.kv_norm.weight");
    poison(ts, "layers.2.attn.compressor.ape");
  });
  const Result inspect = cli("inspect " + (dir / "ckpt").string());
  expect_user_error(inspect, "2 tensors hold NaN or Inf values (listed above)");
  EXPECT_TRUE(has(inspect, "layers.1.attn.kv_norm.weight")) << inspect.out;
  EXPECT_TRUE(has(inspect, "1 of 512 values (first at index 3: nan)")) << inspect.out;
  EXPECT_TRUE(has(inspect, "layers.2.attn.compressor.ape")) << inspect.out;
  const Result run = cli("run --checkpoint " + (dir / "ckpt").string() + " --requests 2 --prompt 40 --gen 2");
  expect_user_error(run, "the outputs went non-finite: ");
  EXPECT_TRUE(has(run, "values of the hidden state were NaN or Inf")) << run.out;
  // Clean weights: inspect says so.
  make_checkpoint(dir / "clean", "mini-fp8");
  const Result clean = cli("inspect " + (dir / "clean").string());
  EXPECT_EQ(clean.status, 0) << clean.out;
  EXPECT_TRUE(has(clean, "every value of every layer's tensors is finite")) << clean.out;
}

TEST(Cli, ExactProfileRunsOddWidthsAndProductionSaysWhy) {
  dsv4::test::TempDir dir;
  std::ifstream in(std::string(DSV4_GOLDEN_DIR) + "/mini.json");
  nlohmann::json config = nlohmann::json::parse(in).at("config");
  config["hidden_size"] = 320;
  config["q_lora_rank"] = 160;
  config["o_lora_rank"] = 80;
  std::ofstream(dir / "config.json") << config.dump();
  const std::string args = "run --config " + (dir / "config.json").string() + " --requests 2 --prompt 100 --gen 2";
  const Result exact = cli(args + " --profile exact");
  EXPECT_EQ(exact.status, 0) << exact.out;
  EXPECT_TRUE(has(exact, "hidden 320")) << exact.out;
  EXPECT_TRUE(has(exact, "finished 2 requests, 0 rejected")) << exact.out;
  EXPECT_TRUE(has(exact, ", 0 non-finite values")) << exact.out;
  expect_user_error(cli(args), "hidden_size = 320 is not a multiple of 128, which the production profile needs");
}

TEST(Cli, InspectNamesWhatAPathIs) {
  dsv4::test::TempDir dir;
  make_checkpoint(dir / "ckpt", "mini-fp8");
  const nlohmann::json index = {{"weight_map", {{"layers.0.attn.attn_sink", "shard.safetensors"}}}};
  std::ofstream(dir / "ckpt" / "model.safetensors.index.json") << index.dump();
  fs::create_directory(dir / "ckpt" / "shard.safetensors");
  expect_user_error(cli("inspect " + (dir / "ckpt").string()), "shard 'shard.safetensors' (holding "
                                                                 "'layers.0.attn.attn_sink') is a directory");
  fs::remove(dir / "ckpt" / "shard.safetensors");
  ASSERT_EQ(mkfifo((dir / "ckpt" / "shard.safetensors").c_str(), 0600), 0);
  expect_user_error(cli("inspect " + (dir / "ckpt").string()), "is a FIFO");
  ASSERT_EQ(mkfifo((dir / "pipe.safetensors").c_str(), 0600), 0);
  expect_user_error(cli("inspect " + (dir / "pipe.safetensors").string()), "is a FIFO (named pipe), not a regular file");
}

// ---- verify: structural errors and verdicts ----------------------------------------------------

// Case "x" in `dir`: the mini golden with its JSON and request files as given.
void copy_mini(const fs::path& dir, const std::function<void(nlohmann::json&)>& edit_json,
               const std::function<void(int, std::vector<OwnedTensor>&)>& edit_tensors) {
  std::ifstream in(std::string(DSV4_GOLDEN_DIR) + "/mini.json");
  nlohmann::json j = nlohmann::json::parse(in);
  edit_json(j);
  std::ofstream(dir / "x.json") << j.dump();
  fs::copy_file(fs::path(DSV4_GOLDEN_DIR) / "mini.weights.safetensors", dir / "x.weights.safetensors");
  for (int r = 0; r < 4; ++r) {
    const std::string suffix = ".r" + std::to_string(r) + ".safetensors";
    const auto f = dsv4::SafetensorsFile::open(fs::path(DSV4_GOLDEN_DIR) / ("mini" + suffix));
    std::vector<OwnedTensor> ts;
    for (const auto& t : f->tensors()) ts.push_back({t.name, t.dtype, t.shape, {t.bytes.begin(), t.bytes.end()}});
    if (edit_tensors) edit_tensors(r, ts);
    std::vector<dsv4::TensorData> out;
    for (const auto& t : ts) out.push_back({t.name, t.dtype, t.shape, t.bytes});
    dsv4::write_safetensors(dir / ("x" + suffix), out);
  }
}

TEST(Cli, VerifyMalformedCasesAreErrorsNotCrashes) {
  dsv4::test::TempDir a, b, c;
  copy_mini(a.path(), [](nlohmann::json& j) { j["requests"][1]["calls"] = nlohmann::json::array(); });
  expect_user_error(cli("verify " + a.path().string() + " x --profile exact"), "x.json: requests[1].calls is empty");
  copy_mini(b.path(), [](nlohmann::json& j) { j["requests"][2]["calls"][8]["len"] = 4; });
  expect_user_error(cli("verify " + b.path().string() + " x --profile exact"),
                    "x.r2.safetensors: request 2, call 8: tensor 'input.r2.c8' has shape [1, 256]; expected [4, 256]");
  copy_mini(c.path(), [](nlohmann::json& j) { j["requests"][0]["calls"][0]["len"] = "520"; });
  expect_user_error(cli("verify " + c.path().string() + " x --profile exact"),
                    "requests[0].calls[0]: field 'len' has the wrong type: expected an integer, got string");
}

TEST(Cli, VerifyFailsOnNaNAndShowsAbsentTensorsAsAbsent) {
  dsv4::test::TempDir nan_case, absent;
  copy_mini(nan_case.path(), [](nlohmann::json&) {}, [](int r, std::vector<OwnedTensor>& ts) {
    if (r == 3) poison(ts, "output.r3.c7.l1");
  });
  const Result r = cli("verify " + nan_case.path().string() + " x --profile exact -v");
  expect_user_error(r, "FAIL: 1 values were not finite");
  EXPECT_TRUE(has(r, "non-finite")) << r.out;
  EXPECT_TRUE(has(r, "1 values were not finite (NaN or Inf)")) << r.out;
  EXPECT_TRUE(has(r, "r3   c7    l1    c4a           nan")) << r.out;
  copy_mini(absent.path(), [](nlohmann::json&) {}, [](int, std::vector<OwnedTensor>& ts) {
    std::erase_if(ts, [](const OwnedTensor& t) { return t.name.starts_with("compressed."); });
  });
  const Result ok = cli("verify " + absent.path().string() + " x --profile exact -v");
  EXPECT_EQ(ok.status, 0) << ok.out;
  EXPECT_TRUE(has(ok, "PASS")) << ok.out;
  EXPECT_FALSE(has(ok, "inf")) << ok.out;
  // r0 c0 l1 (C4A): compressed absent ("-"), index_keys compared.
  const size_t row = ok.out.find("r0   c0    l1    c4a");
  ASSERT_NE(row, std::string::npos) << ok.out;
  const std::string line = ok.out.substr(row, ok.out.find('\n', row) - row);
  EXPECT_NE(line.find("          - "), std::string::npos) << line;
}

// ---- the process name after the runtime re-exec --------------------------------------------------

TEST(Cli, KeepsItsNameAfterReexecutingItself) {
  // The re-exec happens when OMP_WAIT_POLICY is unset: start dsv4 without it,
  // wait until the new image runs (its initial environment then holds
  // DSV4_RUNTIME_ENV=1), and read the name ps shows.
  const std::string bin = std::string(DSV4_BINARY_DIR) + "/dsv4";
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    unsetenv("OMP_WAIT_POLICY");
    unsetenv("DSV4_RUNTIME_ENV");
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, 1), dup2(null, 2);
    execl(bin.c_str(), "dsv4", "run", "--requests", "64", "--prompt", "4096", "--gen", "64", (char*)nullptr);
    _exit(127);
  }
  auto read = [&](const char* what) {
    std::ifstream f("/proc/" + std::to_string(pid) + "/" + what, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  };
  bool reexecuted = false;
  for (int i = 0; i < 600 && !reexecuted; ++i) {  // up to a minute
    reexecuted = read("environ").find("DSV4_RUNTIME_ENV=1") != std::string::npos;
    if (!reexecuted) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const std::string comm = read("comm"), cmdline = read("cmdline");
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(reexecuted) << "dsv4 did not re-execute itself";
  EXPECT_EQ(comm, "dsv4\n");
  EXPECT_EQ(cmdline.substr(0, cmdline.find('\0')), "dsv4") << "argv[0] passes through";
}

// The dsv4 binary end to end: inspect, verify and run, and their errors.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace {

struct Result {
  int status;
  std::string out;
};

Result dsv4(const std::string& args) {
  const std::string cmd = std::string(DSV4_BINARY_DIR) + "/dsv4 " + args + " 2>&1";
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

}  // namespace

TEST(Cli, InspectDefaultIsFlash) {
  const Result r = dsv4("inspect");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r, "layers: 43  (swaonly 2, c4a 21, c128a 20)")) << r.out;
  EXPECT_TRUE(has(r, "3.51 KB/token with MXFP4 indexer keys, 3.85 KB/token with FP8 keys")) << r.out;
  EXPECT_TRUE(has(r, "dense MLA")) << r.out;
}

TEST(Cli, InspectGoldenFp8Checkpoint) {
  const Result r = dsv4(std::string("inspect ") + DSV4_GOLDEN_DIR + "/mini-fp8.weights.safetensors");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r, "layers: 3  (swaonly 1, c4a 1, c128a 1)")) << r.out;
  EXPECT_TRUE(has(r, "wq_b.weight")) << r.out;
  EXPECT_TRUE(has(r, "F8_E4M3")) << r.out;
  EXPECT_TRUE(has(r, "indexer.compressor.ape")) << r.out;
  EXPECT_TRUE(has(r, "all 3 layers load")) << r.out;
}

TEST(Cli, InspectErrorsNameTheProblem) {
  Result r = dsv4("inspect /no/such/path");
  EXPECT_EQ(r.status, 1);
  EXPECT_TRUE(has(r, "no such file or directory: '/no/such/path'")) << r.out;
  r = dsv4(std::string("inspect ") + DSV4_GOLDEN_DIR + "/mini.r0.safetensors");
  EXPECT_EQ(r.status, 1);
  EXPECT_TRUE(has(r, "no config found")) << r.out;
}

TEST(Cli, VerifyPassesAndFails) {
  Result r = dsv4(std::string("verify ") + DSV4_GOLDEN_DIR + " mini --profile exact");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r, "PASS")) << r.out;
  r = dsv4(std::string("verify ") + DSV4_GOLDEN_DIR + " mini-fp8 --profile exact");
  EXPECT_EQ(r.status, 1) << r.out;  // exact numerics are ~6e-2 from the production golden
  EXPECT_TRUE(has(r, "FAIL")) << r.out;
}

TEST(Cli, RunSmallWorkloadWithJson) {
  const std::string json = std::string(DSV4_BINARY_DIR) + "/cli_test_run.json";
  const Result r = dsv4("run --preset mini --requests 3 --prompt 300 --gen 4 --budget 128 --json " + json);
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r, "finished 3 requests, 0 rejected runs")) << r.out;
  EXPECT_TRUE(has(r, "tokens/s")) << r.out;
  FILE* f = fopen(json.c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::string text(4096, '\0');
  text.resize(fread(text.data(), 1, text.size(), f));
  fclose(f);
  EXPECT_NE(text.find("\"decode\""), std::string::npos);
  EXPECT_NE(text.find("\"peak_cache_bytes\""), std::string::npos);
  EXPECT_NE(text.find("\"c4a_state\""), std::string::npos);  // per cache group
  EXPECT_TRUE(has(r, "by cache: compressed entries + indexer keys")) << r.out;
}

TEST(Cli, RunRejectsBadArguments) {
  Result r = dsv4("run --preset nope");
  EXPECT_NE(r.status, 0);
  r = dsv4("run --profile fast");
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
  const Result r = dsv4("run --checkpoint " + dir.string() + " --requests 2 --prompt 200 --gen 3");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r, "3 layers (swaonly 1, c4a 1, c128a 1)")) << r.out;
  EXPECT_TRUE(has(r, "finished 2 requests")) << r.out;
  // Without a config next to it, the error says what to do.
  fs::remove(dir / "config.json");
  const Result bad = dsv4("run --checkpoint " + dir.string());
  EXPECT_EQ(bad.status, 1);
  EXPECT_TRUE(has(bad, "no config.json")) << bad.out;
  fs::remove_all(dir);
}

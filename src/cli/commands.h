#pragma once
// Subcommands of the dsv4 CLI; each registers itself on the app.
#include <CLI/CLI.hpp>

namespace dsv4::cli {

// Re-executes the process with OpenMP/OpenBLAS settings (see runtime_env.cpp).
void reexec_with_runtime_env(char** argv);

void register_inspect(CLI::App& app);
void register_verify(CLI::App& app);
void register_run(CLI::App& app);

}  // namespace dsv4::cli

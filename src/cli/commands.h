#pragma once
// Subcommands of the dsv4 CLI; each registers itself on the app.
#include <CLI/CLI.hpp>

namespace dsv4::cli {

void register_inspect(CLI::App& app);
void register_verify(CLI::App& app);

}  // namespace dsv4::cli

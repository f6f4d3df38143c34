// Each CLI command lives in its own file and registers itself here at static-initialisation time,
// so adding a command never edits main.cpp.
#pragma once

#include <functional>
#include <vector>

#include <CLI/CLI.hpp>

namespace kiln::cli {

using CommandInstaller = std::function<void(CLI::App& app)>;

std::vector<CommandInstaller>& command_installers();

struct RegisterCommand {
  explicit RegisterCommand(CommandInstaller installer) { command_installers().push_back(std::move(installer)); }
};

}  // namespace kiln::cli

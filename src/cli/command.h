// Each CLI command lives in its own file and registers itself here at static-initialisation time,
// so adding a command never edits main.cpp.
#pragma once

#include <functional>
#include <vector>

#include <CLI/CLI.hpp>

namespace kiln::cli {

using CommandInstaller = std::function<void(CLI::App& app)>;

std::vector<CommandInstaller>& command_installers();

// Thrown by a command that has printed its result and must end with a status other than 0 or the
// error status 1 (kiln fit: 2 when the model does not fit).
struct CommandExit {
  int status;
};

struct RegisterCommand {
  explicit RegisterCommand(CommandInstaller installer) { command_installers().push_back(std::move(installer)); }
};

}  // namespace kiln::cli

// kiln: the command line. Every error ends the process with one line on stderr and exit code 1;
// a command may end with another status it documents (kiln fit).
#include <cstdio>
#include <exception>
#include <string>

#include <fmt/format.h>

#include "cli/command.h"
#include "core/error.h"

namespace kiln::cli {
std::vector<CommandInstaller>& command_installers() {
  static std::vector<CommandInstaller> installers;
  return installers;
}
}  // namespace kiln::cli

int main(int argc, char** argv) {
  CLI::App app{"kiln: run open-weight language models on NVIDIA GPUs and CPUs"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kiln 0.1.0");
  // Every --help shows each option's default (subcommands inherit this from the app).
  app.option_defaults()->always_capture_default();
  for (auto& install : kiln::cli::command_installers()) install(app);
  std::string commands;
  bool known = false;
  for (const CLI::App* command : app.get_subcommands({})) {
    commands += (commands.empty() ? "" : ", ") + command->get_name();
    known = known || (argc > 1 && command->get_name() == argv[1]);
  }
  if (argc > 1 && argv[1][0] != '-' && !known) {
    fmt::print(stderr, "kiln: unknown command '{}' (commands: {})\n", argv[1], commands);
    return 1;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    if (error.get_exit_code() == 0) return app.exit(error);
    fmt::print(stderr, "kiln: {}\n", error.what());
    return 1;
  } catch (const kiln::cli::CommandExit& exit) {
    return exit.status;
  } catch (const kiln::Error& error) {
    fmt::print(stderr, "kiln: error: {}\n", error.what());
    return 1;
  } catch (const std::exception& error) {
    fmt::print(stderr, "kiln: error: {}\n", error.what());
    return 1;
  }
  return 0;
}

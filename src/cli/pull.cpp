// kiln pull ORG/NAME[@REVISION]: fetches a model from the Hugging Face hub into its cache (HF_HUB_CACHE,
// shared with huggingface_hub and transformers), only the files kiln reads, resuming what an
// earlier pull left, and prints its snapshot folder on stdout (for `--model "$(kiln pull …)"`).
// Progress and a summary go to stderr. Every command's --model takes the same id and pulls it when
// the cache lacks it; `kiln pull` also asks the hub whether the revision has moved on.
#include <cstdio>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "cli/command.h"
#include "cli/hub_progress.h"
#include "core/error.h"
#include "io/hub_cache.h"
#include "io/hub_download.h"

namespace kiln::cli {
namespace {

void pull(const std::string& name) {
  const std::optional<HubModelId> id = parse_hub_model_id(name);
  if (!id) fail("pull: '{}' is not a Hugging Face hub id (ORG/NAME or ORG/NAME@REVISION)", name);
  const HubSettings settings = HubSettings::from_environment();
  if (!settings.offline)
    fmt::print(stderr, "kiln: pulling {} from {} into {}\n", id->to_string(), settings.endpoint,
               settings.cache.string());
  const PulledModel pulled = pull_model(*id, settings, stderr_pull_listener());
  fmt::print(stderr, "kiln: {} is commit {}: {} files, {} of them fetched now ({}){}\n", id->to_string(),
             pulled.commit, pulled.files, pulled.fetched_files, human_bytes(pulled.fetched_bytes),
             settings.offline ? " (HF_HUB_OFFLINE: from the cache only)" : "");
  fmt::print("{}\n", pulled.snapshot.string());
}

const RegisterCommand kRegisterPull([](CLI::App& app) {
  auto name = std::make_shared<std::string>();
  CLI::App* command = app.add_subcommand(
      "pull", "Fetch a model from the Hugging Face hub into its cache (HF_HUB_CACHE) and print its folder");
  command->add_option("model", *name, "ORG/NAME or ORG/NAME@REVISION (a branch, tag or commit)")->required();
  command->callback([name] { pull(*name); });
});

}  // namespace
}  // namespace kiln::cli

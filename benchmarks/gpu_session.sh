#!/usr/bin/env bash
# One call on the GPU machine (device tool): build against its torch, run the
# whole test suite, then the benchmark. Logs go to $OUT (default ./gpu-logs).
#   bash benchmarks/gpu_session.sh tests          # build + tests
#   bash benchmarks/gpu_session.sh full           # build + tests + full benchmark
#   bash benchmarks/gpu_session.sh bench          # build + full benchmark
#   bash benchmarks/gpu_session.sh rule           # build + the step rule's CUDA tests + bench_rule.py
#   bash benchmarks/gpu_session.sh engine         # build + the engine's and the kernels' CUDA tests + bench_rule.py
#   bash benchmarks/gpu_session.sh networks       # build + the network programs' CUDA tests + bench_networks.py
#   bash benchmarks/gpu_session.sh portable       # a build of compute_80 PTX alone (JIT-compiled by the driver):
#                                                 # the portable path's CUDA tests, compute-sanitizer, bench_rule.py
set -uo pipefail
mode=${1:-full}
out=${OUT:-gpu-logs}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
# The portable path on a Hopper GPU: no 9.0 code at all, so the driver runs
# the compute_80 PTX and the plan takes the kernels of 8.x GPUs.
[ "$mode" = portable ] && export TORCH_CUDA_ARCH_LIST=8.0+PTX
# expecttest is not on that machine's image: install the carried wheel.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The image's default g++ wrapper links libstdc++ statically into extensions,
# which crashes inside libtorch's exception formatting: build with the system one.
for cxx in /usr/bin/g++ /usr/bin/g++-13 /usr/bin/g++-12; do
  if [ -x "$cxx" ]; then export CXX=$cxx CC=${cxx/g++/gcc}; break; fi
done
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; echo "CXX=${CXX:-default} $(${CXX:-g++} --version | head -1)"
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } | tee "$out/env.log"
python3 setup.py build_ext --inplace > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
grep -E "registers|spill" "$out/build.log" | sort | uniq -c | head -20
echo "std:: symbols defined in _C: $(nm -C --defined-only ddpm_ops/_C*.so | grep -c ' std::')"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# pytest under a time limit (the device tool's call ends at 10 minutes),
# one line per test in the log, so that a run cut short still names its
# failures: $1 the limit in seconds, $2 the log, the rest pytest's arguments.
limited_pytest() {
  local limit=$1 log=$2; shift 2
  timeout "$limit" python3 -m pytest -v -n "${PYTEST_WORKERS:-15}" "$@" ${PYTEST_ARGS:-} > "$log" 2>&1
  echo "pytest: exit $? ($(grep -c ' PASSED' "$log") passed, $(grep -c ' FAILED' "$log") failed, $(grep -c ' SKIPPED' "$log") skipped)"
  grep -E ' (FAILED|ERROR) ' "$log" | sed 's/.* \(FAILED\|ERROR\) /\1 /' | sort -u | head -40
}
if [ "$mode" = engine ]; then
  limited_pytest 300 "$out/tests_engine.log" tests/test_cuda_engine.py tests/test_cuda_rule_kernel.py \
    tests/test_cuda_kernel.py tests/test_cuda_plan.py tests/test_sample.py tests/test_cuda_networks.py
  compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/sanitize_kernels.py > "$out/sanitize_memcheck.log" 2>&1
  echo "compute-sanitizer memcheck: exit $? $(grep 'ERROR SUMMARY' "$out/sanitize_memcheck.log" | tail -1)"
  python3 benchmarks/bench_rule.py --device cuda 2>&1 | tee "$out/bench_rule.log"
  exit 0
fi
if [ "$mode" = networks ]; then
  limited_pytest 240 "$out/tests_networks.log" tests/test_cuda_networks.py tests/test_network_modules.py \
    tests/test_networks.py
  python3 benchmarks/bench_networks.py --device cuda 2>&1 | tee "$out/bench_networks.log"
  exit 0
fi
if [ "$mode" = portable ]; then
  # The driver JIT-compiles the PTX once per kernel (minutes for the whole
  # module, measured over 100 s on an H200): one process fills its cache
  # before the test workers and the sanitizer each load the module.
  export CUDA_CACHE_MAXSIZE=4294967296
  timeout 900 python3 tools/sanitize_kernels.py --kernels tiled16 tiled64 rule 2>&1 | tee "$out/jit_warmup.log"
  # The Hopper-only kernels' tests force kernels this build does not hold.
  limited_pytest 240 "$out/tests_portable.log" tests/test_cuda_engine.py tests/test_sample.py \
    tests/test_modules.py tests/test_threads.py -k "not resident and not kernels_per_call"
  for tool in memcheck racecheck synccheck; do
    compute-sanitizer --tool $tool --error-exitcode 9 python3 tools/sanitize_kernels.py --kernels tiled16 tiled64 rule > "$out/sanitize_$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize_$tool.log" | tail -1)"
  done
  python3 benchmarks/bench_rule.py --device cuda --capability 8.0 2>&1 | tee "$out/bench_portable.log"
  exit 0
fi
if [ "$mode" = rule ]; then
  limited_pytest 300 "$out/tests_rule.log" tests/test_cuda_rule_kernel.py tests/test_sample.py \
    tests/test_rewrite_projects.py -k "cuda"
  python3 benchmarks/bench_rule.py --device cuda 2>&1 | tee "$out/bench_rule.log"
  exit 0
fi
if [ "$mode" != bench ]; then
  # PYTEST_WORKERS, PYTEST_ARGS (e.g. --ignore of the files that need packages the image lacks).
  limited_pytest 420 "$out/tests.log" tests
fi
if [ "$mode" != tests ]; then
  python3 benchmarks/bench.py --json "$out/bench.json" 2>&1 | tee "$out/bench.log"
fi

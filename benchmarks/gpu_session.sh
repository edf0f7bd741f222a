#!/usr/bin/env bash
# One call on the GPU machine (device tool): build against its torch, then
# each named mode in turn. Logs go to $OUT (default ./gpu-logs).
#   bash benchmarks/gpu_session.sh MODE [MODE ...]
#     tests      the whole test suite
#     bench      the full benchmark (bench.py)
#     full       tests, then bench
#     rule       the step rule's CUDA tests + bench_rule.py
#     engine     the engine's and the kernels' CUDA tests, compute-sanitizer memcheck, bench_rule.py
#     networks   the network programs' CUDA tests + bench_networks.py
#     clusters   fp32_rule's CUDA tests (alone and in clusters) + sweep_rule.py
#     sanitize   compute-sanitizer racecheck and synccheck of the engine's kernels
#     portable   a build of compute_80 PTX alone (JIT-compiled by the driver): the
#                portable path's CUDA tests, compute-sanitizer, bench_rule.py (alone in its call)
# DDPM_OPS_LIBRARY=path/_C*.so uses a library built elsewhere against the same
# torch and CUDA (it holds no Python symbols: any Python version) instead of
# building; for portable, one built with TORCH_CUDA_ARCH_LIST=8.0+PTX.
set -uo pipefail
modes=("${@:-full}")
out=${OUT:-gpu-logs}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
# The portable path on a Hopper GPU: no 9.0 code at all, so the driver runs
# the compute_80 PTX and the plan takes the kernels of 8.x GPUs.
[ "${modes[*]}" = portable ] && export TORCH_CUDA_ARCH_LIST=8.0+PTX
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
if [ -n "${DDPM_OPS_LIBRARY:-}" ]; then
  # A library built elsewhere against this very torch (the machine's device
  # time then goes to tests and benchmarks): it is loaded as the build's would be.
  rm -f ddpm_ops/_C*.so && cp "$DDPM_OPS_LIBRARY" ddpm_ops/ || exit 1
  echo "library: $DDPM_OPS_LIBRARY (built elsewhere)"
else
  python3 setup.py build_ext --inplace > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
  grep -E "registers|spill" "$out/build.log" | sort | uniq -c | head -20
fi
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
engine_kernels="tiled16 tiled64 rule rule@2 rule@16"
run_mode() {
  case "$1" in
  engine)
    limited_pytest 300 "$out/tests_engine.log" tests/test_cuda_engine.py tests/test_cuda_rule_kernel.py \
      tests/test_cuda_kernel.py tests/test_cuda_plan.py tests/test_sample.py tests/test_cuda_networks.py
    sanitize memcheck
    python3 benchmarks/bench_rule.py --device cuda 2>&1 | tee "$out/bench_rule.log" ;;
  networks)
    limited_pytest 240 "$out/tests_networks.log" tests/test_cuda_networks.py tests/test_network_modules.py \
      tests/test_networks.py
    python3 benchmarks/bench_networks.py --device cuda 2>&1 | tee "$out/bench_networks.log" ;;
  clusters)
    limited_pytest 240 "$out/tests_clusters.log" tests/test_cuda_networks.py tests/test_cuda_rule_kernel.py \
      tests/test_networks.py
    timeout 200 python3 benchmarks/sweep_rule.py ${SWEEP_ARGS:-} 2>&1 | tee "$out/sweep_rule.log" ;;
  sanitize)
    sanitize racecheck --kernels $engine_kernels
    sanitize synccheck --kernels $engine_kernels ;;
  portable)
    # The driver JIT-compiles the PTX once per kernel (minutes for the whole
    # module, measured over 100 s on an H200): one process fills its cache
    # before the test workers and the sanitizer each load the module.
    export CUDA_CACHE_MAXSIZE=4294967296
    timeout 900 python3 tools/sanitize_kernels.py --kernels $engine_kernels 2>&1 | tee "$out/jit_warmup.log"
    # The Hopper-only kernels' tests force kernels this build does not hold.
    limited_pytest 240 "$out/tests_portable.log" tests/test_cuda_engine.py tests/test_sample.py \
      tests/test_modules.py tests/test_threads.py -k "not resident and not kernels_per_call"
    for tool in memcheck racecheck synccheck; do sanitize $tool --kernels $engine_kernels; done
    python3 benchmarks/bench_rule.py --device cuda --capability 8.0 2>&1 | tee "$out/bench_portable.log" ;;
  rule)
    limited_pytest 300 "$out/tests_rule.log" tests/test_cuda_rule_kernel.py tests/test_sample.py \
      tests/test_rewrite_projects.py -k "cuda"
    python3 benchmarks/bench_rule.py --device cuda 2>&1 | tee "$out/bench_rule.log" ;;
  tests)
    # PYTEST_WORKERS, PYTEST_ARGS (e.g. --ignore of the files that need packages the image lacks).
    limited_pytest 420 "$out/tests.log" tests ;;
  bench)
    python3 benchmarks/bench.py --json "$out/bench.json" 2>&1 | tee "$out/bench.log" ;;
  full)
    run_mode tests; run_mode bench ;;
  *)
    echo "unknown mode $1" >&2; exit 2 ;;
  esac
}
# compute-sanitizer's $1 tool over tools/sanitize_kernels.py, the rest its arguments,
# within SANITIZE_LIMIT seconds (default 300).
sanitize() {
  local tool=$1; shift
  timeout "${SANITIZE_LIMIT:-300}" compute-sanitizer --tool "$tool" --error-exitcode 9 python3 tools/sanitize_kernels.py "$@" \
    > "$out/sanitize_$tool.log" 2>&1
  echo "compute-sanitizer $tool: exit $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize_$tool.log" | tail -1)"
}
for mode in "${modes[@]}"; do run_mode "$mode"; done

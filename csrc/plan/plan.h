// Which CUDA kernel runs a call of ddpm::fused_sample, and in which shape: one
// pure function of plain data (the problem, the device, the overrides), so
// that the rule is written once and tested without a GPU. Plain C++: built
// into every extension, CPU-only ones included (the debug op ddpm::cuda_plan,
// plan_op.cpp, and ddpm_ops/cuda_plan.py expose it).
#pragma once

#include "../common/sizes.h"
#include "shapes/fp32_rule.h"
#include "shapes/fp32_smem.h"
#include "shapes/tf32x3_tiled.h"

#include <cstdint>
#include <functional>
#include <string>

namespace ddpm_ops {
namespace plan {

constexpr int kMaxClusterSize = 16;  // non-portable beyond 8

enum class Precision { kFloat32, kTF32, kBFloat16 };

// The kernels, each in csrc/cuda/kernels/<name>.cuh (kernel_name()), their
// shapes in shapes/. The engine's (fp32_resident, tf32x3_tiled, fp32_rule)
// run the general step of both overloads; the others the time-column
// overload alone.
enum class Kernel {
  kFp32Resident,
  kFp32Smem,
  kTf32x3Tiled,
  kBf16Wgmma,
  kBf16x3WgmmaM64,
  kBf16x3WgmmaSwapab,
  kFp32Rule
};

struct LayerShape {
  int in = 0;
  int out = 0;
  bool aligned = false;  // the weight's storage starts on a 16-byte boundary
};

struct Problem {
  int64_t batch = 0;
  int dim = 0;
  int num_steps = 0;
  int num_layers = 0;  // at most kMaxLayers
  LayerShape layers[kMaxLayers];
  Precision precision = Precision::kFloat32;
  // The call is the general step (fused_sample.rule): only the engine's
  // kernels run it. Layer 0 then reads x alone (in = dim), where the
  // time-column overload's reads [x, t / T] (in = dim + 1).
  bool general_step = false;
  // Its bias networks, which the engine's kernels evaluate in shared memory
  // (their widest hidden layer, 0 for networks of one Linear).
  bool time_net = false;
  bool cond_net = false;
  int bias_net_hidden = 0;
  // The rule has a P table: kernels keep each row's previous x0.
  bool previous_x0 = false;
  // A network program (fused_sample.rule's `network`): fp32_rule alone runs
  // it, with program_saved more activation buffers (its residual stack's
  // depth) and, for an "input:" instruction, the concatenated input's width.
  bool program = false;
  int program_saved = 0;
  int program_input = 0;
};

// What the plan needs of the GPU and of the build. The CUDA side fills it
// from the runtime (fused_sample_cuda.cu: device_info); ddpm_ops/cuda_plan.py
// has the H200's.
struct Device {
  int sm_count = 0;
  int max_smem = 0;  // opt-in dynamic shared memory per block
  // Co-resident clusters of each size (one CTA per SM), 0 where that size
  // does not launch. Clusters must fit in one GPC, so this is not simply
  // sm_count / size (H200: 15 clusters of 8, 7 of 16).
  int max_clusters[kMaxClusterSize + 1] = {};
  int cc_major = 0;
  int cc_minor = 0;
  bool sm90a_build = false;   // the extension holds sm_90a code: it was built for 9.0 (setup.py)
  bool tma_encoder = false;   // the driver has cuTensorMapEncodeTiled
  // The Hopper kernels (all but fp32_rule: clusters, distributed shared
  // memory, TMA, wgmma) run here: the GPU is sm_90 and the extension holds
  // their sm_90a code. Any other architecture's code of them is a trap
  // (DDPM_OPS_HOPPER_CODE), which an 8.x GPU, or a 9.0 GPU running a build
  // without 9.0 from compute_8x PTX, would run.
  bool hopper() const { return sm90a_build && cc_major == 9 && cc_minor == 0; }
};

// The DDPM_OPS_CUDA_* switches (tests, benchmarks, diagnostics), parsed in
// one place: docs/kernels.md lists them.
struct Overrides {
  // DDPM_OPS_CUDA_KERNEL: set at all (then only the kernel it names may run
  // outside the last-resort rule between tf32x3_tiled and fp32_smem), and
  // the kernel it names, if any, with tf32x3_tiled's tile rows.
  bool kernel_set = false;
  bool names_kernel = false;
  Kernel kernel = Kernel::kFp32Smem;
  int tiled_rows = 0;
  int cluster_size = 0;  // DDPM_OPS_CUDA_CLUSTER_SIZE (0: the rule's)
  int tile_rows = 0;     // DDPM_OPS_CUDA_TILE_ROWS: bf16x3_wgmma_swapab's tile rows (0: the rule's)
  bool tma = true;       // DDPM_OPS_CUDA_TMA=0: tf32x3_tiled copies weight chunks with cp.async only
  bool log = false;      // DDPM_OPS_CUDA_LOG: each launch's plan on stderr
  // DDPM_OPS_CUDA_CAPABILITY=8.0 (major.minor): plan as for a GPU of that
  // compute capability (described_as), so that the portable path runs on
  // a Hopper GPU in tests and benchmarks. 0: the device's own.
  int capability_major = 0, capability_minor = 0;
};

// lookup(name): the variable's value, or null where it is unset.
Overrides parse_overrides(const std::function<const char*(const char*)>& lookup);
// Read per call, not once per process, so that tests and benchmarks can
// switch kernels between calls.
Overrides overrides_from_environment();

struct Plan {
  Kernel kernel = Kernel::kFp32Smem;
  std::string error;      // non-empty: no kernel can run the call (the message)
  int threads = 0;
  int cluster_size = 0;   // CTAs per cluster; 0: a plain launch
  int64_t grid = 0;       // clusters (CTAs for a plain launch)
  int smem = 0;           // dynamic shared memory, bytes
  int rows = 0;           // rows per tile
  int64_t tiles = 0;
  int co_resident = 0;    // device.max_clusters[cluster_size]
  // The instantiation's template parameters (those of its kernel).
  int hidden = 0;         // bf16_wgmma: H; bf16x3: the padded hidden width
  int own = 0;            // bf16x3: hidden columns per CTA
  int buffers = 0;        // bf16x3_wgmma_m64: exchange buffers
  int opw = 0;            // fp32_resident: outputs per warp
                          // (fp32_rule: rows is its rows per block)
  int products = 0;       // tf32x3_tiled: tf32 products per product (3: 3xTF32, 1)
  int warp_rows = 0;      // fp32_smem: rows of a warp's tile
  // The engine's kernels: steps of time rows the kernel evaluates at once
  // (BiasRowArgs::window); 0 where the bias networks' rows do not fit shared
  // memory and the host evaluates them before the launch.
  int bias_window = 0;
  int num_layers = 0;
  // The kernel arguments computed on the host.
  shapes::SmemPlan smem_plan = {};
  shapes::TilePlan tile_plan = {};
  shapes::RuleWeights rule_weights = {};  // fp32_rule: the layers kept on chip
};

Plan choose_plan(const Problem& problem, const Device& device, const Overrides& overrides);

// `device` as a GPU of the capability DDPM_OPS_CUDA_CAPABILITY names: below
// 9.0 without clusters, wgmma or TMA, as such a GPU reports them.
Device described_as(const Device& device, const Overrides& overrides);

const char* kernel_name(Kernel kernel);
// The launch line DDPM_OPS_CUDA_LOG prints (one per call, without newline).
std::string describe(const Plan& plan, const Problem& problem);
// key=value pairs, space-separated, then a newline and describe(): what the
// debug op returns (ddpm_ops/cuda_plan.py parses it).
std::string to_fields(const Plan& plan, const Problem& problem);

}  // namespace plan
}  // namespace ddpm_ops

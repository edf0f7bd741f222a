// choose_plan: the ordered table of candidate kernels, each with the shape it
// would run the call in (candidates.h) and the condition under which the rule
// takes it; the overrides; the plan's description.
#include "plan.h"

#include "candidates.h"
#include "shapes/bf16_wgmma.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ddpm_ops {
namespace plan {
namespace {

using detail::bf16x3_wgmma_m64_shape;

// The rule's thresholds, each measured on an H200 (graph-replayed gpu us;
// BENCHMARKS.md, docs/kernels.md). tf32x3_tiled's and fp32_smem's are with
// their rule (fp32_shapes.cpp: kTiledMinBatch, kStreamedMinBatch).

// From this batch "bf16" takes bf16_wgmma (where it can): below it the exact
// kernels are faster. Seed shape: bf16_wgmma takes about 117 at any batch up
// to 64 x 132 rows; fp32_smem 101 at batch 256, where its 66 co-resident
// clusters of 2 carry 4 rows each and every CTA computes the whole last
// layer, but 160 at 288, with 5 rows each and the last layer exchanged.
constexpr int64_t kWgmmaMinBatch = 265;

// From this batch every precision takes bf16x3_wgmma_m64 (exact fp32 on
// wgmma) where it can hold the net; below it fp32_smem is mostly faster:
// bf16x3_wgmma_m64 takes about 93 at the seed shape at any batch up to 64 x
// 30 rows (one tile per cluster of 4), fp32_smem 75 at batch 128, 101 to 105
// from 160 to 264, 161 from 320 (from batch 265 its clusters carry 5 rows;
// see kWgmmaMinBatch); at dim 12, hidden 256, 5 steps fp32_smem takes 26 at
// batch 128 and 36.4 at 256, bf16x3_wgmma_m64 36.7 at both. So the seed
// shape's batches 160 to 264 would run about 10% faster on it, smaller
// nets' slower.
constexpr int64_t kM64MinBatch = 265;

// From this batch bf16x3_wgmma_swapab runs (where one wave of it holds the
// batch); below it fp32_resident's range (seed shape: up to 120 rows on the
// H200) and fp32_smem's, which it beats from here: seed shape, batch 128:
// 42.5 against fp32_smem's 74.4; dim 12, 5 steps: 20.5 against 25.3.
constexpr int64_t kSwapabMinBatch = 121;

struct Candidate {
  Kernel kernel;
  const char* name;        // kernel_name(): its files' name
  const char* short_name;  // DDPM_OPS_CUDA_KERNEL's older name for it, and its log line's
  bool general_step;       // an engine kernel: runs the general step (both overloads)
  // Whether it can run the call, and in which shape.
  bool (*fits)(const Problem&, const Device&, const Overrides&, Plan*);
  // Whether the rule takes it there (unless DDPM_OPS_CUDA_KERNEL names a
  // kernel: then only that one is tried, wherever it fits).
  bool (*by_default)(const Problem&, const Device&, const Overrides&, const Plan&);
};

// The rule, the first that applies (then tiled_or_smem: tf32x3_tiled or
// fp32_smem):
//   - "bf16" from kWgmmaMinBatch: bf16_wgmma, but where bf16x3_wgmma_m64
//     would run in clusters of 4 (its tiles in one wave of them): there it
//     and bf16x3_wgmma_swapab are exact and faster (seed shape, batch 512:
//     93 and 57 against 120 gpu us);
//   - every precision, wherever it fits (small batches): fp32_resident;
//   - from kSwapabMinBatch: bf16x3_wgmma_swapab (its fit asks for one wave);
//   - from kM64MinBatch: bf16x3_wgmma_m64;
//   - fp32_rule only where DDPM_OPS_CUDA_KERNEL names it: it is the last
//     resort of the general step and of devices the others cannot run on.
// The general step takes the engine's kernels alone.
const Candidate kCandidates[] = {
    {Kernel::kBf16Wgmma, "bf16_wgmma", "wgmma", false,
     [](const Problem& p, const Device& d, const Overrides&, Plan* plan) {
       return p.precision == Precision::kBFloat16 && detail::bf16_wgmma_shape(p, d, plan);
     },
     [](const Problem& p, const Device& d, const Overrides& o, const Plan&) {
       Plan m64;
       return p.batch >= kWgmmaMinBatch && !(bf16x3_wgmma_m64_shape(p, d, o, &m64) && m64.cluster_size == 4);
     }},
    {Kernel::kFp32Resident, "fp32_resident", "resident", true, detail::fp32_resident_shape,
     [](const Problem&, const Device&, const Overrides&, const Plan&) { return true; }},
    {Kernel::kBf16x3WgmmaSwapab, "bf16x3_wgmma_swapab", "narrow", false, detail::bf16x3_wgmma_swapab_shape,
     [](const Problem& p, const Device&, const Overrides&, const Plan&) { return p.batch >= kSwapabMinBatch; }},
    {Kernel::kBf16x3WgmmaM64, "bf16x3_wgmma_m64", "split", false, detail::bf16x3_wgmma_m64_shape,
     [](const Problem& p, const Device&, const Overrides&, const Plan&) { return p.batch >= kM64MinBatch; }},
    {Kernel::kFp32Rule, "fp32_rule", "rule", true, detail::fp32_rule_shape,
     [](const Problem&, const Device&, const Overrides&, const Plan&) { return false; }},
};

struct NamedKernel {
  Kernel kernel;
  const char* name;
  const char* short_name;
};
// Every kernel's names: the candidates' and the last resort's.
const NamedKernel kNames[] = {
    {Kernel::kBf16Wgmma, kCandidates[0].name, kCandidates[0].short_name},
    {Kernel::kFp32Resident, kCandidates[1].name, kCandidates[1].short_name},
    {Kernel::kBf16x3WgmmaSwapab, kCandidates[2].name, kCandidates[2].short_name},
    {Kernel::kBf16x3WgmmaM64, kCandidates[3].name, kCandidates[3].short_name},
    {Kernel::kFp32Rule, kCandidates[4].name, kCandidates[4].short_name},
    {Kernel::kFp32Smem, "fp32_smem", "cluster"},
    {Kernel::kTf32x3Tiled, "tf32x3_tiled", "tiled"},
};

const NamedKernel& named(Kernel kernel) {
  for (const NamedKernel& n : kNames) {
    if (n.kernel == kernel) return n;
  }
  return kNames[0];  // unreachable: every Kernel is in kNames
}

// DDPM_OPS_CUDA_KERNEL's value: a kernel's name or short name, tf32x3_tiled's
// with its tile rows appended (tiled16, tf32x3_tiled32, ...).
void parse_kernel(const char* value, Overrides* o) {
  const std::string v = value;
  for (const NamedKernel& n : kNames) {
    for (const std::string name : {n.name, n.short_name}) {
      if (n.kernel == Kernel::kTf32x3Tiled) {
        for (int rows : {16, 32, 64}) {
          if (v == name + std::to_string(rows)) {
            o->names_kernel = true;
            o->kernel = n.kernel;
            o->tiled_rows = rows;
          }
        }
      } else if (v == name) {
        o->names_kernel = true;
        o->kernel = n.kernel;
      }
    }
  }
}

}  // namespace

const char* kernel_name(Kernel kernel) { return named(kernel).name; }

Overrides parse_overrides(const std::function<const char*(const char*)>& lookup) {
  Overrides o;
  if (const char* kernel = lookup("DDPM_OPS_CUDA_KERNEL")) {
    o.kernel_set = true;
    parse_kernel(kernel, &o);
  }
  if (const char* size = lookup("DDPM_OPS_CUDA_CLUSTER_SIZE")) o.cluster_size = std::atoi(size);
  if (const char* rows = lookup("DDPM_OPS_CUDA_TILE_ROWS")) o.tile_rows = std::atoi(rows);
  if (const char* tma = lookup("DDPM_OPS_CUDA_TMA")) o.tma = std::strcmp(tma, "0") != 0;
  o.log = lookup("DDPM_OPS_CUDA_LOG") != nullptr;
  if (const char* cc = lookup("DDPM_OPS_CUDA_CAPABILITY")) {
    if (std::sscanf(cc, "%d.%d", &o.capability_major, &o.capability_minor) != 2) o.capability_major = 0;
  }
  return o;
}

Device described_as(const Device& device, const Overrides& overrides) {
  Device d = device;
  if (overrides.capability_major <= 0) return d;
  d.cc_major = overrides.capability_major;
  d.cc_minor = overrides.capability_minor;
  if (d.cc_major < 9) {
    for (int& clusters : d.max_clusters) clusters = 0;
    d.sm90a_build = false;
    d.tma_encoder = false;
  }
  return d;
}

Overrides overrides_from_environment() {
  return parse_overrides([](const char* name) { return static_cast<const char*>(std::getenv(name)); });
}

namespace {

// Why the cluster kernels (tf32x3_tiled, fp32_smem) cannot run on the
// device, or "" where they can. Clusters of 1 launch wherever any size does.
std::string no_cluster_kernels(const Device& d) {
  if (d.cc_major != 9 || d.cc_minor != 0) {
    return "the cluster kernels need compute capability 9.0 (H100, H200), this GPU has " +
           std::to_string(d.cc_major) + "." + std::to_string(d.cc_minor);
  }
  if (!d.sm90a_build) return "the extension was built without 9.0 in TORCH_CUDA_ARCH_LIST";
  if (d.max_clusters[1] <= 0) return "this GPU launches no thread-block clusters";
  return "";
}

}  // namespace

Plan choose_plan(const Problem& problem, const Device& device, const Overrides& overrides) {
  Plan plan;
  // The other kernels compute a chain of Linear layers and activations
  // only (no LayerNorm, residual stack or concatenated input), so a program
  // runs on fp32_rule, whatever DDPM_OPS_CUDA_KERNEL names, or, where its
  // block does not fit, nowhere (the error: the host runs the ATen loop).
  if (problem.program) {
    if (!detail::fp32_rule_shape(problem, device, overrides, &plan)) {
      plan = Plan{};
      plan.kernel = Kernel::kFp32Rule;
      plan.error = "ddpm::fused_sample: a row of this network program does not fit fp32_rule's shared memory";
    }
    plan.num_layers = problem.num_layers;
    return plan;
  }
  bool found = false;
  for (const Candidate& c : kCandidates) {
    if (problem.general_step && !c.general_step) continue;
    if (overrides.kernel_set && !(overrides.names_kernel && overrides.kernel == c.kernel)) continue;
    plan = Plan{};
    if (!c.fits(problem, device, overrides, &plan)) continue;
    if (overrides.kernel_set || c.by_default(problem, device, overrides, plan)) {
      found = true;
      break;
    }
  }
  // Then tf32x3_tiled: on Hopper the time-column overload's rule between it
  // and fp32_smem (cluster kernels), elsewhere the engine's tiles.
  const std::string why = problem.general_step ? "" : no_cluster_kernels(device);
  const bool cluster_kernels = !problem.general_step && why.empty();
  if (!found && cluster_kernels) {
    plan = detail::tiled_or_smem(problem, device, overrides);
    found = plan.error.empty();
  }
  const bool tiled_allowed =
      !overrides.kernel_set || (overrides.names_kernel && overrides.kernel == Kernel::kTf32x3Tiled);
  if (!found && !cluster_kernels && tiled_allowed) {
    found = detail::tf32x3_tiled_shape(problem, device, overrides, /*any_batch=*/false, &plan);
  }
  // fp32_rule runs wherever the others do not, and tiles where it does not
  // fit either (the last resort on any GPU).
  if (!found) {
    const std::string error = plan.error;
    plan = Plan{};
    if (!detail::fp32_rule_shape(problem, device, overrides, &plan) &&
        !(tiled_allowed && detail::tf32x3_tiled_shape(problem, device, overrides, /*any_batch=*/true, &plan))) {
      plan = Plan{};
      plan.kernel = Kernel::kFp32Rule;
      plan.error = !error.empty() ? error
                   : why.empty()    ? "ddpm::fused_sample: no CUDA kernel holds a row of this net in shared memory"
                                    : "ddpm::fused_sample: " + why +
                                       ", and no kernel that runs here holds a row of this net in shared memory";
    }
  }
  plan.num_layers = problem.num_layers;
  return plan;
}

namespace {

// printf into a std::string.
template <typename... Args>
std::string format(const char* fmt, Args... args) {
  char buffer[512];
  std::snprintf(buffer, sizeof(buffer), fmt, args...);
  return buffer;
}

}  // namespace

std::string describe(const Plan& plan, const Problem& problem) {
  const int batch = static_cast<int>(problem.batch);
  const char* name = named(plan.kernel).short_name;
  const long long tiles = plan.tiles, grid = plan.grid;
  std::string line = format("ddpm_ops %s kernel: batch %d, ", name, batch);
  switch (plan.kernel) {
    case Kernel::kFp32Resident:
      return line + format("cluster size %d (%d co-resident), %d rows x %lld clusters, %d outputs per warp",
                           plan.cluster_size, plan.co_resident, plan.rows, tiles, plan.opw);
    case Kernel::kFp32Smem: {
      const shapes::SmemPlan& p = plan.smem_plan;
      const bool replicated = p.last_weight_offset >= 0;
      line += format("cluster size %d (%d co-resident), %d rows x %lld clusters, last layer %s, %zu bytes shared "
                     "memory, weights on chip:",
                     plan.cluster_size, plan.co_resident, plan.rows, tiles, replicated ? "whole per CTA" : "sliced",
                     static_cast<size_t>(plan.smem));
      for (int l = 0; l < plan.num_layers; ++l)
        line += format(" %d", p.weight_offset[l] >= 0 || (replicated && l == plan.num_layers - 1));
      return line;
    }
    case Kernel::kTf32x3Tiled: {
      const shapes::TilePlan& p = plan.tile_plan;
      line += format("%d rows x %lld tiles, cluster size %d, last layer %s, %d chunks in flight, %s, %zu bytes "
                     "shared memory, weight chunks by:",
                     plan.rows, tiles, plan.cluster_size,
                     p.partial_last ? "split over its inner dimension" : "split over its columns", p.slots - 1,
                     plan.products == 3 ? "3xTF32" : "tf32", static_cast<size_t>(plan.smem));
      for (int l = 0; l < plan.num_layers; ++l) line += p.tma[l] ? " tma" : " cp.async";
      return line;
    }
    case Kernel::kBf16Wgmma:
      return line + format("%d rows x %lld tiles on %lld CTAs of %d warpgroups, hidden width %d, %d bytes shared "
                           "memory",
                           plan.rows, tiles, grid, shapes::kBf16Warpgroups, plan.hidden, plan.smem);
    case Kernel::kBf16x3WgmmaM64:
      return line + format("%d rows x %lld tiles on %lld clusters of %d, hidden width %d, %d columns per CTA, %d "
                           "bytes shared memory, %d exchange buffers",
                           plan.rows, tiles, grid, plan.cluster_size, plan.hidden, plan.own, plan.smem,
                           plan.buffers);
    case Kernel::kBf16x3WgmmaSwapab:
      return line + format("%d rows x %lld tiles on %lld clusters of %d, hidden width %d, %d columns per CTA, %d "
                           "bytes shared memory",
                           plan.rows, tiles, grid, plan.cluster_size, plan.hidden, plan.own, plan.smem);
    case Kernel::kFp32Rule:
      if (plan.cluster_size > 0) {
        line += format("cluster size %d (%d co-resident), ", plan.cluster_size, plan.co_resident);
      }
      line += format("%d rows x %lld %s of %d threads, %d bytes shared memory, weights on chip:", plan.rows, tiles,
                     plan.cluster_size > 0 ? "clusters" : "blocks", plan.threads, plan.smem);
      for (int l = 0; l < plan.num_layers; ++l) line += format(" %d", plan.rule_weights.offset[l] != 0);
      return line;
  }
  return line;
}

std::string to_fields(const Plan& plan, const Problem& problem) {
  std::string fields = std::string("kernel=") + kernel_name(plan.kernel) +
                       format(" threads=%d cluster_size=%d grid=%lld smem=%d rows=%d tiles=%lld co_resident=%d "
                              "hidden=%d own=%d buffers=%d opw=%d products=%d warp_rows=%d",
                              plan.threads, plan.cluster_size, static_cast<long long>(plan.grid), plan.smem,
                              plan.rows, static_cast<long long>(plan.tiles), plan.co_resident, plan.hidden, plan.own,
                              plan.buffers, plan.opw, plan.products, plan.warp_rows);
  return fields + "\n" + describe(plan, problem);
}

}  // namespace plan
}  // namespace ddpm_ops

// The fp32_rule kernel of the engine: its block shape and how many rows a
// thread block runs. Plain C++ (the plan includes it).
#pragma once

#include <cstddef>
#include <cstdint>

#include "../common/args.h"

namespace ddpm_ops {
namespace cuda_kernels {

// Rows per block: 1, 2, 4, 8 or 16 (an instantiation each).
constexpr int kRuleMaxRows = 16;

// A warp computes `rule_columns(rows)` output columns of a layer for all the
// block's rows at once (rows * columns sums, reduced across its lanes), so
// that many weight rows are in flight; the columns shrink as the rows grow to
// keep the sums and the weights' float4s in registers at the block size
// `rule_threads(rows)`: 32 warps for one or two rows, whose layers then have
// the most columns in flight per block, 16 for more.
DDPM_HD constexpr int rule_threads(int rows) { return rows <= 2 ? 1024 : 512; }
DDPM_HD constexpr int rule_columns(int rows) { return rows == 1 ? 8 : (rows <= 8 ? 4 : 2); }

// The output columns each CTA of a cluster of `cluster` computes in a layer
// of n, for blocks of `rows` rows: whole groups of a warp's columns, the
// last CTA's share shorter (RuleCluster::columns).
DDPM_HD inline int rule_column_share(int n, int cluster, int rows) {
  const int group = rule_columns(rows);
  return ((n + cluster - 1) / cluster + group - 1) / group * group;
}
// The floats of a CTA's share of a layer's weights kept in shared memory:
// its rows of the layer's columns, each `in` floats rounded up to float4s.
DDPM_HD inline int64_t rule_weight_share_floats(int out, int in, int cluster, int rows) {
  return static_cast<int64_t>(rule_column_share(out, cluster, rows)) * round_up4(in);
}
// Where each CTA keeps its share of each layer's weights, as the plan chose:
// the offset in floats from the start of its shared memory (after
// rule_smem_bytes), copied there once per launch, or 0 where the layer
// streams from L2 at every step.
struct RuleWeights {
  int offset[kMaxLayers];
};

// A block's shared memory, all of it dynamic (prepare_kernel lets a kernel
// ask for the device's whole opt-in size, which leaves no room for static
// arrays): a cluster's two mbarriers (kRuleBarrierFloats); per row its first step index, its step index now, whether it is
// valid and its coefficients, rounded up to float4s; rule_layer's partial
// sums (rule_scratch_floats); then the samples and the
// previous x0 (rows, dim_ld each), two activation buffers (rows, width), a
// network program's `saved_buffers` more (its residual stack) and the bias
// networks' rows (bias_net_floats); then the weights kept on chip
// (RuleWeights).
constexpr int kRuleBarrierFloats = 4;
DDPM_HD inline int rule_row_header_floats(int rows) {
  return kRuleBarrierFloats + round_up4(static_cast<int>(3 + kStepTablesWithPrevious) * rows);
}
// The partial sums of a layer whose columns' inner dimension is split over
// warps (rule_layer): every warp's sums.
DDPM_HD constexpr int rule_scratch_floats(int rows) { return rule_threads(rows) / 32 * rows * rule_columns(rows); }
DDPM_HD inline size_t rule_smem_bytes(int rows, int dim_ld, int width, int bias_floats = 0, int saved_buffers = 0) {
  return sizeof(float) * (rule_row_header_floats(rows) + rule_scratch_floats(rows) + static_cast<size_t>(bias_floats) +
                          static_cast<size_t>(rows) * (2 * static_cast<size_t>(dim_ld) +
                                                       (2 + static_cast<size_t>(saved_buffers)) * static_cast<size_t>(width)));
}

// A network program (fused_sample.rule's `network`) as fp32_rule runs it,
// compiled on the host (fused_sample_cuda.cu): each instruction reads buffer
// `src` and writes buffer `dst`, where kProgramX is the samples (never
// written) and 0, 1, ... the block's activation buffers (rows, width). A
// "save" is no instruction: the host keeps the saved buffer untouched until
// its "add" reads it as `other`, so the residual stack costs no copies, only
// the buffers beyond the two (ProgramArgs::saved_buffers). A Linear's
// activation is EngineArgs::activations[layer], as without a program.
//
// In a cluster (fp32_rule_kernel's kCluster) every CTA holds every buffer and
// computes every instruction but a Linear, whose output columns are split
// over the CTAs and stored into all of them. A partner holding all of a
// Linear's columns may then store the next Linear's into this CTA while it
// still runs the instructions in between (for a step's first Linear: the
// previous step's after its last Linear, and its update, which reads e):
// `fence` marks a Linear whose destination one of those instructions
// touches, which then waits for the whole cluster before its stores
// (compile_program avoids it where the buffers allow).
constexpr int kMaxProgramOps = 64;
constexpr int kMaxProgramNorms = 32;
constexpr int kProgramX = -1;
// The parts of a concatenated input (ProgramArgs::input_parts).
enum ProgramPart : int8_t { kPartX, kPartCond, kPartTime };

struct ProgramOpArgs {
  // kInput: dst = cat(input_parts); kLinear: dst = layer `index` of src (its
  // bias rows for layer 0); kActivation: dst = act(src); kLayerNorm: dst =
  // LayerNorm(src) with eps and the affine parameters norm_*[index] (index
  // -1: none); kAdd: dst = src + other.
  enum Kind : int8_t { kInput, kLinear, kActivation, kLayerNorm, kAdd };
  float eps;
  int width;  // the columns of h it writes
  int8_t kind;
  int8_t act;  // kActivation: an Activation
  int8_t index;
  int8_t src, dst, other;
  bool fence;  // kLinear in a cluster: a cluster barrier before its stores
};

struct ProgramArgs {
  int num_ops;  // 0: no program (the chain of EngineArgs::layers)
  ProgramOpArgs ops[kMaxProgramOps];
  const float* norm_weights[kMaxProgramNorms];
  const float* norm_biases[kMaxProgramNorms];
  int8_t input_parts[3];  // ProgramPart, in column order
  int num_input_parts;
  int input_width;        // the concatenated input's columns (0 without one)
  const float* cond_input;  // (batch, cond_cols) contiguous
  int cond_cols;
  const float* time_input;  // (table_length, time_cols) contiguous
  int time_cols;
  int saved_buffers;  // activation buffers beyond the two (rule_smem_bytes)
};

}  // namespace cuda_kernels
}  // namespace ddpm_ops

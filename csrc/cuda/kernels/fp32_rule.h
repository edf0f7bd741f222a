// The fp32_rule kernel's second argument beside EngineArgs: a network
// program. Plain C++ (fused_sample_cuda.cu compiles programs on the host).
#pragma once

#include <cstdint>

#include "../common/args.h"

namespace ddpm_ops {
namespace cuda_kernels {

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
// over the CTAs and stored into all of them, a cluster barrier after it. A
// partner past that barrier may then store the next Linear's columns into
// this CTA while it still runs the instructions in between: `fence` marks a
// Linear whose destination one of those instructions touches, which then
// waits for the whole cluster before its stores (compile_program avoids it
// where the buffers allow).
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

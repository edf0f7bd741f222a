// The fp32_smem kernel's constants and the plan (work split and
// shared-memory layout) the host computes for it.
#pragma once

#include "../../common/host_device.h"
#include "../../common/sizes.h"

#include <cstdint>

namespace ddpm_ops {
namespace shapes {

constexpr int kSmemThreads = 256;
constexpr int kSmemWarps = kSmemThreads / 32;
// log2 of the widest column tile of a warp in the instantiation whose tiles
// have vr rows: at most 32 outputs per tile (the host's split and the
// kernel's dispatch both read it).
DDPM_HD constexpr int smem_widest_vc_log2(int vr) { return vr == 4 ? 3 : 4; }
// Rows one cluster carries; one thread per row handles its coefficients.
constexpr int kSmemMaxRows = 64;
static_assert(kSmemMaxRows <= kSmemThreads, "one thread per row");

// The exchanged buffers, each with one mbarrier per CTA (phases alternate).
enum ExchangeBuffer { kHidden0 = 0, kHidden1 = 1, kEps0 = 2, kEps1 = 3, kExchangeBuffers = 4 };

// How one layer's outputs are split over a CTA's warps, fixed for the whole
// call and computed on the host, so that the step loop spends its
// instructions on the products rather than on integer division. A warp
// computes one tile of VR rows (the kernel's) x 2^vc_log2 columns at a time.
struct LayerWork {
  int cols;                // output columns per CTA (a multiple of 4 unless the whole layer)
  int vc_log2;             // log2 of the columns of a warp's tile (1 to 4)
  int tiles_c;             // column tiles per CTA
  uint32_t tiles_c_magic;  // magic_divisor(tiles_c)
  int ntiles;              // row tiles x tiles_c
};

// n / d as one multiply-high, exact for n * d < 2^32 (every index here).
DDPM_HD inline uint32_t magic_divisor(uint32_t d) {
  return d <= 1 ? 0u : static_cast<uint32_t>(((1ull << 32) + d - 1) / d);
}

// Shared-memory layout of one CTA (offsets in floats, multiples of 4 so that
// rows can be read as float4) and the work split, computed on the host
// (csrc/plan/fp32_shapes.cpp) so every CTA agrees.
struct SmemPlan {
  LayerWork work[kMaxLayers];  // slice of layer l on each CTA
  LayerWork last_work;         // the whole last layer, when every CTA computes it
  int cluster_size;
  int rows_per_tile;
  int in0_ld;                    // round_up(dim + 1, 4)
  int hidden_ld;                 // round_up(widest hidden layer, 4)
  int eps_ld;                    // round_up(dim, 4)
  int weight_offset[kMaxLayers]; // slice of layer l in shared memory (row stride
                                 // round_up(in, 4), zero padded), or -1: global
  int bias_offset[kMaxLayers];   // its bias slice in shared memory (with the weights)
  int last_weight_offset;        // the whole last layer (padded rows), or -1: sliced
  int last_bias_offset;          // and its whole bias
  int in0_offset;                // rows x in0_ld: [x, t / T], the input of layer 0
  int hidden_offset[2];          // rows x hidden_ld, hidden outputs alternate between them
  int eps_offset[2];             // rows x eps_ld, outputs of the last layer, by step parity
  int x_offset;                  // rows x dim, the current sample
  int coef_offset;               // rows x 2: this step's (c1, c2)
  int t_offset;                  // rows ints: clamped t_start
  int valid_offset;              // rows ints: 1 when every timestep is in range
  int barrier_offset;            // kExchangeBuffers mbarriers (8 bytes each)
};

// Output columns per CTA, a multiple of 4 so that every slice starts on a
// 16-byte boundary (its weight rows are copied as float4).
DDPM_HD inline int slice_size(int out, int cluster_size) {
  return round_up4((out + cluster_size - 1) / cluster_size);
}

}  // namespace shapes
}  // namespace ddpm_ops

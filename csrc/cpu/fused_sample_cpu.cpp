// CPU kernel of ddpm::fused_sample.
//
// The batch is cut into row tiles that run in parallel (at::parallel_for, so
// torch.set_num_threads applies); each tile runs all K steps and all layers on
// its own rows, with no synchronisation between tiles. Every buffer is
// allocated before the step loop; a batch of at most kSerialBatch rows is one
// tile on the calling thread (no parallel region). Per tile, what measured
// fastest (AMD EPYC, AVX-512, torch 2.13 / MKL; see the timings in the commit):
//  - one row (batch 1): a dot-product at::vec kernel on the nn.Linear weights
//    as they are, kV outputs at a time with a joint lane reduction; packing
//    the weights would cost 3-4 steps' worth of time;
//  - more rows: a register-blocked at::vec kernel (MR rows x NB vectors of
//    outputs in registers, each weight vector loaded once per MR rows) on
//    weights packed once per call as zero-padded (in, out) panels. It runs at
//    ~90% of the FMA peak and beat MKL's SGEMM (at::mm_out on the same
//    buffers) by ~2x at every tile size, so BLAS is not used with SIMD;
//  - with only the generic (no AVX2) build, tiles above kGenericVecTileRows
//    rows use ATen's BLAS (at::mm_out into preallocated buffers, weights as
//    W.t() views) plus one vectorised pass for bias + SiLU / the DDPM update.
// The at::vec kernels are compiled for the baseline ISA, and on x86-64 for AVX2
// and AVX-512 too (mlp_kernels_{default,avx2,avx512}.cpp; setup.py), and picked
// at run time from what ATen itself uses on this CPU (ATEN_CPU_CAPABILITY
// honoured), confirmed by cpuid.
#include "../op/fused_sample.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <limits>
#include <tuple>
#include <type_traits>
#include <string>
#include <vector>

#include "mlp_kernels.h"

namespace ddpm_ops {
namespace {

using cpu::Kernels;
using cpu::MlpPlan;
using cpu::StepTables;
using cpu::kPad;
using cpu::round_up;

bool cpu_has(const char* feature) {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  __builtin_cpu_init();
  if (std::string(feature) == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
  if (std::string(feature) == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
#endif
  (void)feature;
  return false;
}

// The widest kernels both ATen (which honours ATEN_CPU_CAPABILITY and checks OS
// support) and cpuid allow; the generic build otherwise.
const Kernels* select_kernels() {
#if defined(DDPM_OPS_X86_ISA_KERNELS)  // setup.py: the AVX2 and AVX-512 builds are linked in (x86-64)
  const std::string capability = at::get_cpu_capability();
  if (capability == "AVX512" && cpu_has("avx512") && cpu::AVX512::kernels() != nullptr) {
    return cpu::AVX512::kernels();
  }
  if ((capability == "AVX512" || capability == "AVX2") && cpu_has("avx2") &&
      cpu::AVX2::kernels() != nullptr) {
    return cpu::AVX2::kernels();
  }
#endif
  return cpu::DEFAULT::kernels();
}

const Kernels& kernels() {
  static const Kernels* selected = select_kernels();
  return *selected;
}

// With SIMD kernels (AVX2 / AVX-512) the vectorised path beats MKL's SGEMM on
// every tile size measured (batch 1 to 4096, widths 64-256), so it runs every
// tile, kVecTileRows rows at most: the tile's activations stay in L2 and every
// thread gets work. 96 rows beat 48 by 10-15% on two threads at batch 512 and
// 4096 (Xeon, AVX2 and AVX-512, seed net), the same on one. With only the
// generic build, tiles larger than kGenericVecTileRows go to BLAS instead.
constexpr int64_t kVecTileRows = 96;
constexpr int64_t kGenericVecTileRows = 8;
// BLAS tile rows: big enough for an efficient GEMM, small enough for L2.
constexpr int64_t kBlasTileRows = 128;
// Up to this batch, the whole batch is one tile on the calling thread: no
// parallel region to pay for.
constexpr int64_t kSerialBatch = 4;
// Threads of at most this many rows each use the dot-product kernels on the
// weights as they are: packing them costs about 3-4 steps of a single row,
// and weights that stay in L2 (Diffusion-QL's 0.8 MB) run the packed
// register blocks from 2 rows on (at 50 rows, one thread: 1.0 ms a call
// packed, 1.6 ms on the dot kernel; Xeon, AVX2).
constexpr int64_t kDotRows = 1;
// Networks of at least kStreamedWeightBytes of weights, which come from L3 or
// memory at every step, use the dot kernel up to kStreamedDotRows rows a
// thread: packing costs every thread a pass over all of them per call. IDQL's
// LN-ResNet (6 MB) at batch 64 on two threads took 8.3 ms this way against
// 12.8 packed; at 64 rows a thread the two are even, and DPPO's residual MLP
// (2 MB, nearly L2-resident once packed) ran 15-25% faster packed there (one
// thread, Xeon, AVX2).
constexpr int64_t kStreamedWeightBytes = int64_t{1} << 20;
constexpr int64_t kStreamedDotRows = 32;
// A call that runs one tile on the calling thread (a batch of at most
// kSerialBatch rows) on unpacked weights splits the output columns of each
// layer of at least this many weights between the threads: such a layer
// (512 KB and more) comes from L3 or memory at every step, and two cores
// stream it twice as fast as one. Not where OMP_WAIT_POLICY=PASSIVE: each
// parallel region then wakes sleeping threads (DPPO at batch 1 took 3.6 ms
// split that way, 1.1 on one thread).
constexpr int64_t kSplitWeights = 128 * 1024;

bool passive_threads() {
  const char* v = std::getenv("OMP_WAIT_POLICY");
  std::string policy = v != nullptr ? v : "";
  std::transform(policy.begin(), policy.end(), policy.begin(), [](unsigned char c) { return std::tolower(c); });
  return policy == "passive";
}

// Tuning and test knobs, read once per process (unset: the defaults above).
// DDPM_OPS_CPU_VEC_TILE (max rows per vectorised tile), DDPM_OPS_CPU_BLAS_TILE,
// DDPM_OPS_CPU_SERIAL_BATCH, DDPM_OPS_CPU_DOT_ROWS, DDPM_OPS_CPU_STREAMED_DOT_ROWS,
// DDPM_OPS_CPU_SPLIT_WEIGHTS, and DDPM_OPS_CPU_BLAS=0/1
// (let large tiles use BLAS; default on only for the generic build). They
// exist so tests can force every path on any machine. DDPM_OPS_CPU_UNFUSED=1
// runs the step-rule overload as the ATen loop other devices use, so that
// loop is tested where there is no other device.
int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoll(v) : fallback;
}

struct Tuning {
  int64_t vec_rows, blas_rows, serial_batch, dot_rows, streamed_dot_rows, split_weights;
  bool allow_blas, unfused;
};

const Tuning& tuning() {
  static const bool simd = std::string(kernels().name) != "DEFAULT";
  static const Tuning t{
      std::max<int64_t>(1, env_int("DDPM_OPS_CPU_VEC_TILE", simd ? kVecTileRows : kGenericVecTileRows)),
      std::max<int64_t>(1, env_int("DDPM_OPS_CPU_BLAS_TILE", kBlasTileRows)),
      env_int("DDPM_OPS_CPU_SERIAL_BATCH", kSerialBatch),
      env_int("DDPM_OPS_CPU_DOT_ROWS", kDotRows),
      env_int("DDPM_OPS_CPU_STREAMED_DOT_ROWS", kStreamedDotRows),
      env_int("DDPM_OPS_CPU_SPLIT_WEIGHTS", passive_threads() ? std::numeric_limits<int64_t>::max() : kSplitWeights),
      env_int("DDPM_OPS_CPU_BLAS", simd ? 0 : 1) != 0,
      env_int("DDPM_OPS_CPU_UNFUSED", 0) != 0};
  return t;
}

// Both overloads, once their arguments are in a plan: weights[0] is layer 0 on
// x alone (a view of the time-column overload's weight), the time-column
// weights, bias tensors and step tables set in `plan` by the caller.
struct CpuProblem {
  const at::Tensor& x;
  const at::Tensor& t_start;
  std::vector<at::Tensor> weights;  // weights[0]: (out_0, dim), any row stride
  at::TensorList biases;
  std::vector<Activation> activations;
  bool return_chain = false;
};

// A row-major view with unit column stride (no copy when it already is one).
at::Tensor rows_unit_stride(const at::Tensor& t) {
  return t.stride(-1) == 1 && t.stride(0) >= t.size(-1) ? t : t.contiguous();
}

// How the batch is cut: one tile on this thread for tiny batches; otherwise at
// least one tile per thread, vectorised kernels for small tiles, BLAS for large.
struct Tiling {
  bool use_vec, use_dot;
  int64_t tile_rows, num_tiles;
};

Tiling choose_tiling(int64_t batch, bool program, int64_t weight_bytes) {
  const bool allow_blas = !program;
  const Tuning& tune = tuning();
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t per_thread = (batch + threads - 1) / threads;
  const bool use_vec = batch <= tune.serial_batch || per_thread <= tune.vec_rows || !tune.allow_blas ||
                       !allow_blas;
  int64_t tile_rows = batch <= tune.serial_batch
                          ? batch
                          : std::min(per_thread, use_vec ? tune.vec_rows : tune.blas_rows);
  const int64_t num_tiles = (batch + tile_rows - 1) / tile_rows;
  tile_rows = (batch + num_tiles - 1) / num_tiles;  // balance the tiles
  const int64_t thread_rows = batch <= tune.serial_batch ? batch : per_thread;
  const bool use_dot =
      thread_rows <= (weight_bytes >= kStreamedWeightBytes ? tune.streamed_dot_rows : tune.dot_rows);
  return {use_vec, use_vec && use_dot, tile_rows, num_tiles};
}

// The vectorised kernels' (in, out_pad) weight panels and padded biases, all
// layers in one buffer; the plan points into it.
at::Tensor pack_weights(const Kernels& kern, MlpPlan& plan, std::vector<const float*>& packed_w,
                        std::vector<const float*>& packed_b, const at::TensorOptions& options) {
  int64_t total = 0;
  for (int64_t l = 0; l < plan.num_layers; ++l) {
    total += (plan.in_f[l] + 1) * round_up(plan.out_f[l], kPad);
  }
  at::Tensor packed = at::empty({total}, options);
  float* p = packed.data_ptr<float>();
  for (int64_t l = 0; l < plan.num_layers; ++l) {
    const int64_t op = round_up(plan.out_f[l], kPad);
    packed_w[l] = p;
    packed_b[l] = p + plan.in_f[l] * op;
    kern.pack_layer(plan.weight[l], plan.weight_ld[l], plan.bias[l], plan.out_f[l], plan.in_f[l],
                    p, p + plan.in_f[l] * op);
    p += (plan.in_f[l] + 1) * op;
  }
  plan.packed_w = packed_w.data();
  plan.packed_b = packed_b.data();
  return packed;
}

// All K steps of one tile with ATen's BLAS for the products (the generic
// build's large tiles): x's rows and the scratch buffers as views, the bias,
// activation and step update from the kernels.
void blas_tile(const Kernels& kern, const MlpPlan& plan, const std::vector<at::Tensor>& w_t,
               float* x_data, int64_t row0, int64_t rows, float* scratch,
               const at::TensorOptions& opts) {
  const int64_t ld = plan.act_ld, dim = plan.dim, num_layers = plan.num_layers;
  float* bufs[2] = {scratch, scratch + rows * ld};
  float* row_bias = scratch + 2 * rows * ld;
  float* x0_prev = cpu::previous_x0(plan, scratch, rows);
  float* x_tile = x_data + row0 * dim;
  std::vector<at::Tensor> layer_in(num_layers), layer_out(num_layers);
  for (int64_t l = 0; l < num_layers; ++l) {
    layer_in[l] = l == 0 ? at::from_blob(x_tile, {rows, dim}, {dim, 1}, opts)
                         : at::from_blob(bufs[(l - 1) % 2], {rows, plan.in_f[l]}, {ld, 1}, opts);
    layer_out[l] = at::from_blob(bufs[l % 2], {rows, plan.out_f[l]}, {ld, 1}, opts);
  }
  for (int64_t k = 0; k < plan.num_steps; ++k) {
    if (plan.row_bias()) kern.first_bias(plan, row0, rows, row_bias, ld, k);
    for (int64_t l = 0; l < num_layers; ++l) {
      at::mm_out(layer_out[l], layer_in[l], w_t[l]);
      const bool own_rows = l == 0 && plan.row_bias();
      const bool last = l + 1 == num_layers;
      if (!last || own_rows) {
        kern.bias_act(bufs[l % 2], ld, rows, plan.out_f[l], own_rows ? row_bias : plan.bias[l],
                      own_rows ? ld : 0, last ? Activation::kIdentity : plan.act[l]);
      }
    }
    const bool bias_added = num_layers == 1 && plan.row_bias();
    kern.step_update(plan, x_tile, row0, rows, bufs[(num_layers - 1) % 2], ld,
                     bias_added ? nullptr : plan.bias[num_layers - 1], k, x0_prev);
  }
}

// MlpPlan::parallel_columns.
void parallel_columns(int64_t n, int64_t grain, void (*fn)(void* ctx, int64_t begin, int64_t end), void* ctx) {
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { fn(ctx, begin, end); });
}

at::Tensor run(const CpuProblem& problem, MlpPlan plan) {
  const at::Tensor& x = problem.x;
  // The network's buffers are float32 whatever the sample's dtype.
  const at::TensorOptions net_options = x.options().dtype(at::kFloat);
  const int64_t batch = x.size(0);
  const int64_t dim = x.size(1);
  const int64_t num_layers = static_cast<int64_t>(problem.weights.size());
  const int64_t num_steps = plan.num_steps;
  at::Tensor chain, out;
  if (problem.return_chain) {
    chain = at::empty({num_steps + 1, batch, dim}, x.options());
    chain[0].copy_(x);
    // The working rows are a buffer of their own: chain[k + 1] is written after step k.
    out = num_steps == 0 ? chain[0] : x.clone(at::MemoryFormat::Contiguous);
  } else {
    out = x.clone(at::MemoryFormat::Contiguous);
  }
  if (num_steps == 0 || batch == 0) {
    return problem.return_chain ? chain : out;
  }
  const Kernels& kern = kernels();
  // A float64 sample: `out` holds its rows, which the step updates in float64;
  // the network reads them rounded to float32, from x32.
  const bool wide = x.scalar_type() == at::kDouble;
  const at::Tensor x32 = wide ? out.to(at::kFloat) : out;

  // ---- Everything the step loop reads, prepared before it.
  std::vector<int64_t> in_f(num_layers), out_f(num_layers), weight_ld(num_layers);
  std::vector<at::Tensor> weight_c(num_layers), bias_c(num_layers);
  std::vector<const float*> weight_p(num_layers), bias_p(num_layers);
  // A program's LayerNorm may read its concatenated input into an activation buffer.
  int64_t widest = std::max(dim, plan.input_ld);
  int64_t weight_bytes = 0;
  for (int64_t l = 0; l < num_layers; ++l) {
    weight_c[l] = rows_unit_stride(problem.weights[l]);
    bias_c[l] = problem.biases[l].contiguous();
    out_f[l] = weight_c[l].size(0);
    in_f[l] = weight_c[l].size(1);
    weight_ld[l] = weight_c[l].stride(0);
    weight_p[l] = weight_c[l].data_ptr<float>();
    bias_p[l] = bias_c[l].data_ptr<float>();
    widest = std::max(widest, out_f[l]);
    weight_bytes += out_f[l] * in_f[l] * static_cast<int64_t>(sizeof(float));
  }
  // A network program runs on the vectorised kernels only.
  const Tiling tiling = choose_tiling(batch, /*program=*/plan.program != nullptr, weight_bytes);
  const at::Tensor t_long = problem.t_start.to(at::kLong).contiguous();
  plan.batch = batch;
  plan.dim = dim;
  plan.num_layers = num_layers;
  plan.act_ld = round_up(widest, kPad);
  plan.in_f = in_f.data();
  plan.out_f = out_f.data();
  plan.act = problem.activations.data();
  plan.weight = weight_p.data();
  plan.weight_ld = weight_ld.data();
  plan.bias = bias_p.data();
  plan.t_start = t_long.data_ptr<int64_t>();
  if (wide) {
    plan.x64 = out.data_ptr<double>();
    plan.step64.chain = problem.return_chain ? chain.data_ptr<double>() : nullptr;
  } else {
    plan.step.chain = problem.return_chain ? chain.data_ptr<float>() : nullptr;
  }
  std::vector<at::Tensor> w_t(num_layers);
  for (int64_t l = 0; l < num_layers; ++l) w_t[l] = weight_c[l].t();

  float* x_data = x32.data_ptr<float>();
  auto run_tiles = [&](int64_t tile_begin, int64_t tile_end) {
    // Scratch for this thread's tiles, allocated once, before any step loop:
    // two activation buffers, layer 0's bias rows and the previous x0.
    std::vector<float> scratch(cpu::scratch_floats(plan, tiling.tile_rows), 0.f);
    // The BLAS path's ATen calls must not re-enter autograd: the inputs are
    // internal buffers.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // Every thread packs the weights into a copy of its own: cores that read
    // one shared copy ran 10-15% slower (two threads, Xeon, batch 2048), and
    // the packing runs in parallel this way.
    MlpPlan own = plan;
    at::Tensor packed;
    std::vector<const float*> packed_w(num_layers), packed_b(num_layers);
    if (tiling.use_vec && !tiling.use_dot) {
      packed = pack_weights(kern, own, packed_w, packed_b, net_options);
    }
    for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
      const int64_t row0 = tile * tiling.tile_rows;
      const int64_t rows = std::min(tiling.tile_rows, batch - row0);
      if (tiling.use_vec) {
        kern.vec_tile(own, x_data, row0, rows, scratch.data());
      } else {
        blas_tile(kern, plan, w_t, x_data, row0, rows, scratch.data(), net_options);
      }
    }
  };
  if (tiling.num_tiles == 1) {
    if (tiling.use_dot && at::get_num_threads() > 1 && !at::in_parallel_region()) {
      plan.parallel_columns = &parallel_columns;
      plan.split_weights = tuning().split_weights;
    }
    run_tiles(0, 1);  // no parallel region for a single tile but the split layers'
  } else {
    at::parallel_for(0, tiling.num_tiles, 1, run_tiles);
  }
  return problem.return_chain ? chain : out;
}

// A table row that is all `value` needs no arithmetic: null it (the plan's
// identity for that term), so a rule without a term runs as fast as one
// that never had it. A plain scan: a reduction op per row would cost more
// than a small batch's whole call.
template <typename T>
const T* unless_all(const T* row, int64_t length, T value) {
  return std::all_of(row, row + length, [value](T v) { return v == value; }) ? nullptr : row;
}

// A clamp as the kernels read it, dim lower and dim upper bounds in the
// sample's scalar type T: the per-column bounds tensor's rows, or the two
// floats repeated.
template <typename T>
class ClampBounds {
 public:
  ClampBounds(OptionalRange range, const std::optional<at::Tensor>& bounds, const char* name,
              int64_t dim)
      : dim_(dim) {
    if (const auto pair = parse_clip(range, name)) {
      repeated_.assign(dim, static_cast<T>(pair->first));
      repeated_.resize(2 * dim, static_cast<T>(pair->second));
      lo_ = repeated_.data();
    } else if (bounds.has_value()) {
      tensor_ = bounds->contiguous();
      lo_ = tensor_.data_ptr<T>();
    }
  }
  // (lo, hi) pointers to dim values each, or nulls without a clamp.
  std::pair<const T*, const T*> lo_hi() const {
    if (lo_ == nullptr) return {nullptr, nullptr};
    return {lo_, lo_ + dim_};
  }

 private:
  int64_t dim_;
  std::vector<T> repeated_;
  at::Tensor tensor_;
  const T* lo_ = nullptr;
};

// The call run with its step's tables, clamps and noise in the sample's
// scalar type T (float, or double for a float64 sample).
template <typename T>
at::Tensor run_with_step(const CpuProblem& problem, MlpPlan plan, const SampleRuleCall& call,
                         const SampleRuleExtras& extras) {
  const at::Tensor tables = call.step_tables.contiguous();
  const at::Tensor z = call.noise.has_value() ? call.noise->contiguous() : at::Tensor();
  StepTables<T>& step = [&]() -> StepTables<T>& {
    if constexpr (std::is_same_v<T, double>) return plan.step64; else return plan.step;
  }();
  // Rows by pointer: a tensor per row would cost a call at batch 1 more than its update.
  const int64_t length = tables.size(1);
  const T* row = tables.data_ptr<T>();
  step.A = unless_all(row + kA * length, length, T(1));
  step.B = row + kB * length;
  step.C = row + kC * length;
  step.D = unless_all(row + kD * length, length, T(0));
  step.E = unless_all(row + kE * length, length, T(0));
  step.S = unless_all(row + kS * length, length, T(0));
  if (tables.size(0) >= kStepTablesWithPrevious) step.P = unless_all(row + kP * length, length, T(0));
  if (tables.size(0) == kStepTablesWithEpsReadback) {
    // E may be all zeros while Q and R are not: the read-back term is then dropped with E.
    if (step.E != nullptr) {
      step.Q = row + kQ * length;
      step.R = row + kR * length;
    }
    if (const auto range = parse_clip(extras.eps_clip, "eps_clip")) {
      step.eps_lo = static_cast<T>(range->first);
      step.eps_hi = static_cast<T>(range->second);
    }
  }
  step.noise = z.defined() ? z.data_ptr<T>() : nullptr;
  const int64_t dim = call.x.size(1);
  const ClampBounds<T> x0_bounds(call.clip, call.clip_bounds, "clip", dim);
  const ClampBounds<T> x_bounds(call.post_clip, call.post_clip_bounds, "post_clip", dim);
  std::tie(step.clip_lo, step.clip_hi) = x0_bounds.lo_hi();
  std::tie(step.post_lo, step.post_hi) = x_bounds.lo_hi();
  if (extras.noise_clip.has_value()) step.noise_clip = static_cast<T>(*extras.noise_clip);
  return run(problem, plan);
}

// A network program as the kernels run it: every instruction with the
// buffers it reads and writes (cpu::ProgramOp), a Linear followed by an
// activation fused into one instruction, identities dropped. A buffer stays
// untouched from its "save" to its "add". `norm_weights` / `norm_biases`:
// contiguous, kept alive by the caller.
std::vector<cpu::ProgramOp> compile_program(const NetworkProgram& program, int64_t input_width,
                                            const std::vector<at::Tensor>& weights,
                                            const std::vector<at::Tensor>& norm_weights,
                                            const std::vector<at::Tensor>& norm_biases,
                                            int64_t& num_buffers) {
  using cpu::ProgramOp;
  const bool own_input = program.input.size() > 1 || program.input[0] != InputPart::kX;
  int32_t cur = own_input ? cpu::kProgramInput : cpu::kProgramX;
  int64_t width = input_width;
  std::vector<int32_t> saved;
  int32_t buffers = 0;
  auto is_saved = [&](int32_t id) { return std::find(saved.begin(), saved.end(), id) != saved.end(); };
  auto fresh = [&]() {
    int32_t id = 0;
    while (id == cur || is_saved(id)) ++id;
    buffers = std::max(buffers, id + 1);
    return id;
  };
  // In place where h's buffer is an activation buffer no "save" holds.
  auto writable = [&]() { return cur >= 0 && !is_saved(cur) ? cur : fresh(); };
  std::vector<ProgramOp> out;
  const std::vector<NetworkOp>& ops = program.ops;
  for (size_t i = 0; i < ops.size(); ++i) {
    const NetworkOp& op = ops[i];
    ProgramOp o{};
    o.src = cur;
    switch (op.kind) {
      case NetworkOp::Kind::kLinear:
        o.kind = ProgramOp::kLinear;
        o.layer = static_cast<int32_t>(op.index);
        o.dst = fresh();
        if (i + 1 < ops.size() && ops[i + 1].kind == NetworkOp::Kind::kActivation) o.act = ops[++i].activation;
        width = weights[op.index].size(0);
        break;
      case NetworkOp::Kind::kActivation:
        if (op.activation == Activation::kIdentity) continue;
        o.kind = ProgramOp::kActivation;
        o.act = op.activation;
        o.dst = writable();
        break;
      case NetworkOp::Kind::kLayerNorm:
        o.kind = ProgramOp::kLayerNorm;
        o.eps = static_cast<float>(op.eps);
        if (op.index >= 0) {
          o.gamma = norm_weights[op.index].data_ptr<float>();
          o.beta = norm_biases[op.index].data_ptr<float>();
        }
        o.dst = writable();
        break;
      case NetworkOp::Kind::kSave:
        saved.push_back(cur);
        continue;
      case NetworkOp::Kind::kAdd:
        o.kind = ProgramOp::kAdd;
        o.other = saved.back();
        saved.pop_back();
        o.dst = writable();
        break;
    }
    o.width = width;
    out.push_back(o);
    cur = o.dst;
  }
  num_buffers = buffers;
  return out;
}

}  // namespace

at::Tensor fused_sample_cpu(const at::Tensor& x, const at::Tensor& t_start,
                            at::TensorList weights, at::TensorList biases,
                            const at::Tensor& sqrt_recip_alphas,
                            const at::Tensor& coef_eps, int64_t num_steps,
                            int64_t total_timesteps, bool /*validate: always on*/,
                            c10::string_view precision) {
  check_fused_sample_args(x, t_start, weights, biases, sqrt_recip_alphas, coef_eps,
                          num_steps, total_timesteps, precision);
  check_timesteps_in_range(t_start, num_steps, sqrt_recip_alphas.size(0));
  const int64_t dim = x.size(1);
  // The t / T input column is layer 0's last: a bias row (s / T) * w[:, dim].
  CpuProblem problem{x, t_start, std::vector<at::Tensor>(weights.begin(), weights.end()), biases,
                     std::vector<Activation>(weights.size() - 1, Activation::kSilu)};
  problem.weights[0] = weights[0].narrow(1, 0, dim);
  const at::Tensor time_weight = weights[0].select(1, dim).contiguous();
  const at::Tensor c1 = sqrt_recip_alphas.contiguous(), c2 = coef_eps.contiguous();
  MlpPlan plan;
  plan.num_steps = num_steps;
  plan.time_weight = time_weight.data_ptr<float>();
  plan.total_timesteps = static_cast<float>(total_timesteps);
  plan.step.B = c2.data_ptr<float>();
  plan.step.C = c1.data_ptr<float>();
  return run(problem, plan);
}

at::Tensor fused_sample_rule_cpu(const SampleRuleCall& call, const SampleRuleExtras& extras) {
  if (tuning().unfused) return fused_sample_rule_unfused(call, extras);
  check_sample_rule_args(call, extras);
  const at::Tensor& x = call.x;
  check_timesteps_in_range(call.t_start, call.num_steps, call.step_tables.size(1));
  if (call.clip_bounds.has_value()) check_bounds_ordered(*call.clip_bounds, "clip_bounds");
  if (call.post_clip_bounds.has_value()) check_bounds_ordered(*call.post_clip_bounds, "post_clip_bounds");
  const bool has_program = extras.network.has_value();
  CpuProblem problem{x, call.t_start, std::vector<at::Tensor>(call.weights.begin(), call.weights.end()), call.biases,
                     has_program ? std::vector<Activation>()
                                 : parse_activations(call.activations, static_cast<int64_t>(call.weights.size())),
                     call.return_chain};
  const at::Tensor time = with_bias_net(call.time_bias, call.time_net).value_or(at::Tensor());
  const at::Tensor cond = with_bias_net(call.cond_bias, call.cond_net).value_or(at::Tensor());
  const std::optional<at::Tensor> seed = noise_seed_of(call);
  const at::Tensor seeds = seed.has_value() ? seed->contiguous() : at::Tensor();
  MlpPlan plan;
  plan.num_steps = call.num_steps;
  plan.time_bias = time.defined() ? time.data_ptr<float>() : nullptr;
  plan.cond_bias = cond.defined() ? cond.data_ptr<float>() : nullptr;
  if (seeds.defined()) {
    plan.noise_seeds = seeds.data_ptr<int64_t>();
    plan.seed_per_row = seed_per_row(seeds);
  }

  // ---- A network program: its instructions with buffers assigned, its input's parts.
  std::vector<at::Tensor> norm_w, norm_b, inputs;
  std::vector<cpu::ProgramOp> program_ops;
  if (has_program) {
    const NetworkProgram program = parse_network(call, extras);
    for (const at::Tensor& t : extras.norm_weights.value_or(at::TensorList())) norm_w.push_back(t.contiguous());
    for (const at::Tensor& t : extras.norm_biases.value_or(at::TensorList())) norm_b.push_back(t.contiguous());
    int64_t input_width = 0;
    const bool own_input = program.input.size() > 1 || program.input[0] != InputPart::kX;
    for (InputPart part : program.input) {
      const int32_t code = part == InputPart::kX ? 0 : part == InputPart::kCond ? 1 : 2;
      if (own_input) plan.input_parts[plan.num_input_parts++] = code;
      if (part == InputPart::kX) {
        input_width += x.size(1);
        continue;
      }
      const at::Tensor rows = (part == InputPart::kCond ? *call.cond_net.input : *call.time_net.input).contiguous();
      inputs.push_back(rows);
      input_width += rows.size(1);
      if (part == InputPart::kCond) {
        plan.cond_input = rows.data_ptr<float>();
        plan.cond_cols = rows.size(1);
      } else {
        plan.time_input = rows.data_ptr<float>();
        plan.time_cols = rows.size(1);
      }
    }
    if (own_input) plan.input_ld = round_up(input_width, kPad);
    program_ops = compile_program(program, input_width, problem.weights, norm_w, norm_b, plan.program_buffers);
    plan.program = program_ops.data();
    plan.program_ops = static_cast<int64_t>(program_ops.size());
  }
  return x.scalar_type() == at::kDouble ? run_with_step<double>(problem, plan, call, extras)
                                        : run_with_step<float>(problem, plan, call, extras);
}

TORCH_LIBRARY_IMPL(ddpm, CPU, m) {
  m.impl("fused_sample", &fused_sample_cpu);
  m.impl("fused_sample.rule", &rule_kernel<&fused_sample_rule_cpu>);
}

}  // namespace ddpm_ops

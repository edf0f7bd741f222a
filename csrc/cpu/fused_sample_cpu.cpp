// CPU kernel of ddpm::fused_sample: batch tiles in parallel, every buffer
// allocated before the step loop.
#include "../fused_sample.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace ddpm_ops {
namespace {

using Vec = at::vec::Vectorized<float>;

// out[r, j] = bias[j] + sum_i in[r, i] * weight[j, i] for rows r < rows, with
// SiLU applied when `silu`. The nn.Linear layout keeps each output's weights
// contiguous, so every output is one vectorised dot product per row.
void linear_rows(const float* in, int64_t in_stride, int64_t rows, const float* weight,
                 const float* bias, int64_t in_features, int64_t out_features, bool silu,
                 float* out, int64_t out_stride) {
  const int64_t vec_end = in_features - in_features % Vec::size();
  for (int64_t r = 0; r < rows; ++r) {
    const float* in_row = in + r * in_stride;
    float* out_row = out + r * out_stride;
    for (int64_t j = 0; j < out_features; ++j) {
      const float* w_row = weight + j * in_features;
      Vec acc(0.f);
      for (int64_t i = 0; i < vec_end; i += Vec::size()) {
        acc = at::vec::fmadd(Vec::loadu(in_row + i), Vec::loadu(w_row + i), acc);
      }
      float sum = at::vec::vec_reduce_all<float>(std::plus<Vec>(), acc);
      for (int64_t i = vec_end; i < in_features; ++i) {
        sum += in_row[i] * w_row[i];
      }
      float value = sum + bias[j];
      out_row[j] = silu ? value / (1.f + std::exp(-value)) : value;
    }
  }
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
  const int64_t table_length = sqrt_recip_alphas.size(0);
  check_timesteps_in_range(t_start, num_steps, table_length);

  at::Tensor out = x.clone(at::MemoryFormat::Contiguous);
  const int64_t batch = x.size(0);
  const int64_t dim = x.size(1);
  const int64_t num_layers = static_cast<int64_t>(weights.size());
  if (num_steps == 0 || batch == 0) {
    return out;
  }

  std::vector<at::Tensor> weight_c, bias_c;
  int64_t widest = dim + 1;
  for (int64_t l = 0; l < num_layers; ++l) {
    weight_c.push_back(weights[l].contiguous());
    bias_c.push_back(biases[l].contiguous());
    widest = std::max(widest, weights[l].size(0));
  }
  const at::Tensor t_long = t_start.to(at::kLong).contiguous();
  const at::Tensor c1_table = sqrt_recip_alphas.contiguous();
  const at::Tensor c2_table = coef_eps.contiguous();
  const int64_t* t_data = t_long.data_ptr<int64_t>();
  const float* c1_data = c1_table.data_ptr<float>();
  const float* c2_data = c2_table.data_ptr<float>();
  float* x_data = out.data_ptr<float>();
  const float total_f = static_cast<float>(total_timesteps);

  constexpr int64_t kRowsPerTile = 16;
  at::parallel_for(0, batch, kRowsPerTile, [&](int64_t begin, int64_t end) {
    const int64_t rows = end - begin;
    // Two ping-pong activation buffers, each wide enough for any layer.
    std::vector<float> act(2 * rows * widest);
    float* bufs[2] = {act.data(), act.data() + rows * widest};
    float* x_tile = x_data + begin * dim;
    for (int64_t k = 0; k < num_steps; ++k) {
      float* in = bufs[0];
      for (int64_t r = 0; r < rows; ++r) {
        std::copy(x_tile + r * dim, x_tile + (r + 1) * dim, in + r * widest);
        in[r * widest + dim] = static_cast<float>(t_data[begin + r] - k) / total_f;
      }
      int64_t in_features = dim + 1;
      for (int64_t l = 0; l < num_layers; ++l) {
        float* layer_out = bufs[(l + 1) % 2];
        const int64_t out_features = weight_c[l].size(0);
        linear_rows(in, widest, rows, weight_c[l].data_ptr<float>(), bias_c[l].data_ptr<float>(),
                    in_features, out_features, l + 1 < num_layers, layer_out, widest);
        in = layer_out;
        in_features = out_features;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = t_data[begin + r] - k;
        const float c1 = c1_data[t];
        const float c2 = c2_data[t];
        float* x_row = x_tile + r * dim;
        const float* eps = in + r * widest;
        for (int64_t j = 0; j < dim; ++j) {
          x_row[j] = c1 * (x_row[j] - c2 * eps[j]);
        }
      }
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(ddpm, CPU, m) { m.impl("fused_sample", &fused_sample_cpu); }

}  // namespace ddpm_ops

// ddpm::cuda_plan: the CUDA plan for a problem on a described device (tests,
// diagnostics; ddpm_ops/cuda_plan.py wraps it). Registered in every build,
// CPU-only ones included: the plan is plain C++.
#include "plan.h"

#include <c10/util/Exception.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include <map>
#include <string>
#include <vector>

namespace ddpm_ops {
namespace {

// device: Device's fields in ddpm_ops/cuda_plan.py's order (Device.as_list);
// aligned: per layer, whether its weight starts on a 16-byte boundary (empty:
// every one does); overrides: NAME=VALUE pairs separated by ';', read as the
// DDPM_OPS_CUDA_* variables would be; general_step: the call is
// fused_sample.rule's (layer 0 reads x alone); previous_x0: it has a
// previous-x0 table; program_saved >= 0: it has a
// network program whose residual stack gets that deep, program_input its
// concatenated input's width (0: none).
std::string cuda_plan(int64_t batch, int64_t dim, std::vector<int64_t> hidden, int64_t num_steps,
                      c10::string_view precision, std::vector<int64_t> device, std::vector<int64_t> aligned,
                      c10::string_view overrides, bool general_step, bool previous_x0, int64_t program_saved,
                      int64_t program_input) {
  plan::Problem p;
  p.general_step = general_step;
  p.previous_x0 = previous_x0;
  TORCH_CHECK(program_saved <= INT32_MAX && program_input >= 0 && program_input <= INT32_MAX &&
                  (program_saved >= 0 || program_input == 0),
              "ddpm::cuda_plan: program_saved must be at most 2^31 - 1 (negative: no program) and program_input "
              "between 0 and 2^31 - 1 (0 without a program), got ", program_saved, " and ", program_input);
  p.program = program_saved >= 0;
  p.program_saved = p.program ? static_cast<int>(program_saved) : 0;
  p.program_input = static_cast<int>(program_input);
  p.batch = batch;
  p.dim = static_cast<int>(dim);
  p.num_steps = static_cast<int>(num_steps);
  p.num_layers = static_cast<int>(hidden.size()) + 1;
  TORCH_CHECK(batch >= 1 && dim >= 1 && num_steps >= 1, "ddpm::cuda_plan: batch, dim and num_steps must be >= 1, got ",
              batch, ", ", dim, " and ", num_steps);
  // As the op requires on CUDA: the plan's arithmetic is in int.
  TORCH_CHECK(batch <= INT32_MAX && dim < INT32_MAX && num_steps <= INT32_MAX,
              "ddpm::cuda_plan: batch, dim + 1 and num_steps must fit in int32, got ", batch, ", ", dim, " + 1 and ",
              num_steps);
  TORCH_CHECK(p.num_layers <= kMaxLayers, "ddpm::cuda_plan: at most ", kMaxLayers, " layers");
  TORCH_CHECK(aligned.empty() || static_cast<int>(aligned.size()) == p.num_layers,
              "ddpm::cuda_plan: aligned needs one flag per layer (", p.num_layers, "), got ", aligned.size());
  int in = p.program_input > 0 ? p.program_input : general_step ? p.dim : p.dim + 1;
  for (int l = 0; l < p.num_layers; ++l) {
    TORCH_CHECK(l + 1 == p.num_layers || (hidden[l] >= 1 && hidden[l] <= INT32_MAX),
                "ddpm::cuda_plan: hidden widths must be between 1 and 2^31 - 1, got ", hidden[l]);
    const int out = l + 1 < p.num_layers ? static_cast<int>(hidden[l]) : p.dim;
    p.layers[l] = {in, out, aligned.empty() || aligned[l] != 0};
    in = out;
  }
  if (precision == "fp32") {
    p.precision = plan::Precision::kFloat32;
  } else if (precision == "tf32") {
    p.precision = plan::Precision::kTF32;
  } else {
    TORCH_CHECK(precision == "bf16", "ddpm::cuda_plan: precision must be fp32, tf32 or bf16");
    p.precision = plan::Precision::kBFloat16;
  }
  constexpr size_t kFields = 6 + plan::kMaxClusterSize + 1;
  TORCH_CHECK(device.size() == kFields, "ddpm::cuda_plan: device needs ", kFields, " fields, got ", device.size());
  for (size_t i = 0; i < kFields; ++i) {
    TORCH_CHECK(device[i] >= 0 && device[i] <= INT32_MAX, "ddpm::cuda_plan: device field ", i,
                " must be between 0 and 2^31 - 1, got ", device[i]);
  }
  TORCH_CHECK(device[0] >= 1, "ddpm::cuda_plan: a device has at least one SM (sm_count), got 0");
  plan::Device d;
  d.sm_count = static_cast<int>(device[0]);
  d.max_smem = static_cast<int>(device[1]);
  d.cc_major = static_cast<int>(device[2]);
  d.cc_minor = static_cast<int>(device[3]);
  d.sm90a_build = device[4] != 0;
  d.tma_encoder = device[5] != 0;
  for (int size = 0; size <= plan::kMaxClusterSize; ++size) d.max_clusters[size] = static_cast<int>(device[6 + size]);

  std::map<std::string, std::string> values;
  const std::string text(overrides);
  for (size_t begin = 0; begin < text.size();) {
    size_t end = text.find(';', begin);
    if (end == std::string::npos) end = text.size();
    const std::string pair = text.substr(begin, end - begin);
    const size_t eq = pair.find('=');
    TORCH_CHECK(pair.empty() || eq != std::string::npos, "ddpm::cuda_plan: overrides are NAME=VALUE pairs, got '",
                pair, "'");
    if (!pair.empty()) values[pair.substr(0, eq)] = pair.substr(eq + 1);
    begin = end + 1;
  }
  const plan::Overrides o = plan::parse_overrides([&](const char* name) -> const char* {
    const auto it = values.find(name);
    return it == values.end() ? nullptr : it->second.c_str();
  });
  const plan::Plan chosen = plan::choose_plan(p, plan::described_as(d, o), o);
  TORCH_CHECK(chosen.error.empty(), chosen.error);
  return plan::to_fields(chosen, p);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ddpm, m) {
  m.def(
      "cuda_plan(int batch, int dim, int[] hidden, int num_steps, str precision, int[] device, "
      "int[] aligned, str overrides, bool general_step=False, bool previous_x0=False, int program_saved=-1, "
      "int program_input=0) -> str",
      &cuda_plan);
}

}  // namespace ddpm_ops

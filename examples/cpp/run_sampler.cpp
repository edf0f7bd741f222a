// Runs the AOTInductor package written by examples/export_deploy.py.
//
// The package calls ddpm::fused_sample through the dispatcher, so the op
// library (ddpm_ops.LIBRARY_PATH) must be loaded first: dlopen registers it.
//
//   run_sampler <path of ddpm_ops _C library> <sampler_aoti.pt2> [batch] [cpu|cuda]
#include <dlfcn.h>

#include <cstdlib>
#include <iostream>
#include <string>

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/torch.h>

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: " << argv[0] << " <ddpm_ops library> <package.pt2> [batch] [cpu|cuda]\n";
    return 2;
  }
  if (dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    std::cerr << "could not load the ddpm_ops library: " << dlerror() << "\n";
    return 1;
  }
  const int64_t batch = argc > 3 ? std::atoll(argv[3]) : 8;
  const torch::Device device(argc > 4 ? argv[4] : "cpu");
  const int64_t total_timesteps = 100;  // as in export_deploy.py

  c10::InferenceMode inference;
  torch::inductor::AOTIModelPackageLoader loader(argv[2]);
  // Deterministic inputs, so that a test can compare with Python: a ramp in [-2, 2).
  auto x = (torch::arange(batch * 2, torch::kFloat32).reshape({batch, 2}) * (4.0 / (batch * 2)) - 2.0)
               .to(device);
  auto t_start = torch::full({batch}, total_timesteps - 1, torch::dtype(torch::kInt64).device(device));
  std::vector<torch::Tensor> outputs = loader.run({x, t_start});
  auto samples = outputs[0].cpu().contiguous();
  std::cout << "samples " << samples.size(0) << " x " << samples.size(1) << "\n";
  std::cout.precision(9);
  for (int64_t i = 0; i < samples.numel(); ++i) {
    std::cout << samples.data_ptr<float>()[i] << (i + 1 < samples.numel() ? " " : "\n");
  }
  return 0;
}

// Asynchronous copies, mbarriers and cluster messages (sm_90 PTX), shared
// by every kernel.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cstdint>

// 1 in the passes that compile the Hopper kernels' bodies (clusters,
// distributed shared memory, TMA): the device pass for sm_90 (setup.py
// builds 9.0 as sm_90a) and the host pass. Every other architecture's pass
// (8.x, compute_8x PTX) compiles those kernels to a trap, so that one fat
// binary holds them next to the portable kernels; the plan never launches
// them there (plan::Device::hopper()).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define DDPM_OPS_HOPPER_CODE 1
#else
#define DDPM_OPS_HOPPER_CODE 0
#endif

// An sm_90 instruction (clusters, TMA, the bulk-copy engine) in a helper that
// portable kernels share too: those call it only on paths their plan never
// takes below 9.0 (clusters of one CTA, cp.async chunks), so other
// architectures' passes compile it to a trap.
#if DDPM_OPS_HOPPER_CODE
#define DDPM_OPS_SM90_ONLY(...) __VA_ARGS__
#else
#define DDPM_OPS_SM90_ONLY(...) __trap()
#endif

namespace ddpm_ops {
namespace cuda_kernels {

__device__ __forceinline__ void cp_async4(float* dst, const float* src, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src), "r"(pred ? 4 : 0));
}
__device__ __forceinline__ void cp_async16(float* dst, const float* src, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(pred ? 16 : 0));
}
// The first `bytes` (0 to 16, a multiple of 4) of 16 from src, the rest of
// dst zero: a row's last group of four columns where the row is narrower.
__device__ __forceinline__ void cp_async16_prefix(float* dst, const float* src, int bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// The shared-memory address `local` of this CTA, in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t cluster_address(uint32_t local, int rank) {
  uint32_t remote = 0;
  DDPM_OPS_SM90_ONLY(asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank)));
  return remote;
}
// This CTA's rank in its cluster.
__device__ __forceinline__ int cluster_rank() {
  uint32_t rank = 0;
  DDPM_OPS_SM90_ONLY(asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank)));
  return static_cast<int>(rank);
}
// The CTAs in this CTA's cluster.
__device__ __forceinline__ int cluster_size() {
  uint32_t size = 1;
  DDPM_OPS_SM90_ONLY(asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(size)));
  return static_cast<int>(size);
}
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(arrivals)
               : "memory");
}
// This thread's arrival on this CTA's own mbarrier, announcing the bytes that
// copies into this CTA will complete on it (its TMA copy, the bulk copies of
// the other CTAs, or the cluster's st.async stores). CTA scope: only this CTA
// waits on it.
__device__ __forceinline__ void mbarrier_expect_local(uint32_t bar, uint32_t bytes) {
  DDPM_OPS_SM90_ONLY(asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory"));
}
__device__ __forceinline__ void st_async(uint32_t cluster_addr, float v, uint32_t cluster_bar) {
  DDPM_OPS_SM90_ONLY(asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(
                   cluster_addr),
               "r"(__float_as_uint(v)), "r"(cluster_bar)
               : "memory"));
}
// dst (in the shared memory of a CTA of the cluster) <- `bytes` (a multiple
// of 16) of this CTA's shared memory at src, by the bulk-copy engine; the
// bytes complete on the receiver's mbarrier. The writes that src holds must
// have been ordered before it with fence_proxy_async (and a CTA barrier).
__device__ __forceinline__ void bulk_copy_to_cluster(uint32_t dst, const void* src, uint32_t bytes,
                                                     uint32_t cluster_bar) {
  DDPM_OPS_SM90_ONLY(asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "r"(smem_address(src)), "r"(bytes), "r"(cluster_bar)
      : "memory"));
}
// dst (this CTA's shared memory) <- the box of `map` at coordinates (k, n),
// by the TMA unit; the bytes complete on this CTA's mbarrier at bar, which
// must expect them (the whole box, zero-filled parts included).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int k, int n, uint32_t bar) {
  DDPM_OPS_SM90_ONLY(asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(n), "r"(bar)
      : "memory"));
}
// Orders this thread's earlier shared-memory writes before later reads of
// the asynchronous proxy (the bulk-copy engine).
__device__ __forceinline__ void fence_proxy_async() {
  DDPM_OPS_SM90_ONLY(asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"));
}
// Plain stores into the shared memory of a CTA of the cluster (ordered by
// the next cluster barrier's release).
__device__ __forceinline__ void st_cluster(uint32_t cluster_addr, float v) {
  DDPM_OPS_SM90_ONLY(asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(cluster_addr), "f"(v) : "memory"));
}
__device__ __forceinline__ void st_cluster(uint32_t cluster_addr, float4 v) {
  DDPM_OPS_SM90_ONLY(asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(cluster_addr), "f"(v.x), "f"(v.y),
               "f"(v.z), "f"(v.w)
               : "memory"));
}
// Waits until the phase of `bar` with this parity has completed. CTA scope:
// every phase waited for here completes by data landing in this CTA's shared
// memory (TMA copies, bulk copies and st.async from the cluster), which the
// completion itself makes visible; a cluster-scope acquire would also
// invalidate the L1 cache (CCTL.IVALL) at every wait, for no data of ours.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = smem_address(bar);
  uint32_t done = 0;
  do {
    DDPM_OPS_SM90_ONLY(asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory"));
  } while (!done);
}

__device__ __forceinline__ void st_async(uint32_t cluster_addr, uint4 v, uint32_t cluster_bar) {
  DDPM_OPS_SM90_ONLY(asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                   cluster_addr),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(cluster_bar)
               : "memory"));
}

// Makes this thread's mbarrier initializations visible to the cluster (the
// bytes other CTAs send complete on them).
__device__ __forceinline__ void fence_mbarrier_init() {
  DDPM_OPS_SM90_ONLY(asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"));
}

// Cluster barrier, split: arrive releases this thread's earlier writes
// (local and remote), wait acquires everyone's. All threads execute both.
__device__ __forceinline__ void cluster_arrive() {
  DDPM_OPS_SM90_ONLY(asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"));
}
__device__ __forceinline__ void cluster_wait() {
  DDPM_OPS_SM90_ONLY(asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"));
}
// Every CTA of a cluster of kCs has reached this point (a CTA barrier
// without a cluster).
template <int kCs>
__device__ __forceinline__ void sync_cluster_or_cta() {
  if constexpr (kCs > 1) {
    cluster_arrive();
    cluster_wait();
  } else {
    __syncthreads();
  }
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops

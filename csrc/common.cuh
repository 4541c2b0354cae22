// Shared device helpers for hf_megatron's fused kernels.
//
// Conventions used by every kernel here:
// * Arithmetic is in fp32 ("opmath"), inputs/outputs are float, half or bfloat16.
// * Where PyTorch's eager code rounds an intermediate to the I/O dtype (e.g. `w * x_hat.to(dtype)`),
//   the kernel rounds it the same way (`round_to<T>`), so kernel and fallback agree to the last bit
//   wherever no reduction is involved.
// * Rows are read in 16-byte packs (8 x bf16/fp16, 4 x fp32) when the row length and every pointer
//   allow it; otherwise the same kernel is instantiated with packs of one element.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace hf_megatron {

// float, half and bfloat16 only (the dtypes the Python side sends here).
#define HFM_DISPATCH_FLOATING(TYPE, NAME, ...)                \
  AT_DISPATCH_SWITCH(TYPE, NAME,                              \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// N elements of T loaded/stored as one aligned vector access.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T>
constexpr int kPack = 16 / sizeof(T);  // elements per 16-byte access

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& pack) {
  *reinterpret_cast<Pack<T, N>*>(p) = pack;
}

// Value of `v` after a round trip through T (round to nearest even, as PyTorch's casts).
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// Product as one rounded fp32 multiply: never contracted into an FMA with a later add, because
// PyTorch computes `a * b + c * d` as separate kernels.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }

// Butterfly sum: every lane ends with the same bits (fp addition is commutative, and each
// level adds the same two partial sums in every lane).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32), returned to every thread.
// `scratch` is >= 32 floats of shared memory; safe to call repeatedly with the same scratch.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int num_warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // the previous call's readers are done with scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : 0.f;
  return warp_sum(v);  // every warp reduces the same partials in the same order
}

inline bool is_aligned_16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

inline int round_up_32(int64_t n) { return static_cast<int>((n + 31) / 32 * 32); }

inline int sm_count(int device) {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// Grid for a grid-stride loop over `work` items with `threads` per block: enough blocks to
// fill the GPU several times over, never more than the work needs.
inline unsigned grid_for(int64_t work, int threads, int device) {
  const int64_t needed = (work + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(sm_count(device)) * 32;
  const int64_t blocks = needed < cap ? needed : cap;
  return static_cast<unsigned>(blocks > 0 ? blocks : 1);
}

inline void check_cuda_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
              name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
}

}  // namespace hf_megatron

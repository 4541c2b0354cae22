// Pieces shared by the row-wise norms (rms_norm.cu, layer_norm.cu).
//
// Forward: one block per row. Backward: a persistent grid; block b walks rows b, b + grid, ...
// and accumulates per-column parameter-gradient partials (shared memory when they fit, else its
// own row of the global partial buffer); sum_partials then adds the grid's partials per column
// in a fixed order, so weight/bias gradients are bitwise reproducible (no atomics).
// Partials are laid out pack-major within a segment of `cols` floats: element i of pack p lives
// at i * packs + p, so the 32 lanes of a warp touch 32 consecutive floats.
#pragma once

#include <ATen/ops/empty.h>

#include "common.cuh"

namespace hf_megatron {
namespace norm {

constexpr int kMaxThreads = 512;
constexpr int kReduceRows = 16;  // partial rows summed in parallel by one column of threads

// Threads per row-block: about two packs per thread, one to 16 warps.
inline int threads_for(int64_t packs) {
  const int64_t want = round_up_32((packs + 1) / 2);
  return static_cast<int>(want < 32 ? 32 : (want > kMaxThreads ? kMaxThreads : want));
}

inline void check_rows(const at::Tensor& x, const at::Tensor& param, const char* name) {
  check_cuda_float(x, name);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, ": x must be a contiguous [rows, cols] tensor");
  TORCH_CHECK(x.size(1) > 0, name, ": rows must not be empty");
  TORCH_CHECK(param.dim() == 1 && param.size(0) == x.size(1) && param.is_contiguous(), name,
              ": weight/bias must be contiguous [cols] tensors, cols = ", x.size(1));
  TORCH_CHECK(param.scalar_type() == x.scalar_type() && param.device() == x.device(), name,
              ": weight/bias must have x's dtype and device");
}

// out[col] = sum_b partial[b * row_stride + j], j = col's pack-major index.
// Block (32, kReduceRows): each thread sums a strided subset of partial rows, then one thread
// per column adds the kReduceRows results in order.
template <typename T>
__global__ void sum_partials_kernel(const float* __restrict__ partial, T* __restrict__ out, int64_t num_partials,
                                    int64_t row_stride, int64_t cols, int64_t packs, int pack) {
  __shared__ float tile[kReduceRows][33];
  const int64_t j = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float acc = 0.f;
  if (j < cols) {
    for (int64_t b = threadIdx.y; b < num_partials; b += kReduceRows) acc += partial[b * row_stride + j];
  }
  tile[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && j < cols) {
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < kReduceRows; ++k) total += tile[k][threadIdx.x];
    out[(j % packs) * pack + j / packs] = static_cast<T>(total);
  }
}

// Sums `segments` consecutive pack-major segments of every partial row into outs[0..segments).
template <typename T>
void sum_partials(const at::Tensor& partial, std::initializer_list<at::Tensor*> outs, int64_t cols, int pack,
                  cudaStream_t stream) {
  const dim3 block(32, kReduceRows);
  const unsigned grid = static_cast<unsigned>((cols + 31) / 32);
  int64_t offset = 0;
  for (at::Tensor* out : outs) {
    sum_partials_kernel<T><<<grid, block, 0, stream>>>(partial.data_ptr<float>() + offset, out->data_ptr<T>(),
                                                       partial.size(0), partial.size(1), cols, cols / pack, pack);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    offset += cols;
  }
}

struct PersistentLaunch {
  int64_t grid;      // blocks (<= rows)
  int shared_bytes;  // dynamic shared memory per block (0: partials accumulate in global memory)
};

// Shared memory for `partial_floats` per block when the device allows it (opting in above 48 KB),
// and as many blocks as fit on the device at once, capped by the row count.
template <typename Kernel>
PersistentLaunch persistent_launch(Kernel kernel, int64_t rows, int threads, int64_t partial_floats, int device) {
  int shared_limit = 0;  // largest dynamic shared memory a block may opt into
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&shared_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const int64_t wanted = partial_floats * static_cast<int64_t>(sizeof(float));
  const bool in_shared = wanted + 32 * static_cast<int64_t>(sizeof(float)) <= shared_limit;  // + block_sum scratch
  const int shared_bytes = in_shared ? static_cast<int>(wanted) : 0;
  if (shared_bytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes));
  }
  int blocks_per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, threads, shared_bytes));
  const int64_t resident = static_cast<int64_t>(sm_count(device)) * (blocks_per_sm > 0 ? blocks_per_sm : 1);
  return {rows < resident ? rows : resident, shared_bytes};
}

}  // namespace norm
}  // namespace hf_megatron

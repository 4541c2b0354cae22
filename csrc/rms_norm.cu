// Fused RMSNorm, forward and backward, for x [rows, cols] (row-major) and weight [cols].
//
// Forward (as hf_megatron/model/norms.py and transformers' LlamaRMSNorm):
//   r      = 1 / sqrt(mean_j(x_j^2) + eps)            fp32, saved per row for backward
//   x_hat  = x * r                                      fp32
//   y      = w * round_T(x_hat)                         product in fp32, rounded to T
// Backward, with g = dy * w (fp32):
//   dx     = r * (g - x_hat * mean_j(g_j * x_hat_j))
//   dw     = sum_rows dy * round_T(x_hat)
//
// Forward: one block per row. Backward: a persistent grid; block b walks rows b, b + grid, ...
// and accumulates per-column dw partials (shared memory when they fit, else its
// own row of the global partial buffer); sum_partials then adds the grid's partials per column
// in a fixed order, so weight gradients are bitwise reproducible (no atomics).
// Partials are laid out pack-major in each row of `cols` floats: element i of pack p lives
// at i * packs + p, so the 32 lanes of a warp touch 32 consecutive floats.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>

#include <vector>

#include "common.cuh"

namespace hf_megatron {
namespace {

constexpr int kMaxThreads = 512;
constexpr int kReduceRows = 16;  // partial rows summed in parallel by one column of threads

// Threads per row-block: about two packs per thread, one to 16 warps.
inline int threads_for(int64_t packs) {
  const int64_t want = round_up_32((packs + 1) / 2);
  return static_cast<int>(want < 32 ? 32 : (want > kMaxThreads ? kMaxThreads : want));
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  check_cuda_float(x, "rms_norm");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x must be a contiguous [rows, cols] tensor");
  TORCH_CHECK(x.size(1) > 0, "rms_norm: rows must not be empty");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "rms_norm: weight must be a contiguous [cols] tensor, cols = ", x.size(1));
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.device() == x.device(),
              "rms_norm: weight must have x's dtype and device");
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

// dw = the grid's partial rows summed per column.
template <typename T>
void sum_partials(const at::Tensor& partial, at::Tensor& out, int64_t cols, int pack, cudaStream_t stream) {
  const dim3 block(32, kReduceRows);
  const unsigned grid = static_cast<unsigned>((cols + 31) / 32);
  sum_partials_kernel<T><<<grid, block, 0, stream>>>(partial.data_ptr<float>(), out.data_ptr<T>(), partial.size(0),
                                                     partial.size(1), cols, cols / pack, pack);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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

template <typename T, int N>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ weight,
                                                               T* __restrict__ y, float* __restrict__ rstd,
                                                               int64_t cols, float eps) {
  __shared__ float scratch[32];
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * cols;
  const int64_t packs = cols / N;

  float sum_sq = 0.f;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    const Pack<T, N> xv = load_pack<T, N>(x + offset + p * N);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float v = static_cast<float>(xv.v[i]);
      sum_sq += v * v;
    }
  }
  const float r = rsqrtf(block_sum(sum_sq, scratch) / static_cast<float>(cols) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;

  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    const Pack<T, N> xv = load_pack<T, N>(x + offset + p * N);
    const Pack<T, N> wv = load_pack<T, N>(weight + p * N);
    Pack<T, N> out;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float x_hat = round_to<T>(mul_rn(static_cast<float>(xv.v[i]), r));
      out.v[i] = static_cast<T>(mul_rn(static_cast<float>(wv.v[i]), x_hat));
    }
    store_pack<T, N>(y + offset + p * N, out);
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_backward_kernel(
    const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ weight, const float* __restrict__ rstd,
    T* __restrict__ dx, float* __restrict__ dw_partial, int64_t rows, int64_t cols, bool accumulate_in_shared) {
  extern __shared__ float dw_shared[];
  __shared__ float scratch[32];
  const int64_t packs = cols / N;
  float* dw_acc = accumulate_in_shared ? dw_shared : dw_partial + static_cast<int64_t>(blockIdx.x) * cols;
  // Each thread owns the same packs in every row, so dw_acc needs no synchronisation.
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
#pragma unroll
    for (int i = 0; i < N; ++i) dw_acc[i * packs + p] = 0.f;
  }
  const float inv_cols = 1.f / static_cast<float>(cols);

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t offset = row * cols;
    const float r = rstd[row];

    float dot = 0.f;  // sum_j g_j * x_hat_j
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const Pack<T, N> dyv = load_pack<T, N>(dy + offset + p * N);
      const Pack<T, N> xv = load_pack<T, N>(x + offset + p * N);
      const Pack<T, N> wv = load_pack<T, N>(weight + p * N);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const float g = static_cast<float>(dyv.v[i]) * static_cast<float>(wv.v[i]);
        dot += g * (static_cast<float>(xv.v[i]) * r);
      }
    }
    const float mean_dot = block_sum(dot, scratch) * inv_cols;

    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const Pack<T, N> dyv = load_pack<T, N>(dy + offset + p * N);
      const Pack<T, N> xv = load_pack<T, N>(x + offset + p * N);
      const Pack<T, N> wv = load_pack<T, N>(weight + p * N);
      Pack<T, N> out;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const float dy_i = static_cast<float>(dyv.v[i]);
        const float g = dy_i * static_cast<float>(wv.v[i]);
        const float x_hat = static_cast<float>(xv.v[i]) * r;
        out.v[i] = static_cast<T>(r * (g - x_hat * mean_dot));
        dw_acc[i * packs + p] += dy_i * round_to<T>(mul_rn(static_cast<float>(xv.v[i]), r));
      }
      store_pack<T, N>(dx + offset + p * N, out);
    }
  }

  if (accumulate_in_shared) {
    float* dst = dw_partial + static_cast<int64_t>(blockIdx.x) * cols;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
#pragma unroll
      for (int i = 0; i < N; ++i) dst[i * packs + p] = dw_shared[i * packs + p];
    }
  }
}

template <typename T, int N>
void launch_forward(const at::Tensor& x, const at::Tensor& weight, at::Tensor& y, at::Tensor& rstd, float eps) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const int threads = threads_for(cols / N);
  rms_norm_forward_kernel<T, N><<<static_cast<unsigned>(rows), threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<T>(), weight.data_ptr<T>(), y.data_ptr<T>(), rstd.data_ptr<float>(), cols, eps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int N>
void launch_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rstd,
                     at::Tensor& dx, at::Tensor& dw) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t packs = cols / N;
  const int threads = threads_for(packs);
  const int device = x.get_device();
  auto kernel = rms_norm_backward_kernel<T, N>;
  const PersistentLaunch launch = persistent_launch(kernel, rows, threads, cols, device);
  auto partial = at::empty({launch.grid, cols}, x.options().dtype(at::kFloat));
  auto stream = c10::cuda::getCurrentCUDAStream();
  kernel<<<static_cast<unsigned>(launch.grid), threads, launch.shared_bytes, stream>>>(
      dy.data_ptr<T>(), x.data_ptr<T>(), weight.data_ptr<T>(), rstd.data_ptr<float>(), dx.data_ptr<T>(),
      partial.data_ptr<float>(), rows, cols, launch.shared_bytes > 0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  sum_partials<T>(partial, dw, cols, N, stream);
}

}  // namespace

// Returns {y [rows, cols], rstd [rows] fp32}.
std::vector<at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty_like(x);
  auto rstd = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  if (x.size(0) == 0) return {y, rstd};
  HFM_DISPATCH_FLOATING(x.scalar_type(), "rms_norm_forward", [&] {
    constexpr int N = kPack<scalar_t>;
    const bool vec = x.size(1) % N == 0 && is_aligned_16(x.data_ptr()) && is_aligned_16(weight.data_ptr()) &&
                     is_aligned_16(y.data_ptr());
    if (vec) {
      launch_forward<scalar_t, N>(x, weight, y, rstd, static_cast<float>(eps));
    } else {
      launch_forward<scalar_t, 1>(x, weight, y, rstd, static_cast<float>(eps));
    }
  });
  return {y, rstd};
}

// Returns {dx [rows, cols], dw [cols]}.
std::vector<at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                                          const at::Tensor& rstd) {
  check_rows(x, weight);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.is_contiguous() && dy.scalar_type() == x.scalar_type() &&
                  dy.device() == x.device(),
              "rms_norm: dy must be contiguous with x's shape, dtype and device");
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.numel() == x.size(0) && rstd.is_contiguous(),
              "rms_norm: rstd must be the fp32 [rows] tensor saved by forward");
  const c10::cuda::CUDAGuard guard(x.device());
  auto dx = at::empty_like(x);
  if (x.size(0) == 0) return {dx, at::zeros_like(weight)};
  auto dw = at::empty_like(weight);
  HFM_DISPATCH_FLOATING(x.scalar_type(), "rms_norm_backward", [&] {
    constexpr int N = kPack<scalar_t>;
    const bool vec = x.size(1) % N == 0 && is_aligned_16(dy.data_ptr()) && is_aligned_16(x.data_ptr()) &&
                     is_aligned_16(weight.data_ptr()) && is_aligned_16(dx.data_ptr());
    if (vec) {
      launch_backward<scalar_t, N>(dy, x, weight, rstd, dx, dw);
    } else {
      launch_backward<scalar_t, 1>(dy, x, weight, rstd, dx, dw);
    }
  });
  return {dx, dw};
}

}  // namespace hf_megatron

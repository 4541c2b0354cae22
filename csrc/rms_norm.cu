// Fused RMSNorm, forward and backward, for x [rows, cols] (row-major) and weight [cols].
//
// Forward (as hf_megatron/model/norms.py and transformers' LlamaRMSNorm):
//   r      = 1 / sqrt(mean_j(x_j^2) + eps)            fp32, saved per row for backward
//   x_hat  = x * r                                      fp32
//   y      = w * round_T(x_hat)                         product in fp32, rounded to T
// Backward, with g = dy * w (fp32):
//   dx     = r * (g - x_hat * mean_j(g_j * x_hat_j))
//   dw     = sum_rows dy * round_T(x_hat)
// Launch scheme and deterministic dw: norm_common.cuh.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>

#include <vector>

#include "norm_common.cuh"

namespace hf_megatron {
namespace {

using norm::kMaxThreads;
using norm::threads_for;

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
  const norm::PersistentLaunch launch = norm::persistent_launch(kernel, rows, threads, cols, device);
  auto partial = at::empty({launch.grid, cols}, x.options().dtype(at::kFloat));
  auto stream = c10::cuda::getCurrentCUDAStream();
  kernel<<<static_cast<unsigned>(launch.grid), threads, launch.shared_bytes, stream>>>(
      dy.data_ptr<T>(), x.data_ptr<T>(), weight.data_ptr<T>(), rstd.data_ptr<float>(), dx.data_ptr<T>(),
      partial.data_ptr<float>(), rows, cols, launch.shared_bytes > 0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  norm::sum_partials<T>(partial, {&dw}, cols, N, stream);
}

}  // namespace

// Returns {y [rows, cols], rstd [rows] fp32}.
std::vector<at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps) {
  norm::check_rows(x, weight, "rms_norm");
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
  norm::check_rows(x, weight, "rms_norm");
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

// Fused LayerNorm, forward and backward, for x [rows, cols] (row-major), weight and bias [cols].
//
// Forward (as torch.nn.functional.layer_norm, biased variance, fp32 statistics):
//   mu = mean_j(x_j),  r = 1 / sqrt(mean_j((x_j - mu)^2) + eps)       saved per row (fp32)
//   y  = (x - mu) * r * w + b                                           fp32, rounded once to T
// Backward, with x_hat = (x - mu) * r and g = dy * w:
//   dx = r * (g - mean_j(g_j) - x_hat * mean_j(g_j * x_hat_j))
//   dw = sum_rows dy * x_hat,   db = sum_rows dy
// Launch scheme and deterministic dw/db: norm_common.cuh (partials: dw segment, then db segment).
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
__global__ void __launch_bounds__(kMaxThreads)
    layer_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ bias,
                              T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                              int64_t cols, float eps) {
  __shared__ float scratch[32];
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * cols;
  const int64_t packs = cols / N;
  const float inv_cols = 1.f / static_cast<float>(cols);

  float sum = 0.f;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    const Pack<T, N> xv = load_pack<T, N>(x + offset + p * N);
#pragma unroll
    for (int i = 0; i < N; ++i) sum += static_cast<float>(xv.v[i]);
  }
  const float mean = block_sum(sum, scratch) * inv_cols;

  float sum_sq = 0.f;  // second pass over the (cached) row: no cancellation from E[x^2] - E[x]^2
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    const Pack<T, N> xv = load_pack<T, N>(x + offset + p * N);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float d = static_cast<float>(xv.v[i]) - mean;
      sum_sq += d * d;
    }
  }
  const float r = rsqrtf(block_sum(sum_sq, scratch) * inv_cols + eps);
  if (threadIdx.x == 0) {
    mean_out[blockIdx.x] = mean;
    rstd_out[blockIdx.x] = r;
  }

  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    const Pack<T, N> xv = load_pack<T, N>(x + offset + p * N);
    const Pack<T, N> wv = load_pack<T, N>(weight + p * N);
    const Pack<T, N> bv = load_pack<T, N>(bias + p * N);
    Pack<T, N> out;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float x_hat = (static_cast<float>(xv.v[i]) - mean) * r;
      out.v[i] = static_cast<T>(x_hat * static_cast<float>(wv.v[i]) + static_cast<float>(bv.v[i]));
    }
    store_pack<T, N>(y + offset + p * N, out);
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kMaxThreads) layer_norm_backward_kernel(
    const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ weight, const float* __restrict__ mean,
    const float* __restrict__ rstd, T* __restrict__ dx, float* __restrict__ partial, int64_t rows, int64_t cols,
    bool accumulate_in_shared) {
  extern __shared__ float shared_partial[];  // [2 * cols]: dw then db, pack-major
  __shared__ float scratch[32];
  const int64_t packs = cols / N;
  float* dw_acc = accumulate_in_shared ? shared_partial : partial + static_cast<int64_t>(blockIdx.x) * 2 * cols;
  float* db_acc = dw_acc + cols;
  // Each thread owns the same packs in every row, so the accumulators need no synchronisation.
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
#pragma unroll
    for (int i = 0; i < N; ++i) dw_acc[i * packs + p] = db_acc[i * packs + p] = 0.f;
  }
  const float inv_cols = 1.f / static_cast<float>(cols);

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t offset = row * cols;
    const float mu = mean[row], r = rstd[row];

    float sum_g = 0.f, sum_g_xhat = 0.f;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const Pack<T, N> dyv = load_pack<T, N>(dy + offset + p * N);
      const Pack<T, N> xv = load_pack<T, N>(x + offset + p * N);
      const Pack<T, N> wv = load_pack<T, N>(weight + p * N);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const float g = static_cast<float>(dyv.v[i]) * static_cast<float>(wv.v[i]);
        sum_g += g;
        sum_g_xhat += g * ((static_cast<float>(xv.v[i]) - mu) * r);
      }
    }
    const float mean_g = block_sum(sum_g, scratch) * inv_cols;
    const float mean_g_xhat = block_sum(sum_g_xhat, scratch) * inv_cols;

    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const Pack<T, N> dyv = load_pack<T, N>(dy + offset + p * N);
      const Pack<T, N> xv = load_pack<T, N>(x + offset + p * N);
      const Pack<T, N> wv = load_pack<T, N>(weight + p * N);
      Pack<T, N> out;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const float dy_i = static_cast<float>(dyv.v[i]);
        const float x_hat = (static_cast<float>(xv.v[i]) - mu) * r;
        const float g = dy_i * static_cast<float>(wv.v[i]);
        out.v[i] = static_cast<T>(r * (g - mean_g - x_hat * mean_g_xhat));
        dw_acc[i * packs + p] += dy_i * x_hat;
        db_acc[i * packs + p] += dy_i;
      }
      store_pack<T, N>(dx + offset + p * N, out);
    }
  }

  if (accumulate_in_shared) {
    float* dst = partial + static_cast<int64_t>(blockIdx.x) * 2 * cols;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        dst[i * packs + p] = shared_partial[i * packs + p];
        dst[cols + i * packs + p] = shared_partial[cols + i * packs + p];
      }
    }
  }
}

template <typename T, int N>
void launch_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, at::Tensor& y,
                    at::Tensor& mean, at::Tensor& rstd, float eps) {
  const int64_t rows = x.size(0), cols = x.size(1);
  layer_norm_forward_kernel<T, N>
      <<<static_cast<unsigned>(rows), threads_for(cols / N), 0, c10::cuda::getCurrentCUDAStream()>>>(
          x.data_ptr<T>(), weight.data_ptr<T>(), bias.data_ptr<T>(), y.data_ptr<T>(), mean.data_ptr<float>(),
          rstd.data_ptr<float>(), cols, eps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int N>
void launch_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& mean,
                     const at::Tensor& rstd, at::Tensor& dx, at::Tensor& dw, at::Tensor& db) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const int threads = threads_for(cols / N);
  auto kernel = layer_norm_backward_kernel<T, N>;
  const norm::PersistentLaunch launch = norm::persistent_launch(kernel, rows, threads, 2 * cols, x.get_device());
  auto partial = at::empty({launch.grid, 2 * cols}, x.options().dtype(at::kFloat));
  auto stream = c10::cuda::getCurrentCUDAStream();
  kernel<<<static_cast<unsigned>(launch.grid), threads, launch.shared_bytes, stream>>>(
      dy.data_ptr<T>(), x.data_ptr<T>(), weight.data_ptr<T>(), mean.data_ptr<float>(), rstd.data_ptr<float>(),
      dx.data_ptr<T>(), partial.data_ptr<float>(), rows, cols, launch.shared_bytes > 0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  norm::sum_partials<T>(partial, {&dw, &db}, cols, N, stream);
}

}  // namespace

// Returns {y [rows, cols], mean [rows] fp32, rstd [rows] fp32}.
std::vector<at::Tensor> layer_norm_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                           double eps) {
  norm::check_rows(x, weight, "layer_norm");
  norm::check_rows(x, bias, "layer_norm");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty_like(x);
  auto mean = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  if (x.size(0) == 0) return {y, mean, rstd};
  HFM_DISPATCH_FLOATING(x.scalar_type(), "layer_norm_forward", [&] {
    constexpr int N = kPack<scalar_t>;
    const bool vec = x.size(1) % N == 0 && is_aligned_16(x.data_ptr()) && is_aligned_16(weight.data_ptr()) &&
                     is_aligned_16(bias.data_ptr()) && is_aligned_16(y.data_ptr());
    if (vec) {
      launch_forward<scalar_t, N>(x, weight, bias, y, mean, rstd, static_cast<float>(eps));
    } else {
      launch_forward<scalar_t, 1>(x, weight, bias, y, mean, rstd, static_cast<float>(eps));
    }
  });
  return {y, mean, rstd};
}

// Returns {dx [rows, cols], dw [cols], db [cols]}.
std::vector<at::Tensor> layer_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                                            const at::Tensor& mean, const at::Tensor& rstd) {
  norm::check_rows(x, weight, "layer_norm");
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.is_contiguous() && dy.scalar_type() == x.scalar_type() &&
                  dy.device() == x.device(),
              "layer_norm: dy must be contiguous with x's shape, dtype and device");
  for (const at::Tensor* stat : {&mean, &rstd}) {
    TORCH_CHECK(stat->scalar_type() == at::kFloat && stat->numel() == x.size(0) && stat->is_contiguous(),
                "layer_norm: mean/rstd must be the fp32 [rows] tensors saved by forward");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  auto dx = at::empty_like(x);
  if (x.size(0) == 0) return {dx, at::zeros_like(weight), at::zeros_like(weight)};
  auto dw = at::empty_like(weight);
  auto db = at::empty_like(weight);
  HFM_DISPATCH_FLOATING(x.scalar_type(), "layer_norm_backward", [&] {
    constexpr int N = kPack<scalar_t>;
    const bool vec = x.size(1) % N == 0 && is_aligned_16(dy.data_ptr()) && is_aligned_16(x.data_ptr()) &&
                     is_aligned_16(weight.data_ptr()) && is_aligned_16(dx.data_ptr());
    if (vec) {
      launch_backward<scalar_t, N>(dy, x, weight, mean, rstd, dx, dw, db);
    } else {
      launch_backward<scalar_t, 1>(dy, x, weight, mean, rstd, dx, dw, db);
    }
  });
  return {dx, dw, db};
}

}  // namespace hf_megatron

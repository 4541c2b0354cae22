// Fused SwiGLU on the fc1 output x = [gate; up] (last dim 2F, row-major [rows, 2F]).
//
// Forward:   y = round_T(silu(gate)) * up,  silu(g) = g / (1 + exp(-g))   -> [rows, F]
// Backward (only x is saved; silu is recomputed):
//   d_up   = dy * round_T(silu(gate))
//   d_gate = round_T(dy * up) * sigma * (1 + gate * (1 - sigma)),  sigma = 1 / (1 + exp(-gate))
// Each intermediate is rounded where PyTorch's eager `F.silu(gate) * up` rounds it, with the same
// fp32 formulas as PyTorch's silu kernels, so the kernel reproduces eager results bit for bit.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "common.cuh"

namespace hf_megatron {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float sigmoid(float g) { return 1.f / (1.f + expf(-g)); }
__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

// Grid-stride loop over packs of N output columns. Forward: out = y [rows, F] (dy unused).
// Backward: out = dx [rows, 2F].
template <typename T, int N, bool kBackward>
__global__ void swiglu_kernel(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ out, int64_t rows,
                              int64_t half) {
  const int64_t packs_per_row = half / N;
  const int64_t total = rows * packs_per_row;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / packs_per_row;
    const int64_t col = (idx - row * packs_per_row) * N;
    const int64_t in_offset = row * 2 * half + col;
    const Pack<T, N> gate = load_pack<T, N>(x + in_offset);
    const Pack<T, N> up = load_pack<T, N>(x + in_offset + half);
    if constexpr (kBackward) {
      const Pack<T, N> grad = load_pack<T, N>(dy + row * half + col);
      Pack<T, N> d_gate, d_up;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const float g = static_cast<float>(gate.v[i]);
        const float dy_i = static_cast<float>(grad.v[i]);
        d_up.v[i] = static_cast<T>(mul_rn(dy_i, round_to<T>(silu(g))));
        const float d_act = round_to<T>(mul_rn(dy_i, static_cast<float>(up.v[i])));
        const float sig = sigmoid(g);
        d_gate.v[i] = static_cast<T>(d_act * sig * (1.f + g * (1.f - sig)));
      }
      store_pack<T, N>(out + in_offset, d_gate);
      store_pack<T, N>(out + in_offset + half, d_up);
    } else {
      Pack<T, N> y;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const float act = round_to<T>(silu(static_cast<float>(gate.v[i])));
        y.v[i] = static_cast<T>(mul_rn(act, static_cast<float>(up.v[i])));
      }
      store_pack<T, N>(out + row * half + col, y);
    }
  }
}

template <bool kBackward>
void launch(const at::Tensor& x, const at::Tensor* dy, at::Tensor& out) {
  const int64_t rows = x.size(0), half = x.size(1) / 2;
  HFM_DISPATCH_FLOATING(x.scalar_type(), "swiglu", [&] {
    constexpr int N = kPack<scalar_t>;
    const scalar_t* dy_ptr = dy != nullptr ? dy->data_ptr<scalar_t>() : nullptr;
    const bool vec = half % N == 0 && is_aligned_16(x.data_ptr()) && is_aligned_16(out.data_ptr()) &&
                     (dy == nullptr || is_aligned_16(dy_ptr));
    const auto stream = c10::cuda::getCurrentCUDAStream();
    if (vec) {
      const unsigned grid = grid_for(rows * (half / N), kThreads, x.get_device());
      swiglu_kernel<scalar_t, N, kBackward><<<grid, kThreads, 0, stream>>>(
          x.data_ptr<scalar_t>(), dy_ptr, out.data_ptr<scalar_t>(), rows, half);
    } else {
      const unsigned grid = grid_for(rows * half, kThreads, x.get_device());
      swiglu_kernel<scalar_t, 1, kBackward><<<grid, kThreads, 0, stream>>>(
          x.data_ptr<scalar_t>(), dy_ptr, out.data_ptr<scalar_t>(), rows, half);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void check_input(const at::Tensor& x) {
  check_cuda_float(x, "swiglu: x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "swiglu: x must be a contiguous [rows, 2F] tensor");
  TORCH_CHECK(x.size(1) % 2 == 0, "swiglu: last dim must be even ([gate; up]), got ", x.size(1));
}

}  // namespace

// x [rows, 2F] -> y [rows, F]
at::Tensor swiglu_forward(const at::Tensor& x) {
  check_input(x);
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (y.numel() > 0) launch<false>(x, nullptr, y);
  return y;
}

// dy [rows, F], x [rows, 2F] -> dx [rows, 2F]
at::Tensor swiglu_backward(const at::Tensor& dy, const at::Tensor& x) {
  check_input(x);
  TORCH_CHECK(dy.dim() == 2 && dy.size(0) == x.size(0) && dy.size(1) == x.size(1) / 2 && dy.is_contiguous() &&
                  dy.scalar_type() == x.scalar_type() && dy.device() == x.device(),
              "swiglu: dy must be a contiguous [rows, F] tensor with x's dtype and device");
  const c10::cuda::CUDAGuard guard(x.device());
  auto dx = at::empty_like(x);
  if (dx.numel() > 0) launch<true>(x, &dy, dx);
  return dx;
}

}  // namespace hf_megatron

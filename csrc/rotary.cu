// Fused rotary position embedding (non-interleaved "rotate half"), forward and backward.
//
// x [B, H, S, D] (any strides over B, H, S; the last dim contiguous), cos/sin [Bc, S, D] contiguous
// with Bc = B or 1 (broadcast over the batch). With h = D/2 and i < h:
// Forward   y  = x * cos + rotate_half(x) * sin,  rotate_half(x) = [-x[h:], x[:h]]
//   y[i]     = x[i] cos[i]       - x[i+h] sin[i]
//   y[i+h]   = x[i+h] cos[i+h]   + x[i] sin[i+h]
// Backward  dx = g * cos - rotate_half(g * sin)       (rotate_half^T = -rotate_half)
//   dx[i]    = g[i] cos[i]       + g[i+h] sin[i+h]
//   dx[i+h]  = g[i+h] cos[i+h]   - g[i] sin[i]
// Each product and the sum are rounded to T as PyTorch's eager ops round them (separate
// multiply and add kernels, no FMA), so results match the fallback bit for bit.
// Output is a new contiguous [B, H, S, D] tensor.
#include <ATen/ops/empty.h>

#include "common.cuh"

namespace hf_megatron {
namespace {

constexpr int kThreads = 256;

struct RotaryShape {
  int64_t seq, dim;                        // S, D
  int64_t x_batch, x_head, x_seq;          // x strides (elements) over B, H, S
  int64_t table_batch;                     // cos/sin batch stride: S * D, or 0 when broadcast
};

// grid (ceil(S / blockDim.y), H, B); block (threads over the packs of half a row, positions).
template <typename T, int N, bool kBackward>
__global__ void rotary_kernel(const T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin,
                              T* __restrict__ y, RotaryShape shape) {
  const int64_t pos = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (pos >= shape.seq) return;
  const int64_t batch = blockIdx.z, head = blockIdx.y;
  const int64_t half = shape.dim / 2;
  const T* x_row = x + batch * shape.x_batch + head * shape.x_head + pos * shape.x_seq;
  const int64_t table_offset = batch * shape.table_batch + pos * shape.dim;
  T* y_row = y + ((batch * gridDim.y + head) * shape.seq + pos) * shape.dim;

  for (int64_t col = static_cast<int64_t>(threadIdx.x) * N; col < half; col += static_cast<int64_t>(blockDim.x) * N) {
    const Pack<T, N> a1 = load_pack<T, N>(x_row + col);
    const Pack<T, N> a2 = load_pack<T, N>(x_row + col + half);
    const Pack<T, N> c1 = load_pack<T, N>(cos + table_offset + col);
    const Pack<T, N> c2 = load_pack<T, N>(cos + table_offset + col + half);
    const Pack<T, N> s1 = load_pack<T, N>(sin + table_offset + col);
    const Pack<T, N> s2 = load_pack<T, N>(sin + table_offset + col + half);
    Pack<T, N> out1, out2;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float v1 = static_cast<float>(a1.v[i]), v2 = static_cast<float>(a2.v[i]);
      const float cos1 = static_cast<float>(c1.v[i]), cos2 = static_cast<float>(c2.v[i]);
      const float sin1 = static_cast<float>(s1.v[i]), sin2 = static_cast<float>(s2.v[i]);
      const float first_cos = round_to<T>(mul_rn(v1, cos1));
      const float second_cos = round_to<T>(mul_rn(v2, cos2));
      if (kBackward) {
        out1.v[i] = static_cast<T>(add_rn(first_cos, round_to<T>(mul_rn(v2, sin2))));
        out2.v[i] = static_cast<T>(add_rn(second_cos, -round_to<T>(mul_rn(v1, sin1))));
      } else {
        out1.v[i] = static_cast<T>(add_rn(first_cos, round_to<T>(mul_rn(-v2, sin1))));
        out2.v[i] = static_cast<T>(add_rn(second_cos, round_to<T>(mul_rn(v1, sin2))));
      }
    }
    store_pack<T, N>(y_row + col, out1);
    store_pack<T, N>(y_row + col + half, out2);
  }
}

template <typename T, int N, bool kBackward>
void launch(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& y,
            const RotaryShape& shape) {
  const int64_t packs = shape.dim / 2 / N;
  const int threads_x = static_cast<int>(packs < kThreads ? packs : kThreads);
  const int threads_y = kThreads / threads_x;
  const dim3 block(threads_x, threads_y);
  const dim3 grid(static_cast<unsigned>((shape.seq + threads_y - 1) / threads_y), static_cast<unsigned>(x.size(1)),
                  static_cast<unsigned>(x.size(0)));
  rotary_kernel<T, N, kBackward><<<grid, block, 0, c10::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), y.data_ptr<T>(), shape);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool kBackward>
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_cuda_float(x, "apply_rotary: x");
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1, "apply_rotary: x must be [b, heads, s, d] with contiguous d");
  const int64_t batch = x.size(0), heads = x.size(1), seq = x.size(2), dim = x.size(3);
  TORCH_CHECK(dim % 2 == 0, "apply_rotary: head dim must be even, got ", dim);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 3 && (t->size(0) == batch || t->size(0) == 1) && t->size(1) == seq &&
                    t->size(2) == dim && t->is_contiguous(),
                "apply_rotary: cos/sin must be contiguous [b or 1, s, d] matching x");
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->device() == x.device(),
                "apply_rotary: cos/sin must have x's dtype and device");
  }
  TORCH_CHECK(heads <= 65535 && batch <= 65535, "apply_rotary: at most 65535 heads and batch entries");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty({batch, heads, seq, dim}, x.options());
  if (y.numel() == 0) return y;
  const RotaryShape shape{seq, dim, x.stride(0), x.stride(1), x.stride(2), cos.size(0) == 1 ? 0 : seq * dim};
  HFM_DISPATCH_FLOATING(x.scalar_type(), "apply_rotary", [&] {
    constexpr int N = kPack<scalar_t>;
    const bool vec = (dim / 2) % N == 0 && shape.x_batch % N == 0 && shape.x_head % N == 0 &&
                     shape.x_seq % N == 0 && is_aligned_16(x.data_ptr()) && is_aligned_16(cos.data_ptr()) &&
                     is_aligned_16(sin.data_ptr()) && is_aligned_16(y.data_ptr());
    if (vec) {
      launch<scalar_t, N, kBackward>(x, cos, sin, y, shape);
    } else {
      launch<scalar_t, 1, kBackward>(x, cos, sin, y, shape);
    }
  });
  return y;
}

}  // namespace

// x [b, heads, s, d], cos/sin [b or 1, s, d] -> x * cos + rotate_half(x) * sin, contiguous.
at::Tensor rotary_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rotary<false>(x, cos, sin);
}

// dy [b, heads, s, d] -> dx = dy * cos - rotate_half(dy * sin), contiguous.
at::Tensor rotary_backward(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin) {
  return rotary<true>(dy, cos, sin);
}

}  // namespace hf_megatron

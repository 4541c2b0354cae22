// Fused cross entropy over the rows of logits z [rows, width] (row-major; width = the padded
// vocabulary, only the first `vocab` columns are classes), all arithmetic in fp32:
//
// Forward (one block per row, one read of the row):
//   lse  = m + log(sum_j exp(z_j - m)),  j < vocab,  m = max_j z_j (kept online, per pack)
//   loss = lse - z[target]                0 where target == ignore_index
// Backward (one block per row, one read and one write of the row):
//   dz_j = g * (exp(z_j - lse) - [j == target])   j < vocab
//   dz_j = 0                                      j >= vocab (padding), and every j of an ignored row
//   rounded once to z's dtype; dz may be z's own buffer (each thread reads a pack, then writes it).
//
// As PyTorch's `F.cross_entropy(z[:, :vocab].float(), t, ignore_index=i, reduction="none")` and its
// backward through the fp32 upcast, without the fp32 copy of the logits: one pass for the loss, one
// for the gradient.  A target outside [0, vocab) trips a device-side assert, as in PyTorch's kernel.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/macros/Macros.h>

#include <cmath>
#include <vector>

#include "common.cuh"

namespace hf_megatron {
namespace {

constexpr int kThreads = 512;
// packs a thread loads before it uses any (bytes in flight), few enough that three blocks fit an SM's
// register file
constexpr int kUnroll = 2;
constexpr int64_t kMaxWidth = 2147483647 - 65536;  // int column indices, with room for a step past the end

// Running (max, sum of exp(z - max)) of a set of logits.
struct MaxSum {
  float m;
  float s;
};

// The pair for the union of two sets.  A set whose max is -inf contributes exp(-inf) = 0; a NaN
// anywhere makes the sum NaN (fmaxf drops NaN from the max, the sum keeps it).
__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, a.s + b.s};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

// Fold `n` logits (already in fp32) into the running pair.
template <int N>
__device__ __forceinline__ MaxSum fold(MaxSum acc, const float (&v)[N], int n) {
  float block_max = -INFINITY;
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (i < n) block_max = fmaxf(block_max, v[i]);
  const float m = fmaxf(acc.m, block_max);
  if (m == -INFINITY) {  // every logit so far is -inf (or NaN, which the sum below would carry)
    float s = acc.s;
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (i < n && v[i] != v[i]) s = v[i];
    return {m, s};
  }
  float s = acc.s * expf(acc.m - m);
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (i < n) s += expf(v[i] - m);
  return {m, s};
}

__device__ __forceinline__ MaxSum warp_combine(MaxSum v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const MaxSum other{__shfl_xor_sync(0xffffffffu, v.m, offset), __shfl_xor_sync(0xffffffffu, v.s, offset)};
    v = combine(v, other);
  }
  return v;
}

// The U packs at base, base + step, ... that start below `limit` (the rest are left unset).
// Columns are int: check_rows keeps the width below 2^31.
template <typename T, int N, int U>
__device__ __forceinline__ void load_packs(Pack<T, N> (&packs)[U], const T* z, int base, int step, int limit) {
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (base + u * step < limit) packs[u] = load_pack<T, N>(z + base + u * step);
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads, 3)
    cross_entropy_forward_kernel(const T* __restrict__ logits, const int64_t* __restrict__ targets,
                                 float* __restrict__ loss, float* __restrict__ lse, int width, int vocab,
                                 int64_t ignore_index) {
  __shared__ MaxSum partial[kThreads / 32];
  const int64_t row = blockIdx.x;
  const T* z = logits + row * width;
  MaxSum acc{-INFINITY, 0.f};

  const int full = vocab / N * N;  // columns in whole packs of classes
  const int step = blockDim.x * N;
  for (int base = threadIdx.x * N; base < full; base += step * kUnroll) {
    Pack<T, N> packs[kUnroll];
    load_packs<T, N, kUnroll>(packs, z, base, step, full);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * step >= full) break;
      float v[N];
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] = static_cast<float>(packs[u].v[i]);
      acc = fold<N>(acc, v, N);
    }
  }
  for (int col = full + threadIdx.x; col < vocab; col += blockDim.x) {  // the last partial pack
    const float v[1] = {static_cast<float>(z[col])};
    acc = fold<1>(acc, v, 1);
  }

  acc = warp_combine(acc);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) partial[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < static_cast<int>(blockDim.x >> 5) ? partial[lane] : MaxSum{-INFINITY, 0.f};
    acc = warp_combine(acc);
    if (lane == 0) {
      const float row_lse = acc.m + logf(acc.s);
      const int64_t target = targets[row];
      float row_loss = 0.f;
      if (target != ignore_index) {
        CUDA_KERNEL_ASSERT(target >= 0 && target < vocab && "cross_entropy: target out of bounds");
        row_loss = row_lse - static_cast<float>(z[target]);
      }
      loss[row] = row_loss;
      lse[row] = row_lse;
    }
  }
}

// grad: fp32, element `row * grad_stride` is row's upstream gradient (stride 0: one value for all).
// logits and out may be the same buffer.
template <typename T, int N>
__global__ void __launch_bounds__(kThreads, 3)
    cross_entropy_backward_kernel(const float* __restrict__ grad, int64_t grad_stride, const T* logits,
                                  const int64_t* __restrict__ targets, const float* __restrict__ lse, T* out,
                                  int width, int vocab, int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const int64_t target64 = targets[row];
  T* dz = out + row * width;
  const int step = blockDim.x * N;
  if (target64 == ignore_index) {  // an ignored row: no gradient, nothing to read
    Pack<T, N> zero;
#pragma unroll
    for (int i = 0; i < N; ++i) zero.v[i] = static_cast<T>(0.f);
    for (int base = threadIdx.x * N; base < width; base += step) store_pack<T, N>(dz + base, zero);
    return;
  }
  const int target = static_cast<int>(target64);  // in [0, vocab): the forward asserted it
  const float g = grad[row * grad_stride];
  const float row_lse = lse[row];
  const T* z = logits + row * width;
  for (int base = threadIdx.x * N; base < width; base += step * kUnroll) {
    Pack<T, N> packs[kUnroll];
    load_packs<T, N, kUnroll>(packs, z, base, step, width);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int col0 = base + u * step;
      if (col0 >= width) break;
      Pack<T, N> d;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int col = col0 + i;
        float value = col < vocab ? g * expf(static_cast<float>(packs[u].v[i]) - row_lse) : 0.f;
        if (col == target) value -= g;
        d.v[i] = static_cast<T>(value);
      }
      store_pack<T, N>(dz + col0, d);
    }
  }
}

void check_rows(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab) {
  check_cuda_float(logits, "cross_entropy: logits");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "cross_entropy: logits must be a contiguous [rows, V] tensor");
  TORCH_CHECK(vocab > 0 && vocab <= logits.size(1), "cross_entropy: vocab must be in [1, ", logits.size(1), "], got ",
              vocab);
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0) && targets.is_contiguous() &&
                  targets.scalar_type() == at::kLong && targets.device() == logits.device(),
              "cross_entropy: targets must be a contiguous int64 [rows] tensor on the logits' device");
  TORCH_CHECK(logits.size(0) <= 2147483647 && logits.size(1) <= kMaxWidth,
              "cross_entropy: at most 2^31 - 1 rows and ", kMaxWidth, " columns");
}

template <typename T>
bool vectorizable(const at::Tensor& a, const at::Tensor& b) {
  return a.size(1) % kPack<T> == 0 && is_aligned_16(a.data_ptr()) && is_aligned_16(b.data_ptr());
}

}  // namespace

// logits [rows, width], targets int64 [rows] -> (loss fp32 [rows], lse fp32 [rows])
std::vector<at::Tensor> cross_entropy_forward(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab,
                                              int64_t ignore_index) {
  check_rows(logits, targets, vocab);
  const c10::cuda::CUDAGuard guard(logits.device());
  auto loss = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  auto lse = at::empty_like(loss);
  if (logits.size(0) == 0) return {loss, lse};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const unsigned rows = static_cast<unsigned>(logits.size(0));
  const int width = static_cast<int>(logits.size(1));
  HFM_DISPATCH_FLOATING(logits.scalar_type(), "cross_entropy_forward", [&] {
    const auto* z = logits.data_ptr<scalar_t>();
    const auto* t = targets.data_ptr<int64_t>();
    if (vectorizable<scalar_t>(logits, logits)) {
      cross_entropy_forward_kernel<scalar_t, kPack<scalar_t>><<<rows, kThreads, 0, stream>>>(
          z, t, loss.data_ptr<float>(), lse.data_ptr<float>(), width, static_cast<int>(vocab), ignore_index);
    } else {
      cross_entropy_forward_kernel<scalar_t, 1><<<rows, kThreads, 0, stream>>>(
          z, t, loss.data_ptr<float>(), lse.data_ptr<float>(), width, static_cast<int>(vocab), ignore_index);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {loss, lse};
}

// grad fp32 [rows] (any stride), logits, targets, lse (from the forward); out: the tensor to write the
// gradient into (logits itself, or none: a new tensor) -> d logits [rows, width]
at::Tensor cross_entropy_backward(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& targets,
                                  const at::Tensor& lse, int64_t vocab, int64_t ignore_index,
                                  const c10::optional<at::Tensor>& out) {
  check_rows(logits, targets, vocab);
  TORCH_CHECK(grad.dim() == 1 && grad.size(0) == logits.size(0) && grad.scalar_type() == at::kFloat &&
                  grad.device() == logits.device(),
              "cross_entropy: grad must be a float32 [rows] tensor on the logits' device");
  TORCH_CHECK(lse.dim() == 1 && lse.size(0) == logits.size(0) && lse.is_contiguous() &&
                  lse.scalar_type() == at::kFloat && lse.device() == logits.device(),
              "cross_entropy: lse must be the forward's float32 [rows] tensor");
  at::Tensor dz;
  if (out.has_value()) {
    dz = *out;
    TORCH_CHECK(dz.sizes() == logits.sizes() && dz.is_contiguous() && dz.scalar_type() == logits.scalar_type() &&
                    dz.device() == logits.device(),
                "cross_entropy: out must be a contiguous tensor of the logits' shape, dtype and device");
  } else {
    dz = at::empty_like(logits);
  }
  if (logits.size(0) == 0) return dz;
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const unsigned rows = static_cast<unsigned>(logits.size(0));
  const int64_t grad_stride = grad.size(0) > 1 ? grad.stride(0) : 0;
  const int width = static_cast<int>(logits.size(1));
  HFM_DISPATCH_FLOATING(logits.scalar_type(), "cross_entropy_backward", [&] {
    const auto* z = logits.data_ptr<scalar_t>();
    auto* d = dz.data_ptr<scalar_t>();
    const auto* t = targets.data_ptr<int64_t>();
    if (vectorizable<scalar_t>(logits, dz)) {
      cross_entropy_backward_kernel<scalar_t, kPack<scalar_t>><<<rows, kThreads, 0, stream>>>(
          grad.data_ptr<float>(), grad_stride, z, t, lse.data_ptr<float>(), d, width, static_cast<int>(vocab), ignore_index);
    } else {
      cross_entropy_backward_kernel<scalar_t, 1><<<rows, kThreads, 0, stream>>>(
          grad.data_ptr<float>(), grad_stride, z, t, lse.data_ptr<float>(), d, width, static_cast<int>(vocab), ignore_index);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return dz;
}

}  // namespace hf_megatron

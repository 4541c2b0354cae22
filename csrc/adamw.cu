// Multi-tensor AdamW on fp32 main weights, and the fp64 sum of squares of a tensor list.
//
// One launch steps a list of tensors that share lr, betas, eps and weight decay. Tensor i is
// described by row i of `table` (int64 [n, kRow], on the device):
//   main (fp32), grad (G), exp_avg (fp32), exp_avg_sq (fp32), model copy (M, or 0), step (fp32 0-d), numel
// and every block of the grid handles one chunk of kChunk elements of one tensor (`blocks`, int32
// [num_blocks, 2]: tensor, chunk), as torch's multi_tensor_apply does.
//
// Per element, with t the tensor's step count (incremented by the caller before the launch):
//   g  = grad / grad_scale                         (grad_scale optional: clipping as a divisor)
//   p <- p - lr wd p                               (decoupled weight decay, AdamW)
//   m <- beta1 m + (1 - beta1) g
//   v <- beta2 v + (1 - beta2) g g
//   p <- p - (lr / (1 - beta1^t)) m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   model <- round_M(p)                            (the low-precision copy, when there is one)
// and nothing is written when *found_inf == 1. The scalar types and the order of operations are
// those of torch's fused AdamW kernel (aten/src/ATen/native/cuda/fused_adam_utils.cuh, torch >= 2.8:
// every hyper-parameter cast to float once, float powers of the float step, the moments as fused
// multiply-adds m + (1 - b)(g - m) written fma(b, m, fma(-b, g, g))), so on the same inputs both give
// the same fp32 results; what this kernel adds is that the gradient
// may be bf16/fp16 (read and widened in registers: no fp32 gradient copy) and that the cast back
// into the model's weights happens in the same pass instead of a second one.
//
// Sum of squares: block b adds (double)g^2 over its chunk of the gradients (column 1 of the same
// table) and writes partial[b]; the caller sums the partials (a fixed order: deterministic).
#include <ATen/ops/empty.h>

#include <cmath>

#include "common.cuh"

namespace hf_megatron {
namespace {

constexpr int kRow = 7;  // int64 columns of a table row
constexpr int kMain = 0, kGrad = 1, kExpAvg = 2, kExpAvgSq = 3, kModel = 4, kStep = 5, kNumel = 6;
constexpr int64_t kChunk = 65536;
constexpr int kThreads = 512;
constexpr int kILP = 4;

template <typename T>
__device__ __forceinline__ T* column(const int64_t* row, int index) {
  return reinterpret_cast<T*>(row[index]);
}

__device__ __forceinline__ bool aligned_to(const void* p, int bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

struct Hyper {  // torch's opmath scalars: the double arguments rounded to float once, on the host
  float lr, beta1, beta2, eps, weight_decay;
};

// One element of the update, in torch's fused AdamW's float arithmetic.
__device__ __forceinline__ void adamw_math(float& param, float grad, float& exp_avg, float& exp_avg_sq,
                                           const Hyper& h, float step_size, float bias_correction2_sqrt,
                                           const float* grad_scale) {
  if (grad_scale != nullptr) grad /= *grad_scale;
  if (h.weight_decay != 0) param -= h.lr * h.weight_decay * param;
  exp_avg = std::fma(h.beta1, exp_avg, std::fma(-h.beta1, grad, grad));
  exp_avg_sq = std::fma(h.beta2, exp_avg_sq, std::fma(-h.beta2, grad * grad, grad * grad));
  const float denom = (std::sqrt(exp_avg_sq) / bias_correction2_sqrt) + h.eps;
  param -= step_size * exp_avg / denom;
}

// S: the moments' storage type (float, or bf16 with --exp-avg-dtype bf16): widened on load, the math in
// float, rounded to nearest on store.
template <typename G, typename M, bool kHasModel, typename S>
__global__ void __launch_bounds__(kThreads) adamw_kernel(const int64_t* __restrict__ table,
                                                       const int* __restrict__ blocks, Hyper h,
                                                       const float* __restrict__ grad_scale,
                                                       const float* __restrict__ found_inf) {
  if (found_inf != nullptr && *found_inf == 1.f) return;
  const int tensor = blocks[2 * blockIdx.x];
  const int64_t lo = static_cast<int64_t>(blocks[2 * blockIdx.x + 1]) * kChunk;
  const int64_t* row = table + static_cast<int64_t>(tensor) * kRow;
  float* main = column<float>(row, kMain);
  const G* grad = column<const G>(row, kGrad);
  S* exp_avg = column<S>(row, kExpAvg);
  S* exp_avg_sq = column<S>(row, kExpAvgSq);
  M* model = column<M>(row, kModel);
  const float step = *column<const float>(row, kStep);
  const int64_t numel = row[kNumel];
  const int64_t hi = lo + kChunk < numel ? lo + kChunk : numel;

  // as torch's kernel: the corrections from float powers of the float step
  const float bias_correction1 = 1 - std::pow(h.beta1, step);
  const float step_size = h.lr / bias_correction1;
  const float bias_correction2 = 1 - std::pow(h.beta2, step);
  const float bias_correction2_sqrt = std::sqrt(bias_correction2);

  const bool packed = numel % kILP == 0 && aligned_to(main, 16) && aligned_to(exp_avg, kILP * sizeof(S)) &&
                      aligned_to(exp_avg_sq, kILP * sizeof(S)) && aligned_to(grad, kILP * sizeof(G)) &&
                      (!kHasModel || aligned_to(model, kILP * sizeof(M)));
  if (packed) {
    for (int64_t i = lo + static_cast<int64_t>(threadIdx.x) * kILP; i < hi; i += kThreads * kILP) {
      Pack<float, kILP> p = load_pack<float, kILP>(main + i);
      Pack<S, kILP> m = load_pack<S, kILP>(exp_avg + i);
      Pack<S, kILP> v = load_pack<S, kILP>(exp_avg_sq + i);
      const Pack<G, kILP> g = load_pack<G, kILP>(grad + i);
#pragma unroll
      for (int k = 0; k < kILP; ++k) {
        float mk = static_cast<float>(m.v[k]), vk = static_cast<float>(v.v[k]);
        adamw_math(p.v[k], static_cast<float>(g.v[k]), mk, vk, h, step_size, bias_correction2_sqrt, grad_scale);
        m.v[k] = static_cast<S>(mk);
        v.v[k] = static_cast<S>(vk);
      }
      store_pack<float, kILP>(main + i, p);
      store_pack<S, kILP>(exp_avg + i, m);
      store_pack<S, kILP>(exp_avg_sq + i, v);
      if constexpr (kHasModel) {
        Pack<M, kILP> out;
#pragma unroll
        for (int k = 0; k < kILP; ++k) out.v[k] = static_cast<M>(p.v[k]);
        store_pack<M, kILP>(model + i, out);
      }
    }
  } else {
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
      float p = main[i], m = static_cast<float>(exp_avg[i]), v = static_cast<float>(exp_avg_sq[i]);
      adamw_math(p, static_cast<float>(grad[i]), m, v, h, step_size, bias_correction2_sqrt, grad_scale);
      main[i] = p;
      exp_avg[i] = static_cast<S>(m);
      exp_avg_sq[i] = static_cast<S>(v);
      if constexpr (kHasModel) model[i] = static_cast<M>(p);
    }
  }
}

template <typename G>
__global__ void __launch_bounds__(kThreads) sum_of_squares_kernel(const int64_t* __restrict__ table,
                                                                const int* __restrict__ blocks,
                                                                double* __restrict__ partial) {
  const int tensor = blocks[2 * blockIdx.x];
  const int64_t lo = static_cast<int64_t>(blocks[2 * blockIdx.x + 1]) * kChunk;
  const int64_t* row = table + static_cast<int64_t>(tensor) * kRow;
  const G* grad = column<const G>(row, kGrad);
  const int64_t numel = row[kNumel];
  const int64_t hi = lo + kChunk < numel ? lo + kChunk : numel;
  double sum = 0;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    const double g = static_cast<float>(grad[i]);
    sum += g * g;
  }
  __shared__ double scratch[kThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int w = 0; w < kThreads / 32; ++w) total += scratch[w];
    partial[blockIdx.x] = total;
  }
}

void check_tables(const at::Tensor& table, const at::Tensor& blocks) {
  TORCH_CHECK(table.is_cuda() && table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == kRow &&
                  table.is_contiguous(),
              "table must be a contiguous CUDA int64 tensor [n, ", kRow, "]");
  TORCH_CHECK(blocks.is_cuda() && blocks.scalar_type() == at::kInt && blocks.dim() == 2 && blocks.size(1) == 2 &&
                  blocks.is_contiguous() && blocks.device() == table.device(),
              "blocks must be a contiguous CUDA int32 tensor [num_blocks, 2] on the table's device");
  TORCH_CHECK(blocks.size(0) > 0 && blocks.size(0) <= 2147483647, "blocks: 1 to 2^31 - 1 rows expected");
}

const float* optional_scalar(const c10::optional<at::Tensor>& t, const at::Tensor& table, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kFloat && t->numel() == 1 && t->device() == table.device(),
              name, " must be a one-element float32 CUDA tensor on the table's device");
  return t->data_ptr<float>();
}

}  // namespace

template <typename G, typename S>
void launch_adamw(const at::Tensor& table, const at::Tensor& blocks, const c10::optional<at::Tensor>& model_like,
                  const Hyper& h, const float* scale, const float* inf, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(blocks.size(0));
  if (!model_like.has_value()) {
    adamw_kernel<G, float, false, S><<<grid, kThreads, 0, stream>>>(table.data_ptr<int64_t>(), blocks.data_ptr<int>(),
                                                                    h, scale, inf);
    return;
  }
  HFM_DISPATCH_FLOATING(model_like->scalar_type(), "multi_tensor_adamw_model", [&] {
    adamw_kernel<G, scalar_t, true, S><<<grid, kThreads, 0, stream>>>(table.data_ptr<int64_t>(),
                                                                      blocks.data_ptr<int>(), h, scale, inf);
  });
}

// grad_like: any tensor of the gradients' dtype; model_like: one of the model copies' dtype, or none
// when the main weights are the model's (column 4 is 0); moment_like: one of the moments (float or bf16,
// both moments of every tensor in that dtype).
void multi_tensor_adamw(const at::Tensor& table, const at::Tensor& blocks, const at::Tensor& grad_like,
                        const c10::optional<at::Tensor>& model_like, const at::Tensor& moment_like, double lr,
                        double beta1, double beta2, double eps, double weight_decay,
                        const c10::optional<at::Tensor>& grad_scale, const c10::optional<at::Tensor>& found_inf) {
  check_tables(table, blocks);
  const at::ScalarType moment_dtype = moment_like.scalar_type();
  TORCH_CHECK(moment_dtype == at::kFloat || moment_dtype == at::kBFloat16,
              "multi_tensor_adamw: moments must be float32 or bfloat16, got ", moment_dtype);
  const float* scale = optional_scalar(grad_scale, table, "grad_scale");
  const float* inf = optional_scalar(found_inf, table, "found_inf");
  const c10::cuda::CUDAGuard guard(table.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const Hyper h{static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(beta2),
                static_cast<float>(eps), static_cast<float>(weight_decay)};
  HFM_DISPATCH_FLOATING(grad_like.scalar_type(), "multi_tensor_adamw", [&] {
    if (moment_dtype == at::kBFloat16) {
      launch_adamw<scalar_t, at::BFloat16>(table, blocks, model_like, h, scale, inf, stream);
    } else {
      launch_adamw<scalar_t, float>(table, blocks, model_like, h, scale, inf, stream);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor multi_tensor_sum_of_squares(const at::Tensor& table, const at::Tensor& blocks,
                                       const at::Tensor& grad_like) {
  check_tables(table, blocks);
  const at::ScalarType grad_dtype = grad_like.scalar_type();
  const c10::cuda::CUDAGuard guard(table.device());
  at::Tensor partial = at::empty({blocks.size(0)}, table.options().dtype(at::kDouble));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  HFM_DISPATCH_FLOATING(grad_dtype, "multi_tensor_sum_of_squares", [&] {
    sum_of_squares_kernel<scalar_t><<<static_cast<unsigned>(blocks.size(0)), kThreads, 0, stream>>>(
        table.data_ptr<int64_t>(), blocks.data_ptr<int>(), partial.data_ptr<double>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return partial;
}

}  // namespace hf_megatron

// Embedding weight gradient without a host sync.
//
// PyTorch's dense embedding backward on CUDA counts the distinct ids on the host
// (embedding_backward_cuda_kernel_unique_by_key returns the count), so every training step waits
// there for the GPU to finish the whole backward before the optimizer can be queued.  Here the
// number of distinct ids never leaves the device:
//
//   sorted, order = stable sort of the ids          (torch.sort, on the device)
//   ends[i]       = first position after sorted[i]'s run   (torch.searchsorted, on the device)
//   grad_weight[id] = sum over the run's positions j, in order, of grad_out[order[j]]
//
// One block per sorted position; a block that is not the head of its run returns at once, a head
// block sums its run's rows in fp32 (in sorted order, so the result is the same on every run) and
// writes the row rounded once to the weight's dtype.  Rows of ids that do not occur are left as
// they are (the caller passes zeros).
#include "common.cuh"

namespace hf_megatron {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kRowsInFlight = 4;  // rows of a run loaded before any is added

template <typename T, int N>
__global__ void embedding_backward_kernel(const T* __restrict__ grad, const int64_t* __restrict__ sorted,
                                          const int64_t* __restrict__ order, const int64_t* __restrict__ ends,
                                          T* __restrict__ out, int64_t hidden) {
  const int64_t i = blockIdx.x;
  const int64_t id = sorted[i];
  if (i > 0 && sorted[i - 1] == id) return;  // not the head of its run
  const int64_t end = ends[i];
  for (int64_t col = static_cast<int64_t>(threadIdx.x) * N; col < hidden; col += static_cast<int64_t>(blockDim.x) * N) {
    float acc[N];
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] = 0.f;
    for (int64_t j = i; j < end; j += kRowsInFlight) {
      Pack<T, N> rows[kRowsInFlight];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u)
        if (j + u < end) rows[u] = load_pack<T, N>(grad + order[j + u] * hidden + col);
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {
        if (j + u >= end) break;
#pragma unroll
        for (int k = 0; k < N; ++k) acc[k] += static_cast<float>(rows[u].v[k]);
      }
    }
    Pack<T, N> result;
#pragma unroll
    for (int k = 0; k < N; ++k) result.v[k] = static_cast<T>(acc[k]);
    store_pack<T, N>(out + id * hidden + col, result);
  }
}

}  // namespace

// grad [tokens, hidden], sorted / order / ends int64 [tokens] (see above), out [num_embeddings, hidden]
// (zeros; grad's dtype): out[id] = the sum of grad's rows of that id.
void embedding_backward(const at::Tensor& grad, const at::Tensor& sorted, const at::Tensor& order,
                        const at::Tensor& ends, at::Tensor& out) {
  check_cuda_float(grad, "embedding_backward: grad");
  TORCH_CHECK(grad.dim() == 2 && grad.is_contiguous(), "embedding_backward: grad must be a contiguous [tokens, hidden] tensor");
  for (const at::Tensor* t : {&sorted, &order, &ends})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == grad.size(0) && t->is_contiguous() && t->scalar_type() == at::kLong &&
                    t->device() == grad.device(),
                "embedding_backward: sorted, order and ends must be contiguous int64 [tokens] tensors on grad's device");
  TORCH_CHECK(out.dim() == 2 && out.size(1) == grad.size(1) && out.is_contiguous() &&
                  out.scalar_type() == grad.scalar_type() && out.device() == grad.device(),
              "embedding_backward: out must be a contiguous [num_embeddings, hidden] tensor with grad's dtype");
  TORCH_CHECK(grad.size(0) <= 2147483647, "embedding_backward: at most 2^31 - 1 tokens");
  if (grad.size(0) == 0 || grad.size(1) == 0) return;
  const c10::cuda::CUDAGuard guard(grad.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t hidden = grad.size(1);
  const unsigned blocks = static_cast<unsigned>(grad.size(0));
  HFM_DISPATCH_FLOATING(grad.scalar_type(), "embedding_backward", [&] {
    constexpr int N = kPack<scalar_t>;
    const bool vec = hidden % N == 0 && is_aligned_16(grad.data_ptr()) && is_aligned_16(out.data_ptr());
    const int64_t packs = vec ? hidden / N : hidden;
    const int threads = static_cast<int>(packs >= kMaxThreads ? kMaxThreads : round_up_32(packs));
    if (vec) {
      embedding_backward_kernel<scalar_t, N><<<blocks, threads, 0, stream>>>(
          grad.data_ptr<scalar_t>(), sorted.data_ptr<int64_t>(), order.data_ptr<int64_t>(), ends.data_ptr<int64_t>(),
          out.data_ptr<scalar_t>(), hidden);
    } else {
      embedding_backward_kernel<scalar_t, 1><<<blocks, threads, 0, stream>>>(
          grad.data_ptr<scalar_t>(), sorted.data_ptr<int64_t>(), order.data_ptr<int64_t>(), ends.data_ptr<int64_t>(),
          out.data_ptr<scalar_t>(), hidden);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace hf_megatron

// Python bindings of the fused kernels (module name set by torch.utils.cpp_extension.load).
// The Python side (hf_megatron/kernels/) owns autograd and falls back to PyTorch when a tensor
// does not fit these entry points; the C++ side checks its inputs and raises on a misuse.
#include <torch/extension.h>

#include <vector>

namespace hf_megatron {
std::vector<at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps);
std::vector<at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                                          const at::Tensor& rstd);
at::Tensor swiglu_forward(const at::Tensor& x);
at::Tensor swiglu_backward(const at::Tensor& dy, const at::Tensor& x);
at::Tensor rotary_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor rotary_backward(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin);
void multi_tensor_adamw(const at::Tensor& table, const at::Tensor& blocks, const at::Tensor& grad_like,
                        const c10::optional<at::Tensor>& model_like, const at::Tensor& moment_like, double lr,
                        double beta1, double beta2, double eps, double weight_decay,
                        const c10::optional<at::Tensor>& grad_scale, const c10::optional<at::Tensor>& found_inf);
at::Tensor multi_tensor_sum_of_squares(const at::Tensor& table, const at::Tensor& blocks,
                                       const at::Tensor& grad_like);
std::vector<at::Tensor> cross_entropy_forward(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab,
                                              int64_t ignore_index);
at::Tensor cross_entropy_backward(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& targets,
                                  const at::Tensor& lse, int64_t vocab, int64_t ignore_index,
                                  const c10::optional<at::Tensor>& out);
}  // namespace hf_megatron

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hf_megatron fused CUDA kernels";
  m.def("rms_norm_forward", &hf_megatron::rms_norm_forward, "RMSNorm forward: x [rows, cols], weight, eps -> (y, rstd)");
  m.def("rms_norm_backward", &hf_megatron::rms_norm_backward, "RMSNorm backward: dy, x, weight, rstd -> (dx, dw)");
  m.def("swiglu_forward", &hf_megatron::swiglu_forward, "SwiGLU forward: x [rows, 2F] -> [rows, F]");
  m.def("swiglu_backward", &hf_megatron::swiglu_backward, "SwiGLU backward: dy [rows, F], x [rows, 2F] -> dx");
  m.def("rotary_forward", &hf_megatron::rotary_forward, "rotary apply: x [b,h,s,d], cos, sin [b|1,s,d] -> y");
  m.def("multi_tensor_adamw", &hf_megatron::multi_tensor_adamw,
        "AdamW on fp32 main weights: table [n, 7] int64, blocks [b, 2] int32, grad_like, model_like, moment_like "
        "(fp32 or bf16 moments), lr, beta1, beta2, eps, weight_decay, grad_scale, found_inf");
  m.def("multi_tensor_sum_of_squares", &hf_megatron::multi_tensor_sum_of_squares,
        "fp64 sum of squares per block of a tensor list: table, blocks, grad_like -> partial [b]");
  m.def("cross_entropy_forward", &hf_megatron::cross_entropy_forward,
        "cross entropy: logits [rows, width], targets int64 [rows], vocab, ignore_index -> (loss, lse) fp32 [rows]");
  m.def("cross_entropy_backward", &hf_megatron::cross_entropy_backward,
        "cross entropy backward: grad fp32 [rows], logits, targets, lse, vocab, ignore_index, out (None or logits) "
        "-> d logits");
  m.def("rotary_backward", &hf_megatron::rotary_backward, "rotary backward: dy, cos, sin -> dx");
}

// Python bindings of the decode kernels (see hispec_decode/kernels/__init__.py).
#include <torch/extension.h>

bool linear_bf16_available();
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& bias);
bool amx_available();
torch::Tensor linear_amx(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& bias);
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                              const torch::Tensor& seq, const torch::Tensor& len, const torch::Tensor& lo,
                              const torch::Tensor& tree_base, const torch::Tensor& tree_mask,
                              const torch::Tensor& tables, int64_t block_size, double scale);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor gemma_rms_norm(const torch::Tensor& x, const torch::Tensor& scale, double eps);
std::vector<torch::Tensor> rope(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& cos,
                                const torch::Tensor& sin);
torch::Tensor silu_and_mul(const torch::Tensor& x);
torch::Tensor argmax_rows(const torch::Tensor& x);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16_available", &linear_bf16_available);
  m.def("linear_bf16", &linear_bf16, "bf16 linear on a VNNI-packed weight (row-independent reduction order)");
  m.def("amx_available", &amx_available);
  m.def("linear_amx", &linear_amx, "bf16 linear on AMX tiles over the same VNNI weight (row-independent order)");
  m.def("paged_attention", &paged_attention, "query rows over their own paged K/V (row-independent)");
  m.def("rms_norm", &rms_norm, "RMSNorm as transformers computes it");
  m.def("gemma_rms_norm", &gemma_rms_norm, "Gemma's RMSNorm: float32 throughout, one rounding");
  m.def("rope", &rope, "rotary embedding of q and k, returned in the attention layout");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused gate/up output");
  m.def("argmax_rows", &argmax_rows, "first index of each row's largest value (NaN largest)");
}

// The kernels one translation unit calls in another (bindings.cpp binds them all to Python).
#pragma once
#include <torch/extension.h>

#include <string>
#include <vector>

bool linear_bf16_available();
std::string linear_bf16_kind();
int64_t linear_bf16_group();
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& bias);
bool linear_q_available();
std::string linear_q_kind();
torch::Tensor linear_q(const torch::Tensor& x, const torch::Tensor& w, int64_t type, const torch::Tensor& bias);
torch::Tensor dequantize_rows(const torch::Tensor& w, int64_t type, const torch::Tensor& ids, int64_t K);
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

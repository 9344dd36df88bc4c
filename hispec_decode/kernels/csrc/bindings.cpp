// Python bindings of the decode kernels (see hispec_decode/kernels/__init__.py).
#include <torch/extension.h>

#include "ops.h"

void bind_stack(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16_available", &linear_bf16_available);
  m.def("linear_bf16_kind", &linear_bf16_kind, "the bf16 linear's loop: avx512_bf16, avx2 or none");
  m.def("linear_bf16_group", &linear_bf16_group, "column blocks side by side per input pair in linear_bf16's weight");
  m.def("linear_bf16", &linear_bf16, "bf16 linear on a VNNI-packed weight (row-independent reduction order)");
  m.def("linear_q_available", &linear_q_available);
  m.def("linear_q_kind", &linear_q_kind,
        "the block linear's loop: vnni (vpdpbusd), avx2, int32 (the vnni loop emulated) or none");
  m.def("linear_q", &linear_q, "linear on a GGUF block weight, 8-bit activations (row-independent order)");
  m.def("dequantize_rows", &dequantize_rows, "rows of a GGUF block weight as float32");
  m.def("amx_available", &amx_available);
  m.def("linear_amx", &linear_amx, "bf16 linear on AMX tiles over the same VNNI weight (row-independent order)");
  m.def("paged_attention", &paged_attention, "query rows over their own paged K/V (row-independent)");
  m.def("rms_norm", &rms_norm, "RMSNorm as transformers computes it");
  m.def("gemma_rms_norm", &gemma_rms_norm, "Gemma's RMSNorm: float32 throughout, one rounding");
  m.def("rope", &rope, "rotary embedding of q and k, returned in the attention layout");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused gate/up output");
  m.def("argmax_rows", &argmax_rows, "first index of each row's largest value (NaN largest)");
  bind_stack(m);
}

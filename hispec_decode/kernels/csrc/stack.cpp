// A run of decoder layers in one call: the same kernels and ATen ops, in the same order, as the
// Python layer loop (hispec_decode/models/llama.py, gemma3.py: ``block``), without a Python frame
// or dispatch per op. At batch 1 a small model's layer is a few dozen microseconds of arithmetic,
// and the interpreter's share of a Python layer loop was of the same order.
//
// Every step calls exactly what the Python path calls (linear_bf16 / linear_amx on VNNI weights or
// oneDNN's packed linear, rms_norm / gemma_rms_norm, rope, paged_attention, silu_and_mul, at::add,
// at::gelu, at::mul), so the two paths give the same bits (tests/test_stack.py compares them).
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ops.h"

namespace {

torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& weight, const std::optional<torch::Tensor>& bias) {
  static const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, weight, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                                 std::string("")};
  handle.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

// One linear as hispec_decode.layers.linear.FusedLinear computes it: on a VNNI weight (bf16), on
// oneDNN's packed weight, or on GGUF block weights (one part per ggml type, outputs side by side).
struct StackLinear {
  torch::Tensor vnni, vnni_bias, weight;  // vnni (+ float32 bias) or weight (oneDNN's blocked layout)
  std::optional<torch::Tensor> bias;      // oneDNN's bias
  int64_t n = 0;
  bool amx = false;
  std::vector<torch::Tensor> blocks, block_biases;  // GGUF parts: uint8 [N_i, row bytes], float32 [N_i] or empty
  std::vector<int64_t> block_types;

  torch::Tensor operator()(const torch::Tensor& x) const {  // x [1, T, K] -> [1, T, n]
    if (!blocks.empty()) {
      const auto flat = x.reshape({-1, x.size(-1)}).contiguous();
      std::vector<torch::Tensor> parts;
      for (size_t i = 0; i < blocks.size(); ++i) parts.push_back(linear_q(flat, blocks[i], block_types[i], block_biases[i]));
      const auto y = parts.size() == 1 ? parts[0] : at::cat(parts, 1);
      return y.reshape({x.size(0), x.size(1), n});
    }
    if (!vnni.defined()) return onednn_linear(x, weight, bias);
    auto flat = x.reshape({-1, x.size(-1)});
    const int64_t kp = 2 * vnni.size(1);
    if (flat.size(1) != kp) flat = at::constant_pad_nd(flat, {0, kp - flat.size(1)});
    flat = flat.contiguous();
    auto y = amx ? linear_amx(flat, vnni, vnni_bias) : linear_bf16(flat, vnni, vnni_bias);
    if (y.size(1) != n) y = y.narrow(1, 0, n);
    return y.reshape({x.size(0), x.size(1), n});
  }
};

struct StackNorm {
  torch::Tensor weight;  // Llama: the norm's weight; Gemma: 1 + weight in float32
  double eps = 1e-6;
  bool gemma = false;

  torch::Tensor operator()(const torch::Tensor& x) const {
    return gemma ? gemma_rms_norm(x, weight, eps) : rms_norm(x, weight, eps);
  }
};

struct StackLayer {
  StackLinear qkv, out, mlp_in, mlp_out;
  StackNorm input, pre_mlp;
  std::optional<StackNorm> post_attention, post_mlp, q_norm, k_norm;  // Gemma's extra norms; q/k norms
  int64_t window = 0;                                                 // sliding window (0: none)
  int64_t rope = 0;                                                   // which rotary table
  double scale = 1.0;
};

// The K/V pools of one cache, per layer: [n_kv, slots, d] each.
struct StackPools {
  std::vector<torch::Tensor> keys, values;
};

// Where each row of a call reads and writes (hispec_decode.layers.attention.PagedRows).
struct StackRows {
  torch::Tensor write, seq, length, position, tree_base, tree_mask, tables;
  int64_t block_size = 16;
};

class LayerStack {
 public:
  LayerStack(int64_t heads, int64_t kv_heads, int64_t head_dim, std::string activation)
      : heads_(heads), kv_heads_(kv_heads), d_(head_dim), gelu_(activation == "gelu_tanh") {
    TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "LayerStack: activation silu or gelu_tanh");
  }

  void add(const StackLayer& layer) { layers_.push_back(layer); }
  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // layers [lo, hi) over h [1, T, C]; cos/sin: the rotary tables' rows of this call, [1, 1, T, d] each
  torch::Tensor run(torch::Tensor h, int64_t lo, int64_t hi, const std::vector<torch::Tensor>& cos,
                    const std::vector<torch::Tensor>& sin, const StackRows& rows, const StackPools& pools) const {
    TORCH_CHECK(0 <= lo && lo <= hi && hi <= size(), "LayerStack.run: layers ", lo, "..", hi, " of ", size());
    TORCH_CHECK(h.dim() == 3 && h.size(0) == 1, "LayerStack.run: h must be [1, T, hidden]");
    std::map<int64_t, torch::Tensor> first;  // the first slot each row sees, per sliding window
    for (int64_t i = lo; i < hi; ++i) h = layer(layers_[i], h, cos, sin, rows, pools.keys[i], pools.values[i], first);
    return h;
  }

 private:
  torch::Tensor layer(const StackLayer& L, torch::Tensor h, const std::vector<torch::Tensor>& cos,
                      const std::vector<torch::Tensor>& sin, const StackRows& rows, const torch::Tensor& keys,
                      const torch::Tensor& values, std::map<int64_t, torch::Tensor>& first) const {
    const int64_t T = h.size(1), hq = heads_ * d_, hk = kv_heads_ * d_;
    auto qkv = L.qkv(L.input(h));  // [1, T, hq + 2 hk]
    auto q = qkv.narrow(2, 0, hq).view({1, T, heads_, d_});
    auto k = qkv.narrow(2, hq, hk).view({1, T, kv_heads_, d_});
    auto v = qkv.narrow(2, hq + hk, hk).view({1, T, kv_heads_, d_});
    if (L.q_norm) q = (*L.q_norm)(q);
    if (L.k_norm) k = (*L.k_norm)(k);
    auto rotated = rope(q, k, cos[L.rope], sin[L.rope]);  // [1, H, T, d], [1, Hk, T, d]
    write(keys, rotated[1][0], rows.write);
    write(values, v[0].transpose(0, 1), rows.write);
    auto lo = first.find(L.window);
    if (lo == first.end())
      lo = first.emplace(L.window, L.window > 0 ? (rows.position + 1 - L.window).clamp_min(0)
                                                : torch::zeros_like(rows.length)).first;
    auto attended = paged_attention(rotated[0][0].contiguous(), keys, values, rows.seq, rows.length, lo->second,
                                    rows.tree_base, rows.tree_mask, rows.tables, rows.block_size, L.scale);
    auto o = L.out(attended.unsqueeze(0));
    h = at::add(h, L.post_attention ? (*L.post_attention)(o) : o);
    auto gate_up = L.mlp_in(L.pre_mlp(h));
    torch::Tensor act;
    if (gelu_) {
      auto parts = gate_up.chunk(2, -1);
      act = at::mul(at::gelu(parts[0], "tanh"), parts[1]);
    } else {
      act = silu_and_mul(gate_up);
    }
    auto m = L.mlp_out(act);
    return at::add(h, L.post_mlp ? (*L.post_mlp)(m) : m);
  }

  // pool[:, slots[t]] = src[:, t] for src [n_kv, T, d] (any strides, the last one 1)
  static void write(const torch::Tensor& pool, const torch::Tensor& src, const torch::Tensor& slots) {
    TORCH_CHECK(pool.scalar_type() == src.scalar_type() && src.stride(2) == 1, "LayerStack: K/V dtype or layout");
    const int64_t n_kv = src.size(0), T = src.size(1), d = src.size(2), S = pool.size(1);
    const int64_t bytes = d * src.element_size();
    const auto* slot = slots.data_ptr<int64_t>();
    auto* dst = static_cast<char*>(pool.data_ptr());
    const auto* from = static_cast<const char*>(src.data_ptr());
    for (int64_t h = 0; h < n_kv; ++h)
      for (int64_t t = 0; t < T; ++t)
        std::memcpy(dst + (h * S + slot[t]) * bytes, from + (h * src.stride(0) + t * src.stride(1)) * src.element_size(),
                    bytes);
  }

  int64_t heads_, kv_heads_, d_;
  bool gelu_;
  std::vector<StackLayer> layers_;
};

void bind_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<StackLinear>(m, "StackLinear")
      .def(py::init([](std::optional<torch::Tensor> vnni, std::optional<torch::Tensor> vnni_bias,
                       std::optional<torch::Tensor> weight, std::optional<torch::Tensor> bias, int64_t n, bool amx) {
             StackLinear l;
             if (vnni) l.vnni = *vnni;
             l.vnni_bias = vnni_bias ? *vnni_bias : torch::empty({0});
             if (weight) l.weight = *weight;
             l.bias = bias;
             l.n = n;
             l.amx = amx;
             TORCH_CHECK(l.vnni.defined() || l.weight.defined(), "StackLinear: a VNNI or a oneDNN weight");
             return l;
           }),
           py::arg("vnni"), py::arg("vnni_bias"), py::arg("weight"), py::arg("bias"), py::arg("n"), py::arg("amx"))
      .def_static("blocks", [](std::vector<torch::Tensor> blocks, std::vector<int64_t> types,
                               std::vector<torch::Tensor> biases, int64_t n) {
             TORCH_CHECK(!blocks.empty() && blocks.size() == types.size() && blocks.size() == biases.size(),
                         "StackLinear.blocks: one type and one bias (maybe empty) per part");
             StackLinear l;
             l.blocks = std::move(blocks);
             l.block_types = std::move(types);
             l.block_biases = std::move(biases);
             l.n = n;
             return l;
           }, py::arg("blocks"), py::arg("types"), py::arg("biases"), py::arg("n"));
  py::class_<StackNorm>(m, "StackNorm")
      .def(py::init([](torch::Tensor weight, double eps, bool gemma) { return StackNorm{weight, eps, gemma}; }),
           py::arg("weight"), py::arg("eps"), py::arg("gemma"));
  py::class_<StackLayer>(m, "StackLayer")
      .def(py::init([](StackLinear qkv, StackLinear out, StackLinear mlp_in, StackLinear mlp_out, StackNorm input,
                       StackNorm pre_mlp, std::optional<StackNorm> post_attention, std::optional<StackNorm> post_mlp,
                       std::optional<StackNorm> q_norm, std::optional<StackNorm> k_norm, int64_t window, int64_t rope,
                       double scale) {
             return StackLayer{qkv, out, mlp_in, mlp_out, input, pre_mlp, post_attention, post_mlp,
                               q_norm, k_norm, window, rope, scale};
           }),
           py::arg("qkv"), py::arg("out"), py::arg("mlp_in"), py::arg("mlp_out"), py::arg("input"), py::arg("pre_mlp"),
           py::arg("post_attention"), py::arg("post_mlp"), py::arg("q_norm"), py::arg("k_norm"), py::arg("window"),
           py::arg("rope"), py::arg("scale"));
  py::class_<StackPools>(m, "StackPools")
      .def(py::init([](std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values) {
        return StackPools{std::move(keys), std::move(values)};
      }));
  py::class_<StackRows>(m, "StackRows")
      .def(py::init([](torch::Tensor write, torch::Tensor seq, torch::Tensor length, torch::Tensor position,
                       torch::Tensor tree_base, torch::Tensor tree_mask, torch::Tensor tables, int64_t block_size) {
        TORCH_CHECK(write.scalar_type() == at::kLong && write.is_contiguous() && position.scalar_type() == at::kLong,
                    "StackRows: int64 write slots and positions");
        return StackRows{write, seq, length, position, tree_base, tree_mask, tables, block_size};
      }));
  py::class_<LayerStack>(m, "LayerStack")
      .def(py::init<int64_t, int64_t, int64_t, std::string>())
      .def("add", &LayerStack::add)
      .def("__len__", &LayerStack::size)
      .def("run", &LayerStack::run, py::call_guard<py::gil_scoped_release>());
}

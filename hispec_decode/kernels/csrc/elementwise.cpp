// The small ops of a decoder layer, one call each instead of a chain of torch ops. Each rounds to
// the model's dtype exactly where the torch ops it replaces do (hispec_decode/kernels/native.py
// holds those torch ops; tests compare the two), so only float32 sums may differ in the last bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include "vec.h"

namespace {

template <typename T>
inline float f(T x) { return static_cast<float>(x); }
template <typename T>
inline float rnd(float x) { return static_cast<float>(static_cast<T>(x)); }  // round to T and back


#if defined(__AVX512F__)
using namespace hispec;
#endif

// silu(gate) * up for 16 columns (false: no vector path for this dtype)
template <typename T>
inline bool silu16(const T*, const T*, T*) { return false; }
#if defined(__AVX512F__)
template <typename T>
inline bool silu16_vector(const T* gate, const T* up, T* y) {
  const __m512 g = load16(gate);
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 act = round_to(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), gate);
  store16(y, _mm512_mul_ps(act, load16(up)));
  return true;
}
template <>
inline bool silu16<float>(const float* gate, const float* up, float* y) { return silu16_vector(gate, up, y); }
template <>
inline bool silu16<at::BFloat16>(const at::BFloat16* gate, const at::BFloat16* up, at::BFloat16* y) {
  return silu16_vector(gate, up, y);
}
#elif defined(__AVX2__) && defined(__FMA__)
template <typename T>
inline bool silu16_vector(const T* gate, const T* up, T* y) {  // two halves of 8 lanes, rounded as above
  for (int h = 0; h < 16; h += 8) {
    const __m256 g = hispec::load8(gate + h);
    const __m256 e = hispec::exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 act = hispec::round_to8(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), gate);
    hispec::store8(y + h, _mm256_mul_ps(act, hispec::load8(up + h)));
  }
  return true;
}
template <>
inline bool silu16<float>(const float* gate, const float* up, float* y) { return silu16_vector(gate, up, y); }
template <>
inline bool silu16<at::BFloat16>(const at::BFloat16* gate, const at::BFloat16* up, at::BFloat16* y) {
  return silu16_vector(gate, up, y);
}
#endif

// The rows of x [..., C] as a [R, C] view with unit column stride, and an empty [R, C] output.
std::pair<torch::Tensor, torch::Tensor> norm_rows(const torch::Tensor& x) {
  auto x2 = x.reshape({-1, x.size(-1)});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  return {x2, torch::empty({x2.size(0), x2.size(1)}, x.options())};
}

// y[r, c] = out(c, x[r, c], inv_r), inv_r = 1 / sqrt(mean(x_r^2) + eps), the sum in float32.
template <typename scalar_t, typename Out>
void rms_rows(const torch::Tensor& x2, torch::Tensor& y, double eps, Out out) {
  const int64_t C = x2.size(1), rs = x2.stride(0);
  const scalar_t* X = x2.data_ptr<scalar_t>();
  scalar_t* Y = y.data_ptr<scalar_t>();
  at::parallel_for(0, x2.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = X + r * rs;
      float ss = 0.f;
      _Pragma("omp simd reduction(+ : ss)")
      for (int64_t c = 0; c < C; ++c) ss += f(xr[c]) * f(xr[c]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(C) + static_cast<float>(eps));
      for (int64_t c = 0; c < C; ++c) Y[r * C + c] = out(c, xr[c], inv);
    }
  });
}

}  // namespace

// weight * (x / sqrt(mean(x^2) + eps)) over the last dimension: normalised in float32, rounded to
// x's dtype, then scaled (as transformers' RMSNorm computes it). x: [..., C]; returns x's shape.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  auto rows = norm_rows(x);
  auto &x2 = rows.first, &y = rows.second;
  auto w = weight.to(x.scalar_type()).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* W = w.data_ptr<scalar_t>();
    rms_rows<scalar_t>(x2, y, eps, [W](int64_t c, scalar_t v, float inv) {
      return static_cast<scalar_t>(f(W[c]) * rnd<scalar_t>(f(v) * inv));
    });
  });
  return y.view(x.sizes());
}

// Gemma's RMSNorm: (x / sqrt(mean(x^2) + eps)) * scale in float32, rounded once to x's dtype, where
// scale = 1 + weight is float32 (the caller keeps it). x: [..., C]; returns x's shape and dtype.
torch::Tensor gemma_rms_norm(const torch::Tensor& x, const torch::Tensor& scale, double eps) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == x.size(-1),
              "gemma_rms_norm: a float32 scale of x's width");
  auto rows = norm_rows(x);
  auto &x2 = rows.first, &y = rows.second;
  auto w = scale.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gemma_rms_norm", [&] {
    const float* W = w.data_ptr<float>();
    rms_rows<scalar_t>(x2, y, eps, [W](int64_t c, scalar_t v, float inv) {
      return static_cast<scalar_t>(W[c] * (f(v) * inv));
    });
  });
  return y.view(x.sizes());
}

// Rotary embedding of q [1, T, H, d] and k [1, T, Hk, d] (any strides, last one 1) with cos/sin
// [T, d]: x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype.
// Returns q and k as contiguous [1, H, T, d] and [1, Hk, T, d] (the attention layout).
std::vector<torch::Tensor> rope(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& cos,
                                const torch::Tensor& sin) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && q.stride(3) == 1 && k.stride(3) == 1, "rope: [1, T, heads, d] views");
  const int64_t T = q.size(1), d = q.size(3), half = d / 2;
  auto c2 = cos.reshape({T, d}).contiguous(), s2 = sin.reshape({T, d}).contiguous();
  auto qo = torch::empty({1, q.size(2), T, d}, q.options()), ko = torch::empty({1, k.size(2), T, d}, k.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rope", [&] {
    const scalar_t* C = c2.data_ptr<scalar_t>();
    const scalar_t* S = s2.data_ptr<scalar_t>();
    auto one = [&](const torch::Tensor& x, torch::Tensor& o) {
      const scalar_t* X = x.data_ptr<scalar_t>();
      scalar_t* O = o.data_ptr<scalar_t>();
      const int64_t H = x.size(2), st = x.stride(1), sh = x.stride(2);
      at::parallel_for(0, T * H, 64, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
          const int64_t t = task / H, h = task % H;
          const scalar_t* xr = X + t * st + h * sh;
          const scalar_t* cr = C + t * d;
          const scalar_t* sr = S + t * d;
          scalar_t* orow = O + (h * T + t) * d;
          for (int64_t i = 0; i < d; ++i) {
            const float rot = i < half ? -f(xr[i + half]) : f(xr[i - half]);
            orow[i] = static_cast<scalar_t>(rnd<scalar_t>(f(xr[i]) * f(cr[i])) + rnd<scalar_t>(rot * f(sr[i])));
          }
        }
      });
    };
    one(q, qo);
    one(k, ko);
  });
  return {qo, ko};
}

// silu(x[..., :I]) * x[..., I:] for the fused gate/up output [..., 2I]: the activation rounded to
// the dtype, then the product. Returns [..., I].
torch::Tensor silu_and_mul(const torch::Tensor& x) {
  const int64_t I = x.size(-1) / 2;
  auto x2 = x.reshape({-1, 2 * I});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = I;
  auto y = torch::empty({x2.size(0), I}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* X = x2.data_ptr<scalar_t>();
    scalar_t* Y = y.data_ptr<scalar_t>();
    const int64_t rs = x2.stride(0);
    at::parallel_for(0, x2.size(0) * I, 2048, [&](int64_t begin, int64_t end) {
      for (int64_t idx = begin; idx < end;) {
        const int64_t r = idx / I, c = idx % I;
        if (c + 16 <= I && idx + 16 <= end && silu16(X + r * rs + c, X + r * rs + I + c, Y + idx)) {
          idx += 16;  // 16 columns of one row at once
          continue;
        }
        const float g = f(X[r * rs + c]);
        const float act = rnd<scalar_t>(g / (1.f + std::exp(-g)));
        Y[idx] = static_cast<scalar_t>(act * f(X[r * rs + I + c]));
        ++idx;
      }
    });
  });
  return y.view(shape);
}

// Index of the largest value of each row of x [..., V] (the first one on ties; a NaN counts as the
// largest, as torch.argmax has it). Returns int64 [...]. One call for every row of a pass, where
// torch's bf16 argmax takes ~250 us per 49k-token row here.
torch::Tensor argmax_rows(const torch::Tensor& x) {
  const int64_t V = x.size(-1);
  auto x2 = x.reshape({-1, V}).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  auto out = torch::empty({x2.size(0)}, x.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax_rows", [&] {
    const scalar_t* X = x2.data_ptr<scalar_t>();
    int64_t* O = out.data_ptr<int64_t>();
    at::parallel_for(0, x2.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = X + r * V;
        int64_t best = 0;
        float top = f(row[0]);
        if (!std::isnan(top))
          for (int64_t i = 1; i < V; ++i) {
            const float v = f(row[i]);
            if (v > top || std::isnan(v)) {
              best = i;
              top = v;
              if (std::isnan(v)) break;
            }
          }
        O[r] = best;
      }
    });
  });
  return out.view(shape);
}

// y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for bf16 x and w, fp32 accumulation, bf16 y.
//
// The weight is packed once into the "VNNI" layout [N/16, K/2, 16, 2]: for every 16 output
// columns and every pair of inputs (k, k+1), one 64-byte vector. One AVX-512 BF16 instruction
// (vdpbf16ps) then adds x[k] w[n, k] + x[k+1] w[n, k+1] to 16 outputs at once, so a step streams
// the weight once, front to back, with no horizontal sums. The weight is the only large operand
// of a decoding step: at one row this is a memory-bound scan, at 16 rows each vector loaded is
// used for every row.
//
// Reduction order: output (m, n) accumulates its k pairs in increasing order into its own lane,
// whatever M is, whichever other rows share the call and however the work is split between
// threads (threads split columns, never k). A row's result is therefore the same bits alone or
// in any batch: the batch-invariant mode gets its linears for free.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int64_t kCols = 16;  // output columns per packed block (one fp32 vector)

template <int MB, int NB>
inline void tile(const uint32_t* x, int64_t x_stride, const uint16_t* w, int64_t K2, const float* bias,
                 uint16_t* y, int64_t y_stride, int64_t n0) {
  // rows x[0..MB), column blocks n0/16 .. n0/16 + NB; w points at block n0/16
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t block = K2 * 2 * kCols;  // uint16 elements per packed column block
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j)
      wv[j] = (__m512bh)_mm512_loadu_si512(w + j * block + k2 * 2 * kCols);
    for (int i = 0; i < MB; ++i) {
      __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[i * x_stride + k2]);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    __m512 b = bias ? _mm512_loadu_ps(bias + n0 + j * kCols) : _mm512_setzero_ps();
    for (int i = 0; i < MB; ++i) {
      __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], b));
      _mm256_storeu_si256((__m256i*)(y + i * y_stride + n0 + j * kCols), (__m256i)out);
    }
  }
}

template <int NB>
inline void rows_tile(int64_t m0, int64_t mb, const uint32_t* x, int64_t K2, const uint16_t* w, const float* bias,
                      uint16_t* y, int64_t Np, int64_t n0) {
  const uint32_t* xr = x + m0 * K2;
  uint16_t* yr = y + m0 * Np;
  switch (mb) {
    case 4: tile<4, NB>(xr, K2, w, K2, bias, yr, Np, n0); break;
    case 3: tile<3, NB>(xr, K2, w, K2, bias, yr, Np, n0); break;
    case 2: tile<2, NB>(xr, K2, w, K2, bias, yr, Np, n0); break;
    default: tile<1, NB>(xr, K2, w, K2, bias, yr, Np, n0); break;
  }
}

}  // namespace

bool linear_bf16_available() { return true; }

// x: [M, 2*K2] bf16 contiguous (K padded to even by the caller); wp: [Np/16, K2, 16, 2] bf16;
// bias: fp32 [Np] or empty. Returns [M, Np] bf16 (Np = N rounded up to 16).
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16, "linear_bf16: bf16 tensors");
  TORCH_CHECK(x.is_contiguous() && wp.is_contiguous() && x.dim() == 2 && wp.dim() == 4, "linear_bf16: layout");
  const int64_t M = x.size(0), blocks = wp.size(0), K2 = wp.size(1), Np = blocks * kCols;
  TORCH_CHECK(x.size(1) == 2 * K2, "linear_bf16: x has ", x.size(1), " features, the weight ", 2 * K2);
  auto y = torch::empty({M, Np}, x.options());
  const uint32_t* X = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* W = reinterpret_cast<const uint16_t*>(wp.data_ptr<at::BFloat16>());
  uint16_t* Y = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float* B = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const int64_t block = K2 * 2 * kCols;
  // threads take contiguous ranges of column blocks (each streams its own part of the weight)
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    constexpr int NB = 4;
    int64_t b = begin;
    for (; b + NB <= end; b += NB)
      for (int64_t m0 = 0; m0 < M; m0 += 4) rows_tile<NB>(m0, std::min<int64_t>(4, M - m0), X, K2, W + b * block, B, Y, Np, b * kCols);
    for (; b < end; ++b)
      for (int64_t m0 = 0; m0 < M; m0 += 4) rows_tile<1>(m0, std::min<int64_t>(4, M - m0), X, K2, W + b * block, B, Y, Np, b * kCols);
  });
  return y;
}

#else  // no AVX-512 BF16 at build time: the caller keeps oneDNN

bool linear_bf16_available() { return false; }
torch::Tensor linear_bf16(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "linear_bf16: built without AVX-512 BF16");
}

#endif

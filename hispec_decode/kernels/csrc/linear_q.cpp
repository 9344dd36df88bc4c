// y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) where w stays in a GGUF file's own blocks (ggml's
// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and x is quantized to 8 bits, as llama.cpp does.
//
// Activations: each row of x, per G consecutive inputs (G = 32 for the 32-value formats, 256 for the
// K formats, as llama.cpp's q8_0 / q8_K), becomes d = amax / 127 and q = round(x * (127 / amax))
// (nearest, ties to even; q = 0 where amax = 0). hispec_decode.layers.quant.quantize_q8 computes the
// same values in torch.
//
// Weights: every format reads, per 32 inputs ("sub-block"), as 32 unsigned values q of at most 6 bits,
// two integer scales (one per 16-input half; 1 and 1 except Q6_K), an integer offset o, and floats A
// and C, with w[i] = A * s_half * (q[i] - o) + C (Q8_0: w[i] = A * q[i], q signed). Dot products are
// integer arithmetic on 32 lanes (vpmaddubsw, vpmaddwd), scaled in float once per x block: per 32
// inputs for the 32-value formats, per 256-value super-block for the K formats (their sub-block
// scales are integers, applied before the conversion); offsets and mins come from x's sums.
//
// Weights come in two layouts: interleaved by 8 rows (type + X8, blocks_x8.h: 8 outputs per vector,
// lane c output c), the form every weight whose rows are a multiple of 8 is served in, or row by row
// (ggml's, blocks_rows.h: one output per vector, its lanes summed at the end).
//
// Out (m, n) adds its blocks in increasing k into its own accumulators (then, row by row, the vector's
// lanes in a fixed order); the other rows of the call and the split between threads (threads split n)
// never change it, so the kernel is batch-invariant. A call over M rows decodes each weight block once
// per tile of rows (up to 4; 8 with AVX-512's 32 registers; the weight's bytes stay in cache across its
// tiles).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "vec.h"
#include "quant_blocks.h"
#include "blocks_rows.h"
#include "blocks_x8.h"

namespace {

using namespace hispec_blocks;

// x quantized to 8 bits (see the header): per 32 inputs for the 32-value formats, with d * sum(q) per
// block; per 256 inputs for the K formats, with the sums of q per 16 inputs. The buffers are the
// calling thread's own, reused from call to call.
struct XRows {
  const int8_t* q;
  const float* d;
  const void* sums;  // 32: float d * sum(q) [M, K / 32]; 256: int16 [M, K / 16]
  int64_t K;
};

struct Q8Scratch {
  std::vector<int8_t> q;
  std::vector<float> d, xs;
  std::vector<int16_t> bs;
};

template <class T>
XRows quantize_rows(const T* X, int64_t M, int64_t K, int64_t group) {
  thread_local Q8Scratch s;
  const int64_t B = K / group;
  s.q.resize(M * K);
  s.d.resize(M * B);
  if (group == 32) s.xs.resize(M * B); else s.bs.resize(M * K / 16);
  int8_t* Q = s.q.data();
  float* D = s.d.data();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t i = 0; i < M * B; ++i) {
    const T* v = X + i * group;
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < group; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, hispec::load8(v + j)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    D[i] = amax / 127.f;
    const __m256 scale = _mm256_set1_ps(id);
    int32_t total = 0;
    for (int j = 0; j < group; j += 16) {  // 16 values: round to nearest even (the default MXCSR mode)
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(hispec::load8(v + j), scale));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(hispec::load8(v + j + 8), scale));
      const __m256i s16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // 16 int16 in order
      const __m128i s8 = _mm_packs_epi16(_mm256_castsi256_si128(s16), _mm256_extracti128_si256(s16, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(Q + i * group + j), s8);
      const __m256i w32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(w32), _mm256_extracti128_si256(w32, 1));
      t = _mm_hadd_epi32(t, t);
      t = _mm_hadd_epi32(t, t);
      const int32_t sum = _mm_cvtsi128_si32(t);
      if (group != 32) s.bs[i * (group / 16) + j / 16] = static_cast<int16_t>(sum);
      total += sum;
    }
    if (group == 32) s.xs[i] = D[i] * static_cast<float>(total);
  }
  return XRows{Q, D, group == 32 ? static_cast<const void*>(s.xs.data()) : static_cast<const void*>(s.bs.data()), K};
}

// The dot product of one weight row with MT rows of the call, by format.
template <int64_t TYPE, int64_t BYTES>
struct RowDot {
  static constexpr int64_t GROUP = 32;
  template <int MT> static void run(const uint8_t* w, int64_t nb, const XRows& x, int64_t m0, float* out) {
    const int64_t K = x.K;
    dot32<TYPE, BYTES, MT>(w, nb, x.q + m0 * K, x.d + m0 * (K / 32), static_cast<const float*>(x.sums) + m0 * (K / 32),
                           K, out);
  }
};
template <int KIND>  // 4: Q4_K, 5: Q5_K, 6: Q6_K
struct KDot {
  static constexpr int64_t GROUP = 256;
  template <int MT> static void run(const uint8_t* w, int64_t nb, const XRows& x, int64_t m0, float* out) {
    const int64_t K = x.K;
    const int8_t* q = x.q + m0 * K;
    const float* d = x.d + m0 * (K / 256);
    const int16_t* bs = static_cast<const int16_t*>(x.sums) + m0 * (K / 16);
    if constexpr (KIND == 6) dot_q6k<MT>(w, nb, q, d, bs, K, out);
    else dot_q45k<KIND == 5, MT>(w, nb, q, d, bs, K, out);
  }
};

// Interleaved blocks (blocks_x8.h): 8 outputs at a time, rows in tiles of up to X8_TILE.
template <int64_t TYPE>
struct X8Dot {
  static constexpr int64_t GROUP = TYPE == Q4_K || TYPE == Q5_K || TYPE == Q6_K ? 256 : 32;
  template <int MT> static void run(const uint8_t* g, int64_t nb, const XRows& x, int64_t m0, __m256* acc) {
    const int64_t K = x.K;
    const int8_t* q = x.q + m0 * K;
    const float* d = x.d + m0 * (K / GROUP);
    if constexpr (GROUP == 32) {
      x8_dot32<TYPE, MT>(g, nb, q, d, static_cast<const float*>(x.sums) + m0 * (K / 32), K, acc);
    } else {
      const int16_t* bs = static_cast<const int16_t*>(x.sums) + m0 * (K / 16);
      if constexpr (TYPE == Q6_K) x8_q6k<MT>(g, nb, q, d, bs, K, acc);
      else x8_q45k<TYPE == Q5_K, MT>(g, nb, q, d, bs, K, acc);
    }
  }
};

// Rows per tile of the interleaved loops: 8 where AVX-512 gives 32 vector registers (a tile's sums stay
// in them), else 4 (AVX2's 16).
#if defined(__AVX512VL__)
constexpr int64_t X8_TILE = 8;
#else
constexpr int64_t X8_TILE = 4;
#endif

template <class Dot, class T>
void linear_x8(const XRows& xq, int64_t M, const uint8_t* W, int64_t row_bytes, int64_t N, int64_t nb,
               const float* bias, T* Y) {
  at::parallel_for(0, N / 8, 2, [&](int64_t begin, int64_t end) {
    __m256 acc[X8_TILE];
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* w = W + g * 8 * row_bytes;
      const __m256 b = bias ? _mm256_loadu_ps(bias + 8 * g) : _mm256_setzero_ps();
      for (int64_t m0 = 0; m0 < M; m0 += X8_TILE) {
        const int64_t mt = std::min<int64_t>(X8_TILE, M - m0);
        for (int r = 0; r < X8_TILE; ++r) acc[r] = _mm256_setzero_ps();
        switch (mt) {
#if defined(__AVX512VL__)
          case 8: Dot::template run<8>(w, nb, xq, m0, acc); break;
          case 7: Dot::template run<7>(w, nb, xq, m0, acc); break;
          case 6: Dot::template run<6>(w, nb, xq, m0, acc); break;
          case 5: Dot::template run<5>(w, nb, xq, m0, acc); break;
#endif
          case 4: Dot::template run<4>(w, nb, xq, m0, acc); break;
          case 3: Dot::template run<3>(w, nb, xq, m0, acc); break;
          case 2: Dot::template run<2>(w, nb, xq, m0, acc); break;
          default: Dot::template run<1>(w, nb, xq, m0, acc); break;
        }
        for (int64_t r = 0; r < mt; ++r) hispec::store8(Y + (m0 + r) * N + 8 * g, _mm256_add_ps(acc[r], b));
      }
    }
  });
}

template <class Dot, class T>
void linear_rows(const XRows& xq, int64_t M, const uint8_t* W, int64_t row_bytes, int64_t N, int64_t nb,
                 const float* bias, T* Y) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    float out[4];
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* w = W + n * row_bytes;
      const float b = bias ? bias[n] : 0.f;
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t mt = std::min<int64_t>(4, M - m0);
        switch (mt) {
          case 4: Dot::template run<4>(w, nb, xq, m0, out); break;
          case 3: Dot::template run<3>(w, nb, xq, m0, out); break;
          case 2: Dot::template run<2>(w, nb, xq, m0, out); break;
          default: Dot::template run<1>(w, nb, xq, m0, out); break;
        }
        for (int64_t r = 0; r < mt; ++r) Y[(m0 + r) * N + n] = static_cast<T>(out[r] + b);
      }
    }
  });
}

template <class Dot, bool INTERLEAVED = false>
void linear_with(const torch::Tensor& x, const torch::Tensor& w, int64_t qk, const float* bias, torch::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1);
  auto run = [&](const auto* X, auto* Y) {
    const XRows xq = quantize_rows(X, M, K, Dot::GROUP);
    if constexpr (INTERLEAVED) linear_x8<Dot>(xq, M, w.data_ptr<uint8_t>(), w.size(1), w.size(0), K / qk, bias, Y);
    else linear_rows<Dot>(xq, M, w.data_ptr<uint8_t>(), w.size(1), w.size(0), K / qk, bias, Y);
  };
  if (x.scalar_type() == at::kBFloat16) run(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  else run(x.data_ptr<float>(), y.data_ptr<float>());
}

template <class F>
void dequantize_format(const uint8_t* W, int64_t row_bytes, const int64_t* ids, int64_t n, int64_t K, float* Y) {
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    alignas(32) int8_t q[32];
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* w = W + ids[i] * row_bytes;
      float* y = Y + i * K;
      for (int64_t blk = 0; blk < K / F::QK; ++blk)
        F::visit(w + blk * F::BYTES, [&](int k, const Sub& s) {
          _mm256_store_si256(reinterpret_cast<__m256i*>(q), s.q);
          float* out = y + blk * F::QK + 32 * k;
          if (F::SIGNED) {
            for (int j = 0; j < 32; ++j) out[j] = s.a * static_cast<float>(q[j]);
            return;
          }
          const float a_lo = s.a * static_cast<float>(s.s_lo), a_hi = s.a * static_cast<float>(s.s_hi);
          for (int j = 0; j < 32; ++j) {
            const float v = (j < 16 ? a_lo : a_hi) * static_cast<float>(static_cast<uint8_t>(q[j]) - s.o);
            out[j] = s.c != 0.f ? v + s.c : v;
          }
        });
    }
  });
}

template <class Fn>
void by_format(int64_t type, Fn&& fn) {
  switch (type) {
    case Q4_0: fn(FQ4_0{}); break;
    case Q4_1: fn(FQ4_1{}); break;
    case Q5_0: fn(FQ5_0{}); break;
    case Q5_1: fn(FQ5_1{}); break;
    case Q8_0: fn(FQ8_0{}); break;
    case Q4_K: fn(FQ4_K{}); break;
    case Q5_K: fn(FQ5_K{}); break;
    case Q6_K: fn(FQ6_K{}); break;
    default: TORCH_CHECK(false, "linear_q: ggml type ", type, " is not served by the kernels");
  }
}

void check_weight(const torch::Tensor& w, int64_t type, int64_t K, const char* name) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), name, ": a uint8 [N, row bytes] weight");
  TORCH_CHECK(type < X8 || w.size(0) % 8 == 0, name, ": interleaved blocks come in groups of 8 rows; the weight has ",
              w.size(0));
  int64_t qk = 0, bytes = 0;
  by_format(type % X8, [&](auto f) { qk = decltype(f)::QK; bytes = decltype(f)::BYTES; });
  TORCH_CHECK(K % qk == 0 && w.size(1) == K / qk * bytes, name, ": ", K, " inputs in ", qk, "-value blocks need ",
              K / qk * bytes, " bytes per row, the weight has ", w.size(1));
}

}  // namespace

bool linear_q_available() { return true; }

std::string linear_q_kind() {
#if defined(HISPEC_X8_INT32) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
  return "vnni";
#elif defined(HISPEC_X8_INT32)
  return "int32";  // the VNNI loops on a CPU without VNNI (to test them)
#else
  return "avx2";
#endif
}

// x [M, K] bf16 or float32; w uint8 [N, K / QK * BYTES], the file's blocks row by row; bias float32 [N] or
// empty. Returns [M, N] in x's dtype.
torch::Tensor linear_q(const torch::Tensor& x, const torch::Tensor& w, int64_t type, const torch::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), "linear_q: x [M, K], "
              "float32 or bf16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, type, K, "linear_q");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.numel() == N), "linear_q: a float32 bias of ",
              N, " values");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* B = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const auto xc = x.contiguous();
  switch (type) {
    case Q4_K: linear_with<KDot<4>>(xc, w, 256, B, y); break;
    case Q5_K: linear_with<KDot<5>>(xc, w, 256, B, y); break;
    case Q6_K: linear_with<KDot<6>>(xc, w, 256, B, y); break;
    case Q4_0: linear_with<RowDot<Q4_0, 18>>(xc, w, 32, B, y); break;
    case Q4_1: linear_with<RowDot<Q4_1, 20>>(xc, w, 32, B, y); break;
    case Q5_0: linear_with<RowDot<Q5_0, 22>>(xc, w, 32, B, y); break;
    case Q5_1: linear_with<RowDot<Q5_1, 24>>(xc, w, 32, B, y); break;
    case Q8_0: linear_with<RowDot<Q8_0, 34>>(xc, w, 32, B, y); break;
    case X8 + Q4_K: linear_with<X8Dot<Q4_K>, true>(xc, w, 256, B, y); break;
    case X8 + Q5_K: linear_with<X8Dot<Q5_K>, true>(xc, w, 256, B, y); break;
    case X8 + Q6_K: linear_with<X8Dot<Q6_K>, true>(xc, w, 256, B, y); break;
    case X8 + Q4_0: linear_with<X8Dot<Q4_0>, true>(xc, w, 32, B, y); break;
    case X8 + Q4_1: linear_with<X8Dot<Q4_1>, true>(xc, w, 32, B, y); break;
    case X8 + Q5_0: linear_with<X8Dot<Q5_0>, true>(xc, w, 32, B, y); break;
    case X8 + Q5_1: linear_with<X8Dot<Q5_1>, true>(xc, w, 32, B, y); break;
    case X8 + Q8_0: linear_with<X8Dot<Q8_0>, true>(xc, w, 32, B, y); break;
    default: TORCH_CHECK(false, "linear_q: ggml type ", type, " is not served by the kernels");
  }
  return y;
}

// rows ids of w as float32 [len(ids), K] (the weight's values, as ggml de-quantizes them)
torch::Tensor dequantize_rows(const torch::Tensor& w, int64_t type, const torch::Tensor& ids, int64_t K) {
  TORCH_CHECK(type < X8, "dequantize_rows: row-major blocks only (hispec_decode.layers.quant.unpack_rows reads "
              "interleaved ones)");
  check_weight(w, type, K, "dequantize_rows");
  const auto idx = ids.to(at::kLong).contiguous();
  const int64_t n = idx.numel();
  const int64_t* I = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(I[i] >= 0 && I[i] < w.size(0), "dequantize_rows: row ", I[i], " of ", w.size(0));
  auto y = torch::empty({n, K}, w.options().dtype(at::kFloat));
  by_format(type, [&](auto f) {
    dequantize_format<decltype(f)>(w.data_ptr<uint8_t>(), w.size(1), I, n, K, y.data_ptr<float>());
  });
  return y;
}

#else

bool linear_q_available() { return false; }
std::string linear_q_kind() { return "none"; }
torch::Tensor linear_q(const torch::Tensor&, const torch::Tensor&, int64_t, const torch::Tensor&) {
  TORCH_CHECK(false, "linear_q: built without AVX2, FMA and F16C");
}
torch::Tensor dequantize_rows(const torch::Tensor&, int64_t, const torch::Tensor&, int64_t) {
  TORCH_CHECK(false, "dequantize_rows: built without AVX2, FMA and F16C");
}

#endif

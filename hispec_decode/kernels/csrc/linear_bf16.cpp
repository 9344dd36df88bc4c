// y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for bf16 x and w, fp32 accumulation, bf16 y.
//
// The weight is packed once into a "VNNI" layout: for every 16 output columns (a column block) and
// every pair of inputs (k, k+1), one 64-byte vector. One AVX-512 BF16 instruction (vdpbf16ps) then
// adds x[k] w[n, k] + x[k+1] w[n, k+1] to 16 outputs at once, so a step streams the weight once,
// front to back, with no horizontal sums. The weight is the only large operand of a decoding step:
// at one row this is a memory-bound scan, at 12 rows each vector loaded is used for every row.
//
// Two arrangements of those vectors (hispec_decode.layers.linear.pack_vnni):
// - group 1, [N/16, K/2, 16, 2]: each column block's vectors one after another. AMX (linear_amx)
//   loads a B tile as 16 consecutive vectors of a block (32 inputs x 16 columns) against an A tile
//   of 16 rows x 32 inputs, so every call up to 16 rows costs about what reading the weight costs.
//   The AVX2 loop reads it too.
// - group 2, [N/32, K/2, 2, 16, 2]: two column blocks side by side for each input pair, for the
//   AVX-512 loop. A thread reads each pair of blocks as one contiguous stream, which the hardware
//   prefetcher follows better than two streams a block apart.
// Where the CPU has AMX it serves every call; the AVX-512 loop serves CPUs with AVX-512 BF16 and no
// AMX. That loop does one multiply-add vector per (row, column block, input pair), so from a few
// rows on it is bound by arithmetic; it keeps up to 12 rows in one register tile so the weight is
// still read once.
//
// Reduction order: in every kernel output (m, n) accumulates over k in increasing order (pairs in
// one lane; 32-input tile steps) into its own accumulator, whatever M is, whichever other rows
// share the call and however the work is split between threads (threads split columns, never k).
// A row's result is therefore the same bits alone or in any batch, per kernel.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec.h"

#if defined(__AVX512BF16__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HISPEC_AMX 1
#endif

namespace {

// The checks every kernel makes of its operands: bf16, contiguous, x [M, 2*K2] against the packed
// weight of its group, a float32 bias (or none) of one value per packed column.
[[maybe_unused]] void check_operands(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& bias,
                                     const char* name, int64_t group = 1) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16, name, ": bf16 tensors");
  TORCH_CHECK(x.is_contiguous() && wp.is_contiguous() && x.dim() == 2, name, ": layout");
  TORCH_CHECK(group == 1 ? wp.dim() == 4 : (wp.dim() == 5 && wp.size(2) == group), name, ": a weight packed with ",
              group, " column block(s) per input pair (pack_vnni(weight, group=", group, "))");
  TORCH_CHECK(x.size(1) == 2 * wp.size(1), name, ": x has ", x.size(1), " features, the weight ", 2 * wp.size(1));
  const int64_t columns = wp.size(0) * group * 16;
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.numel() == columns), name,
              ": a float32 bias of one value per packed column (", columns, "), got ", bias.numel());
}

}  // namespace

#if defined(__AVX512BF16__)

namespace {

constexpr int64_t kCols = 16;  // output columns per packed block (one fp32 vector)
constexpr int64_t kGroup = 2;  // column blocks side by side per input pair: one 128-byte stream
constexpr int64_t kRows = 12;  // rows per tile: 12 x 2 accumulators, 2 weight vectors, 1 input

// rows x[0..MB) against one group (2 column blocks from column n0); w points at the group's first
// vector, its input pair k2 at w + k2 * 64 (uint16). The weight is read front to back, once per tile.
template <int MB>
inline void tile(const uint32_t* x, int64_t K2, const uint16_t* w, const float* bias, uint16_t* y, int64_t y_stride,
                 int64_t n0) {
  __m512 acc[MB][kGroup];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < kGroup; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    __m512bh wv[kGroup];
    for (int j = 0; j < kGroup; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + (k2 * kGroup + j) * 2 * kCols);
    for (int i = 0; i < MB; ++i) {
      __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[i * K2 + k2]);
      for (int j = 0; j < kGroup; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int j = 0; j < kGroup; ++j) {
    __m512 b = bias ? _mm512_loadu_ps(bias + n0 + j * kCols) : _mm512_setzero_ps();
    for (int i = 0; i < MB; ++i) {
      __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], b));
      _mm256_storeu_si256((__m256i*)(y + i * y_stride + n0 + j * kCols), (__m256i)out);
    }
  }
}

}  // namespace

bool linear_bf16_available() { return true; }
std::string linear_bf16_kind() { return "avx512_bf16"; }
int64_t linear_bf16_group() { return kGroup; }

// x: [M, 2*K2] bf16 contiguous (K padded to even by the caller); wp: [Np/32, K2, 2, 16, 2] bf16;
// bias: fp32 [Np] or empty. Returns [M, Np] bf16 (Np = N rounded up to 32).
//
// Each thread streams its own groups of the weight; every group is one contiguous stream, which the
// hardware prefetcher follows best. Up to 12 rows share one pass over the weight; more rows are cut
// into near-equal tiles of at most 12 that find the group's weight in cache after the first.
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& bias) {
  check_operands(x, wp, bias, "linear_bf16", kGroup);
  const int64_t M = x.size(0), groups = wp.size(0), K2 = wp.size(1), Np = groups * kGroup * kCols;
  auto y = torch::empty({M, Np}, x.options());
  const uint32_t* X = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* W = reinterpret_cast<const uint16_t*>(wp.data_ptr<at::BFloat16>());
  uint16_t* Y = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float* B = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const int64_t group = K2 * kGroup * 2 * kCols;  // uint16 elements per group
  const int64_t tiles = (M + kRows - 1) / kRows;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = M * t / tiles, mb = M * (t + 1) / tiles - m0;
        const uint32_t* xr = X + m0 * K2;
        uint16_t* yr = Y + m0 * Np;
        const uint16_t* w = W + g * group;
        const int64_t n0 = g * kGroup * kCols;
        switch (mb) {
#define HISPEC_TILE(n) case n: tile<n>(xr, K2, w, B, yr, Np, n0); break;
          HISPEC_TILE(1) HISPEC_TILE(2) HISPEC_TILE(3) HISPEC_TILE(4) HISPEC_TILE(5) HISPEC_TILE(6)
          HISPEC_TILE(7) HISPEC_TILE(8) HISPEC_TILE(9) HISPEC_TILE(10) HISPEC_TILE(11) HISPEC_TILE(12)
#undef HISPEC_TILE
          default: break;
        }
      }
  });
  return y;
}

#elif defined(__AVX2__) && defined(__FMA__)

// AVX2 + FMA (no AVX-512 BF16): the same VNNI weight, read as 32-bit lanes of (w[n, 2i], w[n, 2i+1])
// pairs for 8 columns per 256-bit load. A lane shifted left by 16 is w[n, 2i] as float32, the lane
// with its low half cleared is w[n, 2i+1]: two integer ops turn 8 weight pairs into two float32
// vectors, each then used for every row of the tile (one FMA per row and vector). Output (m, n)
// adds x[m, 2i] w[n, 2i], then x[m, 2i+1] w[n, 2i+1], for i in increasing order, into its own
// accumulator: the same order for any M, so a row's bits never depend on the others.

namespace {

constexpr int64_t kCols = 16;  // output columns per packed block (two 8-column units)

// rows x[0..MB) (float32, stride Kp), NU units of 8 columns from unit 0 of block w (unit j: block
// j / 2, half j % 2); y columns n0 .. n0 + 8 NU
template <int MB, int NU>
inline void tile(const float* x, int64_t Kp, const uint16_t* w, int64_t block, int64_t K2, const float* bias,
                 uint16_t* y, int64_t y_stride, int64_t n0) {
  __m256 acc[MB][NU];
#pragma GCC unroll 16
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NU; ++j) acc[i][j] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const uint16_t* units[NU];
#pragma GCC unroll 16
  for (int j = 0; j < NU; ++j) units[j] = w + (j / 2) * block + (j % 2) * 16;
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    const int64_t at = k2 * 2 * kCols;
    __m256 even[NU], odd[NU];
#pragma GCC unroll 16
    for (int j = 0; j < NU; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(units[j] + at));
      even[j] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      odd[j] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
    }
#pragma GCC unroll 16
    for (int i = 0; i < MB; ++i) {
      const __m256 x0 = _mm256_broadcast_ss(x + i * Kp + 2 * k2), x1 = _mm256_broadcast_ss(x + i * Kp + 2 * k2 + 1);
#pragma GCC unroll 16
      for (int j = 0; j < NU; ++j) acc[i][j] = _mm256_fmadd_ps(x1, odd[j], _mm256_fmadd_ps(x0, even[j], acc[i][j]));
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < NU; ++j) {
    const __m256 b = bias ? _mm256_loadu_ps(bias + n0 + 8 * j) : _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int i = 0; i < MB; ++i)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i * y_stride + n0 + 8 * j), hispec::bf16_bits8(_mm256_add_ps(acc[i][j], b)));
  }
}

// column blocks [b, b + NU / 2) for every row, in tiles of up to MB rows
template <int MB, int NU>
inline void rows_of(const float* x, int64_t M, int64_t Kp, const uint16_t* w, int64_t block, int64_t K2,
                    const float* bias, uint16_t* y, int64_t Np, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + MB <= M; m0 += MB) tile<MB, NU>(x + m0 * Kp, Kp, w, block, K2, bias, y + m0 * Np, Np, n0);
  switch (M - m0) {  // the last rows
    case 3: tile<3, NU>(x + m0 * Kp, Kp, w, block, K2, bias, y + m0 * Np, Np, n0); break;
    case 2: tile<2, NU>(x + m0 * Kp, Kp, w, block, K2, bias, y + m0 * Np, Np, n0); break;
    case 1: tile<1, NU>(x + m0 * Kp, Kp, w, block, K2, bias, y + m0 * Np, Np, n0); break;
    default: break;
  }
}

// the blocks [begin, end) for every row: NB blocks at a time (more independent accumulators when
// there are few rows), one at a time at the end of the range
template <int MB, int NB>
inline void blocks_of(const float* x, int64_t M, int64_t Kp, const uint16_t* W, int64_t block, int64_t K2,
                      const float* bias, uint16_t* y, int64_t Np, int64_t begin, int64_t end) {
  int64_t b = begin;
  for (; b + NB <= end; b += NB)
    rows_of<MB, 2 * NB>(x, M, Kp, W + b * block, block, K2, bias, y, Np, b * kCols);
  for (; b < end; ++b) rows_of<MB, 2>(x, M, Kp, W + b * block, block, K2, bias, y, Np, b * kCols);
}

}  // namespace

bool linear_bf16_available() { return true; }
std::string linear_bf16_kind() { return "avx2"; }
int64_t linear_bf16_group() { return 1; }

torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& bias) {
  check_operands(x, wp, bias, "linear_bf16");
  const int64_t M = x.size(0), blocks = wp.size(0), K2 = wp.size(1), Np = blocks * kCols, Kp = 2 * K2;
  auto y = torch::empty({M, Np}, x.options());
  const auto xf = x.to(at::kFloat);  // x converted once; each of its values is broadcast to a whole vector
  const float* X = xf.data_ptr<float>();
  const uint16_t* W = reinterpret_cast<const uint16_t*>(wp.data_ptr<at::BFloat16>());
  uint16_t* Y = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float* B = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const int64_t block = K2 * 2 * kCols;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    if (M == 1) blocks_of<1, 4>(X, M, Kp, W, block, K2, B, Y, Np, begin, end);       // 8 accumulators
    else if (M == 2) blocks_of<2, 2>(X, M, Kp, W, block, K2, B, Y, Np, begin, end);  // 8
    else blocks_of<4, 1>(X, M, Kp, W, block, K2, B, Y, Np, begin, end);              // 8, 6 or 4
  });
  return y;
}

#else  // neither AVX-512 BF16 nor AVX2 + FMA at build time: the caller keeps oneDNN

bool linear_bf16_available() { return false; }
std::string linear_bf16_kind() { return "none"; }
int64_t linear_bf16_group() { return 1; }
torch::Tensor linear_bf16(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "linear_bf16: built without AVX-512 BF16 or AVX2");
}

#endif

#if defined(HISPEC_AMX) && defined(__AVX512BF16__)

namespace {

struct TileConfig {  // palette 1: tiles 0-3 accumulators, 4 the A tile (x), 5-7 B tiles (weights)
  uint8_t palette = 1, start_row = 0, reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

inline void configure(int rows) {
  TileConfig c;
  for (int t = 0; t < 5; ++t) { c.rows[t] = rows; c.colsb[t] = 64; }
  for (int t = 5; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  _tile_loadconfig(&c);
}

}  // namespace

bool amx_available() {  // Linux hands out the tile state only on request, once per process
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// x: [M, K] bf16 contiguous with K a multiple of 32; wp: the VNNI weight. Returns [M, Np] bf16.
torch::Tensor linear_amx(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& bias) {
  TORCH_CHECK(amx_available(), "linear_amx: this CPU or kernel grants no AMX tiles");
  check_operands(x, wp, bias, "linear_amx");
  const int64_t M = x.size(0), K = x.size(1), blocks = wp.size(0), K2 = wp.size(1), Np = blocks * kCols;
  TORCH_CHECK(K % 32 == 0, "linear_amx: ", K, " features; AMX tiles need a multiple of 32 (see pack_vnni)");
  auto y = torch::empty({M, Np}, x.options());
  const uint16_t* X = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* W = reinterpret_cast<const uint16_t*>(wp.data_ptr<at::BFloat16>());
  uint16_t* Y = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float* B = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const int64_t block = K2 * 2 * kCols;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float c[4][16 * 16];
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int mr = static_cast<int>(std::min<int64_t>(16, M - m0));
      configure(mr);
      for (int64_t b = begin; b < end; b += 4) {
        const int nb = static_cast<int>(std::min<int64_t>(4, end - b));
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t k0 = 0; k0 < K; k0 += 32) {
          _tile_loadd(4, X + m0 * K + k0, K * 2);
          const uint16_t* wb = W + b * block + k0 * kCols;  // 16 k-pairs x 16 columns, 64 bytes apart
          if (k0 + 64 < K)  // the B tiles two steps ahead: without it a tile load waits on DRAM (1.6x slower)
            for (int j = 0; j < nb; ++j) {
              const char* ahead = reinterpret_cast<const char*>(wb + j * block + 64 * kCols);
              for (int line = 0; line < 1024; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
            }
          _tile_loadd(5, wb, 64); _tile_dpbf16ps(0, 4, 5);
          if (nb > 1) { _tile_loadd(6, wb + block, 64); _tile_dpbf16ps(1, 4, 6); }
          if (nb > 2) { _tile_loadd(7, wb + 2 * block, 64); _tile_dpbf16ps(2, 4, 7); }
          if (nb > 3) { _tile_loadd(5, wb + 3 * block, 64); _tile_dpbf16ps(3, 4, 5); }
        }
        _tile_stored(0, c[0], 64);
        if (nb > 1) _tile_stored(1, c[1], 64);
        if (nb > 2) _tile_stored(2, c[2], 64);
        if (nb > 3) _tile_stored(3, c[3], 64);
        for (int j = 0; j < nb; ++j) {
          const int64_t n0 = (b + j) * kCols;
          const __m512 bv = B ? _mm512_loadu_ps(B + n0) : _mm512_setzero_ps();
          for (int i = 0; i < mr; ++i) {
            const __m256bh o = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(c[j] + i * 16), bv));
            _mm256_storeu_si256((__m256i*)(Y + (m0 + i) * Np + n0), (__m256i)o);
          }
        }
      }
      _tile_release();
    }
  });
  return y;
}

#else

bool amx_available() { return false; }
torch::Tensor linear_amx(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "linear_amx: built without AMX");
}

#endif

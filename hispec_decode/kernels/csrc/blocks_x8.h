// GGUF blocks of 8 output rows interleaved ("x8"), the layout linear_q serves many rows from.
//
// Layout: the bytes of rows 8g .. 8g + 7 (8 * row bytes, where rows 8g .. 8g + 7 lie in [N, row bytes])
// hold, block by block, the 8 rows' copies of that block with every field split into chunks and the
// chunks of the 8 rows side by side: field bytes [chunk i][row c][chunk bytes]. Chunks: 2 bytes for
// half-precision scales (8 scales load as one vector), 1 byte for the K formats' packed scales (8
// bytes: one byte of each row), 4 bytes for quants and high bits (32 bytes: 4 of each row). The
// permutation is hispec_decode.layers.quant.pack; the fields' offsets below are ggml's, times 8.
//
// One 32-byte load is then 4 consecutive inputs of 8 rows; against 4 activations broadcast, one
// vpmaddubsw serves 8 outputs, so int32 lane c is output c throughout and no horizontal sum is needed.
// Products add up in int16 as far as they cannot overflow (8 loads of 4-bit values, 4 of 5-bit, 2 of
// 6-bit, 1 of 8-bit), then in int32, then in float once per activation block, in increasing k: the
// same order for every row of a call, so the kernel stays batch-invariant.
// With VNNI (AVX512-VNNI with VL, or AVX-VNNI; HISPEC_X8_INT32) vpdpbusd adds 4 products straight into
// int32 lane c, replacing vpmaddubsw, the int16 adds and vpmaddwd; sub-block scales then multiply int32
// sums. The integers are the same (the int16 sums never overflow), so the outputs are bit for bit equal.
// AVX2 + FMA + F16C; included by linear_q.cpp after quant_blocks.h.
#pragma once

#if ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)) && !defined(HISPEC_X8_INT16) && \
    !defined(HISPEC_X8_INT32)
#define HISPEC_X8_INT32 1
#endif  // (either loop can be forced with -DHISPEC_X8_INT32 or -DHISPEC_X8_INT16: tests/test_block_loops.py)

namespace hispec_blocks {

// acc + the sums of 4 adjacent products u * s (u unsigned, s signed bytes), per int32 lane
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else  // HISPEC_X8_INT32 forced on a CPU without VNNI (to test those loops): exact, as |u * s| pairs < 2^15 here
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

constexpr int64_t X8 = 256;  // added to a ggml type: its blocks are interleaved by 8 rows

// Software prefetch of the block PREFETCH_BLOCKS ahead (a group's blocks, then the next group's) where a
// tile's work on a block outlasts the arrival of its bytes: tiles of PREFETCH_ROWS rows or more, Q6_K
// (the costliest decoding) from PREFETCH_ROWS_Q6K. Smaller tiles leave streaming to the hardware
// (docs/native.md, "Interleaved blocks").
constexpr int64_t PREFETCH_BLOCKS = 4;
constexpr int PREFETCH_ROWS = 5, PREFETCH_ROWS_Q6K = 2;

template <int64_t BLOCK>
inline void prefetch_ahead(const uint8_t* b) {
  for (int64_t o = 0; o < BLOCK; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(b + PREFETCH_BLOCKS * BLOCK + o), _MM_HINT_T0);
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline __m256 halves8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Q5_0 / Q5_1: lane c holds row c's 32 high bits; byte b of lane c becomes 16 where bit shift + b is set
inline __m256i high_bits(__m256i qh, int shift) {
  const __m256i v = _mm256_srl_epi32(qh, _mm_cvtsi32_si128(shift));
  const __m256i spread = _mm256_shuffle_epi8(v, _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                                                                  0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
  const __m256i bit = _mm256_set1_epi32(0x08040201);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// 8 bytes (one per row) as int16 pairs (v, v) in int32 lane c
inline __m256i pairs_u8(__m128i b8) {
  const __m256i w = _mm256_cvtepu8_epi32(b8);
  return _mm256_or_si256(w, _mm256_slli_epi32(w, 16));
}

// the K formats' sub-block scales, 8 bytes (one per row): int32 lanes (HISPEC_X8_INT32) or int16 pairs
inline __m256i scales(__m128i b8) {
#if defined(HISPEC_X8_INT32)
  return _mm256_cvtepu8_epi32(b8);
#else
  return pairs_u8(b8);
#endif
}

// 32-value formats: the 8 rows of group g against rows m0 .. m0 + MT of x; acc[r] lane c += out (m0 + r, c).
// The 32 inputs go 4 at a time (t), each decoded once for the MT rows, whose sums stay in registers.
template <int64_t TYPE, int MT>
inline void x8_dot32(const uint8_t* g, int64_t nb, const int8_t* Q, const float* D, const float* XS, int64_t K,
                     __m256* acc) {
  constexpr bool SIGNED = TYPE == Q8_0, MIN = TYPE == Q4_1 || TYPE == Q5_1, FIVE = TYPE == Q5_0 || TYPE == Q5_1;
  constexpr int64_t BYTES = TYPE == Q4_0 ? 18 : TYPE == Q4_1 ? 20 : TYPE == Q5_0 ? 22 : TYPE == Q5_1 ? 24 : 34;
  constexpr int64_t QS = TYPE == Q4_1 ? 4 : TYPE == Q5_0 ? 6 : TYPE == Q5_1 ? 8 : 2, QH = TYPE == Q5_0 ? 2 : 4;
  constexpr float OFFSET = TYPE == Q4_0 ? 8.f : TYPE == Q5_0 ? 16.f : 0.f;
  [[maybe_unused]] constexpr int RUN = FIVE ? 4 : 8;  // int16 sums hold this many loads of 5-bit (4-bit) values
  const int64_t KB = K / 32;
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* b = g + blk * 8 * BYTES;
    if constexpr (MT >= PREFETCH_ROWS) prefetch_ahead<8 * BYTES>(b);
    const __m256i qh = FIVE ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 8 * QH)) : _mm256_setzero_si256();
    __m256i p[MT];
    [[maybe_unused]] __m256i s[MT];
    for (int r = 0; r < MT; ++r) p[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {  // inputs 4t .. 4t + 3 of the 8 rows: byte chunk t % 4, its low (t < 4) or high nibbles
      __m256i q;
      if constexpr (SIGNED) {
        q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 8 * QS + 32 * t));
      } else {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 8 * QS + 32 * (t % 4)));
        q = _mm256_and_si256(t < 4 ? v : _mm256_srli_epi16(v, 4), low);
        if constexpr (FIVE) q = _mm256_or_si256(q, high_bits(qh, 4 * t));
      }
#pragma GCC unroll 8
      for (int r = 0; r < MT; ++r) {
        const __m256i x = bcast4(Q + r * K + blk * 32 + 4 * t);
#if defined(HISPEC_X8_INT32)  // Q8_0: |q| against x with q's sign
        p[r] = SIGNED ? dot4(p[r], _mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)) : dot4(p[r], q, x);
#else
        if constexpr (SIGNED) {
          p[r] = _mm256_add_epi32(p[r], _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q),
                                                                               _mm256_sign_epi8(x, q)), ones));
        } else {
          const __m256i m = _mm256_maddubs_epi16(q, x);
          s[r] = t % RUN ? _mm256_add_epi16(s[r], m) : m;
          if (t % RUN == RUN - 1) p[r] = _mm256_add_epi32(p[r], _mm256_madd_epi16(s[r], ones));
        }
#endif
      }
    }
    const __m256 a = halves8(b);
    const __m256 coef = MIN ? halves8(b + 16) : _mm256_mul_ps(a, _mm256_set1_ps(-OFFSET));
#pragma GCC unroll 8
    for (int r = 0; r < MT; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[r]), _mm256_mul_ps(a, _mm256_set1_ps(D[r * KB + blk])), acc[r]);
      if constexpr (!SIGNED) acc[r] = _mm256_fmadd_ps(coef, _mm256_set1_ps(XS[r * KB + blk]), acc[r]);
    }
  }
}

// The K formats go one sub-block (32 inputs) at a time for a tile of several rows, so that its sums stay
// in registers (one row: all the sub-blocks a load of quants holds); scales are decoded where they are
// used, mins and offsets after the last sub-block.

// Q4_K / Q5_K: d [8 halves] dmin [8 halves] 12 planes of packed scales, (Q5_K: qh 32 chunks of 4), qs 32 chunks
template <bool FIVE, int MT>
inline void x8_q45k(const uint8_t* g, int64_t nb, const int8_t* Q, const float* D, const int16_t* BS, int64_t K,
                    __m256* acc) {
  constexpr int64_t BYTES = FIVE ? 176 : 144;
  constexpr int PASS = MT == 1 ? 2 : 1;  // sub-blocks per pass over the quants: both nibbles of a load for one row
  const __m256i low = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  const __m128i m6 = _mm_set1_epi8(63), m4 = _mm_set1_epi8(0x0F), m2 = _mm_set1_epi8(3);
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* b = g + blk * 8 * BYTES;
    if constexpr (MT >= PREFETCH_ROWS) prefetch_ahead<8 * BYTES>(b);
    auto plane = [&](int i) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 32 + 8 * i)); };
    auto top = [&](int i) { return _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(plane(i), 6), m2), 4); };
    // sub-block s's 6-bit scale and min, one byte per row (ggml's get_scale_min_k4)
    auto scale8 = [&](int s) { return s < 4 ? _mm_and_si128(plane(s), m6) : _mm_or_si128(_mm_and_si128(plane(s + 4), m4), top(s - 4)); };
    auto min8 = [&](int s) {
      return s < 4 ? _mm_and_si128(plane(s + 4), m6) : _mm_or_si128(_mm_and_si128(_mm_srli_epi16(plane(s + 4), 4), m4), top(s));
    };
    const uint8_t* qh = b + 8 * 16;
    const uint8_t* qs = b + 8 * (FIVE ? 48 : 16);
    __m256i iacc[MT];
    for (int r = 0; r < MT; ++r) iacc[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int s0 = 0; s0 < 8; s0 += PASS) {  // sub-blocks s0 .. s0 + PASS - 1 (inputs 32s ..: nibble s % 2 of chunks 8 (s / 2) ..)
      __m256i sum[PASS][MT];
      for (int u = 0; u < PASS; ++u)
        for (int r = 0; r < MT; ++r) sum[u][r] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int t = 0; t < 8; ++t) {  // (unrolled further, the compiler sums the products as a tree and spills)
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (8 * (s0 / 2) + t)));
        [[maybe_unused]] const __m256i h = FIVE ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * t)) : v;
#pragma GCC unroll 2
        for (int u = 0; u < PASS; ++u) {
          const int s = s0 + u;
          __m256i q = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(v, 4) : v, low);
          if constexpr (FIVE)  // bit s of qh
            q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(s)), one), 4));
#pragma GCC unroll 8
          for (int r = 0; r < MT; ++r) {
            const __m256i x = bcast4(Q + r * K + blk * 256 + 32 * s + 4 * t);
#if defined(HISPEC_X8_INT32)
            sum[u][r] = dot4(sum[u][r], q, x);
#else
            sum[u][r] = _mm256_add_epi16(sum[u][r], _mm256_maddubs_epi16(q, x));
#endif
          }
        }
#if !defined(HISPEC_X8_INT32)
        if (t == 7 || (FIVE && t == 3)) {  // 5-bit values: int16 holds 4 loads' sums, 4-bit values 8
          for (int u = 0; u < PASS; ++u) {
            const __m256i sc = scales(scale8(s0 + u));  // row c's scale as an int16 pair in lane c
#pragma GCC unroll 8
            for (int r = 0; r < MT; ++r) {
              iacc[r] = _mm256_add_epi32(iacc[r], _mm256_madd_epi16(sum[u][r], sc));
              sum[u][r] = _mm256_setzero_si256();
            }
          }
        }
#endif
      }
#if defined(HISPEC_X8_INT32)
      for (int u = 0; u < PASS; ++u) {
        const __m256i sc = scales(scale8(s0 + u));  // int32 lanes
#pragma GCC unroll 8
        for (int r = 0; r < MT; ++r) iacc[r] = _mm256_add_epi32(iacc[r], _mm256_mullo_epi32(sum[u][r], sc));
      }
#endif
    }
    const __m256 d = halves8(b), dmin = halves8(b + 16);
    __m256i mn[8];  // sub-block s's min of row c as an int16 pair in lane c
    for (int s = 0; s < 8; ++s) mn[s] = pairs_u8(min8(s));
#pragma GCC unroll 8
    for (int r = 0; r < MT; ++r) {
      const float dx = D[r * (K / 256) + blk];
      const int8_t* sums = reinterpret_cast<const int8_t*>(BS + r * (K / 16) + blk * 16);  // x's sums per 16 inputs
      __m256i m = _mm256_setzero_si256();
      for (int s = 0; s < 8; ++s) m = _mm256_add_epi32(m, _mm256_madd_epi16(mn[s], bcast4(sums + 4 * s)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r]), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_mul_ps(dmin, _mm256_set1_ps(-dx)), acc[r]);
    }
  }
}

// Q6_K: d [8 halves], 16 planes of int8 scales, then per 128 inputs (h): ql 16 chunks, qh 8 chunks
template <int MT>
inline void x8_q6k(const uint8_t* g, int64_t nb, const int8_t* Q, const float* D, const int16_t* BS, int64_t K,
                   __m256* acc) {
  constexpr int PASS = MT == 1 ? 4 : 1;  // groups per pass over the quants: all four of a load for one row
  const __m256i mask16 = _mm256_set1_epi32(0xFFFF), low = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* b = g + blk * 8 * 210;
    if constexpr (MT >= PREFETCH_ROWS_Q6K) prefetch_ahead<8 * 210>(b);
    // scale k of row c, sign-extended to int32 lane c
    auto scale32 = [&](int k) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 16 + 8 * k))); };
    __m256i iacc[MT];
    for (int r = 0; r < MT; ++r) iacc[r] = _mm256_setzero_si256();
    for (int s0 = 0; s0 < 8; s0 += PASS) {  // groups s0 .. s0 + PASS - 1 (inputs 32s ..: half s / 4, group s % 4 of it)
      const uint8_t* ql = b + 144 + 768 * (s0 / 4);  // group j: the low (j < 2) or high nibbles of chunks 8 (j % 2) ..
      const uint8_t* qh = ql + 512;  // and bits 2j, 2j + 1 of qh
      __m256i sum[PASS][MT], sc[PASS];
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * t));
#pragma GCC unroll 8
        for (int u = 0; u < PASS; ++u) {
          const int s = s0 + u, j = s % 4;
          if (t % 4 == 0) {  // 16 inputs, one scale: (HISPEC_X8_INT32: s) or (s, s) in lane c
            const __m256i w = scale32(2 * s + t / 4);
#if defined(HISPEC_X8_INT32)
            sc[u] = w;
#else
            sc[u] = _mm256_or_si256(_mm256_and_si256(w, mask16), _mm256_slli_epi32(w, 16));
#endif
          }
          const __m256i L = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32 * (8 * (j % 2) + t)));
          const __m256i q = _mm256_or_si256(_mm256_and_si256(j < 2 ? L : _mm256_srli_epi16(L, 4), low),
                                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(H, _mm_cvtsi32_si128(2 * j)), three), 4));
#pragma GCC unroll 8
          for (int r = 0; r < MT; ++r) {
            const __m256i x = bcast4(Q + r * K + blk * 256 + 32 * s + 4 * t);
#if defined(HISPEC_X8_INT32)
            sum[u][r] = dot4(t % 4 ? sum[u][r] : _mm256_setzero_si256(), q, x);
            if (t % 4 == 3) iacc[r] = _mm256_add_epi32(iacc[r], _mm256_mullo_epi32(sum[u][r], sc[u]));
#else
            const __m256i p = _mm256_maddubs_epi16(q, x);
            sum[u][r] = t % 2 ? _mm256_add_epi16(sum[u][r], p) : p;
            if (t % 2) iacc[r] = _mm256_add_epi32(iacc[r], _mm256_madd_epi16(sum[u][r], sc[u]));  // 6-bit values: 2 loads
#endif
          }
        }
      }
    }
    const __m256 d = halves8(b);
    __m256i pair[8];  // (s_2i, s_2i+1) of row c as int16 in lane c
    for (int i = 0; i < 8; ++i)
      pair[i] = _mm256_or_si256(_mm256_and_si256(scale32(2 * i), mask16), _mm256_slli_epi32(scale32(2 * i + 1), 16));
#pragma GCC unroll 8
    for (int r = 0; r < MT; ++r) {
      const int8_t* sums = reinterpret_cast<const int8_t*>(BS + r * (K / 16) + blk * 16);
      __m256i off = _mm256_setzero_si256();
      for (int i = 0; i < 8; ++i) off = _mm256_add_epi32(off, _mm256_madd_epi16(pair[i], bcast4(sums + 4 * i)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(iacc[r], _mm256_slli_epi32(off, 5))),
                               _mm256_mul_ps(d, _mm256_set1_ps(D[r * (K / 256) + blk])), acc[r]);
    }
  }
}

}  // namespace hispec_blocks

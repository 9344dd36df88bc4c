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

// 32-value formats: the 8 rows of group g against rows m0 .. m0 + MT of x; acc[r] lane c += out (m0 + r, c)
template <int64_t TYPE, int MT>
inline void x8_dot32(const uint8_t* g, int64_t nb, const int8_t* Q, const float* D, const float* XS, int64_t K,
                     __m256* acc) {
  constexpr bool SIGNED = TYPE == Q8_0, MIN = TYPE == Q4_1 || TYPE == Q5_1, FIVE = TYPE == Q5_0 || TYPE == Q5_1;
  constexpr int64_t BYTES = TYPE == Q4_0 ? 18 : TYPE == Q4_1 ? 20 : TYPE == Q5_0 ? 22 : TYPE == Q5_1 ? 24 : 34;
  constexpr int64_t QS = TYPE == Q4_1 ? 4 : TYPE == Q5_0 ? 6 : TYPE == Q5_1 ? 8 : 2, QH = TYPE == Q5_0 ? 2 : 4;
  constexpr float OFFSET = TYPE == Q4_0 ? 8.f : TYPE == Q5_0 ? 16.f : 0.f;
  const int64_t KB = K / 32;
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* b = g + blk * 8 * BYTES;
    const __m256 a = halves8(b);
    const __m256 coef = MIN ? halves8(b + 16) : _mm256_mul_ps(a, _mm256_set1_ps(-OFFSET));
    __m256i q[8];  // q[t]: inputs 4t .. 4t + 3 of the 8 rows
    if constexpr (SIGNED) {
      for (int t = 0; t < 8; ++t) q[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 8 * QS + 32 * t));
    } else {
      const __m256i qh = FIVE ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 8 * QH)) : _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 8 * QS + 32 * i));
        q[i] = _mm256_and_si256(v, low);  // inputs 4i ..
        q[i + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);  // inputs 16 + 4i ..
        if constexpr (FIVE) {
          q[i] = _mm256_or_si256(q[i], high_bits(qh, 4 * i));
          q[i + 4] = _mm256_or_si256(q[i + 4], high_bits(qh, 16 + 4 * i));
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MT; ++r) {
      const int8_t* x = Q + r * K + blk * 32;
      __m256i p;
#if defined(HISPEC_X8_INT32)
      p = _mm256_setzero_si256();
      for (int t = 0; t < 8; ++t)  // q[t]: inputs 4t .. 4t + 3 (Q8_0: |q| against x with q's sign)
        p = SIGNED ? dot4(p, _mm256_sign_epi8(q[t], q[t]), _mm256_sign_epi8(bcast4(x + 4 * t), q[t]))
                   : dot4(p, q[t], bcast4(x + 4 * t));
#else
      if constexpr (SIGNED) {
        p = _mm256_setzero_si256();
        for (int t = 0; t < 8; ++t)
          p = _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q[t], q[t]),
                                                                         _mm256_sign_epi8(bcast4(x + 4 * t), q[t])), ones));
      } else if constexpr (FIVE) {
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        for (int t = 0; t < 4; ++t) {
          s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(q[t], bcast4(x + 4 * t)));
          s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(q[t + 4], bcast4(x + 16 + 4 * t)));
        }
        p = _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
      } else {
        __m256i s = _mm256_setzero_si256();
        for (int t = 0; t < 8; ++t) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(q[t], bcast4(x + 4 * t)));
        p = _mm256_madd_epi16(s, ones);
      }
#endif
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(a, _mm256_set1_ps(D[r * KB + blk])), acc[r]);
      if constexpr (!SIGNED) acc[r] = _mm256_fmadd_ps(coef, _mm256_set1_ps(XS[r * KB + blk]), acc[r]);
    }
  }
}

// Q4_K / Q5_K: d [8 halves] dmin [8 halves] 12 planes of packed scales, (Q5_K: qh 32 chunks of 4), qs 32 chunks
template <bool FIVE, int MT>
inline void x8_q45k(const uint8_t* g, int64_t nb, const int8_t* Q, const float* D, const int16_t* BS, int64_t K,
                    __m256* acc) {
  constexpr int64_t BYTES = FIVE ? 176 : 144;
  const __m256i low = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* b = g + blk * 8 * BYTES;
    const __m256 d = halves8(b), dmin = halves8(b + 16);
    __m256i sc[8], mn[8];  // sub-block s's scale (HISPEC_X8_INT32: int32) and min of row c as an int16 pair in lane c
    {
      auto plane = [&](int i) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 32 + 8 * i)); };
      const __m128i m6 = _mm_set1_epi8(63), m4 = _mm_set1_epi8(0x0F), m2 = _mm_set1_epi8(3);
      for (int s = 0; s < 4; ++s) {
        sc[s] = scales(_mm_and_si128(plane(s), m6));
        mn[s] = pairs_u8(_mm_and_si128(plane(s + 4), m6));
        const __m128i top_sc = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(plane(s), 6), m2), 4);
        const __m128i top_mn = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(plane(s + 4), 6), m2), 4);
        sc[s + 4] = scales(_mm_or_si128(_mm_and_si128(plane(s + 8), m4), top_sc));
        mn[s + 4] = pairs_u8(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(plane(s + 8), 4), m4), top_mn));
      }
    }
    const uint8_t* qh = b + 8 * 16;
    const uint8_t* qs = b + 8 * (FIVE ? 48 : 16);
    __m256i iacc[MT];
    for (int r = 0; r < MT; ++r) iacc[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {  // sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles)
      __m256i slo[MT], shi[MT];
      for (int r = 0; r < MT; ++r) slo[r] = shi[r] = _mm256_setzero_si256();
      for (int t = 0; t < 8; ++t) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (8 * j + t)));
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        if constexpr (FIVE) {
          const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * t));
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * j)), one), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * j + 1)), one), 4));
        }
#pragma GCC unroll 4
        for (int r = 0; r < MT; ++r) {
          const int8_t* x = Q + r * K + blk * 256 + 64 * j + 4 * t;
#if defined(HISPEC_X8_INT32)
          slo[r] = dot4(slo[r], lo, bcast4(x));
          shi[r] = dot4(shi[r], hi, bcast4(x + 32));
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < MT; ++r)
        iacc[r] = _mm256_add_epi32(iacc[r], _mm256_add_epi32(_mm256_mullo_epi32(slo[r], sc[2 * j]),
                                                             _mm256_mullo_epi32(shi[r], sc[2 * j + 1])));
#else
          slo[r] = _mm256_add_epi16(slo[r], _mm256_maddubs_epi16(lo, bcast4(x)));
          shi[r] = _mm256_add_epi16(shi[r], _mm256_maddubs_epi16(hi, bcast4(x + 32)));
        }
        if (t == 7 || (FIVE && t == 3)) {  // 5-bit values: int16 holds 4 loads' sums, 4-bit values 8
#pragma GCC unroll 4
          for (int r = 0; r < MT; ++r) {
            iacc[r] = _mm256_add_epi32(iacc[r], _mm256_add_epi32(_mm256_madd_epi16(slo[r], sc[2 * j]),
                                                                 _mm256_madd_epi16(shi[r], sc[2 * j + 1])));
            slo[r] = shi[r] = _mm256_setzero_si256();
          }
        }
      }
#endif
    }
#pragma GCC unroll 4
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
  const __m256i mask16 = _mm256_set1_epi32(0xFFFF);
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* b = g + blk * 8 * 210;
    const __m256 d = halves8(b);
    __m256i sc[16], pair[8];  // sc[k]: scale k of row c as (s, s) in lane c (HISPEC_X8_INT32: s); pair[i]: (s_2i, s_2i+1)
    for (int k = 0; k < 16; ++k) {
      const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 16 + 8 * k)));
#if defined(HISPEC_X8_INT32)
      sc[k] = w;
#else
      sc[k] = _mm256_or_si256(_mm256_and_si256(w, mask16), _mm256_slli_epi32(w, 16));
#endif
      if (k % 2) pair[k / 2] = _mm256_or_si256(_mm256_and_si256(sc[k - 1], mask16), _mm256_slli_epi32(w, 16));
    }
    __m256i iacc[MT];
    for (int r = 0; r < MT; ++r) iacc[r] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = b + 144 + 768 * h;  // this half's 64 bytes of ql per row, then its 32 of qh
      const uint8_t* qh = ql + 512;
      __m256i s16[MT][4];  // (HISPEC_X8_INT32: int32 sums) inputs 128h + 32j + l: ql[64h + 32 (j & 1) + l], nibble j / 2, qh bits 2j
      for (int t = 0; t < 8; ++t) {
        const __m256i L0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32 * t));
        const __m256i L1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32 * (8 + t)));
        const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * t));
        __m256i q[4];
        q6_values(L0, L1, H, q);
#pragma GCC unroll 4
        for (int r = 0; r < MT; ++r) {
          const int8_t* x = Q + r * K + blk * 256 + 128 * h + 4 * t;
#if defined(HISPEC_X8_INT32)
          for (int j = 0; j < 4; ++j)
            s16[r][j] = dot4(t % 4 ? s16[r][j] : _mm256_setzero_si256(), q[j], bcast4(x + 32 * j));
          if (t % 4 == 3)  // 16 inputs, one scale
            for (int j = 0; j < 4; ++j)
              iacc[r] = _mm256_add_epi32(iacc[r], _mm256_mullo_epi32(s16[r][j], sc[8 * h + 2 * j + t / 4]));
#else
          for (int j = 0; j < 4; ++j) {
            const __m256i p = _mm256_maddubs_epi16(q[j], bcast4(x + 32 * j));
            s16[r][j] = t % 2 ? _mm256_add_epi16(s16[r][j], p) : p;
          }
          if (t % 2)  // 6-bit values: int16 holds 2 loads' sums
            for (int j = 0; j < 4; ++j)
              iacc[r] = _mm256_add_epi32(iacc[r], _mm256_madd_epi16(s16[r][j], sc[8 * h + 2 * j + t / 4]));
#endif
        }
      }
    }
#pragma GCC unroll 4
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

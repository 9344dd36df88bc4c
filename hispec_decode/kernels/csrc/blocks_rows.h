// GGUF blocks row by row (ggml's layout): one weight row against up to 4 rows of x, the vector's lanes
// summed at the end. linear_q serves weights whose rows are not a multiple of 8 with these (the others
// are interleaved: blocks_x8.h). AVX2 + FMA + F16C only; included by linear_q.cpp after quant_blocks.h.
#pragma once

namespace hispec_blocks {

// 32-value formats: rows m0 .. m0 + MT against weight row w (nb blocks); out[r] gets row r's value.
// Per block and row: d_x * A * (integer dot) into a vector, (C - A o) * (d_x sum q_x) into a scalar.
template <int64_t TYPE, int64_t BYTES, int MT>
inline void dot32(const uint8_t* w, int64_t nb, const int8_t* Q, const float* D, const float* XS, int64_t K,
                  float* out) {
  constexpr bool SIGNED = TYPE == Q8_0, MIN = TYPE == Q4_1 || TYPE == Q5_1;
  constexpr float OFFSET = TYPE == Q4_0 ? 8.f : TYPE == Q5_0 ? 16.f : 0.f;
  const int64_t KB = K / 32;
  __m256 vacc[MT];
  float sacc[MT];
  for (int r = 0; r < MT; ++r) { vacc[r] = _mm256_setzero_ps(); sacc[r] = 0.f; }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* b = w + blk * BYTES;
    const __m256i q = decode32<TYPE>(b);
    const float a = half(b);
    const float coef = MIN ? half(b + 2) : -a * OFFSET;
    const __m256i qw = SIGNED ? _mm256_sign_epi8(q, q) : q;
#pragma GCC unroll 4
    for (int r = 0; r < MT; ++r) {
      __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Q + r * K + blk * 32));
      if (SIGNED) qx = _mm256_sign_epi8(qx, q);
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(qw, qx), ones);
      vacc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(a * D[r * KB + blk]), vacc[r]);
      if (!SIGNED) sacc[r] += coef * XS[r * KB + blk];
    }
  }
  for (int r = 0; r < MT; ++r) out[r] = hispec::hsum8(vacc[r]) + sacc[r];
}

// K formats (256-value super-blocks, x per 256): per super-block and row, the sub-blocks' integer
// dots times their integer scales add up in one int32 vector, scaled by d * d_x once; the mins (Q4_K,
// Q5_K) or the offset 32 (Q6_K) come from x's sums per 16 inputs.

template <bool FIVE, int MT>
inline void dot_q45k(const uint8_t* w, int64_t nb, const int8_t* Q, const float* D, const int16_t* BS, int64_t K,
                     float* out) {
  __m256 vacc[MT];
  for (int r = 0; r < MT; ++r) vacc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  constexpr int64_t BYTES = FIVE ? 176 : 144;
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* b = w + blk * BYTES;
    const float d = half(b), dmin = half(b + 2);
    const __m256i sm = scales_mins(b + 4);
    const __m256i scales = _mm256_permute2x128_si256(sm, sm, 0x00);  // the 8 scales in both halves
    const __m128i m8 = _mm256_extracti128_si256(sm, 1);
    const __m256i mins = _mm256_set_m128i(_mm_unpackhi_epi16(m8, m8), _mm_unpacklo_epi16(m8, m8));  // m0 m0 m1 m1 ..
    const uint8_t* qs = b + (FIVE ? 48 : 16);
    __m256i qh;
    if (FIVE) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    __m256i iacc[MT];
    for (int r = 0; r < MT; ++r) iacc[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      if (FIVE) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j)), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j + 1)), one), 4));
      }
      // scale 2j (2j + 1) broadcast to every int16 lane: bytes 4j, 4j + 1 (4j + 2, 4j + 3) of each 128-bit half
      const __m256i s_lo = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<short>((4 * j + 1) << 8 | 4 * j)));
      const __m256i s_hi = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<short>((4 * j + 3) << 8 | (4 * j + 2))));
#pragma GCC unroll 4
      for (int r = 0; r < MT; ++r) {
        const int8_t* x = Q + r * K + blk * 256 + 64 * j;
        const __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), s_lo);
        const __m256i c = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32))), s_hi);
        iacc[r] = _mm256_add_epi32(iacc[r], _mm256_add_epi32(a, c));
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MT; ++r) {
      const float dx = D[r * (K / 256) + blk];
      const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(BS + r * (K / 16) + blk * 16));
      vacc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r]), _mm256_set1_ps(d * dx), vacc[r]);
      vacc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mins, bsums)), _mm256_set1_ps(-(dmin * dx)), vacc[r]);
    }
  }
  for (int r = 0; r < MT; ++r) out[r] = hispec::hsum8(vacc[r]);
}

template <int MT>
inline void dot_q6k(const uint8_t* w, int64_t nb, const int8_t* Q, const float* D, const int16_t* BS, int64_t K,
                    float* out) {
  __m256 vacc[MT];
  for (int r = 0; r < MT; ++r) vacc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* b = w + blk * 210;
    const float d = half(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    __m256i iacc[MT];
    for (int r = 0; r < MT; ++r) iacc[r] = _mm256_setzero_si256();
    for (int h128 = 0; h128 < 2; ++h128) {
      const uint8_t* ql = b + 64 * h128;
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h128));
      for (int j = 0; j < 4; ++j) {
        const __m256i lj = j % 2 ? l1 : l0;
        const __m256i nib = j < 2 ? _mm256_and_si256(lj, low) : _mm256_and_si256(_mm256_srli_epi16(lj, 4), low);
        const __m256i q = _mm256_or_si256(nib, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * j), three), 4));
        const int8_t* s = sc + 8 * h128 + 2 * j;
        const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(s[1]), _mm_set1_epi16(s[0]));
#pragma GCC unroll 4
        for (int r = 0; r < MT; ++r) {
          const int8_t* x = Q + r * K + blk * 256 + 128 * h128 + 32 * j;
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), scale);
          iacc[r] = _mm256_add_epi32(iacc[r], p);
        }
      }
    }
    const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
#pragma GCC unroll 4
    for (int r = 0; r < MT; ++r) {
      const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(BS + r * (K / 16) + blk * 16));
      const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(scales, bsums), 5);  // 32 sum_h s_h S_h
      vacc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(iacc[r], offset)),
                                _mm256_set1_ps(d * D[r * (K / 256) + blk]), vacc[r]);
    }
  }
  for (int r = 0; r < MT; ++r) out[r] = hispec::hsum8(vacc[r]);
}

}  // namespace hispec_blocks

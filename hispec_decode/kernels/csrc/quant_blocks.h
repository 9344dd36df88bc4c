// GGUF block formats as the kernels read them (linear_q.cpp): ggml's layouts of Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0 (32 values per block) and Q4_K, Q5_K, Q6_K (256 per super-block), each decoded to 32
// unsigned values per sub-block with their scales (see linear_q.cpp's header for the arithmetic).
// AVX2 + FMA + F16C only; included inside an anonymous namespace by linear_q.cpp.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace hispec_blocks {

enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// One sub-block as the header describes it.
struct Sub {
  __m256i q;            // 32 values, unsigned (signed for Q8_0)
  float a = 0, c = 0;   // A and C
  int o = 0;            // offset
  int s_lo = 1, s_hi = 1;
};

// Each format: values and bytes per block, and visit(block, f) calling f(k, sub) for each of its
// sub-blocks in increasing k (k: the sub-block's index within the block).
inline __m256i nibbles(const uint8_t* qs) {  // 16 bytes -> low nibbles then high nibbles
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

inline __m256i bits_to_bytes(uint32_t bits, uint8_t value) {  // byte i = value where bit i is set, else 0
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuffle);
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x7fbfdfeff7fbfdfeULL));
  v = _mm256_cmpeq_epi8(_mm256_or_si256(v, select), _mm256_set1_epi64x(-1));
  return _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(value)));
}

struct FQ4_0 {
  static constexpr int64_t QK = 32, BYTES = 18;
  static constexpr bool SIGNED = false;
  template <class F> static inline void visit(const uint8_t* b, F&& f) {
    Sub s; s.q = nibbles(b + 2); s.a = half(b); s.o = 8; f(0, s);
  }
};
struct FQ4_1 {
  static constexpr int64_t QK = 32, BYTES = 20;
  static constexpr bool SIGNED = false;
  template <class F> static inline void visit(const uint8_t* b, F&& f) {
    Sub s; s.q = nibbles(b + 4); s.a = half(b); s.c = half(b + 2); f(0, s);
  }
};
struct FQ5_0 {
  static constexpr int64_t QK = 32, BYTES = 22;
  static constexpr bool SIGNED = false;
  template <class F> static inline void visit(const uint8_t* b, F&& f) {
    uint32_t qh; std::memcpy(&qh, b + 2, 4);
    Sub s; s.q = _mm256_or_si256(nibbles(b + 6), bits_to_bytes(qh, 0x10)); s.a = half(b); s.o = 16; f(0, s);
  }
};
struct FQ5_1 {
  static constexpr int64_t QK = 32, BYTES = 24;
  static constexpr bool SIGNED = false;
  template <class F> static inline void visit(const uint8_t* b, F&& f) {
    uint32_t qh; std::memcpy(&qh, b + 4, 4);
    Sub s; s.q = _mm256_or_si256(nibbles(b + 8), bits_to_bytes(qh, 0x10)); s.a = half(b); s.c = half(b + 2); f(0, s);
  }
};
struct FQ8_0 {
  static constexpr int64_t QK = 32, BYTES = 34;
  static constexpr bool SIGNED = true;
  template <class F> static inline void visit(const uint8_t* b, F&& f) {
    Sub s; s.q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)); s.a = half(b); f(0, s);
  }
};

// the 6-bit scale and min of sub-block j of a Q4_K / Q5_K block (ggml's get_scale_min_k4)
inline void scale_min(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) { sc = q[j] & 63; m = q[j + 4] & 63; }
  else { sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

struct FQ4_K {  // d, dmin, scales[12], qs[128]
  static constexpr int64_t QK = 256, BYTES = 144;
  static constexpr bool SIGNED = false;
  template <class F> static inline void visit(const uint8_t* b, F&& f) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qs = b + 16;
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      int sc, m;
      Sub s;
      scale_min(2 * j, scales, sc, m);
      s.q = _mm256_and_si256(v, low); s.a = d * sc; s.c = -(dmin * m); f(2 * j, s);
      scale_min(2 * j + 1, scales, sc, m);
      s.q = _mm256_and_si256(_mm256_srli_epi16(v, 4), low); s.a = d * sc; s.c = -(dmin * m); f(2 * j + 1, s);
    }
  }
};

struct FQ5_K {  // d, dmin, scales[12], qh[32], qs[128]
  static constexpr int64_t QK = 256, BYTES = 176;
  static constexpr bool SIGNED = false;
  template <class F> static inline void visit(const uint8_t* b, F&& f) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* scales = b + 4;
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    const uint8_t* qs = b + 48;
    const __m256i low = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      // bit 2j (2j + 1) of qh[l] is bit 4 of value l of sub-block 2j (2j + 1)
      const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j)), one), 4);
      const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j + 1)), one), 4);
      int sc, m;
      Sub s;
      scale_min(2 * j, scales, sc, m);
      s.q = _mm256_or_si256(_mm256_and_si256(v, low), h0); s.a = d * sc; s.c = -(dmin * m); f(2 * j, s);
      scale_min(2 * j + 1, scales, sc, m);
      s.q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), h1); s.a = d * sc; s.c = -(dmin * m);
      f(2 * j + 1, s);
    }
  }
};

// Q6_K: 32 positions l of 4 groups j (inputs 32j + l of a 128-input half) from ql[l], ql[32 + l] (l0, l1)
// and qh[l] (h): the low or high nibble of ql, bits 2j and 2j + 1 of qh above it (unsigned, 0 .. 63)
inline void q6_values(__m256i l0, __m256i l1, __m256i h, __m256i q[4]) {
  const __m256i low = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
  q[0] = _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_slli_epi16(_mm256_and_si256(h, three), 4));
  q[1] = _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), three), 4));
  q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), three), 4));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), three), 4));
}

struct FQ6_K {  // ql[128], qh[64], int8 scales[16], d
  static constexpr int64_t QK = 256, BYTES = 210;
  static constexpr bool SIGNED = false;
  template <class F> static inline void visit(const uint8_t* b, F&& f) {
    const float d = half(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int half128 = 0; half128 < 2; ++half128) {
      const uint8_t* ql = b + 64 * half128;
      const uint8_t* qhp = b + 128 + 32 * half128;
      const int8_t* s8 = sc + 8 * half128;
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qhp));
      __m256i q[4];
      q6_values(l0, l1, h, q);
      for (int j = 0; j < 4; ++j) {
        Sub s; s.q = q[j]; s.a = d; s.o = 32; s.s_lo = s8[2 * j]; s.s_hi = s8[2 * j + 1];
        f(4 * half128 + j, s);
      }
    }
  }
};

template <int64_t TYPE>
inline __m256i decode32(const uint8_t* b) {
  if constexpr (TYPE == Q4_0) return nibbles(b + 2);
  if constexpr (TYPE == Q4_1) return nibbles(b + 4);
  if constexpr (TYPE == Q8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  uint32_t qh;
  if constexpr (TYPE == Q5_0) {
    std::memcpy(&qh, b + 2, 4);
    return _mm256_or_si256(nibbles(b + 6), bits_to_bytes(qh, 0x10));
  }
  std::memcpy(&qh, b + 4, 4);  // Q5_1
  return _mm256_or_si256(nibbles(b + 8), bits_to_bytes(qh, 0x10));
}

// The 8 six-bit scales and 8 mins of a Q4_K / Q5_K block as int16: scales in the low 128 bits, mins in
// the high (ggml's get_scale_min_k4 for all 8 sub-blocks at once).
inline __m256i scales_mins(const uint8_t* packed) {
  uint32_t u[4];
  std::memcpy(u, packed, 12);
  const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
  u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
  const uint32_t mins_low = u[1] & m1;
  u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
  u[2] = mins_low;
  u[0] &= m1;
  return _mm256_cvtepu8_epi16(_mm_set_epi32(static_cast<int>(u[3]), static_cast<int>(u[2]), static_cast<int>(u[1]),
                                            static_cast<int>(u[0])));
}

}  // namespace hispec_blocks

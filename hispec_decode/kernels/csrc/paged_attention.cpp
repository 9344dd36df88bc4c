// Attention of query rows over their own sequence's paged K/V, all rows of a pass in one call.
//
// Row r belongs to sequence seq[r] (its block table: tables[seq[r]]) and sees keys lo[r] .. len[r]-1
// (causal: len = its slot + 1; a sliding window raises lo). A row of a draft tree sees, of the slots from
// tree_base[r] on (the tree's nodes), only those whose entry in its row of tree_mask is set (its ancestors and
// itself); rows outside a tree have tree_base = len, so nothing is masked. Every (row, K/V head) pair is one
// task: its query heads' scores in float32, a softmax, the weighted sum of values in float32, one
// rounding to the output dtype. Nothing a row computes depends on the other rows of the call or
// on how many there are, so the batch-invariant mode uses this kernel as it is.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <type_traits>
#include <vector>
#include <algorithm>
#include "vec.h"

namespace {

inline float to_f(float x) { return x; }
inline float to_f(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_f(at::Half x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
using hispec::load16;
template <typename KV>
constexpr bool kVector = std::is_same_v<KV, float> || std::is_same_v<KV, at::BFloat16>;

// One key against every query head of the group (scores), or one value into the group's
// accumulators: d in vectors of 16 (d % 16 == 0, d <= 256), the key/value converted once.
template <typename KV>
inline void scores_avx512(const float* qf, const KV* k, int64_t group, int64_t d, float scale, float* out,
                          int64_t stride) {
  __m512 kv[16];
  for (int64_t c = 0; c < d / 16; ++c) kv[c] = load16(k + 16 * c);
  for (int64_t g = 0; g < group; ++g) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < d / 16; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * d + 16 * c), kv[c], acc);
    out[g * stride] = _mm512_reduce_add_ps(acc) * scale;
  }
}
template <typename KV>
inline void accumulate_avx512(const float* w, int64_t stride, const KV* v, int64_t group, int64_t d, float* acc) {
  __m512 vv[16];
  for (int64_t c = 0; c < d / 16; ++c) vv[c] = load16(v + 16 * c);
  for (int64_t g = 0; g < group; ++g) {
    const __m512 wg = _mm512_set1_ps(w[g * stride]);
    for (int64_t c = 0; c < d / 16; ++c) {
      float* a = acc + g * d + 16 * c;
      _mm512_storeu_ps(a, _mm512_fmadd_ps(wg, vv[c], _mm512_loadu_ps(a)));
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define HISPEC_ATTN_VECTOR 1
using hispec::load8;
template <typename KV>
constexpr bool kVector = std::is_same_v<KV, float> || std::is_same_v<KV, at::BFloat16>;

// AVX2: one query head at a time. Scores of 8 keys at once (8 accumulators, summed across lanes in one
// transpose), then the weighted sum of values with up to 64 of the head's dimensions in registers over
// every key. Each output still adds its keys in position order.
inline __m256 hsum8x8(const __m256* a) {  // lane t: the sum of a[t]'s lanes
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
template <typename KV>
inline void scores_avx2(const float* qg, const KV* K, const int64_t* slots, int64_t n, int64_t d, float scale,
                        float* out) {
  const __m256 sc = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 a[8];
    for (int t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) {
      const __m256 qv = _mm256_loadu_ps(qg + c);
      for (int t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(qv, load8(K + slots[j + t] * d + c), a[t]);
    }
    _mm256_storeu_ps(out + j, _mm256_mul_ps(hsum8x8(a), sc));
  }
  for (; j < n; ++j) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + c), load8(K + slots[j] * d + c), a);
    out[j] = hispec::hsum8(a) * scale;
  }
}
template <typename KV>
inline void values_avx2(const float* w, const KV* V, const int64_t* slots, int64_t n, int64_t d, float* acc) {
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    const int64_t units = std::min<int64_t>(8, (d - c0) / 8);
    __m256 a[8];
    for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m256 wj = _mm256_set1_ps(w[j]);
      const KV* v = V + slots[j] * d + c0;
      for (int64_t u = 0; u < units; ++u) a[u] = _mm256_fmadd_ps(wj, load8(v + 8 * u), a[u]);
    }
    for (int64_t u = 0; u < units; ++u) _mm256_storeu_ps(acc + c0 + 8 * u, a[u]);
  }
}
#endif

// In place: x[0..n) -> softmax(x), in float32 (exp 16 lanes at a time where AVX-512 is there).
inline void softmax(float* x, int64_t n) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, x[j]);
  float sum = 0.f;
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 total = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    const __m512 e = hispec::exp16(_mm512_sub_ps(_mm512_loadu_ps(x + j), _mm512_set1_ps(mx)));
    _mm512_storeu_ps(x + j, e);
    total = _mm512_add_ps(total, e);
  }
  sum = _mm512_reduce_add_ps(total);
#elif defined(HISPEC_ATTN_VECTOR)
  __m256 total = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = hispec::exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), _mm256_set1_ps(mx)));
    _mm256_storeu_ps(x + j, e);
    total = _mm256_add_ps(total, e);
  }
  sum = hispec::hsum8(total);
#endif
  for (; j < n; ++j) {
    x[j] = std::exp(x[j] - mx);
    sum += x[j];
  }
  const float inv = 1.f / sum;
  for (j = 0; j < n; ++j) x[j] *= inv;
}

template <typename Q, typename KV>
void attend_rows(const Q* q, const KV* keys, const KV* values, const int64_t* seq, const int64_t* len, const int64_t* lo,
                 const int64_t* tree_base, const uint8_t* tree_mask, int64_t tree_width, const int32_t* tables,
                 int64_t max_blocks, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, int64_t pool_slots,
                 int64_t block_size, float scale, Q* out) {
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(group * d), acc(group * d);
    std::vector<int64_t> slots;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, h = task % kv_heads;
      const int64_t first = lo[r], last = len[r], tb = tree_base[r];
      const uint8_t* visible = tree_mask + r * tree_width;  // visible[p - tb] for tree slots p >= tb
      const int32_t* table = tables + seq[r] * max_blocks;
      slots.clear();  // the pool slots this row sees, in position order (block by block: no division per key)
      for (int64_t b = first / block_size; b * block_size < last; ++b) {
        const int64_t start = b * block_size, base = static_cast<int64_t>(table[b]) * block_size - start;
        for (int64_t p = std::max(first, start), stop = std::min(last, start + block_size); p < stop; ++p)
          if (p < tb || visible[p - tb]) slots.push_back(base + p);
      }
      const int64_t n = static_cast<int64_t>(slots.size());
      const KV* K = keys + h * pool_slots * d;
      const KV* V = values + h * pool_slots * d;
      scores.resize(group * n);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i) qf[g * d + i] = to_f(q[((h * group + g) * rows + r) * d + i]);
#if defined(__AVX512F__)
      const bool vector = kVector<KV> && d % 16 == 0 && d <= 256;
#elif defined(HISPEC_ATTN_VECTOR)
      if constexpr (kVector<KV>) {
        if (d % 8 == 0) {
          for (int64_t g = 0; g < group; ++g) {
            scores_avx2(qf.data() + g * d, K, slots.data(), n, d, scale, scores.data() + g * n);
            softmax(scores.data() + g * n, n);
            values_avx2(scores.data() + g * n, V, slots.data(), n, d, acc.data() + g * d);
          }
          for (int64_t g = 0; g < group; ++g)
            for (int64_t i = 0; i < d; ++i) out[(r * heads + h * group + g) * d + i] = static_cast<Q>(acc[g * d + i]);
          continue;
        }
      }
#endif
      for (int64_t j = 0; j < n; ++j) {
        const KV* k = K + slots[j] * d;
#if defined(__AVX512F__)
        if constexpr (kVector<KV>) {
          if (vector) {
            scores_avx512(qf.data(), k, group, d, scale, scores.data() + j, n);
            continue;
          }
        }
#endif
        for (int64_t g = 0; g < group; ++g) {
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t i = 0; i < d; ++i) s += qf[g * d + i] * to_f(k[i]);
          scores[g * n + j] = s * scale;
        }
      }
      for (int64_t g = 0; g < group; ++g) softmax(scores.data() + g * n, n);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const KV* v = V + slots[j] * d;
#if defined(__AVX512F__)
        if constexpr (kVector<KV>) {
          if (vector) {
            accumulate_avx512(scores.data() + j, n, v, group, d, acc.data());
            continue;
          }
        }
#endif
        for (int64_t g = 0; g < group; ++g) {
          const float w = scores[g * n + j];
          float* a = acc.data() + g * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) a[i] += w * to_f(v[i]);
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i) out[(r * heads + h * group + g) * d + i] = static_cast<Q>(acc[g * d + i]);
    }
  });
}

}  // namespace

// q: [heads, rows, d] (rope's output layout); keys/values: [kv_heads, slots, d] pools; seq/len/lo: [rows] int64;
// tree_base: [rows] int64; tree_mask: [rows, width] uint8; tables: [sequences, max_blocks] int32.
// Returns [rows, heads * d] in q's dtype.
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                              const torch::Tensor& seq, const torch::Tensor& len, const torch::Tensor& lo,
                              const torch::Tensor& tree_base, const torch::Tensor& tree_mask,
                              const torch::Tensor& tables, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "paged_attention: q must be a contiguous [heads, rows, d]");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.sizes() == values.sizes(), "paged_attention: pools");
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.is_contiguous(), "paged_attention: int32 tables");
  TORCH_CHECK(seq.scalar_type() == at::kLong && len.scalar_type() == at::kLong && lo.scalar_type() == at::kLong,
              "paged_attention: int64 rows");
  TORCH_CHECK(tree_base.scalar_type() == at::kLong && tree_mask.scalar_type() == at::kByte && tree_mask.dim() == 2 &&
                  tree_mask.is_contiguous() && tree_mask.size(0) == q.size(1) && tree_base.size(0) == q.size(1),
              "paged_attention: tree_base [rows] int64 and tree_mask [rows, width] uint8");
  const int64_t heads = q.size(0), rows = q.size(1), d = q.size(2), kv_heads = keys.size(0);
  TORCH_CHECK(heads % kv_heads == 0 && keys.size(2) == d, "paged_attention: head shapes");
  auto out = torch::empty({rows, heads * d}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_q", [&] {
    using Q = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, keys.scalar_type(), "paged_attention_kv", [&] {
      attend_rows<Q, scalar_t>(q.data_ptr<Q>(), keys.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(),
                               seq.data_ptr<int64_t>(), len.data_ptr<int64_t>(), lo.data_ptr<int64_t>(),
                               tree_base.data_ptr<int64_t>(), tree_mask.data_ptr<uint8_t>(), tree_mask.size(1),
                               tables.data_ptr<int32_t>(), tables.size(1), rows, heads, kv_heads, d, keys.size(1),
                               block_size, static_cast<float>(scale), out.data_ptr<Q>());
    });
  });
  return out;
}

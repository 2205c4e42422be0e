// CPU kernels for the decode step: attention over the KV pool in place (through req_to_token),
// rope fused with the K/V store, RMSNorm (+ residual), SiLU-and-mul, and the small-M (1-4 rows)
// products of decode at small batch.
//
// Numerics follow the PyTorch ops they replace: for bf16/fp16 every elementwise op rounds to the
// activations' dtype where the PyTorch sequence does (rope: x*cos, x*sin, their sum; RMSNorm:
// the residual add, the normalised value, the weight product; SiLU: silu(gate), its product with
// up), and reductions (attention scores, softmax, the weighted sum of V, the RMS) run in fp32.
// Built with -ffp-contract=off (no fused multiply-adds PyTorch would not do either) by
// torch.utils.cpp_extension at install or first use (radixserve/core/cpu_kernels);
// the Python callers fall back to PyTorch when it is missing.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <sched.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const c10::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}
inline float load(const c10::Half* p, int64_t i) { return static_cast<float>(p[i]); }

inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(c10::BFloat16* p, int64_t i, float x) { p[i] = c10::BFloat16(x); }
inline void store(c10::Half* p, int64_t i, float x) { p[i] = c10::Half(x); }

// x rounded to T and back (identity for float): where a PyTorch op would hand back a T tensor
template <typename T>
inline float rnd(float x) { return static_cast<float>(static_cast<T>(x)); }
template <>
inline float rnd<float>(float x) { return x; }

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

// kLanes values of T at p, as floats
inline Vec load_vec(const float* p) { return Vec::loadu(p); }
template <typename T>
inline Vec load_vec(const T* p) {
  Vec out;
  at::vec::load_to_float<T>(p, out);
  return out;
}
// bf16 -> fp32 is a 16-bit shift; ATen's loader reads and converts a whole bf16 vector
#if defined(CPU_CAPABILITY_AVX512)
template <>
inline Vec load_vec(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
}
#elif defined(CPU_CAPABILITY_AVX2)
template <>
inline Vec load_vec(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
}
#endif

constexpr int64_t kPrefetch = 6;  // rows ahead

template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64)
    __builtin_prefetch(bytes + off, 0, 3);
}

inline float reduce_add(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(__m512(v));
#else
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
#endif
}

// softmax over n scores of each of `group` rows (stride `padded`), in place, fp32
inline void softmax_rows(float* scores, int64_t group, int64_t n, int64_t padded) {
  alignas(64) float partial[kLanes];
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * padded;
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) peak = std::max(peak, s[j]);
    const Vec peak_v(peak);
    Vec total_v(0.f);
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
      const Vec e = (Vec::loadu(s + j) - peak_v).exp_u20();
      e.store(s + j);
      total_v = total_v + e;
    }
    float total = reduce_add(total_v);
    if (j < n) {
      const Vec e = (Vec::loadu(s + j, n - j) - peak_v).exp_u20();
      e.store(partial);
      for (int64_t i = 0; i < n - j; ++i) {
        s[j + i] = partial[i];
        total += partial[i];
      }
    }
    const float inv = n > 0 ? 1.f / total : 0.f;
    for (int64_t i = 0; i < n; ++i) s[i] *= inv;
  }
}

// One (request, KV head) task with the group size G and the head width DV vectors known at
// compile time: the group's queries, score sums and outputs live in vector registers.
template <typename T, int G, int DV>
void attend_task_fixed(const T* q, int64_t q_sh, const T* k_base, int64_t k_ss,
                       const T* v_base, int64_t v_ss, const int32_t* row, int64_t n,
                       float scale, float cap, float* scores, int64_t padded, T* out,
                       int64_t o_sh) {
  constexpr int64_t D = DV * kLanes;
  Vec qv[G][DV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DV; ++c) qv[g][c] = load_vec(q + g * q_sh + c * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    const T* key = k_base + static_cast<int64_t>(row[j]) * k_ss;
    if (j + kPrefetch < n) prefetch_row(k_base + static_cast<int64_t>(row[j + kPrefetch]) * k_ss, D);
    Vec acc[G];
    for (int g = 0; g < G; ++g) acc[g] = Vec(0.f);
    for (int c = 0; c < DV; ++c) {
      const Vec kv = load_vec(key + c * kLanes);
      for (int g = 0; g < G; ++g) acc[g] = at::vec::fmadd(qv[g][c], kv, acc[g]);
    }
    for (int g = 0; g < G; ++g) {
      float sc = reduce_add(acc[g]) * scale;
      if (cap > 0.f) sc = std::tanh(sc / cap) * cap;
      scores[g * padded + j] = sc;
    }
  }
  softmax_rows(scores, G, n, padded);
  Vec o[G][DV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DV; ++c) o[g][c] = Vec(0.f);
  for (int64_t j = 0; j < n; ++j) {
    const T* value = v_base + static_cast<int64_t>(row[j]) * v_ss;
    if (j + kPrefetch < n) prefetch_row(v_base + static_cast<int64_t>(row[j + kPrefetch]) * v_ss, D);
    for (int c = 0; c < DV; ++c) {
      const Vec vv = load_vec(value + c * kLanes);
      for (int g = 0; g < G; ++g) o[g][c] = at::vec::fmadd(Vec(scores[g * padded + j]), vv, o[g][c]);
    }
  }
  alignas(64) float tmp[D];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < DV; ++c) o[g][c].store(tmp + c * kLanes);
    for (int64_t d = 0; d < D; ++d) store(out + g * o_sh, d, tmp[d]);
  }
}

using FixedTask = void (*)(const void*, int64_t, const void*, int64_t, const void*, int64_t,
                           const int32_t*, int64_t, float, float, float*, int64_t, void*,
                           int64_t);

template <typename T, int G, int DV>
void attend_task_erased(const void* q, int64_t q_sh, const void* k, int64_t k_ss, const void* v,
                        int64_t v_ss, const int32_t* row, int64_t n, float scale, float cap,
                        float* scores, int64_t padded, void* out, int64_t o_sh) {
  attend_task_fixed<T, G, DV>(static_cast<const T*>(q), q_sh, static_cast<const T*>(k), k_ss,
                              static_cast<const T*>(v), v_ss, row, n, scale, cap, scores,
                              padded, static_cast<T*>(out), o_sh);
}

template <typename T, int DV>
FixedTask fixed_task_for_group(int64_t group) {
  switch (group) {
    case 1: return &attend_task_erased<T, 1, DV>;
    case 2: return &attend_task_erased<T, 2, DV>;
    case 3: return &attend_task_erased<T, 3, DV>;
    case 4: return &attend_task_erased<T, 4, DV>;
    case 5: return &attend_task_erased<T, 5, DV>;
    case 6: return &attend_task_erased<T, 6, DV>;
    case 7: return &attend_task_erased<T, 7, DV>;
    case 8: return &attend_task_erased<T, 8, DV>;
    default: return nullptr;
  }
}

// the register-blocked task for (group, head width), or nullptr (then the generic loop)
template <typename T>
FixedTask fixed_task(int64_t group, int64_t head_dim, int64_t v_dim) {
  if (head_dim != v_dim) return nullptr;
  if (head_dim == 4 * kLanes) return fixed_task_for_group<T, 4>(group);
  if (head_dim == 8 * kLanes) return fixed_task_for_group<T, 8>(group);
  return nullptr;
}

// ---- decode attention ----------------------------------------------------------------------
// One query token per request. Task (b, h): the `group` query heads that share KV head h read
// keys/values of positions [start, seq_len) straight from the pool rows req_to_token[row]; each
// key and value row is loaded once for the whole group. Needs head dims that are multiples of
// the vector width (checked by the caller).
template <typename T, typename Index>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                           at::Tensor& out, const at::Tensor& req_to_token,
                           const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                           double scaling, double logit_cap, int64_t sliding_window,
                           int64_t attention_chunk) {
  const int64_t bs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_buf.size(1), v_dim = v_buf.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_sb = q.stride(0), q_sh = q.stride(1);
  const int64_t k_ss = k_buf.stride(0), k_sh = k_buf.stride(1);
  const int64_t v_ss = v_buf.stride(0), v_sh = v_buf.stride(1);
  const int64_t o_sb = out.stride(0), o_sh = out.stride(1);
  const int64_t table_stride = req_to_token.stride(0);
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_buf.data_ptr<T>();
  const T* v_ptr = v_buf.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  const Index* table = req_to_token.data_ptr<Index>();
  const int64_t* rows = req_pool_indices.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float scale = static_cast<float>(scaling);
  const float cap = static_cast<float>(logit_cap);
  const int64_t d_vecs = head_dim / kLanes, v_vecs = v_dim / kLanes;

  FixedTask fixed = std::is_same<Index, int32_t>::value ?
      fixed_task<T>(group, head_dim, v_dim) : nullptr;

  at::parallel_for(0, bs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * v_dim), scores, partial(kLanes);
    std::vector<Vec> sums(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t len = lens[b];
      // the query (at len - 1) sees keys of its window, or of its chunk, or all
      const int64_t start = attention_chunk > 0 ? (len - 1) / attention_chunk * attention_chunk
          : sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const int64_t n = len - start;
      const Index* row = table + rows[b] * table_stride + start;
      if (fixed != nullptr) {
        const int64_t padded = (std::max<int64_t>(n, 1) + kLanes - 1) / kLanes * kLanes;
        scores.resize(padded * group);
        fixed(q_ptr + b * q_sb + h * group * q_sh, q_sh, k_ptr + h * k_sh, k_ss,
              v_ptr + h * v_sh, v_ss, reinterpret_cast<const int32_t*>(row), n, scale, cap,
              scores.data(), padded, o_ptr + b * o_sb + h * group * o_sh, o_sh);
        continue;
      }
      for (int64_t g = 0; g < group; ++g) {
        const T* src = q_ptr + b * q_sb + (h * group + g) * q_sh;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = load(src, d);
      }
      // scores[g * n + j] = (q_g . k_j) * scale (soft-capped)
      const int64_t padded = (std::max<int64_t>(n, 1) + kLanes - 1) / kLanes * kLanes;
      scores.resize(padded * group);
      for (int64_t j = 0; j < n; ++j) {
        const T* key = k_ptr + static_cast<int64_t>(row[j]) * k_ss + h * k_sh;
        if (j + kPrefetch < n)  // rows are scattered over the pool: hide the memory latency
          prefetch_row(k_ptr + static_cast<int64_t>(row[j + kPrefetch]) * k_ss + h * k_sh,
                       head_dim);
        for (int64_t g = 0; g < group; ++g) sums[g] = Vec(0.f);
        for (int64_t c = 0; c < d_vecs; ++c) {
          const Vec kv = load_vec(key + c * kLanes);
          for (int64_t g = 0; g < group; ++g)
            sums[g] = at::vec::fmadd(Vec::loadu(qf.data() + g * head_dim + c * kLanes), kv,
                                     sums[g]);
        }
        for (int64_t g = 0; g < group; ++g) {
          float s = reduce_add(sums[g]) * scale;
          if (cap > 0.f) s = std::tanh(s / cap) * cap;
          scores[g * padded + j] = s;
        }
      }
      softmax_rows(scores.data(), group, n, padded);
      // acc[g] = sum_j p[g][j] v_j, one vector of the value row at a time
      for (int64_t c = 0; c < v_vecs; ++c) {
        for (int64_t g = 0; g < group; ++g) sums[g] = Vec(0.f);
        for (int64_t j = 0; j < n; ++j) {
          const T* value = v_ptr + static_cast<int64_t>(row[j]) * v_ss + h * v_sh;
          if (c == 0 && j + kPrefetch < n)
            prefetch_row(v_ptr + static_cast<int64_t>(row[j + kPrefetch]) * v_ss + h * v_sh,
                         v_dim);
          const Vec vv = load_vec(value + c * kLanes);
          for (int64_t g = 0; g < group; ++g)
            sums[g] = at::vec::fmadd(Vec(scores[g * padded + j]), vv, sums[g]);
        }
        for (int64_t g = 0; g < group; ++g) sums[g].store(acc.data() + g * v_dim + c * kLanes);
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = o_ptr + b * o_sb + (h * group + g) * o_sh;
        for (int64_t d = 0; d < v_dim; ++d) store(dst, d, acc[g * v_dim + d]);
      }
    }
  });
}

// ---- rope (neox halves) + K/V store --------------------------------------------------------
template <typename T>
void rotate_row(T* x, const float* cos_row, const float* sin_row, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = load(x, i), x2 = load(x, i + half);
    const float c1 = rnd<T>(cos_row[i]), s1 = rnd<T>(sin_row[i]);
    const float c2 = rnd<T>(cos_row[i + half]), s2 = rnd<T>(sin_row[i + half]);
    store(x, i, rnd<T>(x1 * c1) + rnd<T>(-x2 * s1));
    store(x, i + half, rnd<T>(x2 * c2) + rnd<T>(x1 * s2));
  }
}

template <typename T>
void rope_store_impl(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& cos_cache,
                     const at::Tensor& sin_cache, int64_t head_dim, at::Tensor& k_buf,
                     at::Tensor& v_buf, const at::Tensor& loc, bool store_kv) {
  const int64_t tokens = q.size(0);
  const int64_t q_heads = q.size(1) / head_dim, k_heads = k.size(1) / head_dim;
  const int64_t half = cos_cache.size(1) / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cos_ptr = cos_cache.data_ptr<float>();
  const float* sin_ptr = sin_cache.data_ptr<float>();
  const int64_t cs = cos_cache.stride(0);
  T* q_ptr = q.data_ptr<T>();
  T* k_ptr = k.data_ptr<T>();
  const int64_t q_st = q.stride(0), k_st = k.stride(0);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_ptr + pos[t] * cs;
      const float* s = sin_ptr + pos[t] * cs;
      for (int64_t h = 0; h < q_heads; ++h) rotate_row(q_ptr + t * q_st + h * head_dim, c, s, half);
      for (int64_t h = 0; h < k_heads; ++h) rotate_row(k_ptr + t * k_st + h * head_dim, c, s, half);
    }
  });
  if (!store_kv) return;
  const int64_t* slots = loc.data_ptr<int64_t>();
  const T* v_ptr = v.data_ptr<T>();
  const int64_t v_st = v.stride(0), row = k_heads * head_dim;
  T* kb = k_buf.data_ptr<T>();
  T* vb = v_buf.data_ptr<T>();
  const int64_t kb_s = k_buf.stride(0), vb_s = v_buf.stride(0);
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(kb + slots[t] * kb_s, k_ptr + t * k_st, row * sizeof(T));
    std::memcpy(vb + slots[t] * vb_s, v_ptr + t * v_st, row * sizeof(T));
  }
}

// ---- RMSNorm (+ residual) ------------------------------------------------------------------
template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps,
                   const at::Tensor* residual, at::Tensor& out, at::Tensor* new_residual) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const T* x_ptr = x.data_ptr<T>();
  const T* w_ptr = weight.data_ptr<T>();
  const T* r_ptr = residual ? residual->data_ptr<T>() : nullptr;
  T* o_ptr = out.data_ptr<T>();
  T* nr_ptr = new_residual ? new_residual->data_ptr<T>() : nullptr;
  const int64_t x_st = x.stride(0), r_st = residual ? residual->stride(0) : 0;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> h(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x_ptr + r * x_st;
      float sumsq = 0.f;
      if (r_ptr) {
        const T* rr = r_ptr + r * r_st;
        T* nr = nr_ptr + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          h[i] = rnd<T>(load(xr, i) + load(rr, i));
          store(nr, i, h[i]);
        }
      } else {
        for (int64_t i = 0; i < hidden; ++i) h[i] = load(xr, i);
      }
#pragma omp simd reduction(+ : sumsq)
      for (int64_t i = 0; i < hidden; ++i) sumsq += h[i] * h[i];
      const float inv = 1.f / std::sqrt(sumsq / static_cast<float>(hidden) +
                                        static_cast<float>(eps));
      T* o = o_ptr + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) store(o, i, load(w_ptr, i) * rnd<T>(h[i] * inv));
    }
  });
}

// ---- SiLU(gate) * up -----------------------------------------------------------------------
template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), width = out.size(1);
  const T* x_ptr = x.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  const int64_t x_st = x.stride(0);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> act(width + kLanes);
    const Vec one(1.f);
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x_ptr + r * x_st;
      const T* up = gate + width;
      T* o = o_ptr + r * width;
      int64_t i = 0;
      // silu(g) = g / (1 + exp(-g)), as PyTorch's vectorised silu computes it
      for (; i + kLanes <= width; i += kLanes) {
        const Vec g = load_vec(gate + i);
        (g / (one + g.neg().exp())).store(act.data() + i);
      }
      for (; i < width; ++i) {
        const float g = load(gate, i);
        act[i] = g / (1.f + std::exp(-g));
      }
      for (int64_t k = 0; k < width; ++k) store(o, k, rnd<T>(act[k]) * load(up, k));
    }
  });
}

// ---- Small-M products (decode GEMV): y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) ----------
// A decode step at batch 1-4 streams every weight row once: the speed is the rate rows are read.
// R weight rows advance together (R independent streams for the prefetcher, each loaded vector
// used by all M activation rows held in fp32), and the fp32 sums are reduced once per row.
template <typename W, int M, int R>
inline void gemv_block(const float* x, int64_t K, const W* w, int64_t w_st, float* sums) {
  Vec acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = Vec(0.f);
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    Vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_vec(w + r * w_st + k);
    for (int m = 0; m < M; ++m) {
      const Vec xv = Vec::loadu(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = at::vec::fmadd(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float total = reduce_add(acc[m][r]);
      for (int64_t t = k; t < K; ++t) total += x[m * K + t] * load(w + r * w_st, t);
      sums[m * R + r] = total;
    }
}

// W: the weight's dtype; Y: the activations' (y and bias), W's or float (a bf16/fp16 weight
// kept in its checkpoint dtype under float32 compute)
template <typename W, typename Y, int M, int R>
void gemv_impl(const float* x, const W* w, int64_t w_st, const Y* bias, int64_t N, int64_t K,
               Y* y, int64_t y_st) {
  const int64_t blocks = (N + R - 1) / R;
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    float sums[M * R];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * R;
      const int64_t rows = std::min<int64_t>(R, N - n0);
      if (rows == R) {
        gemv_block<W, M, R>(x, K, w + n0 * w_st, w_st, sums);
      } else {  // the last rows of N: one at a time
        for (int64_t r = 0; r < rows; ++r) {
          float one[M];
          gemv_block<W, M, 1>(x, K, w + (n0 + r) * w_st, w_st, one);
          for (int m = 0; m < M; ++m) sums[m * R + r] = one[m];
        }
      }
      for (int m = 0; m < M; ++m)
        for (int64_t r = 0; r < rows; ++r) {
          float v = sums[m * R + r];
          if (bias) v += load(bias, n0 + r);
          store(y + m * y_st, n0 + r, v);
        }
    }
  });
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

// float, bfloat16, half (no double: the models run in those three)
#define RS_DISPATCH(dtype, NAME, ...)                                                    \
  AT_DISPATCH_SWITCH(dtype, NAME,                                                        \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                           \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)                        \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

}  // namespace

// q [bs, Hq, D]; k_buf/v_buf [slots, Hkv, D(v)] (last dim contiguous); out [bs, Hq, Dv]
void decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                      at::Tensor& out, const at::Tensor& req_to_token,
                      const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                      double scaling, double logit_cap, int64_t sliding_window,
                      int64_t attention_chunk) {
  for (auto* t : {&q, &k_buf, &v_buf, &req_to_token, &req_pool_indices, &seq_lens})
    check_cpu(*t, "decode_attention input");
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3 && out.dim() == 3);
  TORCH_CHECK(q.stride(2) == 1 && k_buf.stride(2) == 1 && v_buf.stride(2) == 1 &&
              out.stride(2) == 1, "decode_attention: last dims must be contiguous");
  TORCH_CHECK(k_buf.scalar_type() == q.scalar_type() && v_buf.scalar_type() == q.scalar_type() &&
              out.scalar_type() == q.scalar_type(), "decode_attention: one dtype");
  TORCH_CHECK(q.size(1) % k_buf.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) % kLanes == 0 && v_buf.size(2) % kLanes == 0,
              "decode_attention: head dims must be multiples of ", kLanes);
  TORCH_CHECK(req_pool_indices.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong);
  TORCH_CHECK(req_to_token.stride(1) == 1);
  RS_DISPATCH(q.scalar_type(), "decode_attention", [&] {
    if (req_to_token.scalar_type() == at::kInt)
      decode_attention_impl<scalar_t, int32_t>(q, k_buf, v_buf, out, req_to_token,
                                               req_pool_indices, seq_lens, scaling, logit_cap,
                                               sliding_window, attention_chunk);
    else
      decode_attention_impl<scalar_t, int64_t>(q, k_buf, v_buf, out, req_to_token,
                                               req_pool_indices, seq_lens, scaling, logit_cap,
                                               sliding_window, attention_chunk);
  });
}

// q [T, Hq*D], k/v [T, Hk*D] (rows may be strided, e.g. views of one qkv output), rotated in
// place; with store_kv the rotated k and v are copied to k_buf/v_buf [slots, Hk, D] at loc.
void rope_store(const at::Tensor& positions, at::Tensor q, at::Tensor k, const at::Tensor& v,
                const at::Tensor& cos_cache, const at::Tensor& sin_cache, int64_t head_dim,
                at::Tensor k_buf, at::Tensor v_buf, const at::Tensor& loc, bool store_kv) {
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2 && q.stride(1) == 1 && k.stride(1) == 1);
  TORCH_CHECK(positions.scalar_type() == at::kLong && cos_cache.scalar_type() == at::kFloat &&
              sin_cache.scalar_type() == at::kFloat && cos_cache.is_contiguous() &&
              sin_cache.is_contiguous());
  TORCH_CHECK(cos_cache.size(1) == head_dim, "rope_store: partial rotary is not supported");
  TORCH_CHECK(k.scalar_type() == q.scalar_type());
  if (store_kv) {
    TORCH_CHECK(v.dim() == 2 && v.stride(1) == 1 && v.scalar_type() == q.scalar_type() &&
                k_buf.scalar_type() == q.scalar_type() && v_buf.scalar_type() == q.scalar_type() &&
                loc.scalar_type() == at::kLong);
    TORCH_CHECK(k_buf.stride(2) == 1 && k_buf.stride(1) == head_dim && v_buf.stride(2) == 1 &&
                v_buf.stride(1) == head_dim && k_buf.size(1) * head_dim == k.size(1));
  }
  RS_DISPATCH(q.scalar_type(), "rope_store", [&] {
    rope_store_impl<scalar_t>(positions, q, k, v, cos_cache, sin_cache, head_dim, k_buf, v_buf,
                              loc, store_kv);
  });
}

// norm(x) (residual undefined) or (norm(x + residual), x + residual)
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() &&
              weight.scalar_type() == x.scalar_type());
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (residual.has_value()) {
    TORCH_CHECK(residual->dim() == 2 && residual->stride(1) == 1 &&
                residual->scalar_type() == x.scalar_type());
    at::Tensor summed = at::empty(x.sizes(), x.options());
    RS_DISPATCH(x.scalar_type(), "rms_norm",
                [&] { rms_norm_impl<scalar_t>(x, weight, eps, &*residual, out, &summed); });
    return {out, summed};
  }
  RS_DISPATCH(x.scalar_type(), "rms_norm",
              [&] { rms_norm_impl<scalar_t>(x, weight, eps, nullptr, out, nullptr); });
  return {out};
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0);
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  RS_DISPATCH(x.scalar_type(), "silu_and_mul", [&] { silu_and_mul_impl<scalar_t>(x, out); });
  return out;
}

template <typename W, typename Y>
void gemv_dispatch(const float* x, const W* w, int64_t w_st, const Y* bias, int64_t M, int64_t N,
                   int64_t K, Y* y) {
  switch (M) {
    case 1: gemv_impl<W, Y, 1, 8>(x, w, w_st, bias, N, K, y, N); break;
    case 2: gemv_impl<W, Y, 2, 4>(x, w, w_st, bias, N, K, y, N); break;
    case 3: gemv_impl<W, Y, 3, 2>(x, w, w_st, bias, N, K, y, N); break;
    default: gemv_impl<W, Y, 4, 2>(x, w, w_st, bias, N, K, y, N); break;
  }
}

// x [M, K] (M <= 4) @ weight[N, K].T (+ bias [N]) -> [M, N] in x's dtype. The weight has x's
// dtype, or is bf16/fp16 under float32 x (its values widen exactly: the same sums as a float32
// copy of it would give, bit for bit).
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight,
                const c10::optional<at::Tensor>& bias) {
  check_cpu(x, "gemv x");
  check_cpu(weight, "gemv weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "gemv: x [M, K] and weight [N, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 4, "gemv: 1 to 4 rows");
  TORCH_CHECK(weight.stride(1) == 1, "gemv: weight rows must be contiguous");
  const bool widened = x.scalar_type() == at::kFloat &&
                       (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || widened,
              "gemv: one dtype (or a bf16/fp16 weight under float32)");
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous() &&
                bias->scalar_type() == x.scalar_type(), "gemv: bias [N] of x's dtype");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  // x as M x K contiguous floats (a few KB): float32 rows are read in place
  std::vector<float> x_buf;
  const float* xp = nullptr;
  if (x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.stride(0) == K) {
    xp = x.data_ptr<float>();
  } else {
    x_buf.resize(M * K);
    RS_DISPATCH(x.scalar_type(), "gemv_x", [&] {
      const scalar_t* src = x.data_ptr<scalar_t>();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) x_buf[m * K + k] = load(src + m * x.stride(0), k * x.stride(1));
    });
    xp = x_buf.data();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const int64_t ws = weight.stride(0);
  if (widened) {
    const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    if (weight.scalar_type() == at::kBFloat16)
      gemv_dispatch(xp, weight.data_ptr<c10::BFloat16>(), ws, bp, M, N, K, yp);
    else
      gemv_dispatch(xp, weight.data_ptr<c10::Half>(), ws, bp, M, N, K, yp);
    return y;
  }
  RS_DISPATCH(x.scalar_type(), "gemv", [&] {
    const scalar_t* bp = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    gemv_dispatch(xp, weight.data_ptr<scalar_t>(), ws, bp, M, N, K, y.data_ptr<scalar_t>());
  });
  return y;
}

// Thread i of torch's OpenMP team (the one at::parallel_for uses) -> cores[i]: each compute
// thread keeps its core and its caches. Returns the core each thread was pinned to (-1 where
// the kernel refused).
std::vector<int64_t> pin_threads(at::IntArrayRef cores) {
  const int threads = at::get_num_threads();
  std::vector<int64_t> pinned(threads, -1);
  if (cores.empty()) return pinned;
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num();
    const int64_t core = cores[tid % cores.size()];
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(core), &set);
    if (sched_setaffinity(0, sizeof(set), &set) == 0) pinned[tid] = core;
  }
  return pinned;
}

// registered as torch ops (torch.ops.radixserve_cpu.*): they show in torch.profiler tables
TORCH_LIBRARY(radixserve_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor(a!) out, "
        "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, float scaling, "
        "float logit_cap, int sliding_window, int attention_chunk) -> ()");
  m.def("rope_store(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor cos_cache, "
        "Tensor sin_cache, int head_dim, Tensor(c!) k_buf, Tensor(d!) v_buf, Tensor loc, "
        "bool store_kv) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> Tensor[]");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("pin_threads(int[] cores) -> int[]");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rope_store", &rope_store);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gemv", &gemv);
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CompositeExplicitAutograd, m) {
  m.impl("pin_threads", &pin_threads);
}

int64_t vector_width() { return kLanes; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vector_width", &vector_width, "floats per vector register the kernels were built for");
}

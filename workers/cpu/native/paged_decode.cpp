// Decode attention over the paged KV cache, for rows of one or a few queries (decode, draft
// verification), on CPU. Each (row, kv head) task reads only the row's valid keys, in place in
// its blocks: scores for every query of the row and every query head of the group at once, a
// softmax in float32 (with optional soft-capping, sliding window and sinks, as eager attention),
// then the probability-weighted sum of V. Loaded with ctypes by workers/cpu/native_attention.py.
// With AVX-512 and a head dim that is a multiple of 16, a second path keeps a tile of query slots
// and their outputs in registers (attend_row_head_lanes); its sums are the plain path's but for
// the last bit in float32, and identical in bfloat16.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "bfloat16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using raysample::bf16_bits;
using raysample::bf16_to_float;

// Round to the nearest bfloat16 (ties to even), kept as float: with a bfloat16 cache, scores and
// probabilities are rounded where eager attention's bfloat16 matmuls round them.
inline float round_bf16(float value) { return bf16_to_float(bf16_bits(value)); }

// A pool element as float32: float32 pools are read as they are, bfloat16 ones widened in the
// inner loops (a shift, which vectorizes), so a bfloat16 cache is read at half the bytes.
inline float to_float(float value) { return value; }
inline float to_float(uint16_t bits) { return bf16_to_float(bits); }

inline void store(float* into, float value) { *into = value; }
inline void store(uint16_t* into, float value) {  // round to nearest even, as torch's .to(bfloat16)
  if (std::isnan(value)) {
    *into = 0x7fc0u;
    return;
  }
  *into = bf16_bits(value);
}

// exp(x) for x <= 0 as a loop of plain arithmetic, so that the softmax's loop vectorizes (a call
// to std::exp does not): x = k ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6 polynomial
// (Cephes' expf coefficients), 2^k by the exponent bits. Within 2 ulp of std::exp; 0 below the
// smallest normal float's logarithm, where std::exp would give a denormal or 0.
inline float exp_nonpositive(float x) {
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - k * 0.693359375f) - k * -2.12194440e-4f;  // ln2 in two parts (Cody-Waite)
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t exponent = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &exponent, sizeof(scale));
  return x < -87.33654475f ? 0.0f : p * scale;
}

// Hardware prefetchers stop at 4 KiB pages, and one token's key is a few cache lines: fetch the
// keys `kAhead` tokens on (within the block) while this one is used, and the same token's row of
// the next block, so that the next block arrives spread over this one's reads.
constexpr int64_t kAhead = 16;
constexpr int64_t kLine = 64;  // bytes

// `count` contiguous elements from `from` on into L1: a token's row, or a block's slice of one KV
// head while the block before it is read (the hardware prefetchers do not follow a row's table
// from block to block).
template <typename T>
inline void prefetch_elements(const T* from, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(from);
  for (int64_t b = 0; b < count * static_cast<int64_t>(sizeof(T)); b += kLine) __builtin_prefetch(bytes + b);
}

struct Shape {
  int64_t heads, kv_heads, head_dim, block_size, table_width, q_len;
  int64_t q_token_stride, q_head_stride;  // elements; the last dimension is contiguous
};

// Calls body(position, token's row of `pool`) for positions first..last of one row and KV head,
// block by block through its table, prefetching ahead.
template <typename T, typename Body>
inline void for_each_key(const T* pool, const Shape& s, const int64_t* table, int64_t h, int64_t first, int64_t last,
                         Body body) {
  const int64_t bs = s.block_size, dim = s.head_dim, slice_elems = bs * dim;
  for (int64_t b = first / bs; b <= last / bs; ++b) {
    const T* tokens = pool + (table[b] * s.kv_heads + h) * slice_elems;
    const T* next = b < last / bs ? pool + (table[b + 1] * s.kv_heads + h) * slice_elems : nullptr;
    const int64_t lo = std::max(first, b * bs), hi = std::min(last + 1, (b + 1) * bs);
    for (int64_t t = lo; t < hi; ++t) {
      const T* token = tokens + (t - b * bs) * dim;
      if (t + kAhead < hi) prefetch_elements(token + kAhead * dim, dim);
      if (next) prefetch_elements(next + (t - b * bs) * dim, dim);
      body(t, token);
    }
  }
}

// The real queries of one row (padding queries, position -1, come last) and the keys they may see.
struct QuerySpan {
  int64_t nq = 0, max_pos = -1, first = 0, length = 0;
};

inline QuerySpan query_span(const Shape& s, const int64_t* query_pos, int64_t window) {
  QuerySpan span;
  int64_t min_pos = std::numeric_limits<int64_t>::max();
  for (int64_t i = 0; i < s.q_len && query_pos[i] >= 0; ++i) {
    ++span.nq;
    span.max_pos = std::max(span.max_pos, query_pos[i]);
    min_pos = std::min(min_pos, query_pos[i]);
  }
  if (span.nq == 0) return span;
  span.first = window > 0 ? std::max<int64_t>(0, min_pos - window + 1) : 0;
  span.length = span.max_pos + 1 - span.first;
  return span;
}

// Prefetching: a row's blocks sit anywhere in the pool and the hardware prefetchers follow a stream
// only within a 4 KiB page, so without this a decode step's reads wait on memory. On SmolLM2-135M's
// shapes, 64 rows, blocks scattered, with and without alternating: the kernel alone over 30 layers'
// pools at position 100, bfloat16 15.9 -> 12.8 ms (float32 12% less; one task ahead gained less);
// inside the model's forward at position 200 (bench/cpu_ops.py), where the linears' weight reads
// share the memory bandwidth, bfloat16 25.8 -> 23.1 ms and float32 38.9 -> 36.1 ms.
// A task is one row's queries against one KV head: `kTasksAhead` tasks on, the keys and values of
// its first block go to L2 (prefetcht1) while this one computes (a thread's first tasks to L1),
// and within a task each next block is fetched into L1 a token's row at a time, beside the same
// row of the block being read. Bursts cost more than they saved on an Intel AVX-512 Xeon (2 cores,
// KVM): whole tasks ahead (hundreds of prefetches) first, then a whole next block at each block's
// start (a fifth of a bfloat16 call's samples waited on those prefetch loops). Per 64-row forward
// at position 200 (30 layers, alternating builds, identical outputs), the kernel went bfloat16
// 35.8 -> 26.9 ms and float32 56.0 -> 41.9 ms without the task bursts, then 26.8 -> 22.0 and
// 34.6 -> 29.6 ms with blocks spread (and padding slots skipped, full score chunks stored whole);
// built for x86-64-v3 on the same CPU, float32 44.3 -> 38.8 ms.
constexpr int64_t kTasksAhead = 2;

template <int Locality>
inline void prefetch_task(const char* k_pool, const char* v_pool, int64_t element_size, const Shape& s,
                          const int64_t* table, const int64_t* query_pos, int64_t h, int64_t window) {
  const QuerySpan span = query_span(s, query_pos, window);
  if (span.nq == 0) return;
  // GCC counts prefetches as no effect, and would drop a call that has nothing else.
  asm volatile("");
  const int64_t slice_bytes = s.block_size * s.head_dim * element_size;
  const int64_t offset = (table[span.first / s.block_size] * s.kv_heads + h) * slice_bytes;
  for (int64_t o = 0; o < slice_bytes; o += kLine) {
    __builtin_prefetch(k_pool + offset + o, 0, Locality);
    __builtin_prefetch(v_pool + offset + o, 0, Locality);
  }
}

// A thread's tasks: a contiguous run, so it knows which come next, with about equal work per
// thread (queries x keys per row, plus a fixed part) whatever the rows' lengths.
struct TaskRun {
  int64_t begin = 0, end = 0;
};

inline TaskRun task_run(const Shape& s, const int64_t* query_pos, int64_t rows, int64_t window, int64_t thread,
                        int64_t threads) {
  const auto cost = [&](int64_t r) {
    const QuerySpan span = query_span(s, query_pos + r * s.q_len, window);
    return span.nq * span.length + 16;
  };
  int64_t total = 0;
  for (int64_t r = 0; r < rows; ++r) total += cost(r);
  TaskRun run{rows * s.kv_heads, rows * s.kv_heads};
  int64_t before = 0;  // work of the rows before r, times kv_heads
  bool started = false;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t c = cost(r);
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      const int64_t owner = std::min(threads - 1, (before * threads) / (total * s.kv_heads));
      if (owner == thread && !started) run.begin = r * s.kv_heads + h, started = true;
      if (owner > thread) {
        run.end = r * s.kv_heads + h;
        return started ? run : TaskRun{};
      }
      before += c;
    }
  }
  return started ? run : TaskRun{};
}

// One row's queries as float32, query slot (query, head of the group) by slot, head_dim apart.
template <typename Q>
inline void load_queries(float* into, const Q* q_all, const Shape& s, const int64_t* token_index, int64_t nq,
                         int64_t h) {
  const int64_t groups = s.heads / s.kv_heads, dim = s.head_dim;
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < groups; ++g) {
      const Q* query = q_all + token_index[i] * s.q_token_stride + (h * groups + g) * s.q_head_stride;
      for (int64_t d = 0; d < dim; ++d) into[(i * groups + g) * dim + d] = to_float(query[d]);
    }
}

// Scores (query slot by slot, `length` apart, from key `first`) into probabilities, in place: scaled,
// soft-capped, masked to each query's causal window, softmax with the optional sink; rounded to
// bfloat16 where eager's bfloat16 matmul would take them.
inline void softmax_rows(float* scores, int64_t length, const QuerySpan& span, const int64_t* query_pos,
                         int64_t groups, int64_t h, float scale, float softcap, int64_t window, const float* sinks,
                         bool rounded) {
  for (int64_t i = 0; i < span.nq; ++i) {
    const int64_t pos = query_pos[i];
    const int64_t lo = (window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0) - span.first;
    const int64_t hi = pos + 1 - span.first;
    for (int64_t g = 0; g < groups; ++g) {
      float* row = scores + (i * groups + g) * length;
      if (softcap > 0.0f) {
        for (int64_t t = lo; t < hi; ++t) {
          const float value = row[t] * scale;
          row[t] = std::tanh(value / softcap) * softcap;
        }
      } else {
#pragma omp simd
        for (int64_t t = lo; t < hi; ++t) row[t] *= scale;
      }
      // The largest score, as its own reduction: carried through the loop above, the max was a
      // chain of dependent scalar steps (a quarter of a decode call's time on an AVX-512 Xeon).
      // The max is exact in any order; a NaN score makes the slot's output NaN either way.
      float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
      for (int64_t t = lo; t < hi; ++t) top = top > row[t] ? top : row[t];
      const float sink = sinks ? sinks[h * groups + g] : -std::numeric_limits<float>::infinity();
      top = std::max(top, sink);
      float total = sinks ? std::exp(sink - top) : 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t t = lo; t < hi; ++t) {
        row[t] = exp_nonpositive(row[t] - top);
        total += row[t];
      }
      const float inverse = 1.0f / total;
      for (int64_t t = 0; t < length; ++t) row[t] = (t >= lo && t < hi) ? row[t] * inverse : 0.0f;
      if (rounded)
        for (int64_t t = lo; t < hi; ++t) row[t] = round_bf16(row[t]);
    }
  }
}

// The attention outputs of one row's query slots (float32 sums, head_dim apart) into `out`.
template <typename Q>
inline void store_outputs(Q* out, const float* sums, const Shape& s, const int64_t* token_index, int64_t nq,
                          int64_t h) {
  const int64_t groups = s.heads / s.kv_heads, dim = s.head_dim;
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < groups; ++g) {
      Q* into = out + (token_index[i] * s.heads + h * groups + g) * dim;
      for (int64_t d = 0; d < dim; ++d) store(into + d, sums[(i * groups + g) * dim + d]);
    }
}

// Scratch: a task's buffers (queries, scores, sums) are thread_local vectors that keep their
// capacity between tasks and calls: allocating and freeing them per task took about 5% of a
// 64-row decode call (malloc and free in perf, on an AVX-512 Xeon).
// T: the pools' element type; Q: the queries' and the output's (the model's dtype).
template <typename T, typename Q>
void attend_row_head(const Q* q_all, Q* out, const T* k_pool, const T* v_pool, const Shape& s, const int64_t* table, const int64_t* token_index, const int64_t* query_pos,
                     int64_t h, float scale, float softcap, int64_t window, const float* sinks) {
  const int64_t groups = s.heads / s.kv_heads, dim = s.head_dim;
  const QuerySpan span = query_span(s, query_pos, window);
  if (span.nq == 0) return;
  const int64_t nq = span.nq, first = span.first, max_pos = span.max_pos, length = span.length;
  const int64_t width = nq * groups;  // query slots: (query, head of the group)
  constexpr bool rounded = sizeof(T) == 2;  // bfloat16: round where eager's bfloat16 matmuls round
  // Scratch (above): each buffer is fully written before it is read.
  thread_local std::vector<float> queries, scores, acc, key_row;  // key_row: a bfloat16 key (then value) widened once
  queries.resize(width * dim), scores.resize(width * length), acc.assign(width * dim, 0.0f), key_row.resize(dim);
  load_queries(queries.data(), q_all, s, token_index, nq, h);

  for_each_key(k_pool, s, table, h, first, max_pos, [&](int64_t t, const T* key) {
    const float* widened = key_row.data();
    if constexpr (sizeof(T) == 2) {  // widen once, for every query slot
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) key_row[d] = to_float(key[d]);
    } else {
      widened = key;
    }
    for (int64_t w = 0; w < width; ++w) {
      const float* query = &queries[w * dim];
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += query[d] * widened[d];
      scores[w * length + (t - first)] = rounded ? round_bf16(dot) : dot;
    }
  });

  softmax_rows(scores.data(), length, span, query_pos, groups, h, scale, softcap, window, sinks, rounded);

  for_each_key(v_pool, s, table, h, first, max_pos, [&](int64_t t, const T* value) {
    const float* widened = key_row.data();
    if constexpr (sizeof(T) == 2) {
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) key_row[d] = to_float(value[d]);
    } else {
      widened = value;
    }
    for (int64_t w = 0; w < width; ++w) {
      const float p = scores[w * length + (t - first)];
      if (p == 0.0f) continue;
      float* into = &acc[w * dim];
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) into[d] += p * widened[d];
    }
  });
  store_outputs(out, acc.data(), s, token_index, nq, h);
}


// ---- The vectorized path, for head dims that are a multiple of 16 (nearly every model) ----
// One lane group of 16 floats (GCC vector extensions: AVX-512 registers where the CPU has them,
// pairs of AVX2 registers elsewhere). A key's dot product with a query is 16 lane-wise partial
// sums over the head dim, reduced for 16 keys at once by a fixed transpose-and-add tree, so every
// score is the same sums in the same order whichever keys share its chunk.
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 16;

// Loads through memcpy: pool rows are only element-aligned (the compiler emits unaligned loads).
inline f32x16 load_lanes(const float* from) {
  f32x16 lanes;
  std::memcpy(&lanes, from, sizeof(lanes));
  return lanes;
}
inline f32x16 load_lanes(const uint16_t* from) {  // bfloat16 widened: the bits shifted into the high half
  u16x16 narrow;
  std::memcpy(&narrow, from, sizeof(narrow));
  const u32x16 wide = __builtin_convertvector(narrow, u32x16) << 16;
  f32x16 lanes;
  std::memcpy(&lanes, &wide, sizeof(lanes));
  return lanes;
}

// Lane j of the result: the sum of the 16 lanes of parts[j].
inline f32x16 sum_lanes_of_each(f32x16 parts[kLanes]) {
  const i32x16 lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const i32x16 hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const i32x16 lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const i32x16 hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const i32x16 lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const i32x16 hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const i32x16 lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const i32x16 hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  f32x16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: 8 partial sums of parts[2i], 8-15: of parts[2i + 1]
    a[i] = __builtin_shuffle(parts[2 * i], parts[2 * i + 1], lo8) + __builtin_shuffle(parts[2 * i], parts[2 * i + 1], hi8);
  for (int i = 0; i < 4; ++i)  // 4 lanes for each of parts[4i .. 4i + 3]
    b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo4) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi4);
  for (int i = 0; i < 2; ++i)  // 2 lanes for each of parts[8i .. 8i + 7]
    c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo2) + __builtin_shuffle(b[2 * i], b[2 * i + 1], hi2);
  return __builtin_shuffle(c[0], c[1], lo1) + __builtin_shuffle(c[0], c[1], hi1);
}

// round_bf16 of each lane (the same integer steps, 16 at once).
inline f32x16 round_bf16_lanes(f32x16 x) {
  u32x16 word;
  std::memcpy(&word, &x, sizeof(word));
  word = (word + 0x7fffu + ((word >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &word, sizeof(x));
  return x;
}

// The first n (<= 16) lanes of x into `into`, rounded to bfloat16 values first where `rounded`.
// A full chunk is one vector store: a copy of variable length became `rep movs`, whose start-up
// took about a tenth of a bfloat16 decode call with K/V hot (perf, Intel AVX-512 Xeon).
inline void store_scores(float* into, f32x16 x, int64_t n, bool rounded) {
  if (rounded) x = round_bf16_lanes(x);
  if (n == kLanes)
    std::memcpy(into, &x, sizeof(x));
  else
    std::memcpy(into, &x, n * sizeof(float));
}

// attend_row_head's semantics, head_dim = 16 * CH: the head dim's lane groups known at compile
// time and query slots taken kTile at a time, so a tile's queries and its output accumulators
// stay in registers while each key and value is read once per tile.
constexpr int64_t kTile = 4;

template <int CH, typename T, typename Q>
void attend_row_head_lanes(const Q* q_all, Q* out, const T* k_pool, const T* v_pool, const Shape& s,
                           const int64_t* table, const int64_t* token_index, const int64_t* query_pos, int64_t h,
                           float scale, float softcap, int64_t window, const float* sinks) {
  const int64_t groups = s.heads / s.kv_heads, dim = s.head_dim, bs = s.block_size;
  const QuerySpan span = query_span(s, query_pos, window);
  if (span.nq == 0) return;
  const int64_t nq = span.nq, first = span.first, max_pos = span.max_pos, length = span.length;
  const int64_t width = nq * groups;  // query slots: (query, head of the group)
  const int64_t tiles = (width + kTile - 1) / kTile, padded = tiles * kTile;
  constexpr bool rounded = sizeof(T) == 2;  // bfloat16: round where eager's bfloat16 matmuls round
  thread_local std::vector<f32x16> queries, parts, acc;  // per thread, kept between tasks
  thread_local std::vector<float> scores;
  queries.assign(padded * CH, f32x16{}), parts.resize(kTile * kLanes), acc.resize(padded * CH);
  scores.assign(padded * length, 0.0f);  // padding slots' probabilities stay 0
  load_queries(reinterpret_cast<float*>(queries.data()), q_all, s, token_index, nq, h);
  const int64_t slice_elems = bs * dim;
  const auto block_start = [&](const T* pool, int64_t b) { return pool + (table[b] * s.kv_heads + h) * slice_elems; };

  // Scores, 16 keys at a time within a block.
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t real = std::min(kTile, width - tile * kTile);  // the tile's slots past `width`: no products
    f32x16 q[kTile][CH];
    for (int64_t w = 0; w < kTile; ++w)
      for (int c = 0; c < CH; ++c) q[w][c] = queries[(tile * kTile + w) * CH + c];
    for (int64_t b = first / bs; b <= max_pos / bs; ++b) {
      const T* tokens = block_start(k_pool, b);
      const T* next = b < max_pos / bs ? block_start(k_pool, b + 1) : nullptr;
      for (int64_t lo = std::max(first, b * bs), end = std::min(max_pos + 1, (b + 1) * bs); lo < end; lo += kLanes) {
        const int64_t n = std::min(kLanes, end - lo);
        for (int64_t j = 0; j < n; ++j) {
          const int64_t at = (lo + j - b * bs) * dim;
          const T* key = tokens + at;
          if (next) prefetch_elements(next + at, dim);
          f32x16 k[CH];
          for (int c = 0; c < CH; ++c) k[c] = load_lanes(key + c * kLanes);
          for (int64_t w = 0; w < real; ++w) {
            f32x16 part = q[w][0] * k[0];
            for (int c = 1; c < CH; ++c) part += q[w][c] * k[c];
            parts[w * kLanes + j] = part;
          }
        }
        for (int64_t w = 0; w < kTile && tile * kTile + w < width; ++w) {
          f32x16* of_slot = &parts[w * kLanes];
          for (int64_t j = n; j < kLanes; ++j) of_slot[j] = f32x16{};
          store_scores(&scores[(tile * kTile + w) * length + (lo - first)], sum_lanes_of_each(of_slot), n, rounded);
        }
      }
    }
  }

  softmax_rows(scores.data(), length, span, query_pos, groups, h, scale, softcap, window, sinks, rounded);

  // Probability-weighted values, key by key (padding slots' probabilities are 0: skipped).
  for (int64_t tile = 0; tile < tiles; ++tile) {
    f32x16 a[kTile][CH] = {};
    for (int64_t b = first / bs; b <= max_pos / bs; ++b) {
      const T* tokens = block_start(v_pool, b);
      const T* next = b < max_pos / bs ? block_start(v_pool, b + 1) : nullptr;
      for (int64_t t = std::max(first, b * bs), end = std::min(max_pos + 1, (b + 1) * bs); t < end; ++t) {
        const T* value = tokens + (t - b * bs) * dim;
        if (next) prefetch_elements(next + (t - b * bs) * dim, dim);
        f32x16 v[CH];
        for (int c = 0; c < CH; ++c) v[c] = load_lanes(value + c * kLanes);
        for (int64_t w = 0; w < kTile; ++w) {
          const float p = scores[(tile * kTile + w) * length + (t - first)];
          if (p == 0.0f) continue;
          for (int c = 0; c < CH; ++c) a[w][c] += p * v[c];
        }
      }
    }
    for (int64_t w = 0; w < kTile; ++w)
      for (int c = 0; c < CH; ++c) acc[(tile * kTile + w) * CH + c] = a[w][c];
  }
  store_outputs(out, reinterpret_cast<const float*>(acc.data()), s, token_index, nq, h);
}

#if defined(__AVX512BF16__)
// bfloat16 queries and pools on a CPU with AVX512-BF16: scores and weighted values by its dot
// product (vdpbf16ps: two exact products of bfloat16 pairs added into each float32 lane), twice
// the multiply-adds per instruction of the float32 lanes and no widening of keys and values. The
// products are the float32 path's (a product of two bfloat16 is exact in float32); the order of
// the additions differs, as between any two matmul kernels (oneDNN's bfloat16 matmuls in eager
// attention use this instruction too). Like it, it flushes subnormal inputs and sums to zero.
// Head dims of 32k (CH even); the tile, the 16-key reduction tree and the softmax are the
// float32 lanes path's.
inline __m512bh load_pairs(const uint16_t* from) { return (__m512bh)_mm512_loadu_si512(from); }

template <int CH>
void attend_row_head_bf16_dot(const uint16_t* q_all, uint16_t* out, const uint16_t* k_pool, const uint16_t* v_pool,
                              const Shape& s, const int64_t* table, const int64_t* token_index,
                              const int64_t* query_pos, int64_t h, float scale, float softcap, int64_t window,
                              const float* sinks) {
  constexpr int kPairs = CH / 2;  // 32 bfloat16 per vector
  const int64_t groups = s.heads / s.kv_heads, dim = s.head_dim, bs = s.block_size;
  const QuerySpan span = query_span(s, query_pos, window);
  if (span.nq == 0) return;
  const int64_t nq = span.nq, first = span.first, max_pos = span.max_pos, length = span.length;
  const int64_t width = nq * groups;
  const int64_t tiles = (width + kTile - 1) / kTile, padded = tiles * kTile;
  thread_local std::vector<uint16_t> queries;  // bfloat16 as they are: query slot by slot (per thread, kept)
  queries.assign(padded * dim, 0);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < groups; ++g)
      std::memcpy(&queries[(i * groups + g) * dim],
                  q_all + token_index[i] * s.q_token_stride + (h * groups + g) * s.q_head_stride, dim * sizeof(uint16_t));
  thread_local std::vector<f32x16> parts, acc;
  thread_local std::vector<float> scores;
  parts.resize(kTile * kLanes), acc.resize(padded * CH), scores.assign(padded * length, 0.0f);
  const int64_t slice_elems = bs * dim;

  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t real = std::min(kTile, width - tile * kTile);  // the tile's slots past `width`: no products
    __m512bh q[kTile][kPairs];
    for (int64_t w = 0; w < kTile; ++w)
      for (int c = 0; c < kPairs; ++c) q[w][c] = load_pairs(&queries[(tile * kTile + w) * dim + c * 32]);
    for (int64_t b = first / bs; b <= max_pos / bs; ++b) {
      const uint16_t* tokens = k_pool + (table[b] * s.kv_heads + h) * slice_elems;
      const uint16_t* next = b < max_pos / bs ? k_pool + (table[b + 1] * s.kv_heads + h) * slice_elems : nullptr;
      for (int64_t lo = std::max(first, b * bs), end = std::min(max_pos + 1, (b + 1) * bs); lo < end; lo += kLanes) {
        const int64_t n = std::min(kLanes, end - lo);
        for (int64_t j = 0; j < n; ++j) {
          const int64_t at = (lo + j - b * bs) * dim;
          const uint16_t* key = tokens + at;
          if (next) prefetch_elements(next + at, dim);
          __m512bh k[kPairs];
          for (int c = 0; c < kPairs; ++c) k[c] = load_pairs(key + c * 32);
          for (int64_t w = 0; w < real; ++w) {
            __m512 part = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[w][0], k[0]);
            for (int c = 1; c < kPairs; ++c) part = _mm512_dpbf16_ps(part, q[w][c], k[c]);
            parts[w * kLanes + j] = (f32x16)part;
          }
        }
        for (int64_t w = 0; w < kTile && tile * kTile + w < width; ++w) {
          f32x16* of_slot = &parts[w * kLanes];
          for (int64_t j = n; j < kLanes; ++j) of_slot[j] = f32x16{};
          store_scores(&scores[(tile * kTile + w) * length + (lo - first)], sum_lanes_of_each(of_slot), n, true);
        }
      }
    }
  }

  softmax_rows(scores.data(), length, span, query_pos, groups, h, scale, softcap, window, sinks, true);

  // Values two keys at a time: lane d of a vector holds (v_t[d], v_t+1[d]), so one dot product
  // with the pair (p_t, p_t+1) adds both keys' terms for 16 dims. An odd last key pairs with zeros.
  alignas(64) uint16_t low_index[32], high_index[32];
  for (int i = 0; i < 16; ++i) {
    low_index[2 * i] = i, low_index[2 * i + 1] = 32 + i;
    high_index[2 * i] = 16 + i, high_index[2 * i + 1] = 48 + i;
  }
  const __m512i low = _mm512_load_si512(low_index), high = _mm512_load_si512(high_index);
  for (int64_t tile = 0; tile < tiles; ++tile) {
    __m512 a[kTile][CH];
    for (int64_t w = 0; w < kTile; ++w)
      for (int c = 0; c < CH; ++c) a[w][c] = _mm512_setzero_ps();
    // Value rows in order, the block and the offset in it advanced together: a division and a
    // remainder per key (t / bs, t % bs) were a tenth of the call on an AVX-512 Xeon.
    int64_t block = first / bs, offset = first % bs;
    const auto next_value = [&]() {
      const uint16_t* row = v_pool + (table[block] * s.kv_heads + h) * slice_elems + offset * dim;
      if (block < max_pos / bs)  // the same row of the next block on its way
        prefetch_elements(v_pool + (table[block + 1] * s.kv_heads + h) * slice_elems + offset * dim, dim);
      if (++offset == bs) offset = 0, ++block;
      return row;
    };
    for (int64_t t = first; t <= max_pos; t += 2) {
      const bool pair = t + 1 <= max_pos;
      const uint16_t* va = next_value();
      const uint16_t* vb = pair ? next_value() : nullptr;
      __m512bh v[CH];
      for (int c = 0; c < kPairs; ++c) {
        const __m512i x = _mm512_loadu_si512(va + c * 32);
        const __m512i y = pair ? _mm512_loadu_si512(vb + c * 32) : _mm512_setzero_si512();
        v[2 * c] = (__m512bh)_mm512_permutex2var_epi16(x, low, y);
        v[2 * c + 1] = (__m512bh)_mm512_permutex2var_epi16(x, high, y);
      }
      for (int64_t w = 0; w < kTile; ++w) {
        const float* row = &scores[(tile * kTile + w) * length + (t - first)];
        const float pa = row[0], pb = pair ? row[1] : 0.0f;
        if (pa == 0.0f && pb == 0.0f) continue;
        uint32_t bits_a, bits_b;  // probabilities are bfloat16 values already: their high halves
        std::memcpy(&bits_a, &pa, sizeof(bits_a));
        std::memcpy(&bits_b, &pb, sizeof(bits_b));
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>((bits_b & 0xffff0000u) | (bits_a >> 16)));
        for (int c = 0; c < CH; ++c) a[w][c] = _mm512_dpbf16_ps(a[w][c], v[c], p);
      }
    }
    for (int64_t w = 0; w < kTile; ++w)
      for (int c = 0; c < CH; ++c) acc[(tile * kTile + w) * CH + c] = (f32x16)a[w][c];
  }
  store_outputs(out, reinterpret_cast<const float*>(acc.data()), s, token_index, nq, h);
}
#endif

// The compiled lane-group counts: head dims 64, 80, 96, 128, 256 (and 16, 32); false for others,
// and everywhere without AVX-512: with 16 AVX2 registers a tile's accumulators spill and the
// reduction's cross-lane shuffles are emulated (2x slower than the plain loops, measured).
template <typename T, typename Q>
bool lanes_kernel(int64_t head_dim, const Q* q_all, Q* out, const T* k_pool, const T* v_pool, const Shape& s,
                  const int64_t* table, const int64_t* token_index, const int64_t* query_pos, int64_t h, float scale,
                  float softcap, int64_t window, const float* sinks) {
#if !defined(__AVX512F__)
  return false;
#endif
#define RAYSAMPLE_CASE(KERNEL, CH)                                                                           \
  case 16 * CH:                                                                                            \
    KERNEL<CH>(q_all, out, k_pool, v_pool, s, table, token_index, query_pos, h, scale, softcap, window, sinks); \
    return true;
#if defined(__AVX512BF16__)
  if constexpr (sizeof(T) == 2 && sizeof(Q) == 2) {
    switch (head_dim) {
      RAYSAMPLE_CASE(attend_row_head_bf16_dot, 2) RAYSAMPLE_CASE(attend_row_head_bf16_dot, 4)
      RAYSAMPLE_CASE(attend_row_head_bf16_dot, 6) RAYSAMPLE_CASE(attend_row_head_bf16_dot, 8)
      RAYSAMPLE_CASE(attend_row_head_bf16_dot, 16)
      default:
        break;
    }
  }
#endif
  switch (head_dim) {
    RAYSAMPLE_CASE(attend_row_head_lanes, 1) RAYSAMPLE_CASE(attend_row_head_lanes, 2)
    RAYSAMPLE_CASE(attend_row_head_lanes, 4) RAYSAMPLE_CASE(attend_row_head_lanes, 5)
    RAYSAMPLE_CASE(attend_row_head_lanes, 6) RAYSAMPLE_CASE(attend_row_head_lanes, 8)
    RAYSAMPLE_CASE(attend_row_head_lanes, 16)
#undef RAYSAMPLE_CASE
    default:
      return false;
  }
}

}  // namespace

extern "C" {

int raysample_abi_version() { return 5; }

// Whether bfloat16 queries and pools take the AVX512-BF16 dot-product path (head dims of 32k).
int raysample_bf16_dot_product() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// A step's new K and V rows into their cache slots, one call per layer for both (what two
// index_copy_ calls and a contiguous copy of V did). k, v: token t, head h at
// base + (t * token_stride + h * head_stride) elements, head_dim contiguous; slots: int64
// (tokens * kv_heads,), token-major, each a row of the pool viewed as (rows, head_dim), checked in
// range by the caller.
void raysample_write_kv(const void* k, int64_t k_token_stride, int64_t k_head_stride, const void* v,
                        int64_t v_token_stride, int64_t v_head_stride, void* k_pool, void* v_pool, const int64_t* slots,
                        int64_t tokens, int64_t kv_heads, int64_t head_dim, int64_t element_size) {
  const int64_t row_bytes = head_dim * element_size;
  char* k_rows = static_cast<char*>(k_pool);
  char* v_rows = static_cast<char*>(v_pool);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t slot = slots[t * kv_heads + h];
      std::memcpy(k_rows + slot * row_bytes, static_cast<const char*>(k) + (t * k_token_stride + h * k_head_stride) * element_size,
                  row_bytes);
      std::memcpy(v_rows + slot * row_bytes, static_cast<const char*>(v) + (t * v_token_stride + h * v_head_stride) * element_size,
                  row_bytes);
    }
}

// q_all: (tokens, heads, head_dim) with the given strides; out: contiguous, same shape; both of
// q_dtype. k_pool, v_pool: (num_blocks, kv_heads, block_size, head_dim) of dtype. Dtype codes:
// 0 float32, 1 bfloat16.
// block_tables: int64 (rows, table_width); token_index, query_pos: int64 (rows, q_len), padding
// queries last with position -1. softcap <= 0: none; window <= 0: none; sinks: float32 (heads,) or null.
// prefetch: 0 only to measure what prefetching saves (the output is the same either way).
void raysample_paged_decode(const void* q_all, int64_t q_token_stride, int64_t q_head_stride, void* out, int q_dtype,
                            const void* k_pool, const void* v_pool, int dtype, int64_t heads, int64_t kv_heads,
                            int64_t head_dim, int64_t block_size, const int64_t* block_tables, int64_t table_width,
                            const int64_t* token_index, const int64_t* query_pos, int64_t rows, int64_t q_len,
                            float scale, float softcap, int64_t window, const float* sinks, int threads,
                            int prefetch) {
  const Shape s{heads, kv_heads, head_dim, block_size, table_width, q_len, q_token_stride, q_head_stride};
  const int64_t tasks = rows * kv_heads;
  const int64_t element_size = dtype == 0 ? 4 : 2;
  const char* k_bytes = static_cast<const char*>(k_pool);
  const char* v_bytes = static_cast<const char*>(v_pool);
  const auto fetch = [&](auto locality, int64_t task) {
    prefetch_task<decltype(locality)::value>(k_bytes, v_bytes, element_size, s,
                                             block_tables + (task / kv_heads) * table_width,
                                             query_pos + (task / kv_heads) * q_len, task % kv_heads, window);
  };
#pragma omp parallel num_threads(static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tasks))))
  {
#if defined(_OPENMP)
    const TaskRun mine = task_run(s, query_pos, rows, window, omp_get_thread_num(), omp_get_num_threads());
#else
    const TaskRun mine = task_run(s, query_pos, rows, window, 0, 1);
#endif
    for (int64_t task = mine.begin; prefetch && task < std::min(mine.end, mine.begin + kTasksAhead); ++task)
      fetch(std::integral_constant<int, 3>{}, task);
    for (int64_t task = mine.begin; task < mine.end; ++task) {
      if (prefetch && task + kTasksAhead < mine.end) fetch(std::integral_constant<int, 2>{}, task + kTasksAhead);
      const int64_t r = task / kv_heads, h = task % kv_heads;
      const int64_t* table = block_tables + r * table_width;
      const int64_t* row_tokens = token_index + r * q_len;
      const int64_t* row_positions = query_pos + r * q_len;
      const auto run = [&](auto* queries, auto* into) {
        if (dtype == 0 && !lanes_kernel(head_dim, queries, into, static_cast<const float*>(k_pool),
                                        static_cast<const float*>(v_pool), s, table, row_tokens, row_positions, h, scale,
                                        softcap, window, sinks))
          attend_row_head(queries, into, static_cast<const float*>(k_pool), static_cast<const float*>(v_pool), s, table,
                          row_tokens, row_positions, h, scale, softcap, window, sinks);
        else if (dtype != 0 && !lanes_kernel(head_dim, queries, into, static_cast<const uint16_t*>(k_pool),
                                             static_cast<const uint16_t*>(v_pool), s, table, row_tokens, row_positions,
                                             h, scale, softcap, window, sinks))
          attend_row_head(queries, into, static_cast<const uint16_t*>(k_pool), static_cast<const uint16_t*>(v_pool), s,
                          table, row_tokens, row_positions, h, scale, softcap, window, sinks);
      };
      if (q_dtype == 0)
        run(static_cast<const float*>(q_all), static_cast<float*>(out));
      else
        run(static_cast<const uint16_t*>(q_all), static_cast<uint16_t*>(out));
    }
  }
}
}

// Small per-token ops of a decoder layer (RMSNorm, rotary embedding) in one call each, computing
// exactly what transformers' eager code computes with torch on this CPU: every rounding where
// torch rounds (bfloat16 after each op, float32 sums in torch's order), no fused multiply-adds, no
// reassociation (built with -ffp-contract=off and without -fassociative-math). Python checks each
// against the eager code at load and uses it only where the outputs are identical
// (workers/cpu/exact_ops.py). Each token is independent, so a result never depends on the batch.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bfloat16.h"

namespace {

using raysample::bf16_to_float;

// torch's float -> bfloat16. A NaN stays a NaN without torch's test for it: every NaN in these ops
// comes from a bfloat16 input or is the CPU's default NaN of an invalid operation, so its low 16
// bits are zero and adding the rounding bias cannot carry into its exponent (a float32 NaN with a
// payload there could; none reaches these roundings).
inline uint16_t float_to_bf16(float value) { return raysample::bf16_bits(value); }

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) { return bf16_to_float(*p); }
inline void put(float* p, float value) { *p = value; }
inline void put(uint16_t* p, float value) { *p = float_to_bf16(value); }
// The value an op's output holds once stored in the tensor's dtype.
inline float rounded(float value, const float*) { return value; }
inline float rounded(float value, const uint16_t*) { return bf16_to_float(float_to_bf16(value)); }

int ceil_log2(int64_t x) {  // c10::utils::CeilLog2
  if (x <= 2) return 1;
  int bits = 0;
  for (uint64_t v = static_cast<uint64_t>(x) - 1; v; v >>= 1) ++bits;
  return bits;
}

constexpr int kIlp = 4;     // torch's row_sum: four vectors summed side by side
constexpr int kLevels = 4;  // torch's multi_row_sum: a four-level cascade

// The float sum of a contiguous row as torch's CPU sum reduces it (cascade_sum's inner-contiguous
// path: vectorized_inner_sum -> row_sum -> multi_row_sum), with ``lanes`` floats per vector;
// element i of the row is x(i).
template <int lanes, typename Row>
float torch_row_sum(const Row& x, int64_t n) {
  const int64_t vectors = n / lanes;
  const int64_t size = vectors / kIlp;  // groups of four vectors
  float acc[kLevels][kIlp][lanes] = {};
  const int power = ceil_log2(size) / kLevels > 4 ? ceil_log2(size) / kLevels : 4;
  const int64_t step = int64_t{1} << power;
  const int64_t mask = step - 1;
  auto add_group = [&](int64_t group) {
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < lanes; ++l) acc[0][k][l] += x((group * kIlp + k) * lanes + l);
  };
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i) add_group(i);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k)
        for (int l = 0; l < lanes; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.0f;
        }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i) add_group(i);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < lanes; ++l) acc[0][k][l] += acc[j][k][l];
  float* partial = acc[0][0];
  for (int64_t v = size * kIlp; v < vectors; ++v)  // vectors left over from the groups of four
    for (int l = 0; l < lanes; ++l) partial[l] += x(v * lanes + l);
  for (int k = 1; k < kIlp; ++k)
    for (int l = 0; l < lanes; ++l) partial[l] += acc[0][k][l];
  float total = 0.0f;
  for (int64_t t = vectors * lanes; t < n; ++t) total += x(t);  // the scalar tail first, as torch
  for (int l = 0; l < lanes; ++l) total += partial[l];
  return total;
}

// Llama's RMSNorm: h = float(x); h * rsqrt(mean(h^2) + eps), rounded to x's dtype, times weight.
template <typename T, int lanes>
void rms_norm_row(const T* x, const T* weight, T* out, int64_t width, float eps) {
  const auto square = [x](int64_t i) {
    const float h = load(x + i);
    return h * h;
  };
  const float variance = torch_row_sum<lanes>(square, width) / static_cast<float>(width);
  const float inverse = 1.0f / std::sqrt(variance + eps);
  for (int64_t i = 0; i < width; ++i) {
    const float normed = rounded(load(x + i) * inverse, out);
    put(out + i, load(weight + i) * normed);
  }
}

// q * cos + rotate_half(q) * sin for one head, each product and the sum rounded to T.
template <typename T>
void rotate_head(const T* q, const T* cos, const T* sin, T* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < half; ++d) {  // rotate_half(q)[d] = -q[d + half]
    const float a = rounded(load(q + d) * load(cos + d), out);
    const float b = rounded(-load(q + d + half) * load(sin + d), out);
    put(out + d, a + b);
  }
  for (int64_t d = half; d < dim; ++d) {  // rotate_half(q)[d] = q[d - half]
    const float a = rounded(load(q + d) * load(cos + d), out);
    const float b = rounded(load(q + d - half) * load(sin + d), out);
    put(out + d, a + b);
  }
}

template <typename T, int lanes>
void rms_norm(const void* x, int64_t x_stride, const void* weight, void* out, int64_t rows, int64_t width, float eps,
              int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * width >= 65536)
  for (int64_t r = 0; r < rows; ++r)
    rms_norm_row<T, lanes>(static_cast<const T*>(x) + r * x_stride, static_cast<const T*>(weight),
                           static_cast<T*>(out) + r * width, width, eps);
}

// One tensor (queries or keys) of ``heads`` heads per token: token t, head h at
// src + t * token_stride + h * head_stride; out contiguous (tokens, heads, dim).
template <typename T>
void rotate(const void* src, int64_t token_stride, int64_t head_stride, int64_t heads, const void* cos,
            const void* sin, int64_t trig_stride, void* out, int64_t tokens, int64_t dim, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens * heads * dim >= 65536)
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h)
      rotate_head(static_cast<const T*>(src) + t * token_stride + h * head_stride,
                  static_cast<const T*>(cos) + t * trig_stride, static_cast<const T*>(sin) + t * trig_stride,
                  static_cast<T*>(out) + (t * heads + h) * dim, dim);
}

}  // namespace

extern "C" {

int raysample_exact_ops_abi_version() { return 1; }

// dtype: 0 float32, 1 bfloat16. lanes: floats per vector in torch's sum kernel on this CPU (4, 8
// or 16; which one torch uses is found by trying, workers/cpu/exact_ops.py). False for another count.
bool raysample_rms_norm(const void* x, int64_t x_stride, const void* weight, void* out, int dtype, int64_t rows,
                        int64_t width, float eps, int lanes, int threads) {
  auto run = [&](auto norm) { norm(x, x_stride, weight, out, rows, width, eps, threads); };
  switch (lanes * 2 + dtype) {
    case 8: run(rms_norm<float, 4>); return true;
    case 9: run(rms_norm<uint16_t, 4>); return true;
    case 16: run(rms_norm<float, 8>); return true;
    case 17: run(rms_norm<uint16_t, 8>); return true;
    case 32: run(rms_norm<float, 16>); return true;
    case 33: run(rms_norm<uint16_t, 16>); return true;
    default: return false;
  }
}

void raysample_rotary(const void* src, int64_t token_stride, int64_t head_stride, int64_t heads, const void* cos,
                      const void* sin, int64_t trig_stride, void* out, int dtype, int64_t tokens, int64_t dim,
                      int threads) {
  if (dtype == 0) rotate<float>(src, token_stride, head_stride, heads, cos, sin, trig_stride, out, tokens, dim, threads);
  else rotate<uint16_t>(src, token_stride, head_stride, heads, cos, sin, trig_stride, out, tokens, dim, threads);
}

}  // extern "C"

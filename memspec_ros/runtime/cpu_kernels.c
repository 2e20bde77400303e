/* CPU kernels for the engine's decode forward (runtime/cpu_kernels.py compiles this file on the machine
 * it runs on, with -march=native, and falls back to ATen's kernels where it cannot).
 *
 * Why: at 1 thread the bundled target's forward is compute-bound, not memory-bound. ATen's int4 kernel
 * unpacks and dequantizes every weight again for each group of 4 rows, so a 5-row verify costs ~2x a
 * 1-token step; its attention and oneDNN's int8 GEMM spend tens of microseconds per call on set-up.
 *
 * Every kernel computes each row of a multi-row call with exactly the operations it uses for that row
 * alone (rows never share an accumulator, and the code path depends on shapes, not on the row count's
 * blocking), so a verify's rows equal one-token steps bit for bit: the losslessness of speculative
 * decoding rests on that, and the tests check it.
 *
 *   w4_matmul   4-bit weights, groups of 32 with a bf16 scale and minimum (Q4_1's grid); bf16 inputs.
 *               Each group's 16 possible weight values are made once (bf16(q*scale+min)), the nibbles
 *               index them (vpermw), and vdpbf16ps multiplies 32 weights by a row in one instruction, so
 *               the unpacking is shared by all rows of a call. Needs AVX512-BF16.
 *   i8_matmul   int8 weights x int8 inputs with exact int32 sums (vpdpbusd), the inputs quantized per row
 *               here exactly as runtime/forward_paths.py:Int8Linear quantizes them, and scaled as it
 *               scales them: the result equals torch._int_mm's path bit for bit. Needs AVX512-VNNI.
 *   decoder_forward
 *               every layer of a Llama decoder whose linears are w4 or i8, in one call: at 1 token the
 *               Python and dispatch around ~50 small tensor operations per layer cost as much as a third
 *               of the forward; here RMSNorm, RoPE, the KV cache write, attention (each query row over its
 *               own causal prefix), SiLU and the residuals are plain loops between the matmul kernels.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#endif

enum { FEATURE_W4 = 1, FEATURE_I8 = 2, FEATURE_DECODER = 4 };
#define ROW_BLOCK 8 /* rows per pass over the weights */

int memspec_kernel_features(void) {
  int features = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
  features |= FEATURE_W4;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
  features |= FEATURE_I8;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__) && \
    defined(__AVX512VNNI__)
  features |= FEATURE_DECODER;
#endif
  return features;
}

/* ---------------------------------------------------------------- w4: 4-bit weights, bf16 rows */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
/* One group's 32 weights as bf16. q: 16 bytes, byte j holding weight j (low nibble) and j+16 (high);
 * scale_min: the group's bf16 scale (low half) and minimum (high half). */
static inline __m512i group_weights(const uint8_t* q, uint32_t scale_min) {
  const __m512i pair = _mm512_set1_epi32((int)scale_min);
  const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
  const __m512 low = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32((int)0xFFFF0000u)));
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m256bh table = _mm512_cvtneps_pbh(_mm512_fmadd_ps(levels, scale, low));
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)q));
  const __m256i lo = _mm256_and_si256(bytes, _mm256_set1_epi16(15));
  const __m256i hi = _mm256_srli_epi16(bytes, 4);
  const __m512i index = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  return _mm512_permutexvar_epi16(index, _mm512_castsi256_si512((__m256i)table));
}

/* OB output rows at a time share each row's input loads; MR rows share each group's unpacking. */
#define DEFINE_W4(MR, OB)                                                                                   \
  static void w4_##MR(const uint8_t* restrict qw, const uint32_t* restrict sm, const uint16_t* restrict x, \
                      float* restrict y, int K, int O) {                                                    \
    const int groups = K / 32;                                                                              \
    int o = 0;                                                                                              \
    for (; o + OB <= O; o += OB) {                                                                          \
      __m512 acc[OB][MR];                                                                                   \
      for (int r = 0; r < OB; r++)                                                                          \
        for (int m = 0; m < MR; m++) acc[r][m] = _mm512_setzero_ps();                                       \
      for (int g = 0; g < groups; g++) {                                                                    \
        __m512i w[OB];                                                                                      \
        for (int r = 0; r < OB; r++) {                                                                      \
          const size_t at = (size_t)(o + r) * groups + g;                                                   \
          w[r] = group_weights(qw + at * 16, sm[at]);                                                       \
        }                                                                                                   \
        for (int m = 0; m < MR; m++) {                                                                      \
          const __m512i xv = _mm512_loadu_si512(x + (size_t)m * K + g * 32);                                \
          for (int r = 0; r < OB; r++)                                                                      \
            acc[r][m] = _mm512_dpbf16_ps(acc[r][m], (__m512bh)w[r], (__m512bh)xv);                         \
        }                                                                                                   \
      }                                                                                                     \
      for (int r = 0; r < OB; r++)                                                                          \
        for (int m = 0; m < MR; m++) y[(size_t)m * O + o + r] = _mm512_reduce_add_ps(acc[r][m]);            \
    }                                                                                                       \
    for (; o < O; o++) { /* the rest one output at a time: the same operations per output */               \
      __m512 acc[MR];                                                                                       \
      for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();                                            \
      for (int g = 0; g < groups; g++) {                                                                    \
        const size_t at = (size_t)o * groups + g;                                                           \
        const __m512i w = group_weights(qw + at * 16, sm[at]);                                              \
        for (int m = 0; m < MR; m++)                                                                        \
          acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)w,                                                    \
                                    (__m512bh)_mm512_loadu_si512(x + (size_t)m * K + g * 32));             \
      }                                                                                                     \
      for (int m = 0; m < MR; m++) y[(size_t)m * O + o] = _mm512_reduce_add_ps(acc[m]);                     \
    }                                                                                                       \
  }
DEFINE_W4(1, 4) DEFINE_W4(2, 4) DEFINE_W4(3, 4) DEFINE_W4(4, 4)
DEFINE_W4(5, 4) DEFINE_W4(6, 2) DEFINE_W4(7, 2) DEFINE_W4(8, 2)

/* y[M][O] = x[M][K] (bf16) times the 4-bit weights' transpose. K % 32 == 0. */
int w4_matmul(const uint8_t* qw, const uint32_t* sm, const uint16_t* x, float* y, int M, int K, int O) {
  for (int m0 = 0; m0 < M; m0 += ROW_BLOCK) {
    const int mr = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
    const uint16_t* xs = x + (size_t)m0 * K;
    float* ys = y + (size_t)m0 * O;
    switch (mr) {
      case 1: w4_1(qw, sm, xs, ys, K, O); break;
      case 2: w4_2(qw, sm, xs, ys, K, O); break;
      case 3: w4_3(qw, sm, xs, ys, K, O); break;
      case 4: w4_4(qw, sm, xs, ys, K, O); break;
      case 5: w4_5(qw, sm, xs, ys, K, O); break;
      case 6: w4_6(qw, sm, xs, ys, K, O); break;
      case 7: w4_7(qw, sm, xs, ys, K, O); break;
      default: w4_8(qw, sm, xs, ys, K, O); break;
    }
  }
  return 0;
}
#endif

/* ---------------------------------------------------------------- i8: int8 weights and rows */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
/* vpdpbusd multiplies unsigned by signed bytes: rows go in shifted by +128, and each output's
 * 128 * sum(weights) (bias128) is taken off again. All sums are exact int32. */
#define DEFINE_I8(MR, OB)                                                                                  \
  static void i8_##MR(const uint8_t* restrict xu, const int8_t* restrict w, const int32_t* restrict b128, \
                      int32_t* restrict acc_out, int K, int O) {                                           \
    int o = 0;                                                                                             \
    for (; o + OB <= O; o += OB) {                                                                         \
      __m512i acc[OB][MR];                                                                                 \
      for (int r = 0; r < OB; r++)                                                                         \
        for (int m = 0; m < MR; m++) acc[r][m] = _mm512_setzero_si512();                                   \
      for (int k = 0; k < K; k += 64) {                                                                    \
        __m512i wv[OB];                                                                                    \
        for (int r = 0; r < OB; r++) wv[r] = _mm512_loadu_si512(w + (size_t)(o + r) * K + k);             \
        for (int m = 0; m < MR; m++) {                                                                     \
          const __m512i xv = _mm512_loadu_si512(xu + (size_t)m * K + k);                                   \
          for (int r = 0; r < OB; r++) acc[r][m] = _mm512_dpbusd_epi32(acc[r][m], xv, wv[r]);             \
        }                                                                                                  \
      }                                                                                                    \
      for (int r = 0; r < OB; r++)                                                                         \
        for (int m = 0; m < MR; m++)                                                                       \
          acc_out[(size_t)m * O + o + r] = _mm512_reduce_add_epi32(acc[r][m]) - b128[o + r];               \
    }                                                                                                      \
    for (; o < O; o++) {                                                                                   \
      __m512i acc[MR];                                                                                     \
      for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_si512();                                        \
      for (int k = 0; k < K; k += 64) {                                                                    \
        const __m512i wv = _mm512_loadu_si512(w + (size_t)o * K + k);                                      \
        for (int m = 0; m < MR; m++)                                                                       \
          acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_loadu_si512(xu + (size_t)m * K + k), wv);            \
      }                                                                                                    \
      for (int m = 0; m < MR; m++) acc_out[(size_t)m * O + o] = _mm512_reduce_add_epi32(acc[m]) - b128[o]; \
    }                                                                                                      \
  }
DEFINE_I8(1, 4) DEFINE_I8(2, 4) DEFINE_I8(3, 4) DEFINE_I8(4, 4)
DEFINE_I8(5, 2) DEFINE_I8(6, 2) DEFINE_I8(7, 2) DEFINE_I8(8, 2)

/* y[M][O] = (sum_k q(x)[m][k] * w[o][k]) * row_scale[m] * scale[o], where row_scale = max|x[m]| / 127
 * (at least 1e-12 / 127) and q(x) = round-half-even(x / row_scale): Int8Linear's arithmetic, operation
 * for operation. K % 64 == 0. xu: scratch of M*K bytes; acc: scratch of M*O int32. */
int i8_matmul(const float* x, const int8_t* w, const int32_t* b128, const float* scale, float* y,
              uint8_t* xu, int32_t* acc, int M, int K, int O) {
  float row_scale[ROW_BLOCK];
  for (int m0 = 0; m0 < M; m0 += ROW_BLOCK) {
    const int mr = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
    for (int m = 0; m < mr; m++) {
      const float* row = x + (size_t)(m0 + m) * K;
      float top = 0.0f;
      for (int k = 0; k < K; k++) top = fmaxf(top, fabsf(row[k]));
      row_scale[m] = fmaxf(top, 1e-12f) / 127.0f;
      for (int k = 0; k < K; k++) xu[(size_t)m * K + k] = (uint8_t)((int)nearbyintf(row[k] / row_scale[m]) + 128);
    }
    switch (mr) {
      case 1: i8_1(xu, w, b128, acc, K, O); break;
      case 2: i8_2(xu, w, b128, acc, K, O); break;
      case 3: i8_3(xu, w, b128, acc, K, O); break;
      case 4: i8_4(xu, w, b128, acc, K, O); break;
      case 5: i8_5(xu, w, b128, acc, K, O); break;
      case 6: i8_6(xu, w, b128, acc, K, O); break;
      case 7: i8_7(xu, w, b128, acc, K, O); break;
      default: i8_8(xu, w, b128, acc, K, O); break;
    }
    for (int m = 0; m < mr; m++) {
      float* out = y + (size_t)(m0 + m) * O;
      const int32_t* a = acc + (size_t)m * O;
      for (int o = 0; o < O; o++) {
        const float scaled = (float)a[o] * row_scale[m]; /* two roundings, in torch's order */
        out[o] = scaled * scale[o];
      }
    }
  }
  return 0;
}
#endif

/* ---------------------------------------------------------------- a whole decoder in one call */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__) && \
    defined(__AVX512VNNI__)
#include <stdlib.h>

/* ---------------------------------------------------------------- attention over a KV cache */
#define LANES 16
static inline float dot(const float* restrict a, const float* restrict b, int d) {
  float lane[LANES] = {0};
  for (int j = 0; j < d; j += LANES)
    for (int l = 0; l < LANES; l++) lane[l] += a[j + l] * b[j + l];
  for (int width = LANES / 2; width >= 1; width /= 2)
    for (int l = 0; l < width; l++) lane[l] += lane[l + width];
  return lane[0];
}

/* out[i][h][:] = softmax(scale * q[h][i] . K[kv(h)][0..start+i]) V[kv(h)][0..start+i] for i < n.
 * q: [heads][n][d] contiguous; keys/values: [kv_heads][capacity][d] buffers (row stride d);
 * out: [n][heads][d]; scores: scratch of start + n floats. d % 16 == 0. */
static int attend(const float* q, const float* keys, const float* values, float* out, float* scores,
           int n, int heads, int kv_heads, int d, int start, int capacity, float scale) {
  const int group = heads / kv_heads;
  for (int i = 0; i < n; i++) {
    const int length = start + i + 1;
    for (int h = 0; h < heads; h++) {
      const float* qi = q + ((size_t)h * n + i) * d;
      const float* k = keys + (size_t)(h / group) * capacity * d;
      const float* v = values + (size_t)(h / group) * capacity * d;
      float top = -INFINITY;
      for (int t = 0; t < length; t++) {
        scores[t] = dot(qi, k + (size_t)t * d, d) * scale;
        top = fmaxf(top, scores[t]);
      }
      float total = 0.0f;
      for (int t = 0; t < length; t++) {
        scores[t] = expf(scores[t] - top);
        total += scores[t];
      }
      float* o = out + ((size_t)i * heads + h) * d;
      for (int j = 0; j < d; j++) o[j] = 0.0f;
      for (int t = 0; t < length; t++) {
        const float p = scores[t];
        const float* vt = v + (size_t)t * d;
        for (int j = 0; j < d; j++) o[j] += p * vt[j];
      }
      const float inverse = 1.0f / total;
      for (int j = 0; j < d; j++) o[j] *= inverse;
    }
  }
  return 0;
}

/* One linear layer in a kernel's format: kind 4 = w4 (a: packed, b: scale_min), 8 = i8 (a: weights,
 * b: bias128, scale: per output). No bias (Llama has none). */
typedef struct {
  int kind, in_features, out_features;
  const void* a;
  const void* b;
  const float* scale;
} Linear;

typedef struct {
  const float* attn_norm;
  const float* mlp_norm;
  Linear qkv, o, gate_up, down; /* q, k, v side by side; gate, up side by side */
  float* keys;                  /* [kv_heads][capacity][head_dim], rows 0..start-1 filled */
  float* values;
  int capacity;
} Layer;

typedef struct {
  uint16_t* bf16; /* a row block's inputs in bf16 */
  uint8_t* xu;    /* i8 scratch */
  int32_t* acc;
} Scratch;

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch's .to(torch.bfloat16) */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static void linear(const Linear* L, const float* x, float* y, int n, Scratch* s) {
  if (L->kind == 4) {
    for (size_t i = 0; i < (size_t)n * L->in_features; i++) s->bf16[i] = to_bf16(x[i]);
    w4_matmul((const uint8_t*)L->a, (const uint32_t*)L->b, s->bf16, y, n, L->in_features, L->out_features);
  } else {
    i8_matmul(x, (const int8_t*)L->a, (const int32_t*)L->b, L->scale, y, s->xu, s->acc, n, L->in_features,
              L->out_features);
  }
}

static void rms_norm(const float* x, const float* w, float* out, int n, int dim, float eps) {
  for (int i = 0; i < n; i++) {
    const float* row = x + (size_t)i * dim;
    float lane[LANES] = {0};
    for (int j = 0; j < dim; j += LANES)
      for (int l = 0; l < LANES; l++) lane[l] += row[j + l] * row[j + l];
    for (int width = LANES / 2; width >= 1; width /= 2)
      for (int l = 0; l < width; l++) lane[l] += lane[l + width];
    const float r = 1.0f / sqrtf(lane[0] / (float)dim + eps);
    for (int j = 0; j < dim; j++) out[(size_t)i * dim + j] = w[j] * (row[j] * r);
  }
}

static void rope(const float* in, float* out, const float* cos, const float* sin, int d) {
  const int half = d / 2;
  for (int j = 0; j < d; j++) {
    const float rotated = j < half ? -in[j + half] : in[j - half];
    out[j] = in[j] * cos[j] + rotated * sin[j];
  }
}

/* x [n][dim] (in place): every layer of a Llama decoder for rows at positions start..start+n-1, writing
 * their keys and values into each layer's cache buffers. cos/sin: [n][head_dim] (the model's rotary
 * embedding). dim, head_dim and intermediate are multiples of 64. Returns 0, or -1 when out of memory. */
int decoder_forward(const Layer* layers, int n_layers, float* x, int n, int start, const float* cos,
                    const float* sin, int dim, int heads, int kv_heads, int head_dim, int intermediate,
                    float eps) {
  const int q_width = heads * head_dim, kv_width = kv_heads * head_dim, qkv_width = q_width + 2 * kv_width;
  const int widest = 2 * intermediate > qkv_width ? 2 * intermediate : qkv_width;
  const size_t rows = (size_t)n;
  float* h = malloc(rows * dim * sizeof(float));
  float* wide = malloc(rows * widest * sizeof(float));
  float* q = malloc(rows * q_width * sizeof(float));
  float* attn = malloc(rows * q_width * sizeof(float));
  float* act = malloc(rows * intermediate * sizeof(float));
  float* scores = malloc(((size_t)start + n) * sizeof(float));
  const int widest_in = intermediate > dim ? intermediate : dim;
  Scratch s = {malloc(rows * widest_in * sizeof(uint16_t)), malloc((size_t)ROW_BLOCK * widest_in),
               malloc((size_t)ROW_BLOCK * widest * sizeof(int32_t))};
  int status = 0;
  if (!h || !wide || !q || !attn || !act || !scores || !s.bf16 || !s.xu || !s.acc) {
    status = -1;
    goto done;
  }
  for (int l = 0; l < n_layers; l++) {
    const Layer* L = layers + l;
    rms_norm(x, L->attn_norm, h, n, dim, eps);
    linear(&L->qkv, h, wide, n, &s);
    for (int i = 0; i < n; i++) {
      const float* row = wide + (size_t)i * qkv_width;
      const float* c = cos + (size_t)i * head_dim;
      const float* sn = sin + (size_t)i * head_dim;
      for (int hd = 0; hd < heads; hd++)
        rope(row + hd * head_dim, q + ((size_t)hd * n + i) * head_dim, c, sn, head_dim);
      for (int kv = 0; kv < kv_heads; kv++) {
        const size_t at = ((size_t)kv * L->capacity + start + i) * head_dim;
        rope(row + q_width + kv * head_dim, L->keys + at, c, sn, head_dim);
        memcpy(L->values + at, row + q_width + kv_width + kv * head_dim, head_dim * sizeof(float));
      }
    }
    attend(q, L->keys, L->values, attn, scores, n, heads, kv_heads, head_dim, start, L->capacity,
           1.0f / sqrtf((float)head_dim));
    linear(&L->o, attn, h, n, &s);
    for (size_t j = 0; j < rows * dim; j++) x[j] += h[j];
    rms_norm(x, L->mlp_norm, h, n, dim, eps);
    linear(&L->gate_up, h, wide, n, &s);
    for (int i = 0; i < n; i++) {
      const float* gate = wide + (size_t)i * 2 * intermediate;
      const float* up = gate + intermediate;
      float* a = act + (size_t)i * intermediate;
      for (int j = 0; j < intermediate; j++) a[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
    }
    linear(&L->down, act, h, n, &s);
    for (size_t j = 0; j < rows * dim; j++) x[j] += h[j];
  }
done:
  free(h); free(wide); free(q); free(attn); free(act); free(scores);
  free(s.bf16); free(s.xu); free(s.acc);
  return status;
}
#endif

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
 *   w4_matmul   4-bit weights, groups of 32 with a bf16 scale and minimum (Q4_1's grid), fp32 rows in. The
 *               rows are quantized to int8 per block of 32 (scale max|x|/127, as llama.cpp's Q8_1 blocks)
 *               and each block's sum over the 4-bit levels is an exact integer, scaled in fp32: vpdpbusd
 *               with AVX512-VNNI (the weights in blocks of 16 outputs; AMX tiles for calls of more than 5
 *               rows where the CPU has them), vpmaddubsw with AVX2 (15 * 127 * 2 fits int16), plain
 *               integers in portable C for any other CPU.
 *   i8_matmul   int8 weights x int8 inputs with exact int32 sums (AMX tiles where the CPU has AMX-INT8 and Linux
 *               grants them, else vpdpbusd with AVX512-VNNI; vpmaddubsw on
 *               |w| and the sign-adjusted rows with AVX2; plain integers elsewhere), the inputs quantized per row here exactly
 *               as runtime/forward_paths.py:Int8Linear quantizes them, and scaled as it scales them: the
 *               result equals torch._int_mm's path bit for bit, on every instruction set.
 *   f32_matmul  fp32 weights as loaded x fp32 rows, each sum in one fixed order (the model's own numbers, rows exact).
 *   decoder_forward
 *               every layer of a Llama decoder whose linears are w4, i8 or f32, in one call: at 1 token the
 *               Python and dispatch around ~50 small tensor operations per layer cost as much as a third
 *               of the forward; here RMSNorm, RoPE, the KV cache write, attention (each query row over its
 *               own causal prefix), SiLU and the residuals are plain loops between the matmul kernels.
 *   model_step  a whole forward, token ids to logits: the embedding rows, decoder_forward, the final RMSNorm
 *               and the head, and a reduced vocabulary's rows scattered into target-width rows. In the engine's
 *               loop each of a draft's forwards follows a target verify that streamed ~70 MB of weights, which
 *               evicts the interpreter's and torch's dispatch state: a trivial tensor operation then costs
 *               ~15-20 us instead of ~2, and the operations around decoder_forward cost 3x the layers.
 *
 * Instruction sets: chosen at compile time from what -march=native enables (memspec_kernel_isa() says which
 * each kernel got; AMX also needs the kernel's permission, asked at the first call; MEMSPEC_AMX=0 leaves it out). -DMEMSPEC_PORTABLE builds the portable C alone (the tests run it on any machine).
 *
 * Threads: each matmul splits its outputs, and attention its heads, among `threads` OpenMP threads (torch's
 * own pool, see parallel_for). Every output is computed by the same operations whichever thread computes it, so the
 * numbers do not depend on the thread count either.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef MEMSPEC_PORTABLE
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512 1
#endif
#if defined(HAVE_AVX512) && defined(__AVX512VNNI__)
#define I8_VNNI 1
#define W4_VNNI 1 /* w4 on vpdpbusd, its weights in blocks of 16 outputs (pack_w4) */
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#endif
#if defined(I8_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define HAVE_AMX 1 /* i8 and w4 on AMX tiles where Linux lets this process use them (amx_ready) */
#endif
#endif
#if defined(HAVE_AVX512) || defined(HAVE_AVX2)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

enum { FEATURE_W4 = 1, FEATURE_I8 = 2, FEATURE_DECODER = 4, FEATURE_W4_BLOCKED = 16, FEATURE_F32 = 32,
       FEATURE_STEP = 64 };
#define ROW_BLOCK 8 /* rows per pass over the weights */
#define LANES 16   /* fp32 sums in portable C: 16 lanes, as one AVX512 register */

/* Every kernel exists on every CPU (portable C where no SIMD code is written for it); FEATURE_W4_BLOCKED says that
 * w4 takes its weights in blocks of 16 outputs (pack_w4). */
static int amx_ready(void);
int memspec_kernel_features(void) {
  int features = FEATURE_W4 | FEATURE_I8 | FEATURE_DECODER | FEATURE_F32 | FEATURE_STEP;
#ifdef W4_VNNI
  features |= FEATURE_W4_BLOCKED;
#endif
  return features;
}

/* Which instruction set each kernel was compiled for, for the diagnostics. */
#if defined(W4_VNNI)
#define W4_ISA "AVX512-VNNI"
#elif defined(HAVE_AVX2)
#define W4_ISA "AVX2"
#else
#define W4_ISA "portable C"
#endif
#if defined(I8_VNNI)
#define I8_ISA "AVX512-VNNI"
#elif defined(HAVE_AVX2)
#define I8_ISA "AVX2"
#else
#define I8_ISA "portable C"
#endif
#if defined(HAVE_AVX512)
#define ATTEND_ISA "AVX512"
#elif defined(HAVE_AVX2)
#define ATTEND_ISA "AVX2"
#else
#define ATTEND_ISA "portable C"
#endif
const char* memspec_kernel_isa(void) {
  if (amx_ready())
    return "w4 AMX-INT8 (" W4_ISA " up to 5 rows), i8 AMX-INT8 (" I8_ISA " for the last outputs), attention " ATTEND_ISA;
  return "w4 " W4_ISA ", i8 " I8_ISA ", attention " ATTEND_ISA;
}

static inline float bf16_to_float(uint32_t half) { /* half in the low 16 bits */
  const uint32_t u = half << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* fmaxf(top, fabsf(v)) (a NaN is passed over), written out: fmaxf stayed a library call at -O3 (3% of a forward) */
#define MAX_ABS(top, v) (fabsf(v) > (top) ? fabsf(v) : (top))

/* ---------------------------------------------------------------- threads */
typedef void (*RangeFn)(void* ctx, int begin, int end);

/* Part `part` of `parts` of [0, total), in chunks that are multiples of `align` (the kernels' output blocks). */
static void run_part(RangeFn fn, void* ctx, int total, int parts, int align, int part) {
  const int blocks = (total + align - 1) / align;
  const int per = (blocks + parts - 1) / parts;
  int begin = part * per * align, end = begin + per * align;
  if (end > total) end = total;
  if (begin < end) fn(ctx, begin, end);
}

/* fn over [0, total) split among `threads` OpenMP threads. Compiled with -fopenmp, this file's OpenMP calls
 * resolve to the libgomp torch has already loaded (same soname), so the kernels and torch's operations share
 * one pool of threads: two pools on the same cores would spin against each other between calls. */
static void parallel_for(RangeFn fn, void* ctx, int total, int threads, int align) {
#ifdef _OPENMP
  if (threads > 1 && total > align) {
#pragma omp parallel num_threads(threads)
    run_part(fn, ctx, total, omp_get_num_threads(), align, omp_get_thread_num());
    return;
  }
#endif
  (void)threads, (void)align;
  fn(ctx, 0, total);
}

/* ---------------------------------------------------------------- w4: 4-bit weights */
/* Each row's blocks of 32 as int8, with scale d = max|x| / 127 (0 for an all-zero block) and d * (sum of the
 * block's int8 values): a weight's minimum then adds min * d * sum for the whole block. */
static inline void quantize_blocks(const float* x, int8_t* xq, float* xd, float* xs, int M, int K) {
  const int groups = K / 32;
  for (int m = 0; m < M; m++)
    for (int g = 0; g < groups; g++) {
      const size_t at = (size_t)m * K + (size_t)g * 32;
      const float* restrict block = x + at;
      int8_t* restrict out = xq + at;
      float lane[16] = {0}, top = 0.0f; /* 16 independent running maxima, as in i8_matmul */
      for (int j = 0; j < 32; j += 16)
        for (int l = 0; l < 16; l++) lane[l] = MAX_ABS(lane[l], block[j + l]);
      for (int l = 0; l < 16; l++) top = MAX_ABS(top, lane[l]);
      float poison = 0.0f; /* x - x: 0 for a finite value, NaN for NaN and inf (MAX_ABS passes NaN over) */
      for (int j = 0; j < 32; j++) poison += block[j] - block[j];
      if (poison != 0.0f) { /* a non-finite input makes its row's outputs NaN, as ATen's arithmetic does */
        memset(out, 0, 32);
        xd[(size_t)m * groups + g] = NAN;
        xs[(size_t)m * groups + g] = NAN;
        continue;
      }
      const float d = top / 127.0f;
      int sum = 0;
      /* a subnormal step rounds down so far that x / d passes 127 and wraps in int8 (a block of |x| < 1.5e-36):
         such a block is zero, as one of zeros is */
      if (d >= 1.17549435e-38f)
        for (int j = 0; j < 32; j++) {
          const int q = (int)nearbyintf(block[j] / d);
          out[j] = (int8_t)q;
          sum += q;
        }
      else
        memset(out, 0, 32);
      xd[(size_t)m * groups + g] = d;
      xs[(size_t)m * groups + g] = d * (float)sum;
    }
}

/* Weights: per output row, groups of 32 as 16 bytes (byte j: weight j in the low nibble, j+16 in the high)
 * and one uint32 holding the group's bf16 scale (low half) and minimum (high half); weight = q*scale + min. */
typedef struct {
  const uint8_t* qw;
  const uint32_t* sm;
  const int8_t* xq; /* the rows as int8 blocks of 32, */
  const float* xd;    /* each block's scale */
  const float* xs;    /* and scale * (sum of its int8 values) */
  float* y;
  int M, K, O;
} W4Call;

#if defined(HAVE_AVX2)
static inline float hsum8(__m256 v) { /* a fixed order of additions, so the same lanes always give the same sum */
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#if !defined(W4_VNNI) /* int8 blocks: each block's dot product with the 4-bit levels is an exact integer */

#if defined(HAVE_AVX2)
/* Rows per pass: every row of a verify in one pass over the weights (a 5-row int4 forward of the bundled target
 * measured 52.9 ms with 4 rows per pass, 35.3 ms with 8); accumulators beyond the 16 ymm registers spill to L1. */
#define ROW_BLOCK_Q 8

/* One group's 32 levels (0..15) as bytes, in the order of the rows' int8 blocks. */
static inline __m256i w4_levels(const uint8_t* q) {
  const __m128i bytes = _mm_loadu_si128((const __m128i*)q), nibble = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble), _mm_and_si128(bytes, nibble));
}

/* Outputs o..o+OB-1 for MR rows. Per row and output: an exact int32 per block (levels x int8 row, 8 lanes),
 * scaled by the group's scale times the block's d into 8 fp32 lanes; the minimums' part in one scalar. */
#define DEFINE_W4Q_BLOCK(NAME, MR, OB)                                                                       \
  static inline void NAME(const W4Call* c, const int8_t* restrict xq, const float* restrict xd,   \
                                     const float* restrict xs, float* restrict y, int o) {                   \
    const int K = c->K, groups = K / 32;                                                                     \
    const __m256i ones = _mm256_set1_epi16(1);                                                               \
    __m256 acc[OB][MR];                                                                                      \
    float mins[OB][MR];                                                                                      \
    for (int r = 0; r < OB; r++)                                                                             \
      for (int m = 0; m < MR; m++) acc[r][m] = _mm256_setzero_ps(), mins[r][m] = 0.0f;                       \
    for (int g = 0; g < groups; g++) {                                                                       \
      __m256i xv[MR];                                                                                        \
      for (int m = 0; m < MR; m++) xv[m] = _mm256_loadu_si256((const __m256i*)(xq + (size_t)m * K + g * 32)); \
      for (int r = 0; r < OB; r++) {                                                                         \
        const size_t at = (size_t)(o + r) * groups + g;                                                      \
        const __m256i w = w4_levels(c->qw + at * 16);                                                        \
        const float scale = bf16_to_float(c->sm[at] & 0xFFFFu), low = bf16_to_float(c->sm[at] >> 16);       \
        for (int m = 0; m < MR; m++) {                                                                       \
          const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv[m]), ones);                     \
          const size_t b = (size_t)m * groups + g;                                                           \
          acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(scale * xd[b]), acc[r][m]);   \
          mins[r][m] = fmaf(low, xs[b], mins[r][m]);                                                         \
        }                                                                                                    \
      }                                                                                                      \
    }                                                                                                        \
    for (int r = 0; r < OB; r++)                                                                             \
      for (int m = 0; m < MR; m++) y[(size_t)m * c->O + o + r] = hsum8(acc[r][m]) + mins[r][m];             \
  }
#define DEFINE_W4Q(MR, OB)                                                                                   \
  DEFINE_W4Q_BLOCK(w4q_##MR##_block, MR, OB)                                                                 \
  DEFINE_W4Q_BLOCK(w4q_##MR##_one, MR, 1)                                                                    \
  static void w4q_##MR(const W4Call* c, const int8_t* xq, const float* xd, const float* xs, float* y, int o_begin, \
                       int o_end) {                                                                          \
    int o = o_begin;                                                                                         \
    for (; o + OB <= o_end; o += OB) w4q_##MR##_block(c, xq, xd, xs, y, o);                                  \
    for (; o < o_end; o++) w4q_##MR##_one(c, xq, xd, xs, y, o); /* the same operations per output */        \
  }
#ifndef W4Q_OB_SMALL
#define W4Q_OB_SMALL 2 /* outputs per block for 1-2 rows */
#endif
#ifndef W4Q_OB_MID
#define W4Q_OB_MID 2 /* for 3-4 rows */
#endif
DEFINE_W4Q(1, W4Q_OB_SMALL) DEFINE_W4Q(2, W4Q_OB_SMALL) DEFINE_W4Q(3, W4Q_OB_MID) DEFINE_W4Q(4, W4Q_OB_MID)
DEFINE_W4Q(5, 1) DEFINE_W4Q(6, 1) DEFINE_W4Q(7, 1) DEFINE_W4Q(8, 1)

static void w4q_range(void* ctx, int o_begin, int o_end) {
  const W4Call* c = (const W4Call*)ctx;
  const int groups = c->K / 32;
  for (int m0 = 0; m0 < c->M; m0 += ROW_BLOCK_Q) {
    const int mr = c->M - m0 < ROW_BLOCK_Q ? c->M - m0 : ROW_BLOCK_Q;
    const int8_t* xq = c->xq + (size_t)m0 * c->K;
    const float *xd = c->xd + (size_t)m0 * groups, *xs = c->xs + (size_t)m0 * groups;
    float* y = c->y + (size_t)m0 * c->O;
    switch (mr) {
      case 1: w4q_1(c, xq, xd, xs, y, o_begin, o_end); break;
      case 2: w4q_2(c, xq, xd, xs, y, o_begin, o_end); break;
      case 3: w4q_3(c, xq, xd, xs, y, o_begin, o_end); break;
      case 4: w4q_4(c, xq, xd, xs, y, o_begin, o_end); break;
      case 5: w4q_5(c, xq, xd, xs, y, o_begin, o_end); break;
      case 6: w4q_6(c, xq, xd, xs, y, o_begin, o_end); break;
      case 7: w4q_7(c, xq, xd, xs, y, o_begin, o_end); break;
      default: w4q_8(c, xq, xd, xs, y, o_begin, o_end); break;
    }
  }
}

#else /* portable C: what the compiler makes of plain loops for this CPU */
static void w4q_range(void* ctx, int o_begin, int o_end) {
  const W4Call* c = (const W4Call*)ctx;
  const int K = c->K, groups = K / 32;
  for (int o = o_begin; o < o_end; o++)
    for (int m = 0; m < c->M; m++) {
      float acc = 0.0f, mins = 0.0f;
      for (int g = 0; g < groups; g++) {
        const size_t at = (size_t)o * groups + g, b = (size_t)m * groups + g;
        const uint8_t* q = c->qw + at * 16;
        const int8_t* x = c->xq + (size_t)m * K + (size_t)g * 32;
        int sum = 0;
        for (int j = 0; j < 16; j++) sum += (q[j] & 15) * x[j] + (q[j] >> 4) * x[j + 16];
        acc = fmaf((float)sum, bf16_to_float(c->sm[at] & 0xFFFFu) * c->xd[b], acc);
        mins = fmaf(bf16_to_float(c->sm[at] >> 16), c->xs[b], mins);
      }
      c->y[(size_t)m * c->O + o] = acc + mins;
    }
}
#endif
#endif

#ifdef W4_VNNI
#define W4_BLOCK_OUT 16 /* outputs per block of the blocked layout (pack_w4) */
static void w4_blocked_range(void* ctx, int o_begin, int o_end);
#endif

/* y[M][O] = x[M][K] (fp32) times the 4-bit weights' transpose. K % 32 == 0. Returns 0, -1 when out of memory, or
 * KERNEL_BAD_SHAPE for shapes it cannot take. */
/* Shapes the loops below cannot take (they step whole groups and output blocks) return KERNEL_BAD_SHAPE before
 * anything is read: the Python side checks them too, but a caller that skips its checks wrote past a row's end. */
#define KERNEL_BAD_SHAPE -2

int w4_matmul(const uint8_t* qw, const uint32_t* sm, const float* x, float* y, int M, int K, int O, int threads) {
  if (M < 0 || K <= 0 || K % 32 || O < 0) return KERNEL_BAD_SHAPE;
#ifdef W4_VNNI
  if (O % W4_BLOCK_OUT) return KERNEL_BAD_SHAPE;
#endif
  const size_t blocks = (size_t)M * (K / 32);
  int8_t* xq = malloc((size_t)M * K);
  float* scales = malloc(2 * blocks * sizeof(float));
  if (!xq || !scales) {
    free(xq), free(scales);
    return -1;
  }
  quantize_blocks(x, xq, scales, scales + blocks, M, K);
  W4Call call = {qw, sm, xq, scales, scales + blocks, y, M, K, O};
#ifdef W4_VNNI
  parallel_for(w4_blocked_range, &call, O, threads, W4_BLOCK_OUT);
#else
  parallel_for(w4q_range, &call, O, threads, 4);
#endif
  free(xq), free(scales);
  return 0;
}

/* ---------------------------------------------------------------- i8: int8 weights and rows */
/* Rows go in as unsigned bytes shifted by +128 (vpdpbusd multiplies unsigned by signed bytes), and each
 * output's 128 * sum(weights) (bias128) is taken off again. All sums are exact int32, so every instruction set
 * gives the same numbers; each is then scaled as Int8Linear scales it: ((float)sum * row_scale) * scale, two
 * roundings in torch's order. */
#define I8_OUT(m, o, sum) y[(size_t)(m) * O + (o)] = ((float)((sum) - b128[o]) * row_scale[m]) * scale[o]

typedef struct {
  const uint8_t* xu;
  const int8_t* xt; /* AMX: the rows as signed bytes, laid out as B tiles (amx_rows) */
  const int8_t* w;
  const int32_t* b128;
  const float* row_scale;
  const float* scale;
  float* y;
  int M, K, O;
} I8Call;

#if defined(I8_VNNI) || defined(HAVE_AVX2)
#if defined(I8_VNNI)
#define I8_STEP 64
#define I8_VEC __m512i
#define I8_ZERO() _mm512_setzero_si512()
#define I8_W(p) _mm512_loadu_si512(p)
#define I8_X(p) _mm512_loadu_si512(p)
#define I8_DOT(acc, x, w) _mm512_dpbusd_epi32(acc, x, w)
#define I8_SUM(v) _mm512_reduce_add_epi32(v)
#else /* AVX2: rows as signed bytes (xu ^ 0x80 = xu - 128), and |w| x (row with w's sign) by vpmaddubsw: each pair of
       * products is at most 2 * 128 * 127 = 32512, so the int16 pair sums never saturate and the sums stay exact */
static inline int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
static inline __m256i i8_dot(__m256i acc, __m256i x, __m256i w) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#define I8_STEP 32
#define I8_VEC __m256i
#define I8_ZERO() _mm256_setzero_si256()
#define I8_W(p) _mm256_loadu_si256((const __m256i*)(p))
#define I8_X(p) _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(p)), _mm256_set1_epi8((char)0x80))
#define I8_DOT(acc, x, w) i8_dot(acc, x, w)
#define I8_SUM(v) hsum_epi32(v)
#define I8_SIGNED_ROWS /* the sums are of the signed rows already: no bias128 to take off */
#endif
#ifdef I8_SIGNED_ROWS
#define I8_RESULT(m, o, sum) I8_OUT(m, o, (sum) + b128[o])
#else
#define I8_RESULT(m, o, sum) I8_OUT(m, o, sum)
#endif
#define DEFINE_I8(MR, OB)                                                                                  \
  static void i8_##MR(const uint8_t* restrict xu, const int8_t* restrict w, const int32_t* restrict b128, \
                      const float* restrict row_scale, const float* restrict scale, float* restrict y,     \
                      int K, int O, int o_begin, int o_end) {                                              \
    int o = o_begin;                                                                                       \
    for (; o + OB <= o_end; o += OB) {                                                                     \
      I8_VEC acc[OB][MR];                                                                                  \
      for (int r = 0; r < OB; r++)                                                                         \
        for (int m = 0; m < MR; m++) acc[r][m] = I8_ZERO();                                                \
      for (int k = 0; k < K; k += I8_STEP) {                                                               \
        I8_VEC wv[OB];                                                                                     \
        for (int r = 0; r < OB; r++) wv[r] = I8_W(w + (size_t)(o + r) * K + k);                            \
        for (int m = 0; m < MR; m++) {                                                                     \
          const I8_VEC xv = I8_X(xu + (size_t)m * K + k);                                                  \
          for (int r = 0; r < OB; r++) acc[r][m] = I8_DOT(acc[r][m], xv, wv[r]);                           \
        }                                                                                                  \
      }                                                                                                    \
      for (int r = 0; r < OB; r++)                                                                         \
        for (int m = 0; m < MR; m++) I8_RESULT(m, o + r, I8_SUM(acc[r][m]));                               \
    }                                                                                                      \
    for (; o < o_end; o++) {                                                                               \
      I8_VEC acc[MR];                                                                                      \
      for (int m = 0; m < MR; m++) acc[m] = I8_ZERO();                                                     \
      for (int k = 0; k < K; k += I8_STEP) {                                                               \
        const I8_VEC wv = I8_W(w + (size_t)o * K + k);                                                     \
        for (int m = 0; m < MR; m++) acc[m] = I8_DOT(acc[m], I8_X(xu + (size_t)m * K + k), wv);            \
      }                                                                                                    \
      for (int m = 0; m < MR; m++) I8_RESULT(m, o, I8_SUM(acc[m]));                                        \
    }                                                                                                      \
  }
#if defined(I8_VNNI)
DEFINE_I8(1, 4) DEFINE_I8(2, 4) DEFINE_I8(3, 4) DEFINE_I8(4, 4)
DEFINE_I8(5, 2) DEFINE_I8(6, 2) DEFINE_I8(7, 2) DEFINE_I8(8, 2)
#else /* 16 ymm registers */
#ifndef I8_OB_SMALL
#define I8_OB_SMALL 1 /* outputs per block for 1-2 rows */
#endif
DEFINE_I8(1, I8_OB_SMALL) DEFINE_I8(2, I8_OB_SMALL) DEFINE_I8(3, 1) DEFINE_I8(4, 1)
DEFINE_I8(5, 1) DEFINE_I8(6, 1) DEFINE_I8(7, 1) DEFINE_I8(8, 1)
#endif

static void i8_range(void* ctx, int o_begin, int o_end) {
  const I8Call* c = (const I8Call*)ctx;
  for (int m0 = 0; m0 < c->M; m0 += ROW_BLOCK) {
    const int mr = c->M - m0 < ROW_BLOCK ? c->M - m0 : ROW_BLOCK;
    const uint8_t* xs = c->xu + (size_t)m0 * c->K;
    const float* rs = c->row_scale + m0;
    float* ys = c->y + (size_t)m0 * c->O;
    switch (mr) {
      case 1: i8_1(xs, c->w, c->b128, rs, c->scale, ys, c->K, c->O, o_begin, o_end); break;
      case 2: i8_2(xs, c->w, c->b128, rs, c->scale, ys, c->K, c->O, o_begin, o_end); break;
      case 3: i8_3(xs, c->w, c->b128, rs, c->scale, ys, c->K, c->O, o_begin, o_end); break;
      case 4: i8_4(xs, c->w, c->b128, rs, c->scale, ys, c->K, c->O, o_begin, o_end); break;
      case 5: i8_5(xs, c->w, c->b128, rs, c->scale, ys, c->K, c->O, o_begin, o_end); break;
      case 6: i8_6(xs, c->w, c->b128, rs, c->scale, ys, c->K, c->O, o_begin, o_end); break;
      case 7: i8_7(xs, c->w, c->b128, rs, c->scale, ys, c->K, c->O, o_begin, o_end); break;
      default: i8_8(xs, c->w, c->b128, rs, c->scale, ys, c->K, c->O, o_begin, o_end); break;
    }
  }
}

#else /* portable C */
static void i8_range(void* ctx, int o_begin, int o_end) {
  const I8Call* c = (const I8Call*)ctx;
  const int K = c->K, O = c->O;
  const int32_t* b128 = c->b128;
  const float *row_scale = c->row_scale, *scale = c->scale;
  float* y = c->y;
  for (int o = o_begin; o < o_end; o++)
    for (int m = 0; m < c->M; m++) {
      const uint8_t* x = c->xu + (size_t)m * K;
      const int8_t* w = c->w + (size_t)o * K;
      int32_t sum = 0;
      for (int k = 0; k < K; k++) sum += (int32_t)x[k] * (int32_t)w[k];
      I8_OUT(m, o, sum);
    }
}
#endif

#ifdef W4_VNNI
/* ---------------------------------------------------------------- w4's blocked layout, shared by its two paths */
/* One group of a block of 16 outputs (pack_w4's blocked layout): its 256 bytes as the 8 lines of 64 level bytes
 * (low nibbles, then high) that vpdpbusd and AMX's B tile both take. */
static inline void w4_lines(const uint8_t* packed, __m512i line[8]) {
  const __m512i nibble = _mm512_set1_epi8(15);
  for (int j = 0; j < 4; j++) {
    const __m512i v = _mm512_loadu_si512(packed + 64 * j);
    line[j] = _mm512_and_si512(v, nibble);
    line[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
  }
}

/* A group's exact int32 dots with one row, scaled onto that row's 16 accumulators: acc += low * (d * sum), then
 * acc += dot * (scale * d). Both w4 paths (vpdpbusd, AMX tiles) scale through this, so a row's numbers do not
 * depend on which path its call took. */
static inline __m512 w4_scale_group(__m512 acc, __m512i dots, __m512i scale_min, float d, float d_sum) {
  const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(scale_min, 16));
  const __m512 low = _mm512_castsi512_ps(_mm512_and_si512(scale_min, _mm512_set1_epi32((int)0xFFFF0000u)));
  acc = _mm512_fmadd_ps(low, _mm512_set1_ps(d_sum), acc);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(scale, _mm512_set1_ps(d)), acc);
}
#endif

/* ---------------------------------------------------------------- i8 on AMX tiles */
#ifdef HAVE_AMX
/* AMX multiplies 16 x 64 signed bytes by 64 x 16 in one instruction (tdpbssd) with exact int32 sums, so it gives
 * the same integers as the code above. Why: the VNNI kernel spends one instruction per 64 weights per row, so a
 * 5-row verify costs several one-token steps in the int8 layers; a tile's product costs about the same for 1 row
 * as for 16. Here the weights are the A tiles (16 outputs x 64 inputs, read in place, stride K) and the rows the
 * B tiles (C = W x^T: 16 outputs x M rows), so the weights need no repacking. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_OUT 16      /* outputs per tile */
#define AMX_K 64        /* inputs per tile */
#define AMX_ROWS 16     /* rows per pass (a tile's 16 columns of int32) */

/* Linux hands AMX's tile state to a process only on request (arch_prctl); asked once. 1: usable, -1: not. */
static int amx_ready(void) {
  static int state = 0;
  int now = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
  if (now == 0) {
    const char* off = getenv("MEMSPEC_AMX"); /* 0: the VNNI/AVX2 code (A/B runs) */
    now = (off && off[0] == '0') ? -1 : (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1);
    __atomic_store_n(&state, now, __ATOMIC_RELEASE);
  }
  return now == 1;
}

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} TileConfig;

/* Tiles 0..count-1 with these lines and bytes per line (palette 1), for this thread. */
static void amx_configure(int count, const uint8_t* rows, const uint16_t* colsb) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  memcpy(cfg.rows, rows, (size_t)count);
  memcpy(cfg.colsb, colsb, (size_t)count * sizeof *colsb);
  _tile_loadconfig(&cfg);
}

/* The rows as B tiles, packed: pass p's mr rows take bytes p*16*K.. (each pass starts at its first row times K),
 * input block k is 16 lines of mr*4 bytes, line r holding row m's inputs 64k+4r..+3 at bytes 4m..4m+3, as
 * signed bytes (xu - 128: the quantized values themselves). */
static void amx_rows(const uint8_t* xu, int8_t* xt, int M, int K) {
  for (int m0 = 0; m0 < M; m0 += AMX_ROWS) {
    const int mr = M - m0 < AMX_ROWS ? M - m0 : AMX_ROWS;
    int8_t* pass = xt + (size_t)m0 * K;
    for (int m = 0; m < mr; m++) {
      const uint8_t* row = xu + (size_t)(m0 + m) * K;
      for (int k = 0; k < K; k += 4) { /* 4 bytes at a time: k = 64 * block + 4 * line */
        uint32_t four;
        memcpy(&four, row + k, 4);
        four ^= 0x80808080u;
        memcpy(pass + (size_t)(k / 64) * 16 * mr * 4 + (size_t)((k % 64) / 4) * mr * 4 + m * 4, &four, 4);
      }
    }
  }
}

/* Outputs o..o+15 for the pass's rows: the int32 sums over all inputs, then I8_OUT's scaling, 16 outputs at a time
 * (a row's sums are a column of the C tile). Even and odd input blocks go to two accumulators (tmm0, tmm1; exact
 * integers, so their sum is the same whatever the split) with their own A and B tiles, so one block's loads
 * overlap the other's product. The next 16 outputs' weights (16 * K contiguous bytes) are fetched into the cache
 * meanwhile, a slice per block: the tile loads read 16 lines K bytes apart, which the hardware prefetcher does not
 * follow. */
#define AMX_STEP(C, A, B, k)                                                   \
  _tile_loadd(A, w + (k) * AMX_K, K);                                          \
  _tile_loadd(B, xt + (size_t)(k) * AMX_OUT * mr * 4, mr * 4);                 \
  _tile_dpbssd(C, A, B)
static inline void amx_block(const I8Call* c, const int8_t* xt, int m0, int mr, int o, int prefetch) {
  const int K = c->K, blocks = K / AMX_K;
  const int8_t* w = c->w + (size_t)o * K;
  const int lines = AMX_OUT * K / 64, per_block = (lines + blocks - 1) / blocks;
  int32_t sums[2][AMX_OUT][AMX_ROWS];
  _tile_zero(0);
  _tile_zero(1);
  for (int k = 0; k < blocks; k++) {
    if (prefetch)
      for (int l = k * per_block; l < (k + 1) * per_block && l < lines; l++)
        _mm_prefetch((const char*)(w + (size_t)AMX_OUT * K + (size_t)l * 64), _MM_HINT_T0);
    if (k % 2 == 0) {
      AMX_STEP(0, 2, 4, k);
    } else {
      AMX_STEP(1, 3, 5, k);
    }
  }
  _tile_stored(0, sums[0], AMX_ROWS * 4);
  _tile_stored(1, sums[1], AMX_ROWS * 4);
  const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  const __m512 scale = _mm512_loadu_ps(c->scale + o);
  for (int m = 0; m < mr; m++) { /* ((float)sum * row_scale) * scale, I8_OUT's two roundings */
    const __m512i even = _mm512_i32gather_epi32(column, &sums[0][0][m], 4);
    const __m512i odd = _mm512_i32gather_epi32(column, &sums[1][0][m], 4);
    const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
    const __m512 out = _mm512_mul_ps(_mm512_mul_ps(sum, _mm512_set1_ps(c->row_scale[m0 + m])), scale);
    _mm512_storeu_ps(c->y + (size_t)(m0 + m) * c->O + o, out);
  }
}

static void i8_amx_range(void* ctx, int o_begin, int o_end) {
  const I8Call* c = (const I8Call*)ctx;
  const int full = o_begin + (o_end - o_begin) / AMX_OUT * AMX_OUT; /* the rest: the vector code above */
  for (int m0 = 0; m0 < c->M; m0 += AMX_ROWS) {
    const int mr = c->M - m0 < AMX_ROWS ? c->M - m0 : AMX_ROWS;
    const uint16_t b = (uint16_t)(mr * 4); /* tmm0-1: C (16 outputs x the rows' int32), tmm2-3: A (weights), tmm4-5: B */
    amx_configure(6, (const uint8_t[]){AMX_OUT, AMX_OUT, AMX_OUT, AMX_OUT, AMX_OUT, AMX_OUT},
                  (const uint16_t[]){b, b, AMX_K, AMX_K, b, b});
    for (int o = o_begin; o < full; o += AMX_OUT)
      amx_block(c, c->xt + (size_t)m0 * c->K, m0, mr, o, o + AMX_OUT < full);
  }
  _tile_release();
  if (full < o_end) i8_range(ctx, full, o_end);
}

/* w4 on AMX tiles, for calls of more than W4_VNNI_ROWS rows (below: the layout and why). The rows are int8 blocks
 * of 32 (quantize_blocks, as on AVX2), and each group's integer dot products for 16 outputs and up to 16 rows are
 * one tdpbsud (signed rows x unsigned levels, exact int32), then scaled in fp32 per row:
 * acc += low * (d * sum) and acc += dot * (scale * d), the same operations for a row whatever rows share its call.
 * Layout (pack_w4's blocked layout): per 16 outputs and group, 256 bytes that unpack (low nibbles, then high)
 * into the 8 x 64-byte B tile, line r holding output n's levels 4r..4r+3 at bytes 4n..4n+3; scale_min per 16
 * outputs and group, 16 int32. Four blocks of 16 outputs go through each group together, in four C tiles, so
 * their tile work overlaps; their next groups are fetched ahead (four streams the hardware prefetcher did not
 * keep up with: a one-token int4 forward of the bundled target on tiles alone took 12.2 ms without, 9.5 with,
 * other work running). */
/* Block i's levels for group g into its B tile and its dot products into C tile i (the tile numbers must be
 * constants). Four blocks' products are independent, so their tile work overlaps. */
#define W4_AMX_BLOCK(i, B)                                                     \
  if (i < blocks) {                                                            \
    _tile_loadd(B, levels[i], 64);                                             \
    _tile_zero(i);                                                             \
    _tile_dpbsud(i, 4, B);                                                     \
    _tile_stored(i, dots[i], 64);                                              \
  }

#define W4_AMX_BLOCKS 4 /* output blocks of 16 per pass over the rows' groups */
#define W4_AMX_AHEAD 2  /* groups fetched ahead */

static void w4_amx_range(void* ctx, int o_begin, int o_end) {
  const W4Call* c = (const W4Call*)ctx;
  const int K = c->K, O = c->O, groups = K / 32;
  _Alignas(64) uint8_t levels[W4_AMX_BLOCKS][512];
  _Alignas(64) int32_t dots[W4_AMX_BLOCKS][AMX_ROWS][16];
  _Alignas(64) float acc[W4_AMX_BLOCKS][AMX_ROWS][16];
  for (int m0 = 0; m0 < c->M; m0 += AMX_ROWS) {
    const int mr = c->M - m0 < AMX_ROWS ? c->M - m0 : AMX_ROWS;
    const float* xd = c->xd + (size_t)m0 * groups;
    const float* xs = c->xs + (size_t)m0 * groups;
    const uint8_t r = (uint8_t)mr; /* tmm0-3: C (rows x 16 int32), tmm4: A (rows x 32 int8), tmm5-7: B (levels) */
    amx_configure(8, (const uint8_t[]){r, r, r, r, r, 8, 8, 8}, (const uint16_t[]){64, 64, 64, 64, 32, 64, 64, 64});
    for (int o = o_begin; o < o_end; o += W4_AMX_BLOCKS * W4_BLOCK_OUT) {
      const int left = (o_end - o) / W4_BLOCK_OUT, blocks = left < W4_AMX_BLOCKS ? left : W4_AMX_BLOCKS;
      const size_t first = (size_t)(o / W4_BLOCK_OUT) * groups;
      memset(acc, 0, sizeof acc);
      for (int g = 0; g < groups; g++) {
        for (int i = 0; i < blocks && g + W4_AMX_AHEAD < groups; i++) { /* each block is its own stream */
          const size_t ahead = first + (size_t)i * groups + g + W4_AMX_AHEAD;
          for (int j = 0; j < 4; j++) _mm_prefetch((const char*)(c->qw + ahead * 256 + 64 * j), _MM_HINT_T0);
          _mm_prefetch((const char*)(c->sm + ahead * 16), _MM_HINT_T0);
        }
        for (int i = 0; i < blocks; i++) {
          __m512i line[8];
          w4_lines(c->qw + (first + (size_t)i * groups + g) * 256, line);
          for (int j = 0; j < 8; j++) _mm512_store_si512(levels[i] + 64 * j, line[j]);
        }
        _tile_loadd(4, c->xq + (size_t)m0 * K + (size_t)g * 32, K);
        W4_AMX_BLOCK(0, 5)
        W4_AMX_BLOCK(1, 6)
        W4_AMX_BLOCK(2, 7)
        W4_AMX_BLOCK(3, 5)
        for (int i = 0; i < blocks; i++) {
          const __m512i pair = _mm512_loadu_si512(c->sm + (first + (size_t)i * groups + g) * 16);
          for (int m = 0; m < mr; m++) {
            const size_t b = (size_t)m * groups + g;
            _mm512_store_ps(acc[i][m], w4_scale_group(_mm512_load_ps(acc[i][m]), _mm512_load_si512(dots[i][m]),
                                                      pair, xd[b], xs[b]));
          }
        }
      }
      for (int i = 0; i < blocks; i++)
        for (int m = 0; m < mr; m++)
          _mm512_storeu_ps(c->y + (size_t)(m0 + m) * O + o + i * W4_BLOCK_OUT, _mm512_load_ps(acc[i][m]));
    }
  }
  _tile_release();
}
#else
static int amx_ready(void) { return 0; }
#endif

#ifdef W4_VNNI
/* ---------------------------------------------------------------- w4 on vpdpbusd (AVX512-VNNI) */
/* The rows as int8 blocks of 32 (quantize_blocks, as on AVX2) and the weights in blocks of 16 outputs (pack_w4):
 * per group, 256 bytes whose low nibbles, then high, are 8 lines of 64 bytes, line r holding the 16 outputs' levels
 * 4r..4r+3 at bytes 4n..4n+3: vpdpbusd's layout (4 bytes per int32 lane) and AMX's B tile. So 8 vpdpbusd with the
 * row's bytes 4r..4r+3 broadcast give the 16 outputs' exact int32 dots, unpacked once per group for all rows, and
 * each dot is scaled in fp32: acc += low * (d * sum), acc += dot * (scale * d). The AMX tiles (w4_amx_range) give
 * the same integers and scale them with the same operations, so a row's numbers do not depend on which path its
 * call took. Why not bf16 rows (vdpbf16ps, what this CPU class ran before): making each group's 32 weights bf16
 * costs ~10 instructions per output, more than reading them; on an AMX Xeon the bundled int4 target's one-token
 * forward took 15.8 ms that way and 8.5 ms this way. With few rows these beat AMX's tiles, whose latency per group
 * (zero, product, store, reload) is not hidden: all int4 layers of the target took 5.0-5.5 ms at 1 row against 6.9
 * on tiles, 7.6 against 8.5 at 5 rows, the same at 8. */
#define W4_VNNI_ROWS 5 /* rows per pass here; with AMX, calls of more rows go to the tiles */
/* M is a constant wherever this is inlined (w4_vnni_rows), so the rows' accumulators stay in registers */
static inline __attribute__((always_inline)) void w4_vnni_body(const W4Call* c, int o_begin, int o_end, const int M) {
  const int K = c->K, O = c->O, groups = K / 32;
  for (int o = o_begin; o < o_end; o += W4_BLOCK_OUT) {
    const size_t block = (size_t)(o / W4_BLOCK_OUT) * groups;
    __m512 acc[W4_VNNI_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
      const uint8_t* packed = c->qw + (block + g) * 256;
      _mm_prefetch((const char*)(packed + 4 * 256), _MM_HINT_T0);
      _mm_prefetch((const char*)(packed + 4 * 256 + 64), _MM_HINT_T0);
      _mm_prefetch((const char*)(packed + 4 * 256 + 128), _MM_HINT_T0);
      _mm_prefetch((const char*)(packed + 4 * 256 + 192), _MM_HINT_T0);
      __m512i line[8];
      w4_lines(packed, line);
      const __m512i pair = _mm512_loadu_si512(c->sm + (block + g) * 16);
      for (int m = 0; m < M; m++) {
        /* four of the row's bytes at a time, read by memcpy: an int32_t pointer into the int8 buffer broke C's
         * aliasing rules, which let -O3 move these reads ahead of quantize_blocks' writes */
        const int8_t* xr = c->xq + (size_t)m * K + (size_t)g * 32;
        __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
        for (int r = 0; r < 8; r += 2) {
          int32_t four[2];
          memcpy(four, xr + 4 * r, sizeof four);
          even = _mm512_dpbusd_epi32(even, line[r], _mm512_set1_epi32(four[0]));
          odd = _mm512_dpbusd_epi32(odd, line[r + 1], _mm512_set1_epi32(four[1]));
        }
        const size_t b = (size_t)m * groups + g;
        acc[m] = w4_scale_group(acc[m], _mm512_add_epi32(even, odd), pair, c->xd[b], c->xs[b]);
      }
    }
    for (int m = 0; m < M; m++) _mm512_storeu_ps(c->y + (size_t)m * O + o, acc[m]);
  }
}

static void w4_vnni_rows(const W4Call* c, int o_begin, int o_end) {
  switch (c->M) {
    case 1: w4_vnni_body(c, o_begin, o_end, 1); break;
    case 2: w4_vnni_body(c, o_begin, o_end, 2); break;
    case 3: w4_vnni_body(c, o_begin, o_end, 3); break;
    case 4: w4_vnni_body(c, o_begin, o_end, 4); break;
    default: w4_vnni_body(c, o_begin, o_end, 5); break; /* W4_VNNI_ROWS */
  }
}

/* w4 in blocks of 16 outputs: few rows on vpdpbusd, more on AMX's tiles where granted, else vpdpbusd in passes. */
static void w4_blocked_range(void* ctx, int o_begin, int o_end) {
  const W4Call* c = (const W4Call*)ctx;
  if (c->M > W4_VNNI_ROWS && amx_ready()) {
#ifdef HAVE_AMX
    w4_amx_range(ctx, o_begin, o_end);
#endif
    return;
  }
  const int groups = c->K / 32;
  for (int m0 = 0; m0 < c->M; m0 += W4_VNNI_ROWS) {
    W4Call pass = *c;
    pass.M = c->M - m0 < W4_VNNI_ROWS ? c->M - m0 : W4_VNNI_ROWS;
    pass.xq += (size_t)m0 * c->K, pass.xd += (size_t)m0 * groups, pass.xs += (size_t)m0 * groups;
    pass.y += (size_t)m0 * c->O;
    w4_vnni_rows(&pass, o_begin, o_end);
  }
}
#endif

/* y[M][O] = (sum_k q(x)[m][k] * w[o][k]) * row_scale[m] * scale[o], where row_scale = max|x[m]| / 127
 * (at least 1e-12 / 127) and q(x) = round-half-even(x / row_scale): Int8Linear's arithmetic, operation
 * for operation. K % 64 == 0. xu: scratch of M*K bytes; row_scale: scratch of M floats. */
int i8_matmul(const float* x, const int8_t* w, const int32_t* b128, const float* scale, float* y, uint8_t* xu,
              float* row_scale, int M, int K, int O, int threads) {
  if (M < 0 || K <= 0 || K % 64 || O < 0) return KERNEL_BAD_SHAPE;
  for (int m = 0; m < M; m++) {
    const float* restrict row = x + (size_t)m * K;
    uint8_t* restrict out = xu + (size_t)m * K;
    /* 16 independent running maxima (K % 64 == 0): gcc keeps a float maximum scalar (NaN rules), so one chain of
     * maxima would wait on itself; the division loop below vectorizes once the scale is a local */
    float lane[16] = {0}, top = 0.0f;
    for (int k = 0; k < K; k += 16)
      for (int l = 0; l < 16; l++) lane[l] = MAX_ABS(lane[l], row[k + l]);
    for (int l = 0; l < 16; l++) top = MAX_ABS(top, lane[l]);
    float poison = 0.0f; /* as in quantize_blocks: NaN where the row holds a NaN or an inf */
    for (int k = 0; k < K; k++) poison += row[k] - row[k];
    if (poison != 0.0f) { /* the row's outputs NaN, as Int8Linear's scale of such a row makes them */
      memset(out, 128, (size_t)K);
      row_scale[m] = NAN;
      continue;
    }
    const float s = fmaxf(top, 1e-12f) / 127.0f;
    row_scale[m] = s;
    for (int k = 0; k < K; k++) out[k] = (uint8_t)((int)nearbyintf(row[k] / s) + 128);
  }
  I8Call call = {xu, NULL, w, b128, row_scale, scale, y, M, K, O};
#ifdef HAVE_AMX
  if (amx_ready() && O >= AMX_OUT) {
    int8_t* xt = malloc((size_t)M * K);
    if (!xt) return -1;
    amx_rows(xu, xt, M, K);
    call.xt = xt;
    parallel_for(i8_amx_range, &call, O, threads, AMX_OUT);
    free(xt);
    return 0;
  }
#endif
  parallel_for(i8_range, &call, O, threads, 4);
  return 0;
}

/* ---------------------------------------------------------------- f32: fp32 weights as loaded */
/* y[M][O] = x[M][K] . w[O][K] in fp32, K % 16 == 0. Each (row, output) sum is one fixed sequence whatever M is:
 * fused multiply-adds over K in order into 16 lanes (AVX512; 8 with AVX2; 16 scalar lanes in portable C), then
 * a fixed reduction, so a verify's rows equal one-token steps bit for bit. The weights are read once per
 * ROW_BLOCK rows: a BLAS sgemm packs the whole weight matrix again for a few rows (a 5-row call of the
 * bundled target's fp32 head cost 2.1x a 1-row one), while at a few rows this call, memory-bound, costs
 * about what one row costs. */
#define F32_PREFETCH 2048 /* bytes ahead in the weight stream (AVX512 path) */
typedef struct {
  const float* x;
  const float* w;
  float* y;
  int M, K, O;
} F32Call;

static inline __attribute__((always_inline)) void f32_body(const F32Call* c, int o_begin, int o_end, int m0,
                                                           const int M) {
  const int K = c->K;
  const float* x = c->x + (size_t)m0 * K;
  for (int o = o_begin; o < o_end; o++) {
    const float* restrict w = c->w + (size_t)o * K;
#if defined(HAVE_AVX512)
    __m512 acc[ROW_BLOCK];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) {
      /* the weight stream 2 KB ahead: with a few rows' multiply-adds per line the hardware prefetcher alone fell
       * behind (head, 5 rows: 14.8 ms without, 11.4 with, 12.0 for 1 row; 1 KB and 4 KB ahead did no better) */
      _mm_prefetch((const char*)(w + k) + F32_PREFETCH, _MM_HINT_T0);
      const __m512 wk = _mm512_loadu_ps(w + k);
      for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(wk, _mm512_loadu_ps(x + (size_t)m * K + k), acc[m]);
    }
    for (int m = 0; m < M; m++) c->y[(size_t)(m0 + m) * c->O + o] = _mm512_reduce_add_ps(acc[m]);
#elif defined(HAVE_AVX2)
    __m256 acc[ROW_BLOCK];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 8) {
      const __m256 wk = _mm256_loadu_ps(w + k);
      for (int m = 0; m < M; m++) acc[m] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + (size_t)m * K + k), acc[m]);
    }
    for (int m = 0; m < M; m++) c->y[(size_t)(m0 + m) * c->O + o] = hsum8(acc[m]);
#else
    for (int m = 0; m < M; m++) {
      const float* restrict row = x + (size_t)m * K;
      float lane[LANES] = {0};
      for (int k = 0; k < K; k += LANES)
        for (int l = 0; l < LANES; l++) lane[l] = fmaf(w[k + l], row[k + l], lane[l]);
      for (int width = LANES / 2; width >= 1; width /= 2)
        for (int l = 0; l < width; l++) lane[l] += lane[l + width];
      c->y[(size_t)(m0 + m) * c->O + o] = lane[0];
    }
#endif
  }
}

static void f32_range(void* ctx, int o_begin, int o_end) {
  const F32Call* c = (const F32Call*)ctx;
  for (int m0 = 0; m0 < c->M; m0 += ROW_BLOCK) {
    switch (c->M - m0 < ROW_BLOCK ? c->M - m0 : ROW_BLOCK) { /* a constant row count per body: all in registers */
      case 1: f32_body(c, o_begin, o_end, m0, 1); break;
      case 2: f32_body(c, o_begin, o_end, m0, 2); break;
      case 3: f32_body(c, o_begin, o_end, m0, 3); break;
      case 4: f32_body(c, o_begin, o_end, m0, 4); break;
      case 5: f32_body(c, o_begin, o_end, m0, 5); break;
      case 6: f32_body(c, o_begin, o_end, m0, 6); break;
      case 7: f32_body(c, o_begin, o_end, m0, 7); break;
      default: f32_body(c, o_begin, o_end, m0, ROW_BLOCK); break;
    }
  }
}

int f32_matmul(const float* x, const float* w, float* y, int M, int K, int O, int threads) {
  if (M < 0 || K % 16 || O < 0) return KERNEL_BAD_SHAPE;
  F32Call call = {x, w, y, M, K, O};
  parallel_for(f32_range, &call, O, threads, 16);
  return 0;
}

/* ---------------------------------------------------------------- a whole decoder in one call */

/* ---------------------------------------------------------------- e^x on vectors */
/* e^x in 16 (AVX512) or 8 (AVX2) lanes: Cephes' expf (x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial for
 * e^r, times 2^n), within a few ulp of libm's expf, inputs clamped below at -87.34 (e^x about 1e-38 there, not 0).
 * Why: glibc's expf stays scalar here (-O3 without -ffast-math keeps errno semantics), and SiLU's exp per
 * intermediate feature and the softmax's per position and head cost the 135 M target about 0.3 ms per row of a
 * forward, a tenth of a one-token step and a fifth of a 5-row verify. Lanes are independent, so a row's numbers do
 * not depend on the rows computed beside it. */
#define EXP_LOW -87.33654f
#define EXP_HIGH 88.3762626647949f /* above, 2^n would not fit the exponent: AVX2's result is +inf, as e^x's */
/* log2(e); ln 2 in two parts, so that x - n ln 2 is exact; Cephes' polynomial for e^r on |r| <= ln2 / 2 */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f
#if defined(HAVE_AVX512)
static inline __m512 exp16(__m512 x) {
  /* x second: max/min return their second operand where either is NaN, so a NaN stays NaN (as expf's) instead
     of becoming e^EXP_LOW, which would hide a NaN score in attention on these CPUs only */
  x = _mm512_min_ps(_mm512_set1_ps(EXP_HIGH), _mm512_max_ps(_mm512_set1_ps(EXP_LOW), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
  __m512 p = _mm512_set1_ps(EXP_P0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#elif defined(HAVE_AVX2)
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(EXP_HIGH), _mm256_max_ps(_mm256_set1_ps(EXP_LOW), x));  /* NaN stays NaN */
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
  __m256 p = _mm256_set1_ps(EXP_P0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

/* v[0..count) = e^(v - shift) in place; returns their sum (lanes first, then across lanes, the same order for the
 * same count, so a verify's row and a one-token step at the same position give the same sum). */
float exp_shifted_sum(float* v, int count, float shift) {
#if defined(HAVE_AVX512)
  __m512 total = _mm512_setzero_ps();
  const __m512 s = _mm512_set1_ps(shift);
  for (int t = 0; t < count; t += 16) {
    const __mmask16 m = count - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, v + t), s));
    _mm512_mask_storeu_ps(v + t, m, e);
    total = _mm512_mask_add_ps(total, m, total, e);
  }
  return _mm512_reduce_add_ps(total);
#elif defined(HAVE_AVX2)
  __m256 total = _mm256_setzero_ps();
  const __m256 s = _mm256_set1_ps(shift);
  for (int t = 0; t < count; t += 8) {
    const int k = count - t < 8 ? count - t : 8;
    float lane[8] = {0};
    memcpy(lane, v + t, (size_t)k * sizeof(float));
    _mm256_storeu_ps(lane, exp8(_mm256_sub_ps(_mm256_loadu_ps(lane), s)));
    for (int j = k; j < 8; j++) lane[j] = 0.0f; /* the padding adds nothing */
    memcpy(v + t, lane, (size_t)k * sizeof(float));
    total = _mm256_add_ps(total, _mm256_loadu_ps(lane));
  }
  return hsum8(total);
#else
  float total = 0.0f;
  for (int t = 0; t < count; t++) {
    v[t] = expf(v[t] - shift);
    total += v[t];
  }
  return total;
#endif
}

/* a[j] = silu(gate[j]) * up[j] = gate[j] / (1 + e^-gate[j]) * up[j] for j < count (count % 16 == 0) */
void silu_mul(const float* gate, const float* up, float* a, int count) {
#if defined(HAVE_AVX512)
  for (int j = 0; j < count; j += 16) {
    const __m512 g = _mm512_loadu_ps(gate + j);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    _mm512_storeu_ps(a + j, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)),
                                          _mm512_loadu_ps(up + j)));
  }
#elif defined(HAVE_AVX2)
  for (int j = 0; j < count; j += 8) {
    const __m256 g = _mm256_loadu_ps(gate + j);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(a + j, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                          _mm256_loadu_ps(up + j)));
  }
#else
  for (int j = 0; j < count; j++) a[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
#endif
}

/* ---------------------------------------------------------------- attention over a KV cache */
static inline float dot(const float* restrict a, const float* restrict b, int d) { /* d % 16 == 0 */
#if defined(HAVE_AVX512)
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
  for (int j = LANES; j < d; j += LANES) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), acc);
  return _mm512_reduce_add_ps(acc);
#elif defined(HAVE_AVX2)
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
  for (int j = 8; j < d; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
  return hsum8(acc);
#else
  float lane[LANES] = {0};
  for (int j = 0; j < d; j += LANES)
    for (int l = 0; l < LANES; l++) lane[l] = fmaf(a[j + l], b[j + l], lane[l]);
  for (int width = LANES / 2; width >= 1; width /= 2)
    for (int l = 0; l < width; l++) lane[l] += lane[l + width];
  return lane[0];
#endif
}

/* o[0..d) = inverse * sum over t < length of p[t] * v[t][0..d) (v's rows d apart, d % 64 == 0). The sums stay in
 * registers, 64 values at a time, over every position: accumulated in memory, each position's update waited on
 * the last one's store, and that made most of attention's time. Each value's sum is taken in position order, as
 * before. */
static void weigh_values(const float* p, const float* v, int length, int d, float inverse, float* o) {
#if defined(HAVE_AVX512)
  for (int j = 0; j < d; j += 64) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int t = 0; t < length; t++) {
      const __m512 w = _mm512_set1_ps(p[t]);
      const float* vt = v + (size_t)t * d + j;
      a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vt), a0);
      a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vt + 16), a1);
      a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vt + 32), a2);
      a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vt + 48), a3);
    }
    const __m512 s = _mm512_set1_ps(inverse);
    _mm512_storeu_ps(o + j, _mm512_mul_ps(a0, s));
    _mm512_storeu_ps(o + j + 16, _mm512_mul_ps(a1, s));
    _mm512_storeu_ps(o + j + 32, _mm512_mul_ps(a2, s));
    _mm512_storeu_ps(o + j + 48, _mm512_mul_ps(a3, s));
  }
#elif defined(HAVE_AVX2)
  for (int j = 0; j < d; j += 64) {
    __m256 a[8];
    for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
    for (int t = 0; t < length; t++) {
      const __m256 w = _mm256_set1_ps(p[t]);
      const float* vt = v + (size_t)t * d + j;
      for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8 * r), a[r]);
    }
    for (int r = 0; r < 8; r++) _mm256_storeu_ps(o + j + 8 * r, _mm256_mul_ps(a[r], _mm256_set1_ps(inverse)));
  }
#else
  for (int j = 0; j < d; j++) o[j] = 0.0f;
  for (int t = 0; t < length; t++) {
    const float* vt = v + (size_t)t * d;
    for (int j = 0; j < d; j++) o[j] += p[t] * vt[j];
  }
  for (int j = 0; j < d; j++) o[j] *= inverse;
#endif
}

typedef struct {
  const float* q;
  const float* keys;
  const float* values;
  float* out;
  float* scores; /* [heads][start + n] */
  int n, heads, kv_heads, d, start, capacity;
  float scale;
} AttendCall;

/* out[i][h][:] = softmax(scale * q[h][i] . K[kv(h)][0..start+i]) V[kv(h)][0..start+i] for i < n, heads in
 * [h_begin, h_end). q: [heads][n][d] contiguous; keys/values: [kv_heads][capacity][d] buffers (row stride d);
 * out: [n][heads][d]. d % 16 == 0. */
static void attend_range(void* ctx, int h_begin, int h_end) {
  const AttendCall* c = (const AttendCall*)ctx;
  const int d = c->d, group = c->heads / c->kv_heads;
  for (int h = h_begin; h < h_end; h++) {
    float* scores = c->scores + (size_t)h * (c->start + c->n);
    const float* k = c->keys + (size_t)(h / group) * c->capacity * d;
    const float* v = c->values + (size_t)(h / group) * c->capacity * d;
    for (int i = 0; i < c->n; i++) {
      const int length = c->start + i + 1;
      const float* qi = c->q + ((size_t)h * c->n + i) * d;
      float top = -INFINITY;
      for (int t = 0; t < length; t++) {
        scores[t] = dot(qi, k + (size_t)t * d, d) * c->scale;
        top = fmaxf(top, scores[t]);
      }
      const float total = exp_shifted_sum(scores, length, top);
      float* o = c->out + ((size_t)i * c->heads + h) * d;
      weigh_values(scores, v, length, d, 1.0f / total, o);
    }
  }
}

/* One linear layer in a kernel's format: kind 4 = w4 (a: packed, b: scale_min), 8 = i8 (a: weights,
 * b: bias128, scale: per output), 32 = f32 (a: fp32 weights [out][in]). No bias (Llama has none). */
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
  uint8_t* xu;      /* the rows quantized (i8) */
  float* row_scale; /* their scales (i8) */
  int threads;
} Scratch;

static int linear(const Linear* L, const float* x, float* y, int n, Scratch* s) {
  if (L->kind == 32) return f32_matmul(x, (const float*)L->a, y, n, L->in_features, L->out_features, s->threads);
  if (L->kind == 4)
    return w4_matmul((const uint8_t*)L->a, (const uint32_t*)L->b, x, y, n, L->in_features, L->out_features,
                     s->threads);
  return i8_matmul(x, (const int8_t*)L->a, (const int32_t*)L->b, L->scale, y, s->xu, s->row_scale, n,
                   L->in_features, L->out_features, s->threads);
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
 * embedding). dim, head_dim and intermediate are multiples of 64. Returns 0, -1 when out of memory, or
 * KERNEL_BAD_SHAPE (a linear's shapes). */
int decoder_forward(const Layer* layers, int n_layers, float* x, int n, int start, const float* cos,
                    const float* sin, int dim, int heads, int kv_heads, int head_dim, int intermediate,
                    float eps, int threads) {
  const int q_width = heads * head_dim, kv_width = kv_heads * head_dim, qkv_width = q_width + 2 * kv_width;
  const int widest = 2 * intermediate > qkv_width ? 2 * intermediate : qkv_width;
  const size_t rows = (size_t)n;
  /* the KV rows written below must fit every layer's buffer: refused here too, not only by the Python caller */
  if (n < 0 || start < 0) return KERNEL_BAD_SHAPE;
  for (int l = 0; l < n_layers; l++)
    if ((size_t)start + rows > (size_t)layers[l].capacity) return KERNEL_BAD_SHAPE;
  float* h = malloc(rows * dim * sizeof(float));
  float* wide = malloc(rows * widest * sizeof(float));
  float* q = malloc(rows * q_width * sizeof(float));
  float* attn = malloc(rows * q_width * sizeof(float));
  float* act = malloc(rows * intermediate * sizeof(float));
  float* scores = malloc((size_t)heads * ((size_t)start + n) * sizeof(float));
  /* the int8 linears quantize their input rows here: dim (qkv, gate_up), q_width (o), intermediate (down) */
  int widest_in = intermediate > dim ? intermediate : dim;
  if (q_width > widest_in) widest_in = q_width;
  Scratch s = {malloc(rows * widest_in), malloc(rows * sizeof(float)), threads};
  int status = 0;
  if (!h || !wide || !q || !attn || !act || !scores || !s.xu || !s.row_scale) {
    status = -1;
    goto done;
  }
  for (int l = 0; l < n_layers; l++) {
    const Layer* L = layers + l;
    rms_norm(x, L->attn_norm, h, n, dim, eps);
    if ((status = linear(&L->qkv, h, wide, n, &s))) goto done;
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
    AttendCall call = {q, L->keys, L->values, attn, scores, n, heads, kv_heads, head_dim, start, L->capacity,
                       1.0f / sqrtf((float)head_dim)};
    parallel_for(attend_range, &call, heads, threads, 1);
    if ((status = linear(&L->o, attn, h, n, &s))) goto done;
    for (size_t j = 0; j < rows * dim; j++) x[j] += h[j];
    rms_norm(x, L->mlp_norm, h, n, dim, eps);
    if ((status = linear(&L->gate_up, h, wide, n, &s))) goto done;
    for (int i = 0; i < n; i++) {
      const float* gate = wide + (size_t)i * 2 * intermediate;
      const float* up = gate + intermediate;
      silu_mul(gate, up, act + (size_t)i * intermediate, intermediate);
    }
    if ((status = linear(&L->down, act, h, n, &s))) goto done;
    for (size_t j = 0; j < rows * dim; j++) x[j] += h[j];
  }
done:
  free(h); free(wide); free(q); free(attn); free(act); free(scores);
  free(s.xu); free(s.row_scale);
  return status;
}

/* ---------------------------------------------------------------- a whole forward: ids in, logits out */
static inline float half_to_float(uint16_t h) { /* IEEE binary16 -> binary32, exact */
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa) { /* subnormal: normalize */
    int e = -1;
    uint32_t m = mantissa;
    do {
      e++;
      m <<= 1;
    } while (!(m & 0x400));
    bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
  } else {
    bits = sign;
  }
  float out;
  memcpy(&out, &bits, sizeof out);
  return out;
}

/* What model_step needs besides the layers. embed_kind: 32 = an fp32 table [rows][dim], 16 = an fp16 table
 * [rows][dim] (forward_paths.F16Embedding: values fp16 holds exactly, widened bit for bit), 8 = Q8_0 rows (int8
 * values [rows][dim] and one fp16 scale per 32, as forward_paths.Q8Embedding holds them). scatter: a reduced
 * vocabulary's target id per head row (scatter_n of them; the head's further rows are dropped), written into rows
 * of `width` logits that are -inf elsewhere; NULL: the head's rows are the logits. */
typedef struct {
  const Layer* layers;
  int n_layers, dim, heads, kv_heads, head_dim, intermediate;
  float eps;
  int embed_kind, embed_rows;
  const void* embed;
  const uint16_t* embed_scales;
  const float* final_norm;
  Linear head;
  const int64_t* scatter;
  int scatter_n, width;
} StepModel;

/* logits [keep][width] of the last `keep` of n rows fed at positions start..start+n-1 (ids: embedding rows,
 * checked by the caller); x [n][dim] is scratch. normed: NULL, or [n][dim] for every row's final-normed hidden
 * state (the engine's hidden-state observers). cos/sin: [n][head_dim] from row `start` of the rotary table.
 * Returns 0, -1 when out of memory, or KERNEL_BAD_SHAPE (a linear's shapes). */
int model_step(const StepModel* m, const int32_t* ids, int n, int start, const float* cos, const float* sin,
               int keep, float* x, float* normed, float* logits, int threads) {
  const int dim = m->dim;
  for (int i = 0; i < n; i++)  /* the table's rows: refused here too, not only by the Python caller */
    if (ids[i] < 0 || ids[i] >= m->embed_rows) return KERNEL_BAD_SHAPE;
  for (int i = 0; i < n; i++) {
    float* row = x + (size_t)i * dim;
    if (m->embed_kind == 32) {
      memcpy(row, (const float*)m->embed + (size_t)ids[i] * dim, dim * sizeof(float));
    } else if (m->embed_kind == 16) {
      const uint16_t* values = (const uint16_t*)m->embed + (size_t)ids[i] * dim;
      for (int j = 0; j < dim; j++) row[j] = half_to_float(values[j]);
    } else {
      const int8_t* values = (const int8_t*)m->embed + (size_t)ids[i] * dim;
      const uint16_t* scales = m->embed_scales + (size_t)ids[i] * (dim / 32);
      for (int j = 0; j < dim; j++) row[j] = (float)values[j] * half_to_float(scales[j / 32]);
    }
  }
  /* its own code: a bad shape (-2) was reported as "out of memory" (-1) */
  const int decoded = decoder_forward(m->layers, m->n_layers, x, n, start, cos, sin, dim, m->heads, m->kv_heads,
                                      m->head_dim, m->intermediate, m->eps, threads);
  if (decoded) return decoded;
  const int out = m->head.out_features, first = normed ? 0 : n - keep;
  float* own = normed ? NULL : malloc((size_t)keep * dim * sizeof(float));
  float* h = normed ? normed : own;
  float* head_rows = m->scatter ? malloc((size_t)keep * out * sizeof(float)) : logits;
  Scratch s = {malloc((size_t)keep * dim), malloc((size_t)keep * sizeof(float)), threads};
  int status = 0;
  if (!h || !head_rows || !s.xu || !s.row_scale) {
    status = -1;
    goto done;
  }
  rms_norm(x + (size_t)first * dim, m->final_norm, h, n - first, dim, m->eps);
  if ((status = linear(&m->head, h + (size_t)(n - keep - first) * dim, head_rows, keep, &s))) goto done;
  if (m->scatter) {
    for (int r = 0; r < keep; r++) {
      float* row = logits + (size_t)r * m->width;
      const float* mine = head_rows + (size_t)r * out;
      for (int j = 0; j < m->width; j++) row[j] = -INFINITY;
      for (int j = 0; j < m->scatter_n; j++) row[m->scatter[j]] = mine[j];
    }
  }
done:
  free(own);
  if (m->scatter) free(head_rows);
  free(s.xu); free(s.row_scale);
  return status;
}

/* ---------------------------------------------------------------- the predictor's ranking head */
static float dot_any(const float* a, const float* b, int d) { /* any d: dot() over the 16s, then the tail */
  const int body = d - d % 16;
  float sum = body >= 16 ? dot(a, b, body) : 0.0f;
  for (int j = body; j < d; j++) sum = fmaf(a[j], b[j], sum);
  return sum;
}

/* P(d | x) = softmax(W2 gelu(W1 layer_norm(x) + b1) + b2) for one context x = [prompt ; mean of the recent rows]
 * (runtime/predictor.py: RankingHead on TargetHiddenEncoder's features), into probs[classes]. parts[i] points at
 * part_rows[i] contiguous rows of dim floats, oldest first; no rows leave the recent half zero (a prompt-only
 * ranking). Why here: a scheduling point comes right after a verify has streamed the target's weights, and the
 * dozen tensor operations this replaces then cost ~0.4-0.6 ms of cold dispatch (see model_step); this is one call.
 * x must hold 2 * dim floats and h hidden floats of scratch. */
void rank_head(const float* prompt, const float* const* parts, const int* part_rows, int n_parts, int dim,
               const float* ln_w, const float* ln_b, float eps, const float* w1, const float* b1, int hidden,
               const float* w2, const float* b2, int classes, float* x, float* h, float* probs) {
  const int n = 2 * dim;
  float* recent = x + dim;
  memcpy(x, prompt, sizeof(float) * (size_t)dim);
  memset(recent, 0, sizeof(float) * (size_t)dim);
  int count = 0;
  for (int p = 0; p < n_parts; p++)
    for (int r = 0; r < part_rows[p]; r++, count++)
      for (int j = 0; j < dim; j++) recent[j] += parts[p][(size_t)r * dim + j];
  if (count > 0)
    for (int j = 0; j < dim; j++) recent[j] /= (float)count;
  double mean = 0.0, var = 0.0; /* the statistics in double: n is small and this is not the hot path */
  for (int j = 0; j < n; j++) mean += x[j];
  mean /= n;
  for (int j = 0; j < n; j++) var += (x[j] - mean) * (x[j] - mean);
  const float scale = (float)(1.0 / sqrt(var / n + eps)), centre = (float)mean;
  for (int j = 0; j < n; j++) x[j] = (x[j] - centre) * scale * ln_w[j] + ln_b[j];
  for (int k = 0; k < hidden; k++) {
    const float v = dot_any(w1 + (size_t)k * n, x, n) + b1[k];
    h[k] = 0.5f * v * (1.0f + erff(v * (float)M_SQRT1_2)); /* exact GELU, as torch.nn.GELU() */
  }
  float top = -INFINITY, total = 0.0f;
  for (int c = 0; c < classes; c++) {
    probs[c] = dot_any(w2 + (size_t)c * hidden, h, hidden) + b2[c];
    top = probs[c] > top ? probs[c] : top;
  }
  for (int c = 0; c < classes; c++) total += probs[c] = expf(probs[c] - top);
  for (int c = 0; c < classes; c++) probs[c] /= total;
}

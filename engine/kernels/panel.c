/* out[M, N] = x[M, K] @ W^T for a few rows M, with W stored in panels of 16 columns: wp[p][k][j] = W[16 p + j][k].
 *
 * Why: a verify pass feeds the target a few rows, and the library's kernels for 2-12 rows cost 1.3-2.5x one row
 * (engine/kernels/panel.py), though the pass is bound by streaming the weights once. Here the weights stream once,
 * in order, for up to 12 rows at a time, each output kept in a register for the whole sum. Two builds of the same
 * sums: panel_matmul for AVX2 (8-float registers), panel_matmul_avx512 for AVX-512 (16-float registers, several
 * panels streamed side by side with the next lines prefetched).
 *
 * Each output is one float32 sum over k = 0 .. K-1 in order (one fused multiply-add a step), whatever M is and
 * whichever rows are fed beside it: a row's result does not depend on how many rows a call has (bit for bit). */
#include <immintrin.h>
#include <stdint.h>

/* 1 to 6 rows: two accumulators a row (12 + 2 weight registers + 1 broadcast: the 16 ymm registers of AVX2) */

#define PANEL_KERNEL(MC)                                                                                  \
  static void rows_##MC(const float *x, const float *wp, float *out, int64_t k_len, int64_t n_len) {      \
    for (int64_t p = 0; p < n_len / 16; p++) {                                                            \
      const float *w = wp + p * k_len * 16;                                                               \
      __m256 acc[MC][2];                                                                                  \
      for (int m = 0; m < MC; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();                           \
      for (int64_t k = 0; k < k_len; k++) {                                                               \
        __m256 w0 = _mm256_loadu_ps(w + 16 * k), w1 = _mm256_loadu_ps(w + 16 * k + 8);                    \
        for (int m = 0; m < MC; m++) {                                                                    \
          __m256 b = _mm256_broadcast_ss(x + m * k_len + k);                                              \
          acc[m][0] = _mm256_fmadd_ps(b, w0, acc[m][0]);                                                  \
          acc[m][1] = _mm256_fmadd_ps(b, w1, acc[m][1]);                                                  \
        }                                                                                                 \
      }                                                                                                   \
      for (int m = 0; m < MC; m++) {                                                                      \
        _mm256_storeu_ps(out + m * n_len + 16 * p, acc[m][0]);                                            \
        _mm256_storeu_ps(out + m * n_len + 16 * p + 8, acc[m][1]);                                        \
      }                                                                                                   \
    }                                                                                                     \
  }

PANEL_KERNEL(1)
PANEL_KERNEL(2)
PANEL_KERNEL(3)
PANEL_KERNEL(4)
PANEL_KERNEL(5)
PANEL_KERNEL(6)

/* 7 to 12 rows: each panel in two halves of 8 columns, one accumulator a row (12 + 1 weight + 1 broadcast
 * registers). The second half reads the panel again from the cache (K * 64 bytes: 36 KiB for K = 576), so the
 * weights still stream from memory once. Each output is the same sum in the same order as above. */
#define HALF_KERNEL(MC)                                                                                   \
  static void rows_##MC(const float *x, const float *wp, float *out, int64_t k_len, int64_t n_len) {      \
    for (int64_t p = 0; p < n_len / 16; p++) {                                                            \
      for (int h = 0; h < 2; h++) {                                                                       \
        const float *w = wp + p * k_len * 16 + 8 * h;                                                     \
        __m256 acc[MC];                                                                                   \
        for (int m = 0; m < MC; m++) acc[m] = _mm256_setzero_ps();                                        \
        for (int64_t k = 0; k < k_len; k++) {                                                             \
          __m256 wv = _mm256_loadu_ps(w + 16 * k);                                                        \
          for (int m = 0; m < MC; m++)                                                                    \
            acc[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * k_len + k), wv, acc[m]);                 \
        }                                                                                                 \
        for (int m = 0; m < MC; m++) _mm256_storeu_ps(out + m * n_len + 16 * p + 8 * h, acc[m]);          \
      }                                                                                                   \
    }                                                                                                     \
  }

HALF_KERNEL(7)
HALF_KERNEL(8)
HALF_KERNEL(9)
HALF_KERNEL(10)
HALF_KERNEL(11)
HALF_KERNEL(12)

#define MAX_ROWS 12

typedef void (*rows_fn)(const float *, const float *, float *, int64_t, int64_t);

static void run_rows(const rows_fn *kernels, const float *x, const float *wp, float *out, int64_t m_len,
                     int64_t k_len, int64_t n_len) {
  for (int64_t m0 = 0; m0 < m_len; m0 += MAX_ROWS) {
    int64_t rows = m_len - m0 < MAX_ROWS ? m_len - m0 : MAX_ROWS;
    kernels[rows - 1](x + m0 * k_len, wp, out + m0 * n_len, k_len, n_len);
  }
}

/* x [m_len, k_len] and out [m_len, n_len] row-major float32; n_len a multiple of 16. Rows go MAX_ROWS at a time. */
void panel_matmul(const float *x, const float *wp, float *out, int64_t m_len, int64_t k_len, int64_t n_len) {
  static const rows_fn kernels[MAX_ROWS] = {rows_1, rows_2, rows_3, rows_4,  rows_5,  rows_6,
                                             rows_7, rows_8, rows_9, rows_10, rows_11, rows_12};
  run_rows(kernels, x, wp, out, m_len, k_len, n_len);
}

/* AVX-512: one 16-float register holds a panel's row of outputs. One stream of weights does not reach the memory's
 * bandwidth from one core, so S panels are summed side by side (S streams, each K * 64 bytes long), each stream's
 * line PREFETCH bytes ahead asked for. Registers: S * MC accumulators + S weights + 1 broadcast of the 32 zmm, so 4
 * panels for 1-6 rows and 2 for 7-12. Panels past the last whole group of S go one at a time. Each output is the same
 * sum in the same order as the AVX2 kernels': the same bits. */
#define PREFETCH 2048

#define WIDE_KERNEL(MC, S)                                                                                     \
  __attribute__((target("avx512f"))) static void wide_##MC(const float *x, const float *wp, float *out,       \
                                                           int64_t k_len, int64_t n_len) {                     \
    int64_t panels = n_len / 16, p = 0;                                                                        \
    for (; p + S <= panels; p += S) {                                                                          \
      const float *w = wp + p * k_len * 16;                                                                    \
      __m512 acc[S][MC];                                                                                       \
      for (int s = 0; s < S; s++)                                                                              \
        for (int m = 0; m < MC; m++) acc[s][m] = _mm512_setzero_ps();                                          \
      for (int64_t k = 0; k < k_len; k++) {                                                                    \
        __m512 wv[S];                                                                                          \
        for (int s = 0; s < S; s++) {                                                                          \
          const float *line = w + s * k_len * 16 + 16 * k;                                                     \
          _mm_prefetch((const char *)line + PREFETCH, _MM_HINT_T0);                                            \
          wv[s] = _mm512_loadu_ps(line);                                                                       \
        }                                                                                                      \
        for (int m = 0; m < MC; m++) {                                                                         \
          __m512 b = _mm512_set1_ps(x[m * k_len + k]);                                                         \
          for (int s = 0; s < S; s++) acc[s][m] = _mm512_fmadd_ps(b, wv[s], acc[s][m]);                        \
        }                                                                                                      \
      }                                                                                                        \
      for (int s = 0; s < S; s++)                                                                              \
        for (int m = 0; m < MC; m++) _mm512_storeu_ps(out + m * n_len + 16 * (p + s), acc[s][m]);              \
    }                                                                                                          \
    for (; p < panels; p++) {                                                                                  \
      const float *w = wp + p * k_len * 16;                                                                    \
      __m512 acc[MC];                                                                                          \
      for (int m = 0; m < MC; m++) acc[m] = _mm512_setzero_ps();                                               \
      for (int64_t k = 0; k < k_len; k++) {                                                                    \
        _mm_prefetch((const char *)(w + 16 * k) + PREFETCH, _MM_HINT_T0);                                      \
        __m512 wv = _mm512_loadu_ps(w + 16 * k);                                                               \
        for (int m = 0; m < MC; m++) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * k_len + k]), wv, acc[m]);   \
      }                                                                                                        \
      for (int m = 0; m < MC; m++) _mm512_storeu_ps(out + m * n_len + 16 * p, acc[m]);                         \
    }                                                                                                          \
  }

WIDE_KERNEL(1, 4)
WIDE_KERNEL(2, 4)
WIDE_KERNEL(3, 4)
WIDE_KERNEL(4, 4)
WIDE_KERNEL(5, 4)
WIDE_KERNEL(6, 4)
WIDE_KERNEL(7, 2)
WIDE_KERNEL(8, 2)
WIDE_KERNEL(9, 2)
WIDE_KERNEL(10, 2)
WIDE_KERNEL(11, 2)
WIDE_KERNEL(12, 2)

/* The same call on an AVX-512 CPU. */
void panel_matmul_avx512(const float *x, const float *wp, float *out, int64_t m_len, int64_t k_len, int64_t n_len) {
  static const rows_fn kernels[MAX_ROWS] = {wide_1, wide_2, wide_3, wide_4,  wide_5,  wide_6,
                                             wide_7, wide_8, wide_9, wide_10, wide_11, wide_12};
  run_rows(kernels, x, wp, out, m_len, k_len, n_len);
}

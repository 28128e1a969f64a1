// Host-device math of the fused cross-entropy, shared by the CPU handlers and the CUDA
// kernels so both compute the same function the same way.
//
// Per row r of logits z (vocabulary last, V = cols), with the label l (an index in
// [0, V), anything else is "out of range"), the kept set K (every column, or the columns
// whose bool mask entry is set: optax's element-wise `where`), n = |K|, the row weight
// w (jax_ops/ops/cross_entropy.py: 0 for ignored rows, 1/count for "mean"),
// label smoothing ls and the PaLM z-loss coefficient zl:
//   m   = max_{j in K} z_j (0 when every kept logit is -inf),  s = Σ_{j in K} exp(z_j - m)
//   lse = m + log s
//   nll = lse - z_l                 (z_l read whether or not l is kept, as optax does;
//                                    NaN when l is out of range, as optax's gather gives)
//   loss = (1 - ls) nll + ls (lse - Σ_{j in K} z_j / n) + zl lse²
//   out  = w · loss, exactly 0 where w == 0
// and, when the forward also writes the gradient (training), with p_j = exp(z_j - m) / s
// on K and 0 elsewhere:
//   dlogits_j = w · (p_j (1 + 2 zl lse) - (1 - ls)[j == l] - (ls / n)[j in K]),
// all zeros where w == 0 (whatever the logits hold). The backward only scales row r of
// dlogits by the cotangent g_r (in place; rows with g_r == 1 are left alone).
#pragma once
#include <cmath>
#include <cstdint>
#include "cuda_src/common.h"

namespace jax_ops::ce {

struct FwdArgs {
  const void* logits;      // [rows, cols], T
  const int32_t* labels;   // [rows]
  const float* weight;     // [rows]
  const uint8_t* mask;     // [mask_rows, cols] bools (PRED bytes), or nullptr
  int64_t mask_rows;       // 1 (one row for every row) or rows
  float* loss;             // [rows]
  float* lse;              // [rows]
  void* dlogits;           // [rows, cols], T, or nullptr (no gradient)
  int64_t rows, cols;
  float label_smoothing, z_loss;
  // The vocabulary-sharded stages (columns: one device's shard; labels: local columns,
  // anything outside the shard "out of range"). Per row, kStatCount floats
  // (max, Σ exp(z - safe_max(max)), Σ z, kept count, z_label):
  float* parts = nullptr;        // partials: the shard's, z_label 0 when the label is not
                                 // in the shard; nothing else is written
  const float* stats = nullptr;  // apply: the whole rows' (merged over the shards); the
                                 // row's own statistics are not computed
};

constexpr int kStatCount = 5;

struct BwdArgs {
  const void* in;          // dlogits [rows, cols], T
  void* out;               // the scaled rows (XLA aliases it to `in`)
  const float* g;          // [rows]
  int64_t rows, cols;
  bool skip_ones;          // out == in: rows with g == 1 need no work
};

JO_HD float neg_inf() { return -INFINITY; }

constexpr float kLog2e = 1.4426950408889634f;

// 2^v: ex2.approx.ftz on the GPU (2 ulp; results below 2^-126 flush to 0).
JO_HD float exp2_f32(float v) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
#else
  return std::exp2(v);
#endif
}

JO_HD float exp_f32(float v) {
#if defined(__CUDA_ARCH__)
  return exp2_f32(v * kLog2e);
#else
  return std::exp(v);
#endif
}

JO_HD float log_f32(float v) {
#if defined(__CUDA_ARCH__)
  return __logf(v);
#else
  return std::log(v);
#endif
}

JO_HD float max_f(float a, float b) { return a > b ? a : b; }

// The shift subtracted before exp: the max, or 0 when every kept logit is -inf.
JO_HD float safe_max(float m) { return m == neg_inf() ? 0.f : m; }

// Running statistics of one row: max and Σ exp(z - max) (online: merged per pack),
// Σ z and the count of kept logits.
struct RowStats {
  float m = neg_inf(), s = 0.f, sum_z = 0.f, n = 0.f;

  // Merges a (max, Σ exp(z - max)) pair; symmetric, NaN sums propagate.
  JO_HD void merge(float om, float os) {
    const float nm = max_f(om, m);
    if (nm == neg_inf()) { s += os; return; }  // both all -inf (sums 0) or NaN
    s = s * exp_f32(m - nm) + os * exp_f32(om - nm);
    m = nm;
  }
};

// Row constants of the outputs (finish_row): the weighted loss, lse, and the gradient
// d_j = a · e_j - b [j in K] - c [j == l] with e_j = exp(z_j - shift).
struct RowOut {
  float loss, lse;
  float a, b, c, shift;
  bool zero;  // w == 0: the row's loss and gradient are exactly 0
};

// m: the row max over K; s = Σ_K exp(z - safe_max(m)); z_label: the label's logit or NaN.
JO_HD RowOut finish_row(float m, float s, float sum_z, float n, float z_label, float w, float ls, float zl) {
  RowOut r;
  const float ms = safe_max(m);
  const float log_s = log_f32(s);  // -inf when every kept logit is -inf
  const float lse = ms + log_s;
  float loss = (ms - z_label) + log_s;  // lse - z_l, without rounding lse first
  if (ls > 0.f) {
    const float mean_z = n > 0.f ? sum_z / n : 0.f;
    loss = (1.f - ls) * loss + ls * ((ms - mean_z) + log_s);
  }
  if (zl > 0.f) loss += zl * lse * lse;
  r.zero = w == 0.f;
  r.loss = r.zero ? 0.f : w * loss;
  r.lse = lse;
  r.shift = ms;
  r.a = w * (zl > 0.f ? 1.f + 2.f * zl * lse : 1.f) / s;
  r.b = n > 0.f ? w * ls / n : 0.f;
  r.c = w * (1.f - ls);
  return r;
}

// exp(z - shift) as the kernels compute it: one FMA and ex2 on the GPU (the shift's
// rounding is common to the row), std::exp on the host.
JO_HD float row_exp(float z, float shift) {
#if defined(__CUDA_ARCH__)
  return exp2_f32(fmaf(z, kLog2e, -shift * kLog2e));
#else
  return std::exp(z - shift);
#endif
}

// One element of the gradient (not for rows with r.zero: those are all 0).
JO_HD float grad_elem(float z, bool kept, bool is_label, const RowOut& r) {
  const float e = kept ? row_exp(z, r.shift) : 0.f;
  float d = r.a * e;
  if (kept) d -= r.b;
  if (is_label) d -= r.c;
  return d;
}

JO_HD bool label_in_range(int32_t label, int64_t cols) { return label >= 0 && int64_t(label) < cols; }

}  // namespace jax_ops::ce

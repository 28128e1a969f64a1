// Host-device math of the Softmax/LogSoftmax family, shared by the CPU handlers
// and the CUDA kernels so both compute the same function the same way.
//
// Per row of x (the softmax axis last): logits z_j = x_j * scale, then the mask
// (bool: keep or -inf; additive: + m_j) and the causal rule (keep j <= i + offset,
// i the row's position along the query axis). With m = max z and s = Σ exp(z - m):
//   softmax     y = exp(z - m) / s        (all 0 when every z is -inf)
//   log_softmax y = z - m - log s         (all -inf when every z is -inf)
// Backward from y alone, with dz the gradient of the logits and dx = scale * dz:
//   softmax     dz = y * (dy - Σ dy·y)
//   log_softmax dz = dy - exp(y) * Σ dy, and 0 where y = -inf (masked)
#pragma once
#include <cmath>
#include <cstdint>
#include "cuda_src/common.h"

namespace jax_ops::softmax {

enum MaskKind : int { kNoMask = 0, kBoolMask = 1, kAddMask = 2 /* x's dtype */, kAddMaskF32 = 3 };

// Row of x -> row of the (broadcast) mask: Σ_g ((row / inner_g) % size_g) * stride_g
// over the mask's non-broadcast groups of leading axes (jax_ops/softmax.py builds it).
constexpr int kMaxMaskGroups = 4;
struct MaskMap {
  int groups = 0;
  int64_t inner[kMaxMaskGroups] = {}, size[kMaxMaskGroups] = {}, stride[kMaxMaskGroups] = {};
};

JO_HD int64_t mask_row(const MaskMap& m, int64_t row) {
  int64_t r = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int g = 0; g < kMaxMaskGroups; ++g)  // fixed trip count: the arrays stay in registers
    if (g < m.groups) r += ((row / m.inner[g]) % m.size[g]) * m.stride[g];
  return r;
}

struct FwdArgs {
  const void* x; void* y;
  const void* mask; int mask_kind; MaskMap map;  // mask: [mask rows, cols]
  int64_t rows, cols;
  float scale; bool log;
  bool causal; int64_t q_len, offset;  // causal: keep col <= (row % q_len) + offset
};

struct BwdArgs {
  const void* y; const void* dy; void* dx;
  int64_t rows, cols;
  float scale; bool log;
};

JO_HD float neg_inf() { return -INFINITY; }

constexpr float kLog2e = 1.4426950408889634f;

// 2^v: ex2.approx.ftz, 2 ulp; results below 2^-126 flush to 0 (no denormal fix-up
// instructions).
JO_HD float exp2_f32(float v) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
#else
  return std::exp2(v);
#endif
}

// e^v as 2^(v * log2 e): 2 ulp near 0, where the mass is (CPU: std::exp).
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

// Running (max, Σ exp(z - max)) of a set of logits (the long-row kernel merges
// these per pack). merge() is symmetric; NaN sums propagate.
struct MaxSum {
  float m = neg_inf(), s = 0.f;
  JO_HD void merge(float om, float os) {
    const float nm = om > m ? om : m;
    if (nm == neg_inf()) { s += os; return; }  // both all -inf (s 0) or NaN
    s = s * exp_f32(m - nm) + os * exp_f32(om - nm);
    m = nm;
  }
};

// The shift subtracted before exp: the row max, or 0 when every logit is -inf
// (then exp(z - 0) = 0 for all and the sum is 0).
JO_HD float safe_max(float m) { return m == neg_inf() ? 0.f : m; }

// The last column the causal rule keeps in `row` (every column without the rule);
// computed once per row: the modulo is a 64-bit division.
JO_HD int64_t causal_limit(const FwdArgs& a, int64_t row) {
  return a.causal ? (row % a.q_len) + a.offset : INT64_MAX;
}

// One logit: x scaled, with this element's mask value applied (mask value: the bool
// as 0/1 or the additive term, as float).
JO_HD float logit(float x, float scale, int mask_kind, float mask_value, bool keep) {
  if (!keep || (mask_kind == kBoolMask && mask_value == 0.f)) return neg_inf();
  const float z = x * scale;
  return (mask_kind == kAddMask || mask_kind == kAddMaskF32) ? z + mask_value : z;
}

// Row constants of the output, from the shift m (safe_max) and s = Σ exp(z - m).
// A row is empty (fully masked) iff s == 0: an unmasked row has the term exp(0) = 1,
// and a NaN anywhere makes s NaN, which then reaches every output of the row.
struct RowOut {
  float m, inv_s, log_s;
  bool empty;
};

JO_HD RowOut finish_row(float m, float s, bool log) {
  RowOut r;
  r.m = m;
  r.empty = s == 0.f;
  r.inv_s = log ? 0.f : 1.f / s;
  r.log_s = log ? log_f32(s) : 0.f;
  return r;
}

// (z - m) - log s rather than z - (m + log s): with |m| ~ 1e4 the sum would round
// away log s's low bits.
JO_HD float softmax_out(float z, const RowOut& r, bool log) {
  if (log) return r.empty ? neg_inf() : (z - r.m) - r.log_s;
  return r.empty ? 0.f : exp_f32(z - r.m) * r.inv_s;
}

// Per-element term of the backward's row sum: dy·y (softmax) or dy (log_softmax).
JO_HD float bwd_dot_term(float y, float dy, bool log) {
  if (log) return y == neg_inf() ? 0.f : dy;
  return dy * y;
}

JO_HD float softmax_dx(float y, float dy, float dot, float scale, bool log) {
  if (log) return y == neg_inf() ? 0.f : scale * (dy - exp_f32(y) * dot);
  return scale * (y * (dy - dot));
}


// ----------------------------------------------- hidden-sharded stages (issue 23) ---
// The softmax axis split over devices: each device reduces its columns of every row to
// (max, Σ exp(z − max)) of its logits, jax_ops/ops/softmax.py combines them across
// devices (O(rows) data) into the row's (m, s), and a pass writes y from x, m and s by
// the formulas above (finish_row, softmax_out). Backward: the partial Σ dy·y (log: Σ dy)
// per row, combined, then dx (softmax_dx). The logits are those of the unsharded op:
// scale, the mask's local columns and the causal rule, whose limit for local row r is
// (r % q_len) + offset with the device's offset (row0 − col0 + k − q, an operand: it
// depends on the device's position in the mesh).
struct PartArgs {
  FwdArgs f;              // x, mask, rows/cols of the local shard, scale, causal, q_len
  const int32_t* offset;  // causal: the device's offset (null: f.offset)
  float* max; float* sum;
};

struct ApplyArgs {
  FwdArgs f;              // also y and log
  const int32_t* offset;
  const float* max; const float* sum;  // the whole row's max (may be -inf) and Σ exp(z − max)
};

struct BwdPartArgs {
  const void* y; const void* dy; float* dot;
  int64_t rows, cols; bool log;
};

struct BwdApplyArgs {
  BwdArgs b;              // y, dy, dx, rows/cols, scale, log
  const float* dot;       // the whole row's Σ dy·y (log: Σ dy)
};

// The causal limit of local row `row` with the device's offset.
JO_HD int64_t causal_limit_at(const FwdArgs& a, int64_t row, int64_t offset) {
  return a.causal ? (row % a.q_len) + offset : INT64_MAX;
}

// (m, s) ⊕= (om, os), each s = Σ exp(z − safe_max(m)) of its logits: one exp. NaN
// propagates through s.
JO_HD void merge_max_sum(float& m, float& s, float om, float os) {
  if (om == neg_inf()) { s += os; return; }  // the other holds no finite logit (os 0, or NaN)
  if (om <= m) { s += os * exp_f32(om - m); return; }
  s = s * exp_f32(m - om) + os;              // m = -inf: exp gives 0, s is 0 (or NaN)
  m = om;
}
}  // namespace jax_ops::softmax

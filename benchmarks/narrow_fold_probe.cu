// What folding the narrow backward's column sums into the backward could save, measured on
// a mock of the step's structure before the library is changed (issue 20, item 2's narrow
// rows). A bfloat16 LayerNorm training step at 32-128 columns, 49152 rows: a forward kernel
// (y, mean, rstd) and a backward kernel (dx, and a row of float32 dscale/dbias partials a
// resident block), then one of:
//   sums    a second kernel adds the partial rows (the library's structure today);
//   pdl     the same, the sums kernel launched as a programmatic dependent (sm_90);
//   vec1/2/4 the sums kernel with 16-byte loads, 4 / 8 / 16 columns a block;
//   empty   a kernel that does nothing in the sums kernel's place (a third kernel's fixed cost);
//   memset  the backward's last block adds them (a two-level ticket: the last block of each
//           group of blocks adds the group's rows, the last group's the group rows), its
//           counters zeroed by a memset before the backward;
//   ticket  the same with counters the forward kernel zeroes (no extra operation);
//   tickets the ticket's two levels of counters without the sums (the counters' share);
//   partials the backward writes its partial rows, nothing adds them (the sums kernel's share);
//   none    no dscale/dbias at all (the floor of the two kernels).
// The sums stay in a fixed order (bitwise reproducible for a grid); the counters are
// integer tickets only. Each variant is timed as a CUDA graph of 20 steps over 8 buffer
// sets (past L2 at 49152 rows; at 1000 rows they fit in it), replayed; µs a step, the
// median of 7 timings (events). dscale/dbias of the last step are checked against float64.
// nvcc -std=c++17 -O3 -gencode arch=compute_90,code=sm_90 -o narrow_fold_probe benchmarks/narrow_fold_probe.cu
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CHECK(x)                                                               \
  do {                                                                         \
    cudaError_t e_ = (x);                                                      \
    if (e_ != cudaSuccess) {                                                   \
      std::printf("%s:%d %s failed: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

constexpr int kThreads = 128, kPack = 8, kSets = 8, kSteps = 20;

struct Step {
  const __nv_bfloat16* x;
  const __nv_bfloat16* dy;
  __nv_bfloat16* y;
  __nv_bfloat16* dx;
  float* mean;
  float* rstd;
  const float* scale;
  int64_t rows, cols;
  float* part;        // [2][blocks][cols]: dscale's partial rows, then dbias's
  float* group_part;  // [2][groups][cols]
  unsigned* counters; // [groups + 1]
  float* out;         // [2][cols]: dscale, dbias
  int group_blocks;   // blocks a level-1 group
};

__device__ __forceinline__ void unpack(const uint4& u, float (&f)[kPack]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x, f[2 * i + 1] = t.y;
  }
}
__device__ __forceinline__ uint4 pack(const float (&f)[kPack]) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return u;
}

// W lanes a row (a 16-byte pack each), 32 / W rows a warp.
template <int W>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int off = 1; off < W; off *= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

template <int W>
__global__ void __launch_bounds__(kThreads) fwd_kernel(Step s, bool zero_counters, int ncounters) {
  if (zero_counters && blockIdx.x == 0)
    for (int i = threadIdx.x; i < ncounters; i += kThreads) s.counters[i] = 0u;
  constexpr int RPW = 32 / W;
  const int lane = threadIdx.x % 32, glane = lane % W, grp = lane / W;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  const float inv = 1.f / float(s.cols);
  for (int64_t tile = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32; tile * RPW < s.rows; tile += warps) {
    const int64_t row = tile * RPW + grp;
    const bool ok = row < s.rows;
    float v[kPack] = {};
    if (ok) unpack(*reinterpret_cast<const uint4*>(s.x + row * s.cols + glane * kPack), v);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kPack; ++i) sum += v[i];
    const float mu = group_sum<W>(sum) * inv;
    float q = 0.f;
#pragma unroll
    for (int i = 0; i < kPack; ++i) q += (v[i] - mu) * (v[i] - mu);
    const float r = rsqrtf(group_sum<W>(q) * inv + 1e-5f);
    float o[kPack];
#pragma unroll
    for (int i = 0; i < kPack; ++i) o[i] = (v[i] - mu) * r * s.scale[glane * kPack + i];
    if (ok) {
      *reinterpret_cast<uint4*>(s.y + row * s.cols + glane * kPack) = pack(o);
      if (glane == 0) s.mean[row] = mu, s.rstd[row] = r;
    }
  }
}

// Column sums over rows [0, n) of `src` ([2][stride][cols]: both arrays), into `dst`
// ([2][dst_stride][cols], row dst_row) by the block: chunks of rows staged in shared memory
// with every load of a chunk in flight at once (kLoads a thread), then each (array,
// column) item added over the rows in order by one thread: a fixed order, and one L2
// round trip a chunk. Items (2 x cols) at most 2 x kThreads.
constexpr int kLoads = 16, kStage = kLoads * kThreads;
// An L2 load the compiler keeps in program order (asm volatile), so that a chunk's loads
// are all issued before the first is used.
__device__ __forceinline__ float load_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
__device__ void block_column_sums(const float* src, int64_t stride, int n, int64_t cols, float* dst,
                                  int64_t dst_stride, int64_t dst_row, float* buf) {
  const int items = int(2 * cols), chunk_rows = max(1, kStage / items);
  float acc0 = 0.f, acc1 = 0.f;
  for (int r0 = 0; r0 < n; r0 += chunk_rows) {
    const int total = min(chunk_rows, n - r0) * items;
    float t[kLoads];
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int idx = k * kThreads + int(threadIdx.x);
      if (idx < total) {
        const int row = r0 + idx / items, item = idx % items, arr = item / int(cols), col = item % int(cols);
        t[k] = load_cg(src + (int64_t(arr) * stride + row) * cols + col);
      }
    }
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int idx = k * kThreads + int(threadIdx.x);
      if (idx < total) buf[idx] = t[k];
    }
    __syncthreads();
    const int rows = total / items;
    for (int r = 0; r < rows; ++r) {
      if (int(threadIdx.x) < items) acc0 += buf[r * items + threadIdx.x];
      if (int(threadIdx.x) + kThreads < items) acc1 += buf[r * items + threadIdx.x + kThreads];
    }
    __syncthreads();
  }
  for (int h = 0; h < 2; ++h) {
    const int it = int(threadIdx.x) + h * kThreads;
    if (it < items) dst[(int64_t(it / int(cols)) * dst_stride + dst_row) * cols + it % int(cols)] = h ? acc1 : acc0;
  }
}

__device__ __forceinline__ unsigned ticket(unsigned* counter) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
  return old;
}

// MODE 0: no dscale/dbias; 1: partial rows; 2: partial rows and the ticket fold (its own
// kernel: the fold's registers and shared memory do not change the others' occupancy);
// 3: partial rows and the fold's two tickets, no sums (what the tickets alone cost).
template <int W, int MODE>
__global__ void __launch_bounds__(kThreads) bwd_kernel(Step s) {
  asm volatile("griddepcontrol.launch_dependents;");  // a no-op without a programmatic dependent
  constexpr int RPW = 32 / W;
  const int lane = threadIdx.x % 32, glane = lane % W, grp = lane / W, warp = threadIdx.x / 32;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  const float inv = 1.f / float(s.cols);
  float sc[kPack], ds[kPack] = {}, db[kPack] = {};
#pragma unroll
  for (int i = 0; i < kPack; ++i) sc[i] = s.scale[glane * kPack + i];
  int64_t tile = int64_t(blockIdx.x) * (kThreads / 32) + warp;
  uint4 nx = {}, nd = {};
  float nmu = 0.f, nr = 0.f;
  const auto load = [&](int64_t t) {
    const int64_t row = t * RPW + grp;
    if (row < s.rows) {
      nx = *reinterpret_cast<const uint4*>(s.x + row * s.cols + glane * kPack);
      nd = *reinterpret_cast<const uint4*>(s.dy + row * s.cols + glane * kPack);
      nmu = s.mean[row], nr = s.rstd[row];
    }
  };
  if (tile * RPW < s.rows) load(tile);
  for (; tile * RPW < s.rows; tile += warps) {
    const uint4 cx = nx, cd = nd;
    const float mu = nmu, r = nr;
    if ((tile + warps) * RPW < s.rows) load(tile + warps);
    const int64_t row = tile * RPW + grp;
    float xv[kPack], dv[kPack], g[kPack];
    unpack(cx, xv);
    unpack(cd, dv);
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int i = 0; i < kPack; ++i) {
      xv[i] = (xv[i] - mu) * r;
      g[i] = dv[i] * sc[i];
      sg += g[i], sgx += g[i] * xv[i];
      if (row < s.rows) ds[i] += dv[i] * xv[i], db[i] += dv[i];
    }
    sg = group_sum<W>(sg) * inv;
    sgx = group_sum<W>(sgx) * inv;
    float o[kPack];
#pragma unroll
    for (int i = 0; i < kPack; ++i) o[i] = r * (g[i] - sg - xv[i] * sgx);
    if (row < s.rows) *reinterpret_cast<uint4*>(s.dx + row * s.cols + glane * kPack) = pack(o);
  }
  if constexpr (MODE == 0) return;
  // The block's partial row: the warp's groups added across the warp, the warps in order.
#pragma unroll
  for (int off = W; off < 32; off *= 2)
#pragma unroll
    for (int i = 0; i < kPack; ++i) {
      ds[i] += __shfl_xor_sync(0xffffffffu, ds[i], off);
      db[i] += __shfl_xor_sync(0xffffffffu, db[i], off);
    }
  __shared__ float red[2][kThreads / 32][128];
  __shared__ float sums[MODE >= 2 ? kStage : 1];
  __shared__ bool last;
  if (lane < W)
#pragma unroll
    for (int i = 0; i < kPack; ++i) red[0][warp][glane * kPack + i] = ds[i], red[1][warp][glane * kPack + i] = db[i];
  __syncthreads();
  const int64_t P = gridDim.x;
  for (int item = threadIdx.x; item < 2 * s.cols; item += kThreads) {
    const int arr = item / int(s.cols), col = item % int(s.cols);
    float t = 0.f;
    for (int w = 0; w < kThreads / 32; ++w) t += red[arr][w][col];
    s.part[(arr * P + blockIdx.x) * s.cols + col] = t;
  }
  if constexpr (MODE == 1) return;
  // Level 1: the group's last block adds the group's partial rows.
  const int group = blockIdx.x / s.group_blocks, groups = (gridDim.x + s.group_blocks - 1) / s.group_blocks;
  const int members = min(s.group_blocks, int(gridDim.x) - group * s.group_blocks);
  __syncthreads();
  if (threadIdx.x == 0) {
    last = ticket(s.counters + group) == unsigned(members - 1);
    if (last) s.counters[group] = 0u;  // for the next launch
  }
  __syncthreads();
  if (!last) return;
  if constexpr (MODE == 2)
    block_column_sums(s.part + int64_t(group) * s.group_blocks * s.cols, P, members, s.cols, s.group_part, groups,
                      group, sums);
  // Level 2: the last group's finisher adds the group rows.
  __syncthreads();
  if (threadIdx.x == 0) {
    last = ticket(s.counters + groups) == unsigned(groups - 1);
    if (last) s.counters[groups] = 0u;
  }
  __syncthreads();
  if (!last) return;
  if constexpr (MODE == 2) block_column_sums(s.group_part, groups, groups, s.cols, s.out, 1, 0, sums);
}

// The library's structure today: CW columns a block (blockIdx.y the array), a thread's
// rows in a fixed order (four loads in flight), then the column's threads by shuffles and
// the warps in order. PDL: it waits for the backward's grid before reading.
template <int CW>
__global__ void __launch_bounds__(1024) sums_kernel(const float* part, int64_t P, int64_t cols, float* out, bool pdl) {
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  __shared__ float red[32][CW];
  const float* src = part + int64_t(blockIdx.y) * P * cols;
  const int c = threadIdx.x % CW, lane = threadIdx.x % 32, w = threadIdx.x / 32, nw = blockDim.x / 32;
  const int64_t slot = threadIdx.x / CW, slots = blockDim.x / CW, col = int64_t(blockIdx.x) * CW + c;
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
  if (col < cols) {
    int64_t j = slot;
    for (; j + 3 * slots < P; j += 4 * slots) {
      a0 += src[j * cols + col];
      a1 += src[(j + slots) * cols + col];
      a2 += src[(j + 2 * slots) * cols + col];
      a3 += src[(j + 3 * slots) * cols + col];
    }
    for (; j < P; j += slots) a0 += src[j * cols + col];
  }
  float s = (a0 + a1) + (a2 + a3);
  for (int off = CW; off < 32; off *= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane < CW) red[w][lane] = s;
  __syncthreads();
  if (w != 0) return;
  float t = 0.f;
  for (int k = lane / CW; k < nw; k += 32 / CW) t += red[k][c];
  for (int off = CW; off < 32; off *= 2) t += __shfl_xor_sync(0xffffffffu, t, off);
  if (lane < CW && col < cols) out[blockIdx.y * cols + col] = t;
}

// The sums kernel with 16-byte loads: a thread adds 4 columns (a float4) of C4 * 4 a block
// over its rows (four float4 loads in flight), the threads of a float4 by shuffles, then
// the warps in order: a fixed order, but not sums_kernel's (other threads a column).
template <int C4>
__global__ void __launch_bounds__(1024) sums_vec_kernel(const float* part, int64_t P, int64_t cols, float* out) {
  __shared__ float4 red[32][C4];
  const float4* src = reinterpret_cast<const float4*>(part + int64_t(blockIdx.y) * P * cols);
  const int64_t cols4 = cols / 4;
  const int c = threadIdx.x % C4, lane = threadIdx.x % 32, w = threadIdx.x / 32, nw = blockDim.x / 32;
  const int64_t slot = threadIdx.x / C4, slots = blockDim.x / C4, col4 = int64_t(blockIdx.x) * C4 + c;
  const auto add = [](float4& a, const float4& b) { a.x += b.x, a.y += b.y, a.z += b.z, a.w += b.w; };
  float4 a0 = {0.f, 0.f, 0.f, 0.f}, a1 = a0, a2 = a0, a3 = a0;
  if (col4 < cols4) {
    int64_t j = slot;
    for (; j + 3 * slots < P; j += 4 * slots) {
      const float4 v0 = src[j * cols4 + col4], v1 = src[(j + slots) * cols4 + col4];
      const float4 v2 = src[(j + 2 * slots) * cols4 + col4], v3 = src[(j + 3 * slots) * cols4 + col4];
      add(a0, v0), add(a1, v1), add(a2, v2), add(a3, v3);
    }
    for (; j < P; j += slots) add(a0, src[j * cols4 + col4]);
  }
  add(a0, a1), add(a2, a3), add(a0, a2);
  for (int off = C4; off < 32; off *= 2) {
    a0.x += __shfl_xor_sync(0xffffffffu, a0.x, off), a0.y += __shfl_xor_sync(0xffffffffu, a0.y, off);
    a0.z += __shfl_xor_sync(0xffffffffu, a0.z, off), a0.w += __shfl_xor_sync(0xffffffffu, a0.w, off);
  }
  if (lane < C4) red[w][lane] = a0;
  __syncthreads();
  if (w != 0) return;
  float4 t = {0.f, 0.f, 0.f, 0.f};
  for (int k = lane / C4; k < nw; k += 32 / C4) add(t, red[k][c]);
  for (int off = C4; off < 32; off *= 2) {
    t.x += __shfl_xor_sync(0xffffffffu, t.x, off), t.y += __shfl_xor_sync(0xffffffffu, t.y, off);
    t.z += __shfl_xor_sync(0xffffffffu, t.z, off), t.w += __shfl_xor_sync(0xffffffffu, t.w, off);
  }
  if (lane < C4 && col4 < cols4) reinterpret_cast<float4*>(out + int64_t(blockIdx.y) * cols)[col4] = t;
}

// A third kernel that does nothing (the sums kernel's grid): the fixed cost of any.
__global__ void empty_kernel() {}

enum Variant { kSums, kPdl, kSumsVec1, kSumsVec2, kSumsVec4, kEmpty, kMemset, kTicket, kTicketsOnly, kPartials, kNone };
const char* kNames[] = {"sums", "pdl", "vec1", "vec2", "vec4", "empty", "memset", "ticket", "tickets", "partials", "none"};

static uint32_t lcg = 12345u;
static float urand() {
  lcg = lcg * 1664525u + 1013904223u;
  return float(lcg >> 8) / float(1u << 24) * 2.f - 1.f;
}

template <int W>
void run_cols(int64_t rows, int group_blocks_arg) {
  const int64_t cols = W * kPack;
  int sms = 0, per_sm_b = 0, per_sm_t = 0, per_sm_f = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_b, bwd_kernel<W, 1>, kThreads, 0));
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_t, bwd_kernel<W, 2>, kThreads, 0));
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_f, fwd_kernel<W>, kThreads, 0));
  const int64_t tiles = (rows + 32 / W - 1) / (32 / W), need = (tiles + kThreads / 32 - 1) / (kThreads / 32);
  const int PB = int(std::min<int64_t>(int64_t(per_sm_b) * sms, need));
  const int PT = int(std::min<int64_t>(int64_t(per_sm_t) * sms, need));
  const int P = std::max(PB, PT);  // partial rows allocated
  const int PF = int(std::min<int64_t>(int64_t(per_sm_f) * sms, need));
  const int G = group_blocks_arg > 0 ? group_blocks_arg : std::max(1, int(std::ceil(std::sqrt(double(PT)))));
  const int groups = (PT + G - 1) / G;
  const size_t n = size_t(rows * cols);
  std::vector<__nv_bfloat16> hx(n), hd(n);
  std::vector<float> hxf[kSets], hdf[kSets];
  Step s[kSets];
  float *scale, *part, *gpart, *out;
  unsigned* counters;
  std::vector<float> hs(cols);
  for (auto& v : hs) v = 1.f + 0.5f * urand();
  CHECK(cudaMalloc(&scale, cols * 4));
  CHECK(cudaMemcpy(scale, hs.data(), cols * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&part, size_t(2) * P * cols * 4));
  CHECK(cudaMalloc(&gpart, size_t(2) * groups * cols * 4));
  CHECK(cudaMalloc(&out, size_t(2) * cols * 4));
  CHECK(cudaMalloc(&counters, size_t(groups + 1) * 4));
  CHECK(cudaMemset(counters, 0, size_t(groups + 1) * 4));
  for (int k = 0; k < kSets; ++k) {
    hxf[k].resize(n), hdf[k].resize(n);
    for (size_t i = 0; i < n; ++i) {
      hx[i] = __float2bfloat16(urand() * 2.f + 0.3f), hd[i] = __float2bfloat16(urand());
      hxf[k][i] = __bfloat162float(hx[i]), hdf[k][i] = __bfloat162float(hd[i]);
    }
    __nv_bfloat16 *x, *dy, *y, *dx;
    float *mean, *rstd;
    CHECK(cudaMalloc(&x, n * 2));
    CHECK(cudaMalloc(&dy, n * 2));
    CHECK(cudaMalloc(&y, n * 2));
    CHECK(cudaMalloc(&dx, n * 2));
    CHECK(cudaMalloc(&mean, rows * 4));
    CHECK(cudaMalloc(&rstd, rows * 4));
    CHECK(cudaMemcpy(x, hx.data(), n * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dy, hd.data(), n * 2, cudaMemcpyHostToDevice));
    s[k] = Step{x, dy, y, dx, mean, rstd, scale, rows, cols, part, gpart, counters, out, G};
  }
  // Reference dscale/dbias of the last step's set, float64 (its statistics from x).
  const int lastset = (kSteps - 1) % kSets;
  std::vector<double> ref(2 * cols, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = &hxf[lastset][r * cols];
    const float* dr = &hdf[lastset][r * cols];
    double mu = 0, q = 0;
    for (int64_t c = 0; c < cols; ++c) mu += xr[c];
    mu /= cols;
    for (int64_t c = 0; c < cols; ++c) q += (xr[c] - mu) * (xr[c] - mu);
    const double rs = 1.0 / std::sqrt(q / cols + 1e-5);
    for (int64_t c = 0; c < cols; ++c) ref[c] += dr[c] * (xr[c] - mu) * rs, ref[cols + c] += dr[c];
  }
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  constexpr int CW = 4;
  const int sums_threads = int(std::min<int64_t>(1024, ((PB + 3) / 4 * CW + 31) / 32 * 32));
  std::printf("cols %lld rows %lld: backward %d blocks (%d an SM; the ticket's %d, %d an SM), forward %d, ticket groups of %d (%d)\n",
              (long long)cols, (long long)rows, PB, per_sm_b, PT, per_sm_t, PF, G, groups);
  std::vector<float> first_out;
  for (int v = kSums; v <= kNone; ++v) {
    CHECK(cudaMemset(out, 0xff, size_t(2) * cols * 4));  // poisoned
    cudaGraph_t graph;
    CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < kSteps; ++i) {
      const Step& t = s[i % kSets];
      fwd_kernel<W><<<PF, kThreads, 0, st>>>(t, v == kTicket || v == kTicketsOnly, groups + 1);
      CHECK(cudaGetLastError());
      if (v == kMemset) CHECK(cudaMemsetAsync(counters, 0, size_t(groups + 1) * 4, st));
      if (v == kNone) bwd_kernel<W, 0><<<PB, kThreads, 0, st>>>(t);
      else if (v < kMemset || v == kPartials) bwd_kernel<W, 1><<<PB, kThreads, 0, st>>>(t);
      else if (v == kTicketsOnly) bwd_kernel<W, 3><<<PT, kThreads, 0, st>>>(t);
      else bwd_kernel<W, 2><<<PT, kThreads, 0, st>>>(t);
      CHECK(cudaGetLastError());
      if (v == kSums) {
        sums_kernel<CW><<<dim3(unsigned((cols + CW - 1) / CW), 2), sums_threads, 0, st>>>(part, PB, cols, out, false);
        CHECK(cudaGetLastError());
      } else if (v == kSumsVec1 || v == kSumsVec2 || v == kSumsVec4) {
        const int c4 = v == kSumsVec1 ? 1 : (v == kSumsVec2 ? 2 : 4);
        const dim3 grid(unsigned((cols / 4 + c4 - 1) / c4), 2);
        const int threads = int(std::min<int64_t>(1024, ((PB + 3) / 4 * c4 + 31) / 32 * 32));
        if (c4 == 1) sums_vec_kernel<1><<<grid, threads, 0, st>>>(part, PB, cols, out);
        if (c4 == 2) sums_vec_kernel<2><<<grid, threads, 0, st>>>(part, PB, cols, out);
        if (c4 == 4) sums_vec_kernel<4><<<grid, threads, 0, st>>>(part, PB, cols, out);
        CHECK(cudaGetLastError());
      } else if (v == kEmpty) {
        empty_kernel<<<dim3(unsigned((cols + CW - 1) / CW), 2), sums_threads, 0, st>>>();
        CHECK(cudaGetLastError());
      } else if (v == kPdl) {
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(unsigned((cols + CW - 1) / CW), 2);
        cfg.blockDim = dim3(sums_threads);
        cfg.stream = st;
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        CHECK(cudaLaunchKernelEx(&cfg, sums_kernel<CW>, (const float*)part, int64_t(PB), cols, out, true));
      }
    }
    CHECK(cudaStreamEndCapture(st, &graph));
    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 3; ++i) CHECK(cudaGraphLaunch(exec, st));
    CHECK(cudaStreamSynchronize(st));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    std::vector<float> us;
    for (int rep = 0; rep < 7; ++rep) {
      CHECK(cudaEventRecord(e0, st));
      for (int i = 0; i < 10; ++i) CHECK(cudaGraphLaunch(exec, st));
      CHECK(cudaEventRecord(e1, st));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      us.push_back(ms * 1000.f / (10 * kSteps));
    }
    std::sort(us.begin(), us.end());
    std::vector<float> h(2 * cols);
    CHECK(cudaMemcpy(h.data(), out, h.size() * 4, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (int64_t c = 0; c < 2 * cols; ++c) num += (h[c] - ref[c]) * (h[c] - ref[c]), den += ref[c] * ref[c];
    bool same = true;
    if (v == kMemset) first_out = h;
    if (v == kTicket) same = std::memcmp(h.data(), first_out.data(), h.size() * 4) == 0;
    std::printf("  %-7s %7.2f us/step (min %.2f, max %.2f)", kNames[v], us[3], us[0], us[6]);
    if (v != kNone && v != kPartials && v != kTicketsOnly && v != kEmpty) std::printf("  |d - ref| / |ref| %.2e%s", std::sqrt(num / den), v == kTicket ? (same ? "  bitwise = memset" : "  DIFFERS from memset") : "");
    std::printf("\n");
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
  }
  // Counters back at zero after every variant (each launch's last blocks reset them).
  std::vector<unsigned> hc(groups + 1);
  CHECK(cudaMemcpy(hc.data(), counters, hc.size() * 4, cudaMemcpyDeviceToHost));
  bool zero = true;
  for (unsigned c : hc) zero = zero && c == 0u;
  std::printf("  counters back at zero: %s\n", zero ? "yes" : "NO");
  for (int k = 0; k < kSets; ++k) {
    CHECK(cudaFree((void*)s[k].x));
    CHECK(cudaFree((void*)s[k].dy));
    CHECK(cudaFree(s[k].y));
    CHECK(cudaFree(s[k].dx));
    CHECK(cudaFree(s[k].mean));
    CHECK(cudaFree(s[k].rstd));
  }
  CHECK(cudaFree(scale));
  CHECK(cudaFree(part));
  CHECK(cudaFree(gpart));
  CHECK(cudaFree(out));
  CHECK(cudaFree(counters));
  CHECK(cudaStreamDestroy(st));
}

int main(int argc, char** argv) {
  const int64_t rows = argc > 1 ? std::atoll(argv[1]) : 49152;
  const int G = argc > 2 ? std::atoi(argv[2]) : 0;  // blocks a ticket group (0: about sqrt(blocks))
  run_cols<4>(rows, G);
  run_cols<8>(rows, G);
  run_cols<16>(rows, G);
  return 0;
}

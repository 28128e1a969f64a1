// Standalone GPU check and timing of the cross-entropy kernels (not part of the build):
// the kernels of cuda_src/cross_entropy.cuh launched by their launchers, checked against a
// float64 host reference (V = 1..262144, masks, label smoothing, z-loss, ignored rows,
// misaligned pointers, the in-place backward) and timed with CUDA events against a
// 16-byte device copy of the same bytes (docs/perf-notes.md, "Cross-entropy").
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -I. -gencode arch=compute_90,code=sm_90 \
//        -o /tmp/ce_kernels benchmarks/cross_entropy_kernels.cu && /tmp/ce_kernels
// `/tmp/ce_kernels t`: timings only; `l`: the long-row timings only.
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <random>
#include <vector>
#include "cuda_src/cross_entropy.cuh"

using namespace jax_ops;
using namespace jax_ops::ce;

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); exit(1); } } while (0)

template <typename T>
struct Case {
  int64_t rows, cols;
  float ls, zl;
  bool masked, mask_per_row;
  std::vector<T> x; std::vector<int32_t> lab; std::vector<float> w; std::vector<uint8_t> mask;
};

template <typename T>
double check_case(int64_t rows, int64_t cols, float ls, float zl, int mask_mode, unsigned seed, bool offset_ptr) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 3.f);
  std::vector<T> x(size_t(rows * cols));
  for (auto& v : x) v = from_float<T>(nd(rng));
  std::vector<int32_t> lab(rows);
  std::vector<float> w(rows);
  for (int64_t r = 0; r < rows; ++r) {
    lab[r] = int32_t(rng() % cols);
    w[r] = (r % 7 == 3) ? 0.f : 0.5f + float(r % 3);
    if (r % 11 == 5) lab[r] = int32_t(cols);  // out of range: NaN loss
  }
  const int64_t mrows = mask_mode == 0 ? 0 : mask_mode == 1 ? 1 : rows;
  std::vector<uint8_t> mask(size_t(mrows * cols));
  for (auto& m : mask) m = (rng() % 5) != 0;
  T *dx, *dd; int32_t* dl; float *dw, *dloss, *dlse; uint8_t* dm = nullptr;
  CK(cudaMalloc(&dx, x.size() * sizeof(T) + 64));
  CK(cudaMalloc(&dd, x.size() * sizeof(T) + 64));
  CK(cudaMalloc(&dl, rows * 4)); CK(cudaMalloc(&dw, rows * 4)); CK(cudaMalloc(&dloss, rows * 4)); CK(cudaMalloc(&dlse, rows * 4));
  T* xp = offset_ptr ? dx + 1 : dx;  // misaligned: the PACK 1 kernels
  T* dp = offset_ptr ? dd + 1 : dd;
  CK(cudaMemcpy(xp, x.data(), x.size() * sizeof(T), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dl, lab.data(), rows * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dw, w.data(), rows * 4, cudaMemcpyHostToDevice));
  if (mrows) { CK(cudaMalloc(&dm, mask.size())); CK(cudaMemcpy(dm, mask.data(), mask.size(), cudaMemcpyHostToDevice)); }
  double worst = 0;
  for (int grad = 0; grad < 2; ++grad) {
    FwdArgs a{};
    a.logits = xp; a.labels = dl; a.weight = dw; a.mask = dm; a.mask_rows = mrows;
    a.loss = dloss; a.lse = dlse; a.dlogits = grad ? dp : nullptr; a.rows = rows; a.cols = cols;
    a.label_smoothing = ls; a.z_loss = zl;
    CK(launch_fwd<T>(a, 0));
    CK(cudaDeviceSynchronize());
    std::vector<float> loss(rows), lse(rows);
    std::vector<T> d(x.size());
    CK(cudaMemcpy(loss.data(), dloss, rows * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(lse.data(), dlse, rows * 4, cudaMemcpyDeviceToHost));
    if (grad) CK(cudaMemcpy(d.data(), dp, x.size() * sizeof(T), cudaMemcpyDeviceToHost));
    double num = 0, den = 0, gnum = 0, gden = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* k = mrows == 0 ? nullptr : mask.data() + (mrows == 1 ? 0 : r) * cols;
      double m = -INFINITY;
      for (int64_t c = 0; c < cols; ++c) if (!k || k[c]) m = std::fmax(m, to_float(x[r * cols + c]));
      double s = 0, sz = 0, n = 0;
      for (int64_t c = 0; c < cols; ++c) if (!k || k[c]) { double z = to_float(x[r * cols + c]); s += std::exp(z - m); sz += z; n += 1; }
      const double lsev = m + std::log(s);
      const bool inr = lab[r] >= 0 && lab[r] < cols;
      double L = (1 - ls) * (lsev - (inr ? to_float(x[r * cols + lab[r]]) : NAN)) + zl * lsev * lsev;
      if (ls > 0) L += ls * (lsev - sz / n);
      L = w[r] == 0 ? 0 : w[r] * L;
      if (std::isnan(L) != std::isnan(loss[r])) { printf("NaN mismatch row %ld: %g vs %g\n", long(r), L, loss[r]); return 1e9; }
      if (!std::isnan(L)) { num += (L - loss[r]) * (L - loss[r]); den += L * L; }
      if (w[r] != 0 && std::fabs(lse[r] - lsev) > 1e-5 * std::fabs(lsev) + 1e-5) { printf("lse row %ld %g vs %g\n", long(r), lse[r], lsev); return 1e9; }
      if (!grad) continue;
      for (int64_t c = 0; c < cols; ++c) {
        const double z = to_float(x[r * cols + c]);
        const bool kc = !k || k[c];
        double g = (kc ? std::exp(z - m) / s : 0) * (1 + 2 * zl * lsev) - (c == lab[r] ? 1 - ls : 0) - (kc ? ls / n : 0);
        g = w[r] == 0 ? 0 : w[r] * g;
        const double got = to_float(d[r * cols + c]);
        gnum += (g - got) * (g - got); gden += g * g;
      }
    }
    const double e1 = std::sqrt(num / std::fmax(den, 1e-300)), e2 = grad ? std::sqrt(gnum / std::fmax(gden, 1e-300)) : 0;
    worst = std::fmax(worst, std::fmax(e1, e2 * (sizeof(T) == 4 ? 1 : 1e-3)));
    printf("  check T%zu rows %ld cols %ld ls %.2f zl %.3f mask %d off %d grad %d: loss err %.2e, grad err %.2e\n",
           sizeof(T), long(rows), long(cols), ls, zl, mask_mode, int(offset_ptr), grad, e1, e2);
  }
  // backward: g == 1 rows untouched, others scaled (in place)
  {
    std::vector<float> g(rows);
    for (int64_t r = 0; r < rows; ++r) g[r] = (r % 2) ? 1.f : -0.5f;
    float* dg; CK(cudaMalloc(&dg, rows * 4)); CK(cudaMemcpy(dg, g.data(), rows * 4, cudaMemcpyHostToDevice));
    std::vector<T> before(x.size()), after(x.size());
    CK(cudaMemcpy(before.data(), dp, x.size() * sizeof(T), cudaMemcpyDeviceToHost));
    BwdArgs b{}; b.in = dp; b.out = dp; b.g = dg; b.rows = rows; b.cols = cols; b.skip_ones = true;
    CK(launch_bwd<T>(b, 0)); CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(after.data(), dp, x.size() * sizeof(T), cudaMemcpyDeviceToHost));
    long bad = 0;
    for (int64_t r = 0; r < rows; ++r) for (int64_t c = 0; c < cols; ++c) {
      const float want = to_float(from_float<T>(g[r] * to_float(before[r * cols + c])));
      const float got = to_float(after[r * cols + c]);
      if (!(want == got || (std::isnan(want) && std::isnan(got)))) ++bad;
    }
    printf("  bwd: %ld mismatches\n", bad);
    if (bad) worst = 1e9;
    CK(cudaFree(dg));
  }
  CK(cudaFree(dx)); CK(cudaFree(dd)); CK(cudaFree(dl)); CK(cudaFree(dw)); CK(cudaFree(dloss)); CK(cudaFree(dlse));
  if (dm) CK(cudaFree(dm));
  return worst;
}

__global__ void copy_kernel(const uint4* __restrict__ in, uint4* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) out[i] = in[i];
}

template <typename T>
void time_case(int64_t rows, int64_t cols) {
  const size_t n = size_t(rows * cols);
  T *dx, *dd; int32_t* dl; float *dw, *dloss, *dlse, *dg;
  CK(cudaMalloc(&dx, n * sizeof(T))); CK(cudaMalloc(&dd, n * sizeof(T)));
  CK(cudaMalloc(&dl, rows * 4)); CK(cudaMalloc(&dw, rows * 4)); CK(cudaMalloc(&dloss, rows * 4));
  CK(cudaMalloc(&dlse, rows * 4)); CK(cudaMalloc(&dg, rows * 4));
  std::vector<T> x(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 2.f);
  for (size_t i = 0; i < n; ++i) x[i] = from_float<T>(nd(rng));
  std::vector<int32_t> lab(rows); for (auto& l : lab) l = int32_t(rng() % cols);
  std::vector<float> w(rows, 1.f / rows), g(rows, 1.f);
  CK(cudaMemcpy(dx, x.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dl, lab.data(), rows * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dw, w.data(), rows * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dg, g.data(), rows * 4, cudaMemcpyHostToDevice));
  FwdArgs a{};
  a.logits = dx; a.labels = dl; a.weight = dw; a.loss = dloss; a.lse = dlse; a.dlogits = dd;
  a.rows = rows; a.cols = cols;
  BwdArgs b{}; b.in = dd; b.out = dd; b.g = dg; b.rows = rows; b.cols = cols; b.skip_ones = true;
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  auto timeit = [&](auto&& f) {
    for (int i = 0; i < 3; ++i) f();
    CK(cudaDeviceSynchronize());
    const int iters = 20;
    CK(cudaEventRecord(e0));
    for (int i = 0; i < iters; ++i) f();
    CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
    return ms * 1000.f / iters;
  };
  const float t_copy = timeit([&] { copy_kernel<<<132 * 8, 512>>>(reinterpret_cast<const uint4*>(dx), reinterpret_cast<uint4*>(dd), int64_t(n * sizeof(T) / 16)); });
  const float t_fwd_grad = timeit([&] { CK(launch_fwd<T>(a, 0)); });
  FwdArgs a0 = a; a0.dlogits = nullptr;
  const float t_fwd = timeit([&] { CK(launch_fwd<T>(a0, 0)); });
  const float t_bwd1 = timeit([&] { CK(launch_bwd<T>(b, 0)); });
  for (auto& v : g) v = 0.5f;
  CK(cudaMemcpy(dg, g.data(), rows * 4, cudaMemcpyHostToDevice));
  const float t_bwd = timeit([&] { CK(launch_bwd<T>(b, 0)); });
  const double gb = 2.0 * n * sizeof(T) / 1e9;
  printf("T%zu rows %ld cols %ld: copy(read+write X) %.1f us (%.0f GB/s) | fwd+grad %.1f us (%.2fx copy) | fwd only %.1f us | bwd g=1 %.1f us | bwd g=0.5 %.1f us\n",
         sizeof(T), long(rows), long(cols), t_copy, gb / (t_copy * 1e-6), t_fwd_grad, t_fwd_grad / t_copy, t_fwd, t_bwd1, t_bwd);
  CK(cudaFree(dx)); CK(cudaFree(dd)); CK(cudaFree(dl)); CK(cudaFree(dw)); CK(cudaFree(dloss)); CK(cudaFree(dlse)); CK(cudaFree(dg));
}

int main(int argc, char** argv) {
  const bool timing_only = argc > 1 && argv[1][0] == 't';
  if (argc > 1 && argv[1][0] == 'l') {  // long rows only
    time_case<bf16_t>(8192, 128256);
    time_case<bf16_t>(4096, 262144);
    time_case<bf16_t>(8192, 152064);
    return 0;
  }
  double worst = 0;
  if (!timing_only) {
    const int64_t colss[] = {1, 2, 3, 31, 33, 1000, 1031, 4100, 50257, 50304};
    unsigned seed = 1;
    for (int64_t cols : colss) {
      const int64_t rows = cols > 10000 ? 24 : 37;
      worst = std::fmax(worst, check_case<bf16_t>(rows, cols, 0.f, 0.f, 0, seed++, false));
      worst = std::fmax(worst, check_case<float>(rows, cols, 0.1f, 1e-3f, 2, seed++, false));
      worst = std::fmax(worst, check_case<f16_t>(rows, cols, 0.2f, 0.f, 1, seed++, cols % 2 == 1));
    }
    worst = std::fmax(worst, check_case<bf16_t>(4, 262144, 0.1f, 1e-4f, 0, seed++, false));
    worst = std::fmax(worst, check_case<float>(4, 131072, 0.f, 0.f, 1, seed++, false));
    printf("worst %.2e %s\n", worst, worst < 1e-5 ? "OK" : "FAIL");
  }
  time_case<bf16_t>(16384, 50304);
  time_case<bf16_t>(16384, 50257);
  time_case<bf16_t>(8192, 128256);
  time_case<bf16_t>(4096, 262144);
  time_case<bf16_t>(65536, 32000);
  time_case<float>(8192, 50304);
  time_case<bf16_t>(262144, 1024);
  return worst < 1e-5 ? 0 : 1;
}

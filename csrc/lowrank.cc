#include "lowrank.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "reduce.h"

namespace ringreduce {

namespace {

// One pass over each row of out for r <= 4 (the usual ranks), r passes beyond: either
// way out[i][j] is summed in k's order.
template <typename T, int R>
void product_rows(T* out, const T* p, const T* qt, int64_t n, int64_t m) {
  for (int64_t i = 0; i < n; ++i) {
    T* __restrict row = out + i * m;
    const T* pi = p + i * R;
    const T* __restrict q0 = qt;
    const T* __restrict q1 = qt + (R > 1 ? m : 0);
    const T* __restrict q2 = qt + (R > 2 ? 2 * m : 0);
    const T* __restrict q3 = qt + (R > 3 ? 3 * m : 0);
    const T p0 = pi[0], p1 = R > 1 ? pi[1] : 0, p2 = R > 2 ? pi[2] : 0, p3 = R > 3 ? pi[3] : 0;
    for (int64_t j = 0; j < m; ++j) {
      T s = p0 * q0[j];
      if (R > 1) s += p1 * q1[j];
      if (R > 2) s += p2 * q2[j];
      if (R > 3) s += p3 * q3[j];
      row[j] = s;
    }
  }
}

template <typename T>
void product(T* out, const T* p, const T* q, int64_t n, int64_t m, int64_t r) {
  // Q^T first, so that the inner loop runs along contiguous rows of both (and vectorises:
  // lanes are separate elements, each still summed in k's order).
  std::vector<T> qt(static_cast<size_t>(m * r));
  for (int64_t j = 0; j < m; ++j)
    for (int64_t k = 0; k < r; ++k) qt[k * m + j] = q[j * r + k];
  switch (r) {
    case 1: return product_rows<T, 1>(out, p, qt.data(), n, m);
    case 2: return product_rows<T, 2>(out, p, qt.data(), n, m);
    case 3: return product_rows<T, 3>(out, p, qt.data(), n, m);
    case 4: return product_rows<T, 4>(out, p, qt.data(), n, m);
  }
  for (int64_t i = 0; i < n; ++i) {
    T* __restrict row = out + i * m;
    const T* pi = p + i * r;
    const T* __restrict q0 = qt.data();
    const T p0 = pi[0];
    for (int64_t j = 0; j < m; ++j) row[j] = p0 * q0[j];
    for (int64_t k = 1; k < r; ++k) {
      const T pk = pi[k];
      const T* __restrict qk = qt.data() + k * m;
      for (int64_t j = 0; j < m; ++j) row[j] += pk * qk[j];
    }
  }
}

// sum of a[i] b[i] in numpy's pairwise order (its pairwise_sum): error growing with
// log n, not n, and a fixed order for each n. (Eight accumulators, not one, are what
// numpy uses; they also vectorise without reordering anything.)
double dot(const double* a, const double* b, int64_t n) {
  if (n < 8) {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
  }
  if (n <= 128) {
    double acc[8];
    for (int l = 0; l < 8; ++l) acc[l] = a[l] * b[l];
    int64_t i = 8;
    for (; i + 8 <= n; i += 8)
      for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
    double s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
  }
  int64_t half = n / 2;
  half -= half % 8;
  return dot(a, b, half) + dot(a + half, b + half, n - half);
}

// The largest magnitude of x[0..n) as a power of two's exponent e (2^(e-1) <= max <
// 2^e), or none for all 0s: multiplying by 2^-e is exact (bar subnormals, far below
// anything that counts next to the largest), keeps sums of squares from overflowing or
// underflowing, and leaves a Householder vector, and so Q, as it was.
bool exponent_of_largest(const double* x, int64_t n, int* e) {
  double top = 0;
  for (int64_t i = 0; i < n; ++i) top = std::fmax(top, std::fabs(x[i]));
  if (top == 0) return false;
  std::frexp(top, e);
  return true;
}

template <typename T>
void orthonormal(T* out, const T* p, int64_t n, int64_t r) {
  for (int64_t i = 0; i < n * r; ++i) {
    if (!std::isfinite(p[i])) {
      for (int64_t j = 0; j < n * r; ++j) out[j] = std::numeric_limits<T>::quiet_NaN();
      return;
    }
  }
  // a: p's columns, each contiguous; v: the Householder vectors (v[k][k] = 1, 0 above).
  std::vector<double> a(static_cast<size_t>(n * r)), v(static_cast<size_t>(n * r), 0.0);
  std::vector<double> tau(static_cast<size_t>(r), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < r; ++k) a[k * n + i] = static_cast<double>(p[i * r + k]);
  for (int64_t k = 0; k < r; ++k) {  // (float64's largest would overflow the reflections)
    int e;
    if (exponent_of_largest(a.data() + k * n, n, &e))
      for (int64_t i = 0; i < n; ++i) a[k * n + i] = std::ldexp(a[k * n + i], -e);
  }
  for (int64_t k = 0; k < r; ++k) {
    double* x = a.data() + k * n + k;  // column k, from the diagonal down
    const int64_t len = n - k;
    int e;
    if (!exponent_of_largest(x, len, &e)) continue;  // a column of 0s: H = I (tau 0)
    for (int64_t i = 0; i < len; ++i) x[i] = std::ldexp(x[i], -e);
    bool below = false;  // LAPACK's larfg: nothing below the diagonal, H = I
    for (int64_t i = 1; i < len && !below; ++i) below = x[i] != 0;
    if (!below) continue;
    const double squares = dot(x + 1, x + 1, len - 1);
    const double alpha = x[0];
    const double beta = -std::copysign(std::sqrt(alpha * alpha + squares), alpha);
    tau[k] = (beta - alpha) / beta;
    double* vk = v.data() + k * n + k;
    vk[0] = 1;
    const double divisor = alpha - beta;  // |alpha| + |beta| >= 1/2: no underflow
    for (int64_t i = 1; i < len; ++i) vk[i] = x[i] / divisor;
    for (int64_t j = k + 1; j < r; ++j) {  // H_k onto the columns after k
      double* y = a.data() + j * n + k;
      const double w = y[0] + dot(vk + 1, y + 1, len - 1);
      const double tw = tau[k] * w;
      for (int64_t i = 0; i < len; ++i) y[i] -= tw * vk[i];
    }
  }
  // Q = H_0 H_1 ... H_(r-1) times the first r columns of I, from the right (orgqr's
  // order). Column j is still e_j when H_k (k > j) comes, so H_k touches columns k.. only.
  std::vector<double> qcols(static_cast<size_t>(n * r), 0.0);
  for (int64_t k = 0; k < r; ++k) qcols[k * n + k] = 1;
  for (int64_t k = r - 1; k >= 0; --k) {
    if (tau[k] == 0) continue;
    const double* vk = v.data() + k * n + k;
    for (int64_t j = k; j < r; ++j) {
      double* y = qcols.data() + j * n + k;
      const double w = y[0] + dot(vk + 1, y + 1, n - k - 1);
      const double tw = tau[k] * w;
      for (int64_t i = 0; i < n - k; ++i) y[i] -= tw * vk[i];
    }
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < r; ++k) out[i * r + k] = static_cast<T>(qcols[k * n + i]);
}

}  // namespace

void low_rank_product(DType dtype, void* out, const void* p, const void* q, int64_t n,
                      int64_t m, int64_t r) {
  if (n <= 0 || m <= 0) return;
  if (r <= 0) throw std::invalid_argument("low_rank_product: r must be at least 1");
  [[maybe_unused]] IeeeSubnormals ieee;
  if (dtype == DType::Float32)
    product(static_cast<float*>(out), static_cast<const float*>(p),
            static_cast<const float*>(q), n, m, r);
  else if (dtype == DType::Float64)
    product(static_cast<double*>(out), static_cast<const double*>(p),
            static_cast<const double*>(q), n, m, r);
  else
    throw std::invalid_argument("low_rank_product: float32 or float64 only");
}

void orthonormal_columns(DType dtype, void* out, const void* p, int64_t n, int64_t r) {
  if (r <= 0) return;
  if (r > n) throw std::invalid_argument("orthonormal_columns: more columns than rows");
  [[maybe_unused]] IeeeSubnormals ieee;
  if (dtype == DType::Float32)
    orthonormal(static_cast<float*>(out), static_cast<const float*>(p), n, r);
  else if (dtype == DType::Float64)
    orthonormal(static_cast<double*>(out), static_cast<const double*>(p), n, r);
  else
    throw std::invalid_argument("orthonormal_columns: float32 or float64 only");
}

}  // namespace ringreduce

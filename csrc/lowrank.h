// PowerSGD's arithmetic on all-reduced factors (ringreduce/compression.py).
//
// Every rank computes these itself, from inputs that are the same on every rank, and
// applies the result to its own replica: so they must give the same bits on every CPU.
// BLAS and LAPACK do not (OpenBLAS picks FMA kernels on one CPU generation and not on
// the other, and its blocking with them). Here each output element is made by one fixed
// sequence of correctly rounded operations (no FMA contraction: setup.py's
// -ffp-contract=off), whatever the CPU, the vector width or the compiler.
#pragma once

#include <cstdint>

#include "dtype.h"

namespace ringreduce {

// out (n x m) = p (n x r) times the transpose of q (m x r), all C-contiguous, of dtype
// Float32 or Float64. out[i][j] = ((p[i][0] q[j][0] + p[i][1] q[j][1]) + ...) in the
// dtype, each product rounded: sgemm's precision.
void low_rank_product(DType dtype, void* out, const void* p, const void* q, int64_t n,
                      int64_t m, int64_t r);

// out (n x r, r <= n) = the Q of p's QR (C-contiguous, Float32 or Float64), by
// Householder reflections with LAPACK's conventions (geqrf and orgqr): the same columns,
// up to rounding, as numpy.linalg.qr's; a column of p that is 0, or that depends on the
// columns before it, gives a unit column orthogonal to them. Computed in double, and
// rounded to the dtype once. A NaN or inf anywhere in p makes every element of out NaN.
void orthonormal_columns(DType dtype, void* out, const void* p, int64_t n, int64_t r);

}  // namespace ringreduce

// upperGemmBf16: the product the reference's error bounds take their magnitudes from
// (tools/reference.cc): sgemm's driver (sim/gemm_driver.h) over pairs of bf16 values, faster than
// sgemm through AVX512-BF16 (an instruction does two FMAs' work; 1.7x on Zen 5). Not a GEMM for
// results: it rounds its operands up, and runs only on cores with AVX512-BF16.
#pragma once

#include <cstdint>

#include "sim/host_pool.h"
#include "sim/sgemm.h"

namespace tpsim::sim {

// c ≈ a·b for nonnegative a and b. Each value of a and b is rounded toward +Inf to bf16 (a
// positive one below 2^-126 up to 2^-126); their products, exact, are summed in fp32 in sgemm's
// order (an FMA chain per K block of 256, pairs of K steps odd first, then one addition per later
// block), each addition rounded to nearest, except that a chain's result below 2^-126 becomes 0. c
// is row-major (M, N) with unit column stride. Runs where upperGemmBf16Runs().
bool upperGemmBf16Runs();
void upperGemmBf16(std::int64_t m, std::int64_t n, std::int64_t k, FloatMatrix a, FloatMatrix b, float* c,
                   std::int64_t cRowStride, HostPool* pool);

}  // namespace tpsim::sim

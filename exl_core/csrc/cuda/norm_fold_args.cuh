// The arguments of the RMSNorm folded into the decode GEMMs (Mats::nf; the device code is norm_fold_device.cuh),
// without torch headers (standalone probes build the kernels that take them).
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

namespace exl_mma {

// The residual add and the RMSNorm folded into the decode GEMMs (norm_fold_device.cuh; all zero: a plain GEMM).
struct NormFold {
  float* ss_out;              // producer (qgemm_kslice, one matrix): [tiles, M] per output tile and row, the sum of
                              // squares of the values stored, or null
  const float* ss_in;         // consumer: [ss_tiles, M], a producer's ss_out over x's columns
  const __half* nw;           // consumer: the RMSNorm weight [K] (null: x is staged as it is)
  int ss_tiles;
  float eps;
  int add;                    // producer: y += the product (y is the residual stream; one thread reads and writes
                              // each value)
  // The extended copy (ops/norm_fold.py): the producer also stores each value of y at its places in the consumer's
  // extended act-order (ext_pos [N, 2], -1: none) in ext [M, ext_ld], so a consumer with a permutation and extra rows
  // reads x in its own order and folds the norm in; its mean divides by count, the residual's width (0: x's K).
  __half* ext;
  const int32_t* ext_pos;
  int64_t ext_ld;
  int64_t count;
};

}  // namespace exl_mma

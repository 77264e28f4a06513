// tandem's quantized projections: GGUF block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, Q4_K, Q5_K, Q6_K) and
// per-channel int8 (I8), kept quantized in memory and multiplied with integer dot products.
//
//   quant_pack(raw, fmt, N, K)        GGUF rows [N, K / QK * bytes] -> the kernel layout below (lossless)
//   quant_pack_i8(q, scales)          int8 [N, K] + float32 scales [N] -> the I8 layout
//   quant_linear(x, packed, fmts, ns, bias, isa)   y [M, sum(ns)] = x [M, K] @ W^T over one or more packed segments
//   quant_grouped(x, packed, fmts, ns, cols, row0, row1, biases, isa)   a layer's experts in one call: segment i
//                                     multiplies rows [row0_i, row1_i) of x into columns [cols_i, cols_i + ns_i)
//   quant_rows(packed, fmt, N, K, ids)             rows of W dequantized to float32 (embedding lookups, tests)
//   quant_set_narrow_kquant_tiles(on) -> previous  K-quant tiles of one or two rows over short rows take one lane
//                                     group (a speed choice per CPU, gemm_plan.decode_tile_plan; the same results)
//
// As llama.cpp does, activations are quantized per row to int8 on the fly: blocks of 32 with an fp16-rounded scale
// (its Q8_0 / Q8_1) for the 32-blocks formats, blocks of 256 with a float scale and sums of 16 (its Q8_K) for the
// K-quants; every block then reduces to an integer dot product, scaled once per block (super-block for K-quants).
//
// Layout: 16 rows of W (16 output columns of y, "lanes") are interleaved so that one 64-byte load holds 4
// consecutive k of each lane: a "chunk". One `vpdpbusd` (AVX512-VNNI) multiplies a chunk by 4 broadcast activation
// bytes and adds the 4 products into each lane's int32. Nibble formats put k 8c..8c+3 in the low nibbles of chunk c
// and k 8c+4..8c+7 in its high nibbles; a 5th bit is a bit-plane, one 64-bit mask per half-chunk, added with
// a masked byte add (Q6_K: 2-bit fields, see put_q6_high_bits). Per 16-row group and block: the scales (fp16, as
// stored), then the masks, then the chunks:
//   Q8_0  d[16] f16 | 8 chunks of s8                               544 B = 16 x 34 (the GGUF bytes)
//   Q4_0  d[16]     | 4 nibble chunks                              288 B = 16 x 18
//   Q4_1  d, m      | 4 nibble chunks                              320 B = 16 x 20
//   Q5_0  d         | 4 x (lo, hi) u64 masks | 4 nibble chunks     352 B = 16 x 22
//   Q5_1  d, m      | masks | chunks                               384 B = 16 x 24
//   MXFP4 e[16] u8  | 4 nibble chunks of FP4 codes                 272 B = 16 x 17 (the GGUF bytes)
//   Q4_K  d, dmin   | 8 x (6-bit scales, mins as bytes [16] each | 4 nibble chunks)        2368 B (GGUF 2304)
//   Q5_K  like Q4_K, with each sub-block's 4 x (lo, hi) masks before its chunks             2880 B (GGUF 2816)
//   Q6_K  d         | 16 x (s8 scales [16] | 64 B plane of 2-bit high parts | 2 chunks)       3360 B = 16 x 210
//   I8    (per group: 16 float32 scales) | per block of 32: 8 chunks of s8                 512 B + 64 B per group
// Q4_K / Q5_K unpack their 12-byte scale fields to bytes (+2.8 %) so a lane's scale is one byte load away.
// MXFP4 (gpt-oss's experts) keeps each block's E8M0 scale byte e as stored: fp16 cannot hold 2^(e - 128) for most e
// (its range is 2^-24..2^15) and float32 would make the block 320 B (+18 %), while the byte becomes the exact float32
// in three integer ops per 16 lanes (exponent field e - 1; the two subnormals e < 2 by a shift, see e8m0x16). A code
// becomes its doubled E2M1 value plus 12 (0..24, unsigned) through a 16-entry byte shuffle, so its block is an exact
// integer dot product like Q4_0's, 12 * sum(a) taken off once per block.
//
// ISA: the kernels are written once over a 16-lane vector type; `Avx512` (VNNI, 512-bit) and `Avx2` (256-bit pairs,
// vpmaddubsw + vpmaddwd, the same per-lane arithmetic) implement it, and `quant_linear` picks one at run time
// (`isa` argument: 0 best available, 1 AVX2, 2 AVX512-VNNI). Results are bit-identical between the two.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"

#define TQ_INLINE inline __attribute__((always_inline))

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TQ_HAS_AVX512 1
#else
#define TQ_HAS_AVX512 0
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TQ_HAS_AVX2 1
#else
#define TQ_HAS_AVX2 0
#endif

namespace {

using at::Tensor;

constexpr int kLanes = 16;

enum Fmt : int64_t {
  kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ5_0 = 3, kQ5_1 = 4, kQ4_K = 5, kQ5_K = 6, kQ6_K = 7, kI8 = 8, kMXFP4 = 9
};
constexpr int kNumFmts = 10;

struct FmtInfo {
  int qk;         // k per block
  int raw;        // GGUF bytes per block of one row (I8: bytes of int8 per block)
  int head;       // packed bytes per 16-row group before its blocks
  int blk;        // packed bytes per (16-row group, block)
  bool kquant;    // activations as 256-blocks (Q8_K) rather than 32-blocks (Q8_0 / Q8_1)
};

inline FmtInfo fmt_info(int64_t f) {
  switch (f) {
    case kQ8_0: return {32, 34, 0, 32 + 512, false};
    case kQ4_0: return {32, 18, 0, 32 + 256, false};
    case kQ4_1: return {32, 20, 0, 64 + 256, false};
    case kQ5_0: return {32, 22, 0, 32 + 64 + 256, false};
    case kQ5_1: return {32, 24, 0, 64 + 64 + 256, false};
    case kQ4_K: return {256, 144, 0, 64 + 256 + 2048, true};
    case kQ5_K: return {256, 176, 0, 64 + 256 + 512 + 2048, true};
    case kQ6_K: return {256, 210, 0, 32 + 256 + 1024 + 2048, true};
    case kI8: return {32, 32, 64, 512, false};
    case kMXFP4: return {32, 17, 0, 16 + 256, false};
    default: TORCH_CHECK(false, "quant: unknown format id ", f);
  }
}

inline float h2f(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
inline float f16_round(float v) { return static_cast<float>(static_cast<c10::Half>(v)); }
inline uint16_t rd16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t rd32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
inline uint64_t rd64(const uint8_t* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }
inline void wr16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }
inline void wr64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }

// MXFP4: a code's E2M1 value doubled (ggml's kvalues_mxfp4), and the same plus 12 (the kernels' unsigned operand)
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr int kMxfp4Offset = 12;
alignas(16) constexpr int8_t kMxfp4Unsigned[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
// 2^(e - 128), exact for every byte e: half the E8M0 scale 2^(e - 127), undoing the doubled values
// (ggml_e8m0_to_fp32_half: the float with exponent field e - 1, or the subnormals 2^-128 / 2^-127 for e = 0 / 1)
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

// ------------------------------------------------------------------------------------------------------------------
// One block of one row, decoded from GGUF bytes: integer quants q[k] and the block's scales. The dequantized value is
//   32-blocks: d * q + m (Q4_0: q in 0..15, m = -8 d; Q8_0: q signed, m = 0; ...); K-quants per sub-block s:
//   d * sc[s] * q - dmin * mn[s] (Q6_K: d * sc[s] * (q - 32), sc signed); MXFP4: e8m0_half(d) * kMxfp4Values[q]
//   (d the E8M0 byte, q the 4-bit code).
// ------------------------------------------------------------------------------------------------------------------
struct RawBlock {
  int16_t q[256];
  uint16_t d, m;      // fp16 bits (m: Q4_1 / Q5_1 min, K-quants dmin)
  int16_t sc[16], mn[16];
};

inline void k4_scale_min(int j, const uint8_t* s, int16_t& sc, int16_t& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void decode_raw(int64_t f, const uint8_t* b, RawBlock& o) {
  switch (f) {
    case kQ8_0:
      o.d = rd16(b);
      for (int i = 0; i < 32; ++i) o.q[i] = static_cast<int8_t>(b[2 + i]);
      break;
    case kMXFP4:
      o.d = b[0];
      for (int i = 0; i < 16; ++i) {
        o.q[i] = b[1 + i] & 15;
        o.q[i + 16] = b[1 + i] >> 4;
      }
      break;
    case kQ4_0:
    case kQ4_1: {
      o.d = rd16(b);
      const int off = f == kQ4_1 ? 4 : 2;
      o.m = f == kQ4_1 ? rd16(b + 2) : 0;
      for (int i = 0; i < 16; ++i) {
        o.q[i] = b[off + i] & 15;
        o.q[i + 16] = b[off + i] >> 4;
      }
      break;
    }
    case kQ5_0:
    case kQ5_1: {
      o.d = rd16(b);
      const int off = f == kQ5_1 ? 4 : 2;
      o.m = f == kQ5_1 ? rd16(b + 2) : 0;
      const uint32_t qh = rd32(b + off);
      for (int i = 0; i < 16; ++i) {
        o.q[i] = (b[off + 4 + i] & 15) | (((qh >> i) & 1) << 4);
        o.q[i + 16] = (b[off + 4 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
      }
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      o.d = rd16(b);
      o.m = rd16(b + 2);
      for (int j = 0; j < 8; ++j) k4_scale_min(j, b + 4, o.sc[j], o.mn[j]);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (f == kQ5_K ? 48 : 16);
      for (int p = 0; p < 4; ++p) {
        for (int i = 0; i < 32; ++i) {
          int lo = qs[32 * p + i] & 15, hi = qs[32 * p + i] >> 4;
          if (f == kQ5_K) {
            lo |= ((qh[i] >> (2 * p)) & 1) << 4;
            hi |= ((qh[i] >> (2 * p + 1)) & 1) << 4;
          }
          o.q[64 * p + i] = lo;
          o.q[64 * p + 32 + i] = hi;
        }
      }
      break;
    }
    case kQ6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      for (int j = 0; j < 16; ++j) o.sc[j] = static_cast<int8_t>(b[192 + j]);
      o.d = rd16(b + 208);
      for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < 64; ++i) {
          o.q[h * 128 + i] = ql[h * 64 + i] & 15;
          o.q[h * 128 + 64 + i] = ql[h * 64 + i] >> 4;
        }
        for (int s4 = 0; s4 < 4; ++s4)
          for (int i = 0; i < 32; ++i) o.q[h * 128 + s4 * 32 + i] |= ((qh[h * 32 + i] >> (2 * s4)) & 3) << 4;
      }
      break;
    }
    default: TORCH_CHECK(false, "quant: unknown format id ", f);
  }
}

// ---- packing: 16 decoded rows of one block -> the packed group-block ----
// Sub-blocks are stored whole, in the order a kernel reads them (one sequential stream per lane group: with the
// scales, masks and chunks of a block in separate runs, Q6_K ran 1.4x slower at one row, measured):
constexpr int kQ6Sub = 16 + 64 + 128;      // Q6_K, 16 k: scales, high-bit plane, 2 chunks
constexpr int kK4Sub = 16 + 16 + 256;      // Q4_K, 32 k: scales, mins, 4 chunks
constexpr int kK5Sub = 16 + 16 + 64 + 256;  // Q5_K, 32 k: scales, mins, masks, 4 chunks

// chunk c at dst + (c / per) * sub_stride + (c % per) * 64 (all contiguous by default)
inline void put_nibble_chunks(uint8_t* dst, const RawBlock* r, int nchunks, int per = 1 << 20, int sub_stride = 0) {
  for (int c = 0; c < nchunks; ++c)
    for (int j = 0; j < kLanes; ++j)
      for (int i = 0; i < 4; ++i)
        dst[(c / per) * sub_stride + (c % per) * 64 + j * 4 + i] =
            static_cast<uint8_t>((r[j].q[8 * c + i] & 15) | ((r[j].q[8 * c + 4 + i] & 15) << 4));
}

// bit `bit` of every q, as one u64 per half-chunk (bit 4j + i = lane j, byte i); chunk c's pair at
// dst + (c / per) * sub_stride + (c % per) * stride + off
inline void put_bit_masks(uint8_t* dst, const RawBlock* r, int nchunks, int bit, int stride, int off, int per = 1 << 20,
                          int sub_stride = 0) {
  for (int c = 0; c < nchunks; ++c) {
    uint64_t lo = 0, hi = 0;
    for (int j = 0; j < kLanes; ++j)
      for (int i = 0; i < 4; ++i) {
        lo |= static_cast<uint64_t>((r[j].q[8 * c + i] >> bit) & 1) << (4 * j + i);
        hi |= static_cast<uint64_t>((r[j].q[8 * c + 4 + i] >> bit) & 1) << (4 * j + i);
      }
    uint8_t* at = dst + (c / per) * sub_stride + (c % per) * stride + off;
    wr64(at, lo);
    wr64(at + 8, hi);
  }
}

// Q6_K's two high bits: per sub-block of 16 (chunks 2s, 2s + 1) one 64-byte plane, byte 4j + i holding four 2-bit
// fields: chunk 2s low half, its high half, chunk 2s + 1 low half, its high half (bits 0-1, 2-3, 4-5, 6-7). A field is
// brought to bits 4-5 with one shift and one mask, then merged under the nibble with one `vpternlogd`.
inline void put_q6_high_bits(uint8_t* dst, const RawBlock* r) {
  for (int s = 0; s < 16; ++s)
    for (int j = 0; j < kLanes; ++j)
      for (int i = 0; i < 4; ++i) {
        int byte = 0;
        for (int f = 0; f < 4; ++f) byte |= ((r[j].q[16 * s + 8 * (f / 2) + 4 * (f % 2) + i] >> 4) & 3) << (2 * f);
        dst[s * kQ6Sub + j * 4 + i] = static_cast<uint8_t>(byte);
      }
}

void pack_group_block(int64_t f, const RawBlock* r, uint8_t* dst) {
  if (f == kMXFP4) {  // the 16 lanes' scale bytes as stored, then the codes as Q4_0's nibbles
    for (int j = 0; j < kLanes; ++j) dst[j] = static_cast<uint8_t>(r[j].d);
    put_nibble_chunks(dst + 16, r, 4);
    return;
  }
  for (int j = 0; j < kLanes; ++j) wr16(dst + 2 * j, r[j].d);
  switch (f) {
    case kQ8_0:
      for (int c = 0; c < 8; ++c)
        for (int j = 0; j < kLanes; ++j)
          for (int i = 0; i < 4; ++i) dst[32 + c * 64 + j * 4 + i] = static_cast<uint8_t>(r[j].q[4 * c + i]);
      break;
    case kQ4_0: put_nibble_chunks(dst + 32, r, 4); break;
    case kQ4_1:
      for (int j = 0; j < kLanes; ++j) wr16(dst + 32 + 2 * j, r[j].m);
      put_nibble_chunks(dst + 64, r, 4);
      break;
    case kQ5_0:
      put_bit_masks(dst + 32, r, 4, 4, 16, 0);
      put_nibble_chunks(dst + 96, r, 4);
      break;
    case kQ5_1:
      for (int j = 0; j < kLanes; ++j) wr16(dst + 32 + 2 * j, r[j].m);
      put_bit_masks(dst + 64, r, 4, 4, 16, 0);
      put_nibble_chunks(dst + 128, r, 4);
      break;
    case kQ4_K:
    case kQ5_K: {  // per sub-block of 32: its scales, its mins, (Q5_K) its masks, its 4 chunks (read in this order)
      const int sub = f == kQ5_K ? kK5Sub : kK4Sub;
      for (int j = 0; j < kLanes; ++j) wr16(dst + 32 + 2 * j, r[j].m);
      for (int s = 0; s < 8; ++s)
        for (int j = 0; j < kLanes; ++j) {
          dst[64 + s * sub + j] = static_cast<uint8_t>(r[j].sc[s]);
          dst[64 + s * sub + 16 + j] = static_cast<uint8_t>(r[j].mn[s]);
        }
      if (f == kQ5_K) put_bit_masks(dst + 64 + 32, r, 32, 4, 16, 0, 4, sub);
      put_nibble_chunks(dst + 64 + sub - 256, r, 32, 4, sub);
      break;
    }
    case kQ6_K:  // per sub-block of 16: its scales, its high-bit plane, its two nibble chunks (read in this order)
      for (int s = 0; s < 16; ++s) {
        uint8_t* sub = dst + 32 + s * kQ6Sub;
        for (int j = 0; j < kLanes; ++j) sub[j] = static_cast<uint8_t>(r[j].sc[s]);
      }
      put_q6_high_bits(dst + 32 + 16, r);
      put_nibble_chunks(dst + 32 + 80, r, 32, 2, kQ6Sub);
      break;
    default: TORCH_CHECK(false, "quant: unknown format id ", f);
  }
}

Tensor quant_pack(const Tensor& raw, int64_t fmt, int64_t N, int64_t K) {
  const FmtInfo fi = fmt_info(fmt);
  TORCH_CHECK(fmt != kI8, "quant_pack: use quant_pack_i8 for I8");
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.dim() == 2, "quant_pack: raw must be contiguous uint8 [N, row_bytes]");
  TORCH_CHECK(K % fi.qk == 0, "quant_pack: K=", K, " is not a multiple of the block size ", fi.qk);
  const int64_t nblk = K / fi.qk, G = (N + kLanes - 1) / kLanes;
  TORCH_CHECK(raw.size(0) == N && raw.size(1) == nblk * fi.raw, "quant_pack: raw is [", raw.size(0), ", ", raw.size(1), "], expected [", N, ", ", nblk * fi.raw, "]");
  const int64_t gbytes = fi.head + nblk * fi.blk;
  Tensor out = at::empty({G, gbytes}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    std::vector<RawBlock> rows(kLanes);
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t b = 0; b < nblk; ++b) {
        for (int j = 0; j < kLanes; ++j) {
          const int64_t n = g * kLanes + j;
          if (n < N) {
            decode_raw(fmt, src + n * nblk * fi.raw + b * fi.raw, rows[j]);
          } else {
            std::memset(&rows[j], 0, sizeof(RawBlock));  // padding lanes: zero scales, zero quants
          }
        }
        pack_group_block(fmt, rows.data(), dst + g * gbytes + fi.head + b * fi.blk);
      }
    }
  });
  return out;
}

Tensor quant_pack_i8(const Tensor& q, const Tensor& scales) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.dim() == 2, "quant_pack_i8: q must be contiguous int8 [N, K]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == q.size(0), "quant_pack_i8: scales must be float32 [N]");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(K % 32 == 0, "quant_pack_i8: K must be a multiple of 32, got ", K);
  const int64_t nblk = K / 32, G = (N + kLanes - 1) / kLanes, gbytes = 64 + nblk * 512;
  Tensor out = at::zeros({G, gbytes}, q.options().dtype(at::kByte));
  const int8_t* src = q.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      uint8_t* gp = dst + g * gbytes;
      for (int j = 0; j < kLanes && g * kLanes + j < N; ++j) {
        const int64_t n = g * kLanes + j;
        std::memcpy(gp + 4 * j, sc + n, 4);
        for (int64_t b = 0; b < nblk; ++b)
          for (int c = 0; c < 8; ++c)
            std::memcpy(gp + 64 + b * 512 + c * 64 + j * 4, src + n * K + b * 32 + 4 * c, 4);
      }
    }
  });
  return out;
}

// ---- dequantization of packed rows (scalar; embedding lookups and checks) ----
inline int nib(const uint8_t* chunks, int k, int j) {  // quant k (in block) of lane j from nibble chunks
  const int c = k / 8, w = k % 8;
  const uint8_t byte = chunks[c * 64 + j * 4 + (w & 3)];
  return w < 4 ? (byte & 15) : (byte >> 4);
}
inline int mask_bit(const uint8_t* masks, int stride, int off, int k, int j) {
  const int c = k / 8, w = k % 8;
  const uint64_t m = rd64(masks + c * stride + off + (w < 4 ? 0 : 8));
  return static_cast<int>((m >> (4 * j + (w & 3))) & 1);
}

void dequant_lane(int64_t f, const uint8_t* gp, int64_t nblk, int j, float* out) {
  const FmtInfo fi = fmt_info(f);
  if (f == kI8) {
    float s;
    std::memcpy(&s, gp + 4 * j, 4);
    for (int64_t b = 0; b < nblk; ++b)
      for (int k = 0; k < 32; ++k) out[b * 32 + k] = s * static_cast<int8_t>(gp[64 + b * 512 + (k / 4) * 64 + j * 4 + k % 4]);
    return;
  }
  for (int64_t b = 0; b < nblk; ++b) {
    const uint8_t* p = gp + b * fi.blk;
    float* o = out + b * fi.qk;
    if (f == kMXFP4) {
      const float d = e8m0_half(p[j]);
      for (int k = 0; k < 32; ++k) o[k] = static_cast<float>(kMxfp4Values[nib(p + 16, k, j)]) * d;
      continue;
    }
    const float d = h2f(rd16(p + 2 * j));
    switch (f) {
      case kQ8_0:
        for (int k = 0; k < 32; ++k) o[k] = d * static_cast<float>(static_cast<int8_t>(p[32 + (k / 4) * 64 + j * 4 + k % 4]));
        break;
      case kQ4_0:
        for (int k = 0; k < 32; ++k) o[k] = d * static_cast<float>(nib(p + 32, k, j) - 8);
        break;
      case kQ4_1: {
        const float m = h2f(rd16(p + 32 + 2 * j));
        for (int k = 0; k < 32; ++k) o[k] = d * static_cast<float>(nib(p + 64, k, j)) + m;
        break;
      }
      case kQ5_0:
        for (int k = 0; k < 32; ++k) o[k] = d * static_cast<float>((nib(p + 96, k, j) | (mask_bit(p + 32, 16, 0, k, j) << 4)) - 16);
        break;
      case kQ5_1: {
        const float m = h2f(rd16(p + 32 + 2 * j));
        for (int k = 0; k < 32; ++k) o[k] = d * static_cast<float>(nib(p + 128, k, j) | (mask_bit(p + 64, 16, 0, k, j) << 4)) + m;
        break;
      }
      case kQ4_K:
      case kQ5_K: {
        const float dmin = h2f(rd16(p + 32 + 2 * j));
        const int sub_bytes = f == kQ5_K ? kK5Sub : kK4Sub;
        for (int k = 0; k < 256; ++k) {
          const uint8_t* sub = p + 64 + (k / 32) * sub_bytes;
          int q = nib(sub + sub_bytes - 256, k % 32, j);
          if (f == kQ5_K) q |= mask_bit(sub + 32, 16, 0, k % 32, j) << 4;
          o[k] = (d * static_cast<float>(sub[j])) * static_cast<float>(q) - dmin * static_cast<float>(sub[16 + j]);
        }
        break;
      }
      case kQ6_K:
        for (int k = 0; k < 256; ++k) {
          const int field = (k % 16) / 4;  // see put_q6_high_bits
          const uint8_t* sub = p + 32 + (k / 16) * kQ6Sub;
          const int high = (sub[16 + j * 4 + k % 4] >> (2 * field)) & 3;
          const int q = nib(sub + 80, k % 16, j) | (high << 4);
          o[k] = (d * static_cast<float>(static_cast<int8_t>(sub[j]))) * static_cast<float>(q - 32);
        }
        break;
      default: TORCH_CHECK(false, "quant: unknown format id ", f);
    }
  }
}

Tensor quant_rows(const Tensor& packed, int64_t fmt, int64_t N, int64_t K, const Tensor& ids) {
  const FmtInfo fi = fmt_info(fmt);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2, "quant_rows: packed must be contiguous uint8 [G, bytes]");
  const int64_t nblk = K / fi.qk, gbytes = fi.head + nblk * fi.blk;
  TORCH_CHECK(packed.size(1) == gbytes && packed.size(0) * kLanes >= N, "quant_rows: packed shape does not match N, K");
  Tensor idx = ids.to(at::kLong).contiguous();
  const int64_t R = idx.numel();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < N, "quant_rows: row id ", ip[r], " out of range [0, ", N, ")");
  Tensor out = at::empty({R, K}, packed.options().dtype(at::kFloat));
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, K / 64)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = ip[r];
      const uint8_t* gp = pp + (n / kLanes) * gbytes;
      dequant_lane(fmt, fmt == kI8 ? gp : gp + fi.head, nblk, static_cast<int>(n % kLanes), op + r * K);
    }
  });
  return out;
}

// ------------------------------------------------------------------------------------------------------------------
// Activation quantization (per row), as llama.cpp's x86 code:
//   32-blocks (Q8_0 / Q8_1): d = amax / 127 stored as fp16, q = round-to-even(x * 127 / amax), s = fp16(d * sum q);
//   256-blocks (Q8_K): the value of largest magnitude `max`, iscale = -127 / max, q = min(127, round-to-even(iscale x)),
//   d = 1 / iscale (float), sums of each 16.
// ------------------------------------------------------------------------------------------------------------------
struct Act {
  int64_t K = 0;
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> d;      // [M, K / QK]
  std::vector<float> s;      // [M, K / 32]  (32-blocks)
  std::vector<int32_t> sum;  // [M, K / 32] sums of 32 (32-blocks) or [M, K / 16] sums of 16 (256-blocks)
  const int8_t* row(int64_t r) const { return q.data() + r * K; }
};

template <typename S>
inline float ldf(const S* p, int64_t i) { return static_cast<float>(p[i]); }

template <typename S>
void quantize_rows_32(const S* x, int64_t M, int64_t K, Act& a) {
  const int64_t nb = K / 32;
  a.K = K;
  a.q.resize(M * K);
  a.d.resize(M * nb);
  a.s.resize(M * nb);
  a.sum.resize(M * nb);
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const S* xb = x + r * K + b * 32;
        float amax = 0.f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(ldf(xb, i)));
        const float d = amax / 127.f;
        const float id = amax != 0.f ? 127.f / amax : 0.f;
        int8_t* q = a.q.data() + r * K + b * 32;
        int32_t sum = 0;
        for (int i = 0; i < 32; ++i) {
          const int v = static_cast<int>(std::nearbyint(ldf(xb, i) * id));
          q[i] = static_cast<int8_t>(v);
          sum += v;
        }
        a.d[r * nb + b] = f16_round(d);
        a.s[r * nb + b] = f16_round(d * static_cast<float>(sum));
        a.sum[r * nb + b] = sum;
      }
  });
}

inline int nearest_int(float fval) {  // llama.cpp's: round half to even through the float mantissa
  float val = fval + 12582912.f;
  int i;
  std::memcpy(&i, &val, sizeof(int));
  return (i & 0x007fffff) - 0x00400000;
}

template <typename S>
void quantize_rows_256(const S* x, int64_t M, int64_t K, Act& a) {
  const int64_t nb = K / 256;
  a.K = K;
  a.q.resize(M * K);
  a.d.resize(M * nb);
  a.sum.resize(M * K / 16);
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const S* xb = x + r * K + b * 256;
        int8_t* q = a.q.data() + r * K + b * 256;
        int32_t* bs = a.sum.data() + r * (K / 16) + b * 16;
        float amax = 0.f, mx = 0.f;
        for (int i = 0; i < 256; ++i) {
          const float ax = std::fabs(ldf(xb, i));
          if (ax > amax) {
            amax = ax;
            mx = ldf(xb, i);
          }
        }
        if (amax == 0.f) {
          a.d[r * nb + b] = 0.f;
          std::memset(q, 0, 256);
          std::fill(bs, bs + 16, 0);
          continue;
        }
        const float iscale = -127.f / mx;
        for (int j = 0; j < 16; ++j) {
          int32_t sum = 0;
          for (int i = 0; i < 16; ++i) {
            const int v = std::min(127, nearest_int(iscale * ldf(xb, 16 * j + i)));
            q[16 * j + i] = static_cast<int8_t>(v);
            sum += v;
          }
          bs[j] = sum;
        }
        a.d[r * nb + b] = 1.f / iscale;
      }
  });
}

// ------------------------------------------------------------------------------------------------------------------
// The two ISAs behind one 16-lane interface: VI holds 16 int32 lanes (or 64 bytes as 16 x 4), VF 16 floats.
// dot(acc, u, s): per lane, acc += sum of the 4 products u8 x s8 of its 4 bytes (vpdpbusd; AVX2: vpmaddubsw, whose
// int16 pair sums cannot saturate here (|u| <= 128 only with the sign trick, then |s| <= 127), then vpmaddwd by 1).
// ------------------------------------------------------------------------------------------------------------------
#if TQ_HAS_AVX512
struct Avx512 {
  using VI = __m512i;
  using VF = __m512;
  static constexpr int kMaxRows = 4;
  static constexpr int kGroups = 2;  // 16-lane groups per register tile
  static constexpr int kWideGroups = 4;  // ... of one or two rows
  static TQ_INLINE VI load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static TQ_INLINE VI zero() { return _mm512_setzero_si512(); }
  static TQ_INLINE VI set1(int32_t v) { return _mm512_set1_epi32(v); }
  static TQ_INLINE VI bcast4(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
  static TQ_INLINE VI lo(VI x) { return _mm512_and_si512(x, _mm512_set1_epi8(0x0F)); }
  static TQ_INLINE VI hi(VI x) { return _mm512_and_si512(_mm512_srli_epi16(x, 4), _mm512_set1_epi8(0x0F)); }
  static TQ_INLINE VI add_bits(VI x, const uint8_t* mask, int8_t v) {
    return _mm512_mask_add_epi8(x, _cvtu64_mask64(rd64(mask)), x, _mm512_set1_epi8(v));
  }
  static TQ_INLINE VI dot(VI acc, VI u, VI s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static constexpr bool kPairSums = false;  // vpdpbusd widens in the same instruction
  static TQ_INLINE VI srl4(VI x) { return _mm512_srli_epi16(x, 4); }
  // 2-bit field F (bits 2F..2F+1 of each byte) moved to bits 4-5, the rest zero
  template <int F>
  static TQ_INLINE VI field(VI x) {
    const VI m = _mm512_set1_epi8(0x30);
    if constexpr (F == 0) return _mm512_and_si512(_mm512_slli_epi16(x, 4), m);
    if constexpr (F == 1) return _mm512_and_si512(_mm512_slli_epi16(x, 2), m);
    if constexpr (F == 2) return _mm512_and_si512(x, m);
    return _mm512_and_si512(_mm512_srli_epi16(x, 2), m);
  }
  // bits 0-3 of `nib`, bits 4-7 of `high` (whose bits 0-3 are zero): one vpternlogd (c ? a : b, c = 0x0F)
  static TQ_INLINE VI merge_nib(VI nib, VI high) { return _mm512_ternarylogic_epi32(nib, high, _mm512_set1_epi8(0x0F), 0xE4); }
  // signed x signed: (w + 128) as the unsigned operand, 128 * sum(a) subtracted per block
  static constexpr bool kOffsetSigned = true;
  static TQ_INLINE VI flip_sign(VI w) { return _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80))); }
  static TQ_INLINE VI abs8(VI w) { return _mm512_abs_epi8(w); }
  static TQ_INLINE VI sign8(VI a, VI w) { return _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(w), _mm512_setzero_si512(), a); }
  static TQ_INLINE VI add(VI a, VI b) { return _mm512_add_epi32(a, b); }
  static TQ_INLINE VI mullo(VI a, VI b) { return _mm512_mullo_epi32(a, b); }
  static TQ_INLINE VI u8x16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static TQ_INLINE VI s8x16(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static TQ_INLINE VF cvt(VI x) { return _mm512_cvtepi32_ps(x); }
  static TQ_INLINE VF f16x16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static TQ_INLINE VF f32x16(const uint8_t* p) { return _mm512_loadu_ps(p); }
  // 16 E8M0 bytes -> 2^(e - 128) per lane (e8m0_half): exponent field e - 1, or 0x00200000 << e for e < 2
  static TQ_INLINE VF e8m0x16(const uint8_t* p) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(e, _mm512_set1_epi32(1)), tiny, normal));
  }
  // a 16-entry byte table in every 128-bit lane; lookup(t, x): byte i -> t[x_i] for x_i in 0..15 (vpshufb)
  static TQ_INLINE VI table16(const int8_t* t) { return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(t))); }
  static TQ_INLINE VI lookup(VI t, VI x) { return _mm512_shuffle_epi8(t, x); }
  static TQ_INLINE VF fzero() { return _mm512_setzero_ps(); }
  static TQ_INLINE VF fset1(float v) { return _mm512_set1_ps(v); }
  static TQ_INLINE VF fmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
  static TQ_INLINE VF fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
  static TQ_INLINE void store(float* p, VF v, int n) {
    if (n == 16) _mm512_storeu_ps(p, v); else _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
  }
};
#endif

#if TQ_HAS_AVX2
struct Avx2 {
  struct VI { __m256i a, b; };  // lanes 0-7, 8-15 (bytes 0-31, 32-63 of a chunk)
  struct VF { __m256 a, b; };
  static constexpr int kMaxRows = 2;
  static constexpr int kGroups = 1;
  static constexpr int kWideGroups = 1;
  static TQ_INLINE VI load(const uint8_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
  }
  static TQ_INLINE VI zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static TQ_INLINE VI set1(int32_t v) { const __m256i x = _mm256_set1_epi32(v); return {x, x}; }
  static TQ_INLINE VI bcast4(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return set1(v); }
  static TQ_INLINE VI lo(VI x) { const __m256i m = _mm256_set1_epi8(0x0F); return {_mm256_and_si256(x.a, m), _mm256_and_si256(x.b, m)}; }
  static TQ_INLINE VI hi(VI x) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    return {_mm256_and_si256(_mm256_srli_epi16(x.a, 4), m), _mm256_and_si256(_mm256_srli_epi16(x.b, 4), m)};
  }
  static TQ_INLINE __m256i bits_to_bytes(uint32_t m) {  // byte i = 0xFF when bit i of m is set
    const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
    const __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(m)), shuf);
    return _mm256_cmpeq_epi8(_mm256_and_si256(x, bit), bit);
  }
  static TQ_INLINE VI add_bits(VI x, const uint8_t* mask, int8_t v) {
    const uint64_t m = rd64(mask);
    const __m256i val = _mm256_set1_epi8(v);
    return {_mm256_add_epi8(x.a, _mm256_and_si256(bits_to_bytes(static_cast<uint32_t>(m)), val)),
            _mm256_add_epi8(x.b, _mm256_and_si256(bits_to_bytes(static_cast<uint32_t>(m >> 32)), val))};
  }
  static TQ_INLINE __m256i dot1(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  static TQ_INLINE VI dot(VI acc, VI u, VI s) { return {dot1(acc.a, u.a, s.a), dot1(acc.b, u.b, s.b)}; }
  // Pair sums (llama.cpp's AVX2 dot products): prod16 is vpmaddubsw alone, the int16 sums of byte pairs, which the
  // blocks add up as int16 over several chunks (callers bound the count so that no sum passes 32,767: |u| x 127 x 2 x
  // count), then widen once: acc + vpmaddwd(sums, m), m an int16 multiplier per lane (a K-quant sub-block's scale, or
  // 1). Exact integers either way, so the same sums as dot's; one vpmaddwd per chunks instead of one per chunk.
  static constexpr bool kPairSums = true;
  static TQ_INLINE VI prod16(VI u, VI s) { return {_mm256_maddubs_epi16(u.a, s.a), _mm256_maddubs_epi16(u.b, s.b)}; }
  static TQ_INLINE VI add16(VI x, VI y) { return {_mm256_add_epi16(x.a, y.a), _mm256_add_epi16(x.b, y.b)}; }
  static TQ_INLINE VI widen(VI acc, VI p, VI m) {
    return {_mm256_add_epi32(acc.a, _mm256_madd_epi16(p.a, m.a)), _mm256_add_epi32(acc.b, _mm256_madd_epi16(p.b, m.b))};
  }
  static TQ_INLINE VI set16(int16_t v) { const __m256i x = _mm256_set1_epi16(v); return {x, x}; }
  static TQ_INLINE void storei(uint8_t* p, VI x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x.a);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32), x.b);
  }
  // each int32 lane (a value that fits int16) as two equal int16 halves: a per-lane vpmaddwd multiplier
  static TQ_INLINE VI pair16(VI x) {
    return {_mm256_blend_epi16(x.a, _mm256_slli_epi32(x.a, 16), 0xAA), _mm256_blend_epi16(x.b, _mm256_slli_epi32(x.b, 16), 0xAA)};
  }
  static TQ_INLINE VI srl4(VI x) { return {_mm256_srli_epi16(x.a, 4), _mm256_srli_epi16(x.b, 4)}; }
  template <int F>
  static TQ_INLINE VI field(VI x) {
    const __m256i m = _mm256_set1_epi8(0x30);
    auto one = [&](__m256i v) {
      if constexpr (F == 0) return _mm256_and_si256(_mm256_slli_epi16(v, 4), m);
      if constexpr (F == 1) return _mm256_and_si256(_mm256_slli_epi16(v, 2), m);
      if constexpr (F == 2) return _mm256_and_si256(v, m);
      return _mm256_and_si256(_mm256_srli_epi16(v, 2), m);
    };
    return {one(x.a), one(x.b)};
  }
  static TQ_INLINE VI merge_nib(VI nib, VI high) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    return {_mm256_or_si256(_mm256_and_si256(nib.a, m), high.a), _mm256_or_si256(_mm256_and_si256(nib.b, m), high.b)};
  }
  static constexpr bool kOffsetSigned = false;
  static TQ_INLINE VI flip_sign(VI w) { return w; }
  static TQ_INLINE VI abs8(VI w) { return {_mm256_abs_epi8(w.a), _mm256_abs_epi8(w.b)}; }
  static TQ_INLINE VI sign8(VI a, VI w) { return {_mm256_sign_epi8(a.a, w.a), _mm256_sign_epi8(a.b, w.b)}; }
  static TQ_INLINE VI add(VI x, VI y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
  static TQ_INLINE VI mullo(VI x, VI y) { return {_mm256_mullo_epi32(x.a, y.a), _mm256_mullo_epi32(x.b, y.b)}; }
  static TQ_INLINE VI u8x16(const uint8_t* p) {
    return {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static TQ_INLINE VI s8x16(const uint8_t* p) {
    return {_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static TQ_INLINE VF cvt(VI x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
  static TQ_INLINE VF f16x16(const uint8_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
  }
  static TQ_INLINE VF f32x16(const uint8_t* p) {
    return {_mm256_loadu_ps(reinterpret_cast<const float*>(p)), _mm256_loadu_ps(reinterpret_cast<const float*>(p + 32))};
  }
  static TQ_INLINE __m256 e8m0x8(const uint8_t* p) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(tiny, normal, _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1))));
  }
  static TQ_INLINE VF e8m0x16(const uint8_t* p) { return {e8m0x8(p), e8m0x8(p + 8)}; }
  static TQ_INLINE VI table16(const int8_t* t) {
    const __m256i x = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
    return {x, x};
  }
  static TQ_INLINE VI lookup(VI t, VI x) { return {_mm256_shuffle_epi8(t.a, x.a), _mm256_shuffle_epi8(t.b, x.b)}; }
  static TQ_INLINE VF fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static TQ_INLINE VF fset1(float v) { const __m256 x = _mm256_set1_ps(v); return {x, x}; }
  static TQ_INLINE VF fmul(VF x, VF y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
  static TQ_INLINE VF fma(VF x, VF y, VF z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
  static TQ_INLINE void store(float* p, VF v, int n) {
    if (n == 16) {
      _mm256_storeu_ps(p, v.a);
      _mm256_storeu_ps(p + 8, v.b);
    } else {
      float tmp[16];
      _mm256_storeu_ps(tmp, v.a);
      _mm256_storeu_ps(tmp + 8, v.b);
      std::memcpy(p, tmp, sizeof(float) * n);
    }
  }
};
#endif

// ------------------------------------------------------------------------------------------------------------------
// Block kernels: one block of NG 16-lane groups (`g[j]` points at group j's block) against MR activation rows,
// accumulated into facc[r][j] (float, per lane). `a` rows start at row r0; `b` is the block index.
// ------------------------------------------------------------------------------------------------------------------
template <class V, int MR, int NG>
using FAcc = typename V::VF[MR][NG];

// The nibble chunks of one 32-k block (4 chunks) into isum, optionally with a bit-plane (5-bit formats) or each
// nibble replaced by its entry of a 16-byte table (MXFP4's codes).
template <class V, int MR, int NG, bool kFive, bool kTable = false>
TQ_INLINE void dot_nibble_block32(const uint8_t* const* g, int qoff, int moff, const Act& a, int64_t r0, int64_t k0,
                                  typename V::VI (&isum)[MR][NG]) {
  [[maybe_unused]] typename V::VI table;
  if constexpr (kTable) table = V::table16(kMxfp4Unsigned);
  // pair sums (AVX2): a chunk adds two products of |u| <= 15 (31 with the bit-plane, 24 for MXFP4's codes) per int16
  constexpr int kFlush = (kFive || kTable) ? 2 : 4;  // chunks per int16 sum: 4 x 2 x 3,810 or 2 x 2 x 7,874
  [[maybe_unused]] typename V::VI p16[MR][NG];
  for (int c = 0; c < 4; ++c) {
    for (int j = 0; j < NG; ++j) {
      const typename V::VI w = V::load(g[j] + qoff + c * 64);
      typename V::VI l = V::lo(w), h = V::hi(w);
      if (kFive) {
        l = V::add_bits(l, g[j] + moff + c * 16, 16);
        h = V::add_bits(h, g[j] + moff + c * 16 + 8, 16);
      }
      if constexpr (kTable) {
        l = V::lookup(table, l);
        h = V::lookup(table, h);
      }
      for (int r = 0; r < MR; ++r) {
        const int8_t* ap = a.row(r0 + r) + k0 + 8 * c;
        if constexpr (V::kPairSums) {
          const typename V::VI p = V::add16(V::prod16(l, V::bcast4(ap)), V::prod16(h, V::bcast4(ap + 4)));
          p16[r][j] = c % kFlush == 0 ? p : V::add16(p16[r][j], p);
        } else {
          isum[r][j] = V::dot(isum[r][j], l, V::bcast4(ap));
          isum[r][j] = V::dot(isum[r][j], h, V::bcast4(ap + 4));
        }
      }
    }
    if constexpr (V::kPairSums) {
      if ((c + 1) % kFlush == 0)
        for (int r = 0; r < MR; ++r)
          for (int j = 0; j < NG; ++j) isum[r][j] = V::widen(isum[r][j], p16[r][j], V::set16(1));
    }
  }
}

// Q4_0, Q4_1, Q5_0, Q5_1: 32-blocks with an fp16 scale (and min)
template <class V, int MR, int NG, int64_t F>
TQ_INLINE void block_simple(const uint8_t* const* g, const Act& a, int64_t r0, int64_t b, FAcc<V, MR, NG>& facc) {
  constexpr bool kMin = F == kQ4_1 || F == kQ5_1;
  constexpr bool kFive = F == kQ5_0 || F == kQ5_1;
  constexpr int kOffset = F == kQ4_0 ? 8 : (F == kQ5_0 ? 16 : 0);  // q - offset, folded into the integer sum
  constexpr int moff = kMin ? 64 : 32;
  constexpr int qoff = moff + (kFive ? 64 : 0);
  const int64_t nb = a.K / 32;
  typename V::VI isum[MR][NG];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NG; ++j) isum[r][j] = V::set1(-kOffset * a.sum[(r0 + r) * nb + b]);
  dot_nibble_block32<V, MR, NG, kFive>(g, qoff, moff, a, r0, b * 32, isum);
  for (int j = 0; j < NG; ++j) {
    const typename V::VF d = V::f16x16(g[j]);
    for (int r = 0; r < MR; ++r) {
      const typename V::VF dd = V::fmul(d, V::fset1(a.d[(r0 + r) * nb + b]));
      facc[r][j] = V::fma(V::cvt(isum[r][j]), dd, facc[r][j]);
      if (kMin) facc[r][j] = V::fma(V::f16x16(g[j] + 32), V::fset1(a.s[(r0 + r) * nb + b]), facc[r][j]);
    }
  }
}

// MXFP4: 32-blocks of FP4 codes under a power-of-two scale. Each code is looked up as its doubled E2M1 value + 12
// (unsigned, 0..24: no vpmaddubsw pair can saturate on AVX2), 12 * sum(a) is taken off in the integer sum, and the block
// is scaled by 2^(e - 128) * d_a: a power of two times the activation scale, exact, so one rounding per block as Q4_0.
template <class V, int MR, int NG>
TQ_INLINE void block_mxfp4(const uint8_t* const* g, const Act& a, int64_t r0, int64_t b, FAcc<V, MR, NG>& facc) {
  const int64_t nb = a.K / 32;
  typename V::VI isum[MR][NG];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NG; ++j) isum[r][j] = V::set1(-kMxfp4Offset * a.sum[(r0 + r) * nb + b]);
  dot_nibble_block32<V, MR, NG, false, true>(g, 16, 0, a, r0, b * 32, isum);
  for (int j = 0; j < NG; ++j) {
    const typename V::VF d = V::e8m0x16(g[j]);
    for (int r = 0; r < MR; ++r)
      facc[r][j] = V::fma(V::cvt(isum[r][j]), V::fmul(d, V::fset1(a.d[(r0 + r) * nb + b])), facc[r][j]);
  }
}

// Q8_0 and I8: signed weights, 8 chunks of 4 k; Q8_0 scales per block, I8 once per lane (applied at the end).
// AVX512: w + 128 (an xor) is the unsigned operand and 128 * sum(a) is taken off once per block; AVX2 cannot (255 x 127
// pairs would saturate vpmaddubsw), so it multiplies |w| by a carrying w's sign, as llama.cpp does.
template <class V, int MR, int NG, int64_t F>
TQ_INLINE void block_q8(const uint8_t* const* g, const Act& a, int64_t r0, int64_t b, FAcc<V, MR, NG>& facc) {
  constexpr int qoff = F == kQ8_0 ? 32 : 0;
  const int64_t nb = a.K / 32;
  typename V::VI isum[MR][NG];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NG; ++j) isum[r][j] = V::kOffsetSigned ? V::set1(-128 * a.sum[(r0 + r) * nb + b]) : V::zero();
  for (int c = 0; c < 8; ++c) {
    for (int j = 0; j < NG; ++j) {
      const typename V::VI w = V::load(g[j] + qoff + c * 64);
      if constexpr (V::kOffsetSigned) {
        const typename V::VI u = V::flip_sign(w);
        for (int r = 0; r < MR; ++r) isum[r][j] = V::dot(isum[r][j], u, V::bcast4(a.row(r0 + r) + b * 32 + 4 * c));
      } else {
        const typename V::VI u = V::abs8(w);
        for (int r = 0; r < MR; ++r)
          isum[r][j] = V::dot(isum[r][j], u, V::sign8(V::bcast4(a.row(r0 + r) + b * 32 + 4 * c), w));
      }
    }
  }
  for (int j = 0; j < NG; ++j) {
    const typename V::VF d = F == kQ8_0 ? V::f16x16(g[j]) : V::fset1(1.f);
    for (int r = 0; r < MR; ++r)
      facc[r][j] = V::fma(V::cvt(isum[r][j]), V::fmul(d, V::fset1(a.d[(r0 + r) * nb + b])), facc[r][j]);
  }
}

// Chunk c of a Q4_K / Q5_K sub-block (`sb`: its scales; chunks at `qoff` past their end) as unsigned bytes: the low
// nibbles (4 k of each lane) and the high ones (the next 4), the 5th bit added for Q5_K
template <class V, bool kFive>
TQ_INLINE void k45_chunk(const uint8_t* sb, int qoff, int c, typename V::VI& l, typename V::VI& h) {
  const typename V::VI w = V::load(sb + qoff + c * 64);
  l = V::lo(w);
  h = V::hi(w);
  if (kFive) {
    l = V::add_bits(l, sb + 32 + c * 16, 16);
    h = V::add_bits(h, sb + 32 + c * 16 + 8, 16);
  }
}

// Q6_K sub-block `sub`'s four 4-k chunks of 6-bit codes as unsigned bytes (0..63)
template <class V>
TQ_INLINE void q6k_chunks(const uint8_t* sub, typename V::VI (&q)[4]) {
  const typename V::VI hb = V::load(sub + 16);
  const typename V::VI w0 = V::load(sub + 80), w1 = V::load(sub + 144);
  q[0] = V::merge_nib(w0, V::template field<0>(hb));
  q[1] = V::merge_nib(V::srl4(w0), V::template field<1>(hb));
  q[2] = V::merge_nib(w1, V::template field<2>(hb));
  q[3] = V::merge_nib(V::srl4(w1), V::template field<3>(hb));
}

// One sub-block of 32 of Q4_K / Q5_K in pair sums (AVX2): iacc += scale x the sub-block's products, the scale applied
// by the widening vpmaddwd (no int32 multiply). `ap`: row 0's 32 activations (rows `ld` apart); `sub`: the
// sub-block's offset in a group's block (its scales, then mins, masks, chunks at `qoff` past the scales' end).
template <class V, int MR, int NG, bool kFive, bool kU>
TQ_INLINE void k45_sub_pairs(const uint8_t* const* g, const int8_t* ap, int64_t ld, int sub, int qoff,
                             typename V::VI (&iacc)[MR][NG], const uint8_t* u) {
  constexpr int kFlush = kFive ? 2 : 4;  // chunks per int16 sum: 4 x 2 x 3,810 (|u| <= 15) or 2 x 2 x 7,874 (31)
  typename V::VI sc[NG], p16[MR][NG];
  for (int j = 0; j < NG; ++j) sc[j] = V::pair16(V::u8x16(g[j] + sub));
  for (int c = 0; c < 4; ++c) {
    for (int j = 0; j < NG; ++j) {
      typename V::VI l, h;
      if constexpr (kU) {  // unpacked already (strip_unpacked: NG = 1)
        l = V::load(u + c * 128);
        h = V::load(u + c * 128 + 64);
      } else {
        k45_chunk<V, kFive>(g[j] + sub, qoff, c, l, h);
      }
      for (int r = 0; r < MR; ++r) {
        const int8_t* x = ap + r * ld + 8 * c;
        const typename V::VI p = V::add16(V::prod16(l, V::bcast4(x)), V::prod16(h, V::bcast4(x + 4)));
        p16[r][j] = c % kFlush == 0 ? p : V::add16(p16[r][j], p);
      }
    }
    if ((c + 1) % kFlush == 0)
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NG; ++j) iacc[r][j] = V::widen(iacc[r][j], p16[r][j], sc[j]);
  }
}

// Q4_K, Q5_K: 256-blocks, 8 sub-blocks of 32 with 6-bit scales and mins (bytes here); integer sums per super-block.
// kU (pair sums only: strip_unpacked, NG = 1): `u` holds the block's codes unpacked by unpack_block, read instead of
// `g`'s.
template <class V, int MR, int NG, int64_t F, bool kU = false>
TQ_INLINE void block_k45(const uint8_t* const* g, const Act& a, int64_t r0, int64_t b, FAcc<V, MR, NG>& facc,
                         const uint8_t* u = nullptr) {
  static_assert(!kU || V::kPairSums, "unpacked blocks run on the pair-sum path only");
  constexpr bool kFive = F == kQ5_K;
  constexpr int kSub = kFive ? kK5Sub : kK4Sub, qoff = kSub - 256;  // a sub-block: scales, mins, (masks), chunks
  const int64_t nb = a.K / 256, ns = a.K / 16;
  typename V::VI iacc[MR][NG];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NG; ++j) iacc[r][j] = V::zero();
  for (int s = 0; s < 8; ++s) {
    if constexpr (V::kPairSums) {
      k45_sub_pairs<V, MR, NG, kFive, kU>(g, a.row(r0) + b * 256 + 32 * s, a.K, 64 + s * kSub, qoff, iacc,
                                          kU ? u + s * 512 : nullptr);
      continue;
    }
    typename V::VI isum[MR][NG];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NG; ++j) isum[r][j] = V::zero();
    for (int c = 0; c < 4; ++c) {
      const int ch = 4 * s + c;
      for (int j = 0; j < NG; ++j) {
        typename V::VI l, h;
        k45_chunk<V, kFive>(g[j] + 64 + s * kSub, qoff, c, l, h);
        for (int r = 0; r < MR; ++r) {
          const int8_t* ap = a.row(r0 + r) + b * 256 + 8 * ch;
          isum[r][j] = V::dot(isum[r][j], l, V::bcast4(ap));
          isum[r][j] = V::dot(isum[r][j], h, V::bcast4(ap + 4));
        }
      }
    }
    for (int j = 0; j < NG; ++j) {
      const typename V::VI sc = V::u8x16(g[j] + 64 + s * kSub);
      for (int r = 0; r < MR; ++r) iacc[r][j] = V::add(iacc[r][j], V::mullo(isum[r][j], sc));
    }
  }
  for (int j = 0; j < NG; ++j) {
    const typename V::VF d = V::f16x16(g[j]), dmin = V::f16x16(g[j] + 32);
    for (int r = 0; r < MR; ++r) {
      const int32_t* bs = a.sum.data() + (r0 + r) * ns + b * 16;
      typename V::VI imin = V::zero();
      for (int s = 0; s < 8; ++s)
        imin = V::add(imin, V::mullo(V::u8x16(g[j] + 64 + s * kSub + 16), V::set1(bs[2 * s] + bs[2 * s + 1])));
      const typename V::VF da = V::fset1(a.d[(r0 + r) * nb + b]);
      facc[r][j] = V::fma(V::fmul(d, da), V::cvt(iacc[r][j]), facc[r][j]);
      facc[r][j] = V::fma(V::fmul(dmin, V::fset1(-a.d[(r0 + r) * nb + b])), V::cvt(imin), facc[r][j]);
    }
  }
}

// One sub-block of 16 of Q6_K in pair sums (AVX2): iacc += scale x (the products - 32 x the activations' sum), the
// scale applied by the widening vpmaddwd. Two products of |u| <= 63 per int16 sum (2 x 2 x 8,001); the offset as
// two int16 halves of -16 x sum (|sum| <= 16 x 127, so 16 x sum fits int16) against the scale in both.
template <class V, int MR, int NG, bool kU>
TQ_INLINE void q6k_sub_pairs(const uint8_t* const* g, const Act& a, int64_t r0, int64_t b, int s,
                             typename V::VI (&iacc)[MR][NG], const uint8_t* u) {
  const int64_t ns = a.K / 16;
  typename V::VI sc[NG];
  for (int j = 0; j < NG; ++j) sc[j] = V::pair16(V::s8x16(g[j] + 32 + s * kQ6Sub));
  for (int r = 0; r < MR; ++r) {
    const typename V::VI off = V::set16(static_cast<int16_t>(-16 * a.sum[(r0 + r) * ns + b * 16 + s]));
    for (int j = 0; j < NG; ++j) iacc[r][j] = V::widen(iacc[r][j], off, sc[j]);
  }
  for (int j = 0; j < NG; ++j) {
    typename V::VI q[4];
    if constexpr (kU) {  // unpacked already (strip_unpacked: NG = 1)
      for (int f = 0; f < 4; ++f) q[f] = V::load(u + f * 64);
    } else {
      q6k_chunks<V>(g[j] + 32 + s * kQ6Sub, q);
    }
    for (int r = 0; r < MR; ++r) {
      const int8_t* ap = a.row(r0 + r) + b * 256 + 16 * s;
      iacc[r][j] = V::widen(iacc[r][j], V::add16(V::prod16(q[0], V::bcast4(ap)), V::prod16(q[1], V::bcast4(ap + 4))), sc[j]);
      iacc[r][j] = V::widen(iacc[r][j], V::add16(V::prod16(q[2], V::bcast4(ap + 8)), V::prod16(q[3], V::bcast4(ap + 12))), sc[j]);
    }
  }
}

// Q6_K: 256-blocks, 16 sub-blocks of 16 with signed 8-bit scales; q - 32 folded into each sub-block's integer sum.
// kU, `u`: as block_k45's.
template <class V, int MR, int NG, bool kU = false>
TQ_INLINE void block_q6k(const uint8_t* const* g, const Act& a, int64_t r0, int64_t b, FAcc<V, MR, NG>& facc,
                         const uint8_t* u = nullptr) {
  static_assert(!kU || V::kPairSums, "unpacked blocks run on the pair-sum path only");
  const int64_t nb = a.K / 256, ns = a.K / 16;
  typename V::VI iacc[MR][NG];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NG; ++j) iacc[r][j] = V::zero();
  for (int s = 0; s < 16; ++s) {
    if constexpr (V::kPairSums) {
      q6k_sub_pairs<V, MR, NG, kU>(g, a, r0, b, s, iacc, kU ? u + s * 256 : nullptr);
      continue;
    }
    typename V::VI isum[MR][NG];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NG; ++j) isum[r][j] = V::set1(-32 * a.sum[(r0 + r) * ns + b * 16 + s]);
    for (int j = 0; j < NG; ++j) {
      typename V::VI q[4];
      q6k_chunks<V>(g[j] + 32 + s * kQ6Sub, q);
      for (int r = 0; r < MR; ++r) {
        const int8_t* ap = a.row(r0 + r) + b * 256 + 16 * s;
        for (int f = 0; f < 4; ++f) isum[r][j] = V::dot(isum[r][j], q[f], V::bcast4(ap + 4 * f));
      }
    }
    for (int j = 0; j < NG; ++j) {
      const typename V::VI sc = V::s8x16(g[j] + 32 + s * kQ6Sub);
      for (int r = 0; r < MR; ++r) iacc[r][j] = V::add(iacc[r][j], V::mullo(isum[r][j], sc));
    }
  }
  for (int j = 0; j < NG; ++j) {
    const typename V::VF d = V::f16x16(g[j]);
    for (int r = 0; r < MR; ++r)
      facc[r][j] = V::fma(V::fmul(d, V::fset1(a.d[(r0 + r) * nb + b])), V::cvt(iacc[r][j]), facc[r][j]);
  }
}

template <class V, int MR, int NG, int64_t F>
TQ_INLINE void run_block(const uint8_t* const* g, const Act& a, int64_t r0, int64_t b, FAcc<V, MR, NG>& facc) {
  if constexpr (F == kQ8_0 || F == kI8) {
    block_q8<V, MR, NG, F>(g, a, r0, b, facc);
  } else if constexpr (F == kQ4_K || F == kQ5_K) {
    block_k45<V, MR, NG, F>(g, a, r0, b, facc);
  } else if constexpr (F == kQ6_K) {
    block_q6k<V, MR, NG>(g, a, r0, b, facc);
  } else if constexpr (F == kMXFP4) {
    block_mxfp4<V, MR, NG>(g, a, r0, b, facc);
  } else {
    block_simple<V, MR, NG, F>(g, a, r0, b, facc);
  }
}

// One register tile: MR rows x NG groups over all of K, then scale (I8), bias and store.
struct Segment {
  const uint8_t* packed;
  int64_t fmt, N, gbytes, col0;
  const float* bias;  // float32 [N] or null
};

// Row r's 16 lanes of group g (`v`, scaled), plus the bias, cast and stored (the lanes past N dropped)
template <class V, typename O>
TQ_INLINE void store_lanes(const Segment& sg, int64_t g, int64_t r, typename V::VF v, O* out, int64_t ldo) {
  const int64_t n0 = g * kLanes;
  const int n = static_cast<int>(std::min<int64_t>(kLanes, sg.N - n0));
  if (n <= 0) return;
  float tmp[kLanes];
  V::store(tmp, v, kLanes);
  O* o = out + r * ldo + sg.col0 + n0;
  for (int i = 0; i < n; ++i) o[i] = static_cast<O>(tmp[i] + (sg.bias != nullptr ? sg.bias[n0 + i] : 0.f));
}

// AVX2, one or two rows (decode), the 32-blocks formats: each block's bytes are prefetched this far ahead. A thread
// reads its strips' groups (one a tile on AVX2) as one sequential stream, little work per byte, and the hardware
// prefetcher alone kept too few lines in flight for it: on an AMD EPYC (Zen 3, AVX2, 2 threads, weights from DRAM) a
// decode step ran 5-18 % faster with it (SmolLM2-135M Q4_1, SmolLM2-1.7B-shaped Q4_0 / Q8_0, gpt-oss-20b-shaped MXFP4;
// 1024-4096 bytes alike), and 6-13 % slower for the K-quants (blocks of 2.4-3.4 KB a group: not prefetched). x86
// prefetches never fault, so those past a buffer's end are harmless. The loads and sums are unchanged: the same bits.
constexpr int64_t kDecodePrefetchBytes = 2048;

constexpr bool is_kquant(int64_t f) { return f == kQ4_K || f == kQ5_K || f == kQ6_K; }

template <class V, int MR, int NG, int64_t F, typename O>
void tile(const Segment& sg, const Act& a, int64_t r0, int64_t g0, O* out, int64_t ldo) {
  constexpr int head = F == kI8 ? 64 : 0;
  const FmtInfo fi = fmt_info(F);
  const int64_t nblk = a.K / fi.qk;
  typename V::VF facc[MR][NG];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NG; ++j) facc[r][j] = V::fzero();
  const uint8_t* g[NG];
  constexpr bool prefetch = V::kPairSums && MR <= 2 && !is_kquant(F);
  for (int64_t b = 0; b < nblk; ++b) {
    for (int j = 0; j < NG; ++j) g[j] = sg.packed + (g0 + j) * sg.gbytes + head + b * fi.blk;
    if constexpr (prefetch) {
      for (int j = 0; j < NG; ++j)
        for (int64_t o = 0; o < fi.blk; o += 64) {  // an address, not a pointer past the buffer
          const uintptr_t at = reinterpret_cast<uintptr_t>(g[j]) + kDecodePrefetchBytes + o;
          __builtin_prefetch(reinterpret_cast<const void*>(at), 0, 3);
        }
    }
    run_block<V, MR, NG, F>(g, a, r0, b, facc);
  }
  for (int j = 0; j < NG; ++j) {
    typename V::VF scale = V::fset1(1.f);
    if (F == kI8) scale = V::f32x16(sg.packed + (g0 + j) * sg.gbytes);
    for (int r = 0; r < MR; ++r) store_lanes<V>(sg, g0 + j, r0 + r, V::fmul(facc[r][j], scale), out, ldo);
  }
}

// Groups [g, g1) of one segment for `MR` rows at r: tiles of `NG` groups, then single groups.
template <class V, int MR, int NG, int64_t F, typename O>
void row_tile(const Segment& sg, const Act& a, int64_t r, int64_t g, int64_t g1, O* out, int64_t ldo) {
  for (; g + NG <= g1; g += NG) tile<V, MR, NG, F>(sg, a, r, g, out, ldo);
  for (; g < g1; ++g) tile<V, MR, 1, F>(sg, a, r, g, out, ldo);
}

// K-quant tiles of one or two rows (decode) over one lane group instead of several, for short rows: set per CPU from
// a measurement (gemm_plan.decode_tile_plan). A wide tile starts 4 (2) weight streams, one per group, each a group's
// whole row of blocks; one group a tile reads one stream a thread, running on from group to group. On an AMD EPYC
// (Zen 4, 2 threads, weights from DRAM) narrow tiles read Q4_K / Q6_K rows of K = 768 1.3-1.5x faster, K = 2048 Q4_K
// 1.3x (Q6_K, 26 KB a group's row: 0.96-1.16x), and from K = 4096 (38 KB and up) 0.84-1.05x: past
// kNarrowMaxGroupBytes the streams' start-up is paid off and the wide tile's shared activation loads win. From cache
// wide tiles are ~10 % faster. Each group's sums are its own, so the results are the same either way.
std::atomic<bool> g_narrow_kquant_tiles{false};
constexpr int64_t kNarrowMaxGroupBytes = 24 << 10;

// Q5_K / Q6_K on AVX2 over many rows: a group's 256-block unpacked to one byte a weight once (unpack_block, 4 KB that
// stay in L1), then every row tile of the strip runs that block from those bytes, its float sums kept in a buffer
// between blocks; the packed path unpacks the bit planes again for each tile of two rows (AVX2 has no registers for
// more rows). Measured on an AMD EPYC (Zen 3, AVX2 only): Q6_K 1.3-1.5x, Q5_K 1.6x from 16 rows, level at 4. Q4_K's
// nibbles cost fewer instructions to unpack than their bytes cost to load: it keeps the packed path (unpacked:
// 0.69-0.98x, 4 to 512 rows). The same bytes go into the same sums and the same float steps in the same order, so the
// results are those of the packed path to the bit.
constexpr int64_t kUnpackedBlock = 256 * kLanes;
constexpr int64_t kUnpackMinRows = 4;

template <class V, int64_t F>
void unpack_block(const uint8_t* gp, uint8_t* ub) {
  if constexpr (F == kQ6_K) {
    for (int s = 0; s < 16; ++s) {
      typename V::VI q[4];
      q6k_chunks<V>(gp + 32 + s * kQ6Sub, q);
      for (int f = 0; f < 4; ++f) V::storei(ub + s * 256 + f * 64, q[f]);
    }
  } else {
    constexpr int kSub = F == kQ5_K ? kK5Sub : kK4Sub;
    for (int s = 0; s < 8; ++s)
      for (int c = 0; c < 4; ++c) {
        typename V::VI l, h;
        k45_chunk<V, F == kQ5_K>(gp + 64 + s * kSub, kSub - 256, c, l, h);
        V::storei(ub + s * 512 + c * 128, l);
        V::storei(ub + s * 512 + c * 128 + 64, h);
      }
  }
}

// MR rows at r of one block from its unpacked bytes `ub`, their float sums loaded from and stored to `acc` (16 a row)
template <class V, int MR, int64_t F>
TQ_INLINE void unpacked_block_rows(const uint8_t* gp, const uint8_t* ub, const Act& a, int64_t r, int64_t b, float* acc) {
  FAcc<V, MR, 1> facc;
  for (int i = 0; i < MR; ++i) facc[i][0] = V::f32x16(reinterpret_cast<const uint8_t*>(acc + i * kLanes));
  const uint8_t* g[1] = {gp};
  if constexpr (F == kQ6_K) block_q6k<V, MR, 1, true>(g, a, r, b, facc, ub);
  else block_k45<V, MR, 1, F, true>(g, a, r, b, facc, ub);
  for (int i = 0; i < MR; ++i) V::store(acc + i * kLanes, facc[i][0], kLanes);
}

template <class V, int64_t F, typename O>
void strip_unpacked(const Segment& sg, const Act& a, int64_t r0, int64_t r1, int64_t g0, int64_t g1, O* out, int64_t ldo) {
  const FmtInfo fi = fmt_info(F);
  alignas(64) uint8_t ub[kUnpackedBlock];
  thread_local std::vector<float> acc;
  for (int64_t g = g0; g < g1; ++g) {
    acc.assign(static_cast<size_t>((r1 - r0) * kLanes), 0.f);
    for (int64_t b = 0; b < a.K / 256; ++b) {
      const uint8_t* gp = sg.packed + g * sg.gbytes + b * fi.blk;
      unpack_block<V, F>(gp, ub);
      int64_t r = r0;
      for (; r + 2 <= r1; r += 2) unpacked_block_rows<V, 2, F>(gp, ub, a, r, b, acc.data() + (r - r0) * kLanes);
      if (r < r1) unpacked_block_rows<V, 1, F>(gp, ub, a, r, b, acc.data() + (r - r0) * kLanes);
    }
    for (int64_t r = r0; r < r1; ++r)
      store_lanes<V>(sg, g, r, V::f32x16(reinterpret_cast<const uint8_t*>(acc.data() + (r - r0) * kLanes)), out, ldo);
  }
}

// Rows [r0, r1) x groups [g0, g1) of one segment; row tiles of up to kMaxRows. One or two rows (decode) take 4 groups
// per tile on AVX512 (more weight streams in flight; K-quants: one, where narrow tiles are set), more rows kGroups
// (their accumulators fill the registers).
template <class V, int64_t F, typename O>
void strip(const Segment& sg, const Act& a, int64_t r0, int64_t r1, int64_t g0, int64_t g1, O* out, int64_t ldo) {
  if constexpr (V::kPairSums && (F == kQ5_K || F == kQ6_K)) {
    if (r1 - r0 >= kUnpackMinRows) return strip_unpacked<V, F>(sg, a, r0, r1, g0, g1, out, ldo);
  }
  constexpr int NG = V::kGroups;
  constexpr int NGW = V::kWideGroups;
  const bool narrow = is_kquant(F) && sg.gbytes <= kNarrowMaxGroupBytes && g_narrow_kquant_tiles.load(std::memory_order_relaxed);
  for (int64_t r = r0; r < r1; r += V::kMaxRows) {
    const int mr = static_cast<int>(std::min<int64_t>(V::kMaxRows, r1 - r));
    switch (mr) {
      case 4: if constexpr (V::kMaxRows >= 4) { row_tile<V, 4, NG, F>(sg, a, r, g0, g1, out, ldo); break; } [[fallthrough]];
      case 3: if constexpr (V::kMaxRows >= 3) { row_tile<V, 3, NG, F>(sg, a, r, g0, g1, out, ldo); break; } [[fallthrough]];
      // Q4_K / Q5_K keep three accumulators per lane group: two rows of four groups would spill (measured 1.5x slower)
      case 2:
        if (narrow) row_tile<V, 2, 1, F>(sg, a, r, g0, g1, out, ldo);
        else row_tile<V, 2, (F == kQ4_K || F == kQ5_K) ? NG : NGW, F>(sg, a, r, g0, g1, out, ldo);
        break;
      default:
        if (narrow) row_tile<V, 1, 1, F>(sg, a, r, g0, g1, out, ldo);
        else row_tile<V, 1, NGW, F>(sg, a, r, g0, g1, out, ldo);
        break;
    }
  }
}

template <class V, typename O>
void run_strip(const Segment& sg, const Act& a, int64_t r0, int64_t r1, int64_t g0, int64_t g1, O* out, int64_t ldo) {
  switch (sg.fmt) {
    case kQ8_0: strip<V, kQ8_0>(sg, a, r0, r1, g0, g1, out, ldo); break;
    case kQ4_0: strip<V, kQ4_0>(sg, a, r0, r1, g0, g1, out, ldo); break;
    case kQ4_1: strip<V, kQ4_1>(sg, a, r0, r1, g0, g1, out, ldo); break;
    case kQ5_0: strip<V, kQ5_0>(sg, a, r0, r1, g0, g1, out, ldo); break;
    case kQ5_1: strip<V, kQ5_1>(sg, a, r0, r1, g0, g1, out, ldo); break;
    case kQ4_K: strip<V, kQ4_K>(sg, a, r0, r1, g0, g1, out, ldo); break;
    case kQ5_K: strip<V, kQ5_K>(sg, a, r0, r1, g0, g1, out, ldo); break;
    case kQ6_K: strip<V, kQ6_K>(sg, a, r0, r1, g0, g1, out, ldo); break;
    case kI8: strip<V, kI8>(sg, a, r0, r1, g0, g1, out, ldo); break;
    case kMXFP4: strip<V, kMXFP4>(sg, a, r0, r1, g0, g1, out, ldo); break;
    default: TORCH_CHECK(false, "quant: unknown format id ", sg.fmt);
  }
}

// ------------------------------------------------------------------------------------------------------------------
// AMX int8 tiles for the signed 8-bit formats (Q8_0, I8), bit-identical to the VNNI path: a block's 8 chunks (4 k of
// 16 lanes each) are exactly a B tile of K = 32 for `tdpbssd` (8 rows x 64 bytes), so the weight is read as packed;
// the tile's int32 sums equal isum in block_q8 (both exact), and the float scaling that follows is block_q8's, op for
// op (fmul of the scales, then fmadd), in the same block order. So a row's result does not depend on which path ran
// it, and the paths may be mixed by row count (tandem/layers/gemm_plan.py measures where AMX starts to pay).
// Tiles: C 0-3 (2 row halves x 2 lane groups), A 4-5 (16 rows x 32 activation bytes), B 6-7.
// ------------------------------------------------------------------------------------------------------------------
#if TQ_HAS_AVX512 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define TQ_HAS_AMX 1

// A: 32 activation bytes (one block); B: the block's 8 chunks
inline void amx_q8_configure(int rows0, int rows1) { tandem_amx::configure(rows0, rows1, 32, 8); }

// int32 sums of one block for H row halves x J lane groups into isum [32][32] (row stride 32)
template <int H, int J>
TQ_INLINE void amx_q8_block(const int8_t* a0, int64_t K, const uint8_t* w0, const uint8_t* w1, int32_t* isum) {
  _tile_zero(0);
  if constexpr (J > 1) _tile_zero(1);
  if constexpr (H > 1) {
    _tile_zero(2);
    if constexpr (J > 1) _tile_zero(3);
  }
  _tile_loadd(4, a0, K);
  _tile_loadd(6, w0, 64);
  _tile_dpbssd(0, 4, 6);
  if constexpr (J > 1) {
    _tile_loadd(7, w1, 64);
    _tile_dpbssd(1, 4, 7);
  }
  if constexpr (H > 1) {
    _tile_loadd(5, a0 + 16 * K, K);
    _tile_dpbssd(2, 5, 6);
    if constexpr (J > 1) _tile_dpbssd(3, 5, 7);
  }
  _tile_stored(0, isum, 128);
  if constexpr (J > 1) _tile_stored(1, isum + 16, 128);
  if constexpr (H > 1) {
    _tile_stored(2, isum + 16 * 32, 128);
    if constexpr (J > 1) _tile_stored(3, isum + 16 * 32 + 16, 128);
  }
}

// Rows [r0, r1) x groups [g0, g1) of one Q8_0 / I8 segment on AMX tiles (same outputs as strip<Avx512, F>)
template <int64_t F, typename O>
void amx_q8_strip(const Segment& sg, const Act& a, int64_t r0, int64_t r1, int64_t g0, int64_t g1, O* out, int64_t ldo) {
  constexpr int head = F == kI8 ? 64 : 0;
  constexpr int qoff = F == kQ8_0 ? 32 : 0;
  const FmtInfo fi = fmt_info(F);
  const int64_t K = a.K, nblk = K / 32;
  alignas(64) int32_t isum[32 * 32];
  alignas(64) float facc[32 * 32];
  int configured = -1;
  for (int64_t m0 = r0; m0 < r1; m0 += 32) {
    const int rows0 = static_cast<int>(std::min<int64_t>(16, r1 - m0));
    const int rows1 = static_cast<int>(std::clamp<int64_t>(r1 - m0 - 16, 0, 16));
    const int rows = rows0 + rows1;
    if (configured != rows0 * 17 + rows1) {
      amx_q8_configure(rows0, rows1);
      configured = rows0 * 17 + rows1;
    }
    for (int64_t g = g0; g < g1; g += 2) {
      const int J = static_cast<int>(std::min<int64_t>(2, g1 - g));
      const uint8_t* gp[2] = {sg.packed + g * sg.gbytes + head, sg.packed + (g + J - 1) * sg.gbytes + head};
      for (int i = 0; i < 32 * 32; ++i) facc[i] = 0.f;
      for (int64_t b = 0; b < nblk; ++b) {
        const int8_t* ab = a.row(m0) + b * 32;
        const uint8_t* w0 = gp[0] + b * fi.blk + qoff;
        const uint8_t* w1 = gp[1] + b * fi.blk + qoff;
        if (rows1 > 0) {
          J == 2 ? amx_q8_block<2, 2>(ab, K, w0, w1, isum) : amx_q8_block<2, 1>(ab, K, w0, w1, isum);
        } else {
          J == 2 ? amx_q8_block<1, 2>(ab, K, w0, w1, isum) : amx_q8_block<1, 1>(ab, K, w0, w1, isum);
        }
        for (int j = 0; j < J; ++j) {
          const __m512 d = F == kQ8_0 ? Avx512::f16x16(gp[j] + b * fi.blk) : _mm512_set1_ps(1.f);
          for (int r = 0; r < rows; ++r) {
            const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(a.d[(m0 + r) * nblk + b]));
            float* fr = facc + r * 32 + j * 16;
            const __m512 si = _mm512_cvtepi32_ps(_mm512_load_si512(isum + r * 32 + j * 16));
            _mm512_store_ps(fr, _mm512_fmadd_ps(si, dd, _mm512_load_ps(fr)));
          }
        }
      }
      for (int j = 0; j < J; ++j) {  // tile()'s epilogue: I8's per-lane scale, then the bias, then the cast
        const int64_t n0 = (g + j) * kLanes;
        const int n = static_cast<int>(std::min<int64_t>(kLanes, sg.N - n0));
        if (n <= 0) continue;
        __m512 scale = _mm512_set1_ps(1.f);
        if (F == kI8) scale = Avx512::f32x16(sg.packed + (g + j) * sg.gbytes);
        for (int r = 0; r < rows; ++r) {
          float tmp[kLanes];
          Avx512::store(tmp, _mm512_mul_ps(_mm512_load_ps(facc + r * 32 + j * 16), scale), kLanes);
          O* o = out + (m0 + r) * ldo + sg.col0 + n0;
          for (int i = 0; i < n; ++i) o[i] = static_cast<O>(tmp[i] + (sg.bias != nullptr ? sg.bias[n0 + i] : 0.f));
        }
      }
    }
  }
  _tile_release();
}

inline bool amx_int8_permitted() { return tandem_amx::permitted(); }
#else
#define TQ_HAS_AMX 0
inline bool amx_int8_permitted() { return false; }
#endif

bool has_amx_int8() { return TQ_HAS_AMX && amx_int8_permitted(); }

int best_isa() {
#if TQ_HAS_AVX512
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw")) return 2;
#endif
#if TQ_HAS_AVX2
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
  return 0;
}

int64_t quant_isa() { return best_isa(); }

bool quant_set_narrow_kquant_tiles(bool on) { return g_narrow_kquant_tiles.exchange(on); }

// Work units: (row block of kRowBlock rows, strip of kStripGroups groups of one segment). Row blocks keep a block of
// quantized activations in L2 while strips of weights stream past; strips are the parallel grain for decode.
constexpr int64_t kRowBlock = 64;
constexpr int64_t kStripGroups = 2;

struct Unit {
  int seg;
  int64_t r0, r1, g0, g1;
};

template <typename O>
void run_units(int isa, bool amx, const std::vector<Segment>& segs, const std::vector<Unit>& units, const Act* acts[2],
               O* out, int64_t ldo) {
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const Unit& w = units[u];
      const Segment& sg = segs[w.seg];
      const Act& a = *acts[fmt_info(sg.fmt).kquant ? 1 : 0];
#if TQ_HAS_AMX
      if (amx && sg.fmt == kQ8_0) {
        amx_q8_strip<kQ8_0>(sg, a, w.r0, w.r1, w.g0, w.g1, out, ldo);
        continue;
      }
      if (amx && sg.fmt == kI8) {
        amx_q8_strip<kI8>(sg, a, w.r0, w.r1, w.g0, w.g1, out, ldo);
        continue;
      }
#else
      (void)amx;
#endif
#if TQ_HAS_AVX512
      if (isa == 2) {
        run_strip<Avx512>(sg, a, w.r0, w.r1, w.g0, w.g1, out, ldo);
        continue;
      }
#endif
#if TQ_HAS_AVX2
      if (isa == 1) {
        run_strip<Avx2>(sg, a, w.r0, w.r1, w.g0, w.g1, out, ldo);
        continue;
      }
#endif
      TORCH_CHECK(false, "quant_linear: ISA ", isa, " is not available in this build");
    }
  });
}

template <typename S>
void quantize_activations(const Tensor& x, bool need32, bool need256, Act& a32, Act& a256) {
  const S* xp = x.data_ptr<S>();
  const int64_t M = x.size(0), K = x.size(1);
  if (need32) quantize_rows_32(xp, M, K, a32);
  if (need256) quantize_rows_256(xp, M, K, a256);
}

// One packed weight of the call: its format, N and the checks that it matches K.
Segment make_segment(const Tensor& packed, int64_t fmt, int64_t n, int64_t K, int64_t col0) {
  const FmtInfo fi = fmt_info(fmt);
  TORCH_CHECK(K % fi.qk == 0, "quant: K=", K, " is not a multiple of ", fi.qk);
  const int64_t gbytes = fi.head + K / fi.qk * fi.blk;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 &&
              packed.size(1) == gbytes && packed.size(0) * kLanes >= n, "quant: a packed segment does not match K / N / format");
  return {packed.data_ptr<uint8_t>(), fmt, n, gbytes, col0, nullptr};
}

// y [M, Ntot] = for each segment i, rows [row0[i], row1[i]) of x @ W_i^T into columns [col0, col0 + N) (+ bias).
// The activations are quantized once for every row; each (segment, row block, strip) is one unit of one parallel
// region, so a call over many small weights (a layer's experts) pays one quantization and one region, not one each.
Tensor run_segments(const Tensor& x, std::vector<Segment>& segs, const std::vector<int64_t>& row0,
                    const std::vector<int64_t>& row1, int64_t Ntot, int64_t isa, int64_t amx_rows) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quant: x must be contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "quant: x must be float32 or bfloat16");
  if (isa == 0) isa = best_isa();
  TORCH_CHECK(isa == 1 || isa == 2, "quant: no AVX2 or AVX512-VNNI kernels on this CPU / build");
  const int64_t M = x.size(0);
  bool need32 = false, need256 = false;
  int64_t groups = 0, most_rows = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    (fmt_info(segs[i].fmt).kquant ? need256 : need32) = true;
    groups += (segs[i].N + kLanes - 1) / kLanes;
    most_rows = std::max(most_rows, row1[i] - row0[i]);
  }
  Act a32, a256;
  if (x.scalar_type() == at::kFloat) {
    quantize_activations<float>(x, need32, need256, a32, a256);
  } else {
    quantize_activations<c10::BFloat16>(x, need32, need256, a32, a256);
  }
  std::vector<Unit> units;
  // strips of 4 groups (a full wide tile) unless that leaves the threads too few units to share evenly
  const int64_t per_strip = groups >= 16 * at::get_num_threads() ? 2 * kStripGroups : kStripGroups;
  const auto add_units = [&](size_t i, int64_t r0) {
    const int64_t G = (segs[i].N + kLanes - 1) / kLanes;
    for (int64_t g0 = 0; g0 < G; g0 += per_strip)
      units.push_back({static_cast<int>(i), r0, std::min(row1[i], r0 + kRowBlock), g0, std::min(G, g0 + per_strip)});
  };
  const bool same_rows = std::all_of(row0.begin(), row0.end(), [&](int64_t r) { return r == row0[0]; }) &&
                         std::all_of(row1.begin(), row1.end(), [&](int64_t r) { return r == row1[0]; });
  if (same_rows) {  // one input for all (fused q/k/v): row blocks outermost, so a block of activations stays in L2
    for (int64_t r0 = row0[0]; r0 < row1[0]; r0 += kRowBlock)
      for (size_t i = 0; i < segs.size(); ++i) add_units(i, r0);
  } else {
    for (size_t i = 0; i < segs.size(); ++i)
      for (int64_t r0 = row0[i]; r0 < row1[i]; r0 += kRowBlock) add_units(i, r0);
  }
  Tensor y = at::empty({M, Ntot}, x.options());
  const Act* acts[2] = {&a32, &a256};
  const bool amx = isa == 2 && amx_rows > 0 && most_rows >= amx_rows && has_amx_int8();
  if (x.scalar_type() == at::kFloat) {
    run_units<float>(static_cast<int>(isa), amx, segs, units, acts, y.data_ptr<float>(), Ntot);
  } else {
    run_units<c10::BFloat16>(static_cast<int>(isa), amx, segs, units, acts, y.data_ptr<c10::BFloat16>(), Ntot);
  }
  return y;
}

// amx_rows > 0: calls of at least that many rows run their Q8_0 / I8 segments on AMX tiles (where the CPU has them;
// results are the same either way)
Tensor quant_linear(const Tensor& x, at::TensorList packed, at::IntArrayRef fmts, at::IntArrayRef ns,
                    const c10::optional<Tensor>& bias, int64_t isa, int64_t amx_rows) {
  TORCH_CHECK(x.dim() == 2, "quant_linear: x must be [M, K]");
  TORCH_CHECK(packed.size() == fmts.size() && packed.size() == ns.size() && !packed.empty(), "quant_linear: one format and N per packed segment");
  const int64_t M = x.size(0), K = x.size(1);
  int64_t Ntot = 0;
  std::vector<Segment> segs;
  for (size_t i = 0; i < packed.size(); ++i) {
    segs.push_back(make_segment(packed[i], fmts[i], ns[i], K, Ntot));
    Ntot += ns[i];
  }
  Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == Ntot, "quant_linear: bias must have ", Ntot, " elements");
    for (auto& sg : segs) sg.bias = b.data_ptr<float>() + sg.col0;
  }
  return run_segments(x, segs, std::vector<int64_t>(segs.size(), 0), std::vector<int64_t>(segs.size(), M), Ntot, isa, amx_rows);
}

// A mixture-of-experts layer's projections in one call (llama.cpp's mul_mat_id): segment i multiplies the rows
// [row0[i], row1[i]) of x (the tokens routed to its expert, grouped) by its weight into columns [cols[i], cols[i] +
// ns[i]) of y [M, N]; an expert of mixed formats (gate Q4_K, up Q6_K) is several segments over the same rows.
// biases: empty, or one float32 [ns[i]] per segment. Every row of y must be covered by the caller's segments.
Tensor quant_grouped(const Tensor& x, at::TensorList packed, at::IntArrayRef fmts, at::IntArrayRef ns,
                     at::IntArrayRef cols, at::IntArrayRef row0, at::IntArrayRef row1, at::TensorList biases,
                     int64_t isa, int64_t amx_rows) {
  TORCH_CHECK(x.dim() == 2, "quant_grouped: x must be [M, K]");
  const size_t S = packed.size();
  TORCH_CHECK(S > 0 && fmts.size() == S && ns.size() == S && cols.size() == S && row0.size() == S && row1.size() == S,
              "quant_grouped: one format, N, column and row range per packed segment");
  TORCH_CHECK(biases.empty() || biases.size() == S, "quant_grouped: no biases or one per segment");
  const int64_t M = x.size(0), K = x.size(1);
  int64_t Ntot = 0;
  std::vector<Segment> segs;
  std::vector<Tensor> held;  // float32 copies of the biases, alive until the call returns
  for (size_t i = 0; i < S; ++i) {
    TORCH_CHECK(0 <= row0[i] && row0[i] <= row1[i] && row1[i] <= M, "quant_grouped: segment ", i, "'s rows are outside x");
    segs.push_back(make_segment(packed[i], fmts[i], ns[i], K, cols[i]));
    Ntot = std::max(Ntot, cols[i] + ns[i]);
    if (!biases.empty()) {
      held.push_back(biases[i].to(at::kFloat).contiguous());
      TORCH_CHECK(held.back().numel() == ns[i], "quant_grouped: bias ", i, " must have ", ns[i], " elements");
      segs.back().bias = held.back().data_ptr<float>();
    }
  }
  return run_segments(x, segs, std::vector<int64_t>(row0.begin(), row0.end()),
                      std::vector<int64_t>(row1.begin(), row1.end()), Ntot, isa, amx_rows);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("quant_pack(Tensor raw, int fmt, int N, int K) -> Tensor");
  m.def("quant_pack_i8(Tensor q, Tensor scales) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor[] packed, int[] fmts, int[] ns, Tensor? bias, int isa, int amx_rows=0) -> Tensor");
  m.def("quant_grouped(Tensor x, Tensor[] packed, int[] fmts, int[] ns, int[] cols, int[] row0, int[] row1, Tensor[] biases, int isa, int amx_rows=0) -> Tensor");
  m.def("quant_rows(Tensor packed, int fmt, int N, int K, Tensor ids) -> Tensor");
  m.def("quant_isa() -> int", &quant_isa);
  m.def("quant_set_narrow_kquant_tiles(bool on) -> bool", &quant_set_narrow_kquant_tiles);
  m.def("has_amx_int8() -> bool", &has_amx_int8);
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("quant_pack", &quant_pack);
  m.impl("quant_pack_i8", &quant_pack_i8);
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_grouped", &quant_grouped);
  m.impl("quant_rows", &quant_rows);
}

// W4A16 on the tensor cores: y [M, N] = x [M, K] @ W^T with W int4 (group-wise scale and zero point),
// x and y bf16, for the decode regime (M = the batch, small) and up to 64 rows per tile.
//
// The contract with int4_mma.py, which re-lays the weights once at load:
//   wq    uint4 [n_tiles][k_chunks][32 lanes]: one 16-byte word per lane per (16 output rows, 64 inputs).
//         Word s (0..3) of a lane is the lane's A fragment of mma.m16n8k16 for k-step s, its 8 nibbles
//         already in the order the bit-trick dequantization below produces registers a0..a3.
//   meta  uint2 [n_tiles][groups][8]: for lane group g (= lane / 4) of a tile, .x = (bf16 scale of row g)
//         | (0x4300 | zero of row g) << 16, .y the same for row g + 8. 0x4300 | z read as bf16 is 128 + z.
//   Inside a 32-input block the inputs are permuted so that lane t's activations are inputs 8t .. 8t + 7
//   of the block: one 16-byte load per lane per block instead of four 4-byte ones (the weights were
//   permuted the same way at load, so the sum over k is unchanged).
//
// The roles of the operands are swapped (A = 16 weight rows, B = 8 activation rows): a batch of 1 to 8
// pads to 8, not 16, and 16 weight rows are 128 contiguous bytes per k-step.
//
// Dequantization: (word >> 4i) & 0x000F000F | 0x43004300 gives two bf16 128 + q exactly (lop3, no
// int-to-float); subtracting the bf16 pair (128 + z) is exact; the group's scale multiplies the fp32
// partial sum of the group after the mma (one rounding fewer than scaling the weights in bf16).
//
// Partition: a block is 8 warps, WN output tiles x WK warps along K; SPLITS blocks along K more when N
// is small. The K slices are summed in a fixed order: the WK warps of a tile through shared memory, the
// SPLITS blocks through an fp32 workspace summed by the block that arrives last (a counter per tile
// group, reset by that block), so the result does not depend on which block finishes first.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;
constexpr int CHUNK_K = 64;          // inputs per 16-byte lane word (4 k-steps of 16)
constexpr int M_TILE = 64;           // activation rows per block (8 per mma, MB mma per k-step)

__device__ __forceinline__ uint64_t evict_first_policy() {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// The weights are read once per call: stream them past L1. (An L2 evict-first cache hint, a createpolicy
// operand, measured slower on the H200: the operand costs two uniform-register moves per load. The bulk
// copies keep it: one copy per 2 KB.)
__device__ __forceinline__ uint4 load_weights(const uint4* ptr) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t mask, uint32_t bits) {   // (a & mask) | bits
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));
    return d;
}

__device__ __forceinline__ uint32_t bf16x2_sub(uint32_t a, uint32_t b) {
    __nv_bfloat162 r = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
    return *reinterpret_cast<uint32_t*>(&r);
}

// 8 nibbles -> the A fragment (q - z as bf16): reg i holds nibbles i (low half) and i + 4 (high half).
__device__ __forceinline__ void dequantize(uint32_t word, uint32_t zero_row_g, uint32_t zero_row_g8, uint32_t (&a)[4]) {
    constexpr uint32_t MASK = 0x000F000F, BF16_128 = 0x43004300;
    a[0] = bf16x2_sub(and_or(word, MASK, BF16_128), zero_row_g);
    a[1] = bf16x2_sub(and_or(word >> 4, MASK, BF16_128), zero_row_g8);
    a[2] = bf16x2_sub(and_or(word >> 8, MASK, BF16_128), zero_row_g);
    a[3] = bf16x2_sub(and_or(word >> 12, MASK, BF16_128), zero_row_g8);
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// k-step s (0..3) of a lane word: the A fragment `a` times each 8-row block's activations (xs[b][s / 2]
// holds lane t's 8 inputs of that 32-input block: its .x/.y are k-step 2h's B fragment, .z/.w 2h + 1's).
template <int MB>
__device__ __forceinline__ void mma_k_step(float (&d)[MB][4], const uint32_t (&a)[4], const uint4 (&xs)[MB][2], int s) {
    const int h = s >> 1;
#pragma unroll
    for (int b = 0; b < MB; ++b)
        mma_bf16(d[b], a, (s & 1) ? xs[b][h].z : xs[b][h].x, (s & 1) ? xs[b][h].w : xs[b][h].y);
}

__device__ __forceinline__ float scale_of(uint32_t meta_half, bool fp16_scales) {
    uint16_t bits = meta_half & 0xFFFF;
    if (fp16_scales) return __half2float(*reinterpret_cast<__half*>(&bits));
    return __uint_as_float(uint32_t(bits) << 16);
}

__device__ __forceinline__ uint32_t zero_pair(uint32_t meta_half) {     // bf16x2 (128 + z, 128 + z): one prmt
    return __byte_perm(meta_half, 0, 0x3232);
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The bulk-copy stream needs Hopper (sm_90); elsewhere the launcher is asked for the register stream.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define LAB_NO_BULK_COPY 1
#endif

__device__ __forceinline__ void barrier_init(uint64_t* bar) {
#ifdef LAB_NO_BULK_COPY
    __trap();
#else
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_address(bar)));
#endif
}

// One lane asks the copy engine for `bytes` of weights into shared memory; the barrier's phase
// completes when they have landed.
__device__ __forceinline__ void barrier_expect(uint64_t* bar, uint32_t bytes) {
#ifdef LAB_NO_BULK_COPY
    __trap();
#else
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_address(bar)), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar, uint64_t policy) {
#ifdef LAB_NO_BULK_COPY
    __trap();
#else
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                 :: "r"(smem_address(dst)), "l"(src), "r"(bytes), "r"(smem_address(bar)), "l"(policy) : "memory");
#endif
}

__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
#ifdef LAB_NO_BULK_COPY
    __trap();
#else
    uint32_t done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(smem_address(bar)), "r"(parity) : "memory");
    } while (!done);
#endif
}

// Every accumulator of a lane with the output it belongs to: acc[b][i] is row m (an activation)
// and column n (a weight row) of y, by the mma's C fragment layout.
template <int MB, typename F>
__device__ __forceinline__ void for_each_output(int m0, int n_row, int t, F f) {
#pragma unroll
    for (int b = 0; b < MB; ++b)
#pragma unroll
        for (int i = 0; i < 4; ++i) f(b, i, m0 + b * 8 + 2 * t + (i & 1), n_row + 8 * (i >> 1));
}

struct Problem {
    const __nv_bfloat16* x; const uint4* wq; const uint2* meta; __nv_bfloat16* y;
    float* partials; int* counters;
    int M, N, K, n_tiles, k_chunks, groups, log2_blocks_per_group, wn, wk, splits, fp16_scales;
    int x_smem_bytes;         // > 0: the block's activations are staged in shared memory first (small M x K)
    // A fused prologue (one row, staged): what x becomes before the multiply (PROLOGUE_*).
    int prologue;
    const __nv_bfloat16* residual;   // ADD_RMS_NORM: added to x first (null: RMSNorm of x alone)
    const __nv_bfloat16* norm_weight;
    __nv_bfloat16* residual_out;     // ADD_RMS_NORM: x + residual, the whole row, written by block (0, 0, 0)
    float eps;
    int pdl;                         // host: launched as a programmatic dependent of the kernel before it
};

// The fused prologues: the kernel before the multiply, folded into the staging of its one row.
//   ADD_RMS_NORM  x <- RMSNorm(x + residual) * norm_weight (each block sums the whole row's squares)
//   SILU_MUL      x <- SiLU(x[:K]) * x[K:2K] (x is the gate_up projection's [1, 2K] output)
// Both round where the engine's Triton kernels round (fused_ops.py), so the fused path multiplies the
// same bf16 row the unfused one would.
constexpr int PROLOGUE_NONE = 0, PROLOGUE_ADD_RMS_NORM = 1, PROLOGUE_SILU_MUL = 2;

// The block's chunks along K: [begin, end) of its first and last warp slices.
__device__ __forceinline__ int2 block_chunks(const Problem& p) {
    const int n_splits = p.splits * p.wk;
    return make_int2(int((long long)blockIdx.y * p.wk * p.k_chunks / n_splits),
                     int((long long)(blockIdx.y + 1) * p.wk * p.k_chunks / n_splits));
}

// Activations of rows [m0, m0 + rows) over the block's chunks cb (block_chunks), copied once into
// shared memory with cp.async (no registers held; the caller waits with wait_x_staging after issuing
// its first weight loads, so one latency covers both). Row r starts at r * stride inputs. Without this
// every warp fetches its activations from L1/L2 one chunk ahead, and a warp alone on its scheduler
// stalls on that round trip every chunk.
__device__ __forceinline__ void stage_x(const Problem& p, int2 cb, __nv_bfloat16* xs, int m0, int rows, int stride) {
    const int k0 = cb.x * CHUNK_K, width = min(cb.y * CHUNK_K, p.K) - k0;     // a multiple of 8
    const int per_row = width / 8;
    for (int idx = threadIdx.x; idx < rows * per_row; idx += THREADS) {
        const int r = idx / per_row, q = idx - r * per_row;
        const __nv_bfloat16* src = p.x + (size_t)(m0 + r) * p.K + k0 + q * 8;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                     :: "r"(static_cast<uint32_t>(__cvta_generic_to_shared(xs + (size_t)r * stride + q * 8))), "l"(src) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

__device__ __forceinline__ void wait_x_staging() {
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
}

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16(v)); }

// The sum of a float over the block's threads (every thread gets it).
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float warp_sums[THREADS / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) total += warp_sums[w];
    return total;
}

// The fused prologue of row 0 into shared memory: inputs [k0, k0 + width) of the block (after
// block_chunks), in K order, as the unfused kernels would have written them; ends with the block's barrier.
__device__ void stage_prologue(const Problem& p, int2 cb, __nv_bfloat16* xs) {
    const int k0 = cb.x * CHUNK_K, width = min(cb.y * CHUNK_K, p.K) - k0;      // multiples of 8
    if (p.prologue == PROLOGUE_SILU_MUL) {
        for (int k = threadIdx.x * 8; k < width; k += THREADS * 8) {
            const uint4 gv = *reinterpret_cast<const uint4*>(p.x + k0 + k);
            const uint4 uv = *reinterpret_cast<const uint4*>(p.x + p.K + k0 + k);
            const __nv_bfloat16* g8 = reinterpret_cast<const __nv_bfloat16*>(&gv);
            const __nv_bfloat16* u8 = reinterpret_cast<const __nv_bfloat16*>(&uv);
            __align__(16) __nv_bfloat16 out[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float g = __bfloat162float(g8[j]);
                out[j] = __float2bfloat16(bf16_round(g / (1.f + __expf(-g))) * __bfloat162float(u8[j]));
            }
            *reinterpret_cast<uint4*>(xs + k) = *reinterpret_cast<const uint4*>(out);
        }
        __syncthreads();
        return;
    }
    // ADD_RMS_NORM: h = bf16(x + residual) over the whole row for the sum of squares.
    const bool writer = blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && p.residual_out != nullptr;
    float squares = 0.f;
    for (int k = threadIdx.x * 8; k < p.K; k += THREADS * 8) {
        uint4 hv = *reinterpret_cast<const uint4*>(p.x + k);
        __nv_bfloat16* h8 = reinterpret_cast<__nv_bfloat16*>(&hv);
        if (p.residual != nullptr) {
            const uint4 rv = *reinterpret_cast<const uint4*>(p.residual + k);
            const __nv_bfloat16* r8 = reinterpret_cast<const __nv_bfloat16*>(&rv);
#pragma unroll
            for (int j = 0; j < 8; ++j) h8[j] = __float2bfloat16(__bfloat162float(h8[j]) + __bfloat162float(r8[j]));
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) squares += __bfloat162float(h8[j]) * __bfloat162float(h8[j]);
        if (writer) *reinterpret_cast<uint4*>(p.residual_out + k) = hv;
    }
    const float rstd = 1.f / sqrtf(block_sum(squares) / p.K + p.eps);
    for (int k = threadIdx.x * 8; k < width; k += THREADS * 8) {
        uint4 hv = *reinterpret_cast<const uint4*>(p.x + k0 + k);
        __nv_bfloat16* h8 = reinterpret_cast<__nv_bfloat16*>(&hv);
        if (p.residual != nullptr) {
            const uint4 rv = *reinterpret_cast<const uint4*>(p.residual + k0 + k);
            const __nv_bfloat16* r8 = reinterpret_cast<const __nv_bfloat16*>(&rv);
#pragma unroll
            for (int j = 0; j < 8; ++j) h8[j] = __float2bfloat16(__bfloat162float(h8[j]) + __bfloat162float(r8[j]));
        }
        const uint4 wv = *reinterpret_cast<const uint4*>(p.norm_weight + k0 + k);
        const __nv_bfloat16* w8 = reinterpret_cast<const __nv_bfloat16*>(&wv);
        __align__(16) __nv_bfloat16 out[8];
#pragma unroll
        for (int j = 0; j < 8; ++j)
            out[j] = __float2bfloat16(bf16_round(__bfloat162float(h8[j]) * rstd) * __bfloat162float(w8[j]));
        *reinterpret_cast<uint4*>(xs + k) = *reinterpret_cast<const uint4*>(out);
    }
    __syncthreads();
}

// Programmatic dependent launch (Hopper): the kernel is launched while the one before it still runs;
// everything before grid_dependency_wait reads only the weights (never written by a kernel), and
// everything after it sees the previous kernel's results. launch_dependents lets the next kernel's
// blocks start streaming their own weights as this one's blocks leave the SMs.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// One warp's slice of the problem: chunks [c_begin, c_end) of one tile, and its running sums.
// The hot loop's contract: per 64-input chunk a lane spends one 16-byte weight load, its scale entries,
// its activations, 4 x (3 shifts, 4 lop3, 4 bf16 subtractions) of dequantization and 4 x MB mma; every
// address is a pointer bumped once per UNROLL chunks plus an immediate offset, so no per-chunk index
// arithmetic competes with the dequantization for issue slots (batch 1 is bound by instruction issue,
// not by the weight stream, once the stream has enough bytes in flight).
template <int MB, bool SMALL_GROUP>
struct WarpSlice {
    static constexpr int METAS = SMALL_GROUP ? 2 : 1;  // scale entries per chunk (group 32: two groups)
    const uint4* xq[MB];      // the lane's activations of chunk c_begin (uint4 = 8 inputs), per 8-row block
    const uint2* meta;        // entry of group 0 for this lane group
    int c_begin, n_chunks, n_full, group_shift, group_mask, groups, K, t, fp16_scales;
    // part[s % CHAINS]: two independent mma chains per chunk rather than one of four (where registers allow)
    static constexpr int CHAINS = SMALL_GROUP && MB >= 2 ? 1 : 2;
    float acc[MB][4], part[CHAINS][MB][4];

    // xs: the block's staged activations (x_smem) with row stride `stride` from block chunk `block_begin`.
    __device__ __forceinline__ void init(const Problem& p, int tile, int m0, int g, int lane_t, int begin, int end,
                                         const __nv_bfloat16* xs, int stride, int block_begin) {
        t = lane_t;
        K = p.K;
        groups = p.groups;
        fp16_scales = p.fp16_scales;
        c_begin = begin;
        n_chunks = end - begin;
        n_full = max(0, min(end, p.K / CHUNK_K) - begin);            // chunks with no input past K
        meta = p.meta + (size_t)tile * p.groups * 8 + g;
        group_shift = SMALL_GROUP ? 0 : p.log2_blocks_per_group - 1;  // chunk -> group (>= 64 inputs)
        group_mask = SMALL_GROUP ? 0 : (1 << group_shift) - 1;
#pragma unroll
        for (int b = 0; b < MB; ++b) {
            // Rows past M read row M - 1: their columns of the mma are never stored.
            const int m = min(m0 + b * 8 + g, p.M - 1);
            xq[b] = p.x_smem_bytes ? reinterpret_cast<const uint4*>(xs + (size_t)(m - m0) * stride) + (begin - block_begin) * 8 + t
                             : reinterpret_cast<const uint4*>(p.x + (size_t)m * p.K) + (size_t)begin * 8 + t;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                acc[b][i] = 0.f;
#pragma unroll
                for (int c = 0; c < CHAINS; ++c) part[c][b][i] = 0.f;
            }
        }
    }

    // Activations of chunk c_begin + i (two 16-byte loads per 8-row block), bounded by K on the tail.
    template <bool TAIL>
    __device__ __forceinline__ void load_x(int i, uint4 (&xs)[MB][2]) const {
#pragma unroll
        for (int b = 0; b < MB; ++b)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                xs[b][h] = (!TAIL || (c_begin + i) * CHUNK_K + h * 32 + 8 * t < K)
                    ? xq[b][i * 8 + h * 4] : make_uint4(0, 0, 0, 0);     // generic load: shared or global
    }

    template <bool TAIL>
    __device__ __forceinline__ void load_scales(int i, uint2 (&sc)[METAS]) const {
        const int c = c_begin + i;
        if (SMALL_GROUP) {
            sc[0] = __ldg(meta + (TAIL ? min(2 * c, groups - 1) : 2 * c) * 8);
            sc[METAS - 1] = __ldg(meta + (TAIL ? min(2 * c + 1, groups - 1) : 2 * c + 1) * 8);
        } else {
            sc[0] = __ldg(meta + (size_t)(unsigned(c) >> group_shift) * 8);
        }
    }

    // The group's fp32 partial sums times its scales into the running sums.
    __device__ __forceinline__ void fold(uint2 sc) {
        const float s_g = scale_of(sc.x, fp16_scales), s_g8 = scale_of(sc.y, fp16_scales);
#pragma unroll
        for (int b = 0; b < MB; ++b) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float sum = part[0][b][j];
#pragma unroll
                for (int c = 1; c < CHAINS; ++c) sum += part[c][b][j];
                acc[b][j] += (j < 2 ? s_g : s_g8) * sum;
#pragma unroll
                for (int c = 0; c < CHAINS; ++c) part[c][b][j] = 0.f;
            }
        }
    }

    // Chunk c_begin + i (its lane word, scale entries and activations) into the sums.
    __device__ __forceinline__ void chunk(uint4 word, const uint2 (&sc)[METAS], const uint4 (&xs)[MB][2], int i) {
        const uint32_t w4[4] = {word.x, word.y, word.z, word.w};
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const int h = s >> 1;
            const uint2 m = sc[SMALL_GROUP ? h : 0];
            uint32_t a[4];
            dequantize(w4[s], zero_pair(m.x), zero_pair(m.y), a);
            mma_k_step<MB>(part[s % CHAINS], a, xs, s);
            if (SMALL_GROUP && (s & 1)) fold(m);                  // a group per 32-input block
        }
        // A group of >= 64 inputs ends after this chunk when the next chunk starts a new one, or the
        // warp's range ends here.
        if (!SMALL_GROUP && ((((c_begin + i + 1) & group_mask) == 0) || i == n_chunks - 1)) fold(sc[0]);
    }

    // The chunk past the last full one, when K is not a multiple of 64 and this warp owns it.
    __device__ __forceinline__ void tail(uint4 word) {
        uint2 sc[METAS];
        uint4 xs[MB][2];
        load_scales<true>(n_full, sc);
        load_x<true>(n_full, xs);
        chunk(word, sc, xs, n_full);
    }
};

// The weight stream, two ways (the ladder's two CUDA rungs):
//   STREAM_REGISTERS: a ring of UNROLL 16-byte loads per lane in registers (ld.global.nc): each
//     request is tracked by the SM's load unit, whose capacity caps the bytes in flight;
//   STREAM_BULK: a ring of STAGES x STAGE_CHUNKS chunks per warp in shared memory, each stage one
//     bulk copy (cp.async.bulk, the Hopper copy engine) issued by one lane and awaited on an mbarrier:
//     kilobytes in flight per instruction, nothing held in registers;
//   STREAM_ASYNC: a ring of ASYNC_DEPTH chunks per warp in shared memory, each lane copying its own
//     16-byte word and scale entries with cp.async (one commit group per chunk): deeper than the
//     register ring (no register or scoreboard per load in flight) with no barrier between lanes.
constexpr int STREAM_REGISTERS = 0, STREAM_BULK = 1, STREAM_ASYNC = 2;
#ifndef LAB_ASYNC_DEPTH
#define LAB_ASYNC_DEPTH 4
#endif
constexpr int ASYNC_DEPTH = LAB_ASYNC_DEPTH;         // chunks in flight per warp (512 bytes of weights each)
constexpr int STAGES = 4, STAGE_CHUNKS = 4;           // 8 KB of weights in flight per warp
constexpr int STAGE_SCALE_ENTRIES = 2 * STAGE_CHUNKS * 8;  // a stage's scale entries: at most one group per 32 inputs
constexpr int BULK_RING_BYTES = WARPS * STAGES * STAGE_CHUNKS * 512 + WARPS * STAGES * STAGE_SCALE_ENTRIES * 8;

// The register ring: slot u holds chunk i0 + u (its word and scale entries); once taken it is
// refilled with chunk i0 + u + UNROLL. Small batches fetch their activations one chunk ahead into the
// other of two buffers (they come from L1/L2: one chunk of work covers that latency). Full chunks only;
// the caller does the tail. Whole rounds of UNROLL chunks run without per-chunk bounds checks.
template <int MB, int UNROLL, bool SMALL_GROUP, typename Stage>
__device__ __forceinline__ void stream_registers(WarpSlice<MB, SMALL_GROUP>& w, const uint4* wp, Stage stage) {
    static_assert(UNROLL % 2 == 0, "the activation buffers alternate with the chunk's parity");
    constexpr int METAS = WarpSlice<MB, SMALL_GROUP>::METAS;
    constexpr bool X_AHEAD = MB <= 2;
    uint4 words[UNROLL];
    uint2 scales[UNROLL][METAS];
    uint4 xs[2][MB][2];
    const int n = w.n_full;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
        if (u < n) {
            words[u] = load_weights(wp + u * 32);
            w.template load_scales<false>(u, scales[u]);
        }
    stage();                                             // the activations, while the ring fills
    if (X_AHEAD && n > 0) w.template load_x<false>(0, xs[0]);
    // Chunk i = i0 + u from slot u (u is a compile-time constant in every call).
    auto step = [&](int u, int i) {
        const uint4 word = words[u];
        uint2 sc[METAS];
#pragma unroll
        for (int j = 0; j < METAS; ++j) sc[j] = scales[u][j];
        if (i + UNROLL < n) {
            words[u] = load_weights(wp + (u + UNROLL) * 32);
            w.template load_scales<false>(i + UNROLL, scales[u]);
        }
        if (X_AHEAD) {
            if (i + 1 < n) w.template load_x<false>(i + 1, xs[(u + 1) & 1]);
        } else {
            w.template load_x<false>(i, xs[u & 1]);
        }
        w.chunk(word, sc, xs[u & 1], i);
    };
    int i0 = 0;
    for (; i0 + UNROLL <= n; i0 += UNROLL) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) step(u, i0 + u);
        wp += UNROLL * 32;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
        if (i0 + u < n) step(u, i0 + u);
}

// The bulk ring: per warp and stage, STAGE_CHUNKS lane words and the scale entries of their groups,
// two bulk copies completing one barrier phase. Full chunks only; the caller does the tail.
template <int MB, bool SMALL_GROUP, typename Stage>
__device__ __forceinline__ void stream_bulk(WarpSlice<MB, SMALL_GROUP>& w, const char* src, const uint2* tile_meta,
                                            unsigned char* smem, uint64_t (&bars)[STAGES], int warp, int lane,
                                            int g, uint64_t policy, Stage stage) {
    constexpr int METAS = WarpSlice<MB, SMALL_GROUP>::METAS;
    auto ring = reinterpret_cast<uint4 (*)[STAGES][STAGE_CHUNKS * 32]>(smem);
    auto ring_scales = reinterpret_cast<uint2 (*)[STAGES][STAGE_SCALE_ENTRIES]>(smem + WARPS * STAGES * STAGE_CHUNKS * 512);
    const int n = w.n_full;
    const int n_stages = (n + STAGE_CHUNKS - 1) / STAGE_CHUNKS;
    // Group of the chunk's first and second 32-input blocks.
    auto group_lo = [&](int c) { return SMALL_GROUP ? 2 * c : c >> w.group_shift; };
    auto group_hi = [&](int c) { return SMALL_GROUP ? 2 * c + 1 : c >> w.group_shift; };
    auto first_group = [&](int j) { return group_lo(w.c_begin + j * STAGE_CHUNKS); };
    auto issue = [&](int j) {
        const int st = j % STAGES;
        const int chunks = min(STAGE_CHUNKS, n - j * STAGE_CHUNKS);
        const int first = first_group(j), count = group_hi(w.c_begin + j * STAGE_CHUNKS + chunks - 1) - first + 1;
        barrier_expect(&bars[st], chunks * 512 + count * 64);
        bulk_copy(ring[warp][st], src + (size_t)j * STAGE_CHUNKS * 512, chunks * 512, &bars[st], policy);
        bulk_copy(ring_scales[warp][st], tile_meta + (size_t)first * 8, count * 64, &bars[st], policy);
    };
    if (lane == 0) {
#pragma unroll
        for (int st = 0; st < STAGES; ++st) barrier_init(&bars[st]);
#ifndef LAB_NO_BULK_COPY
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
        for (int j = 0; j < min(STAGES, n_stages); ++j) issue(j);
    }
    __syncwarp();
    stage();
    constexpr bool X_AHEAD = MB <= 2;                    // activations one chunk ahead (registers allow)
    uint4 xs[MB][2], xs_next[MB][2];
    if (X_AHEAD && n > 0) w.template load_x<false>(0, xs);
    for (int j = 0; j < n_stages; ++j) {
        const int st = j % STAGES, first = first_group(j);
        barrier_wait(&bars[st], (j / STAGES) & 1);
        uint4 words[STAGE_CHUNKS];
        uint2 sc[STAGE_CHUNKS][METAS];
#pragma unroll
        for (int q = 0; q < STAGE_CHUNKS; ++q) {
            const int c = w.c_begin + min(j * STAGE_CHUNKS + q, n - 1);
            words[q] = ring[warp][st][q * 32 + lane];
            sc[q][0] = ring_scales[warp][st][(group_lo(c) - first) * 8 + g];
            if (SMALL_GROUP) sc[q][METAS - 1] = ring_scales[warp][st][(group_hi(c) - first) * 8 + g];
        }
        __syncwarp();
        if (lane == 0 && j + STAGES < n_stages) issue(j + STAGES);
#pragma unroll
        for (int q = 0; q < STAGE_CHUNKS; ++q) {
            const int i = j * STAGE_CHUNKS + q;
            if (i < n) {
                if (X_AHEAD) {
                    if (i + 1 < n) w.template load_x<false>(i + 1, xs_next);
                } else {
                    w.template load_x<false>(i, xs);
                }
                w.chunk(words[q], sc[q], xs, i);
#pragma unroll
                for (int b = 0; b < MB; ++b) if (X_AHEAD) xs[b][0] = xs_next[b][0], xs[b][1] = xs_next[b][1];
            }
        }
    }
}

// The cp.async ring: chunk i lands in slot i % ASYNC_DEPTH (its commit group); the copy for chunk
// i + ASYNC_DEPTH - 1 is issued before chunk i is awaited, so ASYNC_DEPTH - 1 chunks stay in flight
// while one is multiplied. Each lane copies and reads only its own word and scale entries, so a
// lane's cp.async.wait_group alone orders them. Full chunks only; the caller does the tail.
template <int MB, bool SMALL_GROUP>
__host__ __device__ constexpr int async_ring_bytes() {
    return WARPS * ASYNC_DEPTH * 32 * (16 + 8 * WarpSlice<MB, SMALL_GROUP>::METAS);
}

__device__ __forceinline__ void cp_async(void* dst, const void* src, int bytes16or8) {
    if (bytes16or8 == 16)
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" :: "r"(smem_address(dst)), "l"(src) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" :: "r"(smem_address(dst)), "l"(src) : "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

template <int MB, bool SMALL_GROUP, typename Stage>
__device__ __forceinline__ void stream_async(WarpSlice<MB, SMALL_GROUP>& w, const uint4* wp, unsigned char* smem,
                                             int warp, int lane, Stage stage) {
    constexpr int METAS = WarpSlice<MB, SMALL_GROUP>::METAS, D = ASYNC_DEPTH;
    static_assert((D & (D - 1)) == 0 && D >= 2, "the ring's depth is a power of two");
    uint4* ring = reinterpret_cast<uint4*>(smem) + (size_t)warp * D * 32 + lane;                   // [D][32]
    uint2* ring_meta = reinterpret_cast<uint2*>(smem + WARPS * D * 512) + (size_t)warp * D * METAS * 32 + lane;
    const int n = w.n_full;
    auto issue = [&](int slot, int i) {          // chunk i (< n) into `slot`
        cp_async(ring + slot * 32, wp + (size_t)i * 32, 16);
        const int c = w.c_begin + i;
        if (SMALL_GROUP) {
            cp_async(ring_meta + (slot * METAS) * 32, w.meta + (size_t)(2 * c) * 8, 8);
            cp_async(ring_meta + (slot * METAS + METAS - 1) * 32, w.meta + (size_t)(2 * c + 1) * 8, 8);
        } else {
            cp_async(ring_meta + (slot * METAS) * 32, w.meta + (size_t)(unsigned(c) >> w.group_shift) * 8, 8);
        }
    };
    auto commit = [] { asm volatile("cp.async.commit_group;" ::: "memory"); };
#pragma unroll
    for (int u = 0; u < D - 1; ++u) {
        if (u < n) issue(u, u);
        commit();
    }
    stage();                                         // the activations, while the ring fills
    constexpr bool X_AHEAD = MB <= 2;
    uint4 xs[2][MB][2];
    if (X_AHEAD && n > 0) w.template load_x<false>(0, xs[0]);
    auto step = [&](int u, int i) {                  // chunk i from slot u = i % D
        if (i + D - 1 < n) issue((u + D - 1) % D, i + D - 1);
        commit();
        cp_async_wait<D - 1>();
        const uint4 word = ring[u * 32];
        uint2 sc[METAS];
#pragma unroll
        for (int j = 0; j < METAS; ++j) sc[j] = ring_meta[(u * METAS + j) * 32];
        if (X_AHEAD) {
            if (i + 1 < n) w.template load_x<false>(i + 1, xs[(u + 1) & 1]);
        } else {
            w.template load_x<false>(i, xs[u & 1]);
        }
        w.chunk(word, sc, xs[u & 1], i);
    };
    int i0 = 0;
    for (; i0 + D <= n; i0 += D) {
#pragma unroll
        for (int u = 0; u < D; ++u) step(u, i0 + u);
    }
#pragma unroll
    for (int u = 0; u < D; ++u)
        if (i0 + u < n) step(u, i0 + u);
    cp_async_wait<0>();
}

// Shared memory before the staged activations: the bulk ring while streaming, then the warps' sums.
template <int MB, bool SMALL_GROUP, int STREAM>
__host__ __device__ constexpr int smem_bytes() {
    constexpr int sums = WARPS * MB * 4 * 32 * 4;
    constexpr int ring = STREAM == STREAM_BULK ? BULK_RING_BYTES
                       : STREAM == STREAM_ASYNC ? async_ring_bytes<MB, SMALL_GROUP>() : 0;
    return sums > ring ? sums : ring;
}

constexpr int X_SMEM_MAX_BYTES = 32 * 1024;         // staged activations: two blocks per SM still fit

template <int MB, int UNROLL, bool SMALL_GROUP, int STREAM>
__global__ void __launch_bounds__(THREADS, MB <= 2 ? 2 : 1) w4a16_mma(Problem p) {   // small batches: two blocks per SM
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x * p.wn + warp / p.wk;
    const int split = blockIdx.y * p.wk + warp % p.wk, n_splits = p.splits * p.wk;
    const int m0 = blockIdx.z * M_TILE;
    const int c_begin = int((long long)split * p.k_chunks / n_splits);
    const int c_end = int((long long)(split + 1) * p.k_chunks / n_splits);
    const bool active = tile < p.n_tiles;
    const uint64_t policy = evict_first_policy();

    // Shared memory: the bulk-copy ring while streaming, then the warps' sums (one buffer, both uses).
    // (dynamic: the bulk ring is larger than the 48 KB a static array may take; launch gives smem_bytes<>)
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) uint64_t bars[WARPS][STAGES];
    __shared__ int is_last;

    // The block's activations into shared memory (after the ring or the warps' sums: smem_bytes<>).
    const int2 cb = block_chunks(p);
    const int x_stride = (cb.y - cb.x) * CHUNK_K;
    __nv_bfloat16* x_staged = reinterpret_cast<__nv_bfloat16*>(smem + smem_bytes<MB, SMALL_GROUP, STREAM>());
    const bool staged = p.x_smem_bytes > 0;
    allow_dependents();
    // Once the weights' first loads are in flight: wait for the previous kernel (PDL), then bring in
    // this block's activations (copied, or computed by a fused prologue). Every thread calls it once.
    auto stage = [&]() {
        grid_dependency_wait();
        if (p.prologue != PROLOGUE_NONE) {
            stage_prologue(p, cb, x_staged);
        } else if (staged) {
            stage_x(p, cb, x_staged, m0, min(M_TILE, p.M - m0), x_stride);
            wait_x_staging();
        }
    };
    WarpSlice<MB, SMALL_GROUP> w;
    w.init(p, active ? tile : 0, m0, g, t, c_begin, c_end, x_staged, x_stride, cb.x);
    const uint4* wp = p.wq + ((size_t)(active ? tile : 0) * p.k_chunks + c_begin) * 32 + lane;
    if (active) {
        if (STREAM == STREAM_REGISTERS) {
            stream_registers<MB, UNROLL, SMALL_GROUP>(w, wp, stage);
        } else if (STREAM == STREAM_ASYNC) {
            stream_async<MB, SMALL_GROUP>(w, wp, smem, warp, lane, stage);
        } else {
            stream_bulk<MB, SMALL_GROUP>(w, reinterpret_cast<const char*>(wp - lane), p.meta + (size_t)tile * p.groups * 8,
                                         smem, bars[warp], warp, lane, g, policy, stage);
        }
        if (w.n_full < w.n_chunks) w.tail(load_weights(wp + w.n_full * 32));
    } else {
        stage();                                        // every thread of the block meets its barriers
    }
    float (&acc)[MB][4] = w.acc;
    if (STREAM != STREAM_REGISTERS) __syncthreads();    // every warp is done with the ring

    // The WK warps of a tile: summed in warp order through shared memory.
    auto sums = reinterpret_cast<float (*)[MB][4][32]>(smem);
#pragma unroll
    for (int b = 0; b < MB; ++b)
#pragma unroll
        for (int i = 0; i < 4; ++i) sums[warp][b][i][lane] = acc[b][i];
    __syncthreads();
    const bool leader = (warp % p.wk) == 0;
    if (leader) {
#pragma unroll
        for (int b = 0; b < MB; ++b)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float v = 0.f;
                for (int j = 0; j < p.wk; ++j) v += sums[warp + j][b][i][lane];
                acc[b][i] = v;
            }
    }

    const int n_row = tile * 16 + g;                  // output column (weight row) of acc[.][0..1]
    if (p.splits > 1) {
        // Block partials into the workspace [splits][M_pad][n_tiles * 16]; the last block sums them.
        const int n_pad = p.n_tiles * 16, m_pad = gridDim.z * M_TILE;
        if (leader && active)
            for_each_output<MB>(m0, n_row, t, [&](int b, int i, int m, int n) {
                p.partials[((size_t)blockIdx.y * m_pad + m) * n_pad + n] = acc[b][i];
            });
        __threadfence();
        __syncthreads();
        int* counter = p.counters + blockIdx.z * gridDim.x + blockIdx.x;
        if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == p.splits - 1;
        __syncthreads();
        if (!is_last) return;
        __threadfence();
        if (leader && active) {
            // Split by split, every output's load of that split in flight at once (a loop per output
            // would wait one L2 round trip per split per output: 4 x MB x splits of them in a row).
#pragma unroll
            for (int b = 0; b < MB; ++b)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[b][i] = 0.f;
            for (int s = 0; s < p.splits; ++s)
                for_each_output<MB>(m0, n_row, t, [&](int b, int i, int m, int n) {
                    acc[b][i] += __ldcg(p.partials + ((size_t)s * m_pad + m) * n_pad + n);
                });
        }
        if (threadIdx.x == 0) *counter = 0;             // ready for the next call (and a graph replay)
    }
    if (leader && active)
        for_each_output<MB>(m0, n_row, t, [&](int b, int i, int m, int n) {
            if (m < p.M && n < p.N) p.y[(size_t)m * p.N + n] = __float2bfloat16(acc[b][i]);
        });
}

// The whole weight dequantized to bf16 [N, K] (the path for batches where the tensor cores, not the
// weight stream, bound the time: then cuBLAS multiplies the copy). One warp per (tile, chunk): the
// lane words are dequantized into a 16 x 64 tile in shared memory, then written out row by row.
__global__ void __launch_bounds__(32) dequantize_to_bf16(const uint4* __restrict__ wq, const uint2* __restrict__ meta,
                                   __nv_bfloat16* __restrict__ w, int N, int K, int n_tiles, int k_chunks, int groups,
                                   int log2_blocks_per_group, int fp16_scales) {
    __shared__ __nv_bfloat16 tile_values[16][CHUNK_K];
    const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    const int c = blockIdx.x % k_chunks, tile = blockIdx.x / k_chunks;
    const uint4 v = wq[(size_t)blockIdx.x * 32 + lane];
    const uint32_t w4[4] = {v.x, v.y, v.z, v.w};
    for (int s = 0; s < 4; ++s) {
        const int group = min((2 * c + (s >> 1)) >> log2_blocks_per_group, groups - 1);
        const uint2 sc = meta[((size_t)tile * groups + group) * 8 + g];
        uint32_t a[4];
        dequantize(w4[s], zero_pair(sc.x), zero_pair(sc.y), a);
        for (int r = 0; r < 4; ++r) {                   // reg r: row g + 8 (r & 1), inputs 2 (r >> 1) and + 1
            const float scale = scale_of((r & 1) ? sc.y : sc.x, fp16_scales);
            const __nv_bfloat162 q = *reinterpret_cast<const __nv_bfloat162*>(&a[r]);
            const int k = 32 * (s >> 1) + 8 * t + 4 * (s & 1) + 2 * (r >> 1);
            tile_values[g + 8 * (r & 1)][k] = __float2bfloat16(__bfloat162float(q.x) * scale);
            tile_values[g + 8 * (r & 1)][k + 1] = __float2bfloat16(__bfloat162float(q.y) * scale);
        }
    }
    __syncwarp();
    for (int i = lane; i < 16 * CHUNK_K; i += 32) {
        const int row = i / CHUNK_K, k = c * CHUNK_K + i % CHUNK_K, n = tile * 16 + row;
        if (n < N && k < K) w[(size_t)n * K + k] = tile_values[row][i % CHUNK_K];
    }
}

template <int MB, bool SMALL_GROUP, int STREAM>
cudaError_t launch_mb(const Problem& p, dim3 grid, cudaStream_t stream) {
    // Register ring depth: as deep as registers allow without spilling (two blocks per SM up to MB 2).
    constexpr int UNROLL = MB == 1 ? (SMALL_GROUP ? 2 : 6) : MB == 2 ? (SMALL_GROUP ? 2 : 4) : MB == 4 ? 4 : 2;
    constexpr int bytes = smem_bytes<MB, SMALL_GROUP, STREAM>();
    static bool attribute_set = false;               // once per instantiation, before its first launch
    if (!attribute_set) {
        cudaError_t e = cudaFuncSetAttribute(w4a16_mma<MB, UNROLL, SMALL_GROUP, STREAM>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, bytes + X_SMEM_MAX_BYTES);
        if (e != cudaSuccess) return e;
        attribute_set = true;
    }
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = dim3(THREADS);
    config.dynamicSmemBytes = bytes + p.x_smem_bytes;
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = p.pdl ? 1 : 0;
    return cudaLaunchKernelEx(&config, w4a16_mma<MB, UNROLL, SMALL_GROUP, STREAM>, p);
}

template <bool SMALL_GROUP, int STREAM>
cudaError_t launch_group(const Problem& p, int mb, dim3 grid, cudaStream_t stream) {
    switch (mb) {
        case 1: return launch_mb<1, SMALL_GROUP, STREAM>(p, grid, stream);
        case 2: return launch_mb<2, SMALL_GROUP, STREAM>(p, grid, stream);
        case 4: return launch_mb<4, SMALL_GROUP, STREAM>(p, grid, stream);
        case 8: return launch_mb<8, SMALL_GROUP, STREAM>(p, grid, stream);
        default: return cudaErrorInvalidValue;
    }
}

template <int STREAM>
cudaError_t launch_stream(const Problem& p, int mb, dim3 grid, cudaStream_t stream) {
    return p.log2_blocks_per_group == 0 ? launch_group<true, STREAM>(p, mb, grid, stream)
                                        : launch_group<false, STREAM>(p, mb, grid, stream);
}


// ------------------------------------------------------------------------------ the rows tiling (9 to 64 rows)
// From two 8-row blocks on, the batch-1 layout above runs out of shared-memory bandwidth and registers:
// every warp re-reads all MB blocks' activations for its one tile, and above 16 rows a block's K range
// no longer fits shared memory, so they come from L1 one chunk at a time. The rows kernel stages for the
// whole block, in a ring of windows (ROWS_WINDOW chunks of 64 inputs, up to 64 rows), the activations
// once and every warp's lane words and scale entries (cp.async, ROWS_STAGES deep, one barrier per
// window; the scale entries once per lane group), and gives each warp TW tiles, so each activation fragment read from shared memory feeds
// TW x 4 mma instead of 4. The group's scale multiplies the dequantized weights (bf16 q - z is exact;
// times a bf16 scale it is rounded once, as a dequantized bf16 weight is; fp16 scales go through fp32),
// so the sums run straight in acc. (Scaling the fp32 sums per group after the mma, as w4a16_mma does,
// compiled to more instructions per window here: the partial sums' zeroing and the fold's branches.)
// Partition: a block is 8 warps x TW tiles over all of its K range (no K split inside a block);
// SPLITS blocks along K, summed as the kernel above sums them.
constexpr int ROWS_WINDOW = 2;                      // chunks per window (128 inputs)
constexpr int ROWS_TILES_PER_WARP = 2;              // 4 measured no faster at 8-64 rows and spills at 32
constexpr int ROWS_X_PITCH = ROWS_WINDOW * CHUNK_K * 2 + 64;   // bytes per staged row: = 64 mod 128, so the
                                                    // two rows a quarter-warp reads sit in different banks

template <int MB, int TW, bool SMALL_GROUP>
struct RowsLayout {
    static constexpr int METAS = SMALL_GROUP ? 2 : 1;           // scale entries per chunk
    static constexpr int X_BYTES = MB * 8 * ROWS_X_PITCH;         // one window's activations
    static constexpr int W_BYTES = WARPS * TW * ROWS_WINDOW * 512;  // one window's lane words
    static constexpr int M_BYTES = WARPS * TW * ROWS_WINDOW * METAS * 8 * 8;    // and scale entries (8 per tile)
    static constexpr int STAGE_BYTES = X_BYTES + W_BYTES + M_BYTES;
    // windows in the ring (all but one in flight while one is multiplied): 4, or 3 where 4 would not fit
    static constexpr int STAGES = 4 * STAGE_BYTES <= 200 * 1024 ? 4 : 3;
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES;
};

__device__ __forceinline__ void cp_async_16_or_zero(void* dst, const void* src, bool valid) {
    // src-size 0 fills the 16 bytes with zeros (inputs past K, rows past M)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(smem_address(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" :: "r"(smem_address(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
    __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
    return *reinterpret_cast<uint32_t*>(&r);
}

// bf16x2 (q - z) times a 16-bit scale, rounded once to bf16x2: a bf16 scale multiplies in bf16 (the
// exact product rounded once), an fp16 one in fp32. (A template parameter: a runtime flag compiled to
// a branch per register.)
template <bool FP16_SCALES>
__device__ __forceinline__ uint32_t scaled(uint32_t q_minus_z, uint32_t meta_half) {
    if constexpr (!FP16_SCALES) {
        return bf16x2_mul(q_minus_z, __byte_perm(meta_half, 0, 0x1010));
    } else {
        const float s = scale_of(meta_half, true);
        const float lo = __uint_as_float(q_minus_z << 16) * s, hi = __uint_as_float(q_minus_z & 0xFFFF0000u) * s;
        __nv_bfloat162 r = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&r);
    }
}

template <int MB, int TW, bool SMALL_GROUP, bool FP16_SCALES>
__global__ void __launch_bounds__(THREADS, MB <= 2 ? 2 : 1) w4a16_rows(Problem p) {
    using L = RowsLayout<MB, TW, SMALL_GROUP>;
    constexpr int METAS = L::METAS, ROWS = MB * 8, ROWS_STAGES = L::STAGES;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.z * M_TILE, rows = min(ROWS, p.M - m0);
    const int2 cb = block_chunks(p);                      // wk = 1: the block's K range is its split's
    const int n_chunks = cb.y - cb.x, n_windows = (n_chunks + ROWS_WINDOW - 1) / ROWS_WINDOW;
    const int tile0 = (blockIdx.x * WARPS + warp) * TW;
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ int is_last;

    // Window j into stage st: the block's activations (every thread a share), the warp's lane words and
    // scale entries (each lane its own), one commit group per thread.
    auto issue = [&](int j) {
        unsigned char* stage = smem + (j % ROWS_STAGES) * L::STAGE_BYTES;
        const int c0 = cb.x + j * ROWS_WINDOW;
        constexpr int X_WORDS = ROWS * ROWS_WINDOW * 8;              // 16-byte words of a window's activations
        static_assert(X_WORDS % THREADS == 0, "every thread copies the same number of activation words");
#pragma unroll
        for (int u = 0; u < X_WORDS / THREADS; ++u) {
            const int idx = u * THREADS + threadIdx.x;
            const int r = idx / (ROWS_WINDOW * 8), q = idx % (ROWS_WINDOW * 8);
            const int k = (c0 + q / 8) * CHUNK_K + (q % 8) * 8;
            const bool valid = r < rows && k < p.K && c0 + q / 8 < cb.y;
            const __nv_bfloat16* src = p.x + (size_t)(valid ? m0 + r : 0) * p.K + (valid ? k : 0);
            cp_async_16_or_zero(stage + r * ROWS_X_PITCH + q * 16, src, valid);
        }
        uint4* words = reinterpret_cast<uint4*>(stage + L::X_BYTES) + warp * TW * ROWS_WINDOW * 32 + lane;
        uint2* metas = reinterpret_cast<uint2*>(stage + L::X_BYTES + L::W_BYTES) + warp * TW * ROWS_WINDOW * METAS * 8 + g;
#pragma unroll
        for (int tw = 0; tw < TW; ++tw) {
            const int tile = min(tile0 + tw, p.n_tiles - 1);
#pragma unroll
            for (int c = 0; c < ROWS_WINDOW; ++c) {
                const int chunk = min(c0 + c, cb.y - 1);              // past the range: a repeat, never used
                cp_async(words + (tw * ROWS_WINDOW + c) * 32, p.wq + ((size_t)tile * p.k_chunks + chunk) * 32 + lane, 16);
                const uint2* tile_meta = p.meta + (size_t)tile * p.groups * 8 + g;
                if (t == 0) {                                 // one lane per lane group: its rows' entry
#pragma unroll
                    for (int e = 0; e < METAS; ++e) {
                        const int group = SMALL_GROUP ? min(2 * chunk + e, p.groups - 1)
                                                      : min(chunk >> (p.log2_blocks_per_group - 1), p.groups - 1);
                        cp_async_8(metas + ((tw * ROWS_WINDOW + c) * METAS + e) * 8, tile_meta + (size_t)group * 8);
                    }
                }
            }
        }
    };
    auto commit = [] { asm volatile("cp.async.commit_group;" ::: "memory"); };

    float acc[TW][MB][4];
#pragma unroll
    for (int tw = 0; tw < TW; ++tw)
#pragma unroll
        for (int b = 0; b < MB; ++b)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[tw][b][i] = 0.f;

#pragma unroll
    for (int j = 0; j < ROWS_STAGES - 1; ++j) {
        if (j < n_windows) issue(j);
        commit();
    }
    for (int j = 0; j < n_windows; ++j) {
        cp_async_wait<ROWS_STAGES - 2>();
        __syncthreads();                                  // window j landed for every thread; j - 1 is free
        if (j + ROWS_STAGES - 1 < n_windows) issue(j + ROWS_STAGES - 1);
        commit();
        const unsigned char* stage = smem + (j % ROWS_STAGES) * L::STAGE_BYTES;
        const uint4* words = reinterpret_cast<const uint4*>(stage + L::X_BYTES) + warp * TW * ROWS_WINDOW * 32 + lane;
        const uint2* metas = reinterpret_cast<const uint2*>(stage + L::X_BYTES + L::W_BYTES) + warp * TW * ROWS_WINDOW * METAS * 8 + g;
#pragma unroll
        for (int c = 0; c < ROWS_WINDOW; ++c) {
            if (j * ROWS_WINDOW + c >= n_chunks) break;
            uint4 xs[MB][2];                              // lane t's 8 inputs of each 32-input block, row g of each 8
#pragma unroll
            for (int b = 0; b < MB; ++b)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    xs[b][h] = *reinterpret_cast<const uint4*>(stage + (b * 8 + g) * ROWS_X_PITCH + c * 128 + h * 64 + t * 16);
#pragma unroll
            for (int tw = 0; tw < TW; ++tw) {
                const uint4 word = words[(tw * ROWS_WINDOW + c) * 32];
                uint2 sc[METAS];
#pragma unroll
                for (int e = 0; e < METAS; ++e) sc[e] = metas[((tw * ROWS_WINDOW + c) * METAS + e) * 8];
                const uint32_t w4[4] = {word.x, word.y, word.z, word.w};
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    const int h = s >> 1;
                    const uint2 m = sc[SMALL_GROUP ? h : 0];
                    uint32_t a[4];
                    dequantize(w4[s], zero_pair(m.x), zero_pair(m.y), a);
                    a[0] = scaled<FP16_SCALES>(a[0], m.x);
                    a[1] = scaled<FP16_SCALES>(a[1], m.y);
                    a[2] = scaled<FP16_SCALES>(a[2], m.x);
                    a[3] = scaled<FP16_SCALES>(a[3], m.y);
                    mma_k_step<MB>(acc[tw], a, xs, s);
                }
            }
        }
    }
    cp_async_wait<0>();

    // Split-K: block partials into the workspace [splits][M_pad][n_tiles * 16]; the last block of a tile
    // group sums them in split order (as w4a16_mma does).
    const int m_pad = gridDim.z * M_TILE, n_pad = p.n_tiles * 16;
    if (p.splits > 1) {
#pragma unroll
        for (int tw = 0; tw < TW; ++tw)
            if (tile0 + tw < p.n_tiles)
                for_each_output<MB>(m0, (tile0 + tw) * 16 + g, t, [&](int b, int i, int m, int n) {
                    p.partials[((size_t)blockIdx.y * m_pad + m) * n_pad + n] = acc[tw][b][i];
                });
        __threadfence();
        __syncthreads();
        int* counter = p.counters + blockIdx.z * gridDim.x + blockIdx.x;
        if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == p.splits - 1;
        __syncthreads();
        if (!is_last) return;
        __threadfence();
        // SPLIT_LOADS splits' loads in flight at once (about 64 per lane), added in split order: one L2
        // round trip per SPLIT_LOADS splits rather than per split
        constexpr int SPLIT_LOADS = 64 / (TW * MB * 4) > 1 ? 64 / (TW * MB * 4) : 1;
#pragma unroll
        for (int tw = 0; tw < TW; ++tw)
#pragma unroll
            for (int b = 0; b < MB; ++b)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[tw][b][i] = 0.f;
        if constexpr (SPLIT_LOADS == 1) {             // 64 loads per split already: no second buffer
            for (int s = 0; s < p.splits; ++s)
#pragma unroll
                for (int tw = 0; tw < TW; ++tw)
                    for_each_output<MB>(m0, min(tile0 + tw, p.n_tiles - 1) * 16 + g, t, [&](int b, int i, int m, int n) {
                        acc[tw][b][i] += __ldcg(p.partials + ((size_t)s * m_pad + m) * n_pad + n);
                    });
        } else for (int s0 = 0; s0 < p.splits; s0 += SPLIT_LOADS) {
            float v[SPLIT_LOADS][TW][MB][4];
#pragma unroll
            for (int u = 0; u < SPLIT_LOADS; ++u)
#pragma unroll
                for (int tw = 0; tw < TW; ++tw)
                    for_each_output<MB>(m0, min(tile0 + tw, p.n_tiles - 1) * 16 + g, t, [&](int b, int i, int m, int n) {
                        v[u][tw][b][i] = s0 + u < p.splits ? __ldcg(p.partials + ((size_t)(s0 + u) * m_pad + m) * n_pad + n) : 0.f;
                    });
#pragma unroll
            for (int u = 0; u < SPLIT_LOADS; ++u)
#pragma unroll
                for (int tw = 0; tw < TW; ++tw)
#pragma unroll
                    for (int b = 0; b < MB; ++b)
#pragma unroll
                        for (int i = 0; i < 4; ++i) acc[tw][b][i] += v[u][tw][b][i];
        }
        if (threadIdx.x == 0) *counter = 0;
    }
#pragma unroll
    for (int tw = 0; tw < TW; ++tw)
        if (tile0 + tw < p.n_tiles)
            for_each_output<MB>(m0, (tile0 + tw) * 16 + g, t, [&](int b, int i, int m, int n) {
                if (m < p.M && n < p.N) p.y[(size_t)m * p.N + n] = __float2bfloat16(acc[tw][b][i]);
            });
}

template <int MB, bool SMALL_GROUP, bool FP16_SCALES>
cudaError_t launch_rows(const Problem& p, dim3 grid, cudaStream_t stream) {
    constexpr int TW = ROWS_TILES_PER_WARP, bytes = RowsLayout<MB, TW, SMALL_GROUP>::SMEM_BYTES;
    static bool attribute_set = false;
    if (!attribute_set) {
        cudaError_t e = cudaFuncSetAttribute(w4a16_rows<MB, TW, SMALL_GROUP, FP16_SCALES>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
        if (e != cudaSuccess) return e;
        attribute_set = true;
    }
    w4a16_rows<MB, TW, SMALL_GROUP, FP16_SCALES><<<grid, THREADS, bytes, stream>>>(p);
    return cudaGetLastError();
}

template <bool SMALL_GROUP, bool FP16_SCALES>
cudaError_t launch_rows_mb(const Problem& p, int mb, dim3 grid, cudaStream_t stream) {
    switch (mb) {
        case 2: return launch_rows<2, SMALL_GROUP, FP16_SCALES>(p, grid, stream);
        case 4: return launch_rows<4, SMALL_GROUP, FP16_SCALES>(p, grid, stream);
        case 8: return launch_rows<8, SMALL_GROUP, FP16_SCALES>(p, grid, stream);
        default: return cudaErrorInvalidValue;
    }
}

}  // namespace

extern "C" {

// mb: 8-row activation blocks per tile (1, 2, 4, 8); bulk: 0 the register ring, 1 bulk copies, 2 the cp.async ring (mb 1);
// grid (ceil(n_tiles / wn), splits, ceil(M / 64)). prologue (PROLOGUE_*): one row only, staged in shared memory;
// residual may be null (RMSNorm of x alone), residual_out null (not written). pdl: launch as a programmatic dependent.
int lab_w4a16_mma(const void* x, const void* wq, const void* meta, void* y, void* partials, void* counters,
                  int M, int N, int K, int n_tiles, int k_chunks, int groups, int log2_blocks_per_group,
                  int wn, int wk, int splits, int mb, int fp16_scales, int bulk, int prologue, const void* residual,
                  const void* norm_weight, void* residual_out, float eps, int pdl, void* stream) {
    if (wn * wk != WARPS || splits < 1 || M < 1) return cudaErrorInvalidValue;
    Problem p{static_cast<const __nv_bfloat16*>(x), static_cast<const uint4*>(wq), static_cast<const uint2*>(meta),
              static_cast<__nv_bfloat16*>(y), static_cast<float*>(partials), static_cast<int*>(counters),
              M, N, K, n_tiles, k_chunks, groups, log2_blocks_per_group, wn, wk, splits, fp16_scales, 0,
              prologue, static_cast<const __nv_bfloat16*>(residual), static_cast<const __nv_bfloat16*>(norm_weight),
              static_cast<__nv_bfloat16*>(residual_out), eps, pdl};
    // Stage the activations when a block's rows x K range fit (batch 1 to a few rows).
    const int block_chunks_max = (int)(((long long)k_chunks * wk + splits * wk - 1) / (splits * wk)) + 1;
    const long long x_bytes = (long long)(M < M_TILE ? M : M_TILE) * block_chunks_max * CHUNK_K * 2;
    if (x_bytes <= X_SMEM_MAX_BYTES) p.x_smem_bytes = (int)x_bytes;
    if (prologue != PROLOGUE_NONE && (M != 1 || p.x_smem_bytes == 0 || K % 8)) return cudaErrorInvalidValue;
    if (prologue == PROLOGUE_ADD_RMS_NORM && norm_weight == nullptr) return cudaErrorInvalidValue;
    dim3 grid((n_tiles + wn - 1) / wn, splits, (M + M_TILE - 1) / M_TILE);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (bulk == 2) {                                 // the cp.async ring: one 8-row block (batch 1) only
        if (mb != 1) return cudaErrorInvalidValue;
        return p.log2_blocks_per_group == 0 ? launch_mb<1, true, STREAM_ASYNC>(p, grid, s)
                                            : launch_mb<1, false, STREAM_ASYNC>(p, grid, s);
    }
    return bulk ? launch_stream<STREAM_BULK>(p, mb, grid, s) : launch_stream<STREAM_REGISTERS>(p, mb, grid, s);
}

// The rows tiling: mb 8-row blocks (2, 4, 8), tw tiles per warp (ROWS_TILES_PER_WARP); grid (ceil(n_tiles / (8 tw)), splits,
// ceil(M / 64)); partials/counters as lab_w4a16_mma's.
int lab_w4a16_rows(const void* x, const void* wq, const void* meta, void* y, void* partials, void* counters,
                   int M, int N, int K, int n_tiles, int k_chunks, int groups, int log2_blocks_per_group,
                   int tw, int splits, int mb, int fp16_scales, void* stream) {
    if (splits < 1 || M < 1 || K % 8) return cudaErrorInvalidValue;
    Problem p{static_cast<const __nv_bfloat16*>(x), static_cast<const uint4*>(wq), static_cast<const uint2*>(meta),
              static_cast<__nv_bfloat16*>(y), static_cast<float*>(partials), static_cast<int*>(counters),
              M, N, K, n_tiles, k_chunks, groups, log2_blocks_per_group, WARPS, 1, splits, fp16_scales, 0,
              PROLOGUE_NONE, nullptr, nullptr, nullptr, 0.f, 0};
    dim3 grid((n_tiles + WARPS * tw - 1) / (WARPS * tw), splits, (M + M_TILE - 1) / M_TILE);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (tw != ROWS_TILES_PER_WARP) return cudaErrorInvalidValue;
    const bool small = log2_blocks_per_group == 0;
    if (fp16_scales) return small ? launch_rows_mb<true, true>(p, mb, grid, s) : launch_rows_mb<false, true>(p, mb, grid, s);
    return small ? launch_rows_mb<true, false>(p, mb, grid, s) : launch_rows_mb<false, false>(p, mb, grid, s);
}

int lab_int4_dequantize(const void* wq, const void* meta, void* w, int N, int K, int n_tiles, int k_chunks,
                        int groups, int log2_blocks_per_group, int fp16_scales, void* stream) {
    dequantize_to_bf16<<<(unsigned)((long long)n_tiles * k_chunks), 32, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const uint4*>(wq), static_cast<const uint2*>(meta), static_cast<__nv_bfloat16*>(w), N, K, n_tiles,
        k_chunks, groups, log2_blocks_per_group, fp16_scales);
    return cudaGetLastError();
}

const char* lab_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"

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

// The weights are read once per call: stream them past L1 and let L2 evict them first.
__device__ __forceinline__ uint4 load_weights(const uint4* ptr, uint64_t policy) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr), "l"(policy));
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

__device__ __forceinline__ float scale_of(uint32_t meta_half, bool fp16_scales) {
    uint16_t bits = meta_half & 0xFFFF;
    if (fp16_scales) return __half2float(*reinterpret_cast<__half*>(&bits));
    return __uint_as_float(uint32_t(bits) << 16);
}

__device__ __forceinline__ uint32_t zero_pair(uint32_t meta_half) {     // bf16x2 (128 + z, 128 + z)
    return (meta_half >> 16) * 0x10001u;
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
};

// One warp's view of its slice of the problem: where its activations and scales are, and the
// running sums. `chunk` multiplies one 64-input chunk (the lane's 16-byte word) into them.
template <int MB, bool SMALL_GROUP>
struct WarpSlice {
    const __nv_bfloat16* xrow[MB];
    bool row_ok[MB];
    const uint2* meta;
    int group_shift, groups, K, t, fp16_scales;
    float acc[MB][4], part[MB][4];

    __device__ __forceinline__ void init(const Problem& p, int tile, int m0, int g, int lane_t) {
        t = lane_t;
        K = p.K;
        groups = p.groups;
        fp16_scales = p.fp16_scales;
        meta = p.meta + (size_t)tile * p.groups * 8 + g;
        group_shift = SMALL_GROUP ? 0 : p.log2_blocks_per_group - 1;           // chunk -> group (>= 64 inputs)
#pragma unroll
        for (int b = 0; b < MB; ++b) {
            const int m = m0 + b * 8 + g;
            row_ok[b] = m < p.M;
            xrow[b] = p.x + (size_t)(row_ok[b] ? m : 0) * p.K + 8 * t;
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[b][i] = part[b][i] = 0.f;
        }
    }

    // The chunk's activations: two 16-byte loads per 8-row block (zero past M and K).
    __device__ __forceinline__ void load_x(int c, uint4 (&xs)[MB][2]) const {
        const int k0 = c * CHUNK_K;
#pragma unroll
        for (int b = 0; b < MB; ++b)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                xs[b][h] = (row_ok[b] && k0 + h * 32 + 8 * t < K)
                    ? __ldg(reinterpret_cast<const uint4*>(xrow[b] + k0 + h * 32)) : make_uint4(0, 0, 0, 0);
    }

    // Scale and zero point entries of the chunk's two 32-input blocks (one group for sizes >= 64).
    __device__ __forceinline__ int group_of_block(int block32) const {
        return min(block32 >> (SMALL_GROUP ? 0 : group_shift + 1), groups - 1);
    }

    __device__ __forceinline__ void load_scales(int c, uint2 (&sc)[2]) const {
        sc[0] = __ldg(meta + group_of_block(2 * c) * 8);
        sc[1] = SMALL_GROUP ? __ldg(meta + group_of_block(2 * c + 1) * 8) : sc[0];
    }

    // c: the chunk's index along K; last: the warp's last chunk (its group's partial sum is folded).
    __device__ __forceinline__ void chunk(uint4 word, const uint2 (&sc_chunk)[2], const uint4 (&xs)[MB][2], int c, bool last) {
        const uint32_t w4[4] = {word.x, word.y, word.z, word.w};
        // A group ends at every 32-input block for group size 32; else after this chunk when the next
        // chunk starts a new group or this warp's range ends.
        const bool chunk_ends_group = SMALL_GROUP || last || ((c + 1) >> group_shift) != (c >> group_shift);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const int h = s >> 1;
            const uint2 sc = sc_chunk[h];
            uint32_t a[4];
            dequantize(w4[s], zero_pair(sc.x), zero_pair(sc.y), a);
#pragma unroll
            for (int b = 0; b < MB; ++b) {
                const uint32_t b0 = (s & 1) ? xs[b][h].z : xs[b][h].x;
                const uint32_t b1 = (s & 1) ? xs[b][h].w : xs[b][h].y;
                mma_bf16(part[b], a, b0, b1);
            }
            if ((SMALL_GROUP && (s & 1)) || (s == 3 && chunk_ends_group)) {
                const float s_g = scale_of(sc.x, fp16_scales), s_g8 = scale_of(sc.y, fp16_scales);
#pragma unroll
                for (int b = 0; b < MB; ++b) {
                    acc[b][0] += s_g * part[b][0];
                    acc[b][1] += s_g * part[b][1];
                    acc[b][2] += s_g8 * part[b][2];
                    acc[b][3] += s_g8 * part[b][3];
#pragma unroll
                    for (int j = 0; j < 4; ++j) part[b][j] = 0.f;
                }
            }
        }
    }
};

// The weight stream, two ways (the ladder's two CUDA rungs):
//   STREAM_REGISTERS: a ring of UNROLL 16-byte loads per lane in registers (ld.global.nc): each
//     request is tracked by the SM's load unit, whose capacity caps the bytes in flight;
//   STREAM_BULK: a ring of STAGES x STAGE_CHUNKS chunks per warp in shared memory, each stage one
//     bulk copy (cp.async.bulk, the Hopper copy engine) issued by one lane and awaited on an mbarrier:
//     kilobytes in flight per instruction, nothing held in registers.
constexpr int STREAM_REGISTERS = 0, STREAM_BULK = 1;
constexpr int STAGES = 4, STAGE_CHUNKS = 4;           // 8 KB of weights in flight per warp
constexpr int STAGE_SCALE_ENTRIES = 2 * STAGE_CHUNKS * 8;  // a stage's scale entries: at most one group per 32 inputs
constexpr int BULK_RING_BYTES = WARPS * STAGES * STAGE_CHUNKS * 512 + WARPS * STAGES * STAGE_SCALE_ENTRIES * 8;

template <int MB, int UNROLL, bool SMALL_GROUP, int STREAM>
__global__ void __launch_bounds__(THREADS) w4a16_mma(Problem p) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x * p.wn + warp / p.wk;
    const int split = blockIdx.y * p.wk + warp % p.wk, n_splits = p.splits * p.wk;
    const int m0 = blockIdx.z * M_TILE;
    const int c_begin = int((long long)split * p.k_chunks / n_splits);
    const int c_end = int((long long)(split + 1) * p.k_chunks / n_splits);
    const bool active = tile < p.n_tiles;
    const uint64_t policy = evict_first_policy();
    const int n_chunks = c_end - c_begin;
    constexpr bool PREFETCH_X = MB <= 2;                // activations one chunk ahead (registers allow)

    // Shared memory: the bulk-copy ring while streaming, then the warps' sums (one buffer, both uses).
    // (dynamic: the bulk ring is larger than the 48 KB a static array may take; launch gives smem_bytes<>)
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) uint64_t bars[WARPS][STAGES];
    __shared__ int is_last;

    WarpSlice<MB, SMALL_GROUP> w;
    w.init(p, tile, m0, g, t);

    if (STREAM == STREAM_REGISTERS && active && n_chunks > 0) {
        const uint4* wq = p.wq + ((size_t)tile * p.k_chunks + c_begin) * 32 + lane;
        // Slot u holds chunk i0 + u (its word and scales); once read it is refilled with chunk
        // i0 + u + UNROLL (clamped to the last chunk: the tail re-reads it from L2, branch-free). The
        // activations are fetched one chunk ahead.
        uint4 words[UNROLL];
        uint2 scales[UNROLL][2];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c_begin + min(u, n_chunks - 1);
            words[u] = load_weights(wq + (c - c_begin) * 32, policy);
            w.load_scales(c, scales[u]);
        }
        uint4 xs[MB][2], xs_next[MB][2];
        if (PREFETCH_X) w.load_x(c_begin, xs);
        for (int i0 = 0; i0 < n_chunks; i0 += UNROLL) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int i = i0 + u;
                if (i < n_chunks) {
                    const int c = c_begin + i;
                    if (PREFETCH_X) w.load_x(c_begin + min(i + 1, n_chunks - 1), xs_next); else w.load_x(c_begin + i, xs);
                    const uint4 word = words[u];
                    const uint2 sc[2] = {scales[u][0], scales[u][1]};
                    const int refill = c_begin + min(i + UNROLL, n_chunks - 1);
                    words[u] = load_weights(wq + (refill - c_begin) * 32, policy);
                    w.load_scales(refill, scales[u]);
                    w.chunk(word, sc, xs, c, i == n_chunks - 1);
#pragma unroll
                    for (int b = 0; b < MB; ++b) if (PREFETCH_X) xs[b][0] = xs_next[b][0], xs[b][1] = xs_next[b][1];
                }
            }
        }
    }
    if (STREAM == STREAM_BULK) {
        // Per warp and stage: STAGE_CHUNKS lane words and the scale entries of their groups, two bulk
        // copies completing one barrier phase.
        auto ring = reinterpret_cast<uint4 (*)[STAGES][STAGE_CHUNKS * 32]>(smem);
        auto ring_scales = reinterpret_cast<uint2 (*)[STAGES][STAGE_SCALE_ENTRIES]>(smem + WARPS * STAGES * STAGE_CHUNKS * 512);
        const bool streams = active && n_chunks > 0;
        const char* src = reinterpret_cast<const char*>(p.wq + ((size_t)tile * p.k_chunks + c_begin) * 32);
        const uint2* tile_meta = p.meta + (size_t)tile * p.groups * 8;
        const int n_stages = (n_chunks + STAGE_CHUNKS - 1) / STAGE_CHUNKS;
        auto stage_groups = [&](int j, int& first, int& count) {
            const int c_lo = c_begin + j * STAGE_CHUNKS, c_hi = min(c_lo + STAGE_CHUNKS, c_end) - 1;
            first = w.group_of_block(2 * c_lo);
            count = w.group_of_block(2 * c_hi + 1) - first + 1;
        };
        auto issue = [&](int j) {
            const int st = j % STAGES;
            const int chunks = min(STAGE_CHUNKS, n_chunks - j * STAGE_CHUNKS);
            int first, count;
            stage_groups(j, first, count);
            barrier_expect(&bars[warp][st], chunks * 512 + count * 64);
            bulk_copy(ring[warp][st], src + (size_t)j * STAGE_CHUNKS * 512, chunks * 512, &bars[warp][st], policy);
            bulk_copy(ring_scales[warp][st], tile_meta + (size_t)first * 8, count * 64, &bars[warp][st], policy);
        };
        if (lane == 0) {
#pragma unroll
            for (int st = 0; st < STAGES; ++st) barrier_init(&bars[warp][st]);
#ifndef LAB_NO_BULK_COPY
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
            if (streams)
                for (int j = 0; j < min(STAGES, n_stages); ++j) issue(j);
        }
        __syncwarp();
        if (streams) {
            uint4 xs[MB][2], xs_next[MB][2];
            if (PREFETCH_X) w.load_x(c_begin, xs);
            for (int j = 0; j < n_stages; ++j) {
                const int st = j % STAGES;
                int first, count;
                stage_groups(j, first, count);
                barrier_wait(&bars[warp][st], (j / STAGES) & 1);
                uint4 words[STAGE_CHUNKS];
                uint2 sc[STAGE_CHUNKS][2];
#pragma unroll
                for (int q = 0; q < STAGE_CHUNKS; ++q) {
                    const int c = min(c_begin + j * STAGE_CHUNKS + q, c_end - 1);
                    words[q] = ring[warp][st][q * 32 + lane];
                    sc[q][0] = ring_scales[warp][st][(w.group_of_block(2 * c) - first) * 8 + g];
                    sc[q][1] = ring_scales[warp][st][(w.group_of_block(2 * c + 1) - first) * 8 + g];
                }
                __syncwarp();
                if (lane == 0 && j + STAGES < n_stages) issue(j + STAGES);
#pragma unroll
                for (int q = 0; q < STAGE_CHUNKS; ++q) {
                    const int i = j * STAGE_CHUNKS + q;
                    if (i < n_chunks) {
                        if (PREFETCH_X) w.load_x(c_begin + min(i + 1, n_chunks - 1), xs_next); else w.load_x(c_begin + i, xs);
                        w.chunk(words[q], sc[q], xs, c_begin + i, i == n_chunks - 1);
#pragma unroll
                        for (int b = 0; b < MB; ++b) if (PREFETCH_X) xs[b][0] = xs_next[b][0], xs[b][1] = xs_next[b][1];
                    }
                }
            }
        }
    }
    float (&acc)[MB][4] = w.acc;
    if (STREAM == STREAM_BULK) __syncthreads();         // every warp is done with the ring

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
        if (leader && active)
            for_each_output<MB>(m0, n_row, t, [&](int b, int i, int m, int n) {
                float v = 0.f;
                for (int s = 0; s < p.splits; ++s) v += __ldcg(p.partials + ((size_t)s * m_pad + m) * n_pad + n);
                acc[b][i] = v;
            });
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

template <int MB, int STREAM>
constexpr int smem_bytes() {
    constexpr int sums = WARPS * MB * 4 * 32 * 4, ring = STREAM == STREAM_BULK ? BULK_RING_BYTES : 0;
    return sums > ring ? sums : ring;
}

template <int MB, bool SMALL_GROUP, int STREAM>
cudaError_t launch_mb(const Problem& p, dim3 grid, cudaStream_t stream) {
    constexpr int UNROLL = MB <= 2 && !SMALL_GROUP ? 6 : 4;    // register ring: as deep as registers allow
    constexpr int bytes = smem_bytes<MB, STREAM>();
    static bool attribute_set = false;               // once per instantiation, before its first launch
    if (!attribute_set) {
        cudaError_t e = cudaFuncSetAttribute(w4a16_mma<MB, UNROLL, SMALL_GROUP, STREAM>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
        if (e != cudaSuccess) return e;
        attribute_set = true;
    }
    w4a16_mma<MB, UNROLL, SMALL_GROUP, STREAM><<<grid, THREADS, bytes, stream>>>(p);
    return cudaGetLastError();
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

}  // namespace

extern "C" {

// mb: 8-row activation blocks per tile (1, 2, 4, 8); bulk: 1 streams the weights with bulk copies; grid (ceil(n_tiles / wn), splits, ceil(M / 64)).
int lab_w4a16_mma(const void* x, const void* wq, const void* meta, void* y, void* partials, void* counters,
                  int M, int N, int K, int n_tiles, int k_chunks, int groups, int log2_blocks_per_group,
                  int wn, int wk, int splits, int mb, int fp16_scales, int bulk, void* stream) {
    if (wn * wk != WARPS || splits < 1 || M < 1) return cudaErrorInvalidValue;
    Problem p{static_cast<const __nv_bfloat16*>(x), static_cast<const uint4*>(wq), static_cast<const uint2*>(meta),
              static_cast<__nv_bfloat16*>(y), static_cast<float*>(partials), static_cast<int*>(counters),
              M, N, K, n_tiles, k_chunks, groups, log2_blocks_per_group, wn, wk, splits, fp16_scales};
    dim3 grid((n_tiles + wn - 1) / wn, splits, (M + M_TILE - 1) / M_TILE);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    return bulk ? launch_stream<STREAM_BULK>(p, mb, grid, s) : launch_stream<STREAM_REGISTERS>(p, mb, grid, s);
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

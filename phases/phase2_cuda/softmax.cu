// Phase 2.3: row softmax. y[r, :] = exp(x[r, :] - max_r) / sum(exp(x[r, :] - max_r)) over a
// contiguous rows x cols tensor, fp32 or bf16 in and out, the arithmetic in fp32.
//
// The budget. Per element: one read and one write (8 bytes fp32, 4 bytes bf16) against about five
// FLOPs (scale by log2 e, max, subtract, exp2, add; then one multiply by 1/sum), 0.6 FLOP/byte in
// fp32: far below the H200's ridge, so the time is bytes / bandwidth and the ceiling is a copy of
// the same tensor (the same bytes read and written). A kernel reaches it only if it reads each
// element from HBM once, writes it once, and keeps enough bytes in flight (H200: ~4.8 TB/s x
// ~0.7 us latency ~ 3.4 MB across 132 SMs ~ 25 KB per SM, 32 bytes per thread at full occupancy).
//
// exp(v) = exp2(v * log2 e): each element is multiplied by log2 e once as it is loaded, and every
// exponential afterwards is one `ex2.approx.ftz.f32` (the SFU instruction, relative error ~2^-22,
// far below the fp32 check's 5e-5; ftz flushes results below 2^-126 to zero, which a softmax
// output that small cannot notice). The max is subtracted first so exp2 never overflows.
//
// The kernels (each also a variant of its own; the dispatcher `launch_softmax` picks by dtype and
// length from the DISPATCH table):
//   softmax_warp_row_*    the seed's: one warp per row, each lane cols/32 values in registers,
//                         max and sum by xor-shuffle butterflies (no shared memory, no barrier).
//   softmax_warp_packed_* short rows: a power-of-two group of lanes per row, several rows per warp,
//                         so each lane holds >= 32 bytes (8 fp32 / 16 bf16): a whole warp on a
//                         32-column fp32 row has only 4 bytes per lane in flight.
//   softmax_block_row_*   medium rows (<= 32768): a block per row held in registers, warp shuffles
//                         then one shared-memory exchange between warps.
//   softmax_cluster_row_* long rows (<= 131072) on sm_90: a cluster of 2..16 CTAs per row, each
//                         holding a slice in registers; (max, sum) pairs exchanged through
//                         distributed shared memory. Still one HBM read and one write per element.
//   softmax_online_*      any length: a block per row, pass 1 keeps a running (max, sum), pass 2
//                         re-reads the row (backwards, so its tail is still in L2) and writes it.
//   softmax_block_row_smem_*, softmax_cluster_row_smem_*  long rows: a CTA (or a cluster of CTAs)
//                         per row staged in SHARED memory (bulk copies + mbarriers on sm_90,
//                         cp.async on sm_80), 32 KB or 64 KB per CTA, so 3-6 rows per SM are in
//                         flight instead of 1-2 held in registers.
// Which one `launch_softmax` runs is the DISPATCH table (search for "THE DISPATCH TABLE").
//
// Layout shared by all of them: thread t of n holds packs k = 0..ITERS-1, pack k being PACK
// consecutive elements starting at (k * n + t) * PACK. With `vec` (the row length a multiple of
// PACK and both pointers PACK-element aligned, checked by the launcher) a pack is one 16-byte (or
// narrower) load; otherwise the same elements are loaded one by one, each bounds-checked. Missing
// elements load as -inf, which adds nothing to the max and exp2(-inf) = 0 to the sum.
//
// Launchers: extern "C" int launch_softmax_*(x, y, rows, cols, dtype, stream), dtype 0 = fp32,
// 1 = bf16; they return the cudaError_t of the launch, or cudaErrorInvalidValue /
// cudaErrorNotSupported for a length or a GPU the kernel cannot handle. Row and column counts are
// int (the Python side keeps tensors below 2^31 elements); row offsets are 64-bit.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cooperative_groups.h>
#include <math.h>
#include <stdint.h>
#include <limits.h>
#include <utility>

namespace cg = cooperative_groups;

extern "C" const char* lab_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

#define FULL_MASK 0xffffffffu
#define LOG2E 1.4426950408889634f
#define WARP_KERNEL_WARPS 2            // warp kernels: 64-thread blocks (2 warps beat 4 by up to 1.7 points, see DISPATCH)
#define CLUSTER_THREADS 512            // cluster kernels: 512 threads x 16 values per CTA
#define CLUSTER_VALUES 16
#define ONLINE_THREADS 512             // online kernel: tiles of 512 threads x 16 values
#define ONLINE_VALUES 16

// ---------------------------------------------------------------------------------------------
// Element types: how a value is stored and how it becomes an fp32 and back.
struct F32 {
    using storage = float;
    static constexpr int VEC = 4;                       // elements per 16-byte load
    static __device__ __forceinline__ float to_float(float v) { return v; }
    static __device__ __forceinline__ float from_float(float f) { return f; }
};
struct BF16 {
    using storage = unsigned short;                     // the bf16 bits; the math is fp32
    static constexpr int VEC = 8;
    // bf16 is the top half of an fp32: widening is a 16-bit shift, exact.
    static __device__ __forceinline__ float to_float(unsigned short v) { return __uint_as_float((unsigned)v << 16); }
    // Narrowing rounds to nearest even (as torch does).
    static __device__ __forceinline__ unsigned short from_float(float f) {
        return __bfloat16_as_ushort(__float2bfloat16_rn(f));
    }
};

// PACK consecutive elements seen two ways: as elements, and as one built-in vector type of the
// same size (16 bytes: uint4). Packs move through __ldg / __stwb (inline PTX with the width
// spelled out: ld.global.nc.v4.u32 / st.global.wb.v4.u32), because a plain struct copy can be
// split into scalar accesses by the optimizer (it was, in the cluster kernel).
template <int BYTES> struct RawOf;
template <> struct RawOf<2> { using type = unsigned short; };
template <> struct RawOf<4> { using type = unsigned int; };
template <> struct RawOf<8> { using type = uint2; };
template <> struct RawOf<16> { using type = uint4; };

template <typename Ty, int PACK>
union Pack {
    using Raw = typename RawOf<PACK * sizeof(typename Ty::storage)>::type;
    Raw raw;
    typename Ty::storage e[PACK];
};

// Configurations, used by the kernels' template arguments and by the host launchers alike.
__host__ __device__ constexpr int vec_of(int dtype) { return dtype == 0 ? 4 : 8; }
__host__ __device__ constexpr int pack_of(int vec, int values) { return values < vec ? values : vec; }
// Warp kernels: values per lane for a row bucket of C (a power of two) columns.
__host__ __device__ constexpr int seed_values(int c) { return c / 32; }                         // 32 lanes per row
__host__ __device__ constexpr int packed_values(int dtype, int c) {                             // >= 32 bytes per lane
    return c / 32 > (dtype == 0 ? 8 : 16) ? c / 32 : (c < (dtype == 0 ? 8 : 16) ? c : (dtype == 0 ? 8 : 16));
}
__host__ __device__ constexpr int packed_lanes(int dtype, int c) { return c / packed_values(dtype, c); }
// Block kernel: threads x values = C. 16 values (64 bytes fp32) per thread up to 8192 columns,
// then 32 (the register budget at 1024 threads is 64 per thread: 32 values + addressing).
__host__ __device__ constexpr int block_threads(int c) {
    return c <= 2048 ? 128 : (c <= 8192 ? c / 16 : (c == 16384 ? 512 : 1024));
}
__host__ __device__ constexpr int block_values(int c) { return c <= 8192 ? 16 : 32; }
// Cluster kernel: CTAs per row for a bucket of C columns, each 512 threads x 16 values.
__host__ __device__ constexpr int cluster_ctas(int c) {
    return c <= 16384 ? 2 : c / (CLUSTER_THREADS * CLUSTER_VALUES);
}

// ---------------------------------------------------------------------------------------------
// Per-thread slices, reductions.
__device__ __forceinline__ float ex2(float v) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));   // exp2(-inf) = +0
    return r;
}

// Thread t of `nthreads` loads its PACK * ITERS values of the row segment starting at p (elements
// at offset >= limit are missing: -inf), multiplied by log2 e. All the loads come first, each into
// its own registers, and only then the conversions, with the `vec` test outside both loops: that
// lets the compiler issue the loads back to back, one round trip to memory per thread. (With the
// test inside one loop the compiler kept a branch per pack and reused one register quad, so each
// load waited for the one before.)
template <typename Ty, int PACK, int ITERS>
__device__ __forceinline__ void load_slice(const typename Ty::storage* p, int t, int nthreads, int limit, bool vec,
                                           float (&v)[PACK * ITERS]) {
    using S = typename Ty::storage;
    if (vec) {                          // the row length is a multiple of PACK: a pack is all in or all out
        Pack<Ty, PACK> q[ITERS];
#pragma unroll
        for (int k = 0; k < ITERS; ++k) {
            const int i0 = (k * nthreads + t) * PACK;
            q[k].raw = {};
            if (i0 < limit) q[k].raw = __ldg(reinterpret_cast<const typename Pack<Ty, PACK>::Raw*>(p + i0));
        }
#pragma unroll
        for (int k = 0; k < ITERS; ++k) {
            const bool in = (k * nthreads + t) * PACK < limit;
#pragma unroll
            for (int j = 0; j < PACK; ++j) v[k * PACK + j] = in ? Ty::to_float(q[k].e[j]) * LOG2E : -INFINITY;
        }
    } else {
        S e[PACK * ITERS];
#pragma unroll
        for (int k = 0; k < ITERS; ++k) {
#pragma unroll
            for (int j = 0; j < PACK; ++j) {
                const int i = (k * nthreads + t) * PACK + j;
                e[k * PACK + j] = S{};
                if (i < limit) e[k * PACK + j] = __ldg(p + i);
            }
        }
#pragma unroll
        for (int k = 0; k < ITERS; ++k) {
#pragma unroll
            for (int j = 0; j < PACK; ++j)
                v[k * PACK + j] = (k * nthreads + t) * PACK + j < limit ? Ty::to_float(e[k * PACK + j]) * LOG2E
                                                                       : -INFINITY;
        }
    }
}

// The inverse: writes e * scale for the same elements, none at offset >= limit (the `vec` test
// outside the loop here too: one straight run of stores).
template <typename Ty, int PACK, int ITERS>
__device__ __forceinline__ void store_slice(typename Ty::storage* p, int t, int nthreads, int limit, bool vec,
                                            const float (&e)[PACK * ITERS], float scale) {
    if (vec) {
#pragma unroll
        for (int k = 0; k < ITERS; ++k) {
            const int i0 = (k * nthreads + t) * PACK;
            if (i0 < limit) {
                Pack<Ty, PACK> q;
#pragma unroll
                for (int j = 0; j < PACK; ++j) q.e[j] = Ty::from_float(e[k * PACK + j] * scale);
                __stwb(reinterpret_cast<typename Pack<Ty, PACK>::Raw*>(p + i0), q.raw);
            }
        }
    } else {
#pragma unroll
        for (int k = 0; k < ITERS; ++k) {
            const int i0 = (k * nthreads + t) * PACK;
#pragma unroll
            for (int j = 0; j < PACK; ++j)
                if (i0 + j < limit) p[i0 + j] = Ty::from_float(e[k * PACK + j] * scale);
        }
    }
}

// Butterflies over aligned groups of WIDTH lanes (WIDTH a power of two <= 32): log2(WIDTH) steps,
// after which every lane of the group holds the result (no broadcast needed). Offsets < WIDTH
// never cross a group, so groups of one warp reduce independently.
template <int WIDTH>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
    for (int off = WIDTH / 2; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, off));
    return v;
}
template <int WIDTH>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int off = WIDTH / 2; off > 0; off /= 2) v += __shfl_xor_sync(FULL_MASK, v, off);
    return v;
}

// A block of WARPS warps: shuffle within each warp, one shared-memory slot per warp, one barrier,
// then every warp re-reduces the WARPS partials itself (so no second barrier to broadcast).
// `red` must be used by one reduction only (the kernels give each its own array).
template <int WARPS>
__device__ __forceinline__ float block_max(float v, float* red) {
    v = group_max<32>(v);
    if constexpr (WARPS == 1) return v;
    const int lane = threadIdx.x % 32;
    if (lane == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    return group_max<32>(lane < WARPS ? red[lane] : -INFINITY);
}
template <int WARPS>
__device__ __forceinline__ float block_sum(float v, float* red) {
    v = group_sum<32>(v);
    if constexpr (WARPS == 1) return v;
    const int lane = threadIdx.x % 32;
    if (lane == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    return group_sum<32>(lane < WARPS ? red[lane] : 0.f);
}

// Online softmax's combine rule. (m, s) stands for a set of values whose max is m (log2 units)
// and whose sum of exp2(v - m) is s. The union of two sets has max M = max(m, m2) and sum
// s * exp2(m - M) + s2 * exp2(m2 - M). An empty set is (-inf, 0); two empty sets would give
// -inf - (-inf) = NaN, hence the reference 0 when M = -inf.
__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
    const float mx = fmaxf(m, m2);
    const float ref = mx == -INFINITY ? 0.f : mx;
    s = s * ex2(m - ref) + s2 * ex2(m2 - ref);
    m = mx;
}
__device__ __forceinline__ void warp_combine(float& m, float& s) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2)
        combine(m, s, __shfl_xor_sync(FULL_MASK, m, off), __shfl_xor_sync(FULL_MASK, s, off));
}

__device__ __forceinline__ float finite_or_zero(float m) { return m == -INFINITY ? 0.f : m; }

// The combine rule over a block: warp shuffles, then each warp's pair through shared memory and
// one more warp combine in every warp (the same shape as block_max and block_sum).
template <int WARPS>
__device__ __forceinline__ void block_combine(float& m, float& s, float* red_m, float* red_s) {
    warp_combine(m, s);
    if constexpr (WARPS == 1) return;
    const int lane = threadIdx.x % 32;
    if (lane == 0) {
        red_m[threadIdx.x / 32] = m;
        red_s[threadIdx.x / 32] = s;
    }
    __syncthreads();
    m = lane < WARPS ? red_m[lane] : -INFINITY;
    s = lane < WARPS ? red_s[lane] : 0.f;
    warp_combine(m, s);
}

// A block's slice in registers -> its max m (over the whole block) and, in place, exp2(v - m),
// whose block-wide sum is returned in s. Two reductions, each with its own shared array.
template <int WARPS, int E>
__device__ __forceinline__ void block_max_exp2_sum(float (&v)[E], float* red_max, float* red_sum, float& m, float& s) {
    m = -INFINITY;
#pragma unroll
    for (int i = 0; i < E; ++i) m = fmaxf(m, v[i]);
    m = block_max<WARPS>(m, red_max);
    const float ref = finite_or_zero(m);            // an all-padding block: m = -inf, s = 0
    s = 0.f;
#pragma unroll
    for (int i = 0; i < E; ++i) {
        v[i] = ex2(v[i] - ref);
        s += v[i];
    }
    s = block_sum<WARPS>(s, red_sum);
}

// ---------------------------------------------------------------------------------------------
// Warp kernels: a group of LANES lanes per row, E values per lane (C = LANES * E >= cols), 32/LANES
// rows per warp, WARP_KERNEL_WARPS warps per block. LANES = 32 is the seed's one warp per row.
// Registers: E values + ~20 for addresses and loop state (E <= 32: no spills, see ptxas).
template <typename Ty, int LANES, int E>
__device__ __forceinline__ void warp_row(const void* xv, void* yv, int rows, int cols, bool vec) {
    using S = typename Ty::storage;
    constexpr int PACK = pack_of(Ty::VEC, E), ITERS = E / PACK;
    constexpr int ROWS_PER_WARP = 32 / LANES, ROWS_PER_BLOCK = WARP_KERNEL_WARPS * ROWS_PER_WARP;
    static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0, "LANES: a power of two <= 32");
    static_assert(E % PACK == 0, "E: a multiple of the pack");
    const int lane = threadIdx.x % 32;
    const long long row = (long long)blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x / 32) * ROWS_PER_WARP + lane / LANES;
    // Lanes past the last row still take part in the shuffles (their group is all past it too, so
    // nothing they compute reaches a live row), but load and store nothing.
    const bool live = row < rows;
    const size_t base = live ? (size_t)row * cols : 0;
    const int limit = live ? cols : 0;
    const int t = lane % LANES;
    float v[E];
    load_slice<Ty, PACK, ITERS>(static_cast<const S*>(xv) + base, t, LANES, limit, vec, v);
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < E; ++i) m = fmaxf(m, v[i]);
    m = group_max<LANES>(m);
    const float ref = finite_or_zero(m);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < E; ++i) {
        v[i] = ex2(v[i] - ref);
        s += v[i];
    }
    s = group_sum<LANES>(s);
    store_slice<Ty, PACK, ITERS>(static_cast<S*>(yv) + base, t, LANES, limit, vec, v, 1.f / s);
}

// ---------------------------------------------------------------------------------------------
// Block kernel: one block of THREADS threads per row (grid = rows), E values per thread in
// registers (C = THREADS * E >= cols). Two block reductions (max, then sum of exp2), each one
// barrier; each has its own shared array, so the second never overwrites what the first reads.
template <typename Ty, int THREADS, int E>
__device__ __forceinline__ void block_row(const void* xv, void* yv, int rows, int cols, bool vec) {
    using S = typename Ty::storage;
    constexpr int PACK = pack_of(Ty::VEC, E), ITERS = E / PACK, WARPS = THREADS / 32;
    __shared__ float red_max[32], red_sum[32];
    const size_t base = (size_t)blockIdx.x * cols;
    float v[E];
    load_slice<Ty, PACK, ITERS>(static_cast<const S*>(xv) + base, threadIdx.x, THREADS, cols, vec, v);
    float m, s;
    block_max_exp2_sum<WARPS>(v, red_max, red_sum, m, s);
    store_slice<Ty, PACK, ITERS>(static_cast<S*>(yv) + base, threadIdx.x, THREADS, cols, vec, v, 1.f / s);
}

// ---------------------------------------------------------------------------------------------
// Cluster kernel (sm_90): CL CTAs per row (grid = rows * CL, cluster dims (CL, 1, 1), so the CTAs
// of cluster r are blocks r*CL .. r*CL + CL-1 and handle row r). CTA `rank` holds the slice
// [rank * CHUNK, (rank + 1) * CHUNK) in registers, CHUNK = THREADS * E. Each CTA reduces its
// slice to a pair (m, s) with two block reductions and publishes it in its shared memory; after
// one cluster barrier every warp reads the CL pairs through distributed shared memory
// (map_shared_rank: lane i reads CTA i's pair) and combines them with the online rule. A CTA then
// rescales its own exp2(v - m) by exp2(m - M) / S and writes. The last barrier keeps every CTA
// (and its shared memory) alive until all its peers have read its pair.
template <typename Ty, int CL, int THREADS, int E>
__device__ __forceinline__ void cluster_row(const void* xv, void* yv, int rows, int cols, bool vec) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using S = typename Ty::storage;
    constexpr int PACK = pack_of(Ty::VEC, E), ITERS = E / PACK, WARPS = THREADS / 32, CHUNK = THREADS * E;
    static_assert(CL >= 1 && CL <= 16, "at most 16 CTAs per cluster (one lane reads each)");
    __shared__ float red_max[32], red_sum[32];
    __shared__ float2 cta_pair;
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = (int)cluster.block_rank();
    const size_t base = (size_t)(blockIdx.x / CL) * cols + (size_t)rank * CHUNK;
    const int limit = cols - rank * CHUNK;          // <= 0: a CTA past the end of a short row
    float v[E];
    load_slice<Ty, PACK, ITERS>(static_cast<const S*>(xv) + base, threadIdx.x, THREADS, limit, vec, v);
    float m, s;                                     // an all-padding CTA: m = -inf, s = 0
    block_max_exp2_sum<WARPS>(v, red_max, red_sum, m, s);
    const float ref = finite_or_zero(m);
    if (threadIdx.x == 0) cta_pair = make_float2(m, s);
    cluster.sync();                                 // release/acquire: every CTA's pair is visible
    const int lane = threadIdx.x % 32;
    float row_m = -INFINITY, row_s = 0.f;
    if (lane < CL) {
        const float2 p = *cluster.map_shared_rank(&cta_pair, lane);
        row_m = p.x;
        row_s = p.y;
    }
    warp_combine(row_m, row_s);
    auto token = cluster.barrier_arrive();          // this CTA is done reading its peers
    store_slice<Ty, PACK, ITERS>(static_cast<S*>(yv) + base, threadIdx.x, THREADS, limit, vec, v,
                                 ex2(ref - row_m) / row_s);
    cluster.barrier_wait(std::move(token));         // and no CTA exits while a peer may read it
#endif
}

// ---------------------------------------------------------------------------------------------
// Online kernel, any length: one block of THREADS per row, tiles of TILE = THREADS * E elements.
// Pass 1 walks the first `stat_cols` elements (the launchers pass cols; the broken one fewer)
// keeping a running (m, s) per thread: per tile, m' = max(m, tile max), s' = s * exp2(m - m') +
// sum exp2(v - m'): one exp2 per element plus one per tile. The threads' pairs are then combined
// (warp butterflies, one shared exchange). Pass 2 re-reads the row, last tile first: pass 1 read
// those last, so they are the likeliest to be still in L2; the HBM traffic is between 2 and 3
// times the row's bytes depending on how much of it L2 kept.
template <typename Ty, int THREADS, int E>
__device__ __forceinline__ void online_row(const void* xv, void* yv, int rows, int cols, bool vec, int stat_cols) {
    using S = typename Ty::storage;
    constexpr int PACK = pack_of(Ty::VEC, E), ITERS = E / PACK, WARPS = THREADS / 32, TILE = THREADS * E;
    __shared__ float red_m[32], red_s[32];
    const S* x = static_cast<const S*>(xv) + (size_t)blockIdx.x * cols;
    S* y = static_cast<S*>(yv) + (size_t)blockIdx.x * cols;
    float m = -INFINITY, s = 0.f;
    const int stat_tiles = stat_cols / TILE + (stat_cols % TILE != 0);     // no int overflow near 2^31
    for (int tile = 0; tile < stat_tiles; ++tile) {
        const int start = tile * TILE;
        float v[E];
        load_slice<Ty, PACK, ITERS>(x + start, threadIdx.x, THREADS, stat_cols - start, vec, v);
        float tile_m = -INFINITY;
#pragma unroll
        for (int i = 0; i < E; ++i) tile_m = fmaxf(tile_m, v[i]);
        const float new_m = fmaxf(m, tile_m);
        const float ref = finite_or_zero(new_m);
        float add = 0.f;
#pragma unroll
        for (int i = 0; i < E; ++i) add += ex2(v[i] - ref);
        s = s * ex2(m - ref) + add;                 // m = -inf (nothing seen yet): 0 * 0
        m = new_m;
    }
    block_combine<WARPS>(m, s, red_m, red_s);
    const float ref = finite_or_zero(m), inv = 1.f / s;
    const int tiles = cols / TILE + (cols % TILE != 0);
    for (int tile = tiles - 1; tile >= 0; --tile) {
        const int start = tile * TILE;
        float v[E];
        load_slice<Ty, PACK, ITERS>(x + start, threadIdx.x, THREADS, cols - start, vec, v);
#pragma unroll
        for (int i = 0; i < E; ++i) v[i] = ex2(v[i] - ref);
        store_slice<Ty, PACK, ITERS>(y + start, threadIdx.x, THREADS, cols - start, vec, v, inv);
    }
}

// ---------------------------------------------------------------------------------------------
// Shared-memory row kernels: a CTA stages a SLICE-element slice of a row in SHARED memory, not in
// registers, so several CTAs (rows) per SM have their loads in flight while others reduce and
// write: 32 KB slices -> 6 CTAs per SM, 64 KB -> 3 (H200: 227 KB per SM, 1 KB reserved per CTA).
//   * load: on sm_90 with `vec` (16-byte aligned rows), the bulk-copy engine:
//     `cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes`, the slice in
//     SMEM_CHUNKS pieces, one mbarrier each (one lane issues each piece), so pass 1 starts on
//     piece 0 while the rest are in flight; on sm_80 with `vec`: 16-byte cp.async by every
//     thread; without `vec`: element loads (a partial last pack padded with -inf in shared).
//   * pass 1: each thread keeps a running (max, sum of exp2) over its packs, piece by piece
//     (one exp2 per element + one per piece); block combine (warp butterflies, one exchange).
//   * CLUSTER (sm_90): CTA `rank` of a cluster of `ctas` holds [rank * SLICE, (rank+1) * SLICE);
//     CTA pairs are combined through distributed shared memory as in cluster_row. The cluster
//     size is a launch attribute (cols / SLICE rounded up), not a template argument.
//   * pass 2: re-read shared, y = exp2(x log2e - M) / S, 16-byte stores to global.
// HBM traffic: one read and one write per element, like the register kernels.
#define SMEM_CHUNKS 4

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
    unsigned done = 0;
    do {
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}" : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    } while (!done);
}
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
#endif

template <typename Ty, int THREADS, int SLICE, bool CLUSTER>
__device__ __forceinline__ void smem_row(const void* xv, void* yv, int rows, int cols, bool vec) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (CLUSTER && __CUDA_ARCH__ < 900) {
    return;                                         // clusters: sm_90 only (the launcher refuses earlier)
  } else {
    using S = typename Ty::storage;
    constexpr int VEC = Ty::VEC, PACKS = SLICE / VEC, PIECE = PACKS / SMEM_CHUNKS, PER = PIECE / THREADS;
    constexpr int WARPS = THREADS / 32;
    static_assert(SLICE % (VEC * SMEM_CHUNKS * THREADS) == 0 && PER >= 1, "whole packs per thread per piece");
    using Raw = typename Pack<Ty, VEC>::Raw;
    extern __shared__ __align__(16) unsigned char smem_raw[];      // 16-byte packs and bulk copies
    S* buf = reinterpret_cast<S*>(smem_raw);
    __shared__ float red_m[32], red_s[32];
#if __CUDA_ARCH__ >= 900
    __shared__ __align__(8) uint64_t bars[SMEM_CHUNKS];      // the bulk copies' (sm_90 only)
#endif
    int rank = 0;
    long long row = blockIdx.x;
#if __CUDA_ARCH__ >= 900
    int ctas = 1;
    if constexpr (CLUSTER) {
        cg::cluster_group cluster = cg::this_cluster();
        rank = (int)cluster.block_rank();
        ctas = (int)cluster.num_blocks();
        row = blockIdx.x / ctas;
    }
#endif
    const size_t base = (size_t)row * cols + (size_t)rank * SLICE;
    const int left = cols - rank * SLICE;
    const int n = left < 0 ? 0 : (left > SLICE ? SLICE : left);   // elements of this slice
    const S* x = static_cast<const S*>(xv) + base;
    S* y = static_cast<S*>(yv) + base;
    bool bulk = false;
#if __CUDA_ARCH__ >= 900
    bulk = vec;
    if (bulk) {
        if (threadIdx.x == 0) {
#pragma unroll
            for (int c = 0; c < SMEM_CHUNKS; ++c) mbar_init(&bars[c], 1);
            mbar_init_fence();
        }
        __syncthreads();
        if (threadIdx.x < SMEM_CHUNKS) {            // lane c issues piece c (n is a multiple of VEC)
            const int lo = threadIdx.x * PIECE * VEC, hi = min(n, lo + PIECE * VEC);
            const unsigned bytes = hi > lo ? (unsigned)((hi - lo) * sizeof(S)) : 0u;
            mbar_expect_tx(&bars[threadIdx.x], bytes);      // 0 bytes: the phase completes at once
            if (bytes) bulk_load(buf + lo, x + lo, bytes, &bars[threadIdx.x]);
        }
    }
#endif
    if (!bulk) {
        if (vec) {
            for (int p = threadIdx.x; p * VEC < n; p += THREADS) cp_async16(buf + p * VEC, x + p * VEC);
            cp_async_wait_all();
        } else {
            for (int i = threadIdx.x; i < n; i += THREADS) buf[i] = __ldg(x + i);
            const int padded = (n + VEC - 1) / VEC * VEC;   // <= SLICE
            for (int i = n + threadIdx.x; i < padded; i += THREADS) buf[i] = Ty::from_float(-INFINITY);
        }
        __syncthreads();
    }
    // Pass 1: running (m, s) in log2 units, piece by piece.
    float m = -INFINITY, s = 0.f;
#pragma unroll 1
    for (int c = 0; c < SMEM_CHUNKS; ++c) {
#if __CUDA_ARCH__ >= 900
        if (bulk) mbar_wait(&bars[c], 0);
#endif
        float v[PER * VEC];
        float cm = -INFINITY;
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            const int p = c * PIECE + k * THREADS + threadIdx.x;
            if (p * VEC < n) {
                Pack<Ty, VEC> q;
                q.raw = *reinterpret_cast<const Raw*>(buf + p * VEC);
#pragma unroll
                for (int j = 0; j < VEC; ++j) v[k * VEC + j] = Ty::to_float(q.e[j]);
            } else {
#pragma unroll
                for (int j = 0; j < VEC; ++j) v[k * VEC + j] = -INFINITY;
            }
#pragma unroll
            for (int j = 0; j < VEC; ++j) cm = fmaxf(cm, v[k * VEC + j]);
        }
        const float new_m = fmaxf(m, cm * LOG2E);
        const float ref = finite_or_zero(new_m);
        float add = 0.f;
#pragma unroll
        for (int i = 0; i < PER * VEC; ++i) add += ex2(fmaf(v[i], LOG2E, -ref));
        s = s * ex2(m - ref) + add;                 // m = -inf (nothing yet): 0 * 0
        m = new_m;
    }
    block_combine<WARPS>(m, s, red_m, red_s);
    const int lane = threadIdx.x % 32;
#if __CUDA_ARCH__ >= 900
    if constexpr (CLUSTER) {
        __shared__ float2 cta_pair;
        cg::cluster_group cluster = cg::this_cluster();
        if (threadIdx.x == 0) cta_pair = make_float2(m, s);
        cluster.sync();                             // every CTA's pair is visible
        float rm = -INFINITY, rs = 0.f;
        if (lane < ctas) {
            const float2 q = *cluster.map_shared_rank(&cta_pair, lane);
            rm = q.x;
            rs = q.y;
        }
        warp_combine(rm, rs);
        m = rm;
        s = rs;
        asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");   // done reading the peers
    }
#endif
    // Pass 2: y = exp2(x log2e - M) / S.
    const float ref = finite_or_zero(m), inv = 1.f / s;
    if (vec) {
#pragma unroll 4
        for (int k = 0; k < PACKS / THREADS; ++k) {
            const int p = k * THREADS + threadIdx.x;
            if (p * VEC < n) {
                Pack<Ty, VEC> q, o;
                q.raw = *reinterpret_cast<const Raw*>(buf + p * VEC);
#pragma unroll
                for (int j = 0; j < VEC; ++j) o.e[j] = Ty::from_float(ex2(fmaf(Ty::to_float(q.e[j]), LOG2E, -ref)) * inv);
                __stwb(reinterpret_cast<Raw*>(y + p * VEC), o.raw);
            }
        }
    } else {
        for (int i = threadIdx.x; i < n; i += THREADS)
            y[i] = Ty::from_float(ex2(fmaf(Ty::to_float(buf[i]), LOG2E, -ref)) * inv);
    }
#if __CUDA_ARCH__ >= 900
    if constexpr (CLUSTER) asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");   // peers done with ours
#endif
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// Stream kernel, stream_row (sm_90): a PERSISTENT grid, one CTA per SM, and a ring of
// STREAM_CHUNKS shared chunks of STREAM_CHUNK_BYTES that one producer warp keeps full with bulk
// copies, chunk after chunk and row after row, while 16 consumer warps reduce and write. A CTA
// holds its part of a row (KEEP chunks in registers, at most STREAM_SLICE_CHUNKS in shared
// memory, 144 KB) until the row's (max, sum) is known; the rest of the ring (at least 5 chunks,
// 80 KB) is the next row's bytes already on their way, so the SM's loads do not stop for a
// reduction, an exchange or a write-back. (The one-shot shared-memory kernels above refill an SM
// only when a whole CTA, or a whole cluster, has finished.)
//   * Rows are handed out by a grid-wide ticket counter when a row fits one CTA (bf16 up to
//     73,728 columns, fp32 up to 36,864): an SM that runs faster takes more rows (with a static
//     share per SM the kernel ends with its slowest SM). The producer takes the ticket and
//     announces the row in the slot of its first chunk; a ticket past the end announces "no more rows".
//   * Longer rows (fp32 65,536) are split over a cluster of ceil(chunks / 9) CTAs, each with an
//     equal share of whole chunks, which walk the rows in a static round robin (every peer must
//     take the same rows). The (max, sum) pairs go to every peer's shared memory with a remote
//     store and a remote mbarrier arrive (release/acquire at cluster scope), double-buffered by
//     row parity, so no cluster-wide barrier sits inside the loop.
//   * Barriers: full[slot] (the producer's expect_tx, completed by the copy's bytes), empty[slot]
//     (one arrive per consumer warp once it has read the slot: pass 1 for kept chunks, pass 2
//     for the rest).
//   * Pass 1, per chunk as it lands: a running (m, s) per thread (one exp2 per element); consumer
//     combine (shuffles, one named barrier); pass 2: y = exp2(v - M) / S from shared memory to
//     global with 16-byte stores: the second exp2 per element costs SFU time the SM has
//     (2 per element is about half the H200's 16 per clock per SM at copy speed in bf16).
// Needs `vec` (bulk copies: 16-byte aligned rows): the launcher falls back to cluster_row_smem.
#define STREAM_CONSUMER_WARPS 16
#define STREAM_THREADS ((STREAM_CONSUMER_WARPS + 1) * 32)   // 17 warps: 96 registers each (5 on one sub-partition)
#define STREAM_CHUNK_BYTES 16384            // one 16-byte pack per consumer thread, twice
#define STREAM_CHUNKS 13                    // 208 KB of ring: one CTA per SM (227 KB usable)
#define STREAM_SLICE_CHUNKS 8               // a CTA's part of a row in shared memory: <= 128 KB, so >= 80 KB ahead
#define STREAM_KEEP 1                       // and in registers (more would need more than 96 registers)
#define STREAM_MAX_CTAS 8                   // the portable cluster size

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// Arrive on the mbarrier at the same shared offset as `bar` in CTA `rank` of the cluster; the
// release orders this thread's earlier stores (the pair it wrote there) before the arrival.
__device__ __forceinline__ void mbar_arrive_remote(uint64_t* bar, unsigned rank) {
    asm volatile("{\n\t.reg .b32 r;\n\tmapa.shared::cluster.u32 r, %0, %1;\n\t"
                 "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [r];\n\t}"
                 ::"r"(smem_u32(bar)), "r"(rank) : "memory");
}
__device__ __forceinline__ void mbar_wait_cluster(uint64_t* bar, unsigned parity) {   // acquire: peers' stores
    unsigned done = 0;
    do {
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}" : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    } while (!done);
}
template <int WARPS>
__device__ __forceinline__ void consumers_sync() {        // the consumer warps only (named barrier 1)
    asm volatile("bar.sync 1, %0;" ::"n"(WARPS * 32) : "memory");
}
#endif

template <typename Ty, int KEEP, int CHUNK_BYTES = STREAM_CHUNK_BYTES, int RING_CHUNKS = STREAM_CHUNKS,
          int WARPS = STREAM_CONSUMER_WARPS>
__device__ __forceinline__ void stream_rows(const void* xv, void* yv, int rows, int cols, int* next_row) {
    // next_row: two ints, 0 at launch (see g_stream_tickets)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using S = typename Ty::storage;
    using Raw = typename Pack<Ty, Ty::VEC>::Raw;
    constexpr int VEC = Ty::VEC, CE = CHUNK_BYTES / (int)sizeof(S);              // elements per chunk
    constexpr int PER = CE / VEC / (WARPS * 32);                                   // packs per thread per chunk
    static_assert(CE % (VEC * WARPS * 32) == 0, "whole packs per consumer thread per chunk");
    static_assert(KEEP >= 1, "at least one chunk per row in registers");
    extern __shared__ __align__(16) unsigned char smem_raw[];       // bulk copies: 16-byte aligned
    S* const ring = reinterpret_cast<S*>(smem_raw);
    __shared__ __align__(8) uint64_t full[RING_CHUNKS], empty[RING_CHUNKS], pair_bar[2];
    __shared__ float2 pairs[2][STREAM_MAX_CTAS];
    __shared__ float red_m[2][WARPS], red_s[2][WARPS];
    __shared__ int row_of[RING_CHUNKS];             // the row whose first chunk a slot holds
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = (int)cluster.block_rank(), ctas = (int)cluster.num_blocks();
    const int group = (int)blockIdx.x / ctas, groups = (int)gridDim.x / ctas;
    // This CTA's part of every row: chunks [c0, c0 + mine) of the row's ceil(cols / CE).
    const int row_chunks = (cols + CE - 1) / CE, share = (row_chunks + ctas - 1) / ctas;
    const int c0 = rank * share, mine = max(0, min(share, row_chunks - c0));
    const S* x = static_cast<const S*>(xv);
    S* y = static_cast<S*>(yv);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (threadIdx.x == 0) {
        for (int s = 0; s < RING_CHUNKS; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], WARPS);
        }
        mbar_init(&pair_bar[0], ctas);
        mbar_init(&pair_bar[1], ctas);
        mbar_init_fence();
    }
    cluster.sync();                                 // every peer's barriers exist before any remote arrive
    if (warp == WARPS) {                            // the producer: one lane issues every copy
        if (lane == 0) {
            int k = 0;          // chunks issued so far (< 2^31: the tensor has < 2^31 elements); slot k % RING_CHUNKS
            for (int i = 0;; ++i) {
                // The next row: a ticket from the grid-wide counter when a CTA has rows to itself
                // (fast SMs take more rows, so no SM's share sets the kernel's end), the static
                // round robin when a cluster shares them (every peer must walk the same rows).
                int u = ctas == 1 ? atomicAdd(next_row, 1) : group + i * groups;
                if (u >= rows) u = -1;              // the end: an empty "row" with no bytes
                for (int c = 0; c < (u < 0 ? 1 : mine); ++c, ++k) {
                    const int slot = (int)(k % RING_CHUNKS);
                    mbar_wait(&empty[slot], (unsigned)((k / RING_CHUNKS) & 1) ^ 1u);   // first lap: free
                    if (c == 0) row_of[slot] = u;   // published by the arrive below (release)
                    const int lo = (c0 + c) * CE, n = u < 0 ? 0 : min(CE, cols - lo);
                    mbar_expect_tx(&full[slot], (unsigned)n * (unsigned)sizeof(S));   // 0 bytes: completes at once
                    if (n) bulk_load(ring + slot * CE, x + (size_t)u * cols + lo, (unsigned)n * (unsigned)sizeof(S),
                                     &full[slot]);
                }
                if (u < 0) break;
            }
        }
        __syncwarp();
    } else {                                        // the consumers
        // Thread t's packs of a chunk: p * WARPS * 32 + t, p < PER. read_chunk: those values of a
        // slot, times log2 e (-inf past the row's end); fold: the running (m, s) over them;
        // write_chunk: y = exp2(v - ref) * inv for the same elements.
        auto read_chunk = [&](const S* buf, int n, float (&v)[PER * VEC]) {
#pragma unroll
            for (int p = 0; p < PER; ++p) {
                const int e0 = (p * WARPS * 32 + threadIdx.x) * VEC;
                if (e0 < n) {
                    Pack<Ty, VEC> q;
                    q.raw = *reinterpret_cast<const Raw*>(buf + e0);
#pragma unroll
                    for (int j = 0; j < VEC; ++j) v[p * VEC + j] = Ty::to_float(q.e[j]) * LOG2E;
                } else {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) v[p * VEC + j] = -INFINITY;
                }
            }
        };
        // fold: the running (m, s) over a chunk's values, which it turns into exp2(v - ref) in
        // place; returns ref (the running max, 0 while it is -inf), so a kept chunk is written
        // later as v * exp2(ref - M) / S with no second exp2.
        auto fold = [&](float& m, float& s, float (&v)[PER * VEC]) {
            float cm = -INFINITY;
#pragma unroll
            for (int e = 0; e < PER * VEC; ++e) cm = fmaxf(cm, v[e]);
            const float new_m = fmaxf(m, cm), ref = finite_or_zero(new_m);
            float add = 0.f;
#pragma unroll
            for (int e = 0; e < PER * VEC; ++e) {
                v[e] = ex2(v[e] - ref);
                add += v[e];
            }
            s = s * ex2(m - ref) + add;             // m = -inf (nothing yet): 0 * 0
            m = new_m;
            return ref;
        };
        // write_chunk: y = exp2(v - ref) * inv (values read again from shared memory) or, with
        // `exps`, y = v * inv (a kept chunk: v already exp2(v - ref), inv already rescaled).
        auto write_chunk = [&](S* out, int n, const float (&v)[PER * VEC], float ref, float inv, bool exps) {
#pragma unroll
            for (int p = 0; p < PER; ++p) {
                const int e0 = (p * WARPS * 32 + threadIdx.x) * VEC;
                if (e0 < n) {
                    Pack<Ty, VEC> o;
#pragma unroll
                    for (int j = 0; j < VEC; ++j)
                        o.e[j] = Ty::from_float((exps ? v[p * VEC + j] : ex2(v[p * VEC + j] - ref)) * inv);
                    __stwb(reinterpret_cast<Raw*>(out + e0), o.raw);
                }
            }
        };
        auto release = [&](int slot) {              // every lane of this warp is done reading the slot
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[slot]);
        };
        float keep[KEEP][PER * VEC], kept_ref[KEEP];   // the row's first KEEP chunks, as exps, in registers
        int k = 0;                                  // first chunk of the current row
        for (int i = 0;; k += mine, ++i) {          // i: rows done by this CTA
            mbar_wait(&full[k % RING_CHUNKS], (unsigned)((k / RING_CHUNKS) & 1));
            const int u = row_of[k % RING_CHUNKS];  // which row the producer took (-1: none left)
            if (u < 0) break;
            float m = -INFINITY, s = 0.f;
            // Pass 1: each chunk as it lands; the first KEEP go to registers and their slots back
            // to the producer at once, the rest stay in their slots until pass 2.
#pragma unroll
            for (int c = 0; c < KEEP; ++c) {
                if (c < mine) {
                    const int kc = k + c;
                    const int slot = (int)(kc % RING_CHUNKS), n = min(CE, cols - (c0 + c) * CE);
                    mbar_wait(&full[slot], (unsigned)((kc / RING_CHUNKS) & 1));
                    read_chunk(ring + slot * CE, n, keep[c]);
                    release(slot);
                    kept_ref[c] = fold(m, s, keep[c]);
                }
            }
            for (int c = KEEP; c < mine; ++c) {
                const int kc = k + c;
                const int slot = (int)(kc % RING_CHUNKS), n = min(CE, cols - (c0 + c) * CE);
                mbar_wait(&full[slot], (unsigned)((kc / RING_CHUNKS) & 1));
                float v[PER * VEC];
                read_chunk(ring + slot * CE, n, v);
                fold(m, s, v);
            }
            warp_combine(m, s);                     // the consumers' combine, buffers by row parity
            if (lane == 0) {
                red_m[i & 1][warp] = m;
                red_s[i & 1][warp] = s;
            }
            consumers_sync<WARPS>();
            m = lane < WARPS ? red_m[i & 1][lane] : -INFINITY;
            s = lane < WARPS ? red_s[i & 1][lane] : 0.f;
            warp_combine(m, s);
            if (ctas > 1) {                         // every CTA's pair to every CTA, then combine
                if (threadIdx.x == 0) {
                    for (int r = 0; r < ctas; ++r) {
                        *cluster.map_shared_rank(&pairs[i & 1][rank], r) = make_float2(m, s);
                        mbar_arrive_remote(&pair_bar[i & 1], (unsigned)r);
                    }
                }
                mbar_wait_cluster(&pair_bar[i & 1], (unsigned)((i >> 1) & 1));
                m = -INFINITY;
                s = 0.f;
                if (lane < ctas) {
                    const float2 q = pairs[i & 1][lane];
                    m = q.x;
                    s = q.y;
                }
                warp_combine(m, s);
            }
            // Pass 2: write; the chunks still in shared memory hand their slots back as they go.
            const float ref = finite_or_zero(m), inv = 1.f / s;
            S* const out = y + (size_t)u * cols + (size_t)c0 * CE;
#pragma unroll
            for (int c = 0; c < KEEP; ++c)
                if (c < mine)
                    write_chunk(out + c * CE, min(CE, cols - (c0 + c) * CE), keep[c], 0.f, ex2(kept_ref[c] - ref) * inv, true);
            for (int c = KEEP; c < mine; ++c) {
                const int kc = k + c;
                const int slot = (int)(kc % RING_CHUNKS), n = min(CE, cols - (c0 + c) * CE);
                float v[PER * VEC];
                read_chunk(ring + slot * CE, n, v);
                release(slot);
                write_chunk(out + c * CE, n, v, ref, inv, false);
            }
        }
    }
    cluster.sync();                                 // no CTA leaves while a peer may still write to it
    if (threadIdx.x == 0) {                         // the last CTA out puts the tickets back to 0
        __threadfence();                            // (this CTA's producer took its last ticket before the barrier)
        if (atomicAdd(&next_row[1], 1) == (int)gridDim.x - 1) {
            next_row[0] = 0;
            next_row[1] = 0;
            __threadfence();
        }
    }
#endif
}

// ---------------------------------------------------------------------------------------------
// The kernels: one extern "C" entry per (kernel, dtype, row bucket C), so the ptxas report and the
// records name them plainly. All take (x, y, rows, cols, vec).
#define ROW_KERNEL_ARGS const void* __restrict__ x, void* __restrict__ y, int rows, int cols, int vec

#define SEED_KERNEL(dt, Ty, C)                                                                       \
    extern "C" __global__ void __launch_bounds__(WARP_KERNEL_WARPS * 32)                             \
        softmax_warp_row_##dt##_c##C(ROW_KERNEL_ARGS) {                                              \
        warp_row<Ty, 32, seed_values(C)>(x, y, rows, cols, vec != 0);                                \
    }
#define PACKED_KERNEL(dt, Ty, dtype, C)                                                              \
    extern "C" __global__ void __launch_bounds__(WARP_KERNEL_WARPS * 32)                             \
        softmax_warp_packed_##dt##_c##C(ROW_KERNEL_ARGS) {                                           \
        warp_row<Ty, packed_lanes(dtype, C), packed_values(dtype, C)>(x, y, rows, cols, vec != 0);   \
    }
#define BLOCK_KERNEL(dt, Ty, C)                                                                      \
    extern "C" __global__ void __launch_bounds__(block_threads(C))                                   \
        softmax_block_row_##dt##_c##C(ROW_KERNEL_ARGS) {                                             \
        block_row<Ty, block_threads(C), block_values(C)>(x, y, rows, cols, vec != 0);                \
    }
#define CLUSTER_KERNEL(dt, Ty, C)                                                                    \
    extern "C" __global__ void __launch_bounds__(CLUSTER_THREADS)                                    \
        softmax_cluster_row_##dt##_c##C(ROW_KERNEL_ARGS) {                                           \
        cluster_row<Ty, cluster_ctas(C), CLUSTER_THREADS, CLUSTER_VALUES>(x, y, rows, cols, vec != 0); \
    }
#define ONLINE_KERNEL(dt, Ty)                                                                        \
    extern "C" __global__ void __launch_bounds__(ONLINE_THREADS)                                     \
        softmax_online_##dt(ROW_KERNEL_ARGS, int stat_cols) {                                        \
        online_row<Ty, ONLINE_THREADS, ONLINE_VALUES>(x, y, rows, cols, vec != 0, stat_cols);       \
    }

// Shared-memory kernels: THREADS = slice bytes / 128 (two 16-byte packs per thread per piece), and
// launch bounds that let the shared-memory limit, not registers, set the CTAs per SM.
#define SMEM_KERNEL(name, Ty, S_T, SLICE, CL)                                                        \
    extern "C" __global__ void __launch_bounds__(SLICE * sizeof(S_T) / 128, 196608 / (SLICE * sizeof(S_T)))   \
        name(ROW_KERNEL_ARGS) {                                                                      \
        smem_row<Ty, SLICE * sizeof(S_T) / 128, SLICE, CL>(x, y, rows, cols, vec != 0);             \
    }
#define FOR_DTYPES(M, ...) M(f32, F32, __VA_ARGS__) M(bf16, BF16, __VA_ARGS__)
#define SEED_BOTH(C) SEED_KERNEL(f32, F32, C) SEED_KERNEL(bf16, BF16, C)
#define PACKED_BOTH(C) PACKED_KERNEL(f32, F32, 0, C) PACKED_KERNEL(bf16, BF16, 1, C)
#define BLOCK_BOTH(C) BLOCK_KERNEL(f32, F32, C) BLOCK_KERNEL(bf16, BF16, C)
#define CLUSTER_BOTH(C) CLUSTER_KERNEL(f32, F32, C) CLUSTER_KERNEL(bf16, BF16, C)

SEED_BOTH(32) SEED_BOTH(64) SEED_BOTH(128) SEED_BOTH(256) SEED_BOTH(512) SEED_BOTH(1024)
// Packed only where it differs from the seed's layout (fewer than 32 lanes per row): fp32 up to
// C = 128 (8 values per lane), bf16 up to C = 256 (16 values per lane).
PACKED_BOTH(1) PACKED_BOTH(2) PACKED_BOTH(4) PACKED_BOTH(8) PACKED_BOTH(16) PACKED_BOTH(32)
PACKED_BOTH(64) PACKED_BOTH(128) PACKED_KERNEL(bf16, BF16, 1, 256)
BLOCK_BOTH(2048) BLOCK_BOTH(4096) BLOCK_BOTH(8192) BLOCK_BOTH(16384) BLOCK_BOTH(32768)
CLUSTER_BOTH(16384) CLUSTER_BOTH(32768) CLUSTER_BOTH(65536) CLUSTER_BOTH(131072)
ONLINE_KERNEL(f32, F32) ONLINE_KERNEL(bf16, BF16)
// Shared-memory kernels, named by their slice in elements: a 32 KB slice (256 threads, 6 CTAs per
// SM) and a 64 KB slice (512 threads, 3 CTAs per SM) per dtype.
SMEM_KERNEL(softmax_block_row_smem_f32_s8192, F32, float, 8192, false)
SMEM_KERNEL(softmax_block_row_smem_f32_s16384, F32, float, 16384, false)
SMEM_KERNEL(softmax_block_row_smem_bf16_s16384, BF16, unsigned short, 16384, false)
SMEM_KERNEL(softmax_cluster_row_smem_f32_s8192, F32, float, 8192, true)
SMEM_KERNEL(softmax_cluster_row_smem_f32_s16384, F32, float, 16384, true)
SMEM_KERNEL(softmax_cluster_row_smem_bf16_s16384, BF16, unsigned short, 16384, true)
SMEM_KERNEL(softmax_cluster_row_smem_bf16_s32768, BF16, unsigned short, 32768, true)
// Stream kernels (persistent, one CTA per SM, sm_90): (x, y, rows, cols).
// The row tickets: [0] the next row to take, [1] CTAs finished; the last CTA of each launch sets
// both back to 0, so launches on one device must not overlap (the lab's run on one stream).
__device__ int g_stream_tickets[2];
#define STREAM_KERNEL(name, Ty, KEEP)                                                                \
    extern "C" __global__ void __launch_bounds__(STREAM_THREADS, 1)                                  \
        name(const void* __restrict__ x, void* __restrict__ y, int rows, int cols) {                 \
        stream_rows<Ty, KEEP>(x, y, rows, cols, g_stream_tickets);                                   \
    }
STREAM_KERNEL(softmax_stream_row_f32, F32, STREAM_KEEP)
STREAM_KERNEL(softmax_stream_row_bf16, BF16, STREAM_KEEP)

static_assert(packed_lanes(0, 256) == 32 && packed_lanes(1, 512) == 32, "packed = seed layout from here on");
static_assert(packed_lanes(0, 128) == 16 && packed_lanes(1, 256) == 16, "the last packed kernels");

// ---------------------------------------------------------------------------------------------
// Host side: tables, checks, launches.
using RowKernel = void (*)(const void*, void*, int, int, int);
using OnlineKernel = void (*)(const void*, void*, int, int, int, int);
using StreamKernel = void (*)(const void*, void*, int, int);

// Kernel families, the codes softmax_choose returns (softmax.py's KERNELS lists them in this order).
enum Kernel { K_WARP_PACKED = 0, K_WARP_ROW = 1, K_BLOCK_ROW = 2, K_CLUSTER_ROW = 3, K_ONLINE = 4,
              K_BLOCK_ROW_SMEM = 5, K_CLUSTER_ROW_SMEM = 6, K_CLUSTER_ROW_SMEM64 = 7, K_STREAM_ROW = 8 };
#define WARP_MAX_COLS 1024
#define BLOCK_MAX_COLS 32768
#define CLUSTER_MAX_COLS 131072
#define SMEM_BLOCK_MAX_COLS 16384      // block_row_smem: one CTA's slice (64 KB fp32, 32 KB bf16)
#define SMEM_CLUSTER_MAX_COLS 131072
#define STREAM_MAX_COLS 131072           // stream_row: fp32 up to 4 CTAs x 144 KB, bf16 up to 2

static const RowKernel SEED[2][6] = {       // C = 32 .. 1024
    {softmax_warp_row_f32_c32, softmax_warp_row_f32_c64, softmax_warp_row_f32_c128, softmax_warp_row_f32_c256,
     softmax_warp_row_f32_c512, softmax_warp_row_f32_c1024},
    {softmax_warp_row_bf16_c32, softmax_warp_row_bf16_c64, softmax_warp_row_bf16_c128, softmax_warp_row_bf16_c256,
     softmax_warp_row_bf16_c512, softmax_warp_row_bf16_c1024}};
static const RowKernel PACKED[2][9] = {     // C = 1 .. 256 (fp32 up to 128)
    {softmax_warp_packed_f32_c1, softmax_warp_packed_f32_c2, softmax_warp_packed_f32_c4, softmax_warp_packed_f32_c8,
     softmax_warp_packed_f32_c16, softmax_warp_packed_f32_c32, softmax_warp_packed_f32_c64,
     softmax_warp_packed_f32_c128, nullptr},
    {softmax_warp_packed_bf16_c1, softmax_warp_packed_bf16_c2, softmax_warp_packed_bf16_c4,
     softmax_warp_packed_bf16_c8, softmax_warp_packed_bf16_c16, softmax_warp_packed_bf16_c32,
     softmax_warp_packed_bf16_c64, softmax_warp_packed_bf16_c128, softmax_warp_packed_bf16_c256}};
static const RowKernel BLOCK[2][5] = {      // C = 2048 (and below) .. 32768
    {softmax_block_row_f32_c2048, softmax_block_row_f32_c4096, softmax_block_row_f32_c8192,
     softmax_block_row_f32_c16384, softmax_block_row_f32_c32768},
    {softmax_block_row_bf16_c2048, softmax_block_row_bf16_c4096, softmax_block_row_bf16_c8192,
     softmax_block_row_bf16_c16384, softmax_block_row_bf16_c32768}};
static const RowKernel CLUSTER[2][4] = {    // C = 16384 (and below) .. 131072
    {softmax_cluster_row_f32_c16384, softmax_cluster_row_f32_c32768, softmax_cluster_row_f32_c65536,
     softmax_cluster_row_f32_c131072},
    {softmax_cluster_row_bf16_c16384, softmax_cluster_row_bf16_c32768, softmax_cluster_row_bf16_c65536,
     softmax_cluster_row_bf16_c131072}};
static const OnlineKernel ONLINE[2] = {softmax_online_f32, softmax_online_bf16};
// Shared-memory kernels: {kernel, slice elements, threads}. Index: [dtype][0] 32 KB slice, [1] 64 KB.
struct SmemKernel { RowKernel k; int slice; int threads; };
static const SmemKernel SMEM_BLOCK[2][2] = {
    {{softmax_block_row_smem_f32_s8192, 8192, 256}, {softmax_block_row_smem_f32_s16384, 16384, 512}},
    {{softmax_block_row_smem_bf16_s16384, 16384, 256}, {nullptr, 0, 0}}};
static const SmemKernel SMEM_CLUSTER[2][2] = {
    {{softmax_cluster_row_smem_f32_s8192, 8192, 256}, {softmax_cluster_row_smem_f32_s16384, 16384, 512}},
    {{softmax_cluster_row_smem_bf16_s16384, 16384, 256}, {softmax_cluster_row_smem_bf16_s32768, 32768, 512}}};

static int ceil_log2(int n) {               // smallest p with 2^p >= n (n >= 1)
    int p = 0;
    while ((1LL << p) < (long long)n) ++p;
    return p;
}

// The vector path needs whole packs: the row length a multiple of PACK (so every row starts
// aligned and no pack straddles the end) and both base pointers aligned to the pack's bytes.
static int can_vector(const void* x, const void* y, int cols, int dtype, int pack) {
    const uintptr_t bytes = (uintptr_t)pack * (dtype == 0 ? 4 : 2);
    return cols % pack == 0 && (uintptr_t)x % bytes == 0 && (uintptr_t)y % bytes == 0;
}

static int bad_args(int rows, int cols, int dtype) { return rows < 0 || cols < 1 || (dtype != 0 && dtype != 1); }

static int launch_rows(RowKernel k, long long blocks, int threads, const void* x, void* y, int rows, int cols,
                       int vec, cudaStream_t stream) {
    if (blocks > INT_MAX) return (int)cudaErrorInvalidValue;
    k<<<(unsigned)blocks, threads, 0, stream>>>(x, y, rows, cols, vec);
    return (int)cudaGetLastError();
}

static int run_seed(const void* x, void* y, int rows, int cols, int dtype, cudaStream_t stream) {
    const int p = ceil_log2(cols) < 5 ? 5 : ceil_log2(cols), c = 1 << p;    // C >= 32: one lane per column
    const int vec = can_vector(x, y, cols, dtype, pack_of(vec_of(dtype), seed_values(c)));
    const long long rows_per_block = WARP_KERNEL_WARPS;                    // one row per warp
    return launch_rows(SEED[dtype][p - 5], (rows + rows_per_block - 1) / rows_per_block, WARP_KERNEL_WARPS * 32,
                       x, y, rows, cols, vec, stream);
}

static int run_packed(const void* x, void* y, int rows, int cols, int dtype, cudaStream_t stream) {
    const int p = ceil_log2(cols), c = 1 << p;
    if (packed_lanes(dtype, c) == 32) return run_seed(x, y, rows, cols, dtype, stream);   // same layout
    const int vec = can_vector(x, y, cols, dtype, pack_of(vec_of(dtype), packed_values(dtype, c)));
    const long long rows_per_block = WARP_KERNEL_WARPS * (32 / packed_lanes(dtype, c));
    return launch_rows(PACKED[dtype][p], (rows + rows_per_block - 1) / rows_per_block, WARP_KERNEL_WARPS * 32,
                       x, y, rows, cols, vec, stream);
}

static int run_block(const void* x, void* y, int rows, int cols, int dtype, cudaStream_t stream) {
    const int p = ceil_log2(cols) < 11 ? 11 : ceil_log2(cols), c = 1 << p;
    const int vec = can_vector(x, y, cols, dtype, pack_of(vec_of(dtype), block_values(c)));
    return launch_rows(BLOCK[dtype][p - 11], rows, block_threads(c), x, y, rows, cols, vec, stream);
}

static int run_online(const void* x, void* y, int rows, int cols, int dtype, int stat_cols, cudaStream_t stream) {
    const int vec = can_vector(x, y, cols, dtype, pack_of(vec_of(dtype), ONLINE_VALUES));
    ONLINE[dtype]<<<(unsigned)rows, ONLINE_THREADS, 0, stream>>>(x, y, rows, cols, vec, stat_cols);
    return (int)cudaGetLastError();
}

// Can this GPU run the cluster kernel for this bucket? Clusters need sm_90; size 16 is beyond the
// portable 8 and must be allowed per kernel; and at least one cluster of CTAs must fit on a GPC
// (cudaOccupancyMaxActiveClusters > 0). The answer is cached per device, dtype and bucket.
// The launch configuration of a grid of `blocks` CTAs in clusters of `ctas` along x (an
// occupancy query passes blocks = ctas and no stream); `attr` holds the cluster attribute and must
// outlive the configuration.
static cudaLaunchConfig_t cluster_config(cudaLaunchAttribute (&attr)[1], int ctas, long long blocks, int threads,
                                         size_t smem_bytes, cudaStream_t stream) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = ctas;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)blocks);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem_bytes;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cfg;
}

static int g_cluster_ready[64][2][4];       // 0 unknown, else (cudaError_t + 1)

static int cluster_ready(int dtype, int idx) {
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return (int)e;
    if (dev < 64 && g_cluster_ready[dev][dtype][idx]) return g_cluster_ready[dev][dtype][idx] - 1;
    int supported = 0, result = 0;
    e = cudaDeviceGetAttribute(&supported, cudaDevAttrClusterLaunch, dev);
    RowKernel k = CLUSTER[dtype][idx];
    const int ctas = cluster_ctas(16384 << idx);
    if (e != cudaSuccess || !supported) {
        result = (int)cudaErrorNotSupported;
    } else {
        if (ctas > 8) e = cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
        int clusters = 0;
        if (e == cudaSuccess) {
            cudaLaunchAttribute attr[1];
            const cudaLaunchConfig_t cfg = cluster_config(attr, ctas, ctas, CLUSTER_THREADS, 0, 0);
            e = cudaOccupancyMaxActiveClusters(&clusters, k, &cfg);
        }
        result = e != cudaSuccess ? (int)e : (clusters > 0 ? 0 : (int)cudaErrorNotSupported);
    }
    cudaGetLastError();                     // a refused query must not surface as a later launch's error
    if (dev < 64) g_cluster_ready[dev][dtype][idx] = result + 1;
    return result;
}

static int run_cluster(const void* x, void* y, int rows, int cols, int dtype, cudaStream_t stream) {
    const int p = ceil_log2(cols) < 14 ? 14 : ceil_log2(cols), c = 1 << p, idx = p - 14;
    const int ready = cluster_ready(dtype, idx);
    if (ready != 0) return ready;
    const int ctas = cluster_ctas(c);
    const long long blocks = (long long)rows * ctas;
    if (blocks > INT_MAX) return (int)cudaErrorInvalidValue;
    const int vec = can_vector(x, y, cols, dtype, pack_of(vec_of(dtype), CLUSTER_VALUES));
    cudaLaunchAttribute attr[1];
    const cudaLaunchConfig_t cfg = cluster_config(attr, ctas, blocks, CLUSTER_THREADS, 0, stream);
    const cudaError_t e = cudaLaunchKernelEx(&cfg, CLUSTER[dtype][idx], x, y, rows, cols, vec);
    if (e != cudaSuccess) return (int)e;
    return (int)cudaGetLastError();
}

// Shared-memory kernels need their dynamic shared memory allowed above 48 KB (once per device and
// kernel), and, for clusters, a cluster of that many CTAs with that much shared memory must fit
// (cudaOccupancyMaxActiveClusters > 0; more than 8 CTAs must be allowed per kernel).
static int g_smem_ready[64][2][2][2][17];    // [dev][cluster?][dtype][slice idx][ctas]: 0 unknown, else err + 1

static int smem_ready(const SmemKernel& sk, int cluster, int dtype, int idx, int ctas) {
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return (int)e;
    if (ctas < 1 || ctas > 16 || sk.k == nullptr) return (int)cudaErrorInvalidValue;
    int* slot = dev < 64 ? &g_smem_ready[dev][cluster][dtype][idx][ctas] : nullptr;
    if (slot && *slot) return *slot - 1;
    const size_t bytes = (size_t)sk.slice * (dtype == 0 ? 4 : 2);
    int result = 0;
    if (cluster) {
        int supported = 0;
        e = cudaDeviceGetAttribute(&supported, cudaDevAttrClusterLaunch, dev);
        if (e != cudaSuccess || !supported) result = (int)cudaErrorNotSupported;
    }
    if (result == 0) {
        e = cudaFuncSetAttribute(sk.k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
        if (e == cudaSuccess && cluster && ctas > 8)
            e = cudaFuncSetAttribute(sk.k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
        if (e == cudaSuccess && cluster) {
            cudaLaunchAttribute attr[1];
            const cudaLaunchConfig_t cfg = cluster_config(attr, ctas, ctas, sk.threads, bytes, 0);
            int clusters = 0;
            e = cudaOccupancyMaxActiveClusters(&clusters, sk.k, &cfg);
            if (e == cudaSuccess && clusters <= 0) e = cudaErrorNotSupported;
        }
        result = (int)e;
    }
    cudaGetLastError();                     // a refused query must not surface as a later launch's error
    if (slot) *slot = result + 1;
    return result;
}

// block_row_smem: one CTA per row; the 32 KB slice when the row fits in it, else the 64 KB one.
static int run_block_smem(const void* x, void* y, int rows, int cols, int dtype, cudaStream_t stream) {
    const int idx = cols <= SMEM_BLOCK[dtype][0].slice ? 0 : 1;
    const SmemKernel& sk = SMEM_BLOCK[dtype][idx];
    if (sk.k == nullptr || cols > sk.slice) return (int)cudaErrorInvalidValue;
    const int ready = smem_ready(sk, 0, dtype, idx, 1);
    if (ready != 0) return ready;
    const int vec = can_vector(x, y, cols, dtype, vec_of(dtype));
    sk.k<<<(unsigned)rows, sk.threads, (size_t)sk.slice * (dtype == 0 ? 4 : 2), stream>>>(x, y, rows, cols, vec);
    return (int)cudaGetLastError();
}

// cluster_row_smem (idx 0, 32 KB slices) and cluster_row_smem64 (idx 1, 64 KB slices): a cluster of
// ceil(cols / slice) CTAs per row (1..16).
static int run_cluster_smem(const void* x, void* y, int rows, int cols, int dtype, int idx, cudaStream_t stream) {
    const SmemKernel& sk = SMEM_CLUSTER[dtype][idx];
    const int ctas = (cols + sk.slice - 1) / sk.slice;
    if (ctas > 16) return (int)cudaErrorInvalidValue;
    const int ready = smem_ready(sk, 1, dtype, idx, ctas);
    if (ready != 0) return ready;
    const long long blocks = (long long)rows * ctas;
    if (blocks > INT_MAX) return (int)cudaErrorInvalidValue;
    const int vec = can_vector(x, y, cols, dtype, vec_of(dtype));
    cudaLaunchAttribute attr[1];
    const cudaLaunchConfig_t cfg = cluster_config(attr, ctas, blocks, sk.threads, (size_t)sk.slice * (dtype == 0 ? 4 : 2),
                                                  stream);
    const cudaError_t e = cudaLaunchKernelEx(&cfg, sk.k, x, y, rows, cols, vec);
    if (e != cudaSuccess) return (int)e;
    return (int)cudaGetLastError();
}

// Can this family run rows of `cols` here (without launching anything)? Used by the dispatcher to
// fall back when a table entry names a kernel this GPU lacks (clusters before sm_90).
static int cluster_smem_ready_for(int cols, int dtype, int idx) {
    const int ctas = (cols + SMEM_CLUSTER[dtype][idx].slice - 1) / SMEM_CLUSTER[dtype][idx].slice;
    return ctas <= 16 && smem_ready(SMEM_CLUSTER[dtype][idx], 1, dtype, idx, ctas) == 0;
}

// stream_row is persistent: as many clusters as fit at once, from the occupancy calculator with its
// dynamic shared memory, cached per device, dtype and cluster size.
static const StreamKernel STREAM[2] = {softmax_stream_row_f32, softmax_stream_row_bf16};
#define STREAM_SMEM_BYTES (STREAM_CHUNKS * STREAM_CHUNK_BYTES)
static int g_stream_resident[64][2][17];    // [dev][dtype][ctas]; 0 unknown, < 0: -(err + 1)

static int stream_resident(int dtype, int ctas, int* resident) {
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return (int)e;
    if (ctas < 1 || ctas > 16) return (int)cudaErrorInvalidValue;
    int* slot = dev < 64 ? &g_stream_resident[dev][dtype][ctas] : nullptr;
    if (slot && *slot > 0) { *resident = *slot; return 0; }
    if (slot && *slot < 0) return -*slot - 1;
    StreamKernel k = STREAM[dtype];
    int major = 0, n = 0;
    e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (e == cudaSuccess && major < 9) e = cudaErrorNotSupported;        // bulk copies, clusters: sm_90
    if (e == cudaSuccess) e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, STREAM_SMEM_BYTES);
    if (e == cudaSuccess && ctas > 8)
        e = cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (e == cudaSuccess) {
        cudaLaunchAttribute attr[1];
        const cudaLaunchConfig_t cfg = cluster_config(attr, ctas, ctas, STREAM_THREADS, STREAM_SMEM_BYTES, 0);
        e = cudaOccupancyMaxActiveClusters(&n, k, &cfg);
    }
    if (e == cudaSuccess && n <= 0) e = cudaErrorNotSupported;
    cudaGetLastError();                     // a refused query must not surface as a later launch's error
    if (slot) *slot = e == cudaSuccess ? n : -((int)e + 1);
    if (e == cudaSuccess) *resident = n;
    return (int)e;
}

// A row's chunks (STREAM_CHUNK_BYTES each), and the CTAs per row: a CTA holds KEEP chunks of a row
// in registers and STREAM_SLICE_CHUNKS in shared memory, so ceil(chunks / (KEEP + STREAM_SLICE_CHUNKS))
// CTAs (1..STREAM_MAX_CTAS).
static int stream_chunks(int cols, int dtype) {
    const int chunk = STREAM_CHUNK_BYTES / (dtype == 0 ? 4 : 2);
    return (cols + chunk - 1) / chunk;
}

static int stream_ctas(int cols, int dtype) {
    const int per_cta = STREAM_KEEP + STREAM_SLICE_CHUNKS;
    return (stream_chunks(cols, dtype) + per_cta - 1) / per_cta;
}

// One launch: min(rows, resident clusters) clusters of ceil(chunks / 9) CTAs. Without `vec` (a
// misaligned pointer, a length not a multiple of the 16-byte pack) the bulk copies cannot be used:
// stream_row runs cluster_row_smem (32 KB slices) instead.
static int run_stream(const void* x, void* y, int rows, int cols, int dtype, cudaStream_t stream) {
    const int ctas = stream_ctas(cols, dtype), chunks = stream_chunks(cols, dtype);
    if (ctas > STREAM_MAX_CTAS) return (int)cudaErrorInvalidValue;
    // Every CTA of a cluster must own at least one chunk of a row (its producer announces the rows).
    if ((ctas - 1) * ((chunks + ctas - 1) / ctas) >= chunks) return (int)cudaErrorInvalidValue;
    int resident = 0;
    const int ready = stream_resident(dtype, ctas, &resident);
    if (ready != 0) return ready;
    if (!can_vector(x, y, cols, dtype, vec_of(dtype))) return run_cluster_smem(x, y, rows, cols, dtype, 0, stream);
    const long long blocks = (rows < resident ? rows : resident) * (long long)ctas;
    if (blocks > INT_MAX) return (int)cudaErrorInvalidValue;
    cudaLaunchAttribute attr[1];
    const cudaLaunchConfig_t cfg = cluster_config(attr, ctas, blocks, STREAM_THREADS, STREAM_SMEM_BYTES, stream);
    const cudaError_t e = cudaLaunchKernelEx(&cfg, STREAM[dtype], x, y, rows, cols);
    if (e != cudaSuccess) return (int)e;
    return (int)cudaGetLastError();
}

static int stream_ready_for(int cols, int dtype) {
    const int ctas = stream_ctas(cols, dtype);
    int resident = 0;
    return ctas <= STREAM_MAX_CTAS && stream_resident(dtype, ctas, &resident) == 0;
}

// =============================================================================================
// THE DISPATCH TABLE: which kernel the `cuda` variant (launch_softmax) runs, per dtype and row
// length. Per dtype, entries {longest row, kernel} in increasing order: the first entry whose
// max_cols >= cols wins. Edit here (and only here) after a measured run; the Python side reads
// the choice back through softmax_choose. Each kernel's own limit: warp_* 1024; block_row 32768;
// block_row_smem 16384; cluster_row, cluster_row_smem(64), stream_row 131072 (sm_90); online any.
// A choice this GPU cannot run (a cluster or stream kernel before sm_90, or a length beyond the
// kernel's limit) falls back to warp_row (<= 1024 columns), block_row (<= 32768) or online.
// The choices come from measured runs (results/phase2/softmax/). Rows of 16,385..32,768 and of
// 32,769..131,072 other than 65,536 are dispatched without a measurement of their own.
struct Route { int max_cols; int kernel; };
#define ROUTE_END {INT_MAX, K_ONLINE}
static const Route DISPATCH[2][8] = {
    {   // fp32
        {128, K_WARP_PACKED},               // fewer than 32 lanes per row (8 values per lane)
        {1024, K_WARP_ROW},
        {16384, K_BLOCK_ROW},
        {32768, K_CLUSTER_ROW_SMEM},
        {131072, K_STREAM_ROW},
        ROUTE_END},
    {   // bf16
        {256, K_WARP_PACKED},               // fewer than 32 lanes per row (16 values per lane)
        {1024, K_WARP_ROW},
        {8192, K_BLOCK_ROW},
        {16384, K_BLOCK_ROW_SMEM},
        {32768, K_CLUSTER_ROW_SMEM64},
        {131072, K_STREAM_ROW},
        ROUTE_END},
};
// =============================================================================================

// The dispatcher's choice for a row length (Kernel enum, from DISPATCH above, after the
// fallbacks), also reported to Python for the record.
static int max_cols_of(int kernel) {
    switch (kernel) {
        case K_WARP_PACKED: case K_WARP_ROW: return WARP_MAX_COLS;
        case K_BLOCK_ROW: return BLOCK_MAX_COLS;
        case K_BLOCK_ROW_SMEM: return SMEM_BLOCK_MAX_COLS;
        case K_CLUSTER_ROW: return CLUSTER_MAX_COLS;
        case K_CLUSTER_ROW_SMEM: case K_CLUSTER_ROW_SMEM64: return SMEM_CLUSTER_MAX_COLS;
        case K_STREAM_ROW: return STREAM_MAX_COLS;
        default: return INT_MAX;
    }
}

extern "C" int softmax_choose(int cols, int dtype) {
    if (cols < 1 || (dtype != 0 && dtype != 1)) return -1;
    int k = K_ONLINE;
    for (const Route& r : DISPATCH[dtype]) {
        if (r.max_cols == 0) break;                 // past the table's end
        if (cols <= r.max_cols) { k = r.kernel; break; }
    }
    if (k == K_WARP_PACKED && packed_lanes(dtype, 1 << ceil_log2(cols)) == 32) k = K_WARP_ROW;   // same layout
    bool ok = cols <= max_cols_of(k);
    if (ok && k == K_CLUSTER_ROW) ok = cluster_ready(dtype, ceil_log2(cols) < 14 ? 0 : ceil_log2(cols) - 14) == 0;
    if (ok && k == K_CLUSTER_ROW_SMEM) ok = cluster_smem_ready_for(cols, dtype, 0);
    if (ok && k == K_CLUSTER_ROW_SMEM64) ok = cluster_smem_ready_for(cols, dtype, 1);
    if (ok && k == K_STREAM_ROW) ok = stream_ready_for(cols, dtype);
    if (!ok) k = cols <= WARP_MAX_COLS ? K_WARP_ROW : (cols <= BLOCK_MAX_COLS ? K_BLOCK_ROW : K_ONLINE);
    return k;
}

// Runs kernel k (Kernel enum) on arguments already checked.
static int run_kernel(int k, const void* x, void* y, int rows, int cols, int dtype, cudaStream_t stream) {
    switch (k) {
        case K_WARP_PACKED: return run_packed(x, y, rows, cols, dtype, stream);
        case K_WARP_ROW: return run_seed(x, y, rows, cols, dtype, stream);
        case K_BLOCK_ROW: return run_block(x, y, rows, cols, dtype, stream);
        case K_BLOCK_ROW_SMEM: return run_block_smem(x, y, rows, cols, dtype, stream);
        case K_CLUSTER_ROW: return run_cluster(x, y, rows, cols, dtype, stream);
        case K_CLUSTER_ROW_SMEM: return run_cluster_smem(x, y, rows, cols, dtype, 0, stream);
        case K_CLUSTER_ROW_SMEM64: return run_cluster_smem(x, y, rows, cols, dtype, 1, stream);
        case K_STREAM_ROW: return run_stream(x, y, rows, cols, dtype, stream);
        default: return run_online(x, y, rows, cols, dtype, cols, stream);
    }
}

// One kernel by name: its own row-length limit is checked here, the GPU's abilities (clusters)
// by the kernel's run_* function.
static int launch_one(int k, const void* x, void* y, int rows, int cols, int dtype, cudaStream_t stream) {
    if (bad_args(rows, cols, dtype) || cols > max_cols_of(k)) return (int)cudaErrorInvalidValue;
    return rows == 0 ? 0 : run_kernel(k, x, y, rows, cols, dtype, stream);
}

extern "C" int launch_softmax(const void* x, void* y, int rows, int cols, int dtype, cudaStream_t stream) {
    if (bad_args(rows, cols, dtype)) return (int)cudaErrorInvalidValue;
    return rows == 0 ? 0 : run_kernel(softmax_choose(cols, dtype), x, y, rows, cols, dtype, stream);
}

#define SOFTMAX_LAUNCHER(name, kernel)                                                             \
    extern "C" int launch_softmax_##name(const void* x, void* y, int rows, int cols, int dtype,    \
                                         cudaStream_t stream) {                                    \
        return launch_one(kernel, x, y, rows, cols, dtype, stream);                                \
    }
SOFTMAX_LAUNCHER(warp_row, K_WARP_ROW)
SOFTMAX_LAUNCHER(warp_packed, K_WARP_PACKED)
SOFTMAX_LAUNCHER(block_row, K_BLOCK_ROW)
SOFTMAX_LAUNCHER(cluster_row, K_CLUSTER_ROW)
SOFTMAX_LAUNCHER(block_row_smem, K_BLOCK_ROW_SMEM)
SOFTMAX_LAUNCHER(cluster_row_smem, K_CLUSTER_ROW_SMEM)
SOFTMAX_LAUNCHER(cluster_row_smem64, K_CLUSTER_ROW_SMEM64)
SOFTMAX_LAUNCHER(stream_row, K_STREAM_ROW)
SOFTMAX_LAUNCHER(online, K_ONLINE)

// A deliberately wrong launcher (tests only): the online kernel with max and sum taken over the
// first half of each row only, then every element normalized by that. Rows sum to more than 1;
// the checker must reject it (at cols = 1 the half is the whole row and it is right by accident).
extern "C" int launch_softmax_broken_half_row_sum(const void* x, void* y, int rows, int cols, int dtype,
                                                  cudaStream_t stream) {
    if (bad_args(rows, cols, dtype)) return (int)cudaErrorInvalidValue;
    return rows == 0 ? 0 : run_online(x, y, rows, cols, dtype, cols / 2 > 0 ? cols / 2 : 1, stream);
}

// Phase 2.2, Hopper rungs: wgmma (warpgroup tensor-core MMA) fed by TMA (the bulk tensor copy
// engine), sm_90a only. C = A @ B with A: M x K bf16 row-major (K contiguous), B given column-major,
// i.e. an N x K row-major array (K contiguous, the "K-major" layout wgmma reads untransposed),
// fp32 accumulation, C: M x N bf16 row-major. Any M, N >= 1 and any K that is a multiple of 8 (the
// TMA row pitch must be a multiple of 16 bytes); A and B must be 16-byte aligned. Out-of-range rows
// and columns of every tile are zero-filled by TMA, and the epilogue stores are bounds-checked.
//
//   wgmma_tma     one CTA (2 warpgroups, 256 threads) per 128 x 128 tile of C, BK = 64, a 3-stage
//                 ring of 128B-swizzled TMA tiles with full/empty mbarriers; thread 0 also issues
//                 the copies. Each warpgroup does m64n128k16 wgmma on its 64 rows. 2 CTAs per SM.
//                 Split-K as below (grid y = runs of K) when the tiles leave CTA slots empty.
//   wgmma_tma_ws  warp-specialized and persistent: grid = #SMs, each CTA walks 128 x 256 tiles in
//                 a grouped (L2-friendly) order. Warpgroup 0 is the producer (one thread issues
//                 TMA, setmaxnreg down to 40 registers); warpgroups 1 and 2 are consumers (up to
//                 232 registers), each m64n256k16 on 64 rows of the tile, keeping one wgmma batch
//                 in flight. 4 stages x 48 KB of shared memory; no clusters. Its work units are
//                 (tile, run of K): when the tiles leave SMs idle (tall-skinny M <= 64, few tiles)
//                 K is split by a rule of the shape and SM count (lab_wgmma_ws_split_k), fp32
//                 partial sums go to a workspace and matmul_sum_splits adds them in a fixed order
//                 (deterministic); a consumer warpgroup whose 64 rows all lie past M issues no
//                 wgmma (it only releases the stages), so M <= 64 costs one warpgroup's math.
//   (experimental, not rungs: wgmma_tma_ws_cluster, B multicast to clusters of 2 CTAs; and
//   wgmma_tma_ws_tma_store, the same as wgmma_tma_ws with its epilogue staged through shared memory and
//   written by TMA stores.)
//
// Each launcher returns the cudaError_t of cudaGetLastError() after its launch, or
// cudaErrorInvalidValue (without launching) for K % 8 != 0 or A or B not 16-byte aligned.
// lab-build: arch-specific
#include <cuda_runtime.h>
#include <cuda.h>           // CUtensorMap and its enums (types only: libcuda is reached through the runtime)
#include <cudaTypedefs.h>   // PFN_cuTensorMapEncodeTiled_v12000
#include <cuda_bf16.h>
#include <stdint.h>

extern "C" const char* lab_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

// ---------------------------------------------------------------------------------------------
// Shared-memory layout of one stage (both rungs). A tile: BM rows x 64 bf16 (128 bytes per row),
// written by TMA with the 128-byte swizzle: the 16-byte chunk c of row r lands at chunk c ^ (r % 8),
// so 8 rows form a 1024-byte atom and atoms follow each other every 1024 bytes. The B tile (BN rows
// of N, 64 bf16 of K each) is laid out the same way. wgmma reads exactly this layout ("K-major,
// 128B swizzle") when its descriptor says so; every tile starts on a 1024-byte boundary so the
// swizzle phase (address bits 7-9) is the row index and the descriptor's base offset stays 0.
#define WG_BK 64                  // K per stage: 64 bf16 = 128 bytes = one swizzle row
#define WG_ROW_BYTES 128
#define WG_WAIT_TIMEOUT_NS 4000000000ull   // a barrier wait that takes 4 s is a bug: trap, do not hang

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// wgmma shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"):
//   bits  0-13  start address >> 4
//   bits 16-29  leading-dimension byte offset >> 4: unused for swizzled K-major layouts (the K
//               extent of one wgmma, 16 bf16 = 32 bytes, lies inside one 128-byte swizzle row); 1
//   bits 32-45  stride-dimension byte offset >> 4: from one 8-row core-matrix group to the next
//               along M (or N) = 8 rows x 128 bytes = 1024 -> 64
//   bits 49-51  base offset: 0, tiles are 1024-byte aligned
//   bits 62-63  swizzle mode: 1 = 128-byte swizzle
// Stepping K by 16 inside the 64-wide tile adds 32 bytes to the start address (+2 in the field):
// the hardware applies the XOR swizzle to the final address, as TMA did when writing.
__device__ __forceinline__ uint64_t desc_k_major_sw128(uint32_t smem_addr) {
    return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4)
         | (static_cast<uint64_t>(1) << 16)
         | (static_cast<uint64_t>(1024 >> 4) << 32)
         | (static_cast<uint64_t>(1) << 62);
}

// ---- mbarrier -----------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}

// Make the initialized barriers visible to the other threads and to the async proxy (TMA).
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Arrive once and add `bytes` to the transaction count the phase waits for (the TMA copies'
// complete_tx take it back down to zero).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}

// True once the phase of parity `parity` has completed. A fresh barrier is in phase 0, so waiting
// for parity 1 (the phase "before" it) returns at once: that is how the producer's first pass
// over the empty barriers goes through.
__device__ __forceinline__ uint32_t mbar_try_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done;
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}

// Spin until the phase completes; a wait longer than WG_WAIT_TIMEOUT_NS traps (the launch then
// fails with an error instead of hanging the GPU: a wrong byte count or parity shows up that way).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    if (mbar_try_wait(bar, parity)) return;
    const uint64_t t0 = globaltimer_ns();
    for (uint32_t n = 1;; ++n) {
        if (mbar_try_wait(bar, parity)) return;
        if ((n & 1023u) == 0 && globaltimer_ns() - t0 > WG_WAIT_TIMEOUT_NS) __trap();
    }
}

// ---- TMA ----------------------------------------------------------------------------------------
// Copy the box at (c0 = k, c1 = row) of a 2-D tensor map into shared memory at `dst`; completion
// is signalled on `bar` as transaction bytes (always the whole box: out-of-range elements are
// zero-filled and counted).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4}], [%2];\n"
        :: "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1) : "memory");
}

__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// ---- wgmma --------------------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }

// Pin the accumulators at this point of the program: reads of them (the epilogue) cannot be moved
// above the wgmma.wait_group before it, since wgmma writes them asynchronously.
template <int R>
__device__ __forceinline__ void fence_accumulators(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

__device__ __forceinline__ void setmaxnreg_dec40() { asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n"); }
__device__ __forceinline__ void setmaxnreg_inc232() { asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n"); }

// Accumulator layout of m64nNk16 (fp32): warp w of the warpgroup holds rows 16w .. 16w+15; in it,
// lane l (g = l / 4, t = l % 4) holds, for each 8-column chunk j, d[4j], d[4j+1] at row g, columns
// 8j + 2t, 8j + 2t + 1, and d[4j+2], d[4j+3] at row g + 8, the same columns.
// D (64 x 128, fp32, 64 registers per thread) += A (64 x 16, smem) * B (16 x 128, smem);
// scale_d == 0 ignores D's old value (the first k-step of a tile).
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                 uint32_t scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D (64 x 256, fp32, 128 registers per thread) += A (64 x 16, smem) * B (16 x 256, smem);
// scale_d == 0 ignores D's old value (the first k-step of a tile).
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                 uint32_t scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// ---- shared by both rungs -----------------------------------------------------------------------
__device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

// Tile t of a tiles_m x tiles_n grid in grouped order: down `group_m` tile rows, then across, so
// tiles that run at the same time share rows of A and columns of B in L2.
__device__ __forceinline__ void tile_coords(int t, int tiles_m, int tiles_n, int group_m, int& tm, int& tn) {
    const int per_group = group_m * tiles_n;
    const int g = t / per_group;
    const int first = g * group_m;
    const int rows = min(tiles_m - first, group_m);
    const int r = t - g * per_group;
    tm = first + r % rows;
    tn = r / rows;
}

// Two adjacent outputs (row, col), (row, col + 1), rounded to bf16, bounds-checked. `vec2`: N even
// and C 4-byte aligned, so the pair is one aligned 32-bit store whenever col + 1 < N.
__device__ __forceinline__ void store_pair(__nv_bfloat16* __restrict__ C, int M, int N, int row, int col,
                                           float v0, float v1, int vec2) {
    if (row >= M) return;
    const size_t off = static_cast<size_t>(row) * N + col;
    if (vec2 && col + 1 < N) {
        *reinterpret_cast<__nv_bfloat162*>(C + off) = __floats2bfloat162_rn(v0, v1);
    } else {
        if (col < N) C[off] = __float2bfloat16_rn(v0);
        if (col + 1 < N) C[off + 1] = __float2bfloat16_rn(v1);
    }
}

// ---------------------------------------------------------------------------------------------
// Rung wgmma_tma: one CTA per 128 x 128 tile, 256 threads = 2 warpgroups (rows 0-63 and 64-127 of
// the tile), 3 stages of (A 128x64 + B 128x64) bf16 = 32 KB. Thread 0 issues the first 3 stages'
// copies, then, each time all 8 warps have released a stage (its empty barrier), the copy of the
// k-tile 3 steps ahead into it. Each warp: wait full[s] -> 4 x wgmma m64n128k16 -> wait for them ->
// arrive on empty[s].
#define T1_BM 128
#define T1_BN 128
#define T1_STAGES 3
#define T1_THREADS 256
#define T1_A_BYTES (T1_BM * WG_ROW_BYTES)                 // 16384
#define T1_B_BYTES (T1_BN * WG_ROW_BYTES)                 // 16384
#define T1_STAGE_BYTES (T1_A_BYTES + T1_B_BYTES)          // 32768
#define T1_SMEM_BYTES (1024 + T1_STAGES * T1_STAGE_BYTES + 2 * T1_STAGES * 8)   // 1024: alignment slack
#define T1_GROUP_M 8

// Split-K: run `split` of `splits` takes the k-tiles [k_lo, k_hi) of KT (a unit of wgmma_tma_ws is
// a tile and a run; wgmma_tma's block y is the run). The launchers keep splits <= KT / 4, so every
// run has k-tiles.
__device__ __forceinline__ void split_range(int split, int splits, int KT, int& k_lo, int& k_hi) {
    k_lo = (int)((long long)split * KT / splits);
    k_hi = (int)((long long)(split + 1) * KT / splits);
}

// Two adjacent fp32 partial sums (row, col), (row, col + 1) of run `split` into the workspace
// (splits x M x N fp32), bounds-checked; `vec2`: N even, so the pair is one aligned 8-byte store.
__device__ __forceinline__ void store_partial_pair(float* __restrict__ W, int M, int N, int split, int row, int col,
                                                   float v0, float v1, int vec2) {
    if (row >= M) return;
    const size_t off = (static_cast<size_t>(split) * M + row) * N + col;
    if (vec2 && col + 1 < N) {
        *reinterpret_cast<float2*>(W + off) = make_float2(v0, v1);
    } else {
        if (col < N) W[off] = v0;
        if (col + 1 < N) W[off + 1] = v1;
    }
}

// Split-K (W != nullptr, gridDim.y = splits > 1): block (x, y) computes tile x over run y of K and
// writes fp32 partial sums to W[y]; matmul_sum_splits adds them. A warpgroup whose 64 rows all lie
// past M issues no wgmma (it still waits for and releases each stage).
extern "C" __global__ void __launch_bounds__(T1_THREADS, 2)
matmul_wgmma_tma(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                 __nv_bfloat16* __restrict__ C, int M, int N, int K, int vec2, float* __restrict__ W) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t full0 = base + T1_STAGES * T1_STAGE_BYTES;   // full[s] at full0 + 8 s
    const uint32_t empty0 = full0 + T1_STAGES * 8;              // empty[s] at empty0 + 8 s

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wg = warp / 4, wl = warp % 4;                     // warpgroup, warp within it
    int tm, tn;
    tile_coords(blockIdx.x, cdiv(M, T1_BM), cdiv(N, T1_BN), T1_GROUP_M, tm, tn);
    int k_lo, k_hi;
    split_range(blockIdx.y, gridDim.y, cdiv(K, WG_BK), k_lo, k_hi);
    const bool idle = tm * T1_BM + wg * 64 >= M;                // none of this warpgroup's rows is in C

    if (tid == 0) {
        for (int s = 0; s < T1_STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1);          // the producer's arrive.expect_tx
            mbar_init(empty0 + 8 * s, 8);         // lane 0 of each of the 8 warps
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (tid == 0) {
        tma_prefetch_map(&tmA);
        tma_prefetch_map(&tmB);
        for (int kt = k_lo; kt < k_lo + T1_STAGES && kt < k_hi; ++kt) {
            const uint32_t sa = base + (kt - k_lo) * T1_STAGE_BYTES, bar = full0 + 8 * (kt - k_lo);
            mbar_arrive_expect_tx(bar, T1_STAGE_BYTES);
            tma_load_2d(sa, &tmA, bar, kt * WG_BK, tm * T1_BM);
            tma_load_2d(sa + T1_A_BYTES, &tmB, bar, kt * WG_BK, tn * T1_BN);
        }
    }
    __syncwarp();

    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;

    int s = 0;
    uint32_t phase = 0;
    for (int kt = k_lo; kt < k_hi; ++kt) {
        const uint32_t sa = base + s * T1_STAGE_BYTES;
        mbar_wait(full0 + 8 * s, phase);
        __syncwarp();
        if (!idle) {
            wgmma_fence();
            const uint64_t da = desc_k_major_sw128(sa + wg * 64 * WG_ROW_BYTES);
            const uint64_t db = desc_k_major_sw128(sa + T1_A_BYTES);
#pragma unroll
            for (int k = 0; k < WG_BK / 16; ++k)
                wgmma_m64n128k16(acc, da + 2 * k, db + 2 * k, ((kt - k_lo) | k) != 0);
            wgmma_commit();
            wgmma_wait<0>();
        }
        if (lane == 0) mbar_arrive(empty0 + 8 * s);
        if (tid == 0 && kt + T1_STAGES < k_hi) {
            // Refill this stage with k-tile kt + STAGES once every warp has released it.
            const uint32_t bar = full0 + 8 * s;
            mbar_wait(empty0 + 8 * s, phase);
            mbar_arrive_expect_tx(bar, T1_STAGE_BYTES);
            tma_load_2d(sa, &tmA, bar, (kt + T1_STAGES) * WG_BK, tm * T1_BM);
            tma_load_2d(sa + T1_A_BYTES, &tmB, bar, (kt + T1_STAGES) * WG_BK, tn * T1_BN);
        }
        __syncwarp();
        if (++s == T1_STAGES) { s = 0; phase ^= 1; }
    }
    if (idle) return;
    fence_accumulators(acc);

    const int row = tm * T1_BM + wg * 64 + wl * 16 + lane / 4;
    const int col = tn * T1_BN + 2 * (lane % 4);
    if (W == nullptr) {
#pragma unroll
        for (int j = 0; j < T1_BN / 8; ++j) {
            store_pair(C, M, N, row, col + 8 * j, acc[4 * j], acc[4 * j + 1], vec2);
            store_pair(C, M, N, row + 8, col + 8 * j, acc[4 * j + 2], acc[4 * j + 3], vec2);
        }
    } else {
        const int even = (N % 2) == 0;
#pragma unroll
        for (int j = 0; j < T1_BN / 8; ++j) {
            store_partial_pair(W, M, N, blockIdx.y, row, col + 8 * j, acc[4 * j], acc[4 * j + 1], even);
            store_partial_pair(W, M, N, blockIdx.y, row + 8, col + 8 * j, acc[4 * j + 2], acc[4 * j + 3], even);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Rung wgmma_tma_ws: warp-specialized, persistent. 384 threads: warpgroup 0 = producer (one thread
// issues all TMA copies), warpgroups 1 and 2 = consumers, rows 0-63 and 64-127 of a 128 x 256 tile,
// m64n256k16 (128 fp32 accumulators per thread). 4 stages x (A 128x64 + B 256x64) bf16 = 48 KB.
// Producer and consumers walk the same tile sequence (t = blockIdx.x, += gridDim.x) and the same
// ring of stages; the ring position (stage, phase) carries over from one tile to the next, so the
// producer fills the next tile's stages while the consumers store the last one.
// Barrier protocol, for the i-th use of stage s (round r = i / STAGES):
//   producer: wait empty[s] for parity (r & 1) ^ 1 (round 0 passes at once), arrive.expect_tx on
//             full[s] with 48 KB, issue the two copies onto full[s];
//   consumer: wait full[s] for parity r & 1, issue 4 wgmma, commit; after the *next* stage's batch
//             is committed, wgmma.wait_group 1 says this one is done: lane 0 of each warp arrives on
//             empty[s] (count 8 = 2 warpgroups x 4 warps). The last stage of a tile is released
//             after wait_group 0, before the epilogue.
#define WS_BM 128
#define WS_BN 256
#define WS_STAGES 4
#define WS_THREADS 384
#define WS_A_BYTES (WS_BM * WG_ROW_BYTES)                 // 16384
#define WS_B_BYTES (WS_BN * WG_ROW_BYTES)                 // 32768
#define WS_STAGE_BYTES (WS_A_BYTES + WS_B_BYTES)          // 49152
#define WS_SMEM_BYTES (1024 + WS_STAGES * WS_STAGE_BYTES + 2 * WS_STAGES * 8)   // 197696
#define WS_GROUP_M 16

// The pieces wgmma_tma_ws and wgmma_tma_ws_tma_store share: the barrier set-up, the producer and
// the consumers' mainloop for one tile. Only their epilogues differ.
__device__ __forceinline__ void ws_init_barriers(uint32_t full0, uint32_t empty0) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < WS_STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1);          // the producer's arrive.expect_tx
            mbar_init(empty0 + 8 * s, 8);         // lane 0 of each of the 8 consumer warps
        }
        fence_barrier_init();
    }
    __syncthreads();                              // the barriers exist before anyone waits on them
}

// Producer (one thread): for every unit (tile, run of K) this CTA owns, its k-tiles of A and B
// into the ring.
__device__ __forceinline__ void ws_produce(const CUtensorMap* tmA, const CUtensorMap* tmB, uint32_t base,
                                           uint32_t full0, uint32_t empty0, int tiles_m, int tiles_n,
                                           int num_tiles, int KT, int splits = 1) {
    tma_prefetch_map(tmA);
    tma_prefetch_map(tmB);
    int s = 0;
    uint32_t phase = 0;
    for (int u = blockIdx.x; u < num_tiles * splits; u += gridDim.x) {
        int tm, tn, k_lo, k_hi;
        tile_coords(u / splits, tiles_m, tiles_n, WS_GROUP_M, tm, tn);
        split_range(u % splits, splits, KT, k_lo, k_hi);
        for (int kt = k_lo; kt < k_hi; ++kt) {
            const uint32_t sa = base + s * WS_STAGE_BYTES, bar = full0 + 8 * s;
            mbar_wait(empty0 + 8 * s, phase ^ 1);          // consumers released this stage
            mbar_arrive_expect_tx(bar, WS_STAGE_BYTES);
            tma_load_2d(sa, tmA, bar, kt * WG_BK, tm * WS_BM);
            tma_load_2d(sa + WS_A_BYTES, tmB, bar, kt * WG_BK, tn * WS_BN);
            if (++s == WS_STAGES) { s = 0; phase ^= 1; }
        }
    }
}

// Arrive on the mbarrier at the same shared-memory offset in CTA `rank` of the cluster.
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
    asm volatile(
        "{\n.reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n"
        :: "r"(bar), "r"(rank) : "memory");
}

// Consumer warpgroup cw, one tile: k-tiles [k_lo, k_hi) into acc, one wgmma batch kept in flight,
// each stage released as soon as the batch reading it is done. (s, phase) carry the ring position
// across tiles. `idle`: this warpgroup's 64 rows all lie past M (a tile of a short product): it
// only waits for each stage and releases it, issuing no wgmma (acc is left as it was).
// With PEER (the cluster kernel), a stage is also released in CTA `peer`, whose producer multicast
// into it.
template <bool PEER = false>
__device__ __forceinline__ void ws_consume_tile(float (&acc)[128], uint32_t base, uint32_t full0, uint32_t empty0,
                                                int cw, int lane, int k_lo, int k_hi, int& s, uint32_t& phase,
                                                uint32_t peer = 0, bool idle = false) {
    if (idle) {
        for (int kt = k_lo; kt < k_hi; ++kt) {
            mbar_wait(full0 + 8 * s, phase);
            __syncwarp();
            if (lane == 0) {
                mbar_arrive(empty0 + 8 * s);
                if constexpr (PEER) mbar_arrive_cluster(empty0 + 8 * s, peer);
            }
            if (++s == WS_STAGES) { s = 0; phase ^= 1; }
        }
        return;
    }
    int prev = 0;
    for (int kt = k_lo; kt < k_hi; ++kt) {
        const uint32_t sa = base + s * WS_STAGE_BYTES;
        mbar_wait(full0 + 8 * s, phase);          // TMA has landed this stage
        __syncwarp();
        wgmma_fence();
        const uint64_t da = desc_k_major_sw128(sa + cw * 64 * WG_ROW_BYTES);
        const uint64_t db = desc_k_major_sw128(sa + WS_A_BYTES);
#pragma unroll
        for (int k = 0; k < WG_BK / 16; ++k)
            wgmma_m64n256k16(acc, da + 2 * k, db + 2 * k, ((kt - k_lo) | k) != 0);
        wgmma_commit();
        if (kt > k_lo) {
            wgmma_wait<1>();                      // the previous stage's batch is done
            if (lane == 0) {
                mbar_arrive(empty0 + 8 * prev);
                if constexpr (PEER) mbar_arrive_cluster(empty0 + 8 * prev, peer);
            }
        }
        prev = s;
        if (++s == WS_STAGES) { s = 0; phase ^= 1; }
    }
    wgmma_wait<0>();
    if (lane == 0) {
        mbar_arrive(empty0 + 8 * prev);
        if constexpr (PEER) mbar_arrive_cluster(empty0 + 8 * prev, peer);
    }
    fence_accumulators(acc);
}

extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
matmul_wgmma_tma_ws(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                    __nv_bfloat16* __restrict__ C, int M, int N, int K, int vec2, float* __restrict__ W,
                    int splits) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t full0 = base + WS_STAGES * WS_STAGE_BYTES;
    const uint32_t empty0 = full0 + WS_STAGES * 8;

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wg = warp / 4, wl = warp % 4;
    const int tiles_m = cdiv(M, WS_BM), tiles_n = cdiv(N, WS_BN);
    const int num_tiles = tiles_m * tiles_n;
    const int KT = cdiv(K, WG_BK);
    ws_init_barriers(full0, empty0);

    if (wg == 0) {
        // Producer warpgroup: give registers back, one thread issues every copy.
        setmaxnreg_dec40();
        if (tid == 0) ws_produce(&tmA, &tmB, base, full0, empty0, tiles_m, tiles_n, num_tiles, KT, splits);
    } else {
        setmaxnreg_inc232();
        const int cw = wg - 1;                    // consumer 0 or 1: rows 64 cw .. 64 cw + 63 of the tile
        float acc[128];
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = 0.f;
        int s = 0;
        uint32_t phase = 0;
        for (int u = blockIdx.x; u < num_tiles * splits; u += gridDim.x) {
            int tm, tn, k_lo, k_hi;
            tile_coords(u / splits, tiles_m, tiles_n, WS_GROUP_M, tm, tn);
            const int split = u % splits;
            split_range(split, splits, KT, k_lo, k_hi);
            const bool idle = tm * WS_BM + cw * 64 >= M;      // none of this warpgroup's rows is in C
            ws_consume_tile(acc, base, full0, empty0, cw, lane, k_lo, k_hi, s, phase, 0, idle);
            if (idle) continue;

            const int row = tm * WS_BM + cw * 64 + wl * 16 + lane / 4;
            const int col = tn * WS_BN + 2 * (lane % 4);
            if (splits == 1) {
#pragma unroll
                for (int j = 0; j < WS_BN / 8; ++j) {
                    store_pair(C, M, N, row, col + 8 * j, acc[4 * j], acc[4 * j + 1], vec2);
                    store_pair(C, M, N, row + 8, col + 8 * j, acc[4 * j + 2], acc[4 * j + 3], vec2);
                }
            } else {
                const int even = (N % 2) == 0;
#pragma unroll
                for (int j = 0; j < WS_BN / 8; ++j) {
                    store_partial_pair(W, M, N, split, row, col + 8 * j, acc[4 * j], acc[4 * j + 1], even);
                    store_partial_pair(W, M, N, split, row + 8, col + 8 * j, acc[4 * j + 2], acc[4 * j + 3], even);
                }
            }
        }
    }
}

// Split-K's second kernel: C = sum over runs s = 0, 1, ... of W[s] (fp32), in that order (the same
// bits every run, unlike atomics), rounded once to bf16. One thread per element, grid-stride.
extern "C" __global__ void __launch_bounds__(256)
matmul_sum_splits(const float* __restrict__ W, __nv_bfloat16* __restrict__ C, int M, int N, int splits) {
    const size_t total = static_cast<size_t>(M) * N;
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        float sum = 0.f;
        for (int s = 0; s < splits; ++s) sum += W[s * total + i];
        C[i] = __float2bfloat16_rn(sum);
    }
}

// ---------------------------------------------------------------------------------------------
// Experimental, not a rung yet (launcher launch_matmul_wgmma_tma_ws_cluster): wgmma_tma_ws with
// clusters of 2 CTAs along M and TMA multicast of B. The two CTAs of a cluster compute vertically
// adjacent 128 x 256 tiles (rows 256 i + 128 rank, the same 256 columns), so they need the same B
// tile: each CTA loads its own A tile and one half (128 rows of N) of B, multicast into both CTAs'
// shared memory at the same offset. That cuts the L2 -> SM traffic per CTA from 48 KB to 32 KB per
// k-tile. Protocol changes against wgmma_tma_ws:
//   - full[s] of each CTA expects A (16 KB) + both halves of B (16 KB each, one from each CTA);
//     the peer's complete_tx may come before this CTA's arrive.expect_tx (the tx-count is signed
//     and the phase cannot complete before the producer's arrival).
//   - empty[s] counts 16 arrivals: a stage may be refilled only when the consumers of *both* CTAs
//     are done with it (a multicast writes both); lane 0 of each consumer warp arrives on its own
//     CTA's and on the peer's empty[s] (mapa + mbarrier.arrive.shared::cluster).
//   - a cluster barrier after the mbarrier init (the peer must not signal an uninitialized barrier),
//     and the producer thread, before exiting, waits for the last release of every stage, so no
//     peer arrives on this CTA's barriers after it has exited.
//   - a tile (or B half) wholly outside C is not loaded and not expected (its rows are not stored).
#define CL_B_HALF_BYTES (WS_B_BYTES / 2)                  // 16384: 128 rows of B

__device__ __forceinline__ uint32_t cluster_ctarank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ uint32_t cluster_id_x() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ uint32_t cluster_count_x() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%nclusterid.x;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_sync_all() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}


__device__ __forceinline__ uint32_t mbar_try_wait_cluster(uint32_t bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done;
}

__device__ __forceinline__ void mbar_wait_cluster(uint32_t bar, uint32_t parity) {
    if (mbar_try_wait_cluster(bar, parity)) return;
    const uint64_t t0 = globaltimer_ns();
    for (uint32_t n = 1;; ++n) {
        if (mbar_try_wait_cluster(bar, parity)) return;
        if ((n & 1023u) == 0 && globaltimer_ns() - t0 > WG_WAIT_TIMEOUT_NS) __trap();
    }
}

// The box at (c0, c1) into `dst` of every CTA in `mask`, signalling each one's barrier at `bar`.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0,
                                                      int c1, uint16_t mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%3, %4}], [%2], %5;\n"
        :: "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "h"(mask) : "memory");
}

extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
matmul_wgmma_tma_ws_cluster(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                            __nv_bfloat16* __restrict__ C, int M, int N, int K, int vec2) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t full0 = base + WS_STAGES * WS_STAGE_BYTES;
    const uint32_t empty0 = full0 + WS_STAGES * 8;

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wg = warp / 4, wl = warp % 4;
    const uint32_t rank = cluster_ctarank();                  // 0 or 1: which 128-row half of the pair
    const int cluster = cluster_id_x(), clusters = cluster_count_x();
    const int tiles_m = cdiv(M, WS_BM), tiles_n = cdiv(N, WS_BN);
    const int pairs_m = cdiv(tiles_m, 2);
    const int num_pairs = pairs_m * tiles_n;                  // 256 x 256 regions, one per cluster step
    const int KT = cdiv(K, WG_BK);

    if (tid == 0) {
        for (int s = 0; s < WS_STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, 16);                    // 8 consumer warps x 2 CTAs
        }
        fence_barrier_init();
    }
    cluster_sync_all();                                       // both CTAs' barriers exist before any signal

    if (wg == 0) {
        setmaxnreg_dec40();
        if (tid == 0) {
            tma_prefetch_map(&tmA);
            tma_prefetch_map(&tmB);
            int s = 0;
            uint32_t phase = 0;
            for (int t = cluster; t < num_pairs; t += clusters) {
                int tm2, tn;
                tile_coords(t, pairs_m, tiles_n, WS_GROUP_M / 2, tm2, tn);
                const int tm = 2 * tm2 + (int)rank;
                const bool a_in = tm * WS_BM < M;                     // this CTA's tile has rows in C
                const bool b1_in = tn * WS_BN + WS_BN / 2 < N;         // the second B half has columns in C
                const uint32_t bytes = (a_in ? WS_A_BYTES : 0) + CL_B_HALF_BYTES + (b1_in ? CL_B_HALF_BYTES : 0);
                const bool b_mine = rank == 0 || b1_in;
                for (int kt = 0; kt < KT; ++kt) {
                    const uint32_t sa = base + s * WS_STAGE_BYTES, bar = full0 + 8 * s;
                    mbar_wait_cluster(empty0 + 8 * s, phase ^ 1);
                    mbar_arrive_expect_tx(bar, bytes);
                    if (a_in) tma_load_2d(sa, &tmA, bar, kt * WG_BK, tm * WS_BM);
                    if (b_mine)
                        tma_load_2d_multicast(sa + WS_A_BYTES + rank * CL_B_HALF_BYTES, &tmB, bar, kt * WG_BK,
                                              tn * WS_BN + (int)rank * (WS_BN / 2), (uint16_t)0x3);
                    if (++s == WS_STAGES) { s = 0; phase ^= 1; }
                }
            }
            // Tail: wait until every stage's last use has been released by both CTAs, so no arrive
            // from the peer can reach this CTA's barriers after it exits.
            for (int i = 0; i < WS_STAGES; ++i) {
                mbar_wait_cluster(empty0 + 8 * s, phase ^ 1);
                if (++s == WS_STAGES) { s = 0; phase ^= 1; }
            }
        }
    } else {
        setmaxnreg_inc232();
        const int cw = wg - 1;
        const uint32_t peer = rank ^ 1u;
        float acc[128];
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = 0.f;
        int s = 0;
        uint32_t phase = 0;
        for (int t = cluster; t < num_pairs; t += clusters) {
            int tm2, tn;
            tile_coords(t, pairs_m, tiles_n, WS_GROUP_M / 2, tm2, tn);
            const int tm = 2 * tm2 + (int)rank;
            ws_consume_tile<true>(acc, base, full0, empty0, cw, lane, 0, KT, s, phase, peer);

            const int row = tm * WS_BM + cw * 64 + wl * 16 + lane / 4;
            const int col = tn * WS_BN + 2 * (lane % 4);
#pragma unroll
            for (int j = 0; j < WS_BN / 8; ++j) {
                store_pair(C, M, N, row, col + 8 * j, acc[4 * j], acc[4 * j + 1], vec2);
                store_pair(C, M, N, row + 8, col + 8 * j, acc[4 * j + 2], acc[4 * j + 3], vec2);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Rung wgmma_tma_ws_tma_store (launcher launch_matmul_wgmma_tma_ws_tma_store): wgmma_tma_ws with the
// epilogue staged through shared memory and written by TMA stores. Mainloop, producer, ring and
// its barrier protocol are wgmma_tma_ws's, unchanged. What differs is the epilogue:
//   wgmma_tma_ws stores each thread's accumulators straight from registers, 4 bytes at a time
//   (a warp's store touches 8 rows x 16 bytes: 8 half-used sectors), 64 KB per tile, while the
//   tensor cores idle. Here each consumer warp owns a private 4 KB of shared memory (8 warps x 4 KB
//   = 32 KB after the 4 x 48 KB ring: 230464 bytes of the 232448 a block may have) = two 2 KB
//   buffers, each one TMA box of 16 rows x 64 columns of C (the warp's 16 rows of the tile). The
//   warp's 16 x 256 slice goes out in 4 rounds of 64 columns, alternating buffers:
//     lane 0: cp.async.bulk.wait_group.read 1  -> the store issued two rounds ago (same buffer) has
//             finished reading it (at most the latest one may still be pending); bulk async-groups
//             are per thread, and lane 0 issues all of the warp's stores
//     __syncwarp                               -> the other lanes write only after that wait
//     all:    cvt to bf16, st.shared.b32 into the buffer in the 128-byte-swizzled layout the C
//             tensor map declares (16-byte chunk c of row r at chunk c ^ (r % 8)): for one store
//             instruction the 32 lanes hit 8 rows x 4 words = 32 distinct banks, no conflicts
//     all:    fence.proxy.async.shared::cta    -> the generic-proxy writes are visible to the
//             async proxy (the TMA engine) that reads the buffer
//     __syncwarp                               -> every lane's writes and fence precede lane 0's issue
//     lane 0: cp.async.bulk.tensor store of the box at (col, row), commit_group
//   The stores run asynchronously: the warp goes on to the next tile's wgmma while TMA writes C.
//   TMA clips the box to C's bounds (rows >= M, columns >= N are not written), so the epilogue has
//   no bounds checks; boxes wholly outside C are not issued. Before exiting, lane 0 waits for all
//   of its stores to complete (cp.async.bulk.wait_group 0), so the buffers outlive their reads.
// The C tensor map needs a row pitch N * 2 that is a multiple of 16 bytes and C 16-byte aligned;
// the launcher runs wgmma_tma_ws (register epilogue) otherwise.
#define TRY_EPI_BOX_COLS 64                                         // 128 bytes: one swizzle row
#define TRY_EPI_BOX_ROWS 16                                         // one warp's rows of the tile
#define TRY_EPI_BUF_BYTES (TRY_EPI_BOX_COLS * 2 * TRY_EPI_BOX_ROWS) // 2048
#define TRY_EPI_WARP_BYTES (2 * TRY_EPI_BUF_BYTES)                  // 4096: double-buffered
#define TRY_EPI_BYTES (8 * TRY_EPI_WARP_BYTES)                      // 32768: 8 consumer warps
#define TMA_STORE_SMEM_BYTES (1024 + WS_STAGES * WS_STAGE_BYTES + TRY_EPI_BYTES + 2 * WS_STAGES * 8)   // 230464

// C (global, through the tensor map) <- the box at (c0 = column, c1 = row) from shared memory.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, uint32_t src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n"
                 :: "l"(reinterpret_cast<uint64_t>(map)), "r"(src), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Wait until at most N of this thread's bulk groups are still reading their shared-memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory"); }
// Wait until all of this thread's bulk groups have completed (their writes to global done).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);   // .x = lo (lower address), .y = hi
    return *reinterpret_cast<uint32_t*>(&p);
}

extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
matmul_wgmma_tma_ws_tma_store(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                        const __grid_constant__ CUtensorMap tmC, int M, int N, int K) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t epi0 = base + WS_STAGES * WS_STAGE_BYTES;           // 1024-aligned: swizzle phase = row
    const uint32_t full0 = epi0 + TRY_EPI_BYTES;
    const uint32_t empty0 = full0 + WS_STAGES * 8;

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wg = warp / 4, wl = warp % 4;
    const int tiles_m = cdiv(M, WS_BM), tiles_n = cdiv(N, WS_BN);
    const int num_tiles = tiles_m * tiles_n;
    const int KT = cdiv(K, WG_BK);
    ws_init_barriers(full0, empty0);

    if (wg == 0) {
        // Producer warpgroup: exactly wgmma_tma_ws's.
        setmaxnreg_dec40();
        if (tid == 0) ws_produce(&tmA, &tmB, base, full0, empty0, tiles_m, tiles_n, num_tiles, KT);
    } else {
        setmaxnreg_inc232();
        const int cw = wg - 1;                    // consumer 0 or 1: rows 64 cw .. 64 cw + 63 of the tile
        const uint32_t ebuf = epi0 + (cw * 4 + wl) * TRY_EPI_WARP_BYTES;   // this warp's two buffers
        if (lane == 0) tma_prefetch_map(&tmC);
        float acc[128];
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = 0.f;
        int s = 0;
        uint32_t phase = 0;
        for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
            int tm, tn;
            tile_coords(t, tiles_m, tiles_n, WS_GROUP_M, tm, tn);
            ws_consume_tile(acc, base, full0, empty0, cw, lane, 0, KT, s, phase);

            // Epilogue through shared memory (see above). Thread (g = lane / 4, q = lane % 4) holds,
            // for 8-column chunk j, columns 8j + 2q, 8j + 2q + 1 of warp rows g (acc[4j], acc[4j+1])
            // and g + 8 (acc[4j+2], acc[4j+3]); in the swizzled box, row r's chunk jj is at byte
            // r * 128 + ((jj ^ (r % 8)) * 16), and (g + 8) % 8 == g.
            const int g = lane / 4, q = lane % 4;
            const int row0 = tm * WS_BM + cw * 64 + wl * 16;          // the warp's first row of C
            const bool rows_in = row0 < M;
#pragma unroll
            for (int c = 0; c < WS_BN / TRY_EPI_BOX_COLS; ++c) {
                const uint32_t buf = ebuf + (c & 1) * TRY_EPI_BUF_BYTES;
                if (lane == 0) bulk_wait_read<1>();                   // buf's previous store has read it
                __syncwarp();
#pragma unroll
                for (int jj = 0; jj < 8; ++jj) {
                    const int j = 8 * c + jj;
                    const uint32_t off = ((jj ^ g) << 4) + 4 * q;
                    st_shared_b32(buf + g * 128 + off, pack_bf16x2(acc[4 * j], acc[4 * j + 1]));
                    st_shared_b32(buf + (g + 8) * 128 + off, pack_bf16x2(acc[4 * j + 2], acc[4 * j + 3]));
                }
                fence_proxy_async_smem();                             // generic writes -> async proxy
                __syncwarp();                                         // all lanes' writes before the issue
                const int col0 = tn * WS_BN + c * TRY_EPI_BOX_COLS;
                if (lane == 0) {
                    if (rows_in && col0 < N) tma_store_2d(&tmC, buf, col0, row0);
                    bulk_commit();                                    // an empty group is fine
                }
            }
        }
        if (lane == 0) bulk_wait_all();           // the last stores are done before the CTA exits
    }
}

// ---------------------------------------------------------------------------------------------
// Host side.
// cuTensorMapEncodeTiled is a driver API function; it is reached through the runtime's entry-point
// query, so the library does not link libcuda. Looked up once.
static PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = []() -> PFN_cuTensorMapEncodeTiled_v12000 {
        void* p = nullptr;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess
            || q != cudaDriverEntryPointSuccess)
            return nullptr;
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    }();
    return fn;
}

// A rows x K bf16 row-major matrix (K contiguous) as a 2-D tensor map: dimension 0 = K (the
// contiguous one), dimension 1 = rows, row pitch K * 2 bytes; boxes of 64 (K) x box_rows, 128-byte
// swizzle, out-of-range elements read as zero.
static cudaError_t make_map(CUtensorMap* map, const void* ptr, int rows, int K, int box_rows, int pitch) {
    PFN_cuTensorMapEncodeTiled_v12000 encode = encode_tiled();
    if (encode == nullptr) return cudaErrorNotSupported;
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(rows)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(pitch) * sizeof(__nv_bfloat16)};
    const cuuint32_t box[2] = {WG_BK, static_cast<cuuint32_t>(box_rows)};
    const cuuint32_t elem_strides[2] = {1, 1};
    CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(ptr), dims, strides, box,
                        elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

#define WG_MAX_DEVICES 64

// Raise a kernel's dynamic shared-memory limit, once per device, and ask for the largest shared
// memory carve-out of the L1/shared array (wgmma_tma wants two 97 KB CTAs per SM).
static cudaError_t allow_smem(const void* kernel, int bytes, bool (&done)[WG_MAX_DEVICES], int dev) {
    if (dev >= 0 && dev < WG_MAX_DEVICES && done[dev]) return cudaSuccess;
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    if (e == cudaSuccess && dev >= 0 && dev < WG_MAX_DEVICES) done[dev] = true;
    return e;
}

// The checks and tensor maps both launchers share; *skip is set when there is nothing to launch.
static cudaError_t prepare(const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C, int M, int N, int K,
                           int a_box, int b_box, CUtensorMap* mA, CUtensorMap* mB, int* vec2, bool* skip,
                           cudaStream_t stream, int pitch = 0) {
    *skip = true;
    if (M < 0 || N < 0 || K < 0 || K % 8 != 0) return cudaErrorInvalidValue;
    if (M == 0 || N == 0) return cudaSuccess;
    if (K == 0) return cudaMemsetAsync(C, 0, static_cast<size_t>(M) * N * sizeof(__nv_bfloat16), stream);
    if (reinterpret_cast<uintptr_t>(A) % 16 != 0 || reinterpret_cast<uintptr_t>(B) % 16 != 0)
        return cudaErrorInvalidValue;
    if (pitch == 0) pitch = K;                    // elements from one row to the next (A's and B's)
    cudaError_t e = make_map(mA, A, M, K, a_box, pitch);
    if (e != cudaSuccess) return e;
    e = make_map(mB, B, N, K, b_box, pitch);
    if (e != cudaSuccess) return e;
    *vec2 = (N % 2 == 0) && (reinterpret_cast<uintptr_t>(C) % 4 == 0);
    *skip = false;
    return cudaSuccess;
}

// The split of K, a rule of the shape, the tile and the number of CTAs the GPU holds at once
// (`slots`), no table of sizes: 1 when the tiles fill every slot; otherwise enough runs of K that
// tiles x runs covers the slots once, at most 16, each run at least 4 k-tiles (64 wide), and the
// fp32 partial sums (written, then read back: 8 bytes per element of C per run) within a quarter
// of the bytes of A and B, so a split never moves more than it hides. Tall-skinny products
// (M <= 64: one tile row, few tiles) split; large ones never do. Exported per rung so the Python
// side (rungs.split_k) and the tests read the same rule.
static int split_k_rule(int M, int N, int K, int slots, int bm, int bn) {
    if (M <= 0 || N <= 0 || K <= 0 || slots <= 0) return 1;
    const long long tiles = (long long)((M + bm - 1) / bm) * ((N + bn - 1) / bn);
    if (tiles >= slots) return 1;
    const long long KT = (K + WG_BK - 1) / WG_BK;
    long long split = (slots + tiles - 1) / tiles;
    split = split < 16 ? split : 16;
    split = split < KT / 4 ? split : KT / 4;
    const long long by_traffic = ((long long)M * K + (long long)K * N) * 2 / (32LL * M * N);
    split = split < by_traffic ? split : by_traffic;
    return split > 1 ? (int)split : 1;
}
// wgmma_tma_ws: one persistent CTA per SM, 128 x 256 tiles.
extern "C" int lab_wgmma_ws_split_k(int M, int N, int K, int sms) { return split_k_rule(M, N, K, sms, WS_BM, WS_BN); }
// wgmma_tma: two CTAs per SM, 128 x 128 tiles.
extern "C" int lab_wgmma_tma_split_k(int M, int N, int K, int sms) {
    return split_k_rule(M, N, K, 2 * sms, T1_BM, T1_BN);
}

static cudaError_t sm_count_of(int dev, int* sms) {
    static int cache[WG_MAX_DEVICES] = {};
    *sms = (dev >= 0 && dev < WG_MAX_DEVICES) ? cache[dev] : 0;
    if (*sms > 0) return cudaSuccess;
    cudaError_t e = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev);
    if (e == cudaSuccess && dev >= 0 && dev < WG_MAX_DEVICES) cache[dev] = *sms;
    return e;
}

// Split-K's workspace comes from the device's default memory pool (cudaMallocAsync / cudaFreeAsync
// on the launch stream: no device-wide sync). Once per device the pool is told to keep what it has
// (release threshold: unlimited), so later calls reuse the memory instead of mapping it again.
// torch does not allocate from this pool (it has its own caching allocator).
static cudaError_t keep_pool_memory(int dev) {
    static bool done[WG_MAX_DEVICES] = {};
    if (dev >= 0 && dev < WG_MAX_DEVICES && done[dev]) return cudaSuccess;
    cudaMemPool_t pool;
    cudaError_t e = cudaDeviceGetDefaultMemPool(&pool, dev);
    if (e != cudaSuccess) return e;
    uint64_t keep_all = ~0ull;
    e = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all);
    if (e == cudaSuccess && dev >= 0 && dev < WG_MAX_DEVICES) done[dev] = true;
    return e;
}

static cudaError_t launch_sum_splits(const float* W, __nv_bfloat16* C, int M, int N, int splits, int sms,
                                     cudaStream_t stream) {
    const long long blocks = ((long long)M * N + 255) / 256;
    const unsigned grid = (unsigned)(blocks < 8LL * sms ? blocks : 8LL * sms);
    matmul_sum_splits<<<grid, 256, 0, stream>>>(W, C, M, N, splits);
    return cudaGetLastError();
}

// One persistent CTA per SM (fewer when there are fewer units of work). With a split of K, the
// partial sums go to a stream-ordered workspace that matmul_sum_splits reduces into C, then it
// is freed on the same stream.
// `runs_summed_short` (only for the checker's own test, launch_matmul_wgmma_tma_ws_drop_last_run):
// how many runs of K the sum leaves out.
static int launch_ws(const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C, int M, int N, int K,
                     cudaStream_t stream, int runs_summed_short, int pitch = 0) {
    CUtensorMap mA, mB;
    int vec2 = 0;
    bool skip = true;
    cudaError_t e = prepare(A, B, C, M, N, K, WS_BM, WS_BN, &mA, &mB, &vec2, &skip, stream, pitch);
    if (e != cudaSuccess || skip) return (int)e;
    int dev = 0;
    if ((e = cudaGetDevice(&dev)) != cudaSuccess) return (int)e;
    static bool smem_done[WG_MAX_DEVICES] = {};
    if ((e = allow_smem((const void*)matmul_wgmma_tma_ws, WS_SMEM_BYTES, smem_done, dev)) != cudaSuccess) return (int)e;
    int sms = 0;
    if ((e = sm_count_of(dev, &sms)) != cudaSuccess) return (int)e;
    const long long tiles = (long long)((M + WS_BM - 1) / WS_BM) * ((N + WS_BN - 1) / WS_BN);
    if (tiles > 0x7FFFFFFFLL / 16) return (int)cudaErrorInvalidValue;
    const int splits = lab_wgmma_ws_split_k(M, N, K, sms);
    float* W = nullptr;
    if (splits > 1 && (e = keep_pool_memory(dev)) != cudaSuccess) return (int)e;
    if (splits > 1 && (e = cudaMallocAsync(reinterpret_cast<void**>(&W),
                                           static_cast<size_t>(splits) * M * N * sizeof(float), stream)) != cudaSuccess)
        return (int)e;
    const long long units = tiles * splits;
    const unsigned grid = (unsigned)(units < sms ? units : sms);
    matmul_wgmma_tma_ws<<<grid, WS_THREADS, WS_SMEM_BYTES, stream>>>(mA, mB, C, M, N, K, vec2, W, splits);
    e = cudaGetLastError();
    if (splits > 1) {
        if (e == cudaSuccess) e = launch_sum_splits(W, C, M, N, splits - runs_summed_short, sms, stream);
        cudaError_t f = cudaFreeAsync(W, stream);
        if (e == cudaSuccess) e = f;
    }
    return (int)e;
}

extern "C" int launch_matmul_wgmma_tma_ws(const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C,
                                          int M, int N, int K, cudaStream_t stream) {
    return launch_ws(A, B, C, M, N, K, stream, 0);
}

// Deliberately wrong, for the tests only (rung broken_wgmma_drop_last_run): the split-K sum leaves
// out the last run of K, so a checker that passes it is not checking split shapes.
extern "C" int launch_matmul_wgmma_tma_ws_drop_last_run(const __nv_bfloat16* A, const __nv_bfloat16* B,
                                                        __nv_bfloat16* C, int M, int N, int K, cudaStream_t stream) {
    return launch_ws(A, B, C, M, N, K, stream, 1);
}

// One CTA per 128 x 128 tile (two per SM), times the runs of K when the rule splits it: grid
// (tiles, splits), the partial sums reduced by matmul_sum_splits as for wgmma_tma_ws.
extern "C" int launch_matmul_wgmma_tma(const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C,
                                       int M, int N, int K, cudaStream_t stream) {
    CUtensorMap mA, mB;
    int vec2 = 0;
    bool skip = true;
    cudaError_t e = prepare(A, B, C, M, N, K, T1_BM, T1_BN, &mA, &mB, &vec2, &skip, stream);
    if (e != cudaSuccess || skip) return (int)e;
    int dev = 0;
    if ((e = cudaGetDevice(&dev)) != cudaSuccess) return (int)e;
    static bool smem_done[WG_MAX_DEVICES] = {};
    if ((e = allow_smem((const void*)matmul_wgmma_tma, T1_SMEM_BYTES, smem_done, dev)) != cudaSuccess) return (int)e;
    const long long tiles = (long long)((M + T1_BM - 1) / T1_BM) * ((N + T1_BN - 1) / T1_BN);
    if (tiles > 0x7FFFFFFFLL) return (int)cudaErrorInvalidValue;
    int sms = 0;
    if ((e = sm_count_of(dev, &sms)) != cudaSuccess) return (int)e;
    const int splits = lab_wgmma_tma_split_k(M, N, K, sms);
    float* W = nullptr;
    if (splits > 1 && (e = keep_pool_memory(dev)) != cudaSuccess) return (int)e;
    if (splits > 1 && (e = cudaMallocAsync(reinterpret_cast<void**>(&W),
                                           static_cast<size_t>(splits) * M * N * sizeof(float), stream)) != cudaSuccess)
        return (int)e;
    matmul_wgmma_tma<<<dim3((unsigned)tiles, (unsigned)splits), T1_THREADS, T1_SMEM_BYTES, stream>>>(mA, mB, C, M, N,
                                                                                                     K, vec2, W);
    e = cudaGetLastError();
    if (splits > 1) {
        if (e == cudaSuccess) e = launch_sum_splits(W, C, M, N, splits, sms, stream);
        cudaError_t f = cudaFreeAsync(W, stream);
        if (e == cudaSuccess) e = f;
    }
    return (int)e;
}

// Experimental side branch (rung wgmma_tma_ws_pitch128, compared with wgmma_tma_ws): a question
// for the GPU, not a known win. With K % 64 != 0 every row of A and B starts off a 128-byte
// boundary, so each 128-byte TMA box row spans two L2 lines. This copies A and B (pool memory,
// cudaMemcpy2DAsync) into rows of Kp = K rounded up to 64 elements, then runs wgmma_tma_ws on the
// copies through tensor maps of K columns and pitch Kp (TMA still zero-fills past K): two extra
// passes over A and B, (M + N) K x 2 bytes read and written, bought back only if unaligned rows
// cost the main loop more. With K % 64 == 0 it is wgmma_tma_ws.
extern "C" int launch_matmul_wgmma_tma_ws_pitch128(const __nv_bfloat16* A, const __nv_bfloat16* B,
                                                   __nv_bfloat16* C, int M, int N, int K, cudaStream_t stream) {
    if (K % 64 == 0 || K % 8 != 0 || M <= 0 || N <= 0 || K <= 0) return launch_ws(A, B, C, M, N, K, stream, 0);
    const int Kp = (K + 63) / 64 * 64;
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = keep_pool_memory(dev);
    if (e != cudaSuccess) return (int)e;
    const size_t row_bytes = static_cast<size_t>(K) * sizeof(__nv_bfloat16), pitch_bytes = static_cast<size_t>(Kp) * 2;
    __nv_bfloat16 *Ap = nullptr, *Bp = nullptr;
    if ((e = cudaMallocAsync(reinterpret_cast<void**>(&Ap), pitch_bytes * M, stream)) != cudaSuccess) return (int)e;
    if ((e = cudaMallocAsync(reinterpret_cast<void**>(&Bp), pitch_bytes * N, stream)) == cudaSuccess &&
        (e = cudaMemcpy2DAsync(Ap, pitch_bytes, A, row_bytes, row_bytes, M, cudaMemcpyDeviceToDevice, stream)) ==
            cudaSuccess &&
        (e = cudaMemcpy2DAsync(Bp, pitch_bytes, B, row_bytes, row_bytes, N, cudaMemcpyDeviceToDevice, stream)) ==
            cudaSuccess)
        e = (cudaError_t)launch_ws(Ap, Bp, C, M, N, K, stream, 0, Kp);
    if (Bp != nullptr) {
        cudaError_t f = cudaFreeAsync(Bp, stream);
        if (e == cudaSuccess) e = f;
    }
    cudaError_t f = cudaFreeAsync(Ap, stream);
    return (int)(e == cudaSuccess ? f : e);
}

// wgmma_tma_ws's split on the current device (1 when the device cannot be read: the launch then
// reports the error). wgmma_tma_ws_cluster and wgmma_tma_ws_tma_store hand a product the rule
// splits over to wgmma_tma_ws: what they change (B multicast, the TMA-store epilogue) is about a
// large product's steady state, and the split path stores fp32 partial sums, not C.
static int ws_splits_here(int M, int N, int K) {
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || sm_count_of(dev, &sms) != cudaSuccess) return 1;
    return lab_wgmma_ws_split_k(M, N, K, sms);
}

// Experimental (not a rung): wgmma_tma_ws with clusters of 2 CTAs and B multicast, see above. The
// grid is as many clusters as fit at once (cudaOccupancyMaxActiveClusters: a GPC with an odd number
// of free SMs leaves one idle), at most one per 256 x 256 region of C.
extern "C" int launch_matmul_wgmma_tma_ws_cluster(const __nv_bfloat16* A, const __nv_bfloat16* B,
                                                  __nv_bfloat16* C, int M, int N, int K, cudaStream_t stream) {
    if (ws_splits_here(M, N, K) > 1) return launch_ws(A, B, C, M, N, K, stream, 0);
    CUtensorMap mA, mB;
    int vec2 = 0;
    bool skip = true;
    cudaError_t e = prepare(A, B, C, M, N, K, WS_BM, WS_BN / 2, &mA, &mB, &vec2, &skip, stream);
    if (e != cudaSuccess || skip) return (int)e;
    int dev = 0;
    if ((e = cudaGetDevice(&dev)) != cudaSuccess) return (int)e;
    static bool smem_done[WG_MAX_DEVICES] = {};
    if ((e = allow_smem((const void*)matmul_wgmma_tma_ws_cluster, WS_SMEM_BYTES, smem_done, dev)) != cudaSuccess)
        return (int)e;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 2;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(WS_THREADS, 1, 1);
    cfg.dynamicSmemBytes = WS_SMEM_BYTES;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    static int max_clusters[WG_MAX_DEVICES] = {};
    int fit = (dev >= 0 && dev < WG_MAX_DEVICES) ? max_clusters[dev] : 0;
    if (fit == 0) {
        int sms = 0;
        if ((e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return (int)e;
        cfg.gridDim = dim3(2 * (sms / 2), 1, 1);
        if ((e = cudaOccupancyMaxActiveClusters(&fit, (const void*)matmul_wgmma_tma_ws_cluster, &cfg)) != cudaSuccess)
            return (int)e;
        if (fit <= 0) return (int)cudaErrorInvalidConfiguration;
        if (dev >= 0 && dev < WG_MAX_DEVICES) max_clusters[dev] = fit;
    }
    const long long pairs = (long long)(((M + WS_BM - 1) / WS_BM + 1) / 2) * ((N + WS_BN - 1) / WS_BN);
    if (pairs > 0x3FFFFFFFLL) return (int)cudaErrorInvalidValue;
    cfg.gridDim = dim3(2 * (unsigned)(pairs < fit ? pairs : fit), 1, 1);
    cfg.stream = stream;
    e = cudaLaunchKernelEx(&cfg, matmul_wgmma_tma_ws_cluster, mA, mB, C, M, N, K, vec2);
    if (e != cudaSuccess) return (int)e;
    return (int)cudaGetLastError();
}

// Experimental (not a rung): wgmma_tma_ws with the shared-memory + TMA-store epilogue, see above.
// C as a 2-D tensor map for the stores: dimension 0 = N (contiguous), dimension 1 = M, row pitch
// N * 2 bytes (a multiple of 16: N % 8 == 0), boxes of 64 columns x 16 rows, 128-byte swizzle (the
// layout the epilogue writes). When N % 8 != 0 or C is not 16-byte aligned no such map exists and
// this launches wgmma_tma_ws instead (same mainloop, register epilogue).
extern "C" int launch_matmul_wgmma_tma_ws_tma_store(const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C,
                                              int M, int N, int K, cudaStream_t stream) {
    if (N % 8 != 0 || reinterpret_cast<uintptr_t>(C) % 16 != 0 || ws_splits_here(M, N, K) > 1)
        return launch_ws(A, B, C, M, N, K, stream, 0);
    CUtensorMap mA, mB, mC;
    int vec2 = 0;
    bool skip = true;
    cudaError_t e = prepare(A, B, C, M, N, K, WS_BM, WS_BN, &mA, &mB, &vec2, &skip, stream);
    if (e != cudaSuccess || skip) return (int)e;
    {
        PFN_cuTensorMapEncodeTiled_v12000 encode = encode_tiled();
        if (encode == nullptr) return (int)cudaErrorNotSupported;
        const cuuint64_t dims[2] = {static_cast<cuuint64_t>(N), static_cast<cuuint64_t>(M)};
        const cuuint64_t strides[1] = {static_cast<cuuint64_t>(N) * sizeof(__nv_bfloat16)};
        const cuuint32_t box[2] = {TRY_EPI_BOX_COLS, TRY_EPI_BOX_ROWS};
        const cuuint32_t elem_strides[2] = {1, 1};
        CUresult r = encode(&mC, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, static_cast<void*>(C), dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
        if (r != CUDA_SUCCESS) return (int)cudaErrorInvalidValue;
    }
    int dev = 0;
    if ((e = cudaGetDevice(&dev)) != cudaSuccess) return (int)e;
    static bool smem_done[WG_MAX_DEVICES] = {};
    if ((e = allow_smem((const void*)matmul_wgmma_tma_ws_tma_store, TMA_STORE_SMEM_BYTES, smem_done, dev)) != cudaSuccess)
        return (int)e;
    static int sm_count[WG_MAX_DEVICES] = {};
    int sms = (dev >= 0 && dev < WG_MAX_DEVICES) ? sm_count[dev] : 0;
    if (sms == 0) {
        if ((e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return (int)e;
        if (dev >= 0 && dev < WG_MAX_DEVICES) sm_count[dev] = sms;
    }
    const long long tiles = (long long)((M + WS_BM - 1) / WS_BM) * ((N + WS_BN - 1) / WS_BN);
    if (tiles > 0x7FFFFFFFLL) return (int)cudaErrorInvalidValue;
    const unsigned grid = (unsigned)(tiles < sms ? tiles : sms);
    matmul_wgmma_tma_ws_tma_store<<<grid, WS_THREADS, TMA_STORE_SMEM_BYTES, stream>>>(mA, mB, mC, M, N, K);
    return (int)cudaGetLastError();
}

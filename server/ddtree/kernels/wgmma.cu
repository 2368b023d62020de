// y [rows, n] = x [rows, k] @ w [n, k]^T for a tree verify's 33-136 half-precision rows on Hopper (sm_90a).
//
// Compiled at run time by NVRTC (ddtree/fast/nvrtc.py); ddtree/fast/wgmma.py prepends the tile sizes as
// macros (CONSUMERS, BN, STAGES, SPLITS, EVICT_FIRST, GLU, BOXES, ELEMENT) and `mma_tile`, the wgmma call for BN columns.
//
// The product runs transposed, y^T = w x^T, so the weight fills the MMA's 64-row side and the rows only pad to
// BN, a multiple of 8 (65 rows: 72), where a power-of-two tile pads them to 128. A block owns BM = 64 *
// CONSUMERS weight rows for all the rows, so the weight streams through once. One producer thread feeds
// STAGES shared-memory stages by TMA (128-byte swizzle, rows past `rows` arrive as zeros); each consumer
// warpgroup multiplies its 64 weight rows by the rows' tile with wgmma. Narrow weights split K over gridDim.y
// blocks: each writes its float32 partial tile, and the last block of a tile to finish sums them in split order
// (deterministic) and leaves the tile's ticket at zero for the next launch.
//
// GLU (a SwiGLU MLP's fused [gate; up] weight of 2I rows): a block's BM weight rows are BM / 2 gate rows and the
// same up rows, I further, and it writes SiLU(gate) * up [rows, I] for its BM / 2 columns, as ddtree/fast/rows.py's
// kernel after the plain product would: one launch, and no [rows, 2I] projection through memory, where two were.
//
// BOXES: a stage holds BOXES 64-wide K boxes side by side (one TMA load each), so that a block asks for 128 * BOXES
// contiguous bytes of each weight row at once.
//
// Programmatic dependent launch: the weight does not depend on the kernel before, so the producer loads the
// first stages' weight tiles before griddepcontrol.wait, while that kernel drains; the rows, and every write,
// come after the wait.

typedef unsigned long long u64;
typedef unsigned int u32;

struct __align__(64) TensorMap { u64 opaque[16]; };  // CUtensorMap, passed by value

#define BM (64 * CONSUMERS)
#define BOX_K 64                              // 64 half-precision values: one 128-byte swizzle row
#define BK (BOX_K * BOXES)                    // a stage's K: BOXES boxes side by side, each a tile of its own
#define W_BOX_BYTES (BM * BOX_K * 2)
#define X_BOX_BYTES (BN * BOX_K * 2)
#define W_TILE_BYTES (W_BOX_BYTES * BOXES)
#define X_TILE_BYTES (X_BOX_BYTES * BOXES)
#define STAGE_BYTES (W_TILE_BYTES + X_TILE_BYTES)

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void bar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void bar_expect(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void bar_wait(u64* bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "retry:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra retry;\n"
        "}\n" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
}

__device__ __forceinline__ void tma_load(void* dst, const TensorMap* map, u64* bar, int inner, int outer) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
        ::"r"(smem_u32(dst)), "l"((u64)map), "r"(smem_u32(bar)), "r"(inner), "r"(outer) : "memory");
}

// The same, marking the lines it reads as the first to evict from L2: a weight is read once per product, the
// rows' tile by every block.
__device__ __forceinline__ void tma_load_once(void* dst, const TensorMap* map, u64* bar, int inner, int outer) {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%3, %4}], [%2], %5;"
        ::"r"(smem_u32(dst)), "l"((u64)map), "r"(smem_u32(bar)), "r"(inner), "r"(outer), "l"(policy) : "memory");
}

#if EVICT_FIRST
#define load_weight tma_load_once
#else
#define load_weight tma_load
#endif

// A stage's weight tile, box by box: BM rows from `row0`, or with GLU BM / 2 gate rows from `row0` and the up rows
// `half` further.
__device__ __forceinline__ void load_weight_tile(unsigned char* dst, const TensorMap* map, u64* bar, int inner,
                                                 int row0, int half) {
#pragma unroll
    for (int b = 0; b < BOXES; ++b) {
        load_weight(dst + b * W_BOX_BYTES, map, bar, inner + b * BOX_K, row0);
#if GLU
        load_weight(dst + b * W_BOX_BYTES + W_BOX_BYTES / 2, map, bar, inner + b * BOX_K, row0 + half);
#endif
    }
}

// A stage's tile of the rows, box by box.
__device__ __forceinline__ void load_rows_tile(unsigned char* dst, const TensorMap* map, u64* bar, int inner) {
#pragma unroll
    for (int b = 0; b < BOXES; ++b) tma_load(dst + b * X_BOX_BYTES, map, bar, inner + b * BOX_K, 0);
}

__device__ __forceinline__ void grid_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void grid_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" :::); }

// A K-major tile in shared memory as wgmma reads it: 128-byte rows, 128-byte swizzle, 8-row groups 1024 bytes
// apart. Stepping 16 values along K moves the start address by 32 bytes inside the swizzle row.
__device__ __forceinline__ u64 smem_desc(const void* tile) {
    return (u64)((smem_u32(tile) & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

__device__ __forceinline__ void fence_operands(float (&d)[BN / 2]) {
#pragma unroll
    for (int j = 0; j < BN / 2; ++j) asm volatile("" : "+f"(d[j])::"memory");
}

__device__ __forceinline__ unsigned short to_element(float v) {
    unsigned short h;
    asm("cvt.rn." ELEMENT ".f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}

// The accumulator of warpgroup thread t: value 4i + e sits at weight row 16 * warp + lane / 4 + 8 * (e / 2) and
// token 8i + 2 * (lane % 4) + e % 2 (PTX ISA, wgmma's D fragment for .m64nNk16).
__device__ __forceinline__ void store_tile(const float (&d)[BN / 2], unsigned short* out, int rows, int n, int row0,
                                           int t) {
    const int lane = t % 32, weight_row = row0 + 16 * (t / 32) + lane / 4;
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int token = 8 * i + 2 * (lane % 4) + (e & 1), col = weight_row + 8 * (e >> 1);
            if (token < rows && col < n) out[(size_t)token * n + col] = to_element(d[4 * i + e]);
        }
    }
}

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS * 128) : "memory"); }

#if GLU
__device__ __forceinline__ float to_float(unsigned short h) {
    float v;
    asm("cvt.f32." ELEMENT " %0, %1;" : "=f"(v) : "h"(h));
    return v;
}

// rows.py's _swiglu with the instructions Triton makes of it: SiLU as g / (1 + ex2.approx(-g log2 e)) with
// div.full, rounded to ELEMENT, times up, rounded: the same bits as the row kernel after the plain product.
__device__ __forceinline__ unsigned short swiglu(unsigned short gate, unsigned short up) {
    float silu, product;
    asm("{\n.reg .f32 e;\nmul.rn.f32 e, %1, 0fBFB8AA3B;\nex2.approx.f32 e, e;\nadd.rn.f32 e, e, 0f3F800000;\n"
        "div.full.f32 %0, %1, e;\n}" : "=f"(silu) : "f"(to_float(gate)));
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(product) : "f"(to_float(to_element(silu))), "f"(to_float(up)));
    return to_element(product);
}

// The block's gate and up tiles, rounded as the projection's output, through shared memory (token-major, `tile`:
// BN x BM values in the stages' memory, which every consumer is done with), then SiLU(gate) * up for its BM / 2
// columns [col0, col0 + BM / 2) of out [rows, width], consecutive threads on consecutive columns.
__device__ __forceinline__ void store_glu(const float (&d)[BN / 2], unsigned short* tile, unsigned short* out,
                                          int rows, int width, int col0, int c, int t) {
    const int lane = t % 32, weight_row = c * 64 + 16 * (t / 32) + lane / 4;
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            tile[(8 * i + 2 * (lane % 4) + (e & 1)) * BM + weight_row + 8 * (e >> 1)] = to_element(d[4 * i + e]);
    }
    consumers_sync();
    for (int idx = c * 128 + t; idx < rows * (BM / 2); idx += CONSUMERS * 128) {
        const int token = idx / (BM / 2), j = idx % (BM / 2);
        if (col0 + j < width)
            out[(size_t)token * width + col0 + j] = swiglu(tile[token * BM + j], tile[token * BM + BM / 2 + j]);
    }
}
#endif

// The block's finished tile: with GLU SiLU(gate) * up through the stages' memory (every consumer must be done with
// it), else the product.
__device__ __forceinline__ void store_block(const float (&d)[BN / 2], unsigned char* stages, unsigned short* out,
                                            int rows, int n, int n0, int c, int t) {
#if GLU
    store_glu(d, (unsigned short*)stages, out, rows, n / 2, n0, c, t);
#else
    store_tile(d, out, rows, n, n0 + c * 64, t);
#endif
}

extern "C" __global__ void __launch_bounds__((CONSUMERS + 1) * 128, 1)
wgmma_linear(const __grid_constant__ TensorMap w_map, const __grid_constant__ TensorMap x_map,
             unsigned short* __restrict__ out, int rows, int n, int k_tiles, float* __restrict__ partials,
             int* __restrict__ tickets) {
    extern __shared__ unsigned char dynamic_smem[];
    unsigned char* stages = (unsigned char*)(((size_t)dynamic_smem + 1023) & ~(size_t)1023);
    __shared__ __align__(8) u64 full[STAGES];
    __shared__ __align__(8) u64 empty[STAGES];
    __shared__ int last_split;

    const int tile = blockIdx.x, split = blockIdx.y;
    // k_tiles: 64-wide K tiles per split; with GLU the block's gate rows start at n0, its up rows n / 2 further
    const int n0 = tile * (GLU ? BM / 2 : BM), k0 = split * k_tiles, half = n / 2;
    const int group = threadIdx.x / 128, t = threadIdx.x % 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            bar_init(&full[s], 1);
            bar_init(&empty[s], CONSUMERS * 128);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (group == 0) {  // the producer
        if (t == 0) {
            const int ahead = k_tiles < STAGES ? k_tiles : STAGES;
            for (int s = 0; s < ahead; ++s) {
                bar_expect(&full[s], STAGE_BYTES);
                load_weight_tile(stages + s * STAGE_BYTES, &w_map, &full[s], (k0 + s) * BK, n0, half);
            }
            grid_wait();
            grid_launch_dependents();
            for (int s = 0; s < ahead; ++s)
                load_rows_tile(stages + s * STAGE_BYTES + W_TILE_BYTES, &x_map, &full[s], (k0 + s) * BK);
            for (int kt = ahead; kt < k_tiles; ++kt) {
                const int s = kt % STAGES;
                bar_wait(&empty[s], ((kt / STAGES) + 1) & 1);
                bar_expect(&full[s], STAGE_BYTES);
                load_weight_tile(stages + s * STAGE_BYTES, &w_map, &full[s], (k0 + kt) * BK, n0, half);
                load_rows_tile(stages + s * STAGE_BYTES + W_TILE_BYTES, &x_map, &full[s], (k0 + kt) * BK);
            }
        }
        return;
    }

    grid_wait();
    grid_launch_dependents();
    const int c = group - 1;  // this warpgroup's 64 weight rows: c * 64..
    float d[BN / 2];
#pragma unroll
    for (int j = 0; j < BN / 2; ++j) d[j] = 0.0f;
    for (int kt = 0; kt < k_tiles; ++kt) {
        const int s = kt % STAGES;
        bar_wait(&full[s], (kt / STAGES) & 1);
        const unsigned char* w_tile = stages + s * STAGE_BYTES + c * 64 * BOX_K * 2;
        const unsigned char* x_tile = stages + s * STAGE_BYTES + W_TILE_BYTES;
        fence_operands(d);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int b = 0; b < BOXES; ++b) {
#pragma unroll
            for (int kk = 0; kk < BOX_K / 16; ++kk)
                mma_tile(d, smem_desc(w_tile + b * W_BOX_BYTES + kk * 32), smem_desc(x_tile + b * X_BOX_BYTES + kk * 32));
        }
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        fence_operands(d);
        bar_arrive(&empty[s]);
    }

    if (SPLITS == 1) {
        if (GLU) consumers_sync();  // every consumer's wgmma is done with the stages before they hold the tile
        store_block(d, stages, out, rows, n, n0, c, t);
        return;
    }
    // split K: this split's partial tile, stored so that each float4 store of a warp is contiguous
    float4* tiles = (float4*)partials;
    const size_t per_split = (size_t)CONSUMERS * (BN / 8) * 128;
#pragma unroll
    for (int i = 0; i < BN / 8; ++i)
        tiles[((size_t)tile * SPLITS + split) * per_split + (c * (BN / 8) + i) * 128 + t] =
            make_float4(d[4 * i], d[4 * i + 1], d[4 * i + 2], d[4 * i + 3]);
    __threadfence();
    consumers_sync();
    if (threadIdx.x == 128) last_split = atomicAdd(&tickets[tile], 1) == SPLITS - 1;
    consumers_sync();
    if (!last_split) return;
    __threadfence();
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
        float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int other = 0; other < SPLITS; ++other) {  // in split order, whichever block came last
            const float4 p = other == split
                                 ? make_float4(d[4 * i], d[4 * i + 1], d[4 * i + 2], d[4 * i + 3])
                                 : __ldcg(&tiles[((size_t)tile * SPLITS + other) * per_split + (c * (BN / 8) + i) * 128 + t]);
            sum.x += p.x;
            sum.y += p.y;
            sum.z += p.z;
            sum.w += p.w;
        }
        d[4 * i] = sum.x;
        d[4 * i + 1] = sum.y;
        d[4 * i + 2] = sum.z;
        d[4 * i + 3] = sum.w;
    }
    if (threadIdx.x == 128) tickets[tile] = 0;
    store_block(d, stages, out, rows, n, n0, c, t);  // the syncs above: the stages are free
}

// Decode attention in one launch: append the new token's key/value to the KV cache and attend over
// the whole cache with split-K (flash-decoding), the last block of each head group merging the splits.
//
// Shapes (row-major, contiguous, 16-byte aligned; T = bf16 or fp16, stored here as raw 16-bit words):
//   q          [B, H, D]            the new token's queries (one per sequence)
//   k_new/v_new[B, KVH, D]          the new token's key and value
//   k_cache    [B, KVH, max_len, D] keys; position cache_lens[b] receives k_new[b]
//   v_cache    [B, KVH, max_len, D]
//   cache_lens [B] int32            tokens already cached per sequence; the kernel attends over
//                                   positions 0..cache_lens[b] inclusive (cache_lens[b] + 1 keys)
//   out        [B, H, D]
// Query head h reads KV head h / (H / KVH) (grouped-query attention, any group size).
//
// Grid: x = split index (`splits`, fixed at capture), y = unit = (b, kv head, head chunk). A block
// handles HPB query heads of one KV head (a head chunk), so the heads of a group share each K/V
// load. The keys 0..L-1 (L = cache_len + 1) are cut into `splits` chunks of `chunk` keys, chunk
// rounded up to `granule`; the chunk size follows the *device-side* length, so one graph replays
// correctly at any length up to max_len. Blocks whose chunk is empty write neutral partials
// (max = -inf, sum = 0) and leave. When one chunk covers everything (short caches) its block
// writes the output directly: no workspace, no ticket.
//
// Append/read ordering: the block (split 0, head chunk 0) of each (b, kv head) copies k_new/v_new
// into the cache at position cache_len. No block reads that cache slot in this launch: every block
// reads position cache_len from k_new/v_new directly, so the new token is visible to the attention
// of the same launch without any inter-block ordering. A cache_len outside [0, max_len) writes NaN
// to that sequence's output and appends nothing (loud, and no out-of-bounds write).
//
// Inside a block: a key is read by LPK = D/8 lanes with one 16-byte load each; a warp covers
// 32/LPK keys per row and UNROLL rows per iteration, issuing all K and V loads of the iteration
// before using any (several loads in flight per warp). Scores and softmax are FP32, with
// exp2 and the scale * log2(e) folded into q. Each key subgroup keeps its own running
// (max, sum, accumulator); subgroups merge by shuffles, warps through shared memory.
//
// Merge: each block writes its partial (max, sum, unnormalised accumulator) to the workspace,
// fences (__threadfence) and takes a ticket (atomicAdd on tickets[unit]). The block that draws
// ticket nused - 1 is the last; it resets the ticket to 0 (so the same CUDA graph replays), then
// merges the partials in split order (deterministic) and writes the output.
//
// Compile-time parameters (defines): L2L_HEAD_DIM (64 or 128), L2L_HEADS_PER_BLOCK (1..8),
// L2L_WARPS (warps per block), L2L_UNROLL (rows per warp iteration), L2L_MAX_SPLITS, and L2L_BF16
// (bf16 when defined, else fp16). L2L_EMULATE replaces the inline-PTX helpers with host code for
// a CPU emulation of the kernel (tests only); nothing else changes.

typedef unsigned int u32;
typedef unsigned short u16;

#ifndef L2L_HEAD_DIM
#define L2L_HEAD_DIM 64
#endif
#ifndef L2L_HEADS_PER_BLOCK
#define L2L_HEADS_PER_BLOCK 1
#endif
#ifndef L2L_WARPS
#define L2L_WARPS 4
#endif
#ifndef L2L_UNROLL
#define L2L_UNROLL 4
#endif
#ifndef L2L_MAX_SPLITS
#define L2L_MAX_SPLITS 128
#endif

constexpr int D = L2L_HEAD_DIM;
constexpr int HPB = L2L_HEADS_PER_BLOCK;
constexpr int NWARPS = L2L_WARPS;
constexpr int NTHREADS = NWARPS * 32;
constexpr int UNROLL = L2L_UNROLL;
constexpr int MAX_SPLITS = L2L_MAX_SPLITS;
constexpr int LPK = D / 8;        // lanes per key: 8 elements (16 bytes) per lane
constexpr int KPR = 32 / LPK;     // keys per warp row
constexpr int KPW = KPR * UNROLL; // keys per warp iteration
constexpr u32 FULL = 0xffffffffu;

static_assert(D == 64 || D == 128, "L2L_HEAD_DIM must be 64 or 128");
static_assert(HPB >= 1 && HPB <= 8, "L2L_HEADS_PER_BLOCK must be in 1..8");
static_assert(NWARPS >= 1 && NWARPS <= 16, "L2L_WARPS must be in 1..16");
static_assert(UNROLL >= 1 && UNROLL <= 16, "L2L_UNROLL must be in 1..16");
static_assert(MAX_SPLITS % 32 == 0 && MAX_SPLITS <= 1024, "L2L_MAX_SPLITS must be a multiple of 32, at most 1024");

#ifndef L2L_EMULATE
__device__ __forceinline__ float l2l_ex2(float x) {  // 2^x; ex2.approx(-inf) = +0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float l2l_h2f(u32 h) {  // fp16 bits (low 16) -> float
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((u16)h));
    return f;
}
__device__ __forceinline__ u32 l2l_f2h(float f) {  // float -> fp16 bits, round to nearest even
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

#ifdef L2L_BF16
__device__ __forceinline__ float lo_f(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_f(u32 w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ u32 to_bits(float f) {  // float -> bf16 bits, round to nearest even (as torch)
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
}
constexpr u32 NAN_BITS = 0x7fc0u;
#else
__device__ __forceinline__ float lo_f(u32 w) { return l2l_h2f(w & 0xffffu); }
__device__ __forceinline__ float hi_f(u32 w) { return l2l_h2f(w >> 16); }
__device__ __forceinline__ u32 to_bits(float f) { return l2l_f2h(f); }
constexpr u32 NAN_BITS = 0x7e00u;
#endif

__device__ __forceinline__ void unpack8(const uint4 v, float f[8]) {
    f[0] = lo_f(v.x); f[1] = hi_f(v.x);
    f[2] = lo_f(v.y); f[3] = hi_f(v.y);
    f[4] = lo_f(v.z); f[5] = hi_f(v.z);
    f[6] = lo_f(v.w); f[7] = hi_f(v.w);
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(FULL, x, off));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(FULL, x, off);
    return x;
}

// exp2(m - ref) as a merge weight; a neutral state (m = -inf) weighs 0 even when ref is -inf too.
__device__ __forceinline__ float weight(float m, float ref) { return m == neg_inf() ? 0.f : l2l_ex2(m - ref); }

extern "C" __global__ void __launch_bounds__(NTHREADS)
l2l_decode_attention(const u16* __restrict__ q, const u16* __restrict__ k_new, const u16* __restrict__ v_new,
                     u16* k_cache, u16* v_cache, const int* __restrict__ cache_lens, u16* __restrict__ out,
                     float* part_acc, float* part_ml, u32* tickets, int heads, int kv_heads, int head_chunks,
                     int max_len, int splits, int granule, float qscale) {
    __shared__ __align__(16) float sm_acc[NWARPS][HPB][D];
    __shared__ float sm_m[NWARPS][HPB];
    __shared__ float sm_l[NWARPS][HPB];
    __shared__ float sm_w[HPB][MAX_SPLITS];
    __shared__ u32 sm_ticket;

    const int group = heads / kv_heads;
    const int unit = blockIdx.y;
    const int b = unit / (kv_heads * head_chunks);
    const int rem = unit - b * kv_heads * head_chunks;
    const int kvh = rem / head_chunks;
    const int hc = rem - kvh * head_chunks;
    const int h0 = kvh * group + hc * HPB;        // first query head of this block
    const int gcount = min(HPB, group - hc * HPB); // heads of the chunk that exist (the last chunk may be short)
    const int s = blockIdx.x;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int len = cache_lens[b];
    u16* out_unit = out + ((size_t)b * heads + h0) * D;

    if (len < 0 || len >= max_len) {
        if (s == 0) {
            for (int i = tid; i < gcount * D; i += NTHREADS) out_unit[i] = (u16)NAN_BITS;
        }
        return;
    }
    const int L = len + 1;  // keys attended: the cached ones and the new one
    int chunk = (L + splits - 1) / splits;
    chunk = (chunk + granule - 1) / granule * granule;
    const int nused = (L + chunk - 1) / chunk;
    const size_t row0 = ((size_t)b * kv_heads + kvh) * max_len;  // cache row of position 0
    const u16* knew = k_new + ((size_t)b * kv_heads + kvh) * D;
    const u16* vnew = v_new + ((size_t)b * kv_heads + kvh) * D;

    // Append: one block per (b, kv head) copies the new key and value, bit for bit.
    if (s == 0 && hc == 0 && tid < 2 * LPK) {
        const bool is_v = tid >= LPK;
        const int piece = is_v ? tid - LPK : tid;
        const uint4 val = __ldg(reinterpret_cast<const uint4*>((is_v ? vnew : knew) + piece * 8));
        *reinterpret_cast<uint4*>((is_v ? v_cache : k_cache) + (row0 + len) * D + piece * 8) = val;
    }

    float* ml = part_ml + ((size_t)unit * splits + s) * HPB * 2;
    if (s >= nused) {  // empty range: neutral partial, no ticket (the merge reads only used splits)
        if (tid < HPB) {
            ml[2 * tid] = neg_inf();
            ml[2 * tid + 1] = 0.f;
        }
        return;
    }
    const int start = s * chunk;
    const int end = min(start + chunk, L);

    const int sub = lane / LPK;   // which key of a warp row this lane works on
    const int piece = lane % LPK; // which 8 elements of the head dimension
    float qf[HPB][8];
#pragma unroll
    for (int g = 0; g < HPB; ++g) {
        if (g < gcount) {
            unpack8(__ldg(reinterpret_cast<const uint4*>(q + ((size_t)b * heads + h0 + g) * D + piece * 8)), qf[g]);
#pragma unroll
            for (int j = 0; j < 8; ++j) qf[g][j] *= qscale;
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) qf[g][j] = 0.f;
        }
    }
    float m[HPB], l[HPB], acc[HPB][8];
#pragma unroll
    for (int g = 0; g < HPB; ++g) {
        m[g] = neg_inf();
        l[g] = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] = 0.f;
    }

    // Warp-uniform loop: every lane of a warp has the same `base`, so the shuffles below are safe.
    for (int base = start + warp * KPW; base < end; base += NWARPS * KPW) {
        uint4 kr[UNROLL], vr[UNROLL];
#pragma unroll
        for (int r = 0; r < UNROLL; ++r) {  // issue every load of the iteration first
            const int pos = base + r * KPR + sub;
            if (pos < end) {
                const u16* kp = pos == len ? knew : k_cache + (row0 + pos) * D;
                const u16* vp = pos == len ? vnew : v_cache + (row0 + pos) * D;
                kr[r] = __ldg(reinterpret_cast<const uint4*>(kp + piece * 8));
                vr[r] = __ldg(reinterpret_cast<const uint4*>(vp + piece * 8));
            } else {
                kr[r] = make_uint4(0u, 0u, 0u, 0u);
                vr[r] = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        float sc[UNROLL][HPB];
#pragma unroll
        for (int r = 0; r < UNROLL; ++r) {
            float kf[8];
            unpack8(kr[r], kf);
            const bool valid = base + r * KPR + sub < end;
#pragma unroll
            for (int g = 0; g < HPB; ++g) {
                float p = 0.f;
#pragma unroll
                for (int j = 0; j < 8; ++j) p = fmaf(qf[g][j], kf[j], p);
#pragma unroll
                for (int off = LPK / 2; off > 0; off >>= 1) p += __shfl_xor_sync(FULL, p, off);
                sc[r][g] = valid ? p : neg_inf();
            }
        }
#pragma unroll
        for (int g = 0; g < HPB; ++g) {  // rescale once per iteration, not once per key
            float mt = m[g];
#pragma unroll
            for (int r = 0; r < UNROLL; ++r) mt = fmaxf(mt, sc[r][g]);
            const float alpha = weight(m[g], mt);
            l[g] *= alpha;
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[g][j] *= alpha;
            m[g] = mt;
        }
#pragma unroll
        for (int r = 0; r < UNROLL; ++r) {
            float vf[8];
            unpack8(vr[r], vf);
#pragma unroll
            for (int g = 0; g < HPB; ++g) {
                const float p = weight(sc[r][g], m[g]);
                l[g] += p;
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[g][j] = fmaf(p, vf[j], acc[g][j]);
            }
        }
    }

    // Merge the key subgroups of the warp (lanes piece, piece + LPK, ... hold the same dims).
#pragma unroll
    for (int off = LPK; off < 32; off <<= 1) {
#pragma unroll
        for (int g = 0; g < HPB; ++g) {
            const float mo = __shfl_xor_sync(FULL, m[g], off);
            const float lo = __shfl_xor_sync(FULL, l[g], off);
            const float mn = fmaxf(m[g], mo);
            const float a = weight(m[g], mn);
            const float c = weight(mo, mn);
            l[g] = l[g] * a + lo * c;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float ao = __shfl_xor_sync(FULL, acc[g][j], off);
                acc[g][j] = acc[g][j] * a + ao * c;
            }
            m[g] = mn;
        }
    }
    if (sub == 0) {
#pragma unroll
        for (int g = 0; g < HPB; ++g) {
            float4* dst = reinterpret_cast<float4*>(&sm_acc[warp][g][piece * 8]);
            dst[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
            dst[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
            if (piece == 0) {
                sm_m[warp][g] = m[g];
                sm_l[warp][g] = l[g];
            }
        }
    }
    __syncthreads();

    // Merge the warps: this block's partial for each (head, dim). Warp 0 saw key `start`, so the
    // block's max is finite and its sum positive.
    const bool direct = nused == 1;
    float* pacc = part_acc + ((size_t)unit * splits + s) * HPB * D;
    for (int i = tid; i < HPB * D; i += NTHREADS) {
        const int g = i / D;
        const int d = i - g * D;
        float mx = neg_inf();
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) mx = fmaxf(mx, sm_m[w][g]);
        float lsum = 0.f, a = 0.f;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            const float f = weight(sm_m[w][g], mx);
            lsum += sm_l[w][g] * f;
            a += sm_acc[w][g][d] * f;
        }
        if (direct) {
            if (g < gcount) out_unit[g * D + d] = (u16)to_bits(a / lsum);
        } else {
            pacc[i] = a;
            if (d == 0) {
                ml[2 * g] = mx;
                ml[2 * g + 1] = lsum;
            }
        }
    }
    if (direct) return;

    // Ticket: the last block of this unit to finish merges. Fence first so that the partial this
    // block wrote is visible device-wide before the ticket says it is there.
    __threadfence();
    __syncthreads();
    if (tid == 0) sm_ticket = atomicAdd(&tickets[unit], 1u);
    __syncthreads();
    if (sm_ticket != (u32)(nused - 1)) return;
    if (tid == 0) atomicExch(&tickets[unit], 0u);  // every other block has drawn: ready for the next launch
    __threadfence();

    // Merge weights per head: w[s] = exp2(m_s - M) / sum_t l_t exp2(m_t - M). Partials come from
    // other SMs: read them through L2 (__ldcg), never from this SM's L1.
    const float* ml_unit = part_ml + (size_t)unit * splits * HPB * 2;
    for (int g = warp; g < HPB; g += NWARPS) {
        float ms[MAX_SPLITS / 32], ls[MAX_SPLITS / 32];
        float mx = neg_inf();
#pragma unroll
        for (int k = 0; k < MAX_SPLITS / 32; ++k) {
            const int t = k * 32 + lane;
            ms[k] = t < nused ? __ldcg(ml_unit + ((size_t)t * HPB + g) * 2) : neg_inf();
            ls[k] = t < nused ? __ldcg(ml_unit + ((size_t)t * HPB + g) * 2 + 1) : 0.f;
            mx = fmaxf(mx, ms[k]);
        }
        mx = warp_max(mx);
        float lsum = 0.f;
#pragma unroll
        for (int k = 0; k < MAX_SPLITS / 32; ++k) lsum += ls[k] * weight(ms[k], mx);
        const float inv = 1.f / warp_sum(lsum);
#pragma unroll
        for (int k = 0; k < MAX_SPLITS / 32; ++k) {
            const int t = k * 32 + lane;
            if (t < nused) sm_w[g][t] = weight(ms[k], mx) * inv;
        }
    }
    __syncthreads();

    constexpr int D4 = D / 4;
    const float* acc_unit = part_acc + (size_t)unit * splits * HPB * D;
    constexpr size_t SPLIT_STRIDE4 = (size_t)HPB * D4;  // float4s between two splits' partials
    for (int i = tid; i < gcount * D4; i += NTHREADS) {
        const int g = i / D4;
        const int d4 = i - g * D4;
        const float4* src = reinterpret_cast<const float4*>(acc_unit + (size_t)g * D) + d4;
        float4 a0 = make_float4(0.f, 0.f, 0.f, 0.f);
        float4 a1 = a0;
        int t = 0;
        for (; t + 4 <= nused; t += 4) {  // four loads in flight, two accumulators
            const float4 x0 = __ldcg(src + (size_t)(t + 0) * SPLIT_STRIDE4);
            const float4 x1 = __ldcg(src + (size_t)(t + 1) * SPLIT_STRIDE4);
            const float4 x2 = __ldcg(src + (size_t)(t + 2) * SPLIT_STRIDE4);
            const float4 x3 = __ldcg(src + (size_t)(t + 3) * SPLIT_STRIDE4);
            const float w0 = sm_w[g][t], w1 = sm_w[g][t + 1], w2 = sm_w[g][t + 2], w3 = sm_w[g][t + 3];
            a0.x = fmaf(w0, x0.x, a0.x); a0.y = fmaf(w0, x0.y, a0.y); a0.z = fmaf(w0, x0.z, a0.z); a0.w = fmaf(w0, x0.w, a0.w);
            a1.x = fmaf(w1, x1.x, a1.x); a1.y = fmaf(w1, x1.y, a1.y); a1.z = fmaf(w1, x1.z, a1.z); a1.w = fmaf(w1, x1.w, a1.w);
            a0.x = fmaf(w2, x2.x, a0.x); a0.y = fmaf(w2, x2.y, a0.y); a0.z = fmaf(w2, x2.z, a0.z); a0.w = fmaf(w2, x2.w, a0.w);
            a1.x = fmaf(w3, x3.x, a1.x); a1.y = fmaf(w3, x3.y, a1.y); a1.z = fmaf(w3, x3.z, a1.z); a1.w = fmaf(w3, x3.w, a1.w);
        }
        for (; t < nused; ++t) {
            const float4 x = __ldcg(src + (size_t)t * SPLIT_STRIDE4);
            const float w = sm_w[g][t];
            a0.x = fmaf(w, x.x, a0.x); a0.y = fmaf(w, x.y, a0.y); a0.z = fmaf(w, x.z, a0.z); a0.w = fmaf(w, x.w, a0.w);
        }
        const u32 p0 = to_bits(a0.x + a1.x) | (to_bits(a0.y + a1.y) << 16);
        const u32 p1 = to_bits(a0.z + a1.z) | (to_bits(a0.w + a1.w) << 16);
        *reinterpret_cast<uint2*>(out_unit + g * D + d4 * 4) = make_uint2(p0, p1);
    }
}

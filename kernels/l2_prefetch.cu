// L2 prefetch kernels: ask the L2 cache to fetch a buffer's bytes ahead of the op that reads them.
//
// None of these kernels writes memory. `prefetch.global.L2` and `cp.async.bulk.prefetch.L2` only
// move lines into L2, so whatever runs concurrently computes exactly the bits it would without them.
//
// Kernels (all grid-stride, launched with a few blocks on a side stream):
//   l2_prefetch_hint            prefetch.global.L2 on every `stride` bytes
//   l2_prefetch_hint_last       the same with the ::evict_last cache-priority flavour
//   l2_prefetch_bulk            cp.async.bulk.prefetch.L2.global, `chunk` bytes per call (sm_90+)
//   l2_prefetch_bulk_last       the same with an L2::cache_hint policy made by createpolicy evict_last
// The bulk kernels are compiled only when L2L_HAVE_BULK is defined (the loader defines it on sm_90+);
// the bulk form needs a 16-byte-aligned address and a size that is a multiple of 16, which the
// host side checks before launching.

typedef unsigned long long u64;

extern "C" __global__ void l2_prefetch_hint(const char* __restrict__ base, u64 nbytes, unsigned int stride) {
    const u64 step = (u64)gridDim.x * blockDim.x * stride;
    for (u64 off = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * stride; off < nbytes; off += step) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(base + off));
    }
}

extern "C" __global__ void l2_prefetch_hint_last(const char* __restrict__ base, u64 nbytes, unsigned int stride) {
    const u64 step = (u64)gridDim.x * blockDim.x * stride;
    for (u64 off = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * stride; off < nbytes; off += step) {
        asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(base + off));
    }
}

#ifdef L2L_HAVE_BULK
// One thread issues one bulk prefetch of `chunk` bytes (the last one may be shorter, still a
// multiple of 16 because the host passes a 16-byte multiple `nbytes`).
extern "C" __global__ void l2_prefetch_bulk(const char* __restrict__ base, u64 nbytes, unsigned int chunk) {
    const u64 step = (u64)gridDim.x * blockDim.x * chunk;
    for (u64 off = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * chunk; off < nbytes; off += step) {
        const u64 left = nbytes - off;
        const unsigned int size = left < chunk ? (unsigned int)left : chunk;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + off), "r"(size) : "memory");
    }
}

extern "C" __global__ void l2_prefetch_bulk_last(const char* __restrict__ base, u64 nbytes, unsigned int chunk) {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    const u64 step = (u64)gridDim.x * blockDim.x * chunk;
    for (u64 off = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * chunk; off < nbytes; off += step) {
        const u64 left = nbytes - off;
        const unsigned int size = left < chunk ? (unsigned int)left : chunk;
        asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(base + off), "r"(size),
                     "l"(policy)
                     : "memory");
    }
}
#endif

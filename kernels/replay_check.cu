// The sampled replay check's comparisons (l2lightning/check_kernels.py): every tensor pair of a check
// in one launch, read-only on the tensors.
//
// A check runs once or twice a fit, so its cost is mostly the first use of its kernels in the process:
// torch's comparison and reduction kernels took 20-40 ms each to load on the H200 the first time
// (benchmarks/results/h200/check_first_use.json), for work that takes well under a millisecond. These
// two kernels load with one module.
//
// The host splits each tensor into items and passes a table of them; one block per item writes one
// result, so no output needs zeroing and no atomics are used:
//   l2l_bytes_differ    item = {a, b, nbytes} (u64 each): flags[item] = 1 if any byte differs, else 0
//   l2l_spread_measure  item = {replay, again, eager, count, code}: out[3*item..] = the largest
//                       |replay - eager|, the largest |replay - again|, the largest finite |replay|,
//                       in double precision (exact for every float dtype it reads). Equal values,
//                       equal infinities and two NaNs count as no difference, a NaN against a number
//                       as an infinite one (as replay_check._largest_difference). code 0 compares
//                       bytes instead (integers and bools: count is bytes; the first result is 1 if
//                       any differ, the others 0 and 1).
// Dtype codes: 0 bytes, 1 float32, 2 float64, 3 float16, 4 bfloat16.

typedef unsigned long long u64;

extern "C" __global__ void l2l_bytes_differ(const u64* __restrict__ table, int* __restrict__ flags) {
    const u64* item = table + 3ull * blockIdx.x;
    const unsigned char* a = (const unsigned char*)item[0];
    const unsigned char* b = (const unsigned char*)item[1];
    const u64 n = item[2];
    int differ = 0;
    u64 done = 0;
    if (((item[0] | item[1]) & 15ull) == 0) {  // 16-byte loads where both sides allow them
        const uint4* a4 = (const uint4*)a;
        const uint4* b4 = (const uint4*)b;
        const u64 words = n / 16;
        for (u64 k = threadIdx.x; k < words; k += blockDim.x) {
            const uint4 x = a4[k], y = b4[k];
            differ |= (x.x != y.x) | (x.y != y.y) | (x.z != y.z) | (x.w != y.w);
        }
        done = words * 16;
    }
    for (u64 k = done + threadIdx.x; k < n; k += blockDim.x) {
        differ |= a[k] != b[k];
    }
    differ = __syncthreads_or(differ);
    if (threadIdx.x == 0) {
        flags[blockIdx.x] = differ ? 1 : 0;
    }
}

// IEEE half to float, exactly (subnormals, infinities and NaNs included), without cuda_fp16.h.
__device__ __forceinline__ float half_bits_to_float(unsigned short h) {
    const unsigned int sign = h >> 15, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    float value;
    if (exponent == 0) {
        value = ldexpf((float)mantissa, -24);
    } else if (exponent == 31) {
        value = mantissa ? __int_as_float(0x7fc00000) : __int_as_float(0x7f800000);
    } else {
        value = ldexpf((float)(mantissa | 0x400), (int)exponent - 25);
    }
    return sign ? -value : value;
}

__device__ __forceinline__ double load_as_double(const unsigned char* base, u64 k, int code) {
    switch (code) {
        case 1:
            return (double)((const float*)base)[k];
        case 2:
            return ((const double*)base)[k];
        case 3:
            return (double)half_bits_to_float(((const unsigned short*)base)[k]);
        default:  // 4: bfloat16 is the upper half of a float32
            return (double)__uint_as_float(((unsigned int)((const unsigned short*)base)[k]) << 16);
    }
}

__device__ __forceinline__ double distance(double x, double y) {
    if (x == y) {
        return 0.0;  // equal infinities included
    }
    const bool x_nan = isnan(x), y_nan = isnan(y);
    if (x_nan && y_nan) {
        return 0.0;
    }
    if (x_nan || y_nan) {
        return __longlong_as_double(0x7ff0000000000000ll);  // infinity
    }
    return fabs(x - y);
}

// The block's largest of three non-negative doubles per thread; the result in thread 0's.
__device__ __forceinline__ void block_max3(double& p, double& q, double& r) {
    __shared__ double shared[3][32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        p = fmax(p, __shfl_down_sync(0xffffffffu, p, offset));
        q = fmax(q, __shfl_down_sync(0xffffffffu, q, offset));
        r = fmax(r, __shfl_down_sync(0xffffffffu, r, offset));
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        shared[0][warp] = p;
        shared[1][warp] = q;
        shared[2][warp] = r;
    }
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + 31) >> 5;
        p = lane < warps ? shared[0][lane] : 0.0;
        q = lane < warps ? shared[1][lane] : 0.0;
        r = lane < warps ? shared[2][lane] : 0.0;
        for (int offset = 16; offset > 0; offset >>= 1) {
            p = fmax(p, __shfl_down_sync(0xffffffffu, p, offset));
            q = fmax(q, __shfl_down_sync(0xffffffffu, q, offset));
            r = fmax(r, __shfl_down_sync(0xffffffffu, r, offset));
        }
    }
}

extern "C" __global__ void l2l_spread_measure(const u64* __restrict__ table, double* __restrict__ out) {
    const u64* item = table + 5ull * blockIdx.x;
    const unsigned char* replay = (const unsigned char*)item[0];
    const unsigned char* again = (const unsigned char*)item[1];
    const unsigned char* eager = (const unsigned char*)item[2];
    const u64 n = item[3];
    const int code = (int)item[4];
    double gap = 0.0, spread = 0.0, scale = 0.0;
    if (code == 0) {
        for (u64 k = threadIdx.x; k < n; k += blockDim.x) {
            gap = (replay[k] != eager[k] || replay[k] != again[k]) ? 1.0 : gap;
        }
    } else {
        for (u64 k = threadIdx.x; k < n; k += blockDim.x) {
            const double r = load_as_double(replay, k, code);
            gap = fmax(gap, distance(r, load_as_double(eager, k, code)));
            spread = fmax(spread, distance(r, load_as_double(again, k, code)));
            if (isfinite(r)) {
                scale = fmax(scale, fabs(r));
            }
        }
    }
    block_max3(gap, spread, scale);
    if (threadIdx.x == 0) {
        out[3ull * blockIdx.x] = gap;
        out[3ull * blockIdx.x + 1] = code == 0 ? 0.0 : spread;
        out[3ull * blockIdx.x + 2] = code == 0 ? 1.0 : scale;
    }
}

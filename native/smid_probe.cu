// SM-id probe: which SMs does a stream's work run on, and when?
//
// Each block's first thread reads %smid and spins on %globaltimer for spin_us
// microseconds, then writes one record of BULLET_SMID_FIELDS 64-bit values:
//
//   [0] %smid at the start          [1] %globaltimer at the start (ns)
//   [2] %globaltimer at the end     [3] spin-loop iterations (work done)
//   [4] largest gap between two consecutive timer reads (ns)
//   [5] sum of the gaps longer than BULLET_SMID_GAP_NS (time the block was not running)
//   [6] %smid at the end (differs from [0] only if the block was migrated)
//
// Time-sliced execution (two processes without MPS) still ends every block
// after spin_us of wall time, so the window alone cannot tell concurrency from
// time slicing; the gaps ([4], [5]) and the work done ([3]) can.
//
// C API (loaded with ctypes by bullet_trt/spatial/partitioners/native.py). No function aborts:
// each returns 0 or a cudaError_t value.

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BULLET_SMID_FIELDS 7
#define BULLET_SMID_GAP_NS 20000ull  // 20 us: far above a timer read, far below a time slice

__device__ __forceinline__ unsigned long long bullet_gtimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ unsigned int bullet_smid() {
    unsigned int s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}

__global__ void bullet_smid_kernel(unsigned long long spin_ns, unsigned long long* rec) {
    if (threadIdx.x != 0) return;
    const unsigned int sm0 = bullet_smid();
    const unsigned long long t0 = bullet_gtimer();
    unsigned long long prev = t0, now = t0, iters = 0, max_gap = 0, gaps = 0;
    do {
        now = bullet_gtimer();
        const unsigned long long d = now - prev;
        if (d > max_gap) max_gap = d;
        if (d > BULLET_SMID_GAP_NS) gaps += d;
        prev = now;
        ++iters;
    } while (now - t0 < spin_ns);
    unsigned long long* r = rec + (size_t)blockIdx.x * BULLET_SMID_FIELDS;
    r[0] = sm0;
    r[1] = t0;
    r[2] = now;
    r[3] = iters;
    r[4] = max_gap;
    r[5] = gaps;
    r[6] = bullet_smid();
}

// Make the runtime's current device the stream's device (multi-GPU hosts).
static void bullet_use_stream_device(cudaStream_t stream) {
    int dev = -1, cur = -1;
    if (stream != NULL && cudaStreamGetDevice(stream, &dev) == cudaSuccess &&
        cudaGetDevice(&cur) == cudaSuccess && dev != cur)
        cudaSetDevice(dev);
    cudaGetLastError();
}

extern "C" {

// Number of 64-bit fields per block record.
int bullet_smid_fields(void) { return BULLET_SMID_FIELDS; }

// Asynchronous: launches on `stream` and returns; `dev_records` is device memory
// (e.g. a torch int64 tensor's data_ptr()) of blocks * BULLET_SMID_FIELDS values.
// The caller synchronizes the stream before reading it.
int bullet_smid_launch(void* stream, int blocks, int spin_us, void* dev_records) {
    if (blocks <= 0 || spin_us < 0 || dev_records == NULL) return (int)cudaErrorInvalidValue;
    bullet_use_stream_device((cudaStream_t)stream);  // also clears a stale error
    bullet_smid_kernel<<<blocks, 32, 0, (cudaStream_t)stream>>>(
        (unsigned long long)spin_us * 1000ull, (unsigned long long*)dev_records);
    return (int)cudaGetLastError();
}

// Synchronous: launches on `stream`, waits for it, copies the full records to
// `out_records_host` (blocks * BULLET_SMID_FIELDS values).
int bullet_smid_probe_ex(void* stream, int blocks, int spin_us, unsigned long long* out_records_host) {
    if (blocks <= 0 || spin_us < 0 || out_records_host == NULL) return (int)cudaErrorInvalidValue;
    const size_t bytes = (size_t)blocks * BULLET_SMID_FIELDS * sizeof(unsigned long long);
    unsigned long long* host = NULL;
    // Mapped pinned memory: the kernel writes straight to the host, so no device
    // allocation or copy is needed and only `stream` is synchronized.
    cudaError_t err = cudaHostAlloc((void**)&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
    if (err != cudaSuccess) return (int)err;
    memset(host, 0, bytes);
    unsigned long long* dev = NULL;
    err = cudaHostGetDevicePointer((void**)&dev, host, 0);
    if (err == cudaSuccess) err = (cudaError_t)bullet_smid_launch(stream, blocks, spin_us, dev);
    if (err == cudaSuccess) err = cudaStreamSynchronize((cudaStream_t)stream);
    if (err == cudaSuccess) memcpy(out_records_host, host, bytes);
    cudaError_t free_err = cudaFreeHost(host);
    return (int)(err != cudaSuccess ? err : free_err);
}

// The API the design asks for: SM id of every block (blocks ints).
int bullet_smid_probe(void* stream, int blocks, int spin_us, int* out_smids_host) {
    if (blocks <= 0 || out_smids_host == NULL) return (int)cudaErrorInvalidValue;
    const size_t n = (size_t)blocks * BULLET_SMID_FIELDS;
    unsigned long long* rec = (unsigned long long*)malloc(n * sizeof(unsigned long long));
    if (rec == NULL) return (int)cudaErrorMemoryAllocation;
    int err = bullet_smid_probe_ex(stream, blocks, spin_us, rec);
    if (err == 0)
        for (int b = 0; b < blocks; ++b) out_smids_host[b] = (int)rec[(size_t)b * BULLET_SMID_FIELDS];
    free(rec);
    return err;
}

// Message for an error code returned above.
const char* bullet_smid_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }

}  // extern "C"

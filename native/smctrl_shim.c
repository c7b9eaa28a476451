/* Thin run-time shim around a user-supplied libsmctrl.
 *
 * libsmctrl is not part of this project (it carries no license): the user builds
 * it and points us at the shared library (serve.libsmctrl_path or LIBSMCTRL_PATH).
 * This shim dlopens that path, resolves its public stream-mask setters
 *
 *     void libsmctrl_set_stream_mask(void* stream, uint64_t mask);
 *     void libsmctrl_set_stream_mask_ext(void* stream, __uint128_t mask);  (GPUs with > 64 TPCs)
 *
 * (names and signatures as published in libsmctrl.h), and turns "run this stream
 * on TPCs [first, first + num)" into libsmctrl's mask, in which a SET bit
 * DISABLES that TPC.
 *
 * libsmctrl finds a stream's mask through struct offsets that are only known for
 * CUDA 12.0-12.8 drivers and aborts the process on others, so bullet_smctrl_open
 * refuses other drivers before libsmctrl is ever called. No function here aborts:
 * each returns 0 or one of the BULLET_SMCTRL_E* codes below.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define BULLET_SMCTRL_OK 0
#define BULLET_SMCTRL_ELOAD -1      /* dlopen of the libsmctrl path failed */
#define BULLET_SMCTRL_ESYMBOL -2    /* libsmctrl_set_stream_mask not exported */
#define BULLET_SMCTRL_EDRIVER -3    /* libcuda missing, or driver CUDA version outside 12.0-12.8 */
#define BULLET_SMCTRL_ENOTOPEN -4   /* bullet_smctrl_open has not succeeded */
#define BULLET_SMCTRL_ERANGE -5     /* TPC range invalid or more than 128 TPCs */
#define BULLET_SMCTRL_ESTREAM -6    /* NULL stream: libsmctrl needs a created stream */
#define BULLET_SMCTRL_ENOEXT -7     /* > 64 TPCs but libsmctrl_set_stream_mask_ext is missing */

#define BULLET_SMCTRL_MIN_DRIVER 12000 /* CUDA 12.0 */
#define BULLET_SMCTRL_MAX_DRIVER 12080 /* CUDA 12.8 */
#define BULLET_SMCTRL_MAX_TPCS 128

typedef void (*set_mask_fn)(void*, uint64_t);
typedef void (*set_mask_ext_fn)(void*, __uint128_t);
typedef int (*driver_version_fn)(int*);

static void* g_lib = NULL;
static set_mask_fn g_set_mask = NULL;
static set_mask_ext_fn g_set_mask_ext = NULL;
static int g_driver_version = 0;

static void put_err(char* err, int errlen, const char* fmt, ...) {
    if (err == NULL || errlen <= 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, (size_t)errlen, fmt, ap);
    va_end(ap);
}

/* CUDA version of the installed driver (e.g. 12080, 13000), 0 when libcuda cannot be loaded. */
int bullet_smctrl_driver_version(void) {
    void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (cuda == NULL) cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (cuda == NULL) return 0;
    driver_version_fn get = (driver_version_fn)dlsym(cuda, "cuDriverGetVersion");
    int version = 0;
    if (get == NULL || get(&version) != 0) version = 0;
    return version;
}

/* Supported driver range for libsmctrl's stream masks, for messages. */
int bullet_smctrl_min_driver(void) { return BULLET_SMCTRL_MIN_DRIVER; }
int bullet_smctrl_max_driver(void) { return BULLET_SMCTRL_MAX_DRIVER; }

int bullet_smctrl_open(const char* path, char* err, int errlen) {
    if (g_lib != NULL) return BULLET_SMCTRL_OK;
    if (path == NULL || path[0] == '\0') {
        put_err(err, errlen, "no libsmctrl path given");
        return BULLET_SMCTRL_ELOAD;
    }
    void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        const char* why = dlerror();
        put_err(err, errlen, "dlopen failed: %s", why ? why : "unknown error");
        return BULLET_SMCTRL_ELOAD;
    }
    set_mask_fn set_mask = (set_mask_fn)dlsym(lib, "libsmctrl_set_stream_mask");
    set_mask_ext_fn set_mask_ext = (set_mask_ext_fn)dlsym(lib, "libsmctrl_set_stream_mask_ext");
    if (set_mask == NULL) {
        put_err(err, errlen, "%s does not export libsmctrl_set_stream_mask", path);
        dlclose(lib);
        return BULLET_SMCTRL_ESYMBOL;
    }
    int version = bullet_smctrl_driver_version();
    if (version == 0) {
        put_err(err, errlen, "libcuda.so.1 could not be loaded (no NVIDIA driver)");
        dlclose(lib);
        return BULLET_SMCTRL_EDRIVER;
    }
    if (version < BULLET_SMCTRL_MIN_DRIVER || version > BULLET_SMCTRL_MAX_DRIVER) {
        put_err(err, errlen, "driver CUDA version %d.%d is outside libsmctrl's supported CUDA 12.0-12.8",
                version / 1000, (version % 1000) / 10);
        dlclose(lib);
        return BULLET_SMCTRL_EDRIVER;
    }
    g_lib = lib;
    g_set_mask = set_mask;
    g_set_mask_ext = set_mask_ext;
    g_driver_version = version;
    return BULLET_SMCTRL_OK;
}

/* 1 when the library exports libsmctrl_set_stream_mask_ext (needed above 64 TPCs). */
int bullet_smctrl_has_ext(void) { return g_set_mask_ext != NULL; }

/* Disable-mask for "enable TPCs [first, first + num) of total": every other bit
 * up to 128 is set. Pure computation, usable without a GPU (tests). */
int bullet_smctrl_compute_mask(int first_tpc, int num_tpcs, int total_tpcs, uint64_t* lo, uint64_t* hi) {
    if (lo == NULL || hi == NULL) return BULLET_SMCTRL_ERANGE;
    if (total_tpcs <= 0 || total_tpcs > BULLET_SMCTRL_MAX_TPCS || first_tpc < 0 || num_tpcs <= 0 ||
        first_tpc + num_tpcs > total_tpcs)
        return BULLET_SMCTRL_ERANGE;
    __uint128_t enabled = 0;
    for (int t = first_tpc; t < first_tpc + num_tpcs; ++t) enabled |= ((__uint128_t)1) << t;
    __uint128_t disabled = ~enabled;
    *lo = (uint64_t)disabled;
    *hi = (uint64_t)(disabled >> 64);
    return BULLET_SMCTRL_OK;
}

int bullet_smctrl_set_tpc_range(void* stream, int first_tpc, int num_tpcs, int total_tpcs) {
    if (g_lib == NULL) return BULLET_SMCTRL_ENOTOPEN;
    if (stream == NULL) return BULLET_SMCTRL_ESTREAM;
    uint64_t lo = 0, hi = 0;
    int rc = bullet_smctrl_compute_mask(first_tpc, num_tpcs, total_tpcs, &lo, &hi);
    if (rc != BULLET_SMCTRL_OK) return rc;
    if (g_set_mask_ext != NULL) {
        g_set_mask_ext(stream, (((__uint128_t)hi) << 64) | lo);
    } else if (total_tpcs <= 64) {
        g_set_mask(stream, lo);  /* the 64-bit setter disables TPCs >= 64 itself */
    } else {
        return BULLET_SMCTRL_ENOEXT;
    }
    return BULLET_SMCTRL_OK;
}

/* A strict model of the CUDA driver API subset that vllm-dedup calls, over host memory.
 *
 * THIS IS A MODEL OF NVIDIA'S DOCUMENTED CONTRACT, NOT A GPU.  Built at test time as
 * libcuda.so.1 and found by cuda-bindings through the library path (cuda.pathfinder loads the
 * driver by its soname, then resolves every entry point with cuGetProcAddress_v2), so that
 * vllm_dedup/segments/cudadrv.py runs unchanged on a machine without one.
 *
 * What stands for what:
 *   allocation (cuMemCreate)     a memfd of the rounded size, named cudamodel-dev<N>-<tag>
 *   export / import              a duplicate descriptor out / in (the caller keeps its own)
 *   address reservation          a PROT_NONE anonymous mapping, granularity-aligned
 *   cuMemMap                     MAP_FIXED|MAP_SHARED of the descriptor at offset 0, PROT_NONE
 *                                ("all mappings start with no accessibility")
 *   cuMemSetAccess               mprotect (READ, READWRITE, NONE)
 *   unmap / free / release       undo the above; a memfd lives while a descriptor or a mapping
 *                                of it does, exactly the driver's documented lifetime rule
 *   primary contexts             one per device, reference-counted; one stack per thread
 *
 * Sources: CUDA Driver API reference, "Virtual Memory Management", "Primary Context
 * Management", "Context Management" (docs.nvidia.com/cuda/cuda-driver-api); cuda-samples
 * Samples/3_CUDA_Features/memMapIPCDrv.  Where the documentation says "undefined" (double
 * release, invalid handles) the model returns CUDA_ERROR_INVALID_VALUE.  Two rules are
 * stricter than documented and say so: VMM calls need a current context, and a reservation
 * cannot be freed while a mapping is inside it.  tests/cuda_model/README.md lists them all.
 *
 * Environment (read at cuInit): CUDAMODEL_DEVICES (default 2), CUDA_VISIBLE_DEVICES (indices
 * only), CUDAMODEL_UNSUPPORTED (comma-separated: vmm | posix_fd: the device attribute reads 0 and
 * cuMemCreate refuses; create: the attributes say yes but cuMemCreate of an exportable allocation
 * fails INVALID_VALUE, as under WSL2; read_only: cuMemSetAccess refuses PROT_READ),
 * CUDAMODEL_MIG=1 (every device is a MIG instance of one GPU: cuDeviceGetUuid v1 names the
 * parent GPU, v2 the instance), CUDAMODEL_MEMORY_MB (each device's memory, default 81920),
 * CUDAMODEL_TAG (in allocations' memfd names: cudamodel-dev<N>-<tag>).  Test hooks:
 * cudamodel_stats(), cudamodel_fail().
 *
 * Device memory: the bytes in use on a device are those of its live allocations (memfds named
 * cudamodel-dev<N>-<tag>) held by any process this user can inspect in /proc (a descriptor or a
 * mapping), each counted once: the driver's lifetime rule, so an allocation another process
 * still maps stays counted after its creator exits.  Allocations of other tags belong to other
 * test runs (other "machines") and are not counted.  Contexts, kernels and torch's cache cost
 * nothing here.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr, CUmemGenericAllocationHandle;
/* Layouts as cuda.h lays them out (checked against cuda-bindings 13.5's marshalling). */
typedef struct { int type; int id; } CUmemLocation;
typedef struct { int type, requestedHandleTypes; CUmemLocation location; void *win32; unsigned char flags[8]; } CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
typedef struct { char bytes[16]; } CUuuid;

enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, NO_DEVICE = 100, INVALID_DEVICE = 101,
       INVALID_CONTEXT = 201, NOT_FOUND = 500, ILLEGAL_ADDRESS = 700, CONTEXT_IS_DESTROYED = 709,
       NOT_SUPPORTED = 801, STREAM_CAPTURE_IMPLICIT = 906 };
enum { PINNED = 1, LOC_DEVICE = 1, HANDLE_POSIX_FD = 1, ATTR_VMM = 102, ATTR_POSIX_FD = 103 };
enum { PROT_NONE_ = 0, PROT_READ_ = 1, PROT_READWRITE_ = 3 };

#define GRAN ((size_t)2 << 20)        /* CU_MEM_ALLOC_GRANULARITY_MINIMUM of current GPUs */
#define MAXDEV 8
#define MAXOBJ 1024
#define HANDLE_TAG 0x5eed000000000000ULL

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int initialized, ndev, nphys, physical[MAXDEV], no_vmm, no_posix_fd, no_create, no_read_only, mig;
static size_t memory_per_device = (size_t)81920 << 20;
static char tag[32] = "untagged";
struct ctx { int refs; };
static struct ctx ctxs[MAXDEV];   /* CUcontext == &ctxs[i] */
static __thread CUcontext stack[32];
static __thread int depth;
static struct { int live, fd, device, handle_types, imported; unsigned gen; size_t size; } allocs[MAXOBJ];
static struct { int live; uintptr_t va; size_t size; } reservations[MAXOBJ];
static struct { int live, device; uintptr_t va; size_t size; } maps[MAXOBJ];
static long long n_synchronize, n_create, n_create_calls;
static struct { char name[64]; int code, count; } fails[16];

/* ---- test hooks (not driver API) ---------------------------------------------------- */
/* out: retained primary-context references, live allocation handles, live mappings, live
 * reservations, cuCtxSynchronize calls, cuMemCreate successes, this thread's current device
 * (-1: none), this thread's context stack depth, cuMemCreate calls (failed ones included). */
void cudamodel_stats(long long out[9]) {
  pthread_mutex_lock(&mu);
  long long v[9] = {0, 0, 0, 0, n_synchronize, n_create, -1, depth, n_create_calls};
  for (int i = 0; i < MAXDEV; i++) v[0] += ctxs[i].refs;
  for (int i = 0; i < MAXOBJ; i++) { v[1] += allocs[i].live; v[2] += maps[i].live; v[3] += reservations[i].live; }
  if (depth) v[6] = (int)((char *)stack[depth - 1] - (char *)ctxs) / (int)sizeof ctxs[0];
  memcpy(out, v, sizeof v);
  pthread_mutex_unlock(&mu);
}

/* The next `count` calls of `name` return `code` and do nothing else. */
void cudamodel_fail(const char *name, int code, int count) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < 16; i++)
    if (!fails[i].count || !strcmp(fails[i].name, name)) {
      snprintf(fails[i].name, sizeof fails[i].name, "%s", name);
      fails[i].code = code, fails[i].count = count;
      break;
    }
  pthread_mutex_unlock(&mu);
}

static int injected(const char *name, CUresult *rc) {
  for (int i = 0; i < 16; i++)
    if (fails[i].count && !strcmp(fails[i].name, name)) { fails[i].count--; *rc = fails[i].code; return 1; }
  return 0;
}

/* Every entry point runs under the lock and starts with these checks. */
#define ENTER(name) CUresult rc_; pthread_mutex_lock(&mu); if (injected(name, &rc_)) RETURN(rc_)
#define RETURN(x) do { rc_ = (x); pthread_mutex_unlock(&mu); return rc_; } while (0)
#define NEED_INIT() if (!initialized) RETURN(NOT_INITIALIZED)
/* Stricter than documented for the VMM calls (see the file comment). */
#define NEED_CONTEXT() do { if (!depth) RETURN(INVALID_CONTEXT); \
    if (!((struct ctx *)stack[depth - 1])->refs) RETURN(CONTEXT_IS_DESTROYED); } while (0)

static int device_ok(int d) { return d >= 0 && d < ndev; }
static int is_context(CUcontext c) {
  for (int i = 0; i < ndev; i++) if (c == (CUcontext)&ctxs[i]) return 1;
  return 0;
}
static int alloc_index(CUmemGenericAllocationHandle h) {
  unsigned long long i = h & 0xffffffffULL;   /* tag | generation (16 bits) | slot: stale handles fail */
  if ((h & 0xffff000000000000ULL) != HANDLE_TAG || i >= MAXOBJ || !allocs[i].live) return -1;
  return (h >> 32 & 0xffff) == (allocs[i].gen & 0xffff) ? (int)i : -1;
}
static CUmemGenericAllocationHandle new_handle(int i) {
  allocs[i].gen++;
  return HANDLE_TAG | (unsigned long long)(allocs[i].gen & 0xffff) << 32 | (unsigned)i;
}
static int free_slot(int n, size_t stride, const void *base) {   /* first entry whose `live` is 0 */
  for (int i = 0; i < n; i++) if (!*(const int *)((const char *)base + i * stride)) return i;
  return -1;
}

/* Whether the comma-separated `list` holds `word`. */
static int listed(const char *list, const char *word) {
  size_t n = strlen(word);
  for (const char *at = list; at && *at; at = strchr(at, ',') ? strchr(at, ',') + 1 : NULL)
    if (!strncmp(at, word, n) && (at[n] == ',' || !at[n])) return 1;
  return 0;
}

/* ---- device memory: live allocations, wherever they are held ------------------------- */
#define MAXSEEN 8192
static struct { int pid; unsigned long long inode; size_t bytes; } seen[MAXSEEN];
static int nseen;

static void saw(int pid, unsigned long long inode, size_t bytes) {
  for (int k = 0; k < nseen; k++)
    if (seen[k].pid == pid && seen[k].inode == inode) {
      if (seen[k].bytes < bytes) seen[k].bytes = bytes;
      return;
    }
  if (nseen < MAXSEEN) seen[nseen].pid = pid, seen[nseen].inode = inode, seen[nseen++].bytes = bytes;
}

static int names_allocation(const char *name, const char *want, size_t wantlen) {
  return !strncmp(name, want, wantlen) && (name[wantlen] == 0 || name[wantlen] == ' ');
}

/* Fill `seen` with every (process, allocation) pair of physical device `phys` and this tag:
 * descriptors (sized by fstat) and mappings (sized by their length) in every /proc/PID we can
 * read.  Returns the bytes in use on the device: each allocation once, at the largest size
 * seen (a mapping of part of an allocation that nothing else holds counts only that part). */
static size_t scan_device(int phys) {
  char want[96];
  snprintf(want, sizeof want, "/memfd:cudamodel-dev%d-%s", phys, tag);
  size_t wantlen = strlen(want);
  nseen = 0;
  DIR *proc = opendir("/proc");
  struct dirent *pe;
  while (proc && (pe = readdir(proc))) {
    if (pe->d_name[0] < '0' || pe->d_name[0] > '9') continue;
    int pid = atoi(pe->d_name);
    char path[600], link[320];
    snprintf(path, sizeof path, "/proc/%s/fd", pe->d_name);
    DIR *fds = opendir(path);
    struct dirent *fe;
    while (fds && (fe = readdir(fds))) {
      if (fe->d_name[0] == '.') continue;
      snprintf(path, sizeof path, "/proc/%s/fd/%s", pe->d_name, fe->d_name);
      ssize_t n = readlink(path, link, sizeof link - 1);
      struct stat st;
      if (n <= 0) continue;
      link[n] = 0;
      if (names_allocation(link, want, wantlen) && !stat(path, &st)) saw(pid, st.st_ino, (size_t)st.st_size);
    }
    if (fds) closedir(fds);
    snprintf(path, sizeof path, "/proc/%s/maps", pe->d_name);
    FILE *maps = fopen(path, "r");
    char line[512];
    while (maps && fgets(line, sizeof line, maps)) {
      unsigned long long lo, hi, ino;
      char name[320] = "";
      if (sscanf(line, "%llx-%llx %*s %*s %*s %llu %319[^\n]", &lo, &hi, &ino, name) == 4 &&
          names_allocation(name, want, wantlen))
        saw(pid, ino, hi - lo);
    }
    if (maps) fclose(maps);
  }
  if (proc) closedir(proc);
  size_t total = 0;
  for (int k = 0; k < nseen; k++) {
    int first = 1;
    size_t most = seen[k].bytes;
    for (int j = 0; j < nseen; j++)
      if (seen[j].inode == seen[k].inode) {
        if (j < k) first = 0;
        if (seen[j].bytes > most) most = seen[j].bytes;
      }
    if (first) total += most;
  }
  return total;
}

static size_t device_used(int phys) { return scan_device(phys); }

/* ---- initialisation, devices ------------------------------------------------------- */
/* The environment, read once (by cuInit or nvmlInit, whichever comes first). */
static void read_env(void) {
  static int done;
  if (done) return;
  const char *n = getenv("CUDAMODEL_DEVICES"), *uns = getenv("CUDAMODEL_UNSUPPORTED");
  nphys = n ? atoi(n) : 2;
  if (nphys > MAXDEV) nphys = MAXDEV;
  if (nphys < 0) nphys = 0;
  no_vmm = listed(uns, "vmm"), no_posix_fd = listed(uns, "posix_fd");
  no_create = listed(uns, "create"), no_read_only = listed(uns, "read_only");
  mig = getenv("CUDAMODEL_MIG") && !strcmp(getenv("CUDAMODEL_MIG"), "1");
  if (getenv("CUDAMODEL_MEMORY_MB")) memory_per_device = (size_t)atoll(getenv("CUDAMODEL_MEMORY_MB")) << 20;
  if (getenv("CUDAMODEL_TAG")) snprintf(tag, sizeof tag, "%s", getenv("CUDAMODEL_TAG"));
  done = 1;
}

CUresult cuInit(unsigned int flags) {
  ENTER("cuInit");
  if (flags) RETURN(INVALID_VALUE);
  if (!initialized) {
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    read_env();
    int total = nphys;
    ndev = 0;
    if (vis) {   /* indices up to the first invalid entry are visible (CUDA's documented rule) */
      char buf[256], *save = NULL;
      snprintf(buf, sizeof buf, "%s", vis);
      for (char *tok = strtok_r(buf, ",", &save); tok && ndev < MAXDEV; tok = strtok_r(NULL, ",", &save)) {
        char *end;
        long idx = strtol(tok, &end, 10);
        if (end == tok || *end || idx < 0 || idx >= total) break;
        physical[ndev++] = (int)idx;
      }
    } else
      for (; ndev < total; ndev++) physical[ndev] = ndev;
    initialized = 1;
  }
  RETURN(ndev ? OK : NO_DEVICE);
}

CUresult cuDriverGetVersion(int *version) {
  if (!version) return INVALID_VALUE;
  *version = 13000;
  return OK;
}

CUresult cuDeviceGetCount(int *count) {
  ENTER("cuDeviceGetCount"); NEED_INIT();
  if (!count) RETURN(INVALID_VALUE);
  *count = ndev;
  RETURN(OK);
}

CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
  ENTER("cuDeviceGet"); NEED_INIT();
  if (!dev) RETURN(INVALID_VALUE);
  if (!device_ok(ordinal)) RETURN(INVALID_DEVICE);
  *dev = ordinal;
  RETURN(OK);
}

/* v2 (CUDA 11.4 on) names a MIG instance by its own UUID; v1 by its parent GPU's (CUDA Driver
 * API, cuDeviceGetUuid_v2: "returns the MIG UUID for MIG devices"). */
static void uuid_of(int phys, int v2, unsigned char out[16]) {   /* stable per physical device */
  memcpy(out, mig && v2 ? "cudamodelMIG\0\0\0" : "cudamodel\0\0\0\0\0\0", 16);
  out[15] = (unsigned char)(mig && !v2 ? 0x7f : phys);   /* 0x7f: the MIG instances' parent GPU */
}
static CUresult device_uuid(CUuuid *uuid, CUdevice dev, int v2) {
  ENTER(v2 ? "cuDeviceGetUuid_v2" : "cuDeviceGetUuid"); NEED_INIT();
  if (!uuid) RETURN(INVALID_VALUE);
  if (!device_ok(dev)) RETURN(INVALID_DEVICE);
  uuid_of(physical[dev], v2, (unsigned char *)uuid->bytes);
  RETURN(OK);
}
CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) { return device_uuid(uuid, dev, 0); }
CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) { return device_uuid(uuid, dev, 1); }

CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev) {
  ENTER("cuDeviceGetAttribute"); NEED_INIT();
  if (!value) RETURN(INVALID_VALUE);
  if (!device_ok(dev)) RETURN(INVALID_DEVICE);
  if (attrib == ATTR_VMM) *value = !no_vmm;
  else if (attrib == ATTR_POSIX_FD) *value = !no_posix_fd;
  else {
    fprintf(stderr, "cuda model: device attribute %d is not modelled\n", attrib);
    RETURN(INVALID_VALUE);
  }
  RETURN(OK);
}

/* ---- primary contexts and the per-thread context stack ----------------------------- */
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev) {
  ENTER("cuDevicePrimaryCtxRetain"); NEED_INIT();
  if (!ctx) RETURN(INVALID_VALUE);
  if (!device_ok(dev)) RETURN(INVALID_DEVICE);
  ctxs[dev].refs++;
  *ctx = (CUcontext)&ctxs[dev];
  RETURN(OK);
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
  ENTER("cuDevicePrimaryCtxRelease"); NEED_INIT();
  if (!device_ok(dev)) RETURN(INVALID_DEVICE);
  if (!ctxs[dev].refs) RETURN(INVALID_CONTEXT);   /* a release without a retain */
  ctxs[dev].refs--;   /* never pops it from any thread's stack (documented) */
  RETURN(OK);
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
  ENTER("cuDevicePrimaryCtxGetState"); NEED_INIT();
  if (!flags || !active) RETURN(INVALID_VALUE);
  if (!device_ok(dev)) RETURN(INVALID_DEVICE);
  *flags = 0;   /* cuDevicePrimaryCtxSetFlags is not modelled */
  *active = ctxs[dev].refs > 0;
  RETURN(OK);
}

CUresult cuCtxGetCurrent(CUcontext *ctx) {
  ENTER("cuCtxGetCurrent"); NEED_INIT();
  if (!ctx) RETURN(INVALID_VALUE);
  *ctx = depth ? stack[depth - 1] : NULL;
  RETURN(OK);
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
  ENTER("cuCtxSetCurrent"); NEED_INIT();
  if (!ctx) { if (depth) depth--; RETURN(OK); }   /* NULL unbinds the current one */
  if (!is_context(ctx) || !((struct ctx *)ctx)->refs) RETURN(INVALID_CONTEXT);
  if (!depth) depth = 1;
  stack[depth - 1] = ctx;
  RETURN(OK);
}

CUresult cuCtxPushCurrent(CUcontext ctx) {
  ENTER("cuCtxPushCurrent"); NEED_INIT();
  if (!ctx || !is_context(ctx) || !((struct ctx *)ctx)->refs) RETURN(INVALID_CONTEXT);
  if (depth == (int)(sizeof stack / sizeof stack[0])) RETURN(OUT_OF_MEMORY);
  stack[depth++] = ctx;
  RETURN(OK);
}

CUresult cuCtxPopCurrent(CUcontext *ctx) {
  ENTER("cuCtxPopCurrent"); NEED_INIT();
  if (!depth) RETURN(INVALID_CONTEXT);
  CUcontext top = stack[--depth];
  if (ctx) *ctx = top;
  RETURN(OK);
}

CUresult cuCtxSynchronize(void) {
  ENTER("cuCtxSynchronize"); NEED_INIT(); NEED_CONTEXT();
  n_synchronize++;   /* host memory: nothing is ever in flight */
  RETURN(OK);
}

CUresult cuMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
  ENTER("cuMemGetInfo"); NEED_INIT(); NEED_CONTEXT();   /* "available to the current context" */
  if (!free_bytes || !total_bytes) RETURN(INVALID_VALUE);
  int dev = (int)(((struct ctx *)stack[depth - 1]) - ctxs);
  size_t used = device_used(physical[dev]);
  *total_bytes = memory_per_device;
  *free_bytes = used < memory_per_device ? memory_per_device - used : 0;
  RETURN(OK);
}

/* ---- allocations ------------------------------------------------------------------- */
static CUresult check_prop(const CUmemAllocationProp *p) {
  if (!p || p->type != PINNED || p->location.type != LOC_DEVICE) return INVALID_VALUE;
  if (!device_ok(p->location.id)) return INVALID_DEVICE;
  if (p->requestedHandleTypes & ~HANDLE_POSIX_FD) return NOT_SUPPORTED;   /* Linux: POSIX fds only */
  return OK;
}

CUresult cuMemGetAllocationGranularity(size_t *gran, const CUmemAllocationProp *prop, int option) {
  ENTER("cuMemGetAllocationGranularity"); NEED_INIT();
  if (!gran || (option != 0 && option != 1)) RETURN(INVALID_VALUE);
  CUresult rc = check_prop(prop);
  if (rc) RETURN(rc);
  *gran = GRAN;
  RETURN(OK);
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags) {
  __atomic_add_fetch(&n_create_calls, 1, __ATOMIC_SEQ_CST);
  ENTER("cuMemCreate"); NEED_INIT(); NEED_CONTEXT();
  if (!handle || flags) RETURN(INVALID_VALUE);
  CUresult rc = check_prop(prop);
  if (rc) RETURN(rc);
  if (no_vmm || (no_posix_fd && prop->requestedHandleTypes)) RETURN(NOT_SUPPORTED);
  if (no_create && prop->requestedHandleTypes) RETURN(INVALID_VALUE);   /* WSL2: the attribute said yes */
  if (!size || size % GRAN) RETURN(INVALID_VALUE);
  if (device_used(physical[prop->location.id]) + size > memory_per_device) RETURN(OUT_OF_MEMORY);
  int i = free_slot(MAXOBJ, sizeof allocs[0], allocs);
  if (i < 0) RETURN(OUT_OF_MEMORY);
  char name[64];   /* the tag keeps concurrent test runs' allocations apart in /proc */
  snprintf(name, sizeof name, "cudamodel-dev%d-%s", physical[prop->location.id], tag);
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) RETURN(OUT_OF_MEMORY);
  if (ftruncate(fd, (off_t)size)) { close(fd); RETURN(OUT_OF_MEMORY); }
  allocs[i].live = 1, allocs[i].fd = fd, allocs[i].size = size, allocs[i].device = prop->location.id;
  allocs[i].imported = 0;
  allocs[i].handle_types = prop->requestedHandleTypes;
  n_create++;
  *handle = new_handle(i);
  RETURN(OK);
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  ENTER("cuMemRelease"); NEED_INIT(); NEED_CONTEXT();
  int i = alloc_index(handle);
  if (i < 0) RETURN(INVALID_VALUE);   /* unknown or already released (documented: undefined) */
  close(allocs[i].fd);   /* mappings keep the memfd's pages: freed with the last of them */
  allocs[i].live = 0;
  RETURN(OK);
}

CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle handle, int type,
                                      unsigned long long flags) {
  ENTER("cuMemExportToShareableHandle"); NEED_INIT(); NEED_CONTEXT();
  int i = alloc_index(handle);
  if (!out || flags || i < 0) RETURN(INVALID_VALUE);
  if (type != HANDLE_POSIX_FD) RETURN(NOT_SUPPORTED);
  if (!(allocs[i].handle_types & HANDLE_POSIX_FD)) RETURN(INVALID_VALUE);   /* not requested at create */
  int fd = fcntl(allocs[i].fd, F_DUPFD, 0);   /* the reference promises no close-on-exec */
  if (fd < 0) RETURN(OUT_OF_MEMORY);
  *(int *)out = fd;
  RETURN(OK);
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *os_handle, int type) {
  ENTER("cuMemImportFromShareableHandle"); NEED_INIT(); NEED_CONTEXT();
  if (!handle) RETURN(INVALID_VALUE);
  if (type != HANDLE_POSIX_FD) RETURN(NOT_SUPPORTED);
  int fd = (int)(intptr_t)os_handle, dev = -1, phys = -1;
  char link[64], target[128] = "";
  struct stat st;
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, target, sizeof target - 1);
  if (fstat(fd, &st) || n <= 0 || sscanf(target, "/memfd:cudamodel-dev%d", &phys) != 1)
    RETURN(INVALID_VALUE);   /* not a descriptor this driver exported */
  for (int d = 0; d < ndev; d++) if (physical[d] == phys) dev = d;
  if (dev < 0) RETURN(NOT_SUPPORTED);   /* its device is not visible to this process */
  int i = free_slot(MAXOBJ, sizeof allocs[0], allocs);
  int own = i < 0 ? -1 : fcntl(fd, F_DUPFD_CLOEXEC, 0);   /* the caller keeps `fd` */
  if (own < 0) RETURN(OUT_OF_MEMORY);
  allocs[i].live = 1, allocs[i].fd = own, allocs[i].size = (size_t)st.st_size, allocs[i].device = dev;
  allocs[i].handle_types = HANDLE_POSIX_FD, allocs[i].imported = 1;
  *handle = new_handle(i);
  RETURN(OK);
}

/* ---- address reservations and mappings -------------------------------------------- */
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
  ENTER("cuMemAddressReserve"); NEED_INIT(); NEED_CONTEXT();
  (void)addr;   /* only a hint */
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  if (!ptr || flags || !size || size % page || (alignment & (alignment - 1))) RETURN(INVALID_VALUE);
  /* The model gives exactly the alignment asked for and no more: an alignment below the
   * granularity (0 asks for the driver's default, which the reference does not specify: a page
   * here) gets an address that is that far past a granule boundary, so a caller that needs
   * granularity alignment (cuMemMap does) must ask for it (stricter than documented). */
  size_t align = alignment > page ? alignment : page;
  size_t base = align < GRAN ? GRAN : align, skew = align < GRAN ? align : 0;
  int i = free_slot(MAXOBJ, sizeof reservations[0], reservations);
  if (i < 0) RETURN(OUT_OF_MEMORY);
  size_t span = size + base + skew;
  char *raw = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) RETURN(OUT_OF_MEMORY);
  uintptr_t va = (((uintptr_t)raw + base - 1) & ~(uintptr_t)(base - 1)) + skew;
  if (va > (uintptr_t)raw) munmap(raw, va - (uintptr_t)raw);
  munmap((char *)va + size, (uintptr_t)raw + span - va - size);
  reservations[i].live = 1, reservations[i].va = va, reservations[i].size = size;
  *ptr = va;
  RETURN(OK);
}

static int mappings_inside(uintptr_t va, size_t size) {
  int n = 0;
  for (int i = 0; i < MAXOBJ; i++) n += maps[i].live && maps[i].va < va + size && va < maps[i].va + maps[i].size;
  return n;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  ENTER("cuMemAddressFree"); NEED_INIT(); NEED_CONTEXT();
  for (int i = 0; i < MAXOBJ; i++)
    if (reservations[i].live && reservations[i].va == ptr && reservations[i].size == size) {
      if (mappings_inside(ptr, size)) RETURN(INVALID_VALUE);   /* stricter than documented */
      munmap((void *)ptr, size);
      reservations[i].live = 0;
      RETURN(OK);
    }
  RETURN(INVALID_VALUE);   /* must match a reservation exactly (documented) */
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
  ENTER("cuMemMap"); NEED_INIT(); NEED_CONTEXT();
  int a = alloc_index(handle), inside = 0;
  /* offset: "currently must be zero" (CUDA 11/12 reference); sizes: granularity multiples. */
  if (a < 0 || flags || offset || !size || ptr % GRAN || size % GRAN || size > allocs[a].size) RETURN(INVALID_VALUE);
  for (int i = 0; i < MAXOBJ; i++)
    inside |= reservations[i].live && reservations[i].va <= ptr && ptr + size <= reservations[i].va + reservations[i].size;
  if (!inside || mappings_inside(ptr, size)) RETURN(INVALID_VALUE);   /* reserved and not yet mapped */
  /* Observed, not documented: an H200 with driver 580.159.04 refuses to map part of an imported
   * allocation (benchmarks/gpu_check.py, docs/gpu-results.md). */
  if (allocs[a].imported && size != allocs[a].size) RETURN(NOT_SUPPORTED);
  int m = free_slot(MAXOBJ, sizeof maps[0], maps);
  if (m < 0) RETURN(OUT_OF_MEMORY);
  if (mmap((void *)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, allocs[a].fd, 0) == MAP_FAILED) RETURN(OUT_OF_MEMORY);
  maps[m].live = 1, maps[m].va = ptr, maps[m].size = size, maps[m].device = allocs[a].device;
  RETURN(OK);
}

/* The mappings that exactly tile [ptr, ptr + size), or 0 when the range is not whole mappings. */
static int whole_mappings(uintptr_t ptr, size_t size, int *out) {
  int n = 0;
  for (uintptr_t at = ptr; at < ptr + size;) {
    int found = -1;
    for (int i = 0; i < MAXOBJ && found < 0; i++) if (maps[i].live && maps[i].va == at) found = i;
    if (found < 0 || at + maps[found].size > ptr + size) return 0;
    out[n++] = found, at += maps[found].size;
  }
  return n;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
  ENTER("cuMemSetAccess"); NEED_INIT(); NEED_CONTEXT();
  static int hit[MAXOBJ];
  int n = size ? whole_mappings(ptr, size, hit) : 0;
  if (!desc || count != 1 || !n) RETURN(INVALID_VALUE);   /* one device per mapping: no peers modelled */
  const CUmemAccessDesc *d = desc;
  if (d->location.type != LOC_DEVICE || !device_ok(d->location.id)) RETURN(INVALID_DEVICE);
  int prot = d->flags == PROT_READ_ ? PROT_READ : d->flags == PROT_READWRITE_ ? PROT_READ | PROT_WRITE
           : d->flags == PROT_NONE_ ? PROT_NONE : -1;
  if (prot < 0) RETURN(INVALID_VALUE);
  for (int k = 0; k < n; k++) if (maps[hit[k]].device != d->location.id) RETURN(INVALID_DEVICE);
  if (prot == PROT_READ && no_read_only) RETURN(NOT_SUPPORTED);   /* a platform without read-only mappings */
  if (mprotect((void *)ptr, size, prot)) RETURN(INVALID_VALUE);
  RETURN(OK);
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  ENTER("cuMemUnmap"); NEED_INIT(); NEED_CONTEXT();
  static int hit[MAXOBJ];
  int n = size ? whole_mappings(ptr, size, hit) : 0;
  if (!n) RETURN(INVALID_VALUE);   /* "cannot unmap a sub-range" (documented) */
  /* Back to a bare reservation: the memfd loses this reference. */
  if (mmap((void *)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED)
    RETURN(OUT_OF_MEMORY);
  for (int k = 0; k < n; k++) maps[hit[k]].live = 0;
  RETURN(OK);
}

/* ---- errors and entry-point lookup ------------------------------------------------- */
static const struct { int code; const char *name, *text; } errors[] = {
  {OK, "CUDA_SUCCESS", "no error"},
  {INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
  {OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
  {NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
  {NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
  {INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
  {INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
  {NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
  {ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
  {CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
  {NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
  {STREAM_CAPTURE_IMPLICIT, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
   "operation would make the legacy stream depend on a capturing blocking stream"},
};

static CUresult error_string(CUresult code, const char **out, int text) {
  for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
    if (errors[i].code == code) { *out = text ? errors[i].text : errors[i].name; return OK; }
  *out = NULL;
  return INVALID_VALUE;
}
CUresult cuGetErrorName(CUresult code, const char **out) { return out ? error_string(code, out, 0) : INVALID_VALUE; }
CUresult cuGetErrorString(CUresult code, const char **out) { return out ? error_string(code, out, 1) : INVALID_VALUE; }

#define ENTRY(f) {#f, (void *)f}
static const struct { const char *name; void *fn; } entries[] = {
  ENTRY(cuInit), ENTRY(cuDriverGetVersion), ENTRY(cuDeviceGetCount), ENTRY(cuDeviceGet), ENTRY(cuDeviceGetUuid),
  ENTRY(cuDeviceGetUuid_v2), ENTRY(cuDeviceGetAttribute), ENTRY(cuDevicePrimaryCtxRetain),
  ENTRY(cuDevicePrimaryCtxRelease), ENTRY(cuDevicePrimaryCtxGetState), ENTRY(cuMemGetInfo),
  ENTRY(cuCtxGetCurrent), ENTRY(cuCtxSetCurrent), ENTRY(cuCtxPushCurrent), ENTRY(cuCtxPopCurrent),
  ENTRY(cuCtxSynchronize), ENTRY(cuMemGetAllocationGranularity), ENTRY(cuMemCreate), ENTRY(cuMemRelease),
  ENTRY(cuMemExportToShareableHandle), ENTRY(cuMemImportFromShareableHandle), ENTRY(cuMemAddressReserve),
  ENTRY(cuMemAddressFree), ENTRY(cuMemMap), ENTRY(cuMemSetAccess), ENTRY(cuMemUnmap), ENTRY(cuGetErrorName),
  ENTRY(cuGetErrorString),
};

/* Entry points by base name and the CUDA version the caller was built for, as the driver
 * resolves them: cuDeviceGetUuid asked for at 11.4 (11040) or later is cuDeviceGetUuid_v2
 * (cuda-bindings 13 asks at 11040; 12.x asks at 9020 for cuDeviceGetUuid and at 11040 for
 * cuDeviceGetUuid_v2).  Every other versioned variant of this subset (cuCtxPushCurrent_v2,
 * cuDevicePrimaryCtxRelease_v2, cuMemGetInfo_v2, ...) has the same contract as its base name. */
CUresult cuGetProcAddress_v2(const char *symbol, void **fn, int version, unsigned long long flags, int *status) {
  (void)flags;
  if (!symbol || !fn) return INVALID_VALUE;
  if (!strcmp(symbol, "cuDeviceGetUuid") && version >= 11040) symbol = "cuDeviceGetUuid_v2";
  for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++)
    if (!strcmp(entries[i].name, symbol)) {
      *fn = entries[i].fn;
      if (status) *status = 0;   /* CU_GET_PROC_ADDRESS_SUCCESS */
      return OK;
    }
  *fn = NULL;
  if (status) *status = 1;   /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND: calling it raises in Python */
  return NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **fn, int version, unsigned long long flags) {
  return cuGetProcAddress_v2(symbol, fn, version, flags, NULL);
}

/* ---- NVML: the subset benchmarks/gpu_check.py reads ------------------------------------
 * THIS IS A MODEL TOO.  The same library, also named libnvidia-ml.so.1 (tests/cuda_model
 * builds a link), so NVML and the driver model share one state.  Sources: NVML API reference
 * (nvmlInitWithFlags, nvmlDeviceGetHandleByUUID, nvmlDeviceGetMemoryInfo,
 * nvmlDeviceGetComputeRunningProcesses_v3, nvmlErrorString) and nvidia-ml-py's structures.
 * NVML ignores CUDA_VISIBLE_DEVICES: it lists every physical device, named by its UUID (GPU-,
 * or MIG- for a MIG instance).  Used memory is the driver model's (live allocations of the
 * tag).  Per process, the documented figure is "used GPU memory"; what the real NVML counts for
 * an allocation another process created and this one imported is exactly what the GPU check
 * measures, so the model chooses the simplest rule and says so: every allocation a process
 * holds (a descriptor or a mapping) counts in full for it, and only processes holding one are
 * listed (contexts cost nothing here). */
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int pid; unsigned long long usedGpuMemory; unsigned int gpuInstanceId, computeInstanceId; }
  nvmlProcessInfo_t;
typedef struct { int phys; } *nvmlDevice_t;
enum { NVML_SUCCESS = 0, NVML_ERROR_UNINITIALIZED = 1, NVML_ERROR_INVALID_ARGUMENT = 2, NVML_ERROR_NOT_FOUND = 6,
       NVML_ERROR_INSUFFICIENT_SIZE = 7 };
static struct { int phys; } nvml_devices[MAXDEV];
static int nvml_refs;

int nvmlInitWithFlags(unsigned int flags) {
  (void)flags;
  pthread_mutex_lock(&mu);
  read_env();
  for (int i = 0; i < nphys; i++) nvml_devices[i].phys = i;
  nvml_refs++;
  pthread_mutex_unlock(&mu);
  return NVML_SUCCESS;
}
int nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

int nvmlShutdown(void) {
  pthread_mutex_lock(&mu);
  int rc = nvml_refs ? (nvml_refs--, NVML_SUCCESS) : NVML_ERROR_UNINITIALIZED;
  pthread_mutex_unlock(&mu);
  return rc;
}

const char *nvmlErrorString(int result) {
  switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    default: return "Unknown Error";
  }
}

int nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
  pthread_mutex_lock(&mu);
  int rc = NVML_ERROR_NOT_FOUND;
  if (!nvml_refs) rc = NVML_ERROR_UNINITIALIZED;
  else if (!uuid || !device) rc = NVML_ERROR_INVALID_ARGUMENT;
  else
    for (int i = 0; i < nphys && rc; i++) {
      unsigned char b[16];
      char name[64];
      uuid_of(i, 1, b);
      snprintf(name, sizeof name, "%s-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
               mig ? "MIG" : "GPU", b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
               b[13], b[14], b[15]);
      if (!strcmp(name, uuid)) *device = (nvmlDevice_t)&nvml_devices[i], rc = NVML_SUCCESS;
    }
  pthread_mutex_unlock(&mu);
  return rc;
}

static int nvml_device(nvmlDevice_t device) {
  for (int i = 0; i < nphys; i++) if ((void *)device == (void *)&nvml_devices[i]) return i;
  return -1;
}

int nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
  pthread_mutex_lock(&mu);
  int phys = nvml_device(device), rc = NVML_SUCCESS;
  if (!nvml_refs) rc = NVML_ERROR_UNINITIALIZED;
  else if (phys < 0 || !memory) rc = NVML_ERROR_INVALID_ARGUMENT;
  else {
    size_t used = scan_device(phys);
    memory->total = memory_per_device;
    memory->used = used < memory_per_device ? used : memory_per_device;
    memory->free = memory->total - memory->used;
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

int nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_t *infos) {
  pthread_mutex_lock(&mu);
  int phys = nvml_device(device), rc = NVML_SUCCESS;
  if (!nvml_refs) rc = NVML_ERROR_UNINITIALIZED;
  else if (phys < 0 || !count) rc = NVML_ERROR_INVALID_ARGUMENT;
  else {
    scan_device(phys);
    unsigned int n = 0;
    for (int k = 0; k < nseen; k++) {   /* one entry per process, in order of first sight */
      int first = 1;
      for (int j = 0; j < k; j++) if (seen[j].pid == seen[k].pid) first = 0;
      if (!first) continue;
      if (infos && n < *count) {
        unsigned long long bytes = 0;
        for (int j = k; j < nseen; j++) {
          if (seen[j].pid != seen[k].pid) continue;
          size_t most = seen[j].bytes;   /* the allocation's full size, as any holder sees it */
          for (int i = 0; i < nseen; i++) if (seen[i].inode == seen[j].inode && seen[i].bytes > most) most = seen[i].bytes;
          bytes += most;
        }
        infos[n].pid = (unsigned int)seen[k].pid, infos[n].usedGpuMemory = bytes;
        infos[n].gpuInstanceId = infos[n].computeInstanceId = 0xffffffffu;   /* NVML_VALUE_NOT_AVAILABLE */
      }
      n++;
    }
    if (n > *count || (n && !infos)) rc = NVML_ERROR_INSUFFICIENT_SIZE;
    *count = n;
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

/* flash_reasoning.h: the C ABI of flash-reasoning (libflash_reasoning.so).
 *
 * Tree-aware decode attention for C and C++ runtimes, with no Python, PyTorch or Triton in the
 * process. The library loads the ahead-of-time compiled cubins of the package and opens libcuda
 * at run time; it needs no CUDA toolkit to build or link against.
 *
 * Lifecycle:
 *   frContextCreate(artifact folder, device)     loads the manifest of the device's arch
 *   frPlanCreate(context, shape, tree)           plans one decode step, owns its device memory
 *   frPlanRun(plan, q, k_pool, v_pool, out, s)   any number of times (one call per layer)
 *   frPlanUpdate(plan, tree, s)                  next step, when only the leaves grew
 *   frPlanDestroy(plan), frContextDestroy(context)
 * plus frAppendKV (write one token per branch) and frPagedDecode (no sharing).
 *
 * Conventions:
 * - Every function returns an frStatus; FR_OK is 0. On failure, frGetLastError() returns a
 *   message (thread-local, valid until the thread's next call into the library) that names the
 *   argument, what was expected and what was given. A failed call changes no state.
 * - Device pointers are passed as void* (CUdeviceptr values); streams as void* (a CUstream or
 *   cudaStream_t; NULL is the legacy default stream). Device pointers must be 16-byte aligned.
 * - Host arrays are read during the call only.
 * - Run calls are asynchronous on the given stream and never synchronise or allocate, so they
 *   can be captured in a CUDA graph.
 * - Handles (frContext, frPlan) are checked against the live ones before any use: a destroyed,
 *   doubly destroyed, garbage or foreign handle (one of another copy of the library, or a plan
 *   passed as a context) gets FR_INVALID_ARGUMENT with a message saying which, never a crash.
 *   Handles are opaque values, not addresses: never dereference one. They are not reused, so
 *   a destroyed handle never names a newer object.
 * - A context may be shared by threads; a plan is used by one thread at a time. Destroying a
 *   context or plan while another thread is inside a call on it is safe: that call finishes on
 *   the live object, later calls get FR_INVALID_ARGUMENT.
 * - The caller's thread must have the device's context current, or none (then the device's
 *   primary context is made current, the one the CUDA runtime uses).
 *
 * The pool layout is [num_blocks, block_size, num_kv_heads, head_dim] for K and for V (one
 * layer), q and out are [num_branches, num_qo_heads, head_dim], all contiguous, in the dtype of
 * the shape. Block id 0 is a valid block like any other.
 *
 * This header is plain C99 and C++: no macros in declarations, so cffi can parse it once the
 * lines starting with '#' and the extern "C" braces are dropped.
 */
#ifndef FLASH_REASONING_H_
#define FLASH_REASONING_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum frStatus {
  FR_OK = 0,
  FR_INVALID_ARGUMENT = 1,   /* bad caller input: null pointer, size, dtype, shape */
  FR_NOT_FOUND = 2,          /* artifact folder, manifest or kernel missing */
  FR_INVALID_MANIFEST = 3,   /* manifest.json unreadable or from another package version */
  FR_CORRUPTED_ARTIFACT = 4, /* a cubin's sha256 differs from the manifest's */
  FR_DRIVER_UNAVAILABLE = 5, /* libcuda cannot be loaded (no NVIDIA driver) or lacks a needed entry */
  FR_CUDA_ERROR = 6,         /* a driver call failed (the message names it) */
  FR_UNSUPPORTED_ARCH = 7,   /* no compiled arch serves this device */
  FR_IO_ERROR = 8,           /* a file exists but cannot be read */
  FR_OUT_OF_MEMORY = 9,      /* host or device memory exhausted */
  FR_PLAN_MISMATCH = 10,     /* frPlanUpdate: the tree changed beyond leaf growth; re-plan */
  FR_UNSUPPORTED = 11        /* head_dim or dtype not compiled for this arch */
} frStatus;

typedef enum frDtype { FR_FLOAT16 = 1, FR_BFLOAT16 = 2 } frDtype;

typedef struct frContext_t* frContext;
typedef struct frPlan_t* frPlan;

/* The attention call a plan or decode serves. sm_scale 0 means 1/sqrt(head_dim); any other
 * value, negative included, is used as given if |sm_scale| is at most the bound under which
 * float32 scores of float16 inputs cannot overflow (the error message names it). */
typedef struct frAttentionShape {
  int32_t num_qo_heads;
  int32_t num_kv_heads; /* divides num_qo_heads */
  int32_t head_dim;     /* 64, 128 or 256 */
  frDtype dtype;
  int32_t block_size; /* tokens per KV block */
  int32_t num_blocks; /* blocks in each pool: every table entry a plan reads is below it */
  float sm_scale;
} frAttentionShape;

/* The branches of one decode step, on the host. Branch i holds lengths[i] tokens whose KV
 * blocks are block_tables[i * table_stride + j], j < ceil(lengths[i] / block_size).
 * Sharing is read from the tables: branches listing the same block at the same column hold
 * the same tokens there, up to the shorter branch's length (a paged cache with copy-on-write
 * keeps this true; a block is never written while two branches list it). */
typedef struct frTree {
  int32_t num_branches;
  const int32_t* lengths;      /* [num_branches], each >= 0 */
  const int32_t* block_tables; /* [num_branches, table_stride] */
  int32_t table_stride;
} frTree;

/* Speculative-tree verification: a row's last `tokens` tokens (0 to FR_MAX_DRAFT_TOKENS) are a
 * draft, of which the row attends those whose bit is set in `allowed` (bit k: the k-th of
 * them), and every token before them. A causal row is {0, 0}. */
#define FR_MAX_DRAFT_TOKENS 64
typedef struct frDraftMask {
  int64_t tokens;
  uint64_t allowed;
} frDraftMask;

/* What a plan decided (for logs and tests). The tree's fields (nodes, computed nodes, unique
 * tokens) describe it at creation; logical_tokens follows frPlanUpdate's lengths. */
typedef struct frPlanInfo {
  int32_t num_branches;
  int32_t num_nodes;      /* segments of the shared-prefix tree */
  int32_t computed_nodes; /* segments read once for all the branches below them */
  int32_t num_launches;   /* kernels per frPlanRun */
  int32_t max_blocks;     /* table columns the plan holds (growth room included) */
  int64_t unique_tokens;  /* distinct KV tokens of the tree at creation */
  int64_t logical_tokens; /* sum of the branch lengths */
  size_t workspace_bytes; /* device memory the plan owns */
} frPlanInfo;

/* ---- errors and version ------------------------------------------------------------- */
const char* frGetLastError(void);
const char* frStatusName(frStatus status);
const char* frVersion(void);

/* ---- context -------------------------------------------------------------------------- */
/* artifact_root holds one folder per arch (sm80/, sm89/, sm90/), each with manifest.json and
 * cubins: the package's flash_reasoning/_artifacts. Selects the arch serving `device`.
 * Both constructors refuse a manifest whose "arch" differs from its folder's name
 * (FR_INVALID_MANIFEST), and artifact files that are not regular files, such as a FIFO or a
 * link to a device (FR_IO_ERROR), before opening them for a blocking or endless read. */
frStatus frContextCreate(const char* artifact_root, int device, frContext* out);
/* A context for planning without a GPU: `arch`, "sm" and digits (e.g. "sm90"), names the
 * folder directly under artifact_root to read; anything else (e.g. "../sm90") is
 * FR_INVALID_ARGUMENT. Plans validate and plan (frPlanGetInfo works) but allocate nothing;
 * runs, updates, appends and memory calls return FR_DRIVER_UNAVAILABLE. Plans assume 132 SMs
 * (an H100). */
frStatus frContextCreateHostOnly(const char* artifact_root, const char* arch, frContext* out);
/* Destroys the context and every plan made from it that is still alive: later calls on those
 * plans get FR_INVALID_ARGUMENT, frPlanDestroy included (whatever the order of the destroy
 * calls, nothing leaks). NULL is a no-op; a context destroyed already is FR_INVALID_ARGUMENT. */
frStatus frContextDestroy(frContext context);
/* The arch folder in use, e.g. "sm90"; valid while the context lives. */
frStatus frContextArch(frContext context, const char** arch);

/* ---- tree attention: plan, run, update ----------------------------------------------- */
/* Plans attention of one query per branch over its whole path, reading each shared token
 * once per run. extra_blocks: table columns kept beyond the longest branch, so branches can
 * grow by that many blocks through frPlanUpdate. Copies the tables to the device (synchronous). */
frStatus frPlanCreate(frContext context, const frAttentionShape* shape, const frTree* tree, int32_t extra_blocks,
                      frPlan* out);
/* frPlanCreate with a draft mask per branch (masks[num_branches]): branch i's last
 * masks[i].tokens tokens are read as masks[i] allows (a draft tree's rows: one row per draft
 * token, its allowed bits its ancestors and itself). Through frPlanUpdate the masked tokens stay
 * each branch's last. NULL masks: frPlanCreate. */
frStatus frPlanCreateWithDraftMasks(frContext context, const frAttentionShape* shape, const frTree* tree,
                                    const frDraftMask* masks, int32_t extra_blocks, frPlan* out);
frStatus frPlanGetInfo(frPlan plan, frPlanInfo* info);
/* The manifest name of the kernel that launch `launch` (0 <= launch < num_launches) of
 * frPlanRun runs: the partial launches, then the final or merge kernel (for logs and tests:
 * which specialization dispatch picked, e.g. one compiled for 16-token pages). Kernels are
 * picked when the plan is created and kept through frPlanUpdate, so a CUDA graph captured
 * from frPlanRun stays valid. Valid while the plan lives. */
frStatus frPlanKernelName(frPlan plan, int32_t launch, const char** name);
/* out[i] = softmax(q[i] K_i^T * sm_scale) V_i over branch i's tokens, in one layer's pools. `out`
 * must not overlap `q` (the kernels read q while they write out): FR_INVALID_ARGUMENT. */
frStatus frPlanRun(frPlan plan, const void* q, const void* k_pool, const void* v_pool, void* out, void* stream);
/* The next decode step without re-planning: same branches, each at least as long as before
 * and holding the same blocks over the ranges the plan reads once for several branches.
 * Otherwise FR_PLAN_MISMATCH (the plan is unchanged: create a new one). A tree invalid in
 * itself (a negative count, length or stride, NULL arrays) is FR_INVALID_ARGUMENT, checked
 * before the tree is compared with the plan. Enqueues the copy of the new lengths and tables
 * on `stream`, ordered before later runs on it. */
frStatus frPlanUpdate(frPlan plan, const frTree* tree, void* stream);
/* NULL is a no-op; a plan destroyed already (by frPlanDestroy or with its context) is
 * FR_INVALID_ARGUMENT. */
frStatus frPlanDestroy(frPlan plan);

/* ---- KV cache writes and paged decode ----------------------------------------------- */
/* Writes one token's K and V (num_tokens rows of [num_kv_heads, head_dim], contiguous, the
 * pools' 16-bit dtype) into flat slots (int64 on the device: block * block_size + offset). */
frStatus frAppendKV(frContext context, void* k_pool, void* v_pool, const void* slots, const void* k_new,
                    const void* v_new, int64_t num_tokens, int32_t num_kv_heads, int32_t head_dim, void* stream);

/* Decode over separate block tables (no sharing): block_tables int32 [num_seqs, max_blocks]
 * and seq_lens int32 [num_seqs] on the device, each length <= max_blocks * block_size; `out`
 * apart from `q`.
 * Long sequences are split along their length when few sequences cannot fill the GPU; the
 * split needs `workspace` of frPagedDecodeWorkspaceSize bytes (NULL with size 0 disables it). */
frStatus frPagedDecodeWorkspaceSize(frContext context, const frAttentionShape* shape, int32_t num_seqs,
                                    int32_t max_blocks, size_t* bytes);
frStatus frPagedDecode(frContext context, const frAttentionShape* shape, const void* q, const void* k_pool,
                       const void* v_pool, const void* block_tables, const void* seq_lens, int32_t num_seqs,
                       int32_t max_blocks, void* out, void* workspace, size_t workspace_bytes, void* stream);

/* ---- device memory (for runtimes without the CUDA runtime, and the example) -------- */
frStatus frDeviceAlloc(frContext context, size_t bytes, void** ptr);
frStatus frDeviceFree(frContext context, void* ptr);
frStatus frCopyToDevice(frContext context, void* dst, const void* src, size_t bytes);
frStatus frCopyToHost(frContext context, void* dst, const void* src, size_t bytes);
/* Waits for all work on `stream`. */
frStatus frStreamSynchronize(frContext context, void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FLASH_REASONING_H_ */

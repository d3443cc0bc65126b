/* ort_api.h: the few functions of onnxruntime's C API that cartpole_onnx.c calls, declared
   here so that the build needs onnxruntime's shared library only (the onnxruntime wheel
   ships it; no package registry reachable here ships the C header).

   The C API is one exported function, OrtGetApiBase(); everything else is a function
   pointer in the table struct OrtApi that GetApi(version) returns. The table only grows at
   its end from one version to the next (a member's index never changes), so a table
   declared up to the last member used, with unused members as void* slots, matches the
   library of any version since: we ask for version ORT_API_VERSION below (onnxruntime
   1.13), and the library answers for every version up to its own (1.32 in the wheel). The
   indices were counted in onnxruntime's include/onnxruntime/core/session/onnxruntime_c_api.h
   (API version 13); tests/test_c_client.py runs every function here against the wheel's
   library, and the conformance checker there recomputes output 0 with Python's onnxruntime.

   Using another onnxruntime? Compile with its real header instead:
       make -C clients/c onnx ORT_INCLUDE_DIR=/path/to/onnxruntime/include
   (cartpole_onnx.c uses only the names declared here, which are the real header's). */
#ifndef SHMRL_ORT_API_H
#define SHMRL_ORT_API_H

#ifdef SHMRL_ORT_REAL_HEADER
#include <onnxruntime_c_api.h>
#else
#include <stddef.h>
#include <stdint.h>

#define ORT_API_VERSION 13

typedef struct OrtEnv OrtEnv;
typedef struct OrtStatus OrtStatus;
typedef struct OrtMemoryInfo OrtMemoryInfo;
typedef struct OrtSession OrtSession;
typedef struct OrtValue OrtValue;
typedef struct OrtRunOptions OrtRunOptions;
typedef struct OrtSessionOptions OrtSessionOptions;

typedef enum ONNXTensorElementDataType {
    ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED = 0,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT = 1
} ONNXTensorElementDataType;

typedef enum OrtLoggingLevel {
    ORT_LOGGING_LEVEL_VERBOSE, ORT_LOGGING_LEVEL_INFO, ORT_LOGGING_LEVEL_WARNING, ORT_LOGGING_LEVEL_ERROR,
    ORT_LOGGING_LEVEL_FATAL
} OrtLoggingLevel;

typedef enum GraphOptimizationLevel {
    ORT_DISABLE_ALL = 0, ORT_ENABLE_BASIC = 1, ORT_ENABLE_EXTENDED = 2, ORT_ENABLE_ALL = 99
} GraphOptimizationLevel;

typedef enum OrtAllocatorType { OrtInvalidAllocator = -1, OrtDeviceAllocator = 0, OrtArenaAllocator = 1 } OrtAllocatorType;
typedef enum OrtMemType { OrtMemTypeCPUInput = -2, OrtMemTypeCPUOutput = -1, OrtMemTypeDefault = 0 } OrtMemType;

/* Each member's index in the table is in its comment; a gap's slots are members not used. */
typedef struct OrtApi {
    void *unused_0_1[2];                                                                      /* 0-1 */
    const char *(*GetErrorMessage)(const OrtStatus *status);                                  /* 2 */
    OrtStatus *(*CreateEnv)(OrtLoggingLevel log_severity_level, const char *logid, OrtEnv **out);  /* 3 */
    void *unused_4_7[4];                                                                      /* 4-7 */
    OrtStatus *(*CreateSessionFromArray)(const OrtEnv *env, const void *model_data, size_t model_data_length,
                                         const OrtSessionOptions *options, OrtSession **out); /* 8 */
    OrtStatus *(*Run)(OrtSession *session, const OrtRunOptions *run_options, const char *const *input_names,
                      const OrtValue *const *inputs, size_t input_len, const char *const *output_names,
                      size_t output_names_len, OrtValue **outputs);                         /* 9 */
    OrtStatus *(*CreateSessionOptions)(OrtSessionOptions **options);                          /* 10 */
    void *unused_11_22[12];                                                                   /* 11-22 */
    OrtStatus *(*SetSessionGraphOptimizationLevel)(OrtSessionOptions *options,
                                                   GraphOptimizationLevel graph_optimization_level);  /* 23 */
    OrtStatus *(*SetIntraOpNumThreads)(OrtSessionOptions *options, int intra_op_num_threads); /* 24 */
    OrtStatus *(*SetInterOpNumThreads)(OrtSessionOptions *options, int inter_op_num_threads); /* 25 */
    void *unused_26_48[23];                                                                   /* 26-48 */
    OrtStatus *(*CreateTensorWithDataAsOrtValue)(const OrtMemoryInfo *info, void *p_data, size_t p_data_len,
                                                 const int64_t *shape, size_t shape_len,
                                                 ONNXTensorElementDataType type, OrtValue **out);  /* 49 */
    void *unused_50_68[19];                                                                   /* 50-68 */
    OrtStatus *(*CreateCpuMemoryInfo)(OrtAllocatorType type, OrtMemType mem_type, OrtMemoryInfo **out);  /* 69 */
    void *unused_70_91[22];                                                                   /* 70-91 */
    void (*ReleaseEnv)(OrtEnv *input);                                                        /* 92 */
    void (*ReleaseStatus)(OrtStatus *input);                                                  /* 93 */
    void (*ReleaseMemoryInfo)(OrtMemoryInfo *input);                                          /* 94 */
    void (*ReleaseSession)(OrtSession *input);                                                /* 95 */
    void (*ReleaseValue)(OrtValue *input);                                                    /* 96 */
    void *unused_97_99[3];                                                                    /* 97-99 */
    void (*ReleaseSessionOptions)(OrtSessionOptions *input);                                  /* 100 */
} OrtApi;

typedef struct OrtApiBase {
    const OrtApi *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

#ifdef __cplusplus
extern "C" {
#endif
const OrtApiBase *OrtGetApiBase(void);
#ifdef __cplusplus
}
#endif

#endif /* SHMRL_ORT_REAL_HEADER */
#endif /* SHMRL_ORT_API_H */

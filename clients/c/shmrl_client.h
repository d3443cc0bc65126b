/* shmrl_client.h: an RLlink client for shmrl in one C99 header.

   A simulator written in C or C++ (a game engine, a robot simulator) steps its envs and
   sends their observations; the shmrl server runs the policy for all clients in one
   batched forward pass, answers with actions, and trains on the steps (server-side
   inference, below). A client that runs the policy itself (client-side inference, with
   an ONNX runtime of its own) finds the protocol's side of it at "client-side inference"
   further down: the model's bytes, chunks, EPISODES_AND_GET_STATE. No dependency beyond
   libc, libm and POSIX sockets (Linux, macOS, the BSDs). Windows is not supported
   (winsock differs in socket types, errors and timeouts; port shmrl__* socket calls).

   Use: in ONE .c file, before any other #include (the implementation needs POSIX):
       #define SHMRL_CLIENT_IMPLEMENTATION
       #include "shmrl_client.h"
   Every other file includes it without the define.

   The loop (clients/c/cartpole.c is a complete example):
       shmrl_options opt;  shmrl_client c;  shmrl_step s;
       shmrl_options_init(&opt);  opt.port = 5556;  opt.client_name = "sim-0";
       if (shmrl_open(&c, &opt) != SHMRL_OK) { puts(shmrl_error(&c)); exit(1); }
       reset every env into obs;  s.k = K;  s.obs = obs;  s.actions = actions;  ...
       for (;;) {
           if (shmrl_act(&c, &s) != SHMRL_OK) { shmrl_reconnect(&c) ... reset envs }
           step env k with actions[k]; rewards[k], terminateds[k], truncateds[k] are its
           outcome; an env whose episode ended: its last obs into final_obs[k], reset it,
           its first obs into obs[k]
       }
       shmrl_close(&c);

   What goes over the wire (docs/RLLINK.md has every byte):
   - frames: 8 ASCII digits (the body's length) + body; a body is a JSON object or the
     binary codec (0x93 "RLB", u32 LE head length, JSON head, arrays as raw LE blocks).
   - handshake: PING {codecs, client_name, auth_token, inference} -> PONG {codec,
     heartbeat_s, inference}; GET_CONFIG -> SET_CONFIG {env_steps_per_sample,
     observation_shape, observation_dtype, action_space}.
   - each step: ACT {obs [K, ...], rewards [K], terminateds [K], truncateds [K], final_obs}
     -> ACTIONS {actions [K] or [K, d], weights_seq_no}. A connection's first ACT has obs
     only. The reply may be held while the learner trains (strict on-policy): the reply
     timeout allows for it.
   - HEARTBEAT: a client that agreed on the binary codec sends some frame at least every
     heartbeat_s; each ACT counts, and shmrl_heartbeat() sends one when an engine pauses.

   Reconnecting: shmrl_open and shmrl_reconnect try to connect and handshake up to
   1 + max_retries times (max_retries < 0: forever). Before retry i (1, 2, ...) they wait
   min(backoff_s * 2^(i-1), backoff_max_s) seconds times a random factor in [0.5, 1)
   (so that many clients do not come back in step). A refusal that a retry cannot cure
   (the server does not offer server-side inference, an observation type this client
   cannot send) is returned at once. After a reconnect the server has forgotten the
   connection: the next ACT is a first one (shmrl_act leaves its rewards out); reset the
   envs, or not, as you like.

   Errors: every function returns a shmrl_status; shmrl_error(c) says what happened in
   words. After SHMRL_ERR_IO, _CLOSED, _TIMEOUT or _PROTOCOL the connection is closed:
   call shmrl_reconnect. No global state: one shmrl_client per connection; a client is
   used by one thread at a time. Observations are float32 (dtype "<f4", any shape);
   actions are Discrete, MultiDiscrete (int64) or Box (float32, clipped to the bounds). */
#if defined(SHMRL_CLIENT_IMPLEMENTATION) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200112L   /* sockets, clock_gettime: effective before the first system header */
#endif
#ifndef SHMRL_CLIENT_H
#define SHMRL_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SHMRL_MAX_DIMS 8          /* observation dimensions */
#define SHMRL_MAX_ACTION_DIM 64   /* MultiDiscrete or Box components */
#define SHMRL_MAX_ENVS 4096       /* K, envs per ACT */
#define SHMRL_ERROR_LEN 256

/* shmrl_options_init's defaults. The reply timeout is every shmrl client's (shmrl.sim's
   --timeout, cartpole.js's; REPLY_TIMEOUT_S in shmrl/config/faces.py, which
   tests/test_client_numbers.py holds this to). The retries give up on a server that went
   away after 0.1 + 0.2 + 0.4 + 0.8 + 1.6 = 3.1 s of waits at most, within GIVE_UP_S there. */
#define SHMRL_CONNECT_TIMEOUT_S 5
#define SHMRL_REPLY_TIMEOUT_S 600
#define SHMRL_MAX_RETRIES 5
#define SHMRL_BACKOFF_S 0.1
#define SHMRL_BACKOFF_MAX_S 5

typedef enum shmrl_status {
    SHMRL_OK = 0,
    SHMRL_ERR_ARG,          /* a bad argument (K, a NULL array, a NaN observation, ...) */
    SHMRL_ERR_CONNECT,      /* no connection (refused, unreachable, gave up retrying) */
    SHMRL_ERR_IO,           /* the socket failed while sending or receiving */
    SHMRL_ERR_CLOSED,       /* the server closed the connection */
    SHMRL_ERR_TIMEOUT,      /* no reply within reply_timeout_s */
    SHMRL_ERR_PROTOCOL,     /* a reply that breaks RLlink */
    SHMRL_ERR_REFUSED,      /* the server does not serve actions (no "inference" in its PONG) */
    SHMRL_ERR_UNSUPPORTED,  /* spaces this client cannot handle (Dict observations, ...) */
    SHMRL_ERR_NOMEM
} shmrl_status;

typedef enum shmrl_action_type {
    SHMRL_ACTION_UNKNOWN = 0, SHMRL_DISCRETE, SHMRL_MULTI_DISCRETE, SHMRL_BOX
} shmrl_action_type;

/* How a Box's output 0 is sampled (RLLINK.md section 4.2): RLlib's Gaussian unless SET_CONFIG
   or SET_STATE says "action_dist" (a --algo sac learner: the squashed Gaussian, uniform
   during its warm-up). shmrl_sample_box samples each. */
typedef enum shmrl_action_dist {
    SHMRL_DIST_GAUSSIAN = 0, SHMRL_DIST_SQUASHED_GAUSSIAN, SHMRL_DIST_UNIFORM
} shmrl_action_dist;


/* What the server's SET_CONFIG said (read only). */
typedef struct shmrl_config {
    long env_steps_per_sample;
    int obs_ndim;
    long obs_shape[SHMRL_MAX_DIMS];
    long obs_size;                          /* floats per observation: the shape's product */
    shmrl_action_type action_type;
    long action_n;                          /* Discrete: n ... */
    long action_start;                      /* ... the env's actions start .. start + n - 1 (gymnasium's start; the wire carries 0 .. n - 1) */
    int action_dim;                         /* values per action: 1 for a Discrete */
    long nvec[SHMRL_MAX_ACTION_DIM];        /* MultiDiscrete */
    float low[SHMRL_MAX_ACTION_DIM], high[SHMRL_MAX_ACTION_DIM];  /* Box */
    shmrl_action_dist action_dist;          /* SET_CONFIG's action_dist (absent: RLlib's Gaussian) */
} shmrl_config;

typedef struct shmrl_options {
    const char *host;          /* "127.0.0.1" */
    int port;                  /* 5556 */
    const char *client_name;   /* NULL: none; else 1-64 printable ASCII characters */
    const char *auth_token;    /* NULL: none (the server's --auth-token) */
    int binary;                /* 1 (default): offer the binary codec; 0: JSON only */
    int server_inference;      /* 1 (default): ask for server-side inference; 0: handshake only */
    int action_dists;          /* 1: this client samples SAC's squashed Gaussian and uniform as the learner says
                                  (shmrl_sample_box), and its PING lists them ("action_dists"), which a --algo sac
                                  learner requires of a client that runs the policy itself (RLLINK.md 3.1); 0 (default) */
    double connect_timeout_s;  /* SHMRL_CONNECT_TIMEOUT_S, 5 */
    double reply_timeout_s;    /* SHMRL_REPLY_TIMEOUT_S, 600: a strict on-policy server holds replies while it trains */
    int max_retries;           /* SHMRL_MAX_RETRIES, 5: failed attempts in a row tolerated; < 0: retry forever */
    double backoff_s;          /* SHMRL_BACKOFF_S, 0.1: the first wait between attempts, then doubled ... */
    double backoff_max_s;      /* SHMRL_BACKOFF_MAX_S, 5: ... up to this */
    size_t max_reply_bytes;    /* 64 MiB: a longer reply is a protocol error */
    long obs_size;             /* 0: the server's SET_CONFIG says; else floats per observation */
    shmrl_config declare;      /* obs_ndim 0 (default): none; else the spaces its GET_CONFIG declares (obs_ndim,
                                  obs_shape; action_type with action_n [, action_start], nvec or low/high, and
                                  action_dim), so that a learner started without --env trains them (RLLINK.md 3.2) */
} shmrl_options;

/* One ACT and its ACTIONS: the caller's arrays, none copied or kept. */
typedef struct shmrl_step {
    int k;                              /* envs; fixed for a connection (its first ACT's) */
    const float *obs;                   /* [k * obs_size]: each env's current observation */
    const float *rewards;               /* [k]: the last step's rewards (ignored on a first ACT) */
    const unsigned char *terminateds;   /* [k], 0 or 1 */
    const unsigned char *truncateds;    /* [k], 0 or 1 */
    const float *final_obs;             /* [k * obs_size]: last obs of truncated episodes (other rows unread) */
    int64_t *actions;                   /* out [k * action_dim]: Discrete, MultiDiscrete */
    float *box_actions;                 /* out [k * action_dim]: Box, clipped to low..high */
} shmrl_step;

typedef struct shmrl_client {
    shmrl_options opt;           /* a copy; the strings below are copies too */
    char host[256], name[65], token[1024];
    int fd;                      /* -1 while not connected */
    int binary;                  /* the server agreed on the binary codec */
    int inference;               /* the server granted server-side inference */
    double heartbeat_s;          /* 0: no heartbeat owed */
    double last_send;            /* monotonic seconds of the last frame sent */
    long sessions;               /* handshakes completed since shmrl_open */
    long long acts;              /* ACTIONS received since shmrl_open */
    int fresh;                   /* the next ACT is this connection's first */
    int k;                       /* this connection's envs per ACT (0 before its first) */
    long long weights_seq_no;    /* of the last ACTIONS */
    shmrl_config config;
    shmrl_action_dist action_dist;   /* how to sample output 0 now: the last SET_STATE's action_dist, else SET_CONFIG's */
    unsigned char *wbuf, *rbuf;  /* frame being written; reply read */
    size_t wcap, rcap;
    uint64_t rng;                /* backoff jitter */
    char error[SHMRL_ERROR_LEN];
} shmrl_client;

void shmrl_options_init(shmrl_options *opt);
/* Copy the options, connect (retrying), handshake. On failure the client holds the
   message and must still be shmrl_close()d. */
shmrl_status shmrl_open(shmrl_client *c, const shmrl_options *opt);
shmrl_status shmrl_reconnect(shmrl_client *c);
shmrl_status shmrl_act(shmrl_client *c, shmrl_step *s);
/* Send a HEARTBEAT if one is due (nothing sent for heartbeat_s); env_steps: stepped so far. */
shmrl_status shmrl_heartbeat(shmrl_client *c, long long env_steps);
/* Low level, for requests this header has no function for: send one JSON body; read one
   reply (its JSON text or binary head in *head, the binary data section in *data). */
shmrl_status shmrl_send_json(shmrl_client *c, const char *json);
shmrl_status shmrl_recv(shmrl_client *c, const char **head, size_t *head_len,
                        const unsigned char **data, size_t *data_len);
void shmrl_close(shmrl_client *c);   /* close the socket, free the buffers; reusable by shmrl_open */
const char *shmrl_error(const shmrl_client *c);
const char *shmrl_status_name(shmrl_status s);

/* ---------------------------------------------------------------- client-side inference
   For a client that runs the policy itself (options.server_inference = 0): the protocol
   side only, with no ONNX runtime in this header (clients/c/cartpole_onnx.c pairs it with
   onnxruntime's C library). GET_STATE and EPISODES_AND_GET_STATE's SET_STATE give the ONNX
   model's bytes (onnx_file: base64 of a gzip member of stored deflate blocks, as shmrl
   sends it); a shmrl_rollout records K envs' steps as chunks (RLLINK.md section 4) and
   shmrl_send_rollout sends them as one EPISODES_AND_GET_STATE (binary columns, or JSON). */

typedef struct shmrl_model {
    unsigned char *bytes;        /* the ONNX file (malloc'd; shmrl_model_free) */
    size_t len, cap;
    long long weights_seq_no;    /* its version; -1 before the first */
} shmrl_model;

/* Each env's open chunk and the chunks it finished since the last message, in one block
   per env: rows of obs (a chunk's own rows in turn), its steps, and the chunks' ends. */
typedef struct shmrl__env_chunks {
    float *obs, *dist, *rewards, *logp;
    int64_t *actions;            /* Discrete and MultiDiscrete */
    float *box_actions;          /* Box */
    long rows, steps;            /* recorded since the last message */
    long nchunks;                /* chunks closed since the last message (the open one not counted) */
    long *lengths;               /* [steps_per_env + 1]: steps of each closed chunk */
    unsigned char *terminated, *truncated;
    int64_t *ids;                /* [steps_per_env + 2]: each chunk's episode_id, the open one's last */
    long open_steps;             /* steps of the open chunk */
} shmrl__env_chunks;

typedef struct shmrl_rollout {
    int k, action_dim, box;      /* envs; values per action; 1: float actions (Box) */
    long obs_size, dist_size;    /* floats per observation, per row of output 0 */
    long steps_per_env;          /* steps each env may record per message */
    int64_t next_id;             /* episode ids: unique in the process */
    shmrl__env_chunks *env;
} shmrl_rollout;

/* GET_STATE -> SET_STATE: the model into m (its buffer reused). */
shmrl_status shmrl_get_state(shmrl_client *c, shmrl_model *m);
void shmrl_model_free(shmrl_model *m);
/* onnx_file's text (base64 of a gzip of stored deflate blocks) -> the model's bytes into
   m->bytes. Returns 0 with the reason in err (err_len bytes) on bad input. */
int shmrl_decode_onnx_file(const char *text, size_t len, shmrl_model *m, char *err, size_t err_len);

/* K envs, observations of obs_size floats, output 0 of dist_size, actions of action_dim
   values (box: floats), up to steps_per_env steps per env per message; then every env's
   first chunk with shmrl_rollout_start. r is zeroed the first time (= {0}), and freed with
   shmrl_rollout_free before it is set up again (a new session: env_steps_per_sample may
   have changed); episode ids go on counting. SHMRL_ERR_NOMEM or _ARG. */
shmrl_status shmrl_rollout_init(shmrl_rollout *r, int k, long obs_size, long dist_size, int action_dim, int box,
                                long steps_per_env);
void shmrl_rollout_free(shmrl_rollout *r);
/* Env e's episode starts (at a reset) from obs. */
void shmrl_rollout_start(shmrl_rollout *r, int e, const float *obs);
/* Env e's step: the action taken (actions or box_actions: action_dim values, the other
   NULL), output 0's row it was sampled from and its log-probability, then the outcome.
   A terminated or truncated step ends the chunk (next_obs is the episode's last obs):
   call shmrl_rollout_start with the reset's obs next. SHMRL_ERR_ARG when env e has
   recorded steps_per_env steps since the last message. */
shmrl_status shmrl_rollout_step(shmrl_rollout *r, int e, const int64_t *action, const float *box_action,
                                const float *dist, double logp, float reward, const float *next_obs,
                                int terminated, int truncated);
long shmrl_rollout_steps(const shmrl_rollout *r);   /* recorded since the last message */
/* EPISODES_AND_GET_STATE with every chunk (running episodes continue in the next message
   from their last obs, under the same episode_id), tagged with m's version; then its
   SET_STATE (held while the learner trains), whose model replaces m's when its
   weights_seq_no differs. */
shmrl_status shmrl_send_rollout(shmrl_client *c, shmrl_rollout *r, shmrl_model *m);

/* A Box action of d values from output 0's row dist (d means, then d log-stds), as `how` says
   (c->action_dist); returns its log-probability (RLLINK.md 4.2). z: d standard normal draws
   (shmrl_normals). RLlib's Gaussian: mean + exp(log_std) z, unclipped. The squashed Gaussian:
   u = mean + exp(log_std) z, the action low + (tanh(u) + 1) / 2 (high - low), its logp the
   Gaussian's of u less sum(log(1 - tanh(u)^2)), computed as 2 (log 2 - u - softplus(-2u)), and
   sum(log((high - low) / 2)). Uniform (z used as d uniforms in [0, 1) instead: shmrl_uniforms):
   low + z (high - low), logp -sum(log(high - low)). The bounds must be finite for the last two. */
double shmrl_box_action(shmrl_action_dist how, const float *dist, int d, const float *low, const float *high,
                        const double *z, float *action);
/* d draws from the generator *rng (any seed): standard normals, or uniforms in [0, 1). */
void shmrl_normals(uint64_t *rng, int d, double *z);
void shmrl_uniforms(uint64_t *rng, int d, double *z);
/* Both in one: the draws, then shmrl_box_action. d <= SHMRL_MAX_ACTION_DIM. */
double shmrl_sample_box(shmrl_action_dist how, const float *dist, int d, const float *low, const float *high,
                        uint64_t *rng, float *action);

#ifdef __cplusplus
}
#endif
#endif /* SHMRL_CLIENT_H */

/* ======================================================================== implementation */
#ifdef SHMRL_CLIENT_IMPLEMENTATION
#ifndef SHMRL_CLIENT_IMPLEMENTED
#define SHMRL_CLIENT_IMPLEMENTED

#if defined(_WIN32)
#error "shmrl_client.h: Windows is not supported (POSIX sockets only)"
#endif

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <unistd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/types.h>
#include <netinet/in.h>
#include <netinet/tcp.h>

#ifdef MSG_NOSIGNAL
#define SHMRL__SEND_FLAGS MSG_NOSIGNAL  /* a closed peer gives EPIPE, not SIGPIPE */
#else
#define SHMRL__SEND_FLAGS 0             /* macOS: SO_NOSIGPIPE is set on the socket instead */
#endif

#define SHMRL__MAGIC "\x93RLB"
#define SHMRL__MAX_BODY 99999999UL     /* 8 decimal digits */
#define SHMRL__JSON_DEPTH 64

static shmrl_status shmrl__fail(shmrl_client *c, shmrl_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->error, sizeof c->error, fmt, ap);
    va_end(ap);
    return st;
}

static double shmrl__now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void shmrl__sleep(double seconds) {
    struct timespec ts;
    if (seconds <= 0) return;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

static int shmrl__little_endian(void) {
    const uint16_t one = 1;
    return *(const unsigned char *)&one == 1;
}

/* ---------------------------------------------------------------- a growable write buffer */

typedef struct shmrl__buf { unsigned char *p; size_t len, cap; int oom; } shmrl__buf;

static int shmrl__reserve(shmrl__buf *b, size_t more) {
    size_t need = b->len + more, cap = b->cap ? b->cap : 256;
    unsigned char *p;
    if (b->oom) return 0;
    if (need <= b->cap) return 1;
    while (cap < need) cap *= 2;
    p = (unsigned char *)realloc(b->p, cap);
    if (!p) { b->oom = 1; return 0; }
    b->p = p;
    b->cap = cap;
    return 1;
}

static void shmrl__put(shmrl__buf *b, const void *data, size_t n) {
    if (!shmrl__reserve(b, n)) return;
    memcpy(b->p + b->len, data, n);
    b->len += n;
}

static void shmrl__puts(shmrl__buf *b, const char *s) { shmrl__put(b, s, strlen(s)); }

static void shmrl__putf(shmrl__buf *b, const char *fmt, ...) {
    char tmp[64];
    int n;
    va_list ap;
    va_start(ap, fmt);
    n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0) shmrl__put(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

/* A finite float as JSON: 9 significant digits give float32 back exactly; a locale with a
   decimal comma must not leak into the wire. */
static void shmrl__put_float(shmrl__buf *b, double v) {
    char tmp[40], *q;
    snprintf(tmp, sizeof tmp, "%.9g", v);
    for (q = tmp; *q; q++) if (*q == ',') *q = '.';
    shmrl__puts(b, tmp);
}

static void shmrl__put_string(shmrl__buf *b, const char *s) {
    shmrl__put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') { shmrl__put(b, "\\", 1); shmrl__put(b, s, 1); }
        else if (ch < 0x20) shmrl__putf(b, "\\u%04x", ch);
        else shmrl__put(b, s, 1);
    }
    shmrl__put(b, "\"", 1);
}

static void shmrl__pad8(shmrl__buf *b) {
    static const unsigned char zeros[8] = {0};
    if (b->len % 8) shmrl__put(b, zeros, 8 - b->len % 8);
}

static void shmrl__put_u32le(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v; p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16); p[3] = (unsigned char)(v >> 24);
}

/* n float32 values as little-endian bytes */
static void shmrl__put_f32s(shmrl__buf *b, const float *v, size_t n) {
    size_t i;
    if (shmrl__little_endian()) { shmrl__put(b, v, n * 4); return; }
    if (!shmrl__reserve(b, n * 4)) return;
    for (i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &v[i], 4);
        shmrl__put_u32le(b->p + b->len + 4 * i, u);
    }
    b->len += n * 4;
}

/* ---------------------------------------------------------------- a small JSON reader
   Enough for the replies: find a key in an object, read numbers, strings, arrays.
   Every function takes [p, e) and returns NULL on malformed input. */

static const char *shmrl__ws(const char *p, const char *e) {
    if (!p) return NULL;   /* so that a failed step passes through a chain of calls */
    while (p < e && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
    return p;
}

static const char *shmrl__skip_string(const char *p, const char *e) {
    if (!p || p >= e || *p != '"') return NULL;
    for (p++; p < e; p++) {
        if (*p == '\\') { p++; continue; }
        if (*p == '"') return p + 1;
    }
    return NULL;
}

static const char *shmrl__skip_value(const char *p, const char *e, int depth) {
    p = shmrl__ws(p, e);
    if (!p || p >= e || depth > SHMRL__JSON_DEPTH) return NULL;
    if (*p == '"') return shmrl__skip_string(p, e);
    if (*p == '{' || *p == '[') {
        char close = *p == '{' ? '}' : ']';
        p = shmrl__ws(p + 1, e);
        if (p < e && *p == close) return p + 1;
        for (;;) {
            if (close == '}') {
                p = shmrl__skip_string(shmrl__ws(p, e), e);
                if (!p) return NULL;
                p = shmrl__ws(p, e);
                if (p >= e || *p != ':') return NULL;
                p++;
            }
            p = shmrl__skip_value(p, e, depth + 1);
            if (!p) return NULL;
            p = shmrl__ws(p, e);
            if (p >= e) return NULL;
            if (*p == close) return p + 1;
            if (*p != ',') return NULL;
            p++;
        }
    }
    {   /* a number or a literal: a run of their characters */
        const char *start = p;
        while (p < e && (strchr("+-.0123456789eEtrufalsnIinyNa", *p) != NULL)) p++;
        return p > start ? p : NULL;
    }
}

/* Does the JSON string at p (its opening quote) equal key? Handles the simple escapes. */
static int shmrl__string_is(const char *p, const char *e, const char *key) {
    if (!p || p >= e || *p != '"') return 0;
    for (p++; p < e && *p != '"'; p++, key++) {
        char ch = *p;
        if (ch == '\\') {
            if (++p >= e) return 0;
            switch (*p) {
            case 'n': ch = '\n'; break;
            case 't': ch = '\t'; break;
            case 'r': ch = '\r'; break;
            case 'b': ch = '\b'; break;
            case 'f': ch = '\f'; break;
            case 'u': {
                unsigned v = 0;
                int i;
                for (i = 0; i < 4; i++) {
                    char h;
                    if (++p >= e) return 0;
                    h = *p;
                    v = v * 16 + (unsigned)(h >= '0' && h <= '9' ? h - '0' : (h | 32) - 'a' + 10);
                }
                if (v > 0x7f) return 0;   /* the keys looked for are ASCII */
                ch = (char)v;
                break;
            }
            default: ch = *p;
            }
        }
        if (*key == '\0' || *key != ch) return 0;
    }
    return p < e && *key == '\0';
}

/* The value of key in the object at p, or NULL. */
static const char *shmrl__get(const char *p, const char *e, const char *key) {
    p = shmrl__ws(p, e);
    if (!p || p >= e || *p != '{') return NULL;
    p = shmrl__ws(p + 1, e);
    if (p < e && *p == '}') return NULL;
    for (;;) {
        const char *k = shmrl__ws(p, e), *v;
        p = shmrl__skip_string(k, e);
        if (!p) return NULL;
        p = shmrl__ws(p, e);
        if (p >= e || *p != ':') return NULL;
        v = shmrl__ws(p + 1, e);
        if (shmrl__string_is(k, e, key)) return v;
        p = shmrl__ws(shmrl__skip_value(v, e, 1), e);
        if (!p || p >= e || *p != ',') return NULL;
        p++;
    }
}

/* A JSON number (or Infinity/-Infinity, which Python writes for unbounded boxes), parsed
   without strtod so that the process's locale cannot change it. */
static const char *shmrl__number(const char *p, const char *e, double *out) {
    double m = 0;
    int neg = 0, exp10 = 0, digits = 0;
    p = shmrl__ws(p, e);
    if (!p) return NULL;
    if (p < e && *p == '-') { neg = 1; p++; }
    if (e - p >= 8 && memcmp(p, "Infinity", 8) == 0) { *out = neg ? -HUGE_VAL : HUGE_VAL; return p + 8; }
    for (; p < e && *p >= '0' && *p <= '9'; p++, digits++) m = m * 10 + (*p - '0');
    if (p < e && *p == '.')
        for (p++; p < e && *p >= '0' && *p <= '9'; p++, digits++, exp10--) m = m * 10 + (*p - '0');
    if (!digits) return NULL;
    if (p < e && (*p == 'e' || *p == 'E')) {
        int eneg = 0, ev = 0, edigits = 0;
        p++;
        if (p < e && (*p == '+' || *p == '-')) eneg = *p++ == '-';
        for (; p < e && *p >= '0' && *p <= '9'; p++, edigits++) if (ev < 10000) ev = ev * 10 + (*p - '0');
        if (!edigits) return NULL;
        exp10 += eneg ? -ev : ev;
    }
    if (exp10 > 0) m *= pow(10.0, exp10);
    else if (exp10 < 0) m /= pow(10.0, -exp10);
    *out = neg ? -m : m;
    return p;
}

static int shmrl__get_number(const char *obj, const char *e, const char *key, double *out) {
    const char *v = shmrl__get(obj, e, key);
    return v && shmrl__number(v, e, out) != NULL;
}

/* v is an integer in [lo, hi] (checked before any cast: casting a double beyond the
   target type's range is undefined behaviour) */
static int shmrl__int_in(double v, double lo, double hi) { return v >= lo && v <= hi && v == floor(v); }

/* Up to max numbers of the JSON array at p; the count in *n; 0 if p is no such array. */
static int shmrl__numbers(const char *p, const char *e, double *out, int max, int *n) {
    *n = 0;
    p = shmrl__ws(p, e);
    if (!p || p >= e || *p != '[') return 0;
    p = shmrl__ws(p + 1, e);
    if (p < e && *p == ']') return 1;
    for (;;) {
        double v;
        if (*n >= max || !(p = shmrl__number(p, e, &v))) return 0;
        out[(*n)++] = v;
        p = shmrl__ws(p, e);
        if (p >= e) return 0;
        if (*p == ']') return 1;
        if (*p != ',') return 0;
        p++;
    }
}

/* ---------------------------------------------------------------- sockets and frames */

static void shmrl__disconnect(shmrl_client *c) {
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
}

static shmrl_status shmrl__lost(shmrl_client *c, shmrl_status st, const char *fmt, ...) {
    va_list ap;
    shmrl__disconnect(c);
    va_start(ap, fmt);
    vsnprintf(c->error, sizeof c->error, fmt, ap);
    va_end(ap);
    return st;
}

static int shmrl__connect_one(const struct addrinfo *ai, double timeout_s, double send_timeout_s) {
    int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol), flags, err = 0, one = 1;
    socklen_t len = sizeof err;
    struct timeval tv;
    if (fd < 0) return -1;
    flags = fcntl(fd, F_GETFL, 0);
    fcntl(fd, F_SETFL, flags | O_NONBLOCK);
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
        struct pollfd pfd;
        if (errno != EINPROGRESS) { close(fd); return -1; }
        pfd.fd = fd; pfd.events = POLLOUT; pfd.revents = 0;
        if (poll(&pfd, 1, (int)(timeout_s * 1000)) != 1
            || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
            close(fd);
            errno = err ? err : ETIMEDOUT;
            return -1;
        }
    }
    fcntl(fd, F_SETFL, flags);
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  /* small frames, each awaited */
    tv.tv_sec = (time_t)send_timeout_s;   /* a server that takes no data: send fails with EAGAIN */
    tv.tv_usec = (suseconds_t)((send_timeout_s - (double)tv.tv_sec) * 1e6);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
#ifdef SO_NOSIGPIPE
    setsockopt(fd, SOL_SOCKET, SO_NOSIGPIPE, &one, sizeof one);
#endif
    return fd;
}

static shmrl_status shmrl__connect(shmrl_client *c) {
    struct addrinfo hints, *res = NULL, *ai;
    char port[16];
    int rc;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    snprintf(port, sizeof port, "%d", c->opt.port);
    rc = getaddrinfo(c->host, port, &hints, &res);
    if (rc != 0) return shmrl__fail(c, SHMRL_ERR_CONNECT, "cannot resolve %s: %s", c->host, gai_strerror(rc));
    for (ai = res; ai && c->fd < 0; ai = ai->ai_next) c->fd = shmrl__connect_one(ai, c->opt.connect_timeout_s, c->opt.reply_timeout_s);
    freeaddrinfo(res);
    if (c->fd < 0)
        return shmrl__fail(c, SHMRL_ERR_CONNECT, "cannot connect to %s:%d: %s", c->host, c->opt.port, strerror(errno));
    return SHMRL_OK;
}

/* Send b (a body) as one frame: header, then body. */
static shmrl_status shmrl__send_body(shmrl_client *c, shmrl__buf *b) {
    char header[9];
    size_t sent = 0;
    if (b->oom) return shmrl__fail(c, SHMRL_ERR_NOMEM, "out of memory writing a frame");
    if (c->fd < 0) return shmrl__fail(c, SHMRL_ERR_CLOSED, "not connected");
    if (b->len - 8 > SHMRL__MAX_BODY) return shmrl__fail(c, SHMRL_ERR_ARG, "frame of %lu bytes is too long", (unsigned long)b->len);
    snprintf(header, sizeof header, "%08lu", (unsigned long)(b->len - 8));
    memcpy(b->p, header, 8);   /* the caller left 8 bytes for it */
    while (sent < b->len) {
        ssize_t n = send(c->fd, b->p + sent, b->len - sent, SHMRL__SEND_FLAGS);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return shmrl__lost(c, SHMRL_ERR_TIMEOUT, "the server took no data for %g s", c->opt.reply_timeout_s);
        if (n <= 0) return shmrl__lost(c, SHMRL_ERR_IO, "send failed: %s", strerror(errno));
        sent += (size_t)n;
    }
    c->last_send = shmrl__now();
    return SHMRL_OK;
}

static shmrl_status shmrl__recv_exactly(shmrl_client *c, unsigned char *p, size_t n, double deadline) {
    while (n > 0) {
        struct pollfd pfd;
        double left = deadline - shmrl__now();
        ssize_t got;
        int ready;
        pfd.fd = c->fd; pfd.events = POLLIN; pfd.revents = 0;
        if (left <= 0) return shmrl__lost(c, SHMRL_ERR_TIMEOUT, "no reply within %g s", c->opt.reply_timeout_s);
        ready = poll(&pfd, 1, (int)(left * 1000) + 1);
        if (ready < 0 && errno == EINTR) continue;
        if (ready < 0) return shmrl__lost(c, SHMRL_ERR_IO, "poll failed: %s", strerror(errno));
        if (ready == 0) continue;  /* the deadline check above ends it */
        got = recv(c->fd, p, n, 0);
        if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (got == 0) return shmrl__lost(c, SHMRL_ERR_CLOSED, "the server closed the connection");
        if (got < 0) return shmrl__lost(c, SHMRL_ERR_IO, "recv failed: %s", strerror(errno));
        p += got;
        n -= (size_t)got;
    }
    return SHMRL_OK;
}

/* A reply as read: the JSON text (or binary head) and the binary data section. */
typedef struct shmrl__msg {
    const char *head, *end;
    const unsigned char *data;
    size_t data_len;
} shmrl__msg;

static shmrl_status shmrl__recv_msg(shmrl_client *c, shmrl__msg *m) {
    unsigned char header[8];
    size_t n = 0, i;
    double deadline = shmrl__now() + c->opt.reply_timeout_s;
    shmrl_status st;
    if (c->fd < 0) return shmrl__fail(c, SHMRL_ERR_CLOSED, "not connected");
    if ((st = shmrl__recv_exactly(c, header, 8, deadline)) != SHMRL_OK) return st;
    for (i = 0; i < 8; i++) {
        if (header[i] < '0' || header[i] > '9')
            return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "reply header is not 8 ASCII digits");
        n = n * 10 + (size_t)(header[i] - '0');
    }
    if (n == 0 || n > c->opt.max_reply_bytes)
        return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "reply of %lu bytes (the limit is %lu)", (unsigned long)n,
                           (unsigned long)c->opt.max_reply_bytes);
    if (n + 1 > c->rcap) {
        unsigned char *p = (unsigned char *)realloc(c->rbuf, n + 1);
        if (!p) return shmrl__lost(c, SHMRL_ERR_NOMEM, "out of memory for a reply of %lu bytes", (unsigned long)n);
        c->rbuf = p;
        c->rcap = n + 1;
    }
    if ((st = shmrl__recv_exactly(c, c->rbuf, n, deadline)) != SHMRL_OK) return st;
    c->rbuf[n] = 0;
    m->data = NULL;
    m->data_len = 0;
    if (n >= 8 && memcmp(c->rbuf, SHMRL__MAGIC, 4) == 0) {
        size_t head_len = (size_t)c->rbuf[4] | (size_t)c->rbuf[5] << 8 | (size_t)c->rbuf[6] << 16
                          | (size_t)c->rbuf[7] << 24;
        size_t data_start = (8 + head_len + 7) / 8 * 8;
        if (head_len > n - 8 || data_start > n)
            return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "binary reply: head of %lu bytes overruns the body", (unsigned long)head_len);
        m->head = (const char *)c->rbuf + 8;
        m->end = m->head + head_len;
        m->data = c->rbuf + data_start;
        m->data_len = n - data_start;
    } else {
        m->head = (const char *)c->rbuf;
        m->end = m->head + n;
    }
    if (shmrl__ws(m->head, m->end) >= m->end || *shmrl__ws(m->head, m->end) != '{'
        || shmrl__ws(shmrl__skip_value(m->head, m->end, 0), m->end) != m->end)
        return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "reply is not a JSON object");
    return SHMRL_OK;
}

/* Read a reply and check its type. */
static shmrl_status shmrl__expect(shmrl_client *c, shmrl__msg *m, const char *type) {
    const char *t;
    shmrl_status st = shmrl__recv_msg(c, m);
    if (st != SHMRL_OK) return st;
    t = shmrl__get(m->head, m->end, "type");
    if (!t || !shmrl__string_is(t, m->end, type)) {
        char got[40] = "none";
        if (t) {
            const char *q = shmrl__skip_string(t, m->end);
            size_t l = q ? (size_t)(q - t) : 0;
            if (l >= sizeof got) l = sizeof got - 1;
            memcpy(got, t, l);
            got[l] = 0;
        }
        return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "expected %s, got the type %s", type, got);
    }
    return SHMRL_OK;
}

static shmrl__buf shmrl__start(shmrl_client *c) {
    shmrl__buf b;
    b.p = c->wbuf; b.cap = c->wcap; b.len = 0; b.oom = 0;
    shmrl__put(&b, "00000000", 8);   /* the header, filled in when sent */
    return b;
}

static void shmrl__keep(shmrl_client *c, shmrl__buf *b) { c->wbuf = b->p; c->wcap = b->cap; }

shmrl_status shmrl_send_json(shmrl_client *c, const char *json) {
    shmrl__buf b = shmrl__start(c);
    shmrl_status st;
    shmrl__puts(&b, json);
    st = shmrl__send_body(c, &b);
    shmrl__keep(c, &b);
    return st;
}

shmrl_status shmrl_recv(shmrl_client *c, const char **head, size_t *head_len,
                        const unsigned char **data, size_t *data_len) {
    shmrl__msg m;
    shmrl_status st = shmrl__recv_msg(c, &m);
    if (st != SHMRL_OK) return st;
    *head = m.head; *head_len = (size_t)(m.end - m.head);
    if (data) *data = m.data;
    if (data_len) *data_len = m.data_len;
    return SHMRL_OK;
}

/* ---------------------------------------------------------------- the handshake */

static shmrl_status shmrl__read_spaces(shmrl_client *c, const shmrl__msg *m) {
    shmrl_config *cfg = &c->config;
    double v[SHMRL_MAX_ACTION_DIM];
    const char *shape = shmrl__get(m->head, m->end, "observation_shape");
    const char *dtype = shmrl__get(m->head, m->end, "observation_dtype");
    const char *space = shmrl__get(m->head, m->end, "action_space"), *t;
    int n, i;
    if (shmrl__get(m->head, m->end, "observation_leaves"))
        return shmrl__lost(c, SHMRL_ERR_UNSUPPORTED, "the env has a Dict observation; this client sends one float array");
    if (dtype && !shmrl__string_is(dtype, m->end, "<f4"))
        return shmrl__lost(c, SHMRL_ERR_UNSUPPORTED, "observations of a dtype other than <f4 are not supported here");
    if (shape) {
        double dims[SHMRL_MAX_DIMS];
        if (!shmrl__numbers(shape, m->end, dims, SHMRL_MAX_DIMS, &n))
            return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "SET_CONFIG: observation_shape is not a list of at most %d ints", SHMRL_MAX_DIMS);
        double size = 1;
        for (i = 0; i < n; i++) size *= shmrl__int_in(dims[i], 1, 1 << 24) ? dims[i] : -1;
        if (!(size >= 1 && size <= 1 << 24))
            return shmrl__lost(c, SHMRL_ERR_UNSUPPORTED, "SET_CONFIG: observation_shape must be dims >= 1 of at most 2^24 floats in all");
        cfg->obs_ndim = n;
        cfg->obs_size = (long)size;
        for (i = 0; i < n; i++) cfg->obs_shape[i] = (long)dims[i];
    } else if (c->opt.obs_size > 0) {
        cfg->obs_ndim = 1; cfg->obs_shape[0] = cfg->obs_size = c->opt.obs_size;
    } else if (c->opt.server_inference) {
        return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "SET_CONFIG has no observation_shape (set obs_size in the options)");
    }
    if (c->opt.obs_size > 0 && cfg->obs_size != c->opt.obs_size)
        return shmrl__lost(c, SHMRL_ERR_UNSUPPORTED, "the server's observations have %ld floats, this client %ld",
                           cfg->obs_size, c->opt.obs_size);
    if (!space) return SHMRL_OK;
    t = shmrl__get(space, m->end, "type");
    if (t && shmrl__string_is(t, m->end, "Discrete")) {
        double nv;
        double start = 0;
        if (!shmrl__get_number(space, m->end, "n", &nv) || !shmrl__int_in(nv, 1, 1e9)
            || (shmrl__get(space, m->end, "start") && (!shmrl__get_number(space, m->end, "start", &start)
                                                       || !shmrl__int_in(start, -1e9, 1e9))))
            return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "SET_CONFIG: a Discrete action_space without an n of 1 to 1e9 (or a bad start)");
        cfg->action_type = SHMRL_DISCRETE; cfg->action_n = (long)nv; cfg->action_dim = 1;
        cfg->action_start = (long)start;
    } else if (t && shmrl__string_is(t, m->end, "MultiDiscrete")) {
        if (!shmrl__numbers(shmrl__get(space, m->end, "nvec"), m->end, v, SHMRL_MAX_ACTION_DIM, &n) || n < 1)
            return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "SET_CONFIG: a MultiDiscrete action_space without nvec");
        cfg->action_type = SHMRL_MULTI_DISCRETE; cfg->action_dim = n;
        for (i = 0; i < n; i++) {
            if (!shmrl__int_in(v[i], 1, 1e9)) return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "SET_CONFIG: nvec of ints 1 to 1e9");
            cfg->nvec[i] = (long)v[i];
        }
    } else if (t && shmrl__string_is(t, m->end, "Box")) {
        double hi[SHMRL_MAX_ACTION_DIM];
        int nh;
        if (!shmrl__numbers(shmrl__get(space, m->end, "low"), m->end, v, SHMRL_MAX_ACTION_DIM, &n)
            || !shmrl__numbers(shmrl__get(space, m->end, "high"), m->end, hi, SHMRL_MAX_ACTION_DIM, &nh) || n != nh || n < 1)
            return shmrl__lost(c, SHMRL_ERR_UNSUPPORTED, "SET_CONFIG: a Box action_space needs flat low and high "
                               "of 1-%d values", SHMRL_MAX_ACTION_DIM);
        cfg->action_type = SHMRL_BOX; cfg->action_dim = n;
        for (i = 0; i < n; i++) {   /* beyond float's range: unbounded */
            cfg->low[i] = v[i] < -FLT_MAX ? -HUGE_VALF : (float)v[i];
            cfg->high[i] = hi[i] > FLT_MAX ? HUGE_VALF : (float)hi[i];
            if (!(cfg->low[i] <= cfg->high[i]))
                return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "SET_CONFIG: Box bounds with low > high");
        }
    } else {
        return shmrl__lost(c, SHMRL_ERR_UNSUPPORTED, "SET_CONFIG: an action_space this client does not know");
    }
    return SHMRL_OK;
}

/* The fields of a GET_CONFIG that declare the spaces d (none where d->obs_ndim is 0):
   SET_CONFIG's format, a float32 observation (RLLINK.md 3.2). */
static void shmrl__put_spaces(shmrl__buf *b, const shmrl_config *d) {
    int i;
    if (d->obs_ndim < 1) return;
    shmrl__puts(b, ", \"observation_shape\": [");
    for (i = 0; i < d->obs_ndim; i++) shmrl__putf(b, i ? ", %ld" : "%ld", d->obs_shape[i]);
    shmrl__puts(b, "], \"observation_dtype\": \"<f4\", \"action_space\": ");
    if (d->action_type == SHMRL_DISCRETE) {
        shmrl__putf(b, "{\"type\": \"Discrete\", \"n\": %ld", d->action_n);
        if (d->action_start) shmrl__putf(b, ", \"start\": %ld", d->action_start);
    } else if (d->action_type == SHMRL_MULTI_DISCRETE) {
        shmrl__puts(b, "{\"type\": \"MultiDiscrete\", \"nvec\": [");
        for (i = 0; i < d->action_dim; i++) shmrl__putf(b, i ? ", %ld" : "%ld", d->nvec[i]);
        shmrl__puts(b, "]");
    } else {
        shmrl__putf(b, "{\"type\": \"Box\", \"shape\": [%d], \"low\": [", d->action_dim);
        for (i = 0; i < d->action_dim; i++) { if (i) shmrl__puts(b, ", "); shmrl__put_float(b, d->low[i]); }
        shmrl__puts(b, "], \"high\": [");
        for (i = 0; i < d->action_dim; i++) { if (i) shmrl__puts(b, ", "); shmrl__put_float(b, d->high[i]); }
        shmrl__puts(b, "]");
    }
    shmrl__puts(b, "}");
}

/* A reply's action_dist into *out (absent: dflt); one this client does not sample: UNSUPPORTED. */
static shmrl_status shmrl__action_dist(shmrl_client *c, const shmrl__msg *m, const char *what, shmrl_action_dist dflt,
                                       shmrl_action_dist *out) {
    const char *v = shmrl__get(m->head, m->end, "action_dist");
    if (!v) *out = dflt;
    else if (shmrl__string_is(v, m->end, "squashed_gaussian")) *out = SHMRL_DIST_SQUASHED_GAUSSIAN;
    else if (shmrl__string_is(v, m->end, "uniform")) *out = SHMRL_DIST_UNIFORM;
    else return shmrl__lost(c, SHMRL_ERR_UNSUPPORTED, "%s: an action_dist this client does not sample", what);
    if (*out != SHMRL_DIST_GAUSSIAN && !c->opt.server_inference && !c->opt.action_dists)
        return shmrl__lost(c, SHMRL_ERR_UNSUPPORTED, "%s: the learner's policy is sampled as SAC's (action_dist), "
                           "and this client does not say it samples it (options.action_dists)", what);
    return SHMRL_OK;
}

static shmrl_status shmrl__handshake(shmrl_client *c) {
    shmrl__buf b = shmrl__start(c);
    shmrl__msg m;
    shmrl_status st;
    const char *v;
    double num;
    shmrl__puts(&b, "{\"type\": \"PING\"");
    if (c->token[0]) { shmrl__puts(&b, ", \"auth_token\": "); shmrl__put_string(&b, c->token); }
    if (c->opt.binary) shmrl__puts(&b, ", \"codecs\": [\"binary\"]");
    if (c->name[0]) { shmrl__puts(&b, ", \"client_name\": "); shmrl__put_string(&b, c->name); }
    if (c->opt.server_inference) shmrl__puts(&b, ", \"inference\": \"server\"");
    else if (c->opt.action_dists) shmrl__puts(&b, ", \"action_dists\": [\"squashed_gaussian\", \"uniform\"]");
    shmrl__puts(&b, "}");
    st = shmrl__send_body(c, &b);
    shmrl__keep(c, &b);
    if (st != SHMRL_OK || (st = shmrl__expect(c, &m, "PONG")) != SHMRL_OK) return st;
    v = shmrl__get(m.head, m.end, "codec");
    c->binary = v && shmrl__string_is(v, m.end, "binary");
    if (v && !c->binary) return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "PONG names a codec this client did not offer");
    if (c->binary && !c->opt.binary) return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "PONG names a codec this client did not offer");
    c->heartbeat_s = shmrl__get_number(m.head, m.end, "heartbeat_s", &num) && num > 0 ? num : 0;
    v = shmrl__get(m.head, m.end, "inference");
    c->inference = v && shmrl__string_is(v, m.end, "server");
    if (c->opt.server_inference && !c->inference)
        return shmrl__lost(c, SHMRL_ERR_REFUSED, "the server does not serve actions (its PONG grants no "
                           "\"inference\": \"server\"): it is not shmrl, or too old, or a multi-agent run");
    b = shmrl__start(c);
    shmrl__puts(&b, "{\"type\": \"GET_CONFIG\"");
    shmrl__put_spaces(&b, &c->opt.declare);
    shmrl__puts(&b, "}");
    st = shmrl__send_body(c, &b);
    shmrl__keep(c, &b);
    if (st != SHMRL_OK || (st = shmrl__expect(c, &m, "SET_CONFIG")) != SHMRL_OK)
        return st;
    memset(&c->config, 0, sizeof c->config);
    if (!shmrl__get_number(m.head, m.end, "env_steps_per_sample", &num) || !shmrl__int_in(num, 1, 2e9))
        return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "SET_CONFIG without an env_steps_per_sample of 1 to 2e9");
    c->config.env_steps_per_sample = (long)num;
    if ((st = shmrl__read_spaces(c, &m)) != SHMRL_OK) return st;
    if ((st = shmrl__action_dist(c, &m, "SET_CONFIG", SHMRL_DIST_GAUSSIAN, &c->config.action_dist)) != SHMRL_OK)
        return st;
    c->fresh = 1;
    c->k = 0;
    c->sessions++;
    return SHMRL_OK;
}

static double shmrl__random(shmrl_client *c) {   /* xorshift64*, in [0, 1) */
    c->rng ^= c->rng >> 12; c->rng ^= c->rng << 25; c->rng ^= c->rng >> 27;
    return (double)((c->rng * 2685821657736338717ULL) >> 11) / 9007199254740992.0;
}

shmrl_status shmrl_reconnect(shmrl_client *c) {
    int failures = 0;
    shmrl__disconnect(c);
    for (;;) {
        shmrl_status st = shmrl__connect(c);
        if (st == SHMRL_OK && (st = shmrl__handshake(c)) == SHMRL_OK) return SHMRL_OK;
        shmrl__disconnect(c);
        if (st == SHMRL_ERR_REFUSED || st == SHMRL_ERR_UNSUPPORTED || st == SHMRL_ERR_NOMEM) return st;
        failures++;
        if (c->opt.max_retries >= 0 && failures > c->opt.max_retries) {
            char last[SHMRL_ERROR_LEN];
            memcpy(last, c->error, sizeof last);
            last[sizeof last - 1] = 0;
            return shmrl__fail(c, st, "gave up after %d attempt%s: %.200s", failures, failures == 1 ? "" : "s", last);
        }
        {
            double wait = c->opt.backoff_s * pow(2.0, failures - 1);
            if (wait > c->opt.backoff_max_s) wait = c->opt.backoff_max_s;
            shmrl__sleep(wait * (0.5 + 0.5 * shmrl__random(c)));
        }
    }
}

void shmrl_options_init(shmrl_options *opt) {
    memset(opt, 0, sizeof *opt);
    opt->host = "127.0.0.1";
    opt->port = 5556;
    opt->binary = 1;
    opt->server_inference = 1;
    opt->connect_timeout_s = SHMRL_CONNECT_TIMEOUT_S;
    opt->reply_timeout_s = SHMRL_REPLY_TIMEOUT_S;
    opt->max_retries = SHMRL_MAX_RETRIES;
    opt->backoff_s = SHMRL_BACKOFF_S;
    opt->backoff_max_s = SHMRL_BACKOFF_MAX_S;
    opt->max_reply_bytes = (size_t)64 << 20;
}

static int shmrl__copy(char *dst, size_t cap, const char *src) {
    size_t n = src ? strlen(src) : 0;
    if (n >= cap) return 0;
    if (n) memcpy(dst, src, n);
    dst[n] = 0;
    return 1;
}

shmrl_status shmrl_open(shmrl_client *c, const shmrl_options *opt) {
    const char *p;
    memset(c, 0, sizeof *c);
    c->fd = -1;
    c->opt = *opt;
    c->rng = (uint64_t)getpid() * UINT64_C(0x9E3779B97F4A7C15) ^ (uint64_t)(shmrl__now() * 1e9) ^ (uint64_t)(uintptr_t)c;
    if (!c->rng) c->rng = 1;
    if (!shmrl__copy(c->host, sizeof c->host, opt->host ? opt->host : "127.0.0.1"))
        return shmrl__fail(c, SHMRL_ERR_ARG, "host name too long");
    if (!shmrl__copy(c->token, sizeof c->token, opt->auth_token))
        return shmrl__fail(c, SHMRL_ERR_ARG, "auth_token longer than %d bytes", (int)sizeof c->token - 1);
    if (!shmrl__copy(c->name, sizeof c->name, opt->client_name) || (opt->client_name && !opt->client_name[0]))
        return shmrl__fail(c, SHMRL_ERR_ARG, "client_name must be 1-64 characters");
    for (p = c->name; *p; p++)
        if (*p < 0x20 || *p > 0x7e) return shmrl__fail(c, SHMRL_ERR_ARG, "client_name must be printable ASCII");
    if (opt->port <= 0 || opt->port > 65535) return shmrl__fail(c, SHMRL_ERR_ARG, "port %d is out of range", opt->port);
    if (!(opt->reply_timeout_s > 0) || !(opt->connect_timeout_s > 0) || opt->backoff_s < 0 || opt->obs_size < 0)
        return shmrl__fail(c, SHMRL_ERR_ARG, "timeouts must be > 0, backoff_s and obs_size >= 0");
    return shmrl_reconnect(c);
}

void shmrl_close(shmrl_client *c) {
    shmrl__disconnect(c);
    free(c->wbuf);
    free(c->rbuf);
    c->wbuf = c->rbuf = NULL;
    c->wcap = c->rcap = 0;
}

shmrl_status shmrl_heartbeat(shmrl_client *c, long long env_steps) {
    char json[80];
    if (c->heartbeat_s <= 0 || shmrl__now() - c->last_send < c->heartbeat_s) return SHMRL_OK;
    snprintf(json, sizeof json, "{\"type\": \"HEARTBEAT\", \"env_steps\": %lld}", env_steps < 0 ? 0 : env_steps);
    return shmrl_send_json(c, json);
}

/* ---------------------------------------------------------------- ACT and ACTIONS */

/* Rows of obs; row r from final_obs when r was truncated, else from obs (which the server
   ignores there, but must be finite). */
static const float *shmrl__row(const shmrl_step *s, long size, int final, int r) {
    return (final && s->truncateds[r] ? s->final_obs : s->obs) + (size_t)r * (size_t)size;
}

static void shmrl__json_obs(shmrl__buf *b, const shmrl_client *c, const shmrl_step *s, int final) {
    const shmrl_config *cfg = &c->config;
    int r, d;
    shmrl__put(b, "[", 1);
    for (r = 0; r < s->k; r++) {
        const float *row = shmrl__row(s, cfg->obs_size, final, r);
        long i, stride;
        if (r) shmrl__puts(b, ", ");
        /* nested lists, by the observation's shape */
        for (i = 0; i < cfg->obs_size; i++) {
            for (d = 0, stride = cfg->obs_size; d < cfg->obs_ndim; d++) {
                if (i % stride == 0) shmrl__put(b, "[", 1);
                stride /= cfg->obs_shape[d] ? cfg->obs_shape[d] : 1;
            }
            shmrl__put_float(b, row[i]);
            for (d = cfg->obs_ndim - 1, stride = 1; d >= 0; d--) {
                stride *= cfg->obs_shape[d];
                if ((i + 1) % stride == 0) shmrl__put(b, "]", 1);
                else { shmrl__puts(b, ", "); break; }
            }
        }
    }
    shmrl__put(b, "]", 1);
}

static void shmrl__json_act(shmrl__buf *b, const shmrl_client *c, const shmrl_step *s, int outcome, int final) {
    int r;
    shmrl__puts(b, "{\"type\": \"ACT\", \"obs\": ");
    shmrl__json_obs(b, c, s, 0);
    if (outcome) {
        shmrl__puts(b, ", \"rewards\": [");
        for (r = 0; r < s->k; r++) { if (r) shmrl__puts(b, ", "); shmrl__put_float(b, s->rewards[r]); }
        shmrl__puts(b, "], \"terminateds\": [");
        for (r = 0; r < s->k; r++) shmrl__puts(b, r ? (s->terminateds[r] ? ", true" : ", false") : (s->terminateds[r] ? "true" : "false"));
        shmrl__puts(b, "], \"truncateds\": [");
        for (r = 0; r < s->k; r++) shmrl__puts(b, r ? (s->truncateds[r] ? ", true" : ", false") : (s->truncateds[r] ? "true" : "false"));
        shmrl__puts(b, "]");
        if (final) { shmrl__puts(b, ", \"final_obs\": "); shmrl__json_obs(b, c, s, 1); }
    }
    shmrl__puts(b, "}");
}

/* {"__nd__":[dtype,[k,...shape],offset,nbytes]} */
static void shmrl__descriptor(shmrl__buf *b, const char *dtype, const shmrl_step *s, const shmrl_config *cfg,
                              int obs_shape, size_t offset, size_t nbytes) {
    int d;
    shmrl__putf(b, "{\"__nd__\":[\"%s\",[%d", dtype, s->k);
    for (d = 0; obs_shape && d < cfg->obs_ndim; d++) shmrl__putf(b, ",%ld", cfg->obs_shape[d]);
    shmrl__putf(b, "],%lu,%lu]}", (unsigned long)offset, (unsigned long)nbytes);
}

static void shmrl__binary_act(shmrl__buf *b, const shmrl_client *c, const shmrl_step *s, int outcome, int final) {
    const shmrl_config *cfg = &c->config;
    size_t k = (size_t)s->k, obs_bytes = k * (size_t)cfg->obs_size * 4, head_at, head_len, off = 0, r;
    size_t a8 = (obs_bytes + 7) / 8 * 8, f8 = (k * 4 + 7) / 8 * 8, b8 = (k + 7) / 8 * 8;
    const unsigned char one = 1, zero = 0;
    shmrl__put(b, SHMRL__MAGIC "\0\0\0\0", 8);
    head_at = b->len;
    shmrl__puts(b, "{\"type\":\"ACT\",\"obs\":");
    shmrl__descriptor(b, "<f4", s, cfg, 1, off, obs_bytes);
    off += a8;
    if (outcome) {
        shmrl__puts(b, ",\"rewards\":");
        shmrl__descriptor(b, "<f4", s, cfg, 0, off, k * 4);
        shmrl__puts(b, ",\"terminateds\":");
        shmrl__descriptor(b, "|b1", s, cfg, 0, off + f8, k);
        shmrl__puts(b, ",\"truncateds\":");
        shmrl__descriptor(b, "|b1", s, cfg, 0, off + f8 + b8, k);
        if (final) { shmrl__puts(b, ",\"final_obs\":"); shmrl__descriptor(b, "<f4", s, cfg, 1, off + f8 + 2 * b8, obs_bytes); }
    }
    shmrl__puts(b, "}");
    if (b->oom) return;
    head_len = b->len - head_at;
    shmrl__put_u32le(b->p + head_at - 4, (uint32_t)head_len);
    shmrl__pad8(b);   /* the frame header is 8 bytes, so the body's alignment is the frame's */
    shmrl__put_f32s(b, s->obs, k * (size_t)cfg->obs_size);
    shmrl__pad8(b);
    if (!outcome) return;
    shmrl__put_f32s(b, s->rewards, k);
    shmrl__pad8(b);
    for (r = 0; r < k; r++) shmrl__put(b, s->terminateds[r] ? &one : &zero, 1);
    shmrl__pad8(b);
    for (r = 0; r < k; r++) shmrl__put(b, s->truncateds[r] ? &one : &zero, 1);
    shmrl__pad8(b);
    if (final)
        for (r = 0; r < k; r++) shmrl__put_f32s(b, shmrl__row(s, cfg->obs_size, 1, (int)r), (size_t)cfg->obs_size);
}

static shmrl_status shmrl__check_step(shmrl_client *c, const shmrl_step *s, int outcome, int *final) {
    size_t i, n = (size_t)s->k * (size_t)c->config.obs_size;
    int r;
    *final = 0;
    if (!c->inference) return shmrl__fail(c, SHMRL_ERR_ARG, "shmrl_act needs server-side inference (options.server_inference)");
    if (s->k < 1 || s->k > SHMRL_MAX_ENVS) return shmrl__fail(c, SHMRL_ERR_ARG, "k = %d: 1 to %d envs per ACT", s->k, SHMRL_MAX_ENVS);
    if (c->k && s->k != c->k) return shmrl__fail(c, SHMRL_ERR_ARG, "k = %d, but this connection started with %d", s->k, c->k);
    if (!s->obs) return shmrl__fail(c, SHMRL_ERR_ARG, "obs is NULL");
    if (c->config.action_type == SHMRL_BOX ? !s->box_actions : !s->actions)
        return shmrl__fail(c, SHMRL_ERR_ARG, "no array for the actions (%s)", c->config.action_type == SHMRL_BOX ? "box_actions" : "actions");
    for (i = 0; i < n; i++)
        if (!isfinite(s->obs[i])) return shmrl__fail(c, SHMRL_ERR_ARG, "obs[%lu] is not finite", (unsigned long)i);
    if (!outcome) return SHMRL_OK;
    if (!s->rewards || !s->terminateds || !s->truncateds)
        return shmrl__fail(c, SHMRL_ERR_ARG, "rewards, terminateds and truncateds are needed after the first ACT");
    for (r = 0; r < s->k; r++) {
        if (!isfinite(s->rewards[r])) return shmrl__fail(c, SHMRL_ERR_ARG, "rewards[%d] is not finite", r);
        if (s->truncateds[r]) *final = 1;
    }
    if (*final && !s->final_obs) return shmrl__fail(c, SHMRL_ERR_ARG, "an env was truncated: final_obs is needed");
    for (r = 0; *final && r < s->k; r++)
        for (i = 0; s->truncateds[r] && i < (size_t)c->config.obs_size; i++)
            if (!isfinite(s->final_obs[(size_t)r * (size_t)c->config.obs_size + i]))
                return shmrl__fail(c, SHMRL_ERR_ARG, "final_obs of env %d is not finite", r);
    return SHMRL_OK;
}

static int64_t shmrl__i64le(const unsigned char *p) {
    uint64_t v = 0;
    int i;
    for (i = 7; i >= 0; i--) v = v << 8 | p[i];
    return (int64_t)v;
}

static float shmrl__f32le(const unsigned char *p) {
    uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The actions of a binary ACTIONS: {"__nd__": [dtype, shape, offset, nbytes]} */
static shmrl_status shmrl__binary_actions(shmrl_client *c, const shmrl__msg *m, const char *v, double *out, size_t count) {
    double spec[4 + SHMRL_MAX_DIMS], shape[3];
    const char *nd = shmrl__get(v, m->end, "__nd__"), *p;
    int n, box = c->config.action_type == SHMRL_BOX, is_f4, is_i8;
    size_t i, offset, nbytes, size;
    if (!nd || (p = shmrl__ws(nd, m->end)) >= m->end || *p != '[') return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "ACTIONS: actions is no array");
    p = shmrl__ws(p + 1, m->end);
    is_f4 = shmrl__string_is(p, m->end, "<f4");
    is_i8 = shmrl__string_is(p, m->end, "<i8");
    if (box ? !is_f4 : !is_i8) return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "ACTIONS: actions of an unexpected dtype");
    p = shmrl__ws(shmrl__skip_string(p, m->end), m->end);
    if (!p || p >= m->end || *p != ',' || !shmrl__numbers(p + 1, m->end, shape, 3, &n)) return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "ACTIONS: bad shape");
    p = shmrl__ws(shmrl__skip_value(p + 1, m->end, 1), m->end);
    if (!p || p >= m->end || *p != ',' || !(p = shmrl__number(p + 1, m->end, &spec[0]))
        || (p = shmrl__ws(p, m->end)) >= m->end || *p != ',' || !shmrl__number(p + 1, m->end, &spec[1]))
        return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "ACTIONS: bad array descriptor");
    size = box ? 4 : 8;
    if (shape[0] != c->k || (n == 2 ? shape[1] != c->config.action_dim : (n != 1 || c->config.action_dim != 1)))
        return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "ACTIONS: actions of the wrong shape");
    if (!shmrl__int_in(spec[0], 0, (double)m->data_len) || !shmrl__int_in(spec[1], 0, (double)m->data_len))
        return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "ACTIONS: the actions' block lies outside the data");
    offset = (size_t)spec[0];
    nbytes = (size_t)spec[1];
    if (nbytes != count * size || offset % 8 || offset + nbytes > m->data_len)
        return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "ACTIONS: the actions' block lies outside the data");
    for (i = 0; i < count; i++)
        out[i] = box ? shmrl__f32le(m->data + offset + 4 * i) : (double)shmrl__i64le(m->data + offset + 8 * i);
    return SHMRL_OK;
}

/* The actions of a JSON ACTIONS: [a, ...] or [[a, ...], ...] */
static shmrl_status shmrl__json_actions(shmrl_client *c, const shmrl__msg *m, const char *p, double *out, size_t count) {
    size_t got = 0;
    int dim = c->config.action_dim, n, nested = c->config.action_type != SHMRL_DISCRETE;
    p = shmrl__ws(p, m->end);
    if (p >= m->end || *p != '[') return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "ACTIONS: actions is not a list");
    p++;
    while (got < count) {
        p = shmrl__ws(p, m->end);
        if (nested) {
            if (!shmrl__numbers(p, m->end, out + got, dim, &n) || n != dim) break;
            p = shmrl__skip_value(p, m->end, 1);
        } else if (!(p = shmrl__number(p, m->end, out + got))) {
            break;
        }
        got += nested ? (size_t)dim : 1;
        p = shmrl__ws(p, m->end);
        if (!p || p >= m->end || *p != (got < count ? ',' : ']')) break;
        p++;
    }
    if (got < count || !p) return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "ACTIONS: actions of the wrong shape");
    return SHMRL_OK;
}

static shmrl_status shmrl__read_actions(shmrl_client *c, const shmrl__msg *m, shmrl_step *s) {
    const shmrl_config *cfg = &c->config;
    size_t count = (size_t)s->k * (size_t)cfg->action_dim, i;
    const char *v = shmrl__get(m->head, m->end, "actions");
    double seq, *vals = (double *)malloc(count * sizeof *vals);
    shmrl_status st;
    if (!vals) return shmrl__lost(c, SHMRL_ERR_NOMEM, "out of memory for %lu actions", (unsigned long)count);
    if (!v) st = shmrl__lost(c, SHMRL_ERR_PROTOCOL, "ACTIONS without actions");
    else if (*shmrl__ws(v, m->end) == '{') st = shmrl__binary_actions(c, m, v, vals, count);
    else st = shmrl__json_actions(c, m, v, vals, count);
    for (i = 0; st == SHMRL_OK && i < count; i++) {
        int d = (int)(i % (size_t)cfg->action_dim);
        if (cfg->action_type == SHMRL_BOX) {
            double x = vals[i] < cfg->low[d] ? cfg->low[d] : vals[i] > cfg->high[d] ? cfg->high[d] : vals[i];
            if (!(x >= -FLT_MAX && x <= FLT_MAX))
                st = shmrl__lost(c, SHMRL_ERR_PROTOCOL, "ACTIONS: a Box action that is not a finite float");
            else
                s->box_actions[i] = (float)x;
        } else {
            long n = cfg->action_type == SHMRL_DISCRETE ? cfg->action_n : cfg->nvec[d];
            /* ACTIONS carries 0..n-1; a Discrete's env values begin at its start (gymnasium's). */
            long start = cfg->action_type == SHMRL_DISCRETE ? cfg->action_start : 0;
            if (vals[i] != floor(vals[i]) || vals[i] < 0 || (n > 0 && vals[i] >= (double)n))
                st = shmrl__lost(c, SHMRL_ERR_PROTOCOL, "ACTIONS: action %g is out of range", vals[i]);
            else
                s->actions[i] = (int64_t)vals[i] + start;
        }
    }
    free(vals);
    if (st == SHMRL_OK && shmrl__get_number(m->head, m->end, "weights_seq_no", &seq) && shmrl__int_in(seq, -1, 1e18))
        c->weights_seq_no = (long long)seq;
    return st;
}

shmrl_status shmrl_act(shmrl_client *c, shmrl_step *s) {
    shmrl__buf b;
    shmrl__msg m;
    shmrl_status st;
    int final, outcome = !c->fresh;
    if (c->fd < 0) return shmrl__fail(c, SHMRL_ERR_CLOSED, "not connected (shmrl_reconnect)");
    if ((st = shmrl__check_step(c, s, outcome, &final)) != SHMRL_OK) return st;
    b = shmrl__start(c);
    if (c->binary) shmrl__binary_act(&b, c, s, outcome, final);
    else shmrl__json_act(&b, c, s, outcome, final);
    st = shmrl__send_body(c, &b);
    shmrl__keep(c, &b);
    if (st != SHMRL_OK) return st;
    c->fresh = 0;
    c->k = s->k;
    if ((st = shmrl__expect(c, &m, "ACTIONS")) != SHMRL_OK) return st;
    if ((st = shmrl__read_actions(c, &m, s)) != SHMRL_OK) return st;
    c->acts++;
    return SHMRL_OK;
}

const char *shmrl_error(const shmrl_client *c) { return c->error[0] ? c->error : "no error"; }

const char *shmrl_status_name(shmrl_status s) {
    switch (s) {
    case SHMRL_OK: return "ok";
    case SHMRL_ERR_ARG: return "bad argument";
    case SHMRL_ERR_CONNECT: return "cannot connect";
    case SHMRL_ERR_IO: return "socket error";
    case SHMRL_ERR_CLOSED: return "connection closed";
    case SHMRL_ERR_TIMEOUT: return "timed out";
    case SHMRL_ERR_PROTOCOL: return "protocol error";
    case SHMRL_ERR_REFUSED: return "server-side inference refused";
    case SHMRL_ERR_UNSUPPORTED: return "unsupported spaces";
    case SHMRL_ERR_NOMEM: return "out of memory";
    }
    return "unknown status";
}

/* ---------------------------------------------------------------- client-side inference */

void shmrl_model_free(shmrl_model *m) {
    free(m->bytes);
    m->bytes = NULL;
    m->len = m->cap = 0;
}

static int shmrl__b64(int ch) {
    if (ch >= 'A' && ch <= 'Z') return ch - 'A';
    if (ch >= 'a' && ch <= 'z') return ch - 'a' + 26;
    if (ch >= '0' && ch <= '9') return ch - '0' + 52;
    return ch == '+' ? 62 : ch == '/' ? 63 : -1;
}

static uint32_t shmrl__crc32(const unsigned char *p, size_t n) {
    uint32_t table[256], crc = 0xFFFFFFFFu;
    uint32_t i, j;
    for (i = 0; i < 256; i++) {
        uint32_t v = i;
        for (j = 0; j < 8; j++) v = v & 1 ? 0xEDB88320u ^ (v >> 1) : v >> 1;
        table[i] = v;
    }
    while (n--) crc = table[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return crc ^ 0xFFFFFFFFu;
}

static int shmrl__decode_fail(char *err, size_t err_len, const char *why) {
    if (err && err_len) snprintf(err, err_len, "onnx_file: %s", why);
    return 0;
}

/* base64 (a JSON string's content: "\/" is "/") -> gzip member -> its stored deflate blocks.
   shmrl sends the model stored (gzip level 0), so no inflater is needed; any other block
   type is refused. */
int shmrl_decode_onnx_file(const char *text, size_t len, shmrl_model *m, char *err, size_t err_len) {
    unsigned char *gz = (unsigned char *)malloc(len / 4 * 3 + 3), *out;
    size_t n = 0, i, pos, out_len = 0;
    uint32_t acc = 0;
    int bits = 0, flags, last = 0;
    if (!gz) return shmrl__decode_fail(err, err_len, "out of memory");
    for (i = 0; i < len; i++) {   /* base64, padded or not */
        int v = text[i] == '\\' ? -2 : text[i] == '=' ? -3 : shmrl__b64((unsigned char)text[i]);
        if (v == -2) continue;
        if (v == -3) break;
        if (v < 0) { free(gz); return shmrl__decode_fail(err, err_len, "not base64"); }
        acc = acc << 6 | (uint32_t)v;
        if ((bits += 6) >= 8) { bits -= 8; gz[n++] = (unsigned char)(acc >> bits); }
    }
    if (n < 18 || gz[0] != 0x1f || gz[1] != 0x8b || gz[2] != 8) { free(gz); return shmrl__decode_fail(err, err_len, "not a gzip member"); }
    flags = gz[3];
    pos = 10;
    if (flags & 4) pos += 2 + (size_t)(gz[10] | gz[11] << 8);                       /* FEXTRA */
    if (flags & 8) { while (pos < n && gz[pos]) pos++; pos++; }                      /* FNAME */
    if (flags & 16) { while (pos < n && gz[pos]) pos++; pos++; }                     /* FCOMMENT */
    if (flags & 2) pos += 2;                                                         /* FHCRC */
    out = (unsigned char *)malloc(n);   /* stored blocks are never longer than their input */
    if (!out) { free(gz); return shmrl__decode_fail(err, err_len, "out of memory"); }
    while (!last) {   /* each stored block: BFINAL and BTYPE in a byte's low bits, LEN, NLEN, the bytes */
        size_t block;
        if (pos + 5 > n) { free(gz); free(out); return shmrl__decode_fail(err, err_len, "the gzip member is cut short"); }
        last = gz[pos] & 1;
        if ((gz[pos] >> 1 & 3) != 0) {
            free(gz); free(out);
            return shmrl__decode_fail(err, err_len, "a compressed deflate block (only stored blocks are read here: "
                                      "shmrl sends the model at gzip level 0)");
        }
        block = (size_t)(gz[pos + 1] | gz[pos + 2] << 8);
        if ((block ^ (size_t)(gz[pos + 3] | gz[pos + 4] << 8)) != 0xFFFF || pos + 5 + block > n) {
            free(gz); free(out);
            return shmrl__decode_fail(err, err_len, pos + 5 + block > n ? "the gzip member is cut short"
                                                                        : "a stored block whose LEN and NLEN disagree");
        }
        memcpy(out + out_len, gz + pos + 5, block);
        out_len += block;
        pos += 5 + block;
    }
    if (pos + 8 > n || shmrl__crc32(out, out_len) != (uint32_t)(gz[pos] | gz[pos + 1] << 8 | gz[pos + 2] << 16 | (uint32_t)gz[pos + 3] << 24)
        || (uint32_t)out_len != (uint32_t)(gz[pos + 4] | gz[pos + 5] << 8 | gz[pos + 6] << 16 | (uint32_t)gz[pos + 7] << 24)) {
        free(gz); free(out);
        return shmrl__decode_fail(err, err_len, "the gzip trailer (CRC-32, size) does not match the data");
    }
    free(gz);
    free(m->bytes);
    m->bytes = out;
    m->len = out_len;
    m->cap = n;
    return 1;
}

/* A SET_STATE's model into m when its version differs from m's. */
static shmrl_status shmrl__read_state(shmrl_client *c, const shmrl__msg *m, shmrl_model *model) {
    double seq;
    const char *f = shmrl__get(m->head, m->end, "onnx_file"), *q;
    char why[160];
    shmrl_status st;
    if (!shmrl__get_number(m->head, m->end, "weights_seq_no", &seq) || !shmrl__int_in(seq, 0, 1e18))
        return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "SET_STATE without a weights_seq_no of 0 or more");
    if ((st = shmrl__action_dist(c, m, "SET_STATE", c->config.action_dist, &c->action_dist)) != SHMRL_OK) return st;
    if ((long long)seq == model->weights_seq_no && model->bytes) return SHMRL_OK;
    if (!f && shmrl__get(m->head, m->end, "policies"))
        return shmrl__lost(c, SHMRL_ERR_UNSUPPORTED, "SET_STATE has policies (a multi-agent run): this client plays one policy");
    if (!f || !(q = shmrl__skip_string(f, m->end)))
        return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "SET_STATE without an onnx_file string");
    if (!shmrl_decode_onnx_file(f + 1, (size_t)(q - f - 2), model, why, sizeof why))
        return shmrl__lost(c, SHMRL_ERR_PROTOCOL, "SET_STATE: %s", why);
    model->weights_seq_no = (long long)seq;
    return SHMRL_OK;
}

static uint64_t shmrl__splitmix(uint64_t *x) {
    uint64_t z = (*x += UINT64_C(0x9E3779B97F4A7C15));
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}

void shmrl_uniforms(uint64_t *rng, int d, double *z) {
    int i;
    for (i = 0; i < d; i++) z[i] = (double)(shmrl__splitmix(rng) >> 11) / 9007199254740992.0;
}

void shmrl_normals(uint64_t *rng, int d, double *z) {   /* Box-Muller, one pair per value */
    int i;
    for (i = 0; i < d; i++) {
        double u[2];
        shmrl_uniforms(rng, 2, u);
        z[i] = sqrt(-2.0 * log(1.0 - u[0])) * cos(6.283185307179586 * u[1]);
    }
}

static double shmrl__softplus(double x) { return x > 0 ? x + log1p(exp(-x)) : log1p(exp(x)); }

double shmrl_box_action(shmrl_action_dist how, const float *dist, int d, const float *low, const float *high,
                        const double *z, float *action) {
    const double half_log_2pi = 0.91893853320467274, log_2 = 0.69314718055994531;
    double logp = 0;
    int i;
    for (i = 0; i < d; i++) {
        double mean = dist[i], log_std = dist[d + i], range = (double)high[i] - (double)low[i], u;
        switch (how) {
        case SHMRL_DIST_UNIFORM:
            action[i] = (float)(low[i] + z[i] * range);
            logp -= log(range);
            break;
        case SHMRL_DIST_SQUASHED_GAUSSIAN:
            u = mean + exp(log_std) * z[i];
            action[i] = (float)(low[i] + (tanh(u) + 1.0) / 2.0 * range);
            if (action[i] > high[i]) action[i] = high[i];   /* float rounding past the bound */
            logp += -0.5 * z[i] * z[i] - log_std - half_log_2pi - 2.0 * (log_2 - u - shmrl__softplus(-2.0 * u))
                    - log(range / 2.0);
            break;
        default:
            action[i] = (float)(mean + exp(log_std) * z[i]);
            logp += -0.5 * z[i] * z[i] - log_std - half_log_2pi;
        }
    }
    return logp;
}

double shmrl_sample_box(shmrl_action_dist how, const float *dist, int d, const float *low, const float *high,
                        uint64_t *rng, float *action) {
    double z[SHMRL_MAX_ACTION_DIM];
    if (d > SHMRL_MAX_ACTION_DIM) d = SHMRL_MAX_ACTION_DIM;
    if (how == SHMRL_DIST_UNIFORM) shmrl_uniforms(rng, d, z);
    else shmrl_normals(rng, d, z);
    return shmrl_box_action(how, dist, d, low, high, z, action);
}

shmrl_status shmrl_get_state(shmrl_client *c, shmrl_model *m) {
    shmrl__msg msg;
    shmrl_status st;
    m->weights_seq_no = -1;
    if ((st = shmrl_send_json(c, "{\"type\": \"GET_STATE\"}")) != SHMRL_OK || (st = shmrl__expect(c, &msg, "SET_STATE")) != SHMRL_OK)
        return st;
    return shmrl__read_state(c, &msg, m);
}

void shmrl_rollout_free(shmrl_rollout *r) {
    int e;
    for (e = 0; r->env && e < r->k; e++) {
        shmrl__env_chunks *x = &r->env[e];
        free(x->obs); free(x->dist); free(x->rewards); free(x->logp); free(x->actions); free(x->box_actions);
        free(x->lengths); free(x->terminated); free(x->truncated); free(x->ids);
    }
    free(r->env);
    r->env = NULL;
}

shmrl_status shmrl_rollout_init(shmrl_rollout *r, int k, long obs_size, long dist_size, int action_dim, int box,
                                long steps_per_env) {
    int e, ok = 1;
    int64_t next_id = r->next_id;   /* kept across sessions: ids stay unique */
    size_t s = (size_t)steps_per_env;
    memset(r, 0, sizeof *r);
    r->next_id = next_id;
    if (k < 1 || obs_size < 1 || dist_size < 1 || action_dim < 1 || steps_per_env < 1) return SHMRL_ERR_ARG;
    r->k = k; r->obs_size = obs_size; r->dist_size = dist_size; r->action_dim = action_dim; r->box = box;
    r->steps_per_env = steps_per_env;
    r->env = (shmrl__env_chunks *)calloc((size_t)k, sizeof *r->env);
    if (!r->env) return SHMRL_ERR_NOMEM;
    for (e = 0; e < k; e++) {   /* rows: the open chunk's first, then a step's and at most a reset's per step */
        shmrl__env_chunks *x = &r->env[e];
        x->obs = (float *)malloc((2 * s + 1) * (size_t)obs_size * sizeof *x->obs);
        x->dist = (float *)malloc(s * (size_t)dist_size * sizeof *x->dist);
        x->rewards = (float *)malloc(s * sizeof *x->rewards);
        x->logp = (float *)malloc(s * sizeof *x->logp);
        if (box) x->box_actions = (float *)malloc(s * (size_t)action_dim * sizeof *x->box_actions);
        else x->actions = (int64_t *)malloc(s * (size_t)action_dim * sizeof *x->actions);
        x->lengths = (long *)malloc((s + 1) * sizeof *x->lengths);
        x->terminated = (unsigned char *)malloc(s + 1);
        x->truncated = (unsigned char *)malloc(s + 1);
        x->ids = (int64_t *)malloc((s + 2) * sizeof *x->ids);
        ok = ok && x->obs && x->dist && x->rewards && x->logp && (box ? x->box_actions != NULL : x->actions != NULL)
             && x->lengths && x->terminated && x->truncated && x->ids;
    }
    if (!ok) { shmrl_rollout_free(r); return SHMRL_ERR_NOMEM; }
    return SHMRL_OK;
}

void shmrl_rollout_start(shmrl_rollout *r, int e, const float *obs) {
    shmrl__env_chunks *x = &r->env[e];
    memcpy(x->obs + (size_t)x->rows * (size_t)r->obs_size, obs, (size_t)r->obs_size * sizeof *obs);
    x->rows++;
    x->open_steps = 0;
    x->ids[x->nchunks] = r->next_id++;
}

shmrl_status shmrl_rollout_step(shmrl_rollout *r, int e, const int64_t *action, const float *box_action,
                                const float *dist, double logp, float reward, const float *next_obs,
                                int terminated, int truncated) {
    shmrl__env_chunks *x;
    size_t t, d = (size_t)r->action_dim;
    if (e < 0 || e >= r->k || (r->box ? !box_action : !action)) return SHMRL_ERR_ARG;
    x = &r->env[e];
    if (x->steps >= r->steps_per_env || x->rows == 0) return SHMRL_ERR_ARG;
    t = (size_t)x->steps++;
    if (r->box) memcpy(x->box_actions + t * d, box_action, d * sizeof *box_action);
    else memcpy(x->actions + t * d, action, d * sizeof *action);
    memcpy(x->dist + t * (size_t)r->dist_size, dist, (size_t)r->dist_size * sizeof *dist);
    x->logp[t] = (float)logp;
    x->rewards[t] = reward;
    memcpy(x->obs + (size_t)x->rows * (size_t)r->obs_size, next_obs, (size_t)r->obs_size * sizeof *next_obs);
    x->rows++;
    x->open_steps++;
    if (terminated || truncated) {   /* the chunk is complete; the next starts at shmrl_rollout_start */
        x->lengths[x->nchunks] = x->open_steps;
        x->terminated[x->nchunks] = (unsigned char)(terminated != 0);
        x->truncated[x->nchunks] = (unsigned char)(truncated != 0);
        x->nchunks++;
        x->open_steps = 0;
    }
    return SHMRL_OK;
}

long shmrl_rollout_steps(const shmrl_rollout *r) {
    long n = 0;
    int e;
    for (e = 0; e < r->k; e++) n += r->env[e].steps;
    return n;
}

/* What env e sends: its closed chunks and a running one (if it stepped), and their rows. */
static long shmrl__sent_chunks(const shmrl__env_chunks *x) { return x->nchunks + (x->open_steps > 0); }
static long shmrl__sent_rows(const shmrl__env_chunks *x) { return x->rows - (x->open_steps == 0); }

/* After a message: each env keeps its open chunk's last row (its next chunk's first), same id. */
static void shmrl__rollout_sent(shmrl_rollout *r) {
    int e;
    for (e = 0; e < r->k; e++) {
        shmrl__env_chunks *x = &r->env[e];
        size_t size = (size_t)r->obs_size;
        memmove(x->obs, x->obs + (size_t)(x->rows - 1) * size, size * sizeof *x->obs);
        x->ids[0] = x->ids[x->nchunks];
        x->rows = 1;
        x->steps = x->nchunks = x->open_steps = 0;
    }
}

static void shmrl__nd(shmrl__buf *b, const char *key, const char *dtype, long d0, long d1, const shmrl_config *cfg,
                      size_t *offset, size_t nbytes) {
    int d;
    shmrl__putf(b, "%s\"%s\":{\"__nd__\":[\"%s\",[%ld", strcmp(key, "lengths") ? "," : "", key, dtype, d0);   /* lengths: the first */
    if (cfg) for (d = 0; d < cfg->obs_ndim; d++) shmrl__putf(b, ",%ld", cfg->obs_shape[d]);
    else if (d1 > 0) shmrl__putf(b, ",%ld", d1);
    shmrl__putf(b, "],%lu,%lu]}", (unsigned long)*offset, (unsigned long)nbytes);
    *offset += (nbytes + 7) / 8 * 8;
}

/* One column over every env's block, then the padding to 8. */
#define SHMRL__COLUMN(b, r, field, per, sent)                                                   \
    do {                                                                                         \
        int e_;                                                                                  \
        for (e_ = 0; e_ < (r)->k; e_++)                                                          \
            shmrl__put((b), (r)->env[e_].field, (size_t)(sent) * (per) * sizeof *(r)->env[e_].field); \
        shmrl__pad8(b);                                                                          \
    } while (0)

static void shmrl__binary_episodes(shmrl__buf *b, const shmrl_client *c, const shmrl_rollout *r, long long seq) {
    const shmrl_config *cfg = c->config.obs_ndim > 0 && c->config.obs_size == r->obs_size ? &c->config : NULL;
    long n = 0, rows = 0, steps = 0, i;
    size_t off = 0, head_at, d = (size_t)r->action_dim;
    int e, single = !r->box && r->action_dim == 1;
    for (e = 0; e < r->k; e++) { n += shmrl__sent_chunks(&r->env[e]); rows += shmrl__sent_rows(&r->env[e]); steps += r->env[e].steps; }
    shmrl__put(b, SHMRL__MAGIC "\0\0\0\0", 8);
    head_at = b->len;
    shmrl__puts(b, "{\"type\":\"EPISODES_AND_GET_STATE\",\"episodes\":{\"__cols__\":{");
    shmrl__nd(b, "lengths", "<i8", n, 0, NULL, &off, (size_t)n * 8);
    shmrl__nd(b, "obs", "<f4", rows, cfg ? 0 : r->obs_size, cfg, &off, (size_t)rows * (size_t)r->obs_size * 4);
    shmrl__nd(b, "actions", r->box ? "<f4" : "<i8", steps, single ? 0 : r->action_dim, NULL, &off, (size_t)steps * d * (r->box ? 4 : 8));
    shmrl__nd(b, "rewards", "<f4", steps, 0, NULL, &off, (size_t)steps * 4);
    shmrl__nd(b, "action_dist_inputs", "<f4", steps, r->dist_size, NULL, &off, (size_t)steps * (size_t)r->dist_size * 4);
    shmrl__nd(b, "action_logp", "<f4", steps, 0, NULL, &off, (size_t)steps * 4);
    shmrl__nd(b, "is_terminated", "|b1", n, 0, NULL, &off, (size_t)n);
    shmrl__nd(b, "is_truncated", "|b1", n, 0, NULL, &off, (size_t)n);
    shmrl__nd(b, "weights_seq_no", "<i8", n, 0, NULL, &off, (size_t)n * 8);
    shmrl__puts(b, ",\"episode_id\":[");
    for (e = 0, i = 0; e < r->k; e++) {
        long j;
        for (j = 0; j < shmrl__sent_chunks(&r->env[e]); j++, i++) shmrl__putf(b, i ? ",%lld" : "%lld", (long long)r->env[e].ids[j]);
    }
    shmrl__putf(b, "]}},\"timesteps\":%ld}", steps);
    if (b->oom) return;
    shmrl__put_u32le(b->p + head_at - 4, (uint32_t)(b->len - head_at));
    shmrl__pad8(b);
    for (e = 0; e < r->k; e++) {   /* lengths: the closed chunks', then the running one's */
        const shmrl__env_chunks *x = &r->env[e];
        long j;
        for (j = 0; j < shmrl__sent_chunks(x); j++) {
            int64_t v = j < x->nchunks ? x->lengths[j] : x->open_steps;
            unsigned char le[8];
            int q;
            for (q = 0; q < 8; q++) le[q] = (unsigned char)((uint64_t)v >> (8 * q));
            shmrl__put(b, le, 8);
        }
    }
    shmrl__pad8(b);
    for (e = 0; e < r->k; e++)
        shmrl__put_f32s(b, r->env[e].obs, (size_t)shmrl__sent_rows(&r->env[e]) * (size_t)r->obs_size);
    shmrl__pad8(b);
    if (r->box) SHMRL__COLUMN(b, r, box_actions, d, r->env[e_].steps);
    else SHMRL__COLUMN(b, r, actions, d, r->env[e_].steps);
    SHMRL__COLUMN(b, r, rewards, 1, r->env[e_].steps);
    SHMRL__COLUMN(b, r, dist, (size_t)r->dist_size, r->env[e_].steps);
    SHMRL__COLUMN(b, r, logp, 1, r->env[e_].steps);
    for (i = 0; i < 2; i++) {   /* is_terminated, is_truncated: a running chunk's are 0 */
        static const unsigned char zero = 0;
        for (e = 0; e < r->k; e++) {
            const shmrl__env_chunks *x = &r->env[e];
            shmrl__put(b, i ? x->truncated : x->terminated, (size_t)x->nchunks);
            if (x->open_steps > 0) shmrl__put(b, &zero, 1);
        }
        shmrl__pad8(b);
    }
    for (i = 0; i < n; i++) {
        unsigned char le[8];
        int q;
        for (q = 0; q < 8; q++) le[q] = (unsigned char)((uint64_t)seq >> (8 * q));
        shmrl__put(b, le, 8);
    }
}
#undef SHMRL__COLUMN

static void shmrl__json_floats(shmrl__buf *b, const float *v, size_t n) {
    size_t i;
    shmrl__put(b, "[", 1);
    for (i = 0; i < n; i++) { if (i) shmrl__puts(b, ", "); shmrl__put_float(b, v[i]); }
    shmrl__put(b, "]", 1);
}

/* The list form (RLLINK.md section 4): one object per chunk. */
static void shmrl__json_episodes(shmrl__buf *b, const shmrl_rollout *r, long long seq) {
    long steps = 0, i = 0;
    size_t size = (size_t)r->obs_size, w = (size_t)r->dist_size, d = (size_t)r->action_dim;
    int e;
    shmrl__puts(b, "{\"type\": \"EPISODES_AND_GET_STATE\", \"episodes\": [");
    for (e = 0; e < r->k; e++) {
        const shmrl__env_chunks *x = &r->env[e];
        long j, row = 0, t0 = 0;
        for (j = 0; j < shmrl__sent_chunks(x); j++, i++) {
            long len = j < x->nchunks ? x->lengths[j] : x->open_steps, t, q;
            shmrl__puts(b, i ? ", {\"obs\": [" : "{\"obs\": [");
            for (t = 0; t <= len; t++) { if (t) shmrl__puts(b, ", "); shmrl__json_floats(b, x->obs + (size_t)(row + t) * size, size); }
            shmrl__puts(b, "], \"actions\": [");
            for (t = t0; t < t0 + len; t++) {
                if (t > t0) shmrl__puts(b, ", ");
                if (r->box) shmrl__json_floats(b, x->box_actions + (size_t)t * d, d);
                else if (d == 1) shmrl__putf(b, "%lld", (long long)x->actions[t]);
                else for (q = 0; q < (long)d; q++) shmrl__putf(b, q ? ", %lld" : "[%lld", (long long)x->actions[(size_t)t * d + (size_t)q]);
                if (!r->box && d > 1) shmrl__puts(b, "]");
            }
            shmrl__puts(b, "], \"rewards\": ");
            shmrl__json_floats(b, x->rewards + t0, (size_t)len);
            shmrl__puts(b, ", \"action_dist_inputs\": [");
            for (t = t0; t < t0 + len; t++) { if (t > t0) shmrl__puts(b, ", "); shmrl__json_floats(b, x->dist + (size_t)t * w, w); }
            shmrl__puts(b, "], \"action_logp\": ");
            shmrl__json_floats(b, x->logp + t0, (size_t)len);
            shmrl__puts(b, j < x->nchunks && x->terminated[j] ? ", \"is_terminated\": true" : ", \"is_terminated\": false");
            shmrl__puts(b, j < x->nchunks && x->truncated[j] ? ", \"is_truncated\": true" : ", \"is_truncated\": false");
            shmrl__putf(b, ", \"episode_id\": %lld", (long long)x->ids[j]);
            shmrl__putf(b, ", \"weights_seq_no\": %lld}", seq);
            row += len + 1;
            t0 += len;
        }
        steps += x->steps;
    }
    shmrl__putf(b, "], \"timesteps\": %ld}", steps);
}

shmrl_status shmrl_send_rollout(shmrl_client *c, shmrl_rollout *r, shmrl_model *m) {
    shmrl__buf b;
    shmrl__msg msg;
    shmrl_status st;
    if (c->fd < 0) return shmrl__fail(c, SHMRL_ERR_CLOSED, "not connected (shmrl_reconnect)");
    if (c->inference) return shmrl__fail(c, SHMRL_ERR_ARG, "this connection asked for server-side inference (shmrl_act)");
    if (!c->binary && c->config.obs_ndim > 1)
        return shmrl__fail(c, SHMRL_ERR_UNSUPPORTED, "observations of more than one dimension need the binary codec here");
    b = shmrl__start(c);
    if (c->binary) shmrl__binary_episodes(&b, c, r, m->weights_seq_no);
    else shmrl__json_episodes(&b, r, m->weights_seq_no);
    st = shmrl__send_body(c, &b);
    shmrl__keep(c, &b);
    if (st != SHMRL_OK) return st;
    shmrl__rollout_sent(r);
    if ((st = shmrl__expect(c, &msg, "SET_STATE")) != SHMRL_OK) return st;
    return shmrl__read_state(c, &msg, m);
}

#endif /* SHMRL_CLIENT_IMPLEMENTED */
#endif /* SHMRL_CLIENT_IMPLEMENTATION */

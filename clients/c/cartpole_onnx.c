/* cartpole_onnx: K CartPole-v1 envs in C that run the policy themselves, with onnxruntime's
   C library: client-side inference, as shmrl's own simulators do it.

       make -C clients/c onnx && clients/c/build/cartpole_onnx --port 5556 --envs 16

   Per session: the handshake (PING without "inference", GET_CONFIG), GET_STATE's model
   loaded into an onnxruntime session; then K envs stepped ceil(env_steps_per_sample / K)
   times per message, each step one run of the model for all K observations (output 0:
   two logits per env) and an action sampled per env with its log-probability; the steps
   go out as one EPISODES_AND_GET_STATE (shmrl_send_rollout: chunks, running episodes
   continued in the next message), and its SET_STATE's model is loaded when its version
   is new. The envs and the command line are cartpole_env.h's (without --probe).
   Exit status: 0 when the server ended the session or after --steps/--seconds; 1 when no
   session was ever made, or the model cannot be run (the reason on stderr); 2 for bad
   arguments. */
#define SHMRL_CLIENT_IMPLEMENTATION
#include "shmrl_client.h"
#include "cartpole_env.h"
#include "ort_api.h"

#define INPUT_NAME "onnx::Gemm_0"          /* the policy's input for a flat Box observation */
#define OUTPUT_NAME "action_dist_inputs"   /* output 0 */
#define N_ACTIONS 2                        /* CartPole's Discrete(2): two logits per env */

/* ---------------------------------------------------------------- the policy in onnxruntime */

typedef struct policy {
    const OrtApi *ort;
    OrtEnv *env;
    OrtSessionOptions *options;
    OrtMemoryInfo *cpu;
    OrtSession *session;        /* the loaded version's */
    OrtValue *input, *output;   /* tensors over the envs' obs [K, 4] and dist [K, 2] */
    float *dist;
    char error[SHMRL_ERROR_LEN];
} policy;

static int ort_ok(policy *p, OrtStatus *status, const char *what) {
    if (!status) return 1;
    snprintf(p->error, sizeof p->error, "onnxruntime: %s: %s", what, p->ort->GetErrorMessage(status));
    p->ort->ReleaseStatus(status);
    return 0;
}

/* One thread, no graph optimization: a 64x64 MLP runs in microseconds, and a client is one
   of many small processes (shmrl.onnxio.policy's settings). The tensors wrap obs and dist,
   so a run reads the envs' observations where they are and writes output 0 in place. */
static int policy_init(policy *p, int k, float *obs) {
    const OrtApiBase *base = OrtGetApiBase();
    int64_t in_shape[2], out_shape[2];
    const OrtApi *ort;
    memset(p, 0, sizeof *p);
    in_shape[0] = out_shape[0] = k;
    in_shape[1] = 4;
    out_shape[1] = N_ACTIONS;
    p->ort = ort = base->GetApi(ORT_API_VERSION);
    if (!ort) {
        snprintf(p->error, sizeof p->error, "onnxruntime %s does not serve C API version %d", base->GetVersionString(),
                 ORT_API_VERSION);
        return 0;
    }
    if (!(p->dist = (float *)calloc((size_t)k * N_ACTIONS, sizeof *p->dist))) {
        snprintf(p->error, sizeof p->error, "out of memory");
        return 0;
    }
    return ort_ok(p, ort->CreateEnv(ORT_LOGGING_LEVEL_WARNING, "cartpole_onnx", &p->env), "CreateEnv")
           && ort_ok(p, ort->CreateSessionOptions(&p->options), "CreateSessionOptions")
           && ort_ok(p, ort->SetIntraOpNumThreads(p->options, 1), "SetIntraOpNumThreads")
           && ort_ok(p, ort->SetInterOpNumThreads(p->options, 1), "SetInterOpNumThreads")
           && ort_ok(p, ort->SetSessionGraphOptimizationLevel(p->options, ORT_DISABLE_ALL), "SetSessionGraphOptimizationLevel")
           && ort_ok(p, ort->CreateCpuMemoryInfo(OrtArenaAllocator, OrtMemTypeDefault, &p->cpu), "CreateCpuMemoryInfo")
           && ort_ok(p, ort->CreateTensorWithDataAsOrtValue(p->cpu, obs, (size_t)k * 4 * sizeof *obs, in_shape, 2,
                                                            ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, &p->input), "the input tensor")
           && ort_ok(p, ort->CreateTensorWithDataAsOrtValue(p->cpu, p->dist, (size_t)k * N_ACTIONS * sizeof *p->dist,
                                                            out_shape, 2, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, &p->output),
                     "the output tensor");
}

/* A new version: its session replaces the old one only once it loaded. */
static int policy_load(policy *p, const shmrl_model *m) {
    OrtSession *session = NULL;
    if (!ort_ok(p, p->ort->CreateSessionFromArray(p->env, m->bytes, m->len, p->options, &session), "loading the model"))
        return 0;
    if (p->session) p->ort->ReleaseSession(p->session);
    p->session = session;
    return 1;
}

/* Output 0 for the K observations, into p->dist. */
static int policy_run(policy *p) {
    const char *in = INPUT_NAME, *out = OUTPUT_NAME;
    return ort_ok(p, p->ort->Run(p->session, NULL, &in, (const OrtValue *const *)&p->input, 1, &out, 1, &p->output),
                  "running the model");
}

static void policy_free(policy *p) {
    if (!p->ort) return;
    if (p->session) p->ort->ReleaseSession(p->session);
    if (p->input) p->ort->ReleaseValue(p->input);
    if (p->output) p->ort->ReleaseValue(p->output);
    if (p->cpu) p->ort->ReleaseMemoryInfo(p->cpu);
    if (p->options) p->ort->ReleaseSessionOptions(p->options);
    if (p->env) p->ort->ReleaseEnv(p->env);
    free(p->dist);
}

/* a ~ softmax(logits), and logp = logits[a] - logsumexp(logits) (RLLINK.md section 4.2) */
static int64_t sample(const float *logits, int n, uint64_t *rng, double *logp) {
    double m = logits[0], total = 0, u, acc = 0;
    int i, a = n - 1;
    for (i = 1; i < n; i++) if (logits[i] > m) m = logits[i];
    for (i = 0; i < n; i++) total += exp(logits[i] - m);
    u = (double)(rng_next(rng) >> 11) / 9007199254740992.0 * total;
    for (i = 0; i < n; i++) {
        acc += exp(logits[i] - m);
        if (u < acc) { a = i; break; }
    }
    *logp = logits[a] - m - log(total);
    return a;
}

/* ---------------------------------------------------------------- the loop */

typedef struct client {
    const args *a;
    shmrl_client *c;
    policy p;
    shmrl_model model;
    shmrl_rollout rollout;
    envs e;
    stats st;
    double *logp;
    uint64_t rng;
    int fatal;   /* the model cannot be run: no retry helps */
} client;

static int limits_reached(const client *x) {
    return (x->a->max_steps > 0 && x->st.env_steps >= x->a->max_steps)
           || (x->a->max_seconds > 0 && now_s() - x->st.t_start >= x->a->max_seconds);
}

/* Load the model just received; a model onnxruntime refuses ends the client. */
static shmrl_status load(client *x) {
    if (policy_load(&x->p, &x->model)) return SHMRL_OK;
    snprintf(x->c->error, sizeof x->c->error, "%s", x->p.error);
    x->fatal = 1;
    return SHMRL_ERR_UNSUPPORTED;
}

/* One step of the K envs: the model, a sample per env, the physics, the record. */
static shmrl_status step(client *x) {
    envs *e = &x->e;
    int i;
    if (!policy_run(&x->p)) {
        snprintf(x->c->error, sizeof x->c->error, "%s", x->p.error);
        x->fatal = 1;
        return SHMRL_ERR_UNSUPPORTED;
    }
    for (i = 0; i < e->k; i++) e->actions[i] = sample(x->p.dist + N_ACTIONS * i, N_ACTIONS, &x->rng, &x->logp[i]);
    step_all(e, &x->rng, &x->st);
    for (i = 0; i < e->k; i++) {
        int ended = e->terminateds[i] || e->truncateds[i];
        shmrl_rollout_step(&x->rollout, i, &e->actions[i], NULL, x->p.dist + N_ACTIONS * i, x->logp[i], e->rewards[i],
                           (ended ? e->final_obs : e->obs) + 4 * i, e->terminateds[i], e->truncateds[i]);
        if (ended) shmrl_rollout_start(&x->rollout, i, e->obs + 4 * i);   /* the reset's obs */
    }
    return SHMRL_OK;
}

/* One session on a connection that just did its handshake: GET_STATE, then messages until
   the connection breaks (its status) or the limits are reached (SHMRL_OK). */
static shmrl_status session(client *x) {
    shmrl_client *c = x->c;
    long steps_per_env = (c->config.env_steps_per_sample + x->e.k - 1) / x->e.k, t;
    long long stepped = 0;   /* since the connection began: HEARTBEAT's env_steps */
    shmrl_status s;
    int i;
    if ((s = shmrl_get_state(c, &x->model)) != SHMRL_OK || (s = load(x)) != SHMRL_OK) return s;
    shmrl_rollout_free(&x->rollout);   /* the last session's: this one's steps per message may differ */
    if (shmrl_rollout_init(&x->rollout, x->e.k, 4, N_ACTIONS, 1, 0, steps_per_env) != SHMRL_OK)
        return shmrl__fail(c, SHMRL_ERR_NOMEM, "out of memory for %ld steps per env", steps_per_env);
    reset_all(&x->e, &x->rng);   /* the server forgot any open episodes */
    for (i = 0; i < x->e.k; i++) shmrl_rollout_start(&x->rollout, i, x->e.obs + 4 * i);
    if (!x->st.t_start) x->st.t_start = now_s();
    for (;;) {
        double t0;
        long long version = x->model.weights_seq_no;
        for (t = 0; t < steps_per_env; t++) {
            if ((s = step(x)) != SHMRL_OK) return s;
            stepped += x->e.k;
            if ((s = shmrl_heartbeat(c, stepped)) != SHMRL_OK) return s;
            if (limits_reached(x)) return SHMRL_OK;
        }
        t0 = now_s();
        if ((s = shmrl_send_rollout(c, &x->rollout, &x->model)) != SHMRL_OK) return s;
        x->st.lat[lat_bucket((now_s() - t0) * 1e6)]++;
        x->st.acts++;
        if (x->model.weights_seq_no != version && (s = load(x)) != SHMRL_OK) return s;
    }
}

/* Sessions until the limits, or the server is gone. Returns the exit status. */
static int play(client *x, const char *name) {
    shmrl_step unused;
    long long messages_at_connect = 0;
    int barren = 0;   /* sessions in a row that broke before a message was answered: failed attempts */
    x->st.trips = "message";
    if (!alloc_envs(&x->e, x->a->envs, &unused) || !(x->st.lat = (uint32_t *)calloc(LAT_BUCKETS, sizeof *x->st.lat))
        || !(x->logp = (double *)calloc((size_t)x->a->envs, sizeof *x->logp))) {
        fprintf(stderr, "%s %s: out of memory\n", prog, name);
        return 1;
    }
    if (!policy_init(&x->p, x->a->envs, x->e.obs)) {
        fprintf(stderr, "%s %s: %s\n", prog, name, x->p.error);
        return 1;
    }
    for (;;) {
        shmrl_status s = session(x);
        int served = x->st.acts > 0;
        if (s == SHMRL_OK) break;
        if (x->fatal || s == SHMRL_ERR_ARG || s == SHMRL_ERR_NOMEM) {
            fprintf(stderr, "%s %s: %s\n", prog, name, shmrl_error(x->c));
            return 1;
        }
        if (!x->a->quiet) fprintf(stderr, "%s %s: %s; reconnecting\n", prog, name, shmrl_error(x->c));
        barren = x->st.acts == messages_at_connect ? barren + 1 : 0;
        s = x->a->opt.max_retries >= 0 && barren > x->a->opt.max_retries ? s : shmrl_reconnect(x->c);
        if (s != SHMRL_OK) {
            summary(name, &x->st, served ? "the server ended the session" : "no session", x->a->latency_file);
            fprintf(stderr, "%s %s: %s\n", prog, name, shmrl_error(x->c));
            return served ? 0 : 1;
        }
        messages_at_connect = x->st.acts;
    }
    summary(name, &x->st, "steps done", x->a->latency_file);
    return 0;
}

int main(int argc, char **argv) {
    args a;
    shmrl_client c;
    shmrl_status s;
    client x;
    const char *name;
    int status;
    prog = "cartpole_onnx";
    client_side = 1;
    if (!parse_args(argc, argv, &a)) { usage(); return 2; }
    a.opt.server_inference = 0;   /* this client runs the policy */
    name = a.opt.client_name ? a.opt.client_name : "client";
    s = shmrl_open(&c, &a.opt);
    if (s != SHMRL_OK) {
        fprintf(stderr, "%s %s: no session with %s:%d (%s): %s\n", prog, name, a.opt.host, a.opt.port,
                shmrl_status_name(s), shmrl_error(&c));
        shmrl_close(&c);
        return 1;
    }
    if (c.config.action_type != SHMRL_ACTION_UNKNOWN && (c.config.action_type != SHMRL_DISCRETE || c.config.action_n != N_ACTIONS)) {
        fprintf(stderr, "%s %s: the server's action space is not Discrete(2): is it training CartPole?\n", prog, name);
        shmrl_close(&c);
        return 1;
    }
    memset(&x, 0, sizeof x);
    x.a = &a;
    x.c = &c;
    x.rng = a.seed;
    x.model.weights_seq_no = -1;
    status = play(&x, name);
    free_envs(&x.e);
    free(x.st.lat);
    free(x.logp);
    shmrl_rollout_free(&x.rollout);
    shmrl_model_free(&x.model);
    policy_free(&x.p);
    shmrl_close(&c);
    return status;
}

/* cartpole_env.h: K CartPole-v1 envs in C and the command line of the two CartPole clients
   (cartpole.c: the server runs the policy; cartpole_onnx.c: the client runs it with
   onnxruntime). Included by one .c file each, after shmrl_client.h's implementation.

   The physics are gymnasium's CartPole-v1 exactly (same constants, Euler integration,
   termination at |x| > 2.4 or |theta| > 12 degrees, truncation at 500 steps, reset
   uniform in [-0.05, 0.05]); tests/test_c_client.py steps gymnasium beside them. */
#ifndef SHMRL_CARTPOLE_ENV_H
#define SHMRL_CARTPOLE_ENV_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const char *prog = "cartpole";   /* the program's name in messages (main may change it) */
static int client_side = 0;              /* 1: the client runs the policy (cartpole_onnx's main sets it) */

/* ---------------------------------------------------------------- the physics (gymnasium's) */

#define GRAVITY 9.8
#define MASSCART 1.0
#define MASSPOLE 0.1
#define TOTAL_MASS (MASSPOLE + MASSCART)
#define LENGTH 0.5                          /* half the pole's length */
#define POLEMASS_LENGTH (MASSPOLE * LENGTH)
#define FORCE_MAG 10.0
#define TAU 0.02
#define THETA_THRESHOLD (12 * 2 * M_PI / 360)
#define X_THRESHOLD 2.4
#define MAX_EPISODE_STEPS 500
#ifndef M_PI
#define M_PI 3.14159265358979323846
#endif

typedef struct cartpole { double s[4]; int steps; double ret; } cartpole;

/* Returns terminated; s is x, x_dot, theta, theta_dot (float64, as gymnasium keeps it). */
static int cartpole_physics(double s[4], int action) {
    double force = action == 1 ? FORCE_MAG : -FORCE_MAG;
    double costheta = cos(s[2]), sintheta = sin(s[2]);
    double temp = (force + POLEMASS_LENGTH * (s[3] * s[3]) * sintheta) / TOTAL_MASS;
    double thetaacc = (GRAVITY * sintheta - costheta * temp)
                      / (LENGTH * (4.0 / 3.0 - MASSPOLE * (costheta * costheta) / TOTAL_MASS));
    double xacc = temp - POLEMASS_LENGTH * thetaacc * costheta / TOTAL_MASS;
    s[0] = s[0] + TAU * s[1];
    s[1] = s[1] + TAU * xacc;
    s[2] = s[2] + TAU * s[3];
    s[3] = s[3] + TAU * thetaacc;
    return s[0] < -X_THRESHOLD || s[0] > X_THRESHOLD || s[2] < -THETA_THRESHOLD || s[2] > THETA_THRESHOLD;
}

static uint64_t rng_next(uint64_t *x) {   /* splitmix64 */
    uint64_t z = (*x += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static void cartpole_reset(cartpole *env, uint64_t *rng, float *obs) {
    int i;
    for (i = 0; i < 4; i++) {
        env->s[i] = -0.05 + 0.1 * ((double)(rng_next(rng) >> 11) / 9007199254740992.0);
        obs[i] = (float)env->s[i];
    }
    env->steps = 0;
    env->ret = 0;
}

/* Lines "x x_dot theta theta_dot action" in, "x x_dot theta theta_dot terminated" out:
   tests/test_c_client.py steps gymnasium beside it. */
static int physics_check(void) {
    double s[4];
    int action;
    while (scanf("%lf %lf %lf %lf %d", &s[0], &s[1], &s[2], &s[3], &action) == 5) {
        int terminated = cartpole_physics(s, action);
        printf("%.17g %.17g %.17g %.17g %d\n", s[0], s[1], s[2], s[3], terminated);
    }
    return 0;
}

/* ---------------------------------------------------------------- round-trip statistics */

/* ACT round trips: 1 us buckets below 10 ms, 100 us buckets to 10 s, the last for more */
#define LAT_FINE 10000
#define LAT_BUCKETS (LAT_FINE + 99901)

static int lat_bucket(double us) {
    if (us < LAT_FINE) return (int)us;
    us = LAT_FINE + (us - LAT_FINE) / 100;
    return us < LAT_BUCKETS - 1 ? (int)us : LAT_BUCKETS - 1;
}

static long lat_us(int bucket) {   /* the bucket's lower bound */
    return bucket < LAT_FINE ? bucket : LAT_FINE + 100L * (bucket - LAT_FINE);
}

typedef struct stats {
    long long env_steps, episodes, acts;
    double t_start;          /* the first ACTIONS */
    double returns[100];
    int nreturns;
    uint32_t *lat;           /* round trips by lat_bucket */
    const char *trips;       /* of what: "act" (NULL), "message" */
} stats;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double lat_quantile(const stats *st, double q) {
    long long n = 0, seen = 0, target;
    int i;
    for (i = 0; i < LAT_BUCKETS; i++) n += st->lat[i];
    if (!n) return 0;
    target = (long long)ceil(q * (double)n);
    for (i = 0; i < LAT_BUCKETS; i++) if ((seen += st->lat[i]) >= target) break;
    return lat_us(i) / 1000.0;   /* ms */
}

static void summary(const char *name, const stats *st, const char *why, const char *latency_file) {
    double mean = 0;
    int i, n = st->nreturns < 100 ? st->nreturns : 100;
    for (i = 0; i < n; i++) mean += st->returns[i];
    printf("%s %s: %s: %lld env steps, %lld episodes, mean return of the last %d: %.1f, "
           "%s round trips %lld, p50 %.3f ms, p99 %.3f ms, in %.2f s\n", prog, name, why, st->env_steps, st->episodes, n,
           n ? mean / n : 0.0, st->trips ? st->trips : "act", st->acts, lat_quantile(st, 0.5), lat_quantile(st, 0.99),
           st->acts ? now_s() - st->t_start : 0.0);
    fflush(stdout);
    if (latency_file) {   /* "microseconds count" per line, for a benchmark to merge */
        FILE *f = fopen(latency_file, "w");
        for (i = 0; f && i < LAT_BUCKETS; i++) if (st->lat[i]) fprintf(f, "%ld %lu\n", lat_us(i), (unsigned long)st->lat[i]);
        if (f) fclose(f);
    }
}

/* ---------------------------------------------------------------- the command line */

typedef struct args {
    shmrl_options opt;
    int envs, probe, quiet;
    long long max_steps;
    double max_seconds;
    const char *latency_file;
    uint64_t seed;
} args;

static void usage(void) {
    int pad = (int)strlen(prog) + 8;   /* the continuation lines under the first option */
    const char *round_trip = client_side ? "EPISODES_AND_GET_STATE" : "ACT";
    fprintf(stderr, "usage: %s [--host H] [--port P] [--envs K] [--name NAME] [--token SECRET]\n", prog);
    fprintf(stderr, "%*s[--max-retries N] [--codec binary|json] [--seed S] [--steps N]\n", pad, "");
    fprintf(stderr, "%*s[--seconds S] [--reply-timeout S] [--latency-file F] [--quiet]%s\n", pad, "",
            client_side ? "" : " [--probe]");
    fprintf(stderr, "%*s[--physics-check]\n", pad, "");
    fprintf(stderr, "  --envs K          CartPole envs stepped together, one %s for all (default 1)\n",
            client_side ? "run of the policy" : "ACT");
    fprintf(stderr,
            "  --max-retries N   failed connection attempts in a row before giving up (default 5;\n"
            "                    -1: forever); waits 0.1 s doubling to 5 s between them\n"
            "  --steps N         stop after N env steps (default: until the server ends)\n");
    fprintf(stderr, "  --seconds S       stop S seconds after the first %s came\n", client_side ? "model" : "actions");
    fprintf(stderr, "  --latency-file F  write the %s round trips there at the end\n"
                    "                    (\"microseconds count\" lines)\n", round_trip);
    if (!client_side) fprintf(stderr, "  --probe           handshake only (no inference asked), print the config, exit\n");
    fprintf(stderr, "  --physics-check   step states read from stdin (a test of the physics)\n");
}

static int parse_args(int argc, char **argv, args *a) {
    int i;
    shmrl_options_init(&a->opt);
    a->envs = 1;
    a->probe = a->quiet = 0;
    a->max_steps = 0;
    a->max_seconds = 0;
    a->latency_file = NULL;
    a->seed = (uint64_t)getpid() * 1000003u ^ (uint64_t)time(NULL);
    for (i = 1; i < argc; i++) {
        const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(k, "--probe") && client_side) { fprintf(stderr, "%s: --probe is cartpole's\n", prog); return 0; }
        if (!strcmp(k, "--probe")) { a->probe = 1; continue; }
        if (!strcmp(k, "--quiet")) { a->quiet = 1; continue; }
        if (!strcmp(k, "--physics-check")) { exit(physics_check()); }
        if (!strcmp(k, "--help") || !strcmp(k, "-h")) { usage(); exit(0); }
        if (!v) { fprintf(stderr, "%s: %s needs a value\n", prog, k); return 0; }
        i++;
        if (!strcmp(k, "--host")) a->opt.host = v;
        else if (!strcmp(k, "--port")) a->opt.port = atoi(v);
        else if (!strcmp(k, "--envs")) a->envs = atoi(v);
        else if (!strcmp(k, "--name")) a->opt.client_name = v;
        else if (!strcmp(k, "--token")) a->opt.auth_token = v;
        else if (!strcmp(k, "--max-retries")) a->opt.max_retries = atoi(v);
        else if (!strcmp(k, "--reply-timeout")) a->opt.reply_timeout_s = atof(v);
        else if (!strcmp(k, "--seed")) a->seed = (uint64_t)strtoull(v, NULL, 10);
        else if (!strcmp(k, "--steps")) a->max_steps = atoll(v);
        else if (!strcmp(k, "--seconds")) a->max_seconds = atof(v);
        else if (!strcmp(k, "--latency-file")) a->latency_file = v;
        else if (!strcmp(k, "--codec") && (!strcmp(v, "binary") || !strcmp(v, "json"))) a->opt.binary = !strcmp(v, "binary");
        else { fprintf(stderr, "%s: unknown option or value: %s %s\n", prog, k, v); return 0; }
    }
    if (a->envs < 1 || a->envs > SHMRL_MAX_ENVS) { fprintf(stderr, "%s: --envs must be 1..%d\n", prog, SHMRL_MAX_ENVS); return 0; }
    a->opt.obs_size = 4;
    /* CartPole-v1's spaces, declared: a learner started without --env trains them */
    a->opt.declare.obs_ndim = 1;
    a->opt.declare.obs_shape[0] = 4;
    a->opt.declare.action_type = SHMRL_DISCRETE;
    a->opt.declare.action_n = 2;
    a->opt.declare.action_dim = 1;
    if (a->probe) a->opt.server_inference = 0;
    return 1;
}

/* ---------------------------------------------------------------- the loop */

typedef struct envs {
    int k;
    cartpole *env;
    float *obs, *final_obs, *rewards;
    unsigned char *terminateds, *truncateds;
    int64_t *actions;
} envs;

static void reset_all(envs *e, uint64_t *rng) {
    int i;
    for (i = 0; i < e->k; i++) cartpole_reset(&e->env[i], rng, e->obs + 4 * i);
}

/* Step every env with its action; ended episodes are reset (their last obs in final_obs). */
static void step_all(envs *e, uint64_t *rng, stats *st) {
    int i, j;
    for (i = 0; i < e->k; i++) {
        cartpole *env = &e->env[i];
        int terminated = cartpole_physics(env->s, (int)e->actions[i]);
        int truncated = ++env->steps >= MAX_EPISODE_STEPS;   /* gymnasium's TimeLimit */
        float *obs = e->obs + 4 * i;
        e->rewards[i] = 1.0f;
        e->terminateds[i] = (unsigned char)terminated;
        e->truncateds[i] = (unsigned char)truncated;
        env->ret += 1.0;
        for (j = 0; j < 4; j++) obs[j] = (float)env->s[j];
        if (terminated || truncated) {
            memcpy(e->final_obs + 4 * i, obs, 4 * sizeof *obs);
            st->returns[st->episodes % 100] = env->ret;
            st->episodes++;
            if (st->nreturns < 100) st->nreturns++;
            cartpole_reset(env, rng, obs);
        }
    }
    st->env_steps += e->k;
}

static int alloc_envs(envs *e, int k, shmrl_step *step) {
    e->k = k;
    e->env = (cartpole *)calloc((size_t)k, sizeof *e->env);
    e->obs = (float *)calloc((size_t)k * 4, sizeof *e->obs);
    e->final_obs = (float *)calloc((size_t)k * 4, sizeof *e->final_obs);
    e->rewards = (float *)calloc((size_t)k, sizeof *e->rewards);
    e->terminateds = (unsigned char *)calloc((size_t)k, 1);
    e->truncateds = (unsigned char *)calloc((size_t)k, 1);
    e->actions = (int64_t *)calloc((size_t)k, sizeof *e->actions);
    memset(step, 0, sizeof *step);
    step->k = k;
    step->obs = e->obs;
    step->rewards = e->rewards;
    step->terminateds = e->terminateds;
    step->truncateds = e->truncateds;
    step->final_obs = e->final_obs;
    step->actions = e->actions;
    return e->env && e->obs && e->final_obs && e->rewards && e->terminateds && e->truncateds && e->actions;
}

/* What alloc_envs allocated (free(NULL) is a no-op: a partial allocation frees too). */
static void free_envs(envs *e) {
    free(e->env);
    free(e->obs);
    free(e->final_obs);
    free(e->rewards);
    free(e->terminateds);
    free(e->truncateds);
    free(e->actions);
    memset(e, 0, sizeof *e);
}


#endif /* SHMRL_CARTPOLE_ENV_H */

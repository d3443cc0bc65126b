/* cartpole: K CartPole-v1 envs in C, trained by a shmrl server that chooses their actions.

       make -C clients/c && clients/c/build/cartpole --port 5556 --envs 16

   The envs (gymnasium's physics) and the command line are cartpole_env.h's. Exit status:
   0 when the server ended the session (it closed the connection after the run ended and
   reconnecting gave up) or after --steps; 1 when no session was ever made (with the
   reason on stderr); 2 for bad arguments. */
#define SHMRL_CLIENT_IMPLEMENTATION
#include "shmrl_client.h"
#include "cartpole_env.h"

static int probe(shmrl_client *c) {
    printf("connected: codec %s, heartbeat_s %g, inference %s, env_steps_per_sample %ld, obs_size %ld, "
           "action_n %ld\n", c->binary ? "binary" : "json", c->heartbeat_s, c->inference ? "server" : "client",
           c->config.env_steps_per_sample, c->config.obs_size, c->config.action_n);
    return 0;
}

/* ACT, step, repeat; reconnect when the connection breaks. Returns the exit status. */
static int play(const args *a, const char *name, shmrl_client *c, envs *e, stats *st) {
    shmrl_step step;
    long long acts_at_connect = 0;
    int barren = 0;   /* sessions in a row that broke before any actions came: failed attempts */
    uint64_t rng = a->seed;
    if (!alloc_envs(e, a->envs, &step) || !(st->lat = (uint32_t *)calloc(LAT_BUCKETS, sizeof *st->lat))) {
        fprintf(stderr, "cartpole %s: out of memory\n", name);
        return 1;
    }
    reset_all(e, &rng);
    for (;;) {
        double t0 = now_s();
        shmrl_status s = shmrl_act(c, &step);
        if (s == SHMRL_ERR_ARG || s == SHMRL_ERR_NOMEM) {
            fprintf(stderr, "cartpole %s: %s\n", name, shmrl_error(c));
            return 1;
        }
        if (s != SHMRL_OK) {
            if (!a->quiet) fprintf(stderr, "cartpole %s: %s; reconnecting\n", name, shmrl_error(c));
            barren = c->acts == acts_at_connect ? barren + 1 : 0;
            s = a->opt.max_retries >= 0 && barren > a->opt.max_retries ? s : shmrl_reconnect(c);
            if (s != SHMRL_OK) {
                int served = c->acts > 0;
                summary(name, st, served ? "the server ended the session" : "no session", a->latency_file);
                fprintf(stderr, "cartpole %s: %s\n", name, shmrl_error(c));
                return served ? 0 : 1;
            }
            reset_all(e, &rng);   /* the server forgot the open episodes */
            acts_at_connect = c->acts;
            continue;
        }
        st->lat[lat_bucket((now_s() - t0) * 1e6)]++;
        if (!st->acts++) st->t_start = now_s();
        step_all(e, &rng, st);
        if ((a->max_steps > 0 && st->env_steps >= a->max_steps)
            || (a->max_seconds > 0 && now_s() - st->t_start >= a->max_seconds))
            break;
    }
    summary(name, st, "steps done", a->latency_file);
    return 0;
}

int main(int argc, char **argv) {
    args a;
    shmrl_client c;
    shmrl_status s;
    envs e;
    stats st;
    const char *name;
    int status;
    if (!parse_args(argc, argv, &a)) { usage(); return 2; }
    name = a.opt.client_name ? a.opt.client_name : "client";
    s = shmrl_open(&c, &a.opt);
    if (s != SHMRL_OK) {
        fprintf(stderr, "cartpole %s: no session with %s:%d (%s): %s\n", name, a.opt.host, a.opt.port,
                shmrl_status_name(s), shmrl_error(&c));
        shmrl_close(&c);
        return 1;
    }
    if (a.probe) { probe(&c); shmrl_close(&c); return 0; }
    if (c.config.action_type != SHMRL_DISCRETE || c.config.action_n != 2) {
        fprintf(stderr, "cartpole %s: the server's action space is not Discrete(2): is it training CartPole?\n", name);
        shmrl_close(&c);
        return 1;
    }
    memset(&st, 0, sizeof st);
    memset(&e, 0, sizeof e);
    status = play(&a, name, &c, &e, &st);
    free_envs(&e);
    free(st.lat);
    shmrl_close(&c);
    return status;
}

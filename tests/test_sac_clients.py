"""Issue 36, item 3: clients sample what a --algo sac learner defines. A client that runs the
policy itself says in its PING which distributions beyond RLlib's it samples
(``action_dists``); a SAC learner refuses one that does not list them (RLlib's client) at
the handshake, in one log line, and never a server-side-inference client. The JS and C
clients' squashed Gaussian and uniform draws have the torch side's log-probabilities."""
from __future__ import annotations

import json

import numpy as np

import pytest

from conftest import FakeServer
from shmrl import rllink
from shmrl.envs.make import env_spec
from shmrl.server.hub import Hub
from shmrl.server.store import DEFAULT_POLICY, EpisodeStore

PENDULUM = env_spec("Pendulum-v1")


def sac_hub(state_dist: str = "uniform") -> tuple[Hub, FakeServer]:
    """A Hub as a --algo sac run builds it (SET_CONFIG's action_dist), its SET_STATE saying
    ``state_dist`` (the warm-up's uniform, or the squashed Gaussian after it)."""
    hub = Hub({DEFAULT_POLICY: PENDULUM}, EpisodeStore(), 64, on_policy=False, max_pending_steps=256,
              extra_config={"action_dist": "squashed_gaussian"})
    hub.set_state(1, {DEFAULT_POLICY: {"onnx_file": "abc", "weights_seq_no": 1, "action_dist": state_dist}})
    return hub, FakeServer()


def ping(hub: Hub, server: FakeServer, conn_id: str, **fields) -> None:
    body = rllink.encode({"type": "PING", **fields}, "json")   # through the codec's validation, as on the wire
    hub.handle(server, conn_id, rllink.decode_request(body))


@pytest.mark.parametrize("fields, state_dist, refused", [
    ({}, "uniform", "has no action_dists"),                                             # RLlib's client
    ({"codecs": ["binary"], "client_name": "old"}, "squashed_gaussian", "has no action_dists"),
    ({"action_dists": ["squashed_gaussian"]}, "uniform", "lists only ['squashed_gaussian']"),   # no warm-up
    ({"action_dists": ["squashed_gaussian"]}, "squashed_gaussian", None),               # past the warm-up
    ({"action_dists": ["squashed_gaussian", "uniform", "beta"]}, "uniform", None),
    ({"inference": "server"}, "uniform", None),                                         # the server samples
])
def test_a_sac_learner_refuses_a_ping_that_cannot_sample_its_policy(fields, state_dist, refused):
    hub, server = sac_hub(state_dist)
    ping(hub, server, "tcp:c0", **fields)
    if refused is None:
        assert server.dropped == [] and server.replies[0][1]["type"] == "PONG"
        assert "tcp:c0" in hub.connections
        return
    assert server.replies == [] and "tcp:c0" not in hub.connections   # closed, nothing sent back
    [(conn_id, reason)] = server.dropped
    assert conn_id == "tcp:c0" and "\n" not in reason
    assert refused in reason and "squashed_gaussian" in reason and "server-side inference" in reason, reason


def test_a_ppo_learner_takes_any_ping():
    hub = Hub({DEFAULT_POLICY: PENDULUM}, EpisodeStore(), 64)
    hub.set_state(1, {DEFAULT_POLICY: {"onnx_file": "abc", "weights_seq_no": 1}})
    server = FakeServer()
    for i, fields in enumerate([{}, {"action_dists": ["squashed_gaussian", "uniform"]}]):
        ping(hub, server, f"tcp:c{i}", **fields)
    assert server.dropped == [] and [m["type"] for _, m in server.replies] == ["PONG", "PONG"]


def test_the_hub_names_the_clients_that_cannot_sample_sac():
    """--algo auto switches to SAC only if every client running the policy itself can sample it."""
    hub = Hub({DEFAULT_POLICY: PENDULUM}, EpisodeStore(), 64)
    hub.set_state(1, {DEFAULT_POLICY: {"onnx_file": "abc", "weights_seq_no": 1}})
    server = FakeServer()
    for i, fields in enumerate([{}, {"action_dists": ["squashed_gaussian", "uniform"]}, {"inference": "server"},
                                {"action_dists": ["squashed_gaussian"], "client_name": "old"}]):
        ping(hub, server, f"tcp:c{i}", **fields)
    assert hub.unable_to_sample(("squashed_gaussian", "uniform")) == ["tcp:c0", "tcp:c3 (old)"]
    assert hub.unable_to_sample(()) == []


@pytest.mark.parametrize("bad", ["squashed_gaussian", ["x" * 33], list("abcdefghijklmnopq"), [1]])
def test_action_dists_must_be_a_short_list_of_short_strings(bad):
    with pytest.raises(rllink.ProtocolError, match="'action_dists' must be a list"):
        rllink.decode_request(rllink.encode({"type": "PING", "action_dists": bad}, "json"))


def test_shmrls_python_client_lists_what_its_sampler_samples():
    """shmrl.sim's handshake (every client-side simulator, rings and TCP) says it samples
    SAC's distributions, which its ActionSampler does."""
    from shmrl.client import actor
    from shmrl.client.action_sampler import DISTS

    sent = []

    class Recording:
        def request(self, msg):
            sent.append(msg)
            return {"type": {"PING": "PONG", "GET_CONFIG": "SET_CONFIG", "GET_STATE": "SET_STATE"}[msg["type"]]}

    actor.handshake(Recording())
    assert sent[0]["action_dists"] == ["squashed_gaussian", "uniform"]
    assert set(sent[0]["action_dists"]) <= set(DISTS)
    hub, server = sac_hub()
    ping(hub, server, "tcp:sim", **{k: v for k, v in sent[0].items() if k != "type"})
    assert server.dropped == []


# ---------------------------------------------------------------- the JS client

JS_SAMPLE = """
const c = require('./shmrl_client');
const uniforms = __UNIFORMS__;
let i = 0;
const random = () => uniforms[i++ % uniforms.length];
const space = { type: 'Box', shape: [2], low: [-2, 0], high: [2, 1] };
const s = new c.Sampler(space, random, 'squashed_gaussian');
const dist = Float32Array.from(__DIST__);
const out = { squashed: [], uniform: [] };
for (let row = 0; row < dist.length / 4; row++) out.squashed.push(s.sample(dist, 4 * row));
s.setDist('uniform');
for (let row = 0; row < 200; row++) out.uniform.push(s.sample(dist, 0));
let refused = null;
try { new c.Sampler({ type: 'Box', shape: [1] }, random, 'squashed_gaussian'); } catch (e) { refused = e.message; }
process.stdout.write(JSON.stringify({ ...out, refused, dists: c.ACTION_DISTS }));
"""


def box_muller(u1, u2):
    return np.sqrt(-2 * np.log(1 - u1)) * np.cos(2 * np.pi * u2)


def test_the_js_squashed_gaussian_is_numpys_for_the_same_u_and_z():
    """The JS sampler's draws from known uniforms: the action is low + (tanh(u) + 1) / 2 x
    (high - low) and its logp numpy's squashed_log_prob for the same u and z (float64 on
    both sides), far into the squash too (mean 25: tanh(u) is 1.0 in float64, where a naive
    log(1 - tanh(u)^2) is -inf); uniform draws fill the bounds with -log of the volume."""
    from conftest import need_js_client
    from test_js_client import node

    from shmrl.client.action_sampler import squashed_log_prob

    js = need_js_client()
    rng = np.random.default_rng(0)
    rows = 300
    dist = np.concatenate([rng.normal(0, 1.5, (rows, 2)), rng.uniform(-3, 1, (rows, 2))], 1)
    dist[:5, :2], dist[5:10, :2], dist[:10, 2:] = 25.0, -25.0, -3.0   # tanh(u) is +-1.0 in float64
    dist = dist.astype(np.float32).astype(np.float64)   # what the JS reads from its Float32Array
    uniforms = rng.random(4 * rows).tolist()
    script = JS_SAMPLE.replace("__UNIFORMS__", json.dumps(uniforms)).replace("__DIST__", json.dumps(dist.ravel().tolist()))
    out = json.loads(node(script, js))
    assert out["dists"] == ["squashed_gaussian", "uniform"]
    u = np.array(uniforms).reshape(rows, 2, 2)     # two uniforms per dimension, dimension by dimension
    z = box_muller(u[:, :, 0], u[:, :, 1])
    mean, log_std = dist[:, :2], dist[:, 2:]
    pre = mean + np.exp(log_std) * z
    low, high = np.array([-2.0, 0.0]), np.array([2.0, 1.0])
    actions = np.array([a for a, _ in out["squashed"]])
    logp = np.array([lp for _, lp in out["squashed"]])
    np.testing.assert_allclose(actions, low + (np.tanh(pre) + 1) / 2 * (high - low), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(logp, squashed_log_prob(pre, z, log_std, (high - low) / 2), rtol=1e-9, atol=1e-9)
    assert np.isfinite(logp).all() and (actions[:5] == high).all() and (actions[5:10] == low).all()
    uni = np.array([a for a, _ in out["uniform"]])
    assert ((uni >= low) & (uni <= high)).all() and (uni.max(0) - uni.min(0) > 0.8 * (high - low)).all()
    np.testing.assert_allclose([lp for _, lp in out["uniform"]], -np.log(high - low).sum(), rtol=1e-12)
    assert "needs a Box action space with finite low < high" in out["refused"]


def test_the_js_squashed_log_probabilities_are_torchs():
    """The learner's side: SAC.log_prob of the JS client's Pendulum actions under the same
    output 0 (torch recovers u from the action with atanh, in float32)."""
    from conftest import need_js_client
    from test_js_client import node
    from test_sac import pendulum_sac

    torch = pytest.importorskip("torch")
    js = need_js_client()
    sac, _ = pendulum_sac()
    rng = np.random.default_rng(3)
    dist = np.concatenate([rng.normal(0, 1, (400, 1)), rng.uniform(-2, 0.5, (400, 1))], 1).astype(np.float32)
    script = ("const c = require('./shmrl_client'); const { SPACE } = require('./pendulum');"
              "const s = new c.Sampler(SPACE.action, c.seededRandom(7), 'squashed_gaussian');"
              f"const d = Float32Array.from({json.dumps(dist.ravel().tolist())}); const out = [];"
              "for (let r = 0; r < d.length / 2; r++) out.push(s.sample(d, 2 * r));"
              "process.stdout.write(JSON.stringify(out));")
    out = json.loads(node(script, js))
    actions = np.array([a for a, _ in out], np.float32)
    assert -2 <= actions.min() and actions.max() <= 2 and actions.std() > 0.5
    expected = sac.log_prob(torch.tensor(dist), torch.tensor(actions)).numpy()
    np.testing.assert_allclose([lp for _, lp in out], expected, rtol=1e-3, atol=2e-3)


def bare_ping(port: int) -> bytes:
    """RLlib's client's PING (no fields) on a new connection; what came back before the close."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        body = b'{"type": "PING"}'
        sock.sendall(b"%08d" % len(body) + body)
        got = b""
        while chunk := sock.recv(4096):   # the server closes it: recv gives b"" (or the timeout fails the test)
            got += chunk
        return got


def test_a_js_pendulum_trains_a_sac_learner_and_rllibs_ping_is_refused(start_run, tmp_path):
    """`--env gym:Pendulum-v1 --algo sac --sims 0 --tcp-port 0`: a bare PING (RLlib's client)
    is closed with nothing sent back and one line in the learner's log; the JS Pendulum
    samples uniformly through the warm-up, then the squashed Gaussian, and its steps are
    accepted (none dropped) and counted for it, until the step budget ends the run."""
    import subprocess

    from conftest import check_books, need_js_client, summary_of

    js = need_js_client()
    pytest.importorskip("gymnasium")
    run = start_run("--env", "gym:Pendulum-v1", "--algo", "sac", "--sims", 0, "--tcp-port", 0,
                    "--learning-starts", 400, "--gradient-steps", 0.1, "--max-env-steps", 1600,
                    "--env-steps-per-sample", 200, "--logdir", tmp_path / "run", "--no-tensorboard", "--no-plot")
    port = run.tcp_port(timeout=120)
    assert bare_ping(port) == b""
    line = run.wait_until(lambda out: [x for x in out.splitlines() if "refused at the handshake" in x], 60,
                          "the refusal's log line")
    assert len(line) == 1 and "has no action_dists" in line[0] and "Traceback" not in run.output(), run.output()
    client = subprocess.Popen(["node", js / "pendulum.js", "--port", str(port), "--envs", "2", "--give-up-s", "1",
                               "--name", "js-pendulum"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        code = run.proc.wait(300)
        out = client.communicate(timeout=60)[0]
    finally:
        client.kill()
        client.wait()
    assert code in (0, 1), run.output()     # 1: the step budget, not solved
    assert client.returncode == 0 and "the server ended the session" in out, out
    assert out.index("sampling actions as uniform") < out.index("sampling actions as squashed_gaussian"), out
    summary = summary_of(tmp_path / "run")
    assert summary["config"]["algo"] == "sac" and summary["bad_frames"] == 0, summary
    assert summary["env_steps_dropped"] == {}, summary
    [(client_id, steps)] = summary["env_steps_by_client"].items()
    assert client_id.startswith("tcp:") and steps >= 1600 and summary["updates"] >= 1, summary
    check_books(summary)


# ---------------------------------------------------------------- the C header

C_SAMPLE = r"""
#define SHMRL_CLIENT_IMPLEMENTATION
#include "shmrl_client.h"
#include <stdio.h>
/* stdin: d, the bounds, then rows of (how, d means, d log-stds, d draws); stdout: a row of
   the action and its logp per row, then rows drawn by shmrl_sample_box from seed 7. */
int main(void) {
    int d, i, how, n = 0;
    float low[4], high[4], dist[8], action[4];
    double z[4];
    uint64_t rng = 7;
    if (scanf("%d", &d) != 1 || d > 4) return 3;
    for (i = 0; i < d; i++) if (scanf("%f", &low[i]) != 1) return 3;
    for (i = 0; i < d; i++) if (scanf("%f", &high[i]) != 1) return 3;
    while (scanf("%d", &how) == 1) {
        for (i = 0; i < 2 * d; i++) if (scanf("%f", &dist[i]) != 1) return 3;
        for (i = 0; i < d; i++) if (scanf("%lf", &z[i]) != 1) return 3;
        printf("%.17g", shmrl_box_action((shmrl_action_dist)how, dist, d, low, high, z, action));
        for (i = 0; i < d; i++) printf(" %.9g", action[i]);
        printf("\n");
        n++;
    }
    for (i = 0; i < 400; i++) {
        double logp = shmrl_sample_box(i < 200 ? SHMRL_DIST_SQUASHED_GAUSSIAN : SHMRL_DIST_UNIFORM, dist, d, low, high,
                                       &rng, action);
        printf("%.17g", logp);
        for (how = 0; how < d; how++) printf(" %.9g", action[how]);
        printf("\n");
    }
    return n ? 0 : 4;
}
"""


def c_program(tmp_path, name: str, source: str):
    """``source`` built against clients/c/shmrl_client.h with the Makefile's warning flags."""
    import shutil

    from test_c_client import C_DIR, WARN, gcc

    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed (the C client needs it)")
    (tmp_path / f"{name}.c").write_text(source)
    gcc(*WARN, "-I", str(C_DIR), "-o", str(tmp_path / name), str(tmp_path / f"{name}.c"), "-lm")
    return tmp_path / name


def test_the_c_headers_box_sampler_is_numpys_and_torchs(tmp_path):
    """shmrl_box_action for given draws z: the squashed Gaussian's action and logp are
    numpy's squashed_log_prob for the same u and z (and torch's SAC.log_prob of the float32
    action, away from the bounds), finite deep in the squash; uniform fills the bounds with
    -log of the volume; RLlib's Gaussian is the checker's; shmrl_sample_box's own draws too."""
    import subprocess

    from test_sac import pendulum_sac

    from shmrl.checker.rules import log_probs
    from shmrl.client.action_sampler import squashed_log_prob
    from shmrl.core.spaces import action_layout

    torch = pytest.importorskip("torch")
    gym = pytest.importorskip("gymnasium")
    exe = c_program(tmp_path, "sample", C_SAMPLE)
    rng = np.random.default_rng(5)

    def run(low, high, how, dist, z):
        lines = [f"{len(low)} {' '.join(repr(float(v)) for v in low)} {' '.join(repr(float(v)) for v in high)}"]
        lines += [f"{h} {' '.join(repr(float(v)) for v in row)} {' '.join(repr(float(v)) for v in zr)}"
                  for h, row, zr in zip(how, dist, z)]
        done = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        rows = np.array([[float(v) for v in line.split()] for line in done.stdout.splitlines()])
        return rows[:len(dist), 0], rows[:len(dist), 1:], rows[len(dist):, 0], rows[len(dist):, 1:]

    # Two dimensions of different bounds: the three distributions against numpy.
    n, low, high = 300, np.array([-2.0, 0.0]), np.array([2.0, 1.0])
    dist = np.concatenate([rng.normal(0, 1.5, (n, 2)), rng.uniform(-3, 1, (n, 2))], 1).astype(np.float32)
    dist[:5, :2], dist[5:10, :2], dist[:10, 2:] = 25.0, -25.0, -3.0   # tanh(u) is +-1.0 in float64
    z = rng.normal(size=(n, 2))
    how = np.repeat([1, 2, 0], n // 3)            # squashed, uniform, RLlib's Gaussian
    z[how == 2] = rng.random(((how == 2).sum(), 2))
    logp, actions, drawn_logp, drawn = run(low, high, how, dist, z)
    sq, un, ga = how == 1, how == 2, how == 0
    d64 = dist.astype(np.float64)
    pre = d64[:, :2] + np.exp(d64[:, 2:]) * z
    np.testing.assert_allclose(logp[sq], squashed_log_prob(pre, z, d64[:, 2:], (high - low) / 2)[sq], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(actions[sq], (low + (np.tanh(pre) + 1) / 2 * (high - low))[sq], rtol=1e-6, atol=1e-6)
    assert np.isfinite(logp).all() and (actions[:5] == high).all() and (actions[5:10] == low).all()
    np.testing.assert_allclose(actions[un], (low + z * (high - low))[un], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(logp[un], -np.log(high - low).sum(), rtol=1e-12)
    box = gym.spaces.Box(low.astype(np.float32), high.astype(np.float32), dtype=np.float32)
    np.testing.assert_allclose(logp[ga], log_probs(action_layout(box), dist[ga], actions[ga]), atol=1e-4)
    # shmrl_sample_box's own draws (the last row's output 0): within the bounds, spread.
    sq_drawn, un_drawn = drawn[:200], drawn[200:]
    for part in (sq_drawn, un_drawn):
        assert ((part >= low) & (part <= high)).all() and (part.std(0) > 0).all()
    assert (un_drawn.max(0) - un_drawn.min(0) > 0.8 * (high - low)).all()
    np.testing.assert_allclose(drawn_logp[200:], -np.log(high - low).sum(), rtol=1e-12)

    # Pendulum's Box: the learner's torch log_prob of the float32 actions.
    sac, _ = pendulum_sac()
    dist = np.concatenate([rng.normal(0, 1, (300, 1)), rng.uniform(-2, 0.5, (300, 1))], 1).astype(np.float32)
    logp, actions, _, _ = run([-2.0], [2.0], [1] * 300, dist, rng.normal(size=(300, 1)))
    expected = sac.log_prob(torch.tensor(dist), torch.tensor(actions.astype(np.float32))).numpy()
    np.testing.assert_allclose(logp, expected, rtol=1e-3, atol=2e-3)


C_HANDSHAKE = r"""
#define SHMRL_CLIENT_IMPLEMENTATION
#include "shmrl_client.h"
#include <stdio.h>
int main(int argc, char **argv) {
    shmrl_options opt; shmrl_client c; shmrl_model m = {0};
    shmrl_options_init(&opt);
    if (argc < 3) return 4;
    opt.port = atoi(argv[1]); opt.server_inference = 0; opt.action_dists = atoi(argv[2]); opt.max_retries = 0;
    opt.binary = 0;
    if (shmrl_open(&c, &opt) != SHMRL_OK) { printf("error: %s\n", shmrl_error(&c)); shmrl_close(&c); return 1; }
    printf("config %d\n", (int)c.config.action_dist);
    if (shmrl_get_state(&c, &m) != SHMRL_OK) { printf("error: %s\n", shmrl_error(&c)); return 1; }
    printf("state %d\n", (int)c.action_dist);
    shmrl_model_free(&m);
    shmrl_close(&c);
    return 0;
}
"""
ONNX_FILE = "H4sIAAAAAAAEAwESAO3/YW4gT05OWCBtb2RlbCBmaWxlKURtnBIAAAA="   # RLLINK.md 3.3's example


@pytest.mark.parametrize("says, state_dist, expect", [
    (1, "uniform", ["config 1", "state 2"]),             # SAC's warm-up
    (1, None, ["config 1", "state 1"]),                  # SET_STATE without one: SET_CONFIG's
    (0, "uniform", ["error: SET_CONFIG: the learner's policy is sampled as SAC's (action_dist), and this client "
                    "does not say it samples it (options.action_dists)"]),
])
def test_the_c_header_reads_action_dist_and_says_it_samples_it(tmp_path, says, state_dist, expect):
    """A client-side C client with options.action_dists lists them in its PING, and reads
    SET_CONFIG's and SET_STATE's action_dist into config.action_dist and the client's action_dist;
    one without it is told, at the handshake, that it does not sample the learner's policy."""
    import subprocess

    from conftest import ListeningServer, read_body, send

    exe = c_program(tmp_path, "hs", C_HANDSHAKE)
    server = ListeningServer()
    proc = subprocess.Popen([str(exe), str(server.port), str(says)], stdout=subprocess.PIPE, text=True)
    try:
        conn = server.accept()
        ping = rllink.decode_request(read_body(conn))
        assert ping.get("action_dists") == (["squashed_gaussian", "uniform"] if says else None), ping
        send(conn, {"type": "PONG"})
        assert rllink.decode_request(read_body(conn))["type"] == "GET_CONFIG"
        send(conn, {"type": "SET_CONFIG", "env_steps_per_sample": 64, "force_on_policy": True,
                    "observation_shape": [3], "observation_dtype": "<f4", "action_dist": "squashed_gaussian",
                    "action_space": {"type": "Box", "shape": [1], "low": [-2.0], "high": [2.0]}})
        if says:
            assert rllink.decode_request(read_body(conn))["type"] == "GET_STATE"
            send(conn, {"type": "SET_STATE", "onnx_file": ONNX_FILE, "weights_seq_no": 1,
                        **({"action_dist": state_dist} if state_dist else {})})
        out = proc.communicate(timeout=30)[0]
    finally:
        proc.kill()
        proc.wait()
        server.close()
    assert out.splitlines() == expect, out


def test_a_learner_slower_than_its_clients_holds_them_until_it_takes_their_steps():
    """An off-policy Hub (``paced``) answers a sample at once while fewer than a train batch of
    env steps wait; a client that sends when one waits goes on once the learner took them, not
    at new weights (SAC publishes mid-update): so the learner's gradient steps per env step hold
    however fast the clients are, and no client's steps go over its budget to be dropped."""
    from conftest import episodes_msg

    store = EpisodeStore()
    hub = Hub({DEFAULT_POLICY: env_spec("CartPole-v1")}, store, 8, on_policy=False, max_pending_steps=16,
              client_budget=64)
    hub.paced = True
    hub.set_state(1, {DEFAULT_POLICY: {"onnx_file": "abc", "weights_seq_no": 1}})
    server = FakeServer()
    answered = lambda conn_id: sum(c == conn_id and m["type"] == "SET_STATE" for c, m in server.replies)  # noqa: E731

    def sample(conn_id: str, seed: int) -> None:   # 8 CartPole steps, through the codec as on the wire
        hub.handle(server, conn_id, rllink.decode_request(rllink.encode(episodes_msg(8, seed), "json")))

    sample("tcp:a", 0)
    assert answered("tcp:a") == 1                                                       # 8 of 16 wait: go on
    sample("tcp:b", 1)
    assert answered("tcp:b") == 0 and hub.waiting == ["tcp:b"] and store.pending_steps == 16   # a batch waits
    sample("tcp:a", 2)
    assert answered("tcp:a") == 1 and hub.waiting == ["tcp:b", "tcp:a"]                # held too, steps kept
    hub.set_state(2, {DEFAULT_POLICY: {"onnx_file": "abd", "weights_seq_no": 2}})     # weights mid-update
    hub.release_if_room()
    assert (answered("tcp:a"), answered("tcp:b"), len(hub.waiting)) == (1, 0, 2)      # still held: no room
    taken = store.take(2, None, 16)                                                     # the learner's batch
    assert sum(b.num_steps for b in taken[DEFAULT_POLICY]) == 16 and store.pending_steps == 8
    hub.release_if_room()
    assert (answered("tcp:a"), answered("tcp:b"), hub.waiting) == (2, 1, [])
    assert server.replies[-1][1]["weights_seq_no"] == 2 and store.steps_dropped == {}

"""The settings of a run, each defined once (default, help, check), and what every command
line of shmrl shares: its exit statuses, its errors.

Every setting is one field of one group below, declared with ``setting(default, help,
...)``: its house default, its ``--help`` text, its flag's metavar or choices, and its
check. ``Config`` holds every group (``Config(sims=0, lr=1e-3)``: flat), the command line
of ``python -m shmrl.run`` is generated from the fields (``shmrl.config.flags``), and
``validate`` is the one check of a configuration, for the command line and for
``shmrl.train`` alike. The other command lines declare their settings the same way
(``shmrl.config.faces``).

A setting declared ``preset=True`` is None in a fresh ``Config``: None means "the env's
preset", the house default overridden by the env's family and the env's own table in
``presets.toml`` (``resolve_config``). A value given always wins.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from shmrl.config.algos import ALGO_CHOICES, sac_refusal
from shmrl.config.presets import PRESETS_FILE, preset_tables

EXIT_SOLVED, EXIT_BUDGET, EXIT_USAGE, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
# A simulator that stops because nothing it could send is trainable says why by its exit status.
SIM_EXIT_ENV_NOT_FINITE, SIM_EXIT_POLICY_NOT_FINITE, SIM_EXIT_ALL_MASKED = 10, 11, 12
SIM_EXIT_REASONS = {
    SIM_EXIT_ENV_NOT_FINITE: "stopped: its env returned an observation or reward that is not finite (NaN or inf)",
    SIM_EXIT_POLICY_NOT_FINITE: "stopped: the policy's outputs are not finite (NaN or inf): its weights are",
    SIM_EXIT_ALL_MASKED: "stopped: its env's action_mask forbids every action",
}


class ConfigError(ValueError):
    """What the run was asked to do cannot be done, found before anything starts: a bad
    setting, a port in use, a log folder that cannot be made, a checkpoint that is damaged
    or does not fit. ``python -m shmrl.run`` prints it as one line and exits 2."""


# The environment variable that gives --auth-token its default, on every command line.
AUTH_TOKEN_VAR = "SHMRL_AUTH_TOKEN"
# --env declared: the spaces the first external client declares in its GET_CONFIG
# (docs/RLLINK.md §3.2); what a command line of --sims 0 --tcp-port P without --env trains.
DECLARED_ENV = "declared"


# ---------------------------------------------------------------- how a setting is declared

@dataclass(frozen=True)
class Rule:
    """A check of one value: ``holds(value)``, else the value "must be {says}"."""
    says: str
    holds: Callable[[object], bool]


def at_least(low) -> Rule:
    return Rule(f">= {low}", lambda v: v >= low)


def above(low) -> Rule:
    return Rule(f"> {low}", lambda v: v > low)


def between(low, high) -> Rule:
    return Rule(f"between {low} and {high}", lambda v: low <= v <= high)


PORT = Rule("a port number from 0 to 65535 (0: any free port)", lambda v: 0 <= v <= 65535)


def setting(default, help: str, *, kind: type | None = None, preset: bool = False, check: Rule | None = None,
            metavar: str | None = None, choices: tuple | None = None, flag: str | None = None,
            allow_inf: bool = False, env_var: str | None = None, flag_default_none: bool = False,
            short: str | None = None, positional: bool = False, nargs: str | None = None, required: bool = False,
            one_of: str | None = None, switch: bool = False):
    """One setting: ``default`` (with ``preset``: the house default, and the field is None
    until ``resolve_config``), its ``help`` (argparse's, ``%(default)s`` and all), its
    value's ``kind`` (int, float, str, bool, Path; by default the default's type), and its
    ``check``. ``flag`` (default: --name-with-dashes), ``short`` (-o), ``metavar``,
    ``choices``: its flag. ``allow_inf``: a float that may be infinite. ``env_var``: the
    flag's default comes from that environment variable. ``flag_default_none``: the flag's
    default is None whatever the defaults of the command line (``help`` may then name
    them, ``{field}``). ``positional``: an argument without a flag, ``nargs`` of them;
    ``required``: a flag that must be given; ``one_of``: exactly one of the settings of
    that name must be given. ``switch``: a bool flag without a --no- form, which sets the
    opposite of ``default``."""
    meta = {"help": help, "kind": kind or type(default), "preset": preset, "house": default, "check": check,
            "metavar": metavar, "choices": choices, "flag": flag, "allow_inf": allow_inf, "env_var": env_var,
            "flag_default_none": flag_default_none, "short": short, "positional": positional, "nargs": nargs,
            "required": required, "one_of": one_of, "switch": switch}
    return field(default=None if preset else default, metadata=meta)


def flag_of(f: dataclasses.Field) -> str:
    """How the command line names setting ``f``: its flag, or a positional's name."""
    if f.metadata.get("positional"):
        return f.metadata["metavar"] or f.name
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


# ---------------------------------------------------------------- the settings, by group

@dataclass(kw_only=True)
class RunSettings:
    sims: int | None = setting(
        8, "simulator processes, each with its own shared-memory ring; 0: none, only the external "
        "clients of --tcp-port train (default: %(default)s)",
        preset=True, check=at_least(0))
    env: str | Callable = setting(
        "CartPole-v1", "environment: a built-in id (CartPole-v1, Pendulum-v1), gym:ID for any gymnasium env "
        "(pip install -e '.[gym]' in shmrl's clone), package.module:make_env, a function that makes one, or "
        "declared: the spaces the first external client declares in its GET_CONFIG (docs/CLIENTS.md; if it "
        "declares none, the default env), what --sims 0 --tcp-port P trains without --env; the defaults below "
        "are this env's (default: %(default)s; with --sims 0 --tcp-port P: declared)")
    algo: str = setting(
        "ppo", "ppo (on-policy, every space), sac (soft actor-critic: off-policy, a replay buffer; Box actions "
        "with finite bounds, single-agent, vector observations; presets.toml's [sac] tables), or auto: PPO until "
        "the first batch, then SAC on slow simulators (--slow-rate) where SAC takes the env; a --resume keeps "
        "its checkpoint's (docs/SLOW_SIMULATORS.md) (default: %(default)s)", choices=ALGO_CHOICES)
    seed: int = setting(0, "seed of the learner and, offset per simulator, of the environments and action "
                           "sampling (default: %(default)s)")
    stop_return: float | None = setting(
        None, "stop when the mean return of the last --return-window complete episodes reaches R; "
        "none (or inf): never, train to the --max-env-steps budget (default: %(default)s; None: the "
        "env's reward threshold, or none where it has none)",
        kind=float, preset=True, metavar="R", allow_inf=True)
    max_env_steps: int | None = setting(
        1_000_000, "give up (exit 1) after N env steps accepted (received, less the chunks refused as they "
        "came in: over a client's budget, out of bounds, not fitting the env), counting those before a "
        "--resume (default: %(default)s)", preset=True, check=at_least(1), metavar="N")
    max_seconds: float | None = setting(
        None, "give up (exit 1) after S seconds since the command started (this process's seconds, not "
        "counting those before a --resume); none: no time limit (default: %(default)s)",
        kind=float, preset=True, check=above(0), metavar="S", allow_inf=True)
    return_window: int = setting(
        100, "the mean return reported, and compared with --stop-return, is that of the last N complete "
        "episodes (default: %(default)s)", check=at_least(1), metavar="N")
    pretrain: str | None = setting(
        None, "start from the episodes of the dataset DIR (--record, python -m shmrl.record): PPO clones its "
        "policy and value function from them, SAC puts them in its replay buffer (not again on --resume)",
        kind=str, metavar="DIR")
    pretrain_steps: int = setting(
        5000, "gradient steps of --pretrain's clone, on minibatches of 512 env steps: about 57 passes over "
        "50 HalfCheetah episodes, 6 s on one core (default: %(default)s)", check=at_least(1), metavar="N")


@dataclass(kw_only=True)
class LogSettings:
    logdir: str | None = setting(
        None, "write metrics.jsonl (one line per update), summary.json, policy.onnx and "
        "checkpoints/ to DIR (default: runs/<env>-<date>-<time>-<pid>)", kind=str, metavar="DIR")
    checkpoint_every: int = setting(
        0, "also write a checkpoint every N updates; one is always written when the run ends, "
        "Ctrl-C and SIGTERM included (default: %(default)s, only at the end)", check=at_least(0), metavar="N")
    keep_checkpoints: int = setting(3, "keep the last K checkpoints (default: %(default)s)",
                                    check=at_least(1), metavar="K")
    log_every: float | None = setting(
        None, "print a progress line at most every S seconds (0: every update); default: every "
        "update on a terminal, every 10 s when stdout is a file or a pipe", kind=float, check=at_least(0),
        metavar="S")
    verbose: bool = setting(
        False, "put the detail line (losses, policy lag, each client's env steps) under every progress "
        "line, not only under every 10th (default: %(default)s)")
    tensorboard: bool | None = setting(
        None, "also write the metrics as TensorBoard scalars into the log folder (tensorboard "
        "--logdir runs); default: when the tensorboard package is installed (pip install -e "
        "'.[tensorboard]' in shmrl's clone)",
        kind=bool)
    plot: bool | None = setting(
        None, "draw the run's learning curve into the log folder when it ends (learning_curves.png, as "
        "python -m shmrl.plot does); default: when matplotlib is installed (pip install matplotlib) and the run "
        "took 20 s or more (a shorter run's plot would add a sixth to it)", kind=bool)
    resume: str | None = setting(
        None, "go on from the last checkpoint in DIR (weights, optimizer, env-step counts, "
        "weights_seq_no, return window), with its configuration except for the flags given "
        "here; logs are appended to DIR", kind=str, metavar="DIR", flag_default_none=True)
    record: str | None = setting(
        None, "also write every episode the clients send (any transport, multi-agent too) to the dataset "
        "folder DIR (docs/RECORDING.md), appending if it exists; written every 2 s and at the end",
        kind=str, metavar="DIR")


@dataclass(kw_only=True)
class TransportSettings:
    transport: str = setting(
        "shm", "how the local simulators talk to the learner: shared-memory rings, or RLlink over "
        "TCP loopback like an external client (shmrl's binary codec, which its PING offers and the "
        "server takes; RLlib's JSON for clients that offer nothing) (default: %(default)s)",
        choices=("shm", "tcp"))
    tcp_port: int | None = setting(
        None, "also accept external RLlink clients on this port (RLlib's JSON, or shmrl's binary codec "
        "for clients that offer it); they train the same policy as the local simulators. 0: any free "
        "port, which the log names ('listening for RLlink clients on HOST:PORT'); with --sims 0, "
        "only external clients train (default: none, no TCP port)", kind=int, metavar="PORT", check=PORT)
    tcp_host: str = setting(
        "127.0.0.1", "address to listen on (default: %(default)s, loopback only; 0.0.0.0 exposes "
        "the learner to the network)", metavar="HOST")
    auth_token: str | None = setting(
        None, "require this shared secret in every client's PING (field auth_token); a client "
        f"without it gets only a closed connection (default: ${AUTH_TOKEN_VAR}, else none)", kind=str,
        metavar="SECRET", env_var=AUTH_TOKEN_VAR)
    max_frame_bytes: int = setting(
        64 << 20, "largest TCP frame body accepted; a bigger header closes that connection "
        "before its body is read (default: %(default)s)", metavar="N",
        check=Rule(">= 1024 (a PING alone takes 16)", lambda v: v >= 1024))
    max_json_frame_bytes: int | None = setting(
        None, "largest TCP frame body accepted in JSON, whose decoding takes the server far longer "
        "per byte than binary (default: 8 times the largest binary EPISODES message within "
        "--max-message-chunks, at most --max-frame-bytes)", kind=int, metavar="N",
        check=Rule(">= 1024", lambda v: v >= 1024))
    client_budget: int | None = setting(
        None, "env steps one client may have waiting for training; once they are there, a TCP "
        "client is not read until they are trained, and what arrives anyway is dropped and counted "
        "('over the client's budget') (default: 4 train batches, or 4 samples if larger)", kind=int,
        check=at_least(1), metavar="N")
    max_message_steps: int | None = setting(
        None, "env steps one EPISODES message may carry; more close that connection (default: "
        "--client-budget)", kind=int, check=at_least(1), metavar="N")
    max_message_chunks: int | None = setting(
        None, "chunks one EPISODES message may carry; more close that connection (default: "
        "--max-message-steps + 1024)", kind=int, check=at_least(1), metavar="N")
    ray: str | None = setting(
        None, "place the simulators as Ray actors across the nodes of the Ray cluster at ADDRESS "
        "(auto: the one this machine belongs to; HOST:6379); those on this node use shared "
        "memory, the others connect back over TCP on this node's cluster address (or "
        "--tcp-host) with the binary codec and an auth token (one is generated unless "
        "--auth-token gives it). pip install -e '.[ray]' in shmrl's clone", kind=str, metavar="ADDRESS")
    sim_cpus: float = setting(1.0, "with --ray, CPUs reserved for each simulator actor (default: %(default)s)",
                              check=above(0), metavar="C")


@dataclass(kw_only=True)
class ReliabilitySettings:
    hang_timeout: float = setting(
        10.0, "restart a simulator whose env has not stepped for S seconds while the learner was "
        "not holding it back; close a TCP client of shmrl's that sent no heartbeat for S "
        "seconds; let a strict on-policy batch wait at most S seconds for a client still "
        "sampling (default: %(default)s)", check=above(0), metavar="S")
    max_restarts: int = setting(
        5, "a simulator that fails more than N times within --restart-window seconds fails the run: its "
        "environment is broken, and restarting it again would only hide that (default: %(default)s)",
        check=at_least(0), metavar="N")
    restart_window: float = setting(
        60.0, "the seconds over which --max-restarts counts a simulator's failures (inf: the whole run) "
        "(default: %(default)s)", check=above(0), metavar="S", allow_inf=True)
    max_obs_abs: float = setting(
        1e6, "refuse (and count) a client's chunk whose observations hold a number of magnitude above X "
        "(images, uint8, are exempt): finite but absurd values would poison the weights "
        "(default: %(default)s)", check=above(0), metavar="X")
    max_reward_abs: float = setting(
        1e6, "refuse (and count) a client's chunk whose rewards hold one of magnitude above X "
        "(default: %(default)s)", check=above(0), metavar="X")
    max_skipped_updates: int = setting(
        10, "an update whose loss or gradient is not finite is skipped (the weights stay as they were); "
        "after N skipped in a row the run stops with an error (default: %(default)s)",
        check=at_least(1), metavar="N")


@dataclass(kw_only=True)
class MultiAgentSettings:
    policy_map: str = setting(
        "shared", "which policy each agent plays: shared (one for all), per-agent (one each), or "
        "package.module:fn, a function agent_id -> policy_id; each policy is trained by its own "
        "PPO (default: %(default)s)", metavar="MAP")
    league: int | None = setting(
        0, "self-play league: keep the last N frozen snapshots of each policy; at each episode "
        "start, with probability --league-prob, one agent plays a snapshot picked uniformly "
        "(default: %(default)s, none: every agent plays the current policy)", preset=True, check=at_least(0),
        metavar="N")
    league_every: int | None = setting(10, "add a snapshot every U updates (default: %(default)s)",
                                       preset=True, check=at_least(1), metavar="U")
    league_prob: float | None = setting(
        0.5, "chance that an episode has an agent play a snapshot (default: %(default)s)",
        preset=True, check=between(0, 1), metavar="P")
    eval_every: int | None = setting(
        0, "every U updates, each policy plays --eval-games games against a uniformly random legal player "
        "(greedy, taking the seats in turn, as python -m shmrl.eval does): its win rate goes into the metrics, "
        "and the policy written at the end is the one that won most, however the run ends; 0: never "
        "(default: %(default)s)", preset=True, check=at_least(0), metavar="U")
    eval_games: int | None = setting(200, "games of each --eval-every evaluation (default: %(default)s)",
                                     preset=True, check=at_least(1), metavar="N")
    stop_win_rate: float | None = setting(
        None, "stop (exit 0) once every policy's latest --eval-every win rate reaches W; none: never "
        "(default: %(default)s)", kind=float, preset=True, metavar="W", allow_inf=True,
        check=Rule("in (0, 1], or none", lambda v: 0 < v <= 1 or v == math.inf))


@dataclass(kw_only=True)
class SamplingSettings:
    train_batch_size: int | None = setting(
        2048, "env steps per PPO update; fewer when every client waits for new weights and "
        "together they have sent fewer (default: %(default)s)", preset=True, check=at_least(1), metavar="N")
    env_steps_per_sample: int | None = setting(
        None, "env steps per EPISODES message of each client, what SET_CONFIG tells them "
        "(default: the train batch shared over whoever samples, the run's simulators and the "
        "clients connected, {env_steps_per_sample} for {sims} simulators alone, followed as clients "
        "come and go; the slow profile's batch where the run may switch to it and it is smaller)",
        kind=int, check=at_least(1), metavar="N", flag_default_none=True)
    envs_per_sim: int | None = setting(
        1, "environments each simulator steps together, one batched ONNX call per step "
        "(default: %(default)s)", preset=True, check=at_least(1), metavar="K")
    sim_nice: int = setting(
        19, "run the local simulators N steps below the learner's CPU priority (0-19): the "
        "learner's update is what every simulator waits for, so on a busy machine it "
        "comes first (default: %(default)s)", check=between(0, 19), metavar="N")
    async_sampling: bool | None = setting(
        False, "simulators keep sampling while the learner trains: each EPISODES_AND_GET_STATE "
        "is answered at once with the latest weights, not after the next update; PPO's "
        "ratio is taken against the behaviour log-probabilities the clients report (default: %(default)s)",
        preset=True, flag="--async")
    max_policy_lag: int = setting(
        2, "with --async, drop (and count) chunks sampled with weights more than V "
        "versions old (default: %(default)s)", check=at_least(0), metavar="V")


@dataclass(kw_only=True)
class PPOSettings:
    """What ``shmrl.model.ppo.PPO`` takes (a Config has them all)."""
    lr: float | None = setting(3e-4, "Adam learning rate (default: %(default)s)", preset=True, check=above(0))
    gamma: float | None = setting(0.99, "discount (default: %(default)s)", preset=True,
                                  check=Rule("in (0, 1]", lambda v: 0 < v <= 1))
    gae_lambda: float | None = setting(0.95, "GAE lambda (default: %(default)s)", preset=True,
                                       check=between(0, 1))
    epochs: int | None = setting(10, "passes over each batch (default: %(default)s)", preset=True,
                                 check=at_least(1))
    minibatch_size: int | None = setting(256, "steps per gradient step (default: %(default)s)", preset=True,
                                         check=at_least(1))
    ent_coef: float | None = setting(0.0, "entropy bonus (default: %(default)s)", preset=True, check=at_least(0))
    clip: float | None = setting(0.2, "PPO ratio clip (default: %(default)s)", preset=True, check=above(0))
    vf_coef: float | None = setting(0.5, "weight of the value loss (default: %(default)s)", preset=True,
                                    check=at_least(0))
    max_grad_norm: float | None = setting(
        0.5, "clip the global gradient norm of each step to this (default: %(default)s)", preset=True,
        check=above(0))
    lr_anneal: bool | None = setting(
        False, "let the learning rate fall linearly to 0 over --max-env-steps (default: %(default)s)", preset=True)
    reward_scale: float | None = setting(
        1.0, "train on rewards times C (returns are reported unscaled) (default: %(default)s)", preset=True,
        check=above(0), metavar="C")
    normalize_reward: bool | None = setting(
        False, "also divide the rewards trained on by the running standard deviation of each "
        "client stream's discounted return, as VecNormalize does (default: %(default)s)", preset=True)
    max_seq_len: int | None = setting(
        32, "with --memory, PPO back-propagates through sequences of at most T steps (default: %(default)s)",
        preset=True, check=at_least(1), metavar="T")
    learn_per_step: str = setting(
        "auto", "learning per env step: auto switches to the env's slow profile (presets.toml: a wider "
        "network, small batches, many epochs) when the simulators deliver fewer than --slow-rate env "
        "steps/s, then spends the learner's idle time on more gradient steps per batch, up to 16x "
        "--epochs x --minibatch-size's, each update bounded by --target-kl; a fast simulator keeps this "
        "preset's settings. off: always the preset's; on: the slow profile from the start (an env without "
        "one: the most gradient steps) (docs/SLOW_SIMULATORS.md) (default: %(default)s)",
        choices=("auto", "off", "on"))
    slow_rate: float = setting(
        2000.0, "simulators that deliver fewer than N env steps/s in all (measured once, over the first batch) "
        "are slow: --algo auto switches to SAC, else --learn-per-step auto to the env's slow profile, where "
        "either applies (default: %(default)s)", check=above(0), metavar="N")
    target_kl: float = setting(
        0.02, "with more learning per env step (--learn-per-step), an update stops once the approximate KL "
        "from the policy it began with passes 1.5 x KL (default: %(default)s)", check=above(0), metavar="KL")


@dataclass(kw_only=True)
class NetworkSettings:
    normalize_obs: bool | None = setting(
        False, "normalize observations by running mean and variance of all received, clipped to "
        "+-10, inside the published ONNX policy: clients feed raw observations (default: %(default)s)", preset=True)
    hidden: int | None = setting(
        64, "units in each hidden layer of the policy and value networks (default: %(default)s)", preset=True,
        check=at_least(1))
    layers: int | None = setting(2, "hidden layers after the observation encoders (default: %(default)s)",
                                 preset=True, check=at_least(0))
    cnn: str | None = setting(
        "nature", "CNN for image observations: the Nature CNN (8x8/4, 4x4/2, 3x3/1 convolutions and "
        "512 units) for images of 36x36 or more, else a small one (two 3x3 convolutions), "
        "or always the small one (default: %(default)s)", preset=True, choices=("nature", "small"))
    activation: str | None = setting("Tanh", "activation of the hidden layers (default: %(default)s)",
                                     preset=True, choices=("ReLU", "Tanh"))
    log_std_init: float | None = setting(
        0.0, "initial log standard deviation of a Gaussian policy (Box actions) (default: %(default)s)", preset=True)
    ortho_init: bool | None = setting(
        True, "orthogonal initial weights (gain sqrt 2 in hidden layers, 0.01 for the policy head); "
        "--no-ortho-init: torch's default uniform ones, as rl-zoo3's ortho_init=False (default: %(default)s)",
        preset=True)
    memory: str | None = setting(
        "none", "a recurrent core (LSTM or GRU) between the hidden layers and the heads, shared by "
        "actor and critic: the policy keeps a state across the steps of an episode, for envs "
        "whose observation does not show everything (the ONNX policy takes state_in.<i> and "
        "gives state_out.<i>; docs/ENVIRONMENTS.md, 'Memory') (default: %(default)s)", preset=True,
        choices=("none", "lstm", "gru"))
    memory_size: int | None = setting(64, "units of the recurrent core (default: %(default)s)", preset=True,
                                      check=at_least(1), metavar="N")
    torch_threads: int | None = setting(
        1, "torch threads of the learner; the simulators need the other cores. 0: every core, "
        "where the update dominates and the simulators wait through it (strict on-policy "
        "image presets) (default: %(default)s)", preset=True, check=at_least(0))
    device: str = setting(
        "auto", "where the learner's networks, optimizer and batches live: auto takes the GPU (CUDA) for a "
        "convolutional network (image observations) or minibatches of 4096 steps or more when torch sees "
        "one, else the CPU, and logs its choice; cuda without a CUDA build of torch and a GPU is refused. "
        "Checkpoints hold CPU arrays: a run resumes on either (docs/OPERATIONS.md, 'On a GPU') "
        "(default: %(default)s)", choices=("auto", "cpu", "cuda"))


@dataclass(kw_only=True)
class SACSettings:
    """What ``shmrl.model.sac.SAC`` takes beside the shared ones (--lr, --gamma,
    --minibatch-size as its batch size, --hidden, --layers, --activation)."""
    buffer_size: int | None = setting(
        1_000_000, "with --algo sac, the replay buffer holds the last N env steps (a ring: the oldest are "
        "overwritten); its memory is N x (2 x observation + action + 2) x 4 bytes, said in the log "
        "(default: %(default)s)", preset=True, check=at_least(1), metavar="N")
    learning_starts: int | None = setting(
        10_000, "with --algo sac, the clients act uniformly at random for the run's first N env steps, and "
        "the first gradient step waits for them (default: %(default)s)", preset=True, check=at_least(0),
        metavar="N")
    tau: float | None = setting(
        0.005, "with --algo sac, the target critics move this far toward the critics after each gradient step "
        "(Polyak averaging) (default: %(default)s)", preset=True, check=Rule("in (0, 1]", lambda v: 0 < v <= 1))
    gradient_steps: float | None = setting(
        1.0, "with --algo sac, gradient steps per env step received (the replay ratio; below 1: one every "
        "1/G env steps), kept by holding back the clients of a slower learner, as SB3's env waits for its "
        "update (default: %(default)s)", preset=True, check=above(0), metavar="G")
    target_entropy: float | None = setting(
        None, "with --algo sac, the entropy the learned temperature aims at (default: -(action dimensions), "
        "as SB3's 'auto')", kind=float, metavar="H")
    publish_every: int | None = setting(
        50, "with --algo sac, publish the policy every N gradient steps (clients take it with their next "
        "message; they never wait for an update) (default: %(default)s)", preset=True, check=at_least(1),
        metavar="N")


# The groups in the order --help shows them, under its headings (None: the first lines).
HELP_SECTIONS = ((RunSettings, None), (LogSettings, "logs, checkpoints and resuming"),
                 (TransportSettings, "transports"), (ReliabilitySettings, "simulator failures and hangs"),
                 (MultiAgentSettings, "multi-agent envs (PettingZoo: --env pz:NAME)"),
                 (SamplingSettings, "sampling and PPO"), (PPOSettings, "sampling and PPO"),
                 (SACSettings, "SAC (--algo sac)"), (NetworkSettings, "sampling and PPO"))


# The groups listed last to first: a dataclass's fields start with its last base's, so a
# Config's fields (and summary.json's "config") read in --help's order.
@dataclass(kw_only=True)
class Config(NetworkSettings, SACSettings, PPOSettings, SamplingSettings, MultiAgentSettings, ReliabilitySettings,
             TransportSettings, LogSettings, RunSettings):
    """Everything a run takes, one field per flag of ``python -m shmrl.run`` (its --help
    says what each does). Fields left None take the env's preset (``resolve_config``);
    ``env`` may also be a callable that makes a gymnasium-style env."""


class UnknownSetting(ConfigError, TypeError):
    """A keyword that is no setting of shmrl.Config (a TypeError too, as for any class)."""


def _check_names(init):
    @functools.wraps(init)
    def checked(self, **fields):
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(Config)})
        if unknown:
            near = difflib.get_close_matches(unknown[0], [f.name for f in dataclasses.fields(Config)], n=3)
            if not near and unknown[0].startswith("asyn"):   # the one field not named after its flag
                near = ["async_sampling"]
            raise UnknownSetting(f"shmrl.Config has no setting {unknown[0]!r}"
                                 + (f" (did you mean {' or '.join(near)}?)" if near else ""))
        init(self, **fields)
    return checked


# An unknown keyword names shmrl.Config and the settings it may have meant, not the
# dataclass's generated __init__.
Config.__init__ = _check_names(Config.__init__)


def house_defaults(cls=Config) -> dict:
    """The house default of every preset setting of ``cls`` (Config or one of its groups)."""
    return {f.name: f.metadata["house"] for f in dataclasses.fields(cls) if f.metadata["preset"]}


def with_defaults(cls=Config, **given):
    """A ``cls`` (Config or one of its groups, e.g. PPOSettings) with ``given`` and every
    other preset setting at its house default (no env's preset)."""
    return cls(**{**house_defaults(cls), **given})


def preset_values(env, spec=None, algo: str = "ppo") -> tuple[dict, list[str]]:
    """(every preset setting's value for ``env``, where they came from): the house
    defaults, then the env's family's and its own table in presets.toml (``spec``: to find
    its family); with ``algo`` "sac", SAC's tables instead (``preset_tables``)."""
    overrides, sources = preset_tables(env, spec, algo)
    where = [f"default in {Path(__file__)}"] + ([" + ".join(sources) + f" in {PRESETS_FILE}"] if sources else [])
    return {**house_defaults(), **overrides}, where


def env_defaults(env, spec=None, algo: str = "ppo") -> dict:
    """The preset settings of ``env`` (``spec``: to find its family) for ``algo``."""
    return preset_values(env, spec, algo)[0]


def resolve_config(config: Config, spec=None) -> Config:
    """A copy with every field left None set to the environment's default (its preset);
    unless given, each simulator's message holds its share of a training batch."""
    values = env_defaults(config.env, spec, config.algo)
    config = dataclasses.replace(config, **{k: v for k, v in values.items() if getattr(config, k) is None})
    if config.env_steps_per_sample is None:
        config.env_steps_per_sample = -(-config.train_batch_size // max(config.sims, 1))
    return config


# ---------------------------------------------------------------- the one check

def value_problem(f: dataclasses.Field, value) -> str | None:
    """Why ``value`` cannot be setting ``f`` ("must be ..."), or None."""
    m = f.metadata
    kind = m["kind"]
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number, not {value!r}"
        if math.isnan(value) or (math.isinf(value) and not m["allow_inf"]):
            return f"must be a finite number, not {value}"
    elif kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        return f"must be a whole number, not {value!r}"
    elif kind not in (int, float) and not isinstance(value, kind):
        return f"must be a {kind.__name__}, not {value!r}"
    if m["choices"] and value not in m["choices"]:
        return f"must be one of {', '.join(m['choices'])}, not {value!r}"
    if m["check"] and not m["check"].holds(value):
        return f"must be {m['check'].says}, not {value}"
    return None


def check_fields(settings, skip: tuple = ()) -> None:
    """Raise ConfigError, with the flag's name, for the first field of ``settings`` (a
    dataclass of ``setting`` fields) whose value cannot be; None passes, as do the fields
    named in ``skip``. A setting of several values (``nargs``) checks each."""
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if f.name in skip or value is None:
            continue
        for one in (value if f.metadata["nargs"] else [value]):
            problem = value_problem(f, one)
            if problem:
                raise ConfigError(f"{flag_of(f)} {problem}")


def validate(config: Config, spec=None, servers_given: bool = False) -> None:
    """Raise ConfigError, with the flag's name, for the first setting that cannot be: a
    value out of its range (NaN, and infinity where it means nothing, included) or settings
    that contradict each other. Fields still None (the env's preset) pass; ``spec`` (the
    env's) adds what depends on the env; ``servers_given``: the caller brings its own
    transports (``trainer.train_with_servers``), so a run without simulators or a TCP port
    still has clients."""
    check_fields(config, skip=("env",))
    if config.sims == 0 and config.tcp_port is None and not servers_given:
        raise ConfigError("--sims 0 runs no local simulator: give --tcp-port for external clients")
    if config.ray is not None and config.sims == 0:
        raise ConfigError("--ray places simulators: give --sims N (N >= 1)")
    if config.env == DECLARED_ENV and (config.sims or config.tcp_port is None or servers_given):
        raise ConfigError(f"--env {DECLARED_ENV} trains the spaces an external client declares: give --sims 0 "
                          "and --tcp-port, or an env that simulators can make")
    if spec is not None and spec.multiagent and config.memory not in (None, "none"):
        raise ConfigError("--memory: recurrent policies are single-agent for now; a multi-agent env takes "
                          "--memory none")
    if config.algo == "sac":
        why = sac_refusal(config, spec)
        if why:
            raise ConfigError(f"--algo sac: {why}")


# ---------------------------------------------------------------- a configuration as it is written down

def env_name(env) -> str:
    return env if isinstance(env, str) else f"{getattr(env, '__module__', '?')}.{getattr(env, '__qualname__', env)}"


def saved_config(config: Config) -> dict:
    """The configuration as written to summaries and checkpoints: JSON, never the secret."""
    return {**dataclasses.asdict(config), "env": env_name(config.env),
            "auth_token": "(set)" if config.auth_token else None}


def config_from_saved(saved: dict) -> Config:
    """The Config a run wrote down (``saved_config``), the secret left out; settings it
    does not know (from an older shmrl) take their defaults."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    kept = {k: v for k, v in saved.items() if k in fields and k != "auth_token"}
    # JSON has no infinity: a saved stop return of none (inf) reads back as null, and a
    # saved configuration is resolved, so null there can only have been inf.
    kept.update({k: math.inf for k, v in kept.items() if v is None and fields[k].metadata["allow_inf"]})
    return Config(**kept)


def config_with(config: Config | None = None, **fields) -> Config:
    """``config`` (default: a fresh Config) with ``fields`` set; an unknown name is a
    ConfigError that lists the nearest known ones."""
    return dataclasses.replace(config, **fields) if config is not None else Config(**fields)

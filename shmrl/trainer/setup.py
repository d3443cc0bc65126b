"""A run before anything starts: its settings resolved against the env, its set of
policies (networks, first weights, or those of the checkpoint it resumes), and the serving
side and PPO built from them. Everything here may refuse the run (ConfigError) before a
process is started or a file written; ``shmrl.trainer.loop`` then runs it."""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass

from shmrl.trainer.learn_per_step import SLOW_SETTINGS, given_settings, slow_config
from shmrl.config.settings import ConfigError, env_name, resolve_config, saved_config, validate
from shmrl.trainer.resume import (load_resume_checkpoint, policy_arrays, policy_prefix, ppo_state, restore_store,
                          saved_policy)
from shmrl.server.serving import Serving, check_policy_fits_a_frame
from shmrl.server.store import DEFAULT_POLICY

log = logging.getLogger("shmrl.run")

# --device auto puts an MLP's learner on a GPU for minibatches of at least this many steps:
# below it a gradient step costs a GPU a few kernel launches' latency and a CPU less (issue 34
# measured the MLP presets' updates slower on an H100 than on 2 CPU threads, the Nature CNN's
# 40 times faster).
LARGE_MINIBATCH = 4096


def policy_net(config, spec):
    """The published policy of this run's configuration (and its --algo)."""
    from shmrl.model.algorithm import algorithm

    return algorithm(config.algo).net(config, spec)


@dataclass
class Setup:
    """A run before anything starts: its settings resolved, its env, its set of policies
    (by policy id; a single-agent run's one policy is ``DEFAULT_POLICY``)."""
    config: object
    spec: object
    multiagent: bool             # the env has agents, the clients send RLlib's multi-agent messages
    policy_specs: dict           # policy id -> EnvSpec of its agents
    nets: dict                   # policy id -> PolicyNet
    first_weights: dict          # policy id -> its weights to publish first
    first_seq: int
    resumed: tuple | None        # (path, arrays, state) of the checkpoint it goes on from
    pretrained: dict | None = None   # --pretrain: policy id -> ((arrays, values) of its PPO, reward stats)
    slow: SlowProfile | None = None  # what it may switch to (--learn-per-step auto), until it decides
    profile: dict | None = None      # the profile it trains with and why (summary.json's "profile")
    device: str | None = None        # where the learner's PPOs live, once torch is loaded (summary.json's "device")
    shared_batch: int | None = None  # the train batch the Hub spreads over its clients (None: --env-steps-per-sample)

    def ring_nets(self) -> dict:
        """Per policy, the larger of its network and its slow profile's: the rings carry either."""
        if self.slow is None:
            return self.nets
        return {pid: max(net, self.slow.nets[pid], key=parameters) for pid, net in self.nets.items()}


@dataclass
class SlowProfile:
    """The env's slow profile (presets.toml) as a run may switch to it: its settings, with
    those the command line gave kept, its networks, and the tables it came from."""
    config: object
    nets: dict
    sources: list


def parameters(net) -> int:
    return sum(math.prod(shape) for shape in net.template.shapes.values())


def set_up(config, servers_given: bool = False, given: set[str] | None = None, spec=None) -> Setup:
    """Everything that can refuse the run (ConfigError) short of opening its transports.
    ``given``: the settings the command line gave (default: those ``config`` does not
    leave None), which the env's slow profile leaves as they are. ``config`` is left as
    it is: the Setup's is a copy, with what is decided here (the stop return, the log
    folder, TensorBoard, the plot) filled in. ``spec``: the env's (default: made from
    ``config.env``; ``--env declared``: the spaces a client declared)."""
    from shmrl.envs.make import env_spec
    from shmrl.envs.spec import say_left_out

    spec = spec if spec is not None else env_spec(config.env)
    say_left_out(spec)
    given = given_settings(config) if given is None else given
    config = resolve_config(config, spec)
    validate(config, spec, servers_given)
    check_device(config)
    multiagent = spec.multiagent
    slow, profile = None, {"name": "preset", "why": f"--learn-per-step {config.learn_per_step}"}
    if config.algo != "ppo":   # the slow profile is PPO's: SAC learns as much per env step as --gradient-steps says
        profile["why"] = f"--algo {config.algo}"
    elif config.learn_per_step != "off" and not (config.resume or config.pretrain or multiagent):
        config, slow_settings, sources = slow_config(config, spec, given)
        if slow_settings is None:
            profile["why"] = "no slow profile for this env in presets.toml (or the flags given are it)"
        else:
            validate(slow_settings, spec, servers_given)
            slow = SlowProfile(slow_settings, {}, sources)
            if config.learn_per_step == "on":   # from the start: nothing to measure or switch
                config, slow = slow_settings, None
                profile = {"name": "slow", "why": "--learn-per-step on", "tables": sources}
    policy_specs = {DEFAULT_POLICY: spec}
    if multiagent:
        from shmrl.envs.spec import policy_mapper

        try:
            policy_specs = spec.policy_specs(policy_mapper(config.policy_map))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if config.eval_every and not symmetric_game(spec):
        raise ConfigError(f"--eval-every: the evaluated policy takes every seat in turn, so the env must be a "
                          f"multi-agent env whose agents all have the same spaces; {env_name(config.env)} is not")
    config = dataclasses.replace(config, stop_return=chosen_stop_return(config, spec), logdir=chosen_logdir(config))
    nets = {pid: policy_net(config, s) for pid, s in policy_specs.items()}
    check_policy_fits_a_frame(config, nets, multiagent)
    if slow is not None:
        slow.nets = {pid: policy_net(slow.config, s) for pid, s in policy_specs.items()}
        check_policy_fits_a_frame(slow.config, slow.nets, multiagent)
    resumed = (load_resume_checkpoint(config.resume, env_name(config.env), config.hidden, nets, multiagent,
                                     saved_config(config))
               if config.resume else None)
    if config.algo == "sac":
        say_sac(config, spec)
    if resumed:
        first_weights = {pid: saved_policy(resumed[1], policy_prefix(pid, multiagent)) for pid in nets}
        first_seq = resumed[2]["weights_seq_no"] + 1
    else:
        first_weights = {pid: net.initial_weights(config.seed + i) for i, (pid, net) in enumerate(nets.items())}
        first_seq = 1
    pretrained = None
    if config.pretrain and not resumed:   # the clone is what the clients are served first
        from shmrl.trainer.pretrain import pretrain_policies

        pretrained = pretrain_policies(config, nets, first_weights)
        first_weights = {pid: saved_policy(state[0][0], "") for pid, state in pretrained.items()}
    if config.record:
        check_recording(config, spec, policy_specs)
    config = dataclasses.replace(config, tensorboard=chosen_tensorboard(config), plot=chosen_plot(config))
    if slow is not None:   # the settings decided here (the stop return, the log folder) are the slow profile's too
        slow.config = dataclasses.replace(config, **{k: getattr(slow.config, k) for k in SLOW_SETTINGS})
    # Unless --env-steps-per-sample is given, each client's message is its share of the batch
    # (of the smaller of the two profiles': a client may read it only once), over whoever samples.
    shared_batch = None if "env_steps_per_sample" in given else min(
        [config.train_batch_size] + ([slow.config.train_batch_size] if slow is not None else []))
    return Setup(config, spec, multiagent, policy_specs, nets, first_weights, first_seq, resumed, pretrained,
                 slow, profile, shared_batch=shared_batch)


def say_sac(config, spec) -> None:
    """The log's line of the algorithm and what its replay buffer takes."""
    from shmrl.model.algorithm import replay_row_bytes

    nbytes = config.buffer_size * replay_row_bytes(spec)
    log.info("--algo sac: a replay buffer of %d env steps (%.1f MiB, allocated at once), %d env steps of uniform "
             "actions first, %g gradient steps per env step", config.buffer_size, nbytes / 2 ** 20,
             config.learning_starts, config.gradient_steps)


def chosen_stop_return(config, spec) -> float:
    """--stop-return, else the env's threshold; without one, the run trains to the step budget."""
    if config.stop_return is not None:
        return config.stop_return
    return spec.reward_threshold if spec.reward_threshold is not None else math.inf


def chosen_logdir(config) -> str:
    """--logdir, else a new folder under runs/ named for the env, the time and this process."""
    if config.logdir is not None:
        return config.logdir
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in env_name(config.env))
    return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")


def chosen_tensorboard(config) -> bool:
    """--tensorboard, which needs the tensorboard package; left None: whether it is installed."""
    from shmrl.files.metrics import tensorboard_available

    if config.tensorboard is None:
        return tensorboard_available()
    if config.tensorboard and not tensorboard_available():
        raise ConfigError("--tensorboard needs the tensorboard package: pip install -e '.[tensorboard]' in "
                          "shmrl's clone")
    return config.tensorboard


def chosen_plot(config) -> bool:
    """--plot, which needs matplotlib; left None: whether it is installed."""
    if config.plot is not None and not config.plot:
        return config.plot
    import importlib.util

    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    if config.plot and not has_matplotlib:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib")
    return has_matplotlib


def symmetric_game(spec) -> bool:
    """A multi-agent env whose agents all have the same spaces (one policy could take any seat)."""
    if not spec.multiagent:
        return False
    try:
        spec.policy_specs(lambda agent: "any")
    except ValueError:
        return False
    return True


def recording_manifest(config, spec, policy_specs) -> dict:
    from shmrl.files.dataset import manifest_for

    return manifest_for(env_name(config.env), policy_specs, spec.agents if spec.multiagent else None)


def check_recording(config, spec, policy_specs) -> None:
    """--record into a dataset of another env or other spaces: refused before anything starts."""
    from shmrl.files.dataset import DatasetError, check_appendable

    try:
        check_appendable(config.record, recording_manifest(config, spec, policy_specs))
    except DatasetError as e:
        raise ConfigError(f"--record {e}") from None


def open_recording(setup: Setup, flag: str = "--record"):
    """The DatasetWriter of --record's folder, which holds its lock until it is closed
    (ConfigError if another run writes there, or it does not fit, or cannot be made)."""
    from shmrl.files.dataset import DatasetError, DatasetWriter

    try:
        return DatasetWriter(setup.config.record, recording_manifest(setup.config, setup.spec, setup.policy_specs),
                             flag)
    except DatasetError as e:
        raise ConfigError(f"{flag} {e}") from None


def make_serving(setup: Setup, servers: list, supervisor) -> Serving:
    """The serving side, its first weights published (before torch is even imported);
    ``shmrl.trainer.lifecycle.Run`` gives its store the recorder of --record."""
    from shmrl.model.algorithm import algorithm

    config = setup.config
    algo = algorithm(config.algo)
    extra = algo.config_fields() if not setup.multiagent else {
        "policy_map": config.policy_map, "league_prob": config.league_prob if config.league else 0.0}
    first_dist = algo.first_action_dist(config, bool(setup.resumed))
    serving = Serving(servers, config, setup.policy_specs, {pid: net.template for pid, net in setup.nets.items()},
                      setup.first_weights, multiagent=setup.multiagent, first_weights_seq_no=setup.first_seq,
                      housekeeping=supervisor.check if supervisor else None,
                      state_size=max(net.state_size for net in setup.nets.values()), shared_batch=setup.shared_batch,
                      agents=setup.spec.agents if setup.multiagent else None, extra_config=extra or None,
                      off_policy=algo.off_policy, action_dists={pid: first_dist for pid in setup.nets})
    for pid, (_, reward_stats) in (setup.pretrained or {}).items():
        if reward_stats is not None and serving.store.policies[pid].reward_stats is not None:
            serving.store.policies[pid].reward_stats.set_state(reward_stats, "reward_stats")
    if setup.resumed:
        path, arrays, state = setup.resumed
        restore_store(serving.store, state, arrays, setup.multiagent)
        print(f"resuming from {path} (update {state['update']}, {serving.store.steps_received} env steps, "
              f"weights {setup.first_seq - 1})", flush=True)
    return serving


def cuda_available() -> bool:
    """Whether torch can put tensors on a CUDA GPU here (imports torch)."""
    import torch

    return torch.cuda.is_available()


def check_device(config) -> None:
    """--device cuda where torch sees no CUDA GPU: refused before anything starts. Only
    then is torch imported this early: auto decides once torch is loaded (``make_ppos``)."""
    if config.device != "cuda" or cuda_available():
        return
    import torch

    why = (f"torch {torch.__version__} is a CPU build" if torch.version.cuda is None
           else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no GPU")
    raise ConfigError(f"--device cuda: {why}; give --device cpu or auto, or install a CUDA build of torch "
                      "(docs/OPERATIONS.md, 'On a GPU')")


def learner_device(config, nets: dict, has_cuda: bool) -> tuple[str, str]:
    """(the device of the learner's PPOs, why) for ``config.device`` and the run's networks
    (policy id -> PolicyNet): auto takes the GPU where one is and the update is one a GPU
    makes faster (a convolutional network, or minibatches of LARGE_MINIBATCH steps or
    more), else the CPU."""
    if config.device != "auto":
        return config.device, "as given"
    if not has_cuda:
        return "cpu", "torch sees no CUDA GPU"
    if any(net.convolutional for net in nets.values()):
        return "cuda", "a convolutional network, and a CUDA GPU"
    if config.minibatch_size >= LARGE_MINIBATCH:
        return "cuda", f"minibatches of {config.minibatch_size} steps, and a CUDA GPU"
    return "cpu", (f"no convolution and minibatches of {config.minibatch_size} < {LARGE_MINIBATCH} steps: "
                   "faster on the CPU than on a GPU")


def make_learners(setup: Setup) -> dict:
    """One learner of --algo per policy (policy id -> PPO or SAC: ``shmrl.model.algorithm``),
    from the checkpoint when resuming, on the device ``learner_device`` chooses (said once
    in the log, kept in ``setup.device``). torch's import, begun in a thread
    (``shmrl.model.torch_import``), is waited for here."""
    from shmrl.model.algorithm import algorithm
    from shmrl.model.torch_import import import_torch

    torch = import_torch()
    config = setup.config
    algo = algorithm(config.algo)
    # 0: every core, for strict on-policy runs whose update dominates (the simulators
    # wait through it, so the learner may take their cores).
    torch.set_num_threads(config.torch_threads or os.cpu_count() or 1)
    device, why = learner_device(config, setup.nets, config.device != "cpu" and cuda_available())
    if device != setup.device:   # the slow profile's PPOs may land elsewhere: said again only then
        log.info("learner on %s (--device %s: %s)", device, config.device, why)
        setup.device = device
    ppos = {pid: algo.make(net, config, seed=config.seed + i, initial_weights=setup.first_weights[pid], device=device)
            for i, (pid, net) in enumerate(setup.nets.items())}
    for pid, ((arrays, values), _) in (setup.pretrained or {}).items():
        ppos[pid].set_state(arrays, values)
    if setup.resumed:
        _, arrays, state = setup.resumed
        for pid, ppo in ppos.items():
            ppo.set_state(policy_arrays(arrays, policy_prefix(pid, setup.multiagent)),
                          ppo_state(state, pid, setup.multiagent))
    return ppos


make_ppos = make_learners   # its name before SAC


def switch_to_slow(setup: Setup, serving: Serving, chunks: dict, rate: float) -> dict:
    """The run goes on with its slow profile (the simulators delivered ``rate`` env steps
    per second): its networks, first weights and PPOs, published at once; the batch it
    measured them on (``chunks``, by policy id) and every chunk sampled before is dropped
    (they count in env_steps), their observations kept in the new policies' statistics.
    Returns the new PPOs."""
    from shmrl.core.episode import EpisodeBatch

    slow, setup.slow = setup.slow, None
    setup.config, setup.nets = slow.config, slow.nets
    setup.first_weights = {pid: net.initial_weights(slow.config.seed + i) for i, (pid, net) in enumerate(slow.nets.items())}
    ppos = make_learners(setup)
    chunks = {pid: EpisodeBatch.concat(batches) for pid, batches in chunks.items()}
    for pid, batch in chunks.items():
        ppos[pid].update_obs_stats(batch)
    serving.switch(slow.config, {pid: net.template for pid, net in slow.nets.items()},
                   {pid: ppo.published_weights() for pid, ppo in ppos.items()}, chunks)
    setup.profile = {"name": "slow", "why": f"simulators slow: {rate:.0f} env steps/s < --slow-rate "
                     f"{slow.config.slow_rate:g}", "sim_rate": rate, "tables": slow.sources,
                     "switched_at_env_steps": serving.store.steps_received}
    return ppos

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
from shmrl.config.algos import sac_refusal
from shmrl.config.settings import (ConfigError, SACSettings, env_defaults, env_name, resolve_config, saved_config,
                                   validate)
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

# What --algo auto's switch to SAC changes: how the learner learns (PPO's, the network's and
# SAC's settings, as the slow profile may change them); never the run's shape (its
# simulators, transports, budget, stop return, the clients' message size), fixed before.
SAC_SETTINGS = SLOW_SETTINGS | {f.name for f in dataclasses.fields(SACSettings) if f.metadata["preset"]}


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
    recorded: dict | None = None     # --pretrain with SAC: policy id -> the recorded episodes for its replay buffer
    sac: SlowProfile | None = None   # SAC, which --algo auto switches to on slow simulators, until it decides

    def ring_nets(self) -> dict:
        """Per policy, the largest of its network and those it may switch to: the rings carry any."""
        others = [p.nets for p in (self.slow, self.sac) if p is not None]
        return {pid: max([net, *(nets[pid] for nets in others)], key=parameters) for pid, net in self.nets.items()}

    @property
    def deciding(self) -> bool:
        """Whether the first batch's rate is still to choose between profiles (or algorithms)."""
        return self.slow is not None or self.sac is not None


@dataclass
class SlowProfile:
    """The env's slow profile (presets.toml), or SAC (--algo auto), as a run may switch to
    it: its settings, with those the command line gave kept, its networks, and the tables
    it came from."""
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
    if config.algo == "auto" and config.resume:   # a run resumes with the algorithm it was trained with
        config = dataclasses.replace(config, algo=checkpoint_algo(config.resume))
    auto = config.algo == "auto"
    config = resolve_config(dataclasses.replace(config, algo="ppo") if auto else config, spec)
    validate(config, spec, servers_given)
    check_device(config)
    multiagent = spec.multiagent
    slow, profile = None, {"name": "preset", "why": f"--learn-per-step {config.learn_per_step}"}
    sac = auto_line = None
    if auto:   # PPO until the first batch says how fast the simulators are
        sac, auto_line = auto_sac(config, spec, given, servers_given)
        log.info("--algo auto: %s", auto_line)
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
    if auto_line:
        profile["algo"] = f"--algo auto: {auto_line}"
    if sac is not None and "env_steps_per_sample" not in given:   # messages that fit SAC's batch too
        config = dataclasses.replace(config, env_steps_per_sample=min(
            config.env_steps_per_sample, -(-sac.config.train_batch_size // max(config.sims, 1))))
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
    for alternative in (slow, sac):
        if alternative is not None:
            alternative.nets = {pid: policy_net(alternative.config, s) for pid, s in policy_specs.items()}
            check_policy_fits_a_frame(alternative.config, alternative.nets, multiagent)
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
    pretrained = recorded = None
    if config.pretrain and not resumed and config.algo == "sac":   # the episodes go into the replay buffer
        from shmrl.trainer.pretrain import recorded_batches

        recorded = recorded_batches(config, nets)
        for pid, batch in recorded.items():
            print(f"pretrain: policy {pid!r}: {batch.num_chunks} episodes ({batch.num_steps} steps) into SAC's "
                  f"replay buffer", flush=True)
    elif config.pretrain and not resumed:   # the clone is what the clients are served first
        from shmrl.trainer.pretrain import pretrain_policies

        pretrained = pretrain_policies(config, nets, first_weights)
        first_weights = {pid: saved_policy(state[0][0], "") for pid, state in pretrained.items()}
    if config.record:
        check_recording(config, spec, policy_specs)
    config = dataclasses.replace(config, tensorboard=chosen_tensorboard(config), plot=chosen_plot(config))
    if slow is not None:   # the settings decided here (the stop return, the log folder) are the slow profile's too
        slow.config = dataclasses.replace(config, **{k: getattr(slow.config, k) for k in SLOW_SETTINGS})
    if sac is not None:
        sac.config = dataclasses.replace(config, algo="sac", **{k: getattr(sac.config, k) for k in SAC_SETTINGS})
    # Unless --env-steps-per-sample is given, each client's message is its share of the batch
    # (of the smallest of the profiles': a client may read it only once), over whoever samples.
    shared_batch = None if "env_steps_per_sample" in given else min(
        [config.train_batch_size] + [p.config.train_batch_size for p in (slow, sac) if p is not None])
    return Setup(config, spec, multiagent, policy_specs, nets, first_weights, first_seq, resumed, pretrained,
                 slow, profile, shared_batch=shared_batch, sac=sac, recorded=recorded)


def checkpoint_algo(resume: str) -> str:
    """The --algo of the newest checkpoint in the folder ``resume`` (PPO where it says none,
    or none can be read: ``load_resume_checkpoint`` then says why the run cannot resume)."""
    from pathlib import Path

    from shmrl.files import checkpoint

    try:
        _, _, state, _ = checkpoint.load_latest(Path(resume))
    except checkpoint.CheckpointError:
        return "ppo"
    return state.get("config", {}).get("algo") or "ppo"


def auto_sac(config, spec, given: set[str], servers_given: bool) -> tuple[SlowProfile | None, str]:
    """--algo auto: (SAC as the run may switch to it on slow simulators, with the settings
    the command line gave kept; None where SAC cannot train this run), and the line that
    says which. ``config``: the run's, resolved for PPO."""
    sac_values = {k: v for k, v in env_defaults(config.env, spec, "sac").items() if k in SAC_SETTINGS}
    sac_config = dataclasses.replace(config, algo="sac", **{k: v for k, v in sac_values.items() if k not in given})
    why = sac_refusal(sac_config, spec) or ("--pretrain: PPO's clone serves the first batch" if config.pretrain
                                            else None)
    if why:
        return None, f"PPO ({why.split(': give')[0]})"
    validate(sac_config, spec, servers_given)
    from shmrl.config.presets import preset_tables

    sources = preset_tables(config.env, spec, "sac")[1]
    return SlowProfile(sac_config, {}, sources), (
        f"PPO's preset until the first batch; then SAC if the simulators delivered fewer than --slow-rate "
        f"{config.slow_rate:g} env steps/s (that batch into its replay buffer), else PPO")


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
    first_dist = algo.first_action_dist(config, bool(setup.resumed),
                                        min((b.num_steps for b in (setup.recorded or {}).values()), default=0))
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
    for pid, batch in (setup.recorded or {}).items():   # SAC's --pretrain: counted toward its warm-up
        ppos[pid].remember(batch, reward_scale=config.reward_scale)
    setup.recorded = None
    if setup.resumed:
        _, arrays, state = setup.resumed
        for pid, ppo in ppos.items():
            ppo.set_state(policy_arrays(arrays, policy_prefix(pid, setup.multiagent)),
                          ppo_state(state, pid, setup.multiagent))
    return ppos


make_ppos = make_learners   # its name before SAC


def switch_to_sac(setup: Setup, serving: Serving, chunks: dict, rate: float) -> dict:
    """--algo auto on slow simulators (``rate`` env steps per second): the run goes on with
    SAC, its settings, networks and learners, published at once (with SET_STATE's
    ``action_dist``: uniform through SAC's warm-up). The batch it measured the rate on
    (``chunks``, by policy id: sampled by PPO's first policy) goes into SAC's replay buffer,
    where it counts toward --learning-starts; nothing is dropped (off-policy, no chunk is too
    old). Returns the SAC learners."""
    from shmrl.core.episode import EpisodeBatch
    from shmrl.model.algorithm import algorithm

    sac, setup.sac, setup.slow = setup.sac, None, None
    setup.config, setup.nets = sac.config, sac.nets
    setup.first_weights = {pid: net.initial_weights(sac.config.seed + i)
                           for i, (pid, net) in enumerate(sac.nets.items())}
    say_sac(sac.config, setup.spec)
    learners = make_learners(setup)
    chunks = {pid: EpisodeBatch.concat(batches) for pid, batches in chunks.items()}
    for pid, batch in chunks.items():
        learners[pid].remember(batch, reward_scale=sac.config.reward_scale)
    serving.switch(sac.config, {pid: net.template for pid, net in sac.nets.items()},
                   {pid: learner.published_weights() for pid, learner in learners.items()}, chunks,
                   off_policy=True, config_fields=algorithm("sac").config_fields(),
                   action_dists={pid: learner.action_dist for pid, learner in learners.items()})
    setup.profile = {"name": "sac", "why": f"--algo auto, simulators slow: {rate:.0f} env steps/s < --slow-rate "
                     f"{sac.config.slow_rate:g}", "sim_rate": rate, "tables": sac.sources,
                     "switched_at_env_steps": serving.store.steps_received}
    return learners


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

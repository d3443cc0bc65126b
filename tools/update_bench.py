"""``python tools/bench.py update``: the learner's time per PPO update and per gradient step,
for each preset's network, split into the parts of ``shmrl.trainer.loop.update``; and SAC's
(``sac-mlp256``: its 256x256 actor and twin critics, one gradient step per env step of a
batch), the cost that decides how much of a fast simulator's stream SAC can learn from.

    python tools/bench.py update [--nets mlp64-mb256 ...] [--repeat 5] [--warmup 1] [--threads 1] [--device cpu]
    python tools/bench.py update --quick --json     # tiny batches, one update: checks that it works

Each network is shmrl's own: ``PolicyNet`` and ``PPO`` built from the Config of an env's
preset (presets.toml), trained on a fake batch of that env's shapes (an ``EpisodeBatch``
built in numpy: random observations, actions drawn from the first policy's distribution,
so ratios start near 1), through the learner's code path: ``EpisodeBatch.concat`` of the
simulators' messages, ``PPO.make_batch`` (normalization, values, GAE),
``PPO.update`` (the minibatch epochs), ``PPO.update_obs_stats``, publishing
(``PPO.published_weights``, ``ModelTemplate.publish``, ``encode_onnx_file``) and logging
(``report.metrics_row``, ``report.progress_line``, ``MetricsLog.write``).

Module level: the standard library only, as tools/bench.py (whose fork server imports
this); torch is imported where an update is measured.
"""
from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tools.shared import finished, median, started

PARTS = ("concat", "make_batch", "update", "obs_stats", "publish", "log")
QUICK_SIZES = {"train_batch_size": 128, "minibatch_size": 64, "epochs": 1}
QUICK_IMAGE_SIZES = {"train_batch_size": 32, "minibatch_size": 16, "epochs": 1}


@dataclass(frozen=True)
class Case:
    """One preset's network: the env whose preset it is, that env's spaces (shmrl's), and
    the settings changed from the preset (or its slow profile, ``slow``)."""
    name: str
    env: str
    what: str
    obs: tuple        # (shape, dtype) of the observation (a Box)
    actions: object   # an int: Discrete(n); a tuple: a Box of that shape
    slow: bool = False
    overrides: tuple = ()
    algo: str = "ppo"

    def spec(self):
        from shmrl.core.spaces import Box, Discrete
        from shmrl.envs.spec import EnvSpec

        shape, dtype = self.obs
        obs = Box((0,), (255,), shape, dtype) if dtype == "uint8" else Box((-math.inf,), (math.inf,), shape)
        actions = Discrete(self.actions) if isinstance(self.actions, int) else Box((-1.0,), (1.0,), self.actions)
        return EnvSpec(self.env, obs, actions)


CASES = (
    Case("mlp64-mb256", "gym:HalfCheetah-v5", "HalfCheetah-v5's preset: MLP 64x64 ReLU, minibatch 256",
         ((17,), "float32"), (6,)),
    Case("mlp64-mb64", "gym:HalfCheetah-v5", "HalfCheetah-v5's preset at minibatch 64",
         ((17,), "float32"), (6,), overrides=(("minibatch_size", 64),)),
    Case("mlp256", "gym:HalfCheetah-v5", "HalfCheetah-v5's slow profile: MLP 256x256 ReLU",
         ((17,), "float32"), (6,), slow=True),
    Case("lstm", "CartPoleNoVel-v1", "CartPoleNoVel-v1's preset: MLP 64 + LSTM 64, sequences of 16",
         ((2,), "float32"), 2),
    Case("nature-cnn", "gym:ALE/Breakout-v5", "Atari's preset: the Nature CNN on 4x84x84 uint8 frames",
         ((4, 84, 84), "uint8"), 4),
    Case("sac-mlp256", "gym:HalfCheetah-v5", "HalfCheetah-v5 with --algo sac: 256x256 actor and twin critics, "
         "minibatch 256, a gradient step per env step", ((17,), "float32"), (6,), overrides=(("buffer_size", 100_000),),
         algo="sac"),
)
CASE_NAMES = tuple(c.name for c in CASES)


def case_config(case: Case, quick: bool = False):
    """(the env's spec, the Config of the case: the preset resolved for the env, its slow
    profile where the case is one, the case's overrides, and with ``quick`` tiny sizes)."""
    from shmrl.config.settings import Config, resolve_config
    from shmrl.trainer.learn_per_step import slow_config

    spec = case.spec()
    config = resolve_config(Config(env=case.env, algo=case.algo), spec)
    if case.slow:
        _, config, _ = slow_config(config, spec, set())
    config = dataclasses.replace(config, **dict(case.overrides))
    if quick:
        config = dataclasses.replace(config, **(QUICK_IMAGE_SIZES if case.obs[1] == "uint8" else QUICK_SIZES))
    return spec, config


def fake_messages(net, config, seed: int = 0) -> list:
    """The batch of one update as the simulators send it: ``config.sims`` messages (at
    least one), each with one chunk per env of its share of ``train_batch_size`` steps,
    every third chunk ending its episode; actions and their log-probabilities drawn from
    a policy like the first (near-uniform logits, Gaussian means near 0 with the preset's
    log-std)."""
    import numpy as np

    from shmrl.core.episode import EpisodeBatch

    rng = np.random.default_rng(seed)
    leaf = net.spec.obs.leaves[0]
    layout = net.spec.actions
    sims = max(config.sims or 1, 1)
    envs = max(config.envs_per_sim or 1, 1)
    per_message = -(-config.train_batch_size // sims)
    messages = []
    for _ in range(sims):
        lengths = np.full(envs, per_message // envs, np.int64)
        lengths[: per_message - int(lengths.sum())] += 1
        n, steps = len(lengths), int(lengths.sum())
        rows = steps + n
        if leaf.dtype == "uint8":
            obs = rng.integers(0, 256, (rows, *leaf.shape), dtype=np.uint8)
        else:
            obs = rng.normal(size=(rows, *leaf.shape)).astype(np.float32)
        if layout.single_box:
            size = layout.parts[0].size
            std = np.exp(net.log_std_init)
            actions = (rng.normal(size=(steps, size)) * std).astype(np.float32)
            logp = (-0.5 * (actions / std) ** 2 - net.log_std_init - 0.5 * np.log(2 * np.pi)).sum(1)
        else:
            k = layout.parts[0].size
            actions = rng.integers(0, k, steps).astype(np.int64)
            logp = np.full(steps, -np.log(k))
        messages.append(EpisodeBatch(
            obs=obs, actions=actions, rewards=rng.normal(size=steps).astype(np.float32),
            action_dist_inputs=np.zeros((steps, net.spec.policy_outputs), np.float32),
            action_logp=logp.astype(np.float32), lengths=lengths,
            is_terminated=np.arange(n) % 3 == 0, is_truncated=np.zeros(n, bool),
            state_in=np.zeros((n, net.state_size), np.float32) if net.state_size else None))
    return messages


class LogTarget:
    """What logging an update needs of a run (``report.metrics_row``'s ``run``), with a
    fresh episode store, and the metrics log it writes to, in a folder of its own."""

    def __init__(self, folder: Path):
        from types import SimpleNamespace

        from shmrl.files.metrics import MetricsLog
        from shmrl.server.store import EpisodeStore
        from shmrl.trainer.report import Clock

        store = EpisodeStore()
        hub = SimpleNamespace(heartbeats_ignored=0, auth_failures=0)
        self.serving = SimpleNamespace(store=store, multiagent=False, servers=[], short_batches=0, hub=hub)
        self.supervisor, self.counts = None, SimpleNamespace(skipped=0)
        self.clock = Clock(time.time(), 0)
        self.metrics = MetricsLog(folder)

    def log(self, stats: dict, config) -> None:
        from shmrl.trainer.report import metrics_row, progress_line

        row = metrics_row(stats, self)
        stop = config.stop_return if config.stop_return is not None else math.inf
        progress_line(row, self.serving.store.returns, stop, config.max_env_steps, True)
        self.metrics.write(row)


def timed_updates(messages: list, warmup: int, repeat: int, sync, times: dict):
    """``warmup`` + ``repeat`` timed updates: each yields (its number, the messages
    concatenated: its first part, already timed; ``lap()``, which ends a part, CUDA
    synchronized first; the part boundaries so far; the LogTarget it logs to, in a folder of
    its own). After each of the last ``repeat``, its parts' times go into ``times``."""
    from shmrl.core.episode import EpisodeBatch

    with tempfile.TemporaryDirectory(prefix="shmrl-update-bench-") as folder:
        target = LogTarget(Path(folder))
        try:
            for i in range(warmup + repeat):
                t = [time.perf_counter()]

                def lap(t=t):
                    sync()
                    t.append(time.perf_counter())

                chunks = EpisodeBatch.concat(messages)
                lap()
                yield i, chunks, lap, t, target
                if i >= warmup:
                    for part, a, b in zip(PARTS, t, t[1:]):
                        times[part].append(b - a)
        finally:
            target.metrics.close()


def update_row(i: int, chunks, t: list, config) -> dict:
    """The fields of a timed update's metrics row that every algorithm's has."""
    return {"update": i + 1, "batch_steps": chunks.num_steps, "reward_scale": config.reward_scale,
            "policy_lag": 0.0, "train_s": t[-1] - t[0], "weights_seq_no": i + 1, "learner_share": 1.0,
            "learn_level": 0, "learner_wall": False, "policies": {}}


def measure(case: Case, device: str = "cpu", repeat: int = 5, warmup: int = 1, quick: bool = False,
            seed: int = 0) -> dict:
    """``warmup`` untimed updates, then ``repeat`` timed ones of ``case``'s network on
    ``device``; the median of each part (ms), the gradient steps of an update, and the
    median per gradient step. CUDA is synchronized at every part's end."""
    import torch

    from shmrl.model.ppo import PPO
    from shmrl.onnxio.policy import encode_onnx_file
    from shmrl.trainer.setup import policy_net

    spec, config = case_config(case, quick)
    if case.algo == "sac":
        return measure_sac(case, spec, config, device, repeat, warmup, seed)
    net = policy_net(config, spec)
    ppo = PPO(net, config, seed=seed, device=device)
    messages = fake_messages(net, config, seed)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    times: dict[str, list] = {part: [] for part in PARTS}
    steps, values = [], []
    for i, chunks, lap, t, target in timed_updates(messages, warmup, repeat, sync, times):
        batch = ppo.make_batch(chunks)
        lap()
        result = ppo.update(batch)
        lap()
        ppo.update_obs_stats(chunks)
        lap()
        encode_onnx_file(net.template.publish(ppo.published_weights()))
        lap()
        target.log({**result, **update_row(i, chunks, t, config)}, config)
        lap()
        if i >= warmup:
            steps.append(gradient_steps(batch, config, result))
            values.append(values_time(ppo, chunks, sync))
    ms = {part: median(x) * 1e3 for part, x in times.items()}
    grad_steps = median(steps)
    values_ms = median(values) * 1e3
    return {"net": case.name, "what": case.what, "env": case.env, "device": device,
            "settings": {k: getattr(config, k) for k in ("train_batch_size", "minibatch_size", "epochs", "hidden",
                                                          "layers", "activation", "memory", "max_seq_len")},
            "weights": sum(p.numel() for p in ppo.params.values()), "gradient_steps": grad_steps,
            "ms": ms, "total_ms": sum(ms.values()), "make_batch_values_ms": values_ms,
            "per_gradient_step_ms": ms["update"] / grad_steps if grad_steps else math.nan}


def measure_sac(case: Case, spec, config, device: str, repeat: int, warmup: int, seed: int) -> dict:
    """``measure`` for SAC: a batch of ``train_batch_size`` env steps concatenated, taken into
    the replay buffer (the "make_batch" part), the gradient steps it owes (--gradient-steps
    per env step: the "update" part), publishing and logging; no observation statistics (the
    [sac] presets do not normalize)."""
    import torch

    from shmrl.model.sac import SAC
    from shmrl.onnxio.policy import encode_onnx_file
    from shmrl.trainer.setup import policy_net

    net = policy_net(config, spec)
    sac = SAC(net, config, seed=seed, initial_weights=net.initial_weights(seed), device=device)
    messages = fake_messages(net, config, seed)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    times: dict[str, list] = {part: [] for part in PARTS}
    for i, chunks, lap, t, target in timed_updates(messages, warmup, repeat, sync, times):
        sac.remember(chunks, config.reward_scale)
        lap()
        steps = max(1, round(chunks.num_steps * config.gradient_steps))
        terms = torch.stack([sac.gradient_step() for _ in range(steps)]).mean(0).tolist()
        lap()
        lap()   # observation statistics: none
        encode_onnx_file(net.template.publish(sac.published_weights()))
        lap()
        target.log({**dict(zip(("actor_loss", "critic_loss", "q_mean", "alpha", "entropy"), terms)),
                    "lr": config.lr, "epochs_run": 1.0, **update_row(i, chunks, t, config)}, config)
        lap()
    ms = {part: median(x) * 1e3 for part, x in times.items()}
    return {"net": case.name, "what": case.what, "env": case.env, "device": device, "algo": "sac",
            "settings": {k: getattr(config, k) for k in ("train_batch_size", "minibatch_size", "epochs", "hidden",
                                                          "layers", "activation", "memory", "max_seq_len",
                                                          "gradient_steps")},
            "weights": sum(p.numel() for p in [*sac.params.values(), *sac.q.values()]), "gradient_steps": steps,
            "ms": ms, "total_ms": sum(ms.values()), "make_batch_values_ms": None,
            "per_gradient_step_ms": ms["update"] / steps}


def values_time(ppo, chunks, sync) -> float:
    """Seconds of make_batch's forward pass alone (normalization and the values of every
    observation; a recurrent net's replay of its chunks): the rest of it is GAE's numpy."""
    t0 = time.perf_counter()
    obs = ppo.normalize(chunks.obs)
    if ppo.net.core:
        ppo._replay(chunks, obs)
    else:
        ppo.values(obs)
    sync()
    return time.perf_counter() - t0


def gradient_steps(batch, config, result: dict) -> float:
    """The gradient steps ``PPO.update`` took on ``batch`` (its epochs run times its
    minibatches per epoch)."""
    units = len(batch) // batch.seq_len
    mb = max(1, min(config.minibatch_size // batch.seq_len, units))
    return result["epochs_run"] * max(units // mb, 1)


def update_bench(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    cases = [c for c in CASES if c.name in args.nets]
    result = started(
        "update",
        "the learner's code path of one PPO update (shmrl.trainer.loop.update) per preset network: "
        "EpisodeBatch.concat of the simulators' messages, PPO.make_batch (normalization, values, GAE), "
        "PPO.update (the minibatch epochs), PPO.update_obs_stats, publishing (published_weights, "
        "ModelTemplate.publish, encode_onnx_file) and logging (metrics_row, progress_line, "
        "MetricsLog.write), on fake batches of each env's shapes built in numpy (random observations, "
        "actions from a near-first policy) with PolicyNet and PPO of the env's preset Config; "
        f"{args.warmup} untimed update(s), then the median of {args.repeat}; torch {torch.__version__}, "
        f"{args.threads} thread(s), device {args.device}; sac-mlp256: SAC.remember (the replay buffer, as "
        "make_batch) and the batch's gradient steps (as update)" + ("; --quick: tiny batches, one epoch"
                                                                    if args.quick else ""),
        nets=[c.name for c in cases], repeat=args.repeat, warmup=args.warmup, threads=args.threads,
        device=args.device, quick=args.quick)
    result["nets"] = [measure(c, args.device, args.repeat, args.warmup, args.quick) for c in cases]
    return finished(result)


def print_update(r: dict) -> None:
    p = r["params"]
    print(f"update: the learner's time per update (PPO's; SAC's: its batch's gradient steps), ms (median of "
          f"{p['repeat']}; {p['device']}, "
          f"{p['threads']} torch thread(s))")
    head = (f"  {'network':<12} | {'batch':>5} | {'mb':>4} | {'ep':>2} | {'steps':>5} | {'total':>8} | "
            f"{'concat':>6} | {'make_batch':>10} | {'values':>7} | {'update':>8} | {'per step':>8} | "
            f"{'obs stats':>9} | {'publish':>7} | {'log':>5}")
    print(head)
    for x in r["nets"]:
        s, ms = x["settings"], x["ms"]
        print(f"  {x['net']:<12} | {s['train_batch_size']:>5} | {s['minibatch_size']:>4} | {s['epochs']:>2} | "
              f"{x['gradient_steps']:>5.0f} | {x['total_ms']:>8.2f} | {ms['concat']:>6.2f} | "
              f"{ms['make_batch']:>10.2f} | {fmt_ms(x['make_batch_values_ms']):>7} | {ms['update']:>8.2f} | "
              f"{x['per_gradient_step_ms']:>8.3f} | "
              f"{ms['obs_stats']:>9.2f} | {ms['publish']:>7.2f} | {ms['log']:>5.2f}")
    print("  total: the sum of the parts; values: make_batch's forward pass alone (the rest of it is GAE); "
          "per step: update / steps (gradient steps)")
    for x in r["nets"]:
        print(f"  {x['net']:<12}: {x['what']} ({x['weights']:,} trained weights)")


def fmt_ms(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def add_update_parser(sub, common) -> None:
    """bench.py's ``update`` subcommand."""
    s = sub.add_parser("update", parents=[common],
                       help="the learner's time per PPO update and gradient step, per preset network")
    s.add_argument("--nets", nargs="+", choices=CASE_NAMES, default=list(CASE_NAMES), help="networks to time")
    s.add_argument("--repeat", type=int, default=5, help="timed updates per network; the figures are medians")
    s.add_argument("--warmup", type=int, default=1, help="untimed updates first")
    s.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    s.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where PPO lives")


QUICK = {"repeat": 1, "warmup": 0}

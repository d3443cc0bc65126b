"""Evaluate a trained policy: run it for some episodes and report the mean and std of the return.

    python -m shmrl.eval runs/a/policy.onnx --env CartPole-v1 --episodes 20
    python -m shmrl.eval runs/a/policy.onnx --env Pendulum-v1 --stochastic --json
    python -m shmrl.eval runs/c4/policy-shared.onnx --env pz:connect_four_v3 --opponent random
    python -m shmrl.eval runs/c4/policy-shared.onnx --env pz:connect_four_v3 --opponent runs/old/policy-shared.onnx

A multi-agent env (PettingZoo) is played against ``--opponent``: ``random`` (a uniformly
random legal player: its action mask's allowed actions), ``self`` (the policy itself) or
another policy file (or a run's log folder: its policy-shared.onnx); the policy takes the
seats in turn, and the win, draw and loss rates are reported (a win: the policy's agent
ends with a higher return than every other; against ``self``, the first seat's).

The policy acts greedily by default (the most likely action; the mean of a Gaussian), as
evaluations usually do; ``--stochastic`` samples as training did. The policy acts through
``shmrl.client.actor.Actor``, as in the simulators; like them, this never imports torch: numpy
and onnxruntime only.

Exit status: 0 with the returns printed, 2 for a bad command line (one line ``error: ...``):
a policy file that is missing or not an ONNX model, an unknown env, a policy that does
not fit the env, or one whose outputs are NaN or infinite (a NaN in its weights): no
return is reported from such a policy; an ``--opponent`` that is not random, self, a
policy file or a run's log folder (the error names --opponent, not the policy).
"""
from __future__ import annotations

import json
from pathlib import Path
import statistics
import sys

import numpy as np

from shmrl.client.actor import Actor
from shmrl.envs.make import env_spec, make_vec_env
from shmrl.client.multi_agent import play
from shmrl.onnxio.policy import OnnxPolicy


def evaluate(model_bytes: bytes, env="CartPole-v1", episodes: int = 20, seed: int = 0,
             stochastic: bool = False, num_envs: int = 8) -> list[float]:
    """The returns of ``episodes`` episodes. Each env runs its share of them (the first
    episodes to end across parallel envs would be the short ones)."""
    try:
        policy = OnnxPolicy(model_bytes)
    except Exception as e:  # onnxruntime's own errors: not a model, or one it cannot run
        raise ValueError(f"not an ONNX model onnxruntime can run: {str(e).strip()[:200]}") from None
    envs = make_vec_env(env, min(num_envs, episodes), seed)
    K = envs.num_envs
    actor = Actor(policy, envs.spec, K, np.random.default_rng(seed), greedy=not stochastic)
    obs = envs.reset()
    share = [(episodes + k) // K for k in range(K)]
    running, returns = np.zeros(K), []
    while len(returns) < episodes:
        actions, dist_inputs, _ = actor.act(obs)
        if not np.isfinite(dist_inputs).all():   # argmax of NaN is 0: it would still "act"
            raise ValueError("the policy outputs NaN or infinity (a NaN in its weights?): no return to report")
        obs, rewards, terminated, truncated, _ = envs.step(actions)
        running += rewards
        for k in np.flatnonzero(terminated | truncated):
            actor.reset(k)
            if share[k]:
                share[k] -= 1
                returns.append(float(running[k]))
            running[k] = 0.0
    return returns


def main(argv=None) -> int:
    from shmrl.config.faces import EvalSettings
    from shmrl.config.flags import face_parser, parse_settings

    a = parse_settings(face_parser(EvalSettings, "python -m shmrl.eval", __doc__), EvalSettings, argv)
    try:
        with open(a.policy, "rb") as f:
            model = f.read()
        if env_spec(a.env).multiagent:
            return _multiagent(a, model)
        returns = evaluate(model, a.env, a.episodes, a.seed, a.stochastic)
    except OSError as e:
        print(f"error: {a.policy}: {e.strerror or e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {a.policy}: {e}", file=sys.stderr)
        return 2
    mean, std = statistics.fmean(returns), statistics.pstdev(returns)
    if a.json:
        print(json.dumps({"env": a.env, "episodes": len(returns), "return_mean": mean, "return_std": std,
                          "returns": returns, "stochastic": a.stochastic}))
    else:
        mode = "sampled" if a.stochastic else "greedy"
        print(f"{a.env}: return {mean:.1f} ± {std:.1f} over {len(returns)} episodes ({mode}); "
              f"min {min(returns):.1f}, max {max(returns):.1f}")
    return 0


class OpponentError(ValueError):
    """--opponent names nothing that can play."""


def opponent_model(opponent: str) -> bytes | str:
    """``random``, ``self``, or the bytes of the ONNX policy ``opponent`` names: a file, or
    a run's log folder (its policy-shared.onnx, or its only policy-*.onnx)."""
    if opponent in ("random", "self"):
        return opponent
    path = Path(opponent)
    if path.is_dir():
        found = sorted(path.glob("policy-*.onnx"))
        shared = path / "policy-shared.onnx"
        if not shared.exists() and len(found) != 1:
            raise OpponentError("no policy-shared.onnx and not exactly one policy-*.onnx in this folder")
        path = shared if shared.exists() else found[0]
    try:
        return path.read_bytes()
    except OSError as e:
        raise OpponentError(f"{e.strerror or e}: not random, self, an ONNX policy file or a run's log folder") \
            from None


def _multiagent(a, model: bytes) -> int:
    try:
        opponent = opponent_model(a.opponent)
    except OpponentError as e:
        print(f"error: --opponent {a.opponent}: {e}", file=sys.stderr)
        return 2
    result = play(a.env, model, opponent, a.episodes, a.seed, greedy=not a.stochastic)
    result["stochastic"] = a.stochastic
    if a.opponent not in ("random", "self"):
        result["opponent"] = a.opponent
    if a.json:
        print(json.dumps(result))
    else:
        print(f"{a.env}: against {a.opponent}: win rate {result['win_rate']:.3f}, draws {result['draw_rate']:.3f}, "
              f"losses {result['loss_rate']:.3f} over {result['episodes']} games "
              f"({'sampled' if a.stochastic else 'greedy'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

import numpy as np
import pytest

from conftest import need
from shmrl.envs import CartPole, LoopVecEnv, VecCartPole, env_spec, make_env, make_vec_env


def balancing_action(obs) -> int:
    # Push toward the side the pole falls to: keeps CartPole up for all 500 steps.
    return int(obs[2] + 0.5 * obs[3] > 0)


def step_beside_gymnasium(env_id: str, mine, seed: int, next_action, atol: float) -> tuple[int, bool, bool]:
    """Reset ``mine`` and gymnasium's ``env_id`` with ``seed`` and step both with the same
    actions until the episode ends, checking each step; returns (steps, terminated, truncated)."""
    ref = need("gymnasium", "gym").make(env_id)
    ref_obs, _ = ref.reset(seed=seed)
    obs, _ = mine.reset(seed=seed)
    np.testing.assert_array_equal(obs, ref_obs)  # same seeding, same reset distribution
    for steps in range(1, 1001):   # both envs end episodes by 500 steps: one that never ends fails here
        # Step both from the same state: gymnasium uses np.cos/np.sin, we use math's, and
        # a last-bit difference would grow along a chaotic trajectory.
        mine._state = tuple(float(v) for v in ref.unwrapped.state)
        action = next_action(ref_obs)
        ref_obs, ref_r, ref_term, ref_trunc, _ = ref.step(action)
        obs, r, term, trunc, _ = mine.step(action)
        np.testing.assert_allclose(obs, ref_obs, rtol=1e-6, atol=atol)
        assert r == pytest.approx(float(ref_r), rel=1e-9, abs=1e-9)
        assert (term, trunc) == (ref_term, ref_trunc)
        if term or trunc:
            return steps, term, trunc
    raise AssertionError(f"{env_id}: no episode end in 1000 steps")


@pytest.mark.parametrize("seed", [0, 1, 7])
@pytest.mark.parametrize("controller", ["random", "balancing"])
def test_cartpole_matches_gymnasium_step_by_step(seed, controller):
    rng = np.random.default_rng(seed)
    random_action = lambda obs: int(rng.integers(2))  # noqa: E731
    steps, term, trunc = step_beside_gymnasium("CartPole-v1", CartPole(), seed,
                                               random_action if controller == "random" else balancing_action,
                                               atol=1e-7)
    if controller == "balancing":
        assert steps == 500 and trunc and not term


def test_obs_dtype_and_spec():
    env = make_env("CartPole-v1", seed=3)
    obs, _ = env.reset()
    assert obs.dtype == np.float32 and obs.shape == env_spec("CartPole-v1").obs_shape
    assert np.all(np.abs(obs) <= 0.05)


def test_unknown_env_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown environment 'Nope-v0'.*CartPole-v1"):
        make_env("Nope-v0")


@pytest.mark.parametrize("make_vec", [lambda n, seed: VecCartPole(n, seed), lambda n, seed: LoopVecEnv(CartPole, n, seed)],
                         ids=["numpy", "loop"])
def test_vector_envs_step_like_single_envs_and_reset_at_once(make_vec):
    n, rng = 5, np.random.default_rng(0)
    vec, singles = make_vec(n, 10), [CartPole() for _ in range(n)]
    obs = vec.reset()
    np.testing.assert_array_equal(obs, [env.reset(seed=10 + k)[0] for k, env in enumerate(singles)])
    ended = 0
    for _ in range(600):  # random play: many episodes end (and one env reaching 500 would too)
        actions = rng.integers(2, size=n)
        obs, rewards, terminated, truncated, final_obs = vec.step(actions)
        for k, env in enumerate(singles):
            o, r, term, trunc, _ = env.step(int(actions[k]))
            assert (rewards[k], terminated[k], truncated[k]) == (r, term, trunc)
            if term or trunc:
                ended += 1
                np.testing.assert_allclose(final_obs[k], o, rtol=1e-5, atol=1e-6)  # the last obs...
                o = env.reset()[0]                                                  # ...then the reset one
            np.testing.assert_allclose(obs[k], o, rtol=1e-5, atol=1e-6)
        assert (final_obs is None) == (not (terminated | truncated).any())
    assert ended > 50


def test_make_vec_env_vectorizes_only_where_it_pays():
    assert isinstance(make_vec_env("CartPole-v1", 64, 0), VecCartPole)
    assert isinstance(make_vec_env("CartPole-v1", 2, 0), LoopVecEnv)
    with pytest.raises(ValueError, match="unknown environment"):
        make_vec_env("Nope-v0", 4)

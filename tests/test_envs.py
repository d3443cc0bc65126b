import numpy as np
import pytest

from conftest import balancing_action, step_beside_gymnasium
from shmrl.envs.builtin import CartPole, VecCartPole
from shmrl.envs.make import LoopVecEnv, env_spec, make_env, make_vec_env


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

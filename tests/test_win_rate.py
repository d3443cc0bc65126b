"""A self-play run's win rate against a random legal player (--eval-every, shmrl.trainer.win_rate):
evaluated while it trains, in the metrics; the stop rule on it (--stop-win-rate); the best
policy evaluated is the one written, whatever ends the run; and the time budget
(--max-seconds)."""
from __future__ import annotations

import json

import pytest

from conftest import need
need("pettingzoo", "pettingzoo")
import shmrl  # noqa: E402
from shmrl.config.settings import ConfigError  # noqa: E402
from shmrl.trainer.win_rate import WinRateEval  # noqa: E402
from test_multiagent import FirstWins, model_for  # noqa: E402


class ScriptedPlay:
    """``shmrl.client.multi_agent.play`` that answers the win rates of ``rates`` in turn, one per
    model (the last one from then on; a model played again gets its rate again, or the
    next of ``again`` where given), and keeps the models it was given, and the calls."""

    def __init__(self, rates, again=()):
        self.rates, self.again, self.models, self.calls = list(rates), list(again), [], 0

    def __call__(self, env, model_bytes, opponent="random", episodes=100, seed=0, num_envs=8, greedy=False):
        assert opponent == "random"
        self.calls += 1
        if self.models and self.models[-1] == model_bytes:   # the confirmation of an evaluation
            rate = self.again.pop(0) if self.again else self.rates[min(len(self.models), len(self.rates)) - 1]
        else:
            self.models.append(model_bytes)
            rate = self.rates[min(len(self.models), len(self.rates)) - 1]
        return {"win_rate": rate, "draw_rate": 0.0, "loss_rate": 1 - rate, "episodes": episodes}


def test_the_best_model_is_kept_and_the_stop_rule_reads_the_latest(monkeypatch):
    play = ScriptedPlay([0.5, 0.9, 0.7, 0.95])
    monkeypatch.setattr("shmrl.client.multi_agent.play", play)
    judge = WinRateEval(FirstWins, ["shared"], every=5, games=10, stop_at=0.92)
    assert [u for u in range(1, 21) if judge.due(u)] == [5, 10, 15, 20] and not judge.solved()
    assert WinRateEval(FirstWins, ["shared"], every=0, games=10, stop_at=0.9).due(0) is False
    rows = [judge.evaluate({"shared": bytes([update])}, update) for update in (5, 10, 15)]
    assert [r["win_rate"] for r in rows] == [0.5, 0.9, 0.7] and [r["best_win_rate"] for r in rows] == [0.5, 0.9, 0.9]
    assert judge.best_models() == {"shared": bytes([10])} and not judge.solved()   # 0.9 < 0.92
    assert judge.summary() == {"win_rate": 0.9, "win_rate_update": {"shared": 10}, "win_rate_latest": 0.7,
                               "evaluations": 3}
    judge.evaluate({"shared": bytes([20])}, 20)
    assert judge.solved() and judge.best_models() == {"shared": bytes([20])}
    assert play.calls == 4 + 3   # 0.5, 0.9 and 0.95 each the best so far: played twice


def test_a_lucky_evaluation_is_played_again_and_pooled(monkeypatch):
    """A rate that would be the best or stop the run counts only pooled with as many games
    again: here 0.96 then 0.88 (0.92: the best so far, short of the stop rate); 0.6, below
    both, is not played again."""
    play = ScriptedPlay([0.8, 0.96, 0.6], again=[0.8, 0.88])
    monkeypatch.setattr("shmrl.client.multi_agent.play", play)
    judge = WinRateEval(FirstWins, ["shared"], every=1, games=10, stop_at=0.95)
    rates = [judge.evaluate({"shared": bytes([u])}, u)["win_rate"] for u in (1, 2, 3)]
    assert rates == [0.8, pytest.approx(0.92), 0.6] and play.calls == 5 and not judge.solved()
    assert judge.best_models() == {"shared": bytes([2])}


def test_several_policies_stop_only_when_every_one_reaches_the_win_rate(monkeypatch):
    monkeypatch.setattr("shmrl.client.multi_agent.play", ScriptedPlay([0.95, 0.5, 0.96, 0.97]))
    judge = WinRateEval(FirstWins, ["a", "b"], every=1, games=10, stop_at=0.9)
    row = judge.evaluate({"a": b"a1", "b": b"b1"}, 1)
    assert row["win_rate_by_policy"] == {"a": 0.95, "b": 0.5} and row["win_rate"] == pytest.approx(0.725)
    assert not judge.solved()
    judge.evaluate({"a": b"a2", "b": b"b2"}, 2)
    assert judge.solved() and judge.best_models() == {"a": b"a2", "b": b"b2"}


def test_a_real_evaluation_plays_the_random_player():
    """No script: the games are played (FirstWins: the player who moves first wins, and the
    policy takes each seat in half of them)."""
    judge = WinRateEval(FirstWins, ["shared"], every=1, games=20, stop_at=0.5)
    row = judge.evaluate({"shared": model_for(FirstWins, "p0")}, 1)
    assert row["win_rate"] == 0.5 and row["eval_s"] > 0 and judge.solved()


def test_an_env_the_learner_cannot_play_ends_the_evaluations_not_the_run(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("spaces only")
    monkeypatch.setattr("shmrl.client.multi_agent.play", broken)
    judge = WinRateEval(FirstWins, ["shared"], every=2, games=10, stop_at=0.9)
    assert judge.evaluate({"shared": b"m"}, 2) == {} and not judge.due(4) and not judge.solved()
    assert judge.summary() == {} and "no more evaluations" in caplog.text and "spaces only" in caplog.text


RUN = dict(env=FirstWins, sims=1, envs_per_sim=4, train_batch_size=256, minibatch_size=128, hidden=16,
           eval_every=1, eval_games=10, log_every=0, tensorboard=False, plot=False)


def test_a_budget_leaves_the_best_policy_evaluated_not_the_last(tmp_path, monkeypatch, capsys):
    play = ScriptedPlay([0.3, 0.8, 0.4, 0.6])
    monkeypatch.setattr("shmrl.client.multi_agent.play", play)
    summary = shmrl.train(**RUN, max_env_steps=5 * 256, stop_win_rate=0.9, logdir=str(tmp_path))
    assert summary["exit_status"] == 1 and summary["updates"] >= 3
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["win_rate"] for r in rows][:3] == [0.3, 0.8, 0.4]
    assert [r["best_win_rate"] for r in rows][:3] == [0.3, 0.8, 0.8] and all("eval_s" in r for r in rows)
    assert summary["win_rate"] == 0.8 and summary["win_rate_update"] == {"shared": 2}
    assert summary["evaluations"] == len(play.models) == summary["updates"]
    written = (tmp_path / "policy-shared.onnx").read_bytes()
    assert written == play.models[1] and written != play.models[-1]   # the last published was not written
    out = capsys.readouterr().out
    assert "| random 80%" in out and "step budget exhausted" in out
    assert max(len(line) for line in out.splitlines() if line.startswith("update ")) <= 100
    assert "the policy written won 0.800 of its evaluation games against a random legal player" in out


def test_a_budget_evaluates_the_updates_since_the_last_evaluation(tmp_path, monkeypatch):
    play = ScriptedPlay([0.3, 0.9])
    monkeypatch.setattr("shmrl.client.multi_agent.play", play)
    summary = shmrl.train(**{**RUN, "eval_every": 3}, max_env_steps=5 * 256, stop_win_rate=0.95,
                          logdir=str(tmp_path))
    updates = summary["updates"]
    assert summary["exit_status"] == 1 and updates in (4, 5)   # not a multiple of 3: the last is evaluated at the end
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["update"], r["win_rate"]) for r in rows if "win_rate" in r] == [(3, 0.3), (updates, 0.9)]
    assert summary["win_rate"] == 0.9 and summary["win_rate_update"] == {"shared": updates}
    assert summary["evaluations"] == 2 and (tmp_path / "policy-shared.onnx").read_bytes() == play.models[-1]


def test_the_stop_win_rate_ends_the_run_solved(tmp_path, monkeypatch):
    play = ScriptedPlay([0.2, 0.5, 0.93])
    monkeypatch.setattr("shmrl.client.multi_agent.play", play)
    summary = shmrl.train(**RUN, max_env_steps=100_000, stop_win_rate=0.9, logdir=str(tmp_path))
    assert summary["exit_status"] == 0 and summary["solved"] and summary["updates"] == 3
    assert summary["win_rate"] == 0.93 and (tmp_path / "policy-shared.onnx").read_bytes() == play.models[2]


def test_the_time_budget_ends_the_run_after_its_seconds(tmp_path, capsys):
    summary = shmrl.train(**{**RUN, "eval_every": 0}, max_env_steps=10**9, max_seconds=6.0, logdir=str(tmp_path))
    # How many updates fit in 6 s is the machine's load (none, beside two busy loops on 2 cores).
    assert summary["exit_status"] == 1 and 6.0 <= summary["wall_s"] < 60.0, summary
    assert "win_rate" not in summary   # no evaluation: the last policy, as before
    assert "time budget exhausted" in capsys.readouterr().out


@pytest.mark.parametrize("fields, message", [
    (dict(env="CartPole-v1", eval_every=5), "--eval-every: the evaluated policy takes every seat in turn"),
    (dict(env="pz:connect_four_v3", stop_win_rate=1.5), "--stop-win-rate must be in (0, 1], or none"),
    (dict(env="pz:connect_four_v3", max_seconds=0.0), "--max-seconds must be > 0"),
])
def test_bad_win_rate_settings_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        shmrl.train(**fields, sims=1)


def test_the_connect_four_preset_evaluates_and_stops_on_the_win_rate_or_its_time():
    from shmrl.run import parse_args

    c4 = parse_args(["--env", "pz:connect_four_v3"])
    assert (c4.eval_every, c4.eval_games, c4.stop_win_rate, c4.max_seconds) == (10, 200, 0.95, 240.0)
    other = parse_args(["--env", "pz:simple_spread_v3"])   # no evaluation, no time budget elsewhere
    assert (other.eval_every, other.stop_win_rate, other.max_seconds) == (0, None, None)

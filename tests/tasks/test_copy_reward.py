"""The built-in copy task's two rewards (--copy-reward): the share of the digits copied right, or
all or nothing."""
import pytest

from emapg_megatron.arguments import parse_args
from emapg_megatron.errors import ConfigError
from emapg_megatron.tasks.synthetic import CopyTask

ROW = {"digits": "123"}


def test_fraction_scores_each_digit_and_exact_only_the_whole_string():
    fraction, exact = CopyTask(num_rows=1), CopyTask(num_rows=1, reward="exact")
    for response, share in [("123", 1.0), ("124", 2 / 3), ("923", 2 / 3), ("000", 0.0), ("12", 2 / 3), ("", 0.0)]:
        assert fraction.reward(response, ROW) == pytest.approx(share)
        assert exact.reward(response, ROW) == (1.0 if share == 1.0 else 0.0)
    assert exact.reward("1234", ROW) == fraction.reward("1234", ROW) == 1.0  # what follows the digits is not scored
    assert all(exact.correct(r, ROW) == fraction.correct(r, ROW) for r in ("123", "124", ""))


def test_the_flag_defaults_to_fraction_and_reaches_the_task_config():
    assert parse_args(["--preset", "tiny-cpu"]).task.copy.reward == "fraction"
    assert parse_args(["--preset", "tiny-cpu", "--copy-reward", "exact"]).task.copy.reward == "exact"
    with pytest.raises(ValueError, match="reward must be one of"):
        CopyTask(reward="sparse")


def test_another_task_refuses_it():
    with pytest.raises(ConfigError, match="--copy-reward is the built-in synthetic-copy task's, not --task math's"):
        parse_args(["--task", "math", "--copy-reward", "exact"]).task.validate(load_hf=None)

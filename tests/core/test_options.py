"""GroupOptions' rules that need no cluster: the process group's timeout default, the CPU share."""

from __future__ import annotations

import pytest

from raysgd_core import GroupOptions, resolve_timeout
from raysgd_core.options import DEFAULT_TIMEOUT_S

pytestmark = pytest.mark.timeout(30)


def test_timeout_is_the_argument_else_nccl_timeout_s_else_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NCCL_TIMEOUT_S", raising=False)
    assert resolve_timeout(None) == DEFAULT_TIMEOUT_S == GroupOptions().timeout_s == 1800
    monkeypatch.setenv("NCCL_TIMEOUT_S", "60")
    assert resolve_timeout(None) == 60.0
    assert resolve_timeout(5) == 5
    # A WorkerGroup's options follow the same rule as the trainer's and Tune's.
    assert GroupOptions().timeout_s == 60.0
    assert GroupOptions(timeout_s=5).timeout_s == 5.0


@pytest.mark.parametrize("raw", ["soon", "", "0", "-1", "nan"])
def test_a_bad_nccl_timeout_s_is_one_value_error(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("NCCL_TIMEOUT_S", raw)
    with pytest.raises(ValueError) as info:
        resolve_timeout(None)
    assert str(info.value) == f"NCCL_TIMEOUT_S must be a number of seconds > 0, got {raw!r}"


def test_num_cpus_per_worker_has_one_rule_above_zero() -> None:
    message = r"^num_cpus_per_worker must be a number > 0, got 0$"
    with pytest.raises(ValueError, match=message):
        GroupOptions(num_cpus_per_worker=0)
    with pytest.raises(TypeError, match=r"^num_cpus_per_worker must be a number > 0, got '1'$"):
        GroupOptions(num_cpus_per_worker="1")
    assert GroupOptions(num_cpus_per_worker=0.5).num_cpus_per_worker == 0.5


def test_num_gpus_per_worker_is_a_share_or_a_whole_number() -> None:
    assert GroupOptions(num_gpus_per_worker=0.25).num_gpus_per_worker == 0.25
    assert GroupOptions(num_gpus_per_worker=2).num_gpus_per_worker == 2
    with pytest.raises(ValueError, match=r"at most 1 or a whole number of GPUs, got 1\.5"):
        GroupOptions(num_gpus_per_worker=1.5)
    with pytest.raises(ValueError, match="num_gpus_per_worker"):
        GroupOptions(num_gpus_per_worker=-1)

import pytest

from shared.aqn import aqn_sigma
from shared.config import AqnConfig


def test_qerl_default_schedule():
    config = AqnConfig()  # 1e-2 -> 1e-4, K = 10
    sigmas = [aqn_sigma(config, step, 100) for step in range(100)]
    stages = [sigmas[10 * k] for k in range(10)]
    assert stages[0] == 0.0
    assert stages[1] == pytest.approx(1e-2)
    assert stages[9] == pytest.approx(1e-4)
    ratios = [stages[k + 1] / stages[k] for k in range(1, 9)]
    assert ratios == pytest.approx([ratios[0]] * 8)  # exponential decay
    assert all(sigmas[10 * k + i] == stages[k] for k in range(10) for i in range(10))  # constant in a stage


def test_disabled_and_degenerate_schedules():
    assert aqn_sigma(AqnConfig(enabled=False), 50, 100) == 0.0
    assert aqn_sigma(AqnConfig(num_stages=1), 50, 100) == 0.0
    two = AqnConfig(num_stages=2)
    assert [aqn_sigma(two, s, 4) for s in range(4)] == [0.0, 0.0, 1e-2, 1e-2]
    assert aqn_sigma(AqnConfig(sigma_start=0.0, sigma_end=0.0), 50, 100) == 0.0
    assert aqn_sigma(AqnConfig(), 7, 5) == pytest.approx(1e-4)  # past the end: last stage

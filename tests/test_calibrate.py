"""The CPU calibration's fit to a real training step ([Note: fitted to training steps])."""

from __future__ import annotations

import pytest
import torch

from flatshard.testing.internals import (
    CalibratedSpeeds,
    RecordedOp,
    calibrated_seconds,
    fitted_achieved,
)

SPEEDS = CalibratedSpeeds(fp32=1e10, bf16=1e9, memory=1e9, cache=1e10, overhead=1e-5)


def _ops() -> list[RecordedOp]:
    """A product of 1 GFLOP (0.1 s at the benchmark's rate) and a memory-bound op of
    20 MB, more than the cache holds (0.02 s): only the first gets slower as the achieved
    share falls."""
    product = RecordedOp("aten.mm", 1e9, 1 << 20, None, 1, (), (0,), False, torch.float32)
    stream = RecordedOp("aten.add", 0.0, 2 * 10**7, None, 1, (), (1,), False, torch.float32)
    return [product, stream]


@pytest.mark.parametrize("seconds", [0.05, 0.08, 0.12, 0.2, 0.4])
def test_the_fitted_share_reproduces_the_measured_step(seconds: float) -> None:
    share = fitted_achieved(_ops(), seconds, SPEEDS)
    fitted = CalibratedSpeeds(**{**SPEEDS.__dict__, "achieved": share})
    assert calibrated_seconds(_ops(), fitted) == pytest.approx(seconds, rel=1e-3)
    expected = 0.1 / (seconds - 0.02 - 2e-5)  # the product's share of the time left
    assert share == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize(("seconds", "bound"), [(0.03, 4.0), (10.0, 0.25)])
def test_the_fitted_share_stays_within_its_bounds(seconds: float, bound: float) -> None:
    assert fitted_achieved(_ops(), seconds, SPEEDS) == bound

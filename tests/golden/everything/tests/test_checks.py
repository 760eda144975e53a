"""Runs the built-in checks on the CPU, small and quick: `pytest` after every change."""

from dataclasses import replace

import pytest

from everything.checks import check_loader, check_overfit, check_resume
from everything.config import Config


@pytest.fixture
def cfg(tmp_path) -> Config:
    return Config(device="cpu", run_dir=str(tmp_path / "run"), num_workers=1)


def test_overfits_one_batch(cfg):
    result = check_overfit(cfg)
    assert result.passed, result.line()


def test_resumes_to_the_same_losses(cfg, tmp_path):
    result = check_resume(cfg, tmp_path / "resume")
    assert result.passed, result.line()


def test_loader_keeps_up(cfg):
    result = check_loader(replace(cfg, num_workers=0))
    assert result.passed, result.line()

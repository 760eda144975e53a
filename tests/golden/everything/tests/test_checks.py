"""Runs the built-in checks on the CPU, small and quick: `pytest` after every change."""

from dataclasses import replace

import pytest

from everything.config import Config
from everything.tools.checks import (
    check_batch_independence,
    check_initial_loss,
    check_loader,
    check_overfit,
)
from everything.tools.resume_check import resume_matches


@pytest.fixture
def cfg(tmp_path) -> Config:
    return Config(device="cpu", run_dir=str(tmp_path / "run"), num_workers=1)


def test_overfits_one_batch(cfg):
    result = check_overfit(cfg)
    assert result.passed, result.line()


def test_no_example_depends_on_another(cfg):
    result = check_batch_independence(cfg)
    assert result.passed, result.line()


def test_the_loss_at_initialisation_is_as_expected(cfg):
    result = check_initial_loss(cfg)
    assert result.passed, result.line()


def test_resumes_to_the_same_losses(cfg, tmp_path):
    passed, detail = resume_matches(cfg, tmp_path / "resume")
    assert passed, detail


def test_loader_keeps_up(cfg):
    result = check_loader(replace(cfg, num_workers=0))
    assert result.passed, result.line()

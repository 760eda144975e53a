"""A user swaps the model and the loss, as model.py invites, and every command still works.

Each test renders one task's project, makes `build_model` return another architecture and
`compute_loss` another loss (with the `initial_loss` and `overfit_target` that loss needs), then
runs every command the project offers, as its user would, and asserts that each one succeeds:
the commands that load a model must build it through `build_model`, not through the class the
template shipped.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import checks_passed
from PIL import Image
from test_project import render, run

pytestmark = pytest.mark.slow

# The matrix's small sizes (scaffold/matrix/runner.py CHECK_SIZES), so each command takes seconds.
SMALL = ("--batch-size", "8", "--val-fraction", "0.01")
SMALL_BY_TASK = {
    "generation": ("--n-layer", "1", "--block-size", "16", "--n-embd", "64", "--data", "data/prep"),
    "image": ("--width", "8", "--image-size", "16", "--num-workers", "0"),
}
RUN = "runs/edited"
BEST = f"{RUN}/checkpoints/best.pt"
PREPARE = ("prepare", "--data", "corpus.jsonl", "--out", "data/prep", "--tokenizer", "byte")

# Each task's edits: top-level definitions of model.py replaced by name; a new class goes in
# before build_model, which returns it.
EDITS = {
    "classification": {
        "build_model": '''
class Logistic(nn.Module):
    """Multinomial logistic regression on standardised features."""

    def __init__(self, x_train: torch.Tensor, n_classes: int) -> None:
        super().__init__()
        self.register_buffer("x_mean", x_train.mean(dim=0))
        self.register_buffer("x_std", x_train.std(dim=0).clamp_min(1e-6))
        self.linear = nn.Linear(x_train.shape[1], n_classes)
        nn.init.zeros_(self.linear.weight)  # uniform probabilities at init: the loss starts at ln C

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear((x - self.x_mean) / self.x_std)


def build_model(cfg: Config, splits: Splits) -> nn.Module:
    return Logistic(splits.train.x, splits.n_classes)
''',
        "compute_loss": """
def compute_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), y, label_smoothing=0.1)
""",
        "overfit_target": """
def overfit_target(first_loss: float) -> float:
    return 0.35 + 0.05  # the entropy of targets smoothed by 0.1 over 4 classes, and a margin
""",
    },
    "regression": {
        "build_model": '''
class WideMLP(nn.Module):
    """One wide SiLU layer on standardised features, no normalisation layers."""

    def __init__(self, x_train: torch.Tensor, hidden: int) -> None:
        super().__init__()
        self.register_buffer("x_mean", x_train.mean(dim=0))
        self.register_buffer("x_std", x_train.std(dim=0).clamp_min(1e-6))
        width = x_train.shape[1]
        self.net = nn.Sequential(nn.Linear(width, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.x_mean) / self.x_std)


def build_model(cfg: Config, splits: Splits) -> nn.Module:
    return WideMLP(splits.train.x, 4 * cfg.hidden_dim)
''',
        "compute_loss": """
def compute_loss(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.huber_loss(output.float().squeeze(-1), y, delta=1.0)
""",
        "initial_loss": """
def initial_loss(splits: Splits) -> float:
    return 0.35  # the Huber loss (delta 1) of standard normal targets against outputs near 0
""",
    },
    "image": {
        "build_model": '''
class PlainCNN(nn.Module):
    """Three plain convolutions (no residuals, no BatchNorm), global pooling, a linear head."""

    def __init__(self, n_classes: int, width: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Linear(4 * width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features((x - 0.5) / 0.25)  # fixed constants, not the training split's statistics
        return self.head(x.mean(dim=(2, 3)))


def build_model(cfg: Config, splits: Splits) -> nn.Module:
    return PlainCNN(len(splits.classes), cfg.width)
''',
        "compute_loss": """
def compute_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), y, label_smoothing=0.1)
""",
        "overfit_target": """
def overfit_target(first_loss: float) -> float:
    return 0.35 + 0.05  # the entropy of targets smoothed by 0.1 over 4 classes, and a margin
""",
    },
    "generation": {
        "build_model": '''
class GRULanguageModel(nn.Module):
    """Token embeddings, a GRU, and a linear output layer: causal by construction."""

    def __init__(self, vocab_size: int, n_embd: int, n_layer: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.gru = nn.GRU(n_embd, n_embd, n_layer, batch_first=True)
        self.lm_head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.wte(idx))  # (B, T, n_embd)
        return self.lm_head(h)  # (B, T, vocab_size)


def build_model(cfg: Config, splits: Splits) -> nn.Module:
    return GRULanguageModel(splits.tokenizer.vocab_size, cfg.n_embd, cfg.n_layer)
''',
        "compute_loss": """
def compute_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    flat = logits.float().flatten(0, 1), y.flatten()
    nats = F.cross_entropy(*flat, reduction="none", label_smoothing=0.1)  # (B*T,), 0 where padded
    tokens = (y != PAD_TARGET).sum(dim=1)
    return (nats.view_as(y).sum(dim=1) / tokens).mean()
""",
        "overfit_target": """
def overfit_target(first_loss: float) -> float:
    # Label smoothing 0.1 over V tokens cannot go below about 0.33 + 0.1 ln V, and the first
    # loss is about ln V; with a margin.
    return 0.5 + 0.1 * first_loss
""",
    },
    "custom": {
        "build_model": '''
class TanhNet(nn.Module):
    """Two tanh layers, for the curve's pairs."""

    def __init__(self, n_inputs: int, hidden_dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(n_inputs, hidden_dim), nn.Tanh(), nn.Linear(hidden_dim, hidden_dim), nn.Tanh()
        )
        self.out = nn.Linear(hidden_dim, 1)
        nn.init.zeros_(self.out.weight)  # outputs start at 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.out(self.net(inputs)).squeeze(-1)  # (B,)


def build_model(cfg: Config, splits: Splits) -> nn.Module:
    return TanhNet(splits.train.inputs.shape[1], cfg.hidden_dim)
''',
        "compute_loss": """
def compute_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.l1_loss(output.float(), targets)
""",
        "initial_loss": """
def initial_loss(splits: Splits) -> float:
    return float(splits.train.targets.abs().mean())  # the outputs start at 0
""",
    },
}


def _replace_definition(path: Path, name: str, source: str) -> None:
    """Replaces the top-level `def name` or `class name` of the file, up to the next top-level
    statement, by `source`."""
    text = path.read_text()
    found = re.search(rf"^(def|class) {name}\b.*?(?=^\S)", text, flags=re.MULTILINE | re.DOTALL)
    assert found, f"no top-level {name} in {path}"
    path.write_text(text[: found.start()] + source.strip() + "\n\n\n" + text[found.end() :])


def _corpus(path: Path) -> None:
    """Short documents of random words, for `prepare`."""
    rng = np.random.default_rng(0)
    words = ("the", "cat", "sees", "an", "old", "dog", "by", "the", "sea")
    with path.open("w", encoding="utf-8") as f:
        for _ in range(400):
            text = " ".join(rng.choice(words, size=rng.integers(3, 30)))
            f.write(json.dumps({"text": text + "."}) + "\n")


def _succeeds(project: Path, *args: str) -> str:
    done = run(project, *args)
    assert checks_passed(done), f"{args[0]} failed:\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    return done.stdout


@pytest.mark.parametrize("task", list(EDITS))
def test_every_command_works_after_the_model_and_loss_are_replaced(task, tmp_path):
    project = render(tmp_path / "edited", task=task, device="cpu")
    model_file = next((project / "src").iterdir()) / "model.py"
    for name, source in EDITS[task].items():
        _replace_definition(model_file, name, source)
    options = (*SMALL, *SMALL_BY_TASK.get(task, ()))
    if task == "generation":
        _corpus(project / "corpus.jsonl")
        _succeeds(project, *PREPARE)

    _succeeds(
        project, "train", *options, "--run-dir", RUN, "--max-steps", "20", "--eval-every", "10"
    )
    assert (project / BEST).is_file()
    assert "resume check matched: yes" in _succeeds(project, "check", "all", *options)
    assert "**Results:** best val loss" in _succeeds(project, "report", RUN)
    diagnosed = run(project, "diagnose", RUN)  # 1: it found something, in a run of 20 steps
    assert diagnosed.returncode in (0, 1), diagnosed.stdout + diagnosed.stderr
    assert diagnosed.stdout.startswith(f"{RUN}: ") and not diagnosed.stderr, diagnosed.stderr
    assert "wrote curves.png" in _succeeds(project, "plot", RUN, "-o", "curves.png")

    found = _succeeds(project, "find-lr", *options, "--range-steps", "20", "-o", "lr.png")
    assert "suggested --lr" in found
    assert "suggested: --batch-size" in _succeeds(project, "find-batch-size", *options)
    assert "profile: 20 steps" in _succeeds(project, "profile", *options, "-o", "runs/profile")
    assert "train: " in _succeeds(project, "inspect-data", *options)
    exported = _succeeds(project, "export", "--checkpoint", BEST, "--out", "weights.pt")
    assert exported.startswith("wrote weights.pt")
    weights = torch.load(project / "weights.pt", weights_only=True)  # the edited model's, alone
    assert weights.keys() == torch.load(project / BEST, weights_only=True)["model"].keys()

    if task == "image":
        picture = project / "grey.png"
        Image.fromarray(np.full((24, 24, 3), 200, dtype=np.uint8)).save(picture)
        predicted = _succeeds(project, "predict", picture, "--checkpoint", BEST, "--top-k", "2")
        assert re.fullmatch(rf"{picture}: \w+ [\d.]+  \w+ [\d.]+\n", predicted), predicted
    if task == "generation":
        sampled = _succeeds(project, "sample", "--checkpoint", BEST, "--prompt", "the ")
        assert sampled.startswith("the ") and len(sampled) > len("the \n"), sampled

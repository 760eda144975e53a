"""Machinery: what fine-tuning adds to the step. --freeze keeps the weights under some module names,
and their BatchNorm statistics, as they are until --unfreeze-at; --ema keeps an exponential moving
average of the weights, which validation, best and `export` use. Every checkpoint holds the
average, and its optimizer state says which weights AdamW has moved yet: a resume goes on exactly,
across the unfreeze step too."""

import contextlib

import torch

from ..config import Config, ConfigError
from ..model import HEAD
from .distributed import local_shards

BATCH_NORMS = torch.nn.BatchNorm1d | torch.nn.BatchNorm2d | torch.nn.BatchNorm3d


def under(name: str, prefixes) -> bool:
    """Whether the parameter or module `name` is one of `prefixes`' modules or inside one."""
    return any(name == prefix or name.startswith(f"{prefix}.") for prefix in prefixes)


def top_modules(model: torch.nn.Module) -> list[str]:
    """The names of the model's top-level modules that hold parameters."""
    return [name for name, module in model.named_children() if any(True for _ in module.parameters())]


def body(model: torch.nn.Module) -> str:
    """The model's top-level modules outside HEAD that share no weight with it (GPT's embedding is
    its output layer's), as a --freeze value; none where that is all of them (a HEAD that names
    none): a model frozen whole would train nothing."""
    named = model.named_parameters(remove_duplicate=False)
    head = {id(p) for name, p in named if under(name, HEAD)}
    names = top_modules(model)
    outside = [
        name
        for name in names
        if not under(name, HEAD) and not any(id(p) in head for p in model.get_submodule(name).parameters())
    ]
    return ",".join(outside) if len(outside) < len(names) else ""


class Freezing:
    """--freeze: the parameters under its prefixes keep their values until step --unfreeze-at (0:
    to the end). They stay in the optimizer and keep requires_grad, so that DDP and FSDP, which fix
    what they reduce when they wrap the model, need nothing new at the unfreeze step: their
    gradients are dropped before the optimizer's step, and AdamW then neither updates nor decays
    them (nor starts their moments, which begin at the unfreeze). Their BatchNorm layers are kept in
    eval mode: they normalise with their running statistics and do not update them."""

    def __init__(self, model: torch.nn.Module, cfg: Config) -> None:
        prefixes = [prefix for prefix in cfg.freeze.split(",") if prefix]
        named = list(model.named_parameters(remove_duplicate=False))  # a tied weight under each name
        for prefix in prefixes:  # a typo would freeze nothing, silently
            if not any(under(name, [prefix]) for name, _ in named):
                available = ", ".join(top_modules(model))
                raise ConfigError(
                    f"--freeze {prefix}: no parameter of the model is under it; its modules: {available}"
                )
        self.params = list({id(p): p for name, p in named if under(name, prefixes)}.values())
        if self.params and len(self.params) == len({id(p) for _, p in named}):
            raise ConfigError(
                f"--freeze {cfg.freeze} freezes every parameter of the model: nothing would train"
            )
        modules = [m for name, m in model.named_modules() if under(name, prefixes)]
        self.norms = [m for m in modules if isinstance(m, BATCH_NORMS)]
        self.unfreeze_at = cfg.unfreeze_at
        self.at_step(0)

    def at_step(self, step: int) -> bool:
        """Freezes or not for the step after `step` steps; True at the unfreeze step itself."""
        self.frozen = bool(self.params) and (self.unfreeze_at == 0 or step < self.unfreeze_at)
        for norm in self.norms:  # after each validation, which puts the whole model back in training mode
            norm.train(not self.frozen)
        return bool(self.params) and step == self.unfreeze_at > 0

    def drop_gradients(self) -> None:
        if self.frozen:
            for p in self.params:
                p.grad = None


class WeightAverage:
    """--ema DECAY: the weights' moving average. After each optimizer step with finite gradients,
    average += w x (weights - average), with w = max(1 - DECAY, 1 / steps): the plain mean of the
    weights over the first 1 / (1 - DECAY) steps, then an exponential average, so the weights before
    the first step (which --init-from replaces) weigh nothing. It averages the parameters as this
    process holds them; buffers (BatchNorm's statistics) are the model's own. DECAY 0: no average,
    and every method does nothing."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        self.decay = decay
        named = list(model.named_parameters(remove_duplicate=False)) if decay else []
        self.params = list({id(p): p for _, p in named}.values())
        copies = {id(p): p.detach().clone() for p in self.params}
        self.average = list(copies.values())
        self.named = {name: copies[id(p)] for name, p in named}  # tied weights share one average
        device = self.params[0].device if self.params else None
        self.steps = torch.zeros((), device=device)  # a tensor: counted on the device, no sync a step

    @torch.no_grad()
    def update(self, grad_norm: torch.Tensor) -> None:
        """Adds the weights after a step, unless its gradients were not finite (a skipped step)."""
        if self.decay:
            taken = grad_norm.isfinite()
            self.steps += taken
            weight = torch.clamp(1 / self.steps.clamp(min=1), min=1 - self.decay) * taken
            average, params = local_shards(self.average), local_shards(self.params)
            torch._foreach_lerp_(average, params, [weight] * len(average))

    @contextlib.contextmanager
    def applied(self):
        """The model's parameters are the average inside the block, and its own again after it."""
        if not self.decay:
            yield
            return
        params = local_shards(self.params)
        with torch.no_grad():
            own = [p.detach().clone() for p in params]
            torch._foreach_copy_(params, local_shards(self.average))
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, own)

    def state_dict(self) -> dict:
        """The averages by the model's parameter names, as this process holds them."""
        return dict(self.named)

    @torch.no_grad()
    def load_state_dict(self, averages: dict, steps: torch.Tensor) -> None:
        for name, average in self.named.items():
            average.copy_(averages[name])
        self.steps.copy_(steps)

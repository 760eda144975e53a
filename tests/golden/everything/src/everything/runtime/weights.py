"""Machinery: a fresh run's weights, put into the model from `train --init-from SOURCE`, all or none.

SOURCE is a checkpoint of this project (a run's best or a step's, local or RUN_URL/checkpoints/NAME),
a plain state_dict file (what `export` writes) or a .safetensors file, read without unpickling code
(weights_only=True, or safetensors). The `module.` and `_orig_mod.` that data-parallel and compiled
wrappers put before names (in whatever run wrote SOURCE) are dropped, and model.from_published
renames another layout into the model's.

Every parameter and buffer is loaded, or the run is refused in one line before any step (exit 2):
a load that skips a key trains that part from its random start, and nothing says so. The one
exception is the output head that model.HEAD names: where the source's has another shape (other
classes), it keeps its fresh initialisation, which the run says and run.json records.
Where training runs in several processes, rank 0 alone reads SOURCE; distributed.load_whole_state
gives it to the others.
"""

import hashlib
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..config import ConfigError
from ..model import HEAD, from_published
from . import checkpoint
from .distributed import all_gather, is_main_process, load_whole_state
from .finetune import under
from .rundir import RunDirError, fetch_checkpoint
from .store import StoreError, is_url

WRAPPERS = ("module.", "_orig_mod.")  # what data-parallel and compiled wrappers put before a name
CHECKPOINT_KEYS = {"model", "optimizer", "state", "config"}  # a checkpoint file's (any distributed setting's)
SHOWN = 3  # names shown of each kind of misfit


class WeightsError(ConfigError):
    """Weights that cannot start this run, said in one line: bad input, exit 2."""


def init_weights(model: torch.nn.Module, source: str, say) -> dict:
    """SOURCE's weights in `model` (just built: its head keeps that initialisation where SOURCE's
    does not fit); returns what run.json records: the source, its SHA-256, what was re-initialised."""
    state, found = {}, None
    if is_main_process():
        try:
            state, record, lines = prepare(source, model.state_dict())
            found = (record, lines)
        except WeightsError as error:
            found = str(error)
    found = all_gather(found)[0]  # rank 0's verdict, on every rank
    if isinstance(found, str):
        raise WeightsError(found)
    record, lines = found
    load_whole_state(model, state)
    for line in lines:
        say(line)
    return record


def prepare(source: str, expected: dict[str, torch.Tensor]) -> tuple[dict, dict, list[str]]:
    """SOURCE read and checked against the model's state_dict `expected`: the tensors to load, the
    run.json record, the lines to say. Anything but an exact fit (the head aside) is refused."""
    tensors, sha256 = read(source)
    state = from_published({unwrapped(name): t for name, t in tensors.items()})
    kept = [k for k in expected if under(k, HEAD) and (k not in state or state[k].shape != expected[k].shape)]
    missing = [k for k in expected if k not in state and k not in kept]
    unexpected = [k for k in state if k not in expected and not under(k, HEAD)]
    reshaped = [
        f"{k}: {size(state[k])}, here {size(expected[k])}"
        for k in expected
        if k in state and k not in kept and state[k].shape != expected[k].shape
    ]
    misfits = [(missing, "missing"), (unexpected, "unexpected"), (reshaped, "of another shape")]
    if any(names for names, _ in misfits):
        found = "; ".join(f"{len(names)} {what} ({shown(names)})" for names, what in misfits if names)
        head = f"only model.HEAD ({', '.join(HEAD)}) may differ" if HEAD else "model.HEAD names no head"
        raise WeightsError(f"--init-from {source} does not fit this model: {found}; {head}")
    reinitialised = [
        f"{k} ({size(state[k])} in the source, {size(expected[k])} here)" if k in state else f"{k} (absent)"
        for k in kept
    ]
    state = {k: state[k] for k in expected if k not in kept}
    cast = widened(source, state, expected)
    if infinite := [k for k, t in state.items() if t.is_floating_point() and not t.isfinite().all()]:
        raise WeightsError(f"--init-from {source}: NaN or inf in {len(infinite)} tensors ({shown(infinite)})")
    lines = [f"weights: {len(state)} tensors from {source} (sha256 {sha256[:12]})"]
    if cast:
        lines.append(f"weights: {cast} tensors of a narrower float dtype widened to the model's (exactly)")
    if reinitialised:
        lines.append(f"weights: re-initialised, not loaded (model.HEAD): {', '.join(reinitialised)}")
    record = {"source": source, "sha256": sha256, "reinitialised": kept}
    return state, record, lines


def read(source: str) -> tuple[dict[str, torch.Tensor], str]:
    """SOURCE's tensors by name, and its SHA-256 (a checkpoint folder's: of its files', by name)."""
    try:
        path = Path(fetch_checkpoint(source) if is_url(source) else source)
    except (RunDirError, StoreError) as error:
        raise WeightsError(f"--init-from: {error}") from None
    if not path.exists():
        raise WeightsError(f"--init-from {source}: no such file")
    if path.is_dir():
        try:
            tensors = checkpoint.load(path)["model"]
        except checkpoint.CheckpointError as error:
            raise WeightsError(f"--init-from: {error}") from None
        digests = "".join(f"{p.name} {checkpoint.file_digest(p)}\n" for p in sorted(path.iterdir()))
        return tensors, hashlib.sha256(digests.encode()).hexdigest()
    sha256 = checkpoint.file_digest(path)
    if path.suffix == ".safetensors":
        try:
            return load_file(path), sha256
        except (SafetensorError, OSError) as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise WeightsError(f"--init-from {source} is not readable safetensors ({reason})") from None
    try:
        with warnings.catch_warnings():  # of a pickle protocol it may not read: the outcome is said below
            warnings.simplefilter("ignore")
            payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated, zero bytes, not a torch file: torch raises several types
        if str(error).startswith("Weights only load failed"):  # an object whose unpickling could run code
            raise WeightsError(
                f"--init-from {source} holds pickled objects, not only tensors: torch.load(weights_only=True)"
                " refuses them, as their unpickling could run code; save its state_dict() instead"
            ) from None
        raise WeightsError(f"--init-from {source} is unreadable ({type(error).__name__})") from None
    if isinstance(payload, dict) and payload.keys() >= CHECKPOINT_KEYS:
        if "digest" in payload and payload.pop("digest") != checkpoint.digest(payload):
            raise WeightsError(f"--init-from {source} is damaged (its contents do not match its digest)")
        payload = payload["model"]
    if not isinstance(payload, dict) or not payload:
        what = "an empty dict" if isinstance(payload, dict) else f"a {type(payload).__name__}"
        raise WeightsError(f"--init-from {source} holds no state_dict (tensors by name) but {what}")
    if others := [str(k) for k, v in payload.items() if not isinstance(v, torch.Tensor)]:
        optimizer = "; an optimizer's state_dict" if "param_groups" in payload else ""
        raise WeightsError(
            f"--init-from {source} holds no state_dict: {len(others)} of its entries are not tensors"
            f" ({shown(others)}{optimizer})"
        )
    return payload, sha256


def widened(source: str, state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> int:
    """Casts, in `state`, tensors of a narrower float dtype (fp16 or bf16 weights into an fp32
    model: exact) to the model's, and counts them; any other dtype change is refused, as it loses
    values (fp64 into fp32) or means another tensor (integers for floats)."""
    cast, refused = 0, []
    for k, t in state.items():
        want = expected[k].dtype
        if t.dtype == want:
            continue
        floats = t.is_floating_point() and want.is_floating_point
        if floats and torch.finfo(t.dtype).bits <= torch.finfo(want).bits:
            state[k], cast = t.to(want), cast + 1
        else:
            refused.append(f"{k}: {dtype_name(t.dtype)}, here {dtype_name(want)}")
    if refused:
        raise WeightsError(f"--init-from {source}: {len(refused)} tensors of other dtypes ({shown(refused)})")
    return cast


def unwrapped(name: str) -> str:
    """A name without what a data-parallel wrapper (`module.`, before the whole model's) and a compiled
    one (`_orig_mod.`, before a compiled model's or block's) put in it."""
    while name.startswith(WRAPPERS):
        name = name.split(".", 1)[1]
    return name.replace("._orig_mod.", ".")


def shown(names: list[str]) -> str:
    return ", ".join(names[:SHOWN]) + (f", ... {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def size(t: torch.Tensor) -> str:
    return "x".join(map(str, t.shape)) or "scalar"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

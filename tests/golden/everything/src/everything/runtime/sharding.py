"""Machinery: the FSDP2 model made without any rank holding it whole. distributed.build records
the model's construction on the meta device (record), distributed.wrap shards it, then each rank
replays the recorded ops from cfg.seed and keeps its own shards (materialize): the very values one
process would make, the whole model never in one place."""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ..config import Config


def record(make) -> torch.nn.Module:
    """The model on the meta device, which holds no values: make() runs with every tensor it makes
    put there, and its ops recorded for materialize()."""
    recorder = _Recorder()
    with recorder:
        model = make()
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    made = {name: t.detach().clone() for name, t in tensors if not t.is_meta}  # from data, say
    places = {}  # each meta storage's tensors: name and view
    for name, t in tensors:
        if t.is_meta:
            places.setdefault(_storage(t), []).append((name, t.size(), t.stride(), t.storage_offset()))
    _UNMADE[model] = (recorder.ops, places, made)
    return model


_UNMADE = weakref.WeakKeyDictionary()  # a model build() made, until wrap() makes its shards
_ALLOCATIONS = ("aten::empty", "aten::empty_strided")
_OVERWRITES = {torch.ops.aten.uniform_.default, torch.ops.aten.normal_.default, torch.ops.aten.zero_.default,
               torch.ops.aten.fill_.Scalar, torch.ops.aten.copy_.default}  # fmt: skip


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _whole(t: torch.Tensor) -> bool:
    """Whether `t` is the whole of its storage."""
    return t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes


def _aliases(outs: list[torch.Tensor], ins: list[torch.Tensor]) -> bool:
    return all(_storage(o) in {_storage(t) for t in ins} for o in outs)


def _metas(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.is_meta]


class _Recorder(TorchDispatchMode):
    """Every op a model's construction runs, a factory's tensors made on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and not any(isinstance(a, torch.Tensor) for a in tree_flatten(args)[0]):
            kwargs["device"] = torch.device("meta")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


@torch.no_grad()
def materialize(model: torch.nn.Module, cfg: Config, device: torch.device) -> None:
    """This rank's shards of a model build() made, filled on the device: its recorded ops replayed
    from cfg.seed. A tensor is whole only from its last overwrite to its last op, then this rank
    keeps its shard of it; an earlier overwrite (a default init that the model's own replaces)
    runs on a scratch tensor for its random numbers alone. No rank holds the whole model, only its
    shards and at most a few whole tensors at a time."""
    ops, places, made = _UNMADE.pop(model)
    last, last_overwrite = {}, {}
    for i, (func, args, kwargs, out) in enumerate(ops):
        for t in _metas((args, kwargs, out)):
            last[_storage(t)] = i
        if func in _OVERWRITES and args[0].is_meta and _whole(args[0]):
            last_overwrite[_storage(args[0])] = i
    model.to_empty(device=device)
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    for name, value in made.items():
        _keep_shard(tensors[name], value)
    whole = {}  # storage: a whole tensor on the device

    def real(t):
        if not (isinstance(t, torch.Tensor) and t.is_meta):
            return t
        if _storage(t) not in whole:
            elements = t.untyped_storage().nbytes() // t.element_size()
            whole[_storage(t)] = torch.empty(elements, dtype=t.dtype, device=device)
        return whole[_storage(t)].as_strided(t.size(), t.stride(), t.storage_offset())

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        for i, (func, args, kwargs, out) in enumerate(ops):
            outs = _metas(out)
            written = _storage(args[0]) if func._schema.is_mutable and _metas(args[:1]) else None
            if func._schema.name in _ALLOCATIONS or (written is None and _aliases(outs, _metas(args))):
                pass  # an allocation or a view: made where first used
            elif written is not None and i < last_overwrite.get(written, -1):  # overwritten later
                scratch = torch.empty(args[0].shape, dtype=args[0].dtype, device=device)
                func(scratch, *tree_map(real, args[1:]), **tree_map(real, kwargs))
            else:
                kwargs = {k: device if k == "device" else v for k, v in kwargs.items()}
                result = func(*tree_map(real, args), **tree_map(real, kwargs))
                for o, r in zip(outs, tree_flatten(result)[0], strict=False):
                    whole.setdefault(_storage(o), r)
            for key in [key for key in whole if last[key] == i]:
                for name, size, stride, offset in places.get(key, ()):
                    _keep_shard(tensors[name], whole[key].as_strided(size, stride, offset))
                del whole[key]


def _keep_shard(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """`tensor` (a sharded parameter, or a buffer every rank keeps whole) set from its whole value."""
    if hasattr(tensor, "to_local"):  # a DTensor sharded on dim 0, as FSDP2 does: torch.chunk's pieces
        pieces = value.chunk(tensor.device_mesh.size(), dim=0)
        rank = tensor.device_mesh.get_local_rank()
        value = pieces[rank] if rank < len(pieces) else value[:0]
        tensor = tensor.to_local()
    tensor.copy_(value)


def compiled_for_training(unit: torch.nn.Module):
    """The unit's forward compiled for training steps, evaluation eager: units of one class share
    their code, whose graphs torch.compile caps at 8 (recompile_limit), and a graph per block width
    in each mode ran past it, leaving blocks uncompiled. Static shapes: dynamic ones failed in
    inductor's lowering of a residual block (torch 2.13, CPU: "Cannot convert expression to float")."""
    compiled, eager = torch.compile(unit.forward, dynamic=False), unit.forward

    def forward(*args, **kwargs):
        training = unit.training and torch.is_grad_enabled()
        return compiled(*args, **kwargs) if training else eager(*args, **kwargs)

    return forward


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each module with parameters that an nn.Sequential or nn.ModuleList of the model holds
    (a transformer block, a residual block, an MLP's layer), outermost first: the units FSDP
    gathers one at a time. Parameters outside them (embeddings, a head) belong to the root."""
    units = []

    def visit(module: torch.nn.Module) -> None:
        container = isinstance(module, torch.nn.Sequential | torch.nn.ModuleList)
        for child in module.children():
            if container and any(True for _ in child.parameters()):
                units.append(child)
            else:
                visit(child)

    visit(model)
    return units

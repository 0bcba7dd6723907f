"""Meta-device initialisation: the model built with no storage, parallelised, then filled in
shard by shard with exactly the weights a one-process build draws.

torchtitan builds under ``torch.device("meta")``, applies TP and FSDP, then calls
``to_empty`` and the model's own init on each rank's shards. Run on a shard, an init draws
other random numbers than the one-process build: ``normal_`` on rows 0..k of a weight
is not rows 0..k of ``normal_`` on the whole weight. So here the build is *recorded*
instead: every aten op it runs on the meta device (the constructors' draws, ``_init_weights``'
redraws, the buffers' arithmetic) is logged with its tensors named by storage and view
geometry. ``materialize`` replays that log on the CPU from the generator state the build
started from: the same ops in the same order on tensors of the same shapes draw the same
numbers. Each tensor is held whole only from the op that last overwrites it whole to its
last op; at that point a parameter or buffer is handed to its rank's shard (each rank keeps
its slice, ``distribute_tensor(..., src_data_rank=None)``: no communication) and freed.
With the standard init the peak is one full parameter plus a rank's shards, not the
model; the time is the one-process init's (every draw is made, if only to be discarded).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import UsageError

META = torch.device("meta")

# In-place ops whose result does not read the tensor they write: a draw or a fill of the
# whole storage starts its value afresh (what came before it need not be kept).
_FILLS = {torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default, torch.ops.aten.fill_.Scalar,
          torch.ops.aten.zero_.default, torch.ops.aten.bernoulli_.float, torch.ops.aten.exponential_.default,
          torch.ops.aten.random_.default, getattr(torch.ops.aten.random_, "from"), torch.ops.aten.random_.to,
          torch.ops.aten.cauchy_.default, torch.ops.aten.log_normal_.default, torch.ops.aten.geometric_.default}


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclass(frozen=True)
class _Ref:
    """A tensor of the build: its storage (by key) and the view of it the op saw."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    nbytes: int  # the storage's

    @classmethod
    def of(cls, t: torch.Tensor) -> _Ref:
        return cls(_key(t), tuple(t.size()), tuple(t.stride()), t.storage_offset(), t.dtype,
                   t.untyped_storage().nbytes())

    @property
    def whole(self) -> bool:
        """Whether this view covers its storage, contiguous from its start."""
        numel, expected = 1, True
        for n, s in reversed(list(zip(self.size, self.stride))):
            expected &= n == 1 or s == numel
            numel *= n
        return self.offset == 0 and expected and numel * self.dtype.itemsize == self.nbytes


@dataclass
class _Op:
    func: Any
    args: Any  # with _Ref for meta tensors, real tensors kept as they are
    kwargs: dict
    outputs: list[_Ref]  # storages this op creates
    writes: list[_Ref]  # storages it writes in place
    fill: bool  # a whole-storage draw or fill: the written value before it is not read


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.alive: list[torch.Tensor] = []  # every meta tensor seen: keeps storage keys unique

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        if not written and any(r.alias_info is not None for r in schema.returns):
            return out  # a view: rebuilt from its geometry where it is used
        flat_args = _bound(schema, args, kwargs)
        writes = [_Ref.of(flat_args[i]) for i in written if isinstance(flat_args[i], torch.Tensor)]
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        outputs = [_Ref.of(t) for t in tensors if not any(_key(t) == w.key for w in writes)]
        self.alive.extend(tensors)

        def ref(x):
            if isinstance(x, torch.Tensor) and x.is_meta:
                self.alive.append(x)
                return _Ref.of(x)
            return x

        self.ops.append(_Op(func, tree_map(ref, args), tree_map(ref, kwargs), outputs, writes,
                            fill=func in _FILLS and len(writes) == 1 and writes[0].whole))
        return out


def _bound(schema, args, kwargs) -> list:
    """The op's arguments in schema order (positional, then by name)."""
    return [args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(schema.arguments)]


class _Constants(TorchFunctionMode):
    """``torch.tensor(data)`` on the meta device drops ``data`` before any aten op sees it: make
    it on the CPU and move it, so the log holds the values (alibi's slopes, say)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and not isinstance(args[0] if args else None, torch.Tensor) \
                and torch.device(kwargs.get("device") or META) == META:
            return func(*args, **{**kwargs, "device": "cpu"}).to(META)
        return func(*args, **kwargs)


@dataclass
class InitLog:
    """What a build did on the meta device, and where its parameters and buffers ended up."""

    ops: list[_Op]
    rng_state: torch.Tensor  # the CPU generator's state when the build started
    finals: dict[int, list[tuple[str, _Ref]]] = field(default_factory=dict)  # storage -> (name, view)
    peak_bytes: int = 0  # the most bytes held whole at once by the last replay

    def replay(self, write: Callable[[str, torch.Tensor], None]) -> None:
        """Run the build again on the CPU from ``rng_state``; ``write(name, value)`` receives each
        parameter and buffer (full, in the one-process build's values) once it is final."""
        uses: dict[int, list[tuple[int, bool]]] = {}  # storage -> [(op index, whether it overwrites whole)]
        for i, op in enumerate(self.ops):
            touched = {r.key: False for r in _refs(op.args) + _refs(op.kwargs)}
            touched.update({r.key: op.fill for r in op.writes})
            touched.update({r.key: True for r in op.outputs})
            for key, fresh in touched.items():
                uses.setdefault(key, []).append((i, fresh))
        missing = [name for key, names in self.finals.items() if key not in uses for name, _ in names]
        if missing:
            raise UsageError(f"meta init: {', '.join(missing)} never written by the build; expected every "
                             "parameter and buffer made by torch ops the recorder sees")
        values: dict[int, torch.Tensor] = {}
        position = {key: 0 for key in uses}
        self.peak_bytes = 0
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.rng_state)
            for i, op in enumerate(self.ops):
                for r in op.writes:
                    if r.key not in values and op.fill:  # its old value is dead: fresh storage
                        values[r.key] = torch.empty(r.nbytes // r.dtype.itemsize, dtype=r.dtype)

                def real(x):
                    if not isinstance(x, _Ref):
                        return torch.device("cpu") if isinstance(x, torch.device) and x == META else x
                    if x.key not in values:
                        raise UsageError(f"meta init: {op.func} reads a tensor made outside the recorded build")
                    return values[x.key].as_strided(x.size, x.stride, x.offset)

                out = op.func(*tree_map(real, op.args), **tree_map(real, op.kwargs))
                produced = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                for r in op.outputs:
                    t = next(t for t in produced if tuple(t.size()) == r.size and tuple(t.stride()) == r.stride)
                    values[r.key] = t
                self.peak_bytes = max(self.peak_bytes, sum(v.untyped_storage().nbytes() for v in values.values()))
                for key in {r.key for r in _refs(op.args) + _refs(op.kwargs) + op.writes + op.outputs}:
                    position[key] += 1
                    later = uses[key][position[key]:]
                    if later and not later[0][1]:
                        continue  # read again before it is overwritten: keep it
                    if not later and key in self.finals:
                        for name, view in self.finals[key]:
                            write(name, values[key].as_strided(view.size, view.stride, view.offset))
                    values.pop(key, None)


def _refs(tree: Any) -> list[_Ref]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, _Ref)]


_PENDING: weakref.WeakKeyDictionary[nn.Module, InitLog] = weakref.WeakKeyDictionary()


def build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` run on the meta device (no storage), its init recorded for ``materialize``."""
    recorder = _Recorder()
    rng_state = torch.get_rng_state()
    with torch.device(META), _Constants(), recorder:
        model = build()
    log = InitLog(recorder.ops, rng_state)
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        log.finals.setdefault(_key(t), []).append((name, _Ref.of(t)))
    _PENDING[model] = log
    return model


def pending(model: nn.Module) -> bool:
    """Whether ``model`` was built by ``build_on_meta`` and not yet materialised."""
    return model in _PENDING


def wanted(cfg: Any, runtime: Any, loads_whole: bool = False) -> bool:
    """Whether a run builds on meta: a parallel run that splits its weights (FSDP, TP, or
    pipeline stages: a rank fills in its own stages' only), that does not load whole weights
    into the model before splitting it (``loads_whole``: a resume of an older tensor-parallel
    checkpoint on another layout, or an ``init_from`` LoRA checkpoint that ``finetune.parts_of``
    cannot split: a base tensor of its model is missing from its base), merged whole; a resume
    from ``dcp/`` or from one process's checkpoint, and an ``init_from`` of weights or of a LoRA
    checkpoint over them (or over another LoRA checkpoint), read each rank's part into the
    materialised model."""
    if not getattr(runtime, "parallel", False) or loads_whole:
        return False
    d = runtime.degrees
    return d.pp > 1 or d.dp_shard > 1 or d.tp > 1


def hand_over(built: nn.Module, holder: nn.Module) -> None:
    """The pending replay of ``built`` (a meta build) moves to ``holder``, a module made of some
    of its parts under the same names (a pipeline rank's stages): ``materialize(holder)``
    fills in those parts, and the draws of the rest are made and discarded."""
    if built in _PENDING:
        _PENDING[holder] = _PENDING.pop(built)


def materialize(model: nn.Module, device: torch.device | str, rows: Any = None) -> InitLog:
    """Storage for ``model``'s parameters and buffers on ``device`` (each rank's shards only), filled
    with the values the one-process build gives them. ``rows`` (a ``tensor.RowOrder``) reorders
    the fused weights tensor parallelism split. Returns the log (``peak_bytes``: the most the
    replay held whole at once)."""
    log = _PENDING.pop(model)
    tied: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(name)
    model.to_empty(device=device)  # meta -> real makes a new tensor per name: a tied table comes apart
    for first, *others in (names for names in tied.values() if len(names) > 1):
        for name in others:
            prefix, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(prefix), leaf, model.get_parameter(first))
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
    done: set[int] = set()

    @torch.no_grad()
    def write(name: str, value: torch.Tensor) -> None:
        target = targets.get(name)
        if target is None or id(target) in done:
            return  # a tied parameter already written, or one this rank does not hold
        done.add(id(target))
        if rows is not None:
            value = rows.to_sharded(name, value)
        if isinstance(target, DTensor):
            value = distribute_tensor(value.to(target.device), target.device_mesh, target.placements,
                                      src_data_rank=None).to_local()  # every rank drew it whole: keep this rank's slice
            target = target.to_local()
        target.copy_(value)

    log.replay(write)
    return log


__all__ = ["InitLog", "build_on_meta", "hand_over", "materialize", "pending", "wanted"]

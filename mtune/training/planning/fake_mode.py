"""The planner's dispatch: ``FakeTensorMode`` with a cheaper dispatch-cache key, and both dispatch modes without
dynamo's guard.

A plan dispatches tens of thousands of ops on fake tensors, nearly every one a hit in FakeTensorMode's dispatch
cache (the output's metadata stored per op and per input metadata). Building the key is most of a hit's cost: for
every fake tensor argument torch fills a ``TensorMetadata`` record (17 fields, three sparse checks) and flattens it
field by field through ``dataclasses.fields`` (torch 2.13, ``FakeTensorMode._prep_args_for_hash``).
:class:`PlannerFakeMode` keys an ordinary tensor argument (this mode's, strided, no symbolic sizes, no constant) by
one tuple of the same facts instead: dtype, sizes, strides, device, storage offset, storage bytes, requires_grad,
quantized, conjugate, negative and inference bits. The record's other fields follow from those (the memory format
from sizes and strides; layout, sparsity and sparse dims are fixed for a strided tensor), so two calls share a key
exactly when they share torch's key, and every hit returns what torch's own key would: the same outputs, the same
bytes (``tests/mtune/training/planning/test_fake_mode.py``). Any other argument is keyed by torch's code.

A hit then builds the output's fake tensor: torch enters generator-based context managers around the
``empty_strided`` (and again around a view's ``set_``) that makes it; :class:`PlannerFakeMode` enters the same guards
and sets the same flags directly, once (where there is no shape environment, as in a plan), and builds the same
tensor.

Every ``TorchDispatchMode`` subclass gets its ``__torch_dispatch__`` wrapped so that ``torch.compile`` does not trace
into it (``_should_skip_dynamo``): two more Python frames and two eval-frame switches per op and per mode, and a
plan dispatches each op through two modes (the byte tracker, then the fake mode), and every gradient's ``.device``
through the tracker. A plan that compiles nothing drops the wrapper (:class:`PlannerFakeMode`, and
:class:`PlanningTracker`, the tracker as a plan runs it); their dispatch is otherwise their base's. A plan of
compiled blocks (`Footprint.compiles`) keeps it, and its tracker sets ``ignore_compile_internals``: dynamo compiles
a block with the tracker on the stack (it refuses to under any other mode), the tracker sees none of the tracing,
and it counts the ops the compiled block runs (:func:`planning_modes`).
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._subclasses.meta_utils import is_sparse_any

from mtune.training.planning.tracker import TensorTracker

__all__ = ["PLANNED_BACKEND", "PlannerFakeMode", "PlanningModes", "PlanningTracker", "planner_fake_mode",
           "planning_modes"]

_TENSOR = object()
"""Marks a tensor's tuple in a key (no value torch's own flattening appends is this object)."""

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
"""Argument types keyed as torch keys them (their type, then the value), without a call into torch's code."""


class PlannerFakeMode(FakeTensorMode):
    """``FakeTensorMode`` whose dispatch-cache key costs less per tensor argument (see the module docstring)."""

    def _prep_args_for_hash(self, result, args, state, id_hashed_objects) -> None:
        if isinstance(args, (list, tuple, dict)):
            result.append(type(args))
            result.append(f"length_{len(args)}")
        if isinstance(args, dict):
            self._prep_args_for_hash(result, args.keys(), state, id_hashed_objects)
            self._prep_args_for_hash(result, args.values(), state, id_hashed_objects)
            return
        strided = torch.strided
        for arg in args:
            if (type(arg) is FakeTensor and arg.fake_mode is self and arg.constant is None
                    and arg.layout is strided and not arg._has_symbolic_sizes_strides):
                result.append((_TENSOR, arg.dtype, tuple(arg.shape), arg.stride(), arg.device, arg.storage_offset(),
                               arg.untyped_storage().nbytes(), arg.requires_grad, arg.is_quantized, arg.is_conj(),
                               arg.is_neg(), arg.is_inference()))
            elif type(arg) in _PLAIN:
                result.append(type(arg))
                result.append(arg)
            elif isinstance(arg, (list, tuple, dict)):
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:  # torch's own key for the rest (it raises to bypass the cache where it must)
                super()._prep_args_for_hash(result, (arg,), state, id_hashed_objects)

    def _get_output_tensor_from_cache_entry(self, state, entry, key, func, args):
        # torch's own steps for a new output without a shape environment (the planner's), less the generator-based
        # context managers around them: the same guards and flags, entered directly
        metadata = entry.metadata
        if self.shape_env is not None or metadata is None or entry.inplace_idx is not None or is_sparse_any(metadata):
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        outer = self.in_kernel_invocation
        # one guarded block for all of it: torch makes the view's set_ in a second one, and the conjugate / negative
        # bits and the storage lookup outside, but those are flag setters and a getter that dispatch nothing
        with torch._C._DisableTorchDispatch(), torch._C._PreserveDispatchKeyGuard():
            self.in_kernel_invocation = True
            torch._C._set_meta_in_tls_dispatch_include(True)
            try:
                empty = torch.empty_strided(metadata.shape, metadata.stride, dtype=metadata.dtype,
                                            layout=metadata.layout, device="meta",
                                            requires_grad=metadata.requires_grad)
                if metadata.is_conj:
                    torch._C._set_conj(empty, True)
                if metadata.is_neg:
                    torch._C._set_neg(empty, True)
                if isinstance(func, torch._ops.OpOverload) and func.is_view:  # a view shares its input's storage
                    empty.set_(args[entry.view_idx].untyped_storage(), metadata.storage_offset, metadata.shape,
                               metadata.stride)
            finally:
                self.in_kernel_invocation = outer
        return FakeTensor(self, empty, metadata.device)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing is compiled while planning: no guard around each op (see the module docstring)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # FakeTensorMode's own, less its call counter (torch.utils._stats) and dynamo's guard
        return self.dispatch(func, types, args, kwargs or {})


def planner_fake_mode(compiled: bool = False, **kwargs) -> FakeTensorMode:
    """A :class:`PlannerFakeMode` (:class:`CompilingPlannerFakeMode` for a plan of compiled blocks) where this torch
    has the private methods it overrides with the signature they were written against (torch 2.13's), else torch's
    own ``FakeTensorMode``: the same plans, planned slower. (mtune supports torch from 2.6, whose cache-key function
    takes other arguments.)"""
    key = getattr(FakeTensorMode, "_prep_args_for_hash", None)
    fits = (key is not None and hasattr(FakeTensorMode, "dispatch")
            and list(inspect.signature(key).parameters) == ["self", "result", "args", "state", "id_hashed_objects"])
    if not fits:
        return FakeTensorMode(**kwargs)
    return (CompilingPlannerFakeMode if compiled else PlannerFakeMode)(**kwargs)


class PlanningTracker(TensorTracker):
    """`TensorTracker` as a plan runs it: its dispatch without dynamo's guard (see the module docstring)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    # the tracker's own function, unwrapped (functools.wraps keeps it as __wrapped__; a torch that does not wrap it
    # leaves the function itself)
    __torch_dispatch__ = getattr(TensorTracker.__dict__["__torch_dispatch__"], "__wrapped__",
                                 TensorTracker.__dict__["__torch_dispatch__"])


class CompilingPlannerFakeMode(PlannerFakeMode):
    """:class:`PlannerFakeMode` with dynamo's guard around its dispatch, for a plan of compiled blocks."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # wrapped by TorchDispatchMode's subclass hook
        return self.dispatch(func, types, args, kwargs or {})


PLANNED_RECOMPILE_LIMIT = 4096
"""Dynamo's recompile limits while a plan of compiled blocks runs. Every plan builds a new model, and ``--fit`` plans
dozens of shapes in one process; each is a new entry in the cache of the one compiled code (``Module._call_impl``).
Past dynamo's default limit (8 per code) the blocks would run eagerly, unsaid, and be planned as eager ones."""


class CompilingPlanningTracker(TensorTracker):
    """`TensorTracker` as a plan of compiled blocks runs it: off while dynamo compiles, on for what compiled code
    runs (see the module docstring), and dynamo's recompile limits raised while it is entered."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __enter__(self):
        import torch._dynamo

        self._limits = torch._dynamo.config.patch(recompile_limit=PLANNED_RECOMPILE_LIMIT,
                                                  accumulated_recompile_limit=PLANNED_RECOMPILE_LIMIT)
        self._limits.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._limits.__exit__(*exc)


PLANNED_BACKEND = "aot_eager_decomp_partition"
"""How a plan compiles what the run compiles: Inductor's decompositions and min-cut partitioner, then the graphs run
as plain ops (no code generation), so the planned blocks save for backward what Inductor's save
(`tests/recipes/test_plan_compiled.py`, against Inductor on the CPU)."""


class PlanningModes(NamedTuple):
    """What a plan dispatches through: its fake mode (None: real tensors), its byte tracker's class, and whether
    the run compiles modules (`Footprint.compiles`)."""

    fake_mode: FakeTensorMode | None
    tracker: type[TensorTracker]
    compiled: bool = False

    def compile_as_planned(self, model: torch.nn.Module) -> None:
        """Every module of ``model`` the run compiles (``nn.Module.compile``), compiled for the plan instead with
        :data:`PLANNED_BACKEND`, at static shapes as a run's first compile."""
        if self.compiled:
            for module in model.modules():
                if getattr(module, "_compiled_call_impl", None) is not None:
                    module.compile(backend=PLANNED_BACKEND, dynamic=False)


def planning_modes(*, fake: bool, compiled: bool) -> PlanningModes:
    """The plan's modes: fake tensors or real ones (``fake``), compiled blocks or none (``compiled``)."""
    fake_mode = planner_fake_mode(compiled, allow_non_fake_inputs=True) if fake else None
    return PlanningModes(fake_mode, CompilingPlanningTracker if compiled else PlanningTracker, compiled)

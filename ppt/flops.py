"""Where a training step's compute goes: an analytic cost model derived from the model itself (docs/flops.md).

`cost(model, batch_size, seq_len, dtype, formulas)` runs one forward+backward on the meta device (shapes only) and
books every aten op's FLOPs and logical operand bytes (unfused, not measured traffic) by pass (primal, adjoint) and op
class (matmul, elementwise, reduction, selection). Nothing reads config fields, so an edited model.py is measured as
written: matmuls by torch.utils.flop_counter's formulas, SDPA as one fused flash op, a custom op by its formula in the
`OpFormulas` handed over (one without raises: it would count as zero). MFU follows nanochat/torchtitan (6N plus 3x the
forward FLOPs of activation-by-activation matmuls, no causal halving); the token mixer calls the trace lists feed
ppt/comparison_flops.py, and ppt/roofline.py sets the cost against a device.

Over 400 lines on purpose: the op tables, the dispatch mode that books every op by them and the routing of SDPA into
one fused op are one mechanism, read together.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, handle_torch_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.module_tracker import ModuleTracker
from torch.utils.weak import WeakIdKeyDictionary

from ppt.common import PPTError, warn0
from ppt.formatting import dtype_name, dtype_order, si, text_table

OP_CLASSES = ("matmul", "elementwise", "reduction", "selection")
PASSES = ("primal", "adjoint")
Row = tuple[str, str]  # (pass, op class)
OpKey = tuple[str, str, str, str, torch.dtype]  # (pass, op class, model part, aten op, dtype)

# ---------------------------------------------------------------------------------------------------------------------
# Op classification. Matmuls are the ops torch.utils.flop_counter has formulas for; views and metadata are free;
# torch tags most elementwise ops `pointwise` and most reductions `reduction`; the tables below cover the rest.

_FREE = {  # no data moves: allocation, metadata, aliasing
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view", "lift_fresh",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride", "numel", "dim", "is_contiguous",
    "_has_compatible_shallow_copy_type", "set_", "resize_", "_assert_async", "_assert_tensor_metadata",
}  # fmt: skip
_WRITES = {  # fills and random draws: they write their output and compute nothing worth counting
    "zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full", "fill",
    "fill_", "zero_", "scalar_tensor", "arange", "linspace", "logspace", "eye", "rand", "randn", "randint",
    "rand_like", "randn_like", "randint_like", "normal_", "uniform_", "bernoulli_", "random_", "exponential_",
}  # fmt: skip
_OVERWRITE_SELF = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_", "exponential_"}
_ELEMENTWISE = {  # untagged
    "native_dropout", "native_dropout_backward", "hardswish", "glu", "glu_backward", "log_sigmoid_forward",
    "log_sigmoid_backward",
}  # fmt: skip
_SELECTION = {  # move or pick elements: gathers, scatters, copies, concatenation, sorting
    "embedding", "embedding_dense_backward", "index_select", "gather", "index", "_unsafe_index", "take",
    "masked_select", "nonzero", "cat", "stack", "clone", "_to_copy", "copy", "copy_", "lift_fresh_copy", "repeat",
    "repeat_interleave", "constant_pad_nd", "flip", "roll", "tril", "triu", "slice_scatter", "select_scatter",
    "diagonal_scatter", "as_strided_scatter", "slice_backward", "select_backward", "index_put", "index_put_",
    "_index_put_impl_", "index_add", "index_add_", "scatter", "scatter_", "scatter_add", "scatter_add_",
    "scatter_reduce", "masked_scatter", "sort", "topk", "argsort", "searchsorted", "bucketize", "nll_loss_backward",
}  # fmt: skip
_ACCUMULATED_ARG = {  # scatter-adds do one add per accumulated element: the position of the argument holding them
    "embedding_dense_backward": 0, "index_add": 3, "index_add_": 3, "scatter_add": 3, "scatter_add_": 3,
    "scatter_reduce": 3, "index_put": 2, "index_put_": 2, "_index_put_impl_": 2,
}  # fmt: skip
# Fused reductions, as FLOPs per element of their first input: softmax is max, subtract, exp, sum, divide; its
# backward multiply, sum, subtract, multiply; layer norm mean, subtract, square, sum, scale, gain, bias; RMS norm
# square, sum, scale, gain; norm backwards about twice their forward. nll_loss gathers and sums one per target.
_REDUCTION_FLOPS_PER_ELEMENT = {
    "_softmax": 5, "_log_softmax": 5, "_safe_softmax": 5, "_softmax_backward_data": 4,
    "_log_softmax_backward_data": 4, "native_layer_norm": 7, "native_layer_norm_backward": 10,
    "_fused_rms_norm": 4, "_fused_rms_norm_backward": 8, "native_group_norm": 7, "native_batch_norm": 7,
    "cumsum": 1, "cumprod": 1, "cummax": 1, "cummin": 1, "logcumsumexp": 3, "mse_loss": 3,
    "binary_cross_entropy_with_logits": 5,
}  # fmt: skip
_PER_TARGET = {"nll_loss_forward", "nll_loss2d_forward"}


# matrix-vector and vector products torch's flop formulas lack: 2 FLOPs per element of the matrix (or vector) operand
_MATMUL_EXTRA = dict.fromkeys(
    ("mv", "addmv", "dot", "vdot"), lambda *args, **kw: 2 * max(t.numel() for t in _tensors(args))
)
_COPIES = {"clone", "_to_copy", "_unsafe_view", "alias", "detach"}  # ops that keep a zero-padded tensor's padding
_SHADOW_MAX = 4096  # parameter-derived tensors up to this size keep real values during the trace (see _Trace)


def _part(modules: set[str]) -> str:
    """The model part an op runs in: the innermost module, two levels deep, layer indices dropped (blocks.mlp)."""
    innermost = max(modules, key=len, default="")
    names = [n for n in innermost.split(".")[1:] if not n.isdigit()]  # [1:]: the root is the model's class name
    return ".".join(names[:2]) or "(top level)"


def _is_matmul(func: torch._ops.OpOverload) -> bool:
    return func.namespace == "aten" and (func.overloadpacket in flop_registry or func._opname in _MATMUL_EXTRA)


def _tags(func: torch._ops.OpOverload) -> list[torch.Tag]:
    """An op's tags; an in-place variant (mul_) carries its functional twin's (mul)."""
    if func._opname.endswith("_") and func.namespace == "aten":
        twin = getattr(getattr(torch.ops.aten, func._opname[:-1], None), func._overloadname, None)
        if twin is not None:
            return twin.tags
    return func.tags


def _tensors(tree: object) -> list[torch.Tensor]:
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _compute_dtype(inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> torch.dtype:
    """The dtype an op computes in: its first floating operand's, else its first tensor's."""
    return next((t.dtype for t in inputs + outputs if t.dtype.is_floating_point), (inputs + outputs)[0].dtype)


@dataclass(frozen=True)
class OpFormulas:
    """The formulas of a model's custom ops (ppt/model.py's OP_FORMULAS), keyed by op, op packet or "namespace::name"
    and called with the op's own arguments (small learned tensors holding real values). cost: {"flops": matmul FLOPs,
    "bytes": operand bytes} (or FLOPs per op class, by class name). pairs: one (forward FLOPs per needed pair, reach)
    per head of one row, reach being how many keys back a query needs at most (math.inf: its whole document prefix).
    """

    cost: Mapping[object, Callable[..., object]] = field(default_factory=dict)
    pairs: Mapping[object, Callable[..., object]] = field(default_factory=dict)


NO_FORMULAS = OpFormulas()  # a model without custom ops needs none


class MixerCall(NamedTuple):
    """One forward call of a token mixer, as the trace saw it; ppt/comparison_flops.py counts them."""

    op: str  # an aten or custom op, "scaled_dot_product_attention" or "declare_token_mixer"
    part: str  # the model part it ran in (see _part)
    flops_per_row: float  # its forward activation-by-activation matmul FLOPs
    heads: list[tuple[float, float]] | None  # per row, one (FLOPs per needed pair, reach) per head: None if unknown,
    # reach NaN if only the reach is (SDPA with a mask tensor)


def _checked_heads(source: str, heads: object) -> list[tuple[float, float]]:
    """A token mixer's heads, from a declaration or a pair formula, as floats; a PPTError names what is wrong."""
    try:
        checked = [(float(flops_per_pair), float(reach)) for flops_per_pair, reach in heads]
    except (TypeError, ValueError):
        checked = []
    if not checked or any(not (f > 0 and math.isfinite(f)) or not r >= 1 for f, r in checked):
        raise PPTError(
            f"{source} takes one (forward FLOPs per needed pair > 0, reach >= 1 or math.inf) per head, got {heads!r}"
        )
    return checked


# ---------------------------------------------------------------------------------------------------------------------
# The trace


class _Trace(TorchDispatchMode):
    """Sees every aten op of one forward+backward and books its FLOPs and bytes by (pass, op class, dtype). Tensors
    that depend on the batch (the token ids) are tagged: a matmul with a matrix operand that does not is a weight
    matmul (the N of 6N), one whose operands all do a token mixer call. Small parameter-derived tensors keep real
    values beside their meta twins ("shadows"), so a cost formula sees, say, a learned per-head window."""

    def __init__(self, params: list[torch.Tensor], shadows: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 autocast: torch.dtype | None, formulas: OpFormulas, rows: int) -> None:  # fmt: skip
        super().__init__()
        self.phase = "primal"
        self.autocast = autocast  # None: no mixed precision, every op runs in its operands' dtype
        self.formulas = formulas
        self.rows = rows  # rows of the traced batch: token mixers are described per row
        self._casts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # storage -> (its tensor, its cast copy)
        self.flops: dict[Row, Counter] = defaultdict(Counter)
        self.bytes: dict[Row, Counter] = defaultdict(Counter)
        self.weight_flops = 0.0  # forward FLOPs of matmuls with a batch-independent matrix operand
        self.attention_flops = 0.0  # forward FLOPs of matmuls whose matrix operands all depend on the batch
        self.unclassified: Counter = Counter()
        self.ops: dict[OpKey, list[float]] = defaultdict(lambda: [0.0, 0.0])  # FLOPs, bytes
        self.op_name = ""  # the op being booked
        self.modules = ModuleTracker()
        self.mixers: list[MixerCall] = []  # every token mixer call of the forward, in order
        self._params = {id(p): p for p in params}
        self._param_storages = {p.untyped_storage()._cdata for p in params}
        self.params_used: set[int] = set()
        self._batch_dependent = WeakIdKeyDictionary()
        # batch-independent tensors padded with zeros (F.pad of a weight: an aligned layout, not the architecture's
        # size): the fraction of their elements that are not padding, so that their matmuls count at the unpadded size
        self._unpadded_fraction = WeakIdKeyDictionary()
        self._shadow = WeakIdKeyDictionary(dict(shadows.values()))
        # what `replayed_mixers` runs again: the shadowed tensors' names, the ops computing shadows in order, and the
        # custom ops booked as token mixers (by index in `mixers`) with their arguments
        self._sources = {name: twin for name, (twin, _) in shadows.items()}
        self._shadow_ops: list[tuple] = []
        self._mixer_ops: dict[int, tuple] = {}

    def mark_batch(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self._batch_dependent[t] = True

    def autocasts(self, x: object) -> bool:
        """Whether autocast casts `x`: a floating tensor not already in the autocast dtype."""
        return isinstance(x, torch.Tensor) and self.autocast not in (None, x.dtype) and x.is_floating_point()

    def cast(self, x: object) -> object:
        """A matmul operand in the autocast dtype, as autocast casts it: a parameter once per step, an activation once
        per use, the backward reusing the forward's copies; booked as a selection (a read, then a write)."""
        if not self.autocasts(x):
            return x
        key = x.untyped_storage()._cdata  # by storage, so every view of a tensor finds its copy
        known = key in self._casts
        if not known:
            copy = torch.empty(x.untyped_storage().nbytes() // x.element_size(), dtype=self.autocast, device="meta")
            self._casts[key] = (x, copy)  # holding x keeps the storage, and so the key, alive
        cast_view = self._casts[key][1].as_strided(x.shape, x.stride(), x.storage_offset())
        if x in self._unpadded_fraction:
            self._unpadded_fraction[cast_view] = self._unpadded_fraction[x]
        if not known or (self.phase == "primal" and key not in self._param_storages):
            self.op_name = "_to_copy"
            self.record("selection", 0, x.dtype, [x, cast_view])
        if x in self._batch_dependent:
            self.mark_batch(cast_view)
        return cast_view

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN201 (torch's hook)
        kwargs = kwargs or {}
        # before the casts, which hand a matmul copies of its parameters (a Linear's bias among them)
        self.params_used.update(id(t) for t in _tensors((args, kwargs)) if id(t) in self._params)
        if _is_matmul(func):
            args, kwargs = tree_map(self.cast, (args, kwargs))
        out = func(*args, **kwargs)
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        if self.phase == "primal":
            self._propagate(func, args, kwargs, inputs, outputs)
        self._book(func, args, kwargs, out, inputs, outputs)
        return out

    def _propagate(self, func, args, kwargs, inputs, outputs) -> None:  # noqa: ANN001
        if any(t in self._batch_dependent for t in inputs):
            self.mark_batch(*outputs)
            return
        if func._opname == "constant_pad_nd" and (len(args) < 3 or args[2] == 0):
            fraction = self._unpadded_fraction.get(inputs[0], 1.0) * inputs[0].numel() / outputs[0].numel()
            self._unpadded_fraction[outputs[0]] = fraction
        elif len(inputs) == 1 and inputs[0] in self._unpadded_fraction and (func.is_view or func._opname in _COPIES):
            for t in outputs:
                self._unpadded_fraction[t] = self._unpadded_fraction[inputs[0]]
        if inputs and all(t in self._shadow for t in inputs) and all(t.numel() <= _SHADOW_MAX for t in outputs):
            self._shadow_ops.append((func, args, kwargs, outputs))
            self._compute_shadows(func, args, kwargs, outputs)

    def _compute_shadows(self, func, args, kwargs, outputs) -> None:  # noqa: ANN001
        to_cpu = lambda x: torch.device("cpu") if isinstance(x, torch.device) else x
        try:
            real = func(*self._real(args), **tree_map(to_cpu, self._real(kwargs)))
        except Exception:  # shadows only refine formulas; an op that will not replay just ends them
            return
        for meta_t, real_t in zip(outputs, _tensors(real)):
            self._shadow[meta_t] = real_t

    def _real(self, tree: object) -> object:
        """`tree` with every tensor that has a shadow replaced by its shadow: real values where they are known."""
        return tree_map(lambda x: self._shadow.get(x, x) if isinstance(x, torch.Tensor) else x, tree)

    def book_mixer(self, flops: float, heads: list[tuple[float, float]] | None = None) -> None:
        """A token mixer's forward call in the running op's model part: its activation-by-activation matmul FLOPs
        (whole batch; the MFU attention term) and, where known, its heads as a MixerCall gives them."""
        self.attention_flops += flops
        self.mixers.append(MixerCall(self.op_name, _part(self.modules.parents), flops / self.rows, heads))

    def record(self, op_class: str, flops: float, dtype: torch.dtype, operands: list[torch.Tensor],
               total_bytes: float | None = None) -> None:  # fmt: skip
        row = (self.phase, op_class)
        self.flops[row][dtype] += flops
        booked = self.ops[(*row, _part(self.modules.parents), self.op_name, dtype)]
        booked[0] += flops
        if total_bytes is not None:
            self.bytes[row][dtype] += total_bytes
            booked[1] += total_bytes
        for t in operands:  # broadcast (stride-0) dimensions hold one copy of the data
            nbytes = math.prod(size for size, stride in zip(t.shape, t.stride()) if stride != 0) * t.element_size()
            self.bytes[row][t.dtype] += nbytes
            booked[1] += nbytes

    def _book(self, func, args, kwargs, out, inputs, outputs) -> None:  # noqa: ANN001
        name = self.op_name = func._opname
        if func.namespace not in ("aten", "prims"):
            self._book_custom(func, args, kwargs, out, inputs, outputs)
            return
        if name in _FREE or func.is_view or not (inputs or outputs):
            return
        reads = inputs[1:] if name in _OVERWRITE_SELF else inputs
        operands, dtype = reads + outputs, _compute_dtype(inputs, outputs)
        if _is_matmul(func):
            formula = flop_registry.get(func.overloadpacket) or _MATMUL_EXTRA[name]
            flops = formula(*args, **kwargs, out_val=out)
            if self._mixes(flops, inputs):  # activation by activation: q.k, p.v of an einsum
                self.book_mixer(flops)
            self.record("matmul", flops, dtype, operands)
        elif name in _SELECTION:
            self.record("selection", self._accumulated(name, args, kwargs), dtype, operands)
        elif name in _REDUCTION_FLOPS_PER_ELEMENT:
            self.record("reduction", _REDUCTION_FLOPS_PER_ELEMENT[name] * inputs[0].numel(), dtype, operands)
        elif name in _PER_TARGET:
            self.record("reduction", inputs[1].numel(), dtype, operands)
        elif torch.Tag.reduction in _tags(func):
            self.record("reduction", inputs[0].numel(), dtype, operands)
        elif torch.Tag.pointwise in _tags(func) or name in _ELEMENTWISE:
            self.record("elementwise", outputs[0].numel() if outputs else 0, dtype, operands)
        elif name in _WRITES:
            self.record("elementwise", 0, dtype, operands)
        else:  # not silently zero: one FLOP per output element, and the op is listed in the cost report
            self.unclassified[str(func.overloadpacket)] += 1
            self.record("elementwise", sum(t.numel() for t in outputs), dtype, operands)

    def _mixes(self, flops: float, inputs: list[torch.Tensor]) -> bool:
        """Whether forward matmul FLOPs mix tokens (every matrix operand depends on the batch); weight FLOPs (a matrix
        operand that does not) are booked here."""
        if self.phase != "primal":
            return False
        weights = [t for t in inputs if t.dtype.is_floating_point and t.dim() >= 2 and t not in self._batch_dependent]
        if weights:
            self.weight_flops += flops * min(self._unpadded_fraction.get(t, 1.0) for t in weights)
            return False
        return bool(flops)

    @staticmethod
    def _accumulated(name: str, args: tuple, kwargs: dict) -> int:
        """One add per element a scatter-add accumulates; plain gathers, scatters and copies compute nothing."""
        if name not in _ACCUMULATED_ARG:
            return 0
        if name.startswith(("index_put", "_index_put")) and not kwargs.get("accumulate", len(args) > 3 and args[3]):
            return 0  # a put that overwrites
        return args[_ACCUMULATED_ARG[name]].numel()

    def _book_custom(self, func, args, kwargs, out, inputs, outputs) -> None:  # noqa: ANN001
        dtype = _compute_dtype(inputs, outputs)
        flops, total_bytes = self._custom_cost(func, args, kwargs, out)
        mixes = self._mixes(flops.get("matmul", 0), inputs)
        heads = self._heads(func, args, kwargs) if self.phase == "primal" else None
        if mixes or heads is not None:
            self._mixer_ops[len(self.mixers)] = (func, args, kwargs, out, mixes)
            self.book_mixer(flops.get("matmul", 0) if mixes else 0.0, heads)
        main_class = max(flops, key=flops.get)  # operand bytes go with the class that does most of the work
        for op_class, n in flops.items():
            if op_class == main_class:
                self.record(op_class, n, dtype, [] if total_bytes is not None else inputs + outputs, total_bytes)
            else:
                self.record(op_class, n, dtype, [])

    def _custom_cost(self, func, args, kwargs, out) -> tuple[dict[str, float], float | None]:  # noqa: ANN001
        result = self._apply(self.formulas.cost, func, args, kwargs)
        if result is not None:
            return _parse_formula_result(func, result)
        if func.overloadpacket in flop_registry:
            return {"matmul": flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)}, None
        raise PPTError(
            f"custom op {func.name()} has no cost formula, so its work would count as zero: add "
            f"`torch.ops.{func.namespace}.{func._opname}: its_cost` to the cost formulas of OP_FORMULAS in "
            "ppt/model.py, its_cost(*op_args) returning {'flops': ..., 'bytes': ...} (docs/flops.md)"
        )

    def _heads(self, func, args, kwargs) -> list[tuple[float, float]] | None:  # noqa: ANN001
        heads = self._apply(self.formulas.pairs, func, args, kwargs)
        return None if heads is None else _checked_heads(f"the pair formula of {func.name()}", heads)

    def replayed_mixers(self, model: nn.Module) -> list[MixerCall]:
        """`mixers` for the traced model's current values (after training steps, say): the ops that computed shadows
        and the custom mixers' formulas run again on them, without tracing the forward. The same as a new trace for a
        forward whose ops depend on nothing but its parameters, buffers and inputs."""
        tensors = _named_tensors(model)
        used = {id(t) for op in self._shadow_ops + list(self._mixer_ops.values()) for t in _tensors(op[1:3])}
        self._shadow = WeakIdKeyDictionary(
            {twin: tensors[name].detach().cpu() for name, twin in self._sources.items() if id(twin) in used}
        )
        for op in self._shadow_ops:
            self._compute_shadows(*op)
        mixers = list(self.mixers)
        for index, (func, args, kwargs, out, mixes) in self._mixer_ops.items():
            flops = self._custom_cost(func, args, kwargs, out)[0].get("matmul", 0) if mixes else 0.0
            heads = self._heads(func, args, kwargs)
            mixers[index] = mixers[index]._replace(flops_per_row=flops / self.rows, heads=heads)
        return mixers

    def _apply(self, formulas: Mapping[object, Callable[..., object]], func, args, kwargs) -> object:  # noqa: ANN001
        """What the formula for a custom op (under the op, its packet or its "namespace::name") gives for this call,
        with real values where known; None where there is no formula."""
        formula = formulas.get(func) or formulas.get(func.overloadpacket) or formulas.get(func.name())
        return None if formula is None else formula(*self._real(args), **self._real(kwargs))


def _parse_formula_result(func: object, result: object) -> tuple[dict[str, float], float | None]:
    if not isinstance(result, dict) or not (set(result) & {"flops", *OP_CLASSES}):
        raise PPTError(f"the cost formula of {func} must return a dict with 'flops', got {result!r}")
    flops = {c: float(result[c]) for c in OP_CLASSES if c in result}
    if "flops" in result:
        flops["matmul"] = flops.get("matmul", 0.0) + float(result["flops"])
    return flops, (float(result["bytes"]) if "bytes" in result else None)


def _as_bhtd(shape: torch.Size) -> tuple[int, int, int, int]:
    """SDPA shapes as (batch, heads, tokens, dim): leading dimensions fold into the batch."""
    *lead, h, t, d = (1, 1, *shape) if len(shape) < 4 else tuple(shape)
    return math.prod(lead), h, t, d


def _gqa_shapes(q: torch.Size, k: torch.Size, v: torch.Size) -> list[tuple[int, int, int, int]]:
    """With grouped-query attention every query head still does a full score and value matmul: count K and V at
    the query's head count (older torch flop formulas reject unequal head counts)."""
    (b, h, t, d), (_, _, tk, dk), (_, _, _, dv) = _as_bhtd(q), _as_bhtd(k), _as_bhtd(v)
    return [(b, h, t, d), (b, h, tk, dk), (b, h, tk, dv)]


class _FusedAttention(torch.autograd.Function):
    """SDPA as one traced op with flash attention's costs. On meta, SDPA would run its math path instead: T x T
    scores in memory, many small ops, and a backward that FlopCounterMode does not count the way the GPU runs it."""

    @staticmethod
    def forward(ctx, trace: _Trace, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,  # noqa: ANN001, ANN205
                is_causal: bool):  # fmt: skip
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)  # the row log-sum-exp flash saves for its backward
        flops = sdpa_flop_count(*_gqa_shapes(q.shape, k.shape, v.shape))
        operands = [t for t in (q, k, v, mask) if t is not None]
        trace.op_name = "scaled_dot_product_attention"
        # every query head does its own q.k and p.v, over the causal prefix or over the pairs a mask tensor keeps,
        # which cannot be read on meta (reach NaN: unknown)
        b, h, _, d = _as_bhtd(q.shape)
        reach = math.inf if is_causal and mask is None else math.nan
        trace.book_mixer(flops, [(2.0 * (d + v.shape[-1]), reach)] * (b * h // trace.rows))
        trace.record("matmul", flops, q.dtype, operands + [out, lse])
        ctx.trace = trace
        ctx.save_for_backward(q, k, v, out, lse, *operands[3:])
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # noqa: ANN001, ANN205
        q, k, v, out, lse, *mask = ctx.saved_tensors
        grads = [torch.empty_like(t) for t in (q, k, v)]
        mask_grad = torch.empty_like(mask[0]) if mask and ctx.needs_input_grad[4] else None
        shapes = (_as_bhtd(grad_out.shape), *_gqa_shapes(q.shape, k.shape, v.shape))
        written = grads + ([mask_grad] if mask_grad is not None else [])
        ctx.trace.op_name = "scaled_dot_product_attention_backward"
        ctx.trace.record(
            "matmul", sdpa_backward_flop_count(*shapes), q.dtype, [grad_out, q, k, v, out, lse, *mask] + written
        )
        return None, *grads, mask_grad, None


class _RouteMixers(TorchFunctionMode):
    """SDPA into one fused op, and declare_token_mixer's calls into the trace's list of mixers."""

    def __init__(self, trace: _Trace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN201 (torch's hook)
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _sdpa(self.trace, *args, **kwargs)
        if func is declare_token_mixer:
            self.trace.op_name = "declare_token_mixer"
            return self.trace.book_mixer(0.0, _checked_heads("declare_token_mixer", *args, **kwargs))
        return func(*args, **kwargs)


def _sdpa(trace: _Trace, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
          *args: object, **kwargs: object) -> torch.Tensor:  # fmt: skip
    """Autocast casts SDPA's inputs above autograd, so the casts and their gradients are traced ops."""
    query, key, value = (t.to(trace.autocast) if trace.autocasts(t) else t for t in (query, key, value))
    return _FusedAttention.apply(trace, query, key, value, attn_mask, is_causal)


# ---------------------------------------------------------------------------------------------------------------------
# The cost of one step


@dataclass
class Cost:
    """FLOPs and logical operand bytes of one forward+backward of `batch_size` rows of `seq_len` tokens."""

    params: int  # every parameter, each shared tensor once
    params_active: int  # parameters the step reads
    params_matmul: int  # the N of 6N: forward FLOPs of weight matmuls / (2 * tokens); a tied head counts once
    batch_size: int
    seq_len: int
    flops: dict[Row, dict[torch.dtype, float]]
    bytes: dict[Row, dict[torch.dtype, float]]
    attention_flops: float  # forward FLOPs of activation-by-activation matmuls (SDPA, custom mixers), whole batch
    unclassified: dict[str, int] = field(default_factory=dict)  # aten ops counted as elementwise by default
    ops: dict[OpKey, tuple[float, float]] = field(default_factory=dict)  # FLOPs and bytes of each kind of op

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def flops_per_token_6n(self) -> float:
        return 6 * self.params_matmul

    @property
    def attention_flops_per_token(self) -> float:
        """Forward plus the two backward matmuls of each activation matmul: 12*L*H*Q*T for SDPA layers."""
        return 3 * self.attention_flops / self.tokens

    @property
    def flops_per_token(self) -> float:
        """The MFU convention (nanochat/torchtitan): 6N plus attention, no causal halving."""
        return self.flops_per_token_6n + self.attention_flops_per_token

    def rows(self) -> list[Row]:
        return [(p, c) for p in PASSES for c in OP_CLASSES if (p, c) in self.flops or (p, c) in self.bytes]

    def dtypes(self, of: str) -> list[torch.dtype]:
        """The dtypes that carry any FLOPs (of="flops") or bytes (of="bytes"), in a stable order."""
        found = {d for cell in getattr(self, of).values() for d, n in cell.items() if n}
        return sorted(found, key=dtype_order)

    def total(self, of: str, dtype: torch.dtype) -> float:
        return sum(cell.get(dtype, 0) for cell in getattr(self, of).values())

    def intensity(self, row: Row | None, dtype: torch.dtype) -> float | None:
        """FLOPs per byte of one dtype in a row (None: the whole step); None where there are no FLOPs or bytes."""
        flops = self.flops.get(row, {}).get(dtype, 0) if row else self.total("flops", dtype)
        nbytes = self.bytes.get(row, {}).get(dtype, 0) if row else self.total("bytes", dtype)
        return flops / nbytes if flops and nbytes else None

    def summary(self) -> dict[str, dict[str, float]]:
        """Per-token FLOPs and bytes of each (pass, op class) row, all dtypes together: the run manifest's table."""
        return {
            " ".join(row): {
                "flops": sum(self.flops.get(row, {}).values()) / self.tokens,
                "bytes": sum(self.bytes.get(row, {}).values()) / self.tokens,
            }
            for row in self.rows()
        }

    def __str__(self) -> str:
        flop_dtypes, byte_dtypes = self.dtypes("flops"), self.dtypes("bytes")
        float_dtypes = [d for d in flop_dtypes if d.is_floating_point]  # index arithmetic gets no intensity column
        header = [["flops"] * len(flop_dtypes) + ["bytes"] * len(byte_dtypes) + ["intensity"] * len(float_dtypes)]
        header.append([dtype_name(d) for d in flop_dtypes + byte_dtypes + float_dtypes])
        body = []
        for row in [*self.rows(), None]:
            flops = self.flops.get(row, {}) if row else {d: self.total("flops", d) for d in flop_dtypes}
            nbytes = self.bytes.get(row, {}) if row else {d: self.total("bytes", d) for d in byte_dtypes}
            cells = [si(flops.get(d, 0)) for d in flop_dtypes] + [si(nbytes.get(d, 0)) for d in byte_dtypes]
            cells += [si(self.intensity(row, d) or 0) for d in float_dtypes]
            body.append((" ".join(row) if row else "total", cells))
        lines = [
            f"Cost(params={self.params}, params_active={self.params_active}, params_matmul={self.params_matmul}, "
            f"batch_size={self.batch_size}, seq_len={self.seq_len})",
            text_table(header, body),
        ]
        if self.unclassified:
            listed = ", ".join(f"{op} x{n}" for op, n in sorted(self.unclassified.items()))
            lines.append(f"WARNING: ops without a class, counted as elementwise at 1 FLOP per output: {listed}")
        return "\n".join(lines)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module under torch.compile's and DDP's wrappers: their parameters are the inner module's."""
    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def declare_token_mixer(heads: list[tuple[float, float]]) -> None:
    """For the comparison-FLOPs rule, in a token mixer module's forward, once a call: the pairs it needs per row, one
    (forward FLOPs per needed pair, reach) per head as a pair formula gives them (reach math.inf for the whole prefix,
    the window, or 1 for a cost per query that does not grow with the prefix; docs/flops.md). The module part's other
    matmuls between activations then count for MFU only. Outside the trace it does nothing (no graph break)."""
    if torch._C._is_torch_function_mode_enabled():
        handle_torch_function(declare_token_mixer, (), heads)


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """A model's parameters and buffers by name: what a trace shadows and a replay reads again."""
    return dict(model.named_parameters()) | dict(model.named_buffers())


def traced_step(model: nn.Module, batch_size: int, seq_len: int, dtype: torch.dtype, backward: bool,
                formulas: OpFormulas) -> _Trace:  # fmt: skip
    """Run `model` on meta twins of its tensors under a _Trace: the forward, and the backward when asked."""
    originals = _named_tensors(model)
    twins = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in originals.items()}
    twins |= {name: nn.Parameter(twins[name], requires_grad=p.requires_grad) for name, p in model.named_parameters()}
    shadows = {
        name: (twins[name], t.detach().cpu())
        for name, t in originals.items()
        if t.device.type != "meta" and t.numel() <= _SHADOW_MAX
    }
    params = [twins[name] for name, _ in model.named_parameters()]
    trace = _Trace(params, shadows, dtype if dtype.itemsize < 4 else None, formulas, rows=batch_size)
    idx = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    targets = torch.zeros_like(idx)
    trace.mark_batch(idx, targets)
    with torch.enable_grad(), trace.modules, _RouteMixers(trace), trace:
        try:
            loss = torch.func.functional_call(model, twins, (idx,), {"targets": targets})
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise PPTError("model(idx, targets) must return the scalar loss (SPEC.md, the model contract)")
            if backward:
                trace.phase = "adjoint"
                loss.backward()
        except PPTError:
            raise
        except Exception as exc:
            raise PPTError(
                f"tracing {type(model).__name__} on the meta device failed ({type(exc).__name__}: {exc}); ppt.flops "
                "runs the model on meta tensors, so keep forward free of value-dependent code (.item(), "
                "data-dependent shapes)"
            ) from exc
    return trace


def cost(model: nn.Module, batch_size: int, seq_len: int, dtype: torch.dtype = torch.bfloat16,
         formulas: OpFormulas = NO_FORMULAS, trace: _Trace | None = None) -> Cost:  # fmt: skip
    """Trace one training step of `model` (loss = model(idx, targets); loss.backward()) on meta twins of its tensors,
    the model untouched (or read `trace`, traced_step's of that step). Under autocast to a 16-bit `dtype` (fp32: none)
    matmuls and SDPA cast their operands (each tensor once, booked as a copy); other ops run in whatever dtype
    reaches them. `formulas` count the custom ops."""
    model = unwrap_model(model)
    trace = trace or traced_step(model, batch_size, seq_len, dtype, backward=True, formulas=formulas)
    if trace.unclassified:
        warn0(f"ppt.flops: counted ops without a class as elementwise: {', '.join(sorted(trace.unclassified))}")
    return Cost(
        params=sum(p.numel() for p in model.parameters()),
        params_active=sum(p.numel() for p in trace._params.values() if id(p) in trace.params_used),
        params_matmul=round(trace.weight_flops / (2 * batch_size * seq_len)),
        batch_size=batch_size,
        seq_len=seq_len,
        flops={row: dict(cell) for row, cell in trace.flops.items()},
        bytes={row: dict(cell) for row, cell in trace.bytes.items()},
        attention_flops=trace.attention_flops,
        unclassified=dict(trace.unclassified),
        ops={key: tuple(booked) for key, booked in trace.ops.items()},
    )


def mfu_flops_per_token(model: nn.Module, seq_len: int, formulas: OpFormulas = NO_FORMULAS,
                        trace: _Trace | None = None) -> dict[str, float]:  # fmt: skip
    """Training FLOPs per token, traced once (or read off `trace`, traced_step's of one bf16 row and its backward):
    {"mfu": 6N + attention, "6n", "attention", "params_matmul": N, "per_token": FLOPs and bytes per token by pass
    and op class}."""
    step = cost(model, batch_size=1, seq_len=seq_len, formulas=formulas, trace=trace)
    return {
        "mfu": step.flops_per_token,
        "6n": step.flops_per_token_6n,
        "attention": step.attention_flops_per_token,
        "params_matmul": step.params_matmul,
        "per_token": step.summary(),
    }

"""The classifier's linear layers split across hosts, exactly (Krizhevsky 2014, "One weird
trick for parallelizing convolutional neural networks", arXiv:1404.5997).

AlexNet's and VGG16's classifiers are 96 % and 89 % of their parameters; averaging their
gradients is what makes a second host on a 1-10 Gbit/s link slower than one. Split
instead, each host holds 1/H of them and only activations cross the network:

- the features of every host's samples are gathered everywhere, with their labels and
  dropout keys in the same message (`GatherRows`);
- the first linear layer is split by output (column-parallel: host h computes outputs
  [a_h, b_h) for every sample of the global batch);
- the element-wise layers after it work on that slice; a dropout draws the whole row's
  mask of each sample and keeps the slice (`SlicedDropout`), so a sample's mask does not
  depend on which host holds which slice;
- the second linear layer is split by input (row-parallel: host h multiplies its slice by
  the matching columns of the weight) and the partial products are summed over hosts
  (`SumOverHosts`): every host then has the full activation;
- the layers after that (the last linear layer, 4096 x classes) are replicated: every
  host computes the same thing on the same values, so their gradients agree without
  being sent.

Backward reverses it: the sum's gradient is the upstream gradient on every host, and the
gradient of the gathered features is summed over hosts and cut back into each host's rows
(a reduce-scatter). The pair column/row is Megatron-LM's split of a transformer's MLP.
Per host and step this moves 2(H-1)/H x B x (features + hidden) floats, against the whole
classifier's gradient for data parallelism (see `traffic_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from hybriddl.data.sharding import split_bounds
from hybriddl.dropout import KeyedDropout, current_keys, keyed_dropout

# Layers that act on each value alone: a slice of their input gives the slice of their output.
ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.Hardswish, nn.GELU, nn.SiLU, nn.Tanh, nn.Identity,
               nn.Dropout)


class NotSplittable(ValueError):
    """The model has no classifier this module can split (the message says why)."""


@dataclass(frozen=True)
class LinearSplit:
    """How one linear layer of the classifier is held: 'column' (a slice of its outputs),
    'row' (a slice of its inputs) or 'replicated' (whole, on every host)."""

    index: int  # position in the classifier
    kind: str
    in_features: int
    out_features: int

    @property
    def width(self) -> int:
        """The dimension that is cut: outputs for column, inputs for row."""
        return self.out_features if self.kind == "column" else self.in_features


def plan(classifier: nn.Module) -> list[LinearSplit]:
    """How each linear layer of `classifier` is split; NotSplittable when it cannot be."""
    if not isinstance(classifier, nn.Sequential):
        raise NotSplittable(f"its classifier is a {type(classifier).__name__}, not a sequence "
                            "of layers")
    layers = list(classifier)
    linears = [i for i, layer in enumerate(layers) if type(layer) in (nn.Linear,) or
               isinstance(layer, nn.Linear)]
    for layer in layers:
        if not isinstance(layer, (nn.Linear, *ELEMENTWISE)):
            raise NotSplittable(f"its classifier holds a {type(layer).__name__}, which is "
                                "neither linear nor element-wise")
    splits, sliced = [], False
    for n, i in enumerate(linears):
        layer = layers[i]
        if sliced:
            kind, sliced = "row", False
        elif n + 1 < len(linears):
            kind, sliced = "column", True
        else:
            kind = "replicated"
        splits.append(LinearSplit(i, kind, layer.in_features, layer.out_features))
    if not any(s.kind == "column" for s in splits):
        raise NotSplittable(f"its classifier has {len(linears)} linear layer(s): a split needs "
                            "two in a row")
    return splits


def slice_bounds(width: int, hosts: int, rank: int) -> tuple[int, int]:
    """Host `rank`'s [start, stop) of a layer dimension of `width` (even shares)."""
    return split_bounds(width, [1.0] * hosts)[rank]


def slice_counts(width: int, hosts: int) -> list[int]:
    return [b - a for a, b in split_bounds(width, [1.0] * hosts)]


class GatherRows(torch.autograd.Function):
    """Forward: every host's rows (its samples), in rank order, and with them every host's
    `tags` (int64 rows: labels, dropout keys), in one exchange. Backward: the sum over hosts
    of the gradient of those rows, this host's part (a reduce-scatter).

    `wire_dtype` (--feature-dtype bfloat16): the rows and their gradient cross the wire in
    that 2-byte dtype, half the bytes, and come back in the rows' own; None: bit for bit."""

    @staticmethod
    def forward(ctx, rows, hosts, counts, tags, wire_dtype=None, returned=None):
        ctx.hosts, ctx.counts, ctx.wire_dtype, ctx.returned = hosts, counts, wire_dtype, returned
        wire = rows.detach() if wire_dtype is None else rows.detach().to(wire_dtype)
        width = wire.shape[1] * wire.element_size()
        # One message of bytes per row: the float rows, then the tags, bit for bit.
        packed = torch.cat([wire.contiguous().view(torch.uint8),
                            tags.contiguous().view(torch.uint8)], 1)
        whole = hosts.allgather_rows(packed, counts)
        everyone = whole[:, width:].contiguous().view(torch.int64)
        ctx.mark_non_differentiable(everyone)
        return whole[:, :width].contiguous().view(wire.dtype).to(rows.dtype), everyone

    @staticmethod
    def backward(ctx, grad, _):
        if ctx.returned is not None:  # started here, waited for by whoever holds `returned`
            wire = grad if ctx.wire_dtype is None else grad.to(ctx.wire_dtype)
            ctx.returned.start(ctx.hosts.start_reduce_scatter_rows(wire, ctx.counts), grad)
            return None, None, None, None, None, None
        if ctx.wire_dtype is None:
            return ctx.hosts.reduce_scatter_rows(grad, ctx.counts), None, None, None, None, None
        part = ctx.hosts.reduce_scatter_half_rows(grad.to(ctx.wire_dtype), ctx.counts)
        return part.to(grad.device, grad.dtype), None, None, None, None, None


class ReturnedGradient:
    """The gathered rows' gradient on its way back: given to `GatherRows`, whose backward
    starts the reduce-scatter and returns without waiting for it, so that the first
    linear layer's weight gradient (`ColumnLinear.weight_gradients`) is computed while
    it crosses the wire. `result()`: this host's rows, summed over hosts, in the rows' dtype
    and on their device."""

    def __init__(self):
        self._exchange, self._like = None, None

    def start(self, exchange, like: torch.Tensor) -> None:
        self._exchange, self._like = exchange, like

    def result(self) -> torch.Tensor:
        if self._exchange is None:
            raise RuntimeError("the gathered rows' backward has not run: nothing was returned")
        part, self._exchange = self._exchange.result(), None
        return part.to(self._like.device, self._like.dtype)


class SumOverHosts(torch.autograd.Function):
    """Forward: the sum over hosts of each host's partial product. Backward: every host's
    upstream gradient is the whole sum's (the loss is the same on every host), so it is
    the gradient of its own partial product as it is."""

    @staticmethod
    def forward(ctx, partial, hosts):
        return hosts.allreduce_sum(partial)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class DeferredWeightGradients(nn.Module):
    """A split linear layer whose backward can return its input's gradient only, and leave
    what its weight's (and, `bias_deferred`, its bias's) gradient needs here until
    `weight_gradients`: the input's gradient is what the other hosts wait for."""

    bias_deferred = True

    def __init__(self):
        super().__init__()
        # A list from `defer_weight_gradients` to `weight_gradients`: backward leaves what
        # the weight's and bias's gradients need here, and returns only the input's.
        self.deferred: list | None = None

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.deferred is None or not torch.is_grad_enabled():
            return F.linear(x, self.weight, bias)
        return _InputGradientFirst.apply(x, self.weight, bias, self)

    def defer_weight_gradients(self) -> None:
        """Until `weight_gradients`, backward returns the input's gradient only."""
        self.deferred = []

    def weight_gradients(self) -> None:
        """The weight's and bias's gradients of the backward passes since
        `defer_weight_gradients`, added into their .grad as autograd would; backward
        computes them itself again from now on."""
        deferred, self.deferred = self.deferred or [], None
        for grad, x, (enabled, dtype) in deferred:
            with torch.no_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=enabled):
                weight = grad.t().matmul(x)
            _accumulate(self.weight, weight)
            if self.bias is not None and self.bias_deferred:
                _accumulate(self.bias, grad.sum(0))


class ColumnLinear(DeferredWeightGradients):
    """Outputs [start, stop) of a linear layer: those rows of its weight and bias."""

    def __init__(self, linear: nn.Linear, start: int, stop: int):
        super().__init__()
        self.start, self.stop, self.full_out = start, stop, linear.out_features
        self.in_features, self.out_features = linear.in_features, stop - start
        self.weight = nn.Parameter(linear.weight.detach()[start:stop].clone())
        self.bias = None if linear.bias is None else \
            nn.Parameter(linear.bias.detach()[start:stop].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)

    def extra_repr(self) -> str:
        return f"outputs [{self.start}, {self.stop}) of {self.full_out}, in={self.in_features}"


class _InputGradientFirst(torch.autograd.Function):
    """F.linear whose backward computes its input's gradient only, and leaves what its
    weight's needs with the layer (DeferredWeightGradients.weight_gradients): the input's
    gradient is what the other hosts wait for."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        # bf16 autocast (run_forward): backward runs after it ended, in the same numerics.
        ctx.autocast = (torch.is_autocast_enabled(x.device.type),
                        torch.get_autocast_dtype(x.device.type))
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        with torch.autocast(x.device.type, dtype=dtype, enabled=enabled):
            grad_x = grad.matmul(weight)
        ctx.layer.deferred.append((grad, x, ctx.autocast))
        return grad_x.to(x.dtype), None, None, None


def _accumulate(parameter: nn.Parameter, grad: torch.Tensor) -> None:
    grad = grad.to(parameter.dtype)
    if parameter.grad is None:
        parameter.grad = grad.contiguous()
    else:
        parameter.grad.add_(grad)


class RowLinear(DeferredWeightGradients):
    """A linear layer fed a slice [start, stop) of its inputs: those columns of its weight;
    the partial products are summed over hosts, then the (replicated) bias is added (its
    gradient autograd's: only the weight's is deferred)."""

    bias_deferred = False

    def __init__(self, linear: nn.Linear, start: int, stop: int, hosts):
        super().__init__()
        self.start, self.stop, self.full_in = start, stop, linear.in_features
        self.in_features, self.out_features = stop - start, linear.out_features
        self.hosts = hosts
        self.weight = nn.Parameter(linear.weight.detach()[:, start:stop].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = SumOverHosts.apply(self._linear(x, None), self.hosts)
        return total if self.bias is None else total + self.bias

    def extra_repr(self) -> str:
        return f"inputs [{self.start}, {self.stop}) of {self.full_in}, out={self.out_features}"


class SlicedDropout(KeyedDropout):
    """KeyedDropout on columns [start, stop) of a layer `width` wide: each sample's mask is
    the whole row's columns [start, stop), so it is the mask one host holding the whole
    layer would draw."""

    def __init__(self, dropout: nn.Dropout, width: int, start: int, stop: int):
        super().__init__(dropout.p, getattr(dropout, "layer", 0))
        self.width, self.start, self.stop = width, start, stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = current_keys()
        if not self.training or self.p == 0.0 or keys is None:
            return super().forward(x)
        # The mask is a function of each element's index: draw only this host's columns.
        return keyed_dropout(x, keys, self.layer, self.p, self.start)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, columns [{self.start}, {self.stop}) of {self.width}"


@dataclass
class SplitClassifier:
    """The classifier of one model, split across hosts in place (see `split_classifier`)."""

    splits: list[LinearSplit]
    hosts_count: int
    rank: int

    def parameter_slices(self, model: nn.Module) -> dict[str, tuple[int, int, int, int]]:
        """Each split parameter's name -> (dimension cut, full size, this host's start and
        stop): what turns a whole state_dict into this host's and back."""
        out = {}
        for split in self.splits:
            if split.kind == "replicated":
                continue
            start, stop = slice_bounds(split.width, self.hosts_count, self.rank)
            prefix = f"classifier.{split.index}."
            if split.kind == "column":
                out[prefix + "weight"] = (0, split.width, start, stop)
                out[prefix + "bias"] = (0, split.width, start, stop)
            else:
                out[prefix + "weight"] = (1, split.width, start, stop)
        names = dict(model.named_parameters())
        return {name: cut for name, cut in out.items() if name in names}


def split_classifier(model: nn.Module, hosts) -> SplitClassifier:
    """Replace `model.classifier`'s layers by this host's slices, in place; the parameters
    it does not hold are freed. NotSplittable when the model has no such classifier."""
    classifier = getattr(model, "classifier", None)
    if classifier is None or not all(isinstance(getattr(model, name, None), nn.Module)
                                     for name in ("features", "avgpool")):
        raise NotSplittable("it is not made of features -> avgpool -> classifier")
    splits = plan(classifier)
    layers = list(classifier)
    sliced: tuple[int, int, int] | None = None  # (width, start, stop) while a slice flows
    by_index = {s.index: s for s in splits}
    for i, layer in enumerate(layers):
        split = by_index.get(i)
        if split is not None and split.kind != "replicated":
            start, stop = slice_bounds(split.width, hosts.size, hosts.rank)
            if split.kind == "column":
                classifier[i] = ColumnLinear(layer, start, stop)
                sliced = (split.width, start, stop)
            else:
                classifier[i] = RowLinear(layer, start, stop, hosts)
                sliced = None
        elif sliced is not None and isinstance(layer, nn.Dropout):
            classifier[i] = SlicedDropout(layer, *sliced)
    return SplitClassifier(splits, hosts.size, hosts.rank)

"""One backward pass in two: the inputs' gradients now, the weights' gradients later.

[Note: splitting a backward pass]
Zero-bubble schedules run a stage's backward as an input pass (the gradient of the stage's
inputs, sent on at once to the stage before) and a weight pass later, in what would be a
bubble. Both passes start from the graph the forward recorded; the weights here are the
autograd leaves the parameters are views of (a flat tensor per group, where flatshard's
gradient accumulates), not the modules' parameters.

The graph below the outputs falls into three parts: nodes that lead to an input (the input
pass runs them), nodes that lead only to weights (the weight pass), and nodes that lead to
neither. An *intermediate* is a node of the first part with edges into the second. The
input pass records the gradient each intermediate receives (a pre-hook). The weight pass
runs each intermediate again on it, asking autograd only for the gradients along those
edges (so only that node's weight-side outputs are computed: no input gradient twice),
then runs the weights-only part once from all those edges, summed where two
intermediates feed one. Each weight gets exactly what one whole backward would give it.
Outputs whose graph leads only to weights start the second run directly.

An edge captured that way is a slot of a node: were one of an intermediate's edges also
reached through another of its weights-only children, that slot's capture would hold the
other path's share too, and the second run would add it again. Such a graph (a weight used
twice by one op, once through a function of it) is found while planning, and its backward
then runs whole in the input pass (``WeightPass.done``): exact, not split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class WeightPass:
    """What the input pass leaves for the weight pass."""

    # intermediate -> (its recorded gradient, its edges into the weights-only part)
    intermediates: dict[Node, tuple[tuple[torch.Tensor | None, ...], list[GradientEdge]]] = field(
        default_factory=dict
    )
    # outputs whose graph leads only to weights, with their gradients
    roots: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)
    # the weights' gradients, where the input pass computed them (see the note)
    done: list[torch.Tensor | None] | None = None


def input_pass(
    outputs: Sequence[torch.Tensor],
    output_grads: Sequence[torch.Tensor] | None,
    inputs: Sequence[object],
    weights: Sequence[torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], WeightPass]:
    """The gradients of ``inputs`` (None where an input is not a tensor needing one), and
    what the weight pass needs. ``output_grads`` None: the outputs are the loss."""
    valid = [(i, t) for i, t in enumerate(outputs) if t.requires_grad]
    roots = [t for _, t in valid]
    grads = [torch.ones_like(t) if output_grads is None else output_grads[i] for i, t in valid]
    wanted = [
        (i, t) for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    children = _graph(roots)
    input_nodes = {get_gradient_edge(t).node for _, t in wanted}
    weight_nodes = {get_gradient_edge(w).node for w in weights if w.requires_grad}
    to_inputs = _leading_to(input_nodes, children)
    weights_only = _leading_to(weight_nodes, children) - to_inputs

    plan = WeightPass()
    for node in to_inputs:
        edges = [
            GradientEdge(child, nr) for child, nr in children.get(node, []) if child in weights_only
        ]
        if edges:
            plan.intermediates[node] = ((), edges)
    for root, grad in zip(roots, grads, strict=True):
        edge = get_gradient_edge(root)
        if edge.node in weights_only:
            plan.roots.append((edge, grad))
    if any(_edges_meet(edges, children) for _, edges in plan.intermediates.values()):
        return _whole(roots, grads, inputs, wanted, weights)

    def recorder(node: Node) -> object:
        def record(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            plan.intermediates[node] = (tuple(grad_outputs), plan.intermediates[node][1])

        return record

    handles = [node.register_prehook(recorder(node)) for node in plan.intermediates]  # type: ignore[arg-type]
    try:
        found: tuple[torch.Tensor | None, ...] = ()
        if wanted and roots:
            found = torch.autograd.grad(
                roots,
                [t for _, t in wanted],
                grads,
                retain_graph=True,
                allow_unused=True,
            )
    finally:
        for handle in handles:
            handle.remove()
    dinputs: list[torch.Tensor | None] = [None] * len(inputs)
    for (index, _), dinput in zip(wanted, found, strict=False):
        dinputs[index] = dinput
    return tuple(dinputs), plan


def weight_pass(plan: WeightPass, weights: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """The weights' gradients of the backward whose input pass made ``plan``."""
    if plan.done is not None:
        done, plan.done = plan.done, None
        return done
    into: dict[tuple[Node, int], tuple[GradientEdge, torch.Tensor]] = {}

    def add(edge: GradientEdge, grad: torch.Tensor) -> None:
        key = (edge.node, edge.output_nr)
        if key in into:
            into[key] = (edge, into[key][1] + grad)
        else:
            into[key] = (edge, grad)

    for node, (recorded, edges) in plan.intermediates.items():
        starts = [(GradientEdge(node, i), g) for i, g in enumerate(recorded) if g is not None]
        if not starts:
            continue
        found = torch.autograd.grad(
            [e for e, _ in starts],
            edges,
            [g for _, g in starts],
            retain_graph=True,  # the nodes below may run again in the second run
            allow_unused=True,
        )
        for edge, grad in zip(edges, found, strict=True):
            if grad is not None:
                add(edge, grad)
    for edge, grad in plan.roots:
        add(edge, grad)
    plan.intermediates.clear()
    plan.roots.clear()
    trainable = [w for w in weights if w.requires_grad]
    if not into or not trainable:
        return [None] * len(weights)
    starts = list(into.values())
    found = torch.autograd.grad(
        [e for e, _ in starts],
        trainable,
        [g for _, g in starts],
        allow_unused=True,
    )
    by_weight = dict(zip((id(w) for w in trainable), found, strict=True))
    return [by_weight.get(id(w)) for w in weights]


def _whole(
    roots: list[torch.Tensor],
    grads: list[torch.Tensor],
    inputs: Sequence[object],
    wanted: list[tuple[int, torch.Tensor]],
    weights: Sequence[torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], WeightPass]:
    """The whole backward in one run: the inputs' gradients now, the weights' kept."""
    trainable = [w for w in weights if w.requires_grad]
    targets = [t for _, t in wanted] + trainable
    found = torch.autograd.grad(roots, targets, grads, allow_unused=True) if targets else ()
    dinputs: list[torch.Tensor | None] = [None] * len(inputs)
    for (index, _), dinput in zip(wanted, found, strict=False):
        dinputs[index] = dinput
    by_weight = dict(zip((id(w) for w in trainable), found[len(wanted) :], strict=True))
    return tuple(dinputs), WeightPass(done=[by_weight.get(id(w)) for w in weights])


def _edges_meet(edges: list[GradientEdge], children: dict[Node, list[tuple[Node, int]]]) -> bool:
    """Whether one of ``edges``' slots is also reached through another of their nodes."""
    slots = {(e.node, e.output_nr) for e in edges}
    for start in {e.node for e in edges}:
        stack, seen = [start], {start}
        while stack:
            for child, nr in children.get(stack.pop(), []):
                if (child, nr) in slots:
                    return True
                if child not in seen:
                    seen.add(child)
                    stack.append(child)
    return False


def _graph(roots: Sequence[torch.Tensor]) -> dict[Node, list[tuple[Node, int]]]:
    """Each node below ``roots`` with its children (node, input slot)."""
    children: dict[Node, list[tuple[Node, int]]] = {}
    stack = [get_gradient_edge(t).node for t in roots]
    while stack:
        node = stack.pop()
        if node in children:
            continue
        children[node] = [(c, nr) for c, nr in node.next_functions if c is not None]
        stack.extend(c for c, _ in children[node] if c not in children)
    return children


def _leading_to(targets: set[Node], children: dict[Node, list[tuple[Node, int]]]) -> set[Node]:
    """The nodes of the graph from which some node of ``targets`` is reached (them too)."""
    parents: dict[Node, list[Node]] = {}
    for node, kids in children.items():
        for child, _ in kids:
            parents.setdefault(child, []).append(node)
    found = {t for t in targets if t in children or t in parents}
    stack = list(found)
    while stack:
        node = stack.pop()
        for parent in parents.get(node, []):
            if parent not in found:
                found.add(parent)
                stack.append(parent)
    return found

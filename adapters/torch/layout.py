"""What an hvdp torch optimizer reduces and how: its parameters that require grad, their names,
Horovod groups, and where each goes in the engine's plan. Made with the optimizer, and made again at the next
step when a parameter's ``requires_grad`` has changed (unfrozen: reduced from then on; frozen:
left alone, as plain torch leaves a parameter without a gradient)."""
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

Params = List[torch.Tensor]


def named(param_groups: Sequence[dict], named_parameters) -> List[Tuple[str, torch.Tensor]]:
    """(name, parameter) of every optimizer parameter, checked (Horovod's rules)."""
    if named_parameters is None:
        return [(f"allreduce.noname.{i}.{j}", p) for i, g in enumerate(param_groups)
                for j, p in enumerate(g["params"])]
    pairs = list(named_parameters)
    if any(not isinstance(t, tuple) or len(t) != 2 for t in pairs):
        raise ValueError("named_parameters must be (name, parameter) tuples, "
                         "e.g. model.named_parameters()")
    seen, dups = set(), set()
    for k, _ in pairs:
        (dups if k in seen else seen).add(k)
    if dups:
        raise ValueError(f"parameter names must be unique; duplicated: {', '.join(sorted(dups))}")
    ids = {id(p) for _, p in pairs}
    missing = [p for g in param_groups for p in g["params"] if id(p) not in ids]
    if missing:
        raise ValueError(f"named_parameters was given but {len(missing)} optimizer parameter(s) are "
                         "not in it; pass model.named_parameters() of the model being optimized")
    return pairs


def trainable_ids(param_groups: Sequence[dict]) -> List[int]:
    """ids of the parameters that require grad now, in order (compared every step: cheap)."""
    return [id(p) for g in param_groups for p in g["params"] if p.requires_grad]


@dataclass
class Layout:
    params: Params                                   # reduced, in param_groups order
    name: Dict[torch.Tensor, str]
    groups: Dict[torch.Tensor, Tuple[torch.Tensor, ...]]
    bucket_of: Dict[torch.Tensor, int]
    # while compressing, a group's bucketed members go with their bucket: the group is the
    # rest (waiting for all its members would leave the plain ones unreduced)
    plain_groups: Dict[torch.Tensor, Tuple[torch.Tensor, ...]]


def _groups(params: Params, groups, strict: bool) -> Dict[torch.Tensor, Tuple[torch.Tensor, ...]]:
    if not groups:
        return {}
    if isinstance(groups, int):
        k = -(-len(params) // groups) if params else 1
        lists = [params[i:i + k] for i in range(0, len(params), k)]
    else:
        known = set(params)
        lists = [list(g) for g in groups]
        if strict and any(p not in known for g in lists for p in g):
            raise ValueError("groups must hold parameters of this optimizer that require grad")
        lists = [[p for p in g if p in known] for g in lists]  # frozen since: out of their group
    return {p: tuple(g) for g in lists for p in g}


def agreement_entries(param_groups: Sequence[dict], names: Dict[int, str]) -> list:
    """(name, shape, dtype, requires_grad) of every optimizer parameter, for the ranks-agree check."""
    return [(names.get(id(p), f"param_groups.{i}.{j}"), tuple(p.shape), str(p.dtype).replace("torch.", ""),
             bool(p.requires_grad)) for i, g in enumerate(param_groups) for j, p in enumerate(g["params"])]


def make_layout(param_groups: Sequence[dict], names: Dict[int, str], groups, engine,
                strict: bool = True, at_creation: bool = False) -> Layout:
    """The layout of the parameters that require grad now, planned (and checked) by the engine.
    ``names``: id -> name given at creation; a parameter added to the optimizer later is named
    by its position."""
    params = [p for g in param_groups for p in g["params"] if p.requires_grad]
    pos = {id(p): f"param_groups.{i}.{j}" for i, g in enumerate(param_groups) for j, p in enumerate(g["params"])}
    name = {p: names.get(id(p), pos[id(p)]) for p in params}
    grouped = _groups(params, groups, strict)
    plan = engine.set_layout([name[p] for p in params], [tuple(p.shape) for p in params],
                             [p.is_floating_point() for p in params],
                             tensors=agreement_entries(param_groups, names),
                             groups={tuple(name[p] for p in g) for g in grouped.values()},
                             at_creation=at_creation)
    bucket_of = {params[i]: b for b, idx in enumerate(plan.buckets) for i in idx}
    plain = {p: tuple(q for q in g if q not in bucket_of) for p, g in grouped.items() if p not in bucket_of}
    return Layout(params, name, grouped, bucket_of, plain)

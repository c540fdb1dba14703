"""Fused losses whose LM head is a DTensor sharded by vocabulary rows (FSDP2's ``Shard(0)``).

Under ``torch.distributed.fsdp.fully_shard`` a head that is resharded after forward (a root
with ``reshard_after_forward=True``, or a teacher sharded for inference) reaches the loss as a
DTensor: each rank of a 1-D data-parallel mesh holds the rows ``torch.chunk`` gives it (uneven
shards included) and its own tokens. The fused losses then give what one process would give
FSDP: each rank's loss over its own tokens, exactly, and gradients that follow FSDP's own
reduction, so the whole model trains as it would with the head unsharded:

- the hidden states' gradient is this rank's, ``d loss_r / d hidden_r`` (as any activation);
- the head's gradient is a DTensor of the same placement holding this rank's rows of
  ``sum_r d loss_r / d weight / divide``, ``divide`` the mesh size (FSDP's average) or
  ``gradient_divide_factor`` (the value given to FSDP2's ``set_gradient_divide_factor``).
  FSDP itself never reduces it again: the gradient lands on the sharded parameter, not on the
  unsharded one that FSDP reduce-scatters (a head tied to the input embedding gets both, added).

Two ways, ``sharded_head=``:

- ``"vocab_parallel"`` (the default): no rank ever holds the whole head. Every rank's hidden
  states (and the teacher's rows, labels and mask) are gathered over the mesh, each rank
  computes its own vocabulary rows for every rank's tokens with the tensor-parallel engine,
  and the hidden states' gradients are reduce-scattered back. The local head gradient is then
  already the sum over ranks, so it is only divided.
- ``"gather"``: the whole head is all-gathered once per call, the loss runs as in one process
  on this rank's tokens, and the head's gradient is reduce-scattered and divided.

``reduction="mean"`` means each rank's mean over its own kept rows, as a plain FSDP loss does:
FSDP's average of the per-rank gradients is then the gradient of the average of the per-rank
means, which is the mean over the global batch when every rank keeps as many rows.

Only routing and checks live here; the collectives are :mod:`topkd.parallel`'s and the math is
the engine's.
"""

from __future__ import annotations

import torch

from . import _checks, parallel
from .teacher import SampledTeacher, SparseTeacher

DESIGNS = ("vocab_parallel", "gather")


def _find_dtensor_types():
    """``(DTensor, Shard)``, or ``None`` where this torch has no DTensor."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # torch < 2.4
        try:
            from torch.distributed._tensor import DTensor, Shard
        except ImportError:
            return None
    return DTensor, Shard


_DTENSOR_TYPES = []  # found once, on first use (a plain global: torch.compile traces through it)


def _dtensor_types():
    if not _DTENSOR_TYPES:
        _DTENSOR_TYPES.append(_find_dtensor_types())
    return _DTENSOR_TYPES[0]


def is_dtensor(x) -> bool:
    types = _dtensor_types()
    return types is not None and isinstance(x, types[0])


def involved(student, teacher) -> bool:
    """Whether any tensor of the student or teacher is a DTensor."""
    if _dtensor_types() is None:
        return False
    tensors = list(student) if isinstance(student, tuple) else [student]
    if isinstance(teacher, tuple):
        tensors += list(teacher)
    elif isinstance(teacher, torch.Tensor):
        tensors.append(teacher)
    return any(is_dtensor(t) for t in tensors)


def _describe(x) -> str:
    mesh = x.device_mesh
    return (f"a DTensor of shape {tuple(x.shape)} with placements {tuple(x.placements)} on a "
            f"{mesh.ndim}-D mesh of shape {tuple(mesh.shape)}")


def _check_head(name: str, x) -> None:
    """``x`` is a DTensor sharded by rows, ``Shard(0)``, on a 1-D mesh."""
    _, shard = _dtensor_types()
    placements = tuple(x.placements)
    by_rows = (len(placements) == 1 and type(placements[0]) is shard  # not _StridedShard
               and placements[0].dim == 0)
    if x.device_mesh.ndim != 1 or not by_rows:
        raise ValueError(
            f"{name} is {_describe(x)}; a fused loss takes an LM head sharded by vocabulary "
            f"rows: placements (Shard(dim=0),) on a 1-D mesh (FSDP2's fully_shard), or a "
            f"plain tensor")


def _check_pair(prefix: str, weight, bias) -> bool:
    """Checks a head ``(weight, bias)``; whether it is sharded."""
    sharded = is_dtensor(weight)
    if sharded:
        _check_head(f"{prefix}weight", weight)
    if bias is not None and is_dtensor(bias) != sharded:
        raise ValueError(
            f"{prefix}bias is {_describe(bias) if is_dtensor(bias) else 'a plain tensor'} but "
            f"{prefix}weight is {_describe(weight) if sharded else 'a plain tensor'}; pass "
            f"both sharded alike (as fully_shard shards them) or both plain")
    if bias is not None and sharded:
        _check_head(f"{prefix}bias", bias)
        if bias.device_mesh != weight.device_mesh:
            raise ValueError(f"{prefix}bias is on the mesh {bias.device_mesh} but "
                             f"{prefix}weight on {weight.device_mesh}")
    return sharded


def check(student, teacher, options) -> None:
    """Every check of a call with a DTensor, from local metadata only (before any collective):
    a ``ValueError`` naming the argument and what was seen."""
    if not isinstance(student, tuple):
        raise ValueError(f"student_logits is {_describe(student)}: the logits losses take "
                         f"plain tensors (a DTensor head goes to the fused losses)"
                         if is_dtensor(student) else
                         "teacher_logits is a DTensor: the logits losses take plain tensors")
    hidden, weight, bias = (*student, None)[:3]
    if is_dtensor(hidden):
        raise ValueError(f"hidden is {_describe(hidden)}: pass this rank's own hidden states "
                         f"as a plain tensor (hidden.to_local())")
    sharded = _check_pair("", weight, bias)
    if isinstance(teacher, torch.Tensor) and is_dtensor(teacher):
        raise ValueError(f"teacher logits are {_describe(teacher)}: pass this rank's rows of "
                         f"the teacher's logits as a plain tensor, every vocabulary column")
    teacher_sharded = False
    if isinstance(teacher, tuple) and len(teacher) in (2, 3):
        t_hidden, t_weight, t_bias = (*teacher, None)[:3]
        if is_dtensor(t_hidden):
            raise ValueError(f"teacher hidden is {_describe(t_hidden)}: pass this rank's own "
                             f"teacher hidden states as a plain tensor")
        teacher_sharded = _check_pair("teacher ", t_weight, t_bias)
        if sharded and teacher_sharded and t_weight.device_mesh != weight.device_mesh:
            raise ValueError(
                f"teacher weight is on the mesh {t_weight.device_mesh} but weight on "
                f"{weight.device_mesh}: a sharded teacher head must share the student's mesh")
    if options.process_group is not None:
        raise ValueError("process_group is for plain vocabulary shards; a DTensor head brings "
                         "its own mesh: pass process_group=None")
    if options.reduce_hidden_grad:
        raise ValueError("reduce_hidden_grad=True applies to plain vocabulary shards; with a "
                         "DTensor head each rank's hidden states get their whole gradient")
    if sharded and not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")


def shard_sizes(total: int, world: int) -> list[int]:
    """The rows of each rank under ``Shard(0)`` (``torch.chunk``'s: ceil(total / world) each,
    the last ones shorter or empty)."""
    step = -(-total // world)
    return [max(0, min(step, total - r * step)) for r in range(world)]


class Mesh:
    """A 1-D mesh's group, this rank's place in it and the student head's rows per rank."""

    def __init__(self, weight):
        mesh = weight.device_mesh
        self.group = mesh.get_group()
        self.world = mesh.size()
        self.rank = mesh.get_local_rank()
        self.sizes = shard_sizes(weight.shape[0], self.world)
        local = weight.to_local().shape[0]
        if local != self.sizes[self.rank]:
            raise ValueError(f"weight holds {local} rows on mesh rank {self.rank}; Shard(0) of "
                             f"{weight.shape[0]} rows over {self.world} gives {self.sizes}")

    def sizes_of(self, width: int) -> list[int]:
        """Another tensor's columns (a teacher's) cut at the student's offsets; the last rank
        takes whatever is past the student's width."""
        offsets = [sum(self.sizes[:r]) for r in range(self.world)]
        sizes = [max(0, min(s, width - o)) for s, o in zip(self.sizes, offsets, strict=True)]
        sizes[-1] += max(0, width - sum(self.sizes))
        return sizes


class DivideGradient(parallel.GradientMap):
    """Identity forward; the gradient divided by ``divide`` in backward."""

    @staticmethod
    def forward(ctx, tensor, divide):
        # the engine's gradient of the head is a tensor of its own, used nowhere else (the
        # only consumer of this Function's output is the engine): divided in place
        ctx.map = lambda grad: grad.div_(divide)
        return tensor.view_as(tensor)


def _divide(options, mesh: Mesh) -> float:
    factor = options.gradient_divide_factor
    return float(mesh.world) if factor is None else factor


def _whole_teacher(teacher):
    """A teacher head with any DTensor part gathered whole (no gradient); else unchanged."""
    if not isinstance(teacher, tuple) or not is_dtensor(teacher[1]):
        return teacher
    t_mesh = Mesh(teacher[1])
    parts = [teacher[0]]
    for part in teacher[1:]:
        parts.append(None if part is None else
                     parallel.gather_shards(part.to_local(), t_mesh.group, t_mesh.sizes))
    return tuple(parts)


def sharded_loss(run, student, teacher, options, mask, labels):
    """The loss of a call with a DTensor head; ``run`` is :func:`topkd.distill_loss`."""
    from .entry import check_inputs  # entry imports this module

    check(student, teacher, options)  # local metadata, alike on every rank: raised at once
    try:  # each rank's own rows (labels, a teacher's entries) may be bad on that rank alone
        check_inputs(student, teacher, options, mask, labels)
        refused = None
    except Exception as e:  # noqa: BLE001 - whatever it is, every rank raises together
        refused = e
    hidden, weight, bias = (*student, None)[:3]
    head = weight if is_dtensor(weight) else teacher[1]  # (check: one of them is a DTensor)
    parallel.raise_together(refused, head.device_mesh.get_group(), head.to_local().device)
    if not is_dtensor(weight):  # a plain student with a sharded teacher head: gather that
        return run(student, _whole_teacher(teacher), options, mask=mask, labels=labels)
    mesh = Mesh(weight)
    divide = _divide(options, mesh)
    plain = options.replace(sharded_head="vocab_parallel", gradient_divide_factor=None)
    if options.sharded_head == "gather":
        full = tuple(None if x is None else
                     parallel.GatherShards.apply(x.to_local(), mesh.group, mesh.sizes, divide)
                     for x in (weight, bias))
        return run((hidden, *full), _whole_teacher(teacher), plain, mask=mask,
                   labels=labels)
    return _vocab_parallel(run, mesh, divide, hidden, weight, bias, teacher, plain, mask,
                           labels)


def _vocab_parallel(run, mesh, divide, hidden, weight, bias, teacher, options, mask, labels):
    from .entry import RowOwner, row_weights  # entry imports this module

    group = mesh.group
    lead = hidden.shape[:-1]
    n = lead.numel()
    keep = None if mask is None else mask.reshape(n)
    if isinstance(teacher, (SparseTeacher, SampledTeacher)) and teacher.mask is not None:
        t_mask = teacher.mask.reshape(n)
        keep = t_mask if keep is None else keep & t_mask
    flat_labels = None if labels is None else labels.reshape(n)
    weights = row_weights(keep, flat_labels, options, n, hidden.device)

    # the first collective: every rank's row count and teacher width, checked alike everywhere
    everyone = parallel.exchange_counts(group, [n, _teacher_width(teacher)], hidden.device)
    counts = [c[0] for c in everyone]
    widths = {c[1] for c in everyone}
    if len(widths) > 1:
        raise ValueError(f"the teacher's width (K of a SparseTeacher, the logits' or the "
                         f"teacher hidden states' width) differs across ranks: "
                         f"{[c[1] for c in everyone]}")
    rows = max(counts)
    gathered_hidden = parallel.GatherRows.apply(hidden.reshape(n, hidden.shape[-1]), group,
                                                rows)
    head = [DivideGradient.apply(x.to_local(), divide) for x in (weight, bias)
            if x is not None]
    head = (gathered_hidden, *head)
    pad = len(set(counts)) > 1
    all_keep = None
    if keep is not None or pad:
        local = torch.ones(n, dtype=torch.bool, device=hidden.device) if keep is None else keep
        all_keep = parallel.gather_rows(local, group, rows, False)
    all_labels = None
    if flat_labels is not None:
        all_labels = parallel.gather_rows(flat_labels.to(torch.int64), group, rows,
                                          options.ignore_index)
    all_weights = parallel.gather_rows(weights, group, rows)
    owner = RowOwner(group=group, start=mesh.rank * rows, count=n, rows=rows, lead_shape=lead,
                     keep=keep, weights=all_weights)
    teacher = _teacher_rows(teacher, mesh, group, rows, n)
    if isinstance(teacher, SparseTeacher):  # each rank checked its rows (check_inputs)
        _checks.mark_checked(teacher, all_keep, options.normalize == "full")
    return run(head, teacher, options.replace(process_group=group), mask=all_keep,
               labels=all_labels, owner=owner)


def _teacher_width(teacher) -> int:
    if isinstance(teacher, (SparseTeacher, SampledTeacher)):
        return teacher.k
    if isinstance(teacher, torch.Tensor):
        return teacher.shape[-1]
    return teacher[0].shape[-1]


def _teacher_rows(teacher, mesh: Mesh, group, rows: int, n: int):
    """The teacher for every rank's rows and this rank's vocabulary rows."""
    if isinstance(teacher, SparseTeacher):
        k = teacher.k
        return SparseTeacher(
            parallel.gather_rows(teacher.indices.reshape(n, k), group, rows, -1),
            parallel.gather_rows(teacher.logprobs.reshape(n, k), group, rows, float("-inf")),
            parallel.gather_rows(teacher.rest_logprob.reshape(n), group, rows, 0.0),
            teacher.temperature, teacher.vocab_size)
    if isinstance(teacher, SampledTeacher):  # padding rows: no draws (count 0 everywhere)
        k = teacher.k
        logq = None if teacher.logprobs is None else parallel.gather_rows(
            teacher.logprobs.reshape(n, k), group, rows, float("-inf"))
        return SampledTeacher(
            parallel.gather_rows(teacher.indices.reshape(n, k), group, rows, -1),
            parallel.gather_rows(teacher.counts.reshape(n, k), group, rows, 0),
            teacher.samples, teacher.temperature, teacher.vocab_size, logq)
    if isinstance(teacher, torch.Tensor):  # logits: this rank's columns of every rank's rows
        width = teacher.shape[-1]
        logits = teacher.reshape(n, width)
        return parallel.columns_to_rows(logits, group, mesh.sizes_of(width), rows)
    if isinstance(teacher, tuple) and len(teacher) in (2, 3):
        t_hidden, t_weight, t_bias = (*teacher, None)[:3]
        t_hidden = parallel.gather_rows(t_hidden.reshape(n, t_hidden.shape[-1]), group, rows)
        if is_dtensor(t_weight) and Mesh(t_weight).sizes == mesh.sizes_of(t_weight.shape[0]):
            head = [None if x is None else x.to_local().detach() for x in (t_weight, t_bias)]
        else:  # a plain teacher head, or a sharded one whose rows are not cut where the
            # student's are (another vocabulary width: gathered whole, no gradient): this
            # rank's rows of it, at the student's offsets
            t_weight, t_bias = _whole_teacher((None, t_weight, t_bias))[1:]
            sizes = mesh.sizes_of(t_weight.shape[0])
            start = sum(sizes[:mesh.rank])
            head = [None if x is None else x.detach()[start:start + sizes[mesh.rank]]
                    for x in (t_weight, t_bias)]
        return (t_hidden, *head) if head[1] is not None else (t_hidden, head[0])
    return teacher  # the entry point names what is wrong with it

"""A store build's teacher sharded over the build's ranks with FSDP2, for inference.

Rank 0 alone reads the checkpoint, on the CPU; every other rank builds the same model on the
meta device, which holds no memory (:func:`load_sharded`). :func:`shard_teacher` then shards it
with ``torch.distributed.fsdp.fully_shard`` on its decoder layers and its root, each module
moved to the build's device as it is sharded, and rank 0's weights are broadcast one tensor at
a time, each rank keeping its shard. So a node's host memory holds one copy of the teacher at
most (rank 0's, while it loads), a rank's device ``1/world`` of the weights at rest and, during
a forward, the root's parameters (embeddings, head, final norm) and the layer being run (on GPUs
also the next one, fetched ahead) gathered whole. The gathered weights are the checkpoint's
bits, so the logits are those of the unsharded teacher for the same batch.

A forward is then collective: every rank must run as many as every other, in step, or a rank
waits in an all-gather that no other rank makes, until the process group's timeout.
:class:`Lockstep` makes the ranks agree before each forward: whether any rank still has a
batch (a rank without one runs a dummy forward whose rows are not written), and whether any
rank failed while preparing its batch or writing its rows (then every rank stops: the failed
one with its own error, the others naming it). One all-reduce of two integers per forward.
"""

from __future__ import annotations

import torch


def decoder_layers(model) -> list:
    """The modules that ``fully_shard`` wraps one by one: those whose class is in the model's
    ``_no_split_modules`` (the repeated blocks, as transformers and accelerate's FSDP
    auto-wrap name them). ValueError when the model names none or none is found."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if not layers:
        raise ValueError(
            f"cannot shard the teacher: {type(model).__name__} names no decoder layer class "
            f"(_no_split_modules={sorted(names)}) or has none of them; without layers to "
            f"gather one at a time, sharding would gather the whole teacher at every forward")
    return layers


def shard_teacher(model, device: torch.device, world: int):
    """Shard ``model`` (a Hugging Face causal LM on the CPU, in eval mode) over the default
    process group's ``world`` ranks with FSDP2: ``fully_shard`` on each decoder layer and on
    the root, all resharded after forward; no gradients. Returns the device its shards are on
    (where the inputs must go)."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        raise ImportError(f"sharding the teacher needs FSDP2 (torch.distributed.fsdp."
                          f"fully_shard, torch >= 2.6); this is torch "
                          f"{torch.__version__}") from None

    layers = decoder_layers(model)  # (refused alike on every rank, before any collective)
    model.requires_grad_(False)
    mesh = init_device_mesh(device.type, (world,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return next(model.parameters()).device


def load_sharded(load, teacher_dir: str, dtype, device: torch.device, world: int):
    """``(model, device)``: the teacher of ``teacher_dir`` sharded over the default process
    group's ``world`` ranks (see the module's docstring), in eval mode, its shards on the
    returned device. ``load(teacher_dir, dtype, "cpu")`` loads the checkpoint (rank 0 only).

    Every rank learns from rank 0, in one broadcast, each parameter's and buffer's name, shape
    and dtype (the meta model is given those dtypes, so each shard holds rank 0's bits). A rank
    whose load or model fails stops every rank through :meth:`Lockstep.agree` (its own error
    there, one naming it elsewhere), before any shard is moved. Buffers outside the checkpoint
    (rotary frequencies) are broadcast too."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank = dist.get_rank()
    lockstep, model, error = Lockstep(rank, device), None, None
    if rank == 0:
        try:
            model = load(teacher_dir, dtype, "cpu")
        except Exception as e:  # noqa: BLE001  (raised by agree, the other ranks naming it)
            error = e
    lockstep.agree(True, error)
    layout = [_layout(model) if rank == 0 else None]
    dist.broadcast_object_list(layout, src=0)
    if rank:
        try:
            model = _meta_model(teacher_dir, layout[0])
            if _layout(model) != layout[0]:
                error = RuntimeError(f"rank {rank} built a model from {teacher_dir!r}'s config "
                                     f"whose parameters differ from those rank 0 loaded")
        except Exception as e:  # noqa: BLE001  (as above)
            error = e
    lockstep.agree(True, error)
    full = model.state_dict() if rank == 0 else {}
    placed = shard_teacher(model, device, world)
    if rank:  # its shards are on meta: made on the device fully_shard would have moved them to
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        model.to_empty(device=device)
        placed = device
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                broadcast_from_rank0=True))
    del full
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    return model.eval(), placed


def _layout(model) -> list:
    """Each parameter's and buffer's name, shape and dtype, in the model's order."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in tensors]


def _meta_model(teacher_dir: str, layout: list):
    """The model of ``teacher_dir``'s config on the meta device, each tensor in the dtype that
    ``layout`` (rank 0's) gives it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(teacher_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dtypes = {name: getattr(torch, dtype.removeprefix("torch.")) for name, _, dtype in layout}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name in dtypes and tensor.dtype != dtypes[name]:
            tensor.data = tensor.data.to(dtypes[name])
    return model.eval()


def dummy_forward(model, device: torch.device) -> None:
    """One forward of a single token, whose output is dropped: the collectives of a forward
    for a rank with nothing to compute."""
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, 1), dtype=torch.int64, device=device), use_cache=False)


class Lockstep:
    """Keeps the ranks' forwards in step (see the module's docstring). ``agree`` is called by
    every rank once before each forward; it waits at most the process group's timeout."""

    def __init__(self, rank: int, device: torch.device):
        self.rank = rank
        self.device = device

    def agree(self, has_batch: bool, error: BaseException | None) -> bool:
        """Whether any rank has a batch (else every rank stops). Raises ``error`` on its own
        rank when given, and a RuntimeError naming the failed rank on the others."""
        import torch.distributed as dist

        flags = torch.tensor([int(has_batch), 0 if error is None else self.rank + 1],
                             dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        any_batch, failed = (int(v) for v in flags.tolist())
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"rank {failed - 1} of the sharded teacher's build failed (its "
                               f"error is in its own output); rank {self.rank} stops with it "
                               f"(a rerun resumes)")
        return bool(any_batch)

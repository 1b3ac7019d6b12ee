"""A model's whole weights where each process holds a shard of them (FSDP2), on the main process.

Under DDP every process holds the whole model and its `state_dict()` is the weights. Under FSDP2 each
parameter is a DTensor split over the processes: the whole tensors exist only once they are gathered, which
every process takes part in (torch's `get_model_state_dict` with `full_state_dict`, put on the CPU of the main
process alone, so no process holds more than one copy). What needs the whole weights (the adapter in peft's
format, a merged model, the weights `acc-trainer consolidate` writes) gets them here.
"""

from __future__ import annotations

import torch


def is_sharded(model) -> bool:
    """The model's parameters are split over the processes: FSDP2 shards some of its modules. Asked of the modules,
    not of the parameters: the parameter groups that do not reshard after a forward pass (the root's, and
    Accelerate's group of embeddings, final norm and head) can be left gathered, plain tensors and not DTensors,
    until the next backward pass or `state_dict()` (torch 2.14: seen after a DPO run's last evaluation); a model
    not cut by layers (none for fsdp.yaml's policy to make units of) has all of its parameters there and then
    showed no DTensor at all."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def full_state(model, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """A sharded model's state dict with whole tensors on the CPU: on the main process, `{}` on the others (every
    process must call it: the tensors are gathered). `trainable_only`: the parameters that train (and the buffers), as
    a checkpoint of a partly frozen model keeps them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=trainable_only))

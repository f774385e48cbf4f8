"""DDP's constructor keywords in ``wrap()``, so that ``DDP(model, ...)`` -> ``wrap(model, ...)`` is a rename.

Each keyword is either honoured or refused here, before any collective, with
the reason it does not apply: bagua_x runs one process per device on the
device the parameters are on and always keeps gradients as bucket views.
``static_graph`` needs no check: the backward engines honour it
(:mod:`bagua_x.core.readiness`).
"""

from typing import Any, Optional, Sequence, Union

import torch

from ..core.errors import BaguaXError

__all__ = ["check_ddp_arguments"]

Device = Union[int, str, torch.device]


def check_ddp_arguments(model: torch.nn.Module, optimizer: Any, device_ids: Optional[Sequence[Device]],
                        output_device: Optional[Device], gradient_as_bucket_view: bool,
                        bucket_cap_mb: Optional[float]) -> float:
    """Raise a BaguaXError for a DDP keyword bagua_x cannot honour; return the bucket cap in MB."""
    if isinstance(optimizer, (list, tuple)):
        raise BaguaXError(
            f"wrap()'s second positional argument is the optimizer, got {type(optimizer).__name__} {optimizer!r}; "
            "DDP's positional device_ids goes by keyword here: wrap(model, optimizer, device_ids=[...])"
        )
    device = _model_device(model)
    if device_ids is not None:
        if len(device_ids) != 1:
            raise BaguaXError(
                f"device_ids={list(device_ids)!r}: bagua_x runs one process per device (DDP's single-process "
                "multi-device mode is gone from torch too); pass device_ids=None or [the model's device]"
            )
        _check_device("device_ids[0]", device_ids[0], device)
    if output_device is not None:
        _check_device("output_device", output_device, device)
    if not gradient_as_bucket_view:
        raise BaguaXError(
            "gradient_as_bucket_view=False: bagua_x never keeps a second copy of the gradients (gradient "
            "algorithms make p.grad a view of the bucket buffer, weight algorithms do not bucket gradients), "
            "so it cannot give you separate gradient tensors; drop the argument (only code that resizes "
            "p.grad in place notices; zero_grad(set_to_none=True) and assigning p.grad work)"
        )
    if bucket_cap_mb is None:  # DDP's default
        return 25.0
    return bucket_cap_mb


def _model_device(model: torch.nn.Module) -> Optional[torch.device]:
    devices = {p.device for p in model.parameters()}
    return devices.pop() if len(devices) == 1 else None  # several devices: wrap's input check refuses it


def _check_device(what: str, given: Device, device: Optional[torch.device]) -> None:
    """``given`` must name ``device``; an int is an index on the parameters' device type (DDP: a CUDA index)."""
    if device is None:
        return
    if isinstance(given, int):
        if device.type == "cpu":
            raise BaguaXError(
                f"{what}={given}: the model is on the CPU, where DDP too refuses device indices; pass None"
            )
        given = torch.device(device.type, given)
    given = torch.device(given)
    if given.type != device.type or (given.index is not None and given.index != device.index):
        raise BaguaXError(
            f"{what}={str(given)!r}, but the model's parameters are on {device}; bagua_x runs on the device "
            f"the parameters are on: move the model there (model.to({str(given)!r})) before wrap(), "
            f"or pass {what.split('[')[0]}=None"
        )

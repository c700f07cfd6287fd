"""raysgd-amp alone (torch, no Ray): each precision backend trains a small model on the CPU."""

import torch
from _smoke import import_every_module, report
from torch import nn

from raysgd_amp import ApexNotAvailableError, NativePrecision, available_precisions, get_precision

device = torch.device("cpu")
trained = {}
for label, choice in [
    ("False", False),
    ("True", True),
    ("bf16", "bf16"),
    ("fp16-cpu", NativePrecision("fp16", device="cpu")),
]:
    torch.manual_seed(0)
    precision = get_precision(choice, device=device)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    (model,), (optimizer,) = precision.setup([model], [optimizer], device)
    x = torch.randn(128, 8)
    y = x.sum(dim=1, keepdim=True)
    losses, stepped = [], 0
    for _ in range(30):
        optimizer.zero_grad(set_to_none=True)
        with precision.autocast():
            out = model(x)
            loss = nn.functional.mse_loss(out.float(), y)
        precision.backward(loss, optimizer)
        precision.clip_grad_norm(model.parameters(), 10.0, optimizer)
        stepped += bool(precision.step(optimizer))
        losses.append(loss.item())
    trained[label] = {
        "name": precision.name,
        "enabled": precision.enabled,
        "dtype": str(precision.dtype),
        "autocast_dtype": str(out.dtype),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "steps": stepped,
        "state": precision.state_dict(),
    }
try:
    get_precision("apex", device=device)
    apex = None
except ApexNotAvailableError as error:
    apex = [isinstance(error, ImportError), str(error)]
try:
    get_precision("fp8", device=device)
    unknown = None
except ValueError as error:
    unknown = str(error)

report(
    "raysgd_amp",
    imported=import_every_module("raysgd_amp"),
    trained=trained,
    apex=apex,
    unknown=unknown,
    available=available_precisions(),
)

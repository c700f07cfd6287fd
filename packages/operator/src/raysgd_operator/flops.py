"""FLOPs for ``mfu``: a model's per sample, counted on one batch, and a device's peak per second.

`measure_flops_per_sample` gives what the ``flops_per_sample`` option takes; `peak_flops_per_s`
is where a worker finds its device's peak when the ``peak_flops_per_s`` option does not give it
(`raysgd_operator.throughput` says how both make the results' ``flops_per_s`` and ``mfu``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from raysgd_operator.operator import _own_loss, _rows

__all__ = ["measure_flops_per_sample", "peak_flops_per_s"]

_TERA = 1e12

# Dense peak FLOP/s of one GPU (the data sheets' figures without structured sparsity), by the
# tokens of its CUDA device name: (16-bit tensor cores (bf16, fp16), tf32, fp32). None: no such
# hardware path. Rules are tried in order, so a variant's comes before its family's; a variant
# whose per-GPU figures are not certain here maps to None (no guess: the option gives it).
_Peaks = Optional[tuple[Optional[float], Optional[float], Optional[float], Optional[float]]]
_PEAKS: tuple[tuple[tuple[str, ...], _Peaks], ...] = (
    # (bf16, fp16, tf32, fp32) in TFLOP/s.
    (("H100", "NVL"), None),
    (("H200", "NVL"), None),
    (("H100", "PCIE"), (756.0, 756.0, 378.0, 51.0)),
    (("H100",), (989.4, 989.4, 494.7, 66.9)),  # SXM ("H100 80GB HBM3")
    (("H200",), (989.4, 989.4, 494.7, 66.9)),
    (("GH200",), (989.4, 989.4, 494.7, 66.9)),
    (("A100",), (312.0, 312.0, 156.0, 19.5)),
    (("L40S",), (362.1, 362.1, 183.0, 91.6)),
    (("L4",), (121.0, 121.0, 60.0, 30.3)),
    (("A10",), (125.0, 125.0, 62.5, 31.2)),
    # Before Ampere there is no tf32 (an fp32 matmul stays fp32) and no bf16 tensor core.
    (("V100", "PCIE"), (None, 112.0, 14.0, 14.0)),
    (("V100",), (None, 125.0, 15.7, 15.7)),
    (("T4",), (None, 65.0, 8.1, 8.1)),
)


def peak_flops_per_s(
    device: torch.device | str, dtype: torch.dtype = torch.float32
) -> Optional[float]:
    """The dense peak FLOP/s of `device` computing matrix products in `dtype`, or None when it is
    not known: a CPU, or a GPU missing from the table (H200, H100 SXM and PCIe, GH200, A100, L40S,
    L4, A10, V100, T4).

    ``dtype`` is the compute dtype: bf16 or fp16 (a mixed-precision backend's), else fp32, which
    counts as tf32 where tf32 exists and `torch.get_float32_matmul_precision()` is not
    ``"highest"`` (torch computes fp32 matmuls in tf32 then).
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    tokens = set(name.upper().replace("-", " ").replace("_", " ").split())
    peaks = next((p for need, p in _PEAKS if tokens.issuperset(need)), None)
    if peaks is None:
        return None
    bf16, fp16, tf32, fp32 = peaks
    if dtype == torch.bfloat16:
        peak = bf16
    elif dtype == torch.float16:
        peak = fp16
    elif torch.get_float32_matmul_precision() != "highest":
        peak = tf32
    else:
        peak = fp32
    return None if peak is None else peak * _TERA


def measure_flops_per_sample(
    model: nn.Module,
    batch: Any,
    *,
    criterion: Optional[Callable[[Any, Any], torch.Tensor]] = None,
    num_samples: Optional[float] = None,
) -> float:
    """The FLOPs of one training step on `batch` (forward, loss and backward), per sample: what
    the ``flops_per_sample`` option takes.

    Counted by `torch.utils.flop_counter.FlopCounterMode`, which counts the matrix products,
    convolutions and attention that dominate a model's work (elementwise operations are not
    counted, as MFU conventionally does not count them). It runs the step as the default loop
    does: with a `criterion`, ``criterion(model(*features), target)`` on ``*features, target =
    batch``; without one, ``model(*batch)`` (``model(**batch)`` for a dict) returning its own loss
    (a 0-dim tensor, a tuple ending with one, or a dict or object with a ``loss``).

    ``num_samples`` is what the step counts as its ``num_samples`` (the tokens, for a model
    whose ``train_batch`` counts tokens); default: the batch's rows. Dividing by it gives FLOPs
    per unit of ``num_samples``, which is what the option means.

    The model's gradients are set to None afterwards; normalisation layers' running statistics
    and random draws (dropout) move as in any step, so measure before training, or on a model and
    batch built on the meta device (shapes only: nothing is computed or allocated). For a
    transformer the count is close to the usual estimate of 6 x parameters per token plus the
    attention's products.
    """
    # Imported on first use: only this helper needs it, and a run need not call it.
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        if criterion is not None:
            *features, target = batch
            loss = criterion(model(*features), target)
        else:
            output = model(**batch) if isinstance(batch, dict) else model(*batch)
            loss = _own_loss(output)
            if loss is None:
                raise TypeError(
                    "without a criterion the model must return its own loss (a 0-dim tensor, a "
                    f"tuple ending with one, or a dict or object with a 'loss'); got "
                    f"{type(output).__name__}"
                )
        loss.backward()
    model.zero_grad(set_to_none=True)
    count = num_samples if num_samples is not None else _rows(batch)
    if not count or count <= 0:
        raise ValueError(
            "measure_flops_per_sample needs the batch's sample count: give num_samples= (the "
            "batch has no tensor with a first dimension)"
        )
    return counter.get_total_flops() / count

"""Sharded vs replicated: per-worker memory and throughput of `strategy="fsdp"` against `"ddp"`.

The sides train the same transformer with the same global batch on 2 workers, one after the other
in one run: ``ddp``, ``fsdp`` (the model built whole on every worker, then sharded) and
``fsdp_meta`` (built on the meta device: sharded before it has memory, each worker then filling
only its shards). Per worker it records the peak resident memory (CPU) or peak allocated CUDA
memory (GPU) when the operator's ``setup`` returns (``built_peak_mb``: what building, sharding
and filling the model cost) and once the trainer is constructed (``setup_peak_mb``: with fsdp's
first snapshot), and after training the bytes of parameters, gradients and optimizer state it holds (exact:
counted from its local tensors), its peak memory, and the samples per second over the timed
steps (``--steps 0``: construction only). Ratios are against ddp.

With ``--kill-at K`` the last worker exits at step K of the timed steps of the sharded sides
(ddp is not run), and the trainer restores it: ``restore_s`` is that phase of the recovery (the
lost shards brought back from the survivors' in-memory snapshots into the new group, on the
replacement and on every survivor), ``recovery_s`` the whole resize.

    hatch run bench:fsdp [--quick] [--steps N] [--workers N] [--width W] [--layers L]
                         [--kill-at K] [--snapshot-every N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE
from raysgd_examples.bench import _common

__all__ = ["main"]


class _Operator(TrainingOperator):
    def setup(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        width, layers = config["width"], config["layers"]
        with torch.device("meta" if config["meta"] else "cpu"):
            layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
            model = nn.Sequential(nn.TransformerEncoder(layer, layers, enable_nested_tensor=False))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.register(models=model, optimizers=optimizer, criterion=nn.MSELoss())
        n = config[BATCH_SIZE] * (config["steps"] + 2)
        x = torch.randn(n, 32, width, generator=torch.Generator().manual_seed(1))
        self.register_data(
            train_loader=DataLoader(TensorDataset(x, x), batch_size=config[BATCH_SIZE])
        )
        # The model is built, sharded and filled by now; what follows (the trainer's first
        # snapshot under fsdp) is not the model's cost.
        self.built_peak_mb = _peak_bytes(self.device) / 2**20
        self.kill_at, self.marker = config.get("kill_at"), config.get("marker")

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        if (
            self.kill_at is not None
            and self.global_step == self.kill_at
            and self.world_rank == self.world_size - 1
            and not os.path.exists(self.marker)
        ):
            open(self.marker, "w").close()  # the replacement trains on
            os._exit(1)
        return super().train_batch(batch, batch_info)


def _peak_bytes(device: torch.device) -> int:
    """This process's peak memory so far: allocated CUDA memory on a GPU, else resident."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _worker_memory(operator: Any) -> dict[str, float]:
    from torch.distributed.tensor import DTensor

    def size(t: torch.Tensor) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    params = list(operator.model.parameters())
    state = sum(size(p) + (size(p.grad) if p.grad is not None else 0) for p in params)
    state += sum(
        size(v)
        for s in operator.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    return {
        "state_mb": state / 2**20,
        "peak_mb": _peak_bytes(operator.device) / 2**20,
        "built_peak_mb": operator.built_peak_mb,
    }


def _side(side: str, args: argparse.Namespace) -> dict[str, Any]:
    strategy = "ddp" if side == "ddp" else "fsdp"
    marker = os.path.join(tempfile.mkdtemp(prefix="bench-fsdp-"), "killed")
    trainer = TorchTrainer(
        training_operator_cls=_Operator,
        config={
            BATCH_SIZE: args.batch * args.workers,
            "width": args.width,
            "layers": args.layers,
            "steps": args.steps,
            "meta": side == "fsdp_meta",
            # The timed steps start after the warm-up's 2.
            "kill_at": None if args.kill_at is None else 2 + args.kill_at,
            "marker": marker,
        },
        num_workers=args.workers,
        use_gpu="auto",
        strategy=strategy,
        strategy_args={"shard_modules": nn.TransformerEncoderLayer} if strategy == "fsdp" else None,
        snapshot_every=args.snapshot_every if strategy == "fsdp" else "auto",
    )
    try:
        built = trainer.apply_all_operators(_worker_memory)
        result = {
            "built_peak_mb_per_worker": max(m["built_peak_mb"] for m in built),
            "setup_peak_mb_per_worker": max(m["peak_mb"] for m in built),
        }
        if args.steps:
            trainer.train(num_steps=2, max_retries=0)  # warm-up (allocator, first collectives)
            started = time.perf_counter()
            trainer.train(num_steps=args.steps, max_retries=0 if args.kill_at is None else 1)
            elapsed = time.perf_counter() - started
            resizes = [e for e in trainer.recovery_events if e.kind == "resize"]
            if resizes:
                phases = dict(resizes[0].phases)
                result.update(
                    restore_s=phases.get("restore_s", 0.0),
                    recovery_s=sum(phases.values()),
                    restored_from=resizes[0].source,
                )
            memory = trainer.apply_all_operators(_worker_memory)
            result.update(
                samples_per_s=args.steps * args.batch * args.workers / elapsed,
                state_mb_per_worker=max(m["state_mb"] for m in memory),
                peak_mb_per_worker=max(m["peak_mb"] for m in memory),
            )
    finally:
        trainer.shutdown()
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="per worker")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="a small model and few steps")
    parser.add_argument(
        "--kill-at", type=int, default=None, help="the sharded sides lose a worker at this step"
    )
    parser.add_argument(
        "--snapshot-every",
        type=lambda v: v if v == "auto" else int(v),
        default="auto",
        help='the sharded sides\' snapshot_every (an int or "auto")',
    )
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.width, args.layers = 4, 64, 2
    names = ("fsdp", "fsdp_meta") if args.kill_at is not None else ("ddp", "fsdp", "fsdp_meta")
    sides = {side: _side(side, args) for side in names}
    ratios = {
        side: {key: sides[side][key] / base for key, base in sides["ddp"].items() if base}
        for side in ("fsdp", "fsdp_meta")
        if "ddp" in sides
    }
    result = {
        "benchmark": "fsdp",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": _common.machine_info(),
        "args": vars(args),
        "sides": sides,
        "ratio_over_ddp": ratios,
    }
    print(json.dumps({"sides": sides, "ratio_over_ddp": ratios}, indent=2))
    path = Path(args.out) / "fsdp.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()

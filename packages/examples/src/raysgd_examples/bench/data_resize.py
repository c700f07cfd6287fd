"""Rows trained once per epoch across a resize: raysgd fed by a DataLoader vs fed by Ray Data.

Every row carries its id; every worker appends the ids of each step it finished to a file of its
process (which outlives a killed worker). One epoch of `--rows` rows, global batch `--batch`, on 2
workers; at step `--kill-at` rank 1 dies (``os._exit``) and the failure policy goes on with the
survivor alone (a shrink: the epoch's rest is re-split over one worker), or with a replacement
(``--replace``). Reported per side: rows of the epoch trained twice, rows never trained, and the
epoch's total. A DataLoader is split by raysgd's own sampler, which re-splits exactly the rows
left; a Ray Data dataset is split again by ``streaming_split``, which can only skip by count.

    hatch run bench:data_resize [--rows N] [--batch B] [--kill-at S] [--replace] [--repeats N]
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
from typing import Any

from raysgd_examples.bench import _common

__all__ = ["SIDES", "main", "measure"]

SIDES = ("raysgd_loader", "raysgd_data")
_MODULE = "raysgd_examples.bench.data_resize"


def _operator() -> type:
    import numpy as np
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from raysgd import TrainingOperator
    from raysgd.utils import BATCH_SIZE

    class RowsOperator(TrainingOperator):
        def setup(self, config: dict[str, Any]) -> None:
            torch.manual_seed(0)
            model = nn.Linear(1, 1)
            self.register(
                models=model,
                optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
                criterion=nn.MSELoss(),
            )
            if self.get_dataset_shard("train") is None:
                ids = torch.arange(config["rows"])
                x = ids.float().unsqueeze(1) / config["rows"]
                data = TensorDataset(ids, x, 2 * x + 1)
                self.register_data(
                    train_loader=DataLoader(data, batch_size=config[BATCH_SIZE], shuffle=True)
                )

        def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
            ids, x, y = batch
            if (
                self.world_rank == 1
                and batch_info["global_step"] == self.config["kill_at"]
                and not os.path.exists(self.config["marker"])
            ):
                open(self.config["marker"], "w").close()
                os._exit(1)
            metrics = super().train_batch((x, y), batch_info)
            line = " ".join(str(int(i)) for i in np.asarray(ids).ravel())
            with open(os.path.join(self.config["folder"], f"rows-{os.getpid()}"), "a") as f:
                f.write(line + "\n")
            return metrics

    return RowsOperator


def _shrink_policy() -> Any:
    from raysgd_fault import Action, Decision, FailurePolicy, FailureStatus, FixedSize

    class SurvivorsOnly(FailurePolicy):
        name = "survivors-only"
        scaling = FixedSize()  # never grows back

        def decide(self, status: FailureStatus) -> Decision:
            if status.failures > status.max_retries:
                return Decision(Action.GIVE_UP, reason="one recovery only")
            return Decision(Action.RETRY, num_workers=max(1, status.workers_alive), reason="shrink")

    return SurvivorsOnly()


def measure(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """One epoch with one loss (in a child process): rows twice, rows missed, rows trained."""
    import numpy as np
    import ray

    from raysgd import DatasetOptions, TorchTrainer
    from raysgd.utils import BATCH_SIZE

    with tempfile.TemporaryDirectory(prefix="raysgd_bench_") as folder:
        config = {
            BATCH_SIZE: args.batch,
            "rows": args.rows,
            "kill_at": args.kill_at,
            "marker": os.path.join(folder, "killed"),
            "folder": folder,
        }
        with _common.local_ray(num_cpus=4, raysgd=True):
            extra: dict[str, Any] = {}
            if side == "raysgd_data":
                ray.data.DataContext.get_current().enable_progress_bars = False
                ids = np.arange(args.rows)
                ds = ray.data.from_numpy(ids).map_batches(
                    lambda b: {
                        "id": b["data"],
                        "x": (b["data"] / args.rows).astype("float32").reshape(-1, 1),
                        "y": (2 * b["data"] / args.rows + 1).astype("float32").reshape(-1, 1),
                    }
                )
                extra = {
                    "datasets": {"train": ds},
                    "dataset_options": DatasetOptions(columns=("id", "x", "y")),
                }
            if not args.replace:
                extra["failure_policy"] = _shrink_policy()
            trainer = TorchTrainer(
                training_operator_cls=_operator(), config=config, num_workers=2, **extra
            )
            try:
                trainer.train(max_retries=1)
                workers_after = trainer.num_workers
            finally:
                trainer.shutdown()
        seen: list[int] = []
        for name in os.listdir(folder):
            if name.startswith("rows-"):
                with open(os.path.join(folder, name)) as f:
                    seen += [int(token) for token in f.read().split()]
    counts = collections.Counter(seen)
    return {
        "trained": len(seen),
        "twice": sum(c - 1 for c in counts.values() if c > 1),
        "missed": args.rows - len(counts),
        "workers_after": workers_after,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the measurement; print the table; write ``<out>/data_resize.json``."""
    parser = _common.bench_parser(__doc__.splitlines()[0], sides=SIDES, repeats=1)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--kill-at", type=int, default=None, help="step at which rank 1 dies")
    parser.add_argument("--replace", action="store_true", help="replace the lost worker")
    args = _common.parse_args(parser, argv, steps=1, quick_steps=1)
    if args.quick:
        args.rows, args.batch = 256, 16
    if args.kill_at is None:
        args.kill_at = (args.rows // args.batch) // 2
    runs = _common.dispatch(_MODULE, measure, args, SIDES)
    if runs is None:
        return {}
    metrics = [
        _common.metric(name, "rows", False, runs, key, reference="raysgd_loader")
        for name, key in (
            ("rows trained twice in the epoch", "twice"),
            ("rows never trained in the epoch", "missed"),
            ("rows trained in the epoch", "trained"),
        )
    ]
    for m in metrics:
        _common.print_metric(m)
    _common.write_results(args.out, "data_resize", metrics, args)
    return {"metrics": metrics}


if __name__ == "__main__":
    main()

"""The chaos soak's job (`bench.chaos`) and the driver process that trains it.

The job is deterministic and small: an MLP with dropout, gradient accumulation, every rank
drawing its own numbers and carrying a state of its own; each worker writes the rows of every
batch it starts, and where it is (pid, rank, node), to the run's folder, and exits in a phase of a
batch when the orchestrator's ``plan.json`` names its rank. The driver is a process of its own
(``python -m raysgd_examples.bench._chaos_job SPEC``), so that the orchestrator can kill it and
start it again with ``resume=True``; it writes its state to a JSON file every second.

The gradients are summed one parameter at a time (`per_parameter_mean`, a DDP communication
hook), so that the sums do not depend on how DDP lays the parameters out in its buckets: that layout
is another for the first step of every re-formed group (one bucket in the parameters' order,
then the order their gradients came in), and gloo's ring sums each element in an order that
depends on its place in the bucket. Summed by bucket, a recovery that restores everything exactly
still changes a few sums of that step by one unit in the last place of float32, and thousands of
steps later the weights differ by about 1e-4 from the run never interrupted; summed by parameter
they are equal, so the soak can compare the weights at 1e-6.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TrainingOperator
from raysgd.utils import BATCH_SIZE
from raysgd_operator.parallel_strategies import per_parameter_mean

__all__ = ["JOB", "ChaosOperator", "read_json", "run_driver", "write_json"]

#: The job. Steps per epoch (rows / global batch) are a multiple of the window (k), so that an
#: epoch ends at a window's end; the global batch divides by 8, 7 and 6 workers.
JOB: dict[str, Any] = {
    "features": 32,
    "hidden": 256,
    "outputs": 8,
    "global_batch": 168,
    "steps_per_epoch": 128,
    "k": 4,
    "checkpoint_every": 14,
    "lr": 0.02,
    "dropout": 0.2,
}
_MAX_RETRIES = 10**6


class ChaosOperator(TrainingOperator):
    """The job (see the module docstring); `config["chaos"]` holds its sizes and its folder."""

    def setup(self, config: dict[str, Any]) -> None:
        job = config["chaos"]
        torch.set_num_threads(1)
        torch.manual_seed(0)  # one model for every rank
        f, h, p = job["features"], job["hidden"], job["dropout"]
        model = nn.Sequential(
            nn.Linear(f, h), nn.ReLU(), nn.Dropout(p),
            nn.Linear(h, h), nn.ReLU(), nn.Dropout(p),
            nn.Linear(h, job["outputs"]),
        )  # fmt: skip
        optimizer = torch.optim.SGD(model.parameters(), lr=job["lr"], momentum=0.9)
        rows = job["global_batch"] * job["steps_per_epoch"]
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(rows, f, generator=gen)
        y = torch.tanh(x @ torch.randn(f, job["outputs"], generator=gen))
        self.register(models=model, optimizers=optimizer, criterion=nn.MSELoss())
        if isinstance(self.model, nn.parallel.DistributedDataParallel):
            self.model.register_comm_hook(None, per_parameter_mean)
        self.register_data(
            train_loader=DataLoader(
                TensorDataset(x, y, torch.arange(rows)), batch_size=config[BATCH_SIZE], shuffle=True
            )
        )
        # Each rank's own random streams, as a script that seeds by rank has.
        torch.manual_seed(1000 + self.world_rank)
        random.seed(2000 + self.world_rank)
        np.random.seed(3000 + self.world_rank)
        self.carried = torch.zeros(f)
        folder = Path(job["dir"])
        self._k = int(job["k"])
        self._rows = os.open(
            folder / "rows" / f"rows-{os.getpid()}.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND
        )
        self._workers = folder / "workers"
        self._node = _node_id()
        self._stamped: Optional[tuple[int, int]] = None
        self._exit = _PhaseExit(folder, model[0], model[3], optimizer)

    def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
        x, y, ids = batch
        rank, world = self.world_rank, self.world_size
        if self._stamped != (rank, world):
            self._stamp(rank, world)
        step = batch_info["global_step"]
        # The batch's rows, as it starts: of a batch started more than once, the last counts.
        line = (
            f"{batch_info['epoch_idx']} {batch_info['epoch_batch_idx']} {step} {rank} {world} "
            f"{time.time():.6f} {','.join(str(int(i)) for i in ids)}\n"
        )
        os.write(self._rows, line.encode())
        self._exit.arm(rank, world, will_step=(step + 1) % self._k == 0)
        noise = random.random() + float(np.random.rand())
        x = x + 1e-2 * self.carried + 1e-3 * noise
        self.carried = 0.9 * self.carried + x.mean(dim=0)
        return super().train_batch((x, y), batch_info)

    def rank_state_dict(self) -> Any:
        return {"carried": self.carried}

    def load_rank_state_dict(self, state: Any) -> None:
        self.carried = torch.zeros_like(self.carried) if state is None else state["carried"]

    def _stamp(self, rank: int, world: int) -> None:
        stamp = {"pid": os.getpid(), "rank": rank, "world": world, "node": self._node}
        stamp["raysgd"] = str(Path(sys.modules["raysgd"].__file__).parent)
        write_json(self._workers / f"{os.getpid()}.json", {**stamp, "t": time.time()})
        self._stamped = (rank, world)


class _PhaseExit:
    """Exits this process in a phase of a batch when ``plan.json`` of the run's folder names
    its rank (once per plan: the first process to get there leaves a marker)."""

    def __init__(self, folder: Path, first: nn.Module, middle: nn.Module, optimizer: Any) -> None:
        self._plan_path = folder / "plan.json"
        self._folder = folder
        self._armed: Optional[dict[str, Any]] = None
        # Bound methods, not closures: the model travels to the driver (`get_model`) with them.
        first.register_forward_pre_hook(self._forward)
        middle.register_full_backward_pre_hook(self._backward)
        optimizer.register_step_pre_hook(self._step)
        optimizer.register_step_post_hook(self._after_step)

    def _forward(self, *args: Any) -> None:
        self._fire("forward")

    def _backward(self, *args: Any) -> None:
        self._fire("backward")

    def _step(self, *args: Any) -> None:
        self._fire("step")

    def _after_step(self, *args: Any) -> None:
        self._fire("after_step")

    def arm(self, rank: int, world: int, *, will_step: bool) -> None:
        self._armed = None
        if not self._plan_path.exists():
            return
        try:
            plan = json.loads(self._plan_path.read_text())
        except (OSError, ValueError):
            return
        if (plan["rank"], plan["world"]) != (rank, world):
            return
        if plan["phase"] in ("step", "after_step") and not will_step:
            return
        if not (self._folder / f"exit-{plan['id']}").exists():
            self._armed = plan

    def _fire(self, phase: str) -> None:
        plan = self._armed
        if plan is None or plan["phase"] != phase:
            return None
        self._armed = None
        try:
            marker = self._folder / f"exit-{plan['id']}"
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return None
        os._exit(1)


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def write_json(path: Path, payload: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def read_json(path: Path) -> Optional[Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _make_trainer(spec: dict[str, Any]) -> Any:
    from raysgd import TorchTrainer
    from raysgd_fault import DefaultPolicy

    job = spec["job"]
    return TorchTrainer(
        training_operator_cls=ChaosOperator,
        config={BATCH_SIZE: job["global_batch"], "chaos": {**job, "dir": spec["dir"]}},
        num_workers=spec["workers"],
        num_cpus_per_worker=1,
        use_gpu=False,
        backend="gloo",
        accumulate_grad_batches=job["k"],
        spare_workers=spec["spares"],
        failure_policy=DefaultPolicy(replace_in_background=False),
        checkpoint_dir=spec["checkpoint_dir"],
        checkpoint_every=job["checkpoint_every"],
        keep_checkpoints=3,
        resume=spec["resume"],
        peer_timeout_s=spec["peer_timeout_s"],
    )


def _event(e: Any) -> dict[str, Any]:
    return {
        "kind": e.kind,
        "t": e.timestamp,
        "before": e.num_workers_before,
        "after": e.num_workers_after,
        "steps_redone": e.steps_redone,
        "inexact": list(e.inexact),
        "preempted": e.preempted,
        "source": e.source,
        "duration_s": round(e.duration_s, 3),
        "message": e.message[:400],
    }


class _Status:
    """The driver's state in a JSON file, written every second from a thread (a killed driver
    leaves its counts up to its last second)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.fields: dict[str, Any] = {"pid": os.getpid(), "phase": "starting"}
        self.trainer: Any = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def write(self, **fields: Any) -> None:
        with self._lock:
            self._write(fields)

    def _write(self, fields: dict[str, Any]) -> None:
        self.fields.update(fields)
        snapshot = dict(self.fields)
        trainer = self.trainer
        if trainer is not None:
            try:
                events = trainer.recovery_events
                snapshot.update(
                    failures=trainer.failures,
                    moves=sum(1 for e in events if e.kind == "preemption"),
                    epoch=trainer.epoch,
                    goodput=trainer.goodput(),
                    events=[_event(e) for e in events],
                )
            except Exception as exc:  # a snapshot taken mid-change: the next one will do
                snapshot["snapshot_error"] = repr(exc)
        snapshot["t"] = time.time()
        write_json(self.path, snapshot)

    def start(self, trainer: Any) -> None:
        self.trainer = trainer
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.write()


def run_driver(spec_path: str) -> None:
    """The driver process: train until the deadline (or `epochs`), then save the weights."""
    import ray

    import raysgd

    spec = json.loads(Path(spec_path).read_text())
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True
    )
    ray.init(address=spec["address"], log_to_driver=True)
    status = _Status(spec["status"])
    status.write(phase="constructing", raysgd=str(Path(raysgd.__file__).parent))
    trainer = _make_trainer(spec)
    resumed = trainer.apply_all_operators(lambda op: op.global_step)[0]
    status.write(phase="training", resumed_step=resumed, resumed_epoch=trainer.epoch)
    status.start(trainer)
    started = time.time()
    # A driver resumed inside an epoch finishes it whatever the time: the run ends at an epoch's
    # end, where the reference stops too.
    mid_epoch = resumed != trainer.epoch * spec["job"]["steps_per_epoch"]
    while True:
        if spec["epochs"] is not None:
            if trainer.epoch >= spec["epochs"]:
                break
        elif not mid_epoch:
            deadline = read_json(Path(spec["deadline"]))
            if deadline is not None and time.time() >= deadline:
                break
        trainer.train(max_retries=_MAX_RETRIES)
        mid_epoch = False
        status.write(epochs_done=trainer.epoch)
    ended = time.time()
    status.stop()
    weights = {k: v.detach().cpu().clone() for k, v in trainer.get_model().state_dict().items()}
    torch.save(weights, spec["weights"])
    status.write(phase="done", loop_s=ended - started, loop_start=started, loop_end=ended)
    trainer.shutdown()


if __name__ == "__main__":
    # Through the package, not as __main__: the workers unpickle the operator from its module.
    from raysgd_examples.bench._chaos_job import run_driver as _run

    _run(sys.argv[1])

"""Goodput under a failure rate: the same job with and without failures, raysgd beside torchrun and
Ray Train.

The job: the benchmark CNN (`workload.py`), `--workers` workers (2 by default), `--steps` steps. Each side runs it once
without failures (its own 1.0 line) and once per failure schedule; goodput is the clean run's wall
time over the run's (the share of the time that went into work that was kept, as Meta's effective
training time ratio counts it). Also reported: the steps done again, and the recoveries.

Schedules:

- ``kill30`` / ``kill60``: a random worker is killed (SIGKILL) every 30 / 60 seconds (any
  ``kill<seconds>`` works);
- ``freeze``: one worker is stopped (SIGSTOP) once, at a third of the job: alive, connections
  open, never answering, as a frozen or partitioned machine (it is killed after `--freeze-for`
  seconds, as a machine that comes back rebooted would be);
- ``drain``: one preemption notice at a third of the job: the node of one worker gets Ray's notice
  (``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``) and is removed `--deadline` seconds
  later, as a cloud reclaims a spot machine. The Ray sides run on a `ray.cluster_utils.Cluster` (a
  head without CPUs and one 1-CPU node per worker, plus one to move to) and take their 1.0 line from
  a run without the notice on the same cluster. torchrun does not see Ray's notices: its worker is
  killed at the deadline, when the machine goes.

Sides:

- raysgd: ``train(num_steps=steps, max_retries=100)``: survivors keep their state, the lost
  worker is replaced, the interrupted call goes on from the last finished step. No checkpoint is
  needed for that.
- raysgd_elastic: the same with ``failure_policy="elastic"``: the survivor trains on alone at once
  (the same global batch, so at half the speed on this machine) while the lost worker's
  replacement starts beside it, and the replacement joins at a step boundary once it is up.
- raysgd_spare: the same as raysgd with ``spare_workers=1``: a worker started ahead (its process, torch
  and the first optimizer's imports paid) takes the lost rank, and the next spare starts behind
  it. On this benchmark's one machine that next spare's start takes CPU from the two workers; on a
  cluster it runs on a CPU of its own.
- torchrun: ``torchrun --max-restarts=100``, its documented practice: every process restarts after
  a failure and resumes from a checkpoint rank 0 writes every `--checkpoint-every` steps.
- ray_train: Ray Train's `TorchTrainer` with ``FailureConfig(max_failures=100)``, reporting a
  checkpoint every `--checkpoint-every` steps and resuming from ``ray.train.get_checkpoint()``;
  under ``drain``, its preemption handling instead (a just-in-time checkpoint on the notice, every
  worker restarted from it once the node is gone, as `bench:preemption` runs it).

Goal: raysgd's goodput at least 0.9 at one failure a minute, and at least 1.5 x Ray Train's on the
same schedule.

    hatch run bench:goodput [--quick] [--steps N] [--schedules kill30,kill60,freeze,drain]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from raysgd_examples.bench import _common, _drain

__all__ = ["SCHEDULES", "SIDES", "main", "measure"]

SIDES = ("raysgd", "raysgd_elastic", "raysgd_spare", "torchrun", "ray_train")
SCHEDULES = ("clean", "kill30", "kill60", "freeze", "drain")
_OURS = ("raysgd", "raysgd_elastic", "raysgd_spare")
_RAY_SIDES = (*_OURS, "ray_train")
_MODULE = "raysgd_examples.bench.goodput"


def _trainer_options(side: str) -> dict[str, Any]:
    """What sets one raysgd side apart from the plain one."""
    if side == "raysgd_spare":
        return {"spare_workers": 1}
    if side == "raysgd_elastic":
        return {"failure_policy": "elastic"}
    return {}


class Injector:
    """Kills (or freezes) a worker on a schedule, from a thread of the measuring process.

    Args:
        schedule: One of `SCHEDULES`.
        pids: Returns the worker processes' pids now.
        job_s: The clean run's wall time (the freeze comes at a third of it).
        kill_after_s: Seconds a frozen worker stays stopped before it is killed; under
            ``drain``, the notice's deadline: the worker is killed then, its machine gone (for a
            side that does not see Ray's notices).
        seed: The random choice of the worker.
    """

    def __init__(
        self,
        schedule: str,
        pids: Callable[[], list[int]],
        job_s: float,
        kill_after_s: float,
        seed: int = 0,
    ) -> None:
        self.schedule, self.pids = schedule, pids
        self.job_s, self.kill_after_s = job_s, kill_after_s
        self.rng = random.Random(seed)
        self.injected = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Injector:
        if self.schedule != "clean":
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()

    def _victim(self) -> Optional[int]:
        alive = [pid for pid in self.pids() if _common.process_alive(pid)]
        return self.rng.choice(alive) if alive else None

    def _run(self) -> None:
        if self.schedule in ("freeze", "drain"):
            if self._stop.wait(self.job_s / 3):
                return
            pid = self._victim()
            if pid is None:
                return
            if self.schedule == "freeze":
                os.kill(pid, signal.SIGSTOP)
                self.injected += 1
                self._stop.wait(self.kill_after_s)  # killed even after the job: it is stopped
            elif self._stop.wait(self.kill_after_s):
                return  # drain: the job ended before its machine went
            else:
                self.injected += 1
            os.kill(pid, signal.SIGKILL)
            return
        every = float(self.schedule.removeprefix("kill"))
        while not self._stop.wait(every):
            pid = self._victim()
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                self.injected += 1


def _timeline_pids(path: str) -> Callable[[], list[int]]:
    """The newest pid of every rank, as the workers stamp them in the timeline."""
    from raysgd_examples.bench.workload import Timeline

    def read() -> list[int]:
        newest: dict[int, int] = {}
        for event in Timeline(path).read():
            if event["event"] == "pid":
                newest[int(event["rank"])] = int(event["pid"])
        return list(newest.values())

    return read


def measure(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """One side through every schedule (in a child process): wall time, steps done again and
    recoveries per schedule."""
    from raysgd_examples.bench._loop import steps_done_twice
    from raysgd_examples.bench.workload import Timeline, Workload

    workload = Workload.quick() if args.quick else Workload()
    result: dict[str, Any] = {}
    # The 1.0 lines: the clean run, and for a Ray side's drain the same cluster without a notice.
    lines: dict[str, float] = {}
    schedules = ["clean", *args.schedule_list]
    if "drain" in schedules and side in _RAY_SIDES:
        schedules.insert(schedules.index("drain"), "drain_clean")
    for schedule in schedules:
        line = "drain_clean" if schedule == "drain" and "drain_clean" in lines else "clean"
        with tempfile.TemporaryDirectory(prefix="raysgd_bench_goodput_") as tmp:
            cfg = {
                "workload": workload.to_dict(),
                "warmup": 0,
                "steps": args.steps,
                "timeline": os.path.join(tmp, "timeline.jsonl"),
                "checkpoint": {
                    "path": os.path.join(tmp, "checkpoint.pt"),
                    "every": args.checkpoint_every,
                },
            }
            job_s = lines.get(line, 60.0)
            started = time.perf_counter()
            recoveries, trainer_lost = _run_side(side, schedule, cfg, args, job_s)
            wall = time.perf_counter() - started
            if schedule in ("clean", "drain_clean"):
                lines[schedule] = wall
            result[schedule] = {
                "wall_s": wall,
                "goodput": lines.get(schedule, lines.get(line, wall)) / wall,
                "steps_redone": steps_done_twice(Timeline(cfg["timeline"])),
                "recoveries": recoveries,
            }
            if trainer_lost:
                # Where a raysgd trainer itself says the time went (its goodput()'s causes).
                result[schedule]["trainer_lost_s"] = trainer_lost
            print(f"    {side} {schedule}: {result[schedule]}", flush=True)
    return result


def _run_side(
    side: str, schedule: str, cfg: dict[str, Any], args: argparse.Namespace, job_s: float
) -> tuple[int, dict[str, float]]:
    """Run the job once under `schedule`; the failures injected, and for a raysgd side the
    seconds its trainer counted lost, by cause."""
    if schedule in ("drain", "drain_clean") and side in _RAY_SIDES:
        return _run_drained(side, schedule == "drain", cfg, args, job_s), {}
    if side in _OURS:
        from raysgd_examples.bench import _raysgd

        with _common.local_ray(num_cpus=args.workers + 2, settle=True, raysgd=True):
            trainer = _raysgd.make_trainer(
                {**cfg, "checkpoint": None}, num_workers=args.workers, **_trainer_options(side)
            )
            try:
                pids = lambda: [w.pid for w in trainer.worker_group.workers]  # noqa: E731
                with Injector(schedule, pids, job_s, _kill_after(schedule, args)) as injector:
                    trainer.train(num_steps=cfg["steps"], max_retries=100)
                lost = {k: round(v, 2) for k, v in trainer.goodput()["lost_s"].items() if v}
                return injector.injected, lost
            finally:
                trainer.shutdown(force=True)
    pids = _timeline_pids(cfg["timeline"])
    with Injector(schedule, pids, job_s, _kill_after(schedule, args)) as injector:
        if side == "torchrun":
            _common.run_torchrun(
                "raysgd_examples.bench._torchrun_worker",
                [json.dumps(cfg)],
                nproc=args.workers,
                extra=["--max-restarts=100"],
                timeout=args.timeout,
            )
        elif side == "ray_train":
            from raysgd_examples.bench import _ray_train

            with _common.local_ray(num_cpus=max(4, args.workers + 2), settle=True):
                _ray_train.fit({**cfg, "report": True}, num_workers=args.workers, max_failures=100)
        else:
            raise ValueError(f"unknown side {side!r}")
    return injector.injected, {}


def _kill_after(schedule: str, args: argparse.Namespace) -> float:
    return args.deadline if schedule == "drain" else args.freeze_for


def _run_drained(
    side: str, notice: bool, cfg: dict[str, Any], args: argparse.Namespace, job_s: float
) -> int:
    """A Ray side on a `Cluster`, rank 1's node drained at a third of the job (`notice`) or not;
    the notices given."""
    from raysgd_examples.bench.workload import Timeline

    spare = side == "raysgd_spare"
    with _drain.cluster(nodes=4 if spare else 3) as cluster:
        nodes: list[str] = []
        started = [float("inf")]

        def due() -> bool:
            return notice and time.monotonic() >= started[0] + job_s / 3

        def victim() -> str:
            return _drain.timeline_node(Timeline(cfg["timeline"]), 1) if not nodes else nodes[1]

        reclaim = _drain.Reclaimer(cluster, due, victim, args.deadline)
        try:
            if side == "ray_train":
                from raysgd_examples.bench import _ray_train

                started[0] = time.monotonic()
                _ray_train.fit_preemptible(cfg, num_workers=2)
            else:
                from raysgd_examples.bench import _raysgd

                trainer = _raysgd.make_trainer(
                    {**cfg, "checkpoint": None}, num_workers=2, **_trainer_options(side)
                )
                try:
                    nodes.extend(_drain.worker_nodes(trainer))
                    started[0] = time.monotonic()
                    trainer.train(num_steps=cfg["steps"], max_retries=100)
                finally:
                    trainer.shutdown(force=True)
        finally:
            reclaim.stop()
        return int("notice" in reclaim.times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table; write ``<out>/goodput.json`` and a chart."""
    parser = _common.bench_parser(__doc__.splitlines()[0], sides=SIDES, repeats=1, timeout_s=3600.0)
    parser.add_argument("--schedules", default="kill30,kill60,freeze")
    parser.add_argument("--workers", type=int, default=2, help="workers per side (not drain)")
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--freeze-for", type=float, default=120.0)
    parser.add_argument(
        "--deadline", type=int, default=30, help="drain: seconds from the notice to the reclaim"
    )
    args = _common.parse_args(parser, argv, steps=1500, quick_steps=60)
    args.schedule_list = [s for s in args.schedules.split(",") if s]
    unknown = [
        s
        for s in args.schedule_list
        if s not in SCHEDULES and not (s.startswith("kill") and s[4:].isdigit())
    ]
    if unknown:
        parser.error(f"--schedules: unknown {unknown} (kill<seconds>, freeze, drain)")
    runs = _common.dispatch(_MODULE, measure, args, SIDES)
    if runs is None:
        return {}
    table: dict[str, dict[str, Any]] = {}
    print(f"\ngoodput (clean wall time / wall time; {args.steps} steps, {args.workers} workers)")
    header = "".join(f"{s:>22}" for s in args.schedule_list)
    print(f"  {'side':<12}{header}")
    for side, side_runs in runs.items():
        run = side_runs[0]
        if "error" in run:
            print(f"  {side:<12} error: {run['error'].splitlines()[0][:100]}")
            continue
        table[side] = run
        cells = []
        for schedule in args.schedule_list:
            r = run[schedule]
            cells.append(
                f"{r['goodput']:.2f} ({r['recoveries']}x, {r['steps_redone']} redone)".rjust(22)
            )
        print(f"  {side:<12}{''.join(cells)}")
    ratios: dict[str, dict[str, float]] = {}
    for ours in _OURS:
        if ours not in table or "ray_train" not in table:
            continue
        ratios[ours] = {
            schedule: table[ours][schedule]["goodput"]
            / max(1e-9, table["ray_train"][schedule]["goodput"])
            for schedule in args.schedule_list
        }
        cells = ", ".join(f"{k} {v:.2f}x" for k, v in ratios[ours].items())
        print(f"  {ours} / ray_train: {cells}")
    metric = {"metric": "goodput", "sides": table, "vs_ray_train": ratios}
    _common.write_results(args.out, "goodput", [metric], args, steps=args.steps)
    _chart(table, args)
    return metric


def _chart(table: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """goodput.png: goodput per schedule, one bar per side."""
    plt = _common.pyplot()
    schedules = args.schedule_list
    fig, ax = plt.subplots(figsize=(8.5, 3.5))
    width = 0.8 / max(1, len(table))
    for i, (side, run) in enumerate(table.items()):
        xs = [j + i * width for j in range(len(schedules))]
        ax.bar(xs, [run[s]["goodput"] for s in schedules], width, label=side)
    ax.set_xticks([j + width * (len(table) - 1) / 2 for j in range(len(schedules))])
    ax.set_xticklabels(schedules)
    ax.set_ylabel("goodput (clean time / time)")
    ax.set_ylim(0, 1.05)
    ax.axhline(0.9, color="grey", linewidth=0.8, linestyle="--")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars
    ax.set_title(f"goodput, {args.steps} steps, 2 workers")
    print(f"wrote {_common.save_figure(fig, Path(args.out) / 'goodput.png')}")


if __name__ == "__main__":
    main()

"""Recovery time: a worker dies (``os._exit(1)`` at step k); seconds until the next finished step.

Sides, all on the same 2-worker job (`workload.py`), each run in a fresh process:

- raysgd: ``train(max_retries=1)``; rank 1 dies; the survivor is kept and re-joined ("keep-healthy",
  the path the trainer takes when it can; the path it reports is recorded).
- raysgd_fsdp: as raysgd with ``strategy="fsdp"``: the lost worker's shards come back from the
  survivor's in-memory replica and every worker rebuilds its sharded model for the new group.
  ``--snapshot-every K`` sets its `snapshot_every` (the trainer's default, "auto", otherwise);
  it redoes the steps since the last snapshot, and ``step_s`` (the median step before the kill)
  shows what the snapshots cost the steps.
- raysgd_all_killed: every rank dies at step k, so every worker is started anew. The trainer has
  no switch to force its "full-restart" path (it falls back to it only when re-joining survivors
  fails), so this is the cost of that path (new processes, imports, data) measured the only way a
  user can cause it; the trainer then reports "keep-healthy" with no survivor kept.
- raysgd_digits: the digits CNN of `raysgd_examples.digits` (a real job: its data set, Adam, a
  shuffled loader), rank 1 dies; the job where a user sees recovery.
- raysgd_spare, raysgd_fsdp_spare, raysgd_digits_spare: those sides with ``spare_workers=1``; the clock
  starts once the spare is up (as it is in a job that has trained for a few seconds), so the lost
  worker is replaced by the spare instead of a process started after the loss.
- raysgd_elastic: as raysgd with ``failure_policy="elastic"``: the survivors go on at once at the
  smaller size while the replacement starts, and it joins at a step boundary once it is up (the
  default policy does the same from 4 workers up, where three quarters survive).
  ``join_s`` is what that join costs the loop (the gap between the steps around it, less a
  step's time): the rest of its price, paid after the next step. A raysgd side whose call ends
  before the join trains on, two steps a call, until it has joined.
- ray_train: Ray Train `TorchTrainer` with ``FailureConfig(max_failures=1)``; rank 1 dies.
- torchrun: ``torchrun --max-restarts=1``; rank 1 dies, the agent restarts both processes.

The dying worker stamps the wall-clock time of its death in a timeline file; rank 0 (whichever
process it is by then) stamps every finished step; the result is the gap between the two. The
steps done again per failure come from the same stamps: from the first step stamped after the kill
back to the step the worker died in (1: only the step in flight; kill step + 1: started over). The raysgd
sides also report its phases, from the trainer's recovery events: detect (kill -> the loop sees the
loss), start (replacement actors up; the survivors leave the old group meanwhile), re-form (the new
process group), restore (runners re-bound or built, last good state loaded) and redo (-> the first
step of the redone epoch).
Goal: raysgd recovers in half the time of a restart-all peer and redoes at most the step in flight.

    hatch run bench:recovery [--quick] [--repeats N] [--steps N] [--kill-at K]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any, Optional

from raysgd_examples.bench import _common

__all__ = ["PHASES", "SIDES", "main", "measure", "phases"]

SIDES = (
    "raysgd",
    "raysgd_fsdp",
    "raysgd_all_killed",
    "raysgd_digits",
    "raysgd_spare",
    "raysgd_fsdp_spare",
    "raysgd_digits_spare",
    "raysgd_elastic",
    "torchrun",
    "ray_train",
)
#: The phases of a raysgd recovery, in order (seconds each; see the module docstring).
PHASES = ("detect_s", "start_s", "reform_s", "restore_s", "redo_s")
_MODULE = "raysgd_examples.bench.recovery"


def _loop_config(args: argparse.Namespace) -> dict[str, Any]:
    from raysgd_examples.bench.workload import Workload

    workload = Workload.quick() if args.quick else Workload()
    return {"workload": workload.to_dict(), "warmup": 0, "steps": args.steps}


def measure(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of one side (in a child process): ``{"recovery_s": ...}``."""
    from raysgd_examples.bench._loop import recovery_from_timeline, steps_redone_from_timeline
    from raysgd_examples.bench.workload import Timeline

    cfg = _loop_config(args)
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="raysgd_bench_") as tmp:
        cfg.update(
            timeline=os.path.join(tmp, "timeline.jsonl"),
            marker=os.path.join(tmp, "killed"),
            kill_at=args.kill_at,
            kill_rank="all" if side == "raysgd_all_killed" else 1,
        )
        if side == "torchrun":
            _common.run_torchrun(
                "raysgd_examples.bench._torchrun_worker",
                [json.dumps(cfg)],
                nproc=args.workers,
                extra=["--max-restarts=1"],
                timeout=args.timeout,
            )
        elif side == "ray_train":
            from raysgd_examples.bench import _ray_train

            with _common.local_ray(num_cpus=max(4, args.workers + 2), settle=True):
                _ray_train.fit(cfg, num_workers=args.workers, max_failures=1)
        elif side.startswith("raysgd"):
            from raysgd_examples.bench import _digits, _raysgd

            base = side.removesuffix("_spare").removesuffix("_elastic")
            make = _digits.make_trainer if base == "raysgd_digits" else _raysgd.make_trainer
            # raysgd_fsdp: the same job sharded; the lost shards come back from a peer's replica
            extra: dict[str, Any] = {"strategy": "fsdp"} if base == "raysgd_fsdp" else {}
            if base == "raysgd_fsdp" and args.snapshot_every is not None:
                extra["snapshot_every"] = _snapshot_every(args.snapshot_every)
            if side.endswith("_spare"):
                extra["spare_workers"] = 1
            if side.endswith("_elastic"):
                extra["failure_policy"] = "elastic"
            with _common.local_ray(num_cpus=args.workers + 2, settle=True, raysgd=True):
                trainer = make(cfg, num_workers=args.workers, **extra)
                try:
                    if side.endswith("_spare"):
                        _wait_for_spare(trainer)
                    trainer.train(num_steps=cfg["steps"], max_retries=1)
                    # A replacement started in the background joins at a later step boundary:
                    # train on, a few steps a call, until it has, so that its join is measured.
                    deadline = time.monotonic() + args.timeout / 4
                    while trainer.num_workers < args.workers and time.monotonic() < deadline:
                        trainer.train(num_steps=2, max_retries=1)
                    events = trainer.recovery_events
                    paths = [e.path for e in events if getattr(e, "path", None)]
                    result.update(path=",".join(paths), failures=trainer.failures)
                    result.update(phases(events, Timeline(cfg["timeline"]).read()))
                finally:
                    trainer.shutdown()
        else:
            raise ValueError(f"unknown side {side!r}")
        result["recovery_s"] = recovery_from_timeline(Timeline(cfg["timeline"]))
        result["steps_redone"] = steps_redone_from_timeline(Timeline(cfg["timeline"]))
        before = step_s_before_kill(Timeline(cfg["timeline"]))
        if before is not None:
            result["step_s"] = before
    return result


def _snapshot_every(value: str) -> Any:
    return value if value == "auto" else int(value)


def step_s_before_kill(timeline: Any) -> Optional[float]:
    """The median time between two consecutive steps stamped before the kill (None: too few)."""
    import statistics

    events = timeline.read()
    kill = min(e["t"] for e in events if e["event"] == "kill")
    stamps = sorted(e["t"] for e in events if e["event"] == "step" and e["t"] < kill)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return statistics.median(gaps) if gaps else None


def _wait_for_spare(trainer: Any, timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not trainer.worker_group.spares:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the spare worker was not up after {timeout_s:g} s")
        time.sleep(0.1)


def phases(events: list[Any], timeline: list[dict[str, Any]]) -> dict[str, float]:
    """The phases of the first recovery (`PHASES`), from the trainer's recovery events and the
    timeline's kill and step stamps (wall-clock times, comparable across processes)."""
    kill = min(e["t"] for e in timeline if e["event"] == "kill")
    failure = next(e for e in events if e.kind == "failure")
    resize = next(e for e in events if e.kind == "resize" and e.timestamp >= failure.timestamp)
    step = min(e["t"] for e in timeline if e["event"] == "step" and e["t"] > resize.timestamp)
    times = dict(resize.phases)
    return {
        "detect_s": failure.timestamp - kill,
        "start_s": times.get("start_s", 0.0),
        "reform_s": times.get("form_s", 0.0),
        "restore_s": times.get("restore_s", 0.0),
        "redo_s": step - resize.timestamp,
        **_join(events, timeline, failure.timestamp),
    }


def _join(events: list[Any], timeline: list[dict[str, Any]], after: float) -> dict[str, float]:
    """``join_s``: the pause a later grow (a replacement joining at a step boundary) cost the
    loop: the gap between the steps stamped around it, less the median gap between steps.
    Empty when no grow followed the recovery."""
    import statistics

    grows = [
        e
        for e in events
        if e.kind == "resize"
        and e.timestamp > after
        and (e.num_workers_after or 0) > (e.num_workers_before or 0)
    ]
    stamps = sorted(e["t"] for e in timeline if e["event"] == "step")
    if not grows or len(stamps) < 3:
        return {}
    grow = grows[0]
    begun = grow.timestamp - grow.duration_s
    before = [t for t in stamps if t <= begun]
    later = [t for t in stamps if t >= grow.timestamp]
    if not before or not later:
        return {}
    step = statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
    return {"join_s": max(0.0, later[0] - before[-1] - step)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table; write ``<out>/recovery.json``."""
    parser = _common.bench_parser(__doc__.splitlines()[0], sides=SIDES, repeats=3)
    parser.add_argument("--kill-at", type=int, default=None, help="step at which a rank dies")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--snapshot-every", default=None, help='raysgd_fsdp: its snapshot_every (an int or "auto")'
    )
    args = _common.parse_args(parser, argv, steps=10, quick_steps=4)
    if args.kill_at is None:
        args.kill_at = 1 if args.quick else 3
    if not 0 <= args.kill_at < args.steps:
        parser.error(f"--kill-at must be in [0, --steps), got {args.kill_at}")
    runs = _common.dispatch(_MODULE, measure, args, SIDES)
    if runs is None:
        return {}
    m = _common.metric(
        "recovery after a worker is killed",
        "s",
        False,
        runs,
        "recovery_s",
        note="kill -> next finished step; raysgd_all_killed: every rank killed",
    )
    _common.print_metric(m)
    redone = _common.metric(
        "steps redone per failure",
        "steps",
        False,
        runs,
        "steps_redone",
        note="1 = only the step in flight; kill step + 1 = the run started over",
    )
    _common.print_metric(redone)
    raysgd_runs = {side: r for side, r in runs.items() if side.startswith("raysgd")}
    parts = [
        _common.metric(f"recovery phase {key[:-2]}", "s", False, raysgd_runs, key) for key in PHASES
    ]
    if raysgd_runs:
        print("\nraysgd recovery phases (s, median): " + ", ".join(PHASES))
        for side in raysgd_runs:
            cells = [p["sides"][side].get("median") for p in parts]
            text = "  ".join("   -  " if c is None else f"{c:6.3f}" for c in cells)
            print(f"  {side:<22} {text}")
    _common.write_results(
        args.out, "recovery", [m, redone, *parts], args, workload=_loop_config(args)
    )
    return m


if __name__ == "__main__":
    main()

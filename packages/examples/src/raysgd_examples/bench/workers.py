"""Cost against the worker count: recovery, the first step and the per-call overhead, 2 to 16 workers.

For each count N (``--counts``), every measurement a child process of its own, the sides in one run:

- recovery after rank 1 is killed (`bench:recovery`'s sides ``raysgd``, ``raysgd_spare``,
  ``torchrun``, ``ray_train`` at ``--workers N``): kill -> the next finished step, the steps
  redone, and raysgd's phases (detect, start, re-form, restore, redo). "held" is detect + re-form
  + restore: what the group itself costs, apart from a replacement's process start (CPU-bound
  on this machine, where it shares the cores with every other process) and the step redone
  (which takes a step's time, longer with more workers on the same cores). From 4 workers the
  default policy lets the survivors go on while the replacement starts; ``join`` is what its
  join at a later step boundary costs the loop, and ``+join/tr`` counts it in the ratio.
- the first step (`bench:startup`'s warm sides): raysgd from constructing the trainer to the end
  of ``train(num_steps=1)``, Ray Train from constructing its trainer to its first reported step,
  torchrun from its launch.
- the driver's overhead of one ``train(num_steps=1)`` call (raysgd): the call's wall time less the
  workers' own time in it (``profile=True``'s ``mean_train_epoch_s``), the median of
  ``--calls`` calls.

Writes ``<out>/workers.json`` and ``<out>/workers.png`` (recovery by worker count, one line a
side, and raysgd's phases).

    hatch run bench:workers [--counts 2,4,8,16] [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Optional

from raysgd_examples.bench import _common, recovery

__all__ = ["RECOVERY_SIDES", "STARTUP_SIDES", "chart", "main", "measure", "table"]

RECOVERY_SIDES = ("raysgd", "raysgd_spare", "torchrun", "ray_train")
STARTUP_SIDES = ("raysgd_warm", "torchrun", "ray_train_warm")
#: This module's own side: the driver's overhead of a call.
CALL_SIDE = "raysgd_call"
_MODULE = "raysgd_examples.bench.workers"
_HELD = ("detect_s", "reform_s", "restore_s")


def _call_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """`args.calls` calls of ``train(num_steps=1)`` on `args.workers` workers: the median wall
    time of a call and of the workers' time in it."""
    from raysgd_examples.bench import _raysgd
    from raysgd_examples.bench.workload import Workload

    workload = Workload.quick() if args.quick else Workload()
    cfg = {"workload": workload.to_dict(), "warmup": 0, "steps": args.calls + 2}
    with _common.local_ray(num_cpus=args.workers + 2, settle=True, raysgd=True):
        trainer = _raysgd.make_trainer(cfg, num_workers=args.workers)
        try:
            trainer.train(num_steps=1)  # the first call builds the loader and DDP's buckets
            walls, inside = [], []
            for _ in range(args.calls):
                start = time.perf_counter()
                result = trainer.train(num_steps=1, profile=True)
                walls.append(time.perf_counter() - start)
                inside.append(result["profile"]["mean_train_epoch_s"])
        finally:
            trainer.shutdown()
    call_s, worker_s = statistics.median(walls), statistics.median(inside)
    return {"call_s": call_s, "worker_s": worker_s, "overhead_s": call_s - worker_s}


def measure(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of this module's own side (in a child process)."""
    if side != CALL_SIDE:
        raise ValueError(f"unknown side {side!r}")
    return _call_overhead(args)


def _common_argv(args: argparse.Namespace, count: int) -> list[str]:
    argv = ["--workers", str(count), "--repeats", "1", "--timeout", str(args.timeout)]
    return [*argv, "--quick"] if args.quick else argv


def _run(module: str, side: str, argv: list[str], timeout: float) -> dict[str, Any]:
    try:
        return _common.run_child(module, side, argv, timeout)
    except Exception as exc:  # a side that fails or runs out of time must not hide the others
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return {"error": f"{type(exc).__name__}: {first}"[:200]}


def _sweep(args: argparse.Namespace) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """Every count's runs: ``{count: {"recovery/<side>": [...], "startup/<side>": [...],
    "call": [...]}}``."""
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for count in args.counts:
        per: dict[str, list[dict[str, Any]]] = {}
        for rep in range(args.repeats):
            shared = _common_argv(args, count)
            recovery_argv = [*shared, "--kill-at", str(args.kill_at), "--steps", str(args.steps)]
            for side in RECOVERY_SIDES:
                result = _run(recovery._MODULE, side, recovery_argv, args.timeout)
                per.setdefault(f"recovery/{side}", []).append(result)
                print(f"  [{count} workers, {rep + 1}/{args.repeats}] recovery {side}: {result}")
            for side in STARTUP_SIDES:
                argv = [*shared, "--launched", repr(time.time())]
                result = _run("raysgd_examples.bench.startup", side, argv, args.timeout)
                per.setdefault(f"startup/{side}", []).append(result)
                print(f"  [{count} workers, {rep + 1}/{args.repeats}] first step {side}: {result}")
            call_argv = [*shared, "--calls", str(args.calls)]
            result = _run(_MODULE, CALL_SIDE, call_argv, args.timeout)
            per.setdefault("call", []).append(result)
            print(f"  [{count} workers, {rep + 1}/{args.repeats}] call overhead: {result}")
        runs[count] = per
    return runs


def _median(side_runs: list[dict[str, Any]], key: str) -> Optional[float]:
    values = [float(r[key]) for r in side_runs if key in r]
    return statistics.median(values) if values else None


def table(runs: dict[int, dict[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """One row per count: the medians of every figure, and the ratios the goals are set on."""
    rows = []
    for count, per in runs.items():
        row: dict[str, Any] = {"workers": count}
        for side in RECOVERY_SIDES:
            side_runs = per.get(f"recovery/{side}", [])
            row[f"recovery_{side}"] = _median(side_runs, "recovery_s")
            row[f"redone_{side}"] = _median(side_runs, "steps_redone")
            if side.startswith("raysgd"):
                for phase in recovery.PHASES:
                    row[f"{side}_{phase}"] = _median(side_runs, phase)
                row[f"join_{side}"] = _median(side_runs, "join_s")
                held = [_median(side_runs, p) for p in _HELD]
                row[f"held_{side}"] = None if None in held else sum(held)  # type: ignore[arg-type]
            errors = [r["error"] for r in side_runs if "error" in r]
            if errors:
                row[f"error_{side}"] = errors[0]
        for side in STARTUP_SIDES:
            name = side.removesuffix("_warm")
            row[f"first_step_{name}"] = _median(per.get(f"startup/{side}", []), "first_step_s")
        for key in ("call_s", "worker_s", "overhead_s"):
            row[key] = _median(per.get("call", []), key)
        torchrun = row.get("recovery_torchrun")
        for side in ("raysgd", "raysgd_spare"):
            mine = row.get(f"recovery_{side}")
            row[f"ratio_{side}_vs_torchrun"] = mine / torchrun if mine and torchrun else None
        # With the replacement joining later, the loop pays twice: at the loss and at the join.
        mine = row.get("recovery_raysgd")
        paid = mine + (row.get("join_raysgd") or 0.0) if mine else None
        row["ratio_raysgd_with_join_vs_torchrun"] = paid / torchrun if paid and torchrun else None
        rows.append(row)
    base = next((r.get("held_raysgd") for r in rows if r["workers"] == 2), None)
    for row in rows:
        held = row.get("held_raysgd")
        row["held_raysgd_vs_2"] = held / base if held and base else None
    return rows


def _cell(value: Optional[float], fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def _print(rows: list[dict[str, Any]]) -> None:
    print(
        "\nrecovery, kill -> next step (s); raysgd's held part = detect + re-form + restore;"
        " join: what a replacement that started in the background cost the loop when it joined"
    )
    print(
        f"  {'workers':>7} {'raysgd':>8} {'spare':>8} {'torchrun':>9} {'Ray Train':>10}"
        f" {'raysgd/tr':>10} {'spare/tr':>9} {'held':>6} {'held/2':>7} {'join':>6}"
        f" {'+join/tr':>9}"
    )
    for r in rows:
        print(
            f"  {r['workers']:>7} {_cell(r['recovery_raysgd']):>8}"
            f" {_cell(r['recovery_raysgd_spare']):>8} {_cell(r['recovery_torchrun']):>9}"
            f" {_cell(r['recovery_ray_train']):>10}"
            f" {_cell(r['ratio_raysgd_vs_torchrun'], '{:.2f}x'):>10}"
            f" {_cell(r['ratio_raysgd_spare_vs_torchrun'], '{:.2f}x'):>9}"
            f" {_cell(r['held_raysgd']):>6} {_cell(r['held_raysgd_vs_2'], '{:.2f}x'):>7}"
            f" {_cell(r.get('join_raysgd')):>6}"
            f" {_cell(r['ratio_raysgd_with_join_vs_torchrun'], '{:.2f}x'):>9}"
        )
    print("\nraysgd's phases (s): detect, start, re-form, restore, redo")
    for r in rows:
        for side in ("raysgd", "raysgd_spare"):
            cells = " ".join(_cell(r.get(f"{side}_{p}"), "{:6.3f}") for p in recovery.PHASES)
            print(f"  {r['workers']:>3} {side:<13} {cells}")
    print("\nfirst step (s) and the driver's overhead of one train(num_steps=1) call (ms)")
    for r in rows:
        print(
            f"  {r['workers']:>3}: raysgd {_cell(r['first_step_raysgd'])}"
            f"  torchrun {_cell(r['first_step_torchrun'])}"
            f"  Ray Train {_cell(r['first_step_ray_train'])}"
            f"  | call {_cell(r['call_s'], '{:.4f}')} s, overhead"
            f" {_cell(None if r['overhead_s'] is None else 1000 * r['overhead_s'], '{:.1f}')} ms"
        )


def chart(rows: list[dict[str, Any]], path: Path) -> Optional[Path]:
    """Recovery against the worker count (one line a side) beside raysgd's phases."""
    if not rows:
        return None
    plt = _common.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    counts = [r["workers"] for r in rows]
    labels = {
        "raysgd": "raysgd",
        "raysgd_spare": "raysgd, spare",
        "torchrun": "torchrun (restarts all)",
        "ray_train": "Ray Train",
    }
    for side, label in labels.items():
        points = [(c, r[f"recovery_{side}"]) for c, r in zip(counts, rows) if r[f"recovery_{side}"]]
        if points:
            left.plot(*zip(*points), marker="o", label=label)
    left.set_xscale("log", base=2)
    left.set_xticks(counts, [str(c) for c in counts])
    left.set_xlabel("workers")
    left.set_ylabel("kill -> next step (s)")
    left.set_title("recovery after a killed worker")
    left.legend(fontsize=8)
    bottom = [0.0] * len(rows)
    positions = range(len(rows))
    for phase in recovery.PHASES:
        values = [r.get(f"raysgd_{phase}") or 0.0 for r in rows]
        right.bar(positions, values, bottom=bottom, label=phase[:-2])
        bottom = [b + v for b, v in zip(bottom, values)]
    right.set_xticks(list(positions), [str(c) for c in counts])
    right.set_xlabel("workers")
    right.set_ylabel("s")
    right.set_title("raysgd's recovery by phase (no spare)")
    right.legend(fontsize=8)
    return _common.save_figure(fig, path)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Run the sweep; print the tables; write ``<out>/workers.json`` and the chart."""
    parser = _common.bench_parser(
        __doc__.splitlines()[0], sides=(CALL_SIDE,), repeats=1, timeout_s=600.0
    )
    parser.add_argument("--counts", default="2,4,8,16", help="comma-separated worker counts")
    parser.add_argument("--workers", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--kill-at", type=int, default=None, help="step at which rank 1 dies")
    parser.add_argument("--calls", type=int, default=20, help="train(num_steps=1) calls timed")
    args = _common.parse_args(parser, argv, steps=10, quick_steps=6)
    if args.child:
        _common.child_main(measure, args)
        return {}
    args.counts = [int(c) for c in args.counts.split(",") if c.strip()]
    if any(c < 2 for c in args.counts):
        parser.error("--counts: every count must be >= 2 (rank 1 is killed)")
    if args.kill_at is None:
        args.kill_at = 3
    if not 0 <= args.kill_at < args.steps:
        parser.error(f"--kill-at must be in [0, --steps), got {args.kill_at}")
    rows = table(_sweep(args))
    _print(rows)
    _common.write_results(args.out, "workers", [], args, rows=rows)
    drawn = chart(rows, Path(args.out) / "workers.png")
    if drawn is not None:
        print(f"wrote {drawn}")
    return {"rows": rows}


if __name__ == "__main__":
    main()

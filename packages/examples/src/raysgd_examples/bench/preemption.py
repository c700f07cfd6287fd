"""Preemption: a node holding a worker is drained with a deadline mid-epoch and reclaimed then.

Each run starts its own `ray.cluster_utils.Cluster` (a head with no CPU and three 1-CPU nodes), runs
one epoch of `--steps` steps of the throughput benchmark's job on 2 workers, and at step `--at`
drains rank 1's node with ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
--deadline-remaining-seconds D`` (the real command) and removes the node at the deadline, as a
cloud reclaims a spot machine. Sides:

- raysgd, raysgd_fsdp: `TorchTrainer` (ddp, fsdp): the workers stop at a step boundary, move off
  the node to the free one and go on from that step.
- ray_train: Ray Train's `TorchTrainer` with its preemption handling: every step asks
  `ray.train.get_preemption_info()`, saves a just-in-time checkpoint on the notice and keeps
  training; when the node goes, Ray Train restarts every worker from that checkpoint.
- each side again with a ``_quiet`` suffix: the same epoch without the notice.

Reported per side: time from the notice until the run trained a step off the node ("moved": for
raysgd the move, for Ray Train the deadline plus its restart), steps trained twice (redone), and the
epoch's throughput, which the quiet sides give without a preemption.

    hatch run bench:preemption [--quick] [--repeats N] [--steps N] [--at K] [--deadline S]
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from typing import Any, Optional

from raysgd_examples.bench import _common, _drain

__all__ = ["SIDES", "main", "measure"]

SIDES = (
    "raysgd",
    "raysgd_fsdp",
    "ray_train",
    "raysgd_quiet",
    "raysgd_fsdp_quiet",
    "ray_train_quiet",
)
_MODULE = "raysgd_examples.bench.preemption"


def measure(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """One epoch of one side (in a child process)."""
    from raysgd_examples.bench.workload import Timeline, Workload

    workload = Workload.quick() if args.quick else Workload()
    quiet = side.endswith("_quiet")
    base = side.removesuffix("_quiet")
    with tempfile.TemporaryDirectory(prefix="raysgd_bench_") as tmp:
        timeline = Timeline(f"{tmp}/timeline.jsonl")
        cfg = {
            "workload": workload.to_dict(),
            "warmup": 0,
            "steps": args.steps,
            "timeline": timeline.path,
        }
        nodes: dict[int, str] = {}

        def stamped() -> list[int]:
            return [e["step"] for e in timeline.read() if e["event"] == "step"]

        def victim() -> str:
            return _drain.timeline_node(timeline, 1) if base == "ray_train" else nodes[1]

        events: list[Any] = []
        with _drain.cluster() as cluster:
            at = args.steps + 1 if quiet else args.at  # quiet: never reached
            reclaim = _drain.Reclaimer(cluster, lambda: at in stamped(), victim, args.deadline)
            times = reclaim.times
            try:
                if base == "ray_train":
                    from raysgd_examples.bench import _ray_train

                    _ray_train.fit_preemptible(cfg, num_workers=2)
                else:
                    from raysgd_examples.bench import _raysgd

                    extra = {"strategy": "fsdp"} if base == "raysgd_fsdp" else {}
                    trainer = _raysgd.make_trainer(cfg, num_workers=2, **extra)
                    try:
                        nodes.update(enumerate(_drain.worker_nodes(trainer)))
                        trainer.train(num_steps=args.steps)
                        events = list(trainer.recovery_events)
                        failures = trainer.failures
                    finally:
                        trainer.shutdown()
            finally:
                reclaim.stop()
        stamps = [e for e in timeline.read() if e["event"] == "step"]
    counts = Counter(e["step"] for e in stamps)
    first, last = min(e["t"] for e in stamps), max(e["t"] for e in stamps)
    moments = sorted(e["t"] for e in stamps)
    gaps = sorted(b - a for a, b in zip(moments, moments[1:]))
    typical = gaps[len(gaps) // 2] if gaps else 0.0
    result: dict[str, Any] = {
        "samples_per_s": args.steps * workload.batch_size * 2 / (last - first),
        "steps_redone": sum(c - 1 for c in counts.values() if c > 1),
        # Where the epoch lost time: the steps that took more than twice the typical one.
        "stalled_s": sum(g - typical for g in gaps if g > 2 * typical),
        "typical_step_s": typical,
    }
    moved: Optional[float] = None
    if "notice" in times and base == "ray_train":
        # Off the node once a step is stamped after the node is gone (the restart).
        after = [e["t"] for e in stamps if e["t"] > times.get("reclaimed", last)]
        moved = min(after) if after else None
    elif "notice" in times:
        move = [e.timestamp for e in events if e.kind == "preemption"]
        moved = move[0] if move else None
        result["failures"] = failures
    if moved is not None:
        result["notice_to_moved_s"] = moved - times["notice"]
    if "notice" in times:
        # The typical step before the notice, and after it (once off the node, and once it is gone).
        def typical_between(lo: float, hi: float) -> Optional[float]:
            inside = [b - a for a, b in zip(moments, moments[1:]) if lo <= a and b <= hi]
            return sorted(inside)[len(inside) // 2] if inside else None

        result["step_before_notice_s"] = typical_between(first, times["notice"])
        result["step_after_notice_s"] = typical_between(
            times["notice"], times.get("reclaimed", last)
        )
        if "reclaimed" in times:
            result["step_after_reclaim_s"] = typical_between(times["reclaimed"], last)
    elif "notice" in times:
        result["note"] = "the epoch ended before the run left the node"
    return result


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Run the benchmark; print the tables; write ``<out>/preemption.json``."""
    parser = _common.bench_parser(__doc__.splitlines()[0], sides=SIDES, repeats=1)
    parser.add_argument("--at", type=int, default=None, help="step at which the notice comes")
    parser.add_argument("--deadline", type=int, default=30, help="seconds from notice to reclaim")
    args = _common.parse_args(parser, argv, steps=60, quick_steps=20)
    if args.at is None:
        args.at = args.steps // 4
    runs = _common.dispatch(_MODULE, measure, args, SIDES)
    if runs is None:
        return {}
    # The quiet sides get no notice: they have no time to a move.
    noticed = {side: values for side, values in runs.items() if not side.endswith("_quiet")}
    metrics = [
        _common.metric(
            "notice -> trained off the node",
            "s",
            False,
            noticed,
            "notice_to_moved_s",
            reference="ray_train",
        ),
        _common.metric("steps redone", "steps", False, runs, "steps_redone", reference="ray_train"),
        _common.metric(
            "epoch throughput", "samples/s", True, runs, "samples_per_s", reference="raysgd_quiet"
        ),
    ]
    for m in metrics:
        _common.print_metric(m)
    _common.write_results(args.out, "preemption", metrics, args)
    return {"metrics": metrics}


if __name__ == "__main__":
    main()

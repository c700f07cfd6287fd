"""Checkpoints: how long the loop waits per checkpoint, and what taking them costs in throughput.

The job is one of `scale.SIZES`'s MLPs (0.1M, 25M and 100M parameters) trained with Adam on 2
workers (gloo, CPU, one torch thread each), `--batch-size` synthetic rows per worker and step. The
"s3" sides write to an S3 server (moto's, started by this script on 127.0.0.1 for the run, with a
bucket and dummy credentials); the "local" sides to a folder on the local disk. Sides, each run in
a fresh process:

- raysgd_sync_local, raysgd_sync_s3: ``trainer.save(path)``, the whole call (median of
  `--saves` calls), and ``train(num_steps=1, checkpoint=path)`` less ``train(num_steps=1)``
  (pairs in a random order, median), shown as ``<side>:train``.
- raysgd_async_local, raysgd_async_s3: ``TorchTrainer(checkpoint_dir=..., checkpoint_every=20,
  keep_checkpoints=2, storage_options=...)``; the loop is blocked only while rank 0 copies the
  state to host memory (and while an upload that has not kept up finishes): the trainer's
  ``goodput()["lost_s"]["checkpoint"]`` over the checkpoints the call wrote.
- raysgd_none: the same trainer without checkpoints (the throughput they are compared with).
- torchrun_copy: a plain DDP loop under torchrun in which rank 0 copies the model's and
  optimizer's tensors to host memory (``{k: v.detach().clone()}`` of both state dicts) every 20
  steps: the floor of any checkpoint that writes in the background, the reference of the
  blocked-time ratios.
- torchrun_dcp_async: the same loop calling ``torch.distributed.checkpoint.async_save`` into a new
  local folder every 20 steps (after waiting for the previous save); the time that blocks.
- ray_train_local, ray_train_s3: Ray Train's `TorchTrainer`; every 20 steps rank 0 `torch.save`s
  the state into a new temporary folder and every rank calls ``ray.train.report(metrics,
  checkpoint=Checkpoint.from_directory(folder), checkpoint_upload_mode=CheckpointUploadMode.ASYNC)``
  (`CheckpointConfig(num_to_keep=2)`; storage: a local folder, or
  ``RunConfig(storage_path="<bucket>/<prefix>", storage_filesystem=pyarrow.fs.S3FileSystem(...))``).
  Blocked: the save and the report, less a report without a checkpoint (ray_train_none's median);
  ``<side>:report`` is the report alone, less the same.
- ray_train_none: the same loop reporting at the same steps without a checkpoint.

The Ray Train sides report only every 20 steps: Ray Train hands reports over in order, so a
report made while an earlier checkpoint is still uploading waits for that upload (a report at
every step would turn the asynchronous upload into a wait at the next step).

Throughput (samples/s) is taken on rank 0 over `--steps` steps after `--warmup` (the checkpoints
fall inside), for the checkpointing runs against the run of the same framework that never
checkpoints. The blocked time of the periodic sides is the mean over a run's checkpoints.
Goals: raysgd's asynchronous checkpoint blocks the loop at most 1.2x the plain copy to host memory
(ratio to torchrun_copy <= 1.2), and a raysgd run checkpointing every 20 steps keeps >= 0.95 of
the throughput of one that never does at 100M.

    hatch run bench:checkpoint [--quick] [--repeats N] [--steps N] [--sizes 0.1M,25M,100M]
                               [--sides raysgd_async_local,torchrun_copy,...]

``--quick``: 0.1M only, 40 steps (two checkpoints), two calls of each synchronous kind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from raysgd_examples.bench import _checkpoint_storage, _common
from raysgd_examples.bench._checkpoint_storage import Place
from raysgd_examples.bench.scale import SIZES, mlp_parameters

__all__ = ["SIDES", "main", "measure"]

SIDES = (
    "raysgd_sync_local",
    "raysgd_sync_s3",
    "raysgd_async_local",
    "raysgd_async_s3",
    "raysgd_none",
    "torchrun_copy",
    "torchrun_dcp_async",
    "ray_train_local",
    "ray_train_s3",
    "ray_train_none",
)
#: The blocked-time table: (row, side, key of the side's result).
BLOCKED_ROWS = (
    ("raysgd_sync_local", "raysgd_sync_local", "blocked_s"),
    ("raysgd_sync_local:train", "raysgd_sync_local", "train_extra_s"),
    ("raysgd_sync_s3", "raysgd_sync_s3", "blocked_s"),
    ("raysgd_sync_s3:train", "raysgd_sync_s3", "train_extra_s"),
    ("raysgd_async_local", "raysgd_async_local", "blocked_s"),
    ("raysgd_async_s3", "raysgd_async_s3", "blocked_s"),
    ("torchrun_copy", "torchrun_copy", "blocked_s"),
    ("torchrun_dcp_async", "torchrun_dcp_async", "blocked_s"),
    ("ray_train_local", "ray_train_local", "blocked_s"),
    ("ray_train_local:report", "ray_train_local", "report_s"),
    ("ray_train_s3", "ray_train_s3", "blocked_s"),
    ("ray_train_s3:report", "ray_train_s3", "report_s"),
)
#: The throughput tables: (framework, the side that never checkpoints, the sides that do).
THROUGHPUT_GROUPS = (
    ("raysgd", "raysgd_none", ("raysgd_async_local", "raysgd_async_s3")),
    ("ray_train", "ray_train_none", ("ray_train_local", "ray_train_s3")),
)
#: The blocked-time reference: the plain copy to host memory.
FLOOR = "torchrun_copy"
BLOCKED_GOAL = 1.2
THROUGHPUT_GOAL = 0.95
KEEP = 2  # checkpoints kept by the periodic sides
_MODULE = "raysgd_examples.bench.checkpoint"


# ------------------------------------------------------------------------------------- sides
def _loop_config(args: argparse.Namespace, size: str) -> dict[str, Any]:
    width, depth = SIZES[size]
    return {
        "width": width,
        "depth": depth,
        "batch_size": args.batch_size,
        "warmup": args.warmup,
        "steps": args.steps,
        "every": args.every,
        "threads": 1,
    }


def _operator_class() -> type:
    """The raysgd side's operator: the same MLP, Adam, rows and step as the plain loop, with a
    time stamp after each step (the class is built here so that the parent never imports raysgd;
    the trainer ships it to the workers)."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from raysgd import TrainingOperator
    from raysgd.utils import BATCH_SIZE
    from raysgd_examples.bench._checkpoint_loop import LR, Rows
    from raysgd_examples.bench.scale import make_mlp

    class CheckpointOperator(TrainingOperator):
        def setup(self, config: dict[str, Any]) -> None:
            cfg = config["loop"]
            model = make_mlp(cfg["width"], cfg["depth"])
            self.register(
                models=model,
                optimizers=torch.optim.Adam(model.parameters(), lr=LR),
                criterion=nn.CrossEntropyLoss(),
            )
            rows = Rows(cfg["rows"], cfg["width"])
            self.register_data(
                train_loader=DataLoader(rows, batch_size=config[BATCH_SIZE], drop_last=True)
            )
            self.step_times: list[float] = []

        def train_batch(self, batch: Any, batch_info: dict[str, Any]) -> dict[str, Any]:
            metrics = super().train_batch(batch, batch_info)
            self.step_times.append(time.perf_counter())
            return metrics

    return CheckpointOperator


def _trainer(cfg: dict[str, Any], args: argparse.Namespace, steps: int, **kwargs: Any) -> Any:
    from raysgd import TorchTrainer
    from raysgd.utils import BATCH_SIZE

    global_batch = cfg["batch_size"] * args.workers
    return TorchTrainer(
        training_operator_cls=_operator_class(),
        config={"loop": {**cfg, "rows": steps * global_batch}, BATCH_SIZE: global_batch},
        num_workers=args.workers,
        num_cpus_per_worker=1,
        use_gpu=False,
        backend="gloo",
        **kwargs,
    )


def _timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _samples_per_s(times: list[float], cfg: dict[str, Any], workers: int) -> float:
    from raysgd_examples.bench._loop import throughput_from_times

    return throughput_from_times(times, cfg["warmup"], cfg["batch_size"] * workers)


def _raysgd_sync(cfg: dict[str, Any], args: argparse.Namespace, place: Place) -> dict[str, Any]:
    """``save(path)`` and ``train(checkpoint=path)``'s extra time, with a warm trainer."""
    saves, extras, accounted = [], [], []
    with _common.local_ray(num_cpus=args.workers + 2, raysgd=True):
        trainer = _trainer(cfg, args, 2 + 2 * args.saves + 1, storage_options=place.options)
        try:
            trainer.train(num_steps=2)  # warm-up: Adam's state exists from here on
            path = place.join("state.pt")
            for _ in range(args.saves):
                saves.append(_timed(lambda: trainer.save(path)))
            order = random.Random()
            for _ in range(args.saves):
                before = trainer.goodput()["lost_s"]["checkpoint"]
                took: dict[Optional[str], float] = {}
                # Each pair in a random order: neither call always runs right after the other.
                for checkpoint in order.sample([None, path], 2):
                    took[checkpoint] = _timed(
                        lambda c=checkpoint: trainer.train(num_steps=1, checkpoint=c)
                    )
                extras.append(took[path] - took[None])
                accounted.append(trainer.goodput()["lost_s"]["checkpoint"] - before)
        finally:
            trainer.shutdown()
    return {
        "blocked_s": statistics.median(saves),
        "train_extra_s": statistics.median(extras),
        # What the trainer itself counts as lost to that checkpoint (its goodput).
        "train_checkpoint_goodput_s": statistics.median(accounted),
        "saves_s": saves,
    }


def _raysgd_periodic(
    cfg: dict[str, Any], args: argparse.Namespace, place: Optional[Place]
) -> dict[str, Any]:
    """One `train()` call of warm-up + steps; with `place`, checkpoints every `every` steps."""
    total = cfg["warmup"] + cfg["steps"]
    kwargs: dict[str, Any] = {}
    if place is not None:
        kwargs = dict(
            checkpoint_dir=place.url,
            checkpoint_every=cfg["every"],
            keep_checkpoints=KEEP,
            storage_options=place.options,
        )
    with _common.local_ray(num_cpus=args.workers + 2, raysgd=True):
        trainer = _trainer(cfg, args, total, **kwargs)
        try:
            before = trainer.goodput()["lost_s"]["checkpoint"]
            trainer.train(num_steps=total)
            lost = trainer.goodput()["lost_s"]["checkpoint"] - before
            times = trainer.apply_all_operators(lambda op: op.step_times)[0]
        finally:
            trainer.shutdown()  # waits for the last upload
    result: dict[str, Any] = {"samples_per_s": _samples_per_s(times, cfg, args.workers)}
    if place is not None:
        # The step hook checkpoints where the step count is a multiple of `every` (warm-up < every).
        written = total // cfg["every"]
        complete = place.complete_checkpoints()
        if complete < min(written, KEEP):
            raise RuntimeError(
                f"{written} checkpoints were due but {complete} complete ones are in {place.url}"
            )
        result.update(blocked_s=lost / written, checkpoints=written, lost_s=lost)
    return result


def _torchrun(cfg: dict[str, Any], args: argparse.Namespace, kind: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="raysgd_bench_ckpt_") as tmp:
        run = {**cfg, "mode": "checkpoint", "kind": kind}
        run.update(result=os.path.join(tmp, "result.json"), folder=os.path.join(tmp, "dcp"))
        _common.run_torchrun(
            "raysgd_examples.bench._torchrun_worker",
            [json.dumps(run)],
            nproc=args.workers,
            timeout=args.timeout,
        )
        with open(run["result"], encoding="utf-8") as f:
            out = json.load(f)
    return {
        "samples_per_s": _samples_per_s(out["times"], cfg, args.workers),
        "blocked_s": statistics.mean(out["blocked"]),
        "checkpoints": len(out["blocked"]),
    }


def _ray_train(
    cfg: dict[str, Any], args: argparse.Namespace, kind: str, place: Optional[Place]
) -> dict[str, Any]:
    from raysgd_examples.bench import _checkpoint_loop

    with tempfile.TemporaryDirectory(prefix="raysgd_bench_ckpt_") as tmp:
        run = {**cfg, "kind": kind, "result": os.path.join(tmp, "result.json")}
        storage: dict[str, Any] = {}
        if place is not None and place.endpoint:
            storage["storage_filesystem"], storage["storage_path"] = place.arrow()
        elif place is not None:
            storage["storage_path"] = place.url
        with _common.local_ray(num_cpus=args.workers + 2):
            result = _checkpoint_loop.fit_ray_train(
                run, num_workers=args.workers, keep=KEEP, **storage
            )
        with open(run["result"], encoding="utf-8") as f:
            out = json.load(f)
    samples_per_s = _samples_per_s(out["times"], cfg, args.workers)
    if kind == "ray_train_none":
        return {"samples_per_s": samples_per_s, "plain_report_s": statistics.median(out["report"])}
    if result.checkpoint is None:
        raise RuntimeError("Ray Train reported no checkpoint")
    return {
        "samples_per_s": samples_per_s,
        # Save and report, and the report alone; the parent takes a plain report off both.
        "save_report_s": statistics.mean(out["blocked"]),
        "report_raw_s": statistics.mean(out["report"]),
        "save_s": statistics.mean(out["save"]),
        "checkpoints": len(out["blocked"]),
        "upload_mode": out["upload_mode"],
    }


def measure(key: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of one side at one size (in a child process); `key` is ``<side>@<size>``."""
    side, size = key.split("@")
    cfg = _loop_config(args, size)
    result: dict[str, Any] = {"parameters": mlp_parameters(cfg["width"], cfg["depth"])}
    if side.startswith("torchrun_"):
        result.update(_torchrun(cfg, args, side.removeprefix("torchrun_")))
    elif side == "raysgd_none":
        result.update(_raysgd_periodic(cfg, args, None))
    elif side == "ray_train_none":
        result.update(_ray_train(cfg, args, "ray_train_none", None))
    elif side in SIDES:
        with _checkpoint_storage.place(side, args) as place:
            if side.startswith("raysgd_sync_"):
                result.update(_raysgd_sync(cfg, args, place))
            elif side.startswith("raysgd_async_"):
                result.update(_raysgd_periodic(cfg, args, place))
            else:
                result.update(_ray_train(cfg, args, "ray_train", place))
    else:
        raise ValueError(f"unknown side {side!r}")
    return result


# ------------------------------------------------------------------------------------ tables
def _values(runs: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in runs if key in r]


def _with_plain_report_off(
    runs: dict[str, list[dict[str, Any]]], sizes: list[str]
) -> dict[str, list[dict[str, Any]]]:
    """The Ray Train sides' blocked times: save + report (and the report alone) less the median
    report without a checkpoint of ray_train_none at the same size (nothing taken off without
    it)."""
    runs = {k: [dict(r) for r in v] for k, v in runs.items()}
    for size in sizes:
        plain = _values(runs.get(f"ray_train_none@{size}", []), "plain_report_s")
        base = statistics.median(plain) if plain else 0.0
        for side in ("ray_train_local", "ray_train_s3"):
            for r in runs.get(f"{side}@{size}", []):
                if "save_report_s" in r:
                    r["blocked_s"] = r["save_report_s"] - base
                    r["report_s"] = r["report_raw_s"] - base
                    r["plain_report_taken_off_s"] = base
    return runs


def _blocked_metrics(
    runs: dict[str, list[dict[str, Any]]], sizes: list[str], sides: list[str], every: int
) -> list[dict[str, Any]]:
    metrics = []
    for size in sizes:
        rows: dict[str, list[dict[str, Any]]] = {}
        for row, side, key in BLOCKED_ROWS:
            if side not in sides:
                continue
            side_runs = runs.get(f"{side}@{size}", [])
            rows[row] = [r if "error" in r else {"value": r.get(key)} for r in side_runs]
            rows[row] = [r for r in rows[row] if "error" in r or r["value"] is not None]
        m = _common.metric(
            f"blocked per checkpoint, {size}",
            "s",
            False,
            rows,
            "value",
            note=(
                f"ratio to the plain copy to host memory ({FLOOR}); goal: raysgd_async_* <= "
                f"{BLOCKED_GOAL}x; periodic sides: every {every} steps, mean per checkpoint"
            ),
            reference=FLOOR,
        )
        metrics.append({**m, "size": size, "reference": FLOOR})
    return metrics


def _throughput_metrics(
    runs: dict[str, list[dict[str, Any]]], sizes: list[str], sides: list[str], every: int
) -> list[dict[str, Any]]:
    metrics = []
    for framework, never, checkpointing in THROUGHPUT_GROUPS:
        chosen = [s for s in (never, *checkpointing) if s in sides]
        if not chosen:
            continue
        for size in sizes:
            m = _common.metric(
                f"throughput, {framework}, {size}",
                "samples/s",
                True,
                {side: runs.get(f"{side}@{size}", []) for side in chosen},
                "samples_per_s",
                note=(
                    f"checkpoints every {every} steps against none ({never}); goal at 100M: "
                    f"raysgd >= {THROUGHPUT_GOAL}x"
                ),
                reference=never,
            )
            metrics.append({**m, "size": size, "framework": framework, "reference": never})
    return metrics


def _cell(metric: dict[str, Any], row: str, scale: float) -> str:
    s = metric["sides"].get(row)
    if s is None:
        return "-"
    if "error" in s:
        return "error"
    ratio = metric[f"ratio_vs_{metric['reference']}"].get(row)
    text = f"{s['median'] * scale:.4g}"
    return text + (f" ({ratio:.2f}x)" if ratio is not None else "")


def _print_table(
    title: str, metrics: list[dict[str, Any]], sizes: list[str], scale: float = 1.0
) -> None:
    """Sides as rows, sizes as columns: the median and, in brackets, its ratio to the reference."""
    if not metrics:
        return
    rows: list[str] = []
    for m in metrics:
        rows += [r for r in m["sides"] if r not in rows]
    print(f"\n{title}")
    print(f"  {'side':<24}" + "".join(f"{size:>20}" for size in sizes))
    for row in rows:
        print(f"  {row:<24}" + "".join(f"{_cell(m, row, scale):>20}" for m in metrics))
    errors = {row: s["error"] for m in metrics for row, s in m["sides"].items() if "error" in s}
    for row, error in errors.items():
        print(f"  {row}: {error.splitlines()[0][:110]}")
    print(f"  note: {metrics[0]['note']}")


def chart(
    blocked: list[dict[str, Any]], throughput: list[dict[str, Any]], sizes: list[str], path: Path
) -> Optional[Path]:
    """Two panels over the model size: the blocked time per checkpoint of every side (log scale,
    with the goal of 1.2x the plain copy marked), and each checkpointing run's throughput over the
    same framework's run without checkpoints (with the 0.95 goal)."""
    medians = {
        (row, m["size"]): s["median"]
        for m in blocked
        for row, s in m["sides"].items()
        if "median" in s
    }
    ratios = {
        (side, m["size"]): r
        for m in throughput
        for side, r in m[f"ratio_vs_{m['reference']}"].items()
    }
    # One bar per side (its row of the same name; the ":train" and ":report" rows stay in the table).
    rows = [row for row, side, _ in BLOCKED_ROWS if row == side]
    rows = [row for row in rows if any((row, size) in medians for size in sizes)]
    ratio_sides = [s for _, _, group in THROUGHPUT_GROUPS for s in group]
    ratio_sides = [s for s in ratio_sides if any((s, size) in ratios for size in sizes)]
    if not rows and not ratio_sides:
        return None
    plt = _common.pyplot()

    def bars(ax: Any, names: list[str], values: dict[tuple[str, str], float]) -> None:
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(sizes))]
            ax.bar(
                xs, [values.get((name, size), float("nan")) for size in sizes], width, label=name
            )
        ax.set_xticks(range(len(sizes)), sizes)
        ax.set_xlabel("parameters", fontsize=8)

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.5))
    bars(left, rows, medians)
    for j, size in enumerate(sizes):
        if (FLOOR, size) in medians:
            left.hlines(
                BLOCKED_GOAL * medians[FLOOR, size],
                j - 0.45,
                j + 0.45,
                colors="black",
                linestyles="--",
                linewidth=1,
                label=f"goal: {BLOCKED_GOAL}x {FLOOR}" if j == 0 else None,
            )
    left.set_yscale("log")
    left.set_title("loop blocked per checkpoint, seconds (lower is better)", fontsize=9)
    left.legend(fontsize=6, ncol=2)
    bars(right, ratio_sides, ratios)
    right.axhline(
        THROUGHPUT_GOAL,
        color="tab:red",
        linestyle="--",
        linewidth=1,
        label=f"goal >= {THROUGHPUT_GOAL} (raysgd, 100M)",
    )
    right.axhline(1.0, color="black", linewidth=1)
    right.set_ylim(0, 1.15 * max([1.0, *ratios.values()]))
    right.set_title(
        "throughput with checkpoints / without, same framework (higher is better)", fontsize=9
    )
    right.legend(fontsize=7, loc="lower left")  # the 0.1M slot has no bars
    return _common.save_figure(fig, path)


# -------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the tables; write ``<out>/checkpoint.json`` and
    ``<out>/checkpoint.png``."""
    parser = _common.bench_parser(__doc__.splitlines()[0], sides=SIDES, repeats=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sizes", default=None, help="comma-separated subset of the sizes")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 5)")
    parser.add_argument("--every", type=int, default=20, help="steps between checkpoints")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per worker and step")
    parser.add_argument("--saves", type=int, default=None, help="sync sides: calls of each kind")
    # At 100M the synchronous S3 side writes a 1.2 GB state ten times: on a slow S3 server that
    # takes longer than the harness's usual 600 s per run.
    parser.set_defaults(timeout=1800.0)
    # Internal: the S3 server the parent started, for the children.
    parser.add_argument("--s3-endpoint", default=None, help=argparse.SUPPRESS)
    args = _common.parse_args(parser, argv, steps=100, quick_steps=40)
    if args.warmup is None:
        args.warmup = 2 if args.quick else 5
    if args.saves is None:
        args.saves = 2 if args.quick else 5
    if args.sizes is None:
        args.sizes = "0.1M" if args.quick else ",".join(SIZES)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if sorted(set(sizes) - set(SIZES)):
        parser.error(f"--sizes: choose among {list(SIZES)}")
    if not 0 < args.warmup < args.every <= args.steps:
        parser.error("need 0 < --warmup < --every <= --steps (no checkpoint in the warm-up)")
    sides = _common.selected_sides(args, SIDES)
    keys = [f"{side}@{size}" for size in sizes for side in sides]
    if args.child:
        _common.child_main(measure, args)
        return {}
    args.sides = ",".join(keys)
    with contextlib.ExitStack() as stack:
        if any(side.endswith("_s3") for side in sides):
            try:
                endpoint = stack.enter_context(_checkpoint_storage.s3_server())
                args.argv = [*args.argv, "--s3-endpoint", endpoint]
            except ImportError as exc:  # the s3 sides then fail and say why
                print(f"no S3 server ({exc}); the s3 sides will fail")
        runs = _common.dispatch(_MODULE, measure, args, keys)
    assert runs is not None
    args.sides = ",".join(sides)
    runs = _with_plain_report_off(runs, sizes)
    blocked = _blocked_metrics(runs, sizes, sides, args.every)
    throughput = _throughput_metrics(runs, sizes, sides, args.every)
    _print_table(
        f"loop blocked per checkpoint (ms, lower is better; ratio to {FLOOR})",
        blocked,
        sizes,
        scale=1e3,
    )
    for framework, never, _ in THROUGHPUT_GROUPS:
        mine = [m for m in throughput if m["framework"] == framework]
        _print_table(
            f"throughput, {framework} (samples/s, higher is better; ratio to {never})",
            mine,
            sizes,
        )
    modes = {r.get("upload_mode") for v in runs.values() for r in v if r.get("upload_mode")}
    _common.write_results(
        args.out,
        "checkpoint",
        [*blocked, *throughput],
        args,
        sizes={size: mlp_parameters(*SIZES[size]) for size in sizes},
        ray_train_upload_mode=sorted(modes),
        runs=runs,
    )
    drawn = chart(blocked, throughput, sizes, Path(args.out) / "checkpoint.png")
    if drawn is not None:
        print(f"wrote {drawn}")
    return {"blocked": blocked, "throughput": throughput}


if __name__ == "__main__":
    main()

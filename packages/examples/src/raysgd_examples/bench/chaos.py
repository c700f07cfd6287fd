"""Chaos: one job at 8 workers for a set time under a random, seeded schedule of faults.

The job is deterministic and small (CPU): an MLP with dropout, gradient accumulation over 4
batches, every rank drawing its own dropout and Python/NumPy numbers (each rank seeded apart
after the model is built with a common seed) and carrying a state of its own from batch to batch
(`rank_state_dict`), `ddp`, a checkpoint every 14 steps (at the window end after), ``spare_workers=1`` and
``DefaultPolicy(replace_in_background=False)`` (the group waits for its replacements, so that it
keeps its size and the result can be exact). Every worker writes the rows of each batch it starts
to a file of its own, and where it is (pid, rank, node) whenever that changes.

It runs on a `ray.cluster_utils.Cluster` (a head without CPUs and `--nodes` nodes of 3 CPUs:
room for the workers, the spare and a node's workers moving elsewhere). The driver is a process
of its own (`_chaos_job`, which also holds the job), so that it can be killed and started again
with ``resume=True``; this process owns the cluster and injects the faults, each at its time once
the group is whole again (all ranks training, every node back), or, for about a quarter of them,
a few seconds after the fault before, while the group still recovers from it:

- ``sigkill``: a random worker SIGKILLed at a random moment (a forward, a backward, an
  optimizer step, a checkpoint's copy, a window's end: wherever it is);
- ``exit:<phase>``: a random rank's process exits (``os._exit``) in that phase of its next
  batch: ``forward``, ``backward``, ``step`` (an accumulation window's optimizer step, after
  the gradient sync) and ``after_step`` (the moment between a window's step and the next batch);
- ``sigkill:checkpoint``: rank 0, the writer of the periodic checkpoints, SIGKILLed while a
  checkpoint's folder has no manifest yet;
- ``burst``: two workers SIGKILLed, the second 0.3 to 2 s after the first (while the group
  recovers from it);
- ``sigstop``: a worker stopped (alive, silent): its peers' bounded waits find it and raysgd
  kills it (this process kills it after 180 s if not, and reports that);
- ``drain``: a node holding workers gets Ray's preemption notice (``ray drain-node`` with
  reason PREEMPTION and a 30 s deadline) and is removed at the deadline; a fresh node is added;
- ``remove``: a node holding workers removed without notice (its processes killed); a fresh
  node is added 15 s later;
- ``driver``: the driver SIGKILLed once, mid-call, and started again with ``resume=True``.

The job runs `--minutes` (the epoch in progress at the deadline is finished), then the same job
runs without faults for as many epochs, for the reference weights. Reported (and written to
``<out>/chaos.json``; ``--json`` prints it): faults injected by kind; faults survived
(``trainer.failures`` and preemption moves, the killed driver's included, and the driver's
restart); rows lost and trained twice per epoch, from the rows the workers recorded (of each
batch, the last attempt counts); steps redone (the resize events' sum, the steps the resumed
driver trained again, and all of it counted from the rows); goodput (``trainer.goodput()`` of
both drivers together, and the reference's training time over the chaos run's); the recoveries
that were not exact (resize events with an ``inexact`` reason, and why); and the largest
difference between the final weights and the reference's. A hang, a crash of the driver, rows
lost or a weight difference without an ``inexact`` reason are listed as problems, with the
seed, the schedule and the logs (kept in ``<out>/chaos/``).

    hatch run bench:chaos [--quick] [--minutes M] [--workers N] [--seed S] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from raysgd_examples.bench import _chaos_job, _common, _drain
from raysgd_examples.bench._chaos_faults import KINDS, Fault, plan_faults
from raysgd_examples.bench._chaos_job import JOB, read_json, write_json
from raysgd_examples.bench._chaos_report import print_report, report

__all__ = ["Chaos", "main"]

_DRAIN_DEADLINE_S = 30
_READD_AFTER_S = 15.0
_STOPPED_KILL_S = 180.0
_HANG_S = 300.0
_CPUS_PER_NODE = 3


class _StopWatch:
    """Notes when each stopped process ends, from a thread of its own polling every 50 ms: the
    loop that injects faults can be busy for a minute (a phase exit waits for its phase), and a
    stop's time to be found must not include that."""

    def __init__(self) -> None:
        self._stopped: dict[int, float] = {}  # pid -> when it was stopped
        self._gone: dict[int, float] = {}  # pid -> seconds from its stop to its end
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="chaos-stop-watch", daemon=True).start()

    def stopped(self, pid: int) -> None:
        with self._lock:
            self._stopped[pid] = time.time()

    def gone(self) -> dict[int, float]:
        """The stopped processes that ended since the last call, with their time to end (no
        longer watched from then on)."""
        with self._lock:
            gone, self._gone = self._gone, {}
            for pid in gone:
                self._stopped.pop(pid, None)
            return gone

    def watching(self) -> dict[int, float]:
        """The stopped processes whose end was not reported yet (`gone`), with when each was
        stopped."""
        with self._lock:
            return dict(self._stopped)

    def forget(self, pid: int) -> None:
        """Stop watching `pid` (this benchmark killed it itself)."""
        with self._lock:
            self._stopped.pop(pid, None)

    def _run(self) -> None:
        while True:
            time.sleep(0.05)
            with self._lock:
                watched = {p: w for p, w in self._stopped.items() if p not in self._gone}
            for pid, when in watched.items():
                if not _common.process_alive(pid):
                    with self._lock:
                        self._gone[pid] = time.time() - when


class ProductProblem(RuntimeError):
    """raysgd misbehaved: a hang, a crashed driver."""


class Chaos:
    """Owns the cluster, the driver processes and the faults of one run."""

    def __init__(self, args: argparse.Namespace, folder: Path, cluster: Any) -> None:
        self.args, self.folder, self.cluster = args, folder, cluster
        self.workers = args.workers
        self.rng = random.Random(args.seed + 1)
        self.nodes = args.nodes
        self.log: list[str] = []
        self.faults: list[Fault] = []
        self.pending: list[tuple[float, str, Any]] = []  # (time, action, argument)
        #: The processes stopped with SIGSTOP, until they end.
        self.stop_watch = _StopWatch()
        self.stop_outcomes: list[dict[str, Any]] = []
        self.drivers: list[dict[str, Any]] = []
        self.problems: list[str] = []
        self.start = time.time()
        self.deadline = float("inf")
        self.proc: Optional[subprocess.Popen] = None
        self.killed_driver = False
        #: From the driver's kill to its successor training again (resume=True), in all.
        self.driver_restart_s = 0.0

    # ----------------------------------------------------------------- bookkeeping
    def say(self, text: str) -> None:
        line = f"[{time.time() - self.start:7.1f}s] {text}"
        self.log.append(line)
        print(line, flush=True)

    def _stamps(self) -> list[dict[str, Any]]:
        found = []
        for path in (self.folder / "workers").glob("*.json"):
            stamp = read_json(path)
            if stamp is not None:
                found.append(stamp)
        return found

    def group(self) -> dict[int, dict[str, Any]]:
        """Rank -> the live worker that stamped it last (at the full size), stopped ones not."""
        newest: dict[int, dict[str, Any]] = {}
        for stamp in self._stamps():
            if stamp["world"] != self.workers or stamp["pid"] in self.stop_watch.watching():
                continue
            if not _common.process_alive(stamp["pid"]):
                continue
            if stamp["rank"] not in newest or stamp["t"] > newest[stamp["rank"]]["t"]:
                newest[stamp["rank"]] = stamp
        return newest

    def status(self) -> dict[str, Any]:
        return read_json(self.folder / f"status-{len(self.drivers)}.json") or {}

    def healthy(self) -> bool:
        if self.killed_driver or self.proc is None or self.proc.poll() is not None:
            return False
        if self.status().get("phase") != "training" or self.pending or self.stop_watch.watching():
            return False
        if len(self.cluster.worker_nodes) != self.nodes:
            return False
        return len(self.group()) == self.workers

    def _node(self, node_id: str) -> Any:
        return next((n for n in self.cluster.worker_nodes if n.node_id == node_id), None)

    def _progress_at(self) -> float:
        newest = 0.0
        for entry in os.scandir(self.folder / "rows"):
            newest = max(newest, entry.stat().st_mtime)
        return newest

    # ----------------------------------------------------------------- drivers
    def launch(self, *, resume: bool, epochs: Optional[int] = None, name: str = "") -> None:
        index = len(self.drivers) + 1
        spec = {
            "address": self.cluster.address,
            "job": {**JOB, "checkpoint_every": self.args.checkpoint_every},
            "dir": str(self.folder),
            "workers": self.workers,
            "spares": self.args.spares,
            "checkpoint_dir": str(self.folder / "checkpoints"),
            "resume": resume,
            "peer_timeout_s": self.args.peer_timeout,
            "epochs": epochs,
            "deadline": str(self.folder / "deadline.json"),
            "status": str(self.folder / f"status-{index}.json"),
            "weights": str(self.folder / "weights.pt"),
        }
        spec_path = self.folder / f"driver-{index}.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        with open(self.folder / f"driver-{index}.log", "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", _chaos_job.__name__, str(spec_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_common.child_env(),
            )
        self.drivers.append({"index": index, "pid": self.proc.pid, "resume": resume, "name": name})
        self.say(f"driver {index} started (pid {self.proc.pid}, resume={resume}) {name}")

    def wait_training(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while self.status().get("phase") not in ("training", "done"):
            if self.proc.poll() is not None and self.status().get("phase") != "done":
                raise ProductProblem(self._driver_died())
            if time.time() > deadline:
                raise ProductProblem(f"the driver did not start training in {timeout_s:g} s")
            time.sleep(0.2)

    def _driver_died(self) -> str:
        index = len(self.drivers)
        tail = (self.folder / f"driver-{index}.log").read_text()[-4000:]
        return f"driver {index} exited with {self.proc.returncode}:\n{tail}"

    # ----------------------------------------------------------------- the run
    def run(self, schedule: list[Fault]) -> None:
        (self.folder / "rows").mkdir(parents=True)
        (self.folder / "workers").mkdir()
        self.launch(resume=False, name="(chaos)")
        self.wait_training(600)
        self.start = time.time()
        self.deadline = self.start + self.args.minutes * 60
        write_json(self.folder / "deadline.json", self.deadline)
        self.say(f"training; deadline in {self.args.minutes * 60:.0f} s; {len(schedule)} faults")
        queue = list(schedule)
        last_progress, progress_checked = time.time(), 0.0
        while True:
            now = time.time()
            code = self.proc.poll()
            if code is not None:
                if self.killed_driver:
                    self.killed_driver = False
                    self._restart_driver()
                    continue
                if code == 0 and self.status().get("phase") == "done":
                    self.say(f"driver {len(self.drivers)} finished")
                    break
                raise ProductProblem(self._driver_died())
            self._maintain(now)
            if queue and now < self.deadline and self._due(queue[0], now):
                waited = now - self.start >= queue[0].at_s + self.args.health_wait
                if queue[0].eager_after_s is not None or self.healthy() or waited:
                    fault = queue.pop(0)
                    if not self.healthy():
                        fault.detail["group_not_whole"] = True
                    self.inject(fault)
                    self.faults.append(fault)
                    continue
            if now - progress_checked > 5:
                progress_checked = now
                progressed = self._progress_at()
                if progressed > last_progress:
                    last_progress = progressed
                elif now - last_progress > _HANG_S and self.status().get("phase") == "training":
                    raise ProductProblem(
                        f"no batch started for {now - last_progress:.0f} s (a hang); "
                        f"status: {json.dumps(self.status())[:3000]}"
                    )
            time.sleep(0.1)
        for fault in queue:
            fault.detail["not_injected"] = "the run ended first"
            self.faults.append(fault)
        self.chaos_end = time.time()
        self._settle()

    def _due(self, fault: Fault, now: float) -> bool:
        """Whether `fault`'s time has come: its own, or, for one injected while the group
        recovers, its delay after the fault before it."""
        if fault.eager_after_s is not None and self.faults:
            injected = self.faults[-1].injected_s
            if injected is not None:
                return now - self.start >= injected + fault.eager_after_s
        return now - self.start >= fault.at_s

    def _settle(self) -> None:
        """Every node back, every stopped process gone (before the reference run)."""
        until = time.time() + 300
        while (self.pending or self.stop_watch.watching()) and time.time() < until:
            self._maintain(time.time(), hurry=True)
            time.sleep(0.2)
        while len(self.cluster.worker_nodes) < self.nodes:
            self.cluster.add_node(num_cpus=_CPUS_PER_NODE)

    def _maintain(self, now: float, hurry: bool = False) -> None:
        for item in sorted(self.pending, key=lambda p: p[0]):
            when, action, arg = item
            if now < when and not hurry:
                continue
            self.pending.remove(item)
            if action == "remove":
                node = self._node(arg["node"])
                if node is not None:
                    left = [s for s in self.group().values() if s["node"] == arg["node"]]
                    arg["fault"].detail["workers_left_at_deadline"] = len(left)
                    self.cluster.remove_node(node, allow_graceful=False)
                    self.say(f"drained node {arg['node'][:8]} removed at its deadline")
                self.pending.append((now, "add", None))
            elif action == "add":
                self.cluster.add_node(num_cpus=_CPUS_PER_NODE)
                self.say(f"node added ({len(self.cluster.worker_nodes)} nodes)")
            elif action == "kill":
                pid, fault = arg
                if _signal(pid, signal.SIGKILL):
                    fault.detail.setdefault("pids", []).append(pid)
                    self.say(f"burst: second kill, pid {pid}")
                else:
                    fault.detail["second_gone_before"] = pid
                    self.say(f"burst: pid {pid} had ended before its kill")
        bound = self.args.peer_timeout
        for pid, found_s in self.stop_watch.gone().items():
            found_s = round(found_s, 2)
            self.stop_outcomes.append({"pid": pid, "gone_after_s": found_s})
            self.say(f"stopped pid {pid} gone after {found_s:.2f} s")
            if found_s > bound:
                self.problems.append(
                    f"a stopped worker (pid {pid}) was found and killed after {found_s:.2f} s, "
                    f"past its bound (peer_timeout_s={bound:g})"
                )
        for pid, when in self.stop_watch.watching().items():
            if now - when > _STOPPED_KILL_S:
                _signal(pid, signal.SIGKILL)
                self.stop_outcomes.append({"pid": pid, "killed_by_bench_after_s": now - when})
                self.problems.append(
                    f"a stopped worker (pid {pid}) was still alive {now - when:.0f} s later"
                )
                self.stop_watch.forget(pid)

    def _restart_driver(self) -> None:
        deadline = time.time() + 120
        while time.time() < deadline and any(
            _common.process_alive(s["pid"]) for s in self._stamps()
        ):
            time.sleep(0.2)
        self.say("the killed driver's workers are gone: starting it again with resume=True")
        self.launch(resume=True, name="(resumed)")
        self.wait_training(600)
        status = self.status()
        killed = next(f for f in reversed(self.faults) if f.kind == "driver")
        assert killed.injected_s is not None
        self.driver_restart_s += time.time() - self.start - killed.injected_s
        self.say(
            f"resumed at step {status.get('resumed_step')} (epoch {status.get('resumed_epoch')})"
        )

    # ----------------------------------------------------------------- faults
    def inject(self, fault: Fault) -> None:
        fault.injected_s = round(time.time() - self.start, 1)
        group = self.group()
        kind = fault.kind
        if kind == "driver":
            fault.detail.update(pid=self.proc.pid, epoch=self.status().get("epoch"))
            _signal(self.proc.pid, signal.SIGKILL)
            self.killed_driver = True
            self.say(f"driver {len(self.drivers)} SIGKILLed")
            return
        if not group:
            fault.detail["not_injected"] = "no live worker to pick"
            return
        victim = group[self.rng.choice(sorted(group))]
        if kind in ("sigkill", "burst", "sigstop"):
            victim = self._signal_one(fault, group, victim, kind)
            if victim is None:
                return
        if kind in ("sigkill", "burst"):
            fault.detail.update(pids=[victim["pid"]], rank=victim["rank"])
            self.say(f"{kind}: rank {victim['rank']} (pid {victim['pid']}) SIGKILLed")
            if kind == "burst":
                others = [s["pid"] for s in group.values() if s["pid"] != victim["pid"]]
                second = self.rng.choice(others)
                self.pending.append(
                    (time.time() + self.rng.uniform(0.3, 2.0), "kill", (second, fault))
                )
        elif kind.startswith("exit:"):
            self._phase_exit(fault, victim["rank"])
        elif kind == "sigkill:checkpoint":
            self._kill_in_checkpoint(fault, group)
        elif kind == "sigstop":
            self.stop_watch.stopped(victim["pid"])
            fault.detail.update(pid=victim["pid"], rank=victim["rank"])
            self.say(f"sigstop: rank {victim['rank']} (pid {victim['pid']}) stopped")
        elif kind in ("drain", "remove"):
            on = Counter(s["node"] for s in group.values())
            node_id = self.rng.choice(sorted(on))
            fault.detail.update(node=node_id, workers_on_node=on[node_id])
            if kind == "drain":
                _drain.drain_node(self.cluster.address, node_id, _DRAIN_DEADLINE_S)
                deadline = time.time() + _DRAIN_DEADLINE_S
                self.pending.append((deadline, "remove", {"node": node_id, "fault": fault}))
                self.say(
                    f"drain: node {node_id[:8]} ({on[node_id]} workers), {_DRAIN_DEADLINE_S} s"
                )
            else:
                self.cluster.remove_node(self._node(node_id), allow_graceful=False)
                self.pending.append((time.time() + _READD_AFTER_S, "add", None))
                self.say(f"remove: node {node_id[:8]} ({on[node_id]} workers) removed")
        else:
            raise ValueError(f"unknown fault {kind!r}")

    def _signal_one(
        self,
        fault: Fault,
        group: dict[int, dict[str, Any]],
        victim: dict[str, Any],
        kind: str,
    ) -> Optional[dict[str, Any]]:
        """Send `kind`'s signal to `victim`, or, when its process ended between the choice and
        the signal (a loss of its own, a recovery's kill), to another live worker; the one
        signalled (None: none was left). The fault's detail lists the ones that had ended."""
        sig = signal.SIGSTOP if kind == "sigstop" else signal.SIGKILL
        candidates = [victim] + [s for r, s in sorted(group.items()) if s is not victim]
        for candidate in candidates:
            if _signal(candidate["pid"], sig):
                return candidate
            fault.detail.setdefault("ended_before_signal", []).append(candidate["pid"])
            self.say(f"{kind}: pid {candidate['pid']} had ended before its signal; choosing again")
        fault.detail["not_injected"] = "every worker chosen had ended before its signal"
        return None

    def _phase_exit(self, fault: Fault, rank: int) -> None:
        phase = fault.kind.split(":", 1)[1]
        plan_id = len(self.faults)
        write_json(
            self.folder / "plan.json",
            {"id": plan_id, "rank": rank, "world": self.workers, "phase": phase},
        )
        fault.detail.update(rank=rank, phase=phase)
        marker = self.folder / f"exit-{plan_id}"
        until = time.time() + 60
        while not marker.exists() and time.time() < until and self.proc.poll() is None:
            time.sleep(0.01)
        (self.folder / "plan.json").unlink()
        if marker.exists():
            self.say(f"exit:{phase}: rank {rank} exited in its {phase}")
        else:
            fault.detail["not_injected"] = "the rank did not reach the phase within 60 s"
            self.say(f"exit:{phase}: rank {rank} did not get there")

    def _kill_in_checkpoint(self, fault: Fault, group: dict[int, dict[str, Any]]) -> None:
        """SIGKILL rank 0 (the writer) while a checkpoint folder has no manifest yet."""
        from raysgd._internal.storage.format import MANIFEST_NAME

        root = self.folder / "checkpoints"
        seen = {p.name for p in root.iterdir()} if root.exists() else set()
        until = time.time() + 60
        pid = group[0]["pid"] if 0 in group else None
        while pid is not None and time.time() < until:
            for entry in os.scandir(root):
                if entry.name not in seen and entry.is_dir():
                    if not os.path.exists(os.path.join(entry.path, MANIFEST_NAME)):
                        if not _signal(pid, signal.SIGKILL):
                            # Rank 0 ended on its own meanwhile: the rank 0 of the group now.
                            fault.detail.setdefault("ended_before_signal", []).append(pid)
                            self.say(f"sigkill:checkpoint: pid {pid} had ended; choosing again")
                            now = self.group()
                            pid = now[0]["pid"] if 0 in now else None
                            break
                        fault.detail.update(pid=pid, rank=0, folder=entry.name)
                        self.say(f"sigkill:checkpoint: rank 0 (pid {pid}) killed in {entry.name}")
                        return
                    seen.add(entry.name)
            time.sleep(0.001)
        fault.detail["not_injected"] = "no checkpoint caught in progress within 60 s"
        self.say("sigkill:checkpoint: none caught in progress")


def _signal(pid: int, sig: int) -> bool:
    """Send `sig` to `pid`; False when the process had ended (it may end on its own at any
    moment: a loss of its own, a kill by the recovery)."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


# --------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=None, help="chaos time (default 10)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", type=int, default=None, help="default: 2.5 a minute")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help="the faults to draw from (comma-separated)"
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=JOB["checkpoint_every"], help="0: no checkpoints"
    )
    parser.add_argument("--spares", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=None, help="3-CPU nodes (default: room)")
    parser.add_argument("--peer-timeout", type=float, default=10.0, help="peer_timeout_s")
    parser.add_argument(
        "--health-wait", type=float, default=120.0, help="s a fault waits for the group"
    )
    parser.add_argument("--quick", action="store_true", help="a ~2-minute smoke")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--out", default="bench_results", help="folder for chaos.json")
    return parser


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Run the chaos soak; print the report; write ``<out>/chaos.json``."""
    args = _parser().parse_args(argv)
    if args.minutes is None:
        args.minutes = 1.5 if args.quick else 10.0
    if args.faults is None:
        args.faults = 5 if args.quick else max(1, round(2.5 * args.minutes))
    if args.nodes is None:
        # The workers and spares, and a node's worth of room to move to.
        args.nodes = -(-(args.workers + args.spares) // _CPUS_PER_NODE) + 1
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise SystemExit(f"--kinds: unknown {unknown}; known: {list(KINDS)}")
    schedule = plan_faults(args.faults, args.minutes * 60, args.seed, kinds)
    folder = Path(args.out) / "chaos"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "schedule.json").write_text(json.dumps([asdict(f) for f in schedule], indent=1))
    print(f"schedule (seed {args.seed}): " + ", ".join(f"{f.at_s:g}s {f.kind}" for f in schedule))
    result: dict[str, Any]
    with _cluster(args.nodes) as cluster:
        chaos = Chaos(args, folder.resolve(), cluster)
        try:
            chaos.run(schedule)
            ref = _reference(chaos)
            result = report(chaos, ref, schedule)
        except ProductProblem as exc:
            chaos.say(f"PROBLEM: {str(exc).splitlines()[0]}")
            if chaos.proc is not None and chaos.proc.poll() is None:
                chaos.proc.kill()
            result = {
                "seed": args.seed,
                "problems": [*chaos.problems, str(exc)],
                "faults": [asdict(f) for f in chaos.faults],
                "schedule": [asdict(f) for f in schedule],
                "folder": str(folder),
            }
        (folder / "orchestrator.log").write_text("\n".join(chaos.log) + "\n")
    result["schedule"] = [asdict(f) for f in schedule]
    if "epochs" in result:
        print_report(result)
    else:
        print(f"\nchaos run stopped by a problem (seed {args.seed}); see {folder}")
        for problem in result["problems"]:
            print(f"  PROBLEM: {problem}")
    payload = {k: v for k, v in result.items() if k not in ("faults", "schedule")}
    _common.write_results(args.out, "chaos", [payload], args, faults=result.get("faults"))
    if args.json:
        print(json.dumps(result, indent=1))
    return result


@contextlib.contextmanager
def _cluster(nodes: int) -> Iterator[Any]:
    """`_drain.cluster`'s layout (a head without CPUs) with `nodes` nodes of `_CPUS_PER_NODE`
    CPUs, and this process not connected: it drives the cluster, the drivers train on it (a
    connected process would print every node's removal)."""
    from ray.cluster_utils import Cluster

    started = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": 0, "include_dashboard": False},
    )
    try:
        for _ in range(nodes):
            started.add_node(num_cpus=_CPUS_PER_NODE)
        started.wait_for_nodes()
        yield started
    finally:
        started.shutdown()


def _reference(chaos: Chaos) -> dict[str, Any]:
    """The same job for as many epochs, without faults, in a folder of its own."""
    status = chaos.status()
    epochs = int(status.get("epochs_done", status.get("epoch", 0)))
    ref_folder = chaos.folder / "reference"
    (ref_folder / "rows").mkdir(parents=True)
    (ref_folder / "workers").mkdir()
    reference = Chaos(chaos.args, ref_folder, chaos.cluster)
    chaos.say(f"reference: the same job for {epochs} epochs without faults")
    reference.launch(resume=False, epochs=epochs, name="(reference)")
    code = reference.proc.wait()
    final = reference.status()
    if code != 0 or final.get("phase") != "done":
        raise ProductProblem(reference._driver_died())
    chaos.say(f"reference done in {final['loop_s']:.1f} s")
    return {
        "weights": str(ref_folder / "weights.pt"),
        "loop_s": final["loop_s"],
        "failures": final.get("failures", 0),
    }


if __name__ == "__main__":
    main()

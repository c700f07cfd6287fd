"""The trainer's worker side: what runs in each worker process, called by the driver.

`calls` holds the functions the driver runs on its workers; each worker keeps its runner (the
operator and its loop, built by `build`) and its `state` (what it holds of the training state: the interface its
kind implements, the kinds being the `state` folder's, which uses the machinery here:
`snapshots` and their `snapshot_schedule`, `part_exchange`, `transfer`, `rank_replicas`). The
step hooks: `periodic_checkpoints` (`checkpoint_every`), `boundary_watch`
(stopping every worker at one step boundary for a move or a joining spare) and
`collective_bound` (how long a worker waits for a silent peer).
"""

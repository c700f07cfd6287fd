"""One rank of test_sharded_memory.py's checks (run as a script, not collected).

Usage: python _memory_worker.py PHASE RANK WORLD_SIZE INIT_FILE DIR

- ``keep``: train a model sharded over WORLD_SIZE ranks for a step, keep its state in memory
  (`sharded_memory`), and write this rank's chunks (and on rank 0 the metadata) to DIR, with the
  whole state it trained to (gathered) for the comparison.
- ``load``: build the model afresh, sharded over WORLD_SIZE ranks, and load every rank's chunks
  from DIR into it, resharded: first without rank 0's part (which must fail on every rank with
  the same error), then whole. Writes the whole state it then holds, and the error, to DIR.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from raysgd_operator import sharded_memory
from raysgd_operator._internal.sharded import load_files, tensor_state


def _model(world_size: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    # 12 and 5 rows: shards of uneven sizes over 4 ranks and over 3, which straddle each other.
    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 5))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _whole(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    full = StateDictOptions(full_state_dict=True)
    return {
        "model": get_model_state_dict(model, options=full),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=full)["state"],
    }


def _check_staged(tensors: dict, staged: dict) -> None:
    """The copy keeps the structure and every DTensor's layout, and all of it is one buffer (what
    gives its memory back at once; it also checks the one private use, DTensor's constructor)."""
    from torch.distributed.tensor import DTensor

    storages = set()

    def walk(a: dict, b: dict) -> None:
        assert a.keys() == b.keys()
        for key, value in a.items():
            if isinstance(value, dict):
                walk(value, b[key])
                continue
            copy = b[key]
            assert type(copy) is type(value), (key, type(copy))
            if isinstance(value, DTensor):
                assert copy.device_mesh == value.device_mesh
                assert copy.placements == value.placements and copy.shape == value.shape
                copy, value = copy.to_local(), value.to_local()
            assert copy.device.type == "cpu" and torch.equal(copy, value)
            storages.add(copy.untyped_storage().data_ptr())

    walk(tensors, staged)
    assert len(storages) == 1, storages


def main() -> None:
    phase, rank, world_size, init_file, out = sys.argv[1:]
    rank, world_size, out_dir = int(rank), int(world_size), Path(out)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    model, optimizer = _model(world_size)
    if phase == "keep":
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        model(x).square().mean().backward()
        optimizer.step()
        whole = _whole(model, optimizer)
        if rank == 0:
            torch.save(whole, out_dir / "kept.pt")
        tensors, others = tensor_state([model], [optimizer])
        staged = sharded_memory.stage(tensors)
        _check_staged(tensors, staged)
        # Training goes on: what is kept is the copy.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        metadata, chunks = sharded_memory.keep(staged, None)
        torch.save(chunks, out_dir / f"chunks{rank}.pt")
        if rank == 0:
            (out_dir / "metadata").write_bytes(metadata)  # type: ignore[arg-type]
            (out_dir / "others").write_bytes(pickle.dumps(others))
    else:
        metadata = (out_dir / "metadata").read_bytes()
        others = pickle.loads((out_dir / "others").read_bytes())
        parts = sorted(out_dir.glob("chunks*.pt"))
        every = [torch.load(p, weights_only=False) for p in parts]
        chunks = {k: v for part in every for k, v in part.items()}
        missing = {k: v for part in every[1:] for k, v in part.items()}
        error = None
        try:
            load_files([model], [optimizer], sharded_memory.reader(metadata, missing), others)
        except ValueError as exc:
            error = str(exc)
        load_files([model], [optimizer], sharded_memory.reader(metadata, chunks), others)
        torch.save(
            {"whole": _whole(model, optimizer), "error": error}, out_dir / f"loaded{rank}.pt"
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

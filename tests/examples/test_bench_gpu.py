"""`bench:gpu` on a machine without a GPU: it says so, measures nothing and succeeds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raysgd_examples.bench import gpu, run_all


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_bench_without_a_gpu_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpu.gpu_count() == 0
    assert gpu.main(["--out", str(tmp_path)]) == {}
    assert "no GPU is visible" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
    # bench:all leaves it out unless asked for it.
    assert not run_all._gpu_visible()


def test_gpu_bench_rejects_unknown_precisions() -> None:
    with pytest.raises(SystemExit):
        gpu.main(["--precisions", "fp8"])


def test_builtin_resnet50_has_resnet50_shapes() -> None:
    from raysgd_examples.bench._resnet import resnet50_like

    model = resnet50_like(num_classes=10)
    # torchvision's resnet50 has 25,557,032 parameters with 1000 classes; 10 classes drop
    # 990 * (2048 + 1) of them.
    assert sum(p.numel() for p in model.parameters()) == 25_557_032 - 990 * 2049
    assert model(torch.zeros(1, 3, 64, 64)).shape == (1, 10)

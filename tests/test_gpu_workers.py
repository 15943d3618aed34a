"""`--workers N --device cuda`: worker i runs on its own GPU, cuda:i; fewer GPUs than workers is refused up front.

No GPU is needed: the device count is monkeypatched, and the refusal comes before anything touches CUDA.
"""

from __future__ import annotations

import pytest
import torch

from stagereplay.engine.model import ModelConfig
from stagereplay.errors import StageReplayError
from stagereplay.execution.local import check_worker_devices, worker_config


def _gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_worker_i_gets_cuda_i_and_a_pinned_or_cpu_device_is_kept():
    cuda = ModelConfig(path="m", device="cuda")
    assert [worker_config(cuda, i).device for i in (0, 1, 3)] == ["cuda:0", "cuda:1", "cuda:3"]
    assert worker_config(cuda, None).device == "cuda"  # the command's own process
    assert worker_config(ModelConfig(path="m", device="cuda:2"), 1).device == "cuda:2"
    assert worker_config(ModelConfig(path="m"), 1).device == "cpu"


def test_fewer_gpus_than_workers_is_refused_in_one_line(monkeypatch):
    _gpus(monkeypatch, 1)
    with pytest.raises(StageReplayError) as exc:
        check_worker_devices("cuda", 2)
    assert "--workers 2 with --device cuda needs one GPU per worker, 1 visible" in str(exc.value)
    assert "\n" not in str(exc.value)
    # Negative control: with as many GPUs as workers, the same request passes.
    _gpus(monkeypatch, 2)
    check_worker_devices("cuda", 2)
    # One worker, a pinned GPU, the CPU or Ray (one GPU per actor by its own scheduling) are not refused.
    _gpus(monkeypatch, 1)
    for device, workers, executor in (("cuda", 1, "local"), ("cuda:0", 2, "local"), ("cpu", 2, "local"),
                                      ("cuda", 2, "ray")):
        check_worker_devices(device, workers, executor)


def test_the_cli_refuses_before_any_run_directory_exists(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from stagereplay.cli import app

    _gpus(monkeypatch, 1)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["matched", "--n", "2", "--device", "cuda", "--workers", "2", "--out", str(out)])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --workers 2 with --device cuda needs one GPU per worker")
    assert not out.exists()

"""DDP on CPU: two processes (gloo) launched by `accelerate launch` end with identical heads."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from test_training_support import base_config, make_data, tiny_model_dir

WORKER = r'''
import json, sys
from accelerate import PartialState
from safetensors.torch import save_file
from cadence.training.trainer import TrainConfig, train

cfg = TrainConfig(**json.loads(sys.argv[1]))
res = train(cfg)
rank = PartialState().process_index
save_file({k: v.detach().contiguous() for k, v in res.heads.state_dict().items()},
          f"{cfg.out}/rank{rank}.safetensors")
from cadence.training.command import _leave_process_group
_leave_process_group()  # as `cadence train` does: no gloo threads alive at exit
'''


def _launcher() -> list[str]:
    exe = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which("accelerate")
    if exe is None:
        pytest.skip("accelerate launcher not found")
    # --multi_gpu selects the torchrun launcher; with --device cpu each process uses gloo on CPU
    return [exe, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517"]


def test_two_ranks_end_identical(tmp_path):
    model = tiny_model_dir(tmp_path)
    data = make_data(tmp_path / "data")
    out = tmp_path / "out"
    cfg = base_config(data, out, model, steps=6, grad_accum=2, eval_every=3, save_every=3)
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(_launcher() + [str(worker), json.dumps(cfg.__dict__)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = load_file(str(out / "rank0.safetensors")), load_file(str(out / "rank1.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["status"] == "finished"
    # each optimizer step consumed processes x batch x accumulation = 8 rows
    assert summary["step"] == 6
    heads = load_file(str(out / "heads" / "heads.safetensors"))
    assert all((heads[k] == a[k]).all() for k in a)

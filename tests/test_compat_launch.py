"""Unmodified Bagua scripts: ``bagua.torch_api.*`` served by the compat layer
(functional_bagua.compat.bagua_alias) and Bagua's launcher over torchrun
(functional_bagua.compat.launch). Reference: the compat modules themselves (the aliases are
those objects) and a 2-rank run of a script written as Bagua's examples are."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.cpu_only("starts ranks as CPU processes through torchrun")

ALIASES = """
import sys
from functional_bagua.compat import bagua_alias
names = bagua_alias.install()
import bagua.torch_api as bagua
from bagua.torch_api.algorithms import gradient_allreduce, decentralized, bytegrad, q_adam, async_model_average
from bagua.torch_api.contrib import fuse_optimizer
from bagua.torch_api.data_parallel import DistributedDataParallel
import bagua.torch_api.communication as communication
import functional_bagua.compat as compat
assert bagua is compat and gradient_allreduce is compat.algorithms.gradient_allreduce
assert DistributedDataParallel is compat.data_parallel.DistributedDataParallel
assert communication is compat.communication and fuse_optimizer is compat.contrib.fuse_optimizer
try:
    import bagua.torch_api.model_parallel
except ImportError:
    print("no model_parallel")
print(len(names))
"""

SCRIPT = """
import torch
from helper import STEPS  # a module beside the script, as python script.py finds it
import torch.nn.functional as F
import bagua.torch_api as bagua
from bagua.torch_api.algorithms import gradient_allreduce

bagua.init_process_group()
torch.manual_seed(bagua.get_rank())  # different weights on each rank: wrapping broadcasts rank 0's
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model = model.with_bagua([optimizer], gradient_allreduce.GradientAllReduceAlgorithm())
gen = torch.Generator().manual_seed(10 + bagua.get_rank())
for _ in range(STEPS):
    optimizer.zero_grad()
    F.mse_loss(model(torch.randn(8, 4, generator=gen)), torch.randn(8, 1, generator=gen)).backward()
    optimizer.step()
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
everyone = [torch.empty_like(weights) for _ in range(bagua.get_world_size())]
torch.distributed.all_gather(everyone, weights)
print(f"rank {bagua.get_rank()} of {bagua.get_world_size()}, local {bagua.get_local_rank()}: "
      f"replicas equal {all(torch.equal(w, everyone[0]) for w in everyone)}")
"""


def test_bagua_module_names_are_the_compat_modules():
    result = subprocess.run([sys.executable, "-c", ALIASES], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.split()
    assert "model_parallel" in result.stdout and int(lines[-1]) > 10


def test_a_bagua_script_runs_unchanged_under_the_launcher(tmp_path):
    from dist_harness import free_port

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    (tmp_path / "helper.py").write_text("STEPS = 3\n")
    command = [sys.executable, "-m", "functional_bagua.compat.launch", "--nproc_per_node", "2"]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(free_port()), "--autotune_level", "1"]
    command += ["--enable_bagua_net", str(script)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "ignoring Bagua-only options ['--autotune_level', '--enable_bagua_net']" in result.stderr
    for rank in (0, 1):
        assert f"rank {rank} of 2, local {rank}: replicas equal True" in result.stdout, result.stdout


def test_launcher_arguments_go_to_torchrun_and_the_script():
    from functional_bagua.compat.launch import torchrun_arguments

    arguments, ignored = torchrun_arguments(
        ["--nproc_per_node", "4", "--bagua_service_port", "8123", "--report_metrics", "train.py", "--lr", "0.1"]
    )
    assert arguments == [
        "--nproc_per_node",
        "4",
        "-m",
        "functional_bagua.compat.bagua_alias",
        "train.py",
        "--lr",
        "0.1",
    ]
    assert ignored == ["--bagua_service_port", "--report_metrics"]
    with pytest.raises(SystemExit, match="give the training script"):
        torchrun_arguments(["--nproc_per_node", "2"])

"""`commlens describe-model` in a user's environment: a real module of theirs, the real CLI, and a real DDP job
(torch.distributed on gloo, two processes, profiled) whose every call the description predicts to the byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commlens.backend.attribution import attribute_run
from commlens.backend.compare import compare
from commlens.contract.model_description import ConfigFile, ModelDescription
from commlens.service.config import attach_config
from commlens.service.ingest import ingest_paths

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
COMMLENS = str(ROOT / ".venv" / "bin" / "commlens")

# A user's own module: mixed dtypes (a float64 head), a frozen layer, BatchNorm buffers, an extra float64 buffer,
# a parameter larger than a 1 MiB cap, and a factory that cannot build on the meta device.
USER_MODULE = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class Net(nn.Module):
    def __init__(self, width=8, blocks=2):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(blocks)])
        self.big = nn.Linear(width, 300_000)
        self.head = nn.Linear(300_000, 10).double()
        self.register_buffer("scale", torch.ones(5, dtype=torch.float64))

    def forward(self, x):
        x = self.blocks(self.stem(x)).mean(dim=(2, 3))
        return self.head(self.big(x).double() * self.scale[0])


def build(width=8, blocks=2):
    return Net(width, blocks)


def needs_real_tensors(width=8):
    net = Net(width)
    net.stem.weight.sum().item()  # data-dependent: impossible on the meta device
    return net
"""

DDP_SCRIPT = """
import os, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
sys.path.insert(0, os.getcwd())
import mymodel

rank, out = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", rank=rank, world_size=2)
torch.manual_seed(0)
model = DDP(mymodel.build(width=8), bucket_cap_mb=1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(2, 3, 6, 6)
schedule = torch.profiler.schedule(wait=2, warmup=1, active=2)
with torch.profiler.profile(schedule=schedule, record_shapes=True) as prof:
    for _ in range(5):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        prof.step()
prof.export_chrome_trace(os.path.join(out, f"rank{rank}.pt.trace.json"))
dist.destroy_process_group()
"""


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    (tmp_path / "mymodel.py").write_text(USER_MODULE)
    return tmp_path


def _describe(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [COMMLENS, "describe-model", *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def test_describes_every_tensor_in_order(user_dir: Path) -> None:
    r = _describe(user_dir, "mymodel:build", "--args", '{"width": 16}', "--dp", "2", "--out", "d.json")
    assert r.returncode == 0, r.stderr
    assert "built on the meta device" in r.stderr
    desc = ModelDescription.model_validate_json((user_dir / "d.json").read_text())
    sys.path.insert(0, str(user_dir))
    try:
        import mymodel  # the user's module, imported here only to check the description against it
    finally:
        sys.path.pop(0)
    net = mymodel.build(width=16)
    assert [(p.name, p.shape, p.dtype, p.requires_grad) for p in desc.parameters] == [
        (n, list(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad) for n, p in net.named_parameters()
    ]
    assert [(b.name, b.shape, b.dtype) for b in desc.buffers] == [
        (n, list(b.shape), str(b.dtype).removeprefix("torch.")) for n, b in net.named_buffers()
    ]
    assert desc.parameters[2].name == "frozen.weight" and not desc.parameters[2].requires_grad
    assert desc.torch_version == torch.__version__
    s = desc.strategy
    assert (s.kind, s.dp, s.bucket_cap_mb, s.first_bucket_bytes, s.broadcast_buffers) == ("ddp", 2, None, 2**20, True)
    # one tensor per line; requires_grad written only where it is false
    text = (user_dir / "d.json").read_text()
    assert '{"name": "stem.weight", "shape": [16, 3, 3, 3], "dtype": "float32"}' in text
    assert text.count("requires_grad") == 2


def test_strategy_options_and_wrapping_units(user_dir: Path) -> None:
    r = _describe(user_dir, "mymodel:build", "--bucket-cap-mb", "10", "--no-broadcast-buffers", "--wrap", "Block")
    assert r.returncode == 0, r.stderr
    desc = ModelDescription.model_validate_json(r.stdout)
    assert desc.strategy.first_bucket_bytes == 10 * 2**20  # PyTorch 2.13: a given cap is the first bucket's too
    assert not desc.strategy.broadcast_buffers
    units = {u.name: u.params for u in desc.strategy.units}
    assert list(units) == ["", "blocks.0", "blocks.1"]
    assert units["blocks.1"] == ["blocks.1.conv.weight", "blocks.1.conv.bias", "blocks.1.bn.weight", "blocks.1.bn.bias"]
    assert units[""][:2] == ["stem.weight", "stem.bias"]


def test_a_factory_the_meta_device_cannot_build_is_built_normally(user_dir: Path) -> None:
    r = _describe(user_dir, "mymodel:needs_real_tensors", "--args", "[4]")
    assert r.returncode == 0, r.stderr
    assert "could not build on the meta device" in r.stderr
    assert ModelDescription.model_validate_json(r.stdout).parameters[0].shape == [4, 3, 3, 3]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nosuchmodule:build"], "cannot import 'nosuchmodule'"),
        (["mymodel:nothing"], "'mymodel' has no attribute 'nothing'"),
        (["mymodel"], "expected MODULE:FACTORY"),
        (["mymodel:build", "--args", "{width: 3}"], "--args is not JSON"),
        (["mymodel:build", "--args", '{"depth": 3}'], "the factory failed: TypeError"),
        (["mymodel:build", "--strategy", "zero"], "needs strategy.zero_stage"),
        # options are checked before the user's module is imported: no build to wait for to learn of a typo
        (["nosuchmodule:build", "--strategy", "zero"], "needs strategy.zero_stage"),
    ],
)
def test_bad_targets_say_what_is_wrong(user_dir: Path, args: list[str], message: str) -> None:
    r = _describe(user_dir, *args)
    assert r.returncode == 2
    assert message in r.stderr


def test_a_real_ddp_job_predicted_to_the_byte(user_dir: Path, con) -> None:
    """Two gloo processes train the user's model under DDP (bucket_cap_mb=1); the description the CLI writes,
    attached to the ingested run, predicts every profiled call: per-dtype buckets, the frozen layer left out,
    a parameter larger than the cap, buffers broadcast per dtype."""
    r = _describe(user_dir, "mymodel:build", "--dp", "2", "--bucket-cap-mb", "1", "--out", "d.json")
    assert r.returncode == 0, r.stderr
    (user_dir / "ddp.py").write_text(DDP_SCRIPT)
    traces = user_dir / "traces"
    traces.mkdir()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    procs = [
        subprocess.Popen([sys.executable, "ddp.py", str(rank), str(traces)], cwd=user_dir, env=env) for rank in (0, 1)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert not ingest_paths(con, sorted(traces.iterdir()), "job").failed
    attribute_run(con, "job")
    attached = attach_config(con, "job", [ConfigFile(name="d.json", content=(user_dir / "d.json").read_text())])
    assert attached.stored == "model_description"
    c = compare(con, "job")
    assert c.config_source == "run"
    assert c.ranks == ["0", "1"]
    got = sorted((o.op, o.dtype, o.msg_bytes, o.measured_calls_per_iter, o.status) for s in c.schemes for o in s.ops)
    width = 8
    block = (width * width * 9 + width) * 4 + 2 * width * 4
    assert got == sorted(
        [
            ("all_reduce", "float64", 300_000 * 10 * 8 + 10 * 8, 1.0, "match"),  # the head alone in float64
            ("all_reduce", "float32", 300_000 * 4, 1.0, "match"),  # big.bias: over the 1 MiB cap, alone
            ("all_reduce", "float32", 300_000 * width * 4, 1.0, "match"),  # big.weight: alone too
            ("all_reduce", "float32", 2 * block + (3 * width * 9 + width) * 4, 1.0, "match"),  # the rest
            ("broadcast", "float32", 2 * 2 * width * 4, 1.0, "match"),  # running statistics
            ("broadcast", "int64", 2 * 8, 1.0, "match"),  # num_batches_tracked
            ("broadcast", "float64", 5 * 8, 1.0, "match"),  # the extra buffer
        ]
    )
    assert c.exact


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_descriptions_are_validated_with_their_field() -> None:
    bad = {"schema": "commlens.model-description/1", "parameters": [{"name": "w", "shape": [2], "dtype": "float33"}]}
    with pytest.raises(ValueError, match=r"parameters\.0\n.*unknown dtype .float33."):
        ModelDescription.model_validate(bad)
    dup = {
        "schema": "commlens.model-description/1",
        "parameters": [{"name": "w", "shape": [2], "dtype": "float32"}] * 2,
    }
    with pytest.raises(ValueError, match=r"parameters\[1\]: name 'w' repeats"):
        ModelDescription.model_validate(dup)
    assert json.loads(
        ModelDescription.model_validate(dup | {"parameters": dup["parameters"][:1]}).model_dump_json(by_alias=True)
    )["schema"]

"""Stand-ins round trip: read common state without torch/megatron, write it back, real megatron-core reads
equal objects."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from conftest import FIXTURES, REPO, blocker, fixture_names, require_mcore

ROUND_TRIP = """
import sys
from pathlib import Path
from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.formats.torch_zip import dump_torch_zip
ckpt = open_checkpoint(sys.argv[1])
Path(sys.argv[2]).write_bytes(dump_torch_zip(ckpt.common_state()))
assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')]
"""


def _deep_equal(a, b, torch) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_deep_equal(a[k], b[k], torch) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_deep_equal(x, y, torch) for x, y in zip(a, b))
    if hasattr(a, "__dict__") and not isinstance(a, type) and not hasattr(type(a), "__members__"):
        return _deep_equal(vars(a), vars(b), torch)
    return a == b


def _original_common(name: str, torch):
    iteration_dir = FIXTURES / name / "iter_0000010"
    if (iteration_dir / "common.pt").exists():
        return torch.load(iteration_dir / "common.pt", weights_only=False)
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(iteration_dir))


@pytest.mark.mcore
@pytest.mark.parametrize("name", [n for n in fixture_names() if n.startswith(("core016_tp1", "core019_tp2"))])
def test_common_state_round_trips_to_real_megatron_objects(tmp_path, name):
    torch = pytest.importorskip("torch")
    require_mcore()
    import megatron.core.enums

    out = tmp_path / "common_rewritten.pt"
    code = blocker({"torch", "megatron"}) + ROUND_TRIP
    result = subprocess.run(
        [sys.executable, "-c", code, str(FIXTURES / name), str(out)], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    original = _original_common(name, torch)
    rewritten = torch.load(io.BytesIO(out.read_bytes()), weights_only=False)
    assert isinstance(rewritten["args"].model_type, megatron.core.enums.ModelType)
    assert rewritten["args"].model_type is original["args"].model_type
    assert vars(rewritten["args"]) == vars(original["args"])
    assert _deep_equal(rewritten, original, torch)


METADATA_ROUND_TRIP = """
import sys
from pathlib import Path
from ckptdoctor.pickle import unpickler
from ckptdoctor.formats import torch_dist
from ckptdoctor.pickle.stand_ins import Record
metadata = torch_dist.load_metadata_object(Path(sys.argv[1]))
plans = torch_dist.record_attr(metadata, "all_local_plans")
item = torch_dist.record_attr(plans[0], "items")[0]
assert isinstance(item, Record) and isinstance(torch_dist.record_attr(item, "tensor_data"), Record)
Path(sys.argv[2]).write_bytes(unpickler.dumps(metadata))
assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')]
"""


@pytest.mark.mcore
@pytest.mark.parametrize("name", ["core015_tp2", "core019_tp2", "core019_moe_ep2"])
def test_metadata_with_save_plans_round_trips_to_real_torch_objects(tmp_path, name):
    """A rewrite's read of .metadata (plan parts built as C-speed records) pickles back to the very objects torch
    and megatron-core read from the source: every rank's SavePlan, WriteItem and TensorWriteData included."""
    torch = pytest.importorskip("torch")
    require_mcore()
    import pickle

    import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401  (MCoreSavePlan, MCoreMetadata)

    source = FIXTURES / name / "iter_0000010" / ".metadata"
    out = tmp_path / "metadata_rewritten"
    code = blocker({"torch", "megatron"}) + METADATA_ROUND_TRIP
    result = subprocess.run(
        [sys.executable, "-c", code, str(source), str(out)], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    original = pickle.loads(source.read_bytes())
    rewritten = pickle.loads(out.read_bytes())
    plan = rewritten.all_local_plans[0]
    assert type(plan) is type(original.all_local_plans[0]) and type(plan.items[0]).__name__ == "WriteItem"
    # (MCoreSavePlan, core 0.14-0.15, compares by identity: its write items do not)
    assert [p.items for p in rewritten.all_local_plans] == [p.items for p in original.all_local_plans]
    assert rewritten.state_dict_metadata == original.state_dict_metadata
    assert rewritten.storage_data == original.storage_data
    assert _deep_equal(rewritten, original, torch)

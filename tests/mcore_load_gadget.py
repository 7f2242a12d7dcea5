"""Run planted gadgets (tests/gadget_corpus.py) through real megatron-core 0.19.2 / PyTorch DCP loads, on CPU:

    python tests/mcore_load_gadget.py CASES_JSON

CASES_JSON is a list of ``{"name", "via", "path", "key"}``; each case runs in its own forked process (a gadget may
change a shared class, e.g. ``argparse.Namespace``), megatron-core imported first:

* ``"pickle_loads"``: ``pickle.loads`` of the file ``path`` (a gadget's payload), megatron-core importable;
* ``"read_metadata"``: ``torch.distributed.checkpoint.FileSystemReader(path).read_metadata()`` (plain ``pickle.load``);
* ``"load_common"``: ``megatron.core.dist_checkpointing.load_common_state_dict(path)``;
* ``"load_object"``: ``megatron.core.dist_checkpointing.load`` of a request for the one ShardedObject ``key``
  (``<key>/shard_<offset>_<shape>``), on a one-rank gloo process group.

Prints one line per case: ``CASE <name> {"outcome": "loads" | "fails", "error": ...}``. Whether the gadget ran
is the marker file the caller looks for.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import typing
from pathlib import Path

import typing_extensions

typing.override = typing_extensions.override  # type: ignore[attr-defined]  # megatron.training uses 3.12's

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))

import generate as gen  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _object_request(key: str) -> dict:
    """Every shard of ``key``'s object (one rank requests them all: validation wants the whole grid); the
    planted one under "obj"."""
    import itertools

    from megatron.core.dist_checkpointing.mapping import ShardedObject

    base, shard = key.rsplit("/shard_", 1)
    offset, shape = (tuple(int(x) for x in part.split(".")) for part in shard.split("_"))
    request = {}
    for other in itertools.product(*(range(n) for n in shape)):
        name = "obj" if other == offset else f"obj{'_'.join(map(str, other))}"
        request[name] = ShardedObject(base, None, shape, other, replica_id=0)
    return request


def run_case(case: dict, store: str) -> dict:
    import pickle

    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    via, path = case["via"], case["path"]
    if via == "pickle_loads":
        pickle.loads(Path(path).read_bytes())
    elif via == "read_metadata":
        FileSystemReader(path).read_metadata()
    elif via == "load_common":
        dist_checkpointing.load_common_state_dict(path)
    elif via == "load_object":
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        loaded = dist_checkpointing.load(_object_request(case["key"]), path)
        if loaded["obj"] is None:
            raise RuntimeError("the object did not load")
    else:
        raise ValueError(via)
    return {"outcome": "loads"}


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    gen.install_cpu_shims()
    logging.disable(logging.WARNING)
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.transformer.spec_utils  # noqa: F401
    import megatron.training.config.instantiate_utils  # noqa: F401  # importable, as in a Megatron-LM run

    with tempfile.TemporaryDirectory() as tmp:
        for n, case in enumerate(cases):
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - ends in os._exit
                try:
                    result = run_case(case, f"{tmp}/store{n}")
                except BaseException as exc:  # noqa: BLE001  # SystemExit included
                    result = {"outcome": "fails", "error": f"{type(exc).__name__}: {exc}"[:300]}
                print(f"CASE {case['name']} {json.dumps(result)}", flush=True)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status):
                print(f"CASE {case['name']} " + json.dumps({"outcome": "crashed", "status": status}), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()

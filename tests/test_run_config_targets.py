"""The code in a Megatron-Bridge run_config.yaml: every _target_ (and _builder_) is found, in any YAML form a loader
reads, and judged against the allowlist; whatever the scanner cannot attribute with certainty is a finding."""

from __future__ import annotations

import collections
import random
import re
import time
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor.formats import run_config_targets as targets_module
from ckptdoctor.formats.run_config_allowlist import ALLOWLIST, allowed_uses
from ckptdoctor.formats.run_config_targets import (
    MAX_DEPTH,
    MAX_FINDINGS,
    MAX_LINES,
    TargetFinding,
    TargetScan,
    describe,
    scan_targets,
    summarize,
)

try:
    import yaml
except ImportError:  # PyYAML is optional: the differential tests need it, the rest do not
    yaml = None

# Modelled on a Bridge 0.2-era ConfigContainer.to_yaml() dump (yaml.safe_dump: sorted keys, block style, lists at
# their key's indentation), cut down, plus the later forms: the ModelConfig/_builder_ model, MLM-side configs, PEFT.
REALISTIC = """\
_target_: megatron.bridge.training.config.ConfigContainer
checkpoint:
  _target_: megatron.bridge.training.config.CheckpointConfig
  async_save: false
  ckpt_format: torch_dist
  load: /opt/Megatron-Bridge/nemo_experiments/default/checkpoints
  save_interval: 500
  save_rng: true
comm_overlap: null
dataset:
  _target_: megatron.bridge.training.config.GPTDatasetConfig
  blend: null
  split: 1,1,1
  split_matrix:
  - - 0
    - 0.3333333333333333
  - - 0.3333333333333333
    - 0.6666666666666666
  tokenizer:
    _call_: true
    _target_: megatron.bridge.training.tokenizers.tokenizer._NullTokenizer
mixed_precision:
  _target_: megatron.bridge.training.mixed_precision.MixedPrecisionConfig
  bf16: true
  fp8: null
  params_dtype:
    _call_: false
    _target_: torch.bfloat16
model:
  _target_: megatron.bridge.models.llama.llama_provider.Llama31ModelProvider
  activation_func:
    _call_: false
    _target_: torch.nn.functional.silu
  attention_backend:
    _args_:
    - 5
    _call_: true
    _target_: megatron.core.transformer.enums.AttnBackend
  config_logger_dir: ''
  embedding_init_method:
    _args_: []
    _partial_: true
    _target_: torch.nn.init.normal_
    mean: 0.0
    std: 0.02
  finalize_model_grads_func:
    _call_: false
    _target_: megatron.core.distributed.finalize_model_grads.finalize_model_grads
  generation_config:
    _call_: true
    _target_: transformers.generation.configuration_utils.GenerationConfig.from_dict
    config_dict:
      _from_model_config: true
      bos_token_id: 128000
      do_sample: true
      temperature: 0.6
      transformers_version: 4.53.3
  grad_scale_func:
    _call_: false
    _target_: megatron.core.optimizer.optimizer.MegatronOptimizer.scale_loss
  grad_sync_func:
    _call_: false
    _target_: megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.start_grad_sync
  layernorm_epsilon: 1.0e-05
  normalization: RMSNorm
  num_attention_heads: 32
  pipeline_model_parallel_size: 1
  recompute_modules:
  - core_attn
  tensor_model_parallel_size: 1
  timers:
    _call_: true
    _target_: megatron.core.timers.Timers
  transformer_layer_spec:
    _call_: false
    _target_: megatron.bridge.models.gpt_provider.default_layer_spec
optimizer:
  _target_: megatron.bridge.training.config.OptimizerConfig
  exp_avg_dtype:
    _call_: false
    _target_: torch.float32
  lr: 0.0003
peft:
  _target_: megatron.bridge.peft.lora.LoRA
  alpha: 32
  target_modules:
  - linear_qkv
  - linear_proj
rng:
  _target_: megatron.training.config.common_config.RNGConfig
  seed: 1234
tokenizer:
  _target_: megatron.bridge.training.tokenizers.config.TokenizerConfig
  tokenizer_model: null
  tokenizer_type: NullTokenizer
  vocab_size: 128256
train:
  _target_: megatron.bridge.training.config.TrainingConfig
  exit_signal:
    _args_:
    - 15
    _call_: true
    _target_: signal.Signals
  global_batch_size: 512
  train_iters: 10
"""

# The ModelConfig form: Bridge rebuilds it with ModelConfig.from_dict and imports the _builder_ class.
MODEL_CONFIG_FORM = """\
model:
  _builder_: megatron.bridge.models.gpt.gpt_builder.GPTModelBuilder
  _target_: megatron.bridge.models.gpt.model_config.BridgeGPTModelConfig
  seq_length: 4096
  transformer:
    _target_: megatron.bridge.models.transformer_config.TransformerConfig
    activation_func: silu
    num_layers: 2
"""


def _one(text: str) -> TargetFinding:
    scan = scan_targets(text)
    assert scan.findings, text
    return scan.findings[0]


def _uses(scan: TargetScan) -> dict[str, str]:
    return {target.path: f"{target.target} {target.use}" for target in scan.targets}


# --- what passes ----------------------------------------------------------------------------------------------------


def test_a_realistic_bridge_run_config_passes_with_every_target_found():
    scan = scan_targets(REALISTIC)
    assert scan.findings == () and not scan.refused
    uses = _uses(scan)
    assert len(uses) == 23
    assert uses["_target_"] == "megatron.bridge.training.config.ConfigContainer call"
    assert uses["model._target_"] == "megatron.bridge.models.llama.llama_provider.Llama31ModelProvider call"
    assert uses["model.activation_func._target_"] == "torch.nn.functional.silu reference"
    assert uses["model.attention_backend._target_"] == "megatron.core.transformer.enums.AttnBackend call"
    assert uses["model.embedding_init_method._target_"] == "torch.nn.init.normal_ partial"
    assert uses["dataset.tokenizer._target_"].endswith("_NullTokenizer call")
    assert uses["tokenizer._target_"] == "megatron.bridge.training.tokenizers.config.TokenizerConfig call"
    assert uses["train.exit_signal._target_"] == "signal.Signals call"
    lines = {target.path: target.line for target in scan.targets}
    assert lines["model._target_"] == 30 and lines["model.activation_func._target_"] == 33
    assert [target.line for target in scan.targets] == sorted(target.line for target in scan.targets)
    assert summarize(scan) == "run_config.yaml: 23 _target_ entries, all on the allowlist"


def test_the_model_config_form_with_its_builder_passes():
    scan = scan_targets(MODEL_CONFIG_FORM)
    assert scan.findings == ()
    assert _uses(scan) == {
        "model._builder_": "megatron.bridge.models.gpt.gpt_builder.GPTModelBuilder builder",
        "model._target_": "megatron.bridge.models.gpt.model_config.BridgeGPTModelConfig call",
        "model.transformer._target_": "megatron.bridge.models.transformer_config.TransformerConfig call",
    }


@pytest.mark.parametrize(
    "variant",
    [
        lambda text: text.replace("\n", "\r\n"),
        lambda text: "\ufeff" + text,
        lambda text: "---\n" + text,
        lambda text: "# a comment\n\n" + text.replace("\n  bf16: true\n", "\n  bf16: true  # keep\n\n"),
        lambda text: text.replace("  ", "    "),  # deeper indentation everywhere
    ],
    ids=["crlf", "bom", "document-start", "comments-and-blank-lines", "four-space-indent"],
)
def test_layout_variants_of_the_realistic_file_pass_with_the_same_targets(variant):
    scan = scan_targets(variant(REALISTIC))
    assert scan.findings == ()
    expected = collections.Counter((t.path, t.target, t.use) for t in scan_targets(REALISTIC).targets)
    assert collections.Counter((t.path, t.target, t.use) for t in scan.targets) == expected


def test_flow_style_and_quoted_forms_of_allowed_targets_pass():
    text = (
        "model:\n"
        "  _target_: 'megatron.bridge.models.gpt_provider.GPTModelProvider'\n"
        '  activation_func: {_target_: "torch.nn.functional.silu", _call_: false}\n'
        "  hooks: [{_target_: megatron.core.distributed.finalize_model_grads.finalize_model_grads, _call_: false}]\n"
        "  empty: {}\n"
        "  none: []\n"
        '  "params_dtype":\n'
        "    '_call_': false\n"
        '    "_target_": torch.bfloat16\n'
    )
    scan = scan_targets(text)
    assert scan.findings == ()
    assert _uses(scan) == {
        "model._target_": "megatron.bridge.models.gpt_provider.GPTModelProvider call",
        "model.activation_func._target_": "torch.nn.functional.silu reference",
        "model.hooks[0]._target_": "megatron.core.distributed.finalize_model_grads.finalize_model_grads reference",
        "model.params_dtype._target_": "torch.bfloat16 reference",
    }


def test_text_around_targets_is_plain_data():
    """Strings, numbers, comments and keys that merely contain the letters are no findings."""
    text = (
        "a: 'it''s #not a comment'\n"
        'b: "tab\\there, unicode \\u00e9"\n'
        "c: x #_target_: os.system in a comment\n"
        "lora_target_modules: [linear_qkv]\n"
        "d: >-\n"
        "  folded text\n"
        "  over lines\n"
        "e: long plain text\n"
        "  going on\n"
    )
    assert scan_targets(text) == TargetScan((), (), False)


# --- what is refused ------------------------------------------------------------------------------------------------

HOSTILE_TARGETS = {
    "os.system": "model:\n  _target_: os.system\n  _args_: [touch /tmp/pwned]\n",
    "builtins.eval": "model:\n  _target_: builtins.eval\n  _args_:\n  - __import__('os').system('id')\n",
    "subprocess.Popen": "tokenizer:\n  _target_: subprocess.Popen\n  args: [id]\n",
    "importlib.import_module": "model:\n  x:\n    _target_: importlib.import_module\n    name: evil\n",
    "functools.partial": (
        "model:\n  f:\n    _target_: functools.partial\n    _args_: [{_target_: os.system, _call_: false}]\n"
    ),
    "megatron.bridge.utils.import_utils.safe_import": (
        "m:\n  _target_: megatron.bridge.utils.import_utils.safe_import\n"
    ),
    "megatron.bridge.models.conversion.auto_bridge.AutoBridge.from_hf_pretrained": (
        "model:\n  _target_: megatron.bridge.models.conversion.auto_bridge.AutoBridge.from_hf_pretrained\n"
    ),
    "transformers.AutoTokenizer.from_pretrained": (
        "tokenizer:\n  _target_: transformers.AutoTokenizer.from_pretrained\n  trust_remote_code: true\n"
    ),
    "megatron.bridge.training.tokenizers.tokenizer._HuggingFaceTokenizer": (
        "dataset:\n  tokenizer:\n    _call_: true\n"
        "    _target_: megatron.bridge.training.tokenizers.tokenizer._HuggingFaceTokenizer\n"
    ),
    "torch.load": "model:\n  _target_: torch.load\n  f: /tmp/x.pt\n",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TARGETS))
def test_a_target_off_the_allowlist_is_refused(name):
    scan = scan_targets(HOSTILE_TARGETS[name])
    refused = [f for f in scan.findings if f.kind == "refused"]
    assert refused and refused[0].target == name and refused[0].use == "call", scan.findings
    assert refused[0].reason == "not on the allowlist of Megatron-Bridge config targets"
    assert scan.refused


def test_the_nested_target_in_args_is_judged_too():
    scan = scan_targets(HOSTILE_TARGETS["functools.partial"])
    assert [(f.path, f.target, f.use) for f in scan.findings] == [
        ("model.f._target_", "functools.partial", "call"),
        ("model.f._args_[0]._target_", "os.system", "reference"),
    ]


@pytest.mark.parametrize(
    ("text", "use", "reason"),
    [
        ("a:\n  _target_: torch.nn.functional.silu\n", "call", "on the allowlist only referenced with _call_: false"),
        (
            "a:\n  _target_: torch.nn.functional.silu\n  _partial_: true\n",
            "partial",
            "on the allowlist only referenced with _call_: false",
        ),
        ("a:\n  _call_: true\n  _target_: torch.bfloat16\n", "call",
         "on the allowlist only referenced with _call_: false"),
        (
            "a:\n  _target_: megatron.bridge.models.gpt_provider.GPTModelProvider\n  _partial_: true\n",
            "partial",
            "on the allowlist only called",
        ),
        (
            "a:\n  _target_: megatron.bridge.models.gpt_provider.GPTModelProvider\n  _call_: false\n",
            "reference",
            "on the allowlist only called",
        ),
        (
            "a:\n  _target_: torch.nn.init.normal_\n  mean: 0.0\n",
            "call",
            "on the allowlist only made a functools.partial or referenced with _call_: false",
        ),
        ("model:\n  _builder_: os.system\n", "builder", "not on the allowlist of Megatron-Bridge config targets"),
        (
            "model:\n  _target_: megatron.bridge.models.gpt.gpt_builder.GPTModelBuilder\n",
            "call",
            "on the allowlist only named by _builder_",
        ),
    ],
    ids=["function-called", "function-partial", "dtype-called", "provider-partial", "provider-ref", "init-called",
         "builder-off-list", "builder-as-target"],
)  # fmt: skip
def test_an_allowed_name_used_another_way_is_refused(text, use, reason):
    finding = _one(text)
    assert (finding.kind, finding.use, finding.reason) == ("refused", use, reason)


@pytest.mark.parametrize(
    "text",
    [
        "a: {_target_: os.system, _args_: [id]}\n",
        "a: {x: 1, b: {_target_: os.system}}\n",
        "a:\n  {_target_: os.system,\n   _args_: [id]}\n",
        "a: [1, {_target_: os.system}]\n",
        "a: [_target_: os.system]\n",
        'a: {"_target_":os.system}\n',
        "a:\n  '_target_': os.system\n",
        'a:\n  "_target_": os.system\n',
        'a:\n  "\\x5ftarget_": os.system\n',
        'a:\n  "\\u005ftarget_": os.system\n',
        'a:\n  "_target\\U0000005f": os.system\n',
        "a:\n  _target_ : os.system\n",
        "a:\n  _target_:\n    os.system\n",
        "a:\n  _target_: 'os.system'\n",
        "- _target_: os.system\n",
        "a:\n- - _target_: os.system\n",
        "a:\n  -\n    _target_: os.system\n",
        "a:\n  - x\n  - _call_: true\n    _target_: os.system\n",
        "_target_: os.system\n",
    ],
)
def test_a_target_is_found_in_every_form_a_yaml_loader_reads(text):
    scan = scan_targets(text)
    assert [(f.kind, f.target) for f in scan.findings if f.kind == "refused"] == [("refused", "os.system")], scan


def test_crlf_lines_and_a_lone_cr_are_line_breaks():
    scan = scan_targets("a: 1\r\nb:\r\n  _target_: os.system\r\n")
    assert [(f.line, f.path, f.target) for f in scan.findings] == [(3, "b._target_", "os.system")]
    scan = scan_targets("a: 1\r_target_: os.system\r")
    assert [(f.line, f.target) for f in scan.findings] == [(2, "os.system")]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("a: !!python/object/apply:os.system [id]\n", "an anchor, an alias or a tag"),
        ("a: !!python/name:os.system ''\n", "an anchor, an alias or a tag"),
        ("a:\n  _target_: !!str os.system\n", "an anchor, an alias or a tag"),
        ("a:\n  !!str _target_: os.system\n", "an anchor, an alias or a tag"),
        ("a: 1\n!!str _target_: os.system\n", "a key with an anchor, an alias or a tag"),
        ("a: !custom x\n", "an anchor, an alias or a tag"),
        ("a: &x os.system\nb:\n  _target_: *x\n", "an anchor, an alias or a tag"),
        ("base: &b\n  _target_: os.system\nm:\n  <<: *b\n", "an anchor, an alias or a tag"),
        ("m:\n  <<: {_target_: os.system}\n", "a merge key ('<<')"),
        ("a: {<<: {_target_: x}}\n", "a merge key ('<<')"),
        ("a: [&x 1]\n", "an anchor, alias, tag or indicator in a flow collection"),
        ("? _target_\n: os.system\n", "a complex key ('? key')"),
        ("a:\n  b: 1\n  [x]: 1\n", "a flow collection as a mapping key"),
        ("_target_:\tos.system\n", "a tab"),
        ("a:\n\t_target_: os.system\n", "a tab"),
        ("a: 1\n---\n_target_: os.system\n", "a YAML document marker"),
        ("%TAG ! tag:yaml.org,2002:python/\n---\na: 1\n", "a YAML directive"),
        ("a: 1\x85_target_: os.system\n", "character U+0085"),
        ("a: 1\u2028_target_: os.system\n", "character U+2028"),
        ("a: 1\x00\n", "character U+0000"),
        ("a: 1\n_target_:os.system\n", "a line in a mapping that is not 'key: value'"),
        ("a: x: y\n", "': ' inside a plain value"),
        ("a: x\n  _target_: os.system\n", "': ' in a plain value going on over lines"),
        ("a: {b: 1\n", "a flow collection never closed"),
        ('a: "never closed\n', "a quoted string never closed"),
        ("a: {x: 1}}\n", "text after a flow collection"),
        ('x: 1\n"a\n  b": 1\n', "a quoted string going on over lines where a mapping key is expected"),
        ('"a\n  b": 1\n', "a quoted key going on over lines"),
        ("a: ${oc.decode:'{_target_: os.system}'}\n", "an OmegaConf interpolation"),
        ('a: "${oc.env:HOME}"\n', "an OmegaConf interpolation"),
        ("a: 'x'\n   b: 2\n", "a line indented deeper than its mapping or list that belongs to nothing"),
        ("a: 1\n b: 2\n", "': ' in a plain value going on over lines"),
    ],
)
def test_what_cannot_be_checked_is_a_finding(text, reason):
    scan = scan_targets(text)
    assert any(f.kind == "unreadable" and f.reason.startswith(reason) for f in scan.findings), scan.findings


@pytest.mark.parametrize(
    "text",
    [
        "a: |\n  _target_: os.system\n",
        "a: >\n  x\n  _target_: os.system\n",
        "a: |2-\n    _target_: os.system\n",
        'a: "x\n  _target_: os.system\n  y"\n',
        "a: 'x\n  _target_: os.system\n  y'\n",
        'a: "x\n  _tar\\\n   get_: os.system"\n',
        "a: x\n  _target_\n",
        "a: [x, '_target_: os.system']\n",
        "- '{_target_: os.system}'\n",
        "a: _builder_\n",
    ],
)
def test_a_target_inside_a_string_is_not_missed(text):
    scan = scan_targets(text)
    assert any("a string value holds" in f.reason for f in scan.findings), scan.findings
    assert scan.targets == ()


@pytest.mark.parametrize(
    "text",
    [
        "a:\n  _target_: >-\n    os.system\n",
        "a:\n  _target_: |\n    os.system\n",
        'a:\n  _target_: "os.\\\n    system"\n',
        "a:\n  _target_: os.\n    system\n",
        "a:\n  _target_: {x: 1}\n",
        "a:\n  _target_:\n    x: 1\n",
        "a:\n  _target_:\n",
        "a: {_target_: }\n",
    ],
)
def test_a_target_that_is_not_a_name_on_one_line_cannot_be_checked(text):
    scan = scan_targets(text)
    assert any(f.path == "a._target_" and "its value is" in f.reason for f in scan.findings), scan.findings


@pytest.mark.parametrize("flag", ['"false"', "no", "off", "0", "null", "~", "False # yes", "[]"])
def test_a_call_flag_that_is_not_a_plain_boolean_is_judged_as_a_call(flag):
    scan = scan_targets(f"a:\n  _call_: {flag}\n  _target_: torch.nn.functional.silu\n")
    kinds = [(f.kind, f.path) for f in scan.findings]
    if flag == "False # yes":  # a comment after a plain false is fine
        assert kinds == []
        return
    assert ("unreadable", "a._call_") in kinds and ("refused", "a._target_") in kinds
    assert [t.use for t in scan.targets] == ["call"]


def test_duplicated_special_keys_are_findings_the_last_one_judged():
    scan = scan_targets(
        "a:\n  _target_: torch.nn.functional.silu\n  _call_: false\n  _target_: os.system\n  _call_: true\n"
    )
    found = [(f.kind, f.path, f.line) for f in scan.findings]
    assert ("duplicate", "a._target_", 4) in found and ("duplicate", "a._call_", 5) in found
    assert ("refused", "a._target_", 2) in found  # silu, called: _call_ true is the last
    assert ("refused", "a._target_", 4) in found
    spelled = scan_targets('a:\n  _target_: torch.bfloat16\n  "_target_": os.system\n  _call_: false\n')
    assert [f.kind for f in spelled.findings] == ["duplicate", "refused"]


def test_line_numbers_and_paths_of_findings():
    text = "a:\n  b:\n  - x\n  - c:\n      _target_: os.system\n"
    (finding,) = scan_targets(text).findings
    assert (finding.line, finding.path, finding.target, finding.use) == (5, "a.b[1].c._target_", "os.system", "call")


# --- messages -------------------------------------------------------------------------------------------------------


def test_describe_is_one_terminal_safe_line():
    finding = _one('a:\n  _target_: "os.system\\e[2J\\nforged"\n')
    message = describe(finding)
    assert "\n" not in message and "\x1b" not in message
    assert message.startswith("run_config.yaml line 2, a._target_: 'os.system\\x1b[2J\\nforged' (called) refused:")
    finding = _one("a: !!python/name:os.system ''\n")
    assert describe(finding) == (
        "run_config.yaml line 1, a: \"!!python/name:os.system ''\" cannot be checked: an anchor, an alias or a tag: "
        "it can copy or retype a value"
    )


def test_summarize_names_the_first_findings():
    scan = scan_targets("".join(f"k{i}:\n  _target_: os.system{i}\n" for i in range(7)))
    lines = summarize(scan, limit=2).splitlines()
    assert lines[0] == "run_config.yaml: 7 finding(s) among 7 _target_ entries"
    assert len(lines) == 4 and lines[-1] == "  ... and 5 more"


def test_a_long_target_is_cut_in_findings():
    finding = _one("a:\n  _target_: " + "x" * 100_000 + "\n")
    assert finding.target is not None and len(finding.target) < 300


# --- the allowlist ----------------------------------------------------------------------------------------------------

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+\Z")


def test_every_allowlist_entry_is_a_dotted_name_with_its_uses_and_a_reason():
    assert len(ALLOWLIST) > 300
    for name, entry in ALLOWLIST.items():
        assert entry.target == name and _DOTTED.match(name), name
        assert entry.uses and entry.uses <= {"call", "partial", "reference", "builder"}, name
        assert len(entry.why) > 40 and "\n" not in entry.why, name


def test_functions_and_dtypes_are_never_called_and_providers_only_constructed():
    for name, entry in ALLOWLIST.items():
        if name.startswith(("torch.nn.functional.", "torch.nn.init.", "torch._C.", "megatron.core.activations.")):
            assert "call" not in entry.uses, name
        if name.endswith(("ModelProvider", "Provider")) and name.startswith("megatron.bridge.models."):
            assert entry.uses == {"call"}, name
    assert allowed_uses("torch.bfloat16") == {"reference"}
    assert allowed_uses("megatron.bridge.models.gpt_provider.GPTModelProvider") == {"call"}
    assert allowed_uses("torch.nn.init.normal_") == {"partial", "reference"}
    assert allowed_uses("signal.Signals") == {"call", "reference"}
    assert allowed_uses("megatron.training.models.gpt.GPTModelBuilder") == {"builder"}
    for refused in ("os.system", "builtins.eval", "functools.partial", "torch.load", "numpy.load", "torch.hub.load"):
        assert allowed_uses(refused) == frozenset(), refused


def test_the_docs_list_exactly_the_allowlist():
    docs = (Path(__file__).parents[1] / "docs" / "run_config_targets.md").read_text()
    listed = set()
    for row in re.findall(r"^\| `([^`]+)` \| ([^|]+) \|", docs, re.MULTILINE):
        module, cell = row
        names = re.findall(r"`([^`]+)`", cell)
        listed |= {f"{module}.{name}" for name in names} if names else {module}
    assert listed == set(ALLOWLIST)


# --- bounded on hostile input -----------------------------------------------------------------------------------------

N = 16 << 20


def _fill(unit: str, head: str = "", tail: str = "") -> str:
    return head + unit * ((N - len(head) - len(tail)) // len(unit)) + tail


PAD = "_and_more_of_it" * 3  # lines of ~50 characters: 16 MiB of them stay under MAX_LINES
JUNK = {
    "random": lambda: "".join(random.Random(0).choices("ab :-#{}[],\"'\n \\|>&*!?_$", k=N // 16)) * 16,
    "one-line": lambda: "a" * N,
    "key-lines": lambda: _fill(f"key_1{PAD}: value.2{PAD}\n"),
    "items": lambda: _fill(f"- item{PAD}\n"),
    "comments": lambda: _fill(f"# a comment {PAD}\n"),
    "blank-lines": lambda: _fill(" " * 60 + "\n"),
    "block-scalar": lambda: _fill(f"  some text {PAD}\n", "a: |\n"),
    "plain-lines": lambda: _fill(f"  going on {PAD}\n", "a: b\n"),
    "quoted-lines": lambda: _fill(f"  x\\ty''{PAD}\\\n", 'a: "', '"\n'),
    "escapes": lambda: _fill("\\u00e9", 'a: "', '"\n'),
    "flow-items": lambda: _fill("a, ", "k: [", "]\n"),
    "flow-pairs": lambda: _fill("a: 'b', ", "k: {", "}\n"),
    "flow-lines": lambda: _fill(f"item{PAD}, item,\n", "k: [", "]\n"),
    "unclosed-quote": lambda: _fill("a", "k: '"),
    "nesting": lambda: _fill("- "),
    "brackets": lambda: _fill("["),
    "targets": lambda: _fill(f"- _target_: os.system{PAD}\n"),
    "tabs": lambda: _fill(f"key:\tvalue{PAD}\n"),
    "controls": lambda: _fill(f"a: b\x00{PAD}\n"),
    "too-many-lines": lambda: "\n" * N,
}


@pytest.mark.parametrize("name", sorted(JUNK))
def test_16_mib_of_junk_is_scanned_in_bounded_time(name):
    text = JUNK[name]()
    assert len(text) <= N
    start = time.perf_counter()
    scan = scan_targets(text)
    elapsed = time.perf_counter() - start
    assert elapsed < 30, f"{name}: {elapsed:.1f} s"
    assert len(scan.findings) <= MAX_FINDINGS
    if name == "escapes":
        assert scan.truncated and "escapes in double-quoted strings" in scan.findings[-1].reason
    if name in ("nesting", "brackets"):
        assert any(f"nested deeper than {MAX_DEPTH}" in f.reason for f in scan.findings) and scan.refused
    if name == "too-many-lines":
        assert scan.truncated and scan.findings[0].reason.startswith(f"more than {MAX_LINES} lines")
    if name in ("targets", "tabs", "controls"):
        assert scan.truncated and len(scan.findings) == MAX_FINDINGS


def test_line_by_line_reading_is_linear():
    """Lines no fast path takes (a mapping opened and closed on every other line): twice the lines, ~twice the
    time, and the longest such file (MAX_LINES) stays seconds."""

    def timed(lines: int) -> float:
        text = "a:\n b: 'x y'\n" * (lines // 2)
        start = time.perf_counter()
        assert scan_targets(text).findings == ()
        return time.perf_counter() - start

    small, large = timed(20_000), timed(80_000)
    assert large < 8 * small + 0.5, (small, large)


def _slow(monkeypatch: pytest.MonkeyPatch, text: str) -> TargetScan:
    """The scan with every fast path off: each line read one by one."""
    with monkeypatch.context() as patch:
        patch.setattr(targets_module._Scanner, "fast", lambda self, text, pos: pos)
        patch.setattr(targets_module._Scanner, "flow_items", lambda self, node, text, pos, runs: pos)
        return scan_targets(text)


def _outcome(scan: TargetScan) -> tuple[object, ...]:
    findings = [(f.line, f.kind, f.path, f.use, f.reason) for f in scan.findings]
    return findings, [(t.line, t.path, t.target, t.use) for t in scan.targets], scan.truncated


_EDITS = ["  ", "\n", "\n  ", "- ", ": ", " #", "'", '"', "\\", "{", "}", "[", "]", ",", "_target_", "$", "${", "_",
          ":", "#", "\t", "x_y", "\n    more text\n", "''", "\\\n", "|\n", "\n  - _target_: os.system\n"]  # fmt: skip


def test_the_fast_paths_change_nothing(monkeypatch):
    """Runs of plain lines are passed at C speed: with them off, every finding and target is the same."""
    rng = random.Random(3)
    texts = [REALISTIC, MODEL_CONFIG_FORM, *HOSTILE_TARGETS.values()]
    for _ in range(400):
        text = REALISTIC[rng.randint(0, 1500) :][:600]
        for _ in range(rng.randint(1, 4)):
            at = rng.randint(0, len(text))
            text = text[:at] + rng.choice(_EDITS) + text[at + rng.choice([0, 1]) :]
        texts.append(text)
    for text in texts:
        assert _outcome(scan_targets(text)) == _outcome(_slow(monkeypatch, text)), text


def test_any_text_is_scanned_without_an_exception():
    rng = random.Random(1)
    alphabet = "ab_:-#{}[],\"'\n \t\\|>&*!?%@`$.\r\x85\u2028é0"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        scan_targets(text)


# --- differential: what PyYAML's safe_load sees, the scanner found ---------------------------------------------

needs_yaml = pytest.mark.skipif(yaml is None, reason="PyYAML is not installed (the yaml extra)")


def _loaded_targets(document: Any) -> collections.Counter[tuple[str, str, str]]:
    """(path, target, use) of every _target_ / _builder_ in a loaded document, as Bridge's instantiate reads them."""
    found: collections.Counter[tuple[str, str, str]] = collections.Counter()
    stack: list[tuple[str, Any]] = [("", document)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            if "_target_" in node:
                use = "call"
                if not node.get("_call_", True):
                    use = "reference"
                elif node.get("_partial_", False):
                    use = "partial"
                found[(f"{path}._target_" if path else "_target_", str(node["_target_"]), use)] += 1
            if "_builder_" in node:
                found[(f"{path}._builder_" if path else "_builder_", str(node["_builder_"]), "builder")] += 1
            for key, value in node.items():
                stack.append((f"{path}.{key}" if path else str(key), value))
        elif isinstance(node, list):
            stack.extend((f"{path}[{index}]", value) for index, value in enumerate(node))
    return found


def _scanned(scan: TargetScan) -> collections.Counter[tuple[str, str, str]]:
    return collections.Counter((t.path, t.target, t.use) for t in scan.targets)


@needs_yaml
def test_the_realistic_files_read_as_pyyaml_reads_them():
    for text in (REALISTIC, MODEL_CONFIG_FORM, REALISTIC.replace("\n", "\r\n")):
        assert _scanned(scan_targets(text)) == _loaded_targets(yaml.safe_load(text))


_NAMES = [
    "torch.nn.functional.silu",
    "megatron.bridge.models.gpt_provider.GPTModelProvider",
    "torch.bfloat16",
    "torch.nn.init.normal_",
    "megatron.core.transformer.enums.AttnBackend",
    "os.system",
]
_KEYS = ["a", "model", "b c", "x_target_y", "_args_", "k#", "#k", "- k", "key: colon", "1", "true", "é", "_call"]
_STRINGS = ["plain", "with space", "a: b", "#hash", "x #y", "'q'", '"dq"', "multi\nline", "long " * 25, "", "yes",
            "-", "- item", "{x}", "[y]", "ünï", "a\\b", " lead", "trail ", "null", "~", "x" * 90]  # fmt: skip


def _document(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 4 or roll < 0.3:
        return rng.choice([rng.choice(_STRINGS), rng.randint(-5, 5), rng.random(), True, False, None])
    if roll < 0.5:
        return [_document(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    node = {rng.choice(_KEYS): _document(rng, depth + 1) for _ in range(rng.randint(0, 5))}
    if rng.random() < 0.6:
        node["_target_"] = rng.choice(_NAMES)
        flags = rng.random()
        if flags < 0.5:
            node["_call_"] = flags < 0.4
        elif flags < 0.6:
            node["_partial_"] = True
    if rng.random() < 0.05:
        node["_builder_"] = "megatron.bridge.models.gpt.gpt_builder.GPTModelBuilder"
    return node


@needs_yaml
def test_dumped_documents_read_as_pyyaml_reads_them():
    """safe_dump in every style (block, flow, quoted keys, folded long strings, 2 to 4 spaces, CRLF): where the
    scanner refuses nothing, it found exactly the targets, uses and paths safe_load finds."""
    rng = random.Random(2026)
    checked = 0
    for _ in range(700):
        document = _document(rng)
        options = {
            "default_flow_style": rng.choice([False, False, True, None]),
            "indent": rng.choice([2, 3, 4]),
            "width": rng.choice([20, 40, 80, 1000]),
            "allow_unicode": rng.random() < 0.5,
            "sort_keys": rng.random() < 0.5,
            "default_style": rng.choice([None, None, None, "'"]),
        }
        text = yaml.safe_dump(document, **options)
        if rng.random() < 0.2:
            text = text.replace("\n", "\r\n")
        scan = scan_targets(text)
        loaded = _loaded_targets(yaml.safe_load(text))
        if scan.refused:
            continue
        checked += 1
        assert _scanned(scan) == loaded, text
    assert checked > 100


_FRAGMENTS = [" ", "  ", "\n", "\n  ", "\n    ", "- ", ":", ": ", "#", " #", '"', "'", "{", "}", "[", "]", ",", "&a ",
              "*a", "!", "|", ">", "? ", "\t", "\r", "\\", "_target_", "_target_: os.system", "_call_: false",
              "_partial_: true", "{_target_: os.system}", "[_target_: os.system]", '"_target_": os.system',
              "\n  _target_: os.system\n", "\n- _target_: os.system\n", "<<: ", "x"]  # fmt: skip


@needs_yaml
def test_mutated_files_never_hide_a_target_pyyaml_sees():
    """Random edits of a real-looking file: whenever safe_load still reads it and the scanner refuses nothing,
    every target safe_load sees (with its use) is one the scanner found."""
    rng = random.Random(7)
    base = REALISTIC[: REALISTIC.index("optimizer:")]
    checked = 0
    for _ in range(1500):
        text = base
        for _ in range(rng.randint(1, 3)):
            at = rng.randint(0, len(text))
            cut = at + rng.choice([0, 0, 1, 3])
            text = text[:at] + rng.choice(_FRAGMENTS) + text[cut:]
        scan = scan_targets(text)
        if scan.refused:
            continue
        try:
            loaded = _loaded_targets(yaml.safe_load(text))
        except yaml.YAMLError:
            continue
        checked += 1
        assert not (loaded - _scanned(scan)), text
    assert checked > 100

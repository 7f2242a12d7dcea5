"""The allowlist of ``_target_`` names a Megatron-Bridge ``run_config.yaml`` may hold: exact names, each with the
uses it may have (called, made a ``functools.partial``, referenced with ``_call_: false``, named by ``_builder_``)
and why that use runs nothing the file chooses. :mod:`ckptdoctor.formats.run_config_targets` finds the targets in
the text and judges them by it; ``docs/run_config_targets.md`` lists the Bridge files it follows.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Literal

Use = Literal["call", "partial", "reference", "builder"]


@dataclasses.dataclass(frozen=True)
class AllowedTarget:
    """One allowlisted name: the uses it may have and why each runs nothing the file chooses."""

    target: str
    uses: frozenset[Use]
    why: str


# Collected from Megatron-Bridge's sources (every release tag v0.1.0a0..v0.6.0 and main of 2026-08-22, 067f987)
# and Megatron-LM's main of the same day (d98e8a6): the classes and functions Bridge's dump writes as _target_.

_CALL: frozenset[Use] = frozenset({"call"})
_REFERENCE: frozenset[Use] = frozenset({"reference"})
_CALL_OR_REFERENCE: frozenset[Use] = frozenset({"call", "reference"})
_PARTIAL_OR_REFERENCE: frozenset[Use] = frozenset({"partial", "reference"})
_BUILDER: frozenset[Use] = frozenset({"builder"})

_WHY_PROVIDER = (
    "Megatron-Bridge model provider: a dataclass (a TransformerConfig); constructing it stores and validates "
    "fields and imports or calls nothing the file names"
)
_WHY_MODEL_CONFIG = (
    "Megatron model/transformer config dataclass: construction stores and validates fields, imports or calls "
    "nothing the file names"
)
_WHY_CONFIG = (
    "Megatron-Bridge / Megatron-LM training config dataclass: construction stores and validates fields; "
    "nothing is imported or called by a name from the file"
)
_WHY_ENUM = "enum class: calling it with _args_ looks a member up by value; nothing else runs"
_WHY_DTYPE = "torch dtype object: only referenced (not callable); importing torch runs nothing the file chooses"
_WHY_ACTIVATION = (
    "activation function: only referenced; Megatron calls it on activation tensors, never with the file's values"
)
_WHY_INIT = (
    "torch.nn.init weight initialiser: a partial keeps the file's numbers (mean, std) and Megatron calls it on "
    "a weight tensor; it imports and calls nothing else"
)
_WHY_SPEC = (
    "layer-spec builder: only referenced (or a partial of plain options); Bridge calls it with the model config "
    "when it builds the model and it returns module specs; it imports nothing the file names"
)
_WHY_RUNTIME = "Megatron runtime hook recorded by a training run: only referenced; imported, never called from the file"
_WHY_BUILDER = (
    "Megatron model builder named by _builder_: Bridge imports it and builds the model with it, its purpose; "
    "it imports or calls nothing the file names"
)


def _group(module: str, names: str, uses: frozenset[Use], why: str) -> list[AllowedTarget]:
    return [AllowedTarget(f"{module}.{name}", uses, why) for name in names.split()]


_PROVIDERS = (
    ("megatron.bridge.diffusion.models.flux.flux_provider", "FluxProvider"),
    ("megatron.bridge.diffusion.models.llada15.llada15_provider", "LLaDA15ModelProvider"),
    (
        "megatron.bridge.diffusion.models.nemotron_labs_diffusion.nemotron_labs_diffusion_provider",
        "NemotronLabsDiffusionModelProvider",
    ),
    ("megatron.bridge.diffusion.models.wan.wan_provider", "WanModelProvider WanModelProvider14B WanModelProvider1_3B"),
    (
        "megatron.bridge.models.deepseek.deepseek_provider",
        "DeepSeekModelProvider DeepSeekProvider DeepSeekV2LiteModelProvider DeepSeekV2LiteProvider "
        "DeepSeekV2ModelProvider DeepSeekV2Provider DeepSeekV3ModelProvider DeepSeekV3Provider "
        "MoonlightModelProvider16B MoonlightProvider",
    ),
    ("megatron.bridge.models.distillation_provider", "DistillationProvider"),
    ("megatron.bridge.models.ernie_vl.ernie45_vl_provider", "Ernie45VLModelProvider"),
    ("megatron.bridge.models.exaone.exaone45.exaone45_provider", "Exaone45ModelProvider"),
    ("megatron.bridge.models.exaone.exaone_moe.exaone_moe_provider", "ExaoneMoeModelProvider"),
    ("megatron.bridge.models.falcon_h1.falconh1_provider", "FalconH1ModelProvider"),
    (
        "megatron.bridge.models.gemma.gemma2_provider",
        "Gemma2ModelProvider Gemma2ModelProvider27B Gemma2ModelProvider2B Gemma2ModelProvider9B",
    ),
    (
        "megatron.bridge.models.gemma.gemma3_provider",
        "Gemma3ModelProvider Gemma3ModelProvider12B Gemma3ModelProvider1B Gemma3ModelProvider27B Gemma3ModelProvider4B",
    ),
    ("megatron.bridge.models.gemma.gemma4_provider", "Gemma4DenseProvider Gemma4ModelProvider"),
    (
        "megatron.bridge.models.gemma.gemma_provider",
        "CodeGemmaModelProvider2B CodeGemmaModelProvider7B GemmaModelProvider GemmaModelProvider2B "
        "GemmaModelProvider7B",
    ),
    ("megatron.bridge.models.gemma_vl.gemma3_vl_provider", "Gemma3VLModelProvider"),
    ("megatron.bridge.models.gemma_vl.gemma4_vl_provider", "Gemma4DenseVLProvider Gemma4VLModelProvider"),
    (
        "megatron.bridge.models.glm.glm45_provider",
        "GLM45AirModelProvider106B GLM45ModelProvider355B GLMMoEModelProvider",
    ),
    ("megatron.bridge.models.glm_vl.glm_45v_provider", "GLM45VModelProvider"),
    ("megatron.bridge.models.gpt_oss.gpt_oss_provider", "GPTOSSProvider GPTOSSProvider120B GPTOSSProvider20B"),
    (
        "megatron.bridge.models.gpt_provider",
        "GPTDistillationProvider GPTModelProvider GPTProvider126M GPTProvider175B GPTProvider20B GPTProvider40B "
        "GPTProvider5B GPTProvider7B",
    ),
    ("megatron.bridge.models.hybrid.hybrid_provider", "HybridModelProvider"),
    ("megatron.bridge.models.kimi.kimi_k3_provider", "KimiK3ModelProvider"),
    ("megatron.bridge.models.kimi.kimi_provider", "KimiK2Provider"),
    ("megatron.bridge.models.kimi_vl.kimi_k25_vl_provider", "KimiK25VLModelProvider"),
    (
        "megatron.bridge.models.llama.llama_provider",
        "CodeLlamaModelProvider13B CodeLlamaModelProvider34B CodeLlamaModelProvider70B CodeLlamaModelProvider7B "
        "Llama2ModelProvider13B Llama2ModelProvider70B Llama2ModelProvider7B Llama31ModelProvider "
        "Llama31ModelProvider405B Llama31ModelProvider70B Llama31ModelProvider8B Llama32ModelProvider1B "
        "Llama32ModelProvider3B Llama3ModelProvider Llama3ModelProvider70B Llama3ModelProvider8B "
        "Llama4Experts128ModelProvider Llama4Experts16ModelProvider Llama4ModelProvider LlamaModelProvider",
    ),
    (
        "megatron.bridge.models.llama_nemotron.llama_nemotron_provider",
        "Llama31Nemotron70BProvider Llama31NemotronNano8BProvider Llama31NemotronUltra253BProvider "
        "Llama33NemotronSuper49BProvider LlamaNemotronHeterogeneousProvider",
    ),
    (
        "megatron.bridge.models.mamba.mamba_provider",
        "MambaModelProvider MambaModelProvider130M MambaModelProvider1P3B MambaModelProvider2P7B "
        "MambaModelProvider370M MambaModelProvider780M MambaProvider MambaProvider130M MambaProvider1_3B "
        "MambaProvider2_7B MambaProvider370M MambaProvider780M NVIDIAMambaHybridModelProvider8B "
        "NVIDIAMambaHybridProvider8B NVIDIAMambaModelProvider8B NVIDIAMambaProvider8B",
    ),
    (
        "megatron.bridge.models.mamba.nemotron_h_provider",
        "NemotronHModel47BProvider NemotronHModel4BProvider NemotronHModel56BProvider NemotronHModel8BProvider "
        "NemotronHModelProvider NemotronNano12Bv2Provider NemotronNano9Bv2Provider",
    ),
    ("megatron.bridge.models.megatron_mimo.llava_provider", "LlavaMegatronMIMOProvider"),
    ("megatron.bridge.models.megatron_mimo.megatron_mimo_provider", "MegatronMIMOProvider"),
    ("megatron.bridge.models.mimo.llava_provider", "LlavaMimoProvider"),
    ("megatron.bridge.models.mimo.mimo_provider", "MimoModelProvider"),
    ("megatron.bridge.models.mimo_v2_flash.mimo_v2_flash_provider", "MiMoV2FlashModelProvider"),
    ("megatron.bridge.models.minimax_m3.minimax_m3_bridge", "MiniMaxM3ModelProvider MiniMaxM3VLModelProvider"),
    (
        "megatron.bridge.models.ministral3.ministral3_provider",
        "Ministral3ModelProvider Ministral3ModelProvider14B Ministral3ModelProvider3B Ministral3ModelProvider8B",
    ),
    ("megatron.bridge.models.mistral.mistral_provider", "MistralModelProvider MistralSmall3ModelProvider24B"),
    ("megatron.bridge.models.mla_provider", "MLAModelProvider"),
    (
        "megatron.bridge.models.nemotron.nemotron_provider",
        "Nemotron3ModelProvider22B Nemotron3ModelProvider4B Nemotron3ModelProvider8B Nemotron4ModelProvider15B "
        "Nemotron4ModelProvider340B NemotronModelProvider",
    ),
    (
        "megatron.bridge.models.nemotron_omni.nemotron_omni_provider",
        "NemotronOmniLlavaModelProvider NemotronOmniModelProvider NemotronVLModelProvider",
    ),
    (
        "megatron.bridge.models.nemotron_vl.nemotron_vl_provider",
        "NemotronNano12Bv2VLModelProvider NemotronVLModelProvider",
    ),
    (
        "megatron.bridge.models.nemotronh.nemotron_h_provider",
        "Nemotron3NanoProvider NemotronHModel47BProvider NemotronHModel4BProvider NemotronHModel56BProvider "
        "NemotronHModel8BProvider NemotronHModelProvider NemotronHModelProvider47B NemotronHModelProvider4B "
        "NemotronHModelProvider56B NemotronHModelProvider8B NemotronNano12Bv2Provider NemotronNano9Bv2Provider "
        "NemotronNanoModelProvider12Bv2 NemotronNanoModelProvider9Bv2",
    ),
    ("megatron.bridge.models.olmoe.olmoe_provider", "OlMoEModelProvider"),
    (
        "megatron.bridge.models.qwen.qwen2_provider",
        "Qwen25ModelProvider14B Qwen25ModelProvider1P5B Qwen25ModelProvider32B Qwen25ModelProvider3B "
        "Qwen25ModelProvider500M Qwen25ModelProvider72B Qwen25ModelProvider7B Qwen2ModelProvider "
        "Qwen2ModelProvider1P5B Qwen2ModelProvider500M Qwen2ModelProvider72B Qwen2ModelProvider7B",
    ),
    (
        "megatron.bridge.models.qwen.qwen_provider",
        "Qwen25ModelProvider14B Qwen25ModelProvider1P5B Qwen25ModelProvider32B Qwen25ModelProvider3B "
        "Qwen25ModelProvider500M Qwen25ModelProvider72B Qwen25ModelProvider7B Qwen2ModelProvider "
        "Qwen2ModelProvider1P5B Qwen2ModelProvider500M Qwen2ModelProvider72B Qwen2ModelProvider7B "
        "Qwen3MoEModelProvider Qwen3MoEModelProvider235B_A22B Qwen3MoEModelProvider30B_A3B Qwen3ModelProvider "
        "Qwen3ModelProvider14B Qwen3ModelProvider1P7B Qwen3ModelProvider32B Qwen3ModelProvider4B "
        "Qwen3ModelProvider600M Qwen3ModelProvider8B Qwen3NextModelProvider Qwen3NextModelProvider80B_A3B",
    ),
    ("megatron.bridge.models.qwen3_asr.qwen3_asr_provider", "Qwen3ASRModelProvider"),
    ("megatron.bridge.models.qwen_audio.qwen2_audio_provider", "Qwen2AudioModelProvider"),
    ("megatron.bridge.models.qwen_omni.qwen25_omni_provider", "Qwen25OmniModelProvider"),
    ("megatron.bridge.models.qwen_omni.qwen3_omni_provider", "Qwen3OmniModelProvider"),
    ("megatron.bridge.models.qwen_vl.qwen25_vl_provider", "Qwen25VLModelProvider"),
    (
        "megatron.bridge.models.qwen_vl.qwen35_vl_provider",
        "Qwen35TokenClassificationModelProvider Qwen35VLMoEModelProvider Qwen35VLModelProvider",
    ),
    ("megatron.bridge.models.qwen_vl.qwen3_vl_provider", "Qwen3VLMoEModelProvider Qwen3VLModelProvider"),
    ("megatron.bridge.models.qwen_vl.qwen_vl_provider", "Qwen25VLModelProvider"),
    ("megatron.bridge.models.sarvam.sarvam_provider", "SarvamMLAModelProvider SarvamMoEModelProvider"),
    ("megatron.bridge.models.stepfun.step35_provider", "Step35ModelProvider"),
    ("megatron.bridge.models.stepfun.step37_provider", "Step37ModelProvider"),
    ("megatron.bridge.models.t5_provider", "T5ModelProvider"),
)

_MODEL_CONFIGS = (
    ("megatron.bridge.models.gpt.gpt_builder", "GPTModelConfig"),
    ("megatron.bridge.models.gpt.model_config", "BridgeGPTModelConfig"),
    ("megatron.bridge.models.hybrid.hybrid_builder", "HybridModelConfig"),
    ("megatron.bridge.models.mamba.mamba_builder", "MambaModelConfig"),
    ("megatron.training.models.gpt", "GPTModelConfig"),
    ("megatron.training.models.hybrid", "HybridModelConfig"),
    (
        "megatron.bridge.models.transformer_config",
        "TransformerConfig MLATransformerConfig HeterogeneousTransformerConfig",
    ),
    ("megatron.core.transformer.transformer_config", "TransformerConfig MLATransformerConfig"),
    ("megatron.bridge.models.ernie_vl.modeling_ernie45_vl.vision_transformer_config", "ErnieVisionTransformerConfig"),
    ("megatron.bridge.models.exaone.exaone45.modelling_exaone45.transformer_config", "Exaone45TransformerConfig"),
    ("megatron.bridge.models.falcon_h1.modeling_falconh1.falconh1_model", "FalconH1Config"),
    ("megatron.bridge.models.gemma_vl.modeling_gemma3_vl", "Gemma3VLMultimodalProjectorConfig"),
    ("megatron.bridge.models.qwen3_asr.modeling_qwen3_asr.transformer_config", "Qwen3ASRTransformerConfig"),
    ("megatron.bridge.models.qwen_omni.modeling_qwen25_omni.transformer_config", "Qwen25OmniTransformerConfig"),
    ("megatron.bridge.models.qwen_omni.modeling_qwen3_omni.transformer_config", "Qwen3OmniTransformerConfig"),
    ("megatron.bridge.models.qwen_vl.modelling_qwen3_vl.transformer_config", "Qwen3VLTransformerConfig"),
    ("megatron.bridge.models.stepfun.modelling_step37.transformer_config", "Step37TransformerConfig"),
)

_CONFIGS = (
    (
        "megatron.bridge.training.config",
        "ConfigContainer CheckpointConfig DataloaderConfig DistributedDataParallelConfig DistributedInitConfig "
        "FaultToleranceConfig FinetuningDatasetConfig GPTDatasetConfig GPTFIMDatasetConfig InProcessRestartConfig "
        "LoggerConfig MockGPTDatasetConfig NVRxStragglerDetectionConfig OptimizerConfig ProfilingConfig RNGConfig "
        "RerunStateMachineConfig SchedulerConfig StragglerDetectionConfig TensorInspectConfig TrainingConfig "
        "ValidationConfig",
    ),
    ("megatron.bridge.training.mixed_precision", "MixedPrecisionConfig"),
    (
        "megatron.bridge.training.comm_overlap",
        "CommOverlapConfig TransformerLayerTPOverlapCfg BulkOverlapCfg PipelineOverlapCfg RingExchangeOverlapCfg",
    ),
    ("megatron.bridge.training.tokenizers.config", "TokenizerConfig"),
    ("megatron.training.config.common_config", "RNGConfig ProfilingConfig DistributedInitConfig"),
    (
        "megatron.training.config.training_config",
        "TrainingConfig ValidationConfig SchedulerConfig LoggerConfig CheckpointConfig TokenizerConfig",
    ),
    ("megatron.training.config.resilience_config", "RerunStateMachineConfig StragglerDetectionConfig"),
    ("megatron.bridge.peft.lora", "LoRA VLMLoRA"),
    ("megatron.bridge.peft.dora", "DoRA"),
    ("megatron.bridge.peft.canonical_lora", "CanonicalLoRA"),
    ("megatron.bridge.peft.multi_lora", "MultiLoRA"),
    ("megatron.bridge.data.base", "DataloaderConfig"),
    ("megatron.bridge.data.builders.gpt_sft", "GPTSFTDatasetConfig FinetuningDatasetConfig"),
    ("megatron.bridge.data.builders.hf_dataset", "HFDatasetConfig"),
    ("megatron.bridge.data.builders.direct_hf_sft", "DirectHFSFTDatasetConfig"),
    ("megatron.bridge.data.builders.mock_vlm_sft", "MockVLMSFTDatasetConfig"),
    ("megatron.bridge.data.builders.energon", "EnergonDatasetConfig"),
    ("megatron.bridge.data.datasets.packed_sequence", "PackedSequenceSpecs"),
    ("megatron.bridge.data.packing.config", "PackedSequenceSpecs"),
    ("megatron.bridge.data.energon.energon_provider", "EnergonProvider"),
    (
        "megatron.bridge.data.vlm_datasets.hf_provider",
        "HFDatasetConversationProvider",
    ),
    ("megatron.bridge.data.vlm_datasets.mock_provider", "MockVLMConversationProvider"),
    ("megatron.bridge.data.vlm_datasets.preloaded_provider", "PreloadedVLMConversationProvider"),
    ("megatron.core.quantization.quant_config", "RecipeConfig GlobMatcher"),
)

_ENUMS = (
    (
        "megatron.core.transformer.enums",
        "ModelType LayerType AttnType AttnMaskType AttnBackend CudaGraphModule CudaGraphScope InferenceCudaGraphScope",
    ),
    ("megatron.core.enums", "ModelType Fp8Recipe Fp4Recipe"),
    ("signal", "Signals"),
)

_DTYPES = (
    "float32 float16 bfloat16 float64 int8 uint8 int16 int32 int64 bool complex64 complex128 float8_e4m3fn "
    "float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz"
)

_ACTIVATIONS = (
    ("torch.nn.functional", "silu gelu relu sigmoid"),
    ("torch._C._nn", "gelu"),  # F.gelu's __module__: what Bridge's function representer writes for it
    ("torch", "tanh"),
    ("megatron.core.activations", "fast_gelu squared_relu quick_gelu"),
    ("megatron.core.fusions.fused_bias_geglu", "quick_gelu"),
    ("megatron.core.transformer.utils", "openai_gelu erf_gelu"),
)

_INITS = (
    "normal_ uniform_ trunc_normal_ xavier_normal_ xavier_uniform_ kaiming_normal_ kaiming_uniform_ zeros_ ones_ "
    "constant_ orthogonal_"
)

_SPECS = (
    (
        "megatron.bridge.models.gpt_provider",
        "default_layer_spec local_layer_spec transformer_engine_layer_spec transformer_engine_full_layer_spec "
        "quantization_layer_spec modelopt_transformer_layer_spec mtp_block_spec",
    ),
    (
        "megatron.bridge.models.gpt.gpt_builder",
        "default_layer_spec local_layer_spec transformer_engine_layer_spec transformer_engine_full_layer_spec "
        "modelopt_transformer_layer_spec mtp_block_spec",
    ),
    ("megatron.bridge.models.t5_provider", "local_layer_spec transformer_engine_layer_spec"),
    (
        "megatron.bridge.models.mamba.mamba_provider",
        "get_default_mamba_stack_spec modelopt_mamba_stack_spec transformer_engine_mamba_stack_spec",
    ),
    (
        "megatron.bridge.models.mamba.mamba_builder",
        "get_default_mamba_stack_spec modelopt_mamba_stack_spec transformer_engine_mamba_stack_spec",
    ),
    (
        "megatron.bridge.models.hybrid.hybrid_provider",
        "get_default_hybrid_stack_spec modelopt_hybrid_stack_spec transformer_engine_hybrid_stack_spec",
    ),
    (
        "megatron.bridge.models.hybrid.hybrid_builder",
        "get_default_hybrid_stack_spec modelopt_hybrid_stack_spec transformer_engine_hybrid_stack_spec",
    ),
    ("megatron.bridge.models.gemma.gemma2_provider", "gemma2_layer_spec"),
    ("megatron.bridge.models.gemma.gemma3_provider", "gemma3_layer_spec"),
    ("megatron.bridge.models.gemma.modeling_gemma4", "gemma4_block_spec get_gemma4_layer_spec"),
    ("megatron.bridge.models.olmoe.olmoe_provider", "olmoe_layer_spec"),
    ("megatron.bridge.models.ministral3.ministral3_provider", "ministral_layer_spec"),
    ("megatron.bridge.models.llama.llama4_utils", "get_llama4_layer_spec"),
    ("megatron.bridge.models.llama_nemotron.llama_nemotron_provider", "heterogeneous_layer_spec"),
    ("megatron.bridge.models.falcon_h1.falconh1_provider", "get_default_falconh1_stack_spec"),
    ("megatron.bridge.models.exaone.exaone4.exaone4_provider", "exaone4_layer_spec"),
    (
        "megatron.bridge.models.exaone.exaone45.exaone45_provider",
        "exaone_45_transformer_layer_spec exaone_45_mtp_block_spec",
    ),
    ("megatron.bridge.models.exaone.exaone_moe.exaone_moe_provider", "build_exaone_moe_layer_spec"),
    ("megatron.bridge.models.mimo_v2_flash.modeling_mimo_v2_flash", "mimo_v2_flash_layer_spec"),
    ("megatron.bridge.models.minimax_m2.minimax_m2_provider", "minimax_m2_layer_spec"),
    (
        "megatron.bridge.models.ernie_vl.modeling_ernie45_vl.ernie_decoder_layer_spec",
        "get_ernie45_vl_decoder_block_spec",
    ),
    (
        "megatron.core.models.gpt.gpt_layer_specs",
        "get_gpt_decoder_block_spec get_gpt_layer_with_transformer_engine_spec get_gpt_layer_local_spec "
        "get_gpt_mtp_block_spec",
    ),
    (
        "megatron.core.models.gpt.experimental_attention_variant_module_specs",
        "get_transformer_block_with_experimental_attention_variant_spec",
    ),
)

_RUNTIME = (
    ("megatron.core.distributed.finalize_model_grads", "finalize_model_grads"),
    ("megatron.core.optimizer.optimizer.MegatronOptimizer", "scale_loss"),
    (
        "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel",
        "start_grad_sync start_param_sync no_sync",
    ),
    ("megatron.core.distributed.fsdp.mcore_fsdp_adapter.FullyShardedDataParallel", "start_grad_sync start_param_sync"),
)

_BUILDERS = (
    ("megatron.bridge.models.gpt.gpt_builder", "GPTModelBuilder"),
    ("megatron.bridge.models.hybrid", "HybridModelBuilder"),
    ("megatron.bridge.models.hybrid.hybrid_builder", "HybridModelBuilder"),
    ("megatron.bridge.models.mamba", "MambaModelBuilder"),
    ("megatron.bridge.models.mamba.mamba_builder", "MambaModelBuilder"),
    ("megatron.training.models.gpt", "GPTModelBuilder"),
    ("megatron.training.models.hybrid", "HybridModelBuilder"),
)

_ONE_OFFS = (
    AllowedTarget(
        "megatron.bridge.models.gemma.modeling_gemma4._gemma4_block_spec",
        _PARTIAL_OR_REFERENCE,
        "the Gemma 4 block-spec builder under its former private name (Bridge allows it by name): " + _WHY_SPEC,
    ),
    AllowedTarget(
        "transformers.generation.configuration_utils.GenerationConfig.from_dict",
        _CALL,
        "builds a transformers GenerationConfig from a dict of generation settings: stores them (its sub-configs "
        "come from transformers' fixed classes); no download, no import by a name from the file",
    ),
    AllowedTarget(
        "megatron.core.timers.Timers",
        _CALL,
        "Megatron's timer registry (a training run's runtime object): construction stores the log level and "
        "option; Bridge's reader replaces it with None",
    ),
    AllowedTarget(
        "megatron.bridge.training.tokenizers.tokenizer._NullTokenizer",
        _CALL,
        "the null tokenizer object a mock-data run records: construction stores a vocabulary size; no file, no "
        "download (other tokenizer classes are refused: they load files or remote code)",
    ),
)


def _build_allowlist() -> dict[str, AllowedTarget]:
    entries: list[AllowedTarget] = []
    for module, names in _PROVIDERS:
        entries += _group(module, names, _CALL, _WHY_PROVIDER)
    for module, names in _MODEL_CONFIGS:
        entries += _group(module, names, _CALL, _WHY_MODEL_CONFIG)
    for module, names in _CONFIGS:
        entries += _group(module, names, _CALL, _WHY_CONFIG)
    for module, names in _ENUMS:
        entries += _group(module, names, _CALL_OR_REFERENCE, _WHY_ENUM)
    entries += _group("torch", _DTYPES, _REFERENCE, _WHY_DTYPE)
    for module, names in _ACTIVATIONS:
        entries += _group(module, names, _REFERENCE, _WHY_ACTIVATION)
    entries += _group("torch.nn.init", _INITS, _PARTIAL_OR_REFERENCE, _WHY_INIT)
    for module, names in _SPECS:
        entries += _group(module, names, _PARTIAL_OR_REFERENCE, _WHY_SPEC)
    for module, names in _RUNTIME:
        entries += _group(module, names, _REFERENCE, _WHY_RUNTIME)
    for module, names in _BUILDERS:
        entries += _group(module, names, _BUILDER, _WHY_BUILDER)
    entries += _ONE_OFFS
    table: dict[str, AllowedTarget] = {}
    for entry in entries:
        if entry.target in table:  # a name listed twice must not widen its uses by accident
            raise AssertionError(f"allowlist: {entry.target} listed twice")
        table[entry.target] = entry
    return table


ALLOWLIST: Mapping[str, AllowedTarget] = types.MappingProxyType(_build_allowlist())


def allowed_uses(target: str) -> frozenset[Use]:
    """The uses :data:`ALLOWLIST` grants ``target`` (empty where it is not listed)."""
    entry = ALLOWLIST.get(target)
    return entry.uses if entry is not None else frozenset()

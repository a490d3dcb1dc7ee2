"""Apply the FP8 MoE hot-reload fix to an installed sglang, and take it back.

sglang 0.5.23 cannot hot-reload per-tensor FP8 MoE weights (EPLB's
``update_weights_from_disk(..., weight_name_filter=...)``): post-processing
replaces Parameters (the next load dies on ``weight_loader``), a filtered
reload reads the whole checkpoint, then post-processes every module (FP8
linears are transposed twice). `apply()` replaces a few functions of sglang's
own classes, keeping the originals so `revert()` restores them exactly:

==============================================  =============================================
``Fp8MoEMethod.create_weights``                 bf16 checkpoints: w13/w2 get FP8 storage from
                                                the start (no Parameter ever changes dtype)
``FusedMoE._weight_loader_impl``                records the local expert slots written; bf16
                                                expert weights are staged, not stored
``Fp8MoEMethod.process_weights_after_loading``  per-tensor branch in place, only the experts
                                                loaded since the last processing
``Fp8MoEMethod.get_triton_quant_info``          contiguous ``[E]`` w13 scale; input scales: the
                                                max of the per-expert ``[E]`` ones
``Fp8MoEMethod.apply``                          DeepGEMM: ``[E, 2]`` collapsed before the block
                                                expansion
``FusedMoEWithLoRA._forward_with_lora``         LoRA on a patched layer: the quant info above
                                                taken for every forward, not once
``WeightUpdater.update_weights_from_disk``      makes its ``weight_name_filter`` visible to the
                                                two loader functions below for the call; a
                                                filtered call that fails restores the experts
``DefaultModelLoader._get_weights_iterator``    with a filter: reads only matching tensors
``DefaultModelLoader.load_weights_and_postprocess``  with a filter: post-processes only the
                                                modules whose loaders were called
==============================================  =============================================

The tensor math is `fp8_reload.processing`'s (`requantize_w13_to_expert_max_`,
`quantize_staged_experts_`). Configurations the patch does not
cover (block quant, FP4 experts, ROCm, the CPU engine, FlashInfer TRT-LLM and
HPC-ops runners, non-gated experts) keep sglang's own code paths.

Servers: set ``FP8_RELOAD_SGLANG_PATCH=1``; sglang's plugin loader (entry point
group ``sglang.srt.plugins``, run by every sglang process) then calls
`sglang_plugin`, which applies the patch. ``fp8-reload sglang-launch -- ARGS``
does that for ``python -m sglang.launch_server ARGS``.

Importing this package does not import sglang; `apply()` does.

    patch      version check, apply / revert, the plugin entry point
    moe        the fp8.py / FusedMoE half of the fix
    loader     the loader / updater half: read and post-process only what a filter selects
    originals  what the patch replaced, and the filter of the reload in progress
    rollback   a failed filtered update puts the patched MoE layers back as they were
    launch     `fp8-reload sglang-launch`
"""

from .launch import PLUGIN, launch, plugin_registered
from .loader import read_matching_safetensors
from .moe import deepgemm_quant_info, per_tensor_block_scales
from .originals import original
from .patch import (
                    ENV_ENABLE,
                    PARTS,
                    SUPPORTED_VERSIONS,
                    UnsupportedSGLangVersion,
                    apply,
                    check_version,
                    installed_version,
                    is_applied,
                    revert,
                    sglang_plugin,
                    targets,
)

__all__ = ["ENV_ENABLE", "PARTS", "PLUGIN", "SUPPORTED_VERSIONS", "UnsupportedSGLangVersion",
           "apply", "check_version", "deepgemm_quant_info", "installed_version", "is_applied",
           "launch", "original", "per_tensor_block_scales", "plugin_registered",
           "read_matching_safetensors", "revert", "sglang_plugin", "targets"]

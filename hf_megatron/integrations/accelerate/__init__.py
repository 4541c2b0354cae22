"""`accelerate launch --config_file megatron.yaml train.py` without NVIDIA's `megatron` package.

In train.py, import the Accelerator from hf_megatron instead of from accelerate; the rest of an
accelerate Megatron-LM script stays as it is (accelerate's own
examples/by_feature/megatron_lm_gpt_pretraining.py runs unchanged):

    from hf_megatron import Accelerator          # or hf_megatron.integrations.accelerate
    accelerator = Accelerator()
    model, optimizer, loader, scheduler = accelerator.prepare(hf_model, optimizer, loader, scheduler)
    for batch in loader:
        loss = model(**batch).loss        # one whole Megatron step: micro batches, pipeline, optimizer
        accelerator.backward(loss)        # no-op (done inside the step), as in accelerate's Megatron-LM path
        optimizer.step(); scheduler.step(); optimizer.zero_grad()   # no-ops likewise (a torch / transformers
                                          # scheduler steps here, as accelerate's AcceleratedScheduler)
    accelerator.save_state("ckpt")        # Megatron-LM checkpoint + transformers weights

Modules: accelerator.py (the class), engine.py (the prepared model), plugin.py (MegatronLMPlugin
and MegatronLMDummyScheduler -> our config), loaders.py, batches.py, logits.py, param_groups.py,
weights.py (full HF-named weights), state_io.py (save_state / load_state), wrappers.py,
metrics.py (gather / gather_for_metrics / reduce), clipping.py (clip_grad_norm_ between updates),
user_errors.py (one-line errors in the accelerate config's names).
"""
from .accelerator import Accelerator
from .engine import MegatronEngine
from .plugin import megatron_requested, training_config_from_plugin
from .user_errors import check_plugin_numbers, install_excepthook, refuse_dummy_data_loader

refuse_dummy_data_loader()  # accelerate's needs NVIDIA's Megatron-LM even to be built: one line instead
check_plugin_numbers()      # a non-number in the accelerate config: one line, not a traceback per rank
install_excepthook()        # (also before the Accelerator: a script builds MegatronLMPlugin() first)

__all__ = ["Accelerator", "MegatronEngine", "megatron_requested", "training_config_from_plugin"]

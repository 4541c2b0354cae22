"""The accelerate config file the accelerate tests launch with (what `accelerate config` writes for
Megatron-LM): the layout goes to accelerate's MegatronLMPlugin through `megatron_lm_config`."""
from dist import free_port

YAML = """compute_environment: LOCAL_MACHINE
distributed_type: MEGATRON_LM
mixed_precision: 'no'
num_machines: 1
num_processes: {world}
machine_rank: 0
main_training_function: main
rdzv_backend: static
same_network: true
use_cpu: false
main_process_port: {port}
megatron_lm_config:
  megatron_lm_tp_degree: {tp}
  megatron_lm_pp_degree: {pp}
  megatron_lm_num_micro_batches: {num_micro}
  megatron_lm_sequence_parallelism: {sp}
  megatron_lm_gradient_clipping: 1.0
"""


def write_megatron_config(path, world: int, tp: int, pp: int, num_micro: int, sp: bool):
    path.write_text(YAML.format(world=world, port=free_port(), tp=tp, pp=pp, num_micro=num_micro, sp=str(sp).lower()))
    return path

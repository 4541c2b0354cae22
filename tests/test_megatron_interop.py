"""What Megatron-LM (tag core_v0.16.1) and megatron-core 0.16.1 read from our checkpoints.

* args: every field Megatron-LM's `load_args_from_checkpoint`, its tools/checkpoint loader and
  saver and transformers' GPT-2 script read is there, with Megatron-LM's meaning; a
  megatron-core GPTModel configured from those args alone (Megatron-LM's rule: TransformerConfig
  fields copied by name, swiglu / bias_gelu_fusion mapped as core_transformer_config_from_args
  does) loads our rank file strictly and gives transformers' logits.
* torch_dist output: megatron-core's own `dist_checkpointing.load` reads it into a GPTModel's
  sharded_state_dict with strict handling RAISE_ALL (at another TP than written), same logits.
* RNG entry: Megatron-LM's layout, read back by us in the new and the previous layout.

Megatron-LM itself (megatron.training, tools/checkpoint) is not in the megatron-core wheel and
needs a GPU stack to import; `test_megatron_lm_loader_accepts_our_args` runs its loader's
argument steps when HF_MEGATRON_MEGATRON_LM names a checkout (skipped otherwise).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dist import run_distributed
from hf_megatron.checkpoint import rng
from hf_megatron.checkpoint.unpickle import safe_load
from hf_megatron.conversion.convert import hf_to_megatron
from hf_megatron.parallel import state
from hf_megatron.parallel.random import get_tracker, model_parallel_seed, tp_rng
from hf_megatron.training.checkpoint import load_checkpoint, save_checkpoint
from test_convert_helpers import hf_sources, save_hf  # noqa: F401
from tiny import rel_err

IDS = torch.tensor([[3, 17, 250, 9, 41, 128, 77, 5, 299, 0, 64, 12]])

# what Megatron-LM reads from a checkpoint's args (names taken from its code at core_v0.16.1)
LOAD_ARGS_FROM_CHECKPOINT = [  # megatron/training/checkpointing.py, model / tokenizer / parallel args
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads", "num_query_groups",
    "group_query_attention", "kv_channels", "max_position_embeddings", "position_embedding_type",
    "add_position_embedding", "use_rotary_position_embeddings", "rotary_base", "rotary_percent",
    "rotary_interleaved", "add_bias_linear", "add_qkv_bias", "squared_relu", "swiglu",
    "untie_embeddings_and_output_weights", "apply_layernorm_1p", "normalization", "apply_query_key_layer_scaling",
    "attention_dropout", "hidden_dropout", "tokenizer_type", "padded_vocab_size", "ckpt_format",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"]
TOOLS_CHECKPOINT = ["fp16", "bf16", "iteration", "sequence_parallel", "make_vocab_size_divisible_by"]
LOAD_CHECKPOINT = ["consumed_train_samples", "consumed_valid_samples"]
GPT2_SCRIPT = ["bias_gelu_fusion", "openai_gelu"]
NOT_NONE = LOAD_ARGS_FROM_CHECKPOINT + TOOLS_CHECKPOINT + LOAD_CHECKPOINT + GPT2_SCRIPT


def test_converted_args_carry_what_megatron_lm_reads(hf_sources, tmp_path):
    out = tmp_path / "llama_bf16"
    hf_to_megatron(hf_sources["llama"], out, tp=2, pp=2, dtype="bf16")
    rank = safe_load(out / "release/mp_rank_01_001/model_optim_rng.pt")
    args = rank["args"]
    missing = [name for name in NOT_NONE if getattr(args, name, None) is None]
    assert missing == []
    hf_config = AutoModelForCausalLM.from_pretrained(hf_sources["llama"], local_files_only=True).config
    assert (args.fp16, args.bf16, args.params_dtype) == (False, True, torch.bfloat16)
    assert rank["model"]["output_layer.weight"].dtype == torch.bfloat16
    # validate_args needs seq_length (or encoder_seq_length) and asserts it <= max_position_embeddings
    assert args.seq_length == args.encoder_seq_length == hf_config.max_position_embeddings
    assert args.padded_vocab_size == 2 * rank["model"]["output_layer.weight"].shape[0]  # tp=2 rows x 2
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.sequence_parallel) == (2, 2, False)
    assert (args.consumed_train_samples, args.consumed_valid_samples, args.iteration) == (0, 0, 0)
    assert (args.swiglu, args.add_bias_linear, args.normalization, args.position_embedding_type) == \
        (True, False, "RMSNorm", "rope")
    # Megatron-LM's HuggingFaceTokenizer is AutoTokenizer.from_pretrained(tokenizer_model)
    assert args.tokenizer_type == "HuggingFaceTokenizer"
    assert Path(args.tokenizer_model) == (out / "tokenizer").absolute()
    text = "pipeline and tensor parallel checkpoints"
    assert AutoTokenizer.from_pretrained(args.tokenizer_model)(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(hf_sources["llama"])(text)["input_ids"]


def gpt2_tokenizer_folder(folder: Path) -> Path:
    """A GPT-2 byte-level BPE (vocab.json + merges.txt with <|endoftext|>), as GPT-2 models ship."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GPT2TokenizerFast
    from test_convert_helpers import TEXTS
    folder.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=280, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.model.save(str(folder))  # vocab.json, merges.txt
    GPT2TokenizerFast(vocab_file=str(folder / "vocab.json"), merges_file=str(folder / "merges.txt")).save_pretrained(folder)
    return folder


def test_gpt2_tokenizer_is_megatron_lms_gpt2_bpe(tmp_path):
    src = save_hf(tmp_path / "gpt2", "gpt2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).unlink()
    gpt2_tokenizer_folder(src)
    out = tmp_path / "m"
    hf_to_megatron(src, out)
    args = safe_load(out / "release/mp_rank_00/model_optim_rng.pt")["args"]
    assert args.tokenizer_type == "GPT2BPETokenizer"
    assert Path(args.vocab_file).is_file() and Path(args.merge_file).is_file()
    assert Path(args.vocab_file).parent == (out / "tokenizer").absolute()
    # GPT-2's tanh GELU: megatron-core's fused bias-GELU kernel is that approximation
    assert (args.bias_gelu_fusion, args.openai_gelu, args.add_bias_linear) == (True, True, True)


# ---------------------------------------------------------------- megatron-core as the reader

def mcore_model_from_args(args, tp: int = 1):
    """megatron-core GPTModel (local spec, CPU) configured from a checkpoint's args alone, by
    Megatron-LM's rule; only CPU switches (no fusions, CPU init, no dropout) are added."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(TransformerConfig) if hasattr(args, f.name)}
    if args.swiglu:
        fields.update(activation_func=torch.nn.functional.silu, gated_linear_unit=True,
                      bias_activation_fusion=args.bias_swiglu_fusion)
    else:
        fields["bias_activation_fusion"] = args.bias_gelu_fusion
    fields.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, sequence_parallel=False,
                  pipeline_dtype=args.params_dtype, use_cpu_initialization=True, bias_dropout_fusion=False,
                  apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
                  gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm)
    return GPTModel(TransformerConfig(**fields), spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, position_embedding_type=args.position_embedding_type,
                    rotary_base=args.rotary_base, rotary_percent=args.rotary_percent, rope_scaling=args.use_rope_scaling,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)


def _forward(model) -> torch.Tensor:
    """megatron-core logits [b, s, v] for IDS; the causal mask as Megatron-LM builds it (True = masked)."""
    seq = IDS.shape[1]
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    return model(IDS, position_ids=torch.arange(seq)[None], attention_mask=causal)


def _mcore_worker(rank, world, torch_files, torch_dist_dirs):
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.validation import StrictHandling
    parallel_state.initialize_model_parallel(1, 1)
    # CPU stand-ins: megatron-core puts RoPE tables and a loader flag on the current CUDA device and
    # forks a CUDA RNG state around attention dropout (0 here, in eval: nothing is drawn)
    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    logits = {}
    for arch, path in torch_files.items():  # our rank file, with its args
        payload = safe_load(path)
        model = mcore_model_from_args(payload["args"]).eval()
        result = model.load_state_dict(payload["model"], strict=False)
        assert [k for k in result.missing_keys if not k.endswith("_extra_state")] == [] and not result.unexpected_keys
        with torch.no_grad():
            logits[f"torch/{arch}"] = _forward(model)
    for arch, folder in torch_dist_dirs.items():  # our torch_dist folder, through megatron-core's reader
        args = safe_load(Path(folder) / "common.pt")["args"]
        # Megatron-LM pads its tokenizer's vocab_size: a NullTokenizer's is --vocab-size + 1 (its eod)
        tokenizer_vocab = args.vocab_size + (1 if args.tokenizer_type == "NullTokenizer" else 0)
        args.padded_vocab_size = -(-tokenizer_vocab // args.make_vocab_size_divisible_by) * args.make_vocab_size_divisible_by
        model = mcore_model_from_args(args).eval()
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, folder, strict=StrictHandling.RAISE_ALL)
        model.load_state_dict(loaded["model"], strict=True)
        assert loaded["iteration"] == 0 and loaded["args"].ckpt_format == "torch_dist"
        with torch.no_grad():
            logits[f"torch_dist/{arch}"] = _forward(model)
    parallel_state.destroy_model_parallel()
    return logits


def test_megatron_core_reads_our_args_rank_files_and_torch_dist(hf_sources, tmp_path):
    torch_files, torch_dist_dirs = {}, {}
    # qwen2: rope, GQA, qkv bias, untied (the tiny llama's llama3 rope scaling uses an original
    # context Megatron-LM cannot express: it fixes 8192)
    for arch in ("gpt2", "qwen2"):
        hf_to_megatron(hf_sources[arch], tmp_path / f"{arch}_torch")
        torch_files[arch] = str(tmp_path / f"{arch}_torch/release/mp_rank_00/model_optim_rng.pt")
        # written for tp=2 (vocab padded to 2 x 128), read at tp=1: torch_dist is layout-free
        hf_to_megatron(hf_sources[arch], tmp_path / f"{arch}_dist", tp=2, ckpt_format="torch_dist")
        torch_dist_dirs[arch] = str(tmp_path / f"{arch}_dist/release")
    logits = run_distributed(_mcore_worker, 1, (torch_files, torch_dist_dirs))[0]
    for arch in ("gpt2", "qwen2"):
        reference = AutoModelForCausalLM.from_pretrained(hf_sources[arch], local_files_only=True).eval()
        with torch.no_grad():
            expected = reference(IDS).logits
        for kind in ("torch", "torch_dist"):
            ours = logits[f"{kind}/{arch}"][..., : expected.shape[-1]]
            assert rel_err(ours, expected) <= 1e-5, (kind, arch)


# ---------------------------------------------------------------- training checkpoints: RNG, data position

def _tiny_model():
    import hf_megatron
    from tiny import tiny_hf_model
    return hf_megatron.from_pretrained(tiny_hf_model("gpt2", resid_pdrop=0.1, attn_pdrop=0.1)).train()


def _draws() -> tuple:
    with tp_rng():
        tp = torch.rand(3)
    return random.random(), np.random.rand(), torch.rand(3), tp


def test_training_checkpoint_rng_and_data_position_in_megatron_lm_layout(tmp_path):
    state.reset()
    model = _tiny_model()
    model_parallel_seed(11)  # base seed 11 (pp rank 0); TP stream 11 + 2718 + tp rank 0
    torch.rand(5)  # move the streams off their seeds
    with tp_rng():
        torch.rand(5)
    save_checkpoint(tmp_path, 3, model, args={"seq_length": 32}, extra={"consumed_train_samples": 24})
    payload = safe_load(tmp_path / "iter_0000003/mp_rank_00/model_optim_rng.pt")
    args = payload["args"]
    assert (args.consumed_train_samples, args.consumed_valid_samples, args.seq_length, args.encoder_seq_length) == \
        (24, 0, 32, 32)
    assert (args.iteration, args.fp16, args.bf16, args.no_save_optim, args.no_save_rng) == (3, False, False, True, False)
    assert isinstance(payload["rng_state"], list) and len(payload["rng_state"]) == 1
    entry = payload["rng_state"][0]
    assert {"random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states"} <= set(entry)
    # megatron-core's tracker names; CUDA Philox states are int64 [seed, offset]
    trackers = entry["rng_tracker_states"]
    assert set(trackers) == {"model-parallel-rng", "data-parallel-rng", "expert-parallel-rng"}
    if not torch.cuda.is_available():  # the placeholders a CUDA run seeded the same way starts from
        assert entry["cuda_rng_state"].view(torch.int64).tolist() == [11, 0]
        assert trackers["model-parallel-rng"].view(torch.int64).tolist() == [11 + 2718, 0]
    assert trackers["data-parallel-rng"].view(torch.int64).tolist() == [11, 0]
    assert trackers["expert-parallel-rng"].view(torch.int64).tolist() == [11 + 1024, 0]
    # the calls Megatron-LM's load_checkpoint makes on the entry
    np.random.set_state(entry["np_rng_state"])
    random.setstate(entry["random_rng_state"])
    torch.set_rng_state(entry["torch_rng_state"])

    # resume: the next draws of every stream equal the saved run's
    expected = _draws()
    model_parallel_seed(99)
    random.seed(5), np.random.seed(5)
    assert load_checkpoint(tmp_path, _tiny_model()) == 3
    assert _equal_draws(_draws(), expected)


def _equal_draws(a: tuple, b: tuple) -> bool:
    return all(torch.equal(torch.as_tensor(x), torch.as_tensor(y)) for x, y in zip(a, b))


def test_rng_reader_takes_the_previous_layout_and_megatron_lm_numpy_arrays(tmp_path):
    state.reset()
    model_parallel_seed(4)
    torch.rand(2)
    old = {"random_rng_state": random.getstate(),  # the layout before Megatron-LM's names
           "np_rng_state": rng.capture({}, 0)["np_rng_state"], "torch_rng_state": torch.get_rng_state(),
           "rng_tracker_states": get_tracker().get_states()}
    expected = _draws()
    model_parallel_seed(50)
    get_tracker().set_states(rng.restore(old))
    assert _equal_draws(_draws(), expected)

    # a real numpy array, pickled as Megatron-LM does, comes back through the inert stand-ins
    np.random.seed(8)
    torch.save({"np_rng_state": np.random.get_state()}, tmp_path / "np.pt")
    following = np.random.rand(4)
    loaded = safe_load(tmp_path / "np.pt")["np_rng_state"]
    np.random.seed(0)
    rng.restore({**old, "np_rng_state": loaded})
    assert np.array_equal(np.random.rand(4), following)


def test_philox_seed_wraps_like_a_uint64():
    # an unseeded generator's initial seed is any uint64: the state holds its eight bytes
    assert rng.philox_state(2 ** 64 - 1).view(torch.int64).tolist() == [-1, 0]
    assert rng.philox_state(2 ** 64 + 5, 3).view(torch.int64).tolist() == [5, 3]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_philox_placeholder_is_what_cuda_holds_after_seeding():
    torch.cuda.manual_seed(1234)
    assert torch.equal(torch.cuda.get_rng_state(), rng.philox_state(1234))
    torch.cuda.set_rng_state(rng.philox_state(77))
    assert torch.cuda.initial_seed() == 77


# ---------------------------------------------------------------- Megatron-LM's own loader (optional)

MEGATRON_LM = os.environ.get("HF_MEGATRON_MEGATRON_LM")
LOADER_PROBE = r"""
import sys, types
megatron_lm, load_dir = sys.argv[1], sys.argv[2]
from megatron_lm_checkout import import_megatron_lm  # the checkout over the wheel, CPU shims (tests/)
import_megatron_lm(megatron_lm)
import megatron.training.arguments  # validate_args asks the GPU's arch at tp > 1: a Hopper's
megatron.training.arguments.get_device_arch_version = lambda: 9
sys.path.insert(0, megatron_lm + "/tools/checkpoint")
import queue
from loader_core import MegatronCheckpointLoaderLLM
args = types.SimpleNamespace(load_dir=load_dir, megatron_path=megatron_lm, position_embedding_type=sys.argv[3],
                             loader_transformer_impl="local", model_type="GPT", true_vocab_size=None, vocab_file=None)
loader = MegatronCheckpointLoaderLLM(args, queue.Queue())
loader.parse_megatron_args()          # parse_args + load_args_from_checkpoint + validate_args
loader.ensure_required_arguments()    # exits on any missing checkpoint argument
md = loader.build_checkpoint_metadata(None)
print("OK", md.seq_length, md.tokenizer_type, md.params_dtype, md.previous_tensor_parallel_size)
"""


@pytest.mark.skipif(not MEGATRON_LM, reason="set HF_MEGATRON_MEGATRON_LM to a Megatron-LM checkout (core_v0.16.1)")
def test_megatron_lm_loader_accepts_our_args(hf_sources, tmp_path):
    out = tmp_path / "llama"
    hf_to_megatron(hf_sources["llama"], out, tp=2, pp=2, dtype="bf16")
    env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", LOADER_PROBE, MEGATRON_LM, str(out), "rope"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "OK 64 HuggingFaceTokenizer torch.bfloat16 2" in done.stdout

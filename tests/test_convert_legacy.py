"""Checkpoints written by Megatron-LM itself: legacy names (language_model.encoder...), the
checkpoint_version 0 / 1 / >= 2 QKV orders, TransformerEngine norm names, args without our
hf_config, pickled enums -- and unpickling never runs code."""
from __future__ import annotations

import argparse
import os

import pytest
import torch

from hf_megatron.conversion.convert import hf_to_megatron, megatron_to_hf
from hf_megatron.conversion.hf_io import CheckpointError
from hf_megatron.checkpoint.checksums import sidecar
from hf_megatron.checkpoint.unpickle import safe_load
from test_convert_helpers import assert_identical, hf_sources, hf_tensors  # noqa: F401

LEGACY_SUFFIXES = [(".self_attention.linear_qkv.", ".self_attention.query_key_value."),
                   (".self_attention.linear_proj.", ".self_attention.dense."),
                   (".pre_mlp_layernorm.", ".post_attention_layernorm."),
                   (".mlp.linear_fc1.", ".mlp.dense_h_to_4h."), (".mlp.linear_fc2.", ".mlp.dense_4h_to_h.")]


def _to_version(qkv: torch.Tensor, version: float, local_heads: int) -> torch.Tensor:
    """(np, 3, hn) rows -> the row order Megatron-LM used at `version` (its documented layouts)."""
    if version >= 2.0:
        return qkv
    tail = tuple(qkv.shape[1:])
    grouped = qkv.reshape(local_heads, 3, -1, *tail)
    if version == 0:
        return grouped.transpose(0, 1).reshape(qkv.shape)  # (3, np, hn)
    return grouped.transpose(1, 2).reshape(qkv.shape)  # 1.0: (np, hn, 3)


def _legacy_model(model: dict, version: float, local_heads: int) -> dict:
    """A rank's mcore state dict -> Megatron-LM's nested legacy `model` entry."""
    language_model = {"embedding": {}, "encoder": {}}
    for name, tensor in model.items():
        if name.startswith("embedding."):
            part = name.split(".")[1]
            language_model["embedding"][part] = {"weight": tensor}
        elif name.startswith("output_layer."):
            language_model["output_layer"] = {"weight": tensor}
        else:
            key = name.replace("decoder.", "", 1)
            for new, old in LEGACY_SUFFIXES:
                key = key.replace(new, old)
            if ".query_key_value." in key:
                tensor = _to_version(tensor, version, local_heads)
            language_model["encoder"][key] = tensor
    return {"language_model": language_model}


def _megatron_lm_args(args: argparse.Namespace) -> argparse.Namespace:
    from megatron.core.transformer.enums import AttnBackend
    fields = vars(args).copy()
    for key in ("hf_config", "vocab_size", "hf_megatron_version", "hf_generation_config"):
        fields.pop(key, None)
    fields["attention_backend"] = AttnBackend.auto  # pickled as a megatron.core enum
    return argparse.Namespace(**fields)


@pytest.mark.parametrize("arch,version", [("gpt2", 0), ("gpt2", 1.0), ("llama", 3.0)])
def test_megatron_lm_legacy_checkpoints_convert_exactly(arch, version, hf_sources, tmp_path):
    hf_to_megatron(hf_sources[arch], tmp_path / "mcore", tp=2, pp=1)
    legacy = tmp_path / "legacy"
    for rank in range(2):
        payload = safe_load(tmp_path / f"mcore/release/mp_rank_0{rank}/model_optim_rng.pt")
        rank_dir = legacy / f"iter_0000042/mp_rank_0{rank}"
        rank_dir.mkdir(parents=True)
        torch.save({"model": _legacy_model(payload["model"], version, local_heads=2),
                    "args": _megatron_lm_args(payload["args"]), "checkpoint_version": version, "iteration": 42},
                   rank_dir / "model_optim_rng.pt")
    (legacy / "latest_checkpointed_iteration.txt").write_text("42")
    megatron_to_hf(legacy, tmp_path / "hf", vocab_size=300)
    assert_identical(hf_tensors(hf_sources[arch]), hf_tensors(tmp_path / "hf"))


def test_transformer_engine_names_are_read(hf_sources, tmp_path):
    hf_to_megatron(hf_sources["llama"], tmp_path / "m")
    path = tmp_path / "m/release/mp_rank_00/model_optim_rng.pt"
    payload = safe_load(path)
    te_names = {".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
                ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight"}
    renamed = {}
    for name, tensor in payload["model"].items():
        for ours, te in te_names.items():
            name = name.replace(ours, te)
        renamed[name] = tensor
        renamed[name.rsplit(".", 1)[0] + "._extra_state"] = None  # TE writes these; they are skipped
    payload["model"] = renamed
    torch.save(payload, path)
    sidecar(path).unlink()  # TransformerEngine-era Megatron-LM writes no checksum sidecar
    megatron_to_hf(tmp_path / "m", tmp_path / "hf")
    assert_identical(hf_tensors(hf_sources["llama"]), hf_tensors(tmp_path / "hf"))


class _Exploit:
    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _SideEffect:
    """A class whose unpickling (if it ran) would create the marker file."""

    def __setstate__(self, state):
        open(state["marker"], "w").close()


def test_unpickling_never_runs_code(tmp_path):
    marker = tmp_path / "pwned"
    exploit = _Exploit()
    exploit.marker = marker
    torch.save({"args": exploit, "w": torch.ones(2)}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="evil.pt"):  # os.system: refused outright
        safe_load(tmp_path / "evil.pt")
    sneaky = _SideEffect()
    sneaky.__dict__["marker"] = str(marker)
    torch.save({"args": sneaky, "iteration": 1, "w": torch.ones(2)}, tmp_path / "sneaky.pt")
    with pytest.raises(CheckpointError, match=r"sneaky.pt: refusing to unpickle .*\._SideEffect"):
        safe_load(tmp_path / "sneaky.pt")  # an unknown class: not on the allow-list
    # a class the caller names as data: an inert stand-in, never the class
    loaded = safe_load(tmp_path / "sneaky.pt", stand_ins=[(_SideEffect.__module__, "_SideEffect")])
    assert not marker.exists()
    assert torch.equal(loaded["w"], torch.ones(2)) and loaded["args"].state == {"marker": str(marker)}


@pytest.mark.parametrize("singleton_fc1", [False, True])
def test_torch_dist_with_common_state_inside_the_dcp_files(singleton_fc1, hf_sources, tmp_path):
    """The other torch_dist layout: no common.pt, `args` saved as a byte entry by
    torch.distributed.checkpoint; layers stacked on a leading axis as megatron-core stores them
    (its own writer is exercised in test_convert_dist.py); SwiGLU fc1 optionally as `_w` / `_v`."""
    import torch.distributed.checkpoint as dcp
    from hf_megatron.checkpoint.load import open_megatron
    hf_to_megatron(hf_sources["llama"], tmp_path / "m")
    reader = open_megatron(tmp_path / "m")
    full = reader.full_state_dict()
    state = {}
    for name, tensor in full.items():
        if name.startswith("decoder.layers."):
            suffix = name.split(".", 3)[3]
            key = "decoder.layers." + suffix
            if key not in state:
                state[key] = torch.stack([full[f"decoder.layers.{i}.{suffix}"] for i in range(2)])
        else:
            state[name] = tensor
    if singleton_fc1:
        gate, up = state.pop("decoder.layers.mlp.linear_fc1.weight").chunk(2, dim=1)
        state["decoder.layers.mlp.linear_fc1.weight_w"], state["decoder.layers.mlp.linear_fc1.weight_v"] = gate, up
    state["args"] = _megatron_lm_args(reader.args)
    state["iteration"] = 9
    folder = tmp_path / "dist/iter_0000009"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    (tmp_path / "dist/latest_checkpointed_iteration.txt").write_text("9")
    megatron_to_hf(tmp_path / "dist", tmp_path / "hf", vocab_size=300)
    assert_identical(hf_tensors(hf_sources["llama"]), hf_tensors(tmp_path / "hf"))

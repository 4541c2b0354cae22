"""Fuzz cases for config.json, safetensors files, Megatron rank files and torch_dist checkpoints
(no tests here).  Entry points: `convert hf-to-megatron`, `convert megatron-to-hf`, `reshard`
(the CLI in-process), from_pretrained and load_megatron_weights."""
from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import torch
from safetensors import safe_open

import hf_megatron
from bad_checkpoints import edit_rank_file, edit_safetensors, rank_file, write_torch_dist
from fuzz_bases import Bases
from fuzz_harness import Case, cli
from hf_megatron.checkpoint.checksums import sidecar, write_checksum

LLAMA_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
GPT2_FIELDS = ("vocab_size", "n_embd", "n_layer", "n_head")
BAD_VALUES = {"string": "64", "float": 64.5, "negative": -64, "zero": 0, "null": None, "true": True,
              "list": [64], "object": {"n": 64}}


def to_megatron(hf: Path, workdir: Path):
    return cli(["convert", "hf-to-megatron", "--hf", hf, "--out", workdir / "out"])


def to_hf(root: Path, workdir: Path, *extra):
    return cli(["convert", "megatron-to-hf", "--megatron", root, "--out", workdir / "out", *extra])


def _config(b: Bases, base: Path, edit, entry=to_megatron):
    def run(workdir: Path):
        hf = b.copy(base, workdir)
        path = hf / "config.json"
        data = json.loads(path.read_text())
        text = edit(data)
        path.write_text(text if isinstance(text, Text) else json.dumps(data))
        return entry(hf, workdir)
    return run


class Text(str):
    """An edit's result that replaces the whole file (other results are ignored)."""


def _set(key, value):
    return lambda data: data.__setitem__(key, value)


def _from_pretrained(hf: Path, workdir: Path):
    from hf_megatron.parallel import state
    state.reset()
    return hf_megatron.from_pretrained(hf)


def config_cases(b: Bases) -> list[Case]:
    cat = "config.json"
    texts = {"empty": "", "whitespace": "  \n", "invalid JSON": "{", "truncated": '{"model_type": "llama", "hid',
             "JSON array": "[]", "JSON number": "3", "JSON string": '"llama"', "JSON null": "null",
             "trailing garbage": '{"model_type": "llama"} x', "binary": "\x00\x01\x02"}
    cases = [Case(cat, name, _config(b, b.llama, lambda d, t=t: Text(t)), "config.json") for name, t in texts.items()]
    for arch, base, fields in (("llama", b.llama, LLAMA_FIELDS), ("gpt2", b.gpt2, GPT2_FIELDS)):
        cases += [Case(cat, f"{arch} without {f}", _config(b, base, lambda d, f=f: d.pop(f)), f) for f in fields]
        cases += [Case(cat, f"{arch} {f} {kind}", _config(b, base, _set(f, v)), f)
                  for f in fields for kind, v in BAD_VALUES.items()]
        cases.append(Case(cat, f"{arch} without model_type", _config(b, base, lambda d: d.pop("model_type")), "model_type"))
    mismatched = {"hidden_size": 128, "num_hidden_layers": 3, "intermediate_size": 256, "vocab_size": 301,
                  "num_key_value_heads": 4, "head_dim": 32}
    cases += [Case(cat, f"llama {f}={v} (weights disagree)", _config(b, b.llama, _set(f, v)), "model.")
              for f, v in mismatched.items()]
    cases += [Case(cat, "num_key_value_heads 3", _config(b, b.llama, _set("num_key_value_heads", 3)), "num_key_value_heads"),
              Case(cat, "hidden not divisible by heads", _config(b, b.llama, lambda d: d.update(hidden_size=66, head_dim=None)),
                   "hidden_size"),
              Case(cat, "unknown model_type", _config(b, b.llama, _set("model_type", "bogus")), "bogus"),
              Case(cat, "hidden_act tanh", _config(b, b.llama, _set("hidden_act", "tanh")), "hidden_act"),
              Case(cat, "rope type yarn", _config(b, b.llama, _set("rope_parameters", {
                  "rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0})), "yarn"),
              Case(cat, "gpt2 activation relu", _config(b, b.gpt2, _set("activation_function", "relu")), "relu")]
    cases += [Case(cat, f"from_pretrained: without {f}", _config(b, b.llama, lambda d, f=f: d.pop(f), _from_pretrained), f)
              for f in ("hidden_size", "num_attention_heads")]
    cases.append(Case(cat, "from_pretrained: vocab 301", _config(b, b.llama, _set("vocab_size", 301), _from_pretrained),
                      "model.embed_tokens.weight"))
    return cases


def _header(b: Bases, make):
    """A case replacing model.safetensors by `make(original bytes)`."""
    def run(workdir: Path):
        hf = b.copy(b.llama, workdir)
        path = hf / "model.safetensors"
        path.write_bytes(make(path.read_bytes()))
        return to_megatron(hf, workdir)
    return run


def _with_header(raw: bytes, edit) -> bytes:
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + raw[8 + n:]


def _first_tensor(header: dict) -> dict:
    return header[next(k for k in header if k != "__metadata__")]


def _tensors(b: Bases, edit):
    def run(workdir: Path):
        hf = b.copy(b.llama, workdir)
        edit_safetensors(hf, edit)
        return to_megatron(hf, workdir)
    return run


def _index(b: Bases, edit):
    def run(workdir: Path):
        hf = b.copy(b.llama, workdir)
        weights = hf / "model.safetensors"
        names = list(safe_open(str(weights), "pt").keys())
        weights.rename(hf / "model-00001-of-00001.safetensors")
        index = {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}
        text = edit(index)
        (hf / "model.safetensors.index.json").write_text(text if isinstance(text, Text) else json.dumps(index))
        return to_megatron(hf, workdir)
    return run


def safetensors_cases(b: Bases) -> list[Case]:
    cat = "safetensors"
    names = list(safe_open(str(b.llama / "model.safetensors"), "pt").keys())
    st = "model.safetensors"
    cases = [Case(cat, "empty file", _header(b, lambda r: b""), st),
             Case(cat, "4 bytes", _header(b, lambda r: r[:4]), st),
             Case(cat, "header length huge", _header(b, lambda r: struct.pack("<Q", 2 ** 60) + r[8:]), st),
             Case(cat, "header length past the end", _header(b, lambda r: struct.pack("<Q", len(r)) + r[8:]), st),
             Case(cat, "header length zero", _header(b, lambda r: struct.pack("<Q", 0) + r[8:]), st),
             Case(cat, "header not JSON", _header(b, lambda r: r[:8] + b"x" * (len(r) - 8)), st),
             Case(cat, "header a JSON list", _header(b, lambda r: struct.pack("<Q", 2) + b"[]"), st),
             Case(cat, "garbage", _header(b, lambda r: bytes(range(256)) * 8), st),
             Case(cat, "offsets past the data", _header(b, lambda r: _with_header(r, lambda h: _first_tensor(h).update(
                 data_offsets=[0, 10 ** 9]))), st),
             Case(cat, "offsets disagree with shape", _header(b, lambda r: _with_header(r, lambda h: _first_tensor(h).update(
                 shape=[3, 3]))), st),
             Case(cat, "unknown dtype", _header(b, lambda r: _with_header(r, lambda h: _first_tensor(h).update(dtype="X9"))), st),
             Case(cat, "negative shape", _header(b, lambda r: _with_header(r, lambda h: _first_tensor(h).update(shape=[-1]))), st)]
    cases += [Case(cat, f"truncated to {f:.0%}", _header(b, lambda r, f=f: r[: int(len(r) * f)]), st)
              for f in (0.01, 0.1, 0.5, 0.9, 0.999)]
    cases += [Case(cat, f"{n} missing", _tensors(b, lambda t, n=n: t.pop(n)), n) for n in names]
    cases += [Case(cat, f"{n} one row short", _tensors(b, lambda t, n=n: t.__setitem__(n, t[n][:-1].clone())), n)
              for n in names]
    cases += [Case(cat, f"{n} as int32", _tensors(b, lambda t, n=n: t.__setitem__(n, t[n].to(torch.int32))), n)
              for n in names[::3]]
    cases += [Case(cat, f"{n} transposed", _tensors(b, lambda t, n=n: t.__setitem__(n, t[n].t().contiguous())), n)
              for n in names if n.endswith(("up_proj.weight", "down_proj.weight", "k_proj.weight"))]  # not square
    idx = "model.safetensors.index.json"
    cases += [Case(cat, "index invalid JSON", _index(b, lambda i: Text("{")), idx),
              Case(cat, "index without weight_map", _index(b, lambda i: i.pop("weight_map")), idx),
              Case(cat, "index weight_map a list", _index(b, lambda i: i.__setitem__("weight_map", [1])), idx),
              Case(cat, "index names a missing shard", _index(b, lambda i: i["weight_map"].__setitem__(names[0], "nope.safetensors")),
                   "nope.safetensors"),
              Case(cat, "index names a tensor the shard lacks", _index(b, lambda i: i["weight_map"].__setitem__("extra.w", i["weight_map"][names[0]])),
                   "extra.w"),
              Case(cat, "index leaves the folder", _index(b, lambda i: i["weight_map"].__setitem__(names[0], "../../x.safetensors")),
                   "x.safetensors"),
              Case(cat, "index lacks a tensor", _index(b, lambda i: i["weight_map"].pop(names[-1])), names[-1])]
    return cases


def _rank(b: Bases, edit, tp_rank: int = 1, entry=to_hf, keep_checksum: bool = True):
    """A case editing the `model` entry of one rank file of the llama tp2 checkpoint."""
    def run(workdir: Path):
        root = b.copy(b.meg_llama, workdir)
        path = edit_rank_file(rank_file(root, tp_rank=tp_rank), edit)
        if not keep_checksum:
            sidecar(path).unlink()
        return entry(root, workdir)
    return run


def _payload(b: Bases, edit, checksum: bool = True):
    """A case editing the whole payload of rank 0's file."""
    def run(workdir: Path):
        root = b.copy(b.meg_llama, workdir)
        path = rank_file(root, tp_rank=0)
        payload = torch.load(path, weights_only=False)
        edit(payload)
        torch.save(payload, path)
        write_checksum(path) if checksum else sidecar(path).unlink()
        return to_hf(root, workdir)
    return run


def _bytes(b: Bases, make, checksum: bool):
    def run(workdir: Path):
        root = b.copy(b.meg_llama, workdir)
        path = rank_file(root, tp_rank=1)
        path.write_bytes(make(path.read_bytes()))
        if not checksum:
            sidecar(path).unlink()
        return to_hf(root, workdir)
    return run


def _tree(b: Bases, edit, entry=to_hf, base=None):
    def run(workdir: Path):
        root = b.copy(base or b.meg_llama, workdir)
        edit(root)
        return entry(root, workdir)
    return run


def _reshard(root: Path, workdir: Path):
    return cli(["reshard", "--src", root, "--out", workdir / "out", "--tp", "1"])


def _load_weights(b: Bases):
    """load_megatron_weights of a checkpoint into a fresh llama model (the library entry point)."""
    def run(root: Path, workdir: Path):
        from hf_megatron.checkpoint.load import load_megatron_weights
        from hf_megatron.conversion.hf_io import HFCheckpoint
        from hf_megatron.loading import build_model
        from hf_megatron.parallel import state
        state.reset()
        return load_megatron_weights(build_model(HFCheckpoint(b.llama).model_config(), init=False), root)
    return run


def megatron_cases(b: Bases) -> list[Case]:
    cat = "Megatron rank files"
    local = [k for k, v in torch.load(rank_file(b.meg_llama, tp_rank=1), weights_only=False)["model"].items()]
    pt = "model_optim_rng.pt"
    cases = []
    for checksum in (True, False):
        tag = "" if checksum else ", no sidecar"
        cases += [Case(cat, f"truncated to {f:.0%}{tag}", _bytes(b, lambda r, f=f: r[: int(len(r) * f)], checksum), pt)
                  for f in (0, 0.01, 0.25, 0.5, 0.75, 0.999)]
        cases += [Case(cat, f"garbage{tag}", _bytes(b, lambda r: bytes(range(256)) * 16, checksum), pt),
                  Case(cat, f"plain pickle{tag}", _bytes(b, lambda r: pickle.dumps({"model": {}}), checksum), pt)]
    cases += [Case(cat, f"rank 1 lacks {n}", _rank(b, lambda m, n=n: m.pop(n)), n) for n in local]
    cases += [Case(cat, f"rank 0 {n} one row short", _rank(b, lambda m, n=n: m.__setitem__(n, m[n][:-1].clone()), 0), n)
              for n in local]
    cases += [Case(cat, f"rank 1 {n} as int64", _rank(b, lambda m, n=n: m.__setitem__(n, m[n].long()), 1, to_hf, False), n)
              for n in local[::4]]
    cases += [Case(cat, f"reshard: rank 1 lacks {n}", _rank(b, lambda m, n=n: m.pop(n), 1, _reshard), n) for n in local[::3]]
    cases += [Case(cat, f"load_megatron_weights: rank 0 {n} wrong", _rank(
        b, lambda m, n=n: m.__setitem__(n, torch.zeros(3)), 0, _load_weights(b)), n) for n in local[::5]]
    cases += [Case(cat, "rank 1 entry a string", _rank(b, lambda m: m.__setitem__(local[0], "weights")), local[0]),
              Case(cat, "extra layer tensor", _rank(b, lambda m: m.__setitem__("decoder.layers.7.mlp.linear_fc1.weight",
                                                                             torch.zeros(2))), "decoder.layers.7")]
    for name, edit in [("no args", lambda p: p.pop("args")), ("args None", lambda p: p.__setitem__("args", None)),
                       ("args a string", lambda p: p.__setitem__("args", "x")),
                       ("hf_config unknown model_type", lambda p: p["args"].hf_config.update(model_type="bogus")),
                       ("hf_config without hidden_size", lambda p: p["args"].hf_config.pop("hidden_size")),
                       ("num_layers 3 in hf_config", lambda p: p["args"].hf_config.update(num_hidden_layers=3)),
                       ("no model entry", lambda p: p.pop("model")),
                       ("model entry a list", lambda p: p.__setitem__("model", [1, 2])),
                       ("checkpoint_version a word", lambda p: p.__setitem__("checkpoint_version", "new")),
                       ("tp size 3 in args", lambda p: setattr(p["args"], "tensor_model_parallel_size", 3)),
                       ("payload a list", None)]:
        if edit is None:
            cases.append(Case(cat, name, _bytes(b, lambda r: _torch_bytes([1, 2, 3]), True), pt))
            continue
        cases.append(Case(cat, name, _payload(b, edit), "mp_rank_00" if "model" in name else None))
    tracker = "latest_checkpointed_iteration.txt"
    for name, text in [("empty", ""), ("a word", "abc"), ("negative", "-1"), ("names a missing iteration", "99"),
                       ("binary", "\x00\xff")]:
        cases.append(Case(cat, f"tracker {name}", _tree(b, lambda r, t=text: (r / tracker).write_text(t)),
                          tracker if name != "names a missing iteration" else "iter_0000099"))
    cases += [Case(cat, "rank folder 1 missing", _tree(b, lambda r: _rmtree(r / "release/mp_rank_01")), "mp_rank_01"),
              Case(cat, "rank file 0 missing", _tree(b, lambda r: rank_file(r, 0).unlink()), "mp_rank_00"),
              Case(cat, "no rank folders", _tree(b, lambda r: [_rmtree(p) for p in (r / "release").iterdir()]), "release"),
              Case(cat, "rank file a folder", _tree(b, lambda r: (rank_file(r, 0).unlink(), rank_file(r, 0).mkdir())), pt),
              Case(cat, "pp2 stage 1 missing", _tree(b, lambda r: _rmtree(r / "release/mp_rank_00_001"), base=b.meg_gpt2),
                   "mp_rank_00_001"),
              Case(cat, "not a checkpoint folder", _tree(b, lambda r: ((r / tracker).unlink(), None)), "meg_llama"),
              Case(cat, "sidecar garbage", _tree(b, lambda r: sidecar(rank_file(r, 0)).write_text("zz")), "sha256"),
              Case(cat, "checkpoint is a file", lambda w: (w.joinpath("f").write_text("x"), to_hf(w / "f", w))[1], "f")]
    return cases


def _torch_bytes(obj) -> bytes:
    import io
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _rmtree(path: Path) -> None:
    import shutil
    shutil.rmtree(path)


def _dist_file(b: Bases, name: str, make):
    def run(workdir: Path):
        root = b.copy(b.dist, workdir)
        files = sorted((root / "iter_0000009").glob(name))
        files[0].write_bytes(make(files[0].read_bytes()))
        return to_hf(root, workdir, "--vocab-size", "300")
    return run


def _dist_state(b: Bases, edit, layers: int = 2):
    def run(workdir: Path):
        from hf_megatron.checkpoint.load import open_megatron
        reader = open_megatron(b.meg_llama)
        full = reader.full_state_dict()
        edit(full)
        write_torch_dist(full, reader.args, workdir / "dist", num_layers=layers)
        return to_hf(workdir / "dist", workdir, "--vocab-size", "300")
    return run


def _grow(full: dict, name: str) -> None:
    """One more row on `name` (on every layer's copy of a per-layer tensor: they are stacked)."""
    for n in [name] if ".0." not in name else [name, name.replace(".0.", ".1.")]:
        full[n] = torch.cat([full[n], full[n][:1]])


def torch_dist_cases(b: Bases) -> list[Case]:
    cat = "torch_dist"
    from hf_megatron.checkpoint.load import open_megatron
    names = list(open_megatron(b.meg_llama).names())
    cases = [Case(cat, f".metadata {n}", _dist_file(b, ".metadata", make), ".metadata") for n, make in [
        ("empty", lambda r: b""), ("garbage", lambda r: bytes(range(256))), ("truncated to half", lambda r: r[: len(r) // 2]),
        ("truncated by 1", lambda r: r[:-1]), ("a dict pickle", lambda r: pickle.dumps({"a": 1})),
        ("a list pickle", lambda r: pickle.dumps([1]))]]
    cases += [Case(cat, f".distcp {n}", _dist_file(b, "*.distcp", make), "dist") for n, make in [
        ("empty", lambda r: b""), ("truncated to half", lambda r: r[: len(r) // 2]), ("garbage", lambda r: b"\x07" * len(r))]]
    cases += [Case(cat, f"{n} rows + 1", _dist_state(b, lambda f, n=n: _grow(f, n)), n.replace(".0.", "."))
              for n in names if ".1." not in n]
    cases += [Case(cat, f"{n} missing", _dist_state(b, lambda f, n=n: f.pop(n)), n) for n in names if not n.startswith("decoder.layers.")]
    cases += [Case(cat, "3 layers stacked", _dist_state(b, lambda f: f.update(
        {k.replace("layers.1.", "layers.2."): v for k, v in list(f.items()) if "layers.1." in k}), layers=3), "decoder.layers.2")]
    return cases


def checkpoint_cases(b: Bases) -> list[Case]:
    return config_cases(b) + safetensors_cases(b) + megatron_cases(b) + torch_dist_cases(b)

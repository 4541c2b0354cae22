"""Hostile pickles never run: a corpus of payloads (each would create a marker file when
unpickled by plain pickle -- checked first), fed through every checkpoint reader.  Every one
must end in a one-line CheckpointError, with no marker.

Readers: the rank-file loader (`safe_load`), torch-format `open_megatron`, training's
`load_checkpoint`, `checkpoint_info`, `load_megatron_weights`, torch_dist's `.metadata`,
its `common.pt`, its DCP byte entries and tensor data, accelerate's `load_state` of a
`register_for_checkpointing` object (`custom_checkpoint_<i>.pkl`), and `hf-megatron convert megatron-to-hf`
(in process for every payload, as a subprocess for a few)."""
from __future__ import annotations

import argparse
import io
import os
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import hf_megatron
from hf_megatron.checkpoint.load import load_megatron_weights, open_megatron
from hf_megatron.checkpoint.torch_dist import SafeReader, TorchDistCheckpoint
from hf_megatron.checkpoint.unpickle import safe_load
from hf_megatron.cli import main
from hf_megatron.errors import CheckpointError
from hf_megatron.parallel import state
from hf_megatron.training.checkpoint import checkpoint_info, load_checkpoint
from tiny import tiny_hf_model

# ------------------------------------------------------------------ a tiny pickle assembler

def _text(s: str, protocol: int) -> bytes:
    if protocol == 0:
        return b"V" + s.encode("raw_unicode_escape") + b"\n"
    data = s.encode()
    if protocol >= 4 and len(data) < 256:
        return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def _global(module: str, name: str, protocol: int) -> bytes:
    if protocol >= 4:
        return _text(module, protocol) + _text(name, protocol) + pickle.STACK_GLOBAL
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _call(func: bytes, *args: bytes) -> bytes:
    return func + pickle.MARK + b"".join(args) + pickle.TUPLE + pickle.REDUCE


def _frame(body: bytes, protocol: int) -> bytes:
    head = pickle.PROTO + bytes([protocol]) if protocol >= 2 else b""
    return head + body + pickle.STOP


def reduce_to(module: str, name: str, *args: str, protocol: int = 2) -> bytes:
    return _frame(_call(_global(module, name, protocol), *(_text(a, protocol) for a in args)), protocol)


def chain_getattr(owner: bytes, attribute: str, command: str, protocol: int) -> bytes:
    """getattr(<owner>, attribute)(command)"""
    func = _call(_global("builtins", "getattr", protocol), owner, _text(attribute, protocol))
    return _frame(_call(func, _text(command, protocol)), protocol)


class _Exploit:
    """Pickles as a call (by reference) to `func(*args)`."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


_TEMPLATES: dict[str, bytes] = {}


def _valid_metadata_with(evil, protocol: int) -> bytes:
    """Real torch.distributed.checkpoint metadata with `evil` tucked inside."""
    if "metadata" not in _TEMPLATES:
        folder = Path(os.environ["HOSTILE_TMP"]) / "dcp_template"
        dcp.save({"decoder.layers.w": torch.ones(2, 3), "iteration": 1},
                 storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
        _TEMPLATES["metadata"] = (folder / ".metadata").read_bytes()
    metadata = pickle.loads(_TEMPLATES["metadata"])  # our own file: fine
    metadata.planner_data = {"decoder.layers.w": ("decoder.layers.w",), "evil": evil}
    return pickle.dumps(metadata, protocol=protocol)


def _valid_rank_file_with(evil) -> bytes:
    """A rank-file-shaped dict (tensors, args namespace) with `evil` inside args."""
    buffer = io.BytesIO()
    torch.save({"args": argparse.Namespace(num_layers=2, evil=evil), "iteration": 3,
                "model": {"decoder.layers.0.mlp.linear_fc1.weight": torch.ones(2)}}, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def _builders() -> dict:
    """name -> marker path -> pickle bytes that create the marker file when unpickled."""
    touch, code = (lambda m: f"touch {m}"), (lambda m: f"open({m!r}, 'w').close()")
    b = {}
    for protocol in range(6):
        b[f"os.system p{protocol}"] = lambda m, p=protocol: reduce_to("os", "system", touch(m), protocol=p)
    b["posix.system"] = lambda m: reduce_to("posix", "system", touch(m))
    b["builtins.exec"] = lambda m: reduce_to("builtins", "exec", code(m), protocol=3)
    b["builtins.eval"] = lambda m: reduce_to("builtins", "eval", code(m), protocol=5)
    b["builtins.open"] = lambda m: reduce_to("builtins", "open", m, "w", protocol=1)
    b["subprocess.getoutput"] = lambda m: reduce_to("subprocess", "getoutput", touch(m), protocol=4)
    b["subprocess.call list"] = lambda m: _frame(_call(_global("subprocess", "call", 2), pickle.MARK + _text("touch", 2)
                                                       + _text(m, 2) + pickle.LIST), 2)
    b["builtins.getattr(__import__('os'))"] = lambda m: chain_getattr(
        _call(_global("builtins", "__import__", 4), _text("os", 4)), "system", touch(m), 4)
    b["importlib.import_module + getattr"] = lambda m: chain_getattr(
        _call(_global("importlib", "import_module", 2), _text("os", 2)), "system", touch(m), 2)
    # dotted attribute paths from modules an allow-list might trust by prefix
    for module, path in (("torch.distributed.checkpoint.metadata", "os.system"),
                         ("torch.distributed.checkpoint.filesystem", "os.system"),
                         ("argparse", "_os.system"), ("pathlib", "os.system"),
                         ("torch.serialization", "os.system"), ("torch", "serialization.os.system")):
        b[f"dotted {module}:{path}"] = lambda m, mod=module, name=path: reduce_to(mod, name, touch(m), protocol=4)
    # protocol 0 INST and protocol 1 OBJ call what they name
    b["INST os.system"] = lambda m: b"(" + _text(touch(m), 0) + b"ios\nsystem\n."
    b["OBJ os.system"] = lambda m: b"(cos\nsystem\n" + _text(touch(m), 1) + b"o."
    # nested inside otherwise valid structures
    b["nested in DCP metadata (os.system)"] = lambda m: _valid_metadata_with(_Exploit(os.system, touch(m)), 4)
    b["nested in DCP metadata (exec)"] = lambda m: _valid_metadata_with(_Exploit(exec, code(m)), 5)
    b["nested in rank-file args (os.system)"] = lambda m: _valid_rank_file_with(_Exploit(os.system, touch(m)))
    b["nested in rank-file args (subprocess)"] = lambda m: _valid_rank_file_with(
        _Exploit(subprocess.getoutput, touch(m)))
    return b


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    os.environ["HOSTILE_TMP"] = str(tmp_path_factory.mktemp("templates"))
    builders = _builders()
    assert len(builders) >= 20
    return builders


def _torch_file(pickled: bytes) -> bytes:
    """A torch.save zip whose data.pkl is `pickled`."""
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buffer)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for item in src.infolist():
            dst.writestr(item, pickled if item.filename.endswith("/data.pkl") else src.read(item))
    return out.getvalue()


def test_every_payload_is_live(corpus, tmp_path):
    """Plain pickle runs each payload (so the refusals below are not vacuous)."""
    script = ("import pickle, sys, torch.distributed.checkpoint\n"
              "for path in sys.argv[1:]:\n"
              "    try:\n        pickle.loads(open(path, 'rb').read())\n"
              "    except Exception:\n        pass\n")
    files, markers = [], {}
    for i, (name, build) in enumerate(corpus.items()):
        markers[name] = tmp_path / f"live_{i}"
        files.append(tmp_path / f"payload_{i}.pkl")
        files[-1].write_bytes(build(str(markers[name])))
    subprocess.run([sys.executable, "-c", script, *map(str, files)], check=True, capture_output=True, cwd=tmp_path)
    dead = [name for name, marker in markers.items() if not marker.exists()]
    assert not dead, f"payloads that do not fire under plain pickle: {dead}"


@pytest.fixture(scope="module")
def model():
    state.reset()
    return hf_megatron.from_pretrained(tiny_hf_model("gpt2"))


def _rank_root(root: Path, data: bytes) -> Path:
    rank_dir = root / "iter_0000001/mp_rank_00"
    rank_dir.mkdir(parents=True)
    (rank_dir / "model_optim_rng.pt").write_bytes(data)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    return root


def _dist_root(root: Path, metadata: bytes | None = None, common: bytes | None = None,
               byte_entry: bytes | None = None) -> Path:
    folder = root / "iter_0000001"
    state_dict = {"decoder.layers.mlp.linear_fc1.weight": torch.ones(2, 4)}
    if byte_entry is not None:
        state_dict["args"] = argparse.Namespace()  # its bytes are replaced below
    dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    if byte_entry is not None:
        _replace_byte_entry(folder, "args", byte_entry)
    if metadata is not None:
        (folder / ".metadata").write_bytes(metadata)
    if common is not None:
        (folder / "common.pt").write_bytes(common)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    return root


def _replace_byte_entry(folder: Path, key: str, data: bytes) -> None:
    """Put `data` where DCP stored entry `key` (offsets and metadata updated)."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # our own file: fine
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == key)  # the only chunk of `key`
    file = folder / info.relative_path
    old = file.read_bytes()
    file.write_bytes(old[:info.offset] + data + old[info.offset + info.length:])
    for other in metadata.storage_data.values():
        if other.relative_path == info.relative_path and other.offset > info.offset:
            other.offset += len(data) - info.length
    info.length = len(data)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _cli_error(root: Path, out: Path, capsys) -> str:
    assert main(["convert", "megatron-to-hf", "--megatron", str(root), "--out", str(out)]) == 2
    return capsys.readouterr().err.strip()


def _refusal(reader: str, root: Path, raw: bytes, model, out: Path, capsys) -> str:
    """Feed one payload to one reader; the one-line error it gives."""
    as_torch = _torch_file(raw)
    try:
        if reader == "safe_load":
            root.mkdir()
            (root / "model_optim_rng.pt").write_bytes(as_torch)
            safe_load(root / "model_optim_rng.pt")
        elif reader == "open_megatron":
            open_megatron(_rank_root(root, as_torch))
        elif reader == "load_checkpoint":
            load_checkpoint(_rank_root(root, as_torch), model)
        elif reader == "checkpoint_info":
            checkpoint_info(_rank_root(root, as_torch))
        elif reader == "load_megatron_weights":
            load_megatron_weights(model, _rank_root(root, as_torch))
        elif reader == "cli":
            return _cli_error(_rank_root(root, as_torch), out, capsys)
        elif reader == "torch_dist .metadata":
            open_megatron(_dist_root(root, metadata=raw))
        elif reader == "torch_dist .metadata via cli":
            return _cli_error(_dist_root(root, metadata=raw), out, capsys)
        elif reader == "torch_dist tensor data":
            folder = _dist_root(root) / "iter_0000001"
            _replace_byte_entry(folder, "decoder.layers.mlp.linear_fc1.weight", as_torch)
            reader_ = TorchDistCheckpoint.__new__(TorchDistCheckpoint)  # the tensor path alone (no args)
            reader_.folder, reader_.metadata = folder, SafeReader(str(folder)).read_metadata()
            reader_._read("decoder.layers.mlp.linear_fc1.weight", 0)
        elif reader == "accelerate custom_checkpoint":  # load_state of a register_for_checkpointing object
            from types import SimpleNamespace

            from hf_megatron.integrations.accelerate.state_io import _load_custom_objects
            root.mkdir()
            (root / "custom_checkpoint_0.pkl").write_bytes(as_torch)
            _load_custom_objects(SimpleNamespace(_custom_objects=[torch.optim.lr_scheduler.LambdaLR(
                torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0), lambda step: 1.0)]), root)
        elif reader == "torch_dist common.pt":
            open_megatron(_dist_root(root, common=as_torch))
        else:
            open_megatron(_dist_root(root, byte_entry=as_torch))
    except CheckpointError as exc:
        return str(exc)
    raise AssertionError(f"{reader} accepted the payload")


READERS = ["safe_load", "open_megatron", "load_checkpoint", "checkpoint_info", "load_megatron_weights", "cli",
           "torch_dist .metadata", "torch_dist .metadata via cli", "torch_dist common.pt", "torch_dist byte entry",
           "torch_dist tensor data", "accelerate custom_checkpoint"]


@pytest.mark.parametrize("reader", READERS)
def test_no_reader_runs_a_hostile_pickle(reader, corpus, model, tmp_path, capsys):
    for i, (name, build) in enumerate(corpus.items()):
        marker, out = tmp_path / f"marker_{i}", tmp_path / f"out_{i}"
        state.reset()
        message = _refusal(reader, tmp_path / f"case_{i}", build(str(marker)), model, out, capsys)
        assert not marker.exists(), f"{name} ran through {reader}"
        assert len(message.splitlines()) == 1, (name, message)
        assert "refusing to unpickle" in message or "not a loadable" in message, (name, message)
        assert not out.exists(), name


@pytest.mark.parametrize("name", ["os.system p2", "dotted torch.distributed.checkpoint.metadata:os.system",
                                  "nested in DCP metadata (os.system)"])
def test_cli_process_refuses_hostile_checkpoints(name, corpus, tmp_path):
    """The installed command line, in its own process, on torch-format and torch_dist folders."""
    marker = tmp_path / "marker"
    raw = corpus[name](str(marker))
    for kind, root in (("torch", _rank_root(tmp_path / "torch", _torch_file(raw))),
                       ("torch_dist", _dist_root(tmp_path / "dist", metadata=raw))):
        result = subprocess.run([sys.executable, "-m", "hf_megatron.cli", "convert", "megatron-to-hf", "--megatron",
                                 str(root), "--out", str(tmp_path / f"out_{kind}")], capture_output=True, text=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert result.returncode == 2, (kind, result.stderr)
        err = result.stderr.strip()
        assert len(err.splitlines()) == 1, (kind, err)
        assert "refusing to unpickle" in err or "not a loadable" in err, (kind, err)
        assert not marker.exists() and not (tmp_path / f"out_{kind}").exists(), kind

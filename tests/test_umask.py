"""Files and folders we write get the modes the user's umask asks for (mkstemp / mkdtemp would
make every output 0600 / 0700): converter outputs, training checkpoints, checksum sidecars."""
from __future__ import annotations

import os
import stat

import pytest

import hf_megatron
from hf_megatron.conversion.convert import hf_to_megatron, megatron_to_hf
from hf_megatron.parallel import state
from hf_megatron.training.checkpoint import save_checkpoint
from test_convert_helpers import hf_sources  # noqa: F401


def _modes(root):
    """{relative path: (is_dir, permission bits)} of everything under root, root included."""
    out = {".": (True, stat.S_IMODE(os.stat(root).st_mode))}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            out[os.path.relpath(path, root)] = (name in dirs, stat.S_IMODE(os.stat(path).st_mode))
    return out


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_outputs_follow_the_umask(umask, hf_sources, tmp_path):
    from tiny import tiny_hf_model
    old = os.umask(umask)
    try:
        hf_to_megatron(hf_sources["gpt2"], tmp_path / "meg", tp=2)
        megatron_to_hf(tmp_path / "meg", tmp_path / "hf")
        state.reset()
        save_checkpoint(tmp_path / "train", 2, hf_megatron.from_pretrained(tiny_hf_model("gpt2")))
    finally:
        os.umask(old)
    for root in ("meg", "hf", "train"):
        modes = _modes(tmp_path / root)
        assert any(p.endswith(".sha256") for p in modes) or root == "hf"
        wrong = {p: oct(m) for p, (is_dir, m) in modes.items() if m != (0o777 if is_dir else 0o666) & ~umask}
        assert not wrong, (root, oct(umask), wrong)

"""`hf-megatron train --no-save-optim / --no-save-rng` (Megatron-LM's flags), both checkpoint formats:
the checkpoint holds no optimizer state, LR schedule or distrib_optim.pt / no RNG state, its args record
the flags; resuming it is refused in one line naming the missing part and --no-load-optim /
--no-load-rng (Megatron-LM's load_checkpoint exits there too) and goes on with them; `convert
megatron-to-hf` reads the weights."""
from __future__ import annotations

import pytest

from hf_megatron.checkpoint.unpickle import safe_load
from hf_megatron.cli import main
from train_cli import base_args, cli_inprocess, error_line, make_workspace

FORMATS = {"torch": ("--use-distributed-optimizer",), "torch_dist": ("--ckpt-format", "torch_dist")}


def _saved(folder, ckpt_format):
    """(top-level entries, args, names of the tensor / object entries) of iteration 2 of `folder`."""
    iter_dir = folder / "iter_0000002"
    if ckpt_format == "torch":
        payload = safe_load(iter_dir / "mp_rank_00" / "model_optim_rng.pt")
        return payload, payload["args"], sorted(p.name for p in (iter_dir / "mp_rank_00").iterdir())
    from hf_megatron.checkpoint.torch_dist import SafeReader
    common = safe_load(iter_dir / "common.pt")
    return common, common["args"], sorted(SafeReader(str(iter_dir)).read_metadata().state_dict_metadata)


@pytest.mark.parametrize("ckpt_format", sorted(FORMATS))
def test_no_save_optim_and_rng_write_neither_and_resume_needs_no_load_flags(ckpt_format, tmp_path):
    make_workspace(tmp_path)
    save, flags = tmp_path / "ck", FORMATS[ckpt_format]
    for what in ("optim", "rng"):
        code, _, err = cli_inprocess(*base_args(tmp_path, 4), "--exit-interval", 2, "--save", tmp_path / what,
                                     f"--no-save-{what}", *flags)
        assert code == 0, err[-3000:]
    code, _, err = cli_inprocess(*base_args(tmp_path, 4), "--exit-interval", 2, "--save", save, "--no-save-optim",
                                 "--no-save-rng", *flags)
    assert code == 0, err[-3000:]

    entries, args, names = _saved(tmp_path / "optim", ckpt_format)  # --no-save-optim: RNG, no optimizer
    assert "rng_state" in entries or any(n.startswith("rng_state") for n in names)
    assert not {"optimizer", "opt_param_scheduler"} & set(entries)
    assert (args.no_save_optim, args.no_save_rng) == (True, False)
    assert not [n for n in names if n.startswith("optimizer") or n == "distrib_optim.pt"], names
    entries, args, names = _saved(tmp_path / "rng", ckpt_format)  # --no-save-rng: optimizer, no RNG
    assert "optimizer" in entries and "opt_param_scheduler" in entries
    assert ckpt_format != "torch" or "distrib_optim.pt" in names
    assert ckpt_format != "torch_dist" or any(n.startswith("optimizer.state.exp_avg.") for n in names)
    assert "rng_state" not in entries and not [n for n in names if n.startswith("rng_state")], names
    assert (args.no_save_optim, args.no_save_rng) == (False, True)
    entries, args, names = _saved(save, ckpt_format)
    assert not {"optimizer", "opt_param_scheduler", "rng_state"} & set(entries)
    assert not [n for n in names if n.startswith(("optimizer", "rng_state", "distrib_optim"))], names
    assert any(n.startswith(("decoder.", "embedding.")) for n in names) or "model" in entries

    resume = (*base_args(tmp_path, 4), "--load", save, "--save", save, *flags)
    line = error_line(cli_inprocess(*resume))
    assert "holds no optimizer state" in line and "--no-load-optim" in line, line
    line = error_line(cli_inprocess(*resume, "--no-load-optim"))
    assert "holds no RNG state" in line and "--no-load-rng" in line, line
    line = error_line(cli_inprocess(*base_args(tmp_path, 4), "--load", tmp_path / "rng", *flags))
    assert "holds no RNG state" in line and "--no-load-rng" in line, line
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000002"]
    code, out, err = cli_inprocess(*resume, "--no-load-optim", "--no-load-rng")
    assert code == 0, err[-3000:]
    assert "iteration      3/4" in out and "iteration      1/4" not in out, out[-2000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "4"
    code, _, err = cli_inprocess(*base_args(tmp_path, 4), "--load", tmp_path / "rng", "--no-load-rng", *flags)
    assert code == 0, err[-3000:]

    # weights only: convert reads it
    assert main(["convert", "megatron-to-hf", "--megatron", str(tmp_path / "optim"), "--out",
                 str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()

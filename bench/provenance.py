"""What a benchmark's numbers came from: the date (UTC), the command line, the Python and package
versions and the CUDA build, as one dict for the JSON and one line for the printed header."""
from __future__ import annotations

import datetime
import importlib.metadata
import platform
import shlex
import sys

import torch

PACKAGES = ("torch", "transformers", "accelerate", "triton", "liger-kernel", "torchao")


def provenance() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
            "python": platform.python_version(), "cuda": torch.version.cuda, "versions": versions}


def header(record: dict) -> str:
    found = ", ".join(f"{name} {v}" for name, v in record["versions"].items() if v)
    return f"{record['date']}; python {record['python']}, cuda {record['cuda']}, {found}\n$ {record['command']}"

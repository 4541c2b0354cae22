"""bench/issue14_gpu.sh names only variants, options and test files that exist: a typo there costs a
device call (minutes of a 30-minute budget), so its arguments are checked here, on CPU, with the
benchmarks' own parsers."""
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import loss_curves  # noqa: E402
import throughput  # noqa: E402


def _commands():
    """Each python3 command of the script, continuation lines joined, as argv lists (up to a pipe or a
    redirect)."""
    text = (ROOT / "bench" / "issue14_gpu.sh").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.split("#", 1)[0] if line.lstrip().startswith("#") else line
        if "python3 " in line:
            command = re.split(r"\||2>&1|\s>\s", line[line.index("python3 "):], maxsplit=1)[0]  # up to a pipe or redirect
            yield shlex.split(command)


def _values(argv, flag):
    """The words after `flag` up to the next flag."""
    if flag not in argv:
        return []
    words = argv[argv.index(flag) + 1:]
    return words[:next((i for i, w in enumerate(words) if w.startswith("--")), len(words))]


def test_issue14_plan_names_real_variants_options_and_tests():
    commands = list(_commands())
    scripts = {argv[1] for argv in commands if len(argv) > 1}
    assert {"bench/throughput.py", "bench/loss_curves.py", "bench/profile_step.py"} <= scripts, scripts
    checked = 0
    for argv in commands:
        for variant in _values(argv, "--variants") + _values(argv, "--variant"):  # kernel_callers.py: one
            assert throughput.variant_name(variant) == variant
            checked += 1
        for option in _values(argv, "--options"):
            assert option in loss_curves.OPTIONS, option
            checked += 1
        for model in _values(argv, "--models") + _values(argv, "--model"):
            assert model in throughput.MODELS, model
        if argv[1:3] == ["-m", "pytest"]:
            tests = [w.split("::") for w in argv if w.startswith("tests/")]  # a file, or file::test
            assert tests and all((ROOT / t[0]).is_file() for t in tests), tests
            for path, *node in tests:
                assert all(f"def {name}(" in (ROOT / path).read_text() for name in node), (path, node)
            checked += len(tests)
    assert checked > 30
    stages = re.findall(r"^(\S+)\)$", (ROOT / "bench" / "issue14_gpu.sh").read_text(), flags=re.M)
    assert {"tests", "speed", "speed-gpt2", "curves", "3b", "xl", "profile"} <= set(stages), stages

"""The `radixserve generate` command on the bundled model, as a user runs it."""
from __future__ import annotations

import subprocess
import sys

import pytest


def test_generate_prints_the_answer():
    result = subprocess.run(
        [sys.executable, "-m", "radixserve", "generate", "What is the capital of France?",
         "--chat", "--max-new-tokens", "16", "--dtype", "float32"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.parametrize("args,message", [
    (["hi", "--max-new-tokens", "-1"], "max_new_tokens"),
    (["hi", "--top-p", "2"], "top_p"),
    (["", "--max-new-tokens", "2"], "prompt must not be empty"),
    (["hi", "--model-path", "/nonexistent/model"], "does not exist"),
    (["hi", "--tp-size", "0"], "tp-size"),
])
def test_generate_user_errors_are_one_line(args: list[str], message: str) -> None:
    """Mistakes in the command line are one line on stderr and exit 2, no traceback (the
    sampling ones before the model loads)."""
    result = subprocess.run([sys.executable, "-m", "radixserve", "generate", *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_unknown_command_is_a_usage_error():
    result = subprocess.run([sys.executable, "-m", "radixserve", "frobnicate"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "usage" in result.stderr


def test_help_lists_commands_and_grouped_flags_without_loading_torch():
    top = subprocess.run([sys.executable, "-m", "radixserve", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert top.returncode == 0 and all(c in top.stdout for c in ("serve", "generate", "bench"))
    serve = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--help"],
                           capture_output=True, text=True, timeout=60)
    assert serve.returncode == 0
    for section in ("model options", "serving options", "memory and scheduling options",
                    "kernels (GPU) options", "parallelism options", "logging options"):
        assert section in serve.stdout
    assert "(default: 30000)" in serve.stdout and "{lpm,fcfs,dfs-weight,random}" in serve.stdout
    generate = subprocess.run([sys.executable, "-m", "radixserve", "generate", "--help"],
                              capture_output=True, text=True, timeout=60)
    assert "--max-new-tokens" in generate.stdout
    assert "--port" not in generate.stdout and "--dp-size" not in generate.stdout
    probe = subprocess.run(
        [sys.executable, "-c", "import sys\nfrom radixserve.cli import main\n"
         "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
         "print('torch loaded' if 'torch' in sys.modules else 'no torch')"],
        capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip().endswith("no torch")


def test_every_server_flag_has_help():
    import dataclasses

    from radixserve.config import ServerArgs
    from radixserve.core.server_flags import FLAGS
    names = {f.name for f in dataclasses.fields(ServerArgs)} - {"resolved"}
    assert names == set(FLAGS)


def test_bench_help_describes_every_benchmark(capsys: pytest.CaptureFixture) -> None:
    from radixserve.cli import BENCH_MODULES, BENCH_SUMMARIES, main

    assert set(BENCH_SUMMARIES) == set(BENCH_MODULES)
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for name, summary in BENCH_SUMMARIES.items():
        assert f"  {name:<10} {summary}" in out

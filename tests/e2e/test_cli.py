"""The `radixserve generate` command on the bundled model, as a user runs it."""
from __future__ import annotations

import subprocess
import sys


def test_generate_prints_the_answer():
    result = subprocess.run(
        [sys.executable, "-m", "radixserve", "generate", "What is the capital of France?",
         "--chat", "--max-new-tokens", "16", "--dtype", "float32"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_unknown_command_is_a_usage_error():
    result = subprocess.run([sys.executable, "-m", "radixserve", "frobnicate"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "usage" in result.stderr

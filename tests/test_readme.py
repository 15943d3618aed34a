"""The README's notebook session runs as written, and its first lines are the two set-up commands."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_opens_with_the_two_setup_commands():
    first_block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S)
    assert first_block is not None
    commands = [line for line in first_block.group(1).splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2
    assert "torch==2.13.0" in commands[0] and commands[0].endswith("stagereplay paper")
    assert "torch==2.13.0" in commands[1] and "pytest" in commands[1]


def test_readme_python_session_runs(capsys):
    text = README.read_text()
    session = text.split("## A notebook session", 1)[1]
    code = re.search(r"```python\n(.*?)```", session, re.S)
    assert code is not None
    namespace: dict = {}
    exec(compile(code.group(1), "README.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert "caches differ in" in printed
    assert namespace["fresh"].prefix == namespace["state"].prefix

"""The README's first lines are the two set-up commands, and the documented notebook session (the site's Python
API page) runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
API_PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "api.md"


def test_readme_opens_with_the_two_setup_commands():
    first_block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S)
    assert first_block is not None
    commands = [line for line in first_block.group(1).splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2
    assert "torch==2.13.0" in commands[0] and commands[0].endswith("stagereplay paper")
    assert "torch==2.13.0" in commands[1] and "pytest" in commands[1]


def test_documented_python_session_runs(capsys):
    code = re.search(r"```python\n(.*?)```", API_PAGE.read_text(), re.S)
    assert code is not None
    namespace: dict = {}
    exec(compile(code.group(1), str(API_PAGE), "exec"), namespace)
    printed = capsys.readouterr().out
    assert "caches differ in" in printed
    assert namespace["fresh"].prefix == namespace["state"].prefix

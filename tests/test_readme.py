"""The README's first lines are the two set-up commands, its links and its picture resolve, and the documented
notebook session (the site's Python API page) runs as written."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
API_PAGE = ROOT / "docs" / "reference" / "api.md"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def readme_prose() -> str:
    """README.md without its fenced code blocks, where a bracket is code, not a link."""
    return re.sub(r"^```.*?^```", "", README.read_text(), flags=re.S | re.M)


def test_readme_opens_with_the_two_setup_commands():
    first_block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S)
    assert first_block is not None
    commands = [line for line in first_block.group(1).splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2
    assert "pip install torch==2.13.0" in commands[0] and commands[0].endswith("stagereplay paper")
    assert "pip install torch==2.13.0" in commands[1] and "python -m pytest" in commands[1]


def test_readme_relative_links_resolve():
    targets = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", readme_prose())
    local = [t.split("#", 1)[0] for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]
    assert local, "README.md links to no file of the repository"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_picture_is_a_png():
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", readme_prose())
    assert "docs/images/report.png" in images, images
    for image in (i for i in images if not re.match(r"[a-z][a-z0-9+.-]*:", i)):
        with open(ROOT / image, "rb") as f:
            assert f.read(len(PNG_MAGIC)) == PNG_MAGIC, f"{image} is not a PNG"


def test_documented_python_session_runs(capsys):
    code = re.search(r"```python\n(.*?)```", API_PAGE.read_text(), re.S)
    assert code is not None
    namespace: dict = {}
    exec(compile(code.group(1), str(API_PAGE), "exec"), namespace)
    printed = capsys.readouterr().out
    assert "caches differ in" in printed
    assert namespace["fresh"].prefix == namespace["state"].prefix

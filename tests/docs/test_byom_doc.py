"""docs/byom.md's Python snippet runs as written (in this interpreter, its own namespace) and check_model names the
broken model it shows."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.usefixtures("one_thread")
def test_byom_snippet_runs(capsys):
    [snippet] = re.findall(r"^```python\n(.*?)^```", (ROOT / "docs" / "byom.md").read_text(), flags=re.S | re.M)
    exec(compile(snippet, "docs/byom.md", "exec"), {"__name__": "byom"})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("model check: normalised: Copier.step's log-probabilities are not normalised")
    assert lines[1].startswith("mean reward of the last step:") and len(lines) == 2

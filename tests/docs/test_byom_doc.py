"""docs/byom.md's Python blocks run as written (in this interpreter, each in its own namespace): check_model names
the broken model the first shows, and the second trains its own model with twophase.fit on the task's ids."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.usefixtures("one_thread")
def test_byom_snippets_run(capsys, tmp_path, monkeypatch):
    check, fit, attention = re.findall(r"^```python\n(.*?)^```", (ROOT / "docs" / "byom.md").read_text(),
                                       flags=re.S | re.M)
    exec(compile(check, "docs/byom.md", "exec"), {"__name__": "byom"})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("model check: normalised: Copier.step's log-probabilities are not normalised")
    assert lines[1].startswith("mean reward of the last step:") and len(lines) == 2
    monkeypatch.chdir(tmp_path)
    exec(compile(fit, "docs/byom.md", "exec"), {"__name__": "byom"})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "10 11 torch.Size([2, 3])"  # the vocabularies (4 specials and the tokens), a batch's ids
    assert lines[-1].endswith(str(tmp_path / "runs" / "mine" / "checkpoint_last.pt"))
    exec(compile(attention, "docs/byom.md", "exec"), {"__name__": "byom"})
    assert capsys.readouterr().out == "True\n"  # the attention block equals the formula written out

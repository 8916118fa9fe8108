"""Every ```python snippet of docs/trl.md runs as written (in-process: transformers is imported once)."""
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SNIPPETS = re.findall(r"^```python\n(.*?)^```", (ROOT / "docs" / "trl.md").read_text(), flags=re.S | re.M)


def test_the_page_has_its_two_snippets():
    assert len(SNIPPETS) == 2


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None or importlib.util.find_spec("peft") is None,
                    reason="transformers and peft are not installed (pip install twophase[hf])")
@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_snippet_runs(index, one_thread, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = {"__name__": "__snippet__"}
    exec(compile(SNIPPETS[index], f"docs/trl.md snippet {index + 1}", "exec"), names)
    if index == 1:  # the loop over another generator's completions: it trains, and each generation (the second,
        # after a step, included) asserted inside the loop that its log-probabilities are phase two's
        assert names["step"] == 1 and names["coef"].abs().max() > 0  # the second generation's coefficients
        assert not any(m.training for m in names["model"].modules())  # still evaluation mode: no dropout

"""A real browser (Debian's chromium via Playwright) on the running app: Step twice, tree and mask drawn, no error."""

import os
import shutil

import pytest
from browser import CHROMIUM, running_app, step_twice

pytestmark = pytest.mark.skipif(not (shutil.which(CHROMIUM) or os.path.exists(CHROMIUM)),
                                reason="needs Debian's chromium (installed by .ci/run)")


def test_step_twice_in_a_real_browser(tmp_path):
    with running_app("tiny") as url:
        report = step_twice(url, tmp_path, load_timeout_s=120)
    assert report["exceptions"] == 0 and report["errors"] == []
    assert report["plots"] >= 5  # tree, mask, branches, stop signal, run
    titles = " ".join(report["titles"])
    assert "Step 2: draft tree" in titles and "Tree attention mask" in titles
    assert (tmp_path / "step2_tree.png").stat().st_size > 10_000
    # the default stop policy reads the shipped decision model; its what-if slider explains the step
    assert report["what_if"] and "draft tokens over" in report["what_if"][0]

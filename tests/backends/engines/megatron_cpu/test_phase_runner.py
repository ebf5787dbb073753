"""The phase runner the gloo checks share: a failing phase's error carries its traceback (CI shows
only the error's text), and the phases run concurrently are all stopped when one fails."""

import pytest
from cpu_megatron import PhaseFailed, run_phases, run_phases_concurrently

FAILS = """
import argparse, warnings
parser = argparse.ArgumentParser()
parser.add_argument("--only")
parser.add_argument("--work")
args = parser.parse_args()
warnings.warn("noise that the error leaves out")
print("before the failure", flush=True)
if args.only == "bad":
    raise ValueError("phase bad: the reason")
"""


def test_a_failing_phase_raises_with_its_traceback(tmp_path) -> None:
    script = tmp_path / "phases.py"
    script.write_text(FAILS)
    run_phases(str(script), tmp_path, [["--only", "good"]])
    with pytest.raises(PhaseFailed) as failed:
        run_phases(str(script), tmp_path, [["--only", "good"], ["--only", "bad"]])
    text = str(failed.value)
    assert "--only bad" in text and "exited with 1" in text, text
    assert "Traceback" in text and "ValueError: phase bad: the reason" in text, text
    assert "noise" not in text, text
    assert (tmp_path / "phase_only_bad.log").read_text().count("before the failure") == 1


def test_concurrent_phases_name_the_one_that_failed(tmp_path) -> None:
    script = tmp_path / "phases.py"
    script.write_text(FAILS)
    with pytest.raises(PhaseFailed) as failed:
        run_phases_concurrently(str(script), tmp_path, (["--only", o] for o in ("good", "bad")))
    assert "--only bad" in str(failed.value) and "the reason" in str(failed.value)

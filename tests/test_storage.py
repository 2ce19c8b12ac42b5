"""Storage at an fsspec URL, against a real S3 protocol endpoint (moto's server on
localhost, reached over HTTP by every process like a bucket would be): folder copies with
the marker last, artifacts shared between two "nodes" (two caches), the source checkpoint
fetched by hash, a whole CLI run whose results land in the bucket and resume from it, and
the one-line errors for a bad storage setting."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GATE, TIERS, stable_fields, write_recipe

from conftest import BUCKET

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")


from conftest import s3_store as _store, s3_storage_yaml as _storage_yaml  # noqa: E402


def test_folder_round_trip_writes_marker_last(s3, tmp_path):
    st = _store(s3, "roundtrip")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(b"\x00" * 1000)
    (src / "sub" / "b.txt").write_text("hello")
    (src / "manifest.json").write_text("{}")
    order = []
    real = st.upload_file
    st.upload_file = lambda local, rel: (order.append(rel), real(local, rel))[1]
    assert st.upload_dir(src, "x", marker="manifest.json") == 3
    assert order[-1] == "x/manifest.json"
    assert st.list("x") == ["a.bin", "manifest.json", "sub/b.txt"]
    assert st.download_dir("x", tmp_path / "dst", include=lambda r: r != "a.bin") == 2
    assert (tmp_path / "dst" / "sub" / "b.txt").read_text() == "hello"
    assert not (tmp_path / "dst" / "a.bin").exists()
    assert st.list("absent") == []


def test_artifact_built_on_one_node_is_fetched_by_another(s3, tmp_path, monkeypatch):
    from qeval.artifacts import get_or_build
    st = _store(s3, "artifacts")
    builds = []

    def build(out: Path) -> dict:
        builds.append(out)
        (out / "w.bin").write_bytes(os.urandom(4096))
        return {"n": 1}

    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "node-a"))
    a, man_a, reused = get_or_build("m", {"k": 1}, build, log=lambda m: None, remote=st)
    assert not reused and len(builds) == 1
    assert st.exists(f"cache/artifacts/{a.name}/manifest.json")
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "node-b"))  # another machine: empty cache
    logs = []
    b, man_b, reused = get_or_build("m", {"k": 1}, build, log=logs.append, remote=st)
    assert reused and len(builds) == 1 and any("fetched" in m for m in logs)
    assert b != a and (b / "w.bin").read_bytes() == (a / "w.bin").read_bytes()
    # a corrupt copy in the store is rebuilt on the next node and replaced in the store
    st.fs.pipe_file(st._p(f"cache/artifacts/{a.name}/w.bin"), b"garbage")
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "node-c"))
    logs = []
    c, _, reused = get_or_build("m", {"k": 1}, build, log=logs.append, remote=st)
    assert not reused and len(builds) == 2
    assert any("from the store is unusable" in m for m in logs), logs
    assert st.read_bytes(f"cache/artifacts/{a.name}/w.bin") == (c / "w.bin").read_bytes()


def test_source_fetched_by_hash_and_checked(s3, tiny_llama, tmp_path):
    from qeval.hashing import checkpoint_sha256
    from qeval.storage import fetch_source, publish_source
    st = _store(s3, "sources")
    sha = checkpoint_sha256(tiny_llama)
    rel = publish_source(st, tiny_llama, sha)
    assert st.exists(f"{rel}/source.json") and st.exists(f"{rel}/config.json")
    got = fetch_source(st, sha, tmp_path / "node")
    assert got.parent == tmp_path / "node" / "sources" and checkpoint_sha256(got) == sha
    assert fetch_source(st, sha, tmp_path / "node") == got  # second call: the local copy
    # a checkpoint whose bytes changed in the store is refused, not used
    name = next(f for f in st.list(rel) if f.endswith(".safetensors"))
    st.fs.pipe_file(st._p(f"{rel}/{name}"), b"not weights")
    with pytest.raises(RuntimeError, match="hashes to"):
        fetch_source(st, sha, tmp_path / "node2")
    with pytest.raises(RuntimeError, match="not in"):
        fetch_source(st, "0" * 64, tmp_path / "node3")


def test_tier_task_staging_uses_the_stores_source(s3, tiny_llama, tmp_path, monkeypatch):
    """A node that cannot see the driver's source path gets the checkpoint from the store."""
    from qeval.executors.ray import stage_from_store
    from qeval.hashing import checkpoint_sha256
    from qeval.storage import publish_source
    st = _store(s3, "staging")
    sha = checkpoint_sha256(tiny_llama)
    publish_source(st, tiny_llama, sha)
    rel = "results/tiny/20261130T000000Z"
    st.write_json(f"{rel}/run.json", {"recipe": {}})
    st.write_json(f"{rel}/stages/_run.source.json", {"path": "/nonexistent/driver/tiny", "sha256": sha,
                                                     "origin": str(tiny_llama)})
    st.write_json(f"{rel}/stages/bf16.prepare.json", {"artifact": None})
    st.write_json(f"{rel}/stages/other.prepare.json", {"artifact": None})
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "node"))
    local = stage_from_store(st, rel, "bf16")
    assert local == tmp_path / "node" / "nodes" / "bf16" / rel
    src = json.loads((local / "stages" / "_run.source.json").read_text())
    assert Path(src["path"]).is_relative_to(tmp_path / "node" / "sources")
    assert (local / "stages" / "bf16.prepare.json").exists()
    assert not (local / "stages" / "other.prepare.json").exists()  # another tier's files stay out


def _cli(*args, cache: Path, timeout: int = 900, env: dict | None = None):
    return subprocess.run([sys.executable, "-m", "qeval.cli", *map(str, args)], capture_output=True, text=True,
                          env=dict(os.environ, QEVAL_CACHE=str(cache), **(env or {})), timeout=timeout)


def test_cli_run_lands_in_the_bucket_and_resumes_from_it(s3, tiny_llama, tmp_path, reference_run):
    st = _store(s3, "cli")
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llama, tiers=TIERS, load=False,  # not what is checked here
                          extra=GATE + "\n" + _storage_yaml(s3, "cli"))
    p = _cli("run", recipe, "--tiers", "bf16", cache=tmp_path / "driver")
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]  # the gate: bf16-kv8 has no result yet
    runs = sorted({f.split("/")[0] for f in st.list("results/tiny")})
    assert len(runs) == 1
    rel = f"results/tiny/{runs[0]}"
    assert f"results: s3://{BUCKET}/cli/{rel}" in (p.stdout + p.stderr).replace("\n", "")
    files = st.list(rel)
    for f in ("run.json", "table.md", "gate.json", "report.html", "tiers/bf16.json", "stages/bf16.measure.json",
              "reference/segments.json", "stages/_run.reference.json"):
        assert f in files, (f, files)
    assert not any(f.startswith("tiers/bf16-kv8") for f in files)
    # the keys given in storage_options are not written to run.json (which the store holds)
    stored = st.read_json(f"{rel}/run.json")["recipe"]["storage_options"]
    assert stored["key"] == "***" and stored["secret"] == "***"
    assert stored["client_kwargs"]["endpoint_url"] == s3[0]  # where it went stays visible
    assert any(f.startswith("cache/artifacts/reference-") for f in st.list(""))
    assert any(f.startswith("cache/sources/") and f.endswith("source.json") for f in st.list(""))
    # a fresh machine (empty cache) completes the run from its URL; bf16 is not redone
    q = _cli("run", recipe, "--resume", f"s3://{BUCKET}/cli/{rel}", cache=tmp_path / "other")
    assert q.returncode == 0, q.stdout[-2000:] + q.stderr[-2000:]
    local = tmp_path / "other" / "staging" / "tiny" / runs[0]
    assert not (local / "logs" / "bf16.measure.log").read_text().count("qeval.worker") > 1
    got = st.read_json(f"{rel}/tiers/bf16-kv8.json")
    want = json.loads((reference_run[1] / "tiers" / "bf16-kv8.json").read_text())
    assert stable_fields(got) == stable_fields(want)
    assert "bf16-kv8" in st.read_bytes(f"{rel}/table.md").decode()
    assert "answers/bf16-kv8.json" in st.list(rel)
    # release CI gates the run where it lies; fsspec takes endpoint and keys from the environment
    aws = {"AWS_ENDPOINT_URL": s3[0], "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    g = _cli("gate", f"s3://{BUCKET}/cli/{rel}", cache=tmp_path / "ci", env=aws)
    assert g.returncode == 0 and "gate: PASS" in g.stdout, g.stdout[-1500:] + g.stderr[-1500:]
    g = _cli("gate", f"s3://{BUCKET}/cli/results/tiny/20000101T000000Z", cache=tmp_path / "ci", env=aws)
    assert g.returncode == 2 and len(g.stderr.strip().splitlines()) == 1 and "no run.json" in g.stderr, g.stderr
    g = _cli("gate", f"s3://no-such-bucket/cli/{rel}", cache=tmp_path / "ci", env=aws)
    assert g.returncode == 2 and "s3://no-such-bucket does not exist or these credentials cannot see it" in g.stderr
    p = _cli("plan", f"s3://{BUCKET}/cli/{rel}", "--gpu-mem", "1GiB", "--context", "64", cache=tmp_path / "ci", env=aws)
    assert p.returncode == 0 and "bf16-kv8" in p.stdout, p.stdout[-1000:] + p.stderr[-1000:]


@pytest.mark.parametrize("storage, extra, want", [
    ("nosuchproto://bucket/x", "", "storage: nosuchproto://bucket/x: fsspec does not know the protocol"),
    ("s3://", "", "storage: s3://: give a bucket or folder after s3://"),
    ("/mnt/shared/qeval", "storage_options: {endpoint_url: http://x}",
     "storage_options: storage_options need a storage URL"),
])
def test_bad_storage_is_one_line_exit_2(tiny_llama, tmp_path, storage, extra, want):
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llama, tiers=TIERS, suites=False,
                          extra=f"storage: {storage}\n{extra}")
    p = _cli("validate", recipe, cache=tmp_path / "c", timeout=120)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and want in lines[0] and str(recipe) in lines[0], p.stderr


def test_unreachable_bucket_is_one_line_exit_2(s3, tiny_llama, tmp_path):
    opts = dict(s3[1], key="testing")
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llama, tiers=TIERS, suites=False,
                          extra=f"storage: s3://no-such-bucket/x\nstorage_options: {json.dumps(opts)}\n")
    p = _cli("run", recipe, cache=tmp_path / "c", timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "storage: s3://no-such-bucket/x is not writable" in lines[0], p.stderr
    assert str(recipe) in lines[0]  # names the recipe file (and the line of its storage field)
    assert "Traceback" not in p.stderr


def test_a_failed_copy_does_not_stop_the_run_and_is_retried(s3, tiny_llama, tmp_path, monkeypatch):
    from qeval.recipe import load_recipe
    from qeval.run import Runner, new_run_dir
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "c"))
    r = load_recipe(write_recipe(tmp_path / "tiny.yaml", tiny_llama, tiers=TIERS, suites=False,
                                 extra=_storage_yaml(s3, "flaky")))
    run_dir = new_run_dir(r, tmp_path / "staging")
    events = []
    runner = Runner(r, run_dir, on_event=lambda t, s, m: events.append((s, m)))
    (run_dir / "stages").mkdir(parents=True, exist_ok=True)
    (run_dir / "stages" / "bf16.measure.json").write_text("{}")
    real = runner.remote.upload_file

    def broken(local, rel):
        raise ConnectionError("network is down")
    runner.remote.upload_file = broken
    assert runner.push(lambda rel: True) == 0
    assert runner.push_error and "network is down" in runner.push_error
    assert events and events[-1][0] == "storage" and "network is down" in events[-1][1]
    runner.remote.upload_file = real
    runner.publish_outputs()  # the final copy takes what the failed one missed
    assert "stages/bf16.measure.json" in _store(s3, "flaky").list(f"results/tiny/{run_dir.name}")


def test_a_corrupt_local_artifact_is_rebuilt(tmp_path, monkeypatch):
    """Without a store: a file whose hash no longer matches the manifest is rebuilt, and
    an intact artifact is reused without calling the build."""
    from qeval.artifacts import get_or_build
    monkeypatch.setenv("QEVAL_CACHE", str(tmp_path / "c"))
    builds = []

    def build(out: Path) -> dict:
        builds.append(out)
        (out / "w.bin").write_bytes(b"weights")
        return {}

    a, _, reused = get_or_build("m", {"k": 2}, build, log=lambda m: None)
    assert not reused and len(builds) == 1
    assert get_or_build("m", {"k": 2}, build, log=lambda m: None)[2] is True and len(builds) == 1
    (a / "w.bin").write_bytes(b"bit rot")
    logs = []
    _, _, reused = get_or_build("m", {"k": 2}, build, log=logs.append)
    assert not reused and len(builds) == 2 and any("hash mismatch in w.bin" in m for m in logs), logs
    assert (a / "w.bin").read_bytes() == b"weights"

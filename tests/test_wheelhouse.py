"""The offline install's pieces that run without a network: which build requirements the
wheelhouse collects for an sdist (tools/wheelhouse.py), and what `make setup OFFLINE=1` /
`TORCH=system` would run (``make -n``: nothing is executed). The install itself from a
wheelhouse, in a network namespace, is a manual check (docs/gpu.md "Offline / air-gapped install")."""
from __future__ import annotations

import importlib.util
import io
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("wheelhouse_under_test", REPO / "tools" / "wheelhouse.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sdist(path: Path, pyproject: str | None) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        files = {"pkg-1.0/setup.py": "", **({"pkg-1.0/pyproject.toml": pyproject} if pyproject is not None else {}),
                 "pkg-1.0/sub/pyproject.toml": "[build-system]\nrequires = ['not-this']\n"}
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_build_requirements_of_an_sdist(tmp_path):
    wh = _tool()
    skb = _sdist(tmp_path / "a-1.0.tar.gz", '[build-system]\nrequires = ["scikit-build-core[pyproject]>=0.9.2"]\n'
                                            'build-backend = "scikit_build_core.build"\n')
    assert wh.build_requires(skb) == ["scikit-build-core[pyproject]>=0.9.2", "cmake>=3.21", "ninja>=1.5"]
    st = _sdist(tmp_path / "b-1.0.tar.gz", '[build-system]\nrequires = ["setuptools>=77.0.1,<83"]\n'
                                           'build-backend = "setuptools.build_meta"\n')
    assert wh.build_requires(st) == ["setuptools>=77.0.1,<83", "wheel"]
    legacy = _sdist(tmp_path / "c-1.0.tar.gz", None)  # no pyproject.toml: PEP 518's default
    assert wh.build_requires(legacy) == ["setuptools>=40.8.0", "wheel"]
    assert wh.SYSTEM_TORCH.match("nvidia-cublas-cu12") and wh.SYSTEM_TORCH.match("torch")
    assert not wh.SYSTEM_TORCH.match("torchao") and not wh.SYSTEM_TORCH.match("nvidia-ml-py")  # NVML stays


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_setup_offline_and_system_torch(tmp_path):
    def dry(*args):
        return subprocess.run(["make", "-n", "setup", f"VENV={tmp_path / 'venv'}", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
    p = dry("OFFLINE=1", f"WHEELHOUSE={tmp_path / 'none'}")  # no wheels there: one line, exit 2
    assert p.returncode == 2 and "OFFLINE=1: no wheels in WHEELHOUSE" in p.stderr and "make wheelhouse" in p.stderr
    (tmp_path / "wh").mkdir()
    (tmp_path / "wh" / "x-1.0-py3-none-any.whl").write_bytes(b"")
    p = dry("OFFLINE=1", f"WHEELHOUSE={tmp_path / 'wh'}", "TORCH=system", "CUDA=1")
    assert p.returncode == 0, p.stderr
    assert f"-m venv --system-site-packages {tmp_path / 'venv'}" in p.stdout
    assert "sys.exit(2 if True and not torch.cuda.is_available() else 0)" in p.stdout  # its CUDA checked
    assert "install torch==" not in p.stdout  # the machine's torch is never replaced
    p = dry()
    assert "--system-site-packages" not in p.stdout and "install torch==" in p.stdout

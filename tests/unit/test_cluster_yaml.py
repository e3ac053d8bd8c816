"""cluster/cluster.yaml, the AWS `ray up` file: it passes Ray's own cluster-launcher schema,
its node types hold the pools configs/multi_node.yaml pins, and every node it starts can run
epd: an image found in any region whose python3 is new enough, a GPU check that looks for a
device, GPUs with bfloat16 (the config's `dtype: auto` loads bfloat16 weights) and a disk
that holds the venv and the model."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster.config import REPO_ROOT, load_config
from cluster.placement import NodeShape, unplaceable

CLUSTER_YAML = REPO_ROOT / "cluster" / "cluster.yaml"

# Ubuntu release -> its python3 (epd, and scripts/setup, need >= 3.11).
UBUNTU_PYTHON = {"20.04": (3, 8), "22.04": (3, 10), "24.04": (3, 12)}
# AWS's public SSM parameters that name the current image of a release: Canonical's plain
# Ubuntu server, and the Deep Learning Base GPU AMIs (NVIDIA driver installed).
CPU_IMAGE = re.compile(
    r"resolve:ssm:/aws/service/canonical/ubuntu/server/(?P<release>\d\d\.\d\d)/stable/current/"
    r"amd64/hvm/ebs-gp[23]/ami-id"
)
GPU_IMAGE = re.compile(
    r"resolve:ssm:/aws/service/deeplearning/ami/x86_64/"
    r"base-oss-nvidia-driver-gpu-ubuntu-(?P<release>\d\d\.\d\d)/latest/ami-id"
)
# EC2 GPU instance family -> (GPU, CUDA compute capability). bfloat16 needs >= 8.0 (Ampere).
GPU_FAMILIES = {
    "p3": ("V100", 7.0),
    "p3dn": ("V100", 7.0),
    "g4dn": ("T4", 7.5),
    "g5g": ("T4G", 7.5),
    "g5": ("A10G", 8.6),
    "g6": ("L4", 8.9),
    "gr6": ("L4", 8.9),
    "g6e": ("L40S", 8.9),
    "p4d": ("A100", 8.0),
    "p4de": ("A100", 8.0),
    "p5": ("H100", 9.0),
    "p5e": ("H200", 9.0),
    "p5en": ("H200", 9.0),
}
# Root volume floor (GiB): a venv with torch and its CUDA libraries (~8 GB), the model in the
# Hugging Face cache (Qwen2.5-VL-3B: ~7.5 GB), and on GPU nodes the Deep Learning AMI itself.
MIN_ROOT_GIB = 100
ROOT_DEVICE = "/dev/sda1"  # the root device of both Ubuntu images; another name adds a volume


def _raw() -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load(CLUSTER_YAML.read_text())
    validate_config(prepare_config(raw))  # raises on a schema error
    return raw


def _node_types() -> dict:
    return _raw()["available_node_types"]


def _gpu_types() -> dict:
    return {n: t for n, t in _node_types().items() if t["resources"].get("GPU", 0) > 0}


def test_node_types_hold_the_pinned_pools():
    raw = _raw()
    types = raw["available_node_types"]
    assert "GPU" not in types[raw["head_node_type"]]["resources"]
    # the nodes ray up starts (min_workers), enough for every actor of every pool
    workers = [
        NodeShape(name, t["resources"], t["min_workers"])
        for name, t in types.items()
        if t.get("min_workers", 0) > 0
    ]
    assert unplaceable(load_config(REPO_ROOT / "configs" / "multi_node.yaml"), workers) == []


def test_sets_nodes_up_from_the_readme_setup():
    raw = _raw()
    assert raw["provider"]["type"] == "aws"
    assert (
        raw["file_mounts"] == {"~/epd": "."} and ".venv" in raw["rsync_exclude"]
    )  # each node builds its own venv
    setup = "\n".join(raw["setup_commands"])
    # the serving install (no test tools), at the tested versions
    assert "./scripts/setup --serve" in setup
    assert "epd build-model --config configs/multi_node.yaml" in setup
    assert "torch.cuda.is_available()" in setup  # a GPU node without CUDA torch fails its setup
    # venv needs ensurepip, a package of its own on Ubuntu
    assert "import ensurepip" in setup and "install -y -q python3-venv" in setup
    # the autoscaler's monitor (head venv) imports boto3 for the AWS provider: the aws extra
    head = "\n".join(raw["head_setup_commands"])
    assert ".[aws]" in head and "-c constraints.txt" in head
    extras = __import__("tomllib").loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(dep.startswith("boto3") for dep in extras["aws"])
    assert any(p["FromPort"] == 8000 for p in raw["provider"]["security_group"]["IpPermissions"])


def test_every_image_is_an_ssm_parameter_of_an_ubuntu_whose_python_is_3_11_or_newer():
    """No AMI id hard-coded for one region: EC2 resolves `resolve:ssm:` at launch in any
    region. Ubuntu 22.04's python3 (3.10) is too old for epd; 24.04's is 3.12."""
    for name, node_type in _node_types().items():
        image = node_type["node_config"]["ImageId"]
        found = CPU_IMAGE.fullmatch(image) or GPU_IMAGE.fullmatch(image)
        assert found, f"{name}: {image!r} is not a public SSM parameter of an Ubuntu image"
        release = found["release"]
        assert release in UBUNTU_PYTHON, f"{name}: add Ubuntu {release}'s python3 to the table"
        assert UBUNTU_PYTHON[release] >= (3, 11), (
            f"{name}: Ubuntu {release}'s python3 is {UBUNTU_PYTHON[release]}, epd needs 3.11"
        )


def test_gpu_node_types_run_the_gpu_image_and_the_head_does_not():
    raw = _raw()
    for name, node_type in raw["available_node_types"].items():
        image = node_type["node_config"]["ImageId"]
        if node_type["resources"].get("GPU", 0) > 0:
            assert GPU_IMAGE.fullmatch(image), f"{name}: a GPU node needs the NVIDIA driver"
    head = raw["available_node_types"][raw["head_node_type"]]
    family = head["node_config"]["InstanceType"].split(".")[0]
    assert head["resources"].get("GPU", 0) == 0 and family not in GPU_FAMILIES
    assert CPU_IMAGE.fullmatch(head["node_config"]["ImageId"])  # no GPU image on a CPU host


def test_every_gpu_instance_type_has_bfloat16():
    """T4 (g4dn) and V100 (p3) have no bfloat16: `dtype: auto` would fall back to float16
    there, and a bfloat16 config would not load. Every GPU node type is Ampere or newer."""
    gpu_types = _gpu_types()
    assert gpu_types
    for name, node_type in gpu_types.items():
        family = node_type["node_config"]["InstanceType"].split(".")[0]
        assert family in GPU_FAMILIES, f"{name}: add {family}'s GPU to GPU_FAMILIES"
        gpu, capability = GPU_FAMILIES[family]
        assert capability >= 8.0, f"{name}: {family} ({gpu}, sm {capability}) has no bfloat16"


def _gpu_guard() -> str:
    """The condition of the setup command that asserts CUDA in torch on GPU nodes."""
    (command,) = [c for c in _raw()["setup_commands"] if "torch.cuda.is_available()" in c]
    found = re.fullmatch(r"if (.+?); then .+; fi", command)
    assert found, command
    return found.group(1)


@pytest.mark.parametrize(
    "nvidia_smi, is_gpu",
    [
        (None, False),  # the head's plain Ubuntu: no driver at all
        ('echo "No devices were found"; exit 6', False),  # driver tools, no device
        ('[ "$1" = -L ] && echo "GPU 0: NVIDIA A10G (UUID: GPU-0a1b)"', True),
    ],
    ids=["no-driver", "driver-without-device", "device-listed"],
)
def test_gpu_check_looks_for_a_device_not_for_the_binary(tmp_path: Path, nvidia_smi, is_gpu):
    """A CPU head on an image that ships nvidia-smi has no GPU: the check must not take the
    binary for a device (it asked `command -v nvidia-smi`, and CPU heads failed set-up)."""
    if not is_gpu and Path("/dev/nvidia0").exists():
        pytest.skip("this host has a GPU device")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if nvidia_smi is not None:
        stand_in = bin_dir / "nvidia-smi"
        stand_in.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        stand_in.chmod(0o755)
    done = subprocess.run(
        ["/bin/bash", "-c", _gpu_guard()],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
        capture_output=True,
        timeout=30,
    )
    assert (done.returncode == 0) == is_gpu, done


def test_every_root_volume_holds_the_venv_and_the_model():
    for name, node_type in _node_types().items():
        mappings = node_type["node_config"].get("BlockDeviceMappings", [])
        root = [m for m in mappings if m["DeviceName"] == ROOT_DEVICE]
        assert root, f"{name}: no {ROOT_DEVICE} mapping, the image's default size is too small"
        assert root[0]["Ebs"]["VolumeSize"] >= MIN_ROOT_GIB, name


def test_the_file_says_how_the_head_may_resolve_the_workers_images():
    """Workers are launched by the head's autoscaler with the head's IAM role (Ray's default
    holds EC2 and S3 only), and EC2 reads a `resolve:ssm:` parameter with the caller's
    permissions: the file names the grant."""
    text = CLUSTER_YAML.read_text()
    assert "ray-autoscaler-v1" in text and "ssm:GetParameters" in text
    assert "parameter/aws/service/" in text

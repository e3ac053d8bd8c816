"""Unit tests for cluster.config: loading and validating the cluster YAML."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from cluster.config import (
    DEFAULT_CONFIG,
    ClusterConfig,
    ConfigError,
    LimitsConfig,
    Transport,
    load_config,
    repo_configs,
)
from router.types import Modality

CONFIGS = repo_configs()
MINIMAL = {"model": {"checkpoint": "/tmp/ckpt", "served_name": "m"}}


def write(tmp_path: Path, data, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_there_are_configs_to_check():
    assert DEFAULT_CONFIG in CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_repo_configs_load(path):
    config = load_config(path)
    assert isinstance(config, ClusterConfig)
    assert config.model.served_name
    # every key written in the file is a real field (extra keys would have raised) and
    # survives the round trip
    raw = yaml.safe_load(path.read_text())
    dumped = config.model_dump(mode="json")
    for section, fields in raw.items():
        pools = (
            zip(fields, dumped[section])
            if isinstance(fields, list)
            else [(fields or {}, dumped[section])]
        )
        for written, loaded in pools:
            for key, value in written.items():
                assert loaded[key] == value, (section, key)


def test_default_config_is_cpu_and_object_store():
    config = load_config()
    assert config.model.device == "cpu"
    assert config.transport.kv == Transport.OBJECT_STORE
    assert config.router.policy == "joint"


def test_minimal_config_takes_defaults(tmp_path):
    config = load_config(write(tmp_path, MINIMAL))
    assert config.model.dtype == "float32"
    assert config.decode.max_batch_size == 32
    assert config.transport.embeddings == Transport.OBJECT_STORE


def test_checkpoint_path_expands_user_and_vars(tmp_path, monkeypatch):
    monkeypatch.setenv("EPD_TEST_DIR", "/data/x")
    config = load_config(
        write(tmp_path, {"model": {"checkpoint": "$EPD_TEST_DIR/m", "served_name": "m"}})
    )
    assert config.model.checkpoint_path == Path("/data/x/m")
    config = load_config(write(tmp_path, {"model": {"checkpoint": "~/m", "served_name": "m"}}))
    assert config.model.checkpoint_path == Path.home() / "m"


@pytest.mark.parametrize(
    "data, key",
    [
        ({**MINIMAL, "decoder": {"num_workers": 1}}, "decoder"),  # unknown section
        ({**MINIMAL, "decode": {"max_batch_sise": 4}}, "max_batch_sise"),  # typo in a field
        ({"model": {**MINIMAL["model"], "devcie": "cpu"}}, "devcie"),
    ],
)
def test_unknown_keys_are_rejected_by_name(tmp_path, data, key):
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert key in str(info.value)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("transport", ["nccl", "cuda_ipc"])
def test_gpu_transports_with_cpu_device_are_rejected(tmp_path, transport):
    for section in ("kv", "embeddings"):
        data = {**MINIMAL, "transport": {section: transport}}
        with pytest.raises(ConfigError, match=transport):
            load_config(write(tmp_path, data))


def test_cuda_ipc_is_one_sided_and_allows_several_replicas(tmp_path):
    """CUDA IPC needs no collective group, so nothing pairs transfers by order across replicas."""
    model = {**MINIMAL["model"], "device": "cuda"}
    gpu = {"num_gpus": 0.25}
    data = {
        "model": model,
        "encoder": gpu,
        "prefill": gpu,
        "decode": gpu,
        "transport": {"embeddings": "cuda_ipc", "kv": "cuda_ipc"},
    }
    config = load_config(write(tmp_path, {**data, "server": {"num_replicas": 2}}))
    assert not config.transport.kv.collective and Transport.NCCL.collective
    whole = {"num_gpus": 1}
    nccl = {
        **data,
        "encoder": whole,
        "prefill": whole,
        "decode": whole,
        "transport": {"kv": "nccl"},
        "server": {"num_replicas": 2},
    }
    with pytest.raises(ConfigError, match="num_replicas"):
        load_config(write(tmp_path, nccl))


def test_cuda_needs_gpus_in_every_pool(tmp_path):
    data = {
        "model": {**MINIMAL["model"], "device": "cuda"},
        "encoder": {"num_gpus": 1},
        "prefill": {"num_gpus": 1},
    }
    with pytest.raises(ConfigError, match="num_gpus"):
        load_config(write(tmp_path, data))
    data["decode"] = {"num_gpus": 1}
    data["transport"] = {"kv": "nccl"}
    assert load_config(write(tmp_path, data)).transport.kv == Transport.NCCL


def test_nccl_between_workers_sharing_a_gpu_is_refused_by_pool(tmp_path):
    """On one GPU the NCCL group forms and the first transfer hangs (measured on an H200)."""
    whole = {"num_gpus": 1}
    data = {
        "model": {**MINIMAL["model"], "device": "cuda"},
        "encoder": whole,
        "prefill": {"num_gpus": 0.5},
        "decode": whole,
    }
    data["transport"] = {"embeddings": "nccl"}
    with pytest.raises(
        ConfigError, match="nccl needs a whole GPU per worker, but prefill num_gpus"
    ):
        load_config(write(tmp_path, data))
    data["transport"] = {"embeddings": "object_store", "kv": "cuda_ipc"}
    assert load_config(write(tmp_path, data)).transport.kv == Transport.CUDA_IPC


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"model": {**MINIMAL["model"], "dtype": "int8"}}, "int8"),
        ({**MINIMAL, "prefill": {"max_chunk_tokens": 4}}, "max_chunk_tokens"),
        ({**MINIMAL, "server": {"port": 70000}}, "port"),
        ({**MINIMAL, "transport": {"kv": "carrier_pigeon"}}, "kv"),
        ({"encoder": {"num_workers": 1}}, "model"),  # the model section is required
        ({**MINIMAL, "router": {"calibration": {"pool_memory": 0}}}, "pool_memory"),
        ({**MINIMAL, "router": {"calibration": {"memory": 5}}}, "memory"),
        ({**MINIMAL, "router": {"priors": {"prefill_tokens_per_ms": -1}}}, "prefill_tokens_per_ms"),
        (
            {**MINIMAL, "prefill": {"torch_threads": 4, "idle_torch_threads": 2}},
            "idle_torch_threads",
        ),
        ({**MINIMAL, "encoder": {"idle_torch_threads": 0}}, "idle_torch_threads"),
        ({**MINIMAL, "decode": {"stream_interval": 0}}, "stream_interval"),
        ({**MINIMAL, "prefill": {"overlap_min_tokens": -1}}, "overlap_min_tokens"),
        ({**MINIMAL, "prefill": {"aging_tokens_per_s": -5}}, "aging_tokens_per_s"),
        ({**MINIMAL, "prefill": {"aging_tokens_per_s": float("inf")}}, "aging_tokens_per_s"),
    ],
)
def test_invalid_values_are_rejected(tmp_path, data, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(write(tmp_path, data))


@pytest.mark.parametrize(
    "dtype, device, num_gpus, resolved",
    [
        ("auto", "cpu", 0, "float32"),
        ("auto", "cuda", 1, "bfloat16"),
        ("bfloat16", "cpu", 0, "bfloat16"),
        ("float16", "cuda", 1, "float16"),
    ],
)
def test_dtype_auto_is_bfloat16_on_gpu_and_float32_on_cpu(
    tmp_path, dtype, device, num_gpus, resolved
):
    pools = {kind: {"num_gpus": num_gpus} for kind in ("encoder", "prefill", "decode")}
    config = load_config(
        write(tmp_path, {"model": {**MINIMAL["model"], "dtype": dtype, "device": device}, **pools})
    )
    assert config.model.resolved_dtype == resolved


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope" / "missing.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_bad_yaml_names_the_path(tmp_path):
    path = write(tmp_path, "model: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_empty_file_is_an_error_not_a_crash(tmp_path):
    with pytest.raises(ConfigError, match="model"):
        load_config(write(tmp_path, ""))


def test_config_is_frozen():
    config = load_config()
    with pytest.raises(ValidationError):
        config.model.device = "cuda"  # type: ignore[misc]


def test_replace_swaps_fields_and_keeps_the_rest():
    config = load_config()
    before = config.decode.max_batch_size
    new = config.replace(decode={"max_batch_size": before + 1}, server={"port": 9000})
    assert new.decode.max_batch_size == before + 1
    assert new.decode.num_workers == config.decode.num_workers
    assert new.server.port == 9000 and new.server.host == config.server.host
    assert new.model == config.model
    assert config.decode.max_batch_size == before, "replace must not modify the original"


def test_replace_revalidates():
    config = load_config()
    with pytest.raises(ValueError, match="nccl"):
        config.replace(transport={"kv": "nccl"})
    with pytest.raises(ValueError, match="max_batch_size"):
        config.replace(decode={"max_batch_size": 0})
    with pytest.raises(ValueError, match="bogus"):
        config.replace(decode={"bogus": 1})
    with pytest.raises(ValueError, match="dtype"):
        config.replace(model={"dtype": "float64"})


def test_slowdown_factors_are_validated_and_default_to_one():
    from cluster.config import load_config as _load

    base = _load()
    slowed = base.replace(prefill={"num_workers": 2, "slowdown": [1.0, 3.0]})
    assert [slowed.prefill.slowdown_of(i) for i in range(2)] == [1.0, 3.0]
    assert base.prefill.slowdown_of(0) == 1.0
    for bad in ([0.5], [1.0, 2.0, 2.0]):
        with pytest.raises(ValueError, match="slowdown"):
            base.replace(prefill={"num_workers": 2, "slowdown": bad})


ALL = frozenset(Modality)


def test_one_encoder_pool_encodes_every_modality_of_the_model():
    config = ClusterConfig.model_validate({**MINIMAL, "encoder": {"num_workers": 2}})
    assert config.encoder_modalities(ALL) == [ALL, ALL]


def test_encoder_pools_split_by_modality():
    pools = [
        {"num_workers": 2, "modalities": ["image", "video"]},
        {"num_workers": 1, "modalities": ["audio"]},
    ]
    config = ClusterConfig.model_validate({**MINIMAL, "encoder": pools})
    vision = frozenset({Modality.IMAGE, Modality.VIDEO})
    assert config.encoder_modalities(ALL) == [vision, vision, frozenset({Modality.AUDIO})]


def test_a_modality_without_an_encoder_is_named():
    config = ClusterConfig.model_validate({**MINIMAL, "encoder": [{"modalities": ["image"]}]})
    with pytest.raises(ConfigError, match=r"no encoder pool encodes \['audio', 'video'\]"):
        config.encoder_modalities(ALL)


def test_a_pool_for_a_modality_the_model_does_not_take_is_named():
    config = ClusterConfig.model_validate(
        {**MINIMAL, "encoder": {"modalities": ["image", "audio"]}}
    )
    with pytest.raises(ConfigError, match=r"\['audio'\], which model 'm' does not take"):
        config.encoder_modalities(frozenset({Modality.IMAGE}))


def test_unknown_modality_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="smell"):
        load_config(write(tmp_path, {**MINIMAL, "encoder": {"modalities": ["smell"]}}))


def test_media_limits_and_sampling_defaults(tmp_path):
    config = load_config(write(tmp_path, MINIMAL))
    assert (
        config.limits.max_audio_s,
        config.limits.max_video_s,
        config.limits.max_video_frames,
    ) == (600, 600, 256)
    assert (config.media.video_fps, config.media.video_max_frames) == (2.0, 32)
    for section in (config.limits, config.media):
        assert all(field.description for field in type(section).model_fields.values())


@pytest.mark.parametrize(
    "sections, needle",
    [
        ({"media": {"video_max_frames": 300}}, "must not exceed limits.max_video_frames"),
        (
            {"media": {"video_max_frames": 20}, "limits": {"max_video_frames": 10}},
            "video_max_frames",
        ),
        ({"media": {"video_fps": 0}}, "video_fps"),
        ({"media": {"video_fsp": 2}}, "video_fsp"),  # typo: extra keys are forbidden
        ({"limits": {"max_audio_s": 0}}, "max_audio_s"),
        ({"limits": {"max_video_frames": 0}}, "max_video_frames"),
    ],
)
def test_media_config_is_validated(tmp_path, sections, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(write(tmp_path, {**MINIMAL, **sections}))
    assert (
        load_config(
            write(tmp_path, {**MINIMAL, "media": {"video_max_frames": 256}})
        ).media.video_max_frames
        == 256
    )


@pytest.mark.parametrize(
    "name, value",
    [("max_decode_s", 5.0), ("max_decode_memory_mb", 1024), ("max_decodes_per_process", 4)],
)
def test_process_only_limits_are_refused_with_in_process_decoding(name, value):
    assert (
        LimitsConfig(**{name: value}).decode_in_process is False
    )  # honoured by decoding processes
    assert LimitsConfig(decode_in_process=True).decode_in_process  # defaults simply do not apply
    with pytest.raises(ValueError, match=f"limits.{name} applies to decoding processes only"):
        LimitsConfig(decode_in_process=True, **{name: value})


def test_the_fleet_fingerprint_moves_with_the_workers_settings_only():
    base = load_config()
    ingress_only = [
        {"server": {"api_key": "k", "num_replicas": 2, "log_prompts": True}},
        {"limits": {"request_timeout_s": 5.0}},
        {"router": {"policy": "least_loaded"}},
        {"prefill": {"overlap_encode": False}},  # the ingress's choice of call order
        {"decode": {"stream_interval": 4}},  # the ingress gathers the chunks
    ]
    for change in ingress_only:
        other = base.replace(**change)
        assert other.fingerprint() != base.fingerprint(), change
        assert other.fleet_fingerprint() == base.fleet_fingerprint(), change
    live = [
        {"decode": {"kv_cache_mb": 64.0}},
        {"prefill": {"aging_tokens_per_s": 10.0, "max_chunk_tokens": 64}},
        {"prefill": {"slowdown": [3.0]}},
        {"encoder": {"max_wait_ms": 1.0}},
    ]
    for change in live:  # running workers take these: same fleet, other live settings
        other = base.replace(**change)
        assert other.fleet_fingerprint() == base.fleet_fingerprint(), change
        assert other.live_settings() != base.live_settings(), change
    workers = [
        {"decode": {"max_batch_size": 3}},
        {"prefill": {"prefix_cache_mb": 1.0}},
        {"encoder": {"cache_mb": 1.0}},
        {"transport": {"embeddings": "gloo", "kv": "gloo"}},
        {"model": {"served_name": "other"}},
    ]
    for change in workers:
        other = base.replace(**change)
        assert other.fleet_fingerprint() != base.fleet_fingerprint(), change
        assert other.live_settings() == base.live_settings(), change


@pytest.mark.parametrize(
    "capability, expected", [((7, 5), "float16"), ((8, 0), "bfloat16"), ((9, 0), "bfloat16")]
)
def test_auto_dtype_is_what_the_workers_gpu_supports(monkeypatch, capability, expected):
    """A T4 (sm_75) only emulates bfloat16: `auto` gives it float16; Ampere and newer get
    bfloat16; a set dtype is kept as it is."""
    import torch

    from actors.models.adapter import device_dtype

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert device_dtype("auto", "cuda") == expected
    assert device_dtype("auto", "cpu") == "float32"
    assert device_dtype("bfloat16", "cuda") == "bfloat16"


def test_unset_max_model_len_is_the_models_own(tmp_path):
    """`epd serve --model X` without --max-model-len serves X's whole context, as vLLM does,
    not a fixed 2,048; a set value is kept."""
    import json

    from cluster.prepare import ensure_model

    ckpt = ensure_model(load_config()).model.checkpoint_path
    own = json.loads((ckpt / "config.json").read_text())["text_config"]["max_position_embeddings"]
    config = load_config().replace(model={"max_model_len": None})
    assert ensure_model(config).model.max_model_len == own
    assert ensure_model(config.replace(model={"max_model_len": 77})).model.max_model_len == 77

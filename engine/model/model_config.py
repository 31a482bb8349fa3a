"""The model shape the runtime needs, read from a HuggingFace `config.json`.

transformers parses the file (AutoConfig); this module turns the parts of it
that change the forward pass into one flat, validated value, so the layers never
look at a transformers object and an unsupported checkpoint fails here, with a
message, rather than deep inside a forward pass.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
_WARNED_SEPARATE_HEAD: set[str] = set()     # checkpoints whose stored head was reported (once each)

# architecture name in config.json -> the flags that distinguish it from Llama
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# a config without `architectures` (as a bare `LlamaConfig().save_pretrained()` writes) names its
# model by model_type, from which transformers' AutoModelForCausalLM picks the class
ARCHITECTURE_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})   # a config's `layer_types`
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
CONTEXT_SCALING_ROPE_TYPES = ("linear", "dynamic")    # their factor stretches the context past the trained one


class ModelConfigError(ValueError):
    """A checkpoint's config.json describes a model the runtime cannot run."""


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str = "default"
    # llama3 / linear / dynamic parameters, as transformers names them
    rope_params: dict[str, float] = field(default_factory=dict)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # Qwen3's: an RMSNorm over each head's query and key (head_dim wide), before RoPE
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    # config.json's and (from_pretrained) generation_config.json's, in that order
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    # Mistral's attention window; the engine caps max_model_len at it, since
    # within the window sliding and full attention are the same computation.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(
                f"rope type {self.rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")

    @property
    def longest_context(self) -> int:
        """The longest max_model_len the engine accepts: max_position_embeddings,
        times the factor of a linear or dynamic-NTK RoPE scaling (how such a
        checkpoint reaches past it; vLLM takes the same), within a sliding window
        (the engine does not slide its attention)."""
        limit = self.max_position_embeddings
        if self.rope_type in CONTEXT_SCALING_ROPE_TYPES:
            limit = int(limit * self.rope_params.get("factor", 1.0))
        return min(limit, self.sliding_window) if self.sliding_window else limit

    @property
    def default_context(self) -> int:
        """max_model_len where none is set: the longest, but for dynamic NTK
        max_position_embeddings: its frequencies are fixed for the engine's
        max_model_len (vLLM's choice), which past max_position_embeddings differ
        from transformers' for every shorter sequence."""
        if self.rope_type == "dynamic":
            return min(self.max_position_embeddings, self.longest_context)
        return self.longest_context

    def resolve_context(self, max_model_len: int | None) -> int:
        """The engine's context for a configured max_model_len: it, or default_context
        where None; ValueError past longest_context, naming why."""
        limit = self.longest_context
        if max_model_len is None:
            if self.sliding_window and self.default_context == self.sliding_window:
                logger.info("max_model_len %d: the model's sliding window, which pdserve's attention does not "
                            "slide past (its max_position_embeddings is %d)", self.sliding_window,
                            self.max_position_embeddings)
            return self.default_context
        if self.rope_type == "dynamic" and self.max_position_embeddings < max_model_len <= limit:
            logger.warning(
                "dynamic-NTK RoPE with max_model_len %d past max_position_embeddings %d: its frequencies are "
                "fixed for %d tokens (as vLLM fixes them), so every output, short prompts' too, differs from "
                "transformers' (which scales them with each sequence's length); leave max_model_len unset, or "
                "at most %d, to match it", max_model_len, self.max_position_embeddings, max_model_len,
                self.max_position_embeddings)
        if max_model_len > limit:
            if self.sliding_window and limit == self.sliding_window:
                why = (f"its attention slides over a window of {self.sliding_window} tokens, which pdserve does "
                       f"not implement (its max_position_embeddings is {self.max_position_embeddings})")
            elif self.rope_type in CONTEXT_SCALING_ROPE_TYPES:
                why = (f"its max_position_embeddings {self.max_position_embeddings} times its {self.rope_type} "
                       f"RoPE scaling factor {self.rope_params.get('factor', 1.0):g}")
            else:
                why = f"its max_position_embeddings is {limit}"
            raise ValueError(f"max_model_len ({max_model_len}) is larger than the model supports "
                             f"({limit}: {why}); set max_model_len <= {limit}")
        return max_model_len

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        """Reads `model_dir/config.json` (offline) and validates it. The EOS ids
        also take in `generation_config.json`'s (what transformers' generate()
        stops on), when that file is there and readable."""
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise ModelConfigError(
                f"no config.json in {path}: point the model path at a HuggingFace checkpoint "
                "directory (config.json, tokenizer files, *.safetensors)")
        _check_sizes_are_given(path / "config.json")
        from transformers import AutoConfig
        try:
            hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers' checks raise anything (TypeError, ZeroDivision...)
            raise ModelConfigError(f"cannot read {path / 'config.json'}: {type(exc).__name__}: {exc}") from None
        config = cls.from_hf_config(hf_config)
        from engine.model.loader import stores_separate_head
        if config.tie_word_embeddings and stores_separate_head(path):
            if str(path) not in _WARNED_SEPARATE_HEAD:
                _WARNED_SEPARATE_HEAD.add(str(path))
                logger.warning("%s ties its word embeddings but its checkpoint stores lm_head.weight too: the "
                               "stored head is loaded as its own weight, as transformers does when the two "
                               "differ", path)
            config = replace(config, tie_word_embeddings=False)
        generation_eos = _generation_eos_token_ids(path)
        if generation_eos:
            config = replace(config, eos_token_ids=tuple(dict.fromkeys([*config.eos_token_ids, *generation_eos])))
        return config

    @classmethod
    def from_hf_config(cls, hf: Any) -> "ModelConfig":
        arch = _architecture(hf)
        quantization = getattr(hf, "quantization_config", None)
        if quantization:
            method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else \
                getattr(quantization, "quant_method", "?")
            raise ModelConfigError(f"quantized checkpoints (quant_method={method}) are not supported: pdserve "
                                   "loads float16, bfloat16 or float32 weights; use the unquantized checkpoint")
        unknown = sorted({str(t) for t in getattr(hf, "layer_types", None) or ()} - ATTENTION_LAYER_TYPES)
        if unknown:
            raise ModelConfigError(f"layer_types {', '.join(unknown)} are not supported: pdserve's layers attend "
                                   f"as {' or '.join(sorted(ATTENTION_LAYER_TYPES))}")
        activation = getattr(hf, "hidden_act", "silu")
        if activation not in ("silu", "swish"):
            raise ModelConfigError(f"hidden_act {activation!r} is not supported: the MLP is SiLU-gated "
                                   "(hidden_act 'silu'), as Llama, Mistral and Qwen checkpoints have it")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        rope = _rope_parameters(hf)
        eos_ids = _token_ids(getattr(hf, "eos_token_id", None))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        # Llama and Qwen3 read attention_bias (q, k, v and o), only Llama mlp_bias; Mistral's and Qwen2's
        # projections fix theirs
        attention_bias = arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and \
            bool(getattr(hf, "attention_bias", False))
        dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "float32"
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            max_position_embeddings=hf.max_position_embeddings,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(rope.pop("rope_theta")),
            rope_type=rope.pop("rope_type"),
            rope_params=rope,
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias,
            mlp_bias=arch == "LlamaForCausalLM" and bool(getattr(hf, "mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
            torch_dtype=str(dtype).removeprefix("torch."),
            sliding_window=_sliding_window(hf, arch),
        )


def _architecture(hf: Any) -> str:
    """The model class a transformers config runs as. transformers' AutoModelForCausalLM picks it by
    the config's model_type (its config class), whatever `architectures` lists: a model_type of ours
    decides; an unknown one is refused; `architectures` decides only for a config without model_type."""
    model_type = getattr(hf, "model_type", None)
    architectures = list(getattr(hf, "architectures", None) or [])
    if model_type in ARCHITECTURE_BY_MODEL_TYPE:
        if architectures and not any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
            # a classifier or reward model of a supported family: its head is no language-model head
            raise ModelConfigError(f"{', '.join(map(str, architectures))} is not a causal language model; "
                                   "pdserve generates text with *ForCausalLM checkpoints")
        return ARCHITECTURE_BY_MODEL_TYPE[model_type]
    arch = None if model_type else next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelConfigError(_unsupported_model_type(model_type, architectures))
    return arch


def _unsupported_model_type(model_type: Any, architectures: Any) -> str:
    return (f"unsupported model_type {model_type!r} (architectures {architectures}); pdserve runs model_type "
            + ", ".join(f"{t!r} ({a})" for t, a in ARCHITECTURE_BY_MODEL_TYPE.items()))


# sizes a checkpoint's config.json must give: transformers would fill a missing one with its
# class default (a 4096-wide model), and the weights would then not fit the shapes
_REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _check_sizes_are_given(config_json: Path) -> None:
    """Raises ModelConfigError unless config.json is a JSON object of a supported
    model_type (where it names one) that gives each of _REQUIRED_SIZES as a positive integer."""
    try:
        raw = json.loads(config_json.read_text())
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"cannot read {config_json}: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{config_json} must hold a JSON object")
    model_type = raw.get("model_type")
    if model_type is not None and model_type not in ARCHITECTURE_BY_MODEL_TYPE:
        # a multimodal config keeps its sizes under text_config: its type, not its sizes, is what is wrong
        raise ModelConfigError(_unsupported_model_type(model_type, raw.get("architectures")))
    bad = [k for k in _REQUIRED_SIZES
           if not (isinstance(raw.get(k), int) and not isinstance(raw.get(k), bool) and raw[k] > 0)]
    if bad:
        raise ModelConfigError(f"{config_json} needs a positive integer for each of: "
                               + ", ".join(f"{k} (got {raw.get(k)!r})" for k in bad))


def _token_ids(value: Any) -> tuple[int, ...]:
    """An `eos_token_id` setting (one id, a list of them, or None) as a tuple of ids."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool))


def _generation_config(model_dir: Path) -> dict[str, Any]:
    """`model_dir/generation_config.json`; {} when it is absent or unreadable."""
    try:
        generation = json.loads((Path(model_dir) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return generation if isinstance(generation, dict) else {}


def _generation_eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """`eos_token_id` of `model_dir/generation_config.json`; () where it sets none."""
    return _token_ids(_generation_config(model_dir).get("eos_token_id"))


# the sampling settings a checkpoint's generation_config.json may recommend (vLLM's
# --generation-config auto takes the same, and max_new_tokens as max_tokens)
GENERATION_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                              "frequency_penalty", "max_new_tokens")


def generation_sampling_defaults(model_dir: str | Path) -> dict[str, float]:
    """The sampling settings `model_dir/generation_config.json` recommends, for
    requests that leave them unset (numbers only; {} without the file); its
    max_new_tokens as "max_tokens", which a chat without one stops at (as vLLM's)."""
    from engine.sampling_params import SamplingParams, SamplingParamsError
    generation = _generation_config(Path(model_dir))
    defaults = {}
    for field_name in GENERATION_SAMPLING_FIELDS:
        value = generation.get(field_name)
        name = "max_tokens" if field_name == "max_new_tokens" else field_name
        if name in ("top_k", "max_tokens") and isinstance(value, float) and value.is_integer():
            value = int(value)
        try:
            SamplingParams(**{name: value})     # one the engine would refuse is left out
        except (SamplingParamsError, TypeError, ValueError):
            continue
        if value is not None:
            defaults[name] = value
    return defaults


def _sliding_window(hf: Any, arch: str) -> int | None:
    """The attention window of any layer that slides (None: full attention
    everywhere). Mistral's layers all slide when it is set; Qwen2's and Qwen3's
    only with use_sliding_window, from layer max_window_layers on (`layer_types`
    in newer configs), as transformers reads them."""
    window = getattr(hf, "sliding_window", None)
    if not window:
        return None
    if arch == "MistralForCausalLM":
        return window
    if arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return None
    layer_types = getattr(hf, "layer_types", None)
    if layer_types:
        return window if "sliding_attention" in layer_types else None
    if not getattr(hf, "use_sliding_window", False):
        return None
    return window if getattr(hf, "max_window_layers", 0) < hf.num_hidden_layers else None


def _rope_parameters(hf: Any) -> dict[str, Any]:
    """rope_theta, rope_type and the scaling parameters, from either the
    transformers-5 `rope_parameters` dict or the older `rope_scaling` + `rope_theta`."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    legacy = getattr(hf, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.pop("type", None) or "default"
    params.pop("type", None)
    nested = sorted(key for key, value in params.items() if isinstance(value, dict))
    if nested:
        raise ModelConfigError(f"per-layer-type RoPE parameters ({', '.join(nested)}) are not supported: pdserve "
                               "applies one RoPE to every layer; give rope_parameters one rope_type and rope_theta")
    partial = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0) and params["rope_type"] != "default":
        # Llama, Mistral and Qwen's default RoPE ignore the factor as transformers does; a scaled one
        # would rotate part of each head there and all of it here
        raise ModelConfigError(f"partial_rotary_factor {partial} with {params['rope_type']} RoPE is not "
                               "supported: pdserve rotates the whole head_dim")
    return params

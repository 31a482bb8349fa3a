"""Small, deterministic HuggingFace-format checkpoints.

These checkpoints serve as the built-in default model (so the engine runs with no
download) and as test fixtures for the model loader, the KV cache and the samplers.
Each preset pairs a real byte-level BPE tokenizer, trained on a corpus embedded in
this module, with a randomly initialised transformers model whose weights are
large enough that greedy decoding has clear winners.

The tokenizer is byte-level BPE with special tokens ``<|begin_of_text|>`` (bos, id 0),
``<|end_of_text|>`` (eos, id 1) and ``<|pad|>`` (id 2); it prepends BOS when
``add_special_tokens=True``. Qwen2 and Qwen3 presets use Qwen2's split regex and
NFC normalizer, because ``AutoTokenizer`` always loads qwen2 and qwen3 checkpoints
that way (with ``Qwen2Tokenizer``).

Contracts:
- the same preset, seed and dtype always write byte-identical files;
- ``config.vocab_size == len(tokenizer)``, so every id the model can emit decodes;
- bos/eos/pad ids in ``config.json``, ``generation_config.json`` and the tokenizer agree;
- the output directory loads offline with ``AutoConfig``, ``AutoTokenizer`` and
  ``AutoModelForCausalLM``.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
# Order fixes the ids: bos=0, eos=1, pad=2.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)

# One turn per message: a "<|role|>" header line (plain text, not special tokens),
# the content, then eos, so a finished assistant turn also stops generation.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Stored next to the weights; ensure_default_model() rebuilds a cached model whose
# recipe differs, so a change to this module never leaves a stale default behind.
RECIPE_FILE = "pdserve_recipe.json"
RECIPE_VERSION = 1

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class TinyPreset:
    """Shape of one tiny checkpoint; ``config`` holds extra architecture-specific fields."""

    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    rope_parameters: Mapping[str, Any] = field(
        default_factory=lambda: MappingProxyType({"rope_type": "default", "rope_theta": 10000.0})
    )
    config: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


PRESETS: Mapping[str, TinyPreset] = MappingProxyType(
    {
        # The built-in default model: GQA, untied embeddings.
        "tiny": TinyPreset(
            architecture="llama",
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
        ),
        # Multi-query attention with tied embeddings.
        "tiny-mqa": TinyPreset(
            architecture="llama",
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=128,
            tie_word_embeddings=True,
            head_dim=16,
        ),
        # QKV projections carry (non-zero) biases.
        "tiny-qwen2": TinyPreset(
            architecture="qwen2",
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            tie_word_embeddings=True,
            config=MappingProxyType({"use_sliding_window": False, "sliding_window": None}),
        ),
        # Per-head RMSNorm of queries and keys; head_dim (32) != hidden_size / heads (16); tied.
        "tiny-qwen3": TinyPreset(
            architecture="qwen3",
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            tie_word_embeddings=True,
            head_dim=32,
            config=MappingProxyType({"use_sliding_window": False}),
        ),
        # head_dim (32) != hidden_size / num_attention_heads (8).
        "tiny-mistral": TinyPreset(
            architecture="mistral",
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=128,
            head_dim=32,
            config=MappingProxyType({"sliding_window": None}),
        ),
        # Llama 3.1 frequency-dependent RoPE scaling.
        "tiny-llama3-rope": TinyPreset(
            architecture="llama",
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=2048,
            rope_parameters=MappingProxyType(
                {
                    "rope_type": "llama3",
                    "rope_theta": 10000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 256,
                }
            ),
        ),
        # Large enough (~30M parameters) for throughput measurements.
        "bench": TinyPreset(
            architecture="llama",
            vocab_size=8192,
            hidden_size=512,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=1408,
            max_position_embeddings=2048,
        ),
    }
)

# Typical logit standard deviation at the output head (unit-variance embeddings or
# head rows, RMS-normalised final hidden state). Large enough that greedy decoding
# has clear winners; small enough that sampling still sees alternatives.
_LOGIT_SCALE = 4.0
# Weights default to std = 1 / sqrt(fan_in), keeping activations O(1). Sharper
# attention (q_proj) and a stronger, token-specific MLP (down_proj) keep the hidden
# state moving from step to step; without them greedy decoding of a random model
# soon settles into repeating one token.
_GAINS: Mapping[str, float] = MappingProxyType({"q_proj": 2.0, "down_proj": 2.0})


# --------------------------------------------------------------------------- corpus

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife. Every
morning he rowed out past the harbour wall, and every evening he came back with whatever the water
had given him: sometimes a basket of silver fish, sometimes nothing at all but salt and stories.
"Why do you keep going out?" his neighbour asked one day. "Because the sea does not owe me anything,"
he replied, "and I like to be surprised."

Large language models generate text one token at a time. Each step reads the previous tokens,
computes attention over the cached keys and values, and produces a probability distribution over
the vocabulary. Greedy decoding picks the most likely token; sampling draws from the distribution,
often after applying a temperature, top-k or top-p filter. Serving systems batch many requests
together so that the accelerator stays busy, and they split the work into a prefill phase, which
processes the whole prompt at once, and a decode phase, which extends each sequence by one token.

Weather report for Tuesday: cloudy in the morning, with a 40% chance of rain after 3 p.m.
Temperatures between 12 and 18 degrees Celsius (54-64 F). Winds from the north-west at 15 km/h.
On Wednesday, expect sunshine and a high of 21. The weekend looks warmer; bring sunscreen!

Recipe: pancakes for four people. Mix 250 g of flour, 2 eggs, 500 ml of milk and a pinch of salt.
Let the batter rest for 30 minutes. Heat a pan, add a little butter, and pour in about 60 ml per
pancake. Cook for 1-2 minutes on each side until golden. Serve with lemon and sugar, or maple syrup.

Questions and answers. What is the capital of France? Paris. How many days are in a leap year? 366.
Who wrote "Pride and Prejudice"? Jane Austen. What is 7 times 8? 56. Is the Earth flat? No, it is
an oblate spheroid. Which planet is closest to the Sun? Mercury. What colour is the sky? Usually blue.

Numbers and dates: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 30 42 50 64 99 100 128
256 512 1000 1024 2048 4096 65536 3.14159 2.71828 1e-6 -17 +5 1,000,000 2024-01-15 12:30:45 v1.2.3
Call 555-0142 or write to info@example.com; see https://example.com/docs/index.html#intro for more.

Punctuation test: commas, semicolons; colons: dashes - and -- em dashes; (parentheses) [brackets]
{braces} <angles> "double quotes" 'single quotes' `backticks` ... ellipses! questions? 50% & more #tag
@user ~tilde ^caret | pipe \\ backslash / slash * star _ underscore = equals + plus $ dollar.

International words: café, naïve, résumé, façade, jalapeño, Zürich, Ångström, São Paulo, Kraków.
Greetings: hello, hola, bonjour, hallo, ciao, olá, привет, γειά σου, שלום, مرحبا, नमस्ते, 你好, こんにちは.
日本語のテキストも少し含めます。東京は日本の首都です。中文也可以：我们喜欢学习。한국어도 조금 있습니다.
Emoji: 😀 😂 👍 🎉 🚀 ❤️ 🌍 🐍 ☕ ✨ — and symbols: € £ ¥ © ® ™ ° ± × ÷ ≤ ≥ ≠ ∞ √ π Σ Ω µ → ← ↑ ↓.

def fibonacci(n: int) -> int:
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()


if __name__ == "__main__":
    print([fibonacci(i) for i in range(10)])
    stack = Stack()
    stack.push(42)
    print(f"top = {stack.pop()}")

#include <stdio.h>
int main(void) {
    for (int i = 0; i < 10; ++i) {
        printf("%d\\n", i * i);
    }
    return 0;
}

{"id": 17, "name": "example", "tags": ["alpha", "beta"], "enabled": true, "ratio": 0.75, "parent": null}
SELECT name, COUNT(*) AS total FROM users WHERE age >= 18 GROUP BY name ORDER BY total DESC LIMIT 5;
$ git commit -m "fix: handle empty input" && git push origin main

<|system|>
You are a helpful assistant.<|end_of_text|>
<|user|>
Can you summarise the story of the fisherman in one sentence?<|end_of_text|>
<|assistant|>
An old fisherman keeps rowing out every day because he enjoys being surprised by the sea.<|end_of_text|>
<|user|>
Thanks! Now write a haiku about autumn.<|end_of_text|>
<|assistant|>
Red leaves drift and fall,
cold wind hums along the lane,
the year exhales slow.<|end_of_text|>

In the beginning, the library was quiet. Students turned pages, a clock ticked above the door, and
somewhere a radiator hissed. The librarian, who had worked there for thirty-one years, knew every
shelf by heart. She could tell you where to find a book about volcanoes, a novel set in Lisbon, or
a dictionary of old nautical terms. When the new computers arrived, she learned them too, because
she believed that curiosity was the only real qualification anyone ever needed.

Science notes: water boils at 100 degrees Celsius at sea level. Light travels at about 299,792 km per
second. The mitochondria is the powerhouse of the cell. DNA has four bases: adenine, cytosine,
guanine and thymine. Energy equals mass times the speed of light squared, E = mc^2.
"""

# Syllables for the pseudo-words that give larger vocabularies enough distinct
# material to learn from; the prose above alone runs out of merges near ~1500.
_ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "ch", "cl", "dr", "gr", "pl", "sh", "st", "th", "tr", "qu")
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "y")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "x")


def _corpus(vocab_size: int) -> str:
    """Deterministic training text; grows with the requested vocabulary.

    The prose alone supports ~1.8k tokens; each token beyond 1024 adds one
    pseudo-word, which leaves a wide margin (training checks the size reached).
    """
    rng = random.Random(1234)  # private generator: same corpus in every process
    words_needed = max(0, vocab_size - 1024)
    lines = []
    line: list[str] = []
    for _ in range(words_needed):
        word = "".join(
            rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
            for _ in range(rng.randint(1, 4))
        )
        if rng.random() < 0.15:
            word = word.capitalize()
        if rng.random() < 0.1:
            word += str(rng.randint(0, 9999))
        line.append(word)
        if len(line) >= 12:
            lines.append(" ".join(line) + rng.choice((".", ",", "!", "?", ";")))
            line = []
    if line:
        lines.append(" ".join(line) + ".")
    return _CORPUS + "\n".join(lines)


# ------------------------------------------------------------------------ tokenizer

# the architectures whose checkpoints transformers loads with Qwen2Tokenizer
_QWEN_TOKENIZER = ("qwen2", "qwen3")


def _train_bpe(vocab_size: int, architecture: str):
    """Train the byte-level BPE as a bare ``tokenizers.Tokenizer`` (deterministic).

    Qwen2 and Qwen3 checkpoints are always loaded with ``Qwen2Tokenizer``, which
    rebuilds the pipeline with an NFC normalizer and its own split regex; that
    flavour is trained with the same pipeline so the merges fit how text is split
    at inference.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if architecture in _QWEN_TOKENIZER:
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        # Special tokens are added first, so they take ids 0, 1, 2.
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        # The full 256-byte alphabet makes every UTF-8 string encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(vocab_size).splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"tokenizer training reached {tok.get_vocab_size()} tokens, wanted {vocab_size}; "
            "the built-in corpus is too small for this vocabulary"
        )
    return tok


def _train_tokenizer(vocab_size: int, model_max_length: int, architecture: str):
    """Train the BPE and wrap it in the transformers class ``AutoTokenizer`` will load."""
    tok = _train_bpe(vocab_size, architecture)
    common: dict[str, Any] = dict(
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        # Makes the tokenizer build (and save) a post-processor that prepends BOS
        # when add_special_tokens=True.
        add_bos_token=True,
        add_eos_token=False,
        # Cleanup would strip legitimate spaces and break decode(encode(x)) == x.
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
    )
    if architecture in _QWEN_TOKENIZER:
        from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

        model = json.loads(tok.to_str())["model"]
        # unk_token=None: Qwen2Tokenizer would otherwise add "<|endoftext|>" as an
        # extra token and the vocabulary would outgrow the model's embedding.
        return Qwen2Tokenizer(
            vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], unk_token=None, **common
        )
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, **common)


# ---------------------------------------------------------------------------- model


def _build_config(preset: TinyPreset, tokenizer, dtype: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    config_class = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config,
                    "qwen3": Qwen3Config}[preset.architecture]
    kwargs: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=preset.tie_word_embeddings,
        # transformers 5 takes RoPE settings (theta and scaling) as one dict.
        rope_parameters=dict(preset.rope_parameters),
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=dtype,
        **dict(preset.config),
    )
    if preset.head_dim is not None:
        kwargs["head_dim"] = preset.head_dim
    return config_class(**kwargs)


def _init_weights(model, seed: int) -> None:
    """Overwrite every parameter from a private generator, in name order.

    HF's default init (std 0.02) gives near-uniform logits and a model that repeats
    one token forever; these scales give peaked, context-dependent next-token
    distributions. Norm weights and biases are moved away from 1 and 0 so a loader
    that drops them produces visibly wrong logits.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size

    def randn(shape):
        return torch.randn(shape, generator=gen)

    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                # Unit variance rows; the final norm below sets the logit scale.
                value = randn(param.shape)
            elif name == "model.norm.weight":
                # Random signs: with a tied head each token would otherwise score its
                # own embedding, still in the residual stream, at +|e|^2 and win
                # (harmless with an untied head, so applied uniformly).
                sign = torch.randint(0, 2, param.shape, generator=gen) * 2.0 - 1.0
                value = sign * _LOGIT_SCALE / math.sqrt(hidden) * (1.0 + 0.1 * randn(param.shape))
            elif "norm" in name:
                value = 1.0 + 0.1 * randn(param.shape)
            elif name.endswith(".bias"):
                value = 0.1 * randn(param.shape)
            elif param.dim() == 2:
                gain = _GAINS.get(name.rsplit(".", 2)[-2], 1.0)
                value = randn(param.shape) * (gain / math.sqrt(param.shape[1]))
            else:
                raise RuntimeError(f"no initialisation rule for parameter {name!r}")
            param.copy_(value.to(param.dtype))


def _build_model(preset: TinyPreset, config, seed: int, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    # Keep the caller's global RNG untouched; weights come from a private generator.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed)
    model.eval()
    return model.to(getattr(torch, dtype))


# -------------------------------------------------------------------------- public


def make_tiny_model(
    out_dir: str | Path,
    preset: str = "tiny",
    *,
    seed: int = 0,
    dtype: str = "float32",
    overwrite: bool = False,
) -> Path:
    """Write a checkpoint for ``preset`` into ``out_dir`` and return its path.

    ``out_dir`` may not exist or must be empty, unless ``overwrite`` is set and it
    holds a checkpoint made here before (its recipe file): then it is replaced. The
    checkpoint is written beside it and renamed into place, so an interrupted run
    leaves no half-written checkpoint. ``dtype`` is one of "float32", "bfloat16",
    "float16". Raises KeyError for an unknown preset, ValueError for an unknown
    dtype and FileExistsError for an ``out_dir`` it will not write into.
    """
    if preset not in PRESETS:
        raise KeyError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {_DTYPES}")
    out = Path(out_dir).absolute()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} is not empty (--overwrite / overwrite=True replaces a checkpoint "
                                  "made here before)")
        if not (out / RECIPE_FILE).is_file():
            raise FileExistsError(f"{out} is not empty and holds no checkpoint made here (no {RECIPE_FILE}): "
                                  "not replaced; choose a new or empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-build-", dir=out.parent))
    try:
        _write_checkpoint(staging, preset, seed, dtype)
        if out.exists():
            if any(out.iterdir()):
                _discard(out)
            else:
                out.rmdir()
        os.rename(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _write_checkpoint(out: Path, preset: str, seed: int, dtype: str) -> None:
    """The preset's checkpoint (weights, config, tokenizer, recipe) into the empty directory `out`."""
    spec = PRESETS[preset]
    tokenizer = _train_tokenizer(spec.vocab_size, spec.max_position_embeddings, spec.architecture)
    config = _build_config(spec, tokenizer, dtype)
    model = _build_model(spec, config, seed, dtype)

    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    recipe = {"version": RECIPE_VERSION, "preset": preset, "seed": seed, "dtype": dtype}
    (out / RECIPE_FILE).write_text(json.dumps(recipe, sort_keys=True) + "\n")


def preset_model_dir(preset: str) -> Path:
    """Where a preset's cached checkpoint lives: ``$PDSERVE_HOME/models/<preset>``,
    else ``~/.cache/pdserve/models/<preset>``."""
    home = os.environ.get("PDSERVE_HOME")
    root = Path(home) if home else Path.home() / ".cache" / "pdserve"
    return root / "models" / preset


def default_model_dir() -> Path:
    """Where the built-in model (the "tiny" preset) lives."""
    return preset_model_dir("tiny")


def _is_current(path: Path, preset: str) -> bool:
    try:
        recipe = json.loads((path / RECIPE_FILE).read_text())
    except (OSError, ValueError):
        return False
    wanted = {"version": RECIPE_VERSION, "preset": preset, "seed": 0, "dtype": "float32"}
    return recipe == wanted and (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()


def ensure_default_model() -> Path:
    """Return :func:`default_model_dir`, building the "tiny" preset there first if needed."""
    return ensure_preset_model("tiny")


def ensure_preset_model(preset: str) -> Path:
    """Return :func:`preset_model_dir`, building the preset there first if needed.

    The model is built in a sibling temp directory and renamed into place, so a
    concurrent reader never sees a half-written checkpoint; when several processes
    race, the first rename wins and the others discard their copy. A directory left
    by an older recipe is replaced.
    """
    target = preset_model_dir(preset)
    if _is_current(target, preset):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{preset}-build-", dir=target.parent))
    try:
        _write_checkpoint(staging, preset, 0, "float32")    # (make_tiny_model would stage it once more)
        try:
            os.rename(staging, target)
        except OSError:  # target exists and is not empty
            if _is_current(target, preset):
                return target  # another process finished first
            _discard(target)
            try:
                os.rename(staging, target)
            except OSError:
                if not _is_current(target, preset):
                    raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def ensure_built_in_checkpoint(path: str | Path) -> None:
    """Where `path` is a preset's cache directory here (as checkpoint_dir named it
    on the node that resolved the deployment) and that preset is missing or stale,
    builds it there: each node of a cluster builds its own copy of a built-in
    model, and every copy is the same (seeded). Any other path is left alone."""
    for preset in PRESETS:
        if Path(path) == preset_model_dir(preset):
            ensure_preset_model(preset)
            return


def names_built_in_model(model: str) -> bool:
    """`model` is the name of a preset, and no checkpoint directory of that name is here."""
    return model in PRESETS and not (Path(model) / "config.json").is_file()


def names_built_in_tokenizer(tokenizer: str) -> bool:
    """`tokenizer` is the name of a preset, and no directory of that name here holds a tokenizer."""
    return tokenizer in PRESETS and not any((Path(tokenizer) / name).is_file()
                                            for name in ("tokenizer.json", "tokenizer_config.json"))


def tokenizer_dir(tokenizer: str) -> str:
    """The directory a `tokenizer` setting names, as an absolute path: a built-in
    model's (built here on first use), or the directory given."""
    tokenizer = os.path.expanduser(tokenizer)
    if names_built_in_tokenizer(tokenizer):
        return str(ensure_preset_model(tokenizer))
    return os.path.abspath(tokenizer)


def checkpoint_dir(model: str | None) -> str:
    """The checkpoint directory a `--model` / `model.path` names, as an absolute
    path (a worker on another node, or in another working directory, reads the
    same directory): a HuggingFace checkpoint directory; unset, the built-in "tiny" model; the name
    of a preset ("bench", "tiny-mqa", ...) that is not a checkpoint directory
    here (the repository's own bench/ folder is not one), that preset, built in
    pdserve's model cache on first use. Raises FileNotFoundError, saying what
    to give, for anything else."""
    if model is None:
        return str(ensure_default_model())
    model = os.path.expanduser(model)      # a deployment file's "~/models/x" (a shell expands only a flag's)
    if names_built_in_model(model):
        return str(ensure_preset_model(model))
    if not (Path(model) / "config.json").is_file():
        what = "a file" if Path(model).is_file() else "not a HuggingFace checkpoint directory (no config.json)"
        if Path(model).suffix.lower() == ".gguf":
            what = "a GGUF file, which pdserve does not load (it loads safetensors checkpoints)"
        raise FileNotFoundError(f"model {model} is {what}; give a HuggingFace checkpoint directory (config.json, "
                                f"tokenizer and *.safetensors) or a built-in model: {', '.join(sorted(PRESETS))}")
    return os.path.abspath(model)


def _discard(path: Path) -> None:
    """Remove ``path`` by first renaming it aside, so no reader sees it half-deleted."""
    graveyard = Path(tempfile.mkdtemp(prefix=".tiny-stale-", dir=path.parent))
    try:
        os.rename(path, graveyard / path.name)
    except FileNotFoundError:
        pass  # already gone
    finally:
        shutil.rmtree(graveyard, ignore_errors=True)

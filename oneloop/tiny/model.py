"""The tiny local model: a random-init Qwen3 LM, a locally trained tokenizer, a tool chat template.

Owns building and caching, in Hugging Face format in one directory, everything every engine loads
by path (`AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained`) for tests and the
CPU demo. Nothing comes from a hub:

* the tokenizer is byte-level BPE trained with `tokenizers` on a generated corpus (words, numbers,
  JSON, arithmetic, tool-call markup), so any text round-trips exactly; digits are split one per
  token like Qwen's (`TinyModelSpec.number_digits` = 3 instead makes every integer below 1000 one
  token); ChatML control tokens and the tool markup tags are single tokens;
* the chat template (`oneloop.tiny.chat_template`) is a simplified Qwen3/Hermes ChatML template
  (no `<think>` handling) that takes `tools`, roles system/user/assistant/tool and OpenAI-shaped
  assistant `tool_calls`; `TinyModelSpec.tool_list` picks how it lists the tools;
* the model is `Qwen3ForCausalLM` in fp32 with weights drawn from `TinyModelSpec.seed`.

The same spec always gives the same files (tokenizer.json bytes, weights). A build goes into a
temporary directory beside its cache entry and is renamed into place, so concurrent processes
(Ray workers, parallel tests) never see a half-written directory.
"""

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from oneloop.tiny.chat_template import TOOL_LIST_STYLES, chat_template
from oneloop.tiny.moe import ARCHITECTURES, model_config

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TINY_MODEL_NAME = "oneloop/tiny-qwen3"
"""The `base_model` name that the local backend maps to a built tiny model directory."""

# Bump when the files a build writes change for the same spec, so old cache entries are not reused.
FORMAT_VERSION = 1
# Written last inside the temporary build directory; its presence means the directory is complete.
COMPLETE_MARKER = "oneloop-tiny-model.json"
# The corpus is fixed, not drawn from `TinyModelSpec.seed`: the seed picks weights, not a vocab.
_CORPUS_SEED = 1234
_CORPUS_LINES = 6000

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CONTROL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
TOOL_MARKUP_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<tools>",
    "</tools>",
)
# Qwen2/Qwen3's pre-tokenizer split: contractions, letter runs with one leading non-letter, single
# digits, punctuation runs, newline runs, whitespace. Single `\p{N}` keeps numbers digit by digit.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# With `TinyModelSpec.number_digits` = k > 1, `\p{N}` becomes `\p{N}{1,k}` (as GPT-4's splitter
# does with k = 3), and every integer below 10**k appears this often in the corpus, so BPE merges
# each into one token before any rarer pair.
_NUMBER_REPEATS = 128
_MAX_NUMBER_DIGITS = 3
# Spec fields added after FORMAT_VERSION 1 and their defaults (left out of the cache key there).
_KEY_DEFAULTS = {
    "number_digits": 1,
    "tool_list": "json",
    "architecture": "qwen3",
    "num_experts": 8,
    "experts_per_token": 2,
}


@dataclass(frozen=True)
class TinyModelSpec:
    """What to build. Every field goes into the cache key; defaults train 16k tokens fast on CPU."""

    vocab_size: int = 1024
    """Tokens in the tokenizer and rows in the embedding, control and markup tokens included."""
    hidden_size: int = 64
    """Width of the residual stream (features)."""
    num_layers: int = 2
    """Transformer decoder layers (count)."""
    num_heads: int = 4
    """Query attention heads per layer (count)."""
    num_kv_heads: int = 2
    """Key/value heads per layer, grouped-query attention; must divide `num_heads` (count)."""
    head_dim: int = 16
    """Width of one attention head; even, for rotary embeddings (features)."""
    intermediate_size: int = 192
    """Width of the SwiGLU MLP's hidden layer (features)."""
    max_position_embeddings: int = 4096
    """Longest sequence the model and tokenizer accept (tokens)."""
    tie_word_embeddings: bool = True
    """Share the input embedding with the output projection, as small Qwen3 models do (flag)."""
    seed: int = 0
    """Seed for the random weight init; the tokenizer does not depend on it (integer)."""
    number_digits: int = 1
    """Longest digit run the pre-tokenizer keeps together (digits): 1 = one digit per token as in
    Qwen; 3 = every integer 0..999 is one token (the corpus then holds each of them, so BPE learns
    them all; needs `vocab_size` room for ~1,000 number tokens). Not part of the cache key at 1."""
    tool_list: str = "json"
    """How the chat template lists tools: "json" (Qwen3's schemas) or "compact" (a line per tool,
    see `oneloop.tiny.chat_template`). Not part of the cache key at "json"."""
    architecture: str = "qwen3"
    """Model family (`oneloop.tiny.moe.ARCHITECTURES`): "qwen3" (dense), "qwen3_moe",
    "qwen3_5_moe" (Gated DeltaNet hybrid MoE, text only) or "qwen3_5" (hybrid dense); see
    `oneloop.tiny.moe`. Not part of the cache key at "qwen3"."""
    num_experts: int = 8
    """Routed experts per MoE layer (MoE architectures only; count)."""
    experts_per_token: int = 2
    """Experts the router picks per token; at most `num_experts` (count)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            expected = {"tie_word_embeddings": bool, "tool_list": str, "architecture": str}.get(
                f.name, int
            )
            if type(value) is not expected:
                raise TypeError(
                    f"TinyModelSpec.{f.name}: expected {expected.__name__}, got {value!r}"
                )
        minimum_vocab = 256 + len(CONTROL_TOKENS) + len(TOOL_MARKUP_TOKENS) + 1
        if self.vocab_size < minimum_vocab:
            raise ValueError(
                f"TinyModelSpec.vocab_size: must be at least {minimum_vocab} (256 byte tokens, "
                f"the control and markup tokens, one merge), got {self.vocab_size}"
            )
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
            "number_digits",
            "num_experts",
            "experts_per_token",
        ):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"TinyModelSpec.{name}: must be positive, got {getattr(self, name)}"
                )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TinyModelSpec.num_kv_heads: must divide num_heads={self.num_heads}, "
                f"got {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"TinyModelSpec.head_dim: must be even for RoPE, got {self.head_dim}")
        if self.seed < 0:
            raise ValueError(f"TinyModelSpec.seed: must be non-negative, got {self.seed}")
        if self.tool_list not in TOOL_LIST_STYLES:
            raise ValueError(
                f"TinyModelSpec.tool_list: expected one of {TOOL_LIST_STYLES}, "
                f"got {self.tool_list!r}"
            )
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"TinyModelSpec.architecture: expected one of {ARCHITECTURES}, "
                f"got {self.architecture!r}"
            )
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"TinyModelSpec.experts_per_token: at most num_experts={self.num_experts}, "
                f"got {self.experts_per_token}"
            )
        if self.number_digits > _MAX_NUMBER_DIGITS:
            raise ValueError(
                f"TinyModelSpec.number_digits: at most {_MAX_NUMBER_DIGITS} (every integer below "
                f"10**number_digits gets a token), got {self.number_digits}"
            )


def spec_digest(spec: TinyModelSpec) -> str:
    """Short stable hash of the spec and `FORMAT_VERSION`: the cache key."""
    fields_ = asdict(spec)
    for name, default in _KEY_DEFAULTS.items():  # fields added later: absent at their default,
        if fields_[name] == default:  # so existing specs keep their cache key
            del fields_[name]
    payload = json.dumps({"format": FORMAT_VERSION, **fields_}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_cache_root() -> Path:
    """`$ONELOOP_CACHE` if set, else `~/.cache/oneloop`."""
    env = os.environ.get("ONELOOP_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "oneloop"


def tiny_model_dir(spec: TinyModelSpec = TinyModelSpec(), root: Path | None = None) -> Path:
    """Where `build_tiny_model(spec, root)` puts (or finds) the model; builds nothing."""
    return (root if root is not None else default_cache_root()) / f"tiny-qwen3-{spec_digest(spec)}"


def build_tiny_model(spec: TinyModelSpec = TinyModelSpec(), root: Path | None = None) -> Path:
    """Return the directory of the model for `spec`, building it first unless already cached.

    A complete directory (one holding `COMPLETE_MARKER`) is returned untouched. Otherwise the model
    is built in a temporary directory under `root` and renamed into place; when another process wins
    the race, its directory is kept and ours discarded. Safe to call from many processes at once.
    """
    target = tiny_model_dir(spec, root)
    if (target / COMPLETE_MARKER).is_file():
        return target
    if target.exists():
        raise FileExistsError(
            f"{target} exists but has no {COMPLETE_MARKER}, so it was not written by "
            "build_tiny_model; delete it and call again"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_tokenizer(spec, staging)
        _write_model(spec, staging)
        marker = {"format": FORMAT_VERSION, "spec": asdict(spec), "name": TINY_MODEL_NAME}
        (staging / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        try:
            os.rename(staging, target)
        except OSError:
            # Another process renamed its complete build into place first (the target is then a
            # non-empty directory); anything else is a real failure.
            if not (target / COMPLETE_MARKER).is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


# --------------------------------------------------------------------------------------------------
# Tokenizer


_WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her long
make thing see him two has look more day could go come did number sound no most people my over
know water than call first who may down side been now find any new work part take get place made
live where after back little only round man year came show every good me give our under name
very through just form sentence great think say help low line differ turn cause much mean before
move right boy old too same tell does set three want air well also play small end put home read
hand port large spell add even land here must big high such follow act why ask men change went
light kind off need house picture try us again animal point mother world near build self earth
father head stand own page should country found answer school grow study still learn plant cover
food sun four between state keep eye never last let thought city tree cross farm hard start
might story saw far sea draw left late run while press close night real life few north open seem
together next white children begin got walk example ease paper group always music those both
mark often letter until mile river car feet care second book carry took science eat room friend
began idea fish mountain stop once base hear horse cut sure watch color face wood main enough
plain girl usual young ready above ever red list though feel talk bird soon body dog family
direct pose leave song measure door product black short numeral class wind question happen
complete ship area half rock order fire south problem piece told knew pass since top whole king
space heard best hour better true during hundred five remember step early hold west ground
interest reach fast verb sing listen six table travel less morning ten simple several vowel
toward war lay against pattern slow center love person money serve appear road map rain rule
govern pull cold notice voice unit power town fine certain fly fall lead cry dark machine note
wait plan figure star box noun field rest correct able pound done beauty drive stood contain
front teach week final gave green oh quick develop ocean warm free minute strong special mind
behind clear tail produce fact street inch multiply nothing course stay wheel full force blue
object decide surface deep moon island foot system busy test record boat common gold possible
plane stead dry wonder laugh thousand ago ran check game shape equate answer result compute
calculator add subtract multiply divide sum total value tool call function submit error message
user assistant system content arguments name type description parameters required properties
string integer number object array boolean null true false expression the answer is
""".split()
_TOOL_NAMES = (
    "add",
    "subtract",
    "multiply",
    "divide",
    "calculator",
    "submit",
    "evaluate",
    "lookup",
)


def _random_number(rng: random.Random) -> str:
    if rng.random() < 0.2:
        return f"{rng.uniform(-1000, 1000):.{rng.randint(1, 4)}f}"
    return str(rng.randint(-(10 ** rng.randint(1, 6)), 10 ** rng.randint(1, 8)))


def _random_expression(rng: random.Random, depth: int = 0) -> str:
    if depth > 2 or rng.random() < 0.4:
        return _random_number(rng).lstrip("-")
    left, right = _random_expression(rng, depth + 1), _random_expression(rng, depth + 1)
    expression = f"{left} {rng.choice('+-*/')} {right}"
    return f"({expression})" if depth and rng.random() < 0.5 else expression


def _random_sentence(rng: random.Random) -> str:
    words = rng.choices(_WORDS, k=rng.randint(3, 16))
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice(".?!:,")


def _random_json(rng: random.Random) -> str:
    value: dict[str, object] = {}
    for _ in range(rng.randint(1, 4)):
        kind = rng.random()
        key = rng.choice(_WORDS)
        if kind < 0.4:
            value[key] = int(_random_number(rng).split(".")[0])
        elif kind < 0.7:
            value[key] = _random_sentence(rng)
        elif kind < 0.85:
            value[key] = [rng.randint(0, 99) for _ in range(rng.randint(0, 4))]
        else:
            value[key] = rng.choice([True, False, None])
    return json.dumps(value, indent=rng.choice([None, 2]))


def _random_tool_markup(rng: random.Random) -> str:
    name = rng.choice(_TOOL_NAMES)
    arguments = (
        {"expression": _random_expression(rng)}
        if rng.random() < 0.5
        else {
            "a": int(_random_number(rng).split(".")[0]),
            "b": int(_random_number(rng).split(".")[0]),
        }
    )
    call = json.dumps({"name": name, "arguments": arguments})
    tool = json.dumps(
        {
            "type": "function",
            "function": {
                "name": name,
                "description": _random_sentence(rng),
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        }
    )
    return rng.choice(
        [
            f"{IM_START}assistant\n{_random_sentence(rng)}\n<tool_call>\n{call}\n</tool_call>{IM_END}",
            f"{IM_START}user\n<tool_response>\n{_random_number(rng)}\n</tool_response>{IM_END}",
            f"<tools>\n{tool}\n</tools>",
            f"{IM_START}user\n{_random_sentence(rng)} {_random_expression(rng)}{IM_END}",
        ]
    )


def _generate_corpus(number_digits: int = 1) -> list[str]:
    """A deterministic mixed corpus of prose, numbers, JSON, arithmetic and ChatML tool markup;
    with `number_digits` > 1 also every integer below 10**number_digits, `_NUMBER_REPEATS` times."""
    rng = random.Random(_CORPUS_SEED)
    makers = (_random_sentence, _random_json, _random_expression, _random_tool_markup)
    corpus = [rng.choice(makers)(rng) for _ in range(_CORPUS_LINES)]
    if number_digits > 1:
        numbers = " ".join(str(i) for i in range(10**number_digits))
        corpus += [numbers] * _NUMBER_REPEATS
    return corpus


def _split_pattern(number_digits: int) -> str:
    """The pre-tokenizer regex; exactly `_SPLIT_PATTERN` at 1, so default builds are unchanged."""
    if number_digits == 1:
        return _SPLIT_PATTERN
    return _SPLIT_PATTERN.replace(r"|\p{N}|", rf"|\p{{N}}{{1,{number_digits}}}|", 1)


def _train_tokenizer(vocab_size: int, number_digits: int = 1) -> "Tokenizer":
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(_split_pattern(number_digits)), behavior="isolated", invert=False
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [
        AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS + TOOL_MARKUP_TOKENS
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_generate_corpus(number_digits), trainer=trainer)
    # Tool markup tags are ordinary text in a conversation, not control tokens (as in Qwen3):
    # unmark them so `decode(..., skip_special_tokens=True)` keeps them; they stay single tokens.
    markup = [AddedToken(t, special=False, normalized=False) for t in TOOL_MARKUP_TOKENS]
    tokenizer.add_tokens(markup)
    return tokenizer


def _write_tokenizer(spec: TinyModelSpec, directory: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    backend = _train_tokenizer(spec.vocab_size, spec.number_digits)
    if backend.get_vocab_size() > spec.vocab_size:
        raise RuntimeError(f"trained {backend.get_vocab_size()} tokens for vocab {spec.vocab_size}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=chat_template(spec.tool_list),
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
        add_bos_token=False,
    )
    tokenizer.save_pretrained(directory)


# --------------------------------------------------------------------------------------------------
# Model


def _write_model(spec: TinyModelSpec, directory: Path) -> None:
    import torch
    from transformers import (
        AutoModelForCausalLM,
        GenerationConfig,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    vocab = json.loads((directory / "tokenizer.json").read_text())["added_tokens"]
    token_id = {entry["content"]: entry["id"] for entry in vocab}
    token_ids = {
        "bos_token_id": token_id[PAD_TOKEN],
        "eos_token_id": token_id[IM_END],
        "pad_token_id": token_id[PAD_TOKEN],
    }
    config = model_config(spec, token_ids) if spec.architecture != "qwen3" else Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=token_id[PAD_TOKEN],
        eos_token_id=token_id[IM_END],
        pad_token_id=token_id[PAD_TOKEN],
        dtype="float32",
    )
    # Fork the RNG so building never disturbs the caller's torch random state; init in fp32 whatever
    # the caller's default dtype, so the same seed always draws the same weights.
    default_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        torch.set_default_dtype(torch.float32)
        try:
            model = (
                Qwen3ForCausalLM(config)
                if spec.architecture == "qwen3"
                else AutoModelForCausalLM.from_config(config)
            )
        finally:
            torch.set_default_dtype(default_dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=token_id[PAD_TOKEN],
        eos_token_id=token_id[IM_END],
        pad_token_id=token_id[PAD_TOKEN],
    )
    model.save_pretrained(directory, safe_serialization=True)


# Named variants the local backend resolves as base models (`model.base_model`).
TINY_MODEL_128X4 = "oneloop/tiny-qwen3-128x4"
TINY_MODEL_DEMO = "oneloop/tiny-qwen3-demo"
TINY_MODEL_DEMO_GPU = "oneloop/tiny-qwen3-demo-gpu"
TINY_QWEN3_MOE = "oneloop/tiny-qwen3-moe"
TINY_QWEN3_5_MOE = "oneloop/tiny-qwen3.5-moe"
TINY_QWEN3_5 = "oneloop/tiny-qwen3.5"


def named_tiny_specs() -> dict[str, TinyModelSpec]:
    """Base-model name → spec. The 128×4 variant (0.9 M parameters) is the smallest size that
    reliably learns the demo's tool-call format from a short SFT warm start (probed on a GPU
    grid: hidden 64 learns in one seed of three)."""
    return {
        TINY_MODEL_NAME: TinyModelSpec(),
        TINY_MODEL_128X4: TinyModelSpec(
            hidden_size=128, num_layers=4, head_dim=32, intermediate_size=384
        ),
        # The CPU demo's model: 128×4 with the compact tool list, so a demo episode is ~235
        # tokens instead of ~630 (the JSON schemas of the calculator's five tools were 530 of
        # them): SFT, rollouts and evaluation all cost about a third, and the question is a
        # larger share of what the model attends over.
        TINY_MODEL_DEMO: TinyModelSpec(
            hidden_size=128, num_layers=4, head_dim=32, intermediate_size=384, tool_list="compact"
        ),
        # The GPU demo's model (preset demo-gpu): Qwen3-0.6B's layer shape (width 1024, 16 query
        # and 8 key/value heads of 128, SwiGLU 3072) at 8 layers, 127 M parameters, the demo's
        # tokenizer and compact tool list; random init, warm-started by SFT on the GPU.
        TINY_MODEL_DEMO_GPU: TinyModelSpec(
            hidden_size=1024,
            num_layers=8,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=3072,
            tool_list="compact",
        ),
        # The seed's families at test size (`oneloop.tiny.moe`): 8 experts, top-2; the hybrids
        # have 4 layers, 3 Gated DeltaNet : 1 gated full attention; the demo's compact tool list
        # keeps loop tests' prompts short.
        TINY_QWEN3_MOE: TinyModelSpec(
            architecture="qwen3_moe", intermediate_size=64, tool_list="compact"
        ),
        TINY_QWEN3_5_MOE: TinyModelSpec(
            architecture="qwen3_5_moe", num_layers=4, intermediate_size=64, tool_list="compact"
        ),
        TINY_QWEN3_5: TinyModelSpec(architecture="qwen3_5", num_layers=4, tool_list="compact"),
    }

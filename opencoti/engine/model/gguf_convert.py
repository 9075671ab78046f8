"""A GGUF file's config and tokenizer, written once into the cache: ``<cache>/models/<stem>-<fingerprint>``
holds the transformers config (read from the file's header: :func:`config_from_gguf`), its generation
config and its tokenizer (converted by transformers once per distinct tokenizer, kept in
``<cache>/tokenizers/<digest>``). No weights: the loader reads them from the GGUF file at every start
(``gguf_weights.py``). A conversion is built in a temporary sibling and renamed into place, so an
interrupted one never leaves a directory that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelLoadError
from ..paths import cache_root
from .types import CONVERTER_VERSION, MARKER_FILE, SUPPORTED_ARCHITECTURES, Progress


def _silent(_: str) -> None:
    pass


def convert_gguf(
    gguf_path: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    name: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Write a GGUF file's config and tokenizer to a directory in the cache (once) and return it.

    The directory is ``<cache>/models/<stem>-<fingerprint>`` where the fingerprint
    hashes the file size, its first and last MiB and :data:`CONVERTER_VERSION`.
    It is built in a temporary sibling and renamed into place, so an interrupted
    conversion never leaves a directory that looks complete.
    """
    say = progress or _silent
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    models_dir = cache_root(cache_dir) / "models"
    target = models_dir / f"{gguf_path.stem}-{_fingerprint(gguf_path)}"
    if _is_converted(target):
        return target
    arch = _gguf_architecture(gguf_path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot create the model cache {models_dir}: {exc} (set OPENCOTI_CACHE)") from exc
    _remove_stale_temp_dirs(models_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=models_dir))
    try:
        say(f"reading the config and tokenizer of {gguf_path.name} into {target} (one time) ...")
        started = time.perf_counter()
        _convert_gguf_into(gguf_path, tmp, name or gguf_path.stem, say)
        _make_readable(tmp)  # mkdtemp and save_file create owner-only modes
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_converted(target):  # a leftover without a marker: replace it
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
            # else another process finished first; its result is equivalent
        say(f"read the config and tokenizer of {gguf_path.name} in {time.perf_counter() - started:.1f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf_into(gguf_path: Path, out: Path, name: str, say: Progress) -> None:
    """Write the GGUF's config (read from its header: :func:`config_from_gguf`), generation config and
    tokenizer into ``out``. No weights: they are read from the GGUF file at every start. The tokenizer
    is converted by transformers once per distinct tokenizer (``<cache>/tokenizers/<digest>``: every
    quantization of a model, and every generated test model, shares one), the slow part of a first
    start (gguf-py's reader builds an object per vocabulary entry: ~10-20 s for 49,152 tokens)."""
    from transformers import __version__ as transformers_version

    from .gguf_index import GGUFIndex

    say("reading the GGUF config and tokenizer ...")
    index = GGUFIndex(gguf_path)
    config = config_from_gguf(index)
    config.save_pretrained(str(out))
    _generation_config_from(config).save_pretrained(str(out))
    _tokenizer_into(gguf_path, index.tokenizer_digest, out, say)

    marker = {
        "converter_version": CONVERTER_VERSION,
        "name": name,
        "architecture": config.model_type,
        "source": str(gguf_path),
        "tokenizer": "hf",
        "tokenizer_digest": index.tokenizer_digest,
        "transformers_version": transformers_version,
    }
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def _tokenizer_into(gguf_path: Path, digest: str, out: Path, say: Progress) -> None:
    """The file's tokenizer saved into ``out``: copied from the tokenizer cache when a file with the same
    tokenizer keys was read before, else converted by transformers (and kept in the cache)."""
    from transformers import AutoTokenizer

    shared = out.parent.parent / "tokenizers" / digest
    if (shared / "tokenizer_config.json").is_file():
        for f in shared.iterdir():
            if f.name in _TOKENIZER_FILES:
                shutil.copy2(f, out / f.name)
        return
    say("converting the GGUF tokenizer (once per tokenizer) ...")
    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # transformers raises many types for a bad file
        raise ModelLoadError(f"transformers could not read the tokenizer of {gguf_path}: {exc}") from exc
    hf_tokenizer.save_pretrained(str(out))
    _check_saved_tokenizer(hf_tokenizer, out)
    try:
        shared.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{digest}-", dir=shared.parent))
        for f in out.iterdir():
            if f.name in _TOKENIZER_FILES:
                shutil.copy2(f, tmp / f.name)
        _make_readable(tmp)
        os.rename(tmp, shared)
    except OSError:  # another process kept it first, or a read-only cache: the model's own copy is enough
        shutil.rmtree(locals().get("tmp", shared.parent / ".none"), ignore_errors=True)


_CAUSAL_LM_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM"}
# GGUF metadata key (after "<arch>.") -> config attribute, as transformers' GGUF reader maps them
_CONFIG_KEYS = {"context_length": "max_position_embeddings", "embedding_length": "hidden_size",
                "block_count": "num_hidden_layers", "feed_forward_length": "intermediate_size",
                "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
                "attention.layer_norm_rms_epsilon": "rms_norm_eps", "attention.key_length": "head_dim"}


_TOKEN_IDS = {"tokenizer.ggml.bos_token_id": "bos_token_id", "tokenizer.ggml.eos_token_id": "eos_token_id",
              "tokenizer.ggml.padding_token_id": "pad_token_id", "tokenizer.ggml.unknown_token_id": "unk_token_id"}


def config_from_gguf(index) -> Any:
    """The transformers config of a GGUF file (a ``GGUFIndex``), from its header alone: the sizes, RoPE
    (base, linear / YaRN scaling, llama3-style frequency factors from ``rope_freqs``), tied embeddings
    (no ``output.weight``), the vocabulary (the rows of ``token_embd``), biases and token ids. Equal to
    what transformers' GGUF reader gives for the supported architectures (tested), in milliseconds."""
    from transformers import AutoConfig

    arch = index.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    meta = index.metadata
    model_type = arch
    if arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        model_type = "mistral"  # llama.cpp writes Mistral models as llama (transformers reads them so too)
    kw: dict[str, Any] = {}
    for key, attr in _CONFIG_KEYS.items():
        if f"{arch}.{key}" in meta:
            kw[attr] = meta[f"{arch}.{key}"]
    for key, attr in _TOKEN_IDS.items():
        if key in meta:
            kw[attr] = meta[key]
    missing = [a for a in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads") if a not in kw]
    if missing:
        raise ModelLoadError(f"the GGUF header has no {', '.join(missing)} ({arch}.* keys)")
    kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
    kw.setdefault("max_position_embeddings", 4096)
    kw.setdefault("rms_norm_eps", 1e-6 if arch in ("qwen2", "qwen3") else 1e-5)
    if kw.get("head_dim") == kw["hidden_size"] // kw["num_attention_heads"] and arch != "qwen3":
        kw.pop("head_dim")
    rope: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 1e6 if arch in ("qwen2", "qwen3")
                                                         else 10000.0))}
    scaling = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if scaling in ("linear", "yarn") and factor and float(factor) != 1.0:
        rope.update(rope_type=scaling, factor=float(factor))
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if scaling == "yarn" and original:
            rope["original_max_position_embeddings"] = int(original)
    elif scaling not in (None, "none", "linear", "yarn"):
        raise ModelLoadError(f"RoPE scaling {scaling!r} of the GGUF file is not supported (linear, yarn)")
    kw["rope_parameters"] = rope
    tensors = {t.name: t for t in index.tensors}
    kw["tie_word_embeddings"] = "output.weight" not in tensors
    if "token_embd.weight" in tensors:
        kw["vocab_size"] = int(tensors["token_embd.weight"].shape[1])
    if arch == "llama" and "blk.0.attn_q.bias" in tensors:
        kw["attention_bias"] = True
    config = AutoConfig.for_model(model_type, **kw)
    freqs = tensors.get("rope_freqs.weight")
    if freqs is not None:
        if freqs.type_name != "F32":
            raise ModelLoadError(f"rope_freqs has type {freqs.type_name} (expected F32)")
        config.rope_freq_factors = [float(v) for v in np.frombuffer(freqs.data.tobytes(), dtype=np.float32)]
    config.architectures = [_CAUSAL_LM_CLASSES.get(model_type, "LlamaForCausalLM")]
    name = meta.get("general.name")
    if isinstance(name, str):
        config._model_name_or_path = name  # where transformers' GGUF reader puts general.name
    return config


def _generation_config_from(config):
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_id=getattr(config, "eos_token_id", None),
        pad_token_id=getattr(config, "pad_token_id", None),
    )


def _check_saved_tokenizer(original, out: Path) -> None:
    """Reload the saved tokenizer; the chat template and tokenization must survive the round trip."""
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(str(out))
    if (reloaded.chat_template or None) != (original.chat_template or None):
        raise ModelLoadError(f"converting to {out} lost the tokenizer's chat template")
    probe = "Hello <|im_start|>user\n héllo 日本 🙂  \t x</s><|im_end|>"
    if reloaded.encode(probe, add_special_tokens=False) != original.encode(probe, add_special_tokens=False):
        raise ModelLoadError(f"converting to {out} changed how the tokenizer encodes text")


def _gguf_architecture(path: Path) -> str:
    """``general.architecture`` of a GGUF file (reads the header only)."""
    try:
        from .gguf_index import GGUFIndex

        return GGUFIndex(path).architecture
    except Exception as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def _fingerprint(path: Path, chunk: int = 1 << 20) -> str:
    """Short content hash: size + first and last MiB + converter version (cheap for GB files)."""
    size = path.stat().st_size
    h = hashlib.sha256(f"{size}:{CONVERTER_VERSION}".encode())
    with open(path, "rb") as f:
        h.update(f.read(chunk))
        if size > chunk:
            f.seek(max(chunk, size - chunk))
            h.update(f.read(chunk))
    return h.hexdigest()[:12]


def _is_converted(directory: Path) -> bool:
    try:
        marker = json.loads((directory / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("converter_version") == CONVERTER_VERSION and (directory / "config.json").is_file()


def _make_readable(directory: Path) -> None:
    """World-readable modes (0755/0644) so a shared cache works for every user."""
    os.chmod(directory, 0o755)
    for f in directory.iterdir():
        os.chmod(f, 0o644)


def _remove_stale_temp_dirs(models_dir: Path, max_age_s: float = 3600.0) -> None:
    """Delete leftovers of interrupted conversions (old enough not to be in progress)."""
    now = time.time()
    for p in models_dir.glob(".tmp-*"):
        try:
            if now - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass

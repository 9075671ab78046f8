"""Weight formats: containers and quantizers, GGUF block decoding, kernels, per-shape kernel choice,
the auto format rule, config validation and the thread adapter. Tiny random models only."""

from __future__ import annotations

import functools

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import copy
import json

import numpy as np
import pytest
import torch

from opencoti.engine import EngineConfig
from opencoti.engine.errors import InvalidRequestError
from opencoti.engine.model import autotune, choose, kernels, qformats, threads, weights
from opencoti.engine.model.loader import tiny_model

from gguf_blocks import random_blocks

import gguf
from gguf import GGMLQuantizationType as GT
from gguf import quants


def _w(n=48, k=64, seed=0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1


# ------------------------------------------------------------------------------------------ containers
def test_int8_round_trip_error_within_half_a_step():
    w = _w()
    q = qformats.quantize_int8(w)
    assert q.q.dtype == torch.int8 and q.scale.shape == (48,)
    err = (q.dequantize() - w).abs()
    assert bool((err <= q.scale[:, None] / 2 + 1e-7).all())
    assert qformats.quantize_int8(torch.zeros(3, 32)).dequantize().abs().max() == 0  # no division by zero


def test_int4_round_trip_error_within_half_a_step_and_exact_on_its_grid():
    w = _w(k=96)
    q = qformats.quantize_int4(w, group=32)
    assert q.q.dtype == torch.uint8 and int(q.q.max()) <= 15 and q.scale.shape == (48, 3)
    err = (q.dequantize() - w).abs().view(48, 3, 32)
    assert bool((err <= q.scale[..., None] / 2 + 1e-6).all())
    again = qformats.quantize_int4(q.dequantize(), group=32)  # min and max of each group are on the grid
    assert torch.equal(again.q, q.q)
    torch.testing.assert_close(again.dequantize(), q.dequantize(), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="multiple of the group size"):
        qformats.quantize_int4(torch.zeros(4, 40))


def test_cat_and_permute_rows_commute_with_dequantize():
    a, b = _w(16, 64, 1), _w(8, 64, 2)
    for quant in (qformats.quantize_int8, qformats.quantize_int4):
        fused = qformats.cat_rows([quant(a), quant(b)])
        torch.testing.assert_close(fused.dequantize(), torch.cat([quant(a).dequantize(), quant(b).dequantize()]))
        perm = torch.randperm(24, generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(qformats.permute_rows(fused, perm).dequantize(), fused.dequantize()[perm])
    with pytest.raises(TypeError):
        qformats.cat_rows([qformats.quantize_int8(a), qformats.quantize_int4(b)])


# ------------------------------------------------------------------------------------------ GGUF blocks
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_decode_exactly_like_gguf(type_name):
    x = np.random.default_rng(0).standard_normal((24, 128)).astype(np.float32)
    blocks = quants.quantize(x, GT[type_name])
    w4 = qformats.gguf_block_to_int4(type_name, blocks, 24, 128)
    ref = qformats.gguf_dequantize(type_name, blocks, 24, 128)
    assert torch.equal(w4.dequantize(), ref)
    assert float((ref - torch.from_numpy(x)).abs().max()) < 0.5  # and gguf's decoder is what we think


def test_gguf_q4_k_blocks_decode_exactly_like_gguf():
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (16, 2, 144), dtype=np.uint8)  # 16 rows x 512 values, random scales/mins
    blocks[..., 0:2] = np.frombuffer(np.float16(0.013).tobytes(), np.uint8)
    blocks[..., 2:4] = np.frombuffer(np.float16(0.021).tobytes(), np.uint8)
    blocks = blocks.reshape(16, 288)
    w4 = qformats.gguf_block_to_int4("Q4_K", blocks, 16, 512)
    assert torch.equal(w4.dequantize(), qformats.gguf_dequantize("Q4_K", blocks, 16, 512))


def test_gguf_other_types_have_no_exact_int4_form():
    blocks = quants.quantize(np.ones((2, 32), np.float32), GT.Q8_0)
    with pytest.raises(ValueError, match="no exact int4"):
        qformats.gguf_block_to_int4("Q8_0", blocks, 2, 32)
    torch.testing.assert_close(qformats.gguf_dequantize("Q8_0", blocks, 2, 32), torch.ones(2, 32), atol=1e-4, rtol=0)


def test_gguf_weights_undo_llama_cpp_rotary_order(tmp_path):
    """q/k rows of a llama GGUF come back in HF order, exactly as transformers permutes them, in every
    form the forward reads them (int4 blocks, int8 rows, fp32)."""
    from opencoti.engine.model.gguf_weights import gguf_state
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    loaded = tiny_model("llama")  # 4 heads, 2 kv heads, head_dim 16, hidden 64
    cfg = loaded.hf_config
    rng = np.random.default_rng(2)
    q = rng.standard_normal((64, 64)).astype(np.float32)
    k = rng.standard_normal((32, 64)).astype(np.float32)
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    raw = {}
    for name, x in (("blk.0.attn_q.weight", q), ("blk.0.attn_k.weight", k), ("blk.0.ffn_down.weight", k)):
        raw[name] = quants.quantize(x, GT.Q4_1)
        writer.add_tensor(name, raw[name], raw_shape=raw[name].shape, raw_dtype=GT.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = gguf_state(path, cfg)
    proc = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 2})
    for name, hf, n in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", 64),
                        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", 32),
                        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", 32)):
        deq = qformats.gguf_dequantize("Q4_1", raw[name], n, 64).numpy()
        expected = proc.process(deq, name).weights
        want = torch.from_numpy(np.ascontiguousarray(expected))
        assert tuple(got[hf].shape) == (n, 64)
        assert isinstance(got[hf].to_int4(), qformats.Q4Blocks)
        assert torch.equal(got[hf].to_int4().dequantize(), want)
        assert torch.equal(got[hf].dequantize(), want)
        assert torch.equal(got[hf].dequantize_rows(3, 9), want[3:9])  # a chunk of rows, permuted alike
        w8 = got[hf].to_int8()
        assert (w8.dequantize() - want).abs().max() <= w8.scale.max() / 2 + 1e-6


# ------------------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("fmt", kernels.FORMATS)
def test_every_cpu_kernel_computes_its_format(fmt):
    w, b = _w(48, 64), torch.randn(48) * 0.1
    x = torch.randn(5, 64)
    ref = x @ kernels._float(kernels.to_format(w, fmt)).T + b
    built = 0
    for name in kernels.candidates(fmt, torch.device("cpu")):
        try:
            kern = kernels.build(name, w, b, act_dtype=torch.float32, device="cpu")
        except RuntimeError:  # not on this CPU (e.g. oneDNN bf16 without AVX-512)
            continue
        built += 1
        y = kern(x)
        assert y.shape == (5, 48) and y.dtype == torch.float32 and kern.out_features == 48
        tol = 1e-5 if fmt == "fp32" else 3e-2  # bf16 activations in the int kernels
        torch.testing.assert_close(y, ref, atol=tol, rtol=tol)
    assert built >= 1


def test_kernel_bytes_shrink_with_the_format():
    w = _w(64, 128)
    sizes = {f: kernels.build(kernels.candidates(f, torch.device("cpu"))[-1], w, None, act_dtype=torch.float32,
                              device="cpu").nbytes for f in kernels.FORMATS}
    assert sizes["fp32"] == 64 * 128 * 4
    assert sizes["fp32"] > sizes["bf16"] > sizes["int8"] > sizes["int4"]


def test_unknown_format_and_kernel_are_errors():
    with pytest.raises(ValueError, match="unknown weight format"):
        kernels.candidates("int3", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown kernel"):
        kernels.build("nope", _w(), None, act_dtype=torch.float32, device="cpu")


def test_cuda_candidates_are_the_cuda_kernels():
    cuda = torch.device("cuda")
    assert kernels.candidates("int4", cuda) == ("int4pack_cuda",)
    assert kernels.candidates("int8", cuda) == ("int8pack",)
    assert kernels.candidates("bf16", cuda) == ("matmul_bf16",)


# ------------------------------------------------------------------------------------------ selection
def test_select_takes_the_least_total_time_and_breaks_ties_by_preference():
    order = ("a", "b", "c")
    assert autotune.select({"a": [3.0, 3.0], "b": [1.0, 4.0], "c": [2.0, 2.0]}, order) == "c"
    assert autotune.select({"c": [1.0, 1.0], "b": [1.0, 1.0]}, order) == "b"
    with pytest.raises(ValueError):
        autotune.select({}, order)


def test_autotuner_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "autotune.json"
    t1 = autotune.Autotuner("cpu", torch.float32, cache, measure=True)
    name = t1.choose("bf16", 32, 64)
    assert name in kernels.candidates("bf16", torch.device("cpu"))
    t1.save()
    data = json.loads(cache.read_text())
    assert t1.key in data and any(e.startswith("bf16 32x64") for e in data[t1.key])
    t2 = autotune.Autotuner("cpu", torch.float32, cache, measure=True)
    monkeypatch.setattr(t2, "_time", lambda *a, **k: pytest.fail("measured again despite the cache"))
    assert t2.choose("bf16", 32, 64) == name


def test_autotuner_without_measuring_uses_the_first_kernel_that_builds(monkeypatch):
    tuner = autotune.Autotuner("cpu", torch.float32, None, measure=False)
    monkeypatch.setattr(kernels, "candidates", lambda fmt, dev: ("nope", "int8pack"))
    assert tuner.choose("int8", 16, 32) == "int8pack"


class _FakeTuner:
    def __init__(self, times: dict):
        self.times = times

    def timings(self, fmt, n, k):
        return {f"k_{fmt}": self.times[fmt]}

    def choose(self, fmt, n, k):
        return f"k_{fmt}"


@pytest.mark.parametrize("fmt,times,want", [
    ("int4", {"int8": [0.016, 0.045], "bf16": [0.010, 0.025]}, "bf16"),  # 16-bit head measured faster
    ("int4", {"int8": [0.010, 0.020], "bf16": [0.010, 0.025]}, "int8"),  # 8-bit faster: the default
    ("int8", {"int8": [0.016, 0.045], "bf16": [0.010, 0.025]}, "bf16"),
    ("bf16", {"int8": [0.001, 0.001], "bf16": [0.010, 0.025]}, "bf16"),  # float formats keep their own
    ("fp32", {"int8": [0.001, 0.001], "bf16": [0.001, 0.001]}, "fp32"),
])
def test_head_format_takes_16_bits_only_where_measured_faster(fmt, times, want):
    hf = tiny_model("llama").hf_config
    assert weights.head_format(_FakeTuner(times), fmt, hf) == want


def test_head_format_without_timings_keeps_the_8_bit_head():
    class Unmeasured(_FakeTuner):
        def timings(self, fmt, n, k):
            return {}

    assert weights.head_format(Unmeasured({}), "int4", tiny_model("llama").hf_config) == "int8"


# ------------------------------------------------------------------------------------------ formats on a model
def _on_format_grid(state: dict, fmt: str, tied: bool, head_fmt: str) -> dict:
    """The state dict with every projection weight replaced by what ``fmt`` stores (as fp32)."""
    out = dict(state)
    for name, w in state.items():
        is_head = name == "lm_head.weight" or (tied and name == "model.embed_tokens.weight")
        if not (name.endswith("_proj.weight") or is_head):
            continue
        f = head_fmt if is_head else fmt
        out[name] = kernels._float(kernels.to_format(w, f))  # bf16: fp16 kernels store more precision
    return out


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # q/k/v bias + untied head; tied head
def test_quantized_model_computes_its_weights(fmt, arch):
    """The quantized forward equals the fp32 forward of the weights the format stores (up to the
    bf16 activations of the int kernels), and weighs fewer bytes than fp32."""
    loaded = tiny_model(arch)
    kw = dict(dtype=torch.float32, device="cpu", max_positions=256, adapt_threads=False)
    model = weights.build_forward(loaded, weights=fmt, **kw)
    assert model.weights == fmt and model.weights_choice["reason"] == "requested"
    fp32 = weights.build_forward(loaded, weights="fp32", **kw)
    assert model.weight_bytes < fp32.weight_bytes
    head_fmt = model.weights_info["kernels"]["320x64"].split(":")[0]
    if fmt == "int4":  # the output projection stays in 8 bits, or 16 where that is measured faster
        assert head_fmt in ("int8", "bf16")
    else:
        assert head_fmt == fmt or (fmt == "int8" and head_fmt == "bf16")
    tied = loaded.hf_config.tie_word_embeddings
    grid = copy.copy(loaded)
    grid.state_dict = _on_format_grid(loaded.state_dict, fmt, tied, head_fmt)
    ref = weights.build_forward(grid, weights="fp32", **kw)
    ids = torch.tensor(loaded.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 3))
    got, want = model.dense_logits(ids), ref.dense_logits(ids)
    m = weights.gate_metrics(want, got, ids, 256)
    assert m["top1_agreement"] >= 0.9 and abs(m["ppl_ratio"] - 1) < 0.01, m  # random weights: small margins
    tol = 0.1 * float(want.abs().max())
    assert float((got - want).abs().max()) < tol


def test_auto_keeps_fp32_for_a_model_that_fits_in_cache():
    model = weights.build_forward(tiny_model("llama"), weights="auto", dtype=torch.float32, device="cpu",
                                  max_positions=64, adapt_threads=False)
    assert model.weights == "fp32" and "stay in cache" in model.weights_choice["reason"]


def _stand_in_times(table):
    """``choose.time_steps`` stand-in: {format: (decode_1, decode_8, prefill) seconds} for the built models."""
    def fake(models, rounds=choose.ROUNDS):
        return {f: choose.StepTimes(*table[f]) for f in models}
    return fake


def test_decision_rule_weighs_decode_over_a_mostly_shared_prompt():
    # the reference turn: 75 x t(1) + 75 x t(8) / 8 + 100 x t(prefill 128) / 128
    fast_decode = choose.StepTimes(0.010, 0.030, 0.500)   # 0.75 + 0.28 + 0.39 = 1.42 s
    fast_prefill = choose.StepTimes(0.025, 0.060, 0.150)  # 1.875 + 0.56 + 0.12 = 2.55 s
    assert fast_decode.cost() == pytest.approx(75 * 0.010 + 75 * 0.030 / 8 + 100 * 0.500 / 128)
    assert choose.decide({"bf16": fast_prefill, "int4": fast_decode}, {"bf16": True, "int4": True}) == "int4"
    # a format that fails the gate is never chosen, however fast; fp32 needs no gate
    assert choose.decide({"fp32": fast_prefill, "int4": fast_decode}, {"int4": False}) == "fp32"
    with pytest.raises(ValueError):
        choose.decide({"int4": fast_decode}, {"int4": False})


def test_a_measurement_under_load_is_not_kept():
    quiet = {"int4": choose.StepTimes(0.01, 0.03, 0.5, spread=1.05)}
    assert choose.disturbed(quiet, 0.3, cpus=2) is None
    assert "other processes used 1.10 of 2 cores" in choose.disturbed(quiet, 1.1, cpus=2)
    noisy = {"int4": choose.StepTimes(0.01, 0.03, 0.5, spread=1.6)}
    assert "spread" in choose.disturbed(noisy, 0.0, cpus=2)


def test_other_processes_cpu_is_measured_apart_from_ours():
    # busy CPU seconds of our cores went up by 3.0 in 2 s, of which 1.0 was this process: 1 core of others
    assert choose.others_load((10.0, 2.0), (13.0, 3.0), 2.0) == pytest.approx(1.0)
    assert choose.others_load((10.0, 2.0), (11.0, 3.0), 2.0) == 0.0  # only our own work
    assert choose.others_load(None, (11.0, 3.0), 2.0) == 0.0  # no /proc/stat: nothing known
    import time

    a = choose.cpu_seconds()
    c0 = time.process_time()
    while time.process_time() - c0 < 0.2:  # 0.2 s of our own CPU, however busy the machine is
        pass
    b = choose.cpu_seconds()
    assert a is not None and b is not None
    assert b[1] - a[1] >= 0.2  # our own CPU time, counted apart
    assert b[0] - a[0] >= (b[1] - a[1]) * 0.7  # and inside the busy time of our cores (ticks of 10 ms)


def test_real_steps_are_timed_for_every_format():
    model = weights.build_forward(tiny_model("llama"), weights="int8", dtype=torch.float32, device="cpu",
                                  max_positions=300, adapt_threads=False)
    times = choose.time_steps({"int8": model}, rounds=2)["int8"]
    assert 0 < times.decode_1 and 0 < times.decode_8 and 0 < times.prefill and times.spread >= 1.0
    d = times.as_dict()
    assert set(d) >= {"decode_1_ms", "decode_8_ms", "prefill_128_ms", "turn_cost_ms", "spread"}
    assert choose.StepTimes.from_dict(d).cost() == pytest.approx(times.cost(), rel=1e-2)


def test_real_steps_fit_a_short_context_window():
    model = weights.build_forward(tiny_model("llama"), weights="int8", dtype=torch.float32, device="cpu",
                                  max_positions=64, adapt_threads=False)
    times = choose.time_steps({"int8": model}, rounds=1)["int8"]  # CONTEXT and PREFILL exceed 64 positions
    assert times.decode_1 > 0 and times.prefill > 0


def test_auto_picks_the_cheapest_measured_format_that_passes_the_gate(monkeypatch, tmp_path):
    monkeypatch.setattr(weights, "AUTO_MIN_BYTES", 0)
    table = {"fp32": (0.03, 0.08, 0.2), "bf16": (0.02, 0.06, 0.15), "int8": (0.012, 0.04, 0.3),
             "int4": (0.010, 0.035, 0.4)}
    monkeypatch.setattr(choose, "time_steps", _stand_in_times(table))
    monkeypatch.setattr(choose, "others_load", lambda *a: 0.0)
    model = weights.build_forward(tiny_model("llama"), weights="auto", dtype=torch.float32, device="cpu",
                                  max_positions=300, adapt_threads=False, cache_dir=str(tmp_path))
    choice = model.weights_choice
    passed = {f for f, g in choice["gate"].items() if g["passed"]}
    assert set(choice["measured"]) == passed | {"fp32"}  # only formats that passed the gate run steps
    costs = {f: choose.StepTimes(*table[f]).cost() for f in choice["measured"]}
    assert model.weights == min(costs, key=costs.get)
    assert choice["reason"].startswith(f"auto: {model.weights} ran the reference agent turn fastest")
    assert "weighting" in choice and "disturbed" not in choice


def test_auto_keeps_a_quiet_choice_and_measures_a_disturbed_one_again(monkeypatch, tmp_path):
    monkeypatch.setattr(weights, "AUTO_MIN_BYTES", 0)
    monkeypatch.setattr(weights, "gate_metrics", lambda *a, **k: {"passed": True, "ppl_ratio": 1.0, "kl": 0.0,
                                                                   "top1_agreement": 1.0,
                                                                   "top1_agreement_clear": 1.0})
    kw = dict(weights="auto", dtype=torch.float32, device="cpu", max_positions=300, adapt_threads=False,
              cache_dir=str(tmp_path))
    calls = []
    table = {"fp32": (0.03, 0.08, 0.2), "bf16": (0.02, 0.06, 0.15), "int8": (0.012, 0.04, 0.3),
             "int4": (0.010, 0.035, 0.4)}

    def timed(models, rounds=choose.ROUNDS):
        calls.append(sorted(models))
        return _stand_in_times(table)(models)

    monkeypatch.setattr(choose, "time_steps", timed)
    monkeypatch.setattr(choose, "others_load", lambda *a: 1.9)  # a busy machine: used now, measured again next time
    first = weights.build_forward(tiny_model("llama"), **kw)
    assert first.weights == "int4" and "other processes" in first.weights_choice["disturbed"]
    monkeypatch.setattr(choose, "others_load", lambda *a: 0.0)
    second = weights.build_forward(tiny_model("llama"), **kw)
    assert len(calls) == 2 and second.weights == "int4" and "disturbed" not in second.weights_choice
    monkeypatch.setattr(weights, "gate_metrics", lambda *a, **k: pytest.fail("the gate ran again"))
    third = weights.build_forward(tiny_model("llama"), **kw)  # quiet and cached: no steps, no gate
    assert len(calls) == 2 and third.weights == "int4" and third.weights_choice["cached"]
    assert third.weights_choice["measured"] == second.weights_choice["measured"]


def test_auto_choice_follows_the_weights_not_the_name(monkeypatch, tmp_path):
    """The same weights loaded under two names (``--model file.gguf`` and the bundled default) share
    one measured choice; other weights (another seed) are measured on their own."""
    calls, kw = _counting_auto(monkeypatch, tmp_path)
    monkeypatch.setattr(choose, "others_load", lambda *a: 0.0)
    monkeypatch.setattr(weights, "gate_metrics", lambda *a, **k: {"passed": True, "ppl_ratio": 1.0, "kl": 0.0,
                                                                   "top1_agreement": 1.0,
                                                                   "top1_agreement_clear": 1.0})
    a, b, other = tiny_model("llama"), tiny_model("llama"), tiny_model("llama", seed=1)
    a.name, b.name = "model.Q4_1", "model"
    assert weights.build_forward(a, **kw).weights == "int4" and len(calls) == 1
    second = weights.build_forward(b, **kw)
    assert len(calls) == 1 and second.weights_choice["cached"]
    weights.build_forward(other, **kw)
    assert len(calls) == 2
    requant = tiny_model("llama")  # another quantization of one model: same embeddings, other projections
    name = "model.layers.0.self_attn.q_proj.weight"
    requant.state_dict = {**requant.state_dict, name: requant.state_dict[name] + 0.01}
    weights.build_forward(requant, **kw)
    assert len(calls) == 3


def _counting_auto(monkeypatch, tmp_path) -> tuple[list, dict]:
    """Stand-in step times that count the measurements, and ``build_forward``'s auto arguments."""
    monkeypatch.setattr(weights, "AUTO_MIN_BYTES", 0)
    calls: list = []
    table = {"fp32": (0.03, 0.08, 0.2), "bf16": (0.02, 0.06, 0.15), "int8": (0.012, 0.04, 0.3),
             "int4": (0.010, 0.035, 0.4)}
    monkeypatch.setattr(choose, "time_steps", lambda models, rounds=5: calls.append(1) or
                        _stand_in_times(table)(models))
    return calls, dict(weights="auto", dtype=torch.float32, device="cpu", max_positions=300, adapt_threads=False,
                       cache_dir=str(tmp_path))


def test_auto_on_a_busy_machine_uses_the_earlier_choice_until_a_quiet_start(monkeypatch, tmp_path):
    """A restart under load (after a crash, beside a test run) does not measure again: it uses the
    choice measured under load before (its KV files stay valid), and measures at a quiet start."""
    calls, kw = _counting_auto(monkeypatch, tmp_path)
    others = {"cores": 1.9}
    monkeypatch.setattr(choose, "others_load", lambda *a: others["cores"])
    monkeypatch.setattr(choose, "busy_now", functools.partial(choose.busy_now, window_s=0.0))
    first = weights.build_forward(tiny_model("llama"), **kw)
    assert len(calls) == 1 and "other processes" in first.weights_choice["disturbed"]
    for _ in range(3):
        again = weights.build_forward(tiny_model("llama"), **kw)
        assert again.weights == first.weights and again.weights_choice["cached"]
        assert "measured again at a quieter start" in again.weights_choice["reason"]
    assert len(calls) == 1
    others["cores"] = 0.0
    quiet = weights.build_forward(tiny_model("llama"), **kw)
    assert len(calls) == 2 and "disturbed" not in quiet.weights_choice


def test_auto_where_every_measurement_is_disturbed_keeps_the_last_one(monkeypatch, tmp_path):
    calls, kw = _counting_auto(monkeypatch, tmp_path)
    monkeypatch.setattr(choose, "busy_now", lambda cpus, window_s=0.5: None)  # quiet before it starts ...
    monkeypatch.setattr(choose, "others_load", lambda *a: 1.9)  # ... and busy while it measures
    for _ in range(choose.MAX_ATTEMPTS + 1):
        model = weights.build_forward(tiny_model("llama"), **kw)
    assert len(calls) == choose.MAX_ATTEMPTS and model.weights_choice["cached"]
    for _ in range(choose.RETRY_AFTER):  # kept for a while, then measured again
        weights.build_forward(tiny_model("llama"), **kw)
    assert len(calls) == choose.MAX_ATTEMPTS + 1


def test_auto_over_saved_kv_keeps_its_format_until_a_quiet_measurement_says_otherwise(monkeypatch, tmp_path):
    """A restart over a state directory whose KV files int8 computed: a disturbed last measurement
    (int4) is not redone (its answer could switch formats under the files); a kept quiet one wins."""
    calls, kw = _counting_auto(monkeypatch, tmp_path)
    monkeypatch.setattr(weights, "gate_metrics", lambda *a, **k: {"passed": True, "ppl_ratio": 1.0, "kl": 0.0,
                                                                   "top1_agreement": 1.0,
                                                                   "top1_agreement_clear": 1.0})
    monkeypatch.setattr(choose, "busy_now", lambda cpus, window_s=0.5: None)
    monkeypatch.setattr(choose, "others_load", lambda *a: 1.9)
    first = weights.build_forward(tiny_model("llama"), **kw)
    assert first.weights == "int4" and first.weights_choice["disturbed"] and len(calls) == 1
    again = weights.build_forward(tiny_model("llama"), **kw, saved_kv={"int8": 3, "bf16": 1})
    assert again.weights == "int8" and len(calls) == 1
    assert "3 KV file(s) saved in the state directory" in again.weights_choice["reason"]
    monkeypatch.setattr(choose, "others_load", lambda *a: 0.0)
    quiet = weights.build_forward(tiny_model("llama"), **kw)  # no saved KV: measured, quiet, kept
    assert quiet.weights == "int4" and len(calls) == 2 and "disturbed" not in quiet.weights_choice
    kept = weights.build_forward(tiny_model("llama"), **kw, saved_kv={"int8": 3})
    assert kept.weights == "int4" and kept.weights_choice["cached"] and len(calls) == 2
    unknown = weights.build_forward(tiny_model("llama"), **kw, saved_kv={"fp8": 2})  # not a format here
    assert unknown.weights == "int4"


def test_saved_weight_formats_counts_complete_kv_files(tmp_path):
    from opencoti.engine.persist import kvfile

    k = torch.zeros(2, 3, 1, 4)
    (tmp_path / "kv").mkdir()
    for name, fmt in (("1.kv", "int4"), ("2.kv", "int4"), ("3.kv", "bf16")):
        kvfile.write_kv(tmp_path / "kv" / name, k, k, 0, [1, 2, 3], extra={"kv": {"weights": fmt}})
    (tmp_path / "kv" / "4.kv.tmp").write_bytes(b"half")  # half-written: not counted
    (tmp_path / "kv" / "5.kv").write_bytes(b"not a kv file")
    assert kvfile.saved_weight_formats(tmp_path / "kv", tmp_path / "missing") == {"int4": 2, "bf16": 1}


def test_gate_metrics_pass_and_fail():
    ids = torch.tensor([1, 2, 3, 4, 5])
    ref = torch.nn.functional.one_hot(torch.tensor([2, 3, 4, 5, 0]), 8).float() * 5
    assert weights.gate_metrics(ref, ref.clone(), ids, 256)["passed"]
    bad = ref.roll(1, dims=-1)
    m = weights.gate_metrics(ref, bad, ids, 256)
    assert not m["passed"] and m["top1_agreement"] == 0.0 and m["ppl_ratio"] > 1.03


def test_bad_weights_value_is_a_clear_error():
    with pytest.raises(InvalidRequestError, match="weights must be auto\\|fp32\\|bf16\\|int8\\|int4"):
        EngineConfig(weights="int3")
    with pytest.raises(ValueError, match="weights must be one of"):
        weights.build_forward(tiny_model("llama"), weights="fp8", dtype=torch.float32, device="cpu",
                              max_positions=8)
    assert EngineConfig().weights == "auto"


# ------------------------------------------------------------------------------------------ threads
def _cgroup(tmp_path, cpu_max: str):
    (tmp_path / "sys" / "a").mkdir(parents=True, exist_ok=True)
    (tmp_path / "sys" / "a" / "cpu.max").write_text(cpu_max + "\n")
    (tmp_path / "cg").write_text("0::/a\n")
    return threads._cgroup_quota_cpus(tmp_path / "sys", tmp_path / "cg")


def test_cgroup_quota(tmp_path):
    assert _cgroup(tmp_path, "150000 100000") == 1.5
    assert _cgroup(tmp_path, "max 100000") is None
    assert threads.usable_cpus() >= 1


def test_thread_adapter_moves_off_a_busy_core_and_back():
    calls = []
    ad = threads.ThreadAdapter(2, set_threads=calls.append)
    cost = {1: 0.016, 2: 0.010}  # quiet: two threads are faster

    def run(steps):
        for _ in range(steps):
            n = ad.before(1)
            ad.after(1, cost[n])

    run(40)
    assert ad.best[0] == 2 and ad.current == 2
    cost = {1: 0.020, 2: 0.050}  # a neighbour takes one core: the 2-thread team waits at every barrier
    run(12)
    assert ad.best[0] == 1, ad.state()
    run(200)
    assert ad.current in (1, 2) and ad.best[0] == 1
    before = ad.steps
    cost = {1: 0.016, 2: 0.010}  # the neighbour leaves
    run(300)
    assert ad.best[0] == 2, ad.state()
    assert ad.steps - before == 300 and calls[0] == 2
    share_on_best = sum(1 for _ in range(100) if (ad.before(1), ad.after(1, cost[ad.current]))[0] == 2) / 100
    assert share_on_best > 0.9  # exploration stays rare once it settles


def test_thread_adapter_with_one_core_never_switches():
    ad = threads.ThreadAdapter(1, set_threads=lambda n: None)
    for _ in range(20):
        assert ad.before(1) == 1
        ad.after(1, 0.01)
    assert ad.switches == 0


# ------------------------------------------------------------------------------------------ engine
def test_engine_runs_a_quantized_format_and_reports_it():
    from opencoti.engine import Engine, SamplingParams

    eng = Engine(EngineConfig(model="tiny:llama", weights="int4", kv_budget_tokens=1024))
    try:
        r = eng.generate([1, 2, 3, 4], params=SamplingParams.greedy(6, ignore_eos=True))
        assert len(r.token_ids) == 6
        info = eng.weights_info()
        assert info["format"] == "int4" and info["choice"]["reason"] == "requested"
        assert info["weight_bytes"] == eng.model.weight_bytes
        assert info["threads"]["max_threads"] >= 1  # no num_threads given: the adapter runs
        assert info["native"]["available"] and info["native"]["reason"].startswith("ok")
        # the fused step runs the layers' projections (the head is called apart: it may be measured faster in bf16)
        d = eng.model.dims
        layers = {s: k for s, k in info["kernels"].items() if s != f"{d.vocab_size}x{d.hidden_size}"}
        assert info["fused_decode_layers"] == all(k.startswith("int4:native") or k.startswith("int8:native")
                                                  for k in layers.values())
    finally:
        eng.shutdown()
    fixed = Engine(EngineConfig(model="tiny:llama", num_threads=1, kv_budget_tokens=1024))
    try:
        assert "threads" not in fixed.weights_info() and fixed.weights_info()["format"] == "fp32"
    finally:
        fixed.shutdown()


def test_a_preferred_kernel_is_taken_within_the_margin(monkeypatch):
    tuner = autotune.Autotuner("cpu", torch.float32, None, measure=True)
    monkeypatch.setattr(kernels, "candidates", lambda fmt, dev: ("native_q4", "int4pack_cpu"))
    times = {"native_q4": [0.052, 0.244, 2.96], "int4pack_cpu": [0.064, 0.196, 2.745]}  # ms, 3072x576, 2 threads
    monkeypatch.setattr(tuner, "timings", lambda fmt, n, k: times)
    assert tuner.choose("int4", 3072, 576) == "int4pack_cpu"  # the least total time
    assert tuner.choose("int4", 3072, 576, prefer="native_q4") == "native_q4"  # within 1.25x of it
    times["native_q4"] = [0.05, 0.4, 4.0]  # 1.48x the fastest: the fastest it is
    assert tuner.choose("int4", 3072, 576, prefer="native_q4") == "int4pack_cpu"


@pytest.mark.parametrize("dtype,arch,fused", [(torch.float32, "llama", True), (torch.bfloat16, "llama", False),
                                              (torch.float32, "qwen3", False)])
def test_layers_prefer_the_native_kernel_where_decode_steps_can_run_fused(dtype, arch, fused):
    from opencoti.engine.model.tiny import tiny_config

    hf = tiny_config(arch)
    asked = []

    class Tuner:
        def choose(self, fmt, n, k, prefer=None):
            asked.append(((n, k), prefer))
            return "x"

    choose_kernel = weights.kernel_chooser(Tuner(), hf, "cpu", dtype)
    layer = weights._projection_shapes(hf)[0]
    head = (hf.vocab_size, hf.hidden_size)
    for fmt in ("int4", "int8", "bf16"):
        choose_kernel(fmt, *layer)
    choose_kernel("int4", *head)
    want = {"int4": "native_q4", "int8": "native_q8"}
    assert [p for _, p in asked[:3]] == ([want["int4"], want["int8"], None] if fused else [None, None, None])
    assert asked[3] == (head, None)  # the head never runs in the fused call


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_4bit_rows_become_native_blocks_by_moving_bytes(type_name):
    """Q4_0 / Q4_1 rows are the native int4 layout byte for byte (the same values); Q4_K's sub-block
    scales and offsets are rounded to fp16: each value within 2^-11 of the block's scale and offset."""
    n, k = 6, 512
    raw = random_blocks(type_name, n, k, seed=3)
    want = torch.from_numpy(quants.dequantize(raw, GT[type_name]).astype(np.float32).reshape(n, k))
    blocks = qformats.gguf_to_q4_blocks(type_name, raw, n, k)
    assert blocks.shape == (n, k) and tuple(blocks.blocks.shape) == (n, k // 32 * 20)
    got = blocks.dequantize()
    if type_name == "Q4_K":
        assert (got - want).abs().max() <= 2 ** -10 * want.abs().max()
    else:
        assert torch.equal(got, want)
    # the native kernel takes them as they are, and computes what it computes from the unpacked weight
    from opencoti.engine import native
    if native.lib() is not None:
        xs = torch.randn(3, k, generator=torch.Generator().manual_seed(4))
        direct = kernels.build("native_q4", blocks, None, act_dtype=torch.float32, device="cpu")
        repacked = kernels.build("native_q4", blocks.to_int4(), None, act_dtype=torch.float32, device="cpu")
        if type_name != "Q4_K":  # (Q4_K's offsets round differently through the fp32 unpacked form)
            assert torch.equal(direct.blocks, repacked.blocks)
        torch.testing.assert_close(direct(xs), xs @ got.T, atol=1e-3, rtol=1e-3)
    # fused rows (q/k/v, gate/up) stay blocks
    both = qformats.cat_rows([blocks, blocks])
    assert isinstance(both, qformats.Q4Blocks) and both.shape == (2 * n, k)
    with pytest.raises(ValueError, match="no exact int4"):
        qformats.gguf_to_q4_blocks("Q6_K", raw, n, k)


def test_gate_near_ties_cannot_fail_a_format():
    """Positions where the reference's top two are within GATE_CLEAR_MARGIN do not count for top-1;
    the KL divergence weighs them by probability, so a flipped near-tie costs almost nothing."""
    ids = torch.tensor([1, 2, 3, 4, 5, 6])
    ref = torch.zeros(6, 8)
    ref[:, 2], ref[:, 3] = 3.0, 2.999  # near ties everywhere
    flipped = ref.clone()
    flipped[:, 3] = 3.001  # every greedy token flips
    m = weights.gate_metrics(ref, flipped, ids, 256)
    assert m["top1_agreement"] == 0.0 and m["clear_positions"] == 0
    assert m["kl"] < 1e-5 and m["passed"], m
    # a clear position that flips fails it
    ref[0, 2] = 8.0
    flipped[0, 2], flipped[0, 5] = 0.0, 8.0
    m = weights.gate_metrics(ref, flipped, ids, 256)
    assert m["clear_positions"] == 1 and m["top1_agreement_clear"] == 0.0 and not m["passed"]

"""FlashInfer backend without a GPU: import guard, selection, planning, workspace sizing, and the
backend's own code (permutation, empty-group compaction, merges) run on the torch reference
kernels against the torch backend. The real kernels are checked by benchmarks/gpu_check.py."""

from __future__ import annotations

import ast
import importlib.util
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from opencoti.engine import SamplingParams
from opencoti.engine.attention import select_backend
from opencoti.engine.attention.base import build_metadata
from opencoti.engine.attention.cascade import build_cascade_plan
from opencoti.engine.attention.flashinfer_backend import FlashInferBackend, use_tensor_cores_for
from opencoti.engine.attention.flashinfer_plan import (INT_WORKSPACE_BYTES, MIB, WORKSPACE_ENV, PagedArrays,
                                                       build_step_plan, check_paged_arrays, dfs_row_permutation,
                                                       float_workspace_bytes, paged_arrays, workspace_device_bytes)
from opencoti.engine.attention.flashinfer_reference import ReferenceKernels
from opencoti.engine.attention.torch_backend import TorchAttentionBackend
from opencoti.engine.errors import InvalidRequestError
from opencoti.engine.kv.pages import PagePool

ROOT = Path(__file__).resolve().parents[2]
ATTENTION = ROOT / "opencoti" / "engine" / "attention"
H, HKV, D = 6, 2, 16


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GPU_CHECK = _gpu_check()


def _reference_backend(**kw) -> FlashInferBackend:
    return FlashInferBackend("cpu", kernels=ReferenceKernels(), **kw)


# ============================================================================ import guard & selection
@pytest.mark.parametrize("module", ["flashinfer_backend.py", "flashinfer_plan.py", "flashinfer_reference.py",
                                    "__init__.py"])
def test_no_module_level_flashinfer_import(module):
    tree = ast.parse((ATTENTION / module).read_text())
    for node in tree.body:  # module level only; imports inside functions are the lazy ones
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        assert not any(n.split(".")[0] == "flashinfer" for n in names), f"{module} imports flashinfer at module level"


def test_cpu_selection():
    cpu = torch.device("cpu")
    assert isinstance(select_backend("auto", cpu), TorchAttentionBackend)
    with pytest.raises(InvalidRequestError, match="needs a CUDA device"):
        select_backend("flashinfer", cpu)
    with pytest.raises(InvalidRequestError, match="CUDA device"):
        FlashInferBackend("cpu")  # no kernels given: the real ones need CUDA


def test_engine_on_cpu(make_engine):
    eng = make_engine()
    assert isinstance(eng.backend, TorchAttentionBackend)
    assert eng.generate([5, 6, 7], params=SamplingParams.greedy(3, ignore_eos=True)).token_ids
    with pytest.raises(InvalidRequestError, match="CUDA"):
        make_engine(attention_backend="flashinfer")


def test_broken_flashinfer_install(monkeypatch):
    """CUDA + a flashinfer that does not import: 'auto' falls back to torch, by name it says why."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: types.SimpleNamespace(name=name) if name == "flashinfer" else real_find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ImportError
    cuda = torch.device("cuda")
    assert isinstance(select_backend("auto", cuda), TorchAttentionBackend)
    with pytest.raises(InvalidRequestError, match="flashinfer-python"):
        select_backend("flashinfer", cuda)


def test_package_imports_without_flashinfer():
    code = ("import sys; sys.modules['flashinfer'] = None\n"
            "import opencoti, opencoti.engine\n"
            "from opencoti.engine.attention import flashinfer_backend, flashinfer_plan, flashinfer_reference\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# ============================================================================ planning
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_arrays_last_page_len(page_size):
    rng = random.Random(page_size)
    kv_lens = [1, page_size, page_size + 1, 3 * page_size, 5 * page_size - 1] + [rng.randint(1, 90) for _ in range(6)]
    tables = [list(range(100 * i, 100 * i + -(-n // page_size))) for i, n in enumerate(kv_lens)]
    qo_lens = [1] * len(kv_lens)
    arrays = paged_arrays(tables, kv_lens, qo_lens, page_size)
    check_paged_arrays(arrays, page_size)
    assert arrays.kv_lens(page_size) == kv_lens
    last = arrays.kv_last_page_len.tolist()
    assert all(1 <= x <= page_size for x in last)
    assert last[1] == page_size and last[3] == page_size  # a full last page is page_size, never 0
    assert arrays.kv_indices.tolist() == [p for t in tables for p in t]
    # the private remainder from a page offset, in another order
    start = [0, 0, 1, 2, 3] + [0] * 6
    sub = paged_arrays(tables, kv_lens, qo_lens, page_size, page_start=start, order=[4, 3, 2])
    assert sub.kv_indices.tolist() == tables[4][3:] + tables[3][2:] + tables[2][1:]
    assert sub.kv_lens(page_size) == [kv_lens[s] - start[s] * page_size for s in (4, 3, 2)]
    with pytest.raises(ValueError, match="no tokens left"):
        paged_arrays(tables, kv_lens, qo_lens, page_size, page_start=[1] + [0] * 10)  # kv_len 1: nothing after page 0
    with pytest.raises(ValueError, match="page table covers"):
        paged_arrays([[1]], [page_size + 1], [1], page_size)


def test_check_paged_arrays_rejects_what_flashinfer_cannot_take():
    good = PagedArrays(torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32),
                       torch.tensor([5, 6, 9], dtype=torch.int32), torch.tensor([4, 1], dtype=torch.int32))
    check_paged_arrays(good, 4, num_pages=10)
    bad = {
        "last_page_len 0 (an empty group)": good._replace(kv_last_page_len=torch.tensor([4, 0], dtype=torch.int32)),
        "last_page_len > page_size": good._replace(kv_last_page_len=torch.tensor([5, 1], dtype=torch.int32)),
        "a request with no pages": good._replace(kv_indptr=torch.tensor([0, 3, 3], dtype=torch.int32)),
        "int64 arrays": good._replace(kv_indices=good.kv_indices.long()),
        "indptr/indices mismatch": good._replace(kv_indices=torch.tensor([5, 6], dtype=torch.int32)),
    }
    for why, arrays in bad.items():
        with pytest.raises(ValueError):
            check_paged_arrays(arrays, 4)
        assert why
    with pytest.raises(ValueError, match="out of range"):
        check_paged_arrays(good, 4, num_pages=9)


def test_plain_step_kinds():
    tables, kv_lens = [[1, 2], [3]], [7, 2]
    assert build_step_plan(tables, kv_lens, [1, 1], 4).kind == "decode"
    plan = build_step_plan(tables, kv_lens, [3, 1], 4)
    assert plan.kind == "prefill" and plan.num_rows == 4 and plan.arrays.qo_indptr.tolist() == [0, 3, 4]


def test_dfs_row_permutation():
    assert dfs_row_permutation([0, 1, 2], [1, 3, 2]) == (None, None)
    perm, inv = dfs_row_permutation([2, 0, 1], [1, 3, 2])
    assert perm.tolist() == [4, 5, 0, 1, 2, 3]
    q = torch.arange(6)
    assert torch.equal(q[perm][inv], q)
    with pytest.raises(ValueError):
        dfs_row_permutation([0, 0, 1], [1, 3, 2])


def test_cascade_step_plan_compacts_empty_groups():
    # sequences 0,1,2 share pages [10, 11]; 0,1 further share [12]; 3 is in no pool
    tables = [[10, 11, 12, 20], [10, 11, 12, 21, 22], [10, 11, 30], [40, 41]]
    kv_lens = [15, 18, 12, 5]
    qo_lens = [1, 1, 3, 1]
    cplan = build_cascade_plan(tables, kv_lens, qo_lens, page_size=4)
    plan = build_step_plan(tables, kv_lens, qo_lens, 4, cplan)
    assert plan.kind == "cascade" and len(plan.levels) == 3 and not plan.is_dense
    with pytest.raises(ValueError):
        plan.multilevel_arrays()
    order = cplan.order
    dfs_rows = {}  # sequence -> its rows in DFS order
    r = 0
    for s in order:
        dfs_rows[s] = list(range(r, r + qo_lens[s]))
        r += qo_lens[s]
    perm, _ = dfs_row_permutation(order, qo_lens)
    assert (plan.perm is None) == (perm is None)
    lv0, lv1, private = plan.levels
    # level 0: sequence 3's empty group is dropped; the group's 5 rows attend to pages [10, 11]
    assert lv0.rows.tolist() == sorted(dfs_rows[0] + dfs_rows[1] + dfs_rows[2])
    assert lv0.arrays.qo_indptr.tolist() == [0, 5] and lv0.arrays.kv_indices.tolist() == [10, 11]
    assert lv0.arrays.kv_last_page_len.tolist() == [4] and not lv0.causal
    # level 1: only sequences 0 and 1 (group [12]); 2 and 3 have empty groups
    assert lv1.rows.tolist() == sorted(dfs_rows[0] + dfs_rows[1])
    assert lv1.arrays.kv_indptr.tolist() == [0, 1] and lv1.arrays.kv_indices.tolist() == [12]
    # private level: every sequence's own pages, in DFS order, causal, valid last_page_len
    assert private.rows is None and private.causal and not private.is_decode
    expected = paged_arrays(tables, kv_lens, qo_lens, 4, page_start=cplan.private_start, order=order)
    for a, b in zip(private.arrays, expected):
        assert torch.equal(a, b)
    for lv in plan.levels:
        check_paged_arrays(lv.arrays, 4)


def test_dense_cascade_plan_maps_onto_multilevel_wrapper():
    tables = [[1, 2, 3, 10], [1, 2, 3, 11], [1, 2, 4, 12], [1, 2, 4, 13]]
    cplan = build_cascade_plan(tables, [14] * 4, [1] * 4, 4)
    plan = build_step_plan(tables, [14] * 4, [1] * 4, 4, cplan)
    assert plan.is_dense and plan.perm is None and len(plan.levels) == 3
    arrays = plan.multilevel_arrays()
    assert [a.qo_indptr.tolist() for a in arrays] == [[0, 4], [0, 2, 4], [0, 1, 2, 3, 4]]
    assert [a.kv_indices.tolist() for a in arrays] == [[1, 2], [3, 4], [10, 11, 12, 13]]


# ============================================================================ the backend on reference kernels
def _case(page_size: int, levels: int, prefill_every, seed: int, dense: bool = False):
    rng = random.Random(seed * 100 + levels * 10 + page_size)
    torch.manual_seed(seed)
    kv = PagePool(num_layers=1, num_pages=2048, page_size=page_size, num_kv_heads=HKV, head_dim=D, dtype=torch.float32)
    kv.k_cache.normal_()
    kv.v_cache.normal_()
    entries = GPU_CHECK.random_pool_tree_batch(rng, kv, levels, rng.randint(4, 9), prefill_every=prefill_every,
                                               dense=dense)
    T = sum(e.num_new for e in entries)
    return kv, entries, torch.randn(T, H, D), torch.randn(T, HKV, D), torch.randn(T, HKV, D)


def _run(backend, kv, entries, q, k, v, layers: int = 1):
    meta = build_metadata(entries, kv.page_size)
    backend.plan(meta, num_heads=H, num_kv_heads=HKV, head_dim=D)
    kc, vc = kv.k_cache[0].clone(), kv.v_cache[0].clone()
    outs = [backend.forward(i, q, k, v, kc, vc, meta, 0.25) for i in range(layers)]
    return outs[0], meta, kc


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("levels,prefill_every,cascade,impl", [
    (0, 1, "off", "levels"),  # plain prefill: chunks over cached prefixes
    (2, None, "off", "levels"),  # plain decode over shared pages
    (1, None, "on", "levels"),
    (3, 3, "on", "levels"),  # 3 levels, mixed decode/prefill, sessions in no pool: compaction
    (3, None, "on", "multilevel"),  # sparse: multilevel falls back to our levels
])
def test_backend_equals_torch_backend(page_size, levels, prefill_every, cascade, impl):
    kv, entries, q, k, v = _case(page_size, levels, prefill_every, seed=levels + page_size)
    ref, _, kc_ref = _run(TorchAttentionBackend(cascade="off"), kv, entries, q, k, v)
    out, meta, kc = _run(_reference_backend(cascade=cascade, cascade_impl=impl), kv, entries, q, k, v)
    step = meta.backend_state["flashinfer"]["step"]
    expected_kind = "cascade" if cascade == "on" else ("decode" if prefill_every is None else "prefill")
    assert step.kind == expected_kind
    if cascade == "on" and levels == 3:
        assert any(lv.rows is not None for lv in step.levels)  # an empty group was compacted away
    assert torch.equal(kc, kc_ref)  # the new K/V land where the torch backend puts them
    assert (out - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("page_size", [1, 16])
def test_multilevel_wrapper_path_on_dense_tree(page_size):
    kv, entries, q, k, v = _case(page_size, 2, 3, seed=7, dense=True)
    ref, _, _ = _run(TorchAttentionBackend(cascade="off"), kv, entries, q, k, v)
    out, meta, _ = _run(_reference_backend(cascade="on", cascade_impl="multilevel"), kv, entries, q, k, v)
    state = meta.backend_state["flashinfer"]
    assert state["step"].is_dense and "multilevel" in state
    assert (out - ref).abs().max().item() <= 1e-5


def test_kernels_planned_once_per_step_and_reused():
    kv, entries, q, k, v = _case(16, 2, None, seed=3)
    be = _reference_backend(cascade="on", min_saved_tokens=0)
    _run(be, kv, entries, q, k, v, layers=4)
    created = list(be.kernels.created)
    assert be.last_used_cascade and created
    assert all(w.num_plans == 1 and w.num_runs == 4 for w in created)
    _run(be, kv, entries, q, k, v, layers=4)
    assert be.kernels.created == created  # the wrappers persist across steps, re-planned
    assert all(w.num_plans == 2 for w in created)
    assert be.workspace_device_bytes == be.workspace_bytes + len(created) * INT_WORKSPACE_BYTES


def test_cascade_auto_threshold_and_off():
    kv, entries, q, k, v = _case(16, 1, None, seed=1)
    be = _reference_backend(cascade="auto", min_saved_tokens=10**9)
    _run(be, kv, entries, q, k, v)
    assert not be.last_used_cascade and be.num_cascade_steps == 0
    be.cascade = "on"
    _run(be, kv, entries, q, k, v)
    assert be.last_used_cascade and be.num_cascade_steps == 1


def test_float32_falls_back_to_torch_backend():
    kv, entries, q, k, v = _case(4, 2, 3, seed=2)
    ref, _, kc_ref = _run(TorchAttentionBackend(cascade="on"), kv, entries, q, k, v)
    be = FlashInferBackend("cpu", cascade="on", kernels=ReferenceKernels(supported_dtypes=(torch.bfloat16,)))
    out, _, kc = _run(be, kv, entries, q, k, v, layers=2)
    assert torch.equal(out, ref) and torch.equal(kc, kc_ref)
    assert be.num_fallback_steps == 1 and not be.kernels.created


def test_use_tensor_cores_for():
    assert use_tensor_cores_for(9, 3)  # SmolLM2: group 3 has no CUDA-core decode kernel
    assert use_tensor_cores_for(28, 4)  # group 7
    assert use_tensor_cores_for(64, 8)  # group 8
    assert not use_tensor_cores_for(32, 8) and not use_tensor_cores_for(32, 32) and not use_tensor_cores_for(4, 2)
    assert use_tensor_cores_for(32, 32, True) and not use_tensor_cores_for(9, 3, False)
    with pytest.raises(ValueError):
        use_tensor_cores_for(9, 3, "yes")


def test_workspace_sizing(monkeypatch):
    monkeypatch.delenv(WORKSPACE_ENV, raising=False)
    assert float_workspace_bytes() == 128 * MIB
    assert float_workspace_bytes(100.5) == 101 * MIB
    monkeypatch.setenv(WORKSPACE_ENV, "256")
    assert float_workspace_bytes() == 256 * MIB
    assert float_workspace_bytes(64) == 64 * MIB  # the argument wins
    for bad in ("8", "lots"):
        monkeypatch.setenv(WORKSPACE_ENV, bad)
        with pytest.raises(ValueError, match=WORKSPACE_ENV):
            float_workspace_bytes()
    with pytest.raises(ValueError, match="workspace_mib"):
        float_workspace_bytes(8192)
    assert workspace_device_bytes(128 * MIB, 3) == 128 * MIB + 3 * INT_WORKSPACE_BYTES
    monkeypatch.delenv(WORKSPACE_ENV)
    assert _reference_backend(workspace_mib=32).workspace_bytes == 32 * MIB


# ============================================================================ engine and the GPU check script
def test_engine_greedy_with_reference_kernels_equals_torch(make_engine):
    prefix = [(7 * j) % 250 + 1 for j in range(90)]
    outs = {}
    for name in ("torch", "flashinfer"):
        eng = make_engine(cascade="on")
        if name == "flashinfer":
            GPU_CHECK.install_backend(eng, _reference_backend(cascade="on", min_saved_tokens=0))
        root = eng.create_pool(tokens=prefix[:50])
        inner = eng.fork_pool(root.pool_id, tokens=prefix)
        streams = [eng.stream(prefix + [i + 1] * (i + 1), pool_id=inner.pool_id if i % 3 else root.pool_id,
                              params=SamplingParams.greedy(8, ignore_eos=True)) for i in range(5)]
        streams.append(eng.stream([3, 4, 5], params=SamplingParams.greedy(8, ignore_eos=True)))
        outs[name] = []
        for s in streams:
            list(s)
            outs[name].append(s.result.token_ids)
        assert eng.backend.num_cascade_steps > 0
    assert outs["flashinfer"] == outs["torch"]


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "RESULT: PASS" in proc.stdout
    import json

    report = json.loads(out.read_text())
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert "FAIL" not in statuses.values()
    assert statuses["engine/greedy pooled == unpooled"] == "PASS"
    assert statuses["engine/attention self-check"] == "PASS"
    assert any(n.startswith("kernels/cascade-mixed levels=3") for n in statuses)
    assert [r["sessions"] for r in report["decode"]] == [1, 4]



def test_gpu_bundle_keeps_the_attention_sources():
    spec = importlib.util.spec_from_file_location("gpu_bundle", ROOT / "benchmarks" / "gpu_bundle.py")
    bundle = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bundle)
    kept = ["flashinfer/prefill.py", "flashinfer/fused_moe/backends/x.py", "flashinfer/data/include/flashinfer/a.cuh",
            "flashinfer/data/cutlass/include/cute/t.hpp", "flashinfer/data/csrc/batch_prefill.cu",
            "flashinfer/data/csrc/batch_prefill_paged_kernel_inst.jinja", "flashinfer/data/csrc/tvm_ffi_utils.h",
            "flashinfer/jit/configs.json", "tvm_ffi/include/tvm/ffi/c_api.h", "flashinfer_python-0.7.4.dist-info/RECORD"]
    dropped = ["flashinfer/data/csrc/fused_moe/k.cu", "flashinfer/cake_fmha/csrc/x.cu",
               "flashinfer/experimental/cake/k.cuh"]
    assert all(bundle.keep(p) for p in kept)
    assert not any(bundle.keep(p) for p in dropped)

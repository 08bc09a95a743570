"""One effective-facts record per device (backends/device_facts): an emulated card's launch
tables, shared-memory limit, SM count, fp8 support and memory, read by the kernels exactly as
a real card's, checked without a GPU (the real card's facts are a fake H200 at cuda:0)."""
from __future__ import annotations

import os
import sys
import threading
from types import SimpleNamespace

import attrs
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from triton_env import _triton_interpreter  # noqa: E402,F401 (autouse fixture)

from capdispatch.backends import device_facts as DF  # noqa: E402
from capdispatch.backends import launch_limits as LL  # noqa: E402
from capdispatch.backends.sparse_attention import launch_table as LT  # noqa: E402
from capdispatch.capabilities import catalog  # noqa: E402
from capdispatch.capabilities.effective import DeviceFacts, facts_of  # noqa: E402

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)   # never touched: the facts are faked
GIB = 2 ** 30


def _real(card, index):
    return attrs.evolve(facts_of(catalog.simulate(card), f"cuda:{index}"), label=f"cuda:{index}", card=None)


def _emu(card, index=0):
    return facts_of(catalog.simulate(card), f"cuda:{index}")


@pytest.fixture
def h200(monkeypatch):
    """cuda:0 and cuda:1 are H200s; no emulation before or after the test."""
    monkeypatch.setattr(DF, "_real", {0: _real("h200", 0), 1: _real("h200", 1)})
    DF.stop_emulating()
    yield
    DF.stop_emulating()


def test_rtx_3080_facts():
    f = _emu("rtx-3080")
    assert (f.cc, f.sm_count, f.smem_optin_per_block, f.memory, f.fp8) == ((8, 6), 68, 99 * 1024, 10 * GIB, False)
    assert f.emulated and f.label == "emu:rtx-3080@cuda:0" and f.index == 0
    assert f.to_dict()["cc"] == "8.6" and f.to_dict()["emulated"]
    five = _emu("rtx-5090")
    assert five.fp8 and five.cc == (12, 0) and five.sm_count == 170
    assert not _real("h200", 0).emulated
    cpu = facts_of(catalog.simulate("rtx-3080"), "cpu")
    assert cpu.index is None and cpu.emulated


def test_facts_of_refuses_a_device_it_cannot_run_on():
    with pytest.raises(ValueError, match="cpu or cuda:N"):
        facts_of(catalog.simulate("rtx-3080"), "gpu0")


def test_emulation_is_per_device_and_process_wide(h200):
    assert DF.facts(CUDA0).sm_count == 132 and DF.facts(CUDA0).fp8
    DF.emulate(_emu("rtx-3080", 0))
    assert DF.facts(CUDA0).sm_count == 68 and DF.capability(CUDA0) == (8, 6)
    assert not DF.native_fp8(CUDA0) and not DF.native_fp8(torch.device("cpu"))
    assert DF.facts(CUDA1).sm_count == 132          # another device answers for itself
    assert DF.real(0).sm_count == 132               # what the kernels are compiled for
    seen = []
    t = threading.Thread(target=lambda: seen.append(DF.facts(CUDA0).sm_count))   # every thread of the process
    t.start()
    t.join()
    assert seen == [68]
    DF.stop_emulating(0)
    assert DF.facts(CUDA0).sm_count == 132


def test_emulate_refuses_what_it_cannot_install():
    with pytest.raises(ValueError, match="runs on a CUDA device"):
        DF.emulate(facts_of(catalog.simulate("rtx-3080"), "cpu"))
    with pytest.raises(ValueError, match="sm_count is unknown"):
        DF.emulate(facts_of(catalog.simulate("sm_86"), "cuda:0"))
    with pytest.raises(TypeError):
        DF.emulate("rtx-3080")


def test_emulate_card_installs_a_catalog_card_through_the_adapters_face(h200):
    """extend.emulate_card: what the SGLang plugin's emulated rank calls (it imports the face only)."""
    from capdispatch import extend
    f = extend.emulate_card(catalog.simulate("rtx-3080"), 1)
    assert f.label == "emu:rtx-3080@cuda:1" and DF.facts(CUDA1).sm_count == 68 and DF.facts(CUDA0).sm_count == 132
    with pytest.raises(ValueError, match="needs a catalog card"):
        extend.emulate_card(attrs.evolve(catalog.simulate("h200"), id="cuda:0", probe="torch"), 0)
    assert DF.emulated(0) is None


def test_split_counts_read_the_emulated_sm_count(h200):
    from capdispatch.backends.sparse_attention import kernels as K
    args = (CUDA0, 2, 64, 2048)                    # 2 decode tokens, 64 heads, 2048 index entries
    own = K.decode_splits(*args)
    assert K.num_sms(0) == 132
    DF.emulate(_emu("rtx-3080", 0))
    assert K.num_sms(0) == 68
    emu = K.decode_splits(*args)
    assert emu == K.plan_splits(2 * 2, 2048 // 32, 68) != own == K.plan_splits(2 * 2, 2048 // 32, 132)
    from capdispatch.backends.indexer import triton_kernels as I
    assert I._Plan(CUDA0, None, 1, 64, False).num_sms == 68


def test_tile_tables_read_the_emulated_capability(h200):
    from capdispatch.backends.sparse_attention import kernels as K
    for kind in LT.KINDS:
        assert K.device_configs(CUDA0, kind, 4096) == LT.configs_for((9, 0), kind, 4096)
    DF.emulate(_emu("rtx-3080", 0))             # the cached plans are the H200's: emptied
    for kind in LT.KINDS:
        assert K.device_configs(CUDA0, kind, 4096) == LT.configs_for((8, 6), kind, 4096) \
            != LT.configs_for((9, 0), kind, 4096)
        assert K.device_configs(CUDA1, kind, 4096) == LT.configs_for((9, 0), kind, 4096)
    assert LL.plan_key() == ((0, (8, 6), 101376),)
    DF.stop_emulating()
    assert LL.plan_key() == () and K.device_configs(CUDA0, "decode", 4096) == LT.configs_for((9, 0), "decode", 4096)


def test_fp8_mode_reads_the_emulated_card(h200):
    from capdispatch.backends.indexer import triton_kernels as I
    from capdispatch.backends.triton_common.env import check_device
    from capdispatch.errors import UnsupportedDeviceError
    t = SimpleNamespace(is_cpu=False, is_cuda=True, device=CUDA0)      # a CUDA tensor's attributes
    assert I._native_fp8_default(CUDA0) and I._Plan(CUDA0, None, 1, 64, False).native
    check_device(t, interpreted=False, kernels="K", native_fp8=True)   # the H200 has fp8
    DF.emulate(_emu("rtx-3080", 0))
    assert not I._native_fp8_default(CUDA0) and not I._Plan(CUDA0, None, 1, 64, False).native
    with pytest.raises(UnsupportedDeviceError, match="emu:rtx-3080@cuda:0 has 8.6; use u8"):
        check_device(t, interpreted=False, kernels="K", native_fp8=True, instead="use u8")
    check_device(t, interpreted=False, kernels="K", native_fp8=False)  # the uint8 codec runs


def test_tilelang_builds_for_the_real_card_with_the_emulated_codec(h200):
    pytest.importorskip("tilelang")
    from capdispatch.backends.indexer import tilelang_kernel as TL
    assert TL._device_facts(0) == ("sm_90a", 132, True)
    DF.emulate(_emu("rtx-3080", 0))
    assert TL._device_facts(0) == ("sm_90a", 68, False)


class _Kernel:
    """A Triton-kernel stand-in: warmup 'compiles' to SHARED bytes, [grid] launches."""

    def __init__(self, shared):
        self.shared, self.warmups, self.launched = shared, 0, 0
        self.__name__ = "_k"

    def warmup(self, *args, grid, **kwargs):
        self.warmups += 1
        return SimpleNamespace(metadata=SimpleNamespace(shared=self.shared(kwargs)))

    def __getitem__(self, grid):
        def run(*a, **kw):
            self.launched += 1
        return run


def test_launches_are_admitted_under_the_emulated_shared_memory(h200, monkeypatch):
    from triton.runtime.errors import OutOfResources
    k = _Kernel(lambda kw: 120_000 if kw["BM"] == 64 else 50_000)
    current = [0]
    monkeypatch.setattr(LL, "_current_device", lambda: current[0])
    LL.launch(k, (1,))(BM=64)                    # the H200 itself: no check
    assert (k.warmups, k.launched) == (0, 1)
    DF.emulate(_emu("rtx-3080", 0))
    with pytest.raises(OutOfResources):          # over the 3080's 99 KB: refused as the card would
        LL.launch(k, (1,))(BM=64)
    for _ in range(3):
        LL.launch(k, (1,))(BM=32)                # compiled and admitted once, then launched directly
    assert (k.warmups, k.launched) == (2, 4)
    scope = LL.device_scope(0)
    assert [(r.config, r.fits) for r in scope.launches] == [({"BM": 64}, False), ({"BM": 32}, True)]
    current[0] = 1                               # a launch on the other card: its own limits
    LL.launch(k, (1,))(BM=64)
    assert k.launched == 5
    with LL.tiles_as(LL.card_target("sm_90")):   # a block inside still forces its own target
        current[0] = 0
        LL.launch(k, (1,))(BM=64)
    assert k.launched == 6


def test_install_caps_memory_and_installs_the_card(h200, monkeypatch):
    from capdispatch.rehearse import devices, emulation
    calls = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: calls.append((f, i)))
    got = emulation.install(devices.parse("emu:rtx-3080@cuda:0"))
    assert got.facts == _emu("rtx-3080", 0) and DF.facts(CUDA0) is got.facts
    assert got.memory_cap == 10 * GIB and calls == [(10 * GIB / DF.real(0).memory, 0)]
    d = got.to_dict()
    assert (d["sm_count"], d["smem_optin_per_block"], d["fp8"], d["memory_cap"]) == (68, 101376, False, 10 * GIB)
    # The real card, and a card with more memory than the device: nothing capped.
    assert emulation.install(devices.parse("cuda:1")).memory_cap is None
    assert emulation.install(devices.parse("emu:b200@cuda:1")).memory_cap is None and len(calls) == 1
    cpu = emulation.install(devices.parse("emu:rtx-3080@cpu"))
    assert cpu.note and "interpreter" in cpu.note and DF.emulated(0) is not None


def test_not_emulated_is_said_per_backend():
    from capdispatch.rehearse.emulation import not_emulated
    assert "compiled for the real card" in not_emulated("triton_u8")
    assert "library" in not_emulated("flashmla") and "library" in not_emulated("marlin_w4a16")
    assert "split count" in not_emulated("tilelang")
    assert "memory cap" in not_emulated("torch")

"""capdispatch.backends.launch_limits: launching as a card of another compute capability
and shared-memory size (the benchmarks' --tiles 99kb), checked without a GPU.

The compile step is faked (a kernel object whose ``warmup`` returns metadata with a
chosen ``shared``); the real kernels run under Triton's interpreter in a subprocess.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Under the interpreter on the CPU: triton's own jitted helpers are built in the mode of
# its first import, so no test may import it outside the interpreter first.
from triton_env import _triton_interpreter  # noqa: E402,F401 (autouse fixture)

from capdispatch.backends import launch_limits as LL  # noqa: E402
from capdispatch.backends.sparse_attention import launch_table as LT  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT_99KB = 101376
T99 = LL.TileTarget(capability=(8, 6), shared_bytes=LIMIT_99KB, label="99 KB")
CUDA0 = torch.device("cuda", 0)   # never touched: the capability lookup is replaced


class FakeKernel:
    """A Triton-kernel stand-in: ``warmup`` 'compiles' (shared bytes from the tile),
    ``kernel[grid](...)`` records the launch."""

    def __init__(self, shared_of, arg_names=()):
        self.shared_of = shared_of
        self.arg_names = list(arg_names)      # the real kernel's: arguments by position or by name
        self.warmups, self.launched = [], []
        self.__name__ = "_fake_kernel"

    def _named(self, args, kwargs):
        return dict(zip(self.arg_names, args), **kwargs)

    def warmup(self, *args, grid, **kwargs):
        kw = self._named(args, kwargs)
        self.warmups.append(kw)
        return SimpleNamespace(metadata=SimpleNamespace(shared=self.shared_of(kw)), n_regs=96, n_spills=0)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append((grid, self._named(args, kwargs)))


def _kernels():
    """The sparse-attention kernel module, imported inside a test (not at collection) so
    that it is built in the mode the test session runs: the other attention tests reload
    it under the interpreter only when they find it imported without."""
    from capdispatch.backends.sparse_attention import kernels
    return kernels


@pytest.fixture
def sm90(monkeypatch):
    """The sparse-attention launch path believing it runs on an SM90 card, with empty plans."""
    K = _kernels()
    monkeypatch.setattr(K, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(K, "_plans", {})


def test_card_target_reads_the_catalog():
    import capdispatch.backends as B
    assert (B.tiles_as, B.TileTarget, B.card_target) == (LL.tiles_as, LL.TileTarget, LL.card_target)
    for key in ("sm_86", "sm_89", "sm_120"):
        t = LL.card_target(key)
        assert t.shared_bytes == LIMIT_99KB, key
    assert LL.card_target("sm_86").capability == (8, 6)
    assert LL.card_target("sm_90").shared_bytes > LIMIT_99KB


def test_the_99kb_cards_share_one_table():
    """The label '(as sm_86/sm_89/sm_120 get them)' holds: the three get the same entries,
    which differ from SM90's measured ones."""
    for kind in LT.KINDS:
        got = {cc: LT.configs_for(cc, kind) for cc in ((8, 6), (8, 9), (12, 0))}
        assert got[(8, 6)] == got[(8, 9)] == got[(12, 0)] == LT.PORTABLE_CONFIGS[kind], kind
        assert LT.configs_for((9, 0), kind) != got[(8, 6)], kind


def test_forced_capability_picks_the_99kb_entries_on_sm90(sm90):
    K = _kernels()
    for kind, tokens in (("prefill", 4096), ("decode", 4096), ("decode_split", 1)):
        own = K.device_configs(CUDA0, kind, tokens)
        assert own == LT.configs_for((9, 0), kind, tokens)
        with LL.tiles_as(T99):
            assert K.device_configs(CUDA0, kind, tokens) == LT.configs_for((8, 6), kind, tokens)
        # The forced plan was cached under its own key: the card's own answer is unchanged.
        assert K.device_configs(CUDA0, kind, tokens) == own


def test_capability_and_plan_key_only_inside_the_block():
    assert LL.capability_for((9, 0)) == (9, 0) and LL.plan_key() == () and LL.active() is None
    with LL.tiles_as(T99) as scope:
        assert LL.active() is scope
        assert LL.capability_for((9, 0)) == (8, 6)
        assert LL.plan_key() == ((8, 6), LIMIT_99KB)
        seen = []
        t = threading.Thread(target=lambda: seen.append(LL.active()))   # another thread's calls
        t.start()
        t.join()
        assert seen == [None]
    assert LL.active() is None and LL.capability_for((9, 0)) == (9, 0)


def test_tiles_as_needs_a_target():
    with pytest.raises(TypeError, match="TileTarget"):
        with LL.tiles_as((8, 6)):
            pass


def test_admit_records_and_rejects_an_over_limit_kernel():
    from triton.runtime.errors import OutOfResources
    scope = LL.TileScope(target=T99)
    small = SimpleNamespace(metadata=SimpleNamespace(shared=65536), n_regs=128, n_spills=8)
    big = SimpleNamespace(metadata=SimpleNamespace(shared=LIMIT_99KB + 1), n_regs=255, n_spills=0)
    rec = scope.admit("k", {"BLOCK_H": 32}, small)
    assert (rec.shared, rec.registers, rec.spills, rec.fits) == (65536, 128, 8, True)
    assert scope.admit("k", {}, SimpleNamespace(metadata=SimpleNamespace(shared=LIMIT_99KB))).fits
    with pytest.raises(OutOfResources) as exc:
        scope.admit("k", {"BLOCK_H": 64}, big)
    assert exc.value.required == LIMIT_99KB + 1 and exc.value.limit == LIMIT_99KB
    assert [r.fits for r in scope.launches] == [True, True, False]
    assert scope.launches[-1].config == {"BLOCK_H": 64}


def test_launch_checks_only_inside_a_checking_block():
    fake = FakeKernel(lambda kw: 200_000 if kw["BM"] == 128 else 40_000)
    LL.launch(fake, (1,))(1, 2, BM=128, num_warps=8)          # outside: as fn[grid], no compile check
    assert fake.warmups == [] and len(fake.launched) == 1
    with LL.tiles_as(T99, check=False):
        LL.launch(fake, (1,))(BM=128)
    assert fake.warmups == [] and len(fake.launched) == 2
    from triton.runtime.errors import OutOfResources
    with LL.tiles_as(T99) as scope:
        LL.launch(fake, (2,))(BM=16, num_warps=4, other="x")
        with pytest.raises(OutOfResources):       # a single-entry table fails as the card does
            LL.launch(fake, (2,))(BM=128, num_warps=8)
    assert len(fake.launched) == 3                # the over-limit kernel never launched
    assert [(r.kernel, r.config, r.fits) for r in scope.launches] == [
        ("_fake_kernel", {"BM": 16, "num_warps": 4}, True), ("_fake_kernel", {"BM": 128, "num_warps": 8}, False)]


def test_sparse_launch_skips_an_entry_over_the_limit(sm90, monkeypatch):
    """The first portable decode entry 'needs' more than 99 KB here: the launch moves to the
    next entry, exactly as Triton's OutOfResources moves it on the card, and hands back the
    plan that ran, which the op keeps for its next call of that shape."""
    K = _kernels()
    fake = FakeKernel(lambda kw: 120_000 if kw["BLOCK_H"] == 32 else 50_000, K._sparse_mla_kernel.arg_names)
    monkeypatch.setattr(K, "_sparse_mla_kernel", fake)
    consts = (1, 64, 37440, 1, 1, False, False, False, False, 2)       # KV_MODE ... STATS
    head = ("q", 0, 0, 0, "kv", 0, 0, "idx", 0, 0, 64, "len", "kv2", 0, "idx2", 0, 0, 0, "len2", "sink",
            "out", 0, 0, 0, "ml", "lse", 0, 0, 0)
    with LL.tiles_as(T99) as scope:
        plan = K.plan_launch(CUDA0, "decode", 4, 64, consts, n_idx=64)
        ran = K.launch_planned(plan, 4, head, 1, 1, 0.1, CUDA0)
    first, second = LT.PORTABLE_CONFIGS["decode"][:2]
    assert plan.cfg == first and ran.cfg == second and ran.rest == LT.PORTABLE_CONFIGS["decode"][2:]
    assert [(r.config["BLOCK_H"], r.fits) for r in scope.launches] == [(first["BLOCK_H"], False),
                                                                       (second["BLOCK_H"], True)]
    assert [kw["BLOCK_H"] for _, kw in fake.launched] == [second["BLOCK_H"]]
    assert fake.launched[0][1]["out_ptr"] == "out" and fake.launched[0][1]["part_o_ptr"] == "out"
    with LL.tiles_as(T99) as scope:          # the kept plan starts from the entry that fit
        assert K.launch_planned(ran, 4, head, 1, 1, 0.1, CUDA0) is ran
    assert [(r.config["BLOCK_H"], r.fits) for r in scope.launches] == [(second["BLOCK_H"], True)]
    # The card's own table (SM90, 227 KB: no check) still starts from its measured entry.
    assert K.plan_launch(CUDA0, "decode", 4, 64, consts, n_idx=64).cfg == LT.configs_for((9, 0), "decode")[0]


def test_interpreted_kernels_run_unchanged_inside_a_block(tmp_path):
    """The real kernels (kv_cache, moe) under the interpreter: a block changes nothing they
    compute and records each launch with its entry (no compile facts off a GPU)."""
    code = textwrap.dedent("""
        import torch
        from capdispatch.backends import launch_limits as LL
        from capdispatch.backends.kv_cache import reference as KR, triton_kernels as KT
        from capdispatch.backends.moe import reference as MR, triton_kernels as MT
        gen = torch.Generator().manual_seed(3)
        t = LL.card_target("sm_86")
        k = torch.randn(8, 512, generator=gen).bfloat16()
        loc = torch.randperm(32, generator=gen)[:8].long()
        want = KR.new_pool(2, 16, "cpu"); KR.kv_quant(k, want, loc, 16)
        with LL.tiles_as(t) as scope:
            pool = KR.new_pool(2, 16, "cpu"); KT.kv_quant_u8(k, pool, loc, 16)
            out = KT.kv_dequant_u8(pool, loc, 16)
        assert torch.equal(pool, want)
        assert torch.equal(out, KR.kv_dequant(want, loc, 16))
        names = [r.kernel for r in scope.launches]
        assert names == ["_kv_quant_kernel", "_kv_dequant_kernel"], names
        assert all(r.fits and r.shared is None for r in scope.launches)
        assert scope.launches[0].config["num_warps"] == KT.QUANT_NUM_WARPS
        w = MR.random_weights(4, 64, 64, gen=gen)
        x = torch.randn(3, 64, generator=gen).bfloat16()
        tw, ids = MR.random_routing(3, 2, 4, gen=gen)
        with LL.tiles_as(t) as scope:
            got = MT.moe_w4a16(x, w, tw, ids)
        ref = MR.moe(x, w, tw, ids)
        assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 1.5e-2
        names = [r.kernel for r in scope.launches]
        assert "_gemm1_swiglu_kernel" in names and "_gemm2_kernel" in names, names
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]

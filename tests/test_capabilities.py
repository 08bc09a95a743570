"""Capabilities: catalog, feature rules, NVML probing (through a stand-in NVML), libraries."""
import sys
import types

import pytest
from attrs import evolve as attrs_evolve

from capdispatch.capabilities import catalog, derive_features, features, probe
from capdispatch.capabilities.libraries import AssumeLibError, Inventory, parse_assume


@pytest.mark.parametrize("name,cc,has,lacks", [
    ("rtx-3080", "8.6", {"bf16", "smem_99k"}, {"fp8_e4m3", "wgmma", "tcgen05", "tma"}),
    ("rtx-4090", "8.9", {"bf16", "fp8_e4m3"}, {"wgmma", "tma"}),
    ("h200", "9.0", {"fp8_e4m3", "tma", "wgmma", "smem_227k"}, {"tcgen05", "sm120_block_scaled_mma"}),
    ("b200", "10.0", {"tcgen05", "tma", "smem_227k"}, {"wgmma", "sm120_block_scaled_mma"}),
    ("rtx-5090", "12.0", {"sm120_block_scaled_mma", "fp8_e4m3", "tma"}, {"tcgen05", "wgmma", "smem_163k"}),
    ("dgx-spark", "12.1", {"sm120_block_scaled_mma"}, {"tcgen05"}),
    ("a100", "8.0", {"bf16", "smem_163k"}, {"fp8_e4m3", "smem_227k"}),
    ("sm_120", "12.0", {"sm120_block_scaled_mma"}, {"tcgen05"}),
])
def test_features_follow_rules(name, cc, has, lacks):
    spec = catalog.simulate(name)
    feats = derive_features(spec)
    assert spec.cc_str == cc
    assert has <= feats and not (lacks & feats)


def test_cpu_has_no_gpu_features():
    assert derive_features(probe("cpu")) == frozenset()


def test_every_rule_and_catalog_value_has_a_source():
    for rule in features.rules().values():
        assert len(rule.source) > 20
    for key in catalog.names():
        entry = catalog.lookup(key)
        for field in ("cc", "sm_count", "smem_optin_per_block", "memory"):
            assert field in entry, (key, field)
            assert entry["sources"].get(field), (key, field)


def test_catalog_aliases_and_arch_forms():
    assert catalog.lookup("gb10")["key"] == "dgx-spark"
    assert catalog.lookup("sm_90a")["key"] == "sm_90"
    assert catalog.lookup("SM_120")["key"] == "sm_120"
    with pytest.raises(catalog.UnknownDeviceError, match="rtx-4090"):
        catalog.lookup("rtx-4909")


def test_assume_lib_parsing():
    assert parse_assume("triton") == ("triton", None)
    assert parse_assume("FlashInfer_Python==0.6.14") == ("flashinfer-python", "0.6.14")
    for bad in ("triton>=3", "triton==3.*", "tri ton", "x==1,==2"):
        with pytest.raises(AssumeLibError):
            parse_assume(bad)
    inv = Inventory.with_assumptions(["flashinfer-python==0.6.14"])
    f = inv.get("flashinfer_python")
    assert f.installed and f.assumed and f.version == "0.6.14"
    assert not inv.get("surely-not-an-installed-dist").installed


def test_torch_cuda_version_from_metadata(monkeypatch):
    from capdispatch.capabilities import probing as probe_mod
    assert probe_mod.cuda_from_local("2.11.0+cu130") == "13.0"
    assert probe_mod.cuda_from_local("2.9.1+cu128") == "12.8"
    assert probe_mod.cuda_from_local("2.13.0+cpu") is None
    assert probe_mod.cuda_from_local("2.13.0") is None


class _FakeNVML(types.ModuleType):
    """A stand-in for pynvml on a machine without a driver: two different cards."""

    class NVMLError(Exception):
        pass

    def __init__(self, cards):
        super().__init__("pynvml")
        self.cards = cards
        self.inits = self.shutdowns = 0

    def nvmlInit(self): self.inits += 1
    def nvmlShutdown(self): self.shutdowns += 1
    def nvmlDeviceGetCount(self): return len(self.cards)
    def nvmlDeviceGetHandleByIndex(self, i): return self.cards[i]
    def nvmlDeviceGetHandleByUUID(self, u):
        return next(c for c in self.cards if c["uuid"] == u)
    def nvmlDeviceGetName(self, h): return h["name"]
    def nvmlDeviceGetCudaComputeCapability(self, h): return h["cc"]
    def nvmlDeviceGetMemoryInfo(self, h): return types.SimpleNamespace(total=h["mem"])
    def nvmlDeviceGetUUID(self, h): return h["uuid"]
    def nvmlDeviceGetAttributes_v2(self, h): raise self.NVMLError("Not Supported")
    def nvmlSystemGetDriverVersion(self): return b"580.95.05"
    def nvmlSystemGetCudaDriverVersion(self): return 13000


@pytest.fixture
def fake_nvml(monkeypatch):
    fake = _FakeNVML([
        {"name": "NVIDIA GeForce RTX 5090", "cc": (12, 0), "mem": 32 * 2**30, "uuid": "GPU-aaa"},
        {"name": "NVIDIA GeForce RTX 3080", "cc": (8, 6), "mem": 10 * 2**30, "uuid": "GPU-bbb"},
    ])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    return fake


def test_nvml_probe_reads_facts_and_fills_from_catalog(fake_nvml):
    from capdispatch.capabilities.probing import probe_nvml
    s = probe_nvml(1)
    assert (s.id, s.name, s.cc, s.probe) == ("cuda:1", "NVIDIA GeForce RTX 3080", (8, 6), "nvml")
    assert s.sm_count == 68 and s.smem_optin_per_block == 101376 and s.uuid == "GPU-bbb"
    assert any("catalog" in n for n in s.notes)
    assert any("CUDA_DEVICE_ORDER" in n for n in s.notes)   # mixed models, default order


def test_nvml_is_shut_down_after_each_probe_and_fails_as_probe_errors(fake_nvml, monkeypatch):
    """Every NVML session (a device's facts, the count) shuts down once it started, also
    when a query fails; a failed query or a broken binding is a ProbeError, the device named."""
    from capdispatch.capabilities.probing import ProbeError, local_devices, probe_nvml
    assert len(local_devices(via="nvml")) == 2
    assert fake_nvml.inits == fake_nvml.shutdowns == 3           # the count, then each card

    def lost(h):
        raise fake_nvml.NVMLError("GPU is lost")
    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetCudaComputeCapability", lost)
    with pytest.raises(ProbeError, match=r"^cuda:1: NVML query failed: GPU is lost$"):
        probe_nvml(1)
    assert fake_nvml.inits == fake_nvml.shutdowns == 4

    def broken():
        raise OSError("undefined symbol: nvmlInit_v2")
    monkeypatch.setattr(fake_nvml, "nvmlInit", broken)
    with pytest.raises(ProbeError, match=r"^cuda:0: NVML could not start: undefined symbol"):
        probe_nvml(0)
    assert fake_nvml.shutdowns == 4                               # never started: not shut down


def test_env_and_the_verdict_key_read_nvml_in_the_same_session(fake_nvml, monkeypatch):
    """`dispatch env` and a verdict's driver open the probe's session: shut down once
    started, also when a query fails; env keeps what it read before the failure and says
    why, the verdict key says "unknown" (None); missing bindings or NVML that cannot start
    are said as the probe says them. Each call asks the driver again (nothing cached)."""
    from capdispatch.capabilities import catalog as cat
    from capdispatch.capabilities.probing import nvml_failure
    from capdispatch.dispatch import env_cmd
    from capdispatch.proof import identity
    card = attrs_evolve(cat.simulate("rtx-3080"), platform="cuda")
    r = env_cmd._nvml()
    assert (r["ok"], r["driver"], r["cuda_driver"]) == (True, "580.95.05", "13.0")
    assert [c["uuid"] for c in r["cards"]] == ["GPU-aaa", "GPU-bbb"]
    assert identity.driver_version(card) == "580.95.05"
    assert fake_nvml.inits == fake_nvml.shutdowns == 2
    monkeypatch.setattr(fake_nvml, "nvmlSystemGetDriverVersion", lambda: b"581.00")
    assert identity.driver_version(card) == "581.00"           # asked again, not remembered

    def lost(h):
        raise fake_nvml.NVMLError("GPU is lost")
    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetUUID", lost)
    r = env_cmd._nvml()
    assert (r["ok"], r["error"], r["driver"], r["cards"]) == (False, "NVML query failed: GPU is lost", "581.00", [])

    def gone():
        raise fake_nvml.NVMLError("Uninitialized")
    monkeypatch.setattr(fake_nvml, "nvmlSystemGetDriverVersion", gone)
    assert identity.driver_version(card) is None
    monkeypatch.setattr(fake_nvml, "nvmlSystemGetDriverVersion", lambda: 7 / 0)   # a broken binding
    assert identity.driver_version(card) is None
    assert fake_nvml.inits == fake_nvml.shutdowns == 6

    def broken():
        raise OSError("undefined symbol: nvmlInit_v2")
    monkeypatch.setattr(fake_nvml, "nvmlInit", broken)
    assert env_cmd._nvml() == {"ok": False, "error": "NVML could not start: undefined symbol: nvmlInit_v2",
                               "cards": []}
    assert identity.driver_version(card) is None
    assert fake_nvml.shutdowns == 6                               # never started: not shut down
    monkeypatch.setitem(sys.modules, "pynvml", None)             # not installed
    assert env_cmd._nvml() == {"ok": False, "error": nvml_failure(ImportError()), "cards": []}
    assert identity.driver_version(card) is None
    assert identity.driver_version(cat.simulate("rtx-3080")) is None    # not a CUDA card: NVML unasked


def test_one_module_opens_nvml():
    """NVML's session (import pynvml, init, shut down) is written once, in
    capabilities/probing.py's nvml_session: every other module opens it from there."""
    import ast
    import os
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "capdispatch")
    found = []
    for d, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(d, f)
            tree = ast.parse(open(path, encoding="utf-8").read(), path)
            where = {}       # node -> the function it stands in (the module: "")
            for fn in ast.walk(tree):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for node in ast.walk(fn):
                        where[node] = fn.name    # the innermost function: walked last
            for node in ast.walk(tree):
                hit = ((isinstance(node, ast.Import) and any(a.name.split(".")[0] == "pynvml" for a in node.names))
                       or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pynvml")
                       or (isinstance(node, ast.Attribute) and node.attr in ("nvmlInit", "nvmlShutdown")))
                if hit:
                    found.append(f"{os.path.relpath(path, root)}:{where.get(node, '')}")
    assert sorted(set(found)) == ["capabilities/probing.py:nvml_session"], sorted(set(found))


def test_nvml_probe_honours_cuda_visible_devices_at_call_time(fake_nvml, monkeypatch):
    from capdispatch.capabilities.probing import ProbeError, local_devices, probe_nvml
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert probe_nvml(0).name == "NVIDIA GeForce RTX 3080"
    with pytest.raises(ProbeError, match="no such device"):
        probe_nvml(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaa,GPU-bbb")
    assert [d.cc for d in local_devices(via="nvml")] == [(12, 0), (8, 6)]
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert not any("CUDA_DEVICE_ORDER" in n for n in probe_nvml(0).notes)


def test_cuda_version_from_torch_version_file():
    from capdispatch.capabilities.probing import cuda_from_version_text
    assert cuda_from_version_text("__version__ = '2.11.0'\ncuda: Optional[str] = '13.0'\n") == "13.0"
    assert cuda_from_version_text("cuda = '12.8'\n") == "12.8"
    assert cuda_from_version_text("cuda: Optional[str] = None\n") is None

"""Op and Backend declarations, and requirements as data.

A requirement never looks at a device itself: it is evaluated by the resolver
against a `Facts` value into a `Check` {code, need, found, ok, message}.
"""
from __future__ import annotations

import re
from typing import Mapping, Optional
import importlib

import attrs
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ..capabilities import DeviceSpec, Inventory
from ..capabilities import features as _features
from ..capabilities.libraries import import_check


@attrs.frozen
class Check:
    """One requirement evaluated on one device: what was needed, what was found, and (when
    it failed) a sentence the requirement wrote for people."""
    code: str
    need: str
    found: str
    ok: bool
    message: str = ""

    @property
    def wording(self) -> str:
        """The one wording of a check as need against found: 'CODE: need NEED, found FOUND'."""
        return need_found(self.code, self.need, self.found)

    @property
    def reason(self) -> str:
        """Why it failed, for an error or a warning: its message, else its wording."""
        return self.message or self.wording

    def to_dict(self) -> dict:
        return attrs.asdict(self)


def need_found(what: str, need, found) -> str:
    """'WHAT: need NEED, found FOUND': how capdispatch words anything checked against what
    it needs (a requirement on a device, a cached verdict's key against today's)."""
    return f"{what}: need {need}, found {found}"


def failed_checks(checks, *, exact: bool = False) -> str:
    """The failed ones of CHECKS, joined by '; ': each its reason, or with EXACT its
    wording (need against found, as a trace shows it)."""
    return "; ".join(ch.wording if exact else ch.reason for ch in checks if not ch.ok)


@attrs.frozen
class Facts:
    """Everything a requirement may look at, for one device and one decision."""

    device: DeviceSpec
    features: frozenset
    libraries: Inventory
    env: Mapping = attrs.field(factory=dict)   # snapshot taken when the decision is made
    check_imports: bool = False                # real devices only: planning never imports
    # The rank's shapes (a capdispatch.models.RankShape, read by attribute: models stands above
    # backends, so it is not imported here) when the decision is made for a model and layout;
    # None: shape requirements are not evaluated.
    shapes: Optional[object] = None


@attrs.frozen
class Feature:
    name: str

    def evaluate(self, f: Facts) -> Check:
        rule = _features.rules()[self.name]
        ok = self.name in f.features
        return Check(
            code=f"feature:{self.name}", need=f"{self.name} ({rule.need})",
            found=rule.found(f.device), ok=ok,
            message="" if ok else f"{f.device.id} lacks {self.name}: needs {rule.need}, has {rule.found(f.device)}",
        )


@attrs.frozen
class AnyFeature:
    """At least one of several features (e.g. wgmma or tcgen05)."""
    names: tuple

    def evaluate(self, f: Facts) -> Check:
        have = [n for n in self.names if n in f.features]
        need = " or ".join(self.names)
        rules = _features.rules()
        found = ", ".join(sorted({rules[n].found(f.device) for n in self.names}))
        return Check(code=f"feature:{'|'.join(self.names)}", need=need, found=found,
                     ok=bool(have), message="" if have else f"{f.device.id} has none of {need} ({found})")


@attrs.frozen
class Platform:
    kind: str   # "cuda" or "cpu"

    def evaluate(self, f: Facts) -> Check:
        ok = f.device.platform == self.kind
        return Check(code="platform", need=self.kind, found=f.device.platform, ok=ok,
                     message="" if ok else f"needs a {self.kind} device, {f.device.id} is {f.device.platform}")


# Triton reads TRITON_INTERPRET as a boolean: these spellings (any case, nothing around
# them) mean on; anything else, unset included, means off.
_TRITON_TRUE = ("1", "true", "on", "yes", "y")


def triton_interpret(env) -> bool:
    """Whether Triton, started with ENV, runs its kernels under the CPU interpreter."""
    value = env.get("TRITON_INTERPRET")
    return isinstance(value, str) and value.lower() in _TRITON_TRUE


@attrs.frozen
class TritonTarget:
    """Triton compiles for CUDA cards from MIN_CC, or runs on the CPU under its interpreter."""
    min_cc: str = "8.0"

    def __attrs_post_init__(self):
        # fail at declaration, not at every decision
        if not isinstance(self.min_cc, str) or not re.fullmatch(r"\d{1,2}\.\d{1,2}", self.min_cc):
            raise ValueError(f"TritonTarget min_cc {self.min_cc!r} is not a compute capability "
                             f"(valid: MAJOR.MINOR, e.g. '8.0')")

    def evaluate(self, f: Facts) -> Check:
        need = f"CUDA cc >= {self.min_cc}, or cpu with TRITON_INTERPRET=1"
        d = f.device
        if d.platform == "cuda":
            ok = d.cc is not None and Version(d.cc_str) >= Version(self.min_cc)
            found = f"cuda cc {d.cc_str or 'unknown'}"
        else:
            ok = triton_interpret(f.env)
            found = f"cpu, TRITON_INTERPRET={f.env.get('TRITON_INTERPRET', '(unset)')}"
        return Check(code="triton_target", need=need, found=found, ok=ok,
                     message="" if ok else f"Triton cannot run on {d.id}: needs {need}")


@attrs.frozen
class ComputeCapability:
    spec: str

    def __attrs_post_init__(self):
        SpecifierSet(self.spec)  # fail at declaration, not at decision

    def evaluate(self, f: Facts) -> Check:
        d = f.device
        ok = d.cc is not None and Version(d.cc_str) in SpecifierSet(self.spec)
        return Check(code="cc", need=f"cc {self.spec}", found=f"cc {d.cc_str or 'none'}", ok=ok,
                     message="" if ok else f"{d.id} has cc {d.cc_str or 'none'}, needs {self.spec}")


@attrs.frozen
class Library:
    """An installed distribution (by package metadata), optionally within a version
    range; when `module` is given and the device is real, also that it imports."""
    dist: str
    spec: str = ""
    module: Optional[str] = None
    extra: Optional[str] = None     # capdispatch's extra that installs it, for the message

    def __attrs_post_init__(self):
        SpecifierSet(self.spec)

    def evaluate(self, f: Facts) -> Check:
        fact = f.libraries.get(self.dist)
        need = f"{self.dist}{self.spec}" if self.spec else self.dist
        ok = fact.installed
        msg = ""
        if not ok:
            msg = f"{self.dist} is not installed"
            if self.extra:
                msg += f" (pip install 'capdispatch[{self.extra}]')"
        elif self.spec and fact.version is not None:
            try:
                ok = Version(fact.version) in SpecifierSet(self.spec, prereleases=True)
            except InvalidVersion:
                ok = False
            if not ok:
                msg = f"{self.dist} {fact.version} is outside {self.spec}"
        found = fact.describe()
        if ok and self.module and f.check_imports and not fact.assumed:
            imp = import_check(self.module, env=f.env)
            if not imp.ok:
                ok, msg = False, f"import {self.module} failed: {imp.error}"
                found = f"{found}, import failed ({imp.error})"   # the reason in the text trace too
        return Check(code=f"library:{self.dist}", need=need, found=found, ok=ok, message=msg)



# The RankShape attributes a ShapeRange may name (integers; capdispatch.models.RankShape).
SHAPE_FIELDS = ("heads", "head_dim", "rope_dim", "indexer_heads", "indexer_dim", "index_topk", "window",
                "next_n", "experts", "experts_total", "topk", "hidden", "moe_intermediate", "o_groups",
                "kv_bytes_per_token", "attn_tp", "moe_tp", "tp", "ep")


@attrs.frozen
class ShapeRange:
    """What a kernel supports of one of a rank's shapes (a RankShape attribute: heads,
    head_dim, indexer_heads, next_n, hidden, moe_intermediate, ...): a set of allowed values,
    or a min / max / multiple-of rule (any combination), with the SOURCE that states it
    (a file of the library, or of capdispatch's adapter, and what it says).

    Evaluated only when the decision has shapes (a model and layout); without them it
    yields no check, so a decision for no model is unchanged."""
    field: str
    source: str
    allowed: tuple = attrs.field(default=(), converter=tuple)
    min: Optional[int] = None
    max: Optional[int] = None
    multiple_of: Optional[int] = None
    what: str = ""          # the field in words ("query heads per rank"), for the message

    def __attrs_post_init__(self):
        if not (self.allowed or self.min is not None or self.max is not None or self.multiple_of):
            raise ValueError(f"ShapeRange({self.field!r}) states no range")
        if not self.source:
            raise ValueError(f"ShapeRange({self.field!r}) has no source")
        if self.field not in SHAPE_FIELDS:
            raise ValueError(f"ShapeRange field {self.field!r} is not a rank shape (valid: {', '.join(SHAPE_FIELDS)})")

    @property
    def need(self) -> str:
        parts = []
        if self.allowed:
            parts.append("in {" + ", ".join(str(v) for v in self.allowed) + "}")
        if self.min is not None and self.max is not None:
            parts.append(f"{self.min}..{self.max}")
        elif self.min is not None:
            parts.append(f">= {self.min}")
        elif self.max is not None:
            parts.append(f"<= {self.max}")
        if self.multiple_of:
            parts.append(f"a multiple of {self.multiple_of}")
        return f"{self.field} " + " and ".join(parts) + f" ({self.source})"

    def admits(self, value: int) -> bool:
        return ((not self.allowed or value in self.allowed)
                and (self.min is None or value >= self.min)
                and (self.max is None or value <= self.max)
                and (not self.multiple_of or value % self.multiple_of == 0))

    def evaluate(self, f: Facts) -> Optional[Check]:
        if f.shapes is None:
            return None
        value = getattr(f.shapes, self.field)
        ok = self.admits(value)
        where = f"{getattr(f.shapes, 'model', 'the model')} at {_layout_text(f.shapes)}"
        found = f"{self.field} {value} ({where})"
        what = self.what or self.field
        return Check(code=f"shape:{self.field}", need=self.need, found=found, ok=ok,
                     message="" if ok else f"{what} is {value} on each rank of {where}; "
                                           f"the kernel needs {self.need}")


def _layout_text(shapes) -> str:
    text = f"tp {getattr(shapes, 'tp', '?')}"
    if getattr(shapes, "ep", 1) != 1:
        text += f" ep {shapes.ep}"
    if getattr(shapes, "dp_attention", False):
        text += " dp-attention"
    return text


# The requirements every kernel package shares, declared once so a minimum moves in
# one place: torch for every backend, Triton (its interpreter included) for the
# portable kernels.
TORCH = Library("torch", ">=2.4", module="torch", extra="torch")
TRITON = Library("triton", ">=3.2", module="triton", extra="triton")

# The size ladder of decode-time ops (Op.sizes): 1-4096 tokens, SGLang's decode batches and extends.
DECODE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@attrs.frozen
class SizeArg:
    """The problem size a policy may bucket an op on: the leading dimension of one
    tensor argument, named in policies by KEY ("tokens" or "rows")."""
    key: str
    index: int              # the argument's position in the op's call
    name: str               # its parameter name, for a call that passes it by keyword


@attrs.frozen
class Op:
    name: str
    summary: str
    # The op contract. Typed (torch.library's schema language, backends/signature.py), it is
    # also the custom ops' schema; an untyped one ("bare(x) -> Tensor") only describes the call.
    signature: str
    reference: str          # the backend that defines the op's meaning
    size: Optional[SizeArg] = None   # what size buckets test; None: the op takes no buckets
    # Backends whose prepared inputs differ (MoE weight layouts) cannot share one call site
    # across size buckets: backend name -> layout tag. Buckets keep the catch-all's layout.
    layouts: Optional[dict] = attrs.field(default=None, eq=False)
    # "module:function" of the op's canary (a small canonical problem checked against
    # the reference on the card), imported only when a backend is verified.
    canary: str = ""
    # "module:function" comparing a backend's results with the reference's on the same inputs:
    # compare(got, want, args) -> backends.cases.Comparison (ok, detail, error, bound); an op
    # that returns nothing is compared on the arguments it writes (cases.compared). The
    # rehearsal and canaries judge a backend by it.
    compare: str = ""
    # How a model serves the op. "decode": in every step, replayed from a CUDA graph at the
    # batch sizes SGLang captures and eager above them; "prefill": eager (SGLang 0.5.23
    # captures no prefill graph for DeepSeek-V4 by default).
    served: str = attrs.field(default="decode", validator=attrs.validators.in_(("decode", "prefill")))
    # Positions of the arguments one forward hands every layer unchanged (per-batch tensors
    # such as valid counts or slot maps): work a library derives from them once per batch
    # is shared by the layers inside `capdispatch.batch()`, and calibration times it so.
    batch_args: tuple = attrs.field(default=(), converter=tuple)
    # "module:function" of the op's calibration and benchmark case builder
    # (backends/cases.py says its call), imported only when inputs are built.
    case: str = ""
    # The sizes `dispatch bench` times the op at by default (its SizeArg's leading dimension).
    sizes: tuple = attrs.field(default=(), converter=tuple)
    # "module:function" giving the op's Triton kernels to compile offline for a card
    # (compile_matrix.py: function(Target) -> [Job]); ops sharing one function name it once
    # each. "": the op has no Triton kernel.
    compile_jobs: str = ""
    # Each result's shape and dtype (signature.Out), in the signature's order: with a typed
    # signature, what torch_ops.custom_op derives the schemas and fake implementations from.
    # None: the op declares no custom op (its backends are plain functions).
    outputs: Optional[tuple] = attrs.field(default=None, converter=attrs.converters.optional(tuple))
    # Record types the signature names -> "module:Class" (the class gives PARTS, the schema of
    # its parts, parts() and from_parts(*parts)): a custom op passes a record as its parts.
    records: Optional[dict] = attrs.field(default=None, eq=False)

    def __attrs_post_init__(self):
        if self.outputs is not None:        # refused at declaration, by name, before any bind
            from .signature import parse
            try:
                call = parse(self.signature, tuple(self.records or ()))
            except ValueError as e:
                raise ValueError(f"op {self.name!r}: {e}") from None
            if len(call.returns) != len(self.outputs):
                raise ValueError(f"op {self.name!r}: its signature returns {len(call.returns)} result(s), "
                                 f"outputs= describes {len(self.outputs)}")

    def call(self):
        """The parsed typed signature (signature.Call)."""
        from .signature import parse
        return parse(self.signature, tuple(self.records or ()))

    def load_compile_jobs(self):
        module, _, attr = self.compile_jobs.partition(":")
        return getattr(importlib.import_module(module), attr)

    def load_case(self):
        module, _, attr = self.case.partition(":")
        return getattr(importlib.import_module(module), attr)

    def load_compare(self):
        module, _, attr = self.compare.partition(":")
        return getattr(importlib.import_module(module), attr)

    def load_canary(self):
        module, _, attr = self.canary.partition(":")
        return getattr(importlib.import_module(module), attr)


@attrs.frozen
class Backend:
    op: str
    name: str
    impl: str               # "package.module:function", imported only when bound
    requires: tuple = attrs.field(converter=tuple)
    summary: str = ""
    # "module:callable" of a context manager a server enters for one warm-up call before it
    # serves (FlashInfer's autotuner: SGLang tunes its MoE tactics that way before capturing
    # graphs); the served form does the same before timing.
    tune: str = ""

    def load_tune(self):
        """The tuning context manager's factory, or None."""
        if not self.tune:
            return None
        module, _, attr = self.tune.partition(":")
        return getattr(importlib.import_module(module), attr)

    def evaluate(self, facts: Facts) -> list:
        """Every requirement's check; shape ranges give none when FACTS has no shapes."""
        return [c for c in (r.evaluate(facts) for r in self.requires) if c is not None]

    def load(self):
        module, _, attr = self.impl.partition(":")
        return getattr(importlib.import_module(module), attr)

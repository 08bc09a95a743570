"""The engine rehearsal's records, the rank reports it reads (the plugin's own format,
adapters/sglang/report.py) and the comparison of the plugin-on run with the plugin-off run.

Fail closed: tokens must be identical (and their logprobs within LOGPROB_TOL) where every
rank keeps SGLang's own kernels; where a
rank routes an op to capdispatch's kernel, each position's logprob must agree within
LOGPROB_TOL up to the first differing token, and that token must be a near tie in the
plugin-off run (its logprob there within LOGPROB_TOL of the token chosen).

Where routed kernels' logprobs are further apart than LOGPROB_TOL, a third run settles
whose kernel is off: the same launch with each routed op on its torch reference (the op's
meaning: exact dequantisation, fp32 accumulation). The routed kernels pass only where they
are no further from the references than REF_FACTOR times SGLang's own kernels are (or
within LOGPROB_TOL of them), over the positions all three runs agree on; positions past
those are held to LOGPROB_TOL as before."""
from __future__ import annotations

import json
import math
import os
from typing import Optional

import attrs

SCHEMA = "capdispatch.rehearse-engine/1"
LOGPROB_TOL = 0.05      # nats, per position: bf16 logits through different kernels of one op contract
REF_FACTOR = 1.5        # routed kernels may be this much further from the references than SGLang's own
TOP_LOGPROBS = 5        # alternatives SGLang returns per position, for the near-tie check
REPORT_LIMIT = 4 << 20
# SGLang's fields that choose kernels and that the plugin's launch step may set (knobs.yaml);
# where the two runs resolve one differently, their kernels differ even where every op is kept.
SETTINGS = ("kv_cache_dtype", "page_size", "attention_backend", "dsv4_attn_backend", "dsv4_prefill_backend",
            "moe_runner_backend")


@attrs.frozen
class Reply:
    """One request's answer: token ids, their logprobs, the top alternatives per position
    ((id, logprob), ...), and the client's times for 1 and for all output tokens."""
    tokens: tuple
    logprobs: tuple
    top: tuple
    first_s: float
    total_s: float


@attrs.frozen
class OpReport:
    op: str
    backend: Optional[str]
    runs: Optional[str]
    action: Optional[str]      # kept / routed / reported
    install: Optional[str]     # installed at ..., failed: ..., removed, None
    route: Optional[str]


@attrs.frozen
class RankReport:
    rank: int
    gpu_id: int
    device: str
    path: str
    ops: tuple                 # OpReport...
    agreed: Optional[bool]     # None: the report predates the group's agreement
    not_carried_out: tuple
    emulated: Optional[dict] = None   # the card the rank decided as, and on which device (the plugin's)

    def routed(self) -> tuple:
        return tuple(o for o in self.ops if o.action == "routed")


@attrs.frozen
class Run:
    plugin: bool
    command: tuple             # the launch, as a user would type it
    ok: bool
    step: Optional[str]        # where it failed
    rank: Optional[int]
    error: Optional[str]
    ready_s: Optional[float]
    version: Optional[str]     # SGLang's, from /server_info
    memory: Optional[dict]     # /server_info internal_states[0].memory_usage (GiB)
    settings: tuple            # (field, value) of SETTINGS as SGLang resolved them (/server_info)
    replies: tuple             # Reply per request
    reports: tuple             # RankReport per rank (plugin on), () off
    log: Optional[str]         # the server log's file under --out, or None
    log_tail: str = ""         # the log's last lines where the run failed
    reference: bool = False    # the plugin on, the routed ops on their torch references
    kept_from: Optional[str] = None   # plugin off: the report of the same launch it was run for (--off-from)

    @property
    def label(self) -> str:
        return "reference" if self.reference else f"plugin {'on' if self.plugin else 'off'}"


@attrs.frozen
class Comparison:
    request: int
    exact: bool                # identical tokens required
    ok: bool
    first_diff: Optional[int]  # first position whose tokens differ
    compared: int              # positions whose logprobs were compared
    max_logprob_diff: Optional[float]
    detail: str
    # Against the reference run (where one ran): the routed kernels' and SGLang's own largest
    # logprob distance from the torch references, over the positions all three agree on.
    from_ref_on: Optional[float] = None
    from_ref_off: Optional[float] = None


@attrs.frozen
class Measure:
    """One measured quantity beside its prediction."""
    name: str
    unit: str
    measured: Optional[float]
    predicted: Optional[float]
    bound: Optional[float]     # the relative miss the bar allows
    note: str = ""

    @property
    def miss(self) -> Optional[float]:
        if self.measured is None or not self.predicted:
            return None
        return self.measured / self.predicted - 1.0

    def to_dict(self) -> dict:
        d = attrs.asdict(self)
        d["miss"] = self.miss
        d["within"] = None if self.miss is None or self.bound is None else abs(self.miss) <= self.bound
        return d


@attrs.frozen
class EngineRehearsal:
    engine: str
    model: str
    checkpoint: str
    devices: tuple
    tp: int
    prompt: int
    steps: int
    requests: int
    seed: int
    on: Run
    off: Optional[Run]
    routed: tuple              # "op on rank R (backend)": where the plugin runs capdispatch's kernel
    settings_differ: tuple     # "field: A with the plugin, B without": SETTINGS the runs resolved apart
    comparisons: tuple         # Comparison per request
    measures: tuple            # Measure...
    ok: bool
    cause: Optional[str]
    tolerance: float
    wall_s: float
    out: Optional[str]
    # op -> why, for the ops a rank decided that the model declaration (calls.yaml) does not
    # call: named, not rehearsed (the comparison of tokens says nothing of them).
    not_called: dict = attrs.field(factory=dict)
    reference: Optional[Run] = None     # the routed ops on their torch references, where needed
    reference_ops: tuple = ()           # the ops that run routed it
    off_key: Optional[object] = None    # baseline.OffKey: what the plugin-off run's answers depend on

    def to_dict(self) -> dict:
        d = attrs.asdict(self, recurse=True, filter=lambda a, v: a.name != "measures")
        d["measures"] = [m.to_dict() for m in self.measures]
        d["schema"] = SCHEMA
        return d


def read_reports(folder: str, gpu_ids, emulated=None) -> tuple:
    """Each rank's report in FOLDER (where CAPDISPATCH_REPORT_DIR sent them), by the plugin's
    own naming. Raises ValueError naming the rank for one that is missing or unreadable, or
    whose emulation is not the one asked (EMULATED: gpu id -> catalog card)."""
    emulated = emulated or {}
    from ...adapters.sglang import report
    from ...safe_io import read_bytes
    out = []
    for rank, g in enumerate(gpu_ids):
        path = report.report_path(g, {report.ENV_DIR: folder})
        if not os.path.exists(path):
            raise ValueError(f"rank {rank} (cuda:{g}) wrote no report in {folder}: the plugin did not "
                             f"decide there (is capdispatch installed in SGLang's environment?)")
        try:
            d = json.loads(read_bytes(path, limit=REPORT_LIMIT, what="rank report"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"rank {rank} (cuda:{g}): its report {path} cannot be read: {exc}") from None
        if not isinstance(d, dict) or d.get("schema") != report.SCHEMA:
            raise ValueError(f"rank {rank} (cuda:{g}): report {path} has schema "
                             f"{d.get('schema') if isinstance(d, dict) else None!r}, expected {report.SCHEMA}")
        ops = tuple(OpReport(op, e.get("backend"), e.get("runs"), e.get("action"), e.get("install"),
                             e.get("route")) for op, e in (d.get("ops") or {}).items())
        a = d.get("agreement")
        emu = d.get("emulated")
        want = emulated.get(g)
        got = (emu.get("card"), emu.get("on")) if isinstance(emu, dict) else None
        if (want is None) != (got is None) or (want is not None and got != (want, f"cuda:{g}")):
            asked = f"emu:{want}@cuda:{g}" if want else f"cuda:{g} itself"
            said = f"emu:{got[0]}@{got[1]}" if got else "its own card"
            raise ValueError(f"rank {rank} (cuda:{g}): asked to decide as {asked}, its report {path} says it "
                             f"decided as {said}")
        facts = emu.get("facts") if want is not None else None
        if want is not None and not (isinstance(facts, dict) and facts.get("device") == f"cuda:{g}"
                                     and facts.get("card") == want):
            raise ValueError(f"rank {rank} (cuda:{g}): its report {path} shows no launch facts of {want} "
                             f"installed on cuda:{g} (emulated.facts: {facts!r}): capdispatch's kernels there "
                             f"would launch as the device, not the card")
        out.append(RankReport(rank, g, str((d.get("device") or {}).get("name") or f"cuda:{g}"), str(path), ops,
                              None if a is None else bool(a.get("agreed")),
                              tuple(a.get("not_carried_out") or ()) if a else (), emu))
    return tuple(out)


def settings_of(info: dict) -> tuple:
    """SETTINGS as /server_info gives them (a field the release lacks is left out)."""
    return tuple((k, info[k]) for k in SETTINGS if k in info)


def settings_differ(on, off) -> tuple:
    a, b = dict(on.settings), dict(off.settings)
    return tuple(f"{k}: {a.get(k)!r} with the plugin, {b.get(k)!r} without" for k in SETTINGS
                 if (k in a or k in b) and a.get(k) != b.get(k))


def report_problems(reports) -> list:
    """What the plugin-on run's reports say went wrong, one line per rank and op."""
    out = []
    for r in reports:
        if not r.ops:
            out.append(f"rank {r.rank} (cuda:{r.gpu_id}): its report lists no op: the plugin decided nothing "
                       f"for this checkpoint")
        if r.agreed is None:
            out.append(f"rank {r.rank} (cuda:{r.gpu_id}): its report predates the group's agreement "
                       f"(the group hook did not run)")
        elif not r.agreed:
            out.append(f"rank {r.rank} (cuda:{r.gpu_id}): the group did not agree: "
                       + ("; ".join(r.not_carried_out) or "see its report"))
        for o in r.ops:
            if o.install and o.install.startswith("failed"):
                out.append(f"rank {r.rank} (cuda:{r.gpu_id}): {o.op}'s route was not installed ({o.install})")
    return out


def _finite(xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


def needs_reference(comparisons, tol: float = LOGPROB_TOL) -> bool:
    """Does a request's routed-kernel comparison miss by its logprobs alone (the reference run
    can tell whose kernel is off)?"""
    return any(not c.exact and c.max_logprob_diff is not None and c.max_logprob_diff > tol for c in comparisons)


def reference_set(given: Optional[str], ops) -> str:
    """CAPDISPATCH_SET for the reference run: the user's selections, with OPS on torch."""
    kept = [x.strip() for x in (given or "").split(",")
            if x.strip() and x.split("=", 1)[0].strip() not in ops]
    return ",".join([*kept, *(f"{op}=torch" for op in ops)])


def reference_problems(reports, ops) -> list:
    """Where the reference run's ranks did not route OPS to their torch references."""
    out = []
    for r in reports:
        got = {o.op: o for o in r.ops}
        for op in ops:
            o = got.get(op)
            if o is None or o.backend != "torch" or o.action != "routed":
                said = "not decided" if o is None else f"{o.backend}, {o.action}"
                out.append(f"rank {r.rank} (cuda:{r.gpu_id}): the reference run did not route {op} to its torch "
                           f"reference (its report: {said})")
    return out


def compare(i: int, on: Reply, off: Reply, *, exact: bool, tol: float = LOGPROB_TOL,
            ref: Optional[Reply] = None) -> Comparison:
    """Request I's plugin-on reply against its plugin-off reply, and against REF (the routed
    ops on their torch references) where the logprobs miss TOL (module docstring)."""
    d_on = d_off = None         # the distances from the reference, once judged by it

    def no(detail, first=None, compared=0, worst=None):
        return Comparison(i, exact, False, first, compared, worst, f"request {i}: {detail}", d_on, d_off)
    if not on.tokens or len(on.tokens) != len(off.tokens):
        return no(f"{len(on.tokens)} tokens with the plugin, {len(off.tokens)} without: nothing to compare alike")
    first = next((k for k, (a, b) in enumerate(zip(on.tokens, off.tokens)) if a != b), None)
    upto = len(on.tokens) if first is None else first
    worst = None
    if len(on.logprobs) == len(on.tokens) == len(off.logprobs) and _finite(on.logprobs + off.logprobs):
        worst = max((abs(a - b) for a, b in zip(on.logprobs[:upto], off.logprobs[:upto])), default=0.0)
    if exact:
        if first is not None:
            return no(f"tokens differ at position {first} ({on.tokens[first]} with the plugin, "
                      f"{off.tokens[first]} without) though every rank keeps SGLang's own kernels",
                      first, upto, worst)
        if worst is None or worst > tol:
            said = "no finite logprob per token in both replies" if worst is None else f"logprobs {worst:.3g} apart"
            return no(f"tokens identical but {said} (bound {tol:g}) though every rank keeps SGLang's own kernels",
                      None, upto, worst)
        return Comparison(i, True, True, None, upto, worst,
                          f"request {i}: {upto} tokens identical, logprobs at most {worst:.2g} apart")
    if worst is None:
        return no("no finite logprob per token in both replies: nothing to compare within tolerance", first)
    judged = f"logprobs at most {worst:.2g} apart"
    if worst > tol:
        k = max(range(upto), key=lambda k: abs(on.logprobs[k] - off.logprobs[k]))
        if ref is None:
            return no(f"logprob differs by {worst:.3g} at position {k} (bound {tol:g})", first, upto, worst)
        agree = next((k for k in range(upto) if k >= len(ref.tokens) or ref.tokens[k] != on.tokens[k]), upto)
        if agree == 0 or not _finite(ref.logprobs[:agree]) or len(ref.logprobs) < agree:
            return no(f"logprob differs by {worst:.3g} at position {k} (bound {tol:g}), and the reference run "
                      f"gives no finite logprob of the same token to judge it by", first, upto, worst)
        d_on = max(abs(a - b) for a, b in zip(on.logprobs[:agree], ref.logprobs[:agree]))
        d_off = max(abs(a - b) for a, b in zip(off.logprobs[:agree], ref.logprobs[:agree]))
        bound = max(tol, REF_FACTOR * d_off)
        if d_on > bound:
            return no(f"logprob differs by {worst:.3g} at position {k}; capdispatch's routed kernels are "
                      f"{d_on:.3g} from the ops' torch references where SGLang's own are {d_off:.3g} "
                      f"(bound {bound:.3g}: the larger of {tol:g} and {REF_FACTOR:g} x SGLang's) over "
                      f"{agree} position(s)", first, upto, worst)
        past = [(abs(on.logprobs[j] - off.logprobs[j]), j) for j in range(agree, upto)]
        if past and max(past)[0] > tol:
            miss, j = max(past)
            return no(f"logprob differs by {miss:.3g} at position {j}, past the {agree} position(s) the "
                      f"reference run agrees on (bound {tol:g})", first, upto, worst)
        judged = (f"logprobs {worst:.2g} apart, and capdispatch's kernels {d_on:.2g} from the ops' torch references "
                  f"where SGLang's own are {d_off:.2g} (bound {bound:.2g}) over {agree} position(s)")
    if first is None:
        return Comparison(i, False, True, None, upto, worst, f"request {i}: {upto} tokens identical, {judged}",
                          d_on, d_off)
    alt = dict((t, lp) for t, lp in (off.top[first] if first < len(off.top) else ()))
    chosen = on.tokens[first]
    if chosen not in alt or not math.isfinite(alt[chosen]) or off.logprobs[first] - alt[chosen] > tol:
        gap = "not among its top alternatives" if chosen not in alt else f"{off.logprobs[first] - alt[chosen]:.3g} below"
        return no(f"token {chosen} at position {first} (plugin on) is no near tie without the plugin, "
                  f"which chose {off.tokens[first]} ({gap}; bound {tol:g})", first, upto, worst)
    return Comparison(i, False, True, first, upto, worst,
                      f"request {i}: {judged} over {upto} positions; at position {first} a near "
                      f"tie ({chosen} vs {off.tokens[first]}) went the other way; later positions not compared",
                      d_on, d_off)


def reply_of(body: dict, first_s: float, total_s: float) -> Reply:
    """SGLang's /generate answer (skip_tokenizer_init, return_logprob, top_logprobs_num)."""
    if not isinstance(body, dict) or not isinstance(body.get("output_ids"), list):
        raise ValueError(f"the reply has no output_ids: {json.dumps(body)[:300]}")
    meta = body.get("meta_info") or {}
    lps = tuple(float(x[0]) if x and x[0] is not None else float("nan")
                for x in meta.get("output_token_logprobs") or ())
    top = tuple(tuple((int(t[1]), float(t[0]) if t[0] is not None else float("nan")) for t in (pos or ()))
                for pos in meta.get("output_top_logprobs") or ())
    return Reply(tuple(int(t) for t in body["output_ids"]), lps, top, first_s, total_s)
